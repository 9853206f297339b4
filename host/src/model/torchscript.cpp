// Networks loaded with torch::jit::load: parameters only, one opaque unit.
#include <torch/script.h>

#include <unordered_set>

#include "core/status.h"
#include "model/network.h"

namespace cai {
namespace {

class TorchScriptNetwork final : public Network {
 public:
  TorchScriptNetwork(torch::jit::Module module, std::string path)
      : module_(std::move(module)), path_(std::move(path)) {
    module_.train();
    // A tensor registered under several names is one parameter: the first name owns it.
    std::unordered_set<const c10::TensorImpl*> seen;
    UnitSpec unit{"model", CAI_UNIT_OTHER, {}};
    for (const auto& named : module_.named_parameters(/*recurse=*/true)) {
      if (!seen.insert(named.value.unsafeGetTensorImpl()).second) continue;
      const std::string& name = named.name;
      const size_t dot = name.rfind('.');
      const std::string leaf = dot == std::string::npos ? name : name.substr(dot + 1);
      unit.reads.push_back(static_cast<uint32_t>(params.size()));
      params.push_back(ParamSpec{name,
                                 dot == std::string::npos ? "" : name.substr(0, dot),
                                 named.value,
                                 0,
                                 CAI_ROLE_OTHER,
                                 -1,
                                 leaf == "bias",
                                 {},
                                 -1,
                                 1,
                                 0});
    }
    units.push_back(std::move(unit));
    for (const auto& named : module_.named_buffers(/*recurse=*/true)) {
      buffers.emplace_back(named.name, named.value);
    }
  }

  torch::Tensor Forward(size_t, const torch::Tensor& tokens) const override {
    c10::IValue out = module_.forward({tokens});
    if (!out.isTensor()) {
      throw Error(CAI_INVALID_ARGUMENT, "TorchScript model '" + path_ +
                                            "': forward must return a logits tensor [B, T, V], "
                                            "got " +
                                            out.tagKind());
    }
    torch::Tensor logits = out.toTensor();
    if (logits.dim() != 3 || logits.size(0) != tokens.size(0) || logits.size(1) != tokens.size(1)) {
      throw Error(CAI_INVALID_ARGUMENT, "TorchScript model '" + path_ +
                                            "': forward must return logits [B, T, V] for "
                                            "tokens [B, T]");
    }
    return logits;
  }

  std::string Describe() const override { return "torchscript " + path_; }
  bool CastsToComputeType() const override { return false; }

 private:
  // forward() is not const in the jit API, but running it does not change the module.
  mutable torch::jit::Module module_;
  std::string path_;
};

}  // namespace

std::unique_ptr<Network> LoadTorchScriptNetwork(const std::string& path) {
  torch::jit::Module module;
  try {
    module = torch::jit::load(path);
  } catch (const c10::Error& e) {
    throw Error(CAI_INVALID_ARGUMENT,
                "cannot load TorchScript model '" + path + "': " + e.what_without_backtrace());
  }
  if (!module.find_method("forward")) {
    throw Error(CAI_INVALID_ARGUMENT,
                "TorchScript model '" + path + "' has no forward(tokens) method");
  }
  return std::make_unique<TorchScriptNetwork>(std::move(module), path);
}

std::unique_ptr<Model> LoadTorchScriptModel(const std::string& path, const ParamOptions& options) {
  return MakeModel(LoadTorchScriptNetwork(path), options);
}

}  // namespace cai
