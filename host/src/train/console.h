// What `cai train` prints for the user to watch: a one-screen summary of the run at start, and a
// line per step (a progress bar updated in place on a terminal, plain log lines elsewhere).
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>

#include "cai/model.h"

namespace cai {

// Model FLOPs of one trained token (forward and backward), PaLM's estimate (Chowdhery et al.
// 2022, appendix B; also Megatron-LM's and nanoGPT's): 6Ψ for the matrix multiplies of the Ψ
// parameters they read (MatmulParams), plus 12·n_layer·n_embd·seq_len for attention's scores
// and weighted sum. Pass n_layer = 0 where the shape is unknown (a TorchScript model): 6Ψ alone.
double ModelFlopsPerToken(int64_t params, int64_t n_layer, int64_t n_embd, int64_t seq_len);

// The Ψ of ModelFlopsPerToken: the elements of the parameters a matrix product reads. Tables
// only looked up are left out: learned positions, and a token embedding that no unit reads as
// its matrix (Llama's, whose head is a matrix of its own; GPT-2's head reads its embedding,
// which therefore counts). Counting them put a Llama's MFU above the matmul peak.
int64_t MatmulParams(std::span<const cai_param_info> params, std::span<const cai_unit_info> units);

// Model FLOPs utilisation: the FLOP/s the tokens cost over what `world_size` devices of
// `peak_flops` each could do. NaN when the peak is unknown (peak_flops <= 0).
double ModelFlopsUtilization(double flops_per_token, double tokens_per_s, double peak_flops,
                             int world_size);

// Whether what this process writes to stdout reaches a terminal, where a progress bar may
// rewrite its line: stdout is one, or the process is a rank of `cai train --nproc N` whose
// launcher's stdout is one (launch::kStdoutTerminalVar), and the launcher passes the rewrites on.
bool StdoutReachesTerminal();

// "1h2m3s", "4m0s", "7s"; "?" when not finite.
std::string FormatDuration(double seconds);

struct StepLine {
  int64_t step = 0, steps = 0;
  double loss = 0, lr = 0, tokens_per_s = 0;
  double mfu = 0;  // a fraction; NaN: unknown, shown as "–"
  double eta_s = 0;
  bool skipped = false;
};

// "step 3/8  loss 5.4321  lr 3.00e-03  1234 tok/s  MFU 41.2%  ETA 5s", no newline.
std::string FormatStepLine(const StepLine& line);

// The same line as a progress bar that overwrites the previous one on a terminal: a carriage
// return, "[#####...] ", the line, padding over a longer earlier line; a newline after the
// last step only. With `columns` (> 0) it fits in one line of that width: the bar narrows,
// then goes, then the line is cut at its end.
std::string FormatProgressBar(const StepLine& line, int columns = 0);

// The width of the terminal rank 0's step lines reach: stdout's own, or under the local
// launcher what it passes (launch::kStdoutColumnsVar); 0 when unknown.
int StdoutColumns();

struct RunSummary {
  std::string model;  // Model::Describe()
  int64_t params = 0;
  std::string strategy;
  std::string strategy_options;  // the [plugin.<name>] table as written, TOML text
  int world_size = 1;
  int threads = 1;
  std::string precision;
  int64_t steps = 0, global_batch = 0, seq_len = 0, grad_accum = 1;
  double flops_per_token = 0;
  double peak_flops = 0;  // per rank; 0: unknown
  // The strategy's own per-rank model-state estimate (estimate_memory), if it has one.
  struct Memory {
    uint64_t device_bytes = 0, host_bytes = 0;
    std::string formula;
  };
  std::optional<Memory> memory;
  uint64_t device_budget = 0;  // memory.device_budget per rank; 0: none
  std::filesystem::path run_dir;
};

// A dozen lines: the full configuration stays in run_dir/config.resolved.toml, which it names.
std::string FormatRunSummary(const RunSummary& summary);

}  // namespace cai
