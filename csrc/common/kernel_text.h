// Included first by every kernel text (csrc/<op>/*_simd.h): a text is compiled only through the translation units
// cmake/cpu_kernels.cmake generates, one per vector layer on its "// pyscore-vec-layers:" line, which bind `V` to the
// layer and name its entry points (PYSCORE_VEC_ENTRY).
#pragma once
#ifndef PYSCORE_VEC_ENTRY
#error "a kernel text is compiled once per vector layer on its pyscore-vec-layers line (cmake/cpu_kernels.cmake)"
#endif
