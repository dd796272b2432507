// The CPU tier, decided at run time in this one place: the kernel table (common/dispatch.h) dispatches on it and the
// Python op registry (pyscore/ops/_ext.py, through _C.cpu_features()) reads the same answer. ISA-specific kernels
// live in files compiled with that ISA's flags and are only entered when the running CPU's tier allows them, so one
// build runs on any x86-64 (or aarch64) machine.
#pragma once
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif
#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

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

// The tiers, lowest first. x86: generic < avx2 (+FMA, F16C) < avx512 (F/BW/DQ/VL) < avx512bf16 < amx (AMX-BF16
// tiles, with AVX512-BF16); aarch64: generic < neon. A tier implies every lower tier of its architecture.
enum class CpuTier { kGeneric = 0, kAvx2, kAvx512, kAvx512Bf16, kAmx, kNeon };

inline const char* tier_name(CpuTier t) {
  switch (t) {
    case CpuTier::kAvx2: return "avx2";
    case CpuTier::kAvx512: return "avx512";
    case CpuTier::kAvx512Bf16: return "avx512bf16";
    case CpuTier::kAmx: return "amx";
    case CpuTier::kNeon: return "neon";
    default: return "generic";
  }
}

inline bool cpu_has_avx2() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

// Linux hands a process the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, once);
// without it the first tile instruction faults. Asked once; false where refused or not Linux.
inline bool cpu_amx_permitted() {
#if defined(__x86_64__) && defined(__linux__)
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

inline bool cpu_has_amx_bf16() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") && cpu_amx_permitted();
#else
  return false;
#endif
}

// aarch64 extensions worth naming (Linux hwcaps): bf16 arithmetic (BFDOT/BFMMLA) and int8 matrix multiply.
inline bool cpu_has_arm_bf16() {
#if defined(__aarch64__) && defined(__linux__) && defined(HWCAP2_BF16)
  return getauxval(AT_HWCAP2) & HWCAP2_BF16;
#else
  return false;
#endif
}

inline bool cpu_has_arm_i8mm() {
#if defined(__aarch64__) && defined(__linux__) && defined(HWCAP2_I8MM)
  return getauxval(AT_HWCAP2) & HWCAP2_I8MM;
#else
  return false;
#endif
}

// The best tier this CPU runs (detected once).
inline CpuTier cpu_hardware_tier() {
  static const CpuTier tier = [] {
#if defined(__aarch64__)
    return CpuTier::kNeon;  // Advanced SIMD is mandatory on ARMv8-A
#else
    if (cpu_has_avx512bf16() && cpu_has_amx_bf16()) return CpuTier::kAmx;
    if (cpu_has_avx512bf16()) return CpuTier::kAvx512Bf16;
    if (cpu_has_avx512() && cpu_has_avx2()) return CpuTier::kAvx512;
    if (cpu_has_avx2()) return CpuTier::kAvx2;
    return CpuTier::kGeneric;
#endif
  }();
  return tier;
}

// The tier asked for by PYSCORE_CPU_TIER (a tier name), or the hardware's when unset or unknown. The legacy
// PYSCORE_DISABLE_AVX512 (non-empty, not "0") asks for "generic".
inline CpuTier cpu_requested_tier() {
  if (env_flag("PYSCORE_DISABLE_AVX512")) return CpuTier::kGeneric;
  const char* v = std::getenv("PYSCORE_CPU_TIER");
  if (!v || !*v) return cpu_hardware_tier();
  for (CpuTier t : {CpuTier::kGeneric, CpuTier::kAvx2, CpuTier::kAvx512, CpuTier::kAvx512Bf16, CpuTier::kAmx,
                    CpuTier::kNeon}) {
    if (std::strcmp(v, tier_name(t)) == 0) return t;
  }
  return cpu_hardware_tier();
}

// What the launchers dispatch on (read at each call, so tests and benches can force a lower tier on a bigger CPU):
// the requested tier where the hardware runs it; a tier above the hardware, or of the other architecture, falls to
// the hardware tier, or to generic across architectures.
inline CpuTier cpu_tier() {
  const CpuTier hw = cpu_hardware_tier(), want = cpu_requested_tier();
  if (want == CpuTier::kGeneric) return want;
  if ((want == CpuTier::kNeon) != (hw == CpuTier::kNeon)) return CpuTier::kGeneric;
  return static_cast<int>(want) < static_cast<int>(hw) ? want : hw;
}

// x86 tier order: true when the running tier is `min` or above (never for neon, which is ordered on its own).
inline bool cpu_tier_at_least(CpuTier min) {
  const CpuTier t = cpu_tier();
  return t != CpuTier::kNeon && static_cast<int>(t) >= static_cast<int>(min);
}

// How the AVX-512 kernels multiply bf16 pairs (both give bitwise the same fp32 result on normal numbers):
//  kDpbf16: vdpbf16ps, 32 multiply-adds per instruction. On AMD Zen 4/5 it issues at the fp32 FMA rate, so it does
//           twice the work of the alternative.
//  kWiden:  widen each bf16 pair to two fp32 vectors in registers (a shift and a mask) and use two FMAs, odd element
//           first as vdpbf16ps does. On Intel (Sapphire Rapids) vdpbf16ps retires one per 2 cycles, half the FMA
//           rate, and this is faster.
// Chosen by vendor; PYSCORE_BF16_DOT=dpbf16|widen forces either so both are tested on any AVX512-BF16 machine. Below
// tier avx512bf16 it is kWiden.
enum class Bf16Dot { kDpbf16, kWiden };

inline Bf16Dot cpu_bf16_dot() {
  if (!cpu_tier_at_least(CpuTier::kAvx512Bf16)) return Bf16Dot::kWiden;  // no vdpbf16ps below tier avx512bf16, whatever is asked
  const char* forced = std::getenv("PYSCORE_BF16_DOT");
  if (forced && std::strcmp(forced, "widen") == 0) return Bf16Dot::kWiden;
  if (forced && std::strcmp(forced, "dpbf16") == 0) return Bf16Dot::kDpbf16;
  return cpu_is_intel() ? Bf16Dot::kWiden : Bf16Dot::kDpbf16;
}

// Whether linear's int8 quads run on AVX512-VNNI (vpdpbusd): at tier avx512bf16 and up (every such CPU has it,
// checked anyway); below, the int8 ops come from the AVX2 layer.
inline bool cpu_int8_vnni() {
#if defined(__x86_64__)
  return cpu_tier_at_least(CpuTier::kAvx512Bf16) && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

inline const char* bf16_dot_name(Bf16Dot d) { return d == Bf16Dot::kWiden ? "widen" : "dpbf16"; }

}  // namespace pyscore
