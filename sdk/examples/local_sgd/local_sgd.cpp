// local_sgd: local SGD (Lin et al., ICLR 2020) on the SDK's building blocks. Between syncs each
// rank steps on its own mean gradient, communicating nothing. Every sync_every-th step the ranks
// average weights and optimizer state, weighted by the rows each trained on since the last sync,
// then step on the global-batch gradient (the SUM over ranks: loss_weight divides by the global
// batch). Replicas agree after it, so sync_every = 1 is DDP exactly, with any optimizer.
#define CAI_TARGET_ABI_MINOR 0  // uses nothing newer than ABI 1.0: loads in every 1.x host
#include <cai/sdk.hpp>
#include <cai/sdk/collectives.hpp>
#include <cai/sdk/flat.hpp>
#include <cai/sdk/step.hpp>
#include <cmath>
#include <optional>

namespace {
namespace sdk = cai::sdk;

class LocalSgd {
 public:
  static constexpr const char* kName = "local_sgd";
  static constexpr const char* kVersion = "0.1.0";
  static constexpr uint64_t kCapabilities = CAI_CAP_PRECISION_FP32 | CAI_CAP_NO_SYNC;
  static std::span<const cai_config_key> ConfigKeys() {
    static constexpr cai_config_key kKeys[] = {
        sdk::IntKey("sync_every", "1", "Average replicas and take a global step every this many.",
                    1, 0, CAI_CONFIG_HAS_MIN)};
    return kKeys;
  }
  explicit LocalSgd(const cai_create_args& a) : every_(sdk::Config(a.config).Int("sync_every")) {}

  void Boost(const cai_boost_args& a) {  // fp32 only: the host refuses other precisions
    model_ = a.model;
    sdk::BroadcastModel(model_);
    replica_.emplace(model_, a.optimizer);
    epilogue_.emplace(a.optimizer);
  }
  void NoSync(bool) {}  // nothing is communicated before step anyway
  void ForwardBackward(const cai_micro_batch& b) {
    sdk::RunMicroBatch(model_, b, true);
    share_ += b.loss_weight;  // this rank's share of the step's global batch
  }
  void Evaluate(const cai_micro_batch& b) { sdk::RunMicroBatch(model_, b, false); }

  void Step(cai_step_result& result) {
    const bool sync = (epilogue_->step() + 1) % every_ == 0;
    if (sync && drifted_) Average();
    if (sync) sdk::RunCollective(CAI_COMM_ALL_REDUCE, nullptr, replica_->grads(), false);
    if (sync) replica_->AgreeOnUsed();  // torch.optim: update what got a gradient anywhere
    sdk::StepSums sums{replica_->GradSumSquares(), false, {}};
    if (sync) {
      const sdk::StepDecision d = epilogue_->Decide(sums, result, nullptr, /*agree=*/false);
      replica_->Update(d.step, d.grad_scale);
    } else {  // the local mean gradient is the local sum over this rank's share
      const double norm = std::sqrt(sums.sum_squares) / share_;
      replica_->Update(epilogue_->CountStep(result), epilogue_->ClipCoefficient(norm) / share_);
      period_share_ += share_;
      drifted_ = true;
    }
    share_ = 0;
  }
  void ZeroGrad() { replica_->ZeroGrad(); }

  // A checkpoint is a synchronisation point: every rank saves (and resumes) the average.
  void Save(const cai_checkpoint_args& args) {
    if (drifted_) Average();
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
  // Σ_r share_r·x_r / Σ_r share_r over the weights and every optimizer state slot.
  void Average() {
    double total[] = {period_share_};
    sdk::AllReduceValues(total);
    for (size_t k = 0; k <= replica_->num_state_slots(); ++k) {
      const cai_tensor t = k == 0 ? replica_->weights() : replica_->state(k - 1);
      sdk::RunKernel(CAI_KERNEL_SCALE, nullptr, t, period_share_ / total[0]);
      sdk::RunCollective(CAI_COMM_ALL_REDUCE, nullptr, t, false);
    }
    period_share_ = 0;
    drifted_ = false;
  }

  const int64_t every_;
  cai_model* model_ = nullptr;
  std::optional<sdk::FlatReplica> replica_;
  std::optional<sdk::StepEpilogue> epilogue_;
  double share_ = 0, period_share_ = 0;  // this step's, and the local steps' since a sync
  bool drifted_ = false;                 // replicas differ since the last sync
};
}  // namespace

CAI_PLUGIN(LocalSgd)
