// Rotary position embedding of x [b, s, heads, d] by tables cos/sin [b or 1, s, d] (fp32; fp64 for fp64 x).
// half mode (rotate_half, Hugging Face LLaMA): dims i and i + d/2 are a pair, angle from column i.
// interleaved mode (GPT-J): dims 2i and 2i+1 are a pair, angle from column 2i.
// The backward is the same rotation by the opposite angle (inverse = true flips the sign of sin).
#include "common.h"

namespace megacann {
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved, bool inverse) {
  TORCH_CHECK(x.dim() == 4, "megacann::rotary: x must be [batch, seq, heads, head_dim], got ", x.sizes());
  const int64_t b = x.size(0), s = x.size(1), heads = x.size(2), d = x.size(3);
  TORCH_CHECK(d % 2 == 0, "megacann::rotary: head_dim must be even, got ", d);
  TORCH_CHECK(cos.dim() == 3 && cos.size(1) == s && cos.size(2) == d && (cos.size(0) == 1 || cos.size(0) == b) &&
                  sin.sizes() == cos.sizes(),
              "megacann::rotary: cos/sin must be [1 or ", b, ", ", s, ", ", d, "], got ", cos.sizes(), " and ",
              sin.sizes());
  at::Tensor xs = x.stride(3) == 1 ? x : x.contiguous();
  const at::ScalarType table_type = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor c = cos.to(table_type).contiguous();
  at::Tensor sn = sin.to(table_type).contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  MEGACANN_DISPATCH_FLOATS(x.scalar_type(), "megacann::rotary", [&] {
    const auto& k = kernels_for<scalar_t>();
    const auto* xp = kptr(xs.const_data_ptr<scalar_t>());
    const auto* cp = c.const_data_ptr<acc_t<scalar_t>>();
    const auto* sp = sn.const_data_ptr<acc_t<scalar_t>>();
    auto* yp = kptr(y.mutable_data_ptr<scalar_t>());
    const int64_t sb = xs.stride(0), ss = xs.stride(1), sh = xs.stride(2);
    const bool per_batch = c.size(0) == b && b > 1;
    parallel_rows(b * s, heads * d, [&](int64_t begin, int64_t end) {
      k.rotary(xp, sb, ss, sh, cp, sp, per_batch, yp, s, heads, d, interleaved, inverse, begin, end);
    });
  });
  return y;
}

}  // namespace megacann
