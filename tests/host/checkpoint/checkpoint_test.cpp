#include "checkpoint/checkpoint.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <barrier>
#include <cstring>
#include <fstream>
#include <thread>

#include "checkpoint/dtype_convert.h"
#include "checkpoint/rank_file.h"
#include "core/status.h"

namespace cai::ckpt {
namespace {

namespace fs = std::filesystem;

constexpr cai_dtype kFp32{CAI_DTYPE_FLOAT, 32, 1};
constexpr cai_dtype kFp16{CAI_DTYPE_FLOAT, 16, 1};
constexpr cai_dtype kBf16{CAI_DTYPE_BFLOAT, 16, 1};
constexpr cai_dtype kInt64{CAI_DTYPE_INT, 64, 1};

// A contiguous host tensor over a caller's vector.
struct View {
  template <class T>
  View(std::vector<T>& data, cai_dtype dtype, std::vector<int64_t> dims)
      : shape(std::move(dims)), strides(shape.size()) {
    int64_t stride = 1;
    for (size_t d = shape.size(); d-- > 0;) {
      strides[d] = stride;
      stride *= shape[d];
    }
    tensor = {data.data(),
              {CAI_DEVICE_CPU, 0},
              static_cast<int32_t>(shape.size()),
              dtype,
              shape.data(),
              strides.data(),
              0};
  }
  View(const View&) = delete;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  cai_tensor tensor{};
};

const cai_checkpoint_api& Api() { return *CheckpointApi(); }

// Expects `status` to carry `code` and a message containing every one of `parts`.
void ExpectStatus(cai_status* status, cai_status_code code,
                  std::initializer_list<std::string> parts) {
  ASSERT_NE(status, nullptr) << "expected an error";
  EXPECT_EQ(StatusCode(status), code) << StatusMessage(status);
  for (const std::string& part : parts) {
    EXPECT_NE(std::string(StatusMessage(status)).find(part), std::string::npos)
        << "'" << part << "' missing from: " << StatusMessage(status);
  }
  DestroyStatus(status);
}

void Ok(cai_status* status) { ThrowIfError(status); }

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    run_ = fs::temp_directory_path() /
           ("cai_ckpt_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(run_);
  }
  void TearDown() override { fs::remove_all(run_); }

  // Saves one rank-0-of-1 checkpoint holding "w" = values.
  fs::path SaveSingle(int64_t step, std::vector<float> values, const std::string& run_id) {
    CheckpointWriter writer(run_, step, 0, 1, run_id);
    View w(values, kFp32, {static_cast<int64_t>(values.size())});
    Ok(Api().write_tensor(writer.handle(), "w", &w.tensor));
    return writer.Commit([] {});
  }

  static std::vector<float> ReadFloats(const fs::path& dir, const char* name, size_t n) {
    CheckpointReader reader(dir);
    std::vector<float> out(n);
    View v(out, kFp32, {static_cast<int64_t>(n)});
    Ok(Api().read_tensor(reader.handle(), name, 0, 0, &v.tensor));
    return out;
  }

