#include "cli/report_command.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <vector>

#include "core/files.h"
#include "core/json.h"
#include "core/status.h"

namespace fs = std::filesystem;

namespace cai {
namespace {

constexpr const char* kReportUsage =
    "usage: cai report RUN_DIR [RUN_DIR...] [-o OUT.svg|OUT.png]\n"
    "\n"
    "Draws, for each run directory of `cai train`, the loss, the gradient norm and the tokens/s\n"
    "of every step (metrics.jsonl) and each rank's peak memory (summary.json: peak RSS,\n"
    "LibTorch's own peak, the strategy's model states) in one image of four panels, the runs\n"
    "overlaid, named by their directory and strategy. Needs gnuplot (apt-get install\n"
    "gnuplot-nox).\n"
    "\n"
    "  RUN_DIR          a run directory (holds metrics.jsonl; summary.json once the run ended)\n"
    "  -o, --output F   the image, .svg or .png (default: report.svg)\n";

constexpr double kMiB = 1024.0 * 1024.0;

// One run as the report draws it.
struct RunData {
  std::string title;  // "<directory name> (<strategy>)"
  // step, loss, grad_norm, tokens/s per line of metrics.jsonl; NaN where a value is null.
  std::vector<std::array<double, 4>> steps;
  // rank, peak RSS, LibTorch's peak, model states, in MiB; empty without summary.json.
  std::vector<std::array<double, 4>> ranks;
};

double Number(const JsonValue* v) {
  return v && v->type == JsonValue::Type::kNumber ? v->number : NAN;
}

RunData ReadRun(const fs::path& dir) {
  if (!fs::is_directory(dir)) {
    throw Error(CAI_NOT_FOUND, dir.string() + ": no such directory; name the run directory " +
                                   "`cai train` wrote (--run-dir, or runs/<job>-<time>)");
  }
  const fs::path metrics = dir / "metrics.jsonl";
  if (!fs::is_regular_file(metrics)) {
    throw Error(CAI_NOT_FOUND, metrics.string() + ": not found; is " + dir.string() +
                                   " a run directory of `cai train` that has made a step?");
  }
  RunData run;
  std::istringstream lines(ReadTextFile(metrics));
  int number = 0;
  for (std::string line; std::getline(lines, line);) {
    ++number;
    if (line.empty()) continue;
    const JsonValue step = ParseJson(line, metrics.string() + " line " + std::to_string(number));
    run.steps.push_back({Number(step.Find("step")), Number(step.Find("loss")),
                         Number(step.Find("grad_norm")), Number(step.Find("tokens_per_s"))});
  }
  if (run.steps.empty()) {
    throw Error(CAI_NOT_FOUND,
                metrics.string() + ": no steps yet; report once the run has made one");
  }

  std::string name = dir.lexically_normal().filename().string();
  if (name.empty()) name = dir.lexically_normal().parent_path().filename().string();
  run.title = name;
  const fs::path summary_path = dir / "summary.json";
  if (!fs::exists(summary_path)) {
    std::cerr << "cai: " << summary_path.string()
              << " not found (the run has not ended): its memory panel is left out\n";
    return run;
  }
  const JsonValue summary = ParseJson(ReadTextFile(summary_path), summary_path.string());
  if (const JsonValue* plugin = summary.Find("plugin");
      plugin && plugin->type == JsonValue::Type::kString) {
    run.title += " (" + plugin->string + ")";
  }
  const JsonValue* ranks = summary.Find("ranks");
  if (!ranks || ranks->type != JsonValue::Type::kArray) {
    throw Error(CAI_INVALID_ARGUMENT, summary_path.string() +
                                          ": has no \"ranks\" array; was it written by `cai "
                                          "train`? Remove it to report the steps alone");
  }
  for (const JsonValue& rank : ranks->array) {
    double states = 0;
    if (const JsonValue* bytes = rank.Find("strategy_bytes")) {
      for (const auto& [kind, value] : bytes->object) states += Number(&value);
    }
    run.ranks.push_back({Number(rank.Find("rank")), Number(rank.Find("peak_rss_bytes")) / kMiB,
                         Number(rank.Find("framework_peak_bytes")) / kMiB, states / kMiB});
  }
  return run;
}

// gnuplot reads "NaN" as a missing point.
template <size_t N>
void WriteColumns(const fs::path& path, const std::vector<std::array<double, N>>& rows) {
  std::ofstream out(path);
  out.precision(10);
  for (const auto& row : rows) {
    for (size_t i = 0; i < N; ++i) {
      out << (i ? " " : "");
      if (std::isfinite(row[i])) {
        out << row[i];
      } else {
        out << "NaN";
      }
    }
    out << "\n";
  }
  if (!out) throw Error(CAI_PERMISSION_DENIED, path.string() + ": cannot be written");
}

// A gnuplot single-quoted string: quotes doubled, nothing else is special in it.
std::string Quote(const std::string& text) {
  std::string out = "'";
  for (char c : text) out += c == '\'' ? std::string("''") : std::string(1, c);
  return out + "'";
}

std::string Script(const std::vector<RunData>& runs, const fs::path& output, bool png) {
  // One colour per run in every panel (matplotlib's first ten).
  static const char* const kColours[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                         "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
  const auto colour = [&](size_t i) {
    return std::string("lc rgb '") + kColours[i % std::size(kColours)] + "'";
  };
  std::ostringstream s;
  s << (png ? "set terminal pngcairo noenhanced size 1400,900 font 'sans,10'\n"
            : "set terminal svg noenhanced size 1400,900 dynamic font 'sans,10' background "
              "'white'\n")
    << "set output " << Quote(output.string()) << "\n"
    << "set multiplot layout 2,2\nset grid\nset key top right\nset xlabel 'step'\n";
  const auto panel = [&](const char* title, const char* ylabel, int column) {
    s << "set title '" << title << "'\nset ylabel '" << ylabel << "'\nplot ";
    for (size_t i = 0; i < runs.size(); ++i) {
      s << (i ? ", " : "") << "'steps-" << i << ".dat' using 1:" << column << " with lines "
        << colour(i) << " lw 1.5 title " << Quote(runs[i].title);
    }
    s << "\n";
  };
  panel("loss", "loss", 2);
  panel("gradient norm", "L2 norm (before clipping)", 3);
  panel("throughput", "tokens/s", 4);
  size_t ranks = 1;
  for (const RunData& run : runs) ranks = std::max(ranks, run.ranks.size());
  s << "set title 'peak memory per rank'\nset ylabel 'MiB'\nset xlabel 'rank'\nset xtics 1\n"
    << "set xrange [-0.5:" << static_cast<double>(ranks) - 0.5 << "]\nplot ";
  bool any = false;
  for (size_t i = 0; i < runs.size(); ++i) {
    if (runs[i].ranks.empty()) continue;
    const std::string file = "'memory-" + std::to_string(i) + ".dat'";
    s << (any ? ", " : "") << file << " using 1:2 with linespoints " << colour(i) << " pt 7 title "
      << Quote(runs[i].title + ": peak RSS") << ", " << file << " using 1:3 with linespoints "
      << colour(i) << " dt 2 pt 6 title " << Quote(runs[i].title + ": LibTorch peak") << ", "
      << file << " using 1:4 with linespoints " << colour(i) << " dt 3 pt 4 title "
      << Quote(runs[i].title + ": model states");
    any = true;
  }
  // gnuplot needs something to plot: a panel that says why it is empty.
  if (!any) s << "NaN title 'no summary.json: no run has ended'";
  s << "\nunset multiplot\n";
  return s.str();
}

// The gnuplot on PATH, or nullopt.
std::optional<fs::path> FindGnuplot() {
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path ? path : "");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    const fs::path candidate = fs::path(dir.empty() ? "." : dir) / "gnuplot";
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return std::nullopt;
}

// Runs gnuplot on `script` in `dir` (its data files are named relative to it); returns its exit
// status, or -1 when it could not run or was killed.
int RunGnuplot(const fs::path& gnuplot, const fs::path& dir, const fs::path& script) {
  const pid_t pid = ::fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    if (::chdir(dir.c_str()) != 0) ::_exit(127);
    ::execl(gnuplot.c_str(), "gnuplot", script.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return -1;
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// A directory under $TMPDIR for the script and data files, removed with this object.
class ScratchDir {
 public:
  ScratchDir() {
    std::string pattern = (fs::temp_directory_path() / "cai-report-XXXXXX").string();
    if (!::mkdtemp(pattern.data())) {
      throw Error(CAI_PERMISSION_DENIED,
                  "cannot create a temporary directory " + pattern + ": " + std::strerror(errno));
    }
    path_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

}  // namespace

int RunReportCommand(std::span<const std::string> args, std::ostream& out) {
  std::vector<fs::path> dirs;
  fs::path output = "report.svg";
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      out << kReportUsage;
      return 0;
    } else if (a == "-o" || a == "--output") {
      if (i + 1 >= args.size()) {
        throw Error(CAI_INVALID_ARGUMENT, a + " needs a file name\n" + kReportUsage);
      }
      output = args[++i];
    } else if (!a.empty() && a[0] == '-') {
      throw Error(CAI_INVALID_ARGUMENT, "unknown option '" + a + "'\n" + kReportUsage);
    } else {
      dirs.emplace_back(a);
    }
  }
  if (dirs.empty()) {
    throw Error(CAI_INVALID_ARGUMENT, std::string("needs a run directory\n") + kReportUsage);
  }
  const std::string extension = output.extension().string();
  if (extension != ".svg" && extension != ".png") {
    throw Error(CAI_INVALID_ARGUMENT, "-o " + output.string() +
                                          ": the image is drawn as SVG or PNG; name it "
                                          "*.svg or *.png");
  }
  const fs::path parent = fs::absolute(output).parent_path();
  if (!fs::is_directory(parent)) {
    throw Error(CAI_NOT_FOUND, "-o " + output.string() + ": directory " + parent.string() +
                                   " does not exist; create it first");
  }
  // Before any work: the one thing the user has to install.
  const std::optional<fs::path> gnuplot = FindGnuplot();
  if (!gnuplot) {
    throw Error(CAI_FAILED_PRECONDITION,
                "cai report draws with gnuplot, which is not on PATH; install it with `apt-get "
                "install gnuplot-nox`");
  }

  std::vector<RunData> runs;
  for (const fs::path& dir : dirs) runs.push_back(ReadRun(dir));
  ScratchDir scratch;
  for (size_t i = 0; i < runs.size(); ++i) {
    WriteColumns(scratch.path() / ("steps-" + std::to_string(i) + ".dat"), runs[i].steps);
    if (!runs[i].ranks.empty()) {
      WriteColumns(scratch.path() / ("memory-" + std::to_string(i) + ".dat"), runs[i].ranks);
    }
  }
  const fs::path script = scratch.path() / "report.gp";
  std::ofstream(script) << Script(runs, fs::absolute(output), extension == ".png");
  const int status = RunGnuplot(*gnuplot, scratch.path(), script);
  if (status != 0) {
    throw Error(CAI_INTERNAL, gnuplot->string() + " failed (exit status " + std::to_string(status) +
                                  ") drawing " + output.string() + "; its messages are above");
  }
  out << "cai: report of " << runs.size() << (runs.size() == 1 ? " run" : " runs") << " in "
      << output.string() << "\n";
  return 0;
}

}  // namespace cai
