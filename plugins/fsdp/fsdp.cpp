// libcai_fsdp: fully sharded data parallelism (ZeRO-3, Rajbhandari et al. 2020), as PyTorch's
// FullyShardedDataParallel and ColossalAI's TorchFSDPPlugin, without the two limits ColossalAI
// documents for it: checkpoints are sharded, and several parameter groups train.
//
// Wrapping. auto_wrap = "block" (PyTorch's transformer_auto_wrap_policy): every transformer
// block the model service exposes is one unit; every other trainable parameter (embeddings,
// final norm, the head, a parameter in no unit) belongs to the root unit. The root holds the
// tied GPT-2 embedding, which the head reads as well as the embedding, so it stays gathered
// from the start of forward to the end of backward, as PyTorch's root FSDP instance does.
// auto_wrap = "size" (size_based_auto_wrap_policy) merges consecutive blocks until each unit
// holds at least min_num_params elements; "none" puts every parameter in the root: one flat
// parameter, DDP's memory.
//
// Groups. A unit is sharded over a shard group of G ranks and replicated over R = N / G
// replica groups: FULL_SHARD and SHARD_GRAD_OP G = N; NO_SHARD G = 1 (R = N, DDP);
// HYBRID_SHARD G = shard_group_size (default: the ranks of one node, as the launcher says), so
// the parameter all-gathers stay inside a node and only a gradient shard's all-reduce
// crosses nodes.
//
// Layout. A unit's trainable parameters, concatenated in registration order, form its flat
// parameter of Ψ_u elements, padded to G·s_u with s_u = ceil(Ψ_u / G); shard-group rank r
// owns elements [r·s_u, (r+1)·s_u). This rank's shards of all units lie end to end in fp32
// buffers of S = Σ s_u ≤ Ψ/G + #units elements: parameters (the masters under mixed
// precision), gradient sums and optimizer state slots; cpu_offload puts those three in the
// host tier. Under bf16/fp16 or cpu_offload a compute-dtype device copy of the parameter
// shard (S elements) is what the all-gathers read. Frozen parameters are not sharded: every
// rank keeps them whole. Buffers are not sharded either; buffer_dtype casts them once at boost
// (after sync_module_states broadcast them) through the model service, which ABI 1.2 added.
//
// One micro-batch (FULL_SHARD):
//  start          root: all-gathered and its gradient buffer zeroed.
//  PRE_FORWARD    all-gather the unit (s_u elements in, G·s_u out, compute dtype) into the
//                 parameters' released storage (the model service refills a released
//                 parameter's storage in place, so autograd's saved views stay valid).
//  POST_FORWARD   release the unit (SHARD_GRAD_OP: keep it for backward).
//  PRE_BACKWARD   all-gather again; a zeroed G·s_u gradient buffer that .grad are views of.
//  POST_BACKWARD  reduce-scatter (SUM, in reduce_dtype) over the shard group, all-reduce the
//                 s_u result over the replica group (HYBRID_SHARD), add it into the fp32
//                 gradient shard; release.
//  end            the root's reduction, then its release.
// Under no_sync (gradient accumulation, every micro-batch but the last) POST_BACKWARD keeps
// the unit's gradient buffer and the next micro-batch accumulates into it: no reduction, at
// the price of the unsharded gradients (4Ψ per rank in fp32), as PyTorch's no_sync.
// Prefetch: forward_prefetch starts the all-gathers of the next prefetch_limit units when a
// unit's forward begins; backward_prefetch "pre" starts the previous units' when a unit's
// backward begins, "post" after its gradient reduction (so its memory is freed first). At most
// prefetch_limit all-gathers are in flight ahead of the running unit.
//
// Why SUM: the host weights each micro-batch's loss by its rows / the step's global batch
// (cai_micro_batch.loss_weight), so the global-mean gradient is the sum of the local ones
// (exact with uneven batches too).
//
// step: one SUM all-reduce of [squared norm of the gradient shards (replica 0 only: the other
// replicas hold copies), fp16 overflow flag, per-parameter "got a gradient here"]; the loss
// scaler's verdict; clip coefficient; the host's fused update of this rank's part of each used
// parameter (a parameter without gradient on every rank is not updated, as torch.optim skips
// a parameter without .grad); the compute copy refreshed. The next forward gathers the
// updated shards.
//
// Communication per micro-batch and rank, e the compute dtype's and e_r the reduce dtype's
// bytes per element: all-gather e·(2·Σ_units s_u + s_root) (SHARD_GRAD_OP e·S) ≈ 2·eΨ/G,
// reduce-scatter e_r·G·S ≈ e_r·Ψ, HYBRID_SHARD's all-reduce e_r·S: ZeRO-3's 3Ψ of traffic;
// plus one all-reduce of 8·(2 + #trainable parameters) bytes per step.
// Per-rank memory, k optimizer slots (2 for Adam): shards (4 + 4 + 4k)·S (+ e·S for the
// compute copy), plus while a unit runs its gathered parameters e·G·s_u and in backward its
// gradient buffer e·G·s_u and the previous unit's, still in its reduce-scatter, plus the
// root's two buffers throughout:
// ≤ (8 + 4k)·S + e·G·(2·s_root + 3·max s_u) (+ e·G·prefetch_limit·max s_u with prefetch).
// With async_reduce_scatter (default) the reduce-scatter of a unit's gradient runs while
// backward goes on to the previous units; one is in flight at a time, completed when the next
// unit's starts or at the end of backward. Without it, the 3 above is a 2.
//
// Checkpoints. state_dict_type = "sharded" (default): every rank of replica 0 writes its own
// shards ("fsdp/<unit>/param.<r>", "fsdp/<unit>/state<k>.<r>") and rank 0 an index
// (meta "fsdp.index": the saved units, their members' offsets and the shard size), so no rank
// ever holds more than one shard of the model. Load maps every parameter through the index by
// name and reads only the saved slices that overlap this rank's shard: any world size, shard
// group or wrapping loads. state_dict_type = "full" writes the consolidated canonical layout
// ("model/<name>", "optim/<name>/<slot>", the single-process reference's), a unit at a time
// gathered and written by rank 0, which every strategy loads; load reads either.
#include <algorithm>
#include <cai/sdk.hpp>
#include <cai/sdk/collectives.hpp>
#include <cai/sdk/flat.hpp>
#include <cai/sdk/overlap.hpp>
#include <cai/sdk/sharded_index.hpp>
#include <cai/sdk/sharding.hpp>
#include <cai/sdk/step.hpp>
#include <cmath>
#include <cstdlib>
#include <map>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <vector>

