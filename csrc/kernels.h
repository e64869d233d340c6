// The table of megacann's CPU kernels compiled once per instruction set (csrc/kernels_isa.cpp): the
// portable baseline always, and on x86-64 also an AVX2 + FMA (x86-64-v3) and an AVX-512 (x86-64-v4)
// build of the same loops, each fully auto-vectorised for its ISA. isa.cpp picks one at run time.
//
// Each kernel processes rows [begin, end) of its problem; the parallel loop over rows stays in the
// torch-facing files. This header and the kernel files include no torch (nor any library with inline
// functions): the same code compiled with different -march flags must not share an inline function,
// which the linker would merge into one copy that may need instructions the CPU lacks.
#pragma once

#include <cstdint>

namespace megacann {

struct Bf16 {  // the bits of a bfloat16 (layout of c10::BFloat16)
  uint16_t x;
};
struct F16 {  // the bits of an IEEE float16 (layout of c10::Half)
  uint16_t x;
};

template <typename T>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};

template <typename T>
struct KernelSet {
  using A = typename Acc<T>::type;
  // SwiGLU y = silu(gate) * up over rows of f features, and its gradients
  void (*swiglu_forward)(const T* gate, int64_t gate_stride, const T* up, int64_t up_stride, T* y, int64_t begin,
                         int64_t end, int64_t f);
  void (*swiglu_backward)(const T* grad, const T* gate, int64_t gate_stride, const T* up, int64_t up_stride,
                          T* dgate, int64_t dgate_stride, T* dup, int64_t dup_stride, int64_t begin, int64_t end,
                          int64_t f);
  // cross entropy over a vocabulary shard: log-sum-exp and the target's logit per row; the gradient
  void (*ce_stats)(const T* logits, int64_t stride, const int64_t* target, int64_t begin, int64_t end, int64_t start,
                   int64_t valid, int64_t ignore_index, A* lse, A* target_logit);
  void (*ce_grad)(const T* x, int64_t x_stride, T* out, int64_t out_stride, const int64_t* target, const A* lse,
                  const A* grad_loss, int64_t begin, int64_t end, int64_t cols, int64_t start, int64_t valid,
                  int64_t ignore_index);
  // RMSNorm forward (y and rstd) and backward (grad x, and grad w summed into gw)
  void (*rms_forward)(const T* x, int64_t x_stride, const T* w, T* y, A* rstd, int64_t begin, int64_t end, int64_t n,
                      double eps);
  void (*rms_backward)(const T* g, const T* x, int64_t x_stride, const T* w, const A* rstd, T* gx, A* gw,
                       int64_t begin, int64_t end, int64_t n);
  // rotary embedding of rows (batch * seq) of x [b, s, heads, d]
  void (*rotary)(const T* x, int64_t sb, int64_t ss, int64_t sh, const A* cos, const A* sin, bool cos_per_batch,
                 T* y, int64_t s, int64_t heads, int64_t d, bool interleaved, bool inverse, int64_t begin,
                 int64_t end);
};

// A decoding step's attention: one query token a row over a key/value cache of type T, computed in fp32.
// Rows [begin, end) of the batch: query head h (q and out [b, hq, d] fp32, contiguous) reads kv head
// h / (hq / hkv), keys at k + row * k_sb + t * k_st + head * k_sh (values likewise, head dim contiguous), for
// slots t < used where mask[row * mask_sb + t] (mask null: all), with an optional sink logit per query head
// (sinks null: none). scratch: hq * used floats per row.
template <typename T>
using DecodeAttention = void (*)(const float* q, const T* k, int64_t k_sb, int64_t k_st, int64_t k_sh, const T* v,
                                 int64_t v_sb, int64_t v_st, int64_t v_sh, const bool* mask, int64_t mask_sb,
                                 const float* sinks, float* out, float* scratch, int64_t hq, int64_t hkv,
                                 int64_t used, int64_t d, float scale, int64_t begin, int64_t end);

struct DecodeKernels {
  DecodeAttention<float> f32;
  DecodeAttention<Bf16> bf16;
  DecodeAttention<F16> f16;
};

struct KernelTable {
  const char* name;
  KernelSet<float> f32;
  KernelSet<Bf16> bf16;
  KernelSet<double> f64;
  DecodeKernels decode;
};

// One table per compiled variant; MEGACANN_HAVE_ISA_<NAME> says which the build linked in.
extern const KernelTable kernels_baseline;
extern const KernelTable kernels_avx2;
extern const KernelTable kernels_avx512;

// The table in use (isa.cpp): the baseline until Python selects another.
const KernelTable& active_kernels();

}  // namespace megacann
