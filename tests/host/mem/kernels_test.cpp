// Every element-wise kernel against a scalar reference, for each dtype, at sizes below and
// above the multi-threading threshold and with a ragged tail.
#include "mem/kernels.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "mem/float16.h"
#include "mem/parallel.h"

namespace cai {
namespace {

constexpr FloatType kTypes[] = {FloatType::kF32, FloatType::kBF16, FloatType::kF16};
const size_t kSizes[] = {1, 13, 1000, 3 * kParallelMinElements + 17};

// A buffer of n random values in [-4, 4), stored as `type`, with its values read back as
// fp32 (exactly what the kernels see).
struct Buffer {
  FloatType type;
  std::vector<uint8_t> bytes;
  std::vector<float> values;

  Buffer(FloatType t, size_t n, uint32_t seed) : type(t), bytes(n * SizeOf(t)), values(n) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> dist(-4, 4);
    for (size_t i = 0; i < n; ++i) Set(i, dist(rng));
  }
  void* data() { return bytes.data(); }
  void Set(size_t i, float v) {
    if (type == FloatType::kF32) {
      reinterpret_cast<float*>(bytes.data())[i] = v;
    } else {
      reinterpret_cast<uint16_t*>(bytes.data())[i] =
          type == FloatType::kBF16 ? FloatToBf16(v) : FloatToHalf(v);
    }
    values[i] = Get(i);
  }
  float Get(size_t i) const {
    if (type == FloatType::kF32) return reinterpret_cast<const float*>(bytes.data())[i];
    const uint16_t h = reinterpret_cast<const uint16_t*>(bytes.data())[i];
    return type == FloatType::kBF16 ? Bf16ToFloat(h) : HalfToFloat(h);
  }
};

float RoundTo(FloatType t, float v) {
  if (t == FloatType::kF32) return v;
  return t == FloatType::kBF16 ? Bf16ToFloat(FloatToBf16(v)) : HalfToFloat(FloatToHalf(v));
}

TEST(Kernels, CastCopy_EveryTypePair_MatchesScalarRounding) {
  for (size_t n : kSizes) {
    for (FloatType from : kTypes) {
      for (FloatType to : kTypes) {
        Buffer x(from, n, 1), y(to, n, 2);
        CastCopy(x.data(), from, y.data(), to, n);
        for (size_t i = 0; i < n; ++i) {
          ASSERT_EQ(y.Get(i), RoundTo(to, x.values[i]))
              << FloatTypeName(from) << "->" << FloatTypeName(to) << " n=" << n << " i=" << i;
        }
      }
    }
  }
}

TEST(Kernels, Scale_EveryType_MatchesScalarReference) {
  for (size_t n : kSizes) {
    for (FloatType t : kTypes) {
      Buffer y(t, n, 3);
      const std::vector<float> before = y.values;
      Scale(y.data(), t, n, -0.37f);
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(y.Get(i), RoundTo(t, -0.37f * before[i])) << i;
    }
  }
}

TEST(Kernels, Axpy_LowPrecisionX_AccumulatesIntoFp32) {
  for (size_t n : kSizes) {
    for (FloatType t : kTypes) {
      Buffer x(t, n, 4), y(FloatType::kF32, n, 5);
      const std::vector<float> before = y.values;
      Axpy(1.5f, x.data(), t, reinterpret_cast<float*>(y.data()), n);
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(y.Get(i), before[i] + 1.5f * x.values[i]) << i;
    }
  }
}

TEST(Kernels, Fill_EveryType_WritesRoundedValue) {
  for (size_t n : kSizes) {
    for (FloatType t : kTypes) {
      Buffer y(t, n, 6);
      Fill(y.data(), t, n, 0.1f);
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(y.Get(i), RoundTo(t, 0.1f)) << i;
    }
  }
}

TEST(Kernels, SumSquares_AccumulatesInFp64) {
  for (size_t n : kSizes) {
    for (FloatType t : kTypes) {
      Buffer y(t, n, 7);
      long double want = 0;
      for (float v : y.values) want += static_cast<long double>(v) * v;
      const double got = SumSquares(y.data(), t, n);
      EXPECT_NEAR(got, static_cast<double>(want), 1e-13 * static_cast<double>(want)) << n;
    }
  }
  // In fp32 the small squares (2^-20) would vanish next to the large one (2^24, whose fp32
  // ulp is 2); in fp64 every partial sum here is exact.
  std::vector<float> y(100001, 0x1p-10f);
  y[0] = 4096.0f;
  EXPECT_EQ(SumSquares(y.data(), FloatType::kF32, y.size()), 0x1p24 + 100000 * 0x1p-20);
}

TEST(Kernels, SumSquares_IndependentOfThreadCount) {
  Buffer y(FloatType::kF32, 5 * kParallelMinElements + 3, 8);
  const double many = SumSquares(y.data(), FloatType::kF32, y.values.size());
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const double one = SumSquares(y.data(), FloatType::kF32, y.values.size());
  omp_set_num_threads(threads);
  EXPECT_EQ(many, one);
}

TEST(Kernels, AllFinite_DetectsInfAndNanAnywhere) {
  const float bad[] = {std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity(),
                       std::numeric_limits<float>::quiet_NaN()};
  for (size_t n : kSizes) {
    for (FloatType t : kTypes) {
      Buffer y(t, n, 9);
      EXPECT_TRUE(AllFinite(y.data(), t, n));
      for (float b : bad) {
        for (size_t at : {size_t{0}, n / 2, n - 1}) {
          const float keep = y.values[at];
          y.Set(at, b);
          EXPECT_FALSE(AllFinite(y.data(), t, n)) << FloatTypeName(t) << " n=" << n << " at=" << at;
          y.Set(at, keep);
        }
      }
    }
  }
  // Largest finite values are finite; fp32 values beyond fp16's range are not in fp16.
  const float big = std::numeric_limits<float>::max();
  EXPECT_TRUE(AllFinite(&big, FloatType::kF32, 1));
  const uint16_t half_max = 0x7bff, bf16_max = 0x7f7f;
  EXPECT_TRUE(AllFinite(&half_max, FloatType::kF16, 1));
  EXPECT_TRUE(AllFinite(&bf16_max, FloatType::kBF16, 1));
}

TEST(Kernels, ParallelMemcpy_CopiesEveryByte) {
  std::vector<uint8_t> src(1 << 22), dst(src.size());
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 31 + 7);
  ParallelMemcpy(dst.data(), src.data(), src.size() - 5);
  EXPECT_TRUE(std::equal(src.begin(), src.end() - 5, dst.begin()));
  EXPECT_EQ(dst[src.size() - 5], 0);
}

}  // namespace
}  // namespace cai