namespace {

using cai::sdk::Buffer;
using cai::sdk::Check;
using cai::sdk::Error;
using cai::sdk::FlatView;
using cai::sdk::Host;
using cai::sdk::ParseShardedIndex;
using cai::sdk::RunCollective;
using cai::sdk::RunKernel;
using cai::sdk::SameDtype;
using cai::sdk::ShardedParam;
using cai::sdk::ShardedTensorName;

constexpr cai_dtype kF32{CAI_DTYPE_FLOAT, 32, 1};
constexpr cai_dtype kBF16{CAI_DTYPE_BFLOAT, 16, 1};

const char* const kShardingStrategies[] = {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD",
                                           "HYBRID_SHARD", nullptr};
const char* const kAutoWrap[] = {"block", "size", "none", nullptr};
const char* const kBackwardPrefetch[] = {"none", "pre", "post", nullptr};
const char* const kReduceDtypes[] = {"param", "fp32", "bf16", "fp16", nullptr};
const char* const kBufferDtypes[] = {"model", "param", "fp32", "bf16", "fp16", nullptr};
const char* const kStateDictTypes[] = {"sharded", "full", nullptr};

size_t Bytes(int64_t numel, cai_dtype dtype) {
  return static_cast<size_t>(numel) * cai::sdk::ElementSize(dtype);
}

// A zero-filled buffer of `numel` elements (the SDK's AllocFlat, for the signed counts used here).
Buffer Alloc(cai_mem_tier tier, int64_t numel, cai_dtype dtype, const char* tag) {
  return cai::sdk::AllocFlat(tier, static_cast<size_t>(numel), dtype, tag);
}

// A view that starts `offset` elements into `base`; `numel` must outlive its uses.
cai_tensor View(const Buffer& base, cai_dtype dtype, int64_t offset, const int64_t* numel) {
  return FlatView(base, dtype, static_cast<size_t>(offset), const_cast<int64_t*>(numel));
}

// FSDP's wrapping of model units, from the elements of the trainable parameters each would
// wrap (`owned`, 0 for none): unit 0 is the root; a model unit with parameters starts a unit
// of its own or, with `by_size` (auto_wrap = "size"), joins the last one while that holds
// fewer than `min_num_params`. Returns each model unit's FSDP unit, -1 for one without
// parameters.
std::vector<int32_t> WrapUnits(const std::vector<int64_t>& owned, bool by_size,
                               int64_t min_num_params) {
  std::vector<int32_t> unit_of(owned.size(), -1);
  int32_t last = 0;
  int64_t held = 0;
  for (size_t u = 0; u < owned.size(); ++u) {
    if (owned[u] == 0) continue;
    if (!(by_size && last > 0 && held < min_num_params)) {
      ++last;
      held = 0;
    }
    held += owned[u];
    unit_of[u] = last;
  }
  return unit_of;
}

class Fsdp {
 public:
  static constexpr const char* kName = "fsdp";
  static constexpr const char* kVersion = "0.2.0";
  static constexpr uint64_t kCapabilities = CAI_CAP_PRECISION_FP32 | CAI_CAP_PRECISION_BF16 |
                                            CAI_CAP_PRECISION_FP16 | CAI_CAP_NO_SYNC |
                                            CAI_CAP_CPU_OFFLOAD | CAI_CAP_SHARDED_CHECKPOINT;

  static std::span<const cai_config_key> ConfigKeys() {
    using cai::sdk::BoolKey;
    using cai::sdk::IntKey;
    using cai::sdk::StringKey;
    static constexpr auto kKeys = cai::sdk::JoinKeys(
        std::array{
            StringKey("sharding_strategy", "\"FULL_SHARD\"",
                      "FULL_SHARD: parameters, gradients and optimizer state sharded; a unit is "
                      "gathered for its forward and again for its backward. SHARD_GRAD_OP: a "
                      "unit stays gathered from its forward to the end of its backward. "
                      "NO_SHARD: replicated, gradients all-reduced (DDP). HYBRID_SHARD: "
                      "FULL_SHARD inside groups of shard_group_size ranks, replicated across "
                      "them.",
                      kShardingStrategies),
            IntKey("shard_group_size", "0",
                   "HYBRID_SHARD: ranks a unit is sharded over; must divide the world size. "
                   "0 = the ranks of one node (LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE or "
                   "SLURM_NTASKS_PER_NODE).",
                   0, 0, CAI_CONFIG_HAS_MIN),
            StringKey("auto_wrap", "\"block\"",
                      "block: one unit per transformer block, the rest (embeddings, final norm, "
                      "head) in the root unit, gathered throughout. size: consecutive blocks "
                      "merged until a unit holds min_num_params elements. none: everything in "
                      "the root unit.",
                      kAutoWrap),
            IntKey("min_num_params", "100000000",
                   "auto_wrap = \"size\": the fewest parameter elements of a unit (PyTorch's "
                   "size_based_auto_wrap_policy default, 1e8).",
                   1, 0, CAI_CONFIG_HAS_MIN),
            BoolKey("sync_module_states", "true",
                    "Broadcast rank 0's parameters and buffers at boost, so every rank starts "
                    "from the same weights whatever it loaded."),
            BoolKey("async_reduce_scatter", "true",
                    "Reduce-scatter a unit's gradient while backward goes on to the previous "
                    "units (as PyTorch FSDP's separate stream); costs one more unit's gradient "
                    "of memory. false: each reduction completes before backward goes on."),
            BoolKey("forward_prefetch", "false",
                    "Start the next units' all-gathers when a unit's forward begins, so they "
                    "run behind compute."),
            StringKey("backward_prefetch", "\"none\"",
                      "pre: start the previous units' all-gathers when a unit's backward "
                      "begins. post: after the unit's gradient reduction (its memory freed "
                      "first). none: gather each unit when its backward begins.",
                      kBackwardPrefetch),
            IntKey("prefetch_limit", "1",
                   "Units gathered ahead of the running one at most, i.e. all-gathers in "
                   "flight; each costs one gathered unit of memory.",
                   1, 16, CAI_CONFIG_HAS_MIN | CAI_CONFIG_HAS_MAX),
            StringKey("reduce_dtype", "\"param\"",
                      "dtype gradients are reduced in: param (train.precision's), fp32, bf16 "
                      "or fp16. Shards accumulate in fp32 whatever it is.",
                      kReduceDtypes),
            StringKey("buffer_dtype", "\"model\"",
                      "dtype of the model's floating-point buffers in forward: model (as the "
                      "model defines them, PyTorch's default), param (train.precision's), fp32, "
                      "bf16 or fp16. An fp32 buffer in a bf16 forward turns what it touches "
                      "back to fp32. Needs host ABI 1.2.",
                      kBufferDtypes),
            BoolKey("cpu_offload", "false",
                    "Keep the sharded fp32 parameters, gradient sums and optimizer state in host "
                    "memory; the host's CPU optimizer updates them and the compute-dtype shard "
                    "is copied back to the device after each step."),
            StringKey("state_dict_type", "\"sharded\"",
                      "sharded: every rank writes its own shards plus an index (no rank holds "
                      "the full model); full: the consolidated canonical layout, written by "
                      "rank 0 a unit at a time. Both load at any world size.",
                      kStateDictTypes),
        },
        cai::sdk::LossScalerKeys("65536.0", "fp16: initial loss scale (2^16, PyTorch's)."));
    return kKeys;
  }

  explicit Fsdp(const cai_create_args& args) : rank_(args.rank), world_(args.world_size) {
    cai::sdk::Config config(args.config);
    const std::string strategy = config.String("sharding_strategy");
    full_shard_ = strategy == "FULL_SHARD" || strategy == "HYBRID_SHARD";
    sharded_ = strategy != "NO_SHARD";
    hybrid_ = strategy == "HYBRID_SHARD";
    strategy_name_ = strategy;
    shards_ = !sharded_ ? 1 : world_;
    if (hybrid_) {
      int64_t g = config.Int("shard_group_size");
      // Ranks per node as torchrun (and cai train --nproc), Open MPI and SLURM say it.
      for (const char* var :
           {"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"}) {
        const char* value = std::getenv(var);
        if (g == 0 && value) g = std::atoll(value);
      }
      if (g <= 0) {
        throw Error(CAI_INVALID_ARGUMENT,
                    "fsdp: HYBRID_SHARD needs plugin.fsdp.shard_group_size (none of "
                    "LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE, SLURM_NTASKS_PER_NODE says "
                    "how many ranks share a node); set it to the ranks per node");
      }
      if (world_ % g != 0) {
        throw Error(CAI_INVALID_ARGUMENT,
                    "fsdp: plugin.fsdp.shard_group_size = " + std::to_string(g) +
                        " does not divide the world size " + std::to_string(world_) +
                        "; use a divisor of it");
      }
      shards_ = g;
    }
    replicas_ = world_ / shards_;
    shard_index_ = rank_ % shards_;
    replica_index_ = rank_ / shards_;
    const std::string wrap = config.String("auto_wrap");
    wrap_ = wrap == "block" ? Wrap::kBlock : wrap == "size" ? Wrap::kSize : Wrap::kNone;
    min_num_params_ = config.Int("min_num_params");
    sync_module_states_ = config.Bool("sync_module_states");
    forward_prefetch_ = config.Bool("forward_prefetch");
    reduces_in_flight_ = config.Bool("async_reduce_scatter") ? 1 : 0;
    const std::string backward_prefetch = config.String("backward_prefetch");
    backward_prefetch_ = backward_prefetch == "pre"    ? Prefetch::kPre
                         : backward_prefetch == "post" ? Prefetch::kPost
                                                       : Prefetch::kNone;
    prefetch_limit_ = config.Int("prefetch_limit");
    reduce_dtype_name_ = config.String("reduce_dtype");
    buffer_dtype_name_ = config.String("buffer_dtype");
    offload_ = config.Bool("cpu_offload");
    full_state_dict_ = config.String("state_dict_type") == "full";
    scaler_config_ = cai::sdk::LossScalerConfig(config, kName);
  }

