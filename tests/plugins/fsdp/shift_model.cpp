#include "shift_model.h"

#include <torch/script.h>
#include <torch/torch.h>

namespace cai::testing {

void SaveShiftModel(const std::filesystem::path& path, const std::string& round_to) {
  torch::manual_seed(0);
  torch::Tensor shift = 1000.0 + (torch::rand({32}) - 0.5);
  if (!round_to.empty()) shift = shift.to(round_to == "bf16" ? torch::kBFloat16 : torch::kHalf);
  torch::jit::Module head("Head");
  head.register_parameter("weight", (torch::randn({32, 256}) * 0.1).requires_grad_(true), false);
  head.register_parameter("bias", torch::zeros({256}).requires_grad_(true), false);
  torch::jit::Module lm("ShiftLM");
  lm.register_parameter("emb", (torch::randn({256, 32}) * 0.1).requires_grad_(true), false);
  lm.register_buffer("shift", shift.to(torch::kFloat));
  lm.register_module("head", head);
  lm.define(R"JIT(
def forward(self, tokens):
    h = torch.tanh(torch.embedding(self.emb, tokens) + (self.shift - 1000.0))
    return torch.matmul(h, self.head.weight) + self.head.bias
)JIT");
  std::filesystem::create_directories(path.parent_path());
  lm.save(path.string());
}

}  // namespace cai::testing
