// Checkpoint reading, as `checkpoint.resume` does it: the input is the run directory's
// `latest` pointer, NUL, a step directory's COMPLETE marker, NUL, and rank 0's file
// (rank-00000.cait). The target finds the checkpoint, opens it and reads every entry the rank
// file lists (tensors as fp32 where they are floating point, meta entries), and every
// canonical name fsdp's sharded index lists.
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/rank_file.h"
#include "core/status.h"
#include "fuzz_input.h"

namespace {

namespace fs = std::filesystem;

// Reads `name` whole into fp32 when it is at most 1M elements; errors are the reader's answers.
void ReadAsFp32(cai_checkpoint* ckpt, const std::string& name, int64_t numel) {
  if (numel < 0 || numel > (1 << 20)) return;
  std::vector<float> out(static_cast<size_t>(numel));
  int64_t shape = numel, stride = 1;
  cai_tensor t{out.data(), {CAI_DEVICE_CPU, 0}, 1, {CAI_DTYPE_FLOAT, 32, 1}, &shape, &stride, 0};
  if (cai_status* s = cai::CheckpointApi()->read_tensor(ckpt, name.c_str(), 0, 0, &t)) {
    cai::DestroyStatus(s);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view rest(reinterpret_cast<const char*>(data), size);
  const std::string_view latest = cai::fuzz::TakeUntilNul(rest);
  const std::string_view complete = cai::fuzz::TakeUntilNul(rest);
  const fs::path run = cai::fuzz::Scratch() / "run";
  fs::remove_all(run);
  fs::create_directories(run / "step-000001");
  cai::fuzz::WriteFile(run / "latest", latest);
  cai::fuzz::WriteFile(run / "step-000001" / "COMPLETE", complete);
  cai::fuzz::WriteFile(run / "step-000001" / cai::ckpt::RankFileName(0), rest);
  try {
    const auto found = cai::ckpt::FindLatestCheckpoint(run);
    if (!found) return 0;
    cai::ckpt::CheckpointReader reader(*found);
    const cai::ckpt::RankFileReader file(*found / cai::ckpt::RankFileName(0));
    for (const cai::ckpt::Entry& e : file.entries()) {
      if (e.kind == cai::ckpt::EntryKind::kMeta) {
        const char* value = nullptr;
        cai_status* s = cai::CheckpointApi()->read_meta(reader.handle(), e.name.c_str(), &value);
        if (s) cai::DestroyStatus(s);
        if (e.name == "fsdp.index" && value) {
          std::istringstream index(value);
          std::string word, name;
          int64_t offset = 0, numel = 0;
          while (index >> word) {
            if (word != "param" || !(index >> offset >> numel)) continue;
            index.get();
            std::getline(index, name);
            ReadAsFp32(reader.handle(), "model/" + name, numel);
          }
        }
        continue;
      }
      int64_t numel = 1;
      for (int64_t d : e.shape) {
        if (d < 0 || (d > 0 && numel > (int64_t{1} << 20) / d)) {
          numel = -1;
          break;
        }
        numel *= d;
      }
      ReadAsFp32(reader.handle(), e.name, numel);
    }
  } catch (const cai::Error&) {
  }
  return 0;
}
