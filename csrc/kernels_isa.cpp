// The loops of megacann's CPU kernels, compiled once per instruction set: in the main build for the
// portable baseline, and again with -DMEGACANN_ISA=avx2 -march=x86-64-v3 / -DMEGACANN_ISA=avx512
// -march=x86-64-v4 (megacann/ops/extension.py) into objects linked beside it. Everything here lives in a
// namespace named after the variant and uses compiler builtins only (see kernels.h: no shared inline code).
//
// Plain C++ written so that GCC/Clang vectorise it (-O3, `#pragma omp simd` for the reductions,
// -fopenmp-simd); bf16 is widened to fp32 and every kernel accumulates in fp32 (fp64 for fp64 inputs).
#include "kernels.h"

#ifndef MEGACANN_ISA
#define MEGACANN_ISA baseline
#endif
#define MEGACANN_CAT2(a, b) a##b
#define MEGACANN_CAT(a, b) MEGACANN_CAT2(a, b)

namespace megacann {
namespace MEGACANN_CAT(isa_, MEGACANN_ISA) {
namespace {

template <typename T>
using acc_t = typename Acc<T>::type;

inline float load(const float* p, int64_t i) { return p[i]; }
inline double load(const double* p, int64_t i) { return p[i]; }
inline float load(const Bf16* p, int64_t i) {
  // bf16 is the top half of an fp32: shift into place (branch-free, vectorises)
  return __builtin_bit_cast(float, static_cast<uint32_t>(p[i].x) << 16);
}

inline float load(const F16* p, int64_t i) {
  // the exponent and mantissa moved into fp32's places, scaled by 2^(127 - 15): exact for normal and
  // subnormal halves; infinities and NaNs get fp32's all-ones exponent; then the sign (branch-free)
  const uint32_t h = p[i].x, magnitude = h & 0x7FFFu;
  uint32_t bits = __builtin_bit_cast(uint32_t, __builtin_bit_cast(float, magnitude << 13) * 0x1p112f);
  bits = magnitude >= 0x7C00u ? (bits | 0x7F800000u) : bits;
  return __builtin_bit_cast(float, bits | ((h & 0x8000u) << 16));
}

inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(double* p, int64_t i, double v) { p[i] = v; }
inline void store(Bf16* p, int64_t i, float v) {
  // round to nearest even, NaN kept quiet; written with selects so the loop stays vectorised
  uint32_t bits = __builtin_bit_cast(uint32_t, v);
  uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  p[i].x = (v != v) ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(rounded);
}

template <typename A>
inline A max_of(A a, A b) {
  return a < b ? b : a;
}

// a * b + c: one fused multiply-add where the ISA has it (more exact, not less), else two operations
inline float mul_add(float a, float b, float c) {
#ifdef __FMA__
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

// floor(t) for |t| < 2^31. A vectorised floor needs SSE4.1's roundps; x86-64's baseline (SSE2) has none,
// and a libm call would keep the loop scalar, so there it goes through an int conversion (cvttps2dq).
inline float floor_small(float t) {
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(__SSE4_1__)
  float k = static_cast<float>(static_cast<int32_t>(t));  // t rounded toward zero
  return k > t ? k - 1.0f : k;
#else
  return __builtin_floorf(t);
#endif
}

// e^x for fp32 that vectorises (libm's expf does not without -ffast-math): x = n ln2 + r with
// |r| <= ln2/2, e^r from a degree-6 polynomial (the Cephes coefficients), 2^n put in the exponent bits.
// Relative error about 1e-7; underflow gives 0, overflow inf, NaN stays NaN.
inline float exp_fast(float x) {
  float c = x < -87.3f ? -87.3f : (x > 88.37f ? 88.37f : x);
  float n = floor_small(c * 1.44269504088896341f + 0.5f);  // |.| <= 128: equal to floor
  float r = c - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = mul_add(p, r, 1.3981999507e-3f);
  p = mul_add(p, r, 8.3334519073e-3f);
  p = mul_add(p, r, 4.1665795894e-2f);
  p = mul_add(p, r, 1.6666665459e-1f);
  p = mul_add(p, r, 5.0000001201e-1f);
  float y = mul_add(p, r * r, r) + 1.0f;
  float out = y * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
  out = (x < -87.3f) ? 0.0f : out;
  out = (x > 88.72f) ? __builtin_inff() : out;
  return (x != x) ? x : out;
}
inline double exp_fast(double x) { return __builtin_exp(x); }
inline float log_of(float x) { return __builtin_logf(x); }
inline double log_of(double x) { return __builtin_log(x); }
inline float sqrt_of(float x) { return __builtin_sqrtf(x); }
inline double sqrt_of(double x) { return __builtin_sqrt(x); }

template <typename A>
inline A sigmoid(A v) {
  return A(1) / (A(1) + exp_fast(-v));
}

template <typename T>
void swiglu_forward(const T* gate, int64_t gate_stride, const T* up, int64_t up_stride, T* y, int64_t begin,
                    int64_t end, int64_t f) {
  using A = acc_t<T>;
  for (int64_t r = begin; r < end; ++r) {
    const T* g = gate + r * gate_stride;
    const T* u = up + r * up_stride;
    T* yr = y + r * f;
#pragma omp simd
    for (int64_t i = 0; i < f; ++i) {
      A gv = load(g, i);
      store(yr, i, gv * sigmoid(gv) * A(load(u, i)));
    }
  }
}

// d gate = grad * up * sig * (1 + gate * (1 - sig)),  d up = grad * gate * sig
template <typename T>
void swiglu_backward(const T* grad, const T* gate, int64_t gate_stride, const T* up, int64_t up_stride, T* dgate,
                     int64_t dgate_stride, T* dup, int64_t dup_stride, int64_t begin, int64_t end, int64_t f) {
  using A = acc_t<T>;
  for (int64_t r = begin; r < end; ++r) {
    const T* gr = grad + r * f;
    const T* g = gate + r * gate_stride;
    const T* u = up + r * up_stride;
    T* dg = dgate + r * dgate_stride;
    T* du = dup + r * dup_stride;
#pragma omp simd
    for (int64_t i = 0; i < f; ++i) {
      A go = load(gr, i), gv = load(g, i), uv = load(u, i);
      A sig = sigmoid(gv);
      store(dg, i, go * uv * sig * (A(1) + gv * (A(1) - sig)));
      store(du, i, go * gv * sig);
    }
  }
}

template <typename T>
void ce_stats(const T* logits, int64_t stride, const int64_t* target, int64_t begin, int64_t end, int64_t start,
              int64_t valid, int64_t ignore_index, acc_t<T>* lse, acc_t<T>* target_logit) {
  using A = acc_t<T>;
  for (int64_t r = begin; r < end; ++r) {
    const T* x = logits + r * stride;
    A m = -__builtin_inff();
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < valid; ++i) m = max_of(m, A(load(x, i)));
    A sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < valid; ++i) sum += exp_fast(A(load(x, i)) - m);
    lse[r] = valid > 0 ? m + log_of(sum) : A(-__builtin_inff());
    const int64_t t = target[r] - start;
    const bool hit = target[r] != ignore_index && t >= 0 && t < valid;
    target_logit[r] = hit ? A(load(x, t)) : A(0);
  }
}

// out may be x itself (the in-place form): each element is read before it is written, and the target's
// logit is read before the row is overwritten, so the target column is still rounded only once.
template <typename T>
void ce_grad(const T* x_base, int64_t x_stride, T* out_base, int64_t out_stride, const int64_t* target,
             const acc_t<T>* lse, const acc_t<T>* grad_loss, int64_t begin, int64_t end, int64_t cols, int64_t start,
             int64_t valid, int64_t ignore_index) {
  using A = acc_t<T>;
  for (int64_t r = begin; r < end; ++r) {
    const T* x = x_base + r * x_stride;
    T* out = out_base + r * out_stride;
    const A g = target[r] == ignore_index ? A(0) : grad_loss[r];
    const A shift = lse[r];
    const int64_t t = target[r] - start;
    const bool hit = g != A(0) && t >= 0 && t < valid;
    const A target_logit = hit ? A(load(x, t)) : A(0);
    if (g == A(0)) {
#pragma omp simd
      for (int64_t i = 0; i < cols; ++i) store(out, i, A(0));
      continue;
    }
#pragma omp simd
    for (int64_t i = 0; i < valid; ++i) store(out, i, exp_fast(A(load(x, i)) - shift) * g);
#pragma omp simd
    for (int64_t i = valid; i < cols; ++i) store(out, i, A(0));
    if (hit) store(out, t, exp_fast(target_logit - shift) * g - g);
  }
}

template <typename T>
void rms_forward(const T* x, int64_t x_stride, const T* w, T* y, acc_t<T>* rstd, int64_t begin, int64_t end,
                 int64_t n, double eps) {
  using A = acc_t<T>;
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = x + r * x_stride;
    T* yr = y + r * n;
    A sum_sq = 0;
#pragma omp simd reduction(+ : sum_sq)
    for (int64_t i = 0; i < n; ++i) {
      A v = load(xr, i);
      sum_sq += v * v;
    }
    A rs = A(1) / sqrt_of(sum_sq / A(n) + A(eps));
    rstd[r] = rs;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) store(yr, i, load(xr, i) * rs * load(w, i));
  }
}

