// Split backward (zero-bubble pipelines, Qi et al. 2023): the transformer blocks' linear
// projections compute their input gradient in backward and leave their weight gradient
// (dW = dYᵀ·X, db = Σ dY) to a later pass, which a pipeline schedule runs where a stage would
// otherwise wait. The projections keep X and receive dY; the deferred pass needs neither the
// weights nor anything else of the graph.
#pragma once

#include <torch/torch.h>

#include <vector>

namespace cai {

// One projection's deferred weight gradient. `weight` / `bias` are the parameters (undefined
// where frozen or absent).
struct DeferredLinear {
  torch::Tensor input, grad_output, weight, bias;
};
using WeightGradQueue = std::vector<DeferredLinear>;

// While alive, projections (Linear below) that build a graph on this thread defer their
// weight gradients to `queue`; null defers nothing. Scopes nest.
class DeferWeightGrads {
 public:
  explicit DeferWeightGrads(WeightGradQueue* queue);
  ~DeferWeightGrads();
  DeferWeightGrads(const DeferWeightGrads&) = delete;
  DeferWeightGrads& operator=(const DeferWeightGrads&) = delete;
  // The queue of the innermost scope on this thread (null outside any).
  static WeightGradQueue* Current();

 private:
  WeightGradQueue* saved_;
};

// x·wᵀ + b (torch::linear) with the parameters w and b (b may be undefined) cast to `compute`.
// Inside a DeferWeightGrads scope, when x requires grad, its backward computes only x's
// gradient and queues the weight's and bias's.
torch::Tensor Linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                     torch::ScalarType compute);

// dW = dYᵀ·X (and db = Σ dY) of one deferred projection, over every leading dimension, in
// the parameter's dtype.
torch::Tensor WeightGradient(const DeferredLinear& item);
torch::Tensor BiasGradient(const DeferredLinear& item);

}  // namespace cai
