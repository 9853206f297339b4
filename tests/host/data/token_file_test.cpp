#include "data/token_file.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <fstream>

#include "core/status.h"

namespace cai::data {
namespace {

namespace fs = std::filesystem;

class TokenFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("cai_token_file_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Asserts Open throws with `code` and a message containing every one of `parts`.
  static void ExpectOpenError(const fs::path& path, int vocab, cai_status_code code,
                              std::initializer_list<std::string> parts) {
    try {
      TokenFile::Open(path, vocab);
      ADD_FAILURE() << "opened " << path;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      for (const std::string& part : parts) {
        EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
            << "'" << part << "' missing from: " << e.what();
      }
    }
  }

  fs::path dir_;
};

const std::vector<Token> kTokens{0, 1, 255, 256, 50256, 7};

TEST_F(TokenFileTest, RawUint16Layout_ReadsBackWhatWasWritten) {
  const fs::path path = dir_ / "train.bin";
  WriteTokenFile(path, kTokens, TokenFileLayout::kRawUint16);
  EXPECT_EQ(fs::file_size(path), kTokens.size() * 2);
  const TokenFile file = TokenFile::Open(path, 50257);
  EXPECT_EQ(file.layout(), TokenFileLayout::kRawUint16);
  EXPECT_EQ(std::vector<Token>(file.tokens().begin(), file.tokens().end()), kTokens);
}

TEST_F(TokenFileTest, LlmcLayout_HeaderIsLlmcsAndTokensReadBack) {
  const fs::path path = dir_ / "train.bin";
  WriteTokenFile(path, kTokens, TokenFileLayout::kLlmc);
  ASSERT_EQ(fs::file_size(path), 1024 + kTokens.size() * 2);
  int32_t header[3];
  std::ifstream(path, std::ios::binary).read(reinterpret_cast<char*>(header), sizeof(header));
  EXPECT_EQ(header[0], 20240520);
  EXPECT_EQ(header[1], 1);
  EXPECT_EQ(header[2], static_cast<int32_t>(kTokens.size()));

  TokenFile file = TokenFile::Open(path, 50257);
  EXPECT_EQ(file.layout(), TokenFileLayout::kLlmc);
  EXPECT_EQ(std::vector<Token>(file.tokens().begin(), file.tokens().end()), kTokens);
  const TokenFile moved = std::move(file);
  EXPECT_EQ(moved.tokens()[4], 50256);
}

TEST_F(TokenFileTest, OddByteLength_ErrorNamesFileAndSize) {
  const fs::path path = dir_ / "odd.bin";
  std::ofstream(path, std::ios::binary) << "abcde";
  ExpectOpenError(path, 256, CAI_DATA_LOSS, {path.string(), "size 5 bytes is odd"});
}

TEST_F(TokenFileTest, IdAtOrAboveVocabulary_ErrorNamesFileOffsetAndId) {
  const fs::path raw = dir_ / "raw.bin";
  WriteTokenFile(raw, std::vector<Token>{10, 20, 256, 30}, TokenFileLayout::kRawUint16);
  ExpectOpenError(raw, 256, CAI_DATA_LOSS,
                  {raw.string(), "token 2 (byte offset 4) has id 256", "vocabulary size 256"});

  const fs::path llmc = dir_ / "llmc.bin";
  WriteTokenFile(llmc, std::vector<Token>{10, 20, 256, 30}, TokenFileLayout::kLlmc);
  ExpectOpenError(llmc, 256, CAI_DATA_LOSS, {llmc.string(), "token 2 (byte offset 1028)"});
}

TEST_F(TokenFileTest, MissingFile_IsNotFoundNamingThePath) {
  const fs::path path = dir_ / "nope.bin";
  ExpectOpenError(path, 256, CAI_NOT_FOUND, {path.string(), "No such file"});
}

TEST_F(TokenFileTest, LlmcHeaderCountDisagreeingWithSize_IsRejected) {
  const fs::path path = dir_ / "short.bin";
  WriteTokenFile(path, kTokens, TokenFileLayout::kLlmc);
  fs::resize_file(path, 1024 + 4);
  ExpectOpenError(path, 50257, CAI_DATA_LOSS, {"header says 6 tokens", "file is 1028 bytes"});
}

TEST_F(TokenFileTest, LlmcVersion2_IsRejectedAsUnsupported) {
  const fs::path path = dir_ / "v2.bin";
  int32_t header[256] = {20240520, 2, 0};
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<char*>(header), sizeof(header));
  ExpectOpenError(path, 50257, CAI_DATA_LOSS, {"version 2 is not supported"});
}

TEST_F(TokenFileTest, EmptyRawFile_HasNoTokens) {
  const fs::path path = dir_ / "empty.bin";
  std::ofstream(path, std::ios::binary).close();
  EXPECT_TRUE(TokenFile::Open(path, 256).tokens().empty());
}

}  // namespace
}  // namespace cai::data
