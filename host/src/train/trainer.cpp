#include "train/trainer.h"

#include <malloc.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>

#include "checkpoint/checkpoint.h"
#include "comm/comm_api.h"
#include "comm/communicator.h"
#include "core/json.h"
#include "core/log.h"
#include "core/status.h"
#include "core/strings.h"
#include "data/default_corpus.h"
#include "data/sampler.h"
#include "data/token_file.h"
#include "data/tokenizer.h"
#include "interop/hf_weights.h"
#include "launch/local_launcher.h"
#include "launch/rank_env.h"
#include "loader/registry.h"
#include "mem/mem_api.h"
#include "mem/pool.h"
#include "model/framework_allocator.h"
#include "model/model.h"
#include "optim/optimizer.h"
#include "services/host_table.h"
#include "train/console.h"
#include "train/job.h"
#include "train/plan.h"
#include "train/reference_strategy.h"
#include "train/runtime.h"

namespace cai {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

const char* const kOpNames[CAI_COMM_NUM_OPS] = {"all_reduce", "reduce_scatter", "all_gather",
                                                "broadcast",  "reduce",         "all_to_all",
                                                "send",       "recv",           "barrier"};
const char* const kTierNames[CAI_MEM_NUM_TIERS] = {"device", "pinned_host", "host", "nvme"};

fs::path DefaultRunDir(const fs::path& job_file) {
  std::time_t now = std::time(nullptr);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", std::localtime(&now));
  std::string stem = job_file.empty() ? "defaults" : job_file.stem().string();
  return fs::path("runs") / (stem + "-" + stamp);
}

uint64_t PrecisionCapability(cai_precision p) {
  return p == CAI_PRECISION_BF16   ? CAI_CAP_PRECISION_BF16
         : p == CAI_PRECISION_FP16 ? CAI_CAP_PRECISION_FP16
                                   : CAI_CAP_PRECISION_FP32;
}

// The strategy table to drive, with its schema.
struct Strategy {
  std::string name;
  const cai_plugin_api* api = nullptr;
  std::vector<ConfigKey> schema;
};

Strategy SelectStrategy(const std::string& name, const std::vector<fs::path>& plugin_paths,
                        const cai_host_api* host) {
  Strategy s;
  s.name = name;
  if (name == "none") {
    s.api = ReferenceStrategy(host);
    s.schema = ReadSchema(s.api->config_keys, s.api->num_config_keys, "strategy 'none'");
    return s;
  }
  std::vector<PluginRecord> records = DiscoverPlugins(PluginSearchPath(plugin_paths));
  std::vector<std::string_view> names = {"none"};
  for (const PluginRecord& r : records) {
    if (!r.error.empty()) continue;
    names.push_back(r.manifest.name);
    if (r.manifest.name == name) {
      const LoadedPlugin& plugin = LoadPlugin(r.manifest, host);
      s.api = plugin.api;
      s.schema = plugin.schema;
      return s;
    }
  }
  for (const PluginRecord& r : records) {
    if (!r.error.empty() && r.manifest.name == name) throw Error(CAI_FAILED_PRECONDITION, r.error);
  }
  throw Error(CAI_NOT_FOUND, "plugin.name = \"" + name + "\": no such strategy." +
                                 DidYouMean(name, names) + " Available: " + Join(names) +
                                 ". `cai plugins list` shows where cai looked");
}

std::unique_ptr<Model> BuildModel(const JobConfig& job, uint64_t seed) {
  const cai_config& m = *job.model;
  const std::string& kind = GetString(m, "kind");
  ParamOptions options;
  std::stringstream patterns(GetString(m, "freeze"));
  for (std::string pattern; std::getline(patterns, pattern, ',');) {
    pattern.erase(0, pattern.find_first_not_of(' '));
    pattern.erase(pattern.find_last_not_of(' ') + 1);
    if (!pattern.empty()) options.frozen.push_back(pattern);
  }
  options.unused_parameter = GetBool(m, "unused_parameter");
  options.ignore_index = GetInt(m, "ignore_index");
  if (kind == "torchscript") {
    const std::string& path = GetString(m, "path");
    if (path.empty()) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "[model] kind = \"torchscript\" needs model.path, the "
                  "TorchScript file to train");
    }
    if (!fs::is_regular_file(path)) {
      throw Error(CAI_NOT_FOUND, "model.path: TorchScript file '" + path + "' not found");
    }
    if (!GetString(m, "init_from").empty()) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "model.init_from reads Hugging Face weights into the zoo's gpt2 and llama; a "
                  "TorchScript model brings its own weights");
    }
    if (GetString(m, "init_device") == "lazy") {
      throw Error(CAI_INVALID_ARGUMENT,
                  "model.init_device = \"lazy\" draws the zoo's gpt2 and llama weights when "
                  "first read; a TorchScript model is loaded with its weights: use \"device\" "
                  "or \"host\"");
    }
    for (const char* key :
         {"memory_efficient_attention", "fused_normalization", "fused_activation"}) {
      if (GetBool(m, key)) {
        throw Error(CAI_INVALID_ARGUMENT,
                    std::string("model.") + key +
                        " replaces kernels of the zoo's gpt2 and llama; a TorchScript model's "
                        "forward is its own: set it to false");
      }
    }
    const std::string& policy = GetString(m, "tp_policy");
    if (!policy.empty() && !fs::is_regular_file(policy)) {
      throw Error(CAI_NOT_FOUND, "model.tp_policy: policy file '" + policy + "' not found");
    }
    return LoadTorchScriptModel(path, options, policy);
  }
  if (!GetString(m, "tp_policy").empty()) {
    throw Error(CAI_INVALID_ARGUMENT,
                "model.tp_policy is for TorchScript models (model.kind = \"torchscript\"); the "
                "zoo's gpt2 and llama split themselves under tensor parallelism: remove it");
  }
  ModelConfig config = ZooModelConfig(m);
  config.lazy_init = GetString(m, "init_device") == "lazy";
  if (config.lazy_init && !GetString(m, "init_from").empty()) {
    throw Error(CAI_INVALID_ARGUMENT,
                "model.init_device = \"lazy\" draws the initial weights from the seed, and "
                "model.init_from loads them from '" +
                    GetString(m, "init_from") + "': use init_device \"device\" or \"host\"");
  }
  auto model = MakeZooModel(config, seed, options);
  // Before the strategy takes the parameters over: every strategy starts from them as from
  // the seeded init.
  if (const std::string& dir = GetString(m, "init_from"); !dir.empty()) {
    interop::LoadHfWeights(dir, config, *model);
  }
  model->SetActivationCheckpointing(GetBool(m, "activation_checkpointing"));
  model->EnableKernels(
      (GetBool(m, "memory_efficient_attention") ? CAI_MODEL_KERNEL_MEMORY_EFFICIENT_ATTENTION : 0) |
      (GetBool(m, "fused_normalization") ? CAI_MODEL_KERNEL_FUSED_NORMALIZATION : 0) |
      (GetBool(m, "fused_activation") ? CAI_MODEL_KERNEL_FUSED_ACTIVATION : 0));
  return model;
}

