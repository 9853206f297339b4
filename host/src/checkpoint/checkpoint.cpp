#include "checkpoint/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <vector>

#include "cai/sdk/sharded_index.hpp"
#include "checkpoint/dtype_convert.h"
#include "checkpoint/rank_file.h"
#include "core/status.h"

namespace fs = std::filesystem;

// What a cai_checkpoint handle points at: a writer during save, a reader during load. The
// operations of the other side fail with FAILED_PRECONDITION.
struct cai_checkpoint {
  virtual ~cai_checkpoint() = default;
  virtual void WriteTensor(const std::string& name, const cai_tensor&) {
    WrongSide("write_tensor", name);
  }
  virtual void ReadTensor(const std::string& name, int64_t, int64_t, const cai_tensor&) {
    WrongSide("read_tensor", name);
  }
  virtual cai_ckpt_tensor_info TensorInfo(const std::string& name) {
    WrongSide("tensor_info", name);
  }
  virtual void WriteMeta(const std::string& key, const std::string&) {
    WrongSide("write_meta", key);
  }
  virtual const char* ReadMeta(const std::string& key) { WrongSide("read_meta", key); }
  virtual int32_t SavedWorldSize() const = 0;
  virtual const fs::path& Dir() const = 0;
  virtual bool Loading() const = 0;

 private:
  [[noreturn]] void WrongSide(const char* function, const std::string& name) const {
    throw cai::Error(CAI_FAILED_PRECONDITION,
                     std::string(function) + "('" + name + "') on checkpoint " + Dir().string() +
                         ", which is open for " + (Loading() ? "loading" : "saving"));
  }
};

namespace cai::ckpt {
namespace {

// Bytes moved per device copy or dtype conversion: bounds the temporary host buffer.
constexpr size_t kChunkBytes = 16u << 20;

// Fault injection, for the tests that prove saves atomic (tests/plugins/resume):
// CAI_TEST_KILL_IN_SAVE="<rank>:<n>" makes that rank SIGKILL itself at the n-th point of a save
// it reaches (each tensor or meta entry written, the rank file finished, and on rank 0 COMPLETE
// written, the directory renamed into place, `latest` moved), counted over the process, as a
// power cut or the OOM killer would stop it. Unset, this is one comparison per point.
void SavePoint(int rank) {
  static const std::pair<long, long> target = [] {
    const char* v = std::getenv("CAI_TEST_KILL_IN_SAVE");
    long r = -1, n = 0;
    if (v == nullptr || std::sscanf(v, "%ld:%ld", &r, &n) != 2 || n < 1) return std::pair{-1L, 0L};
    return std::pair{r, n};
  }();
  static long reached = 0;
  if (target.first == rank && ++reached == target.second) ::raise(SIGKILL);
}

bool InHostMemory(const cai_tensor& t) {
  return t.device.device_type == CAI_DEVICE_CPU || t.device.device_type == CAI_DEVICE_CUDA_HOST;
}

// Checks what the ABI promises about a tensor the plugin hands in and returns its numel.
int64_t CheckedNumel(const cai_tensor& t, const std::string& what) {
  if (t.ndim < 0 || t.ndim > 8) {
    throw Error(CAI_INVALID_ARGUMENT,
                what + " has " + std::to_string(t.ndim) + " dimensions; checkpoints hold 0 to 8");
  }
  if (t.dtype.lanes != 1 || t.dtype.bits == 0 || t.dtype.bits % 8 != 0) {
    throw Error(CAI_INVALID_ARGUMENT, what + " has dtype {code " + std::to_string(t.dtype.code) +
                                          ", bits " + std::to_string(t.dtype.bits) + ", lanes " +
                                          std::to_string(t.dtype.lanes) + "}");
  }
  if (t.ndim > 0 && (t.shape == nullptr || t.strides == nullptr)) {
    throw Error(CAI_INVALID_ARGUMENT, what + " has no shape or strides");
  }
  int64_t numel = 1;
  int64_t expected_stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    if (t.shape[d] < 0) throw Error(CAI_INVALID_ARGUMENT, what + " has a negative dimension");
    if (t.shape[d] != 1 && t.strides[d] != expected_stride) {
      throw Error(CAI_INVALID_ARGUMENT, what + " is not contiguous (dimension " +
                                            std::to_string(d) + " has stride " +
                                            std::to_string(t.strides[d]) + ", expected " +
                                            std::to_string(expected_stride) + ")");
    }
    expected_stride *= t.shape[d];
    numel *= t.shape[d];
  }
  if (numel > 0 && t.data == nullptr) throw Error(CAI_INVALID_ARGUMENT, what + " has no data");
  return numel;
}

void RequireCopier(bool present, const cai_tensor& t, const std::string& what) {
  if (!present) {
    throw Error(CAI_INVALID_ARGUMENT,
                what + " is in device memory (device type " + std::to_string(t.device.device_type) +
                    ") but this checkpoint was opened without a device copier");
  }
}

std::string SafeRunId(const std::string& run_id) {
  std::string safe = run_id.empty() ? "0" : run_id;
  for (char& c : safe) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '-' && c != '_') c = '_';
  }
  return safe;
}

