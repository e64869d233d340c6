// Which compiled variant of the kernel loops (kernels_isa.cpp) runs: the portable baseline, AVX2 + FMA
// (x86-64-v3) or AVX-512 (x86-64-v4). Python chooses at load (megacann/ops/isa.py) and calls
// megacann::set_cpu_isa; this file refuses a variant the build lacks or the CPU cannot run, so a forced
// choice fails with a message instead of an illegal instruction.
#include <torch/library.h>

#include <atomic>

#include "common.h"

namespace megacann {
namespace {

// codes shared with megacann/ops/isa.py (ISA_NAMES)
constexpr int64_t kBaseline = 0, kAvx2 = 1, kAvx512 = 2;

const KernelTable* table_of(int64_t code) {
  switch (code) {
    case kBaseline:
      return &kernels_baseline;
#ifdef MEGACANN_HAVE_ISA_AVX2
    case kAvx2:
      return &kernels_avx2;
#endif
#ifdef MEGACANN_HAVE_ISA_AVX512
    case kAvx512:
      return &kernels_avx512;
#endif
    default:
      return nullptr;
  }
}

bool cpu_runs(int64_t code) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  const bool v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                  __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("avx");
  if (code == kAvx2) return v3;
  if (code == kAvx512)
    return v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512cd");
#endif
  return code == kBaseline;
}

std::atomic<int64_t> active_code{kBaseline};
std::atomic<const KernelTable*> active_table{&kernels_baseline};

// bit k set: variant k is compiled in and this CPU runs it
int64_t cpu_isa_available() {
  int64_t mask = 0;
  for (int64_t code = kBaseline; code <= kAvx512; ++code)
    if (table_of(code) != nullptr && cpu_runs(code)) mask |= int64_t(1) << code;
  return mask;
}

int64_t set_cpu_isa(int64_t code) {
  const KernelTable* table = table_of(code);
  TORCH_CHECK(table != nullptr, "megacann: kernel variant ", code, " is not part of this build (available mask ",
              cpu_isa_available(), ")");
  TORCH_CHECK(cpu_runs(code), "megacann: this CPU cannot run kernel variant ", table->name);
  active_table.store(table);
  return active_code.exchange(code);
}

int64_t cpu_isa() { return active_code.load(); }

}  // namespace

const KernelTable& active_kernels() { return *active_table.load(std::memory_order_relaxed); }

}  // namespace megacann

TORCH_LIBRARY_FRAGMENT(megacann, m) {
  m.def("cpu_isa_available() -> int", &megacann::cpu_isa_available);
  m.def("set_cpu_isa(int code) -> int", &megacann::set_cpu_isa);
  m.def("cpu_isa() -> int", &megacann::cpu_isa);
}