std::unique_ptr<Optimizer> BuildOptimizer(const JobConfig& job) {
  const cai_config& o = *job.optimizer;
  const std::string& kind = GetString(o, "kind");
  GroupHyper hyper;
  hyper.lr = GetFloat(o, "lr");
  hyper.weight_decay = GetFloat(o, "weight_decay");
  hyper.beta1 = GetFloat(o, "beta1");
  hyper.beta2 = GetFloat(o, "beta2");
  hyper.eps = GetFloat(o, "eps");
  hyper.momentum = GetFloat(o, "momentum");
  hyper.dampening = GetFloat(o, "dampening");
  hyper.nesterov = GetBool(o, "nesterov");
  std::vector<GroupHyper> groups = DefaultParamGroups(hyper);
  if (double lr = GetFloat(o, "no_decay_lr"); lr > 0) groups[1].lr = lr;
  groups[1].weight_decay = GetFloat(o, "no_decay_weight_decay");
  LrSchedule schedule;
  schedule.warmup_steps = GetInt(o, "warmup_steps");
  const int64_t decay = GetInt(o, "decay_steps");
  schedule.total_steps = decay > 0 ? decay : GetInt(*job.train, "steps");
  schedule.min_lr_ratio = GetFloat(o, "min_lr_ratio");
  cai_optim_kind k = kind == "adam"  ? CAI_OPTIM_ADAM
                     : kind == "sgd" ? CAI_OPTIM_SGD
                                     : CAI_OPTIM_ADAMW;
  return std::make_unique<Optimizer>(k, groups, schedule, GetFloat(o, "max_grad_norm"));
}

std::vector<data::Token> LoadTokens(const JobConfig& job, int64_t vocab_size) {
  const std::string& source = GetString(*job.data, "source");
  const std::string& path = GetString(*job.data, "path");
  if (source != "default" && path.empty()) {
    throw Error(CAI_INVALID_ARGUMENT, "[data] source = \"" + source + "\" needs data.path");
  }
  if (source == "tokens") {
    data::TokenFile file = data::TokenFile::Open(path, static_cast<int>(vocab_size));
    return std::vector<data::Token>(file.tokens().begin(), file.tokens().end());
  }
  if (vocab_size < 256) {
    throw Error(CAI_INVALID_ARGUMENT, "model.vocab_size = " + std::to_string(vocab_size) +
                                          " is below 256, but data "
                                          "source '" +
                                          source +
                                          "' is byte-level text (ids 0..255); set model.vocab_size "
                                          ">= 256");
  }
  if (source == "default") return data::DefaultCorpusTokens();
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(CAI_NOT_FOUND, "data.path: text file '" + path + "' not found");
  std::string text((std::istreambuf_iterator<char>(in)), {});
  return data::ByteTokenizer().Encode(text);
}

// A [rows, T] int64 descriptor over a batch's vector.
struct BatchTensors {
  int64_t shape[2];
  int64_t strides[2];
  cai_tensor tokens, targets;
  explicit BatchTensors(data::Batch& b) : shape{b.rows, b.seq_len}, strides{b.seq_len, 1} {
    tokens = {b.tokens.data(), {CAI_DEVICE_CPU, 0}, 2, {CAI_DTYPE_INT, 64, 1}, shape, strides, 0};
    targets = {b.targets.data(), {CAI_DEVICE_CPU, 0}, 2, {CAI_DTYPE_INT, 64, 1}, shape, strides, 0};
  }
};

// How the strategy lays the world out (cai_plugin_api.parallel_layout, ABI 1.3). Without one,
// every rank is a replica of its own that reports its loss: what 1.0-1.2 strategies assume.
struct Layout {
  int dp_rank = 0, dp_size = 1;
  bool reports_loss = true;
  bool pipelines = false;
  // "rank 1" in a world of replicas, "replica 1 (of 2)" otherwise: who holds the rows.
  std::string Holder(int world) const {
    return dp_size == world ? "rank " + std::to_string(dp_rank)
                            : "data-parallel replica " + std::to_string(dp_rank) + " (of " +
                                  std::to_string(dp_size) + ")";
  }
};

// The rows of a global batch that this rank's replica trains on, cut into `accum` micro-batches
// of near-equal size. The ranks of one replica get the same rows.
std::vector<std::vector<int64_t>> RankChunks(const std::vector<int64_t>& starts,
                                             const Layout& layout, int world, int64_t accum) {
  const auto global = static_cast<int64_t>(starts.size());
  if (layout.dp_size != world && global < layout.dp_size) {
    throw Error(CAI_INVALID_ARGUMENT,
                "train.global_batch (" + std::to_string(global) +
                    ") must be at least the number of data-parallel replicas (" +
                    std::to_string(layout.dp_size) +
                    "): every replica needs at least one sequence per step");
  }
  data::RankShare share = data::ShareOfRank(global, layout.dp_rank, layout.dp_size);
  if (share.count < accum) {
    throw Error(CAI_INVALID_ARGUMENT,
                layout.Holder(world) + " holds " + std::to_string(share.count) +
                    " sequences of the global batch but train.grad_accum = " +
                    std::to_string(accum) + "; raise train.global_batch to at least " +
                    std::to_string(accum * layout.dp_size) + " or lower train.grad_accum");
  }
  std::vector<std::vector<int64_t>> chunks(accum);
  for (int64_t i = 0; i < accum; ++i) {
    int64_t begin = share.first + share.count * i / accum;
    int64_t end = share.first + share.count * (i + 1) / accum;
    chunks[i].assign(starts.begin() + begin, starts.begin() + end);
  }
  return chunks;
}

uint64_t PeakRssBytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<uint64_t>(usage.ru_maxrss) * 1024;
}

class Run {
 public:
  Run(const TrainOptions& options, JobConfig job, const launch::RankEnv& env, fs::path run_dir)
      : options_(options), job_(std::move(job)), env_(env), run_dir_(std::move(run_dir)) {}

  int Execute();

 private:
  void Setup();
  void ChooseAuto();
  void LearnLayout();
  double StepLoss(int64_t step);
  double SumOverRanks(double value);
  // Every rank's `mine` (the same length on every rank), in rank order. Collective.
  std::vector<int64_t> GatherOverRanks(std::vector<int64_t> mine);
  void Barrier();
  static Communicator& World();
  double Evaluate();
  void SaveCheckpoint(int64_t step);
  void WriteSummary(double wall_s);
  void Report(int64_t step, double loss, const cai_step_result& result, double step_s);
  RunSummary Summary();
  // Bytes handed to each collective (the ABI's counters) and sent on the wire, summed over
  // groups, since the communicator started.
  struct CommBytes {
    cai_comm_counters handed;
    WireCounters wire;
  };
  CommBytes Counters();