void FsyncPath(const fs::path& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0 || ::fsync(fd) != 0) {
    const int err = errno;
    if (fd >= 0) ::close(fd);
    throw Error(CAI_DATA_LOSS, "fsync " + path.string() + ": " + std::strerror(err));
  }
  ::close(fd);
}

void FsyncDir(const fs::path& dir) { FsyncPath(dir, O_RDONLY | O_DIRECTORY); }

void WriteFileDurably(const fs::path& path, const std::string& content) {
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << content;
    out.close();
    if (!out) throw Error(CAI_DATA_LOSS, "cannot write " + path.string());
  }
  FsyncPath(path, O_RDONLY);
}

void Rename(const fs::path& from, const fs::path& to) {
  if (std::rename(from.c_str(), to.c_str()) != 0) {
    throw Error(CAI_DATA_LOSS,
                "rename " + from.string() + " -> " + to.string() + ": " + std::strerror(errno));
  }
}

constexpr char kCompleteFile[] = "COMPLETE";
constexpr char kLatestFile[] = "latest";

// COMPLETE holds "key = value" lines; returns them, or nullopt when the file is absent.
std::optional<std::map<std::string, std::string>> ReadComplete(const fs::path& dir) {
  std::ifstream in(dir / kCompleteFile);
  if (!in) return std::nullopt;
  std::map<std::string, std::string> values;
  for (std::string line; std::getline(in, line);) {
    const size_t eq = line.find(" = ");
    if (eq != std::string::npos) values[line.substr(0, eq)] = line.substr(eq + 3);
  }
  return values;
}

std::optional<int64_t> StepOfDirName(const std::string& name) {
  constexpr std::string_view kPrefix = "step-";
  if (!name.starts_with(kPrefix) || name.size() == kPrefix.size()) return std::nullopt;
  int64_t step = 0;
  for (char c : name.substr(kPrefix.size())) {
    if (c < '0' || c > '9' || step > (INT64_MAX - 9) / 10) return std::nullopt;
    step = step * 10 + (c - '0');
  }
  return step;
}

// Whether `name` is "optim/<param>/<k>" with k in decimal; then *slot = k and *prefix_length
// is the length of "optim/<param>/".
bool NumberedSlot(const std::string& name, size_t* slot, size_t* prefix_length) {
  if (!name.starts_with("optim/")) return false;
  const size_t slash = name.rfind('/');
  if (slash <= 6 || slash + 1 == name.size() || name.size() - slash > 3) return false;
  size_t k = 0;
  for (size_t i = slash + 1; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return false;
    k = k * 10 + static_cast<size_t>(name[i] - '0');
  }
  *slot = k;
  *prefix_length = slash + 1;
  return true;
}

bool IsComplete(const fs::path& dir) {
  std::error_code ec;
  return fs::is_regular_file(dir / kCompleteFile, ec);
}

// The complete step directories of `run_dir`, newest first.
std::vector<std::pair<int64_t, fs::path>> CompleteCheckpoints(const fs::path& run_dir) {
  std::vector<std::pair<int64_t, fs::path>> found;
  std::error_code ec;
  for (const fs::directory_entry& entry : fs::directory_iterator(run_dir, ec)) {
    const std::optional<int64_t> step = StepOfDirName(entry.path().filename().string());
    if (step && entry.is_directory(ec) && IsComplete(entry.path())) {
      found.emplace_back(*step, entry.path());
    }
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a > b; });
  return found;
}

