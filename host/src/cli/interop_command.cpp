#include "cli/interop_command.h"

#include <cctype>
#include <cmath>
#include <filesystem>
#include <optional>

#include "checkpoint/checkpoint.h"
#include "core/json.h"
#include "core/status.h"
#include "interop/hf_layout.h"
#include "interop/hf_weights.h"
#include "train/job.h"

namespace fs = std::filesystem;

namespace cai {
namespace {

constexpr const char* kExportUsage =
    "usage: cai export CHECKPOINT --format safetensors OUT_DIR [--job JOB.toml]\n"
    "                  [--max-shard-size SIZE] [--dtype fp32|bf16|fp16]\n"
    "\n"
    "Writes the model weights of a checkpoint in Hugging Face's names and layouts\n"
    "(GPT2LMHeadModel, LlamaForCausalLM): model.safetensors (or "
    "model-0000i-of-0000n.safetensors),\n"
    "model.safetensors.index.json and config.json, which transformers' from_pretrained loads.\n"
    "\n"
    "  CHECKPOINT        a step directory (run/checkpoints/step-000100), or a run directory or\n"
    "                    its checkpoints/ (then the latest complete checkpoint); saved by any\n"
    "                    strategy at any world size\n"
    "  --format F        safetensors (the only format)\n"
    "  --job JOB.toml    the job that describes the model (default: the run directory's\n"
    "                    config.resolved.toml)\n"
    "  --max-shard-size  largest file, e.g. 5GB (default), 500MB, 1GiB or bytes\n"
    "  --dtype D         write fp32, bf16 or fp16 (default: as the checkpoint holds them)\n";

constexpr const char* kImportUsage =
    "usage: cai import DIR\n"
    "\n"
    "Reads DIR/config.json (a GPT2LMHeadModel or LlamaForCausalLM saved by transformers, or by\n"
    "`cai export`) and prints the [model] section of a job that trains from its weights:\n"
    "the model's keys and model.init_from = \"DIR\". Paste it into a job file; `cai train`\n"
    "checks the weights when it starts.\n";

// "5GB" (10^9, as transformers), "1GiB" (2^30), "500MB", "123" bytes.
uint64_t ParseSize(const std::string& text) {
  size_t digits = 0;
  while (digits < text.size() &&
         (std::isdigit(static_cast<unsigned char>(text[digits])) || text[digits] == '.')) {
    ++digits;
  }
  std::string unit = text.substr(digits);
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double scale = 0;
  if (unit.empty() || unit == "B") scale = 1;
  if (unit == "KB") scale = 1e3;
  if (unit == "MB") scale = 1e6;
  if (unit == "GB") scale = 1e9;
  if (unit == "KIB") scale = 1024.0;
  if (unit == "MIB") scale = 1024.0 * 1024;
  if (unit == "GIB") scale = 1024.0 * 1024 * 1024;
  double value = 0;
  try {
    value = digits == 0 ? 0 : std::stod(text.substr(0, digits));
  } catch (const std::exception&) {
    value = 0;
  }
  if (scale == 0 || !(value > 0)) {
    throw Error(CAI_INVALID_ARGUMENT,
                "--max-shard-size '" + text + "': expected a size such as 5GB, 500MB or 1GiB");
  }
  return static_cast<uint64_t>(std::llround(value * scale));
}

// A step directory as given, or the latest complete one of a run or checkpoints directory.
fs::path ResolveCheckpoint(const fs::path& given) {
  if (fs::is_regular_file(given / "COMPLETE")) return given;
  for (const fs::path& dir : {given, given / "checkpoints"}) {
    if (auto latest = ckpt::FindLatestCheckpoint(dir)) return *latest;
  }
  throw Error(CAI_NOT_FOUND, given.string() +
                                 ": not a complete checkpoint, nor a run or checkpoints "
                                 "directory holding one");
}

}  // namespace

int RunExportCommand(std::span<const std::string> args, std::ostream& out) {
  std::optional<fs::path> checkpoint, out_dir, job_file;
  std::string format;
  interop::ExportOptions options;
  auto value = [&](size_t& i) -> const std::string& {
    if (i + 1 >= args.size()) {
      throw Error(CAI_INVALID_ARGUMENT, args[i] + " needs a value\n" + kExportUsage);
    }
    return args[++i];
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      out << kExportUsage;
      return 0;
    } else if (a == "--format") {
      format = value(i);
    } else if (a == "--job") {
      job_file = value(i);
    } else if (a == "--max-shard-size") {
      options.max_shard_bytes = ParseSize(value(i));
    } else if (a == "--dtype") {
      const std::string& d = value(i);
      if (d == "fp32") {
        options.dtype = cai_dtype{CAI_DTYPE_FLOAT, 32, 1};
      } else if (d == "bf16") {
        options.dtype = cai_dtype{CAI_DTYPE_BFLOAT, 16, 1};
      } else if (d == "fp16") {
        options.dtype = cai_dtype{CAI_DTYPE_FLOAT, 16, 1};
      } else {
        throw Error(CAI_INVALID_ARGUMENT, "--dtype '" + d + "': expected fp32, bf16 or fp16");
      }
    } else if (!a.empty() && a[0] == '-') {
      throw Error(CAI_INVALID_ARGUMENT, "unknown option '" + a + "'\n" + kExportUsage);
    } else if (!checkpoint) {
      checkpoint = a;
    } else if (!out_dir) {
      out_dir = a;
    } else {
      throw Error(CAI_INVALID_ARGUMENT, "unexpected argument '" + a + "'\n" + kExportUsage);
    }
  }
  if (!checkpoint || !out_dir) {
    throw Error(CAI_INVALID_ARGUMENT,
                std::string("needs a checkpoint and an output directory\n") + kExportUsage);
  }
  if (format != "safetensors") {
    throw Error(CAI_INVALID_ARGUMENT,
                (format.empty() ? std::string("--format is required")
                                : "--format '" + format + "' is not supported") +
                    "; the format is safetensors\n" + kExportUsage);
  }
  const fs::path step_dir = ResolveCheckpoint(*checkpoint);
  if (!job_file) {
    // run/checkpoints/step-N -> run/config.resolved.toml, which `cai train` wrote.
    job_file = step_dir.parent_path().parent_path() / "config.resolved.toml";
    if (!fs::is_regular_file(*job_file)) {
      throw Error(CAI_NOT_FOUND, "no " + job_file->string() +
                                     " beside the checkpoint to say what model it holds; "
                                     "name the job with --job JOB.toml");
    }
  }
  const JobConfig job = LoadJob(*job_file, {});
  if (GetString(*job.model, "kind") == "torchscript") {
    throw Error(CAI_INVALID_ARGUMENT, job_file->string() +
                                          ": model.kind = \"torchscript\"; cai export writes the "
                                          "zoo's models (gpt2, llama)");
  }
  const interop::ExportResult result =
      interop::ExportSafetensors(step_dir, ZooModelConfig(*job.model), *out_dir, options);
  out << "exported " << result.tensors << " tensors (" << result.bytes << " bytes) of "
      << step_dir.string() << " to " << out_dir->string() << " in " << result.files.size()
      << (result.files.size() == 1 ? " file" : " files") << "\n";
  return 0;
}

int RunImportCommand(std::span<const std::string> args, std::ostream& out) {
  std::optional<fs::path> dir;
  for (const std::string& a : args) {
    if (a == "--help" || a == "-h") {
      out << kImportUsage;
      return 0;
    }
    if ((!a.empty() && a[0] == '-') || dir) {
      throw Error(CAI_INVALID_ARGUMENT, "unexpected argument '" + a + "'\n" + kImportUsage);
    }
    dir = a;
  }
  if (!dir) throw Error(CAI_INVALID_ARGUMENT, std::string("needs a directory\n") + kImportUsage);
  const ModelConfig config = interop::ReadHfConfig(*dir);
  std::string path = fs::absolute(*dir).lexically_normal().string();
  if (path.size() > 1 && path.back() == '/') path.pop_back();
  out << "[model]\n" << interop::ModelKeysToml(config) << "init_from = " << JsonQuote(path) << "\n";
  return 0;
}

}  // namespace cai