  const TrainOptions& options_;
  JobConfig job_;
  launch::RankEnv env_;
  fs::path run_dir_;
  const cai_host_api* host_ = nullptr;
  std::unique_ptr<Model> model_;
  std::unique_ptr<Optimizer> optimizer_;
  Strategy strategy_;
  // The strategy's own estimate (rank 0, which prints it), beside the measured peaks in
  // summary.json.
  std::optional<RunSummary::Memory> memory_estimate_;
  Layout layout_;
  std::unique_ptr<cai_config> plugin_config_;
  cai_strategy* instance_ = nullptr;
  std::vector<data::Token> tokens_;
  std::unique_ptr<data::WindowSampler> train_sampler_, eval_sampler_;
  int64_t steps_ = 0, global_batch_ = 0, seq_len_ = 0, accum_ = 1, start_step_ = 0;
  cai_precision precision_ = CAI_PRECISION_FP32;
  std::ofstream metrics_;
  bool progress_bar_ = false;
  int64_t params_ = 0;
  double flops_per_token_ = 0;
  std::vector<double> step_times_;
  // Per op, summed over this run's optimizer steps (comm_steps_); summary.json has the means.
  std::array<uint64_t, CAI_COMM_NUM_OPS> handed_sum_{}, wire_sum_{}, unmeasured_calls_{};
  int64_t comm_steps_ = 0;
  double last_loss_ = NAN, last_eval_ = NAN;
  Clock::time_point loop_start_;
};

Run::CommBytes Run::Counters() {
  CommBytes c{};
  c.handed.struct_size = CAI_COMM_COUNTERS_STRUCT_SIZE;
  ThrowIfError(CommApi()->counters(nullptr, &c.handed));
  c.wire = Communicator::Get()->WireBytes(nullptr);
  return c;
}

double Run::SumOverRanks(double value) {
  if (env_.world_size == 1) return value;
  return World().AllReduce(value, CAI_REDUCE_SUM);
}

std::vector<int64_t> Run::GatherOverRanks(std::vector<int64_t> mine) {
  if (env_.world_size == 1) return mine;
  return World().AllGather(mine);
}

void Run::Barrier() { World().Barrier(); }

Communicator& Run::World() {
  Communicator* comm = Communicator::Get();
  if (comm == nullptr) {
    throw Error(CAI_FAILED_PRECONDITION, "the communicator is not initialised");
  }
  return *comm;
}

// Rank 0 decides and tells the others, so ranks on machines of different sizes agree: the
// plugin and the [plugin.<name>] table it runs with (the user's plus the options of the
// configuration the plan sized), which then resolves as if the user had written it.
void Run::ChooseAuto() {
  constexpr size_t kWire = 8192;
  std::vector<uint8_t> wire(kWire, 0);
  if (env_.rank == 0) {
    Plan plan = MakePlan(job_, env_.world_size, options_.plugin_paths, host_);
    Log(CAI_LOG_INFO, "", "plugin.name = \"auto\" chose '" + plan.choice + "': " + plan.reason);
    for (const auto& [name, table] : job_.plugin_tables) {
      if (name == plan.choice) continue;
      const auto where = job_.plugin_table_where.find(name);
      Log(CAI_LOG_INFO, "",
          "[plugin." + name + "]" + (where == job_.plugin_table_where.end() ? "" : where->second) +
              " is not used: plugin.name = \"auto\" chose '" + plan.choice + "'");
    }
    const std::string text = plan.choice + "\n" + plan.choice_table;
    if (text.size() >= kWire) {
      throw Error(CAI_INVALID_ARGUMENT, "plugin.name = \"auto\": the [plugin." + plan.choice +
                                            "] table is " + std::to_string(text.size()) +
                                            " bytes, more than the " + std::to_string(kWire - 1) +
                                            " that travel to the other ranks; name the plugin "
                                            "instead of \"auto\"");
    }
    std::copy(text.begin(), text.end(), wire.begin());
  }
  if (env_.world_size > 1) {
    int64_t n = static_cast<int64_t>(wire.size()), stride = 1;
    cai_tensor t{wire.data(), {CAI_DEVICE_CPU, 0}, 1, {CAI_DTYPE_UINT, 8, 1}, &n, &stride, 0};
    cai_comm_args args{};
    args.struct_size = CAI_COMM_ARGS_STRUCT_SIZE;
    args.op = CAI_COMM_BROADCAST;
    args.output = &t;
    args.root = 0;
    ThrowIfError(CommApi()->run(&args, nullptr));
  }
  const std::string text(reinterpret_cast<const char*>(wire.data()));
  const size_t newline = text.find('\n');
  job_.plugin = text.substr(0, newline);
  job_.plugin_table_toml = newline == std::string::npos ? "" : text.substr(newline + 1);
  // config.resolved.toml names what ran, not "auto".
  const std::string from = "[plugin]\nname = \"auto\"";
  if (const size_t at = job_.resolved_toml.find(from); at != std::string::npos) {
    job_.resolved_toml.replace(at, from.size(),
                               "[plugin]\nname = \"" + job_.plugin + "\"  # chosen by auto");
  }
}

