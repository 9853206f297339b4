// Conversions between fp32 and the two 16-bit float formats, bit for bit as IEEE 754 and
// torch do them: round to nearest, ties to even; NaN stays NaN (made quiet, sign and leading
// payload kept); overflow rounds to infinity. Written without branches so that the loops
// calling them vectorise.
#pragma once

#include <bit>
#include <cstdint>

namespace cai {

inline float Bf16ToFloat(uint16_t h) { return std::bit_cast<float>(uint32_t{h} << 16); }

inline uint16_t FloatToBf16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  // Adding 0x7fff plus the lowest kept bit rounds the dropped half to nearest even; a carry
  // into the exponent is the correct rounding up to the next binade or to infinity.
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  // A NaN whose payload sits only in the dropped bits would otherwise become infinity.
  const uint32_t nan = (x >> 16) | 0x40u;
  const bool is_nan = (x & 0x7fffffffu) > 0x7f800000u;
  return static_cast<uint16_t>(is_nan ? nan : rounded);
}

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  const uint32_t normal = ((exponent + (127u - 15u)) << 23) | (mantissa << 13);
  const uint32_t inf_or_nan = 0x7f800000u | (mantissa << 13);
  // fp16 subnormals are mantissa * 2^-24, exact in fp32.
  const uint32_t subnormal = std::bit_cast<uint32_t>(static_cast<float>(mantissa) * 0x1p-24f);
  const uint32_t magnitude = exponent == 0 ? subnormal : (exponent == 31 ? inf_or_nan : normal);
  return std::bit_cast<float>(sign | magnitude);
}

inline uint16_t FloatToHalf(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t x = bits & 0x7fffffffu;
  // Normal results: rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest
  // even; a carry out of the mantissa bumps the exponent, up to infinity for >= 65520.
  const uint32_t normal = (x - ((127u - 15u) << 23) + 0xfffu + ((x >> 13) & 1u)) >> 13;
  // Below 2^-14 the result is subnormal. Adding 0.5f makes fp32's ulp equal fp16's subnormal
  // step (2^-24), so the FPU's own round-to-nearest-even does the rounding; the mantissa bits
  // of the sum are then the fp16 encoding (0x400 when it rounds up to the smallest normal).
  const uint32_t subnormal = std::bit_cast<uint32_t>(std::bit_cast<float>(x) + 0.5f) - 0x3f000000u;
  const uint32_t inf_or_nan = x > 0x7f800000u ? (0x7e00u | ((x >> 13) & 0x3ffu)) : 0x7c00u;
  const uint32_t magnitude = x >= 0x47800000u ? inf_or_nan : (x < 0x38800000u ? subnormal : normal);
  return static_cast<uint16_t>(sign | magnitude);
}

}  // namespace cai
