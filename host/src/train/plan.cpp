#include "train/plan.h"

#include <toml++/toml.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <map>
#include <sstream>

#include "core/status.h"
#include "loader/config.h"
#include "loader/registry.h"
#include "train/reference_strategy.h"

namespace cai {
namespace {

constexpr int64_t kBillion = 1'000'000'000;

uint64_t MachineMemory() {
  return static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) *
         static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
}

}  // namespace

std::string FormatBytes(uint64_t b) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(b >= (1ull << 30) ? 2 : 1);
  if (b >= (1ull << 30))
    os << double(b) / double(1ull << 30) << " GiB";
  else
    os << double(b) / double(1ull << 20) << " MiB";
  return os.str();
}

ModelSize ZooModelSize(const ModelConfig& c) {
  // The zoo's construction order (model/zoo.cpp): the embedding unit, one unit per block, the
  // head; plan_test checks it against the built model parameter by parameter.
  const int64_t e = c.n_embd;
  const auto blocks = static_cast<int32_t>(c.n_layer);
  const int32_t head = blocks + 1;
  ModelSize size;
  size.unit_kind.assign(static_cast<size_t>(blocks) + 2, CAI_UNIT_BLOCK);
  size.unit_kind.front() = CAI_UNIT_EMBEDDING;
  size.unit_kind.back() = CAI_UNIT_HEAD;
  auto add = [&](int64_t numel, int32_t unit) {
    size.param_numel.push_back(numel);
    size.param_unit.push_back(unit);
  };
  // A weight, then its bias where the model has biases.
  auto linear = [&](int64_t out, int64_t in, int32_t unit) {
    add(out * in, unit);
    if (c.bias) add(out, unit);
  };
  if (c.arch == ModelConfig::Arch::kGpt2) {
    const int64_t f = c.ffn_hidden ? c.ffn_hidden : 4 * e;
    add(c.vocab_size * e, 0);  // wte; the output projection is tied to it
    add(c.n_ctx * e, 0);       // wpe
    for (int32_t u = 1; u <= blocks; ++u) {
      linear(e, 1, u);      // ln_1
      linear(3 * e, e, u);  // qkv
      linear(e, e, u);      // proj
      linear(e, 1, u);      // ln_2
      linear(f, e, u);      // fc
      linear(e, f, u);      // mlp proj
    }
    linear(e, 1, head);  // ln_f
  } else {
    const int64_t f = c.ffn_hidden ? c.ffn_hidden : 256 * ((8 * e / 3 + 255) / 256);
    const int64_t kv = (c.n_kv_head ? c.n_kv_head : c.n_head) * (e / c.n_head);
    add(c.vocab_size * e, 0);  // embed_tokens
    for (int32_t u = 1; u <= blocks; ++u) {
      add(e, u);         // attn_norm
      linear(e, e, u);   // q
      linear(kv, e, u);  // k
      linear(kv, e, u);  // v
      linear(e, e, u);   // o
      add(e, u);         // mlp_norm
      linear(f, e, u);   // gate
      linear(f, e, u);   // up
      linear(e, f, u);   // down
    }
    add(e, head);                 // norm
    add(c.vocab_size * e, head);  // lm_head (untied)
  }
  std::vector<int64_t> per_unit(size.unit_kind.size(), 0);
  for (size_t i = 0; i < size.param_numel.size(); ++i) {
    size.params += size.param_numel[i];
    per_unit[static_cast<size_t>(size.param_unit[i])] += size.param_numel[i];
  }
  size.largest_unit = *std::max_element(per_unit.begin(), per_unit.end());
  return size;
}

