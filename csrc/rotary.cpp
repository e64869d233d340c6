// Rotary position embedding of x [b, s, heads, d] by tables cos/sin [b or 1, s, d] (fp32; fp64 for fp64 x).
// half mode (rotate_half, Hugging Face LLaMA): dims i and i + d/2 are a pair, angle from column i.
// interleaved mode (GPT-J): dims 2i and 2i+1 are a pair, angle from column 2i.
// The backward is the same rotation by the opposite angle (inverse = true flips the sign of sin).
#include "common.h"

namespace megacann {
namespace {

template <typename T>
void rotary_kernel(const T* x, int64_t sb, int64_t ss, int64_t sh, const acc_t<T>* cos, const acc_t<T>* sin,
                   bool cos_per_batch, T* y, int64_t b, int64_t s, int64_t heads, int64_t d, bool interleaved,
                   bool inverse) {
  using A = acc_t<T>;
  const int64_t half = d / 2;
  const A sign = inverse ? A(-1) : A(1);
  parallel_rows(b * s, heads * d, [&](int64_t begin, int64_t end) {
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
  });
}

}  // namespace

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
    rotary_kernel<scalar_t>(xs.const_data_ptr<scalar_t>(), xs.stride(0), xs.stride(1), xs.stride(2),
                            c.const_data_ptr<acc_t<scalar_t>>(), sn.const_data_ptr<acc_t<scalar_t>>(),
                            c.size(0) == b && b > 1, y.mutable_data_ptr<scalar_t>(), b, s, heads, d, interleaved,
                            inverse);
  });
  return y;
}

}  // namespace megacann