// What to do about a damaged checkpoint `dir`: the complete ones saved before it, and how to
// resume from the newest of them.
std::string DamagedAdvice(const fs::path& dir, int64_t step) {
  const fs::path run_dir = dir.parent_path();
  std::string earlier;
  for (const auto& [s, path] : CompleteCheckpoints(run_dir)) {
    if (s < step) earlier += (earlier.empty() ? "" : ", ") + path.filename().string();
  }
  std::string text = ". The checkpoint " + dir.string() + " is damaged and cannot be loaded. ";
  if (earlier.empty()) {
    return text + "No earlier complete checkpoint is in " + run_dir.string() +
           ": restore the file from a copy, or start the run again without checkpoint.resume";
  }
  return text + "Earlier checkpoints in " + run_dir.string() + ": " + earlier +
         ". To resume from the newest of them, move this one aside (mv " + dir.string() + " " +
         dir.string() + ".damaged) and run again with checkpoint.resume = true";
}

}  // namespace

std::vector<std::string> OptimizerSlotNames(const std::string& kind) {
  if (kind == "adam" || kind == "adamw") return {"exp_avg", "exp_avg_sq"};
  if (kind == "sgd") return {"momentum_buffer"};
  return {};
}

std::string StepDirName(int64_t step) {
  char name[40];
  std::snprintf(name, sizeof(name), "step-%06lld", static_cast<long long>(step));
  return name;
}

// ---- Writing ------------------------------------------------------------------------------

struct CheckpointWriter::State : cai_checkpoint {
  fs::path run_dir;
  fs::path tmp_dir;
  fs::path final_dir;
  std::string run_id;
  int64_t step = 0;
  int rank = 0;
  int world_size = 0;
  DeviceCopy copy;
  std::optional<RankFileWriter> file;
  std::vector<std::string> slot_names;

  // "optim/<param>/<k>" under slot k's name, when it has one.
  std::string Stored(const std::string& name) const {
    size_t k = 0, prefix = 0;
    if (!NumberedSlot(name, &k, &prefix) || k >= slot_names.size()) return name;
    return name.substr(0, prefix) + slot_names[k];
  }

  void WriteTensor(const std::string& given, const cai_tensor& t) override {
    SavePoint(rank);
    const std::string name = Stored(given);
    RankFileWriter& out = Open(name);
    const std::string what = "tensor '" + name + "'";
    const int64_t numel = CheckedNumel(t, what);
    const uint64_t bytes = static_cast<uint64_t>(numel) * DtypeBytes(t.dtype);
    const uint64_t offset = out.Reserve(EntryKind::kTensor, name, bytes);
    if (InHostMemory(t)) {
      out.Write(offset, static_cast<const char*>(t.data) + t.byte_offset, bytes);
    } else if (bytes > 0) {
      RequireCopier(static_cast<bool>(copy.to_host), t, what);
      std::vector<char> buffer(std::min<uint64_t>(bytes, kChunkBytes));
      for (uint64_t done = 0; done < bytes; done += buffer.size()) {
        const size_t n = std::min<uint64_t>(buffer.size(), bytes - done);
        copy.to_host(buffer.data(), t, done, n);
        out.Write(offset + done, buffer.data(), n);
      }
    }
    Entry entry;
    entry.kind = EntryKind::kTensor;
    entry.name = name;
    entry.dtype = t.dtype;
    entry.shape.assign(t.shape, t.shape + t.ndim);
    entry.offset = offset;
    entry.bytes = bytes;
    out.Add(std::move(entry));
  }

  void WriteMeta(const std::string& key, const std::string& value) override {
    SavePoint(rank);
    RankFileWriter& out = Open(key);
    const uint64_t offset = out.Reserve(EntryKind::kMeta, key, value.size());
    out.Write(offset, value.data(), value.size());
    Entry entry;
    entry.kind = EntryKind::kMeta;
    entry.name = key;
    entry.shape = {static_cast<int64_t>(value.size())};
    entry.offset = offset;
    entry.bytes = value.size();
    out.Add(std::move(entry));
  }

  int32_t SavedWorldSize() const override { return world_size; }
  const fs::path& Dir() const override { return tmp_dir; }
  bool Loading() const override { return false; }

