#include "checkpoint/crc32c.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace cai::ckpt {
namespace {

using CrcFunction = uint32_t (*)(uint32_t, const void*, size_t);

// RFC 3720 (iSCSI), appendix B.4, and the "check" value of the CRC catalogue.
void ExpectKnownVectors(CrcFunction crc) {
  const std::string check = "123456789";
  EXPECT_EQ(crc(0, check.data(), check.size()), 0xE3069283u);
  std::vector<unsigned char> bytes(32, 0);
  EXPECT_EQ(crc(0, bytes.data(), bytes.size()), 0x8A9136AAu);
  std::fill(bytes.begin(), bytes.end(), 0xFF);
  EXPECT_EQ(crc(0, bytes.data(), bytes.size()), 0x62A8AB43u);
  for (size_t i = 0; i < 32; ++i) bytes[i] = static_cast<unsigned char>(i);
  EXPECT_EQ(crc(0, bytes.data(), bytes.size()), 0x46DD794Eu);
  for (size_t i = 0; i < 32; ++i) bytes[i] = static_cast<unsigned char>(31 - i);
  EXPECT_EQ(crc(0, bytes.data(), bytes.size()), 0x113FDB5Cu);
  EXPECT_EQ(crc(0, nullptr, 0), 0u);
}

TEST(Crc32cTest, Portable_MatchesKnownVectors) { ExpectKnownVectors(Crc32cPortable); }

TEST(Crc32cTest, Hardware_MatchesKnownVectors) {
  if (!HasCrc32cHardware()) GTEST_SKIP() << "this CPU has no SSE4.2 crc32 instruction";
  ExpectKnownVectors(Crc32cHardware);
}

TEST(Crc32cTest, Dispatch_MatchesKnownVectors) { ExpectKnownVectors(Crc32c); }

TEST(Crc32cTest, AnyLengthAndAlignment_BothImplementationsAgreeAndExtend) {
  std::mt19937 random(7);
  std::vector<unsigned char> data(4096 + 17);
  for (auto& b : data) b = static_cast<unsigned char>(random());
  for (size_t begin : {0, 1, 3, 7}) {
    for (size_t n : {0, 1, 7, 8, 9, 63, 64, 1000, 4096}) {
      const uint32_t whole = Crc32cPortable(0, data.data() + begin, n);
      if (HasCrc32cHardware()) {
        EXPECT_EQ(Crc32cHardware(0, data.data() + begin, n), whole) << begin << "+" << n;
      }
      // Extending by the second part gives the CRC of the whole, as the writer relies on.
      const size_t cut = n / 3;
      EXPECT_EQ(Crc32c(Crc32c(0, data.data() + begin, cut), data.data() + begin + cut, n - cut),
                whole);
    }
  }
}

}  // namespace
}  // namespace cai::ckpt