  fs::path run_;
};

TEST_F(CheckpointTest, ApiTable_IsFullyFilled) {
  const cai_checkpoint_api& api = Api();
  EXPECT_EQ(api.struct_size, CAI_CHECKPOINT_API_STRUCT_SIZE);
  EXPECT_NE(api.write_tensor, nullptr);
  EXPECT_NE(api.read_tensor, nullptr);
  EXPECT_NE(api.tensor_info, nullptr);
  EXPECT_NE(api.write_meta, nullptr);
  EXPECT_NE(api.read_meta, nullptr);
  EXPECT_NE(api.saved_world_size, nullptr);
  EXPECT_EQ(api.saved_world_size(nullptr), 0);
}

TEST_F(CheckpointTest, OptimizerSlots_StoredUnderTorchNamesAndReadByNumberOrName) {
  std::vector<float> m{1, 2}, v{3, 4}, momentum{5, 6};
  View vm(m, kFp32, {2}), vv(v, kFp32, {2}), vmom(momentum, kFp32, {2});
  fs::path adam, sgd, numbered;
  {
    CheckpointWriter writer(run_ / "adam", 1, 0, 1, "r");
    writer.NameOptimizerSlots(OptimizerSlotNames("adamw"));
    Ok(Api().write_tensor(writer.handle(), "optim/blocks.0.w/0", &vm.tensor));
    Ok(Api().write_tensor(writer.handle(), "optim/blocks.0.w/1", &vv.tensor));
    adam = writer.Commit([] {});
  }
  {
    CheckpointWriter writer(run_ / "sgd", 1, 0, 1, "r");
    writer.NameOptimizerSlots(OptimizerSlotNames("sgd"));
    Ok(Api().write_tensor(writer.handle(), "optim/w/0", &vmom.tensor));
    sgd = writer.Commit([] {});
  }
  {
    CheckpointWriter writer(run_ / "old", 1, 0, 1, "r");  // as written before slots had names
    Ok(Api().write_tensor(writer.handle(), "optim/w/0", &vm.tensor));
    numbered = writer.Commit([] {});
  }
  RankFileReader file(adam / RankFileName(0));
  std::vector<std::string> names;
  for (const Entry& e : file.entries()) names.push_back(e.name);
  EXPECT_EQ(names,
            (std::vector<std::string>{"optim/blocks.0.w/exp_avg", "optim/blocks.0.w/exp_avg_sq"}));
  EXPECT_EQ(ReadFloats(adam, "optim/blocks.0.w/1", 2), v);
  EXPECT_EQ(ReadFloats(adam, "optim/blocks.0.w/exp_avg", 2), m);
  EXPECT_EQ(ReadFloats(sgd, "optim/w/0", 2), momentum);
  EXPECT_EQ(ReadFloats(sgd, "optim/w/momentum_buffer", 2), momentum);
  EXPECT_EQ(ReadFloats(numbered, "optim/w/0", 2), m);
  CheckpointReader reader(sgd);
  std::vector<float> out(2);
  View o(out, kFp32, {2});
  ExpectStatus(Api().read_tensor(reader.handle(), "optim/w/1", 0, 0, &o.tensor), CAI_NOT_FOUND,
               {"optim/w/1"});
}

TEST_F(CheckpointTest, SaveThenLoad_RoundTripsTensorsShapesAndMeta) {
  std::vector<float> w{1, 2, 3, 4, 5, 6};
  std::vector<int64_t> ids{7, -8, 1LL << 40, 0};
  {
    CheckpointWriter writer(run_, 100, 0, 1, "run-a");
    View wv(w, kFp32, {2, 3});
    View iv(ids, kInt64, {4});
    Ok(Api().write_tensor(writer.handle(), "model/blocks.0.w", &wv.tensor));
    Ok(Api().write_tensor(writer.handle(), "optim/step_ids", &iv.tensor));
    Ok(Api().write_meta(writer.handle(), "plugin", "{\"stage\": 2}"));
    EXPECT_EQ(Api().saved_world_size(writer.handle()), 1);
    EXPECT_EQ(writer.Commit([] {}), run_ / "step-000100");
  }
  EXPECT_EQ(FindLatestCheckpoint(run_), run_ / "step-000100");
  std::string latest;
  std::getline(std::ifstream(run_ / "latest"), latest);
  EXPECT_EQ(latest, "step-000100");
  EXPECT_TRUE(fs::exists(run_ / "step-000100" / "COMPLETE"));

  CheckpointReader reader(run_ / "step-000100");
  EXPECT_EQ(reader.step(), 100);
  EXPECT_EQ(reader.saved_world_size(), 1);
  EXPECT_EQ(Api().saved_world_size(reader.handle()), 1);

  cai_ckpt_tensor_info info{};
  info.struct_size = CAI_CKPT_TENSOR_INFO_STRUCT_SIZE;
  Ok(Api().tensor_info(reader.handle(), "model/blocks.0.w", &info));
  EXPECT_EQ(info.ndim, 2);
  EXPECT_EQ(info.shape[0], 2);
  EXPECT_EQ(info.shape[1], 3);
  EXPECT_TRUE(SameDtype(info.dtype, kFp32));

  std::vector<float> w_back(6);
  View wb(w_back, kFp32, {2, 3});
  Ok(Api().read_tensor(reader.handle(), "model/blocks.0.w", 0, 0, &wb.tensor));
  EXPECT_EQ(w_back, w);
  std::vector<int64_t> ids_back(4);
  View ib(ids_back, kInt64, {4});
  Ok(Api().read_tensor(reader.handle(), "optim/step_ids", 0, 0, &ib.tensor));
  EXPECT_EQ(ids_back, ids);

  const char* value = nullptr;
  Ok(Api().read_meta(reader.handle(), "plugin", &value));
  EXPECT_STREQ(value, "{\"stage\": 2}");
}

TEST_F(CheckpointTest, ThreeRanks_EachRanksShardIsReadableByAnyRank) {
  constexpr int kWorld = 3;
  std::barrier sync(kWorld);
  std::vector<std::thread> ranks;
  for (int r = 0; r < kWorld; ++r) {
    ranks.emplace_back([&, r] {
      std::vector<float> shard(5);
      for (int i = 0; i < 5; ++i) shard[i] = static_cast<float>(100 * r + i);
      CheckpointWriter writer(run_, 20, r, kWorld, "run-3");
      View v(shard, kFp32, {5});
      Ok(Api().write_tensor(writer.handle(), ("model/w.shard" + std::to_string(r)).c_str(),
                            &v.tensor));
      writer.Commit([&] { sync.arrive_and_wait(); });
    });
  }
  for (std::thread& t : ranks) t.join();

  const fs::path dir = run_ / "step-000020";
  ASSERT_EQ(FindLatestCheckpoint(run_), dir);
  for (int r = 0; r < kWorld; ++r) EXPECT_TRUE(fs::exists(dir / RankFileName(r)));
  EXPECT_FALSE(fs::exists(run_ / "step-000020.tmp-run-3"));
  CheckpointReader reader(dir);
  EXPECT_EQ(reader.saved_world_size(), 3);
  for (int r = 0; r < kWorld; ++r) {
    const std::vector<float> shard =
        ReadFloats(dir, ("model/w.shard" + std::to_string(r)).c_str(), 5);
    EXPECT_EQ(shard[0], 100.0f * r);
    EXPECT_EQ(shard[4], 100.0f * r + 4);
  }
}

TEST_F(CheckpointTest, ReadWithOffsetAndCount_ReadsOnlyThatSlice) {
  std::vector<float> values(10);
  for (int i = 0; i < 10; ++i) values[i] = static_cast<float>(i);
  const fs::path dir = SaveSingle(1, values, "r");
  CheckpointReader reader(dir);

  std::vector<float> middle(4);
  View m(middle, kFp32, {4});
  Ok(Api().read_tensor(reader.handle(), "w", 3, 4, &m.tensor));
  EXPECT_EQ(middle, (std::vector<float>{3, 4, 5, 6}));

  std::vector<float> tail(4);
  View t(tail, kFp32, {4});
  Ok(Api().read_tensor(reader.handle(), "w", 6, 0, &t.tensor));  // count 0: to the end
  EXPECT_EQ(tail, (std::vector<float>{6, 7, 8, 9}));

  ExpectStatus(Api().read_tensor(reader.handle(), "w", 8, 4, &t.tensor), CAI_OUT_OF_RANGE,
               {"elements [8, 12)", "which has 10"});
  std::vector<float> three(3);
  View wrong(three, kFp32, {3});
  ExpectStatus(Api().read_tensor(reader.handle(), "w", 0, 4, &wrong.tensor), CAI_INVALID_ARGUMENT,
               {"holds 3 elements but 4 are read"});
}

TEST_F(CheckpointTest, ReadIntoOtherFloatDtype_ConvertsFp32Bf16Fp16) {
  const fs::path dir = SaveSingle(1, {1.0f, -3.0f, 0.1f, 65504.0f}, "r");
  CheckpointReader reader(dir);
  std::vector<uint16_t> bf16(4), fp16(4);
  View b(bf16, kBf16, {4});
  View h(fp16, kFp16, {4});
  Ok(Api().read_tensor(reader.handle(), "w", 0, 0, &b.tensor));
  Ok(Api().read_tensor(reader.handle(), "w", 0, 0, &h.tensor));
  EXPECT_EQ(bf16, (std::vector<uint16_t>{0x3f80, 0xc040, 0x3dcd, 0x4780}));
  EXPECT_EQ(fp16, (std::vector<uint16_t>{0x3c00, 0xc200, 0x2e66, 0x7bff}));

  // And back: an fp16 tensor read as fp32, a slice of it.
  {
    CheckpointWriter writer(run_, 2, 0, 1, "r");
    View hv(fp16, kFp16, {4});
    Ok(Api().write_tensor(writer.handle(), "h", &hv.tensor));
    writer.Commit([] {});
  }
  CheckpointReader reader2(run_ / "step-000002");
  std::vector<float> back(2);
  View f(back, kFp32, {2});
  Ok(Api().read_tensor(reader2.handle(), "h", 1, 2, &f.tensor));
  EXPECT_EQ(back, (std::vector<float>{-3.0f, Fp16ToFp32(0x2e66)}));

  std::vector<int64_t> ints(4);
  View i(ints, kInt64, {4});
  ExpectStatus(Api().read_tensor(reader.handle(), "w", 0, 0, &i.tensor), CAI_INVALID_ARGUMENT,
               {"'w' is fp32 and cannot be read into int64"});
}

TEST_F(CheckpointTest, MissingEntry_IsNotFoundNamingEntryAndCheckpoint) {
  const fs::path dir = SaveSingle(1, {1.0f}, "r");
  CheckpointReader reader(dir);
  std::vector<float> out(1);
  View v(out, kFp32, {1});
  ExpectStatus(Api().read_tensor(reader.handle(), "model/nope", 0, 0, &v.tensor), CAI_NOT_FOUND,
               {"'model/nope'", dir.string()});
  cai_ckpt_tensor_info info{};
  info.struct_size = CAI_CKPT_TENSOR_INFO_STRUCT_SIZE;
  info.ndim = -7;
  ExpectStatus(Api().tensor_info(reader.handle(), "model/nope", &info), CAI_NOT_FOUND,
               {"'model/nope'"});
  EXPECT_EQ(info.ndim, -7) << "out-parameter touched on error";
  const char* value = "untouched";
  ExpectStatus(Api().read_meta(reader.handle(), "sched", &value), CAI_NOT_FOUND,
               {"meta entry 'sched'", dir.string()});
  EXPECT_STREQ(value, "untouched");
}

// fsdp's sharded layout read under canonical names: unit "u" holds a (4 elements at offset 0)
// and b (3 at offset 4), cut into shards of 3 padded elements; a's slice [2, 4) spans shards 0
// and 1, b straddles shards 1 and 2; optimizer slot 1 the same way.
TEST_F(CheckpointTest, ShardedLayout_ReadsCanonicalNamesAcrossShards) {
  auto save = [&](int64_t step, const std::string& index) {
    CheckpointWriter writer(run_, step, 0, 1, "r");
    for (int j = 0; j < 3; ++j) {
      std::vector<float> shard = {float(3 * j), float(3 * j + 1), float(3 * j + 2)};
      std::vector<float> state = {-shard[0], -shard[1], -shard[2]};
      View p(shard, kFp32, {3});
      View s(state, kFp32, {3});
      Ok(Api().write_tensor(writer.handle(), ("fsdp/u/param." + std::to_string(j)).c_str(),
                            &p.tensor));
      Ok(Api().write_tensor(writer.handle(), ("fsdp/u/state1." + std::to_string(j)).c_str(),
                            &s.tensor));
    }
    Ok(Api().write_meta(writer.handle(), "fsdp.index", index.c_str()));
    return writer.Commit([] {});
  };
  const fs::path dir = save(1, "fsdp-sharded 1 3\nunit u 3\nparam 0 4 a\nparam 4 3 b\n");
  CheckpointReader reader(dir);
  std::vector<float> a(2), b(3), b_state(3);
  View av(a, kFp32, {2});
  View bv(b, kFp32, {3});
  View bs(b_state, kFp32, {3});
  Ok(Api().read_tensor(reader.handle(), "model/a", 2, 2, &av.tensor));
  Ok(Api().read_tensor(reader.handle(), "model/b", 0, 0, &bv.tensor));
  Ok(Api().read_tensor(reader.handle(), "optim/b/1", 0, 0, &bs.tensor));
  EXPECT_EQ(a, (std::vector<float>{2, 3}));
  EXPECT_EQ(b, (std::vector<float>{4, 5, 6}));
  EXPECT_EQ(b_state, (std::vector<float>{-4, -5, -6}));
  cai_ckpt_tensor_info info{};
  info.struct_size = CAI_CKPT_TENSOR_INFO_STRUCT_SIZE;
  Ok(Api().tensor_info(reader.handle(), "model/b", &info));
  EXPECT_EQ(info.ndim, 1);
  EXPECT_EQ(info.shape[0], 3);
  ExpectStatus(Api().read_tensor(reader.handle(), "model/b", 2, 2, &av.tensor), CAI_OUT_OF_RANGE,
               {"'model/b'", "which has 3"});
  ExpectStatus(Api().read_tensor(reader.handle(), "model/c", 0, 0, &av.tensor), CAI_NOT_FOUND,
               {"'model/c'"});

  const fs::path bad = save(2, "fsdp-sharded 1 3\nunit u 3\nparma 0 4 a\n");
  CheckpointReader bad_reader(bad);
  ExpectStatus(Api().read_tensor(bad_reader.handle(), "model/a", 0, 0, &bv.tensor), CAI_DATA_LOSS,
               {"meta 'fsdp.index'", "unknown line 'parma'"});
}

TEST_F(CheckpointTest, WritingDuringLoadOrReadingDuringSave_IsAFailedPrecondition) {
  std::vector<float> values{1, 2};
  View v(values, kFp32, {2});
  CheckpointWriter writer(run_, 1, 0, 1, "r");
  ExpectStatus(Api().read_tensor(writer.handle(), "w", 0, 0, &v.tensor), CAI_FAILED_PRECONDITION,
               {"open for saving"});
  Ok(Api().write_tensor(writer.handle(), "w", &v.tensor));
  ExpectStatus(Api().write_tensor(writer.handle(), "w", &v.tensor), CAI_ALREADY_EXISTS,
               {"tensor 'w' is written twice"});
  const fs::path dir = writer.Commit([] {});
  CheckpointReader reader(dir);
  ExpectStatus(Api().write_meta(reader.handle(), "k", "v"), CAI_FAILED_PRECONDITION,
               {"open for loading"});
}

TEST_F(CheckpointTest, DeviceTensors_MoveThroughTheHostsCopyCallbacks) {
  // A "device" tensor whose memory is really on the host; the copier is memcpy.
  int to_host_calls = 0, to_device_calls = 0;
  DeviceCopy copy;
  copy.to_host = [&](void* dst, const cai_tensor& src, size_t offset, size_t bytes) {
    ++to_host_calls;
    std::memcpy(dst, static_cast<const char*>(src.data) + src.byte_offset + offset, bytes);
  };
  copy.to_device = [&](const cai_tensor& dst, size_t offset, const void* src, size_t bytes) {
    ++to_device_calls;
    std::memcpy(static_cast<char*>(dst.data) + dst.byte_offset + offset, src, bytes);
  };
  std::vector<float> values{1.5f, 2.5f, 3.5f};
  View v(values, kFp32, {3});
  v.tensor.device = {CAI_DEVICE_CUDA, 0};
  {
    CheckpointWriter bare(run_, 1, 0, 1, "bare");
    ExpectStatus(Api().write_tensor(bare.handle(), "w", &v.tensor), CAI_INVALID_ARGUMENT,
                 {"device memory", "without a device copier"});
  }
  CheckpointWriter writer(run_, 2, 0, 1, "dev", copy);
  Ok(Api().write_tensor(writer.handle(), "w", &v.tensor));
  const fs::path dir = writer.Commit([] {});
  EXPECT_EQ(to_host_calls, 1);

  CheckpointReader reader(dir, copy);
  std::vector<uint16_t> bf16(3);
  View b(bf16, kBf16, {3});
  b.tensor.device = {CAI_DEVICE_CUDA, 0};
  Ok(Api().read_tensor(reader.handle(), "w", 0, 0, &b.tensor));
  EXPECT_EQ(to_device_calls, 1);
  EXPECT_EQ(bf16, (std::vector<uint16_t>{0x3fc0, 0x4020, 0x4060}));
}

TEST_F(CheckpointTest, KillDuringSave_LeavesPreviousCheckpointLatestAndLoadable) {
  SaveSingle(1, {42.0f, 43.0f}, "first");

  int ready[2], hold[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(hold), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // 16 x 4 MiB; the parent kills us after the second tensor, while more are being written.
    std::vector<float> big(1 << 20, 7.0f);
    CheckpointWriter writer(run_, 2, 0, 1, "doomed");
    View v(big, kFp32, {1 << 20});
    for (int i = 0; i < 16; ++i) {
      if (Api().write_tensor(writer.handle(), ("big" + std::to_string(i)).c_str(), &v.tensor)) {
        ::_exit(2);
      }
      if (i == 1) [[maybe_unused]]
        auto n = ::write(ready[1], "x", 1);
    }
    char c;
    [[maybe_unused]] auto n = ::read(hold[0], &c, 1);  // never returns before the kill
    writer.Commit([] {});
    ::_exit(0);
  }
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  ASSERT_TRUE(WIFSIGNALED(status));
  for (int fd : {ready[0], ready[1], hold[0], hold[1]}) ::close(fd);

  EXPECT_TRUE(fs::exists(run_ / "step-000002.tmp-doomed"));
  EXPECT_FALSE(fs::exists(run_ / "step-000002"));
  ASSERT_EQ(FindLatestCheckpoint(run_), run_ / "step-000001");
  EXPECT_EQ(ReadFloats(run_ / "step-000001", "w", 2), (std::vector<float>{42.0f, 43.0f}));
  try {
    CheckpointReader partial(run_ / "step-000002.tmp-doomed");
    ADD_FAILURE() << "opened an interrupted save";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), CAI_NOT_FOUND);
    EXPECT_NE(std::string(e.what()).find("no COMPLETE marker"), std::string::npos) << e.what();
  }

  // The next attempt at the same step succeeds and becomes the latest.
  SaveSingle(2, {5.0f}, "retry");
  EXPECT_EQ(FindLatestCheckpoint(run_), run_ / "step-000002");
  EXPECT_EQ(ReadFloats(run_ / "step-000002", "w", 1), (std::vector<float>{5.0f}));
}

