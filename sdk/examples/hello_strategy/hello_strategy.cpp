// hello_strategy: the smallest complete data-parallel strategy, as a template for plugin
// authors. Every rank holds the whole model; after the last micro-batch of a step each
// gradient is summed across ranks with one blocking all-reduce, then every rank applies the
// same update. (libcai_ddp does the same with buckets overlapped with backward.)
//
// It builds for ABI 1.0 hosts: nothing newer than 1.0 is required.
#define CAI_TARGET_ABI_MINOR 0
#include <cai/sdk.hpp>
#include <cmath>
#include <string>
#include <vector>

namespace {

using cai::sdk::Check;
using cai::sdk::Host;

class HelloStrategy {
 public:
  static constexpr const char* kName = "hello_strategy";
  static constexpr const char* kVersion = "0.1.0";
  static constexpr uint64_t kCapabilities = CAI_CAP_PRECISION_FP32 | CAI_CAP_NO_SYNC;

  static std::span<const cai_config_key> ConfigKeys() {
    static constexpr cai_config_key kKeys[] = {
        cai::sdk::IntKey("broadcast_from", "0",
                         "Rank whose initial parameters every rank starts from.", 0, 0,
                         CAI_CONFIG_HAS_MIN),
        cai::sdk::IntKey("timeout_ms", "600000",
                         "Milliseconds a collective may take before the step fails.", 1, 0,
                         CAI_CONFIG_HAS_MIN),
    };
    return kKeys;
  }

  explicit HelloStrategy(const cai_create_args& args)
      : root_(static_cast<int32_t>(cai::sdk::Config(args.config).Int("broadcast_from"))),
        timeout_ms_(cai::sdk::Config(args.config).Int("timeout_ms")) {
    if (root_ >= args.world_size) {
      throw cai::sdk::Error(CAI_INVALID_ARGUMENT, "broadcast_from = " + std::to_string(root_) +
                                                      " but there are only " +
                                                      std::to_string(args.world_size) + " ranks");
    }
  }

  void Boost(const cai_boost_args& args) {
    if (args.precision != CAI_PRECISION_FP32) {
      throw cai::sdk::Error(CAI_UNIMPLEMENTED,
                            "hello_strategy trains in fp32 only; set train.precision = \"fp32\" "
                            "or use the ddp strategy for bf16/fp16");
    }
    model_ = args.model;
    optimizer_ = args.optimizer;
    const auto& model = *Host().model;
    for (uint32_t i = 0; i < model.num_params(model_); ++i) {
      cai_param_info info{};
      info.struct_size = CAI_PARAM_INFO_STRUCT_SIZE;
      Check(model.param_info(model_, i, &info));
      if (info.tied_to >= 0) continue;  // shares storage with a parameter already handled
      cai_tensor data{};
      Check(model.param_data(model_, i, &data));
      Collective(CAI_COMM_BROADCAST, data);
      if (info.flags & CAI_PARAM_REQUIRES_GRAD) {
        Param p{i, info.group, static_cast<size_t>(info.numel), {}};
        cai_optim_group_info group{};
        group.struct_size = CAI_OPTIM_GROUP_INFO_STRUCT_SIZE;
        Check(Host().optimizer->group_info(optimizer_, p.group, &group));
        for (uint32_t s = 0; s < group.state_slots; ++s) {
          p.state.push_back(cai::sdk::Buffer::Alloc(CAI_MEM_DEVICE, p.numel * sizeof(float),
                                                    "hello.optimizer_state", true));
        }
        params_.push_back(std::move(p));
      }
    }
  }

  // Communication happens only in Step(), so accumulating micro-batches never communicates:
  // there is nothing for no_sync to skip.
  void NoSync(bool) {}

  void ForwardBackward(const cai_micro_batch& batch) {
    cai::sdk::RunMicroBatch(model_, batch, /*backward=*/true);
  }

  void Evaluate(const cai_micro_batch& batch) {
    cai::sdk::RunMicroBatch(model_, batch, /*backward=*/false);
  }

