// Cross entropy per token, reading the logits in place (any float dtype) and accumulating in fp32: no fp32
// copy, no log-softmax tensor. Each row is one token: pass 1 finds the max, pass 2 sums exp(x - max).
//
// The shard form serves the vocabulary-parallel loss: a rank holds logit columns [start, start + V) of
// which the first `valid` are real tokens (the rest is vocabulary padding and is skipped). It returns
// the shard's log-sum-exp and the target's logit (0 where the target is elsewhere or ignored); the
// caller combines shards. The gradient is (softmax - onehot) * grad_loss over the shard, given the
// global log-sum-exp.
#include "common.h"

namespace megacann {
namespace {

template <typename T>
void stats_kernel(const T* logits, int64_t stride, const int64_t* target, int64_t rows, int64_t start, int64_t valid,
                  int64_t ignore_index, acc_t<T>* lse, acc_t<T>* target_logit) {
  using A = acc_t<T>;
  parallel_rows(rows, valid, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* x = logits + r * stride;
      A m = -INFINITY;
#pragma omp simd reduction(max : m)
      for (int64_t i = 0; i < valid; ++i) m = std::max(m, A(load(x, i)));
      A sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < valid; ++i) sum += exp_fast(A(load(x, i)) - m);
      lse[r] = valid > 0 ? m + std::log(sum) : A(-INFINITY);
      const int64_t t = target[r] - start;
      const bool hit = target[r] != ignore_index && t >= 0 && t < valid;
      target_logit[r] = hit ? A(load(x, t)) : A(0);
    }
  });
}

// out may be x itself (the in-place form): each element is read before it is written, and the target's
// logit is read before the row is overwritten, so the target column is still rounded only once.
template <typename T>
void grad_kernel(const T* x_base, int64_t x_stride, T* out_base, int64_t out_stride, const int64_t* target,
                 const acc_t<T>* lse, const acc_t<T>* grad_loss, int64_t rows, int64_t cols, int64_t start,
                 int64_t valid, int64_t ignore_index) {
  using A = acc_t<T>;
  parallel_rows(rows, cols, [&](int64_t begin, int64_t end) {
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
  });
}

at::Tensor logit_rows(const at::Tensor& logits) {
  at::Tensor rows = logits.reshape({-1, logits.size(-1)});
  return rows.stride(1) == 1 ? rows : rows.contiguous();
}

at::ScalarType acc_type_of(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

void check_args(const at::Tensor& logits, const at::Tensor& target, int64_t start, int64_t valid) {
  TORCH_CHECK(target.scalar_type() == at::kLong, "megacann cross entropy: target must be int64, got ",
              target.scalar_type());
  TORCH_CHECK(target.numel() * logits.size(-1) == logits.numel(), "megacann cross entropy: target ", target.sizes(),
              " does not match logits ", logits.sizes());
  TORCH_CHECK(start >= 0 && valid >= 0 && valid <= logits.size(-1), "megacann cross entropy: valid columns ", valid,
              " out of range for ", logits.size(-1), " logit columns");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> vocab_shard_stats(const at::Tensor& logits, const at::Tensor& target,
                                                     int64_t start, int64_t valid, int64_t ignore_index) {
  check_args(logits, target, start, valid);
  at::Tensor x = logit_rows(logits);
  at::Tensor t = target.contiguous();
  auto stat_options = logits.options().dtype(acc_type_of(logits));
  at::Tensor lse = at::empty(target.sizes(), stat_options);
  at::Tensor target_logit = at::empty(target.sizes(), stat_options);
  MEGACANN_DISPATCH_FLOATS(logits.scalar_type(), "megacann::vocab_shard_stats", [&] {
    using A = acc_t<scalar_t>;
    stats_kernel<scalar_t>(x.const_data_ptr<scalar_t>(), x.stride(0), t.const_data_ptr<int64_t>(), x.size(0), start,
                           valid, ignore_index, lse.mutable_data_ptr<A>(), target_logit.mutable_data_ptr<A>());
  });
  return {lse, target_logit};
}

namespace {

// (softmax - onehot) * grad_loss of logits' rows, written to out (which may be logits).
void shard_grad_into(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& lse,
                     const at::Tensor& grad_loss, int64_t start, int64_t valid, int64_t ignore_index, at::Tensor& out) {
  check_args(logits, target, start, valid);
  at::Tensor x = logit_rows(logits);
  at::Tensor o = out.view({-1, out.size(-1)});
  at::Tensor t = target.contiguous();
  const at::ScalarType acc = acc_type_of(logits);
  at::Tensor l = lse.to(acc).contiguous();
  at::Tensor g = grad_loss.to(acc).contiguous();
  MEGACANN_DISPATCH_FLOATS(logits.scalar_type(), "megacann::vocab_shard_grad", [&] {
    using A = acc_t<scalar_t>;
    grad_kernel<scalar_t>(x.const_data_ptr<scalar_t>(), x.stride(0), o.mutable_data_ptr<scalar_t>(), o.stride(0),
                          t.const_data_ptr<int64_t>(), l.const_data_ptr<A>(), g.const_data_ptr<A>(), x.size(0),
                          x.size(1), start, valid, ignore_index);
  });
}

}  // namespace

// In place: the logits become their gradient (the fused head loss needs no second buffer per chunk).
void vocab_shard_grad_(at::Tensor& logits, const at::Tensor& target, const at::Tensor& lse,
                       const at::Tensor& grad_loss, int64_t start, int64_t valid, int64_t ignore_index) {
  TORCH_CHECK(logits.is_contiguous(), "megacann::vocab_shard_grad_: logits must be contiguous");
  shard_grad_into(logits, target, lse, grad_loss, start, valid, ignore_index, logits);
}

// Whole-vocabulary cross entropy: loss = lse - logit[target] (0 where target == ignore_index), and lse
// for the backward.
std::tuple<at::Tensor, at::Tensor> cross_entropy_forward(const at::Tensor& logits, const at::Tensor& target,
                                                         int64_t ignore_index) {
  auto [lse, target_logit] = vocab_shard_stats(logits, target, 0, logits.size(-1), ignore_index);
  at::Tensor loss = (lse - target_logit).masked_fill_(target == ignore_index, 0);
  return {loss, lse};
}

at::Tensor cross_entropy_backward(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& target,
                                  const at::Tensor& lse, int64_t ignore_index) {
  at::Tensor grad = at::empty(logits.sizes(), logits.options().memory_format(at::MemoryFormat::Contiguous));
  shard_grad_into(logits, target, lse, grad_loss, 0, logits.size(-1), ignore_index, grad);
  return grad;
}

}  // namespace megacann
