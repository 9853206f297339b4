// cai SDK: what fully sharded strategies (ZeRO-3: fsdp, gemini) share.
//
// ShardGroups   the world as R replica groups of G-rank shard groups (PyTorch FSDP's
//               HYBRID_SHARD, ColossalAI Gemini's extra_dp_size).
// ShardReducer  a gathered gradient summed into this rank's shard: reduce-scatter over the
//               shard group (left running behind compute, a bounded number at a time), then
//               all-reduce over the replica group.
// UnitHooks     one callback for every unit hook and GRAD_READY, removed with the object.
// MemoryReplay  a schedule's device buffers replayed for estimate_memory, with a
//               ShardReducer's queue; HasLayout / LayoutBlocks read the model layout
//               estimate_memory receives.
#ifndef CAI_SDK_SHARDING_HPP_
#define CAI_SDK_SHARDING_HPP_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <utility>
#include <vector>

#include "cai/sdk.hpp"
#include "cai/sdk/overlap.hpp"

namespace cai::sdk {

// Shard groups of G consecutive ranks; replica groups of the ranks with the same index in
// their shard group. Rank r is shard index r % G of replica r / G.
class ShardGroups {
 public:
  ShardGroups() = default;
  // Collective over the world: every rank creates every group, in one order. G must divide
  // the world size (the caller says so in its own words first).
  ShardGroups(int32_t rank, int32_t world, int32_t shards)
      : world_(world),
        shards_(shards),
        replicas_(world / shards),
        shard_index_(rank % shards),
        replica_index_(rank / shards) {
    if (shards_ == world_ || shards_ == 1) return;  // the world is the one group that counts
    for (int32_t r = 0; r < replicas_; ++r) {
      std::vector<int32_t> ranks;
      for (int32_t i = 0; i < shards_; ++i) ranks.push_back(r * shards_ + i);
      cai_comm_group* g = nullptr;
      Check(Host().comm->new_group(ranks.data(), ranks.size(), &g));
      if (g) shard_group_ = g;
    }
    for (int32_t i = 0; i < shards_; ++i) {
      std::vector<int32_t> ranks;
      for (int32_t r = 0; r < replicas_; ++r) ranks.push_back(r * shards_ + i);
      cai_comm_group* g = nullptr;
      Check(Host().comm->new_group(ranks.data(), ranks.size(), &g));
      if (g) replica_group_ = g;
    }
  }
  ShardGroups(ShardGroups&& other) noexcept { *this = std::move(other); }
  ShardGroups& operator=(ShardGroups&& other) noexcept {
    std::swap(world_, other.world_);
    std::swap(shards_, other.shards_);
    std::swap(replicas_, other.replicas_);
    std::swap(shard_index_, other.shard_index_);
    std::swap(replica_index_, other.replica_index_);
    std::swap(shard_group_, other.shard_group_);
    std::swap(replica_group_, other.replica_group_);
    return *this;
  }
  ~ShardGroups() {
    if (shard_group_) Host().comm->destroy_group(shard_group_);
    if (replica_group_) Host().comm->destroy_group(replica_group_);
  }

  int32_t shards() const { return shards_; }      // G
  int32_t replicas() const { return replicas_; }  // R = N / G
  int32_t shard_index() const { return shard_index_; }
  int32_t replica_index() const { return replica_index_; }
  // NULL: the world.
  cai_comm_group* shard() const { return shards_ == world_ ? nullptr : shard_group_; }
  cai_comm_group* replica() const { return replicas_ == world_ ? nullptr : replica_group_; }

 private:
  int32_t world_ = 1, shards_ = 1, replicas_ = 1, shard_index_ = 0, replica_index_ = 0;
  cai_comm_group* shard_group_ = nullptr;
  cai_comm_group* replica_group_ = nullptr;
};

// Sums gathered gradients (G·s elements each) over every rank into this rank's s-element
// shard. Reduce starts the reduce-scatter and returns once at most `in_flight` are left
// running (0: it completes before returning); completing one runs the replica all-reduce and
// hands the summed shard to its `land` callback (which adds it wherever the strategy keeps its
// gradient shard). Reductions complete in the order they started, which every rank shares.
// Time spent waiting is charged to the OverlapMeter.
class ShardReducer {
 public:
  // land(summed, wire): `summed` is s elements of the reduction's dtype on the device;
  // `wire` the buffer holding them.
  using Land = std::function<void(const cai_tensor& summed, const Buffer& wire)>;