// grad_x = rstd * (g*w - xhat * mean(g*w*xhat)), xhat = x * rstd; gw += g * xhat (the caller's partial sums)
template <typename T>
void rms_backward(const T* g, const T* x, int64_t x_stride, const T* w, const acc_t<T>* rstd, T* gx, acc_t<T>* gw,
                  int64_t begin, int64_t end, int64_t n) {
  using A = acc_t<T>;
  for (int64_t r = begin; r < end; ++r) {
    const T* gr = g + r * n;
    const T* xr = x + r * x_stride;
    T* gxr = gx + r * n;
    A rs = rstd[r];
    A dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < n; ++i) dot += A(load(gr, i)) * load(w, i) * (load(xr, i) * rs);
    A mean_dot = dot / A(n);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      A xhat = load(xr, i) * rs;
      store(gxr, i, rs * (A(load(gr, i)) * load(w, i) - xhat * mean_dot));
    }
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) gw[i] += A(load(gr, i)) * (load(xr, i) * rs);
  }
}

// half mode (rotate_half): dims i and i + d/2 are a pair; interleaved (GPT-J): dims 2i and 2i+1.
// inverse flips the sign of sin (the backward).
template <typename T>
void rotary(const T* x, int64_t sb, int64_t ss, int64_t sh, const acc_t<T>* cos, const acc_t<T>* sin,
            bool cos_per_batch, T* y, int64_t s, int64_t heads, int64_t d, bool interleaved, bool inverse,
            int64_t begin, int64_t end) {
  using A = acc_t<T>;
  const int64_t half = d / 2;
  const A sign = inverse ? A(-1) : A(1);
  for (int64_t row = begin; row < end; ++row) {
    const int64_t bi = row / s, si = row % s;
    const int64_t table = ((cos_per_batch ? bi : 0) * s + si) * d;
    const A* c = cos + table;
    const A* sn = sin + table;
    for (int64_t h = 0; h < heads; ++h) {
      const T* xr = x + bi * sb + si * ss + h * sh;
      T* yr = y + (row * heads + h) * d;
      if (interleaved) {
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          A x1 = load(xr, 2 * i), x2 = load(xr, 2 * i + 1);
          A ci = c[2 * i], si_ = sign * sn[2 * i];
          store(yr, 2 * i, x1 * ci - x2 * si_);
          store(yr, 2 * i + 1, x2 * ci + x1 * si_);
        }
      } else {
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          A x1 = load(xr, i), x2 = load(xr, i + half);
          A ci = c[i], si_ = sign * sn[i];
          store(yr, i, x1 * ci - x2 * si_);
          store(yr, i + half, x2 * ci + x1 * si_);
        }
      }
    }
  }
}