  ~Fsdp() {
    // Collectives still in flight write into our buffers: finish them before those go.
    for (Unit& u : units_) u.prefetch = cai::sdk::Work();
    reducer_.Discard();
  }

  void Boost(const cai_boost_args& args) {
    if (model_) throw Error(CAI_FAILED_PRECONDITION, "fsdp: boost was already called");
    model_ = args.model;
    optimizer_ = args.optimizer;
    compute_ = cai::sdk::ComputeDtype(args.precision);
    reduce_ = cai::sdk::DtypeNamed(reduce_dtype_name_, compute_);
    const bool mixed = !SameDtype(compute_, kF32);
    const auto& model = *Host().model;
    if (buffer_dtype_name_ != "model" &&
        !CAI_HAS_FIELD(Host().model, cai_model_api, set_buffer_dtype)) {
      throw Error(CAI_FAILED_PRECONDITION,
                  "fsdp: plugin.fsdp.buffer_dtype = \"" + buffer_dtype_name_ +
                      "\" needs host ABI 1.2 (set_buffer_dtype); this host's model service is "
                      "older. Upgrade cai, or set buffer_dtype = \"model\"");
    }
    groups_ = cai::sdk::ShardGroups(rank_, world_, shards_);
    reducer_ = cai::sdk::ShardReducer(&groups_, reduces_in_flight_, &overlap_);
    PlanUnits();

    const cai_mem_tier state_tier = offload_ ? CAI_MEM_HOST : CAI_MEM_DEVICE;
    params_ = Alloc(state_tier, shard_numel_, kF32, "fsdp.param_shard");
    grads_ = Alloc(state_tier, shard_numel_, kF32, "fsdp.grad_shard");
    optim_ = cai::sdk::FlatOptimizer(optimizer_, static_cast<size_t>(shard_numel_), state_tier,
                                     "fsdp.optim_state");
    cai_tensor probe = View(params_, kF32, 0, &shard_numel_);
    state_device_ = probe.device;
    if (mixed || offload_) {
      compute_shard_ = Alloc(CAI_MEM_DEVICE, shard_numel_, compute_, "fsdp.param_compute");
      device_ = View(compute_shard_, compute_, 0, &shard_numel_).device;
    } else {
      device_ = state_device_;
    }

    // Each unit in turn: its flat fp32 parameter assembled (from rank 0 with
    // sync_module_states) and this rank's shard kept; the model is never whole here.
    for (Unit& u : units_) {
      if (u.members.empty()) continue;  // a root without parameters
      Buffer flat = Alloc(CAI_MEM_DEVICE, u.full, kF32, "fsdp.gathered");
      for (const Member& m : u.members) {
        cai::sdk::MoveParamInto(model_, m.param, View(flat, kF32, m.offset, &m.numel));
      }
      if (sync_module_states_ && world_ > 1) cai::sdk::Broadcast(View(flat, kF32, 0, &u.full));
      Check(Host().mempool->copy(static_cast<float*>(params_.data()) + u.base,
                                 static_cast<float*>(flat.data()) + shard_index_ * u.shard,
                                 Bytes(u.shard, kF32), nullptr));
    }
    if (sync_module_states_) {
      cai::sdk::BroadcastParams(model_, frozen_);
      cai::sdk::BroadcastBuffers(model_);
    }
    // The model casts its (released) parameters to the compute dtype; ours are then views of
    // the compute copy (NO_SHARD) or released until their unit is gathered.
    if (mixed) Check(model.set_compute_dtype(model_, compute_));
    std::string buffers = "buffers as the model defines them";
    if (buffer_dtype_name_ != "model") {
      const cai_dtype dtype = cai::sdk::DtypeNamed(buffer_dtype_name_, compute_);
      Check(model.set_buffer_dtype(model_, dtype));
      buffers = std::string(Name(dtype)) + " buffers";
    }
    RefreshComputeShard();
    for (Unit& u : units_) {
      if (sharded_) {
        ReleaseParams(u);
      } else {
        PointParams(u, compute_shard_.get() ? compute_shard_ : params_, u.base);
      }
    }
    epilogue_.emplace(optimizer_);
    if (args.precision == CAI_PRECISION_FP16) epilogue_->EnableLossScaling(scaler_config_);
    used_.assign(num_members_, 0);

    hooks_ = cai::sdk::UnitHooks(model_, &Fsdp::OnUnitHook, this);

    std::ostringstream layout;
    layout << "fsdp: " << strategy_name_ << ", " << Name(compute_) << " compute, " << Name(reduce_)
           << " reduce, " << buffers << ", " << shards_ << " shards x " << replicas_
           << " replicas, " << psi_ << " trainable elements, " << shard_numel_
           << " in this rank's shards; unit sizes:";
    for (const Unit& u : units_) layout << " " << u.name << "=" << u.numel;
    cai::sdk::Log(CAI_LOG_INFO, layout.str());
  }

  void NoSync(bool enabled) { no_sync_ = enabled; }

  void ForwardBackward(const cai_micro_batch& batch) {
    if (!model_) throw Error(CAI_FAILED_PRECONDITION, "fsdp: forward_backward before boost");
    Unit& root = units_[0];
    in_backward_ = false;
    Gather(root);
    BeginGrads(root);
    backward_ = true;
    cai_status* status = cai::sdk::Guard(
        [&] { cai::sdk::RunMicroBatch(model_, batch, true, epilogue_->loss_scale()); });
    Check(status);
    // A unit whose backward never ended (no gradient reached it) is reduced here, in unit
    // order, which every rank shares.
    for (Unit& u : units_) {
      if (!no_sync_ && u.grads.get()) ReduceGrads(u);
      ReleaseParams(u);
    }
    reducer_.Finish();
  }

  void Evaluate(const cai_micro_batch& batch) {
    if (!model_) throw Error(CAI_FAILED_PRECONDITION, "fsdp: evaluate before boost");
    in_backward_ = false;
    Gather(units_[0]);
    backward_ = false;
    cai_status* status = cai::sdk::Guard([&] { cai::sdk::RunMicroBatch(model_, batch, false); });
    for (Unit& u : units_) ReleaseParams(u);
    Check(status);
  }

