#include "checkpoint/dtype_convert.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace cai::ckpt {
namespace {

TEST(DtypeConvert, Fp16_ExactValuesAndRoundingMatchIeee) {
  EXPECT_EQ(Fp32ToFp16(1.0f), 0x3c00);
  EXPECT_EQ(Fp32ToFp16(-2.0f), 0xc000);
  EXPECT_EQ(Fp32ToFp16(65504.0f), 0x7bff);           // largest fp16
  EXPECT_EQ(Fp32ToFp16(65520.0f), 0x7c00);           // rounds up to inf
  EXPECT_EQ(Fp32ToFp16(0x1p-24f), 0x0001);           // smallest subnormal
  EXPECT_EQ(Fp32ToFp16(0x1p-25f), 0x0000);           // halfway to 0: ties to even
  EXPECT_EQ(Fp32ToFp16(0x1.8p-24f), 0x0002);         // 1.5 units: ties to even (2)
  EXPECT_EQ(Fp32ToFp16(1.0f + 0x1p-11f), 0x3c00);    // halfway above 1: ties to even
  EXPECT_EQ(Fp32ToFp16(1.0f + 0x1.8p-11f), 0x3c01);  // above halfway: rounds up
  EXPECT_EQ(Fp32ToFp16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_TRUE(std::isnan(Fp16ToFp32(Fp32ToFp16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(Fp16ToFp32(0x3555), 0x1.554p-2f);
  EXPECT_EQ(Fp16ToFp32(0x0001), 0x1p-24f);
  EXPECT_EQ(Fp16ToFp32(0xfc00), -std::numeric_limits<float>::infinity());
  // Every finite fp16 survives a round trip through fp32.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7c00) == 0x7c00) continue;
    ASSERT_EQ(Fp32ToFp16(Fp16ToFp32(static_cast<uint16_t>(h))), h) << std::hex << h;
  }
}

TEST(DtypeConvert, Bf16_TruncatesWithRoundToNearestEven) {
  EXPECT_EQ(Fp32ToBf16(1.0f), 0x3f80);
  EXPECT_EQ(Fp32ToBf16(1.0f + 0x1p-8f), 0x3f80);    // halfway: ties to even
  EXPECT_EQ(Fp32ToBf16(1.0f + 0x1.8p-8f), 0x3f81);  // above halfway
  EXPECT_EQ(Bf16ToFp32(0xc040), -3.0f);
  EXPECT_TRUE(std::isnan(Bf16ToFp32(Fp32ToBf16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(DtypeConvert, ConvertFloats_FromBf16ToFp16ThroughFp32) {
  const uint16_t bf16[3] = {0x3f80, 0xc040, 0x0000};  // 1, -3, 0
  uint16_t fp16[3];
  ConvertFloats(bf16, {CAI_DTYPE_BFLOAT, 16, 1}, fp16, {CAI_DTYPE_FLOAT, 16, 1}, 3);
  EXPECT_EQ(fp16[0], 0x3c00);
  EXPECT_EQ(fp16[1], 0xc200);
  EXPECT_EQ(fp16[2], 0x0000);
}

}  // namespace
}  // namespace cai::ckpt
