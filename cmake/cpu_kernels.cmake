# The CPU kernels' sources and their ISA flags, in one place for the two builds that compile them: the pyscore._C
# module (CMakeLists.txt) and the kernel check harness (tests/cpu/CMakeLists.txt, also cross-compiled for aarch64).
#
# Portable sources (*_cpu.cpp, csrc/common/*.cpp) build for any target with the baseline ISA. On x86-64 the ISA files
# are added with their flags: *_avx512.cpp and *_amx.cpp (AVX-512 F/BW/DQ/VL + BF16, and AMX for the tile kernels) and
# *_avx2.cpp (AVX2 + FMA + F16C, and -ffp-contract=off: their elementwise kernels round each product as torch does, so
# the compiler must not fuse a mul and an add; explicit FMAs are intrinsics). They are only entered after the run-time
# tier check (csrc/common/cpu_features.h), so one build runs on any x86-64. On aarch64 the *_neon.cpp files (on
# common/vec_neon.h; -ffp-contract=off too) are added instead; NEON is baseline there, so they need no -m flag, and
# the portable sources are written so that -O3 vectorizes their hot loops. The other architecture's entry points get
# stand-ins (csrc/common/isa_entry.h, csrc/common/isa_stubs.cpp).
#
# Sets PYSCORE_CPU_KERNEL_SOURCES and PYSCORE_CPU_KERNEL_OPTIONS; needs PYSCORE_ROOT (the repository root).
file(GLOB_RECURSE PYSCORE_CPU_KERNEL_SOURCES CONFIGURE_DEPENDS
  ${PYSCORE_ROOT}/csrc/*_cpu.cpp ${PYSCORE_ROOT}/csrc/common/*.cpp)
list(FILTER PYSCORE_CPU_KERNEL_SOURCES EXCLUDE REGEX "/csrc/bindings_[^/]*$")  # the module's, not a kernel
if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")
  file(GLOB_RECURSE PYSCORE_AVX512_SOURCES CONFIGURE_DEPENDS ${PYSCORE_ROOT}/csrc/*_avx512.cpp ${PYSCORE_ROOT}/csrc/*_amx.cpp)
  set_source_files_properties(${PYSCORE_AVX512_SOURCES} PROPERTIES COMPILE_OPTIONS
    "-mavx512f;-mavx512bw;-mavx512dq;-mavx512vl;-mavx512bf16;-mfma;-mf16c;-mamx-tile;-mamx-bf16")
  file(GLOB_RECURSE PYSCORE_AVX2_SOURCES CONFIGURE_DEPENDS ${PYSCORE_ROOT}/csrc/*_avx2.cpp)
  set_source_files_properties(${PYSCORE_AVX2_SOURCES} PROPERTIES COMPILE_OPTIONS
    "-mavx2;-mfma;-mf16c;-ffp-contract=off")
  list(APPEND PYSCORE_CPU_KERNEL_SOURCES ${PYSCORE_AVX512_SOURCES} ${PYSCORE_AVX2_SOURCES})
elseif(CMAKE_SYSTEM_PROCESSOR MATCHES "^(aarch64|arm64|ARM64)$")
  file(GLOB_RECURSE PYSCORE_NEON_SOURCES CONFIGURE_DEPENDS ${PYSCORE_ROOT}/csrc/*_neon.cpp)
  set_source_files_properties(${PYSCORE_NEON_SOURCES} PROPERTIES COMPILE_OPTIONS "-ffp-contract=off")
  list(APPEND PYSCORE_CPU_KERNEL_SOURCES ${PYSCORE_NEON_SOURCES})
endif()
message(STATUS "pyscore: CPU kernels for ${CMAKE_SYSTEM_PROCESSOR}")
# -fno-trapping-math: nothing here reads floating-point exception flags, and without it GCC keeps any loop with a
# float select (the clamps of csrc/common/vec_portable.h's exp) scalar. It changes no result: no reordering is allowed.
set(PYSCORE_CPU_KERNEL_OPTIONS -O3 -fno-math-errno -fno-trapping-math -Wall -Wextra -Wno-unused-parameter)
