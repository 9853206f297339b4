#include "train/job.h"

#include <toml++/toml.h>

#include <algorithm>
#include <optional>
#include <sstream>

#include "cai/sdk.hpp"
#include "core/status.h"
#include "core/strings.h"

namespace cai {
namespace {

using sdk::BoolKey;
using sdk::FloatKey;
using sdk::IntKey;
using sdk::StringKey;
constexpr uint64_t kMin = CAI_CONFIG_HAS_MIN;
constexpr uint64_t kMinMax = CAI_CONFIG_HAS_MIN | CAI_CONFIG_HAS_MAX;

const char* const kModelKinds[] = {"gpt2", "llama", "torchscript", nullptr};
const char* const kOptimKinds[] = {"adamw", "adam", "sgd", nullptr};
const char* const kSources[] = {"default", "tokens", "text", nullptr};
const char* const kPrecisions[] = {"fp32", "bf16", "fp16", nullptr};
const char* const kBackends[] = {"gloo", "nccl", nullptr};
const char* const kTransports[] = {"auto", "tcp", nullptr};
const char* const kInitDevices[] = {"device", "host", "lazy", nullptr};

const cai_config_key kModelKeys[] = {
    StringKey("kind", "\"gpt2\"", "Model: gpt2 or llama from the zoo, or a torchscript file.",
              kModelKinds),
    StringKey("path", "\"\"",
              "TorchScript file (model.kind = \"torchscript\"): forward(tokens "
              "int64 [B,T]) -> logits [B,T,V]."),
    StringKey("tp_policy", "\"\"",
              "TorchScript models: a TOML file naming the column- and row-parallel Linears and "
              "the head counts, which tensor parallelism (hybrid_parallel's tp_size) follows "
              "(Shardformer's custom policy; README: \"TorchScript models under tensor "
              "parallelism\")."),
    IntKey("vocab_size", "256", "Vocabulary size (256: the byte-level tokenizer).", 2, 0, kMin),
    IntKey("n_ctx", "128", "Longest sequence the model accepts.", 1, 0, kMin),
    IntKey("n_layer", "4", "Transformer blocks.", 1, 0, kMin),
    IntKey("n_head", "4", "Attention heads.", 1, 0, kMin),
    IntKey("n_kv_head", "0", "Key/value heads for Llama grouped-query attention (0 = n_head).", 0,
           0, kMin),
    IntKey("n_embd", "128", "Hidden size.", 1, 0, kMin),
    IntKey("ffn_hidden", "0",
           "MLP hidden size (0 = 4*n_embd for GPT-2; for Llama 8/3*n_embd rounded up to a "
           "multiple of 256, as Meta's reference).",
           0, 0, kMin),
    BoolKey("bias", "true",
            "Biases in linear layers (and GPT-2's LayerNorm). Default: true for gpt2, false for "
            "llama (as GPT2LMHeadModel and LlamaForCausalLM)."),
    FloatKey("norm_eps", "1e-5",
             "Epsilon of the LayerNorm (gpt2, HF's layer_norm_epsilon) or RMSNorm (llama, HF's "
             "rms_norm_eps).",
             0, 0, kMin),
    FloatKey("rope_theta", "10000.0", "Llama: base of the rotary position embedding.", 0, 0, kMin),
    FloatKey("init_std", "0.02",
             "Standard deviation of the initial matrices and embeddings (HF's initializer_range); "
             "residual projections take init_std / sqrt(2 * n_layer).",
             0, 0, kMin),
    IntKey("ignore_index", "-100",
           "Target value the loss skips (PyTorch's CrossEntropyLoss default); -1 is skipped "
           "too.",
           0, 0, 0),
    StringKey("init_from", "\"\"",
              "Initial weights instead of the seeded init: a directory of safetensors in Hugging "
              "Face names and layouts (config.json, model.safetensors[.index.json]), as `cai "
              "export` writes and GPT2LMHeadModel / LlamaForCausalLM save; its config.json must "
              "match these keys (`cai import DIR` prints them)."),
    StringKey("init_device", "\"device\"",
              "Where the model is built: device (its initial weights count against "
              "memory.device_budget from the start), host (built in host memory, as a "
              "PyTorch model built on the CPU before FSDP moves it: only what the strategy "
              "places on the device counts, and after boost whatever the strategy left in the "
              "model moves there) or lazy (as ColossalAI's LazyInitContext: no parameter is "
              "allocated at build; each is drawn from the seed, the same values, when first "
              "read, so a strategy that copies parameters into its shards one at a time "
              "never holds the whole model; gpt2 and llama only).",
              kInitDevices),
    BoolKey("activation_checkpointing", "false",
            "Recompute each block's forward during backward to save activation memory."),
    BoolKey("memory_efficient_attention", "false",
            "Zoo models: causal attention tiled over query and key blocks with an online "
            "softmax and its own backward, O(T·d) memory per head instead of the T×T scores "
            "(ColossalAI's enable_flash_attention)."),
    BoolKey("fused_normalization", "false",
            "Zoo models: Llama's RMSNorm in one pass keeping only its input and 1/rms for "
            "backward (GPT-2's LayerNorm is ATen's fused kernel already)."),
    BoolKey("fused_activation", "false",
            "Zoo models: GPT-2's bias + GELU and Llama's SwiGLU in one pass each way, keeping "
            "only their inputs (ColossalAI's enable_jit_fused)."),
    StringKey("freeze", "\"\"",
              "Comma-separated parameter-name patterns ('*' wildcard) that do not train."),
    BoolKey("unused_parameter", "false",
            "Add a parameter that forward never reads (checks a strategy's unused-parameter "
            "handling)."),
};

const cai_config_key kOptimizerKeys[] = {
    StringKey("kind", "\"adamw\"", "adamw, adam or sgd.", kOptimKinds),
    FloatKey("lr", "0.001", "Peak learning rate.", 0, 0, kMin),
    FloatKey("weight_decay", "0.1", "Weight decay of matrices and embeddings (group 0).", 0, 0,
             kMin),
    FloatKey("beta1", "0.9", "Adam beta1.", 0, 1, kMinMax),
    FloatKey("beta2", "0.95", "Adam beta2.", 0, 1, kMinMax),
    FloatKey("eps", "1e-8", "Adam epsilon.", 0, 0, kMin),
    FloatKey("momentum", "0.0", "SGD momentum.", 0, 0, kMin),
    FloatKey("dampening", "0.0", "SGD dampening.", 0, 0, kMin),
    BoolKey("nesterov", "false", "SGD Nesterov momentum."),
    FloatKey("no_decay_lr", "0.0",
             "Learning rate of group 1 (biases and norm weights); 0 = the same as lr.", 0, 0, kMin),
    FloatKey("no_decay_weight_decay", "0.0", "Weight decay of group 1.", 0, 0, kMin),
    FloatKey("max_grad_norm", "1.0", "Clip gradients to this global L2 norm (0 = no clipping).", 0,
             0, kMin),
    IntKey("warmup_steps", "0", "Linear learning-rate warmup steps.", 0, 0, kMin),
    FloatKey("min_lr_ratio", "0.1", "Cosine decay ends at this fraction of lr.", 0, 1, kMinMax),
    IntKey("decay_steps", "0", "Step at which the cosine decay ends (0 = train.steps).", 0, 0,
           kMin),
};

const cai_config_key kDataKeys[] = {
    StringKey("source", "\"default\"",
              "default (the embedded corpus), tokens (a uint16 .bin file) or text (a UTF-8 file "
              "read through the byte-level tokenizer).",
              kSources),
    StringKey("path", "\"\"", "File for source = tokens or text."),
    FloatKey("eval_fraction", "0.05", "Tail of the token stream held out for evaluation.", 0, 0.5,
             kMinMax),
};

const cai_config_key kTrainKeys[] = {
    IntKey("steps", "100", "Optimizer steps.", 1, 0, kMin),
    IntKey("global_batch", "16", "Sequences per optimizer step over all ranks.", 1, 0, kMin),
    IntKey("grad_accum", "1",
           "Micro-batches per step on every rank (gradient accumulation; communication only on "
           "the last where the strategy supports no_sync).",
           1, 0, kMin),
    IntKey("seq_len", "64", "Tokens per sequence.", 1, 0, kMin),
    StringKey("precision", "\"fp32\"", "Compute precision: fp32, bf16 or fp16.", kPrecisions),
    IntKey("seed", "1234", "Seed of the initial weights and of the data order.", 0, 0, kMin),
    IntKey("eval_every", "50", "Evaluate every this many steps (0 = only at the end).", 0, 0, kMin),
    IntKey("eval_batches", "4", "Global batches per evaluation.", 1, 0, kMin),
    IntKey("log_every", "10", "Log a line every this many steps (without a terminal).", 1, 0, kMin),
    IntKey("threads", "0", "Compute threads per rank (0 = cores / ranks, at least 1).", 0, 0, kMin),
    BoolKey("cpu_caching_allocator", "true",
            "Keep LibTorch's freed CPU blocks of 1 MiB or more for reuse by later steps, as "
            "PyTorch caches device memory, instead of returning them to the kernel and "
            "page-faulting them in again every step; live and cached blocks together never "
            "exceed the most LibTorch had live at once by more than an eighth."),
    FloatKey("peak_flops", "0",
             "Peak FLOP/s of one rank's device (e.g. 989e12 for an H100's dense bf16), for the "
             "MFU of the step line and metrics.jsonl: model FLOPs per token (6 x parameters + 12 "
             "x n_layer x n_embd x seq_len, PaLM's estimate) x tokens/s / (peak_flops x ranks). "
             "0 = unknown: MFU is shown as –.",
             0, 0, kMin),
};

const cai_config_key kCheckpointKeys[] = {
    IntKey("every", "0", "Save a checkpoint every this many steps (0 = never).", 0, 0, kMin),
    BoolKey("at_end", "true", "Save a checkpoint after the last step."),
    BoolKey("at_start", "false",
            "Save a complete checkpoint of step 0 (the initial weights and zero optimizer "
            "state) before the first step; not when resuming."),
    BoolKey("resume", "false",
            "Resume from the latest complete checkpoint of the run directory, if there is one."),
};

const cai_config_key kLaunchKeys[] = {
    IntKey("nproc", "1", "Ranks to start on this machine (--nproc overrides).", 1, 0, kMin),
    StringKey("backend", "\"gloo\"", "Collective backend: gloo (CPU) or nccl (CUDA).", kBackends),
    StringKey("master_addr", "\"127.0.0.1\"", "Address of rank 0's rendezvous store."),
    IntKey("master_port", "0", "Port of the rendezvous store (0 = a free port).", 0, 65535,
           kMinMax),
    IntKey("timeout_s", "300",
           "Seconds a collective or the rendezvous may take before the job fails.", 1, 0, kMin),
    FloatKey("heartbeat_timeout_s", "5",
             "Seconds without a heartbeat after which a peer (a hung, stopped or killed rank, or "
             "a lost node) is declared lost and every rank exits naming it (0 = off; detection "
             "takes up to this plus 0.5 s, whatever timeout_s is).",
             0, 0, kMin),
    BoolKey("check_calls", "true",
            "Before each collective, check that every rank calls the same one (operation, "
            "element counts, dtype, reduce op, root) and fail naming each rank's call if not."),
    IntKey("comm_lanes", "2",
           "Connections per peer, each with its own I/O thread, that all_reduce, reduce_scatter "
           "and all_gather of 1 MiB or more per lane are split over (1 = one connection).",
           1, 16, kMinMax),
    StringKey("comm_transport", "\"auto\"",
              "How gloo's all_reduce, reduce_scatter and all_gather travel: auto = through "
              "shared memory when every rank of the group is on this host (else TCP), tcp = "
              "always over the connections.",
              kTransports),
    StringKey("socket_ifname", "\"\"",
              "Network interface the collectives bind to (\"\" = CAI_SOCKET_IFNAME, else "
              "GLOO_SOCKET_IFNAME, else the route to master_addr)."),
    FloatKey("device_memory_gib", "0",
             "Device memory one rank may use for model states, in GiB, which `cai plan` and "
             "plugin.name = \"auto\" size strategies against (0 = this machine's memory divided "
             "by the ranks).",
             0, 0, kMin),
};

const cai_config_key kMemoryKeys[] = {
    StringKey("device_budget", "\"0\"",
              "Memory one rank's DEVICE tier may hold: the strategy's device buffers and "
              "LibTorch's own tensors (activations, temporaries, the model's weights while "
              "LibTorch holds them) together. An allocation beyond it fails as a device "
              "out-of-memory, naming what it was for. A size (\"6GiB\", \"512MiB\", bytes); "
              "\"0\" = no budget. On a CPU host both are host memory: the budget is an "
              "accounting boundary that behaves as a device's capacity would."),
    StringKey("pinned_host_budget", "\"0\"",
              "Memory one rank's PINNED_HOST tier (strategies' page-locked staging) may hold; "
              "a size, \"0\" = no budget."),
    StringKey("host_budget", "\"0\"",
              "Memory one rank's HOST tier (strategies' offloaded state) may hold; a size, "
              "\"0\" = no budget."),
    StringKey("nvme_dir", "\"\"",
              "Directory of the NVMe tier's files (\"\" = $TMPDIR, else /tmp): a fast local "
              "disk."),
};

template <size_t N>
std::vector<ConfigKey> Schema(const cai_config_key (&keys)[N], const char* section) {
  return ReadSchema(keys, N, std::string("job schema [") + section + "]");
}

// Inserts `value` at the dotted `path` of `root`, creating tables on the way.
template <class Node>
void SetAt(toml::table& root, const std::string& path, Node&& value, const std::string& what) {
  std::vector<std::string> parts;
  std::stringstream in(path);
  std::string part;
  while (std::getline(in, part, '.')) parts.push_back(part);
  const bool empty_part =
      std::any_of(parts.begin(), parts.end(), [](auto& p) { return p.empty(); });
  if (parts.size() < 2 || empty_part) {
    throw Error(CAI_INVALID_ARGUMENT, what + ": '" + path +
                                          "' is not a section.key path "
                                          "(e.g. --set train.steps=20)");
  }
  toml::table* table = &root;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    toml::node* next = table->get(parts[i]);
    if (!next) {
      table->insert(parts[i], toml::table{});
      next = table->get(parts[i]);
    }
    if (!next->is_table()) {
      throw Error(CAI_INVALID_ARGUMENT,
                  what + ": '" + parts[i] + "' in '" + path + "' is a value, not a table");
    }
    table = next->as_table();
  }
  table->insert_or_assign(parts.back(), std::forward<Node>(value));
}

void ApplySet(toml::table& root, const std::string& assignment) {
  const std::string what = "--set " + assignment;
  size_t eq = assignment.find('=');
  if (eq == std::string::npos) {
    throw Error(CAI_INVALID_ARGUMENT, what + ": expected key=value (e.g. --set train.steps=20)");
  }
  std::string key = assignment.substr(0, eq);
  std::string value = assignment.substr(eq + 1);
  // Parsed with the option as its source, so that messages about the value name it.
  const std::string source = std::string(kSetSourcePrefix) + assignment;
  toml::table parsed;
  try {
    parsed = toml::parse("v = " + value, source);
  } catch (const toml::parse_error&) {
  }
  if (!parsed.get("v")) {  // a bare word: a string
    std::ostringstream quoted;
    quoted << toml::table{{"v", value}};
    parsed = toml::parse(quoted.str(), source);
  }
  parsed.get("v")->visit([&](auto& typed) { SetAt(root, key, std::move(typed), what); });
}

// Where a [plugin.<name>] table was written: its header's line, or, for one that --set made,
// the first --set that gave it a key.
std::string WhereTable(const toml::table& table) {
  std::string where = WhereWritten(table);
  for (auto it = table.begin(); where.empty() && it != table.end(); ++it) {
    where = WhereWritten(it->second);
  }
  return where;
}

// Keys whose default depends on model.kind: Llama has no biases unless asked (as HF's
// LlamaForCausalLM). Resolved here so config.resolved.toml states the value used.
void ResolveArchDefaults(cai_config& model) {
  auto bias = model.values.find(std::string_view("bias"));
  auto kind = model.values.find(std::string_view("kind"));
  if (bias != model.values.end() && bias->second.is_default && kind != model.values.end() &&
      kind->second.s == "llama") {
    bias->second.b = false;
  }
}

void AppendSection(std::ostringstream& out, const std::string& name, const cai_config& config) {
  toml::table table;
  for (const auto& [key, v] : config.values) {
    switch (v.type) {
      case CAI_CONFIG_BOOL:
        table.insert(key, v.b);
        break;
      case CAI_CONFIG_INT:
        table.insert(key, v.i);
        break;
      case CAI_CONFIG_FLOAT:
        table.insert(key, v.f);
        break;
      default:
        table.insert(key, v.s);
        break;
    }
  }
  out << "[" << name << "]\n" << table << "\n\n";
}

}  // namespace

