// libcai_gemini: chunk-based ZeRO-3 across device, host and NVMe memory, as ColossalAI's
// GeminiPlugin (Fang et al., "PatrickStar", 2021): parameters, gradients and optimizer state
// live in fixed-size chunks, each chunk sharded over the ranks and placed on a memory tier.
//
// Chunks. Trainable parameters, in registration order, are packed into chunks of capacity C
// elements (a multiple of the shard group G): a parameter never straddles two chunks, one
// larger than C gets a chunk of its own (rounded up to G), and the parameters outside the
// transformer blocks (embeddings, final norm, head: the "root" ones, which the tied head reads
// outside any unit) get chunks of their own, gathered for the whole micro-batch as PyTorch
// FSDP's root. C is chunk_size, or searched (ColossalAI's search_chunk_configuration): every
// size from min_chunk_size_m·2^20 to that + search_range_m·2^20 in steps of hidden_dim
// (1024 when 0), the least padding wins, the smallest among equals; never more than Ψ rounded
// up to G. Rank r of the shard group owns elements [r·C/G, (r+1)·C/G) of every chunk.
//
// Placement (placement_policy = "static", ColossalAI's StaticPlacementPolicy), by chunk
// capacity in chunk order, a fraction f taking the first chunks until f of the capacity is
// reached:
//  shard_param_frac    the first chunks are sharded (ZeRO-3: gathered around use, released
//                      after); the others stay gathered on every rank (their gradients are
//                      still reduce-scattered and their optimizer state sharded, as ZeRO-2),
//                      re-gathered once after each step.
//  offload_optim_frac  the first chunks keep their fp32 master shard, gradient shard and
//                      optimizer state in host memory (pinned with pin_memory); the host's
//                      fused update runs there (HybridAdam's split), and the compute copy of
//                      the shard goes to the device after each step.
//  offload_param_frac  the first chunks keep even the compute copy of their shard in host
//                      memory, copied to the device for each all-gather. Needs
//                      shard_param_frac = 1 and offload_optim_frac = 1 (ColossalAI's rule;
//                      ColossalAI warns and ignores it, this plugin refuses).
//  nvme_offload_fraction  of the host-offloaded chunks (the last ones), the optimizer state
//                      lives in unmapped NVMe buffers under memory.nvme_dir (ColossalAI's
//                      HybridAdam nvme_offload_fraction, ZeRO-Infinity): each step streams a
//                      chunk's state in, updates it and writes it back, the next chunk's read
//                      running behind the update on the pool's copy thread.
//
// placement_policy = "auto" (ColossalAI's AutoPlacementPolicy, in the terms of this host):
// without a device budget everything is on the device; under memory.device_budget the
// optimizer state starts on the host and the first step runs with the parameters' copies
// there too, except the last chunks' within (1 - warmup_non_model_data_ratio) of the budget.
// When it ends the ranks agree on the largest device peak (pool and LibTorch) any of them saw.
// gpu_margin_mem_ratio of the margin (the budget less that peak) takes whole chunks' fp32
// master, gradient and optimizer-state shards onto the device, first chunks first, whose
// update then runs there (ColossalAI's GeminiOptimizer moves its fp32 chunks into that margin
// in the same way; its default 0 leaves all the state on the host). The room below
// steady_cuda_cap_ratio of the budget, less that state and max_prefetch gathered chunks,
// takes chunks' parameter copies onto the device (first chunks first), and what is left keeps
// gathered chunks for reuse: a chunk released after use stays gathered if the cache has room
// or can make it by evicting a chunk next needed later in the recorded order (Belady's rule,
// the order the first micro-batch recorded); the cache empties at each step, whose update makes
// the gathered copies stale. Every rank takes the same decisions (same chunks, same order,
// same agreed capacity), so the collectives stay matched.
//
// One micro-batch: root chunks gathered; at a unit's PRE_FORWARD its sharded chunks are
// all-gathered (compute dtype) into the parameters' released storage, and released at the
// POST_FORWARD of the last unit they hold parameters of; PRE_BACKWARD gathers them again. As
// each parameter's gradient is ready (GRAD_READY, after its last use in this backward) it is
// copied over the parameter's own place in the gathered chunk, as ColossalAI's chunks do, so
// gradients take no chunk-sized buffer of their own (a kept chunk, and every chunk under auto,
// whose gathered parameters are still wanted, have a zeroed gradient buffer the .grad are views
// of instead). The POST_BACKWARD of the first unit a chunk serves reduce-scatters the chunk's
// gradient (SUM, compute dtype), all-reduces the result over the extra_dp_size replicas and
// adds it into the fp32 gradient shard. With enable_async_reduce one chunk's reduce-scatter
// runs while backward goes on. With max_prefetch > 0 the first micro-batch records the order
// chunks are gathered in (forward, recomputation and backward); later ones start the
// all-gathers of the next max_prefetch chunks of that order as each is gathered, so they run
// behind compute.
//
// Gradient accumulation needs nothing special: each micro-batch's gradients are reduced into
// the fp32 gradient shards, which accumulate until the step (enable_gradient_accumulation is
// accepted for ColossalAI's sake and changes nothing). A parameter without a gradient in a
// micro-batch (unused) is fine: its chunk is reduced with zeros, and a parameter no rank gave
// a gradient since zero_grad is not updated (torch.optim's rule), where ColossalAI raises.
//
// step: as fsdp's: one SUM all-reduce of [Σ g² of the gradient shards (replica 0 only), fp16
// overflow, per-parameter used flags], the loss scaler, the clip coefficient (max_norm, else
// optimizer.max_grad_norm), the fused update of every chunk on the tier holding its state,
// the compute copies refreshed, the kept chunks re-gathered.
//
// Checkpoints: the canonical layout (docs/checkpoint-layout.md), streamed one chunk at a
// time: a chunk's fp32 shards are all-gathered and rank 0 writes its parameters, so no rank
// ever holds more than one chunk of the model. Load reads only this rank's slice of every
// tensor, so any world size, chunk size or strategy's canonical checkpoint loads.
#include <algorithm>
#include <array>
#include <cai/sdk.hpp>
#include <cai/sdk/collectives.hpp>
#include <cai/sdk/flat.hpp>
#include <cai/sdk/overlap.hpp>
#include <cai/sdk/sharding.hpp>
#include <cai/sdk/step.hpp>
#include <cmath>
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
using cai::sdk::RunCollective;
using cai::sdk::RunKernel;
using cai::sdk::SameDtype;

constexpr cai_dtype kF32{CAI_DTYPE_FLOAT, 32, 1};
constexpr cai_dtype kBF16{CAI_DTYPE_BFLOAT, 16, 1};
constexpr double kMega = 1024.0 * 1024.0;  // ColossalAI's "_m" unit: 2^20 elements

const char* const kPlacementPolicies[] = {"static", "auto", nullptr};
const char* const kChunkInitDevices[] = {"device", "host", nullptr};

size_t Bytes(int64_t numel, cai_dtype dtype) {
  return static_cast<size_t>(numel) * cai::sdk::ElementSize(dtype);
}

// A zero-filled buffer of `numel` elements (the SDK's AllocFlat, for the signed counts used here).
Buffer Alloc(cai_mem_tier tier, int64_t numel, cai_dtype dtype, const char* tag) {
  return cai::sdk::AllocFlat(tier, static_cast<size_t>(numel), dtype, tag);
}

cai_tensor View(const Buffer& base, cai_dtype dtype, int64_t offset, const int64_t* numel) {
  return FlatView(base, dtype, static_cast<size_t>(offset), const_cast<int64_t*>(numel));
}

int64_t RoundUp(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Chunk capacities for parameters of `sizes` (in order; `root[i]` marks the ones that must not
// share a chunk with the others) at capacity `c`, and the padding that costs. The last chunk
// of each run of one kind holds only what it needs (rounded up to g): ColossalAI pads it to
// the full capacity, which for a model smaller than the chunk size doubles its memory.
struct Packing {
  std::vector<int64_t> chunk_of;  // per parameter
  std::vector<int64_t> capacity;  // per chunk
  int64_t waste = 0;
};
Packing Pack(const std::vector<int64_t>& sizes, const std::vector<bool>& root, int64_t c,
             int64_t g) {
  Packing p;
  int64_t used = 0;
  bool open_root = false;
  bool open = false;
  auto close = [&](bool last_of_kind) {
    if (!open) return;
    if (last_of_kind) p.capacity.back() = RoundUp(used, g);
    p.waste += p.capacity.back() - used;
    open = false;
  };
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] > c) {  // a chunk of its own
      close(true);
      p.capacity.push_back(RoundUp(sizes[i], g));
      p.waste += p.capacity.back() - sizes[i];
      p.chunk_of.push_back(static_cast<int64_t>(p.capacity.size()) - 1);
      continue;
    }
    if (!open || open_root != root[i] || used + sizes[i] > c) {
      close(open && open_root != root[i]);
      p.capacity.push_back(c);
      used = 0;
      open = true;
      open_root = root[i];
    }
    p.chunk_of.push_back(static_cast<int64_t>(p.capacity.size()) - 1);
    used += sizes[i];
  }
  close(true);
  return p;
}

// How the chunk capacity C is chosen: chunk_size, or ColossalAI's search over a range.
struct ChunkSizing {
  int64_t chunk_size = 0, min_chunk = 0, search_range = 0, interval = 1024;

  static ChunkSizing From(const cai::sdk::Config& config) {
    ChunkSizing s;
    s.chunk_size = config.Int("chunk_size");
    s.min_chunk = std::llround(config.Float("min_chunk_size_m") * kMega);
    s.search_range = std::llround(config.Float("search_range_m") * kMega);
    s.interval = config.Int("hidden_dim") > 0 ? config.Int("hidden_dim") : 1024;
    return s;
  }

  // C for parameters of `sizes` (in chunk order, `root` as Pack takes it) over g shards: the
  // least padding over the range, the smallest size among equals, never above Ψ rounded up.
  int64_t Capacity(const std::vector<int64_t>& sizes, const std::vector<bool>& root,
                   int64_t g) const {
    if (chunk_size > 0) return RoundUp(chunk_size, g);
    int64_t psi = 0;
    for (int64_t n : sizes) psi += n;
    const int64_t lo = RoundUp(std::max<int64_t>(1, std::min(min_chunk, psi)), g);
    const int64_t hi = std::max(lo, RoundUp(std::min(min_chunk + search_range, psi), g));
    int64_t best = -1, c = lo;
    for (int64_t size = lo; size <= hi; size += RoundUp(interval, g)) {
      const int64_t waste = Pack(sizes, root, size, g).waste;
      if (best < 0 || waste < best) {
        best = waste;
        c = size;
      }
    }
    return c;
  }
};

// A model's chunks. Trainable parameters in chunk order (those outside every block, the root
// ones, first; then each block's in unit order; registration order within) packed at the
// sized capacity; per chunk whether it is a root one and the first and last block unit it
// holds parameters of; per unit its chunks in the order its hooks meet them. `numel[i]`,
// `block_of[i]` (-1 outside every block) and `trainable[i]` describe parameter i.
struct ChunkLayout {
  struct Span {
    bool root = false;
    int32_t first_unit = -1, last_unit = -1;
  };
  std::vector<uint32_t> order;  // parameters in chunk order; packing.chunk_of follows it
  std::vector<int64_t> sizes;   // their elements, in that order
  int64_t capacity = 0;         // C
  Packing packing;
  std::vector<Span> spans;  // per chunk
  std::vector<std::vector<int32_t>> chunks_of_unit;