  RankFileWriter& Open(const std::string& name) {
    if (!file) {
      throw Error(CAI_FAILED_PRECONDITION, "cannot write '" + name + "': checkpoint " +
                                               final_dir.string() + " was already committed");
    }
    return *file;
  }
};

CheckpointWriter::CheckpointWriter(const fs::path& run_dir, int64_t step, int rank, int world_size,
                                   const std::string& run_id, DeviceCopy copy)
    : state_(std::make_unique<State>()) {
  if (step < 0 || world_size < 1 || rank < 0 || rank >= world_size) {
    throw Error(CAI_INVALID_ARGUMENT, "checkpoint of step " + std::to_string(step) + " for rank " +
                                          std::to_string(rank) + " of " +
                                          std::to_string(world_size));
  }
  State& s = *state_;
  s.run_dir = run_dir;
  s.run_id = SafeRunId(run_id);
  s.final_dir = run_dir / StepDirName(step);
  s.tmp_dir = run_dir / (StepDirName(step) + ".tmp-" + s.run_id);
  s.step = step;
  s.rank = rank;
  s.world_size = world_size;
  s.copy = std::move(copy);
  std::error_code ec;
  fs::create_directories(s.tmp_dir, ec);
  if (ec) {
    throw Error(CAI_PERMISSION_DENIED,
                "cannot create checkpoint directory " + s.tmp_dir.string() + ": " + ec.message());
  }
  s.file.emplace(s.tmp_dir / RankFileName(rank), rank, world_size, step);
}

CheckpointWriter::~CheckpointWriter() = default;

cai_checkpoint* CheckpointWriter::handle() { return state_.get(); }

void CheckpointWriter::NameOptimizerSlots(std::vector<std::string> names) {
  state_->slot_names = std::move(names);
}

fs::path CheckpointWriter::Commit(const std::function<void()>& barrier) {
  State& s = *state_;
  if (!s.file) {
    throw Error(CAI_FAILED_PRECONDITION,
                "checkpoint " + s.final_dir.string() + " was already committed");
  }
  s.file->Finish();
  s.file.reset();
  FsyncDir(s.tmp_dir);
  SavePoint(s.rank);
  barrier();
  if (s.rank == 0) {
    std::ostringstream complete;
    complete << "step = " << s.step << "\nworld_size = " << s.world_size << "\n";
    WriteFileDurably(s.tmp_dir / kCompleteFile, complete.str());
    FsyncDir(s.tmp_dir);
    SavePoint(s.rank);
    // rename() cannot replace a non-empty directory; move an old save of this step aside.
    const fs::path old_dir = s.run_dir / (StepDirName(s.step) + ".old-" + s.run_id);
    std::error_code ec;
    const bool replacing = fs::exists(s.final_dir, ec);
    if (replacing) Rename(s.final_dir, old_dir);
    Rename(s.tmp_dir, s.final_dir);
    FsyncDir(s.run_dir);
    SavePoint(s.rank);
    const fs::path latest_tmp = s.run_dir / (std::string(kLatestFile) + ".tmp-" + s.run_id);
    WriteFileDurably(latest_tmp, StepDirName(s.step) + "\n");
    Rename(latest_tmp, s.run_dir / kLatestFile);
    FsyncDir(s.run_dir);
    SavePoint(s.rank);
    if (replacing) fs::remove_all(old_dir, ec);
  }
  barrier();
  return s.final_dir;
}

// ---- Reading ------------------------------------------------------------------------------

struct CheckpointReader::State : cai_checkpoint {
  struct Location {
    size_t file;
    size_t entry;
  };

  fs::path dir;
  int64_t step = 0;
  int world_size = 0;
  DeviceCopy copy;
  std::vector<RankFileReader> files;
  std::map<std::string, Location> tensors;
  std::map<std::string, Location> metas;
  std::map<std::string, std::string> meta_values;  // read_meta's strings live here

  // Reads through ReadEntry, adding what to do when the data is damaged.
  void ReadVerified(const RankFileReader& file, const Entry& e, uint64_t begin, void* data,
                    size_t bytes) const {
    try {
      file.ReadEntry(e, begin, data, bytes);
    } catch (const Error& error) {
      if (error.code() != CAI_DATA_LOSS) throw;
      throw Error(CAI_DATA_LOSS, error.what() + DamagedAdvice(dir, step));
    }
  }

