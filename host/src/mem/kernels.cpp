#include "mem/kernels.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "mem/element.h"
#include "mem/parallel.h"

namespace cai {
namespace {

using F = FloatType;

// Elements per cache-line-aligned range boundary for element-wise kernels (64 fp32 = 4 lines).
constexpr size_t kAlign = 64;
// Elements per fixed reduction block of SumSquares: the unit whose partial sums are added in
// order, making the result independent of the thread split.
constexpr size_t kReduceBlock = 4096;

template <F X, F Y>
CAI_INLINE_KERNEL void CastBody(const void* x, void* y, size_t n) {
  const auto* in = static_cast<const typename Element<X>::Storage*>(x);
  auto* out = static_cast<typename Element<Y>::Storage*>(y);
  for (size_t i = 0; i < n; ++i) out[i] = Element<Y>::Store(Element<X>::Load(in[i]));
}

template <F T>
CAI_INLINE_KERNEL void ScaleBody(void* y, size_t n, float alpha) {
  auto* out = static_cast<typename Element<T>::Storage*>(y);
  for (size_t i = 0; i < n; ++i) out[i] = Element<T>::Store(alpha * Element<T>::Load(out[i]));
}

template <F X>
CAI_INLINE_KERNEL void AxpyBody(float alpha, const void* x, float* y, size_t n) {
  const auto* in = static_cast<const typename Element<X>::Storage*>(x);
  for (size_t i = 0; i < n; ++i) y[i] = y[i] + alpha * Element<X>::Load(in[i]);
}

template <F T>
CAI_INLINE_KERNEL double SumSquaresBody(const void* y, size_t n) {
  const auto* in = static_cast<const typename Element<T>::Storage*>(y);
  // Eight independent accumulators: a fixed association the compiler may vectorise without
  // reassociating, so every ISA clone returns the same bits.
  constexpr size_t kLanes = 8;
  double acc[kLanes] = {};
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (size_t k = 0; k < kLanes; ++k) {
      const double v = Element<T>::Load(in[i + k]);
      acc[k] += v * v;
    }
  }
  for (size_t k = 0; i < n; ++i, ++k) {
    const double v = Element<T>::Load(in[i]);
    acc[k] += v * v;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

template <F T>
CAI_INLINE_KERNEL bool AllFiniteBody(const void* y, size_t n) {
  const auto* in = static_cast<const typename Element<T>::Storage*>(y);
  constexpr uint32_t kMask = Element<T>::kExponentMask;
  uint32_t non_finite = 0;
  for (size_t i = 0; i < n; ++i) non_finite |= (Element<T>::Bits(in[i]) & kMask) == kMask;
  return non_finite == 0;
}

CAI_VECTOR_CLONES void CastF32ToBf16(const void* x, void* y, size_t n) {
  CastBody<F::kF32, F::kBF16>(x, y, n);
}
CAI_VECTOR_CLONES void CastF32ToF16(const void* x, void* y, size_t n) {
  CastBody<F::kF32, F::kF16>(x, y, n);
}
CAI_VECTOR_CLONES void CastBf16ToF32(const void* x, void* y, size_t n) {
  CastBody<F::kBF16, F::kF32>(x, y, n);
}
CAI_VECTOR_CLONES void CastF16ToF32(const void* x, void* y, size_t n) {
  CastBody<F::kF16, F::kF32>(x, y, n);
}
CAI_VECTOR_CLONES void CastBf16ToF16(const void* x, void* y, size_t n) {
  CastBody<F::kBF16, F::kF16>(x, y, n);
}
CAI_VECTOR_CLONES void CastF16ToBf16(const void* x, void* y, size_t n) {
  CastBody<F::kF16, F::kBF16>(x, y, n);
}
CAI_VECTOR_CLONES void ScaleF32(void* y, size_t n, float a) { ScaleBody<F::kF32>(y, n, a); }
CAI_VECTOR_CLONES void ScaleBf16(void* y, size_t n, float a) { ScaleBody<F::kBF16>(y, n, a); }
CAI_VECTOR_CLONES void ScaleF16(void* y, size_t n, float a) { ScaleBody<F::kF16>(y, n, a); }
CAI_VECTOR_CLONES void AxpyF32(float a, const void* x, float* y, size_t n) {
  AxpyBody<F::kF32>(a, x, y, n);
}
CAI_VECTOR_CLONES void AxpyBf16(float a, const void* x, float* y, size_t n) {
  AxpyBody<F::kBF16>(a, x, y, n);
}
CAI_VECTOR_CLONES void AxpyF16(float a, const void* x, float* y, size_t n) {
  AxpyBody<F::kF16>(a, x, y, n);
}
CAI_VECTOR_CLONES double SumSquaresF32(const void* y, size_t n) {
  return SumSquaresBody<F::kF32>(y, n);
}
CAI_VECTOR_CLONES double SumSquaresBf16(const void* y, size_t n) {
  return SumSquaresBody<F::kBF16>(y, n);
}
CAI_VECTOR_CLONES double SumSquaresF16(const void* y, size_t n) {
  return SumSquaresBody<F::kF16>(y, n);
}
CAI_VECTOR_CLONES bool AllFiniteF32(const void* y, size_t n) {
  return AllFiniteBody<F::kF32>(y, n);
}
CAI_VECTOR_CLONES bool AllFiniteBf16(const void* y, size_t n) {
  return AllFiniteBody<F::kBF16>(y, n);
}
CAI_VECTOR_CLONES bool AllFiniteF16(const void* y, size_t n) {
  return AllFiniteBody<F::kF16>(y, n);
}

using CastFn = void (*)(const void*, void*, size_t);

CastFn CastFunction(F x, F y) {
  switch (x) {
    case F::kF32:
      return y == F::kBF16 ? CastF32ToBf16 : CastF32ToF16;
    case F::kBF16:
      return y == F::kF32 ? CastBf16ToF32 : CastBf16ToF16;
    case F::kF16:
      return y == F::kF32 ? CastF16ToF32 : CastF16ToBf16;
  }
  return nullptr;
}

template <class T>
const T* Offset(const void* p, size_t bytes) {
  return reinterpret_cast<const T*>(static_cast<const char*>(p) + bytes);
}
template <class T>
T* Offset(void* p, size_t bytes) {
  return reinterpret_cast<T*>(static_cast<char*>(p) + bytes);
}

}  // namespace

const char* FloatTypeName(FloatType t) {
  switch (t) {
    case F::kF32:
      return "fp32";
    case F::kBF16:
      return "bf16";
    case F::kF16:
      return "fp16";
  }
  return "?";
}

namespace serial {
void CastCopy(const void* x, FloatType x_type, void* y, FloatType y_type, size_t n) {
  if (x_type == y_type) {
    std::memcpy(y, x, n * SizeOf(x_type));
  } else {
    CastFunction(x_type, y_type)(x, y, n);
  }
}
}  // namespace serial

void CastCopy(const void* x, FloatType x_type, void* y, FloatType y_type, size_t n) {
  if (x_type == y_type) {
    ParallelMemcpy(y, x, n * SizeOf(x_type));
    return;
  }
  const CastFn cast = CastFunction(x_type, y_type);
  const size_t xs = SizeOf(x_type), ys = SizeOf(y_type);
  ParallelFor(n, kAlign, [&](size_t b, size_t e) {
    cast(Offset<char>(x, b * xs), Offset<char>(y, b * ys), e - b);
  });
}

void Scale(void* y, FloatType type, size_t n, float alpha) {
  auto* fn = type == F::kF32 ? ScaleF32 : (type == F::kBF16 ? ScaleBf16 : ScaleF16);
  const size_t s = SizeOf(type);
  ParallelFor(n, kAlign, [&](size_t b, size_t e) { fn(Offset<char>(y, b * s), e - b, alpha); });
}

void Axpy(float alpha, const void* x, FloatType x_type, float* y, size_t n) {
  auto* fn = x_type == F::kF32 ? AxpyF32 : (x_type == F::kBF16 ? AxpyBf16 : AxpyF16);
  const size_t s = SizeOf(x_type);
  ParallelFor(n, kAlign,
              [&](size_t b, size_t e) { fn(alpha, Offset<char>(x, b * s), y + b, e - b); });
}

void Fill(void* y, FloatType type, size_t n, float value) {
  if (type == F::kF32) {
    ParallelFor(n, kAlign, [&](size_t b, size_t e) {
      std::fill(static_cast<float*>(y) + b, static_cast<float*>(y) + e, value);
    });
    return;
  }
  const uint16_t bits = type == F::kBF16 ? FloatToBf16(value) : FloatToHalf(value);
  ParallelFor(n, kAlign, [&](size_t b, size_t e) {
    std::fill(static_cast<uint16_t*>(y) + b, static_cast<uint16_t*>(y) + e, bits);
  });
}

double SumSquares(const void* y, FloatType type, size_t n) {
  auto* fn = type == F::kF32 ? SumSquaresF32 : (type == F::kBF16 ? SumSquaresBf16 : SumSquaresF16);
  const size_t s = SizeOf(type);
  std::vector<double> partial((n + kReduceBlock - 1) / kReduceBlock);
  ParallelFor(n, kReduceBlock, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; i += kReduceBlock) {
      partial[i / kReduceBlock] = fn(Offset<char>(y, i * s), std::min(kReduceBlock, e - i));
    }
  });
  double sum = 0;
  for (double p : partial) sum += p;
  return sum;
}

bool AllFinite(const void* y, FloatType type, size_t n) {
  auto* fn = type == F::kF32 ? AllFiniteF32 : (type == F::kBF16 ? AllFiniteBf16 : AllFiniteF16);
  const size_t s = SizeOf(type);
  std::atomic<bool> finite{true};
  ParallelFor(n, kAlign, [&](size_t b, size_t e) {
    if (!fn(Offset<char>(y, b * s), e - b)) finite.store(false, std::memory_order_relaxed);
  });
  return finite.load(std::memory_order_relaxed);
}

void ParallelMemcpy(void* dst, const void* src, size_t bytes) {
  // Split in 4 KiB units: page-aligned boundaries for page-aligned buffers.
  ParallelFor(bytes, 4096, [&](size_t b, size_t e) {
    std::memcpy(Offset<char>(dst, b), Offset<char>(src, b), e - b);
  });
}

}  // namespace cai
