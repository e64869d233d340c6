// SwiGLU: y = silu(gate) * up = gate * sigmoid(gate) * up, over rows of `f` features. gate and up may be the
// two halves of one fused [rows, 2f] projection (strided views, no copy), and the backward then writes both
// gradients into one [rows, 2f] tensor.
#include "common.h"

namespace megacann {
namespace {

template <typename T>
struct Rows {  // a [rows, f] matrix with unit stride along f
  T* data;
  int64_t stride;
  T* row(int64_t r) const { return data + r * stride; }
};

template <typename T>
inline acc_t<T> sigmoid(acc_t<T> v) {
  return acc_t<T>(1) / (acc_t<T>(1) + exp_fast(-v));
}

template <typename T>
void swiglu_forward_kernel(Rows<const T> gate, Rows<const T> up, T* y, int64_t rows, int64_t f) {
  using A = acc_t<T>;
  parallel_rows(rows, f, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate.row(r);
      const T* u = up.row(r);
      T* yr = y + r * f;
#pragma omp simd
      for (int64_t i = 0; i < f; ++i) {
        A gv = load(g, i);
        store(yr, i, gv * sigmoid<T>(gv) * A(load(u, i)));
      }
    }
  });
}

// d gate = grad * up * sig * (1 + gate * (1 - sig)),  d up = grad * gate * sig
template <typename T>
void swiglu_backward_kernel(const T* grad, Rows<const T> gate, Rows<const T> up, Rows<T> dgate, Rows<T> dup,
                            int64_t rows, int64_t f) {
  using A = acc_t<T>;
  parallel_rows(rows, f, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gr = grad + r * f;
      const T* g = gate.row(r);
      const T* u = up.row(r);
      T* dg = dgate.row(r);
      T* du = dup.row(r);
#pragma omp simd
      for (int64_t i = 0; i < f; ++i) {
        A go = load(gr, i), gv = load(g, i), uv = load(u, i);
        A sig = sigmoid<T>(gv);
        store(dg, i, go * uv * sig * (A(1) + gv * (A(1) - sig)));
        store(du, i, go * gv * sig);
      }
    }
  });
}

// [rows, f] view of t's last dim (t may be a strided half of a fused tensor)
at::Tensor as_rows(const at::Tensor& t) {
  at::Tensor rows = t.reshape({-1, t.size(-1)});
  return rows.stride(1) == 1 ? rows : rows.contiguous();
}

template <typename T>
Rows<const T> const_rows(const at::Tensor& t) {
  return {t.const_data_ptr<T>(), t.stride(0)};
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
    swiglu_forward_kernel<scalar_t>(const_rows<scalar_t>(g), const_rows<scalar_t>(u), y.mutable_data_ptr<scalar_t>(),
                                    g.size(0), g.size(1));
  });
  return y;
}

void backward_impl(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up, at::Tensor& dgate,
                   at::Tensor& dup) {
  at::Tensor g = as_rows(gate), u = as_rows(up);
  at::Tensor go = grad.to(gate.scalar_type()).contiguous();
  MEGACANN_DISPATCH_FLOATS(gate.scalar_type(), "megacann::swiglu_backward", [&] {
    swiglu_backward_kernel<scalar_t>(go.const_data_ptr<scalar_t>(), const_rows<scalar_t>(g), const_rows<scalar_t>(u),
                                     {dgate.mutable_data_ptr<scalar_t>(), dgate.stride(0)},
                                     {dup.mutable_data_ptr<scalar_t>(), dup.stride(0)}, g.size(0), g.size(1));
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