void Run::Setup() {
  const cai_config& train = *job_.train;
  steps_ = GetInt(train, "steps");
  global_batch_ = GetInt(train, "global_batch");
  seq_len_ = GetInt(train, "seq_len");
  accum_ = GetInt(train, "grad_accum");
  precision_ = ParsePrecision(GetString(train, "precision"));
  const uint64_t seed = static_cast<uint64_t>(GetInt(train, "seed"));

  int threads = static_cast<int>(GetInt(train, "threads"));
  if (threads == 0) {
    threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / env_.world_size);
  }
  SetComputeThreads(threads);

  host_ = HostServicesTable();
  if (job_.plugin == "auto") ChooseAuto();
  strategy_ = SelectStrategy(job_.plugin, options_.plugin_paths, host_);
  plugin_config_ = ResolvePluginConfig(job_, strategy_.schema);
  if (!(strategy_.api->capabilities & PrecisionCapability(precision_))) {
    throw Error(CAI_FAILED_PRECONDITION, "strategy '" + strategy_.name + "' does not train in " +
                                             GetString(train, "precision") +
                                             "; see `cai plugins info " + strategy_.name +
                                             "` for its precisions, or set train.precision");
  }
  if (GetString(*job_.launch, "backend") == "nccl") {
    throw Error(CAI_UNIMPLEMENTED,
                "launch.backend = \"nccl\" needs CUDA devices, and this cai "
                "host trains on the CPU; use \"gloo\"");
  }

  const bool init_on_host = GetString(*job_.model, "init_device") == "host";
  {
    // Built in host memory, the model's initial weights are not the device's: only what the
    // strategy places on the device (and, after boost, what it leaves in the model) is.
    AllocationSite site("building the model (its initial weights)");
    if (init_on_host) ChargeFrameworkTo(nullptr);
    model_ = BuildModel(job_, seed);
    if (init_on_host) ChargeFrameworkTo(&MemoryPool::Global());
  }
  const cai_config& m = *job_.model;
  std::vector<cai_param_info> infos;
  for (uint32_t i = 0; i < model_->NumParams(); ++i) infos.push_back(model_->ParamInfo(i));
  std::vector<cai_unit_info> units;
  for (uint32_t u = 0; u < model_->NumUnits(); ++u) units.push_back(model_->UnitInfo(u));
  for (const cai_param_info& info : infos) params_ += info.numel;
  // A TorchScript model's shape is not in [model]: its attention term is left out.
  const bool zoo = GetString(m, "kind") != "torchscript";
  flops_per_token_ = ModelFlopsPerToken(MatmulParams(infos, units), zoo ? GetInt(m, "n_layer") : 0,
                                        GetInt(m, "n_embd"), seq_len_);
  if (GetString(m, "kind") != "torchscript" && seq_len_ > GetInt(m, "n_ctx")) {
    throw Error(CAI_INVALID_ARGUMENT,
                "train.seq_len = " + std::to_string(seq_len_) +
                    " exceeds model.n_ctx = " + std::to_string(GetInt(m, "n_ctx")));
  }
  optimizer_ = BuildOptimizer(job_);

  tokens_ = LoadTokens(job_, GetInt(m, "vocab_size"));
  data::TokenSplit split = data::SplitTokens(tokens_, GetFloat(*job_.data, "eval_fraction"));
  train_sampler_ = std::make_unique<data::WindowSampler>(
      split.train, data::SamplerOptions{seq_len_, global_batch_, seed, true});
  if (!split.eval.empty()) {
    if (static_cast<int64_t>(split.eval.size()) <= seq_len_) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "the evaluation split holds " + std::to_string(split.eval.size()) +
                      " tokens, fewer than train.seq_len + 1; raise data.eval_fraction, give "
                      "more data, or set data.eval_fraction = 0");
    }
    eval_sampler_ = std::make_unique<data::WindowSampler>(
        split.eval, data::SamplerOptions{seq_len_, global_batch_, seed, false});
  }
  // Fail before any work if the batch cannot be split as asked. A strategy with a layout
  // states its replicas only after boost, where LearnLayout checks the split.
  layout_ = {env_.rank, env_.world_size, true, false};
  const cai_plugin_api* api = strategy_.api;
  const bool has_layout =
      CAI_HAS_FIELD(api, cai_plugin_api, parallel_layout) && api->parallel_layout != nullptr;
  if (!has_layout) {
    RankChunks(train_sampler_->GlobalBatchStarts(0), layout_, env_.world_size, accum_);
  }

  cai_create_args create{};
  create.struct_size = CAI_CREATE_ARGS_STRUCT_SIZE;
  create.config = plugin_config_.get();
  create.rank = env_.rank;
  create.world_size = env_.world_size;
  ThrowIfError(strategy_.api->create(&create, &instance_));
  cai_boost_args boost{};
  boost.struct_size = CAI_BOOST_ARGS_STRUCT_SIZE;
  boost.model = AsHandle(model_.get());
  boost.optimizer = ToHandle(optimizer_.get());
  boost.precision = precision_;
  boost.grad_accumulation = static_cast<int32_t>(accum_);
  {
    AllocationSite site("the strategy's boost (placing the model's states)");
    ThrowIfError(strategy_.api->boost(instance_, &boost));
  }
  if (init_on_host) {
    AllocationSite site("moving to the device what the strategy left in the model");
    const uint64_t moved = model_->ChargeOwnStorage();
    if (env_.rank == 0) {
      Log(CAI_LOG_INFO, "",
          "model.init_device = \"host\": the model was built in host memory; " +
              FormatByteCount(moved) +
              " of it (buffers and the parameters the strategy kept in the model) moved to "
              "the device after boost");
    }
  }
  {
    AllocationSite site("drawing the lazily initialised parameters the strategy left unread");
    const uint64_t drawn = model_->InitPendingParams();  // none unless model.init_device = lazy
    if (env_.rank == 0 && drawn > 0) {
      Log(CAI_LOG_INFO, "",
          "model.init_device = \"lazy\": " + FormatByteCount(drawn) +
              " of parameters the strategy left unread were drawn after boost");
    }
  }
  if (has_layout) LearnLayout();

  if (GetBool(*job_.checkpoint, "resume")) {
    const fs::path checkpoints = run_dir_ / "checkpoints";
    std::vector<std::string> skipped;
    const auto latest = ckpt::FindLatestCheckpoint(checkpoints, &skipped);
    if (env_.rank == 0) {
      for (const std::string& dir : skipped) {
        Log(CAI_LOG_WARN, "",
            "checkpoint.resume: skipped " + dir +
                (latest ? "; resuming from the older " + latest->filename().string() : ""));
      }
      if (!latest) {
        Log(skipped.empty() ? CAI_LOG_INFO : CAI_LOG_WARN, "",
            "checkpoint.resume = true, but " + checkpoints.string() +
                " holds no complete checkpoint: training starts at step 1");
      }
    }
    if (latest) {
      ckpt::CheckpointReader reader(*latest);
      cai_checkpoint_args args{};
      args.struct_size = CAI_CHECKPOINT_ARGS_STRUCT_SIZE;
      args.checkpoint = reader.handle();
      args.model = true;
      args.optimizer = true;
      ThrowIfError(strategy_.api->load(instance_, &args));
      start_step_ = reader.step();
      Log(CAI_LOG_INFO, "",
          "resumed from " + latest->string() + " (step " + std::to_string(start_step_) +
              ", saved by " + std::to_string(reader.saved_world_size()) + " ranks)");
    }
  }
  if (env_.rank == 0) {
    // A resumed run appends; a run that starts at step 1 keeps an earlier run's metrics as
    // metrics.jsonl.N (the lowest N free) and starts a new file.
    const fs::path metrics = run_dir_ / "metrics.jsonl";
    std::error_code ec;
    if (start_step_ == 0 && fs::exists(metrics, ec)) {
      fs::path kept;
      for (int n = 1; kept.empty() || fs::exists(kept, ec); ++n) {
        kept = run_dir_ / ("metrics.jsonl." + std::to_string(n));
      }
      fs::rename(metrics, kept, ec);
      if (ec) {
        throw Error(CAI_PERMISSION_DENIED,
                    metrics.string() + " of an earlier run cannot be kept as " + kept.string() +
                        ": " + ec.message() + "; move it away or choose another --run-dir");
      }
      Log(CAI_LOG_WARN, "",
          "this run starts at step 1; the earlier " + metrics.string() + " is kept as " +
              kept.filename().string());
    }
    metrics_.open(metrics, start_step_ > 0 ? std::ios::app : std::ios::trunc);
    if (!metrics_)
      throw Error(CAI_PERMISSION_DENIED,
                  (run_dir_ / "metrics.jsonl").string() + ": cannot be written");
    std::ofstream(run_dir_ / "config.resolved.toml") << job_.resolved_toml;
  }
}

