// Included first by every kernel text (csrc/<op>/*_simd.h): a text is compiled only through the translation units
// cmake/cpu_kernels.cmake generates, one per vector layer on its "// pyscore-vec-layers:" line, which bind `V` to the
// layer and name its entry points (PYSCORE_VEC_ENTRY).
#pragma once
#ifndef PYSCORE_VEC_ENTRY
#error "a kernel text is compiled once per vector layer on its pyscore-vec-layers line (cmake/cpu_kernels.cmake)"
#endif

// Put before every loop over a register tile's rows (or any loop indexing a tile array by a loop variable): GCC's
// complete unrolling of such a loop runs before its scalar replacement of the tile array only for the innermost loop
// of a nest, so a tile indexed acc[r][j] with r an outer loop's variable stays an array in memory. Inside the hot
// loop loop-invariant motion still keeps it in registers, but every call then writes the whole tile to the stack and
// reads it back at entry and exit (24 zmm each way for linear's 6x4 AVX-512 tile, ~5-7% of its prefill samples on a
// Zen 4), and on aarch64 the stores stayed inside the hot loop. Unrolled here, the tile is scalars from the start.
#define PYSCORE_UNROLL _Pragma("GCC unroll 16")
