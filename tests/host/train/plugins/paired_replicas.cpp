// A fixture strategy for the host's side of cai_plugin_api.parallel_layout (ABI 1.3): the
// world's ranks form replicas of two (data_parallel_size = world / 2, unless the key says
// otherwise), both ranks of a replica train on the same rows and compute the same thing, and
// only the even one reports its loss. Its step sums the reporting ranks' gradients over the
// world, so a run matches the single-process reference exactly when the host gives both ranks
// of a replica the same rows, splits the batch over the replicas and counts each replica's
// loss once. Built twice: paired_replicas (forward_backward per micro-batch) and
// paired_pipeline (FIXTURE_PIPELINE: the host must call execute_pipeline and never no_sync).
#include <cai/sdk.hpp>
#include <cai/sdk/collectives.hpp>
#include <cai/sdk/flat.hpp>
#include <cai/sdk/step.hpp>
#include <optional>
#include <string>

namespace {
namespace sdk = cai::sdk;

class PairedReplicas {
 public:
  static constexpr const char* kName = FIXTURE_NAME;
  static constexpr const char* kVersion = "0.1.0";
  static constexpr uint64_t kCapabilities =
      CAI_CAP_PRECISION_FP32 | CAI_CAP_NO_SYNC | (FIXTURE_PIPELINE ? CAI_CAP_PIPELINE : 0);
  static std::span<const cai_config_key> ConfigKeys() {
    static constexpr cai_config_key kKeys[] = {
        sdk::IntKey("data_parallel_size", "0",
                    "Replicas the layout reports; 0 = half the world (at least 1).", 0, 0,
                    CAI_CONFIG_HAS_MIN),
        sdk::BoolKey("pipelines", FIXTURE_PIPELINE ? "true" : "false",
                     "Whether the layout asks the host for execute_pipeline."),
        sdk::BoolKey("every_rank_reports", "false",
                     "Every rank reports its loss (a broken layout, for the host's check)."),
    };
    return kKeys;
  }
  explicit PairedReplicas(const cai_create_args& a)
      : rank_(a.rank),
        pipelines_(sdk::Config(a.config).Bool("pipelines")),
        every_rank_reports_(sdk::Config(a.config).Bool("every_rank_reports")) {
    const int64_t asked = sdk::Config(a.config).Int("data_parallel_size");
    dp_size_ = asked > 0 ? static_cast<int32_t>(asked) : std::max(1, a.world_size / 2);
    members_ = std::max(1, a.world_size / dp_size_);
  }

  void Boost(const cai_boost_args& a) {
    model_ = a.model;
    sdk::BroadcastModel(model_);
    replica_.emplace(model_, a.optimizer);
    epilogue_.emplace(a.optimizer);
  }
  void ParallelLayout(cai_parallel_layout& layout) {
    layout.data_parallel_rank = rank_ / members_;
    layout.data_parallel_size = dp_size_;
    layout.reports_loss = reports() || every_rank_reports_;
    layout.pipelines = pipelines_;
  }
  void NoSync(bool) {
    if (pipelines_) throw sdk::Error(CAI_FAILED_PRECONDITION, "no_sync called while pipelining");
  }
  void ForwardBackward(const cai_micro_batch& b) {
    if (pipelines_) {
      throw sdk::Error(CAI_FAILED_PRECONDITION, "forward_backward called while pipelining");
    }
    sdk::RunMicroBatch(model_, b, true);
  }
  // As a pipeline's last stage would: the micro-batches' losses where this rank reports them,
  // and their weighted sum.
  void ExecutePipeline(const cai_pipeline_args& a) {
    double sum = 0;
    for (int32_t i = 0; i < a.num_micro_batches; ++i) {
      cai_micro_batch b = a.micro_batches[i];
      double loss = 0;
      b.loss = &loss;
      sdk::RunMicroBatch(model_, b, true);
      if (reports() && a.micro_batches[i].loss) *a.micro_batches[i].loss = loss;
      sum += loss * b.loss_weight;
    }
    if (a.loss) *a.loss = reports() ? sum : -1.0;  // a non-reporting rank's value must not count
  }
  void Evaluate(const cai_micro_batch& b) { sdk::RunMicroBatch(model_, b, false); }

  // Both ranks of a replica hold the replica's gradient: one copy of each counts.
  void Step(cai_step_result& result) {
    if (!reports()) sdk::RunKernel(CAI_KERNEL_SCALE, nullptr, replica_->grads(), 0.0);
    sdk::RunCollective(CAI_COMM_ALL_REDUCE, nullptr, replica_->grads(), false);
    replica_->AgreeOnUsed();
    sdk::StepSums sums{replica_->GradSumSquares(), false, {}};
    const sdk::StepDecision d = epilogue_->Decide(sums, result, nullptr, /*agree=*/false);
    replica_->Update(d.step, d.grad_scale);
  }
  void ZeroGrad() { replica_->ZeroGrad(); }
  void Save(const cai_checkpoint_args& args) {
    if (sdk::GroupRank(nullptr) != 0) return;
    replica_->Save(args);
    if (args.optimizer) epilogue_->Save(args.checkpoint, kName);
  }
  void Load(const cai_checkpoint_args& args) {
    replica_->Load(args);
    if (args.optimizer) epilogue_->Load(args.checkpoint, kName);
  }
  void Stats(cai_strategy_stats& s) { replica_->AddStats(s); }

 private:
  bool reports() const { return rank_ % members_ == 0; }

  const int32_t rank_;
  const bool pipelines_, every_rank_reports_;
  int32_t dp_size_ = 1, members_ = 1;
  cai_model* model_ = nullptr;
  std::optional<sdk::FlatReplica> replica_;
  std::optional<sdk::StepEpilogue> epilogue_;
};
}  // namespace

CAI_PLUGIN(PairedReplicas)