const std::vector<std::pair<std::string, std::vector<ConfigKey>>>& JobSchema() {
  static const auto* schema = new std::vector<std::pair<std::string, std::vector<ConfigKey>>>{
      {"model", Schema(kModelKeys, "model")},
      {"optimizer", Schema(kOptimizerKeys, "optimizer")},
      {"data", Schema(kDataKeys, "data")},
      {"train", Schema(kTrainKeys, "train")},
      {"checkpoint", Schema(kCheckpointKeys, "checkpoint")},
      {"launch", Schema(kLaunchKeys, "launch")},
      {"memory", Schema(kMemoryKeys, "memory")},
  };
  return *schema;
}

JobConfig LoadJob(const std::filesystem::path& file, const std::vector<std::string>& sets) {
  JobConfig job;
  job.file = file;
  const std::string where = file.empty() ? std::string("job") : file.string();
  toml::table root;
  if (!file.empty()) {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(file, ec)) {
      throw Error(CAI_NOT_FOUND, where + ": job file not found; see examples/ for job files");
    }
    try {
      root = toml::parse_file(file.string());
    } catch (const toml::parse_error& e) {
      throw Error(CAI_INVALID_ARGUMENT, where + ": malformed TOML at line " +
                                            std::to_string(e.source().begin.line) + ", column " +
                                            std::to_string(e.source().begin.column) + ": " +
                                            std::string(e.description()));
    }
  }
  for (const std::string& set : sets) ApplySet(root, set);

  std::vector<std::string_view> sections = {"plugin"};
  for (const auto& [name, keys] : JobSchema()) sections.push_back(name);
  for (const auto& [name, node] : root) {
    if (std::find(sections.begin(), sections.end(), name.str()) == sections.end()) {
      throw Error(CAI_INVALID_ARGUMENT, where + ": unknown section '" + std::string(name.str()) +
                                            "'" + WhereWritten(node) + "." +
                                            DidYouMean(name.str(), sections) +
                                            " Sections: " + Join(sections) + ".");
    }
    if (!node.is_table()) {
      throw Error(CAI_INVALID_ARGUMENT, where + ": '" + std::string(name.str()) +
                                            "' must be a table ([" + std::string(name.str()) +
                                            "])");
    }
  }

  // A size may be written as a bare number of bytes: the schema takes it as the string it reads.
  if (toml::table* memory = root["memory"].as_table()) {
    for (const char* key : kBudgetKeys) {
      toml::node* value = memory->get(key);
      if (value && value->is_integer()) {
        memory->insert_or_assign(key, std::to_string(value->as_integer()->get()));
      }
    }
  }

  std::ostringstream resolved;
  job.plugin = "none";
  std::vector<std::string_view> plugin_keys = {"name"};
  if (const toml::table* plugin = root["plugin"].as_table()) {
    for (const auto& [key, node] : *plugin) {
      if (key.str() == "name") {
        if (!node.is_string()) {
          throw Error(CAI_INVALID_ARGUMENT, where + ": key 'plugin.name'" + WhereWritten(node) +
                                                " must be a string: a plugin name, \"none\" "
                                                "or \"auto\"");
        }
        job.plugin = *node.value<std::string>();
      } else if (!node.is_table()) {
        throw Error(CAI_INVALID_ARGUMENT,
                    where + ": unknown key 'plugin." + std::string(key.str()) + "'" +
                        WhereWritten(node) + "." + DidYouMean(key.str(), plugin_keys) +
                        " [plugin] takes 'name'; a strategy's options go in [plugin.<name>]");
      }
    }
    for (const auto& [key, node] : *plugin) {
      if (const toml::table* options = node.as_table()) {
        std::ostringstream text;
        text << *options;
        job.plugin_tables[std::string(key.str())] = text.str();
        job.plugin_table_where[std::string(key.str())] = WhereTable(*options);
      }
    }
    if (auto it = job.plugin_tables.find(job.plugin); it != job.plugin_tables.end()) {
      job.plugin_table_toml = it->second;
    }
  }
  resolved << "[plugin]\nname = \"" << job.plugin << "\"\n\n";

  for (const auto& [name, schema] : JobSchema()) {
    const toml::table* table = root[name].as_table();
    auto config = ValidateConfig(schema, table, "[" + name + "] in " + where);
    if (name == "model") ResolveArchDefaults(*config);
    AppendSection(resolved, name, *config);
    if (name == "model")
      job.model = std::move(config);
    else if (name == "optimizer")
      job.optimizer = std::move(config);
    else if (name == "data")
      job.data = std::move(config);
    else if (name == "train")
      job.train = std::move(config);
    else if (name == "checkpoint")
      job.checkpoint = std::move(config);
    else if (name == "launch")
      job.launch = std::move(config);
    else
      job.memory = std::move(config);
  }
  // Sizes are strings in the schema: checked here, so a bad one fails once, before any rank.
  for (const char* key : kBudgetKeys) MemoryBudget(job, key);
  job.resolved_toml = resolved.str();
  job.root = std::make_shared<const toml::table>(std::move(root));
  return job;
}

