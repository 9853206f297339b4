#include "checkpoint/dtype_convert.h"

#include <bit>
#include <cstring>
#include <string>

#include "core/status.h"

namespace cai::ckpt {
namespace {

constexpr cai_dtype kFp32{CAI_DTYPE_FLOAT, 32, 1};
constexpr cai_dtype kFp16{CAI_DTYPE_FLOAT, 16, 1};
constexpr cai_dtype kBf16{CAI_DTYPE_BFLOAT, 16, 1};

float LoadAsFp32(const unsigned char* p, cai_dtype dtype) {
  if (SameDtype(dtype, kFp32)) {
    float f;
    std::memcpy(&f, p, sizeof(f));
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return SameDtype(dtype, kFp16) ? Fp16ToFp32(h) : Bf16ToFp32(h);
}

void StoreFromFp32(unsigned char* p, cai_dtype dtype, float f) {
  if (SameDtype(dtype, kFp32)) {
    std::memcpy(p, &f, sizeof(f));
    return;
  }
  const uint16_t h = SameDtype(dtype, kFp16) ? Fp32ToFp16(f) : Fp32ToBf16(f);
  std::memcpy(p, &h, sizeof(h));
}

}  // namespace

bool SameDtype(cai_dtype a, cai_dtype b) {
  return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}

bool IsConvertibleFloat(cai_dtype dtype) {
  return SameDtype(dtype, kFp32) || SameDtype(dtype, kFp16) || SameDtype(dtype, kBf16);
}

const char* DtypeName(cai_dtype dtype) {
  if (dtype.lanes == 1) {
    switch (dtype.code) {
      case CAI_DTYPE_FLOAT:
        if (dtype.bits == 32) return "fp32";
        if (dtype.bits == 16) return "fp16";
        if (dtype.bits == 64) return "fp64";
        break;
      case CAI_DTYPE_BFLOAT:
        if (dtype.bits == 16) return "bf16";
        break;
      case CAI_DTYPE_INT:
        if (dtype.bits == 8) return "int8";
        if (dtype.bits == 16) return "int16";
        if (dtype.bits == 32) return "int32";
        if (dtype.bits == 64) return "int64";
        break;
      case CAI_DTYPE_UINT:
        if (dtype.bits == 8) return "uint8";
        if (dtype.bits == 16) return "uint16";
        if (dtype.bits == 32) return "uint32";
        if (dtype.bits == 64) return "uint64";
        break;
      case CAI_DTYPE_BOOL:
        if (dtype.bits == 8) return "bool";
        break;
      default:
        break;
    }
  }
  return "an unsupported dtype";
}

size_t DtypeBytes(cai_dtype dtype) { return dtype.bits / 8u; }

float Fp16ToFp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in fp32.
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return std::bit_cast<float>(std::bit_cast<uint32_t>(magnitude) | sign);
  }
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  // Rebias the exponent from 15 to 127.
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

uint16_t Fp32ToFp16(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  const auto sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude >= 0x7f800000u) {
    // Inf stays inf; NaN stays a (quiet) NaN with its top payload bits.
    const uint32_t nan_bits = magnitude > 0x7f800000u ? 0x200u | ((magnitude >> 13) & 0x3ffu) : 0;
    return static_cast<uint16_t>(sign | 0x7c00u | nan_bits);
  }
  // 65520 = 65504 + half an ulp: from here up, round-to-nearest-even gives inf.
  if (magnitude >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (magnitude < 0x38800000u) {
    // Below 2^-14 the result is subnormal (units of 2^-24). Adding 0.5 (whose ulp is 2^-24)
    // makes the FPU round to that unit, to nearest even; the low mantissa bits are the result.
    const float shifted = std::bit_cast<float>(magnitude) + 0.5f;
    return static_cast<uint16_t>(sign | (std::bit_cast<uint32_t>(shifted) - 0x3f000000u));
  }
  // Rebias the exponent (127 -> 15 is -112 << 23) and round to nearest even on the 13 bits
  // that are dropped.
  const uint32_t odd = (magnitude >> 13) & 1u;
  magnitude += 0xc8000fffu + odd;
  return static_cast<uint16_t>(sign | (magnitude >> 13));
}

float Bf16ToFp32(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

uint16_t Fp32ToBf16(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  const uint32_t odd = (bits >> 16) & 1u;
  return static_cast<uint16_t>((bits + 0x7fffu + odd) >> 16);
}

void ConvertFloats(const void* src, cai_dtype src_dtype, void* dst, cai_dtype dst_dtype,
                   size_t count) {
  if (SameDtype(src_dtype, dst_dtype)) {
    std::memcpy(dst, src, count * DtypeBytes(src_dtype));
    return;
  }
  if (!IsConvertibleFloat(src_dtype) || !IsConvertibleFloat(dst_dtype)) {
    throw Error(CAI_INVALID_ARGUMENT, std::string("cannot convert ") + DtypeName(src_dtype) +
                                          " to " + DtypeName(dst_dtype) +
                                          " (only between fp32, bf16 and fp16)");
  }
  const auto* in = static_cast<const unsigned char*>(src);
  auto* out = static_cast<unsigned char*>(dst);
  const size_t in_size = DtypeBytes(src_dtype);
  const size_t out_size = DtypeBytes(dst_dtype);
  for (size_t i = 0; i < count; ++i) {
    StoreFromFp32(out + i * out_size, dst_dtype, LoadAsFp32(in + i * in_size, src_dtype));
  }
}

}  // namespace cai::ckpt