// One query token a row over the cache (kernels.h, DecodeAttention): for each row, the scores of every
// query head against every readable slot, the slot's keys read in order (all kv heads of a slot lie
// together, so the row's cache is read front to back, and each kv head's key once for its g query heads),
// the softmax in fp32 with the sink as an extra column, then the values weighted the same way.
// A query with no readable slot gets zeros, as PyTorch's CPU attention gives (no slot is weighted).
template <typename T>
void decode_attention(const float* q, const T* k, int64_t k_sb, int64_t k_st, int64_t k_sh, const T* v, int64_t v_sb,
                      int64_t v_st, int64_t v_sh, const bool* mask, int64_t mask_sb, const float* sinks, float* out,
                      float* scratch, int64_t hq, int64_t hkv, int64_t used, int64_t d, float scale, int64_t begin,
                      int64_t end) {
  const int64_t g = hq / hkv;
  const float minus_inf = -__builtin_inff();
  for (int64_t row = begin; row < end; ++row) {
    const float* qr = q + row * hq * d;
    float* orow = out + row * hq * d;
    const bool* m = mask ? mask + row * mask_sb : nullptr;
    float* scores = scratch + (row - begin) * hq * used;  // [hq, used]
    for (int64_t t = 0; t < used; ++t) {
      if (m && !m[t]) {
        for (int64_t h = 0; h < hq; ++h) scores[h * used + t] = minus_inf;
        continue;
      }
      const T* kt = k + row * k_sb + t * k_st;
      for (int64_t h = 0; h < hq; ++h) {
        const T* kh = kt + (h / g) * k_sh;
        const float* qh = qr + h * d;
        float dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int64_t c = 0; c < d; ++c) dot += qh[c] * load(kh, c);
        scores[h * used + t] = dot * scale;
      }
    }
    for (int64_t h = 0; h < hq; ++h) {
      float* sh = scores + h * used;
      float top = sinks ? sinks[h] : minus_inf;
#pragma omp simd reduction(max : top)
      for (int64_t t = 0; t < used; ++t) top = max_of(top, sh[t]);
      float sum = sinks ? exp_fast(sinks[h] - top) : 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < used; ++t) {
        const float p = exp_fast(sh[t] - top);  // a left-out slot: e^-inf = 0
        sh[t] = p;
        sum += p;
      }
      const float inv = 1.0f / sum;
#pragma omp simd
      for (int64_t t = 0; t < used; ++t) sh[t] *= inv;
    }