const std::vector<std::string_view>& ShippedPlugins() {
  static const std::vector<std::string_view> names = {"ddp", "low_level_zero", "fsdp", "gemini",
                                                      "hybrid_parallel"};
  return names;
}

std::vector<std::string> CheckPluginTables(const JobConfig& job,
                                           const std::vector<std::string>& installed) {
  std::vector<std::string_view> known = {"none"};
  for (const std::string& name : installed) known.push_back(name);
  for (std::string_view name : ShippedPlugins()) {
    if (std::find(known.begin(), known.end(), name) == known.end()) known.push_back(name);
  }
  const std::string file = job.file.empty() ? std::string("job") : job.file.string();
  std::vector<std::string> unused;
  for (const auto& [name, text] : job.plugin_tables) {
    const auto where = job.plugin_table_where.find(name);
    const std::string table = "[plugin." + name + "]" +
                              (where == job.plugin_table_where.end() ? "" : where->second) +
                              " in " + file;
    if (std::find(known.begin(), known.end(), name) == known.end()) {
      const std::string nearest = NearestKey(name, known);
      throw Error(CAI_INVALID_ARGUMENT,
                  table + " names no plugin, so no strategy would read its options." +
                      (nearest.empty() ? "" : " Did you mean [plugin." + nearest + "]?") +
                      " Options go in [plugin.<name>] of the strategy they are for: " +
                      Join(known) + " (`cai plugins list` shows what is installed)");
    }
    if (name != job.plugin && job.plugin != "auto") {
      unused.push_back(table + " is not used: plugin.name = \"" + job.plugin +
                       "\"; its options apply only with plugin.name = \"" + name + "\"");
    }
  }
  return unused;
}

