// Mixture-of-experts unpermute in one pass over memory each way: forward, each token's expert outputs
// gathered, weighted by its routing probabilities and summed; backward, each output row's gradient scattered
// to its distinct permuted rows, and the probabilities' gradients as row dot products. PyTorch's way (a
// gather, a batched matmul, and index_add_ into a zero-filled buffer backward) moves about twice the bytes.
// row_id_map[t * k + j] is the permuted row of token t's j-th expert; it is a permutation of the rows.
// Also the experts' products with the threads spread over the groups' rows (grouped_mm_, below).
#include <ATen/MemoryOverlap.h>
#include <ATen/ops/mm_cpu_dispatch.h>

#include <vector>

#include "common.h"

namespace megacann {
namespace {

// the map as int64 indices, checked against the shapes
at::Tensor checked_map(const at::Tensor& row_id_map, int64_t assignments, int64_t rows, const char* op) {
  TORCH_CHECK(row_id_map.dim() == 1 && row_id_map.numel() == assignments, op, ": row_id_map must hold ",
              assignments, " entries (tokens x top_k), got ", row_id_map.sizes());
  TORCH_CHECK(rows == assignments, op, ": the permuted rows (", rows, ") must equal tokens x top_k (",
              assignments, ")");
  at::Tensor map = row_id_map.to(at::kLong).contiguous();
  if (assignments > 0) {  // the kernels index rows with it unchecked
    auto [low, high] = at::aminmax(map);
    TORCH_CHECK(low.item<int64_t>() >= 0 && high.item<int64_t>() < rows, op, ": row_id_map entries must lie in [0, ",
                rows, "), got [", low.item<int64_t>(), ", ", high.item<int64_t>(), "]");
  }
  return map;
}

// the probabilities in the tokens' dtype (as the reference rounds them), then in the accumulation type
template <typename scalar_t>
at::Tensor probs_as_acc(const at::Tensor& probs, const at::Tensor& like) {
  return probs.to(like.scalar_type()).to(c10::CppTypeToScalarType<acc_t<scalar_t>>::value).contiguous();
}

int64_t token_grain(int64_t hidden, int64_t top_k) { return row_grain(hidden * top_k); }

}  // namespace

at::Tensor moe_unpermute(const at::Tensor& permuted, const at::Tensor& row_id_map, const at::Tensor& probs) {
  TORCH_CHECK(permuted.dim() == 2 && probs.dim() == 2, "megacann::moe_unpermute: permuted [rows, h] and probs "
              "[tokens, k] expected, got ", permuted.sizes(), " and ", probs.sizes());
  const int64_t tokens = probs.size(0), top_k = probs.size(1), hidden = permuted.size(1);
  at::Tensor map = checked_map(row_id_map, tokens * top_k, permuted.size(0), "megacann::moe_unpermute");
  at::Tensor src = permuted.contiguous();
  at::Tensor out = at::empty({tokens, hidden}, permuted.options().memory_format(at::MemoryFormat::Contiguous));
  MEGACANN_DISPATCH_FLOATS(permuted.scalar_type(), "megacann::moe_unpermute", [&] {
    using acc = acc_t<scalar_t>;
    at::Tensor weights = probs_as_acc<scalar_t>(probs, permuted);
    const acc* w = weights.const_data_ptr<acc>();
    const int64_t* rows = map.const_data_ptr<int64_t>();
    const scalar_t* x = src.const_data_ptr<scalar_t>();
    scalar_t* y = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, tokens, token_grain(hidden, top_k), [&](int64_t begin, int64_t end) {
      std::vector<acc> sum(hidden);
      for (int64_t t = begin; t < end; ++t) {
        std::fill(sum.begin(), sum.end(), acc(0));
        for (int64_t j = 0; j < top_k; ++j) {
          const acc p = w[t * top_k + j];
          const scalar_t* row = x + rows[t * top_k + j] * hidden;
          for (int64_t c = 0; c < hidden; ++c) sum[c] += p * static_cast<acc>(row[c]);
        }
        scalar_t* dst = y + t * hidden;
        for (int64_t c = 0; c < hidden; ++c) dst[c] = static_cast<scalar_t>(sum[c]);
      }
    });
  });
  return out;
}

namespace {

// the permuted rows' gradients into gx (which may be permuted's own memory: each element is read before it
// is written) and the probabilities' gradients, returned
at::Tensor unpermute_backward_into(const at::Tensor& grad, const at::Tensor& src, const at::Tensor& map,
                                   const at::Tensor& probs, at::Tensor& grad_permuted) {
  const int64_t tokens = probs.size(0), top_k = probs.size(1), hidden = src.size(1);
  at::Tensor go = grad.to(src.scalar_type()).contiguous();
  at::Tensor grad_probs;
  MEGACANN_DISPATCH_FLOATS(src.scalar_type(), "megacann::moe_unpermute_backward", [&] {
    using acc = acc_t<scalar_t>;
    at::Tensor weights = probs_as_acc<scalar_t>(probs, src);
    at::Tensor dots = at::empty(weights.sizes(), weights.options());
    const acc* w = weights.const_data_ptr<acc>();
    acc* dp = dots.mutable_data_ptr<acc>();
    const int64_t* rows = map.const_data_ptr<int64_t>();
    const scalar_t* g = go.const_data_ptr<scalar_t>();
    const scalar_t* x = src.const_data_ptr<scalar_t>();
    scalar_t* gx = grad_permuted.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, tokens, token_grain(hidden, top_k), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* gt = g + t * hidden;
        for (int64_t j = 0; j < top_k; ++j) {
          const acc p = w[t * top_k + j];
          const int64_t r = rows[t * top_k + j];
          const scalar_t* row = x + r * hidden;
          scalar_t* grow = gx + r * hidden;
          acc dot = 0;
          for (int64_t c = 0; c < hidden; ++c) {
            const acc gc = static_cast<acc>(gt[c]);
            dot += gc * static_cast<acc>(row[c]);
            grow[c] = static_cast<scalar_t>(p * gc);
          }
          dp[t * top_k + j] = dot;
        }
      }
    });
    grad_probs = dots.to(probs.scalar_type());
  });
  return grad_probs;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> moe_unpermute_backward(const at::Tensor& grad, const at::Tensor& permuted,
                                                          const at::Tensor& row_id_map, const at::Tensor& probs) {
  const int64_t tokens = probs.size(0), top_k = probs.size(1);
  at::Tensor map = checked_map(row_id_map, tokens * top_k, permuted.size(0), "megacann::moe_unpermute_backward");
  at::Tensor src = permuted.contiguous();
  at::Tensor grad_permuted = at::empty(src.sizes(), src.options());
  at::Tensor grad_probs = unpermute_backward_into(grad, src, map, probs, grad_permuted);
  return {grad_permuted, grad_probs};
}