TEST_F(CheckpointTest, FindLatest_FollowsPointerAndIgnoresTemporaryAndIncompleteDirs) {
  EXPECT_EQ(FindLatestCheckpoint(run_), std::nullopt);
  SaveSingle(5, {5.0f}, "a");
  SaveSingle(7, {7.0f}, "b");
  fs::create_directories(run_ / "step-000009.tmp-c");
  fs::create_directories(run_ / "step-000008");  // no COMPLETE
  EXPECT_EQ(FindLatestCheckpoint(run_), run_ / "step-000007");

  std::ofstream(run_ / "latest") << "step-000005\n";
  EXPECT_EQ(FindLatestCheckpoint(run_), run_ / "step-000005") << "the pointer is authoritative";

  std::ofstream(run_ / "latest") << "step-000042\n";
  EXPECT_EQ(FindLatestCheckpoint(run_), run_ / "step-000007") << "dangling pointer: scan";
  fs::remove(run_ / "latest");
  EXPECT_EQ(FindLatestCheckpoint(run_), run_ / "step-000007") << "no pointer: scan";
}

TEST_F(CheckpointTest, SavingAStepAgain_ReplacesIt) {
  SaveSingle(3, {1.0f}, "first");
  SaveSingle(3, {2.0f}, "second");
  EXPECT_EQ(ReadFloats(run_ / "step-000003", "w", 1), (std::vector<float>{2.0f}));
  size_t entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(run_)) ++entries;
  EXPECT_EQ(entries, 2u) << "only step-000003 and latest remain";
}