// Asks the strategy for its layout and checks it on every rank at once: each rank's answer
// travels to all in one all-gather, so every rank refuses a bad layout with the same error
// instead of some waiting in a collective the others never reach.
void Run::LearnLayout() {
  cai_parallel_layout out{};
  out.struct_size = CAI_PARALLEL_LAYOUT_STRUCT_SIZE;
  ThrowIfError(strategy_.api->parallel_layout(instance_, &out));
  std::vector<int64_t> mine = {out.data_parallel_rank, out.data_parallel_size,
                               out.reports_loss ? 1 : 0, out.pipelines ? 1 : 0};
  const int world = env_.world_size;
  const std::vector<int64_t> all = GatherOverRanks(mine);
  const std::string who = "strategy '" + strategy_.name + "' (parallel_layout)";
  const auto fail = [&](const std::string& what) {
    throw Error(CAI_FAILED_PRECONDITION, who + ": " + what + "; this is a bug in the strategy");
  };
  const int64_t size = all[1];
  if (size < 1 || world % size != 0) {
    fail("rank 0 reports data_parallel_size " + std::to_string(size) +
         ", which does not divide the world of " + std::to_string(world) + " ranks");
  }
  // Per replica: its ranks, and how many of them report the loss.
  std::vector<int64_t> members(size, 0), reporters(size, 0);
  for (int r = 0; r < world; ++r) {
    const int64_t* f = all.data() + r * mine.size();
    if (f[1] != size) {
      fail("rank " + std::to_string(r) + " reports data_parallel_size " + std::to_string(f[1]) +
           " but rank 0 reports " + std::to_string(size));
    }
    if (f[0] < 0 || f[0] >= size) {
      fail("rank " + std::to_string(r) + " reports data_parallel_rank " + std::to_string(f[0]) +
           ", outside [0, " + std::to_string(size) + ")");
    }
    if (f[3] != all[3]) {
      fail("rank " + std::to_string(r) + " says pipelines = " + (f[3] ? "true" : "false") +
           " but rank 0 says " + (all[3] ? "true" : "false"));
    }
    ++members[f[0]];
    reporters[f[0]] += f[2];
  }
  for (int64_t d = 0; d < size; ++d) {
    if (members[d] != world / size) {
      fail("replica " + std::to_string(d) + " has " + std::to_string(members[d]) +
           " ranks; each of the " + std::to_string(size) + " replicas needs " +
           std::to_string(world / size));
    }
    if (reporters[d] != 1) {
      fail("replica " + std::to_string(d) + " has " + std::to_string(reporters[d]) +
           " ranks with reports_loss; exactly one must report, or its loss is counted " +
           (reporters[d] == 0 ? "nowhere" : "more than once"));
    }
  }
  const cai_plugin_api* api = strategy_.api;
  if (all[3] && !((api->capabilities & CAI_CAP_PIPELINE) && api->execute_pipeline)) {
    fail(
        "it asks for execute_pipeline (pipelines = true) but lacks CAI_CAP_PIPELINE or "
        "execute_pipeline");
  }
  layout_ = {static_cast<int>(mine[0]), static_cast<int>(size), mine[2] != 0, mine[3] != 0};
  if (env_.rank == 0) {
    Log(CAI_LOG_INFO, "",
        "layout: " + std::to_string(size) + " data-parallel replica(s) of " +
            std::to_string(world / size) + " rank(s)" + (layout_.pipelines ? ", pipelined" : ""));
  }
  // The last replica holds the fewest rows: checking it makes every rank refuse alike.
  Layout fewest = layout_;
  fewest.dp_rank = layout_.dp_size - 1;
  RankChunks(train_sampler_->GlobalBatchStarts(0), fewest, world, accum_);
}

double Run::Evaluate() {
  if (!eval_sampler_) return NAN;
  const int64_t batches = GetInt(*job_.train, "eval_batches");
  double local = 0;
  for (int64_t i = 0; i < batches; ++i) {
    auto chunks = RankChunks(eval_sampler_->GlobalBatchStarts(i), layout_, env_.world_size, 1);
    data::Batch batch = eval_sampler_->Gather(chunks[0]);
    BatchTensors t(batch);
    double loss = 0;
    if (CAI_HAS_FIELD(strategy_.api, cai_plugin_api, evaluate) && strategy_.api->evaluate) {
      cai_micro_batch mb{};
      mb.struct_size = CAI_MICRO_BATCH_STRUCT_SIZE;
      mb.tokens = &t.tokens;
      mb.targets = &t.targets;
      mb.loss_weight = 1;
      mb.loss = &loss;
      ThrowIfError(strategy_.api->evaluate(instance_, &mb));
    } else {
      loss = model_->ForwardBackward(t.tokens, t.targets, false);
    }
    if (layout_.reports_loss) {
      local += loss * static_cast<double>(batch.rows) / static_cast<double>(global_batch_);
    }
  }
  return SumOverRanks(local) / static_cast<double>(batches);
}

// Forward and backward of this replica's rows of step `step` (1-based): one forward_backward
// per micro-batch, or one execute_pipeline with all of them. Returns this rank's share of the
// step's loss, Σ mean loss × loss_weight (meaningful where the layout reports the loss).
double Run::StepLoss(int64_t step) {
  auto chunks =
      RankChunks(train_sampler_->GlobalBatchStarts(step - 1), layout_, env_.world_size, accum_);
  // Kept in place for the call: the micro-batches point into them.
  std::vector<data::Batch> batches;
  std::vector<std::unique_ptr<BatchTensors>> tensors;
  std::vector<double> losses(accum_, 0.0);
  std::vector<cai_micro_batch> micro_batches(accum_);
  batches.reserve(accum_);
  for (int64_t i = 0; i < accum_; ++i) {
    batches.push_back(train_sampler_->Gather(chunks[i]));
    data::Batch& batch = batches.back();
    batch.loss_weight = static_cast<double>(batch.rows) / static_cast<double>(global_batch_);
    tensors.push_back(std::make_unique<BatchTensors>(batch));
    cai_micro_batch& mb = micro_batches[i];
    mb.struct_size = CAI_MICRO_BATCH_STRUCT_SIZE;
    mb.tokens = &tensors.back()->tokens;
    mb.targets = &tensors.back()->targets;
    mb.loss_weight = batch.loss_weight;
    mb.loss = &losses[i];
  }
  if (layout_.pipelines) {
    double loss = 0;
    cai_pipeline_args args{};
    args.struct_size = CAI_PIPELINE_ARGS_STRUCT_SIZE;
    args.micro_batches = micro_batches.data();
    args.num_micro_batches = static_cast<int32_t>(accum_);
    args.loss = &loss;
    ThrowIfError(strategy_.api->execute_pipeline(instance_, &args));
    return loss;
  }
  double local_loss = 0;
  for (int64_t i = 0; i < accum_; ++i) {
    if (strategy_.api->no_sync && accum_ > 1) {
      ThrowIfError(strategy_.api->no_sync(instance_, i + 1 < accum_));
    }
    ThrowIfError(strategy_.api->forward_backward(instance_, &micro_batches[i]));
    local_loss += losses[i] * micro_batches[i].loss_weight;
  }
  return local_loss;
}

void Run::SaveCheckpoint(int64_t step) {
  ckpt::CheckpointWriter writer(run_dir_ / "checkpoints", step, env_.rank, env_.world_size,
                                env_.run_id);
  writer.NameOptimizerSlots(ckpt::OptimizerSlotNames(GetString(*job_.optimizer, "kind")));
  cai_checkpoint_args args{};
  args.struct_size = CAI_CHECKPOINT_ARGS_STRUCT_SIZE;
  args.checkpoint = writer.handle();
  args.model = true;
  args.optimizer = true;
  ThrowIfError(strategy_.api->save(instance_, &args));
  fs::path dir = writer.Commit([&] { Barrier(); });
  if (env_.rank == 0) Log(CAI_LOG_INFO, "", "checkpoint saved: " + dir.string());
}

