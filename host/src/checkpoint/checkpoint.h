// The host's checkpoint writer and reader behind cai_checkpoint_api.
//
// On disk, a run directory holds one directory per saved step plus a pointer to the current
// one:
//   run/step-000100/rank-00000.cait   one file per rank: its tensors and meta entries
//   run/step-000100/rank-00001.cait
//   run/step-000100/COMPLETE          "step = 100\nworld_size = 2\n"; written last
//   run/latest                        "step-000100\n"
// (rank_file.h describes the .cait layout.)
//
// Saving is atomic (the protocol of Orbax and PyTorch DCP, with POSIX rename as the commit):
// every rank writes into run/step-000100.tmp-<run id>/ and fsyncs its file and the directory;
// after a barrier, rank 0 writes COMPLETE, renames the directory to its final name, fsyncs the
// run directory, and replaces `latest` by write-to-temporary + rename. A save killed at any
// point leaves the previous checkpoint, and `latest` naming it, intact; a dead save leaves
// only a *.tmp-* directory, which readers ignore.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cai/plugin.h"

namespace cai {

// The table handed to plugins as cai_host_api.checkpoint: every entry filled, each one
// catching all exceptions into a status. Static storage. Functions on one cai_checkpoint are
// externally synchronised (the host calls a plugin's save/load on one thread).
const cai_checkpoint_api* CheckpointApi();

}  // namespace cai

namespace cai::ckpt {

// How to move bytes of tensors that do not live in host memory (device types other than
// CPU and CUDA_HOST). The host fills these from its memory pool; without them such tensors
// are refused with INVALID_ARGUMENT. Offsets are in bytes from the tensor's first element.
struct DeviceCopy {
  std::function<void(void* host_dst, const cai_tensor& src, size_t src_offset, size_t bytes)>
      to_host;
  std::function<void(const cai_tensor& dst, size_t dst_offset, const void* host_src, size_t bytes)>
      to_device;
};

// torch.optim's names of an optimizer's state slots, by slot index: adam and adamw
// {"exp_avg", "exp_avg_sq"}, sgd {"momentum_buffer"}; empty for other kinds.
std::vector<std::string> OptimizerSlotNames(const std::string& kind);

// "step-000100": the directory name of a step (six digits, more when the step needs them).
std::string StepDirName(int64_t step);

// One rank's side of a save. Not thread-safe.
class CheckpointWriter {
 public:
  // Creates run_dir/step-NNNNNN.tmp-<run_id>/ (every rank of a save must pass the same run_id;
  // RankEnv::run_id is made for this) and opens this rank's file in it. Throws cai::Error
  // naming the path when it cannot.
  CheckpointWriter(const std::filesystem::path& run_dir, int64_t step, int rank, int world_size,
                   const std::string& run_id, DeviceCopy copy = {});
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // What the plugin's save() writes through; valid until Commit() or destruction.
  cai_checkpoint* handle();

  // Names of the optimizer's state slots, by index (AdamW: exp_avg, exp_avg_sq; SGD:
  // momentum_buffer): a tensor the strategy writes as "optim/<param>/<k>" is stored as
  // "optim/<param>/<names[k]>", as torch.optim's state_dict names it. Readers find it under
  // either name (CheckpointReader). Without names, slots keep their numbers.
  void NameOptimizerSlots(std::vector<std::string> names);

  // Finishes and fsyncs this rank's file, calls barrier(); rank 0 then publishes the
  // checkpoint (COMPLETE, rename, `latest`); then barrier() again so that no rank returns
  // before the checkpoint is visible. `barrier` must block until every rank has called it.
  // If a step directory of the same name exists already (a run resumed from an earlier
  // step), it is replaced. Returns the final directory. If rank 0 fails to publish it throws
  // without the second barrier; the launcher then stops the ranks waiting in it.
  std::filesystem::path Commit(const std::function<void()>& barrier);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// A published checkpoint opened for loading. Any rank may read any rank's entries. Not
// thread-safe.
class CheckpointReader {
 public:
  // Throws cai::Error: NOT_FOUND naming `dir` when it is not a complete checkpoint (no
  // COMPLETE); DATA_LOSS naming the file when a rank file is missing or malformed, or two
  // ranks wrote the same name. read_tensor and read_meta verify every byte they return
  // against the file's CRC32Cs: DATA_LOSS naming the file and the entry, with the earlier
  // checkpoints to resume from instead.
  explicit CheckpointReader(const std::filesystem::path& dir, DeviceCopy copy = {});
  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  // What the plugin's load() reads through; valid while the reader lives. A tensor asked for
  // as "optim/<param>/<k>" that the checkpoint does not hold under that name is read from
  // slot k's name (OptimizerSlotNames of adamw, then of sgd), so checkpoints with named and with
  // numbered slots both load.
  cai_checkpoint* handle();
  int saved_world_size() const;
  int64_t step() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// The checkpoint to resume from: the directory `run_dir/latest` names when it is complete;
// otherwise (pointer missing, or naming a directory that is gone or incomplete) the complete
// step-* directory with the highest step. *.tmp-* directories and directories without COMPLETE
// are never returned. nullopt when there is none, or no run_dir. With `skipped`, appends each
// step directory newer than the one returned (all of them when none is) that was passed over,
// with why: "<path> (no COMPLETE marker: ...)" or "<path> (temporary directory ...)".
std::optional<std::filesystem::path> FindLatestCheckpoint(
    const std::filesystem::path& run_dir, std::vector<std::string>* skipped = nullptr);

}  // namespace cai::ckpt
