#include "script_gpt.h"

#include <torch/script.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <stdexcept>

namespace cai::testing {
namespace {

torch::Tensor Init(std::vector<int64_t> shape, double std) {
  return (torch::randn(shape) * std).requires_grad_(true);
}

// Every module gets its own class name: TorchScript types are per class, not per instance.
std::string Unique(const std::string& base) {
  static int counter = 0;
  return base + std::to_string(counter++);
}

// nn.Linear's layout: weight [out, in], read by aten::linear.
torch::jit::Module Linear(int64_t in, int64_t out, bool bias = true) {
  torch::jit::Module m(Unique("Linear"));
  m.register_parameter("weight", Init({out, in}, 0.02), false);
  if (bias) {
    m.register_parameter("bias", torch::zeros({out}).requires_grad_(true), false);
    m.define(R"JIT(
def forward(self, x):
    return torch.linear(x, self.weight, self.bias)
)JIT");
  } else {
    m.define(R"JIT(
def forward(self, x):
    return torch.linear(x, self.weight)
)JIT");
  }
  return m;
}

torch::jit::Module LayerNorm(int64_t c) {
  torch::jit::Module m(Unique("LayerNorm"));
  m.register_parameter("weight", torch::ones({c}).requires_grad_(true), false);
  m.register_parameter("bias", torch::zeros({c}).requires_grad_(true), false);
  m.define(R"JIT(
def forward(self, x):
    return torch.layer_norm(x, [x.size(-1)], self.weight, self.bias, 1e-5)
)JIT");
  return m;
}

}  // namespace

std::string SaveScriptGpt(const std::string& path, const ScriptGptShape& s) {
  torch::manual_seed(7);
  const int64_t c = s.n_embd;
  torch::jit::Module gpt(Unique("ScriptGpt"));
  gpt.register_parameter("wte", Init({s.vocab, c}, 0.02), false);
  gpt.register_parameter("wpe", Init({s.n_ctx, c}, 0.01), false);
  torch::jit::Module blocks(Unique("Blocks"));
  for (int64_t l = 0; l < s.n_layer; ++l) {
    torch::jit::Module attn(Unique("Attention"));
    attn.register_attribute("n_head", c10::IntType::get(), s.n_head);
    // No q/k/v bias: the key bias's gradient is zero in exact arithmetic (softmax ignores a
    // shift shared by a row), so AdamW would turn rounding noise into full-size updates that
    // differ between any two summation orders.
    attn.register_module("qkv", Linear(c, 3 * c, /*bias=*/false));
    attn.register_module("proj", Linear(c, c));
    // The width per head comes from the local projection, so only n_head needs dividing.
    attn.define(R"JIT(
def forward(self, x):
    B = x.size(0)
    T = x.size(1)
    qkv = self.qkv.forward(x)
    q, k, v = qkv.chunk(3, -1)
    q = q.view(B, T, self.n_head, -1).transpose(1, 2)
    k = k.view(B, T, self.n_head, -1).transpose(1, 2)
    v = v.view(B, T, self.n_head, -1).transpose(1, 2)
    scores = torch.matmul(q, k.transpose(-2, -1)) / (q.size(-1) ** 0.5)
    future = torch.ones(T, T).tril() == 0
    scores = scores.masked_fill(future, float("-inf"))
    y = torch.matmul(torch.softmax(scores, -1), v)
    return self.proj.forward(y.transpose(1, 2).contiguous().view(B, T, -1))
)JIT");
    torch::jit::Module mlp(Unique("Mlp"));
    mlp.register_module("fc", Linear(c, 4 * c));
    mlp.register_module("proj", Linear(4 * c, c));
    mlp.define(R"JIT(
def forward(self, x):
    return self.proj.forward(torch.gelu(self.fc.forward(x), approximate="tanh"))
)JIT");
    torch::jit::Module block(Unique("Block"));
    block.register_module("ln1", LayerNorm(c));
    block.register_module("attn", attn);
    block.register_module("ln2", LayerNorm(c));
    block.register_module("mlp", mlp);
    block.define(R"JIT(
def forward(self, x):
    x = x + self.attn.forward(self.ln1.forward(x))
    return x + self.mlp.forward(self.ln2.forward(x))
)JIT");
    blocks.register_module("l" + std::to_string(l), block);
  }
  std::string calls;
  for (int64_t l = 0; l < s.n_layer; ++l) {
    calls += "    h = self.blocks.l" + std::to_string(l) + ".forward(h)\n";
  }
  gpt.register_module("blocks", blocks);
  gpt.register_module("ln_f", LayerNorm(c));
  torch::jit::Module head(Unique("Head"));
  if (s.head == "transposed") {
    head.register_parameter("weight", Init({s.vocab, c}, 0.02), false);
  } else {
    head.register_parameter("weight", Init({c, s.vocab}, 0.02), false);
  }
  head.register_parameter("bias", Init({s.vocab}, 0.02), false);
  gpt.register_module("head", head);
  const std::string logits = s.head == "transposed"
                                 ? "torch.matmul(h, self.head.weight.t()) + self.head.bias"
                                 : "torch.matmul(h, self.head.weight) + self.head.bias";
  gpt.define(
      "def forward(self, tokens):\n"
      "    positions = torch.arange(tokens.size(1))\n"
      "    h = torch.embedding(self.wte, tokens) + torch.embedding(self.wpe, positions)\n" +
      calls + "    h = self.ln_f.forward(h)\n    return " + logits + "\n");
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  gpt.save(path);
  return path;
}

std::string WriteText(const std::string& path, const std::string& text) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream out(path);
  out << text;
  if (!out.flush()) throw std::runtime_error("cannot write " + path);
  return path;
}

}  // namespace cai::testing