  void Step(cai_step_result& result) {
    if (!model_) throw Error(CAI_FAILED_PRECONDITION, "fsdp: step before boost");
    // Gradients accumulated under no_sync and never reduced by a synchronised micro-batch.
    for (Unit& u : units_) {
      if (u.grads.get()) ReduceGrads(u);
    }
    reducer_.Finish();
    // Σ g² of the gradient shards (replica 0's only: the other replicas hold copies), fp16
    // overflow, and per member whether it got a gradient here: agreed over the world.
    cai::sdk::StepSums sums;
    const cai_tensor grads = View(grads_, kF32, 0, &shard_numel_);
    if (replica_index_ == 0)
      RunKernel(CAI_KERNEL_SUM_SQUARES, nullptr, grads, 0, &sums.sum_squares);
    if (epilogue_->loss_scaling()) {
      double finite = 0;
      RunKernel(CAI_KERNEL_ALL_FINITE, nullptr, grads, 0, &finite);
      sums.overflow = finite != 1.0;
    }
    sums.used.assign(used_.begin(), used_.end());
    const cai::sdk::StepDecision d = epilogue_->Decide(sums, result);
    if (d.skipped) return;
    // Each used parameter's part of this rank's shard of its unit.
    for (const Unit& u : units_) {
      const int64_t lo = shard_index_ * u.shard, hi = lo + u.shard;
      for (const Member& m : u.members) {
        if (sums.used[m.index] == 0) continue;
        const int64_t a = std::max(lo, m.offset), b = std::min(hi, m.offset + m.numel);
        if (a >= b) continue;
        cai::sdk::FlatOptimizer::Piece piece;
        piece.group = m.group;
        piece.offset = static_cast<size_t>(u.base + (a - lo));
        piece.count = static_cast<size_t>(b - a);
        piece.param = static_cast<float*>(params_.data()) + piece.offset;
        piece.grad = static_cast<float*>(grads_.data()) + piece.offset;
        optim_.Update(piece, d.step, d.grad_scale);
      }
    }
    RefreshComputeShard();
  }

  void ZeroGrad() {
    if (!model_) throw Error(CAI_FAILED_PRECONDITION, "fsdp: zero_grad before boost");
    // Gradients accumulated under no_sync and never stepped are dropped as asked, and so are
    // the reductions a failed micro-batch left behind.
    reducer_.Discard();
    for (Unit& u : units_) {
      if (!u.grads.get()) continue;
      for (const Member& m : u.members) Check(Host().model->release_grad(model_, m.param));
      u.grads = Buffer();
    }
    RunKernel(CAI_KERNEL_FILL, nullptr, View(grads_, kF32, 0, &shard_numel_));
    std::fill(used_.begin(), used_.end(), 0);
  }

  void Save(const cai_checkpoint_args& args) {
    if (full_state_dict_) {
      SaveFull(args);
    } else {
      SaveSharded(args);
    }
    if (rank_ == 0 && args.model) {
      for (uint32_t i : frozen_) {
        cai_tensor data{};
        Check(Host().model->param_data(model_, i, &data));
        cai::sdk::WriteAsFp32(args.checkpoint, "model/" + ParamName(i), data);
      }
    }
    if (rank_ == 0 && args.optimizer) epilogue_->Save(args.checkpoint, kName);
  }

  void Load(const cai_checkpoint_args& args) {
    const std::optional<std::string> index =
        cai::sdk::ReadMetaIfPresent(args.checkpoint, "fsdp.index");
    if (index) {
      LoadSharded(args, *index);
    } else {
      LoadFull(args);
    }
    if (args.model) {
      for (uint32_t i : frozen_) {
        cai_tensor data{};
        Check(Host().model->param_data(model_, i, &data));
        Check(Host().checkpoint->read_tensor(args.checkpoint, ("model/" + ParamName(i)).c_str(), 0,
                                             0, &data));
      }
      RefreshComputeShard();
    }
    if (args.optimizer) epilogue_->Load(args.checkpoint, kName);
  }

  void Stats(cai_strategy_stats& stats) {
    const uint64_t frozen = FrozenBytes();
    const bool mixed = !SameDtype(compute_, kF32);
    stats.param_bytes = (mixed ? compute_shard_.size() : params_.size()) + frozen;
    stats.grad_bytes = grads_.size();
    stats.optimizer_state_bytes = optim_.bytes();
    stats.master_bytes = mixed ? params_.size() : 0;
    stats.overlap_ratio = overlap_.ratio();
    // The forward's peak of parameter memory, for the bound Ψ/G + (prefetch+1)·unit.
    cai::sdk::Log(CAI_LOG_INFO, "fsdp: peak parameter bytes in forward " +
                                    std::to_string(forward_param_peak_) + " (shards " +
                                    std::to_string(ShardParamBytes()) + ")");
  }

  static void EstimateMemory(const cai_memory_estimate_args& args, cai_memory_estimate& out) {
    const cai::sdk::Config config(args.config);
    const std::string strategy = args.config ? config.String("sharding_strategy") : "FULL_SHARD";
    uint64_t n = static_cast<uint64_t>(std::max(args.world_size, 1));
    if (strategy == "NO_SHARD") n = 1;
    if (strategy == "HYBRID_SHARD" && config.Int("shard_group_size") > 0) {
      n = static_cast<uint64_t>(config.Int("shard_group_size"));
    }
    if (args.config && cai::sdk::HasLayout(args)) {
      EstimateLayout(args, config, strategy, static_cast<int64_t>(n), out);
      return;
    }
    const uint64_t e = args.precision == CAI_PRECISION_FP32 ? 4 : 2;
    const uint64_t shard = (static_cast<uint64_t>(args.num_params) + n - 1) / n;
    const uint64_t unit = static_cast<uint64_t>(args.largest_unit_numel);
    // Sharded fp32 states plus, at the peak of backward, a gathered unit, its gradient and
    // the previous unit's gradient in its reduce-scatter.
    out.master_bytes = e == 4 ? 0 : 4 * shard;
    out.param_bytes = e * shard + (n == 1 ? 0 : e * unit);
    const bool async_reduce = !args.config || config.Bool("async_reduce_scatter");
    out.grad_bytes = 4 * shard + e * unit + (n == 1 || !async_reduce ? 0 : e * unit);
    out.optimizer_state_bytes = 4ull * args.optimizer_state_slots * shard;
    const uint64_t total =
        out.param_bytes + out.grad_bytes + out.optimizer_state_bytes + out.master_bytes;
    if (args.config && config.Bool("cpu_offload")) {
      // The fp32 shards (parameters or masters, gradient sums) and the optimizer state live on
      // the host; the device keeps the compute copy of the shard and the gathered unit.
      out.host_bytes = 4 * shard + 4 * shard + out.optimizer_state_bytes;
      out.device_bytes = total - out.host_bytes + (e == 4 ? e * shard : 0);
      out.formula =
          "device eΨ/G + 3·e·unit (compute copy, a gathered unit, its gradient and the "
          "previous unit's in its reduce-scatter), host "
          "(4 + 4 + 4k)Ψ/G (G = shard group)";
      return;
    }
    out.device_bytes = total;
    out.formula =
        "(4 + 4 + 4k)Ψ/G (+ eΨ/G compute copy) + 3·e·unit: fp32 shards, k state "
        "slots, a gathered unit, its gradient and the previous unit's in its reduce-scatter "
        "(G = shard group; no layout: the model's parameters are not known before it is built)";
  }