  ChunkLayout(const std::vector<int64_t>& numel, const std::vector<int32_t>& block_of,
              const std::vector<bool>& trainable, size_t num_units, int64_t g,
              const ChunkSizing& sizing) {
    std::vector<uint32_t> blocks;
    for (uint32_t i = 0; i < block_of.size(); ++i) {
      if (trainable[i]) (block_of[i] < 0 ? order : blocks).push_back(i);
    }
    std::stable_sort(blocks.begin(), blocks.end(),
                     [&](uint32_t a, uint32_t b) { return block_of[a] < block_of[b]; });
    order.insert(order.end(), blocks.begin(), blocks.end());
    std::vector<bool> root;
    for (uint32_t i : order) {
      sizes.push_back(numel[i]);
      root.push_back(block_of[i] < 0);
    }
    if (order.empty()) return;
    capacity = sizing.Capacity(sizes, root, g);
    packing = Pack(sizes, root, capacity, g);
    spans.resize(packing.capacity.size());
    chunks_of_unit.assign(num_units, {});
    for (size_t j = 0; j < order.size(); ++j) {
      const auto k = static_cast<int32_t>(packing.chunk_of[j]);
      Span& span = spans[static_cast<size_t>(k)];
      span.root = root[j];
      if (root[j]) continue;
      const int32_t u = block_of[order[j]];
      if (span.first_unit < 0) span.first_unit = u;
      span.last_unit = u;
      auto& list = chunks_of_unit[static_cast<size_t>(u)];
      if (list.empty() || list.back() != k) list.push_back(k);
    }
  }
};

// Where each chunk lives, by the static policy's fractions of the chunks' capacity in chunk
// order, a fraction f taking the first chunks until f of the capacity is reached.
constexpr int kDevice = 0, kHost = 1, kNvme = 2, kBanks = 3;
struct Placement {
  bool kept = false;   // gathered on every rank, never released (shard_param_frac)
  int bank = kDevice;  // where its fp32 shards live
  int compute = -1;    // compute-dtype shard: -1 none (the fp32 master is it), 0 device, 1 host
};
struct Fractions {
  double shard = 1, optim = 0, param = 0, nvme = 0;
};
std::vector<Placement> Place(const std::vector<int64_t>& capacity, const Fractions& f,
                             int64_t shards, bool mixed) {
  int64_t total = 0;
  for (int64_t c : capacity) total += c;
  auto first = [&](double frac) {
    std::vector<bool> in(capacity.size(), false);
    int64_t before = 0;
    for (size_t k = 0; k < capacity.size(); ++k) {
      in[k] = static_cast<double>(before) < frac * static_cast<double>(total) - 0.5;
      before += capacity[k];
    }
    return in;
  };
  const std::vector<bool> sharded = first(f.shard);
  const std::vector<bool> offload = first(f.optim);
  const std::vector<bool> host_param = first(f.param);
  // NVMe takes the last nvme_offload_fraction of the offloaded capacity.
  int64_t offloaded = 0;
  for (size_t k = 0; k < capacity.size(); ++k) offloaded += offload[k] ? capacity[k] : 0;
  std::vector<Placement> out(capacity.size());
  int64_t before = 0;
  for (size_t k = 0; k < capacity.size(); ++k) {
    Placement& p = out[k];
    p.kept = !sharded[k] || shards == 1;
    if (offload[k]) {
      // The last offloaded chunks until the fraction is reached (rounding up).
      const bool nvme = f.nvme > 0 && static_cast<double>(offloaded - before - capacity[k]) <
                                          f.nvme * static_cast<double>(offloaded);
      p.bank = nvme ? kNvme : kHost;
      before += capacity[k];
    }
    if (host_param[k]) {
      p.compute = 1;
    } else if (mixed || p.bank != kDevice) {
      p.compute = 0;
    }
  }
  return out;
}

// The most the device pool holds beyond the banks and the compute copies, replaying the
// plugin's schedule over its chunks buffer by buffer: boost assembling one chunk at a time in
// fp32; a micro-batch that records the gather order, then one that follows it with
// max_prefetch chunks gathered ahead; the root chunks gathered throughout, each block's
// around its forward and its backward; gradients over the gathered parameters, or in a buffer
// beside them (kept chunks, auto); each reduce-scatter holding its input and output until
// enough others queue behind it; a checkpoint gathering one chunk in fp32. The estimate's
// test holds it against measured peaks, so a schedule change it does not follow shows there.
struct Schedule {
  const ChunkLayout& layout;
  const std::vector<Placement>& placed;  // per chunk
  uint64_t element = 4;                  // bytes of a compute-dtype element
  int64_t shards = 1;
  size_t max_prefetch = 0;
  size_t in_flight = 1;    // reduce-scatters left running (enable_async_reduce)
  bool cache_all = false;  // auto without a budget: gathered chunks stay until the step
  bool init_on_device = true;

  uint64_t Peak() const {
    const std::vector<int64_t>& capacity = layout.packing.capacity;
    const auto& spans = layout.spans;
    const auto& chunks_of_unit = layout.chunks_of_unit;
    const size_t n = capacity.size();
    enum State { kReleased, kPrefetched, kGathered };
    std::vector<State> state(n, kReleased);
    std::vector<bool> collecting(n, false);
    cai::sdk::MemoryReplay pool(in_flight);
    auto bytes = [&](size_t k) { return static_cast<uint64_t>(capacity[k]) * element; };
    auto shard = [&](size_t k) { return bytes(k) / static_cast<uint64_t>(shards); };
    // The device copy of a host-held compute shard, while its all-gather runs.
    auto staging = [&](size_t k) { return placed[k].compute == 1 ? shard(k) : 0; };
    auto kept = [&](size_t k) { return placed[k].kept; };
    uint64_t largest = 0;  // elements
    for (int64_t c : capacity) largest = std::max(largest, static_cast<uint64_t>(c));

    if (init_on_device) pool.Passing(4 * largest);
    for (size_t k = 0; k < n; ++k) {
      if (kept(k)) {
        state[k] = kGathered;
        pool.Add(bytes(k));
      }
    }

    std::vector<size_t> order;
    bool recording = true, following = false;
    size_t cursor = 0;
    auto follow = [&](size_t k) {
      if (max_prefetch == 0 && !cache_all) return;
      if (recording) {
        order.push_back(k);
        return;
      }
      if (!following) return;
      if (cursor >= order.size() || order[cursor] != k) {
        following = false;
        return;
      }
      ++cursor;
      for (size_t j = cursor; j < std::min(order.size(), cursor + max_prefetch); ++j) {
        if (state[order[j]] != kReleased) continue;
        state[order[j]] = kPrefetched;
        pool.Add(bytes(order[j]) + staging(order[j]));
      }
    };
    auto gather = [&](size_t k) {
      if (state[k] == kGathered) return;
      if (state[k] == kReleased) pool.Add(bytes(k) + staging(k));
      pool.Free(staging(k));
      state[k] = kGathered;
      if (!spans[k].root && !kept(k)) follow(k);
    };
    auto release = [&](size_t k) {
      if (kept(k) || state[k] == kReleased || cache_all) return;
      pool.Free(bytes(k) + (state[k] == kPrefetched ? staging(k) : 0));
      state[k] = kReleased;
    };
    auto in_place = [&](size_t k) { return !kept(k) && !cache_all; };
    auto begin_grads = [&](size_t k) {
      if (collecting[k]) return;
      collecting[k] = true;
      if (!in_place(k)) pool.Add(bytes(k));
    };
    auto reduce = [&](size_t k) {
      collecting[k] = false;
      // In place, the gathered buffer becomes the reduce-scatter's input; else the gradient
      // buffer does.
      if (in_place(k)) state[k] = kReleased;
      pool.Reduce(bytes(k), shards > 1 ? shard(k) : 0);
    };
    for (int pass = 0; pass < 2; ++pass) {
      cursor = 0;
      following = !recording;
      for (size_t k = 0; k < n; ++k) {
        if (spans[k].root) {
          gather(k);
          begin_grads(k);
        }
      }
      for (size_t u = 0; u < chunks_of_unit.size(); ++u) {
        for (int32_t k : chunks_of_unit[u]) gather(k);
        for (int32_t k : chunks_of_unit[u]) {
          if (spans[k].last_unit == static_cast<int32_t>(u)) release(k);
        }
      }
      for (size_t u = chunks_of_unit.size(); u-- > 0;) {
        for (int32_t k : chunks_of_unit[u]) {
          gather(k);
          begin_grads(k);
        }
        for (int32_t k : chunks_of_unit[u]) {
          if (spans[k].first_unit != static_cast<int32_t>(u)) continue;
          if (collecting[k]) reduce(k);
          release(k);
        }
      }
      for (size_t k = 0; k < n; ++k) {
        if (collecting[k]) reduce(k);
        release(k);
      }
      pool.Finish();
      recording = false;
    }
    // A checkpoint: one chunk's fp32 values gathered, beside a device copy of its shard.
    pool.Passing(4 * largest + 4 * largest / static_cast<uint64_t>(shards));
    return pool.peak();
  }
};

class Gemini {
 public:
  static constexpr const char* kName = "gemini";
  static constexpr const char* kVersion = "0.1.0";
  static constexpr uint64_t kCapabilities = CAI_CAP_PRECISION_FP32 | CAI_CAP_PRECISION_BF16 |
                                            CAI_CAP_PRECISION_FP16 | CAI_CAP_CPU_OFFLOAD;