TEST_F(CheckpointTest, TruncatedRankFile_IsDataLossNamingTheFile) {
  const fs::path dir = SaveSingle(1, {1.0f, 2.0f}, "r");
  const fs::path file = dir / RankFileName(0);
  fs::resize_file(file, 70);
  try {
    CheckpointReader reader(dir);
    ADD_FAILURE() << "opened a truncated checkpoint";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), CAI_DATA_LOSS);
    EXPECT_NE(std::string(e.what()).find(file.string()), std::string::npos) << e.what();
  }
}

// Overwrites `bytes` bytes of `file` at `offset` with zeros, as a failing disk or a bad copy
// might.
void ZeroBytes(const fs::path& file, uint64_t offset, size_t bytes) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(static_cast<std::streamoff>(offset));
  const std::vector<char> zeros(bytes, 0);
  f.write(zeros.data(), static_cast<std::streamsize>(bytes));
  ASSERT_TRUE(f.good()) << file;
}

const Entry& EntryNamed(const RankFileReader& file, const std::string& name) {
  for (const Entry& e : file.entries()) {
    if (e.name == name) return e;
  }
  throw Error(CAI_NOT_FOUND, name);
}

std::vector<float> Ramp(size_t n) {
  std::vector<float> values(n);
  for (size_t i = 0; i < n; ++i) values[i] = static_cast<float>(i) + 0.5f;
  return values;
}