std::unique_ptr<cai_config> ResolvePluginConfig(JobConfig& job,
                                                const std::vector<ConfigKey>& schema) {
  const std::string where = "[plugin." + job.plugin + "] in " +
                            (job.file.empty() ? std::string("job") : job.file.string());
  // The user's own table first, as parsed from the file and --set, so that a message names
  // the line or the option; then the text the run uses (auto may have added options).
  if (job.root) {
    if (const toml::table* plugin = (*job.root)["plugin"].as_table()) {
      if (const toml::table* own = (*plugin)[job.plugin].as_table()) {
        ValidateConfig(schema, own, where);
      }
    }
  }
  toml::table table;
  if (!job.plugin_table_toml.empty()) table = toml::parse(job.plugin_table_toml);
  auto config = ValidateConfig(schema, &table, where);
  std::ostringstream out;
  AppendSection(out, "plugin." + job.plugin, *config);
  job.resolved_toml += out.str();
  return config;
}

namespace {
const cai_config::Value& Lookup(const cai_config& c, const char* key) {
  auto it = c.values.find(std::string_view(key));
  if (it == c.values.end()) throw Error(CAI_INTERNAL, std::string("job key '") + key + "' missing");
  return it->second;
}
}  // namespace

ModelConfig ZooModelConfig(const cai_config& m) {
  ModelConfig config;
  config.arch =
      GetString(m, "kind") == "llama" ? ModelConfig::Arch::kLlama : ModelConfig::Arch::kGpt2;
  config.vocab_size = GetInt(m, "vocab_size");
  config.n_ctx = GetInt(m, "n_ctx");
  config.n_layer = GetInt(m, "n_layer");
  config.n_head = GetInt(m, "n_head");
  config.n_kv_head = GetInt(m, "n_kv_head");
  config.n_embd = GetInt(m, "n_embd");
  config.ffn_hidden = GetInt(m, "ffn_hidden");
  config.bias = GetBool(m, "bias");
  config.norm_eps = GetFloat(m, "norm_eps");
  config.rope_theta = GetFloat(m, "rope_theta");
  config.init_std = GetFloat(m, "init_std");
  return config;
}

