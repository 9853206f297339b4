// `cai report`: the loss, gradient norm, tokens/s and per-rank memory of one or more run
// directories, overlaid in one SVG or PNG drawn by gnuplot.
#pragma once

#include <ostream>
#include <span>
#include <string>

namespace cai {

// Runs `cai report ARGS...`; returns the exit status.
int RunReportCommand(std::span<const std::string> args, std::ostream& out);

}  // namespace cai