  ShardReducer() = default;
  ShardReducer(const ShardGroups* groups, size_t in_flight, OverlapMeter* meter)
      : groups_(groups), in_flight_(in_flight), meter_(meter) {}
  ShardReducer(const ShardReducer&) = delete;
  ShardReducer& operator=(const ShardReducer&) = delete;
  ShardReducer(ShardReducer&&) = default;
  ShardReducer& operator=(ShardReducer&&) = default;

  // Takes `grads`: `shard` · G elements of `dtype` on the device.
  void Reduce(Buffer grads, int64_t shard, cai_dtype dtype, Land land) {
    Pending& p = pending_.emplace_back();
    p.wire = std::move(grads);
    p.shard = shard;
    p.full = shard * groups_->shards();
    p.dtype = dtype;
    p.land = std::move(land);
    if (groups_->shards() > 1) {
      p.part = Buffer::Alloc(CAI_MEM_DEVICE, static_cast<size_t>(shard) * ElementSize(dtype),
                             "sdk.reduce_scatter");
      const cai_tensor full = FlatView(p.wire, dtype, 0, &p.full);
      meter_->Launched();
      p.work = RunCollective(CAI_COMM_REDUCE_SCATTER, &full, FlatView(p.part, dtype, 0, &p.shard),
                             /*async=*/true, CAI_REDUCE_SUM, groups_->shard());
    }
    while (pending_.size() > in_flight_) FinishOne();
  }

  // Completes every reduction, then closes the meter's window.
  void Finish() {
    while (!pending_.empty()) FinishOne();
    meter_->Completed();
  }
  // Drops what is pending (a failed micro-batch's reductions), waiting for the collectives.
  void Discard() {
    pending_.clear();
    if (meter_) meter_->Discard();
  }
  bool empty() const { return pending_.empty(); }

 private:
  struct Pending {
    Buffer wire;  // G·s elements, read until `work` completes
    Buffer part;  // s elements, the reduce-scatter's result
    int64_t shard = 0, full = 0;
    cai_dtype dtype{};
    Land land;
    // Declared after the buffers: destroyed (waiting for the operation) before they are freed.
    Work work;
  };

  void FinishOne() {
    Pending p = std::move(pending_.front());
    pending_.pop_front();
    meter_->Wait([&] { p.work.Wait(); });
    const Buffer& wire = groups_->shards() > 1 ? p.part : p.wire;
    const cai_tensor mine = FlatView(wire, p.dtype, 0, &p.shard);
    if (groups_->replicas() > 1) {
      meter_->Wait([&] {
        RunCollective(CAI_COMM_ALL_REDUCE, nullptr, mine, false, CAI_REDUCE_SUM,
                      groups_->replica());
      });
    }
    p.land(mine, wire);
  }

  const ShardGroups* groups_ = nullptr;
  size_t in_flight_ = 0;
  OverlapMeter* meter_ = nullptr;
  std::deque<Pending> pending_;
};

// A strategy's device buffers replayed allocation by allocation for its memory estimate: what
// is held now, the most ever held, and the reductions a ShardReducer keeps (each its input,
// handed over while held, and its output), completed oldest first past `in_flight` as
// ShardReducer::Reduce and Finish complete them.
class MemoryReplay {
 public:
  explicit MemoryReplay(size_t in_flight) : in_flight_(in_flight) {}

  void Add(uint64_t bytes) {
    now_ += bytes;
    if (now_ > peak_) peak_ = now_;
  }
  void Free(uint64_t bytes) { now_ -= bytes; }
  // A buffer that lives for a moment (a staging copy, one chunk of a checkpoint).
  void Passing(uint64_t bytes) {
    Add(bytes);
    Free(bytes);
  }
  // Hands `input` bytes, already held, to a reduction whose output takes `output` more.
  void Reduce(uint64_t input, uint64_t output) {
    Add(output);
    pending_.push_back(input + output);
    while (pending_.size() > in_flight_) Complete();
  }
  void Finish() {
    while (!pending_.empty()) Complete();
  }
  uint64_t peak() const { return peak_; }

