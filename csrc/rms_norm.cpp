// RMSNorm over the last dim: y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps), one row per token.
// Forward saves rstd (fp32, one per row); backward recomputes x * rstd from x, so nothing of the input's
// size is kept besides x itself.
#include "common.h"

namespace megacann {
namespace {

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
    const auto& k = kernels_for<scalar_t>();
    const auto* xp = kptr(x2.const_data_ptr<scalar_t>());
    const auto* wp = kptr(w.const_data_ptr<scalar_t>());
    auto* yp = kptr(y.mutable_data_ptr<scalar_t>());
    auto* rp = rstd.mutable_data_ptr<acc_t<scalar_t>>();
    const int64_t xs = x2.stride(0);
    parallel_rows(rows, n, [&](int64_t begin, int64_t end) { k.rms_forward(xp, xs, wp, yp, rp, begin, end, n, eps); });
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
    // grad w: summed per thread into fp32 partials, then across threads
    const auto& k = kernels_for<scalar_t>();
    const auto* gp = kptr(g.const_data_ptr<scalar_t>());
    const auto* xp = kptr(x2.const_data_ptr<scalar_t>());
    const auto* wp = kptr(w.const_data_ptr<scalar_t>());
    const auto* rp = rs.const_data_ptr<acc_t<scalar_t>>();
    auto* gxp = kptr(gx.mutable_data_ptr<scalar_t>());
    auto* pp = partial.mutable_data_ptr<acc_t<scalar_t>>();
    const int64_t xs = x2.stride(0);
    parallel_rows(rows, n, [&](int64_t begin, int64_t end) {
      k.rms_backward(gp, xp, xs, wp, rp, gxp, pp + at::get_thread_num() * n, begin, end, n);
    });
  });
  return {gx, partial.sum(0).to(weight.scalar_type())};
}

}  // namespace megacann
