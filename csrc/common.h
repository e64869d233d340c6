// Shared helpers of the torch-facing side of megacann's CPU kernels: the accumulation type, the kernel
// set for a dtype from the table of the selected instruction set (kernels.h, kernels_isa.cpp holds the
// loops), and the row-parallel loop.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels.h"

namespace megacann {

// The type a kernel computes in: fp32 for fp32/bf16 inputs, fp64 for fp64 (used by gradcheck).
template <typename T>
using acc_t = typename Acc<T>::type;

// The kernel set for a dtype from the table in use (kernels.h; c10::BFloat16 is laid out as Bf16).
template <typename T>
struct KernelType {
  using type = T;
};
template <>
struct KernelType<c10::BFloat16> {
  using type = Bf16;
};
template <typename T>
using kernel_t = typename KernelType<T>::type;

template <typename T>
const KernelSet<kernel_t<T>>& kernels_for();
template <>
inline const KernelSet<float>& kernels_for<float>() { return active_kernels().f32; }
template <>
inline const KernelSet<Bf16>& kernels_for<c10::BFloat16>() { return active_kernels().bf16; }
template <>
inline const KernelSet<double>& kernels_for<double>() { return active_kernels().f64; }

// T* as the kernels' pointer type (c10::BFloat16* -> Bf16*; others unchanged)
template <typename T>
inline kernel_t<T>* kptr(T* p) {
  return reinterpret_cast<kernel_t<T>*>(p);
}
template <typename T>
inline const kernel_t<T>* kptr(const T* p) {
  return reinterpret_cast<const kernel_t<T>*>(p);
}

// Rows per task so that each task touches at least ~16K elements (smaller tasks cost more than they save).
inline int64_t row_grain(int64_t row_len) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_len)); }

// Run f(first_row, end_row) over [0, rows) on ATen's intra-op thread pool (torch.set_num_threads applies).
template <typename F>
inline void parallel_rows(int64_t rows, int64_t row_len, const F& f) {
  at::parallel_for(0, rows, row_grain(row_len), f);
}

}  // namespace megacann

// fp32, bf16 and fp64 (fp64 for gradcheck); other dtypes take the reference path in Python.
#define MEGACANN_DISPATCH_FLOATS(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, TYPE, NAME, __VA_ARGS__)