  const Entry& Find(const std::map<std::string, Location>& table, const std::string& name,
                    const char* kind, Location* where) const {
    auto it = table.find(name);
    size_t k = 0, prefix = 0;
    if (&table == &tensors && NumberedSlot(name, &k, &prefix)) {
      for (const char* optimizer : {"adamw", "sgd"}) {
        const std::vector<std::string> names = OptimizerSlotNames(optimizer);
        if (it == table.end() && k < names.size()) {
          it = table.find(name.substr(0, prefix) + names[k]);
        }
      }
    }
    if (it == table.end()) {
      throw Error(CAI_NOT_FOUND, std::string("checkpoint ") + dir.string() + " has no " + kind +
                                     " '" + name + "'");
    }
    *where = it->second;
    return files[it->second.file].entries()[it->second.entry];
  }

  // The element count of a read of [offset, offset + count) (count 0: to the end) from a
  // tensor of `numel` elements into `dst`, which must hold exactly that many.
  int64_t CheckedRange(const std::string& name, int64_t numel, int64_t offset, int64_t count,
                       const cai_tensor& dst) const {
    if (count == 0) count = numel - offset;
    if (offset < 0 || count < 0 || offset > numel || count > numel - offset) {
      throw Error(CAI_OUT_OF_RANGE, "elements [" + std::to_string(offset) + ", " +
                                        std::to_string(offset + count) + ") of tensor '" + name +
                                        "' in " + dir.string() + ", which has " +
                                        std::to_string(numel));
    }
    const std::string what = "destination of '" + name + "'";
    const int64_t dst_numel = CheckedNumel(dst, what);
    if (dst_numel != count) {
      throw Error(CAI_INVALID_ARGUMENT, what + " holds " + std::to_string(dst_numel) +
                                            " elements but " + std::to_string(count) + " are read");
    }
    return count;
  }

  void ReadTensor(const std::string& name, int64_t offset, int64_t count,
                  const cai_tensor& dst) override {
    if (!tensors.count(name)) {
      if (const ShardedTensor* sharded = FindSharded(name)) {
        return ReadSharded(name, *sharded, offset, count, dst);
      }
    }
    Location at{};
    const Entry& e = Find(tensors, name, "tensor", &at);
    const RankFileReader& file = files[at.file];
    int64_t numel = 1;
    for (int64_t d : e.shape) numel *= d;
    count = CheckedRange(name, numel, offset, count, dst);
    const std::string what = "destination of '" + name + "'";
    const bool same = SameDtype(e.dtype, dst.dtype);
    if (!same && !(IsConvertibleFloat(e.dtype) && IsConvertibleFloat(dst.dtype))) {
      throw Error(CAI_INVALID_ARGUMENT, "tensor '" + name + "' is " + DtypeName(e.dtype) +
                                            " and cannot be read into " + DtypeName(dst.dtype) +
                                            " (conversions are between fp32, bf16 and fp16)");
    }
    const bool host = InHostMemory(dst);
    if (!host && count > 0) RequireCopier(static_cast<bool>(copy.to_device), dst, what);

    const size_t src_size = DtypeBytes(e.dtype);
    const size_t dst_size = DtypeBytes(dst.dtype);
    const uint64_t src_begin = static_cast<uint64_t>(offset) * src_size;  // within the entry
    auto* dst_bytes = static_cast<char*>(dst.data) + dst.byte_offset;
    if (same && host) {
      ReadVerified(file, e, src_begin, dst_bytes, static_cast<size_t>(count) * src_size);
      return;
    }
    const size_t chunk = std::max<size_t>(1, kChunkBytes / std::max(src_size, dst_size));
    std::vector<char> in(chunk * src_size);
    std::vector<char> out(same ? 0 : chunk * dst_size);
    for (int64_t done = 0; done < count; done += static_cast<int64_t>(chunk)) {
      const size_t n = std::min<size_t>(chunk, static_cast<size_t>(count - done));
      ReadVerified(file, e, src_begin + static_cast<uint64_t>(done) * src_size, in.data(),
                   n * src_size);
      const char* converted = in.data();
      if (!same) {
        // Straight into host memory when possible; through `out` for the device copy.
        char* target = host ? dst_bytes + static_cast<size_t>(done) * dst_size : out.data();
        ConvertFloats(in.data(), e.dtype, target, dst.dtype, n);
        if (host) continue;
        converted = out.data();
      }
      copy.to_device(dst, static_cast<size_t>(done) * dst_size, converted, n * dst_size);
    }
  }