TEST_F(CheckpointTest, SlicesAcrossChecksumBlocks_ReadBackExactly) {
  // 300 KiB: four whole 64 KiB blocks and a short fifth; slices start and end inside blocks,
  // on block edges, and span runs of whole blocks.
  const size_t n = 300 * 256;
  const std::vector<float> values = Ramp(n);
  const fs::path dir = SaveSingle(1, values, "r");
  RankFileReader file(dir / RankFileName(0));
  EXPECT_EQ(file.version(), 2u);
  EXPECT_EQ(EntryNamed(file, "w").block_crc32c.size(), 5u);
  CheckpointReader reader(dir);
  const size_t block = kChecksumBlockBytes / 4;
  for (auto [offset, count] : std::vector<std::pair<size_t, size_t>>{{0, n},
                                                                     {1, 10},
                                                                     {block - 3, 6},
                                                                     {block, block},
                                                                     {block + 5, 3 * block},
                                                                     {17, n - 17},
                                                                     {4 * block, n - 4 * block},
                                                                     {n - 1, 1}}) {
    std::vector<float> out(count);
    View v(out, kFp32, {static_cast<int64_t>(count)});
    Ok(Api().read_tensor(reader.handle(), "w", static_cast<int64_t>(offset),
                         static_cast<int64_t>(count), &v.tensor));
    EXPECT_TRUE(std::equal(out.begin(), out.end(), values.begin() + static_cast<long>(offset)))
        << "elements [" << offset << ", " << offset + count << ")";
  }
}

