// Runtime ISA checks: the AVX-512 kernels are compiled with those flags in *_avx512.cpp files and are only
// entered when the running CPU has them, so one build runs on any x86-64 machine.
#pragma once
#include <cstdlib>

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

// What the launchers dispatch on: the CPU check, unless PYSCORE_DISABLE_AVX512 is set (non-empty, not "0"),
// which lets tests and benchmarks run the portable code paths on an AVX-512 machine.
inline bool cpu_use_avx512bf16() {
  const char* off = std::getenv("PYSCORE_DISABLE_AVX512");
  return cpu_has_avx512bf16() && !(off && *off && !(off[0] == '0' && off[1] == 0));
}

}  // namespace pyscore