#pragma omp simd
    for (int64_t c = 0; c < hq * d; ++c) orow[c] = 0.0f;
    for (int64_t t = 0; t < used; ++t) {
      if (m && !m[t]) continue;
      const T* vt = v + row * v_sb + t * v_st;
      for (int64_t h = 0; h < hq; ++h) {
        const T* vh = vt + (h / g) * v_sh;
        const float p = scores[h * used + t];
        float* oh = orow + h * d;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) oh[c] += p * load(vh, c);
      }
    }
  }
}

template <typename T>
constexpr KernelSet<T> kernel_set() {
  return {swiglu_forward<T>, swiglu_backward<T>, ce_stats<T>, ce_grad<T>, rms_forward<T>, rms_backward<T>, rotary<T>};
}

}  // namespace
}  // namespace MEGACANN_CAT(isa_, MEGACANN_ISA)

extern const KernelTable MEGACANN_CAT(kernels_, MEGACANN_ISA);
const KernelTable MEGACANN_CAT(kernels_, MEGACANN_ISA) = {
#define MEGACANN_STR2(a) #a
#define MEGACANN_STR(a) MEGACANN_STR2(a)
    MEGACANN_STR(MEGACANN_ISA),
    MEGACANN_CAT(isa_, MEGACANN_ISA)::kernel_set<float>(),
    MEGACANN_CAT(isa_, MEGACANN_ISA)::kernel_set<Bf16>(),
    MEGACANN_CAT(isa_, MEGACANN_ISA)::kernel_set<double>(),
    {MEGACANN_CAT(isa_, MEGACANN_ISA)::decode_attention<float>, MEGACANN_CAT(isa_, MEGACANN_ISA)::decode_attention<Bf16>,
     MEGACANN_CAT(isa_, MEGACANN_ISA)::decode_attention<F16>},
};

}  // namespace megacann