RunSummary Run::Summary() {
  RunSummary s;
  s.model = model_->Describe();
  s.params = params_;
  s.strategy = strategy_.name;
  s.strategy_options = job_.plugin_table_toml;
  s.world_size = env_.world_size;
  s.threads = ComputeThreads();
  s.precision = GetString(*job_.train, "precision");
  s.steps = steps_;
  s.global_batch = global_batch_;
  s.seq_len = seq_len_;
  s.grad_accum = accum_;
  s.flops_per_token = flops_per_token_;
  s.peak_flops = GetFloat(*job_.train, "peak_flops");
  s.device_budget = MemoryBudget(job_, "device_budget");
  s.run_dir = run_dir_;
  const cai_plugin_api* api = strategy_.api;
  if (GetString(*job_.model, "kind") != "torchscript" &&
      CAI_HAS_FIELD(api, cai_plugin_api, estimate_memory) && api->estimate_memory) {
    try {
      const MemoryEstimate e = EstimateMemory(
          *api, *plugin_config_, job_, ZooModelSize(ZooModelConfig(*job_.model)), env_.world_size);
      s.memory = RunSummary::Memory{e.device_bytes, e.host_bytes, e.formula};
      memory_estimate_ = s.memory;
    } catch (const Error& e) {
      // The estimate only informs the summary; training does not depend on it.
      Log(CAI_LOG_WARN, "",
          "strategy '" + strategy_.name + "' could not estimate its memory: " + e.what());
    }
  }
  return s;
}

void Run::Report(int64_t step, double loss, const cai_step_result& result, double step_s) {
  const double tokens_per_s = static_cast<double>(global_batch_ * seq_len_) / step_s;
  const double mfu = ModelFlopsUtilization(flops_per_token_, tokens_per_s,
                                           GetFloat(*job_.train, "peak_flops"), env_.world_size);
  JsonObject line;
  line.Add("step", step)
      .Add("loss", loss)
      .Add("lr", result.lr)
      .Add("grad_norm", result.grad_norm)
      .Add("loss_scale", result.loss_scale)
      .Add("skipped", result.skipped)
      .Add("tokens_per_s", tokens_per_s)
      .Add("step_time_s", step_s);
  if (!std::isnan(last_eval_)) line.Add("eval_loss", last_eval_);
  if (!std::isnan(mfu)) line.Add("mfu", mfu);
  metrics_ << line.str() << "\n";
  metrics_.flush();

  const int64_t done = step - start_step_;
  const double elapsed = std::chrono::duration<double>(Clock::now() - loop_start_).count();
  StepLine text;
  text.step = step;
  text.steps = steps_;
  text.loss = loss;
  text.lr = result.lr;
  text.tokens_per_s = tokens_per_s;
  text.mfu = mfu;
  text.eta_s = elapsed / static_cast<double>(done) * static_cast<double>(steps_ - step);
  text.skipped = result.skipped;
  if (progress_bar_) {
    std::cout << FormatProgressBar(text, StdoutColumns()) << std::flush;
  } else if (step % GetInt(*job_.train, "log_every") == 0 || step == steps_ || done == 1) {
    Log(CAI_LOG_INFO, "", FormatStepLine(text));
  }
}

// A per-step mean of a byte count for summary.json: an integer when it is one (strategies move
// the same bytes every step), null when there is no step or `sum` is -1 (not measured).
void AddMean(JsonObject& object, const char* key, int64_t sum, int64_t steps) {
  if (sum < 0 || steps <= 0) {
    object.Add(key, NAN);
  } else if (sum % steps == 0) {
    object.Add(key, sum / steps);
  } else {
    object.Add(key, static_cast<double>(sum) / static_cast<double>(steps));
  }
}

void Run::WriteSummary(double wall_s) {
  // Per-rank figures travel to rank 0 in one all-gather: peak bytes per tier, peak RSS, bytes
  // handed to each collective and bytes sent on the wire for it, summed over the steps (-1:
  // not measurable, e.g. NCCL), what the strategy holds (sharding strategies hold different
  // amounts on different ranks), LibTorch's own allocations (peak, and live now), and the
  // strategy's overlap_ratio in parts per million.
  constexpr size_t kHanded = CAI_MEM_NUM_TIERS + 1;
  constexpr size_t kWire = kHanded + CAI_COMM_NUM_OPS;
  constexpr size_t kStats = kWire + CAI_COMM_NUM_OPS;
  constexpr size_t kFramework = kStats + 4;
  constexpr size_t kOverlap = kFramework + 3;
  constexpr size_t kDeviceTotal = kOverlap + 1;
  constexpr size_t kBudget = kDeviceTotal + 1;
  constexpr size_t kFields = kBudget + CAI_MEM_NUM_TIERS;
  cai_strategy_stats stats{};
  stats.struct_size = CAI_STRATEGY_STATS_STRUCT_SIZE;
  ThrowIfError(strategy_.api->stats(instance_, &stats));
  std::vector<int64_t> mine(kFields);
  mine[kStats + 0] = static_cast<int64_t>(stats.param_bytes);
  mine[kStats + 1] = static_cast<int64_t>(stats.grad_bytes);
  mine[kStats + 2] = static_cast<int64_t>(stats.optimizer_state_bytes);
  mine[kStats + 3] = static_cast<int64_t>(stats.master_bytes);
  const FrameworkMemory framework = FrameworkMemoryUsage();
  mine[kFramework + 0] = static_cast<int64_t>(framework.max_bytes);
  mine[kFramework + 1] = static_cast<int64_t>(framework.current_bytes);
  mine[kFramework + 2] = static_cast<int64_t>(framework.peak_bytes);  // reset before step 1
  mine[kOverlap] = std::llround(1e6 * stats.overlap_ratio);
  for (int tier = 0; tier < CAI_MEM_NUM_TIERS; ++tier) {
    cai_mem_usage usage{};
    usage.struct_size = CAI_MEM_USAGE_STRUCT_SIZE;
    ThrowIfError(MemApi()->usage(tier, &usage));
    mine[tier] = static_cast<int64_t>(usage.peak_bytes);
    mine[kBudget + tier] = static_cast<int64_t>(usage.budget_bytes);
    if (tier == CAI_MEM_DEVICE) mine[kDeviceTotal] = static_cast<int64_t>(usage.total_peak_bytes);
  }
  mine[CAI_MEM_NUM_TIERS] = static_cast<int64_t>(PeakRssBytes());
  for (int op = 0; op < CAI_COMM_NUM_OPS; ++op) {
    mine[kHanded + op] = static_cast<int64_t>(handed_sum_[op]);
    mine[kWire + op] = unmeasured_calls_[op] > 0 ? -1 : static_cast<int64_t>(wire_sum_[op]);
  }
  const std::vector<int64_t> all = GatherOverRanks(mine);
  if (env_.rank != 0) return;

  std::vector<double> sorted = step_times_;
  std::sort(sorted.begin(), sorted.end());
  // The first step pays for allocation and warm-up; the median of the rest is the rate.
  const double median = sorted.empty() ? NAN : sorted[sorted.size() / 2];
  std::vector<std::string> ranks;
  for (int r = 0; r < env_.world_size; ++r) {
    const int64_t* f = all.data() + r * kFields;
    JsonObject peak, budget, handed, wire;
    for (int tier = 0; tier < CAI_MEM_NUM_TIERS; ++tier) {
      peak.Add(kTierNames[tier], f[tier]);
      budget.Add(kTierNames[tier], f[kBudget + tier]);
    }
    for (int op = 0; op < CAI_COMM_NUM_OPS; ++op) {
      AddMean(handed, kOpNames[op], f[kHanded + op], comm_steps_);
      AddMean(wire, kOpNames[op], f[kWire + op], comm_steps_);
    }
    ranks.push_back(JsonObject()
                        .Add("rank", r)
                        .AddRaw("peak_bytes", peak.str())
                        .Add("peak_rss_bytes", f[CAI_MEM_NUM_TIERS])
                        .Add("device_total_peak_bytes", f[kDeviceTotal])
                        .AddRaw("budget_bytes", budget.str())
                        .Add("framework_peak_bytes", f[kFramework + 0])
                        .Add("framework_step_peak_bytes", f[kFramework + 2])
                        .Add("framework_bytes_at_end", f[kFramework + 1])
                        .AddRaw("comm_bytes_per_step_mean", handed.str())
                        .AddRaw("wire_bytes_per_step_mean", wire.str())
                        .Add("overlap_ratio", static_cast<double>(f[kOverlap]) / 1e6)
                        .AddRaw("strategy_bytes", JsonObject()
                                                      .Add("params", f[kStats + 0])
                                                      .Add("grads", f[kStats + 1])
                                                      .Add("optimizer_state", f[kStats + 2])
                                                      .Add("master", f[kStats + 3])
                                                      .str())
                        .str());
  }
  JsonObject summary;
  summary.Add("plugin", strategy_.name)
      .Add("world_size", env_.world_size)
      .Add("steps", steps_)
      .Add("final_loss", last_loss_)
      .Add("final_eval_loss", last_eval_)
      .Add("tokens_per_s", static_cast<double>(global_batch_ * seq_len_) / median)
      .Add("median_step_time_s", median)
      .Add("wall_time_s", wall_s)
      .Add("precision", GetString(*job_.train, "precision"))
      .Add("threads_per_rank", ComputeThreads())
      .Add("blas", LoadedBlas())
      .AddRaw("strategy_bytes_rank0", JsonObject()
                                          .Add("params", stats.param_bytes)
                                          .Add("grads", stats.grad_bytes)
                                          .Add("optimizer_state", stats.optimizer_state_bytes)
                                          .Add("master", stats.master_bytes)
                                          .str())
      .Add("comm_bytes_basis", "mean over " + std::to_string(comm_steps_) + " optimizer steps");
  if (memory_estimate_) {
    summary.AddRaw("memory_estimate_per_rank",
                   JsonObject()
                       .Add("device_bytes", memory_estimate_->device_bytes)
                       .Add("host_bytes", memory_estimate_->host_bytes)
                       .Add("formula", memory_estimate_->formula)
                       .str());
  }
  summary.AddRaw("ranks", JsonArray(ranks));
  std::ofstream(run_dir_ / "summary.json") << summary.str() << "\n";
}