// as moe_unpermute_backward, the permuted rows' gradients written over `permuted` (the map is a permutation
// of its rows, so every row is overwritten); returns the probabilities' gradients
at::Tensor moe_unpermute_backward_(const at::Tensor& grad, at::Tensor& permuted, const at::Tensor& row_id_map,
                                   const at::Tensor& probs) {
  TORCH_CHECK(permuted.dim() == 2 && probs.dim() == 2 && permuted.is_contiguous(),
              "megacann::moe_unpermute_backward_: contiguous permuted [rows, h] and probs [tokens, k] expected, got ",
              permuted.sizes(), " (strides ", permuted.strides(), ") and ", probs.sizes());
  const int64_t tokens = probs.size(0), top_k = probs.size(1);
  at::Tensor map = checked_map(row_id_map, tokens * top_k, permuted.size(0), "megacann::moe_unpermute_backward_");
  at::assert_no_overlap(grad, permuted);
  return unpermute_backward_into(grad, permuted, map, probs, permuted);
}

// out[g] = a[g] · b[g] for every group, the groups' rows cut into `parts` pieces of about equal work
// (rows x K x N), each piece one single-threaded product on its own thread (parts <= 0: one per intra-op
// thread), so a call waits on its threads once, not once per product as a torch.mm per group does: level
// with that on a quiet CPU, far faster where other processes share the cores (benchmarks/NOTES.md, issue
// 28 session 9). Cutting rows keeps the pieces balanced whatever the group sizes; a cut of a's rows is a
// cut of out's rows, so each output element is one whole dot product as in at::mm.
void grouped_mm_(at::TensorList out, at::TensorList a, at::TensorList b, int64_t parts) {
  const int64_t groups = static_cast<int64_t>(out.size());
  TORCH_CHECK(static_cast<int64_t>(a.size()) == groups && static_cast<int64_t>(b.size()) == groups,
              "megacann::grouped_mm_: ", groups, " outputs but ", a.size(), " left and ", b.size(), " right operands");
  std::vector<int64_t> start(groups + 1, 0);  // start[g]: the work (rows x K x N) of the groups before g
  std::vector<int64_t> unit(groups, 0);       // unit[g]: the work of one row of group g
  for (int64_t g = 0; g < groups; ++g) {
    TORCH_CHECK(a[g].dim() == 2 && b[g].dim() == 2 && out[g].dim() == 2 && a[g].size(1) == b[g].size(0) &&
                    out[g].size(0) == a[g].size(0) && out[g].size(1) == b[g].size(1),
                "megacann::grouped_mm_: group ", g, ": out ", out[g].sizes(), " != a ", a[g].sizes(), " x b ",
                b[g].sizes());
    unit[g] = a[g].size(1) * b[g].size(1);
    start[g + 1] = start[g] + a[g].size(0) * unit[g];
  }
  auto product = [&](int64_t g, int64_t begin, int64_t end) {
    if (end <= begin) return;
    at::Tensor dst = out[g].narrow(0, begin, end - begin);
    at::cpu::mm_out(dst, a[g].narrow(0, begin, end - begin), b[g]);
  };
  const int64_t total = start[groups];
  if (parts <= 0) parts = at::in_parallel_region() ? 1 : at::get_num_threads();
  parts = std::max<int64_t>(1, std::min(parts, total));
  if (parts == 1) {  // each product on every thread, as at::mm would run it
    for (int64_t g = 0; g < groups; ++g) product(g, 0, a[g].size(0));
    return;
  }
  for (int64_t g = 0; g < groups; ++g) {
    if (unit[g] == 0) product(g, 0, a[g].size(0));  // K or N == 0: no work to share (zeros when K == 0)
  }
  // the first row of group g that starts at or after `work` (work within group g's range)
  auto first_row = [&](int64_t g, int64_t work) {
    return std::min(a[g].size(0), (work - start[g] + unit[g] - 1) / unit[g]);
  };
  at::parallel_for(0, parts, 1, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      const int64_t lo = total * p / parts, hi = total * (p + 1) / parts;  // this piece's work [lo, hi)
      for (int64_t g = 0; g < groups; ++g) {
        if (unit[g] == 0 || start[g + 1] <= lo || start[g] >= hi) continue;
        const int64_t begin = start[g] >= lo ? 0 : first_row(g, lo);
        const int64_t end = start[g + 1] <= hi ? a[g].size(0) : first_row(g, hi);
        product(g, begin, end);
      }
    }
  });
}

}  // namespace megacann