 private:
  // The estimate from the model's layout: its units as PlanUnits will wrap them, this rank's
  // shards of them, and the most the device pool holds beyond those while the hooks below run
  // over one micro-batch, with boost and a full checkpoint around it (each a unit at a time).
  // `g`: the shard group's ranks.
  static void EstimateLayout(const cai_memory_estimate_args& args, const cai::sdk::Config& config,
                             const std::string& strategy, int64_t g, cai_memory_estimate& out) {
    const bool sharded = strategy != "NO_SHARD";
    const bool full_shard = strategy == "FULL_SHARD" || strategy == "HYBRID_SHARD";
    const std::string wrap = config.String("auto_wrap");
    const bool offload = config.Bool("cpu_offload");
    const uint64_t e = args.precision == CAI_PRECISION_FP32 ? 4 : 2;
    const std::string reduce = config.String("reduce_dtype");
    const uint64_t er = reduce == "param" ? e : reduce == "fp32" ? 4 : 2;
    const uint64_t k = args.optimizer_state_slots;

    // Units: the root (everything outside a wrapped block) first, then the blocks' (merged up
    // to min_num_params under "size"), by model unit.
    struct Span {
      int64_t numel = 0;
      int32_t first = -1, last = -1;
    };
    std::vector<Span> units(1);
    std::vector<int64_t> owned(args.num_layout_units, 0);
    const std::vector<int32_t> block_of = cai::sdk::LayoutBlocks(args);
    for (uint32_t i = 0; i < args.num_layout_params; ++i) {
      if (wrap != "none" && block_of[i] >= 0) {
        owned[static_cast<size_t>(block_of[i])] += args.param_numel[i];
      } else {
        units[0].numel += args.param_numel[i];
      }
    }
    const std::vector<int32_t> unit_of =
        WrapUnits(owned, wrap == "size", config.Int("min_num_params"));
    for (uint32_t u = 0; u < args.num_layout_units; ++u) {
      if (unit_of[u] < 0) continue;
      if (static_cast<size_t>(unit_of[u]) == units.size()) {
        units.push_back({0, static_cast<int32_t>(u), -1});
      }
      units.back().last = static_cast<int32_t>(u);
      units.back().numel += owned[u];
    }
    uint64_t shard_sum = 0, largest_full = 0;
    std::vector<uint64_t> full(units.size());
    for (size_t j = 0; j < units.size(); ++j) {
      const auto shard = static_cast<uint64_t>((units[j].numel + g - 1) / g);
      full[j] = shard * static_cast<uint64_t>(g);
      shard_sum += shard;
      largest_full = std::max(largest_full, full[j]);
    }

    cai::sdk::MemoryReplay pool(config.Bool("async_reduce_scatter") ? 1 : 0);
    for (size_t j = 0; j < units.size(); ++j) {
      if (units[j].numel > 0) pool.Passing(4 * full[j]);  // boost: the flat fp32 unit
    }
    enum State { kReleased, kPrefetched, kGathered };
    std::vector<State> state(units.size(), kReleased);
    std::vector<bool> grads(units.size(), false);
    const auto limit = config.Int("prefetch_limit");
    auto gather = [&](size_t j) {
      if (!sharded || state[j] == kGathered || units[j].numel == 0) return;
      if (state[j] == kReleased) pool.Add(e * full[j]);
      state[j] = kGathered;
    };
    auto release = [&](size_t j) {
      if (!sharded || state[j] == kReleased) return;
      pool.Free(e * full[j]);
      state[j] = kReleased;
    };
    auto prefetch = [&](int64_t from, int dir) {
      for (int64_t j = from, n = 0; n < limit; j += dir, ++n) {
        if (j < 1 || j >= static_cast<int64_t>(units.size())) return;
        const auto u = static_cast<size_t>(j);
        if (!sharded || g == 1 || state[u] != kReleased || units[u].numel == 0) continue;
        state[u] = kPrefetched;
        pool.Add(e * full[u]);
      }
    };
    auto begin_grads = [&](size_t j) {
      if (grads[j] || units[j].numel == 0) return;
      grads[j] = true;
      pool.Add(e * full[j]);
    };
    auto reduce_grads = [&](size_t j) {
      grads[j] = false;
      if (er != e) {  // converted to the reduce dtype before the gradient buffer goes
        pool.Add(er * full[j]);
        pool.Free(e * full[j]);
      }
      pool.Reduce(er * full[j], g > 1 ? er * full[j] / static_cast<uint64_t>(g) : 0);
    };
    const bool forward_prefetch = config.Bool("forward_prefetch");
    const std::string backward_prefetch = config.String("backward_prefetch");
    gather(0);
    begin_grads(0);
    for (size_t m = 0; m < unit_of.size(); ++m) {
      if (unit_of[m] < 0) continue;
      const auto j = static_cast<size_t>(unit_of[m]);
      gather(j);
      if (forward_prefetch && units[j].first == static_cast<int32_t>(m)) {
        prefetch(unit_of[m] + 1, +1);
      }
      if (units[j].last == static_cast<int32_t>(m) && full_shard) release(j);
    }
    for (size_t m = unit_of.size(); m-- > 0;) {
      if (unit_of[m] < 0) continue;
      const auto j = static_cast<size_t>(unit_of[m]);
      gather(j);
      if (backward_prefetch == "pre" && full_shard && units[j].last == static_cast<int32_t>(m)) {
        prefetch(unit_of[m] - 1, -1);
      }
      begin_grads(j);
      if (units[j].first != static_cast<int32_t>(m)) continue;
      if (grads[j]) reduce_grads(j);
      release(j);
      if (backward_prefetch == "post" && full_shard) prefetch(unit_of[m] - 1, -1);
    }
    for (size_t j = 0; j < units.size(); ++j) {
      if (grads[j]) reduce_grads(j);
      release(j);
    }
    pool.Finish();
    if (config.String("state_dict_type") == "full") {  // a unit gathered in fp32 at a time
      pool.Passing(4 * largest_full + (offload ? 4 * largest_full / static_cast<uint64_t>(g) : 0));
    }

    const uint64_t states = (8 + 4 * k) * shard_sum;
    const uint64_t compute_copy = e != 4 || offload ? e * shard_sum : 0;
    out.master_bytes = e == 4 ? 0 : 4 * shard_sum;
    out.param_bytes = (e == 4 ? 4 : e + 4) * shard_sum;
    out.grad_bytes = 4 * shard_sum + pool.peak();
    out.optimizer_state_bytes = 4 * k * shard_sum;
    out.device_bytes = (offload ? 0 : states) + compute_copy + pool.peak();
    // cpu_offload's host transients, one at a time: each reduced gradient shard lands in host
    // memory before it is added (the largest unit's, in the reduce dtype), and under mixed
    // precision the compute copy is cast on the host before its one copy over.
    const uint64_t landed = er * largest_full / static_cast<uint64_t>(g);
    const uint64_t cast = e != 4 ? e * shard_sum : 0;
    out.host_bytes = offload ? states + std::max(landed, cast) : 0;
    out.formula =
        "this model's units as boost wraps them: fp32 shards (4 + 4 + 4k)·S (on the host with "
        "cpu_offload) and the compute copy e·S, S = Σ ceil(Ψ_u/G), plus the device's peak of "
        "gathered units, gradient buffers and reduce-scatter buffers over boost, one micro-batch "
        "with the prefetch set, and a full checkpoint (gradient accumulation's no_sync keeps "
        "every unit's gradient besides: eΨ more); with cpu_offload the host also holds the "
        "larger of a reduced shard landing (e_reduce·Ψ_u/G of the largest unit) and the compute "
        "copy's host cast (e·S, mixed precision)";
  }

  enum class Wrap { kBlock, kSize, kNone };
  enum class Prefetch { kNone, kPre, kPost };

  struct Member {
    uint32_t param;
    uint32_t group;
    int64_t numel;
    int64_t offset;  // elements into the unit's flat parameter
    int32_t index;   // among all trainable parameters (the step's used flags)
  };
  struct Unit {
    std::string name;
    int32_t first = -1, last = -1;  // model units it spans; -1: the root
    std::vector<Member> members;
    int64_t numel = 0;  // Ψ_u
    int64_t shard = 0;  // s_u = ceil(Ψ_u / G)
    int64_t full = 0;   // G·s_u, the padded flat length
    int64_t base = 0;   // elements into this rank's shard buffers
    Buffer gathered;    // G·s_u compute-dtype while gathered (sharded strategies)
    Buffer grads;       // G·s_u compute-dtype while a backward accumulates into it
    bool released = false;
    cai::sdk::Work prefetch;  // an all-gather into `gathered` not yet waited for
  };