  cai_ckpt_tensor_info TensorInfo(const std::string& name) override {
    if (!tensors.count(name)) {
      if (const ShardedTensor* sharded = FindSharded(name)) {
        // The index keeps sizes, not shapes: a canonical tensor read from shards is 1-D.
        cai_ckpt_tensor_info info = TensorInfo(ShardName(*sharded, 0));
        info.ndim = 1;
        info.shape[0] = sharded->numel;
        return info;
      }
    }
    Location at{};
    const Entry& e = Find(tensors, name, "tensor", &at);
    cai_ckpt_tensor_info info{};
    info.struct_size = CAI_CKPT_TENSOR_INFO_STRUCT_SIZE;
    info.dtype = e.dtype;
    info.ndim = static_cast<int32_t>(e.shape.size());
    std::copy(e.shape.begin(), e.shape.end(), info.shape);
    return info;
  }

  const char* ReadMeta(const std::string& key) override {
    if (const auto cached = meta_values.find(key); cached != meta_values.end()) {
      return cached->second.c_str();
    }
    Location at{};
    const Entry& e = Find(metas, key, "meta entry", &at);
    std::string value(e.bytes, '\0');
    ReadVerified(files[at.file], e, 0, value.data(), value.size());
    return meta_values.emplace(key, std::move(value)).first->second.c_str();
  }

  int32_t SavedWorldSize() const override { return world_size; }
  const fs::path& Dir() const override { return dir; }
  bool Loading() const override { return true; }

  // The sharded layout (docs/checkpoint-layout.md): a unit's members concatenated into one
  // flat tensor, cut into shards of `shard` elements, written as "<prefix>/<unit>/param.<j>"
  // and "<prefix>/<unit>/state<k>.<j>" with the index in meta "<prefix>.index". Reading a
  // canonical name ("model/<p>", "optim/<p>/<k>") through it lets every strategy load such a
  // checkpoint, not only the one that wrote it.
  struct ShardedTensor {
    std::string prefix;  // "fsdp/<unit>/param" or "fsdp/<unit>/state<k>"
    int64_t offset = 0;  // of the parameter in the unit's flat tensor
    int64_t numel = 0;
    int64_t shard = 0;
  };
  static std::string ShardName(const ShardedTensor& t, int64_t j) {
    return t.prefix + "." + std::to_string(j);
  }

  const ShardedTensor* FindSharded(const std::string& name) {
    if (!sharded_index) {
      sharded_index.emplace();
      if (metas.count(kShardedIndexKey)) {
        try {
          sharded_index = sdk::ParseShardedIndex(ReadMeta(kShardedIndexKey));
        } catch (const sdk::Error& e) {
          throw Error(e.code(), "checkpoint " + dir.string() + ": " + e.what());
        }
      }
    }
    if (sharded_index->empty()) return nullptr;
    std::string param, what = "param";
    if (name.starts_with("model/")) {
      param = name.substr(6);
    } else if (name.starts_with("optim/")) {
      const size_t slash = name.rfind('/');
      if (slash <= 6) return nullptr;
      param = name.substr(6, slash - 6);
      what = "state" + name.substr(slash + 1);
    } else {
      return nullptr;
    }
    const auto p = sharded_index->find(param);
    if (p == sharded_index->end()) return nullptr;
    ShardedTensor t{kShardedPrefix + p->second.unit + "/" + what, p->second.offset, p->second.numel,
                    p->second.shard};
    if (!tensors.count(ShardName(t, 0))) return nullptr;
    return &sharded_views.insert_or_assign(name, std::move(t)).first->second;
  }

