// Conversions between the floating-point dtypes a checkpoint may hold and a reader may want:
// fp32, bf16 and fp16, with round-to-nearest-even as the hardware does, so a checkpoint saved
// in one precision loads into another as a cast on the device would.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cai/core.h"

namespace cai::ckpt {

bool SameDtype(cai_dtype a, cai_dtype b);
bool IsConvertibleFloat(cai_dtype dtype);  // fp32, bf16 or fp16
// "fp32", "bf16", "fp16", "int64", "uint8", "bool", or "dtype{code,bits}" for the rest.
const char* DtypeName(cai_dtype dtype);
size_t DtypeBytes(cai_dtype dtype);  // bits / 8

float Fp16ToFp32(uint16_t h);
uint16_t Fp32ToFp16(float f);
float Bf16ToFp32(uint16_t b);
uint16_t Fp32ToBf16(float f);

// Converts `count` elements between two convertible float dtypes (or copies when equal).
void ConvertFloats(const void* src, cai_dtype src_dtype, void* dst, cai_dtype dst_dtype,
                   size_t count);

}  // namespace cai::ckpt
