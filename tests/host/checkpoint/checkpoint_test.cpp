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

}  // namespace
}  // namespace cai::ckpt