namespace {

// The configurations auto considers, by plugin; `pp_size` is filled in per world.
struct Candidate {
  const char* plugin;
  std::vector<std::pair<std::string, std::string>> options;
};

std::vector<Candidate> Candidates(int world_size, int64_t layers) {
  // hybrid_parallel: one pipeline stage per rank as far as the blocks allow, ZeRO-1 across the
  // pipelines the rest of the world forms.
  int pp = 1;
  for (int d = 1; d <= world_size && d <= layers; ++d) {
    if (world_size % d == 0) pp = d;
  }
  return {
      {"none", {}},
      {"ddp", {}},
      {"low_level_zero", {{"stage", "1"}}},
      {"low_level_zero", {{"stage", "2"}}},
      {"low_level_zero", {{"stage", "2"}, {"cpu_offload", "true"}}},
      {"fsdp", {{"sharding_strategy", "\"FULL_SHARD\""}}},
      {"fsdp", {{"sharding_strategy", "\"FULL_SHARD\""}, {"cpu_offload", "true"}}},
      {"gemini", {}},
      {"hybrid_parallel", {{"pp_size", std::to_string(pp)}, {"zero_stage", "1"}}},
  };
}

std::string Label(const std::string& plugin,
                  const std::vector<std::pair<std::string, std::string>>& options) {
  std::string label = plugin;
  for (size_t i = 0; i < options.size(); ++i) {
    label += (i ? ", " : " (") + options[i].first + " = " + options[i].second;
  }
  return options.empty() ? label : label + ")";
}

// The user's [plugin.<name>] table with `options` added where the user set nothing, as a
// table and as the options that were added.
toml::table MergedTable(const JobConfig& job, const std::string& plugin,
                        const std::vector<std::pair<std::string, std::string>>& options,
                        std::vector<std::pair<std::string, std::string>>* added) {
  toml::table table;
  if (auto it = job.plugin_tables.find(plugin); it != job.plugin_tables.end()) {
    table = toml::parse(it->second);
  }
  for (const auto& [key, literal] : options) {
    if (table.contains(key)) continue;  // the user's value wins
    toml::table parsed = toml::parse("v = " + literal);
    table.insert(key, *parsed.get("v"));
    added->emplace_back(key, literal);
  }
  return table;
}

}  // namespace

MemoryEstimate EstimateMemory(const cai_plugin_api& api, const cai_config& config,
                              const JobConfig& job, const ModelSize& size, int world_size) {
  const std::string& kind = GetString(*job.optimizer, "kind");
  cai_memory_estimate_args args{};
  args.struct_size = CAI_MEMORY_ESTIMATE_ARGS_STRUCT_SIZE;
  args.config = &config;
  args.num_params = size.params;
  args.largest_unit_numel = size.largest_unit;
  args.world_size = world_size;
  args.precision = ParsePrecision(GetString(*job.train, "precision"));
  args.optimizer_state_slots =
      kind == "sgd" ? (GetFloat(*job.optimizer, "momentum") > 0 ? 1 : 0) : 2;
  args.num_layout_params = static_cast<uint32_t>(size.param_numel.size());
  args.param_numel = size.param_numel.data();
  args.param_unit = size.param_unit.data();
  args.num_layout_units = static_cast<uint32_t>(size.unit_kind.size());
  args.unit_kind = size.unit_kind.data();
  cai_memory_estimate out{};
  out.struct_size = CAI_MEMORY_ESTIMATE_STRUCT_SIZE;
  ThrowIfError(api.estimate_memory(&args, &out));
  const uint64_t total =
      out.param_bytes + out.grad_bytes + out.optimizer_state_bytes + out.master_bytes;
  return {out.device_bytes ? out.device_bytes : total, out.host_bytes,
          out.formula ? out.formula : ""};
}

