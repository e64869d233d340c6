// The operator schemas of megacann's CPU kernels, registered with torch.library under the `megacann`
// namespace (torch.ops.megacann.*). Fake (meta) implementations and autograd formulas are registered in
// Python (megacann/ops/cpp.py), which makes the ops work under autograd and torch.compile.
#include <Python.h>
#include <torch/library.h>

#include "common.h"

namespace megacann {
std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad, const at::Tensor& x,
                                                     const at::Tensor& weight, const at::Tensor& rstd);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved, bool inverse);
at::Tensor swiglu_fused(const at::Tensor& x);
at::Tensor swiglu_fused_backward(const at::Tensor& grad, const at::Tensor& x);
void swiglu_fused_backward_(const at::Tensor& grad, at::Tensor& x);
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);
std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad, const at::Tensor& gate,
                                                   const at::Tensor& up);
std::tuple<at::Tensor, at::Tensor> vocab_shard_stats(const at::Tensor& logits, const at::Tensor& target,
                                                     int64_t start, int64_t valid, int64_t ignore_index);
void vocab_shard_grad_(at::Tensor& logits, const at::Tensor& target, const at::Tensor& lse,
                       const at::Tensor& grad_loss, int64_t start, int64_t valid, int64_t ignore_index);
std::tuple<at::Tensor, at::Tensor> cross_entropy_forward(const at::Tensor& logits, const at::Tensor& target,
                                                         int64_t ignore_index);
at::Tensor cross_entropy_backward(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& target,
                                  const at::Tensor& lse, int64_t ignore_index);
at::Tensor moe_unpermute(const at::Tensor& permuted, const at::Tensor& row_id_map, const at::Tensor& probs);
std::tuple<at::Tensor, at::Tensor> moe_unpermute_backward(const at::Tensor& grad, const at::Tensor& permuted,
                                                          const at::Tensor& row_id_map, const at::Tensor& probs);
at::Tensor moe_unpermute_backward_(const at::Tensor& grad, at::Tensor& permuted, const at::Tensor& row_id_map,
                                   const at::Tensor& probs);
void grouped_mm_(at::TensorList out, at::TensorList a, at::TensorList b, int64_t parts);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const c10::optional<at::Tensor>& attn_mask, double scale,
                            const c10::optional<at::Tensor>& sinks);
}  // namespace megacann

TORCH_LIBRARY(megacann, m) {
  m.def("rms_norm_forward(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rms_norm_backward(Tensor grad, Tensor x, Tensor weight, Tensor rstd) -> (Tensor, Tensor)");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, bool interleaved, bool inverse) -> Tensor");
  m.def("swiglu_fused(Tensor x) -> Tensor");
  m.def("swiglu_fused_backward(Tensor grad, Tensor x) -> Tensor");
  m.def("swiglu_fused_backward_(Tensor grad, Tensor(a!) x) -> ()");
  m.def("swiglu(Tensor gate, Tensor up) -> Tensor");
  m.def("swiglu_backward(Tensor grad, Tensor gate, Tensor up) -> (Tensor, Tensor)");
  m.def("cross_entropy_forward(Tensor logits, Tensor target, int ignore_index) -> (Tensor, Tensor)");
  m.def("cross_entropy_backward(Tensor grad_loss, Tensor logits, Tensor target, Tensor lse, int ignore_index) -> Tensor");
  m.def("vocab_shard_stats(Tensor logits, Tensor target, int start, int valid, int ignore_index) -> (Tensor, Tensor)");
  m.def(
      "vocab_shard_grad_(Tensor(a!) logits, Tensor target, Tensor lse, Tensor grad_loss, int start, int valid, "
      "int ignore_index) -> ()");
  m.def("moe_unpermute(Tensor permuted, Tensor row_id_map, Tensor probs) -> Tensor");
  m.def("moe_unpermute_backward(Tensor grad, Tensor permuted, Tensor row_id_map, Tensor probs) -> (Tensor, Tensor)");
  m.def("moe_unpermute_backward_(Tensor grad, Tensor(a!) permuted, Tensor row_id_map, Tensor probs) -> Tensor");
  m.def("grouped_mm_(Tensor(a!)[] out, Tensor[] a, Tensor[] b, int parts) -> ()");
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? attn_mask, float scale, Tensor? sinks) -> Tensor");
}

TORCH_LIBRARY_IMPL(megacann, CPU, m) {
  m.impl("rms_norm_forward", &megacann::rms_norm_forward);
  m.impl("rms_norm_backward", &megacann::rms_norm_backward);
  m.impl("rotary", &megacann::rotary);
  m.impl("swiglu_fused", &megacann::swiglu_fused);
  m.impl("swiglu_fused_backward", &megacann::swiglu_fused_backward);
  m.impl("swiglu_fused_backward_", &megacann::swiglu_fused_backward_);
  m.impl("swiglu", &megacann::swiglu);
  m.impl("swiglu_backward", &megacann::swiglu_backward);
  m.impl("cross_entropy_forward", &megacann::cross_entropy_forward);
  m.impl("cross_entropy_backward", &megacann::cross_entropy_backward);
  m.impl("vocab_shard_stats", &megacann::vocab_shard_stats);
  m.impl("vocab_shard_grad_", &megacann::vocab_shard_grad_);
  m.impl("moe_unpermute", &megacann::moe_unpermute);
  m.impl("moe_unpermute_backward", &megacann::moe_unpermute_backward);
  m.impl("moe_unpermute_backward_", &megacann::moe_unpermute_backward_);
  m.impl("grouped_mm_", &megacann::grouped_mm_);
  m.impl("decode_attention", &megacann::decode_attention);
}

// An importable, empty Python module (`import megacann._C` loads the library and runs the registrations
// above); no pybind11 needed.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "megacann CPU kernels (torch.ops.megacann)", -1,
                                      nullptr};
  return PyModule_Create(&module);
}