  // Elements [offset, offset + count) of a canonical tensor, from the shards that hold them.
  void ReadSharded(const std::string& name, const ShardedTensor& t, int64_t offset, int64_t count,
                   const cai_tensor& dst) {
    count = CheckedRange(name, t.numel, offset, count, dst);
    const size_t elem = DtypeBytes(dst.dtype);
    for (int64_t done = 0; done < count;) {
      const int64_t flat = t.offset + offset + done;
      const int64_t j = flat / t.shard, in_shard = flat - j * t.shard;
      const int64_t n = std::min(count - done, t.shard - in_shard);
      cai_tensor part = dst;
      int64_t shape = n, stride = 1;
      part.ndim = 1;
      part.shape = &shape;
      part.strides = &stride;
      part.byte_offset = dst.byte_offset + static_cast<size_t>(done) * elem;
      ReadTensor(ShardName(t, j), in_shard, n, part);
      done += n;
    }
  }

  static constexpr const char* kShardedIndexKey = "fsdp.index";
  static constexpr const char* kShardedPrefix = "fsdp/";
  std::optional<std::map<std::string, sdk::ShardedParam>> sharded_index;  // parsed on first need
  std::map<std::string, ShardedTensor> sharded_views;
};

CheckpointReader::CheckpointReader(const fs::path& dir, DeviceCopy copy)
    : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.dir = dir;
  s.copy = std::move(copy);
  const auto complete = ReadComplete(dir);
  if (!complete) {
    throw Error(CAI_NOT_FOUND, "no complete checkpoint at " + dir.string() + " (no " +
                                   kCompleteFile + " marker; an interrupted save?)");
  }
  try {
    s.step = std::stoll(complete->at("step"));
    s.world_size = std::stoi(complete->at("world_size"));
  } catch (const std::exception&) {
    throw Error(CAI_DATA_LOSS, (dir / kCompleteFile).string() +
                                   " lacks a valid 'step = N' or 'world_size = N' line");
  }
  if (s.world_size < 1) {
    throw Error(CAI_DATA_LOSS,
                (dir / kCompleteFile).string() + " has world_size " + std::to_string(s.world_size));
  }
  for (int r = 0; r < s.world_size; ++r) {
    try {
      s.files.emplace_back(dir / RankFileName(r));
    } catch (const Error& error) {
      if (error.code() != CAI_DATA_LOSS) throw;
      throw Error(CAI_DATA_LOSS, error.what() + DamagedAdvice(dir, s.step));
    }
    const RankFileReader& f = s.files.back();
    if (f.rank() != r || f.world_size() != s.world_size || f.step() != s.step) {
      throw Error(CAI_DATA_LOSS, f.path().string() + " says rank " + std::to_string(f.rank()) +
                                     " of " + std::to_string(f.world_size()) + " at step " +
                                     std::to_string(f.step()) + ", but the checkpoint is step " +
                                     std::to_string(s.step) + " of " +
                                     std::to_string(s.world_size) + " ranks");
    }
    for (size_t i = 0; i < f.entries().size(); ++i) {
      const Entry& e = f.entries()[i];
      auto& table = e.kind == EntryKind::kMeta ? s.metas : s.tensors;
      const auto [it, inserted] = table.emplace(e.name, State::Location{s.files.size() - 1, i});
      if (!inserted) {
        throw Error(CAI_DATA_LOSS, "checkpoint " + dir.string() + ": '" + e.name +
                                       "' was written by rank " + std::to_string(it->second.file) +
                                       " and rank " + std::to_string(r));
      }
    }
  }
}

CheckpointReader::~CheckpointReader() = default;

cai_checkpoint* CheckpointReader::handle() { return state_.get(); }
int CheckpointReader::saved_world_size() const { return state_->world_size; }
int64_t CheckpointReader::step() const { return state_->step; }

// ---- Finding ------------------------------------------------------------------------------

