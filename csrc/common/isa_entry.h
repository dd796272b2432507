// Declares an ISA file's entry point where its op declares its other CPU parts (the op's header, csrc/<op>/<op>.h), so a new
// entry point is one line in its own folder:
//   PYSCORE_X86_ENTRY(SiluMulRows silu_mul_rows_avx2(DType dtype));
// cmake/cpu_kernels.cmake compiles *_avx512.cpp and *_avx2.cpp (and the kernel texts' avx2 / avx512 units) on x86-64
// only and *_neon.cpp (and the texts' neon units) on aarch64 only. On its own architecture the macro is the plain
// declaration (a missing definition stays a link error); on the other it defines an inline stand-in that returns
// nullptr, "not covered", so every launcher keeps one dispatch code for all architectures. The stand-ins are never
// reached: cpu_tier() never names another architecture's tier.
// csrc/common/isa_stubs.cpp holds the stand-ins of the ops whose headers declare their entry points plainly.
#pragma once

#if defined(__x86_64__)
#define PYSCORE_X86_ENTRY(...) __VA_ARGS__
#else
#define PYSCORE_X86_ENTRY(...) \
  inline __VA_ARGS__ { return nullptr; }
#endif

#if defined(__aarch64__)
#define PYSCORE_ARM_ENTRY(...) __VA_ARGS__
#else
#define PYSCORE_ARM_ENTRY(...) \
  inline __VA_ARGS__ { return nullptr; }
#endif