  static const char* Name(cai_dtype d) {
    return SameDtype(d, kF32) ? "fp32" : SameDtype(d, kBF16) ? "bf16" : "fp16";
  }
  cai_param_info ParamInfo(uint32_t index) const { return cai::sdk::ParamInfo(model_, index); }
  std::string ParamName(uint32_t index) const { return ParamInfo(index).name; }
  uint64_t FrozenBytes() const {
    uint64_t bytes = 0;
    for (uint32_t i : frozen_) {
      const cai_param_info info = ParamInfo(i);
      bytes += Bytes(info.numel, info.dtype);
    }
    return bytes;
  }
  uint64_t ShardParamBytes() const {
    return params_.size() + (compute_shard_.get() ? compute_shard_.size() : 0);
  }

  // Which unit every trainable parameter joins, the units' order and their shard layout.
  void PlanUnits() {
    const auto& model = *Host().model;
    const uint32_t num_params = model.num_params(model_);
    const uint32_t num_units = model.num_units(model_);
    // The ABI lists a unit's own parameters, not the ones it reads from other units (the tied
    // head reads the embedding's wte), so only blocks, which read nothing else, are wrapped.
    std::vector<int32_t> block_of(num_params, -1);
    for (uint32_t u = 0; u < num_units; ++u) {
      cai_unit_info info{};
      info.struct_size = CAI_UNIT_INFO_STRUCT_SIZE;
      Check(model.unit_info(model_, u, &info));
      if (info.kind != CAI_UNIT_BLOCK) continue;
      for (uint32_t k = 0; k < info.num_params; ++k)
        block_of[info.params[k]] = static_cast<int32_t>(u);
    }
    std::vector<std::vector<uint32_t>> owned(num_units);
    units_.emplace_back().name = "root";
    member_of_param_.assign(num_params, -1);
    for (uint32_t i = 0; i < num_params; ++i) {
      const cai_param_info info = ParamInfo(i);
      if (!SameDtype(info.dtype, kF32)) {
        throw Error(CAI_FAILED_PRECONDITION,
                    std::string("fsdp: parameter '") + info.name +
                        "' is not fp32 at boost; fsdp keeps fp32 shards and casts to "
                        "train.precision itself, so save the model in fp32");
      }
      if (info.tied_to >= 0) continue;
      if (!(info.flags & CAI_PARAM_REQUIRES_GRAD)) {
        frozen_.push_back(i);
        continue;
      }
      if (wrap_ != Wrap::kNone && block_of[i] >= 0) {
        owned[block_of[i]].push_back(i);
      } else {
        AddMember(units_[0], i, info);
      }
    }
    // Model units in order, grouped into FSDP units (one each, or merged up to the size).
    std::vector<int64_t> owned_numel(num_units, 0);
    for (uint32_t u = 0; u < num_units; ++u) {
      for (uint32_t i : owned[u]) owned_numel[u] += ParamInfo(i).numel;
    }
    unit_of_model_unit_ = WrapUnits(owned_numel, wrap_ == Wrap::kSize, min_num_params_);
    for (uint32_t u = 0; u < num_units; ++u) {
      if (unit_of_model_unit_[u] < 0) continue;
      cai_unit_info info{};
      info.struct_size = CAI_UNIT_INFO_STRUCT_SIZE;
      Check(model.unit_info(model_, u, &info));
      if (static_cast<size_t>(unit_of_model_unit_[u]) == units_.size()) {
        Unit& fresh = units_.emplace_back();
        fresh.name = info.name;
        fresh.first = static_cast<int32_t>(u);
      } else {
        units_.back().name += std::string("+") + info.name;
      }
      Unit& unit = units_.back();
      unit.last = static_cast<int32_t>(u);
      for (uint32_t i : owned[u]) AddMember(unit, i, ParamInfo(i));
    }
    int64_t total = 0;
    for (Unit& u : units_) {
      u.shard = (u.numel + shards_ - 1) / shards_;
      u.full = u.shard * shards_;
      u.base = total;
      total += u.shard;
      psi_ += u.numel;
    }
    shard_numel_ = total;
    if (psi_ == 0) {
      throw Error(CAI_FAILED_PRECONDITION,
                  "fsdp: the model has no trainable parameters; unfreeze some (model.freeze)");
    }
  }

  void AddMember(Unit& unit, uint32_t param, const cai_param_info& info) {
    member_of_param_[param] = static_cast<int32_t>(num_members_++);
    unit.members.push_back({param, info.group, info.numel, unit.numel, member_of_param_[param]});
    unit.numel += info.numel;
  }

  // The compute-dtype device copy of the parameter shard, from the fp32 shard (through a
  // host-tier cast and one copy under cpu_offload, so it is one transfer on an accelerator).
  void RefreshComputeShard() {
    if (!compute_shard_.get()) return;
    const cai_tensor masters = View(params_, kF32, 0, &shard_numel_);
    if (offload_ && SameDtype(compute_, kF32)) {
      Check(Host().mempool->copy(compute_shard_.data(), params_.data(), params_.size(), nullptr));
      return;
    }
    if (!offload_) {
      RunKernel(CAI_KERNEL_COPY, &masters, View(compute_shard_, compute_, 0, &shard_numel_));
      return;
    }
    Buffer host = Alloc(CAI_MEM_HOST, shard_numel_, compute_, "fsdp.offload_param");
    RunKernel(CAI_KERNEL_COPY, &masters, View(host, compute_, 0, &shard_numel_));
    Check(Host().mempool->copy(compute_shard_.data(), host.data(), compute_shard_.size(), nullptr));
  }

  // Points the unit's parameters at `flat` (compute dtype, elements from `base` on); a
  // released parameter's storage is refilled in place, which keeps autograd's saved views
  // valid.
  void PointParams(Unit& u, const Buffer& flat, int64_t base) {
    for (const Member& m : u.members) {
      cai_tensor view = View(flat, compute_, base + m.offset, &m.numel);
      Check(Host().model->replace_param_storage(model_, m.param, &view));
    }
    u.released = false;
  }

  void ReleaseParams(Unit& u) {
    u.prefetch = cai::sdk::Work();  // a prefetch still writing into u.gathered finishes first
    if (!sharded_) return;
    if (!u.released) {
      for (const Member& m : u.members) {
        Check(Host().model->release_param_storage(model_, m.param));
      }
      u.released = true;
    }
    if (u.gathered.get()) gathered_bytes_ -= u.gathered.size();
    u.gathered = Buffer();
  }

  // The all-gather input: this rank's shard of unit u in the compute dtype, on the device.
  cai_tensor ShardSource(const Unit& u) const {
    return compute_shard_.get() ? View(compute_shard_, compute_, u.base, &u.shard)
                                : View(params_, kF32, u.base, &u.shard);
  }

  // Starts (async) or runs the all-gather of unit u's compute shard into u.gathered.
  cai::sdk::Work StartGather(Unit& u, bool async) {
    u.gathered = Alloc(CAI_MEM_DEVICE, u.full, compute_, "fsdp.gathered");
    gathered_bytes_ += u.gathered.size();
    if (!in_backward_) {
      forward_param_peak_ = std::max(forward_param_peak_, ShardParamBytes() + gathered_bytes_);
    }
    const cai_tensor in = ShardSource(u);
    const cai_tensor out = View(u.gathered, compute_, 0, &u.full);
    if (shards_ == 1) {
      RunKernel(CAI_KERNEL_COPY, &in, out);
      return {};
    }
    return RunCollective(CAI_COMM_ALL_GATHER, &in, out, async, CAI_REDUCE_SUM, groups_.shard());
  }

