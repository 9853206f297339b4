// The fp32 <-> bf16/fp16 conversions against an independent reference that rounds in double
// arithmetic with std::nearbyint (round to nearest even) instead of bit manipulation.
#include "mem/float16.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "mem/kernels.h"

namespace cai {
namespace {

struct Format {
  int mantissa_bits;
  int min_exponent;  // of the smallest normal
  int max_exponent;
  uint16_t (*encode)(float);
  float (*decode)(uint16_t);
};

const Format kHalf{10, -14, 15, FloatToHalf, HalfToFloat};
const Format kBf16{7, -126, 127, FloatToBf16, Bf16ToFloat};

// The value of one 16-bit code, decoded with ldexp.
double ReferenceDecode(const Format& f, uint16_t code) {
  const int exponent_bits = 15 - f.mantissa_bits;
  const int bias = (1 << (exponent_bits - 1)) - 1;
  const int e = (code >> f.mantissa_bits) & ((1 << exponent_bits) - 1);
  const int m = code & ((1 << f.mantissa_bits) - 1);
  const double sign = (code & 0x8000) ? -1.0 : 1.0;
  if (e == (1 << exponent_bits) - 1) return m ? NAN : sign * INFINITY;
  if (e == 0) return sign * std::ldexp(m, 1 - bias - f.mantissa_bits);
  return sign * std::ldexp(m + (1 << f.mantissa_bits), e - bias - f.mantissa_bits);
}

// x rounded to the format's nearest value, ties to even, as a double.
double ReferenceRound(const Format& f, float x) {
  if (std::isnan(x) || std::isinf(x)) return x;
  const double a = std::fabs(static_cast<double>(x));
  int e = std::ilogb(a == 0 ? 1.0 : a);
  if (e < f.min_exponent) e = f.min_exponent;  // subnormals share the smallest normal's step
  const double step = std::ldexp(1.0, e - f.mantissa_bits);
  double r = std::nearbyint(a / step) * step;
  const double max_finite = std::ldexp(2.0 - std::ldexp(1.0, -f.mantissa_bits), f.max_exponent);
  if (r > max_finite) r = INFINITY;
  return std::copysign(r, static_cast<double>(x));
}

void ExpectRoundsLikeReference(const Format& f, float x) {
  const uint16_t code = f.encode(x);
  const double got = ReferenceDecode(f, code);
  const double want = ReferenceRound(f, x);
  if (std::isnan(want)) {
    EXPECT_TRUE(std::isnan(got)) << "x bits 0x" << std::hex << std::bit_cast<uint32_t>(x);
    return;
  }
  EXPECT_EQ(got, want) << "x = " << x << " bits 0x" << std::hex << std::bit_cast<uint32_t>(x);
  EXPECT_EQ(std::signbit(got), std::signbit(x)) << x;
}

TEST(Float16, DecodeOfEveryCode_MatchesLdexpReference) {
  for (uint32_t code = 0; code <= 0xffff; ++code) {
    for (const Format* f : {&kHalf, &kBf16}) {
      const double want = ReferenceDecode(*f, static_cast<uint16_t>(code));
      const float got = f->decode(static_cast<uint16_t>(code));
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(got)) << code;
      } else {
        ASSERT_EQ(static_cast<double>(got), want) << code;
        ASSERT_EQ(std::signbit(got), std::signbit(want)) << code;
      }
    }
  }
}

TEST(Float16, EncodeOfEveryCode_RoundTripsExactly) {
  for (uint32_t code = 0; code <= 0xffff; ++code) {
    for (const Format* f : {&kHalf, &kBf16}) {
      const float value = f->decode(static_cast<uint16_t>(code));
      if (std::isnan(value)) continue;
      ASSERT_EQ(f->encode(value), code) << code;
    }
  }
}

