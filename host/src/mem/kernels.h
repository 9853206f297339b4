// Element-wise kernels on raw, contiguous buffers of fp32 / bf16 / fp16: what the memory
// service offers plugins (cai_mem_api.kernel) and what the fused optimizer update builds on.
//
// Every kernel is vectorised (an AVX2 clone chosen at load time, SSE2 otherwise; results are
// bit-identical between the two because neither uses FMA or reassociation) and runs on all
// OpenMP threads from kParallelMinElements elements on. Thread-safe; callers order their own
// accesses to a buffer.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cai {

enum class FloatType : uint8_t { kF32, kBF16, kF16 };

inline size_t SizeOf(FloatType t) { return t == FloatType::kF32 ? 4 : 2; }
const char* FloatTypeName(FloatType t);

// y = x, converted when the types differ (round to nearest even, NaN kept).
void CastCopy(const void* x, FloatType x_type, void* y, FloatType y_type, size_t n);
// y = alpha * y, computed in fp32 and rounded once to y's type.
void Scale(void* y, FloatType type, size_t n, float alpha);
// y = alpha * x + y; x of any type, y fp32.
void Axpy(float alpha, const void* x, FloatType x_type, float* y, size_t n);
// y = value, rounded to y's type.
void Fill(void* y, FloatType type, size_t n, float value);
// sum(y^2) accumulated in fp64. The order of additions depends only on n, never on the
// thread count or CPU, so the result is reproducible everywhere.
double SumSquares(const void* y, FloatType type, size_t n);
// False when any element is inf or NaN.
bool AllFinite(const void* y, FloatType type, size_t n);
// memcpy spread over threads for large copies (one core cannot saturate memory bandwidth).
void ParallelMemcpy(void* dst, const void* src, size_t bytes);

// Single-threaded variants, for callers that already run inside their own parallel split.
namespace serial {
void CastCopy(const void* x, FloatType x_type, void* y, FloatType y_type, size_t n);
}  // namespace serial

}  // namespace cai