cai_precision ParsePrecision(const std::string& p) {
  return p == "bf16" ? CAI_PRECISION_BF16 : p == "fp16" ? CAI_PRECISION_FP16 : CAI_PRECISION_FP32;
}

uint64_t MemoryBudget(const JobConfig& job, const char* key) {
  const std::string& text = GetString(*job.memory, key);
  if (std::optional<uint64_t> bytes = ParseByteSize(text)) return *bytes;
  const std::string where = job.file.empty() ? std::string("job") : job.file.string();
  throw Error(CAI_INVALID_ARGUMENT,
              "[memory] " + std::string(key) + " = \"" + text + "\" in " + where +
                  " is not a size: write a whole number of bytes or a number with a binary unit "
                  "(\"6GiB\", \"512MiB\", \"1.5GiB\"; B, KiB, MiB, GiB, TiB), or \"0\" for no "
                  "budget (decimal units such as GB are refused: 1 GB is not 1 GiB)");
}

bool GetBool(const cai_config& c, const char* key) { return Lookup(c, key).b; }
int64_t GetInt(const cai_config& c, const char* key) { return Lookup(c, key).i; }
double GetFloat(const cai_config& c, const char* key) { return Lookup(c, key).f; }
const std::string& GetString(const cai_config& c, const char* key) { return Lookup(c, key).s; }

}  // namespace cai