TEST_F(CheckpointTest, ZeroedBytesInTensorData_LoadFailsNamingFileTensorAndEarlierCheckpoints) {
  SaveSingle(1, {1.0f}, "a");
  SaveSingle(2, {2.0f}, "b");
  const size_t n = 256 * 1024;  // 1 MiB
  const fs::path dir = SaveSingle(3, Ramp(n), "c");
  const fs::path path = dir / RankFileName(0);
  uint64_t data_offset = 0;
  {
    RankFileReader file(path);
    data_offset = EntryNamed(file, "w").offset;
  }
  // 4 KiB of zeros inside the third checksum block (bytes 131072 to 196608 of the data).
  ZeroBytes(path, data_offset + 2 * kChecksumBlockBytes + 1000, 4096);

  CheckpointReader reader(dir);  // header and index are intact
  std::vector<float> out(n);
  View all(out, kFp32, {static_cast<int64_t>(n)});
  ExpectStatus(Api().read_tensor(reader.handle(), "w", 0, 0, &all.tensor), CAI_DATA_LOSS,
               {path.string(), "tensor 'w' is damaged", "do not match the CRC32C",
                "bytes 131072 to 196608", "checkpoint " + dir.string() + " is damaged",
                "Earlier checkpoints in " + run_.string() + ": step-000002, step-000001",
                "mv " + dir.string()});
  // Converting reads go through the same checks.
  std::vector<uint16_t> half(n);
  View h(half, kBf16, {static_cast<int64_t>(n)});
  ExpectStatus(Api().read_tensor(reader.handle(), "w", 0, 0, &h.tensor), CAI_DATA_LOSS,
               {"tensor 'w' is damaged"});
  // A shard that lies in intact blocks still reads: only what is returned is checked.
  std::vector<float> first(1000);
  View f(first, kFp32, {1000});
  Ok(Api().read_tensor(reader.handle(), "w", 0, 1000, &f.tensor));
  EXPECT_EQ(first[999], 999.5f);
  std::vector<float> ten(10);
  View t(ten, kFp32, {10});
  ExpectStatus(Api().read_tensor(reader.handle(), "w", 2 * 16384 + 500, 10, &t.tensor),
               CAI_DATA_LOSS, {"tensor 'w' is damaged", "bytes 131072 to 196608"});
}