TEST(Float16, MidpointsBetweenNeighbours_RoundToEven) {
  for (const Format* f : {&kHalf, &kBf16}) {
    for (uint32_t code = 0; code < 0x7bff; ++code) {
      const double lo = ReferenceDecode(*f, static_cast<uint16_t>(code));
      const double hi = ReferenceDecode(*f, static_cast<uint16_t>(code + 1));
      if (std::isinf(hi) || std::isnan(hi)) break;
      const float mid = static_cast<float>((lo + hi) / 2);
      if (static_cast<double>(mid) != (lo + hi) / 2) continue;  // not representable in fp32
      const uint16_t even =
          (code & 1) ? static_cast<uint16_t>(code + 1) : static_cast<uint16_t>(code);
      ASSERT_EQ(f->encode(mid), even) << "between codes " << code << " and " << code + 1;
      ASSERT_EQ(f->encode(-mid), even | 0x8000) << code;
    }
  }
}

TEST(Float16, EdgeCases_RoundAsIeee) {
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65519.996f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);  // the tie above the largest finite goes to inf
  EXPECT_EQ(FloatToHalf(1e30f), 0x7c00);
  EXPECT_EQ(FloatToHalf(-INFINITY), 0xfc00);
  EXPECT_EQ(FloatToHalf(0x1p-24f), 0x0001);      // smallest subnormal
  EXPECT_EQ(FloatToHalf(0x1p-25f), 0x0000);      // tie between 0 and it: even is 0
  EXPECT_EQ(FloatToHalf(0x1.8p-24f), 0x0002);    // tie between 1 and 2: even is 2
  EXPECT_EQ(FloatToHalf(0x1.ffcp-15f), 0x0400);  // rounds up into the smallest normal
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(FloatToBf16(1.0f + 0x1p-8f), 0x3f80);                     // tie, 1.0 is even
  EXPECT_EQ(FloatToBf16(1.0f + 0x1.8p-7f), 0x3f82);                   // tie, rounds up to even
  EXPECT_EQ(FloatToBf16(3.4028235e38f), 0x7f80);                      // FLT_MAX rounds to inf
  EXPECT_EQ(FloatToBf16(std::bit_cast<float>(0x00000001u)), 0x0000);  // tiny subnormal
  EXPECT_EQ(FloatToBf16(-INFINITY), 0xff80);
}

TEST(Float16, NaNs_StayNaNWithSignAndLeadingPayload) {
  // Payload only in the bits bf16 drops: plain truncation would make this infinity.
  const float low_payload = std::bit_cast<float>(0x7f800001u);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(low_payload))));
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(low_payload))));
  const float negative = std::bit_cast<float>(0xffc12345u);
  EXPECT_EQ(FloatToBf16(negative), 0xffc1);
  EXPECT_EQ(FloatToHalf(negative) & 0xfe00, 0xfe00);
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7c01)));
  EXPECT_TRUE(std::isnan(Bf16ToFloat(0x7f81)));
}

TEST(Float16, RandomBitPatterns_MatchReference) {
  std::mt19937 rng(7);
  for (int i = 0; i < 1'000'000; ++i) {
    const float x = std::bit_cast<float>(static_cast<uint32_t>(rng()));
    ExpectRoundsLikeReference(kHalf, x);
    ExpectRoundsLikeReference(kBf16, x);
    if (HasFailure()) return;
  }
}

TEST(Float16, VectorisedCastCopy_EqualsScalarConversionForEveryPattern) {
  // Every fp32 pattern with a random low half exercises both clones' select logic.
  std::mt19937 rng(11);
  std::vector<float> x(1 << 20);
  for (float& v : x) v = std::bit_cast<float>(static_cast<uint32_t>(rng()));
  std::vector<uint16_t> half(x.size()), bf16(x.size());
  CastCopy(x.data(), FloatType::kF32, half.data(), FloatType::kF16, x.size());
  CastCopy(x.data(), FloatType::kF32, bf16.data(), FloatType::kBF16, x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(half[i], FloatToHalf(x[i])) << i;
    ASSERT_EQ(bf16[i], FloatToBf16(x[i])) << i;
  }
  std::vector<float> back(x.size());
  CastCopy(half.data(), FloatType::kF16, back.data(), FloatType::kF32, x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(std::bit_cast<uint32_t>(back[i]), std::bit_cast<uint32_t>(HalfToFloat(half[i])));
  }
}

}  // namespace
}  // namespace cai