int Run::Execute() {
  const auto wall_start = Clock::now();
  Setup();
  if (env_.rank == 0) std::cout << FormatRunSummary(Summary()) << std::flush;
  progress_bar_ = env_.rank == 0 && StdoutReachesTerminal();
  const int64_t eval_every = GetInt(*job_.train, "eval_every");
  const int64_t ckpt_every = GetInt(*job_.checkpoint, "every");
  // Before any step, through the strategy's own save like every other checkpoint, so a step-0
  // checkpoint loads wherever the strategy's later ones do.
  if (start_step_ == 0 && GetBool(*job_.checkpoint, "at_start")) SaveCheckpoint(0);
  loop_start_ = Clock::now();
  // framework_step_peak_bytes: the steps' own peak, without the model as built before the
  // strategy took it over (which framework_peak_bytes includes).
  ResetFrameworkPeak();
  for (int64_t step = start_step_ + 1; step <= steps_; ++step) {
    const auto t0 = Clock::now();
    const CommBytes before = Counters();
    const double local_loss = StepLoss(step);
    cai_step_result result{};
    result.struct_size = CAI_STEP_RESULT_STRUCT_SIZE;
    ThrowIfError(strategy_.api->step(instance_, &result));
    ThrowIfError(strategy_.api->zero_grad(instance_));
    const CommBytes after = Counters();
    // One loss per replica counts: the global loss is the sum of the reporting ranks' shares.
    const double loss = SumOverRanks(layout_.reports_loss ? local_loss : 0.0);
    const double step_s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (step > start_step_ + 1 || steps_ - start_step_ == 1) step_times_.push_back(step_s);
    for (int op = 0; op < CAI_COMM_NUM_OPS; ++op) {
      handed_sum_[op] += after.handed.bytes[op] - before.handed.bytes[op];
      wire_sum_[op] += after.wire.bytes[op] - before.wire.bytes[op];
      unmeasured_calls_[op] += after.wire.unmeasured_calls[op] - before.wire.unmeasured_calls[op];
    }
    ++comm_steps_;
    if (!std::isfinite(loss)) {
      throw Error(CAI_ABORTED, "loss is " + std::to_string(loss) + " at step " +
                                   std::to_string(step) + "; lower optimizer.lr or use fp32");
    }
    last_loss_ = loss;
    if ((eval_every > 0 && step % eval_every == 0) || step == steps_) last_eval_ = Evaluate();
    if (env_.rank == 0) Report(step, loss, result, step_s);
    if ((ckpt_every > 0 && step % ckpt_every == 0) ||
        (step == steps_ && GetBool(*job_.checkpoint, "at_end"))) {
      SaveCheckpoint(step);
    }
  }
  WriteSummary(std::chrono::duration<double>(Clock::now() - wall_start).count());
  strategy_.api->destroy(instance_);
  instance_ = nullptr;
  // The strategy's memory is gone: the model must not keep pointing into it.
  model_->DetachStrategy();
  if (env_.rank == 0) {
    std::cout << "cai: trained " << steps_ << " steps with '" << strategy_.name << "' on "
              << env_.world_size << " rank(s); final loss " << std::fixed << std::setprecision(4)
              << last_loss_ << ", eval loss " << last_eval_ << "\n"
              << "cai: metrics in " << (run_dir_ / "metrics.jsonl").string() << ", summary in "
              << (run_dir_ / "summary.json").string() << ", checkpoints in "
              << (run_dir_ / "checkpoints").string() << "\n";
  }
  return 0;
}

