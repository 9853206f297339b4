// Networks loaded with torch::jit::load: parameters only, one opaque unit; tensor parallelism
// from a policy file that names the Linear modules to split (Shardformer's custom policies).
#include <toml++/toml.h>
#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/passes/inliner.h>
#include <torch/script.h>

#include <map>
#include <optional>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "core/status.h"
#include "model/network.h"
#include "model/tensor_parallel.h"

namespace cai {

using torch::jit::Node;
using torch::jit::Value;

namespace {

// The ops a policy inserts into a TorchScript forward; `group` is the tp::Handle of the
// network's TensorParallelGroup, which outlives the graph.
torch::Tensor ScriptCopy(const torch::Tensor& x, int64_t group) {
  return tp::CopyToGroup(x, tp::GroupOf(group));
}
torch::Tensor ScriptReduce(const torch::Tensor& x, int64_t group) {
  return tp::ReduceFromGroup(x, tp::GroupOf(group));
}
torch::Tensor ScriptGather(const torch::Tensor& x, int64_t group) {
  return tp::GatherLastDim(x, tp::GroupOf(group));
}

TORCH_LIBRARY_FRAGMENT(cai, m) {
  m.def("tp_copy(Tensor x, int group) -> Tensor", &ScriptCopy);
  m.def("tp_reduce(Tensor x, int group) -> Tensor", &ScriptReduce);
  m.def("tp_gather(Tensor x, int group) -> Tensor", &ScriptGather);
}

// What a policy file says (docs: README, "TorchScript models under tensor parallelism").
struct Policy {
  std::string path;
  std::vector<std::string> column, row, heads, gather_output;
  std::vector<std::pair<std::string, int64_t>> fused;  // pattern, blocks
};

[[noreturn]] void PolicyError(const std::string& path, const std::string& what) {
  throw Error(CAI_INVALID_ARGUMENT, "tensor-parallel policy '" + path + "': " + what);
}

Policy ReadPolicy(const std::string& path) {
  Policy policy;
  policy.path = path;
  toml::table root;
  try {
    root = toml::parse_file(path);
  } catch (const toml::parse_error& err) {
    PolicyError(path, "malformed TOML at line " + std::to_string(err.source().begin.line) +
                          ", column " + std::to_string(err.source().begin.column) + ": " +
                          std::string(err.description()));
  }
  const std::map<std::string, std::vector<std::string>*> lists = {
      {"column", &policy.column},
      {"row", &policy.row},
      {"heads", &policy.heads},
      {"gather_output", &policy.gather_output}};
  for (const auto& [key, node] : root) {
    const std::string name(key.str());
    if (name == "fused") {
      const toml::table* fused = node.as_table();
      if (!fused) PolicyError(path, "fused must be a table of module pattern = block count");
      for (const auto& [pattern, blocks] : *fused) {
        const std::optional<int64_t> n = blocks.value<int64_t>();
        if (!blocks.is_integer() || !n || *n < 1) {
          PolicyError(path, "fused.\"" + std::string(pattern.str()) +
                                "\" must be a positive integer (3 for a fused q, k, v)");
        }
        policy.fused.emplace_back(std::string(pattern.str()), *n);
      }
      continue;
    }
    auto list = lists.find(name);
    if (list == lists.end()) {
      PolicyError(path, "unknown key '" + name +
                            "'; a policy has column, row, heads, gather_output and [fused]");
    }
    const toml::array* array = node.as_array();
    if (!array || !array->is_homogeneous(toml::node_type::string)) {
      PolicyError(path, name + " must be an array of strings (module or attribute patterns)");
    }
    for (const toml::node& item : *array) list->second->push_back(**item.as_string());
  }
  if (policy.column.empty() && policy.row.empty()) {
    PolicyError(path, "names no column- or row-parallel module; nothing to split");
  }
  return policy;
}

// Every node of `block` and of the blocks nested in it, in program order.
void CollectNodes(torch::jit::Block* block, std::vector<Node*>& out) {
  for (Node* node : block->nodes()) {
    out.push_back(node);
    for (torch::jit::Block* inner : node->blocks()) CollectNodes(inner, out);
  }
}

std::string Join(const std::string& path, const std::string& leaf) {
  return path.empty() ? leaf : path + "." + leaf;
}

class TorchScriptNetwork final : public Network {
 public:
  TorchScriptNetwork(torch::jit::Module module, std::string path, std::optional<Policy> policy)
      : module_(std::move(module)), path_(std::move(path)), policy_(std::move(policy)) {
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
                                 0,
                                 {}});
    }
    units.push_back(std::move(unit));
    for (const auto& named : module_.named_buffers(/*recurse=*/true)) {
      buffers.emplace_back(named.name, named.value);
    }
    if (policy_) MatchPolicy();
    graph_ = module_.get_method("forward").graph()->copy();
    torch::jit::Inline(*graph_);
    forward_ = Executable(graph_->copy());
  }

  torch::Tensor Forward(size_t, const torch::Tensor& tokens) const override {
    torch::jit::Stack stack{module_._ivalue(), tokens};
    try {
      forward_->run(stack);
    } catch (const c10::Error& e) {
      if (tp_.size == 1) throw;
      throw Error(CAI_INVALID_ARGUMENT,
                  "TorchScript model '" + path_ + "' failed under the tensor-parallel policy '" +
                      policy_->path + "' (tp " + std::to_string(tp_.size) +
                      "); a split module's output must reach a row-parallel module or be "
                      "gathered, and every width the forward computes from an attribute must "
                      "be listed in heads: " +
                      e.what_without_backtrace());
    }
    const c10::IValue& out = stack.back();
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

  std::string Describe() const override {
    return "torchscript " + path_ +
           (policy_ ? " (tensor-parallel policy " + policy_->path + ")" : "");
  }
  bool CastsToComputeType() const override { return false; }

  // The vocabulary options are the zoo's: a policy gathers logits with gather_output.
  void ApplyTensorParallel(TensorParallelGroup group,
                           const TensorParallelOptions& options) override {
    if (options.sequence_parallel) {
      throw Error(CAI_UNIMPLEMENTED,
                  "apply_tensor_parallel: sequence parallelism needs to know which ops of the "
                  "forward run on sequence shards; TorchScript models ('" +
                      path_ + "') split under a policy without it");
    }
    if (!policy_) {
      throw Error(CAI_UNIMPLEMENTED,
                  "apply_tensor_parallel: TorchScript model '" + path_ +
                      "' has no tensor-parallel policy; name its column- and row-parallel "
                      "Linears and its head counts in a policy file and set model.tp_policy "
                      "(README: \"TorchScript models under tensor parallelism\")");
    }
    if (tp_.size > 1) {
      throw Error(CAI_FAILED_PRECONDITION,
                  "apply_tensor_parallel: tensor parallelism is already applied to this model");
    }
    std::shared_ptr<torch::jit::Graph> graph = graph_->copy();
    RewriteAndSlice(*graph, group);
    tp_ = std::move(group);
    for (ParamSpec& p : params) {
      if (p.global_shape.empty()) p.global_shape = p.tensor.sizes().vec();
    }
    forward_ = Executable(std::move(graph));
  }

 private:
  struct Split {
    std::string module;  // the Linear's path; its parameters are module.weight, module.bias
    bool column = false, gather = false;
    int64_t blocks = 1;
  };

  [[noreturn]] void Fail(const std::string& what) const {
    PolicyError(policy_->path, what + " (model '" + path_ + "')");
  }

  ParamSpec* Param(const std::string& name) {
    for (ParamSpec& p : params) {
      if (p.name == name) return &p;
    }
    return nullptr;
  }

  // Resolves the policy's patterns against the module: which Linears split, and how. Run at
  // load so a policy that does not fit fails before any rank starts.
  void MatchPolicy() {
    std::vector<std::string> modules;  // paths with a parameter named path.weight
    for (const ParamSpec& p : params) {
      if (p.name == Join(p.module_path, "weight")) {
        modules.push_back(p.module_path);
      }
    }
    auto matching = [&](const std::string& key, size_t index, const std::string& pattern) {
      std::vector<std::string> hits;
      for (const std::string& m : modules) {
        if (GlobMatch(pattern, m)) hits.push_back(m);
      }
      if (hits.empty()) {
        std::string some;
        for (size_t i = 0; i < modules.size() && i < 6; ++i) some += (i ? ", " : "") + modules[i];
        Fail(key + "[" + std::to_string(index) + "] = \"" + pattern +
             "\" matches no module with a parameter named <module>.weight; modules with one: " +
             (some.empty() ? "none" : some + (modules.size() > 6 ? ", ..." : "")));
      }
      return hits;
    };
    std::map<std::string, Split> splits;
    for (bool column : {true, false}) {
      const std::vector<std::string>& patterns = column ? policy_->column : policy_->row;
      const char* key = column ? "column" : "row";
      for (size_t i = 0; i < patterns.size(); ++i) {
        for (const std::string& m : matching(key, i, patterns[i])) {
          auto [it, fresh] = splits.emplace(m, Split{m, column});
          if (!fresh && it->second.column != column) {
            Fail("module '" + m + "' is both column- and row-parallel; name it in one list");
          }
        }
      }
    }
    auto column_only = [&](const std::string& key, size_t index, const std::string& pattern) {
      std::vector<Split*> hits;
      for (const std::string& m : matching(key, index, pattern)) {
        auto it = splits.find(m);
        if (it == splits.end() || !it->second.column) {
          Fail(key + " \"" + pattern + "\" matches '" + m +
               "', which is not column-parallel; list it under column too");
        }
        hits.push_back(&it->second);
      }
      return hits;
    };
    for (size_t i = 0; i < policy_->gather_output.size(); ++i) {
      for (Split* s : column_only("gather_output", i, policy_->gather_output[i])) s->gather = true;
    }
    for (const auto& [pattern, blocks] : policy_->fused) {
      for (Split* s : column_only("fused", 0, pattern)) s->blocks = blocks;
    }
    for (auto& [m, split] : splits) splits_.push_back(split);
    // Integer attributes divided by the group's size (head counts, split widths).
    for (size_t i = 0; i < policy_->heads.size(); ++i) {
      bool matched = false;
      for (const auto& attr : module_.named_attributes(/*recurse=*/true)) {
        if (!GlobMatch(policy_->heads[i], attr.name)) continue;
        if (!attr.value.isInt()) {
          Fail("heads[" + std::to_string(i) + "] matches attribute '" + attr.name + "', a " +
               attr.value.tagKind() + "; heads names integer attributes (head counts, widths)");
        }
        heads_.push_back(attr.name);
        matched = true;
      }
      if (!matched) {
        Fail("heads[" + std::to_string(i) + "] = \"" + policy_->heads[i] +
             "\" matches no attribute of the module (attributes annotated Final are compiled "
             "into the code as constants and cannot be divided: make them plain attributes)");
      }
    }
  }

  // The values that read each attribute of the module ("blocks.l0.attn.qkv.weight"), following
  // GetAttr chains from self.
  static std::unordered_map<std::string, std::vector<Value*>> AttributeReads(
      torch::jit::Graph& graph) {
    std::unordered_map<std::string, std::vector<Value*>> reads;
    std::unordered_map<const Value*, std::string> paths{{graph.inputs()[0], ""}};  // modules
    std::vector<Node*> nodes;
    CollectNodes(graph.block(), nodes);
    for (Node* node : nodes) {
      if (node->kind() != c10::prim::GetAttr) continue;
      auto owner = paths.find(node->input(0));
      if (owner == paths.end()) continue;
      const std::string path = Join(owner->second, node->s(c10::attr::name));
      if (node->output()->type()->cast<c10::ClassType>()) {
        paths.emplace(node->output(), path);
      } else {
        reads[path].push_back(node->output());
      }
    }
    return reads;
  }

  // The simple executor runs the graph as the interpreter reads it, each op's backward being its
  // eager autograd formula, as eager PyTorch computes it: the profiling executor builds
  // differentiable subgraphs with their own gradient formulas, cut differently around the
  // inserted collectives than in the unsplit model.
  static std::unique_ptr<torch::jit::GraphFunction> Executable(
      std::shared_ptr<torch::jit::Graph> graph) {
    return std::make_unique<torch::jit::GraphFunction>(c10::QualifiedName("__cai__.forward"),
                                                       std::move(graph), nullptr,
                                                       torch::jit::ExecutorExecutionMode::SIMPLE);
  }

  // Slicing uses the group's rank and size, which `tp_` holds only once everything succeeded;
  // the inserted ops refer to tp_ itself.
  void RewriteAndSlice(torch::jit::Graph& graph, const TensorParallelGroup& group) {
    const int64_t n = group.size;
    std::unordered_map<std::string, std::vector<Value*>> reads = AttributeReads(graph);
    // Everything is checked before the graph or a parameter changes.
    struct Site {
      const Split* split;
      ParamSpec *weight, *bias;
      int32_t dim;
      int64_t width;
      std::vector<Node*> nodes;
    };
    std::vector<Site> sites;
    for (const Split& s : splits_) {
      const std::string weight_name = Join(s.module, "weight");
      ParamSpec* weight = Param(weight_name);
      if (!weight) Fail("'" + weight_name + "' is another name of a parameter; split its owner");
      if (weight->tensor.dim() != 2) {
        Fail("'" + weight_name + "' has " + std::to_string(weight->tensor.dim()) +
             " dimensions; only the 2-D weights of linear maps split");
      }
      // aten::linear reads [out, in]; matmul and mm read [in, out].
      int32_t out_dim = -1;
      std::vector<Node*> nodes;
      for (Value* read : reads[weight_name]) {
        for (const torch::jit::Use& use : read->uses()) {
          const c10::Symbol kind = use.user->kind();
          const bool linear = kind == c10::aten::linear;
          if (use.offset != 1 || !(linear || kind == c10::aten::matmul || kind == c10::aten::mm)) {
            Fail("'" + weight_name + "' is read by " + std::string(kind.toQualString()) +
                 " (input " + std::to_string(use.offset) +
                 "); a split weight must be read only as the weight of aten::linear "
                 "(nn.Linear, F.linear) or the right operand of torch.matmul / torch.mm, where "
                 "the policy knows which dimension holds the output features");
          }
          const int32_t dim = linear ? 0 : 1;
          if (out_dim >= 0 && out_dim != dim) {
            Fail("'" + weight_name + "' is read both by linear and by matmul; read it one way");
          }
          out_dim = dim;
          nodes.push_back(use.user);
        }
      }
      if (nodes.empty()) Fail("'" + weight_name + "' is never read by forward");
      const int32_t dim = s.column ? out_dim : 1 - out_dim;
      const int64_t width = weight->tensor.size(dim);
      if (width % (n * s.blocks) != 0) {
        Fail("'" + weight_name + "': " + (s.column ? "output" : "input") + " features (" +
             std::to_string(width) + ") must divide by tp (" + std::to_string(n) + ")" +
             (s.blocks > 1 ? " × fused blocks (" + std::to_string(s.blocks) + ")" : "") +
             "; choose a tp size that divides them");
      }
      // A column-parallel bias splits with the output it is added to: inside aten::linear, or
      // after matmul unless the output is gathered first. Row-parallel biases stay whole.
      ParamSpec* bias =
          s.column && (out_dim == 0 || !s.gather) ? Param(Join(s.module, "bias")) : nullptr;
      if (bias && (bias->tensor.dim() != 1 || bias->tensor.size(0) != width)) {
        Fail("'" + bias->name + "' has shape " + c10::str(bias->tensor.sizes()) + ", not the " +
             std::to_string(width) + " output features of '" + weight_name + "'");
      }
      sites.push_back({&s, weight, bias, dim, width, std::move(nodes)});
    }
    std::vector<std::pair<torch::jit::Module, std::string>> attributes;
    for (const std::string& name : heads_) {
      const size_t dot = name.rfind('.');
      torch::jit::Module owner = module_;
      if (dot != std::string::npos) {
        std::stringstream parts(name.substr(0, dot));
        for (std::string part; std::getline(parts, part, '.');) owner = owner.attr(part).toModule();
      }
      const std::string leaf = dot == std::string::npos ? name : name.substr(dot + 1);
      const int64_t value = owner.attr(leaf).toInt();
      if (value % n != 0) {
        Fail("heads: attribute '" + name + "' (" + std::to_string(value) + ") must divide by tp (" +
             std::to_string(n) + "); choose a tp size that divides it");
      }
      attributes.emplace_back(owner, leaf);
    }

    Value* handle = nullptr;
    {
      torch::jit::WithInsertPoint at_start(graph.block()->nodes().front());
      handle = graph.insertConstant(tp::Handle(tp_));
    }
    const c10::Symbol copy = c10::Symbol::fromQualString("cai::tp_copy");
    const c10::Symbol reduce = c10::Symbol::fromQualString("cai::tp_reduce");
    const c10::Symbol gather = c10::Symbol::fromQualString("cai::tp_gather");
    // Inserts op(value, second) right after value's node and points value's other uses at
    // the result.
    auto follow = [&](Value* value, c10::Symbol op, Value* second) {
      torch::jit::WithInsertPoint after(value->node()->next());
      Value* out = graph.insert(op, {value, second});
      value->replaceAllUsesWith(out);
      out->node()->replaceInput(0, value);
      return out;
    };
    for (Site& site : sites) {
      const Split& s = *site.split;
      for (Node* node : site.nodes) {
        if (s.column) {
          torch::jit::WithInsertPoint before(node);
          node->replaceInput(0, graph.insert(copy, {node->input(0), handle}));
          if (s.gather) follow(node->output(), gather, handle);
          continue;
        }
        Value* bias = node->kind() == c10::aten::linear ? node->input(2) : nullptr;
        if (bias && bias->type()->kind() == c10::TypeKind::NoneType) bias = nullptr;
        if (bias) {
          torch::jit::WithInsertPoint before(node);
          node->replaceInput(2, graph.insertConstant(c10::IValue()));
        }
        Value* summed = follow(node->output(), reduce, handle);
        if (bias) follow(summed, c10::aten::add, bias);  // once, after the partial sums
      }
      const int32_t blocks = static_cast<int32_t>(s.column ? s.blocks : 1);
      site.weight->global_shape = site.weight->tensor.sizes().vec();
      tp::SliceParam(*site.weight, site.dim, blocks, site.width / blocks, group);
      if (site.bias) {
        site.bias->global_shape = site.bias->tensor.sizes().vec();
        tp::SliceParam(*site.bias, 0, blocks, site.width / blocks, group);
      }
    }
    for (auto& [owner, leaf] : attributes) owner.setattr(leaf, owner.attr(leaf).toInt() / n);
  }

  // forward() is not const in the jit API, but running it does not change the module.
  mutable torch::jit::Module module_;
  std::string path_;
  std::optional<Policy> policy_;
  std::vector<Split> splits_;
  std::vector<std::string> heads_;
  TensorParallelGroup tp_;
  // forward with its method calls inlined; what runs is a copy, with the policy's collectives
  // inserted once tensor parallelism applies (module_ holds the sliced parameters then).
  std::shared_ptr<torch::jit::Graph> graph_;
  std::unique_ptr<torch::jit::GraphFunction> forward_;
};

}  // namespace

std::unique_ptr<Network> LoadTorchScriptNetwork(const std::string& path,
                                                const std::string& policy_path) {
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
  std::optional<Policy> policy;
  if (!policy_path.empty()) policy = ReadPolicy(policy_path);
  return std::make_unique<TorchScriptNetwork>(std::move(module), path, std::move(policy));
}

std::unique_ptr<Model> LoadTorchScriptModel(const std::string& path, const ParamOptions& options,
                                            const std::string& policy_path) {
  return MakeModel(LoadTorchScriptNetwork(path, policy_path), options);
}

}  // namespace cai
