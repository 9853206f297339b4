// Loading and storing one element of a FloatType buffer as fp32, for kernels written once for
// all three types.
#pragma once

#include <cstdint>

#include "mem/float16.h"
#include "mem/kernels.h"
#include "mem/vectorize.h"

namespace cai {

template <FloatType T>
struct Element;

template <>
struct Element<FloatType::kF32> {
  using Storage = float;
  CAI_INLINE_KERNEL static float Load(float v) { return v; }
  CAI_INLINE_KERNEL static float Store(float v) { return v; }
  // Bit pattern of the exponent field: all ones means inf or NaN.
  static constexpr uint32_t kExponentMask = 0x7f800000u;
  CAI_INLINE_KERNEL static uint32_t Bits(float v) { return std::bit_cast<uint32_t>(v); }
};

template <>
struct Element<FloatType::kBF16> {
  using Storage = uint16_t;
  CAI_INLINE_KERNEL static float Load(uint16_t v) { return Bf16ToFloat(v); }
  CAI_INLINE_KERNEL static uint16_t Store(float v) { return FloatToBf16(v); }
  static constexpr uint32_t kExponentMask = 0x7f80u;
  CAI_INLINE_KERNEL static uint32_t Bits(uint16_t v) { return v; }
};

template <>
struct Element<FloatType::kF16> {
  using Storage = uint16_t;
  CAI_INLINE_KERNEL static float Load(uint16_t v) { return HalfToFloat(v); }
  CAI_INLINE_KERNEL static uint16_t Store(float v) { return FloatToHalf(v); }
  static constexpr uint32_t kExponentMask = 0x7c00u;
  CAI_INLINE_KERNEL static uint32_t Bits(uint16_t v) { return v; }
};

}  // namespace cai
