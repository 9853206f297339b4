// `cai export` (a checkpoint's weights as Hugging Face safetensors) and `cai import` (the job
// keys that train from such weights).
#pragma once

#include <ostream>
#include <span>
#include <string>

namespace cai {

// Runs `cai export ARGS...`; returns the exit status.
int RunExportCommand(std::span<const std::string> args, std::ostream& out);

// Runs `cai import ARGS...`; returns the exit status.
int RunImportCommand(std::span<const std::string> args, std::ostream& out);

}  // namespace cai