  static std::span<const cai_config_key> ConfigKeys() {
    using cai::sdk::BoolKey;
    using cai::sdk::FloatKey;
    using cai::sdk::IntKey;
    using cai::sdk::StringKey;
    static constexpr auto kKeys = cai::sdk::JoinKeys(
        std::array{
            IntKey("chunk_size", "0",
                   "Chunk capacity in elements (ColossalAI's chunk_config_dict chunk_size), "
                   "rounded up to a multiple of the shard group; 0 = searched (the keys "
                   "below).",
                   0, 0, CAI_CONFIG_HAS_MIN),
            FloatKey("search_range_m", "32.0",
                     "Chunk search: sizes from min_chunk_size_m to min_chunk_size_m + "
                     "search_range_m, in 2^20 elements; the least padding wins.",
                     0, 0, CAI_CONFIG_HAS_MIN),
            FloatKey("min_chunk_size_m", "32.0",
                     "Chunk search: the smallest capacity tried, in 2^20 elements (never above "
                     "the model's trainable elements). A chunk is gathered whole, so larger chunks "
                     "mean fewer messages and more memory: GPT-2 124M makes 3 chunks at the "
                     "defaults and gathers the whole model at its peak, 8 chunks with "
                     "min_chunk_size_m = search_range_m = 8.",
                     0, 0, CAI_CONFIG_HAS_MIN),
            IntKey("hidden_dim", "0",
                   "Chunk search: step between the sizes tried, in elements (the model's "
                   "hidden size suits); 0 = 1024.",
                   0, 0, CAI_CONFIG_HAS_MIN),
            StringKey("placement_policy", "\"static\"",
                      "static: chunks placed by shard_param_frac, offload_optim_frac and "
                      "offload_param_frac. auto: under a device budget (memory.device_budget) "
                      "the optimizer state starts on the host and the first step runs with the "
                      "parameters there too, measuring the device's peak; then chunks' state "
                      "moves to the device within gpu_margin_mem_ratio of the margin left, and "
                      "chunks' parameters while steady_cuda_cap_ratio of the budget "
                      "allows, and what remains keeps gathered chunks for reuse, evicting the "
                      "one needed furthest ahead in the recorded order. Without a budget, all "
                      "on the device and every gathered chunk kept until the step.",
                      kPlacementPolicies),
            StringKey("chunk_init_device", "\"device\"",
                      "Where each chunk's fp32 values are assembled at boost (and broadcast "
                      "from rank 0 with sync_module_states), one chunk at a time: device or "
                      "host memory. The model's parameters are released chunk by chunk as they "
                      "are copied, so with model.init_device = \"lazy\" no rank ever holds "
                      "more than one chunk of the unsharded model.",
                      kChunkInitDevices),
            FloatKey("warmup_non_model_data_ratio", "0.8",
                     "auto, under a device budget: share of the budget the first step leaves to "
                     "what is not model data (activations, temporaries, gathered chunks); the "
                     "last chunks' parameter copies take the rest on the device from the start "
                     "(ColossalAI's). 1 keeps every copy on the host until the first step has "
                     "measured the device's peak.",
                     0, 1, CAI_CONFIG_HAS_MIN | CAI_CONFIG_HAS_MAX),
            FloatKey("steady_cuda_cap_ratio", "0.9",
                     "auto: share of the device budget the placement after the first step may "
                     "fill (ColossalAI's).",
                     0, 1, CAI_CONFIG_HAS_MIN | CAI_CONFIG_HAS_MAX),
            FloatKey("gpu_margin_mem_ratio", "0.0",
                     "auto, under a device budget: share of the margin the first step leaves "
                     "(the budget less its device peak) that takes whole chunks' fp32 master, "
                     "gradient and optimizer-state shards onto the device after that step, "
                     "first chunks first, so that their update runs there (ColossalAI's). 0 "
                     "keeps all the optimizer state on the host.",
                     0, 1, CAI_CONFIG_HAS_MIN | CAI_CONFIG_HAS_MAX),
            FloatKey("shard_param_frac", "1.0",
                     "Share of the chunks (by capacity, first chunks first) that are sharded "
                     "and gathered around use (ZeRO-3); the rest stay gathered on every rank "
                     "(ZeRO-2 for them).",
                     0, 1, CAI_CONFIG_HAS_MIN | CAI_CONFIG_HAS_MAX),
            FloatKey("offload_optim_frac", "0.0",
                     "Share of the chunks whose fp32 master, gradient and optimizer state shards "
                     "live in host memory, updated there.",
                     0, 1, CAI_CONFIG_HAS_MIN | CAI_CONFIG_HAS_MAX),
            FloatKey("offload_param_frac", "0.0",
                     "Share of the chunks whose compute-dtype parameter shard lives in host "
                     "memory too, copied to the device for each gather. Needs shard_param_frac "
                     "= 1 and offload_optim_frac = 1.",
                     0, 1, CAI_CONFIG_HAS_MIN | CAI_CONFIG_HAS_MAX),
            FloatKey("nvme_offload_fraction", "0.0",
                     "Share of the host-offloaded chunks (the last ones) whose optimizer state "
                     "lives on NVMe (memory.nvme_dir), out of RAM, streamed through each step. "
                     "Needs offload_optim_frac > 0.",
                     0, 1, CAI_CONFIG_HAS_MIN | CAI_CONFIG_HAS_MAX),
            BoolKey("nvme_offload_masters", "false",
                    "The NVMe chunks' fp32 master shards on NVMe too (ZeRO-Infinity's parameter "
                    "offload), streamed with their optimizer state; only the gradient shard and "
                    "the compute copy stay in RAM. Needs nvme_offload_fraction > 0."),
            IntKey("nvme_stream_elements", "1048576",
                   "Elements of a chunk's shard streamed through RAM at a time in the NVMe "
                   "chunks' update (DeepSpeed's NVMe buffer size): two such pieces of every "
                   "streamed slot are staged at once.",
                   1024, 0, CAI_CONFIG_HAS_MIN),
            IntKey("max_prefetch", "0",
                   "Chunks whose all-gathers run ahead of use, along the order the first "
                   "micro-batch recorded; each costs one gathered chunk of memory.",
                   0, 64, CAI_CONFIG_HAS_MIN | CAI_CONFIG_HAS_MAX),
            BoolKey("enable_gradient_accumulation", "false",
                    "Accepted for ColossalAI's sake: micro-batches' gradients always "
                    "accumulate in the fp32 gradient shards, so both values train the same."),
            BoolKey("master_weights", "true",
                    "fp32 master shards under bf16/fp16. false is refused: the update runs on "
                    "fp32 masters."),
            FloatKey("max_norm", "0.0",
                     "Clip the global gradient norm to this; 0 = optimizer.max_grad_norm.", 0, 0,
                     CAI_CONFIG_HAS_MIN),
            BoolKey("pin_memory", "false",
                    "Offloaded shards in page-locked host memory (faster device copies on a "
                    "GPU; plain host memory on a CPU build)."),
            BoolKey("enable_async_reduce", "true",
                    "Reduce-scatter a chunk's gradient while backward goes on (one chunk's "
                    "gradient of memory more)."),
            IntKey("extra_dp_size", "1",
                   "Replicate the chunks over this many groups of world_size / extra_dp_size "
                   "ranks (sharded inside a group, gradient shards all-reduced across); must "
                   "divide the world size.",
                   1, 0, CAI_CONFIG_HAS_MIN),
            BoolKey("sync_module_states", "true",
                    "Broadcast rank 0's parameters and buffers at boost."),
            BoolKey("verbose", "false", "Log every chunk: its parameters, capacity and tiers."),
        },
        cai::sdk::LossScalerKeys("65536.0", "fp16: initial loss scale (2^16, ColossalAI's)."));
    return kKeys;
  }

