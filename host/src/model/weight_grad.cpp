#include "model/weight_grad.h"

#include <cstdint>

namespace cai {
namespace {

thread_local WeightGradQueue* current_queue = nullptr;

// The parameters travel outside autograd's inputs: were they inputs, backward would hand
// their accumulators an undefined gradient, which still fires the hooks a strategy counts
// gradients with (GRAD_READY) before the gradient exists.
struct Params {
  torch::Tensor weight, bias;
  torch::ScalarType compute;
};

torch::Tensor Cast(const torch::Tensor& t, torch::ScalarType compute) {
  return !t.defined() || t.scalar_type() == compute ? t : t.to(compute);
}

struct DeferredLinearFunction : torch::autograd::Function<DeferredLinearFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x,
                               const Params& params, WeightGradQueue* queue) {
    const torch::Tensor w = Cast(params.weight, params.compute);
    ctx->save_for_backward({x});
    ctx->saved_data["weight"] = params.weight;
    ctx->saved_data["cast_weight"] = w;
    if (params.bias.defined()) ctx->saved_data["bias"] = params.bias;
    // The context stores IValues; the queue outlives the graph (the stage's activation owns
    // both).
    ctx->saved_data["queue"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(queue));
    return torch::linear(x, w, Cast(params.bias, params.compute));
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const torch::Tensor x = ctx->get_saved_variables()[0];
    const torch::Tensor w = ctx->saved_data["weight"].toTensor();
    const torch::Tensor cast_w = ctx->saved_data["cast_weight"].toTensor();
    const torch::Tensor& dy = grad_outputs[0];
    auto* queue =
        reinterpret_cast<WeightGradQueue*>(static_cast<intptr_t>(ctx->saved_data["queue"].toInt()));
    DeferredLinear item;
    item.input = x.detach();
    item.grad_output = dy.detach();
    if (w.requires_grad()) item.weight = w;
    if (ctx->saved_data.count("bias") && ctx->saved_data["bias"].toTensor().requires_grad()) {
      item.bias = ctx->saved_data["bias"].toTensor();
    }
    if (item.weight.defined() || item.bias.defined()) queue->push_back(std::move(item));
    return {dy.matmul(cast_w), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

DeferWeightGrads::DeferWeightGrads(WeightGradQueue* queue) : saved_(current_queue) {
  current_queue = queue;
}
DeferWeightGrads::~DeferWeightGrads() { current_queue = saved_; }
WeightGradQueue* DeferWeightGrads::Current() { return current_queue; }

torch::Tensor Linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                     torch::ScalarType compute) {
  WeightGradQueue* queue = current_queue;
  // Without a graph through x there is no input gradient to split from (and x would not carry
  // the weight's requires_grad to the output).
  if (queue == nullptr || !torch::GradMode::is_enabled() || !x.requires_grad()) {
    return torch::linear(x, Cast(w, compute), Cast(b, compute));
  }
  return DeferredLinearFunction::apply(x, Params{w, b, compute}, queue);
}

torch::Tensor WeightGradient(const DeferredLinear& item) {
  const int64_t out = item.grad_output.size(-1), in = item.input.size(-1);
  return item.grad_output.reshape({-1, out})
      .t()
      .mm(item.input.reshape({-1, in}))
      .to(item.weight.scalar_type());
}

torch::Tensor BiasGradient(const DeferredLinear& item) {
  return item.grad_output.reshape({-1, item.grad_output.size(-1)})
      .sum(0)
      .to(item.bias.scalar_type());
}

}  // namespace cai