// [memory]: the tiers' budgets and the NVMe directory, before anything is allocated for the
// run, so that the model's own weights count too.
void ApplyMemoryKeys(const JobConfig& job) {
  MemoryPool& pool = MemoryPool::Global();
  const cai_mem_tier tiers[] = {CAI_MEM_DEVICE, CAI_MEM_PINNED_HOST, CAI_MEM_HOST};
  for (size_t i = 0; i < std::size(kBudgetKeys); ++i) {
    try {
      pool.SetBudget(tiers[i], MemoryBudget(job, kBudgetKeys[i]));
    } catch (const Error& e) {
      throw Error(e.code(), std::string("memory.") + kBudgetKeys[i] + ": " + e.what());
    }
  }
  if (const std::string& dir = GetString(*job.memory, "nvme_dir"); !dir.empty()) {
    try {
      pool.SetNvmeDirectory(dir);
    } catch (const Error& e) {
      throw Error(e.code(), std::string("memory.nvme_dir: ") + e.what());
    }
  }
}

int RunRank(const TrainOptions& options, JobConfig job, const launch::RankEnv& env,
            const fs::path& run_dir) {
  // Every step allocates and frees the same activation buffers, and memory handed back to the
  // kernel is page-faulted in again on the next step (22% of a rank's cycles once). glibc's heap
  // keeps what it is given here: LibTorch's blocks under 1 MiB and other libraries' buffers
  // (Gloo's among them). Larger LibTorch blocks and the pool's come from the kernel instead,
  // through caches that bound what they keep: in this heap, freed between live allocations,
  // they stayed resident, gigabytes at a billion parameters that no count saw.
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
  // Before any thread starts and any tensor exists: LibTorch's own allocations (activations,
  // temporaries) are counted from here, for summary.json's framework_peak_bytes.
  InstallFrameworkAllocator();
  SetFrameworkCaching(GetBool(*job.train, "cpu_caching_allocator"));
  MemoryPool::SetHostReclaimer(&TrimFrameworkCache);
  // LibTorch's tensors count against the DEVICE tier's budget with the strategy's buffers.
  ChargeFrameworkTo(&MemoryPool::Global());
  const bool launched_locally = std::getenv("CAI_LAUNCHER") != nullptr;
  InitLogging(env.rank, CAI_LOG_INFO, !launched_locally);
  try {
    std::error_code ec;
    fs::create_directories(run_dir / "logs", ec);
    if (ec) {
      throw Error(CAI_PERMISSION_DENIED,
                  "run directory " + run_dir.string() + " cannot be created: " + ec.message());
    }
    AddLogFile((run_dir / "logs" / ("rank-" + std::to_string(env.rank) + ".log")).string());
    Log(CAI_LOG_INFO, "",
        "rank " + std::to_string(env.rank) + " of " + std::to_string(env.world_size) + " (pid " +
            std::to_string(getpid()) + ", joined through " + env.launcher + ")");
    ApplyMemoryKeys(job);
    CommOptions comm;
    comm.rank = env.rank;
    comm.world_size = env.world_size;
    comm.master_addr = env.master_addr;
    comm.master_port = env.master_port;
    comm.timeout = std::chrono::seconds(GetInt(*job.launch, "timeout_s"));
    comm.heartbeat_timeout = std::chrono::milliseconds(
        std::llround(1000 * GetFloat(*job.launch, "heartbeat_timeout_s")));
    comm.check_calls = GetBool(*job.launch, "check_calls");
    comm.lanes = static_cast<int>(GetInt(*job.launch, "comm_lanes"));
    comm.shared_memory = GetString(*job.launch, "comm_transport") == "auto";
    comm.socket_ifname = GetString(*job.launch, "socket_ifname");
    comm.on_peer_failure = [](const std::string& report) {
      // The training loop may be computing, not waiting on the communicator, for a long time:
      // exit from here. Checkpoints are written to a temporary directory and renamed when
      // complete, so the last complete one stays as it was.
      Log(CAI_LOG_ERROR, "",
          "lost a peer, stopping: " + report +
              ". The last complete checkpoint is intact (checkpoint.resume = true continues "
              "from it)");
      std::_Exit(1);
    };
    Communicator& communicator = Communicator::Init(comm);
    if (env.world_size > 1) {
      Log(CAI_LOG_INFO, "", "collectives bind to " + communicator.BindAddress());
      const std::string why_not = communicator.WhyNotSharedMemory(nullptr);
      Log(CAI_LOG_INFO, "",
          why_not.empty() ? "all_reduce, reduce_scatter and all_gather go through shared memory"
                          : "all_reduce, reduce_scatter and all_gather go over TCP, not through "
                            "shared memory (" +
                                why_not + ")");
    }
    int code = Run(options, std::move(job), env, run_dir).Execute();
    Communicator::Shutdown();
    return code;
  } catch (const std::exception& e) {
    if (launched_locally) {
      // The log file keeps it; the launcher prints it once for all the ranks that hit it.
      SetConsoleLogging(false);
      Log(CAI_LOG_ERROR, "", e.what());
      const std::string line = launch::RankErrorLine(e.what()) + "\n";
      std::fwrite(line.data(), 1, line.size(), stderr);
      std::fflush(stderr);
    } else {
      Log(CAI_LOG_ERROR, "", e.what());
    }
    // Other ranks may be waiting in a collective: the launcher (or the job scheduler) stops
    // them once this rank exits non-zero.
    std::_Exit(1);
  }
}

}  // namespace

int RunTrain(const TrainOptions& options) {
  JobConfig job = LoadJob(options.job_file, options.sets);
  // Before any rank starts, so that a misspelt table fails once, not once per rank.
  std::vector<std::string> installed;
  for (const PluginRecord& r : DiscoverPlugins(PluginSearchPath(options.plugin_paths))) {
    if (!r.manifest.name.empty()) installed.push_back(r.manifest.name);
  }
  const std::optional<launch::RankEnv> rank_env = launch::DetectRankEnv();
  for (const std::string& unused : CheckPluginTables(job, installed)) {
    if (!rank_env || rank_env->rank == 0) Log(CAI_LOG_WARN, "", unused);
  }
  fs::path run_dir = options.run_dir.empty() ? DefaultRunDir(options.job_file) : options.run_dir;
  // What each launched rank runs: this command again, with the run directory fixed so that
  // every rank writes to the same one.
  launch::LaunchOptions launch;
  launch.nproc = options.nproc > 0 ? options.nproc : static_cast<int>(GetInt(*job.launch, "nproc"));
  for (const fs::path& p : options.plugin_paths) {
    launch.args.push_back("--plugin-path");
    launch.args.push_back(fs::absolute(p).string());
  }
  launch.args.push_back("train");
  if (!options.job_file.empty()) launch.args.push_back(fs::absolute(options.job_file).string());
  launch.args.push_back("--run-dir");
  launch.args.push_back(fs::absolute(run_dir).string());
  for (const std::string& set : options.sets) {
    launch.args.push_back("--set");
    launch.args.push_back(set);
  }
  launch.env.emplace_back("CAI_LAUNCHER", "local");
  launch.master_addr = GetString(*job.launch, "master_addr");
  launch.master_port = static_cast<int>(GetInt(*job.launch, "master_port"));
  if (launch.nproc > 1 && !rank_env) {
    std::cerr << "cai: launching " << launch.nproc << " ranks; logs in "
              << (run_dir / "logs").string() << "\n";
  }
  return launch::RunOrLaunch(launch, [&](const launch::RankEnv& env) {
    return RunRank(options, std::move(job), env, run_dir);
  });
}

}  // namespace cai
