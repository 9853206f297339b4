// Writes the seed inputs of fuzz_checkpoint (latest, NUL, COMPLETE, NUL, rank-00000.cait) and
// fuzz_safetensors under the corpus root given (checkpoint/, safetensors/), through the host's
// own writers: a checkpoint in the canonical layout (tensors, optimizer state, meta), one in
// fsdp's sharded layout with its index, and a safetensors file of three dtypes. Rerun after a
// format change: scripts/fuzz.sh --seeds.
#include <cstdint>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/rank_file.h"
#include "checkpoint/safetensors.h"
#include "core/status.h"
#include "fuzz_input.h"

namespace {

namespace fs = std::filesystem;

void Write(cai_checkpoint* ckpt, const std::string& name, std::vector<float> values,
           std::vector<int64_t> shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) strides[d - 1] = strides[d] * shape[d];
  cai_tensor t{values.data(),
               {CAI_DEVICE_CPU, 0},
               static_cast<int32_t>(shape.size()),
               {CAI_DTYPE_FLOAT, 32, 1},
               shape.data(),
               strides.data(),
               0};
  cai::ThrowIfError(cai::CheckpointApi()->write_tensor(ckpt, name.c_str(), &t));
}

std::string Slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void Pack(const fs::path& run, const fs::path& dir, const fs::path& out) {
  std::string seed = "step-000001";
  seed += '\0';
  seed += Slurp(dir / "COMPLETE");
  seed += '\0';
  seed += Slurp(dir / cai::ckpt::RankFileName(0));
  cai::fuzz::WriteFile(out, seed);
  fs::remove_all(run);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: make_seeds CORPUS_ROOT\n";
    return 2;
  }
  const fs::path out = fs::path(argv[1]) / "checkpoint", run = cai::fuzz::Scratch() / "seeds";
  fs::create_directories(out);
  fs::create_directories(fs::path(argv[1]) / "safetensors");
  {
    using cai::ckpt::SafetensorsTensor;
    std::vector<SafetensorsTensor> tensors = {
        {"transformer.wte.weight", {CAI_DTYPE_FLOAT, 32, 1}, {2, 2}, 0, 0},
        {"transformer.h.0.ln_1.weight", {CAI_DTYPE_BFLOAT, 16, 1}, {2}, 0, 0},
        {"lm_head.bias", {CAI_DTYPE_FLOAT, 16, 1}, {3}, 0, 0}};
    cai::ckpt::SafetensorsWriter w(fs::path(argv[1]) / "safetensors" / "small", tensors,
                                   {{"format", "pt"}});
    const std::vector<uint8_t> bytes(16 + 4 + 6, 0x3c);
    w.Append(bytes.data(), bytes.size());
    w.Finish();
  }
  {
    fs::remove_all(run);
    cai::ckpt::CheckpointWriter w(run, 1, 0, 1, "seed");
    Write(w.handle(), "model/wte.weight", {1, 2, 3, 4, 5, 6}, {2, 3});
    Write(w.handle(), "optim/wte.weight/0", {0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f}, {2, 3});
    cai::ThrowIfError(cai::CheckpointApi()->write_meta(w.handle(), "train.step", "1"));
    Pack(run, w.Commit([] {}), out / "canonical");
  }
  {
    fs::remove_all(run);
    cai::ckpt::CheckpointWriter w(run, 1, 0, 1, "seed");
    Write(w.handle(), "fsdp/root/param.0", {1, 2, 3, 4}, {4});
    Write(w.handle(), "fsdp/root/state0.0", {5, 6, 7, 8}, {4});
    cai::ThrowIfError(cai::CheckpointApi()->write_meta(
        w.handle(), "fsdp.index", "fsdp-sharded 1 1\nunit root 4\nparam 0 3 a\nparam 3 1 b\n"));
    Pack(run, w.Commit([] {}), out / "sharded");
  }
  return 0;
}