Plan MakePlan(const JobConfig& job, int world_size, const std::vector<std::filesystem::path>& paths,
              const cai_host_api* host) {
  Plan plan;
  plan.world_size = world_size;
  const cai_config& m = *job.model;
  if (GetString(m, "kind") == "torchscript") {
    throw Error(CAI_UNIMPLEMENTED,
                "cai plan sizes zoo models from their config; a TorchScript "
                "model's size is known only once loaded (model.kind)");
  }
  plan.size = ZooModelSize(ZooModelConfig(m));
  plan.precision = ParsePrecision(GetString(*job.train, "precision"));
  // The enforced budget (memory.device_budget) bounds whatever launch.device_memory_gib says.
  const double gib = GetFloat(*job.launch, "device_memory_gib");
  plan.device_budget = gib > 0 ? static_cast<uint64_t>(gib * double(1ull << 30))
                               : MachineMemory() / static_cast<uint64_t>(world_size);
  plan.enforced_budget = MemoryBudget(job, "device_budget");
  if (plan.enforced_budget != 0)
    plan.device_budget = std::min(plan.device_budget, plan.enforced_budget);

  // What can run here: installed plugins that load, and the built-in reference on one rank.
  std::map<std::string, const LoadedPlugin*> installed;
  const std::vector<PluginRecord> records = DiscoverPlugins(PluginSearchPath(paths));
  std::vector<std::string> names;
  for (const PluginRecord& r : records) {
    if (!r.manifest.name.empty()) names.push_back(r.manifest.name);
  }
  CheckPluginTables(job, names);  // a misspelt [plugin.<name>] table; no plugin is "unused" here
  for (const PluginRecord& r : records) {
    if (!r.error.empty()) continue;
    try {
      installed.emplace(r.manifest.name, &LoadPlugin(r.manifest, host));
    } catch (const Error&) {
      // A plugin that does not load is not a candidate; `cai plugins list` says why.
    }
  }
  std::vector<Candidate> candidates = Candidates(world_size, GetInt(m, "n_layer"));
  for (const auto& [name, plugin] : installed) {  // third parties: their defaults
    const bool known = std::any_of(candidates.begin(), candidates.end(),
                                   [&](const Candidate& c) { return name == c.plugin; });
    if (!known) candidates.push_back({name.c_str(), {}});
  }
  std::map<std::string, std::string> tables;  // label -> merged table text
  for (const Candidate& c : candidates) {
    StrategyEstimate e;
    e.plugin = c.plugin;
    const bool reference = e.plugin == "none";
    if (reference && world_size != 1) continue;  // the reference runs on one rank only
    const LoadedPlugin* plugin = nullptr;
    if (auto it = installed.find(e.plugin); it != installed.end()) plugin = it->second;
    e.installed = reference || plugin;
    toml::table table = MergedTable(job, e.plugin, c.options, &e.options);
    e.name = Label(e.plugin, e.options);
    if (std::any_of(plan.estimates.begin(), plan.estimates.end(),
                    [&](const StrategyEstimate& o) { return o.name == e.name; })) {
      continue;  // the user's options made it the same as an earlier candidate
    }
    const cai_plugin_api* api = reference ? ReferenceStrategy(host)
                                : plugin  ? plugin->api
                                          : nullptr;
    if (!e.installed) {
      e.formula = "plugin '" + e.plugin + "' not installed";
    } else if (!(reference || plugin->Has(&cai_plugin_api::estimate_memory))) {
      e.formula = "no estimate: the plugin does not implement estimate_memory (ABI 1.1)";
    } else {
      const std::vector<ConfigKey> schema =
          reference ? ReadSchema(api->config_keys, api->num_config_keys, "strategy 'none'")
                    : plugin->schema;
      auto missing = std::find_if(e.options.begin(), e.options.end(), [&](const auto& o) {
        return std::none_of(schema.begin(), schema.end(),
                            [&](const ConfigKey& k) { return k.name == o.first; });
      });
      if (missing != e.options.end()) {
        e.formula = "not sized: this version of the plugin has no key '" + missing->first + "'";
        e.installed = false;
      } else {
        auto config =
            ValidateConfig(schema, &table,
                           "[plugin." + e.plugin + "] in " +
                               (job.file.empty() ? std::string("job") : job.file.string()));
        const MemoryEstimate out = EstimateMemory(*api, *config, job, plan.size, world_size);
        e.estimated = true;
        e.device_bytes = out.device_bytes;
        e.host_bytes = out.host_bytes;
        e.formula = out.formula;
      }
    }
    std::ostringstream text;
    text << table;
    tables[e.name] = text.str();
    plan.estimates.push_back(std::move(e));
  }

  // ColossalAI's sizing guide decides the order in which plugins are considered; within a
  // plugin, the candidates in the order listed (least memory saving first, the fastest).
  std::vector<std::string> order;
  std::string band;
  if (world_size == 1) {
    order = {"none", "low_level_zero", "fsdp", "gemini"};
    band = "one rank: no parallelism is needed unless the model does not fit";
  } else if (plan.size.params < 2 * kBillion) {
    order = {"ddp", "low_level_zero", "fsdp", "gemini"};
    band = "below 2B parameters ColossalAI recommends DDP";
  } else if (plan.size.params < 10 * kBillion) {
    order = {"low_level_zero", "fsdp", "gemini", "ddp"};
    band = "2B–10B parameters: low-level ZeRO or FSDP";
  } else if (plan.size.params < 60 * kBillion) {
    order = {"gemini", "fsdp", "hybrid_parallel"};
    band = "above 10B parameters: Gemini";
  } else {
    order = {"hybrid_parallel", "gemini"};
    band = "above 60B parameters: hybrid parallelism";
  }
  auto fits = [&](const StrategyEstimate& e) { return e.device_bytes <= plan.device_budget; };
  auto choose = [&](const StrategyEstimate& e, const std::string& why) {
    plan.choice = e.plugin;
    plan.choice_table = tables[e.name];
    plan.reason = why;
  };
  std::vector<std::string> passed;
  for (const std::string& plugin : order) {
    for (const StrategyEstimate& e : plan.estimates) {
      if (e.plugin != plugin) continue;
      if (!e.installed || !e.estimated) {
        passed.push_back(e.name + " (" + e.formula + ")");
      } else if (!fits(e)) {
        passed.push_back(e.name + " (needs " + FormatBytes(e.device_bytes) + ")");
      } else {
        std::string why = band + "; " + e.name + " needs " + FormatBytes(e.device_bytes) +
                          " per rank of " + FormatBytes(plan.device_budget);
        if (!passed.empty()) {
          why += " (passed over:";
          for (const auto& p : passed) why += " " + p + ";";
          why.back() = ')';
        }
        choose(e, why);
        return plan;
      }
    }
  }
  // Nothing from the guide fits: the installed configuration that needs least and fits.
  const StrategyEstimate* best = nullptr;
  for (const StrategyEstimate& e : plan.estimates) {
    if (e.installed && e.estimated && fits(e) && (!best || e.device_bytes < best->device_bytes)) {
      best = &e;
    }
  }
  if (best) {
    choose(*best, band + ", but none of those fits; '" + best->name +
                      "' is the installed configuration that does (" +
                      FormatBytes(best->device_bytes) + " per rank)");
    return plan;
  }
  std::string tried;
  for (const auto& p : passed) tried += "\n  " + p;
  throw Error(CAI_NOT_FOUND, "plugin.name = \"auto\": no installed strategy fits " +
                                 std::to_string(world_size) + " rank(s) of " +
                                 FormatBytes(plan.device_budget) + ":" + tried +
                                 "\nInstall the strategy packages (cai-plugin-*), add ranks, or "
                                 "raise launch.device_memory_gib");
}

