// A decoding step's attention on CPU: one query token a row over a key/value cache [b, used, hkv, d] of
// fp32, bf16 or fp16, read as it lies (a slice of the preallocated cache: any row, slot and head strides,
// the head dim contiguous) and computed in fp32, each row's cache read front to back.
// The queries are taken in fp32 and the output is fp32 [b, 1, hq, d]: the caller rounds it once to its dtype.
#include "common.h"

namespace megacann {
namespace {

template <typename T>
DecodeAttention<T> decode_kernel();
template <>
DecodeAttention<float> decode_kernel<float>() { return active_kernels().decode.f32; }
template <>
DecodeAttention<Bf16> decode_kernel<Bf16>() { return active_kernels().decode.bf16; }
template <>
DecodeAttention<F16> decode_kernel<F16>() { return active_kernels().decode.f16; }

at::Tensor head_dim_contiguous(const at::Tensor& x) { return x.stride(3) == 1 ? x : x.contiguous(); }

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const bool* mask, int64_t mask_sb,
         const float* sinks, at::Tensor& out, float scale) {
  const int64_t b = k.size(0), used = k.size(1), hkv = k.size(2), d = k.size(3), hq = q.size(2);
  at::Tensor scratch = at::empty({b, hq * used}, q.options());
  const float* qp = q.const_data_ptr<float>();
  const T* kp = reinterpret_cast<const T*>(k.const_data_ptr());
  const T* vp = reinterpret_cast<const T*>(v.const_data_ptr());
  float* op = out.mutable_data_ptr<float>();
  float* sp = scratch.mutable_data_ptr<float>();
  const auto kernel = decode_kernel<T>();
  parallel_rows(b, hq * used * d, [&](int64_t begin, int64_t end) {
    kernel(qp, kp, k.stride(0), k.stride(1), k.stride(2), vp, v.stride(0), v.stride(1), v.stride(2), mask, mask_sb,
           sinks, op, sp + begin * hq * used, hq, hkv, used, d, scale, begin, end);
  });
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const c10::optional<at::Tensor>& attn_mask, double scale,
                            const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 4 && q.size(1) == 1, "megacann::decode_attention: q must be [batch, 1, heads, head_dim], got ",
              q.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "megacann::decode_attention: k_cache and v_cache must be [batch, slots, kv_heads, head_dim] alike, got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  const int64_t b = q.size(0), hq = q.size(2), d = q.size(3), used = k_cache.size(1), hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(0) == b && k_cache.size(3) == d && used > 0 && hkv > 0 && hq % hkv == 0,
              "megacann::decode_attention: a cache of ", k_cache.sizes(), " does not serve queries of ", q.sizes());
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "megacann::decode_attention: k_cache dtype ",
              k_cache.scalar_type(), " differs from v_cache dtype ", v_cache.scalar_type());
  at::Tensor qf = q.to(at::kFloat).contiguous();
  at::Tensor k = head_dim_contiguous(k_cache), v = head_dim_contiguous(v_cache);
  const bool* mask = nullptr;
  int64_t mask_sb = 0;
  at::Tensor m;
  if (attn_mask.has_value()) {
    m = *attn_mask;
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 4 && (m.size(0) == b || m.size(0) == 1) && m.size(1) == 1 &&
                    m.size(2) == 1 && m.size(3) == used,
                "megacann::decode_attention: attn_mask must be bool [", b, " or 1, 1, 1, ", used, "], got ",
                m.scalar_type(), " ", m.sizes());
    if (m.stride(3) != 1) m = m.contiguous();
    mask = m.const_data_ptr<bool>();
    mask_sb = m.size(0) == 1 ? 0 : m.stride(0);
  }
  const float* sink = nullptr;
  at::Tensor s;
  if (sinks.has_value()) {
    s = sinks->to(at::kFloat).contiguous();
    TORCH_CHECK(s.dim() == 1 && s.size(0) == hq, "megacann::decode_attention: sinks must be [", hq, "], got ",
                s.sizes());
    sink = s.const_data_ptr<float>();
  }
  at::Tensor out = at::empty({b, 1, hq, d}, qf.options());
  const float sc = static_cast<float>(scale);
  switch (k.scalar_type()) {
    case at::kFloat:
      run<float>(qf, k, v, mask, mask_sb, sink, out, sc);
      break;
    case at::kBFloat16:
      run<Bf16>(qf, k, v, mask, mask_sb, sink, out, sc);
      break;
    case at::kHalf:
      run<F16>(qf, k, v, mask, mask_sb, sink, out, sc);
      break;
    default:
      TORCH_CHECK(false, "megacann::decode_attention: cache dtype ", k.scalar_type(),
                  " is not float32, bfloat16 or float16");
  }
  return out;
}

}  // namespace megacann