  void Gather(Unit& u) {
    if (!sharded_ || !u.released || u.members.empty()) return;
    if (u.prefetch.valid()) {
      u.prefetch.Wait();
      u.prefetch = cai::sdk::Work();
    } else {
      StartGather(u, false);
    }
    PointParams(u, u.gathered, 0);
  }

  // Starts the all-gathers of units_[from], units_[from + dir], ... (prefetch_limit of them
  // at most) without waiting; Gather completes them. Every rank prefetches at the same hooks,
  // so collectives keep one order across ranks.
  void PrefetchFrom(int64_t from, int dir) {
    for (int64_t k = from, n = 0; n < prefetch_limit_; k += dir, ++n) {
      if (k < 1 || k >= static_cast<int64_t>(units_.size())) return;  // the root is gathered
      Unit& u = units_[k];
      if (!sharded_ || shards_ == 1 || !u.released || u.members.empty() || u.prefetch.valid()) {
        continue;
      }
      u.prefetch = StartGather(u, true);
    }
  }

  // The unit's .grad become views of a zeroed flat buffer laid out like its parameter.
  void BeginGrads(Unit& u) {
    if (u.grads.get() || u.members.empty()) return;
    u.grads = Alloc(CAI_MEM_DEVICE, u.full, compute_, "fsdp.grad");
    for (const Member& m : u.members) {
      cai_tensor view = View(u.grads, compute_, m.offset, &m.numel);
      Check(Host().model->replace_grad_storage(model_, m.param, &view));
    }
  }

  // Sums the unit's gradient over all ranks into this rank's fp32 gradient shard: a
  // reduce-scatter over the shard group, an all-reduce of the result over the replicas. With
  // async_reduce_scatter the reduce-scatter runs while backward goes on to the next units (as
  // PyTorch FSDP's runs on its own stream) and completes when the next one starts: one unit's
  // full-size gradient stays alive meanwhile.
  void ReduceGrads(Unit& u) {
    for (const Member& m : u.members) Check(Host().model->release_grad(model_, m.param));
    Buffer wire = std::move(u.grads);
    if (!SameDtype(reduce_, compute_)) {
      Buffer converted = Alloc(CAI_MEM_DEVICE, u.full, reduce_, "fsdp.grad");
      const cai_tensor from = View(wire, compute_, 0, &u.full);
      RunKernel(CAI_KERNEL_COPY, &from, View(converted, reduce_, 0, &u.full));
      wire = std::move(converted);
    }
    const Unit* unit = &u;
    reducer_.Reduce(std::move(wire), u.shard, reduce_,
                    [this, unit](const cai_tensor& summed, const Buffer& on) {
                      cai::sdk::AddToShard(summed, on, View(grads_, kF32, unit->base, &unit->shard),
                                           offload_ ? CAI_MEM_HOST : CAI_MEM_DEVICE);
                    });
  }

  static cai_status* OnUnitHook(void* self, const cai_hook_event* event) {
    return cai::sdk::Guard([&] { static_cast<Fsdp*>(self)->OnHook(*event); });
  }

  void OnHook(const cai_hook_event& e) {
    if (e.kind == CAI_HOOK_GRAD_READY) {
      if (e.param >= 0 && static_cast<size_t>(e.param) < member_of_param_.size() &&
          member_of_param_[e.param] >= 0) {
        used_[member_of_param_[e.param]] = 1;
      }
      return;
    }
    if (e.unit < 0 || static_cast<size_t>(e.unit) >= unit_of_model_unit_.size()) return;
    const int32_t k = unit_of_model_unit_[e.unit];
    if (k < 0) return;  // no parameters of its own: the root's are gathered throughout
    Unit& u = units_[k];
    // A unit spanning several model units is gathered at the first event that needs it and
    // released after its last model unit (forward) or first (backward).
    switch (e.kind) {
      case CAI_HOOK_PRE_FORWARD:
        Gather(u);
        if (forward_prefetch_ && !e.recompute && e.unit == u.first) PrefetchFrom(k + 1, +1);
        break;
      case CAI_HOOK_POST_FORWARD:
        // A recomputation inside backward (activation checkpointing) keeps what backward needs.
        if (e.unit == u.last && !e.recompute && (full_shard_ || !backward_)) ReleaseParams(u);
        break;
      case CAI_HOOK_PRE_BACKWARD:
        in_backward_ = true;
        Gather(u);
        if (backward_prefetch_ == Prefetch::kPre && full_shard_ && e.unit == u.last) {
          PrefetchFrom(k - 1, -1);
        }
        BeginGrads(u);
        break;
      case CAI_HOOK_POST_BACKWARD:
        if (e.unit != u.first) break;
        if (!no_sync_ && u.grads.get()) ReduceGrads(u);
        ReleaseParams(u);
        if (backward_prefetch_ == Prefetch::kPost && full_shard_) PrefetchFrom(k - 1, -1);
        break;
      default:
        break;
    }
  }

  // ---- Checkpoints ------------------------------------------------------------------------

  // This rank's shard of unit u from `shards` (fp32, either tier) on the device.
  cai_tensor DeviceShard(const Unit& u, const Buffer& shards, Buffer& staging) const {
    if (!offload_) return View(shards, kF32, u.base, &u.shard);
    staging = Alloc(CAI_MEM_DEVICE, u.shard, kF32, "fsdp.checkpoint");
    Check(Host().mempool->copy(staging.data(), static_cast<const float*>(shards.data()) + u.base,
                               staging.size(), nullptr));
    return View(staging, kF32, 0, &u.shard);
  }

  // Consolidated: the reference's layout, one unit gathered at a time; rank 0 writes.
  void SaveFull(const cai_checkpoint_args& args) {
    if (replica_index_ != 0) return;  // replica 0's shard group holds every value
    auto write_unit = [&](const Unit& u, const Buffer& shards, const std::string& suffix) {
      if (u.members.empty()) return;
      Buffer staging;
      const cai_tensor in = DeviceShard(u, shards, staging);
      Buffer full = Alloc(CAI_MEM_DEVICE, u.full, kF32, "fsdp.checkpoint");
      const cai_tensor out = View(full, kF32, 0, &u.full);
      if (shards_ > 1) {
        RunCollective(CAI_COMM_ALL_GATHER, &in, out, false, CAI_REDUCE_SUM, groups_.shard());
      } else {
        RunKernel(CAI_KERNEL_COPY, &in, out);
      }
      if (rank_ != 0) return;
      for (const Member& m : u.members) {
        const cai_param_info info = ParamInfo(m.param);
        const cai_tensor t = View(full, kF32, m.offset, &m.numel);
        if (suffix.empty()) {
          cai::sdk::WriteAsFp32(args.checkpoint, std::string("model/") + info.name, t,
                                std::span<const int64_t>(info.shape, info.ndim));
        } else {
          Check(Host().checkpoint->write_tensor(
              args.checkpoint, (std::string("optim/") + info.name + suffix).c_str(), &t));
        }
      }
    };
    if (args.model) {
      for (const Unit& u : units_) write_unit(u, params_, "");
    }
    if (args.optimizer) {
      for (size_t k = 0; k < optim_.num_slots(); ++k) {
        for (const Unit& u : units_) write_unit(u, optim_.state(k), "/" + std::to_string(k));
      }
    }
  }

