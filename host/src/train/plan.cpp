#include "train/plan.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <map>
#include <sstream>

#include "core/status.h"
#include "loader/registry.h"

namespace cai {
namespace {

constexpr int64_t kBillion = 1'000'000'000;

std::string Bytes(uint64_t b) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(b >= (1ull << 30) ? 2 : 1);
  if (b >= (1ull << 30))
    os << double(b) / double(1ull << 30) << " GiB";
  else
    os << double(b) / double(1ull << 20) << " MiB";
  return os.str();
}

uint64_t MachineMemory() {
  return static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) *
         static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
}

}  // namespace

ModelSize ZooModelSize(const ModelConfig& c) {
  const int64_t e = c.n_embd, b = c.bias ? 1 : 0;
  ModelSize size;
  int64_t block = 0, embedding = 0, head = 0;
  if (c.arch == ModelConfig::Arch::kGpt2) {
    const int64_t f = c.ffn_hidden ? c.ffn_hidden : 4 * e;
    block = 2 * (e + b * e)          // ln_1, ln_2
            + 3 * e * e + b * 3 * e  // qkv
            + e * e + b * e          // proj
            + f * e + b * f          // fc
            + e * f + b * e;         // mlp proj
    embedding = c.vocab_size * e + c.n_ctx * e;
    head = e + b * e;  // ln_f; the output projection is tied to wte
  } else {
    const int64_t f = c.ffn_hidden ? c.ffn_hidden : 256 * ((8 * e / 3 + 255) / 256);
    const int64_t kv = (c.n_kv_head ? c.n_kv_head : c.n_head) * (e / c.n_head);
    block = 2 * e                    // attn_norm, mlp_norm
            + 2 * (e * e + b * e)    // q, o
            + 2 * (kv * e + b * kv)  // k, v
            + 2 * (f * e + b * f)    // gate, up
            + e * f + b * e;         // down
    embedding = c.vocab_size * e;
    head = e + c.vocab_size * e;  // norm, lm_head (untied)
  }
  size.params = embedding + c.n_layer * block + head;
  size.largest_unit = std::max({embedding, block, head});
  return size;
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
  plan.device_budget = MachineMemory() / static_cast<uint64_t>(world_size);

  const double psi = static_cast<double>(plan.size.params);
  const double n = world_size;
  const bool mixed = plan.precision != CAI_PRECISION_FP32;
  const std::string kind = GetString(*job.optimizer, "kind");
  const double k = kind == "sgd" ? (GetFloat(*job.optimizer, "momentum") > 0 ? 4 : 0) : 8;
  const double p = mixed ? 2 : 4;       // bytes of a parameter / gradient as trained
  const double master = mixed ? 4 : 0;  // fp32 master copy
  const double unit = static_cast<double>(plan.size.largest_unit);
  // The ZeRO paper's per-rank formulas (Rajbhandari et al. 2020, §5 and Figure 1), K = master +
  // optimizer state.
  struct Formula {
    const char* name;
    const char* plugin;
    double device;
    double host;
    const char* text;
  };
  const Formula formulas[] = {
      {"ddp", "ddp", (p + p + master + k) * psi, 0, "(P + G + K)Ψ"},
      {"low_level_zero stage 1", "low_level_zero", (p + p) * psi + (master + k) * psi / n, 0,
       "(P + G)Ψ + KΨ/N"},
      {"low_level_zero stage 2", "low_level_zero", p * psi + (p + master + k) * psi / n, 0,
       "PΨ + (G + K)Ψ/N"},
      {"low_level_zero stage 2 + cpu_offload", "low_level_zero", p * psi + p * psi / n,
       (master + k + 4) * psi / n, "device PΨ + GΨ/N, host (K + 4)Ψ/N"},
      {"fsdp (FULL_SHARD)", "fsdp", (p + p + master + k) * psi / n + 2 * (p + p) * unit, 0,
       "(P + G + K)Ψ/N + 2 units gathered"},
      {"gemini", "gemini", (p + p) * psi / n + 2 * (p + p) * unit, (master + k) * psi / n,
       "device (P + G)Ψ/N + chunks in flight, host KΨ/N"},
      {"hybrid_parallel (tp × pp × dp)", "hybrid_parallel", (p + p + master + k) * psi / n, 0,
       "(P + G + K)Ψ/(tp·pp) with ZeRO-1 over dp"},
  };
  std::map<std::string, const LoadedPlugin*> installed;
  for (const PluginRecord& r : DiscoverPlugins(PluginSearchPath(paths))) {
    if (!r.error.empty()) continue;
    try {
      installed.emplace(r.manifest.name, &LoadPlugin(r.manifest, host));
    } catch (const Error&) {
      // A plugin that does not load is not a candidate; `cai plugins list` says why.
    }
  }
  for (const Formula& f : formulas) {
    StrategyEstimate e{f.name,
                       f.plugin,
                       installed.count(f.plugin) > 0,
                       static_cast<uint64_t>(f.device),
                       static_cast<uint64_t>(f.host),
                       f.text};
    plan.estimates.push_back(e);
  }
  // Third-party strategies that can estimate themselves.
  for (const auto& [name, plugin] : installed) {
    bool known = false;
    for (const Formula& f : formulas) known = known || name == f.plugin;
    if (known || !plugin->Has(&cai_plugin_api::estimate_memory)) continue;
    auto defaults = ValidateConfig(plugin->schema, nullptr, "[plugin." + name + "]");
    cai_memory_estimate_args args{};
    args.struct_size = CAI_MEMORY_ESTIMATE_ARGS_STRUCT_SIZE;
    args.config = defaults.get();
    args.num_params = plan.size.params;
    args.largest_unit_numel = plan.size.largest_unit;
    args.world_size = world_size;
    args.precision = plan.precision;
    args.optimizer_state_slots = static_cast<uint32_t>(k / 4);
    cai_memory_estimate out{};
    out.struct_size = CAI_MEMORY_ESTIMATE_STRUCT_SIZE;
    ThrowIfError(plugin->api->estimate_memory(&args, &out));
    uint64_t total =
        out.param_bytes + out.grad_bytes + out.optimizer_state_bytes + out.master_bytes;
    plan.estimates.push_back({name, name, true, out.device_bytes ? out.device_bytes : total,
                              out.host_bytes, out.formula ? out.formula : ""});
  }

  // ColossalAI's sizing guide decides the order in which strategies are considered.
  std::vector<std::string> order;
  std::string band;
  if (world_size == 1) {
    order = {"none", "low_level_zero stage 2 + cpu_offload", "gemini"};
    band = "one rank: no parallelism is needed unless the model does not fit";
  } else if (plan.size.params < 2 * kBillion) {
    order = {"ddp", "low_level_zero stage 2", "fsdp (FULL_SHARD)", "gemini"};
    band = "below 2B parameters ColossalAI recommends DDP";
  } else if (plan.size.params < 10 * kBillion) {
    order = {"low_level_zero stage 2", "fsdp (FULL_SHARD)", "gemini", "ddp"};
    band = "2B–10B parameters: low-level ZeRO or FSDP";
  } else if (plan.size.params < 60 * kBillion) {
    order = {"gemini", "fsdp (FULL_SHARD)", "hybrid_parallel (tp × pp × dp)"};
    band = "above 10B parameters: Gemini";
  } else {
    order = {"hybrid_parallel (tp × pp × dp)", "gemini"};
    band = "above 60B parameters: hybrid parallelism";
  }
  const uint64_t replica = static_cast<uint64_t>((p + p + master + k) * psi);
  std::vector<std::string> passed;
  auto fits = [&](uint64_t bytes) { return bytes <= plan.device_budget; };
  for (const std::string& name : order) {
    if (name == "none") {
      if (fits(replica)) {
        plan.choice = "none";
        plan.reason =
            band + "; the replica needs " + Bytes(replica) + " of " + Bytes(plan.device_budget);
        return plan;
      }
      passed.push_back("none (needs " + Bytes(replica) + ")");
      continue;
    }
    for (const StrategyEstimate& e : plan.estimates) {
      if (e.name != name) continue;
      if (!e.installed) {
        passed.push_back(e.name + " (plugin '" + e.plugin + "' not installed)");
      } else if (!fits(e.device_bytes)) {
        passed.push_back(e.name + " (needs " + Bytes(e.device_bytes) + ")");
      } else {
        plan.choice = e.plugin;
        plan.reason = band + "; " + e.name + " needs " + Bytes(e.device_bytes) + " per rank of " +
                      Bytes(plan.device_budget);
        if (!passed.empty()) {
          plan.reason += " (passed over:";
          for (const auto& s : passed) plan.reason += " " + s + ";";
          plan.reason.back() = ')';
        }
        return plan;
      }
    }
  }
  // Nothing from the guide is installed: the smallest installed estimate that fits.
  const StrategyEstimate* best = nullptr;
  for (const StrategyEstimate& e : plan.estimates) {
    if (e.installed && fits(e.device_bytes) && (!best || e.device_bytes < best->device_bytes)) {
      best = &e;
    }
  }
  if (best) {
    plan.choice = best->plugin;
    plan.reason = band + ", but none of those is installed; '" + best->plugin +
                  "' is the installed strategy that fits (" + Bytes(best->device_bytes) +
                  " per rank)";
    return plan;
  }
  std::string tried;
  for (const auto& s : passed) tried += "\n  " + s;
  throw Error(CAI_NOT_FOUND, "plugin.name = \"auto\": no installed strategy fits " +
                                 std::to_string(world_size) + " rank(s) of " +
                                 Bytes(plan.device_budget) + ":" + tried +
                                 "\nInstall the strategy packages (cai-plugin-*) or add ranks");
}

void PrintPlan(const Plan& plan, std::ostream& out) {
  const char* precision = plan.precision == CAI_PRECISION_BF16   ? "bf16"
                          : plan.precision == CAI_PRECISION_FP16 ? "fp16"
                                                                 : "fp32";
  out << "parameters: " << plan.size.params << " (" << std::fixed << std::setprecision(3)
      << double(plan.size.params) / 1e9 << "B); largest unit " << plan.size.largest_unit
      << "\nranks: " << plan.world_size << ", precision " << precision
      << ", device memory per rank " << Bytes(plan.device_budget) << "\n\n";
  out << std::left << std::setw(40) << "strategy" << std::setw(14) << "device/rank" << std::setw(14)
      << "host/rank" << std::setw(11) << "installed"
      << "formula\n";
  for (const StrategyEstimate& e : plan.estimates) {
    out << std::left << std::setw(40) << e.name << std::setw(14) << Bytes(e.device_bytes)
        << std::setw(14) << Bytes(e.host_bytes) << std::setw(11) << (e.installed ? "yes" : "no")
        << e.formula << "\n";
  }
  out << "\nauto picks: " << plan.choice << "\n  because " << plan.reason << "\n";
}

}  // namespace cai
