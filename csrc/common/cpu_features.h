// Runtime ISA checks: the AVX-512 kernels are compiled with those flags in *_avx512.cpp files and are only
// entered when the running CPU has them, so one build runs on any x86-64 machine.
#pragma once

namespace pyscore {

inline bool cpu_has_avx512() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

inline bool cpu_has_avx512bf16() {
#if defined(__x86_64__)
  return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

}  // namespace pyscore