  // Reads only this rank's slice of each canonical tensor, so any saved world size loads.
  void LoadFull(const cai_checkpoint_args& args) {
    auto read_unit = [&](const Unit& u, const Buffer& shards, const std::string& suffix) {
      const int64_t lo = shard_index_ * u.shard, hi = lo + u.shard;
      for (const Member& m : u.members) {
        const int64_t a = std::max(lo, m.offset), b = std::min(hi, m.offset + m.numel);
        if (a >= b) continue;
        const int64_t count = b - a;
        const cai_tensor dst = View(shards, kF32, u.base + (a - lo), &count);
        const std::string name =
            suffix.empty() ? "model/" + ParamName(m.param) : "optim/" + ParamName(m.param) + suffix;
        Check(Host().checkpoint->read_tensor(args.checkpoint, name.c_str(), a - m.offset, count,
                                             &dst));
      }
    };
    if (args.model) {
      for (const Unit& u : units_) read_unit(u, params_, "");
    }
    if (args.optimizer) {
      for (size_t k = 0; k < optim_.num_slots(); ++k) {
        for (const Unit& u : units_) read_unit(u, optim_.state(k), "/" + std::to_string(k));
      }
    }
  }

  // Sharded: replica 0's ranks write their own shards, rank 0 the index. Index text:
  //   "fsdp-sharded 1 <shards>" then per unit "unit <name> <s_u>" and its members
  //   "param <offset> <numel> <name>".
  void SaveSharded(const cai_checkpoint_args& args) {
    if (replica_index_ != 0) return;
    for (const Unit& u : units_) {
      if (u.members.empty()) continue;
      if (args.model) {
        const cai_tensor t = View(params_, kF32, u.base, &u.shard);
        Check(Host().checkpoint->write_tensor(
            args.checkpoint, ShardedTensorName(u.name, "param", shard_index_).c_str(), &t));
      }
      for (size_t k = 0; args.optimizer && k < optim_.num_slots(); ++k) {
        const cai_tensor t = View(optim_.state(k), kF32, u.base, &u.shard);
        Check(Host().checkpoint->write_tensor(
            args.checkpoint,
            ShardedTensorName(u.name, "state" + std::to_string(k), shard_index_).c_str(), &t));
      }
    }
    if (rank_ != 0) return;
    std::ostringstream index;
    index << "fsdp-sharded 1 " << shards_ << "\n";
    for (const Unit& u : units_) {
      if (u.members.empty()) continue;
      index << "unit " << u.name << " " << u.shard << "\n";
      for (const Member& m : u.members) {
        index << "param " << m.offset << " " << m.numel << " " << ParamName(m.param) << "\n";
      }
    }
    Check(Host().checkpoint->write_meta(args.checkpoint, "fsdp.index", index.str().c_str()));
  }

  // Every parameter's slice of this rank's shard, read from the saved shards that hold it.
  void LoadSharded(const cai_checkpoint_args& args, const std::string& text) {
    const std::map<std::string, ShardedParam> saved = ParseShardedIndex(text);
    auto read_unit = [&](const Unit& u, const Buffer& shards, const std::string& what) {
      const int64_t lo = shard_index_ * u.shard, hi = lo + u.shard;
      for (const Member& m : u.members) {
        const int64_t a = std::max(lo, m.offset), b = std::min(hi, m.offset + m.numel);
        if (a >= b) continue;
        const std::string name = ParamName(m.param);
        auto it = saved.find(name);
        if (it == saved.end() || it->second.numel != m.numel) {
          throw Error(CAI_NOT_FOUND, "fsdp: the sharded checkpoint's index has no parameter '" +
                                         name + "' of " + std::to_string(m.numel) +
                                         " elements; it was saved from another model");
        }
        const ShardedParam& p = it->second;
        // Elements [a, b) of the unit are [a - m.offset, b - m.offset) of the parameter, at
        // p.offset + that in the saved unit, whose shard j holds [j·s, (j+1)·s).
        for (int64_t at = a; at < b;) {
          const int64_t pos = p.offset + (at - m.offset);
          const int64_t j = pos / p.shard, within = pos % p.shard;
          const int64_t count = std::min(b - at, p.shard - within);
          const cai_tensor dst = View(shards, kF32, u.base + (at - lo), &count);
          Check(Host().checkpoint->read_tensor(
              args.checkpoint, ShardedTensorName(p.unit, what, j).c_str(), within, count, &dst));
          at += count;
        }
      }
    };
    if (args.model) {
      for (const Unit& u : units_) read_unit(u, params_, "param");
    }
    if (args.optimizer) {
      for (size_t k = 0; k < optim_.num_slots(); ++k) {
        for (const Unit& u : units_) read_unit(u, optim_.state(k), "state" + std::to_string(k));
      }
    }
  }

  // Configuration.
  int32_t rank_ = 0;
  int32_t world_ = 1;
  std::string strategy_name_;
  bool full_shard_ = true;  // re-gather for backward
  bool sharded_ = true;     // parameters released between uses
  bool hybrid_ = false;
  Wrap wrap_ = Wrap::kBlock;
  int64_t min_num_params_ = 0;
  bool sync_module_states_ = true;
  bool forward_prefetch_ = false;
  Prefetch backward_prefetch_ = Prefetch::kNone;
  int64_t prefetch_limit_ = 1;
  std::string reduce_dtype_name_;
  std::string buffer_dtype_name_;
  bool offload_ = false;
  bool full_state_dict_ = false;
  cai_loss_scaler_config scaler_config_{};

  cai_model* model_ = nullptr;
  cai_optimizer* optimizer_ = nullptr;
  cai_dtype compute_ = kF32;  // parameters and gradients as the model computes
  cai_dtype reduce_ = kF32;   // gradients on the wire
  cai_device device_{CAI_DEVICE_CPU, 0};
  cai_device state_device_{CAI_DEVICE_CPU, 0};  // where the shards live (host under offload)
  cai::sdk::UnitHooks hooks_;
  int32_t shards_ = 1;    // G: ranks a unit is sharded over
  int32_t replicas_ = 1;  // R = N / G
  int32_t shard_index_ = 0;
  int32_t replica_index_ = 0;
  cai::sdk::ShardGroups groups_;

  std::vector<Unit> units_;                  // [0] is the root, then in forward order
  std::vector<int32_t> unit_of_model_unit_;  // model unit -> index in units_, -1 = none
  std::vector<int32_t> member_of_param_;     // model parameter -> trainable index, -1 if none
  std::vector<uint32_t> frozen_;             // parameters kept whole on every rank
  size_t num_members_ = 0;
  int64_t psi_ = 0;          // Ψ: trainable elements
  int64_t shard_numel_ = 0;  // S = Σ s_u

  // This rank's shards, S fp32 elements each, units end to end.
  Buffer params_;
  Buffer grads_;                   // gradient sums since zero_grad
  cai::sdk::FlatOptimizer optim_;  // optimizer state slots of the shards
  Buffer compute_shard_;           // S compute-dtype elements on the device (mixed or offload)
  std::optional<cai::sdk::StepEpilogue> epilogue_;

  bool backward_ = false;     // the current model call back-propagates
  bool in_backward_ = false;  // its backward has begun
  bool no_sync_ = false;
  size_t reduces_in_flight_ = 1;    // left pending when ReduceGrads returns
  cai::sdk::OverlapMeter overlap_;  // of the reductions (stats.overlap_ratio)
  cai::sdk::ShardReducer reducer_;  // after overlap_ and groups_, which it points at
  std::vector<uint8_t> used_;    // trainable parameter got a gradient on this rank since zero_grad
  uint64_t gathered_bytes_ = 0;  // gathered units alive now
  uint64_t forward_param_peak_ = 0;
};

}  // namespace

CAI_PLUGIN(Fsdp)
