// linear: out = epilogue(x . W^T + bias) for a weight prepacked once at load (pyscore/ops/linear.py packs it).
//
// Packed layout, in blocks of kLinearBlockN = 64 output columns ("packed columns"): block b holds columns
// [64 b, 64 b + 64) as [K_pad / pack][64 columns][pack], pack = 2 for bf16 (pairs along K, vdpbf16ps's operand
// order; K_pad = K rounded up to even, the padding zero) and 1 for fp32. One zmm of a block = 16 columns x one
// pair (or one fp32), so a micro-kernel reads the weight with aligned full-width loads and broadcasts x.
// Columns past the last real one are zero. Plain weights: packed column j = weight row j. Gated (gate_up of a
// SwiGLU MLP, [2I, K] = gate rows then up rows): packed columns go in units of 32, unit u = gate rows
// [16u, 16u + 16) then up rows I + [16u, 16u + 16), each half zero-padded to a multiple of 16 rows; the unit
// makes output columns [16u, 16u + 16).
//
// Epilogue, in fp32 on the accumulators, rounded once to the output dtype (round to nearest even, as torch):
//   v = x . W^T + bias (bias in packed column order, fp32, or null)
//   gated: out[:, o] = silu(v_gate[o]) * v_up[o]      (out [M, I]);   else out = v   (out [M, N])
//   residual (non-null, may alias out): out = residual + that
// Every output row is computed by the same instructions in the same order over K whatever M is and wherever the
// row falls in the tiling (no split-K, tail rows run the same per-row arithmetic): results are batch-invariant.
// bf16_weight: fp32 x, residual and out with a bf16 packed weight (pack 2), each pair widened to fp32 exactly, so
// the result is bitwise that of the fp32 weight holding the same values (a bf16 checkpoint served in fp32 with its
// projections held in half the memory; decode reads half the bytes).
// Strides in elements.
#pragma once
#include <cstdint>

#include "common/dispatch.h"
#include "common/op_args.h"
#include "common/dtype.h"

