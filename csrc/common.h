// Shared helpers of megacann's CPU kernels: element loads/stores that widen bf16 to fp32 (so every
// kernel accumulates in fp32, or in fp64 for double inputs), an exp the compiler can vectorise, and the
// row-parallel loop.
//
// The loops are plain C++ written so that GCC/Clang vectorise them (-O3, `#pragma omp simd` for the
// reductions, compiled with -fopenmp-simd); no intrinsics, so one source serves SSE, AVX2, AVX-512 and NEON.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace megacann {

// The type a kernel computes in: fp32 for fp32/bf16 inputs, fp64 for fp64 (used by gradcheck).
template <typename T>
struct AccType {
  using type = float;
};
template <>
struct AccType<double> {
  using type = double;
};
template <typename T>
using acc_t = typename AccType<T>::type;

// std::bit_cast before C++20 (memcpy-based punning keeps GCC from vectorising `omp simd` loops)
template <typename To, typename From>
inline To bit_cast(From v) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast needs equal sizes");
  return __builtin_bit_cast(To, v);
}

inline float load(const float* p, int64_t i) { return p[i]; }
inline double load(const double* p, int64_t i) { return p[i]; }
inline float load(const c10::BFloat16* p, int64_t i) {
  // bf16 is the top half of an fp32: shift into place (branch-free, vectorises)
  return bit_cast<float>(static_cast<uint32_t>(p[i].x) << 16);
}

inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(double* p, int64_t i, double v) { p[i] = v; }
inline void store(c10::BFloat16* p, int64_t i, float v) {
  // round to nearest even, NaN kept quiet; written with selects so the loop stays vectorised
  uint32_t bits = bit_cast<uint32_t>(v);
  uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  p[i].x = (v != v) ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(rounded);
}

// floor(t) for |t| < 2^31. std::floor vectorises only with SSE4.1's roundps (or on other architectures);
// x86-64's portable baseline (SSE2, no -march) has none, and the libm call would keep the whole loop
// scalar, so there floor goes through an int conversion (cvttps2dq, SSE2). Both give the same value.
inline float floor_small(float t) {
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(__SSE4_1__)
  float k = static_cast<float>(static_cast<int32_t>(t));  // t rounded toward zero
  return k > t ? k - 1.0f : k;
#else
  return std::floor(t);
#endif
}

// e^x for fp32 that vectorises (std::exp is a libm call the compiler will not vectorise without
// -ffast-math): x = n ln2 + r with |r| <= ln2/2, e^r from a degree-6 polynomial (the classic Cephes
// coefficients), 2^n put in the exponent bits. Relative error about 1e-7; underflow gives 0, overflow inf, NaN stays NaN.
inline float exp_fast(float x) {
  float c = std::min(std::max(x, -87.3f), 88.37f);
  float n = floor_small(c * 1.44269504088896341f + 0.5f);  // |.| <= 128: equal to std::floor
  float r = c - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float y = p * r * r + r + 1.0f;
  float out = y * bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  out = (x < -87.3f) ? 0.0f : out;
  out = (x > 88.72f) ? INFINITY : out;
  return (x != x) ? x : out;
}
inline double exp_fast(double x) { return std::exp(x); }

// Rows per task so that each task touches at least ~16K elements (smaller tasks cost more than they save).
inline int64_t row_grain(int64_t row_len) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_len)); }

// Run f(first_row, end_row) over [0, rows) on ATen's intra-op thread pool (torch.set_num_threads applies).
template <typename F>
inline void parallel_rows(int64_t rows, int64_t row_len, const F& f) {
  at::parallel_for(0, rows, row_grain(row_len), f);
}

}  // namespace megacann

// fp32, bf16 and fp64 (fp64 for gradcheck); other dtypes take the reference path in Python.
#define MEGACANN_DISPATCH_FLOATS(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, TYPE, NAME, __VA_ARGS__)