void PrintPlan(const Plan& plan, std::ostream& out) {
  const char* precision = plan.precision == CAI_PRECISION_BF16   ? "bf16"
                          : plan.precision == CAI_PRECISION_FP16 ? "fp16"
                                                                 : "fp32";
  out << "parameters: " << plan.size.params << " (" << std::fixed << std::setprecision(3)
      << double(plan.size.params) / 1e9 << "B); largest unit " << plan.size.largest_unit
      << "\nranks: " << plan.world_size << ", precision " << precision
      << ", device memory per rank " << FormatBytes(plan.device_budget) << "\n";
  if (plan.enforced_budget != 0) {
    out << "memory.device_budget " << FormatBytes(plan.enforced_budget)
        << " is enforced: the strategy's DEVICE buffers and LibTorch's own tensors count "
           "against it together, and the run fails as on a full device beyond it. On this "
           "CPU host both are host memory: the budget is an accounting boundary.\n";
  }
  out << "\n";
  size_t width = 10;
  for (const StrategyEstimate& e : plan.estimates) width = std::max(width, e.name.size() + 2);
  out << std::left << std::setw(static_cast<int>(width)) << "strategy" << std::setw(14)
      << "device/rank" << std::setw(14) << "host/rank" << std::setw(11) << "installed"
      << "formula (the plugin's own estimate)\n";
  for (const StrategyEstimate& e : plan.estimates) {
    out << std::left << std::setw(static_cast<int>(width)) << e.name << std::setw(14)
        << (e.estimated ? FormatBytes(e.device_bytes) : "-") << std::setw(14)
        << (e.estimated ? FormatBytes(e.host_bytes) : "-") << std::setw(11)
        << (e.installed ? "yes" : "no") << e.formula << "\n";
  }
  out << "\nauto picks: " << plan.choice << "\n  because " << plan.reason << "\n";
  if (!plan.choice_table.empty()) {
    out << "  and runs it with [plugin." << plan.choice << "]:\n";
    std::istringstream lines(plan.choice_table);
    for (std::string line; std::getline(lines, line);) out << "    " << line << "\n";
  }
}

}  // namespace cai
