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
    const auto& k = kernels_for<scalar_t>();
    const auto* xp = kptr(x.const_data_ptr<scalar_t>());
    const int64_t* tp = t.const_data_ptr<int64_t>();
    A* lp = lse.mutable_data_ptr<A>();
    A* tl = target_logit.mutable_data_ptr<A>();
    const int64_t stride = x.stride(0);
    parallel_rows(x.size(0), valid, [&](int64_t begin, int64_t end) {
      k.ce_stats(xp, stride, tp, begin, end, start, valid, ignore_index, lp, tl);
    });
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
    const auto& k = kernels_for<scalar_t>();
    const auto* xp = kptr(x.const_data_ptr<scalar_t>());
    auto* op = kptr(o.mutable_data_ptr<scalar_t>());
    const int64_t* tp = t.const_data_ptr<int64_t>();
    const A* lp = l.const_data_ptr<A>();
    const A* gp = g.const_data_ptr<A>();
    const int64_t xs = x.stride(0), os = o.stride(0), cols = x.size(1);
    parallel_rows(x.size(0), cols, [&](int64_t begin, int64_t end) {
      k.ce_grad(xp, xs, op, os, tp, lp, gp, begin, end, cols, start, valid, ignore_index);
    });
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
