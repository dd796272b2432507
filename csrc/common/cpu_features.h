// Runtime ISA checks: the AVX-512 kernels are compiled with those flags in *_avx512.cpp files and are only
// entered when the running CPU has them, so one build runs on any x86-64 machine.
#pragma once
#include <cstdlib>
#include <cstring>

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

inline bool cpu_is_intel() {
#if defined(__x86_64__)
  return __builtin_cpu_is("intel");
#else
  return false;
#endif
}

// True when the environment variable is set, non-empty and not "0".
inline bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v && *v && std::strcmp(v, "0") != 0;
}

// What the launchers dispatch on: the CPU check, unless PYSCORE_DISABLE_AVX512 is set (non-empty, not "0"),
// which lets tests and benchmarks run the portable code paths on an AVX-512 machine.
inline bool cpu_use_avx512bf16() { return cpu_has_avx512bf16() && !env_flag("PYSCORE_DISABLE_AVX512"); }

// How the AVX-512 kernels multiply bf16 pairs (both give bitwise the same fp32 result on normal numbers):
//  kDpbf16: vdpbf16ps, 32 multiply-adds per instruction. On AMD Zen 4/5 it issues at the fp32 FMA rate, so it does
//           twice the work of the alternative.
//  kWiden:  widen each bf16 pair to two fp32 vectors in registers (a shift and a mask) and use two FMAs, odd element
//           first as vdpbf16ps does. On Intel (Sapphire Rapids) vdpbf16ps retires one per 2 cycles, half the FMA
//           rate, and this is faster.
// Chosen by vendor; PYSCORE_BF16_DOT=dpbf16|widen forces either so both are tested on any AVX512-BF16 machine.
enum class Bf16Dot { kDpbf16, kWiden };

inline Bf16Dot cpu_bf16_dot() {
  const char* forced = std::getenv("PYSCORE_BF16_DOT");
  if (forced && std::strcmp(forced, "widen") == 0) return Bf16Dot::kWiden;
  if (forced && std::strcmp(forced, "dpbf16") == 0) return Bf16Dot::kDpbf16;
  return cpu_is_intel() ? Bf16Dot::kWiden : Bf16Dot::kDpbf16;
}

inline const char* bf16_dot_name(Bf16Dot d) { return d == Bf16Dot::kWiden ? "widen" : "dpbf16"; }

}  // namespace pyscore
