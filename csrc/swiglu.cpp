// SwiGLU: y = silu(gate) * up = gate * sigmoid(gate) * up, over rows of `f` features. gate and up may be the
// two halves of one fused [rows, 2f] projection (strided views, no copy), and the backward then writes both
// gradients into one [rows, 2f] tensor, or over the projection itself (swiglu_fused_backward_) when the
// caller no longer needs it: each element's gradients depend on that element's gate, up and output
// gradient only, so overwriting in place is exact and saves a buffer as large as the projection.
#include <ATen/MemoryOverlap.h>

#include "common.h"

namespace megacann {
namespace {

// [rows, f] view of t's last dim (t may be a strided half of a fused tensor)
at::Tensor as_rows(const at::Tensor& t) {
  at::Tensor rows = t.reshape({-1, t.size(-1)});
  return rows.stride(1) == 1 ? rows : rows.contiguous();
}

void check_pair(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type(),
              "megacann::swiglu: gate ", gate.sizes(), " ", gate.scalar_type(), " and up ", up.sizes(), " ",
              up.scalar_type(), " must match");
}

at::Tensor forward_impl(const at::Tensor& gate, const at::Tensor& up, at::IntArrayRef out_shape) {
  at::Tensor g = as_rows(gate), u = as_rows(up);
  at::Tensor y = at::empty(out_shape, gate.options().memory_format(at::MemoryFormat::Contiguous));
  MEGACANN_DISPATCH_FLOATS(gate.scalar_type(), "megacann::swiglu", [&] {
    const auto& k = kernels_for<scalar_t>();
    const auto* gp = kptr(g.const_data_ptr<scalar_t>());
    const auto* up = kptr(u.const_data_ptr<scalar_t>());
    auto* yp = kptr(y.mutable_data_ptr<scalar_t>());
    const int64_t f = g.size(1), gs = g.stride(0), us = u.stride(0);
    parallel_rows(g.size(0), f, [&](int64_t begin, int64_t end) { k.swiglu_forward(gp, gs, up, us, yp, begin, end, f); });
  });
  return y;
}

void backward_impl(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up, at::Tensor& dgate,
                   at::Tensor& dup) {
  at::Tensor g = as_rows(gate), u = as_rows(up);
  at::Tensor go = grad.to(gate.scalar_type()).contiguous();
  MEGACANN_DISPATCH_FLOATS(gate.scalar_type(), "megacann::swiglu_backward", [&] {
    const auto& k = kernels_for<scalar_t>();
    const auto* grad_p = kptr(go.const_data_ptr<scalar_t>());
    const auto* gp = kptr(g.const_data_ptr<scalar_t>());
    const auto* up = kptr(u.const_data_ptr<scalar_t>());
    auto* dgp = kptr(dgate.mutable_data_ptr<scalar_t>());
    auto* dup_p = kptr(dup.mutable_data_ptr<scalar_t>());
    const int64_t f = g.size(1), gs = g.stride(0), us = u.stride(0), dgs = dgate.stride(0), dus = dup.stride(0);
    parallel_rows(g.size(0), f, [&](int64_t begin, int64_t end) {
      k.swiglu_backward(grad_p, gp, gs, up, us, dgp, dgs, dup_p, dus, begin, end, f);
    });
  });
}

std::vector<int64_t> halved(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "megacann::swiglu: the fused gate|up last dim must be even, got ",
              x.sizes());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() /= 2;
  return shape;
}

}  // namespace

// x = cat(gate, up) along the last dim
at::Tensor swiglu_fused(const at::Tensor& x) {
  std::vector<int64_t> shape = halved(x);
  auto halves = x.chunk(2, -1);
  return forward_impl(halves[0], halves[1], shape);
}

at::Tensor swiglu_fused_backward(const at::Tensor& grad, const at::Tensor& x) {
  halved(x);
  auto halves = x.chunk(2, -1);
  const int64_t f = x.size(-1) / 2;
  at::Tensor dx = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor dx2 = dx.view({-1, 2 * f});
  at::Tensor dgate = dx2.narrow(1, 0, f), dup = dx2.narrow(1, f, f);
  backward_impl(grad, halves[0], halves[1], dgate, dup);
  return dx;
}

void swiglu_fused_backward_(const at::Tensor& grad, at::Tensor& x) {
  halved(x);
  TORCH_CHECK(x.is_contiguous(), "megacann::swiglu_fused_backward_: the gate|up tensor it overwrites must be "
              "contiguous, got strides ", x.strides());
  at::assert_no_overlap(grad, x);
  const int64_t f = x.size(-1) / 2;
  at::Tensor x2 = x.view({-1, 2 * f});
  at::Tensor gate = x2.narrow(1, 0, f), up = x2.narrow(1, f, f);
  at::Tensor dgate = gate, dup = up;  // the same memory: each element is read before it is written
  backward_impl(grad, gate, up, dgate, dup);
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  check_pair(gate, up);
  return forward_impl(gate, up, gate.sizes());
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad, const at::Tensor& gate,
                                                   const at::Tensor& up) {
  check_pair(gate, up);
  const int64_t f = gate.size(-1);
  at::Tensor dgate = at::empty(gate.sizes(), gate.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor dup = at::empty(up.sizes(), up.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor dg2 = dgate.view({-1, f}), du2 = dup.view({-1, f});
  backward_impl(grad, gate, up, dg2, du2);
  return {dgate, dup};
}

}  // namespace megacann
