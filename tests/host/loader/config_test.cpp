// Schema validation of configuration tables and the helpers behind its messages.
#include "loader/config.h"

#include <gtest/gtest.h>
#include <toml++/toml.h>

#include "cai/sdk.hpp"
#include "core/status.h"
#include "core/strings.h"
#include "loader/file_checks.h"

namespace cai {
namespace {

const char* const kPrecisions[] = {"fp32", "bf16", "fp16", nullptr};
const cai_config_key kKeys[] = {
    sdk::IntKey("bucket_cap_mb", "25", "Gradient bucket size in MiB.", 1, 4096,
                CAI_CONFIG_HAS_MIN | CAI_CONFIG_HAS_MAX),
    sdk::BoolKey("broadcast_buffers", "true", "Broadcast buffers every step."),
    sdk::FloatKey("max_norm", "0.0", "Clip gradients to this global norm (0 = off)."),
    sdk::StringKey("precision", "\"fp32\"", "Compute precision.", kPrecisions),
};

std::unique_ptr<cai_config> Validate(const std::string& text) {
  toml::table table = toml::parse(text);
  return ValidateConfig(ReadSchema(kKeys, 4, "test"), &table, "[plugin.ddp] in job.toml");
}

std::string ErrorOf(const std::string& text) {
  try {
    Validate(text);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Config, AbsentKeys_TakeTheirDefaults) {
  auto config = Validate("");
  int64_t bucket = 0;
  bool broadcast = false;
  double norm = -1;
  const char* precision = nullptr;
  EXPECT_EQ(ConfigGetInt(config.get(), "bucket_cap_mb", &bucket), nullptr);
  EXPECT_EQ(ConfigGetBool(config.get(), "broadcast_buffers", &broadcast), nullptr);
  EXPECT_EQ(ConfigGetFloat(config.get(), "max_norm", &norm), nullptr);
  EXPECT_EQ(ConfigGetString(config.get(), "precision", &precision), nullptr);
  EXPECT_EQ(bucket, 25);
  EXPECT_TRUE(broadcast);
  EXPECT_EQ(norm, 0.0);
  EXPECT_STREQ(precision, "fp32");
}

TEST(Config, GivenValues_AreReadBackTyped) {
  auto config = Validate("bucket_cap_mb = 50\nmax_norm = 1\nprecision = \"bf16\"");
  int64_t bucket = 0;
  double norm = 0;
  ASSERT_EQ(ConfigGetInt(config.get(), "bucket_cap_mb", &bucket), nullptr);
  ASSERT_EQ(ConfigGetFloat(config.get(), "max_norm", &norm), nullptr);
  EXPECT_EQ(bucket, 50);
  EXPECT_EQ(norm, 1.0);  // an integer literal is accepted for a float key
}

TEST(Config, UnknownKey_NamesNearestValidKeyAndWhere) {
  std::string error = ErrorOf("bucket_cap = 10");
  EXPECT_NE(error.find("[plugin.ddp] in job.toml"), std::string::npos) << error;
  EXPECT_NE(error.find("unknown key 'bucket_cap'"), std::string::npos) << error;
  EXPECT_NE(error.find("did you mean 'bucket_cap_mb'?"), std::string::npos) << error;
  EXPECT_NE(error.find("line 1"), std::string::npos) << error;
}

TEST(Config, WrongType_NamesKeyExpectedAndGiven) {
  std::string error = ErrorOf("\n\nbroadcast_buffers = \"yes\"");
  EXPECT_NE(error.find("key 'broadcast_buffers'"), std::string::npos) << error;
  EXPECT_NE(error.find("expected a boolean, got string \"yes\""), std::string::npos) << error;
  EXPECT_NE(error.find("line 3"), std::string::npos) << error;
}

TEST(Config, OutOfRangeAndBadChoice_AreRefused) {
  EXPECT_NE(ErrorOf("bucket_cap_mb = 0").find("below the minimum 1"), std::string::npos);
  EXPECT_NE(ErrorOf("bucket_cap_mb = 5000").find("above the maximum 4096"), std::string::npos);
  const std::string choice = ErrorOf("precision = \"fp8\"");
  EXPECT_NE(choice.find("key 'precision' (line 1): \"fp8\" is not one of \"fp32\", \"bf16\", "
                        "\"fp16\" (did you mean \"fp32\"?). Compute precision."),
            std::string::npos)
      << choice;
  const std::string typo = ErrorOf("precision = \"bf61\"");
  EXPECT_NE(typo.find("(did you mean \"bf16\"?)"), std::string::npos) << typo;
}

TEST(Config, ValueFromSetOption_NamesTheOptionNotALine) {
  toml::table table =
      toml::parse("bucket_cap_mb = 0", std::string_view("--set plugin.ddp.bucket_cap_mb=0"));
  try {
    ValidateConfig(ReadSchema(kKeys, 4, "test"), &table, "[plugin.ddp] in job.toml");
    ADD_FAILURE() << "accepted 0";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "key 'bucket_cap_mb' (from --set plugin.ddp.bucket_cap_mb=0): value 0 is below"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(WhereWritten(*table.get("bucket_cap_mb")), " (from --set plugin.ddp.bucket_cap_mb=0)");
  EXPECT_EQ(WhereWritten(*toml::parse("\nx = 1").get("x")), " (line 2)");
}

TEST(Config, ReadingAsTheWrongType_FailsWithStatus) {
  auto config = Validate("");
  bool b = false;
  cai_status* status = ConfigGetBool(config.get(), "bucket_cap_mb", &b);
  ASSERT_NE(status, nullptr);
  EXPECT_EQ(StatusCode(status), CAI_INVALID_ARGUMENT);
  DestroyStatus(status);
  status = ConfigGetBool(config.get(), "nope", &b);
  ASSERT_NE(status, nullptr);
  EXPECT_EQ(StatusCode(status), CAI_NOT_FOUND);
  DestroyStatus(status);
}

TEST(Config, MalformedSchema_IsRejected) {
  const cai_config_key bad_default[] = {sdk::IntKey("n", "\"x\"", "doc")};
  EXPECT_THROW(ReadSchema(bad_default, 1, "p"), Error);
  const cai_config_key no_doc[] = {sdk::BoolKey("n", "true", "")};
  EXPECT_THROW(ReadSchema(no_doc, 1, "p"), Error);
  const cai_config_key twice[] = {sdk::BoolKey("n", "true", "d"), sdk::BoolKey("n", "true", "d")};
  EXPECT_THROW(ReadSchema(twice, 2, "p"), Error);
  const cai_config_key upper[] = {sdk::BoolKey("Name", "true", "d")};
  EXPECT_THROW(ReadSchema(upper, 1, "p"), Error);
}

TEST(Strings, NearestKey_FindsTyposNotStrangers) {
  const std::string_view keys[] = {"bucket_cap_mb", "static_graph", "no_sync"};
  EXPECT_EQ(NearestKey("static_grpah", keys), "static_graph");
  EXPECT_EQ(NearestKey("nosync", keys), "no_sync");
  EXPECT_EQ(NearestKey("learning_rate", keys), "");
}

TEST(Strings, SwappedNeighbours_AreOneEditAndWinATie) {
  EXPECT_EQ(EditDistance("fdsp", "fsdp"), 1u);
  EXPECT_EQ(EditDistance("fdsp", "ddp"), 2u);
  EXPECT_EQ(EditDistance("kitten", "sitting"), 3u);
  EXPECT_EQ(EditDistance("", "abc"), 3u);
  const std::string_view plugins[] = {"none", "ddp", "fsdp", "low_level_zero"};
  EXPECT_EQ(NearestKey("fdsp", plugins), "fsdp");
}

TEST(Strings, ByteSizes_ReadBinaryUnitsAndRefuseDecimalOnesAndNonsense) {
  EXPECT_EQ(ParseByteSize("0"), 0u);
  EXPECT_EQ(ParseByteSize("1048576"), 1048576u);
  EXPECT_EQ(ParseByteSize("512MiB"), 512u << 20);
  EXPECT_EQ(ParseByteSize(" 1.5 GiB "), 3u << 29);
  EXPECT_EQ(ParseByteSize("2tib"), uint64_t{2} << 40);
  EXPECT_EQ(ParseByteSize("64 B"), 64u);
  for (const char* bad :
       {"", "GiB", "4GB", "1.5", "0.5B", "1.2.3MiB", "-1", "1e9", "8EiB", "9000000TiB"}) {
    EXPECT_EQ(ParseByteSize(bad), std::nullopt) << bad;
  }
  EXPECT_EQ(FormatByteCount(1000), "1000 bytes");
  EXPECT_EQ(FormatByteCount(3u << 20), "3145728 bytes (3.00 MiB)");
}

TEST(FileChecks, Sha256_MatchesFipsVectors) {
  char path[] = "/tmp/cai-sha-XXXXXX";
  int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(write(fd, "abc", 3), 3);
  close(fd);
  EXPECT_EQ(Sha256File(path), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  unlink(path);
}

}  // namespace
}  // namespace cai
