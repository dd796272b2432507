// The CPU kernels' thread count, process-wide. omp_set_num_threads only affects the calling thread, and the
// server calls the kernels from a worker thread, so the count set at start-up is kept here and passed to
// every parallel region explicitly. 0 (the default) means OpenMP's own default.
#pragma once
#include <omp.h>

#include <atomic>

namespace pyscore {

inline std::atomic<int>& kernel_threads_setting() {
  static std::atomic<int> threads{0};
  return threads;
}

inline void set_kernel_threads(int n) { kernel_threads_setting().store(n > 0 ? n : 0); }

inline int kernel_threads() {
  int n = kernel_threads_setting().load();
  return n > 0 ? n : omp_get_max_threads();
}

}  // namespace pyscore