  void Step(cai_step_result& result) {
    const auto& model = *Host().model;
    const auto& optim = *Host().optimizer;
    // Sum gradients (the host weights each rank's loss by its share of the global batch, so the
    // sum is the global mean's gradient, also when ranks hold unequal shares), and sum their
    // squares for the global norm (the same on every rank after the all-reduce, so no second
    // collective is needed).
    double sum_squares = 0;
    std::vector<cai_tensor> grads(params_.size());
    for (size_t k = 0; k < params_.size(); ++k) {
      cai_status* missing = model.param_grad(model_, params_[k].index, &grads[k]);
      if (missing) {  // no gradient this step (unused parameter): treat as zero
        Host().status_destroy(missing);
        grads[k].data = nullptr;
        continue;
      }
      Collective(CAI_COMM_ALL_REDUCE, grads[k]);
      double sq = 0;
      cai::sdk::RunKernel(CAI_KERNEL_SUM_SQUARES, nullptr, grads[k], 0, &sq);
      sum_squares += sq;
    }
    const double norm = std::sqrt(sum_squares);
    const double clip = optim.clip_coefficient(optimizer_, norm);
    ++step_;
    for (size_t k = 0; k < params_.size(); ++k) {
      if (!grads[k].data) continue;
      Param& p = params_[k];
      cai_tensor data{};
      Check(model.param_data(model_, p.index, &data));
      cai_optim_update_args update{};
      update.struct_size = CAI_OPTIM_UPDATE_ARGS_STRUCT_SIZE;
      update.optimizer = optimizer_;
      update.group = p.group;
      update.param = static_cast<float*>(data.data);
      update.grad = grads[k].data;
      update.grad_dtype = grads[k].dtype;
      for (size_t s = 0; s < p.state.size(); ++s) {
        update.state[s] = static_cast<float*>(p.state[s].data());
      }
      update.numel = p.numel;
      update.step = step_;
      update.lr = optim.lr_at(optimizer_, p.group, step_);
      update.grad_scale = clip;
      update.device = data.device;
      Check(optim.update(&update));
    }
    result.skipped = false;
    result.grad_norm = norm;
    result.loss_scale = 1;
    result.lr = optim.lr_at(optimizer_, 0, step_);
  }

  void ZeroGrad() { Check(Host().model->zero_grad(model_, false)); }

  // Replicated state: rank 0 writes it, every rank reads it. The step count goes with the
  // optimizer state: Adam's bias correction depends on it.
  void Save(const cai_checkpoint_args& args) {
    if (Host().comm->rank(nullptr) != 0) return;
    ForEachState(args, [&](const char* name, const cai_tensor& t) {
      Check(Host().checkpoint->write_tensor(args.checkpoint, name, &t));
    });
    if (args.optimizer) {
      Check(Host().checkpoint->write_meta(args.checkpoint, "hello_strategy.step",
                                          std::to_string(step_).c_str()));
    }
  }
  void Load(const cai_checkpoint_args& args) {
    ForEachState(args, [&](const char* name, const cai_tensor& t) {
      Check(Host().checkpoint->read_tensor(args.checkpoint, name, 0, 0, &t));
    });
    if (args.optimizer) {
      const char* step = nullptr;
      Check(Host().checkpoint->read_meta(args.checkpoint, "hello_strategy.step", &step));
      step_ = std::stoll(step);
    }
  }

  void Stats(cai_strategy_stats& stats) {
    for (const Param& p : params_) {
      stats.param_bytes += p.numel * sizeof(float);
      stats.grad_bytes += p.numel * sizeof(float);
      for (const auto& s : p.state) stats.optimizer_state_bytes += s.size();
    }
  }

  // Full replica: parameters, gradients and optimizer state all 4 bytes per element.
  static void EstimateMemory(const cai_memory_estimate_args& args, cai_memory_estimate& out) {
    const uint64_t psi = static_cast<uint64_t>(args.num_params);
    out.param_bytes = 4 * psi;
    out.grad_bytes = 4 * psi;
    out.optimizer_state_bytes = 4ull * args.optimizer_state_slots * psi;
    out.device_bytes = out.param_bytes + out.grad_bytes + out.optimizer_state_bytes;
    out.formula = "(4 + 4 + 4k)Ψ, k = optimizer state slots";
  }

 private:
  struct Param {
    uint32_t index;
    uint32_t group;
    size_t numel;
    std::vector<cai::sdk::Buffer> state;
  };

  void Collective(cai_comm_op op, const cai_tensor& tensor) {
    cai_comm_args args{};
    args.struct_size = CAI_COMM_ARGS_STRUCT_SIZE;
    args.op = op;
    args.reduce_op = CAI_REDUCE_SUM;
    args.output = &tensor;
    args.root = root_;
    args.timeout_ms = timeout_ms_;
    Check(Host().comm->run(&args, nullptr));
  }

  template <class F>
  void ForEachState(const cai_checkpoint_args& args, F&& fn) {
    const auto& model = *Host().model;
    for (Param& p : params_) {
      cai_param_info info{};
      info.struct_size = CAI_PARAM_INFO_STRUCT_SIZE;
      Check(model.param_info(model_, p.index, &info));
      if (args.model) {
        cai_tensor data{};
        Check(model.param_data(model_, p.index, &data));
        fn(("model/" + std::string(info.name)).c_str(), data);
      }
      if (args.optimizer) {
        for (size_t s = 0; s < p.state.size(); ++s) {
          int64_t numel = static_cast<int64_t>(p.numel);
          int64_t stride = 1;
          cai_tensor t{p.state[s].data(),
                       {CAI_DEVICE_CPU, 0},
                       1,
                       {CAI_DTYPE_FLOAT, 32, 1},
                       &numel,
                       &stride,
                       0};
          fn(("optim/" + std::string(info.name) + "/" + std::to_string(s)).c_str(), t);
        }
      }
    }
  }

  int32_t root_;
  int64_t timeout_ms_;
  cai_model* model_ = nullptr;
  cai_optimizer* optimizer_ = nullptr;
  std::vector<Param> params_;
  int64_t step_ = 0;
};

}  // namespace

CAI_PLUGIN(HelloStrategy)