  explicit Gemini(const cai_create_args& args) : rank_(args.rank), world_(args.world_size) {
    cai::sdk::Config config(args.config);
    auto_ = config.String("placement_policy") == "auto";
    cap_ratio_ = config.Float("steady_cuda_cap_ratio");
    warmup_ratio_ = config.Float("warmup_non_model_data_ratio");
    margin_ratio_ = config.Float("gpu_margin_mem_ratio");
    if (!auto_ && margin_ratio_ > 0) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "gemini: gpu_margin_mem_ratio > 0 needs placement_policy = \"auto\" (it "
                  "moves optimizer state into the room the first step leaves under "
                  "memory.device_budget); with \"static\", offload_optim_frac places the "
                  "optimizer state");
    }
    if (auto_ &&
        (config.Float("shard_param_frac") != 1.0 || config.Float("offload_optim_frac") != 0.0 ||
         config.Float("offload_param_frac") != 0.0 ||
         config.Float("nvme_offload_fraction") != 0.0)) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "gemini: placement_policy = \"auto\" places the chunks itself; remove "
                  "shard_param_frac, offload_optim_frac, offload_param_frac and "
                  "nvme_offload_fraction, or use placement_policy = \"static\"");
    }
    if (!config.Bool("master_weights")) {
      throw Error(CAI_UNIMPLEMENTED,
                  "gemini: plugin.gemini.master_weights = false is not supported: the update "
                  "runs on fp32 master shards; remove the key");
    }
    sizing_ = ChunkSizing::From(config);
    shard_frac_ = config.Float("shard_param_frac");
    optim_frac_ = config.Float("offload_optim_frac");
    param_frac_ = config.Float("offload_param_frac");
    nvme_frac_ = config.Float("nvme_offload_fraction");
    if (param_frac_ > 0 && (shard_frac_ < 1 || optim_frac_ < 1)) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "gemini: plugin.gemini.offload_param_frac > 0 needs shard_param_frac = 1.0 "
                  "and offload_optim_frac = 1.0 (a chunk's parameters go to the host only "
                  "with its optimizer state, and only when sharded); they are " +
                      std::to_string(shard_frac_) + " and " + std::to_string(optim_frac_));
    }
    if (nvme_frac_ > 0 && optim_frac_ <= 0) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "gemini: plugin.gemini.nvme_offload_fraction > 0 needs offload_optim_frac > "
                  "0: NVMe holds the optimizer state of host-offloaded chunks");
    }
    nvme_masters_ = config.Bool("nvme_offload_masters");
    if (nvme_masters_ && nvme_frac_ <= 0) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "gemini: plugin.gemini.nvme_offload_masters = true needs nvme_offload_fraction "
                  "> 0: the masters go to NVMe with the optimizer state of the NVMe chunks");
    }
    max_prefetch_ = config.Int("max_prefetch");
    stream_elements_ = config.Int("nvme_stream_elements");
    max_norm_ = config.Float("max_norm");
    pin_ = config.Bool("pin_memory");
    reduces_in_flight_ = config.Bool("enable_async_reduce") ? 1 : 0;
    const int64_t extra = config.Int("extra_dp_size");
    if (world_ % extra != 0) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "gemini: plugin.gemini.extra_dp_size = " + std::to_string(extra) +
                      " does not divide the world size " + std::to_string(world_) +
                      "; use a divisor of it");
    }
    replicas_ = static_cast<int32_t>(extra);
    shards_ = world_ / replicas_;
    shard_index_ = rank_ % shards_;
    replica_index_ = rank_ / shards_;
    sync_module_states_ = config.Bool("sync_module_states");
    init_tier_ = config.String("chunk_init_device") == "host" ? CAI_MEM_HOST : CAI_MEM_DEVICE;
    verbose_ = config.Bool("verbose");
    scaler_config_ = cai::sdk::LossScalerConfig(config, kName);
  }

  ~Gemini() {
    // Collectives still in flight write into our buffers: finish them before those go.
    for (Chunk& c : chunks_) c.prefetch = cai::sdk::Work();
    reducer_.Discard();
  }

  void Boost(const cai_boost_args& args) {
    if (model_) throw Error(CAI_FAILED_PRECONDITION, "gemini: boost was already called");
    model_ = args.model;
    optimizer_ = args.optimizer;
    accumulation_ = std::max(1, args.grad_accumulation);
    compute_ = cai::sdk::ComputeDtype(args.precision);
    const bool mixed = !SameDtype(compute_, kF32);
    const auto& model = *Host().model;
    groups_ = cai::sdk::ShardGroups(rank_, world_, shards_);
    reducer_ = cai::sdk::ShardReducer(&groups_, reduces_in_flight_, &overlap_);
    PlanChunks();
    if (auto_) {
      // Under a budget the state starts on the host, the parameters too until the first step
      // has shown what the device has room for; without one everything is on the device.
      cai_mem_usage usage{};
      usage.struct_size = CAI_MEM_USAGE_STRUCT_SIZE;
      Check(Host().mempool->usage(CAI_MEM_DEVICE, &usage));
      budget_ = usage.budget_bytes;
      if (budget_ == 0 && margin_ratio_ > 0) {
        throw Error(CAI_INVALID_ARGUMENT,
                    "gemini: gpu_margin_mem_ratio > 0 needs memory.device_budget: without a "
                    "device budget placement_policy = \"auto\" keeps all the optimizer state "
                    "on the device already; set memory.device_budget or remove "
                    "gpu_margin_mem_ratio");
      }
      optim_frac_ = budget_ > 0 ? 1.0 : 0.0;
      param_frac_ = optim_frac_;
      cache_cap_ = budget_ > 0 ? 0 : UINT64_MAX;
      if (budget_ > 0) {
        // The warm-up's device share for parameter copies, the last chunks taking it (the
        // first ones stay on the host, as offload_param_frac places them).
        double copies = 0;
        for (const Chunk& c : chunks_) copies += static_cast<double>(Bytes(c.shard, compute_));
        const double room = (1.0 - warmup_ratio_) * static_cast<double>(budget_);
        param_frac_ = copies > 0 ? std::clamp(1.0 - room / copies, 0.0, 1.0) : 1.0;
      }
    }
    PlaceChunks(mixed);
    if (auto_ && budget_ > 0) {
      int on_device = 0;
      for (const Chunk& c : chunks_) on_device += c.compute == 0 ? 1 : 0;
      std::ostringstream line;
      line << "gemini: auto warm-up: " << on_device << " of " << chunks_.size()
           << " chunks' parameters on the device (warmup_non_model_data_ratio " << warmup_ratio_
           << " of a budget of " << budget_ << " B)";
      cai::sdk::Log(CAI_LOG_INFO, line.str());
    }

    // Banks: the fp32 shards of the chunks of each placement, end to end.
    const cai_mem_tier host_tier = pin_ ? CAI_MEM_PINNED_HOST : CAI_MEM_HOST;
    const cai_mem_tier bank_tiers[kBanks] = {CAI_MEM_DEVICE, host_tier, host_tier};
    for (int b = 0; b < kBanks; ++b) {
      banks_[b].tier = bank_tiers[b];
      AllocBank(b, banks_[b]);
    }
    for (int k = 0; k < 2; ++k) {
      compute_bufs_[k] = Alloc(k == 0 ? CAI_MEM_DEVICE : host_tier, compute_numel_[k], compute_,
                               "gemini.param_compute");
    }

    // Each chunk in turn: its fp32 values assembled (from rank 0 with sync_module_states) and
    // this rank's shard kept; the unsharded model is never whole on a rank.
    for (Chunk& c : chunks_) {
      Buffer flat = Alloc(init_tier_, c.capacity, kF32, "gemini.init");
      for (const Member& m : c.members) {
        cai::sdk::MoveParamInto(model_, m.param, View(flat, kF32, m.offset, &m.numel));
      }
      if (sync_module_states_ && world_ > 1) cai::sdk::Broadcast(View(flat, kF32, 0, &c.capacity));
      Buffer host = Alloc(CAI_MEM_HOST, c.shard, kF32, "gemini.init");
      Check(Host().mempool->copy(host.data(), static_cast<float*>(flat.data()) + Lo(c), host.size(),
                                 nullptr));
      MoveShard(banks_[c.bank].master, c, host.data(), CAI_MEM_INTO_BUFFER);
    }
    if (sync_module_states_) {
      cai::sdk::BroadcastParams(model_, frozen_);
      cai::sdk::BroadcastBuffers(model_);
    }
    if (mixed) Check(model.set_compute_dtype(model_, compute_));
    for (Chunk& c : chunks_) {
      RefreshCompute(c);
      c.released = false;
      ReleaseParams(c, /*force=*/true);
    }
    for (Chunk& c : chunks_) {
      if (c.kept) Gather(c);
    }
    epilogue_.emplace(optimizer_, max_norm_);
    if (args.precision == CAI_PRECISION_FP16) epilogue_->EnableLossScaling(scaler_config_);
    used_.assign(num_members_, 0);
    in_chunk_.assign(num_members_, 0);

    hooks_ = cai::sdk::UnitHooks(model_, &Gemini::OnUnitHook, this);
    LogLayout();
    traffic_ = Traffic();  // per step from here on
  }

  void ForwardBackward(const cai_micro_batch& batch) {
    if (!model_) throw Error(CAI_FAILED_PRECONDITION, "gemini: forward_backward before boost");
    in_backward_ = false;
    backward_ = true;
    // auto's warm-up: the device peak so far (boost included, which is conservative) is
    // read when the first step ends.
    if (auto_ && !warmed_up_) warming_up_ = true;
    BeginOrder();
    for (Chunk& c : chunks_) {
      if (c.root) {
        Gather(c);
        BeginGrads(c);
      }
    }
    cai_status* status = cai::sdk::Guard(
        [&] { cai::sdk::RunMicroBatch(model_, batch, true, epilogue_->loss_scale()); });
    if (status != nullptr) {
      for (Chunk& c : chunks_) {
        if (c.collecting) DropGrads(c);
      }
    }
    Check(status);
    // Chunks whose backward never ended (no gradient reached them), then the root's, in chunk
    // order, which every rank shares.
    for (Chunk& c : chunks_) {
      if (c.collecting) ReduceGrads(c);
      ReleaseParams(c);
    }
    reducer_.Finish();
    if (recording_) {
      recording_ = false;
      recorded_ = true;
    }
    ++micro_batch_;
  }

  void Evaluate(const cai_micro_batch& batch) {
    if (!model_) throw Error(CAI_FAILED_PRECONDITION, "gemini: evaluate before boost");
    in_backward_ = false;
    backward_ = false;
    following_ = false;
    for (Chunk& c : chunks_) {
      if (c.root) Gather(c);
    }
    cai_status* status = cai::sdk::Guard([&] { cai::sdk::RunMicroBatch(model_, batch, false); });
    for (Chunk& c : chunks_) ReleaseParams(c);
    Check(status);
  }

  void Step(cai_step_result& result) {
    if (!model_) throw Error(CAI_FAILED_PRECONDITION, "gemini: step before boost");
    for (Chunk& c : chunks_) {
      if (c.collecting) ReduceGrads(c);
    }
    reducer_.Finish();
    cai::sdk::StepSums sums;
    for (Bank& bank : banks_) {
      const cai_tensor grads = View(bank.grads, kF32, 0, &bank.numel);
      double sq = 0;
      if (replica_index_ == 0) RunKernel(CAI_KERNEL_SUM_SQUARES, nullptr, grads, 0, &sq);
      sums.sum_squares += sq;
      if (epilogue_->loss_scaling()) {
        double finite = 0;
        RunKernel(CAI_KERNEL_ALL_FINITE, nullptr, grads, 0, &finite);
        sums.overflow = sums.overflow || finite != 1.0;
      }
    }
    sums.used.assign(used_.begin(), used_.end());
    const cai::sdk::StepDecision d = epilogue_->Decide(sums, result);
    if (d.skipped) return;
    std::vector<Chunk*> nvme;
    for (Chunk& c : chunks_) {
      if (c.bank == kNvme) {
        nvme.push_back(&c);
        continue;
      }
      ForEachPiece(c, sums.used, [&](cai::sdk::FlatOptimizer::Piece& piece) {
        banks_[c.bank].optim.Update(piece, d.step, d.grad_scale);
      });
    }
    UpdateNvmeChunks(nvme, sums.used, d);
    for (Chunk& c : chunks_) {
      if (!MasterOnNvme(c)) RefreshCompute(c);  // those were, from their staged master
    }
    for (Chunk& c : chunks_) {
      if (c.kept) {
        c.released = true;
        Gather(c);
      }
    }
    micro_batch_ = 0;
    DropCache();  // the gathered copies are of the weights before this update
    if (warming_up_) FinishWarmUp();
  }

  void ZeroGrad() {
    if (!model_) throw Error(CAI_FAILED_PRECONDITION, "gemini: zero_grad before boost");
    micro_batch_ = 0;
    reducer_.Discard();
    for (Chunk& c : chunks_) {
      if (c.collecting) DropGrads(c);
    }
    for (Bank& bank : banks_) {
      RunKernel(CAI_KERNEL_FILL, nullptr, View(bank.grads, kF32, 0, &bank.numel));
    }
    std::fill(used_.begin(), used_.end(), 0);
  }

  void Save(const cai_checkpoint_args& args) {
    if (replica_index_ == 0) {
      for (const Chunk& c : chunks_) {
        if (args.model) SaveChunk(args, c, -1);
        for (size_t k = 0; args.optimizer && k < NumSlots(); ++k) {
          SaveChunk(args, c, static_cast<int>(k));
        }
      }
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
    for (Chunk& c : chunks_) {
      if (args.model) LoadChunk(args, c, -1);
      for (size_t k = 0; args.optimizer && k < NumSlots(); ++k) {
        LoadChunk(args, c, static_cast<int>(k));
      }
    }
    if (args.model) {
      for (uint32_t i : frozen_) {
        cai_tensor data{};
        Check(Host().model->param_data(model_, i, &data));
        Check(Host().checkpoint->read_tensor(args.checkpoint, ("model/" + ParamName(i)).c_str(), 0,
                                             0, &data));
      }
      DropCache();
      for (Chunk& c : chunks_) RefreshCompute(c);
      for (Chunk& c : chunks_) {
        if (c.kept) {
          c.released = true;
          Gather(c);
        }
      }
    }
    if (args.optimizer) epilogue_->Load(args.checkpoint, kName);
  }

  void Stats(cai_strategy_stats& stats) {
    const bool mixed = !SameDtype(compute_, kF32);
    uint64_t master = 0, grads = 0, state = 0;
    for (const Bank& bank : banks_) {
      master += bank.master.size();
      grads += bank.grads.size();
      state += bank.optim.bytes();
      for (const Buffer& b : bank.nvme) state += b.size();
    }
    const uint64_t compute = compute_bufs_[0].size() + compute_bufs_[1].size();
    stats.param_bytes = (mixed ? compute : master) + FrozenBytes();
    stats.grad_bytes = grads;
    stats.optimizer_state_bytes = state;
    stats.master_bytes = mixed ? master : 0;
    stats.overlap_ratio = overlap_.ratio();
    const double steps = std::max<double>(1, epilogue_ ? epilogue_->step() : 1);
    std::ostringstream line;
    auto per_step = [&](double bytes) { return static_cast<uint64_t>(bytes / steps); };
    line << "gemini: tier traffic per step: device->host " << per_step(traffic_.to_host)
         << " B, host->device " << per_step(traffic_.to_device) << " B, NVMe read "
         << per_step(traffic_.nvme_read) << " B, NVMe written " << per_step(traffic_.nvme_written)
         << " B; peak gathered chunk bytes " << gathered_peak_;
    if (auto_) {
      line << "; gathered chunks reused " << cache_hits_ << " times, evicted " << cache_evictions_
           << " times";
    }
    cai::sdk::Log(CAI_LOG_INFO, line.str());
  }

  static void EstimateMemory(const cai_memory_estimate_args& args, cai_memory_estimate& out) {
    const cai::sdk::Config config(args.config);
    const bool have = args.config != nullptr;
    const uint64_t extra = have ? static_cast<uint64_t>(config.Int("extra_dp_size")) : 1;
    const uint64_t n = std::max<uint64_t>(1, static_cast<uint64_t>(args.world_size) / extra);
    const bool auto_policy = have && config.String("placement_policy") == "auto";
    const Fractions f =
        !have || auto_policy
            ? Fractions{}
            : Fractions{config.Float("shard_param_frac"), config.Float("offload_optim_frac"),
                        config.Float("offload_param_frac"), config.Float("nvme_offload_fraction")};
    // The masters of the NVMe chunks leave the host too.
    const bool nvme_masters = have && config.Bool("nvme_offload_masters");
    const uint64_t e = args.precision == CAI_PRECISION_FP32 ? 4 : 2;
    const uint64_t k = args.optimizer_state_slots;
    if (have && cai::sdk::HasLayout(args)) {
      EstimateLayout(args, config, f, auto_policy, nvme_masters, n, e, k, out);
      return;
    }
    const double nvme_master = nvme_masters ? 4.0 : 0.0;
    const auto psi = static_cast<double>(args.num_params);
    const double shard = psi / static_cast<double>(n);
    const auto slots = static_cast<double>(k);
    // A gathered unit's worth of chunks and the one in its reduce-scatter. The static policy
    // writes the gradients over the gathered parameters; auto, and the kept chunks, give them a
    // buffer of their own beside them in backward.
    const double working = (auto_policy ? 3.0 : 2.0) * static_cast<double>(e) *
                           static_cast<double>(args.largest_unit_numel);
    const double kept = (1 - f.shard) * static_cast<double>(e) * psi;
    const double on_host = f.optim * (8 + 4 * slots - (4 * slots + nvme_master) * f.nvme) * shard;
    const double on_device = (1 - f.optim) * (8 + 4 * slots) * shard;
    const double compute_copy =
        (e == 4 ? f.optim : 1.0) * (1 - f.param) * static_cast<double>(e) * shard;
    out.master_bytes = e == 4 ? 0 : static_cast<uint64_t>(4 * shard);
    out.param_bytes = static_cast<uint64_t>(static_cast<double>(e) * shard + kept);
    out.grad_bytes = static_cast<uint64_t>(4 * shard + working);
    out.optimizer_state_bytes = static_cast<uint64_t>(4 * slots * shard);
    out.device_bytes = static_cast<uint64_t>(on_device + compute_copy + 2 * kept + working);
    out.host_bytes = static_cast<uint64_t>(on_host + f.param * static_cast<double>(e) * shard);
    out.formula =
        "device (1-f_optim)(8+4k)Ψ/G + compute copy eΨ/G of the chunks not on the host + "
        "(1-f_shard)eΨ kept gathered and as much for their gradient + 2e·unit gathered (3e·unit "
        "under auto, whose gradients have a buffer of their own); host f_optim(8 + 4k - (4k + "
        "m)f_nvme)Ψ/G (+ f_param·eΨ/G); NVMe f_optim·f_nvme·(4k + m)Ψ/G (m = 4 with "
        "nvme_offload_masters) (G = world / extra_dp_size, f = the placement fractions; no "
        "chunk layout: the model's parameters are not known before it is built)";
  }

 private:
  // The estimate from the model's layout: its chunks as boost will cut and place them, each
  // chunk's state on its tier, and the peak of what the schedule gathers (Schedule).
  static void EstimateLayout(const cai_memory_estimate_args& args, const cai::sdk::Config& config,
                             const Fractions& f, bool auto_policy, bool nvme_masters, uint64_t g,
                             uint64_t e, uint64_t k, cai_memory_estimate& out) {
    const auto shards = static_cast<int64_t>(g);
    const ChunkLayout layout(
        std::vector<int64_t>(args.param_numel, args.param_numel + args.num_layout_params),
        cai::sdk::LayoutBlocks(args), std::vector<bool>(args.num_layout_params, true),
        args.num_layout_units, shards, ChunkSizing::From(config));
    const std::vector<Placement> placed = Place(layout.packing.capacity, f, shards, e != 4);
    // Beside the banks, the host holds at its peak the larger of two transients: boost's, which
    // assembles each chunk in turn on chunk_init_device and copies this rank's fp32 shard out
    // of it through the host; and the step's two NVMe staging buffers, each a piece of at most
    // nvme_stream_elements of an NVMe chunk's shard for every slot it streams.
    const bool init_on_host = config.String("chunk_init_device") == "host";
    uint64_t device = 0, host = 0, shard_sum = 0, kept = 0, boost_host = 0, nvme_piece = 0;
    for (size_t c = 0; c < placed.size(); ++c) {
      const auto capacity = static_cast<uint64_t>(layout.packing.capacity[c]);
      const uint64_t s = capacity / g;
      shard_sum += s;
      boost_host = std::max(boost_host, 4 * s + (init_on_host ? 4 * capacity : 0));
      if (placed[c].bank == kNvme) nvme_piece = std::max(nvme_piece, s);
      if (placed[c].kept) kept += e * capacity;
      // fp32 master, gradient and k slots; NVMe takes the slots (and the master with
      // nvme_offload_masters) off the host.
      const uint64_t state = (8 + 4 * k) * s;
      if (placed[c].bank == kDevice) {
        device += state;
      } else if (placed[c].bank == kHost) {
        host += state;
      } else {
        host += (nvme_masters ? 4 : 8) * s;
      }
      if (placed[c].compute == 0) device += e * s;
      if (placed[c].compute == 1) host += e * s;
    }
    Schedule schedule{layout, placed};
    schedule.element = e;
    schedule.shards = shards;
    schedule.max_prefetch = static_cast<size_t>(config.Int("max_prefetch"));
    schedule.in_flight = config.Bool("enable_async_reduce") ? 1 : 0;
    schedule.cache_all = auto_policy;
    schedule.init_on_device = !init_on_host;
    const uint64_t transient = schedule.Peak();
    out.master_bytes = e == 4 ? 0 : 4 * shard_sum;
    out.param_bytes = e * shard_sum + kept;
    out.grad_bytes = 4 * shard_sum + (transient > kept ? transient - kept : 0);
    out.optimizer_state_bytes = 4 * k * shard_sum;
    out.device_bytes = device + transient;
    nvme_piece = std::min(nvme_piece, static_cast<uint64_t>(config.Int("nvme_stream_elements")));
    const uint64_t nvme_stages = 2 * 4 * nvme_piece * (k + (nvme_masters ? 1 : 0));
    out.host_bytes = host + std::max(boost_host, nvme_stages);
    out.formula =
        "this model's chunks as boost cuts and places them: each chunk's fp32 master, gradient "
        "and k optimizer slots (8+4k)·C/G on its tier (NVMe takes the slots, and the master "
        "with nvme_offload_masters) and its compute copy e·C/G where placed, plus the device's "
        "peak of gathered chunks, gradient buffers and reduce-scatter buffers over boost, two "
        "micro-batches (max_prefetch ahead) and a checkpoint (auto: every chunk stays "
        "gathered, as without a device budget); on the host, beside its banks, the larger of "
        "boost's fp32 copy of the largest chunk's shard (4·C/G, and the chunk 4·C with "
        "chunk_init_device = host) and the NVMe update's two staging pieces (2·4·min(C/G, "
        "nvme_stream_elements)·(k + 1 with nvme_offload_masters))";
  }

 private:
  struct Member {
    uint32_t param;
    uint32_t group;
    int64_t numel;
    int64_t offset;  // elements into the chunk
    int32_t index;   // among all trainable parameters (the step's used flags)
  };
  struct Chunk {
    std::vector<Member> members;
    int64_t numel = 0;     // elements its parameters take
    int64_t capacity = 0;  // C_c, a multiple of G
    int64_t shard = 0;     // C_c / G
    bool root = false;     // gathered for the whole micro-batch
    bool kept = false;     // never released (shard_param_frac)
    int bank = kDevice;    // where its fp32 shards live
    int64_t base = 0;      // elements into its bank
    int compute = -1;      // compute-dtype shard: -1 none (the fp32 master is it), 0 device, 1 host
    int64_t cbase = 0;     // elements into compute_bufs_[compute]
    int32_t first_unit = -1, last_unit = -1;  // model units holding its parameters
    Buffer gathered;                          // capacity compute-dtype elements while gathered
    Buffer staging;  // the device copy of a host-held compute shard, while gathering
    Buffer grads;    // capacity compute-dtype elements while backward accumulates (not in place)
    bool collecting = false;  // backward's gradients go to it (BeginGrads until ReduceGrads)
    bool released = true;
    bool cached = false;  // auto: gathered and unused, kept for its next use
    cai::sdk::Work prefetch;
  };
  struct Bank {
    cai_mem_tier tier = CAI_MEM_DEVICE;
    int64_t numel = 0;
    Buffer master, grads;
    cai::sdk::FlatOptimizer optim;  // kDevice, kHost
    std::vector<Buffer> nvme;       // kNvme: one unmapped buffer per state slot
    cai_device device{CAI_DEVICE_CPU, 0};
  };
  struct Traffic {
    double to_host = 0, to_device = 0, nvme_read = 0, nvme_written = 0;
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
  size_t NumSlots() const { return cai::sdk::MaxStateSlots(optimizer_); }
  int64_t Lo(const Chunk& c) const { return shard_index_ * c.shard; }
  float* MasterPtr(const Chunk& c) const {
    return static_cast<float*>(banks_[c.bank].master.data()) + c.base;
  }
  float* GradPtr(const Chunk& c) const {
    return static_cast<float*>(banks_[c.bank].grads.data()) + c.base;
  }
  // Moves elements [from, from + count) (count -1: to the end) of chunk c's shard of fp32
  // bank buffer `b` (unmapped NVMe, or any tier) into or out of host memory `host`.
  void MoveShard(const Buffer& b, const Chunk& c, void* host, cai_mem_direction direction,
                 int64_t from = 0, int64_t count = -1) {
    if (count < 0) count = c.shard - from;
    if (b.data() == nullptr) {  // unmapped
      cai::sdk::Transfer::Start(b, Bytes(c.base + from, kF32), host, Bytes(count, kF32), direction,
                                false);
      return;
    }
    float* at = static_cast<float*>(b.data()) + c.base + from;
    Check(direction == CAI_MEM_INTO_BUFFER
              ? Host().mempool->copy(at, host, Bytes(count, kF32), nullptr)
              : Host().mempool->copy(host, at, Bytes(count, kF32), nullptr));
  }
  bool MasterOnNvme(const Chunk& c) const { return c.bank == kNvme && nvme_masters_; }

  // The chunk size (given or searched) and every trainable parameter's chunk: the root
  // parameters first, then the blocks' in unit order.
  void PlanChunks() {
    const auto& model = *Host().model;
    const uint32_t num_params = model.num_params(model_);
    const uint32_t num_units = model.num_units(model_);
    std::vector<int32_t> block_of(num_params, -1);
    for (uint32_t u = 0; u < num_units; ++u) {
      cai_unit_info info{};
      info.struct_size = CAI_UNIT_INFO_STRUCT_SIZE;
      Check(model.unit_info(model_, u, &info));
      if (info.kind != CAI_UNIT_BLOCK) continue;
      for (uint32_t k = 0; k < info.num_params; ++k) {
        block_of[info.params[k]] = static_cast<int32_t>(u);
      }
    }
    std::vector<int64_t> numel(num_params);
    std::vector<bool> trainable(num_params);
    for (uint32_t i = 0; i < num_params; ++i) {
      const cai_param_info info = ParamInfo(i);
      if (!SameDtype(info.dtype, kF32) && info.tied_to < 0) {
        throw Error(CAI_FAILED_PRECONDITION,
                    std::string("gemini: parameter '") + info.name +
                        "' is not fp32 at boost; gemini keeps fp32 chunks and casts to "
                        "train.precision itself, so save the model in fp32");
      }
      numel[i] = info.numel;
      trainable[i] = info.tied_to < 0 && (info.flags & CAI_PARAM_REQUIRES_GRAD);
      if (info.tied_to < 0 && !trainable[i]) frozen_.push_back(i);
    }
    const ChunkLayout layout(numel, block_of, trainable, num_units, shards_, sizing_);
    if (layout.order.empty()) {
      throw Error(CAI_FAILED_PRECONDITION,
                  "gemini: the model has no trainable parameters; unfreeze some (model.freeze)");
    }
    for (int64_t n : layout.sizes) psi_ += n;
    chunk_capacity_ = layout.capacity;
    const Packing& packing = layout.packing;
    chunks_.resize(packing.capacity.size());
    for (size_t k = 0; k < chunks_.size(); ++k) {
      chunks_[k].capacity = packing.capacity[k];
      chunks_[k].shard = packing.capacity[k] / shards_;
      chunks_[k].root = layout.spans[k].root;
      chunks_[k].first_unit = layout.spans[k].first_unit;
      chunks_[k].last_unit = layout.spans[k].last_unit;
    }
    chunks_of_unit_ = layout.chunks_of_unit;
    member_of_param_.assign(num_params, -1);
    chunk_of_member_.clear();
    for (size_t j = 0; j < layout.order.size(); ++j) {
      const uint32_t param = layout.order[j];
      Chunk& chunk = chunks_[packing.chunk_of[j]];
      member_of_param_[param] = static_cast<int32_t>(num_members_);
      chunk_of_member_.push_back(static_cast<int32_t>(packing.chunk_of[j]));
      chunk.members.push_back({param, ParamInfo(param).group, layout.sizes[j], chunk.numel,
                               static_cast<int32_t>(num_members_)});
      ++num_members_;
      chunk.numel += layout.sizes[j];
    }
    waste_ = packing.waste;
  }

  // Tiers, by the static policy's fractions of the chunks' capacity, first chunks first.
  void PlaceChunks(bool mixed) {
    std::vector<int64_t> capacity;
    for (const Chunk& c : chunks_) capacity.push_back(c.capacity);
    const std::vector<Placement> placed =
        Place(capacity, {shard_frac_, optim_frac_, param_frac_, nvme_frac_}, shards_, mixed);
    for (size_t k = 0; k < chunks_.size(); ++k) {
      Chunk& c = chunks_[k];
      c.kept = placed[k].kept;
      c.bank = placed[k].bank;
      c.compute = placed[k].compute;
      c.base = banks_[c.bank].numel;
      banks_[c.bank].numel += c.shard;
      if (c.compute >= 0) {
        c.cbase = compute_numel_[c.compute];
        compute_numel_[c.compute] += c.shard;
      }
    }
  }

  void LogLayout() const {
    std::ostringstream line;
    int counts[kBanks] = {0, 0, 0};
    int kept = 0, root = 0;
    for (const Chunk& c : chunks_) {
      ++counts[c.bank];
      kept += c.kept ? 1 : 0;
      root += c.root ? 1 : 0;
    }
    line << "gemini: " << chunks_.size() << " chunks of " << chunk_capacity_ << " elements ("
         << Name(compute_) << " compute, " << shards_ << " shards x " << replicas_ << " replicas), "
         << psi_ << " trainable elements, " << waste_ << " of padding; state on device "
         << counts[kDevice] << ", host " << counts[kHost] << ", NVMe " << counts[kNvme]
         << (nvme_masters_ ? " (masters too)" : "") << " chunks; " << kept << " kept gathered; "
         << root << " root; chunk sizes:";
    for (const Chunk& c : chunks_) line << " " << c.capacity;
    cai::sdk::Log(CAI_LOG_INFO, line.str());
    if (!verbose_) return;
    for (size_t k = 0; k < chunks_.size(); ++k) {
      const Chunk& c = chunks_[k];
      std::ostringstream detail;
      detail << "gemini: chunk " << k << ": " << c.numel << "/" << c.capacity << " elements, "
             << (c.root ? "root, " : "") << (c.kept ? "kept gathered, " : "sharded, ")
             << (c.bank == kDevice ? "device"
                 : c.bank == kHost ? "host"
                                   : "host+NVMe")
             << " state, parameters:";
      for (const Member& m : c.members) detail << " " << ParamName(m.param);
      cai::sdk::Log(CAI_LOG_INFO, detail.str());
    }
  }

  // Calls fn(piece) for every used parameter's part of this rank's shard of chunk c.
  template <class F>
  void ForEachPiece(const Chunk& c, const std::vector<double>& used, F&& fn) const {
    const int64_t lo = Lo(c), hi = lo + c.shard;
    for (const Member& m : c.members) {
      if (used[m.index] == 0) continue;
      const int64_t a = std::max(lo, m.offset), b = std::min(hi, m.offset + m.numel);
      if (a >= b) continue;
      cai::sdk::FlatOptimizer::Piece piece;
      piece.group = m.group;
      piece.offset = static_cast<size_t>(c.base + (a - lo));
      piece.count = static_cast<size_t>(b - a);
      // An unmapped (NVMe) master has no address: the update stages it and sets `param`.
      piece.param = MasterOnNvme(c) ? nullptr : MasterPtr(c) + (a - lo);
      piece.grad = GradPtr(c) + (a - lo);
      fn(piece);
    }
  }

  // The NVMe chunks' update, streamed in pieces of at most nvme_stream_elements of a chunk's
  // shard: each piece's state slots (and with nvme_offload_masters its master) read into one
  // of two host staging buffers, the next piece's read queued behind this one's write on the
  // copy thread while this one updates. RAM holds two pieces, whatever the chunk size.
  void UpdateNvmeChunks(const std::vector<Chunk*>& chunks, const std::vector<double>& used,
                        const cai::sdk::StepDecision& d) {
    struct Stream {
      Chunk* c;
      int64_t from, count;  // elements of the chunk's shard
    };
    std::vector<Stream> streams;
    for (Chunk* c : chunks) {
      for (int64_t from = 0; from < c->shard; from += stream_elements_) {
        streams.push_back({c, from, std::min(stream_elements_, c->shard - from)});
      }
    }
    if (streams.empty()) return;
    Bank& bank = banks_[kNvme];
    std::vector<const Buffer*> segments;  // staged: slot 0, slot 1, ..., the master
    for (const Buffer& b : bank.nvme) segments.push_back(&b);
    if (nvme_masters_) segments.push_back(&bank.master);
    int64_t most = 0;
    for (const Stream& st : streams) most = std::max(most, st.count);
    const auto per_stage = most * static_cast<int64_t>(std::max<size_t>(segments.size(), 1));
    std::array<Buffer, 2> stage;
    for (Buffer& b : stage) b = Alloc(bank.tier, per_stage, kF32, "gemini.nvme_stage");
    auto staged = [&](int s, size_t segment) {
      return static_cast<float*>(stage[s].data()) + segment * static_cast<size_t>(most);
    };
    std::array<std::vector<cai::sdk::Transfer>, 2> io;
    auto submit = [&](const Stream& st, int s, cai_mem_direction dir) {
      io[s].clear();
      for (size_t k = 0; k < segments.size(); ++k) {
        io[s].push_back(cai::sdk::Transfer::Start(*segments[k], Bytes(st.c->base + st.from, kF32),
                                                  staged(s, k), Bytes(st.count, kF32), dir, true));
        (dir == CAI_MEM_OUT_OF_BUFFER ? traffic_.nvme_read : traffic_.nvme_written) +=
            static_cast<double>(Bytes(st.count, kF32));
      }
    };
    auto wait = [&](int s) {
      for (cai::sdk::Transfer& t : io[s]) t.Wait();
      io[s].clear();
    };
    submit(streams[0], 0, CAI_MEM_OUT_OF_BUFFER);
    for (size_t i = 0; i < streams.size(); ++i) {
      const int s = static_cast<int>(i % 2);
      wait(s);
      if (i + 1 < streams.size()) {
        wait(1 - s);  // the previous piece's write-back out of the other stage
        submit(streams[i + 1], 1 - s, CAI_MEM_OUT_OF_BUFFER);
      }
      const Stream& st = streams[i];
      Chunk& c = *st.c;
      const auto lo = static_cast<size_t>(c.base + st.from);  // bank elements of this piece
      const size_t hi = lo + static_cast<size_t>(st.count);
      ForEachPiece(c, used, [&](cai::sdk::FlatOptimizer::Piece& piece) {
        const size_t a = std::max(lo, piece.offset), b = std::min(hi, piece.offset + piece.count);
        if (a >= b) return;
        if (piece.param != nullptr) piece.param += a - piece.offset;
        piece.grad = static_cast<const float*>(piece.grad) + (a - piece.offset);
        piece.offset = a;
        piece.count = b - a;
        float* states[4] = {};
        for (size_t k = 0; k < bank.nvme.size(); ++k) states[k] = staged(s, k) + (a - lo);
        if (nvme_masters_) piece.param = staged(s, bank.nvme.size()) + (a - lo);
        cai::sdk::FlatOptimizer::Update(optimizer_, bank.device, piece, states, d.step,
                                        d.grad_scale);
      });
      if (nvme_masters_) {
        const cai_tensor master =
            View(stage[s], kF32, most * static_cast<int64_t>(bank.nvme.size()), &st.count);
        RefreshCompute(c, st.from, &st.count, &master);
      }
      submit(st, s, CAI_MEM_INTO_BUFFER);
    }
    wait(0);
    wait(1);
  }

  // The compute-dtype copy of elements [from, from + *count) of chunk c's shard (all of it
  // without `count`) from its fp32 master (a host-held master is cast on the host and copied
  // over once, one transfer on an accelerator). `staged`: those elements of the master in
  // host memory, where the bank's is unmapped (NVMe).
  void RefreshCompute(Chunk& c, int64_t from = 0, const int64_t* count = nullptr,
                      const cai_tensor* staged = nullptr) {
    if (c.compute < 0) return;
    if (count == nullptr) count = &c.shard;
    const int64_t n = *count;
    Buffer fetched;
    if (staged == nullptr && MasterOnNvme(c)) {
      fetched = Alloc(CAI_MEM_HOST, n, kF32, "gemini.nvme_stage");
      MoveShard(banks_[c.bank].master, c, fetched.data(), CAI_MEM_OUT_OF_BUFFER, from, n);
    }
    const cai_tensor master = staged ? *staged
                              : fetched.get()
                                  ? View(fetched, kF32, 0, count)
                                  : View(banks_[c.bank].master, kF32, c.base + from, count);
    const Buffer& target = compute_bufs_[c.compute];
    const cai_tensor out = View(target, compute_, c.cbase + from, count);
    if (c.compute == 1 || c.bank == kDevice) {  // same tier
      RunKernel(CAI_KERNEL_COPY, &master, out);
      return;
    }
    void* dst = static_cast<char*>(target.data()) + Bytes(c.cbase + from, compute_);
    if (SameDtype(compute_, kF32)) {
      Check(Host().mempool->copy(dst, master.data, Bytes(n, kF32), nullptr));
    } else {
      Buffer host = Alloc(banks_[c.bank].tier, n, compute_, "gemini.offload_param");
      RunKernel(CAI_KERNEL_COPY, &master, View(host, compute_, 0, count));
      Check(Host().mempool->copy(dst, host.data(), Bytes(n, compute_), nullptr));
    }
    traffic_.to_device += static_cast<double>(Bytes(n, compute_));
  }

  // The all-gather's input: chunk c's shard in the compute dtype, on the device.
  cai_tensor ShardSource(Chunk& c) {
    if (c.compute < 0) return View(banks_[c.bank].master, kF32, c.base, &c.shard);
    if (c.compute == 0) return View(compute_bufs_[0], compute_, c.cbase, &c.shard);
    c.staging = Alloc(CAI_MEM_DEVICE, c.shard, compute_, "gemini.param_staging");
    Check(Host().mempool->copy(
        c.staging.data(), static_cast<char*>(compute_bufs_[1].data()) + Bytes(c.cbase, compute_),
        Bytes(c.shard, compute_), nullptr));
    traffic_.to_device += static_cast<double>(Bytes(c.shard, compute_));
    return View(c.staging, compute_, 0, &c.shard);
  }

  cai::sdk::Work StartGather(Chunk& c, bool async) {
    if (!c.gathered.get()) {
      c.gathered = Alloc(CAI_MEM_DEVICE, c.capacity, compute_, "gemini.chunk");
      gathered_bytes_ += c.gathered.size();
      gathered_peak_ = std::max(gathered_peak_, gathered_bytes_);
    }
    const cai_tensor in = ShardSource(c);
    const cai_tensor out = View(c.gathered, compute_, 0, &c.capacity);
    if (shards_ == 1) {
      RunKernel(CAI_KERNEL_COPY, &in, out);
      c.staging = Buffer();
      return {};
    }
    cai::sdk::Work work =
        RunCollective(CAI_COMM_ALL_GATHER, &in, out, async, CAI_REDUCE_SUM, groups_.shard());
    if (!async) c.staging = Buffer();
    return work;
  }

  // Gathers chunk c (waiting for its prefetch, if one runs) into its parameters' storage, and
  // with prefetch on, starts the next chunks' all-gathers along the recorded order.
  void Gather(Chunk& c) {
    const auto index = static_cast<int32_t>(&c - chunks_.data());
    if (c.cached) {  // kept since its last use: a gather the recorded order counts
      c.cached = false;
      cache_bytes_ -= c.gathered.size();
      ++cache_hits_;
      FollowOrder(index);
      return;
    }
    if (!c.released) return;
    if (c.prefetch.valid()) {
      c.prefetch.Wait();
      c.prefetch = cai::sdk::Work();
      c.staging = Buffer();
    } else {
      StartGather(c, false);
    }
    for (const Member& m : c.members) {
      cai_tensor view = View(c.gathered, compute_, m.offset, &m.numel);
      Check(Host().model->replace_param_storage(model_, m.param, &view));
    }
    c.released = false;
    if (c.root || c.kept) return;
    FollowOrder(index);
  }

  // A gather of chunk `index` (or a hit in the cache of gathered chunks): recorded in the
  // first micro-batch; later, the position in the recorded order moves on and the next
  // max_prefetch chunks' all-gathers start.
  void FollowOrder(int32_t index) {
    if (!Ordering()) return;
    if (recording_) {
      order_.push_back(index);
      return;
    }
    if (!following_) return;
    if (cursor_ >= order_.size() || order_[cursor_] != index) {
      following_ = false;  // this micro-batch left the recorded order: no more guessing
      return;
    }
    ++cursor_;
    for (size_t j = cursor_; j < std::min(order_.size(), cursor_ + max_prefetch_); ++j) {
      Chunk& next = chunks_[order_[j]];
      if (next.released && !next.prefetch.valid()) next.prefetch = StartGather(next, true);
    }
  }
  bool Ordering() const { return max_prefetch_ > 0 || auto_; }

  // How far ahead chunk `index` is next gathered in the recorded order (one micro-batch's),
  // from the current position and on into the step's next micro-batch if one follows;
  // SIZE_MAX when not again before the step (or when the order is not being followed).
  size_t NextUse(int32_t index) const {
    if (!following_) return SIZE_MAX;
    for (size_t j = cursor_; j < order_.size(); ++j) {
      if (order_[j] == index) return j - cursor_;
    }
    if (micro_batch_ + 1 >= accumulation_) return SIZE_MAX;
    for (size_t j = 0; j < cursor_; ++j) {
      if (order_[j] == index) return order_.size() - cursor_ + j;
    }
    return SIZE_MAX;
  }

  // Keeps chunk c gathered instead of releasing it, if the cache has room or can make it by
  // evicting chunks needed later than c (Belady's rule); returns whether it did. Every rank
  // decides alike: the same chunks, the same order, the same agreed capacity.
  bool Cache(Chunk& c) {
    if (cache_cap_ == 0 || c.root || c.kept || c.released || !c.gathered.get()) return false;
    const uint64_t size = c.gathered.size();
    if (size > cache_cap_) return false;
    const size_t mine = NextUse(static_cast<int32_t>(&c - chunks_.data()));
    if (following_ && mine == SIZE_MAX) return false;  // not gathered again before the step
    while (cache_bytes_ + size > cache_cap_) {
      if (!following_) return false;  // no order to choose a victim by
      Chunk* victim = nullptr;
      size_t furthest = 0;
      for (Chunk& other : chunks_) {
        if (!other.cached) continue;
        const size_t next = NextUse(static_cast<int32_t>(&other - chunks_.data()));
        if (!victim || next > furthest) {
          victim = &other;
          furthest = next;
        }
      }
      if (victim == nullptr || furthest <= mine) return false;
      Evict(*victim);
      ++cache_evictions_;
    }
    c.cached = true;
    cache_bytes_ += size;
    return true;
  }

  void Evict(Chunk& c) {
    c.cached = false;
    cache_bytes_ -= c.gathered.size();
    ReleaseParams(c, /*force=*/false, /*may_cache=*/false);
  }

  void DropCache() {
    for (Chunk& c : chunks_) {
      if (c.cached) Evict(c);
    }
  }

  // auto, after the first step: the ranks agree on the most any of them had on the device
  // (pool and LibTorch) in it; gpu_margin_mem_ratio of the margin above that takes chunks'
  // fp32 state onto the device; the room below steady_cuda_cap_ratio of the budget (less that
  // state and what max_prefetch gathers ahead) takes chunks' parameter copies onto the device,
  // first chunks first, and what is left becomes the cache of gathered chunks.
  void FinishWarmUp() {
    warming_up_ = false;
    warmed_up_ = true;
    if (budget_ == 0) return;
    cai_mem_usage usage{};
    usage.struct_size = CAI_MEM_USAGE_STRUCT_SIZE;
    Check(Host().mempool->usage(CAI_MEM_DEVICE, &usage));
    std::vector<double> peak = {static_cast<double>(usage.total_peak_bytes)};
    cai::sdk::AllReduceValues(peak, nullptr, CAI_REDUCE_MAX);
    uint64_t largest = 0;
    for (const Chunk& c : chunks_)
      largest = std::max<uint64_t>(largest, Bytes(c.capacity, compute_));
    double room = cap_ratio_ * static_cast<double>(budget_) - peak[0] -
                  static_cast<double>(max_prefetch_ * largest);
    // Whole chunks' state (master, gradient and every slot, fp32) to the device while it fits.
    // A chunk whose state moves has its update write the compute copy from the device master:
    // in fp32 that master is the copy, and a 16-bit copy held on the host moves with it.
    const bool fp32 = SameDtype(compute_, kF32);
    double margin = margin_ratio_ * (static_cast<double>(budget_) - peak[0]);
    std::vector<bool> state_to_device(chunks_.size(), false);
    uint64_t state_moved = 0;
    int states = 0;
    for (size_t k = 0; k < chunks_.size(); ++k) {
      const Chunk& c = chunks_[k];
      const auto copy = static_cast<double>(Bytes(c.shard, compute_));
      const double bytes = static_cast<double>(Bytes(c.shard, kF32) * (2 + NumSlots())) +
                           (!fp32 && c.compute == 1 ? copy : 0.0);
      if (c.bank != kHost || margin < bytes) continue;
      state_to_device[k] = true;
      margin -= bytes;
      room -= bytes;
      if (fp32 && c.compute == 0) room += copy;  // the device copy it had goes
      state_moved += static_cast<uint64_t>(bytes);
      ++states;
    }
    if (states > 0) MoveStatesToDevice(state_to_device);
    // Parameter copies to the device, chunk by chunk while they fit.
    std::vector<int> target(chunks_.size());
    uint64_t promoted = 0;
    int moved = 0;
    for (size_t k = 0; k < chunks_.size(); ++k) {
      const Chunk& c = chunks_[k];
      target[k] = !state_to_device[k] ? c.compute : fp32 ? -1 : 0;
      const auto bytes = static_cast<double>(Bytes(c.shard, compute_));
      if (target[k] == 1 && room >= bytes) {
        target[k] = 0;
        room -= bytes;
        promoted += static_cast<uint64_t>(bytes);
        ++moved;
      }
    }
    if (moved > 0 || states > 0) MoveComputeCopies(target);
    cache_cap_ = room > 0 ? static_cast<uint64_t>(room) : 0;
    std::ostringstream line;
    line << "gemini: auto placement after the first step: device peak "
         << static_cast<uint64_t>(peak[0]) << " B of a budget of " << budget_ << " B; " << states
         << " of " << chunks_.size() << " chunks' fp32 master, gradient and optimizer state ("
         << state_moved
         << " B, with any 16-bit copy on the host) moved to the device (gpu_margin_mem_ratio "
         << margin_ratio_ << "); " << moved << " of " << chunks_.size() << " chunks' parameters ("
         << promoted << " B) moved to the device; " << cache_cap_
         << " B keep gathered chunks for reuse";
    cai::sdk::Log(CAI_LOG_INFO, line.str());
  }

  // Bank b's buffers for bank.numel elements on bank.tier: fp32 master and gradient shards and
  // the optimizer's state slots (the NVMe bank's slots, and with nvme_offload_masters its
  // master, unmapped on NVMe).
  void AllocBank(int b, Bank& bank) const {
    static constexpr const char* kTags[kBanks] = {"gemini.device", "gemini.host", "gemini.host"};
    auto nvme = [&] {
      return Buffer::Alloc(CAI_MEM_NVME, Bytes(bank.numel, kF32), "gemini.nvme",
                           /*zero_fill=*/false, CAI_MEM_ALLOC_UNMAPPED);
    };
    bank.master = b == kNvme && nvme_masters_ && bank.numel > 0
                      ? nvme()
                      : Alloc(bank.tier, bank.numel, kF32, kTags[b]);
    bank.grads = Alloc(bank.tier, bank.numel, kF32, kTags[b]);
    bank.device = View(bank.grads, kF32, 0, &bank.numel).device;
    if (b != kNvme) {
      bank.optim =
          cai::sdk::FlatOptimizer(optimizer_, static_cast<size_t>(bank.numel), bank.tier, kTags[b]);
    } else if (bank.numel > 0) {
      for (uint32_t k = 0; k < cai::sdk::MaxStateSlots(optimizer_); ++k)
        bank.nvme.push_back(nvme());
    }
  }

  // Re-lays the device and host banks with the state of the chunks `to_device` marks (all in
  // the host bank) moved to the device bank: fp32 master, gradient and every optimizer slot.
  void MoveStatesToDevice(const std::vector<bool>& to_device) {
    std::array<int64_t, 2> numel{0, 0};  // kDevice, kHost
    std::vector<int64_t> base(chunks_.size(), 0);
    for (size_t k = 0; k < chunks_.size(); ++k) {
      const Chunk& c = chunks_[k];
      if (c.bank == kNvme) continue;
      const int b = to_device[k] ? kDevice : c.bank;
      base[k] = numel[b];
      numel[b] += c.shard;
    }
    std::array<Bank, 2> fresh;
    for (int b = 0; b < 2; ++b) {
      fresh[b].tier = banks_[b].tier;
      fresh[b].numel = numel[b];
      AllocBank(b, fresh[b]);
    }
    auto copy = [&](const Buffer& to, int64_t to_base, const Buffer& from, int64_t from_base,
                    int64_t n) {
      Check(Host().mempool->copy(static_cast<float*>(to.data()) + to_base,
                                 static_cast<const float*>(from.data()) + from_base, Bytes(n, kF32),
                                 nullptr));
    };
    for (size_t k = 0; k < chunks_.size(); ++k) {
      Chunk& c = chunks_[k];
      if (c.bank == kNvme) continue;
      const Bank& from = banks_[c.bank];
      const int b = to_device[k] ? kDevice : c.bank;
      Bank& to = fresh[b];
      copy(to.master, base[k], from.master, c.base, c.shard);
      copy(to.grads, base[k], from.grads, c.base, c.shard);
      for (size_t slot = 0; slot < NumSlots(); ++slot) {
        copy(to.optim.state(slot), base[k], from.optim.state(slot), c.base, c.shard);
      }
      if (to_device[k])
        traffic_.to_device += static_cast<double>(Bytes(c.shard, kF32) * (2 + NumSlots()));
      c.bank = b;
      c.base = base[k];
    }
    for (int b = 0; b < 2; ++b) banks_[b] = std::move(fresh[b]);
  }

  // Re-lays the compute-dtype copies with chunk k's in compute_bufs_[target[k]] (-1: none, for
  // an fp32 chunk whose master is on the device).
  void MoveComputeCopies(const std::vector<int>& target) {
    std::array<int64_t, 2> numel{0, 0};
    std::vector<int64_t> cbase(chunks_.size(), 0);
    for (size_t k = 0; k < chunks_.size(); ++k) {
      if (target[k] < 0) continue;
      cbase[k] = numel[target[k]];
      numel[target[k]] += chunks_[k].shard;
    }
    const cai_mem_tier host_tier = pin_ ? CAI_MEM_PINNED_HOST : CAI_MEM_HOST;
    std::array<Buffer, 2> fresh;
    for (int t = 0; t < 2; ++t) {
      fresh[t] =
          Alloc(t == 0 ? CAI_MEM_DEVICE : host_tier, numel[t], compute_, "gemini.param_compute");
    }
    for (size_t k = 0; k < chunks_.size(); ++k) {
      Chunk& c = chunks_[k];
      if (c.compute < 0) continue;
      if (target[k] < 0) {  // fp32 with its master on the device: that is the copy
        c.compute = -1;
        continue;
      }
      Check(Host().mempool->copy(
          static_cast<char*>(fresh[target[k]].data()) + Bytes(cbase[k], compute_),
          static_cast<char*>(compute_bufs_[c.compute].data()) + Bytes(c.cbase, compute_),
          Bytes(c.shard, compute_), nullptr));
      c.compute = target[k];
      c.cbase = cbase[k];
    }
    compute_bufs_ = std::move(fresh);
    compute_numel_ = numel;
  }

  // The recorded gather order is taken from the first training micro-batch; later ones follow
  // it from the start.
  void BeginOrder() {
    cursor_ = 0;
    if (!Ordering()) return;
    if (!recorded_ && !recording_) {
      recording_ = true;
      order_.clear();
    }
    following_ = recorded_;
  }

  // Releases chunk c's parameters (never a kept chunk's unless `force`) and its gathered
  // memory, unless (auto, `may_cache`) the cache of gathered chunks keeps it.
  void ReleaseParams(Chunk& c, bool force = false, bool may_cache = true) {
    if (c.prefetch.valid()) {
      c.prefetch.Wait();
      c.prefetch = cai::sdk::Work();
      c.staging = Buffer();
    }
    if (c.kept && !force) return;
    if (c.cached) return;
    if (!force && may_cache && Cache(c)) return;
    Ungather(c);
  }

  // Releases chunk c's parameters' storage and hands over its gathered memory.
  Buffer Ungather(Chunk& c) {
    if (!c.released) {
      for (const Member& m : c.members) {
        Check(Host().model->release_param_storage(model_, m.param));
      }
      c.released = true;
    }
    if (c.gathered.get()) gathered_bytes_ -= c.gathered.size();
    return std::move(c.gathered);
  }

  // Whether backward writes chunk c's gradients over its gathered parameters, as ColossalAI's
  // chunks do: GRAD_READY fires once a parameter's gradient holds every use, after which its
  // value is not read again in this backward, so the gradient takes its place and the chunk is
  // reduce-scattered from there, with no second chunk-sized buffer. Not for a kept chunk,
  // whose gathered parameters serve the next micro-batch too, nor under auto, whose cache
  // keeps gathered chunks for their next use.
  bool GradsInPlace(const Chunk& c) const { return !c.kept && !auto_; }

  void BeginGrads(Chunk& c) {
    if (c.collecting) return;
    c.collecting = true;
    if (GradsInPlace(c)) {
      for (const Member& m : c.members) in_chunk_[m.index] = 0;
      return;
    }
    c.grads = Alloc(CAI_MEM_DEVICE, c.capacity, compute_, "gemini.grad");
    for (const Member& m : c.members) {
      cai_tensor view = View(c.grads, compute_, m.offset, &m.numel);
      Check(Host().model->replace_grad_storage(model_, m.param, &view));
    }
  }

  // Chunk c's gradient, summed over all ranks, into this rank's fp32 gradient shard: a
  // reduce-scatter over the shard group (left running behind backward with
  // enable_async_reduce), then an all-reduce over the replicas; offloaded chunks take it to
  // the host.
  void ReduceGrads(Chunk& c) {
    c.collecting = false;
    Buffer grads;
    if (GradsInPlace(c)) {
      grads = TakeGatheredAsGrads(c);
    } else {
      for (const Member& m : c.members) Check(Host().model->release_grad(model_, m.param));
      grads = std::move(c.grads);
    }
    const Chunk* chunk = &c;
    reducer_.Reduce(std::move(grads), c.shard, compute_,
                    [this, chunk](const cai_tensor& summed, const Buffer& on) {
                      const Chunk& c = *chunk;
                      const Bank& bank = banks_[c.bank];
                      traffic_.to_host += static_cast<double>(cai::sdk::AddToShard(
                          summed, on, View(bank.grads, kF32, c.base, &c.shard), bank.tier));
                    });
  }

  // GradsInPlace: the gradient of trainable parameter `member` (model parameter `param`) of
  // chunk c into its place in the gathered chunk; the model's copy goes.
  void GradIntoChunk(Chunk& c, int32_t member, uint32_t param) {
    if (!c.collecting || c.released || !c.gathered.get()) {
      throw Error(CAI_INTERNAL, "gemini: the gradient of '" + ParamName(param) +
                                    "' was ready while its chunk was not in backward");
    }
    cai_tensor grad{};
    cai_status* missing = Host().model->param_grad(model_, param, &grad);
    if (missing) {  // no gradient after all: its place is zeroed with the unused ones
      Host().status_destroy(missing);
      return;
    }
    const auto it = std::find_if(c.members.begin(), c.members.end(),
                                 [&](const Member& m) { return m.index == member; });
    RunKernel(CAI_KERNEL_COPY, &grad, View(c.gathered, compute_, it->offset, &it->numel));
    Check(Host().model->release_grad(model_, param));
    in_chunk_[member] = 1;
  }

  // GradsInPlace: chunk c's gathered memory, now its gradients (zero where no gradient came:
  // parameters unused in this backward, and the padding), leaves the parameters.
  Buffer TakeGatheredAsGrads(Chunk& c) {
    if (!c.gathered.get()) return Alloc(CAI_MEM_DEVICE, c.capacity, compute_, "gemini.grad");
    int64_t from = 0;
    auto zero = [&](int64_t to) {
      int64_t count = to - from;
      if (count > 0) RunKernel(CAI_KERNEL_FILL, nullptr, View(c.gathered, compute_, from, &count));
    };
    for (const Member& m : c.members) {
      if (in_chunk_[m.index]) {
        zero(m.offset);
        from = m.offset + m.numel;
      }
    }
    zero(c.capacity);
    return Ungather(c);
  }

  // A backward's gradients that will not be reduced (zero_grad, or a failed forward_backward).
  void DropGrads(Chunk& c) {
    for (const Member& m : c.members) Check(Host().model->release_grad(model_, m.param));
    if (GradsInPlace(c)) ReleaseParams(c, /*force=*/true, /*may_cache=*/false);  // holds gradients
    c.grads = Buffer();
    c.collecting = false;
  }

  static cai_status* OnUnitHook(void* self, const cai_hook_event* event) {
    return cai::sdk::Guard([&] { static_cast<Gemini*>(self)->OnHook(*event); });
  }

  void OnHook(const cai_hook_event& e) {
    if (e.kind == CAI_HOOK_GRAD_READY) {
      if (e.param >= 0 && static_cast<size_t>(e.param) < member_of_param_.size() &&
          member_of_param_[e.param] >= 0) {
        const int32_t member = member_of_param_[e.param];
        used_[member] = 1;
        Chunk& c = chunks_[chunk_of_member_[member]];
        if (GradsInPlace(c)) GradIntoChunk(c, member, static_cast<uint32_t>(e.param));
      }
      return;
    }
    if (e.unit < 0 || static_cast<size_t>(e.unit) >= chunks_of_unit_.size()) return;
    for (int32_t k : chunks_of_unit_[e.unit]) {
      Chunk& c = chunks_[k];
      switch (e.kind) {
        case CAI_HOOK_PRE_FORWARD:
          Gather(c);
          break;
        case CAI_HOOK_POST_FORWARD:
          // A recomputation inside backward keeps what backward needs.
          if (e.unit == c.last_unit && !e.recompute && !in_backward_) ReleaseParams(c);
          break;
        case CAI_HOOK_PRE_BACKWARD:
          in_backward_ = true;
          Gather(c);
          BeginGrads(c);
          break;
        case CAI_HOOK_POST_BACKWARD:
          if (e.unit != c.first_unit) break;
          if (c.collecting) ReduceGrads(c);
          ReleaseParams(c);
          break;
        default:
          break;
      }
    }
  }

  // ---- Checkpoints: the canonical layout, one chunk at a time -----------------------------

  // The bank buffer holding chunk c's master (slot -1) or optimizer state slot k.
  const Buffer& StateBuffer(const Chunk& c, int slot) const {
    const Bank& bank = banks_[c.bank];
    if (slot < 0) return bank.master;
    return c.bank == kNvme ? bank.nvme[static_cast<size_t>(slot)]
                           : bank.optim.state(static_cast<size_t>(slot));
  }

  // This rank's fp32 shard of chunk c (slot -1: the master, else optimizer state slot k) on
  // the device: a view of device-held state, else a device copy in `staging`.
  cai_tensor DeviceShard(const Chunk& c, int slot, Buffer& staging) {
    const Buffer& src = StateBuffer(c, slot);
    if (c.bank == kDevice) return View(src, kF32, c.base, &c.shard);
    Buffer host = Alloc(CAI_MEM_HOST, c.shard, kF32, "gemini.checkpoint");
    MoveShard(src, c, host.data(), CAI_MEM_OUT_OF_BUFFER);
    staging = Alloc(CAI_MEM_DEVICE, c.shard, kF32, "gemini.checkpoint");
    Check(Host().mempool->copy(staging.data(), host.data(), staging.size(), nullptr));
    return View(staging, kF32, 0, &c.shard);
  }

  void SaveChunk(const cai_checkpoint_args& args, const Chunk& c, int slot) {
    Buffer staging;
    const cai_tensor in = DeviceShard(c, slot, staging);
    Buffer full = Alloc(CAI_MEM_DEVICE, c.capacity, kF32, "gemini.checkpoint");
    const cai_tensor out = View(full, kF32, 0, &c.capacity);
    if (shards_ > 1) {
      RunCollective(CAI_COMM_ALL_GATHER, &in, out, false, CAI_REDUCE_SUM, groups_.shard());
    } else {
      RunKernel(CAI_KERNEL_COPY, &in, out);
    }
    if (rank_ != 0) return;
    for (const Member& m : c.members) {
      const cai_param_info info = ParamInfo(m.param);
      const cai_tensor t = View(full, kF32, m.offset, &m.numel);
      if (slot < 0) {
        cai::sdk::WriteAsFp32(args.checkpoint, std::string("model/") + info.name, t,
                              std::span<const int64_t>(info.shape, info.ndim));
      } else {
        Check(Host().checkpoint->write_tensor(
            args.checkpoint,
            cai::sdk::OptimStateName(info.name, static_cast<uint32_t>(slot)).c_str(), &t));
      }
    }
  }

  // Reads this rank's slice of every member of chunk c into a host shard, then puts it where
  // the chunk's state lives.
  void LoadChunk(const cai_checkpoint_args& args, const Chunk& c, int slot) {
    Buffer host = Alloc(CAI_MEM_HOST, c.shard, kF32, "gemini.checkpoint");
    const int64_t lo = Lo(c), hi = lo + c.shard;
    for (const Member& m : c.members) {
      const int64_t a = std::max(lo, m.offset), b = std::min(hi, m.offset + m.numel);
      if (a >= b) continue;
      const int64_t count = b - a;
      const cai_tensor dst = View(host, kF32, a - lo, &count);
      const std::string name =
          slot < 0 ? "model/" + ParamName(m.param)
                   : cai::sdk::OptimStateName(ParamName(m.param), static_cast<uint32_t>(slot));
      Check(
          Host().checkpoint->read_tensor(args.checkpoint, name.c_str(), a - m.offset, count, &dst));
    }
    MoveShard(StateBuffer(c, slot), c, host.data(), CAI_MEM_INTO_BUFFER);
  }

  // Configuration.
  int32_t rank_ = 0;
  int32_t world_ = 1;
  ChunkSizing sizing_;
  double shard_frac_ = 1, optim_frac_ = 0, param_frac_ = 0, nvme_frac_ = 0;
  bool nvme_masters_ = false;
  bool auto_ = false;
  double cap_ratio_ = 0.9;
  double margin_ratio_ = 0.0;
  double warmup_ratio_ = 0.8;
  uint64_t budget_ = 0;  // auto: the DEVICE tier's budget (0: none)
  int64_t stream_elements_ = 1 << 20;
  size_t max_prefetch_ = 0;
  double max_norm_ = 0;
  bool pin_ = false;
  bool sync_module_states_ = true;
  cai_mem_tier init_tier_ = CAI_MEM_DEVICE;
  bool verbose_ = false;
  cai_loss_scaler_config scaler_config_{};
  int32_t shards_ = 1;    // G
  int32_t replicas_ = 1;  // extra_dp_size
  int32_t shard_index_ = 0;
  int32_t replica_index_ = 0;
  cai::sdk::ShardGroups groups_;

  cai_model* model_ = nullptr;
  cai_optimizer* optimizer_ = nullptr;
  cai_dtype compute_ = kF32;
  cai::sdk::UnitHooks hooks_;

  std::vector<Chunk> chunks_;
  std::vector<std::vector<int32_t>> chunks_of_unit_;  // model unit -> its chunks, in order
  std::vector<int32_t> member_of_param_;              // model parameter -> trainable index
  std::vector<int32_t> chunk_of_member_;              // trainable index -> its chunk
  std::vector<uint8_t> in_chunk_;  // GradsInPlace: this backward's gradient is in its chunk
  std::vector<uint32_t> frozen_;
  size_t num_members_ = 0;
  int64_t psi_ = 0;
  int64_t chunk_capacity_ = 0;
  int64_t waste_ = 0;
  std::array<Bank, kBanks> banks_;
  std::array<Buffer, 2> compute_bufs_;  // compute-dtype shards: device, host
  std::array<int64_t, 2> compute_numel_{0, 0};
  std::optional<cai::sdk::StepEpilogue> epilogue_;

  bool backward_ = false;
  bool in_backward_ = false;
  size_t reduces_in_flight_ = 1;
  cai::sdk::OverlapMeter overlap_;
  cai::sdk::ShardReducer reducer_;  // after overlap_ and groups_, which it points at
  std::vector<uint8_t> used_;
  uint64_t gathered_bytes_ = 0;
  uint64_t gathered_peak_ = 0;
  Traffic traffic_;

  // auto: the cache of gathered chunks and the warm-up.
  uint64_t cache_cap_ = 0;
  int32_t accumulation_ = 1;  // micro-batches per step
  int32_t micro_batch_ = 0;   // of this step, done
  uint64_t cache_bytes_ = 0;
  uint64_t cache_hits_ = 0;
  uint64_t cache_evictions_ = 0;
  bool warming_up_ = false;
  bool warmed_up_ = false;

  // Prefetch along the recorded gather order.
  std::vector<int32_t> order_;
  size_t cursor_ = 0;
  bool recording_ = false;
  bool recorded_ = false;
  bool following_ = false;
};

}  // namespace

CAI_PLUGIN(Gemini)