std::optional<fs::path> FindLatestCheckpoint(const fs::path& run_dir,
                                             std::vector<std::string>* skipped) {
  std::error_code ec;
  if (!fs::is_directory(run_dir, ec)) return std::nullopt;
  std::optional<fs::path> best;
  std::ifstream latest(run_dir / kLatestFile);
  std::string name;
  if (latest >> name && StepOfDirName(name) && IsComplete(run_dir / name)) {
    best = run_dir / name;
  } else if (const auto complete = CompleteCheckpoints(run_dir); !complete.empty()) {
    best = complete.front().second;
  }
  if (skipped == nullptr) return best;

  // Step directories newer than the one chosen that a save left unfinished.
  const int64_t best_step = best ? *StepOfDirName(best->filename().string()) : -1;
  std::vector<std::pair<int64_t, std::string>> passed;
  for (const fs::directory_entry& entry : fs::directory_iterator(run_dir, ec)) {
    const std::string dir_name = entry.path().filename().string();
    const size_t tmp = dir_name.find(".tmp-");
    const std::optional<int64_t> step = StepOfDirName(dir_name.substr(0, tmp));
    if (!step || *step <= best_step || !entry.is_directory(ec)) continue;
    if (tmp != std::string::npos) {
      passed.emplace_back(
          *step, entry.path().string() + " (temporary directory of a save that did not finish)");
    } else if (!IsComplete(entry.path())) {
      passed.emplace_back(*step, entry.path().string() + " (no " + kCompleteFile +
                                     " marker: its save did not finish)");
    }
  }
  std::sort(passed.begin(), passed.end());
  for (auto& [step, why] : passed) skipped->push_back(std::move(why));
  return best;
}

}  // namespace cai::ckpt

// ---- The ABI table ------------------------------------------------------------------------

namespace cai {
namespace {

cai_checkpoint& Checked(cai_checkpoint* ckpt) {
  if (ckpt == nullptr) throw Error(CAI_INVALID_ARGUMENT, "checkpoint handle is NULL");
  return *ckpt;
}

std::string Name(const char* name, const char* what) {
  if (name == nullptr || *name == '\0') {
    throw Error(CAI_INVALID_ARGUMENT, std::string(what) + " is NULL or empty");
  }
  return name;
}

const cai_tensor& Tensor(const cai_tensor* tensor) {
  if (tensor == nullptr) throw Error(CAI_INVALID_ARGUMENT, "tensor descriptor is NULL");
  return *tensor;
}

cai_status* WriteTensor(cai_checkpoint* ckpt, const char* name, const cai_tensor* tensor) {
  return Guard([&] { Checked(ckpt).WriteTensor(Name(name, "tensor name"), Tensor(tensor)); });
}

cai_status* ReadTensor(cai_checkpoint* ckpt, const char* name, int64_t offset, int64_t count,
                       const cai_tensor* dst) {
  return Guard(
      [&] { Checked(ckpt).ReadTensor(Name(name, "tensor name"), offset, count, Tensor(dst)); });
}

cai_status* TensorInfo(cai_checkpoint* ckpt, const char* name, cai_ckpt_tensor_info* out) {
  return Guard([&] {
    if (out == nullptr) throw Error(CAI_INVALID_ARGUMENT, "tensor_info output is NULL");
    const cai_ckpt_tensor_info info = Checked(ckpt).TensorInfo(Name(name, "tensor name"));
    // Fill only what the caller's struct_size says it has room for.
    if (CAI_HAS_FIELD(out, cai_ckpt_tensor_info, dtype)) out->dtype = info.dtype;
    if (CAI_HAS_FIELD(out, cai_ckpt_tensor_info, ndim)) out->ndim = info.ndim;
    if (CAI_HAS_FIELD(out, cai_ckpt_tensor_info, shape)) {
      std::copy(std::begin(info.shape), std::end(info.shape), out->shape);
    }
  });
}

cai_status* WriteMeta(cai_checkpoint* ckpt, const char* key, const char* value) {
  return Guard([&] {
    if (value == nullptr) throw Error(CAI_INVALID_ARGUMENT, "meta value is NULL");
    Checked(ckpt).WriteMeta(Name(key, "meta key"), value);
  });
}

cai_status* ReadMeta(cai_checkpoint* ckpt, const char* key, const char** value) {
  return Guard([&] {
    if (value == nullptr) throw Error(CAI_INVALID_ARGUMENT, "meta output is NULL");
    *value = Checked(ckpt).ReadMeta(Name(key, "meta key"));
  });
}

int32_t SavedWorldSize(const cai_checkpoint* ckpt) {
  return ckpt == nullptr ? 0 : ckpt->SavedWorldSize();
}

}  // namespace

const cai_checkpoint_api* CheckpointApi() {
  static const cai_checkpoint_api api = {
      CAI_CHECKPOINT_API_STRUCT_SIZE,
      nullptr,
      WriteTensor,
      ReadTensor,
      TensorInfo,
      WriteMeta,
      ReadMeta,
      SavedWorldSize,
  };
  return &api;
}

}  // namespace cai
