// The safetensors writer and reader: bit-exact round trips in every float dtype, the header's
// alignment, and malformed files refused naming the file and the tensor.
#include "checkpoint/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <random>

#include "core/json.h"
#include "core/status.h"
#include "util/temp_dir.h"

namespace cai::ckpt {
namespace {

namespace fs = std::filesystem;

constexpr cai_dtype kFp32{CAI_DTYPE_FLOAT, 32, 1};
constexpr cai_dtype kFp16{CAI_DTYPE_FLOAT, 16, 1};
constexpr cai_dtype kBf16{CAI_DTYPE_BFLOAT, 16, 1};

// Every TempDir of this file under /tmp/cai-safetensors-XXXXXX.
class TempDir : public cai::testing::TempDir {
 public:
  TempDir() : cai::testing::TempDir("cai-safetensors") {}
};

std::vector<char> RandomBytes(size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::vector<char> out(n);
  for (char& c : out) c = static_cast<char>(gen());
  return out;
}

// A file with the given JSON header and `data_bytes` zero bytes of data.
void WriteRaw(const fs::path& path, const std::string& header, size_t data_bytes) {
  std::ofstream out(path, std::ios::binary);
  const uint64_t n = header.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << header << std::string(data_bytes, '\0');
}

std::string Error(const fs::path& path) {
  try {
    SafetensorsReader reader(path);
  } catch (const cai::Error& e) {
    return e.what();
  }
  return "";
}

TEST(Safetensors, WriteThenRead_BitExactInEveryFloatDtype) {
  TempDir dir;
  const std::vector<SafetensorsTensor> tensors = {{"a.weight", kFp32, {3, 5}},
                                                  {"b", kBf16, {7}},
                                                  {"c", kFp16, {2, 1, 3}},
                                                  {"scalar", kFp32, {}},
                                                  {"empty", kFp32, {0, 4}}};
  std::vector<std::vector<char>> data;
  for (size_t i = 0; i < tensors.size(); ++i) {
    size_t n = tensors[i].dtype.bits / 8;
    for (int64_t d : tensors[i].shape) n *= static_cast<size_t>(d);
    data.push_back(RandomBytes(n, static_cast<unsigned>(i)));
  }
  {
    SafetensorsWriter writer(dir / "m.safetensors", tensors, {{"format", "pt"}});
    for (const auto& d : data) {
      // In two pieces: a tensor may stream in any number of appends.
      writer.Append(d.data(), d.size() / 2);
      writer.Append(d.data() + d.size() / 2, d.size() - d.size() / 2);
    }
    writer.Finish();
  }
  // The data starts 8-byte aligned, as the reference writer pads it.
  std::ifstream in(dir / "m.safetensors", std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  EXPECT_EQ((8 + n) % 8, 0u);

  SafetensorsReader reader(dir / "m.safetensors");
  EXPECT_EQ(reader.metadata().at("format"), "pt");
  ASSERT_EQ(reader.tensors().size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const SafetensorsTensor* t = reader.Find(tensors[i].name);
    ASSERT_NE(t, nullptr) << tensors[i].name;
    EXPECT_EQ(t->shape, tensors[i].shape);
    EXPECT_EQ(t->dtype.code, tensors[i].dtype.code);
    EXPECT_EQ(t->dtype.bits, tensors[i].dtype.bits);
    std::vector<char> back(t->bytes());
    reader.Read(*t, 0, back.data(), back.size());
    EXPECT_EQ(back, data[i]) << tensors[i].name;
  }
  EXPECT_EQ(reader.Find("missing"), nullptr);
}

TEST(Safetensors, WriterRefusesShortDataAndRepeatedNames) {
  TempDir dir;
  const std::vector<SafetensorsTensor> twice = {{"a", kFp32, {1}}, {"a", kFp32, {1}}};
  EXPECT_THROW(SafetensorsWriter(dir / "x", twice), cai::Error);
  SafetensorsWriter writer(dir / "y", {{"a", kFp32, {2}}});
  const float one = 1;
  writer.Append(&one, sizeof one);
  EXPECT_THROW(writer.Finish(), cai::Error);
}

TEST(Safetensors, MalformedFiles_RefusedNamingFileAndTensor) {
  TempDir dir;
  const fs::path p = dir / "bad.safetensors";
  auto refused = [&](const std::string& header, size_t data_bytes, const std::string& expect) {
    WriteRaw(p, header, data_bytes);
    const std::string error = Error(p);
    EXPECT_NE(error.find(p.string()), std::string::npos) << error;
    EXPECT_NE(error.find(expect), std::string::npos) << "expected '" << expect << "' in: " << error;
  };
  // Range beyond the data.
  refused(R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 8,
          "tensor 'w' has data_offsets [0, 16] outside the 8 bytes");
  // Shape x item size differs from the range.
  refused(R"({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", 8,
          "tensor 'w': shape [3] of F32 takes 12 bytes, but data_offsets span 8");
  // Unknown dtype.
  refused(R"({"w": {"dtype": "F8_E4M3", "shape": [8], "data_offsets": [0, 8]}})", 8,
          "tensor 'w' has dtype 'F8_E4M3'");
  // Two tensors over the same bytes.
  refused(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
          R"( "b": {"dtype": "F16", "shape": [2], "data_offsets": [4, 8]}})",
          8, "tensors 'a' and 'b' overlap");
  // A gap before a tensor, bytes after the last.
  refused(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", 8,
          "tensor 'w' starts at byte 4 of the data");
  refused(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", 8,
          "the tensors span 4 bytes of data, the file holds 8");
  // Missing fields, negative dimensions, malformed JSON, a header longer than the file.
  refused(R"({"w": {"dtype": "F32", "shape": [2]}})", 8, "tensor 'w' needs");
  refused(R"({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", 8,
          "tensor 'w' has a shape entry");
  refused(R"({"w": {"dtype": "F32", )", 8, "malformed JSON");
  {
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    const uint64_t n = 1000;
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << "{}";
  }
  EXPECT_NE(Error(p).find("header length 1000 exceeds the file"), std::string::npos) << Error(p);
}

// A file refused while its header is parsed must not leave its descriptor open (found by
// fuzz_safetensors: half a million refusals ran out of descriptors).
TEST(Safetensors, RefusedFiles_LeaveNoDescriptorOpen) {
  TempDir dir;
  const fs::path p = dir / "bad.safetensors";
  WriteRaw(p, R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 8);
  auto open_fds = [] {
    return std::distance(fs::directory_iterator("/proc/self/fd"), fs::directory_iterator());
  };
  const auto before = open_fds();
  for (int i = 0; i < 100; ++i) EXPECT_FALSE(Error(p).empty());
  EXPECT_EQ(open_fds(), before);
}

TEST(Json, ParsesWhatHuggingFaceWrites) {
  const JsonValue v = ParseJson(
      R"({"a": [1, -2.5e-3, true, null, "x\u00e9\n"], "big": 9007199254740993, "o": {}})", "t");
  ASSERT_EQ(v.type, JsonValue::Type::kObject);
  const JsonValue* a = v.Find("a");
  ASSERT_NE(a, nullptr);
  ASSERT_EQ(a->array.size(), 5u);
  EXPECT_TRUE(a->array[0].is_integer);
  EXPECT_DOUBLE_EQ(a->array[1].number, -2.5e-3);
  EXPECT_TRUE(a->array[2].boolean);
  EXPECT_EQ(a->array[3].type, JsonValue::Type::kNull);
  EXPECT_EQ(a->array[4].string, "x\xc3\xa9\n");
  EXPECT_EQ(v.Find("big")->integer, 9007199254740993LL);  // exact beyond 2^53
  EXPECT_THROW(ParseJson("{\"a\": 1,}", "t"), cai::Error);
  EXPECT_THROW(ParseJson("[1] 2", "t"), cai::Error);
}

}  // namespace
}  // namespace cai::ckpt