TEST_F(CheckpointTest, ZeroedBytesInMetaEntry_LoadFailsNamingFileAndKey) {
  const fs::path dir = [&] {
    CheckpointWriter writer(run_, 4, 0, 1, "m");
    Ok(Api().write_meta(writer.handle(), "plugin", std::string(8192, 'x').c_str()));
    return writer.Commit([] {});
  }();
  const fs::path path = dir / RankFileName(0);
  uint64_t data_offset = 0;
  {
    RankFileReader file(path);
    data_offset = EntryNamed(file, "plugin").offset;
  }
  ZeroBytes(path, data_offset + 100, 4096);
  CheckpointReader reader(dir);
  const char* value = nullptr;
  ExpectStatus(Api().read_meta(reader.handle(), "plugin", &value), CAI_DATA_LOSS,
               {path.string(), "meta entry 'plugin' is damaged",
                "No earlier complete checkpoint is in " + run_.string()});
  EXPECT_EQ(value, nullptr);
}

TEST_F(CheckpointTest, DamagedIndexOrHeader_OpenFailsNamingTheFile) {
  const fs::path dir = SaveSingle(1, {1.0f, 2.0f, 3.0f}, "r");
  const fs::path path = dir / RankFileName(0);
  const auto size = fs::file_size(path);
  ZeroBytes(path, size - 4, 4);  // inside the index: the last block checksum
  try {
    CheckpointReader reader(dir);
    ADD_FAILURE() << "opened a checkpoint with a damaged index";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), CAI_DATA_LOSS);
    EXPECT_NE(std::string(e.what()).find(path.string() + ": index"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("does not match its checksum"), std::string::npos)
        << e.what();
  }
  const fs::path again = SaveSingle(2, {1.0f}, "s");
  ZeroBytes(again / RankFileName(0), 16, 4);  // the header's world size
  try {
    RankFileReader file(again / RankFileName(0));
    ADD_FAILURE() << "opened a file with a damaged header";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("header does not match its checksum"), std::string::npos)
        << e.what();
  }
}