namespace pyscore {

constexpr int32_t kLinearBlockN = 64;

struct LinearParams {
  const void* x;  // [M, K]
  int64_t x_row_stride;
  const void* w_packed;  // [N_pad / 64][K_pad / pack][64][pack], x's dtype (bf16 when bf16_weight)
  const float* bias;     // [N_pad] in packed column order, or nullptr
  const void* residual;  // [M, n_out] in x's dtype, or nullptr
  int64_t residual_row_stride;
  void* out;  // [M, n_out] in x's dtype
  int64_t out_row_stride;
  int32_t m;
  int32_t k;          // x's columns (K); the packed weight holds K_pad rows
  int32_t n_packed;   // packed columns, a multiple of 64
  int32_t n_out;      // output columns: N, or I when gated
  bool gated;
  DType dtype;       // x's, the residual's and out's
  bool bf16_weight;  // a bf16 weight under fp32 x (dtype float32); false: the weight is in dtype
};

// ---- Launchers ---------------------------------------------------------------------------------------------------
// Launcher for linear. Returns a Status, never throws.

Status linear_cpu(const LinearParams& params);
PYSCORE_BIND(linear, linear_cpu, Ptr, int64_t, Ptr, Ptr, Ptr, int64_t, Ptr, int64_t, int32_t, int32_t, int32_t, int32_t,
             bool, DTypeName, bool);

// ---- The CPU launcher's parts ------------------------------------------------------------------------------------
// Internal interface of the CPU linear kernel: the launcher (linear_cpu.cpp, baseline ISA) splits the output into
// rectangles over threads and calls these ops on them; they come from the kernel text linear_simd.h (one unit per
// vector layer: avx2, avx512, neon), the AMX tiles (linear_amx.cpp) and the portable loops. x arrives with an even K
// (the launcher pads an odd K), so a bf16 row is whole pairs.

// Packed columns per unit of work: one gated unit (16 gate + 16 up columns), two zmm.
constexpr int32_t kLinearUnitN = 32;

struct LinearCpuOps {
  // Rows [m0, m1) x packed columns [c0, c1) (multiples of kLinearUnitN) of the output, epilogue included.
  void (*rect)(const LinearParams& p, int32_t m0, int32_t m1, int32_t c0, int32_t c1);
  int32_t row_tile;  // rows the micro-kernel takes at once: row chunks are multiples of it (no short tile left)
  // The epilogue (bias, SiLU-mul, residual, rounding to x's dtype) of rows [m, m + rows) x packed columns [c, c +
  // width) (whole units) from their fp32 sums in acc (column c first, rows ldc floats apart); the AMX tiles run the
  // avx512 unit's. nullptr for the portable loops.
  void (*epilogue)(const LinearParams& p, int32_t m, int32_t rows, int32_t c, int32_t width, const float* acc,
                   int64_t ldc) = nullptr;
};

// The layers' ops: the AMX tile GEMM (bf16 only, where the OS grants the tile state) and the vector layers' (key.bf16_dot:
// how bf16 pairs are multiplied; key.bf16_weight: a bf16 weight under fp32 x, dtype float32). nullptr where the key
// is not covered.
PYSCORE_KERNELS(linear, linear_ops, const LinearCpuOps*);

// ---- int8 weights (W8A8; pyscore/ops/linear_int8.py states the arithmetic) ----------------------------------------
// The weight in int8 codes, packed as above with pack = 4 (quads along K, K4 = K rounded up to a multiple of 4, the
// padding zero): block b = [K4 / 4][64 columns][4] bytes, one zmm = 16 columns x one quad. K runs in groups of
// `group` elements (a multiple of 4; the last group of K may be shorter), G = ceil(K / group) of them, each with its
// own scales: per packed column and group, the weight's fp32 scale and w_base = -128 * (the sum of the group's codes),
// what a layer whose x codes are offset by 128 (vpdpbusd's unsigned operand) starts its sums from; both in blocks
// [N_pad / 64][G][64]. Each x row is quantized per group on its own (scale max|x| / 127 over the group, codes
// round_half_even(x * (127 / max|x|)) in [-127, 127]; a zero group: scale and codes 0). A group's sums are exact
// int32 and v, from 0, takes the groups in K order: v = fma(float(sum) * w_scale[c, g], x_scale[m, g], v); then
// linear's epilogue (+ bias, SiLU-mul, residual, one rounding to x's dtype): a row's bits depend on that row alone.
constexpr int32_t kInt8MaxGroup = 1024;  // 127 * 127 * 1024 < 2^24: a group's sum is exact in fp32

struct LinearInt8Params {
  const void* x;  // [M, K], fp32 or bf16
  int64_t x_row_stride;
  const void* w_packed;   // int8 [N_pad / 64][K4 / 4][64][4]
  const float* w_scale;   // [N_pad / 64][G][64]
  const int32_t* w_base;  // [N_pad / 64][G][64]
  const float* bias;      // [N_pad] in packed column order, or nullptr
  const void* residual;   // [M, n_out] in x's dtype, or nullptr
  int64_t residual_row_stride;
  void* out;  // [M, n_out] in x's dtype
  int64_t out_row_stride;
  int32_t m;
  int32_t k;      // x's columns (K)
  int32_t group;  // K elements per group: a multiple of 4 in [4, kInt8MaxGroup]
  int32_t n_packed;
  int32_t n_out;
  bool gated;
  DType dtype;  // x's, the residual's and out's
};

Status linear_int8_cpu(const LinearInt8Params& params);
PYSCORE_BIND(linear_int8, linear_int8_cpu, Ptr, int64_t, Ptr, Ptr, Ptr, Ptr, Ptr, int64_t, Ptr, int64_t, int32_t,
             int32_t, int32_t, int32_t, int32_t, bool, DTypeName);

// What the int8 rectangles read beside a LinearParams whose x is the quantized rows (codes, p.k = K4).
struct Int8Scales {
  const float* x_scale;  // [M][groups]
  const float* w_scale;  // as LinearInt8Params'
  const int32_t* w_base;
  int32_t groups;
  int32_t group_steps;  // quads per group: group / 4
};

struct LinearInt8CpuOps {
  // Rows [m0, m1) of x quantized: codes into q (rows q_stride bytes apart, K4 each, the padding the zero code) and
  // their group scales into scale (rows ceil(K / group) apart).
  void (*quantize)(const LinearInt8Params& p, int32_t m0, int32_t m1, uint8_t* q, int64_t q_stride, float* scale);
  // As LinearCpuOps::rect, p.x the codes.
  void (*rect)(const LinearParams& p, const Int8Scales& s, int32_t m0, int32_t m1, int32_t c0, int32_t c1);
  int32_t row_tile;
};

// The vector layers' int8 ops (key.dtype: x's); nullptr where not covered.
PYSCORE_KERNELS(linear_int8, linear_int8_ops, const LinearInt8CpuOps*);

}  // namespace pyscore
