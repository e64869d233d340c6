// RMSNorm over the last dim: y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps), one row per token.
// Forward saves rstd (fp32, one per row); backward recomputes x * rstd from x, so nothing of the input's
// size is kept besides x itself.
#include "common.h"

namespace megacann {
namespace {

template <typename T>
void rms_norm_forward_kernel(const T* x, int64_t x_stride, const T* w, T* y, acc_t<T>* rstd, int64_t rows,
                             int64_t n, double eps) {
  using A = acc_t<T>;
  parallel_rows(rows, n, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      T* yr = y + r * n;
      A sum_sq = 0;
#pragma omp simd reduction(+ : sum_sq)
      for (int64_t i = 0; i < n; ++i) {
        A v = load(xr, i);
        sum_sq += v * v;
      }
      A rs = A(1) / std::sqrt(sum_sq / A(n) + A(eps));
      rstd[r] = rs;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) store(yr, i, load(xr, i) * rs * load(w, i));
    }
  });
}

// grad_x = rstd * (g*w - xhat * mean(g*w*xhat)), xhat = x * rstd; grad_w = sum over rows of g * xhat,
// summed per thread into fp32 partials and then across threads.
template <typename T>
void rms_norm_backward_kernel(const T* g, const T* x, int64_t x_stride, const T* w, const acc_t<T>* rstd, T* gx,
                              acc_t<T>* gw_partial, int64_t rows, int64_t n) {
  using A = acc_t<T>;
  parallel_rows(rows, n, [&](int64_t begin, int64_t end) {
    A* gw = gw_partial + at::get_thread_num() * n;
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
  });
}

at::Tensor rows_of(const at::Tensor& x) {
  at::Tensor rows = x.reshape({-1, x.size(-1)});  // a view when the layout allows it
  return rows.stride(1) == 1 ? rows : rows.contiguous();
}

void check_weight(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "megacann::rms_norm: weight of shape ",
              weight.sizes(), " does not match the last dim of x ", x.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "megacann::rms_norm: weight dtype ", weight.scalar_type(),
              " differs from x dtype ", x.scalar_type());
}

at::ScalarType acc_type_of(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_weight(x, weight);
  at::Tensor x2 = rows_of(x);
  at::Tensor w = weight.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(acc_type_of(x)));
  int64_t rows = x2.size(0), n = x2.size(1);
  MEGACANN_DISPATCH_FLOATS(x.scalar_type(), "megacann::rms_norm_forward", [&] {
    rms_norm_forward_kernel<scalar_t>(x2.const_data_ptr<scalar_t>(), x2.stride(0), w.const_data_ptr<scalar_t>(),
                                      y.mutable_data_ptr<scalar_t>(), rstd.mutable_data_ptr<acc_t<scalar_t>>(), rows,
                                      n, eps);
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad, const at::Tensor& x,
                                                     const at::Tensor& weight, const at::Tensor& rstd) {
  check_weight(x, weight);
  at::Tensor g = grad.to(x.scalar_type()).contiguous().view({-1, x.size(-1)});
  at::Tensor x2 = rows_of(x);
  at::Tensor w = weight.contiguous();
  at::Tensor rs = rstd.contiguous();
  int64_t rows = x2.size(0), n = x2.size(1);
  at::Tensor gx = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor partial = at::zeros({at::get_num_threads(), n}, x.options().dtype(acc_type_of(x)));
  MEGACANN_DISPATCH_FLOATS(x.scalar_type(), "megacann::rms_norm_backward", [&] {
    rms_norm_backward_kernel<scalar_t>(g.const_data_ptr<scalar_t>(), x2.const_data_ptr<scalar_t>(), x2.stride(0),
                                       w.const_data_ptr<scalar_t>(), rs.const_data_ptr<acc_t<scalar_t>>(),
                                       gx.mutable_data_ptr<scalar_t>(),
                                       partial.mutable_data_ptr<acc_t<scalar_t>>(), rows, n);
  });
  return {gx, partial.sum(0).to(weight.scalar_type())};
}

}  // namespace megacann
