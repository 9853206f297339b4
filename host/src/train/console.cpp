#include "train/console.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iomanip>
#include <sstream>
#include <string_view>
#include <vector>

#include "core/strings.h"
#include "launch/local_launcher.h"
#include "train/plan.h"

namespace cai {

double ModelFlopsPerToken(int64_t params, int64_t n_layer, int64_t n_embd, int64_t seq_len) {
  return 6.0 * static_cast<double>(params) + 12.0 * static_cast<double>(n_layer) *
                                                 static_cast<double>(n_embd) *
                                                 static_cast<double>(seq_len);
}

int64_t MatmulParams(std::span<const cai_param_info> params, std::span<const cai_unit_info> units) {
  std::vector<bool> read_by_a_unit(params.size(), false);
  for (const cai_unit_info& unit : units) {
    for (uint32_t k = 0; k < unit.num_reads; ++k) read_by_a_unit.at(unit.reads[k]) = true;
  }
  int64_t total = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const bool looked_up = params[i].role == CAI_ROLE_POS_EMBEDDING ||
                           (params[i].role == CAI_ROLE_EMBEDDING && !read_by_a_unit[i]);
    if (!looked_up) total += params[i].numel;
  }
  return total;
}

double ModelFlopsUtilization(double flops_per_token, double tokens_per_s, double peak_flops,
                             int world_size) {
  if (!(peak_flops > 0) || world_size < 1) return NAN;
  return flops_per_token * tokens_per_s / (peak_flops * world_size);
}

bool StdoutReachesTerminal() {
  if (::isatty(STDOUT_FILENO) == 1) return true;
  // Set by the local launcher in every rank it starts; a rank's own stdout is then a pipe.
  const char* launcher_terminal = std::getenv(launch::kStdoutTerminalVar);
  return launcher_terminal != nullptr && std::string_view(launcher_terminal) == "1";
}

std::string FormatDuration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  int s = static_cast<int>(seconds + 0.5);
  std::ostringstream os;
  if (s >= 3600) os << s / 3600 << "h";
  if (s >= 60) os << (s / 60) % 60 << "m";
  os << s % 60 << "s";
  return os.str();
}

std::string FormatStepLine(const StepLine& line) {
  std::ostringstream text;
  text << "step " << line.step << "/" << line.steps << "  loss " << std::fixed
       << std::setprecision(4) << line.loss << "  lr " << std::scientific << std::setprecision(2)
       << line.lr << std::fixed << std::setprecision(0) << "  " << line.tokens_per_s
       << " tok/s  MFU ";
  if (std::isnan(line.mfu)) {
    text << "–";
  } else {
    text << std::setprecision(1) << 100 * line.mfu << "%";
  }
  text << "  ETA " << FormatDuration(line.eta_s);
  if (line.skipped) text << "  (overflow: step skipped)";
  return text.str();
}

int StdoutColumns() {
  if (::isatty(STDOUT_FILENO) == 1) return TerminalColumns(STDOUT_FILENO);
  const char* columns = std::getenv(launch::kStdoutColumnsVar);
  return columns != nullptr ? std::max(0, std::atoi(columns)) : 0;
}

std::string FormatProgressBar(const StepLine& line, int columns) {
  constexpr size_t kFullBar = 24, kMinBar = 6, kFrame = 3;  // "[", "] "
  const std::string text = FormatStepLine(line);
  // The last column stays free: writing into it makes some terminals wrap, and a wrapped line
  // is not what the carriage return goes back to.
  const size_t room = columns > 0 ? static_cast<size_t>(columns) - 1 : SIZE_MAX;
  const size_t shown = std::min(Columns(text), room);
  size_t width = kFullBar;
  if (shown + kFrame + kFullBar > room) {
    width = room > shown + kFrame + kMinBar ? room - shown - kFrame : 0;
  }
  std::string bar = "\r";
  if (width > 0) {
    const int64_t steps = line.steps > 0 ? line.steps : 1;
    const size_t filled =
        width * static_cast<size_t>(std::min(line.step, steps)) / static_cast<size_t>(steps);
    bar += "[" + std::string(filled, '#') + std::string(width - filled, '.') + "] ";
  }
  bar += FitColumns(text, shown);
  // The padding blanks what a longer earlier line (a skipped step's note) left behind.
  const size_t used = (width > 0 ? width + kFrame : 0) + shown;
  bar += std::string(columns > 0 ? room - std::min(room, used) : 3, ' ');
  return bar + (line.step >= line.steps ? "\n" : "");
}

std::string FormatRunSummary(const RunSummary& s) {
  std::ostringstream out;
  out << "cai: training\n"
      << "  model      " << s.model << "\n"
      << "  Ψ          " << s.params << " parameters (" << std::fixed << std::setprecision(2)
      << static_cast<double>(s.params) / 1e6 << "M); " << std::scientific << std::setprecision(3)
      << s.flops_per_token
      << " FLOPs per token (6 per matmul parameter + 12·n_layer·n_embd·seq_len)\n";
  out << "  strategy   " << s.strategy;
  std::string options;
  std::istringstream table(s.strategy_options);
  for (std::string row; std::getline(table, row);) {
    if (row.empty() || row[0] == '#' || row[0] == '[') continue;
    options += (options.empty() ? "" : ", ") + row;
  }
  out << (options.empty() ? " (its defaults)" : " (" + options + ")") << "\n"
      << "  ranks      " << s.world_size << ", " << s.threads << " compute thread"
      << (s.threads == 1 ? "" : "s") << " per rank, " << s.precision << "\n"
      << "  batch      " << s.global_batch << " sequences × " << s.seq_len << " tokens"
      << (s.grad_accum > 1 ? " in " + std::to_string(s.grad_accum) + " micro-batches" : "") << ", "
      << s.steps << " steps\n";
  out << "  memory     ";
  if (s.memory) {
    out << FormatBytes(s.memory->device_bytes) << " device";
    if (s.memory->host_bytes > 0) out << " + " << FormatBytes(s.memory->host_bytes) << " host";
    out << " per rank for model states";
    if (!s.memory->formula.empty()) out << ", " << s.memory->formula;
    out << "\n";
  } else {
    out << "no estimate (the strategy has no estimate_memory, or the model is TorchScript)\n";
  }
  if (s.device_budget > 0) {
    out << "  budget     " << FormatBytes(s.device_budget)
        << " device per rank for buffers and LibTorch's tensors together (memory.device_budget)\n";
  }
  out << "  peak       ";
  if (s.peak_flops > 0) {
    out << std::scientific << std::setprecision(3) << s.peak_flops << " FLOP/s per rank\n";
  } else {
    out << "unknown: MFU is shown as – (set train.peak_flops to the device's peak FLOP/s)\n";
  }
  out << "  run dir    " << s.run_dir.string() << "\n"
      << "  config     " << (s.run_dir / "config.resolved.toml").string()
      << " (every key, defaults filled)\n";
  return out.str();
}

}  // namespace cai