// A rank file as cai wrote it before checksums (format version 1), built byte by byte.
void WriteVersion1File(const fs::path& path, const std::vector<float>& values) {
  std::string file(64, '\0');
  const uint64_t offset = 64, bytes = values.size() * sizeof(float);
  file.append(reinterpret_cast<const char*>(values.data()), bytes);
  while (file.size() % 64 != 0) file.push_back('\0');
  const uint64_t index_offset = file.size();
  auto put = [&](auto v) { file.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  put(uint8_t{0});
  put(uint8_t{CAI_DTYPE_FLOAT});
  put(uint8_t{32});
  put(uint8_t{0});
  put(uint16_t{1});
  put(uint16_t{0});
  put(uint32_t{1});  // ndim
  put(uint32_t{1});  // name length
  file += "w";
  put(static_cast<int64_t>(values.size()));
  put(offset);
  put(bytes);
  const uint64_t index_bytes = file.size() - index_offset;
  std::string header("CAICKPT1");
  auto put_header = [&](auto v) { header.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  put_header(uint32_t{1});  // version
  put_header(uint32_t{0});  // rank
  put_header(uint32_t{1});  // world size
  put_header(uint32_t{0});
  put_header(int64_t{6});  // step
  put_header(index_offset);
  put_header(index_bytes);
  put_header(uint64_t{1});  // entries
  put_header(uint64_t{0});
  file.replace(0, 64, header);
  std::ofstream(path, std::ios::binary) << file;
}

TEST_F(CheckpointTest, Version1FileWithoutChecksums_StillLoads) {
  const fs::path dir = run_ / "step-000006";
  fs::create_directories(dir);
  WriteVersion1File(dir / RankFileName(0), {1.5f, 2.5f, 3.5f});
  std::ofstream(dir / "COMPLETE") << "step = 6\nworld_size = 1\n";
  RankFileReader file(dir / RankFileName(0));
  EXPECT_EQ(file.version(), 1u);
  EXPECT_TRUE(EntryNamed(file, "w").block_crc32c.empty());
  EXPECT_EQ(ReadFloats(dir, "w", 3), (std::vector<float>{1.5f, 2.5f, 3.5f}));
}

TEST_F(CheckpointTest, FindLatest_ReportsEachNewerUnfinishedSaveAndWhy) {
  std::vector<std::string> skipped;
  fs::create_directories(run_ / "step-000004");  // no COMPLETE
  fs::create_directories(run_ / "step-000005.tmp-x");
  EXPECT_EQ(FindLatestCheckpoint(run_, &skipped), std::nullopt);
  ASSERT_EQ(skipped.size(), 2u);
  EXPECT_EQ(skipped[0],
            (run_ / "step-000004").string() + " (no COMPLETE marker: its save did not finish)");
  EXPECT_EQ(skipped[1], (run_ / "step-000005.tmp-x").string() +
                            " (temporary directory of a save that did not finish)");

  SaveSingle(3, {3.0f}, "a");
  fs::create_directories(run_ / "step-000002");  // older than the one chosen: not mentioned
  skipped.clear();
  EXPECT_EQ(FindLatestCheckpoint(run_, &skipped), run_ / "step-000003");
  ASSERT_EQ(skipped.size(), 2u);
  EXPECT_NE(skipped[0].find("step-000004 (no COMPLETE"), std::string::npos) << skipped[0];
}

}  // namespace
}  // namespace cai::ckpt