 private:
  void Complete() {
    Free(pending_.front());
    pending_.pop_front();
  }

  size_t in_flight_;
  uint64_t now_ = 0, peak_ = 0;
  std::deque<uint64_t> pending_;
};

// Whether estimate_memory's arguments carry the model's layout (ABI 1.3: zoo models; the SDK
// zero-fills what an older host did not send).
inline bool HasLayout(const cai_memory_estimate_args& args) {
  return args.num_layout_params > 0 && args.param_numel && args.param_unit && args.unit_kind;
}

// Each parameter of that layout's block unit: its unit when that is a CAI_UNIT_BLOCK, else -1
// (embeddings, final norm, head, a parameter in no unit).
inline std::vector<int32_t> LayoutBlocks(const cai_memory_estimate_args& args) {
  std::vector<int32_t> block_of(args.num_layout_params, -1);
  for (uint32_t i = 0; i < args.num_layout_params; ++i) {
    const int32_t u = args.param_unit[i];
    if (u >= 0 && static_cast<uint32_t>(u) < args.num_layout_units &&
        args.unit_kind[u] == CAI_UNIT_BLOCK) {
      block_of[i] = u;
    }
  }
  return block_of;
}

// Adds `summed` (a ShardReducer's result, s elements on the device, in `on`) into `shard`, s
// fp32 elements on `tier`: directly on the device, else through one copy to that tier (the
// device-to-host transfer of an offloaded shard). Returns the bytes copied between tiers.
inline uint64_t AddToShard(const cai_tensor& summed, const Buffer& on, const cai_tensor& shard,
                           cai_mem_tier tier) {
  if (tier == CAI_MEM_DEVICE) {
    RunKernel(CAI_KERNEL_AXPY, &summed, shard, 1.0);
    return 0;
  }
  const size_t bytes = static_cast<size_t>(summed.shape[0]) * ElementSize(summed.dtype);
  Buffer landed = Buffer::Alloc(tier, bytes, "sdk.offload_grad");
  Check(Host().mempool->copy(landed.data(), on.data(), bytes, nullptr));
  const cai_tensor from = FlatView(landed, summed.dtype, 0, summed.shape);
  RunKernel(CAI_KERNEL_AXPY, &from, shard, 1.0);
  return bytes;
}

// Registers `fn(user_data, event)` for PRE/POST_FORWARD, PRE/POST_BACKWARD of every unit and
// GRAD_READY of every parameter; removed when the object goes.
class UnitHooks {
 public:
  UnitHooks() = default;
  UnitHooks(cai_model* model, cai_hook_fn fn, void* user_data) : model_(model) {
    const cai_hook_kind kinds[] = {CAI_HOOK_PRE_FORWARD, CAI_HOOK_POST_FORWARD,
                                   CAI_HOOK_PRE_BACKWARD, CAI_HOOK_POST_BACKWARD,
                                   CAI_HOOK_GRAD_READY};
    for (cai_hook_kind kind : kinds) {
      cai_hook_args hook{};
      hook.struct_size = CAI_HOOK_ARGS_STRUCT_SIZE;
      hook.kind = kind;
      hook.unit = -1;
      hook.param = -1;
      hook.fn = fn;
      hook.user_data = user_data;
      Check(Host().model->register_hook(model, &hook, &ids_.emplace_back()));
    }
  }
  UnitHooks(UnitHooks&& other) noexcept { *this = std::move(other); }
  UnitHooks& operator=(UnitHooks&& other) noexcept {
    std::swap(model_, other.model_);
    std::swap(ids_, other.ids_);
    return *this;
  }
  ~UnitHooks() {
    for (uint64_t id : ids_) Host().status_destroy(Host().model->remove_hook(model_, id));
  }

 private:
  cai_model* model_ = nullptr;
  std::vector<uint64_t> ids_;
};

}  // namespace cai::sdk

#endif  // CAI_SDK_SHARDING_HPP_
