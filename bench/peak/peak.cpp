// The physical ceilings of this CPU's matrix and vector units, the reference every GEMM figure in bench/ is read
// against (issue 19: "the physical limit: the GEMM ceiling of the CPU at hand"). Each loop keeps its operands in
// registers or L1 and runs enough independent accumulators to cover the unit's latency, so it measures issue
// rate, not memory:
//   amx        TDPBF16PS on 4 independent C tiles, A/B tiles resident (16 x 16 x 32 MACs each);
//   amx+loads  the same with linear's 2 x 2 pattern: 2 A + 2 B tile loads (L1) per 4 TDPBF16PS;
//   amx+stores amx+loads plus what linear's epilogue adds at K = 576 (SmolLM2's qkv / o / gate_up): two 64-byte
//              output lines written per 4 TDPBF16PS, rows 1920 bytes apart, cycling over 15 MB (each line misses
//              L1 and L2, as a call's output does);
//   fma        AVX-512 fp32 FMA, 16 independent zmm chains (the avx512 tier's fp32 GEMM ceiling);
//   dpbf16     AVX512-BF16 VDPBF16PS, 16 independent chains (the avx512bf16 tier's bf16 ceiling);
//   fma256     AVX2 fp32 FMA, 12 independent ymm chains (the avx2 tier's GEMM ceiling: its micro-kernel holds 12
//              accumulators; AMD Zen 1 splits each ymm FMA into two 128-bit halves, Zen 2 and later do not);
//   amx-int8   TDPBUSD on 4 independent C tiles, A/B tiles resident (16 x 16 x 64 MACs each: int8 at amx);
//   vnni       AVX512-VNNI VPDPBUSD, 16 independent zmm chains (64 int8 MACs each: linear_int8's dot at avx512bf16);
//   int8-256   AVX2's int8 dot as linear_int8 runs it without VNNI (vpsignb, vpmaddubsw, vpmaddwd by ones, vpaddd:
//              32 MACs) in a 2-row x 2-vector tile (the avx2 tier's int8 ceiling for that instruction sequence).
// Best of ROUNDS rounds per loop (default 15; the loops alternate within a round), on 1 thread and on every thread
// (OpenMP), in GFLOP/s (a MAC = 2 FLOP; for the int8 loops, 2 integer operations).
// Build and run (x86-64; each loop is skipped where the CPU lacks its instructions, so an AVX2-only CPU runs fma256
// and int8-256 alone; the AVX-512 and AMX loops are compiled for their ISA by target attributes, not run there):
//   g++ -O2 -fopenmp bench/peak/peak.cpp -o /tmp/peak && /tmp/peak [ROUNDS]
// tests/bench/test_peak.py builds it and runs one round.
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

alignas(64) uint16_t g_tiles[16 * 1024];  // 16 slots of 4 tiles: 32 KiB, L1

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

constexpr int64_t kOutStride = 1920, kOutLines = 8000;  // 15 MB of output rows, per thread

// Tiles 0-7 configured 16 x 64 bytes: A/B operands 4-7 loaded from g_tiles, the C tiles 0-3 zeroed.
__attribute__((target("amx-tile"))) void resident_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
  _tile_loadd(4, g_tiles, 64);
  _tile_loadd(5, g_tiles + 512, 64);
  _tile_loadd(6, g_tiles + 1024, 64);
  _tile_loadd(7, g_tiles + 1536, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// Ends a tile loop begun at t0: `ops` operations per second elapsed, tile 0 stored and tested against a value it
// never holds so that the loop's results stay live; the tiles released.
__attribute__((target("amx-tile"))) double tiles_rate(std::chrono::steady_clock::time_point t0, double ops) {
  alignas(64) int32_t sink[256];
  _tile_stored(0, sink, 64);
  const double s = seconds_since(t0);
  _tile_release();
  return sink[0] == 1 ? 0 : ops / s;
}

// FLOP per second of `iters` iterations of 4 TDPBF16PS (with the 2 x 2 loads when `loads`, and two output lines
// written per iteration when `stores`).
__attribute__((target("avx512f,amx-tile,amx-bf16"))) double amx(long iters, bool loads, bool stores = false) {
  thread_local char* const out = static_cast<char*>(std::aligned_alloc(64, kOutStride * kOutLines));
  resident_tiles();
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < iters; ++i) {
    const uint16_t* slot = g_tiles + (i & 7) * 2048;
    if (loads) {
      _tile_loadd(4, slot, 64);
      _tile_loadd(6, slot + 512, 64);
      _tile_loadd(7, slot + 1024, 64);
    }
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (loads) _tile_loadd(5, slot + 1536, 64);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    if (stores) {
      char* const line = out + (2 * i) % kOutLines * kOutStride;
      _mm512_store_si512(line, _mm512_set1_epi32(int(i)));
      _mm512_store_si512(line + kOutStride, _mm512_set1_epi32(int(i)));
    }
  }
  return tiles_rate(t0, iters * 4.0 * 16 * 16 * 32 * 2);
}

// Operations per second of `iters` iterations of 4 TDPBUSD (int8: 16 x 16 x 64 MACs each), operands resident.
__attribute__((target("avx512f,amx-tile,amx-int8"))) double amx_int8(long iters) {
  resident_tiles();
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < iters; ++i) {
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
    _tile_dpbusd(2, 5, 6);
    _tile_dpbusd(3, 5, 7);
  }
  return tiles_rate(t0, iters * 4.0 * 16 * 16 * 64 * 2);
}

// Operations per second of 16 independent zmm chains of VPDPBUSD (16 lanes x 4 int8 MACs). In asm, as
// common/vec_avx512.h's dot_quads: GCC 12's builtin copies each accumulator to a fresh register and back.
__attribute__((target("avx512f,avx512vnni"))) double vnni(long iters) {
  __m512i acc[16];
#pragma GCC unroll 16  // every loop over acc, or GCC keeps it an array on the stack
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_set1_epi32(j);
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < iters; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) asm("vpdpbusd %2, %1, %0" : "+v"(acc[j]) : "v"(a), "v"(b));
  const double s = seconds_since(t0);
  long long sum = 0;
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) sum += _mm512_reduce_add_epi32(acc[j]);
  return sum == 1 ? 0 : iters * 16.0 * 64 * 2 / s;
}

// Operations per second of AVX2's int8 dot without VNNI as common/vec_avx2.h's dot_quads runs it: per step and row
// |x| once, then per weight vector vpsignb, vpmaddubsw, vpmaddwd by ones and vpaddd, in one of linear_int8's AVX2
// tiles, 2 rows x 2 vectors (the adds are the only chain: 4 cover their latency). The weights and x pass through an
// empty asm each step, as the kernel loads them. Named accumulators: with 6 of them GCC -O2 stored three to the
// stack each step.
__attribute__((target("avx2"))) inline __m256i dot_quads256(__m256i acc, __m256i ax, __m256i x, __m256i w) {
  const __m256i pairs = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w, x));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

__attribute__((target("avx2"))) double int8_256(long iters) {
  __m256i a0 = _mm256_set1_epi32(0), a1 = _mm256_set1_epi32(1), b0 = _mm256_set1_epi32(2), b1 = _mm256_set1_epi32(3);
  __m256i w0 = _mm256_set1_epi8(-2), w1 = _mm256_set1_epi8(-3), x0 = _mm256_set1_epi8(3), x1 = _mm256_set1_epi8(-5);
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < iters; ++i) {
    asm("" : "+x"(w0), "+x"(w1), "+x"(x0), "+x"(x1));
    const __m256i ax0 = _mm256_abs_epi8(x0), ax1 = _mm256_abs_epi8(x1);
    a0 = dot_quads256(a0, ax0, x0, w0), a1 = dot_quads256(a1, ax0, x0, w1);
    b0 = dot_quads256(b0, ax1, x1, w0), b1 = dot_quads256(b1, ax1, x1, w1);
  }
  const double s = seconds_since(t0);
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(b0, b1)));
  long long sum = 0;
  for (int32_t v : lanes) sum += v;
  return sum == 1 ? 0 : iters * 4.0 * 32 * 2 / s;
}

// FLOP per second of 12 independent ymm chains of FMA (AVX2: 8 fp32 lanes).
__attribute__((target("avx2,fma"))) double vector256(long iters) {
  __m256 acc[12];
  for (int j = 0; j < 12; ++j) acc[j] = _mm256_set1_ps(1.0f + j * 1e-3f);
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < iters; ++i)
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j) acc[j] = _mm256_fmadd_ps(acc[j], a, b);
  const double s = seconds_since(t0);
  alignas(32) float lanes[8];
  float sum = 0;
  for (int j = 0; j < 12; ++j) {
    _mm256_store_ps(lanes, acc[j]);
    for (float v : lanes) sum += v;
  }
  return sum == 1.0f ? 0 : iters * 12.0 * 16 / s;
}

// FLOP per second of 16 independent zmm chains of FMA (bf16: VDPBF16PS, 32 MACs per instruction).
template <bool kBf16>
__attribute__((target("avx512f,avx512bf16"))) double vector(long iters) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_set1_ps(1.0f + j * 1e-3f);
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
  const __m512bh ab = (__m512bh)_mm512_set1_epi16(0x3f80), bb = (__m512bh)_mm512_set1_epi16(0x0001);
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < iters; ++i)
#pragma GCC unroll 16  // the 16 accumulators must live in registers
    for (int j = 0; j < 16; ++j)
      acc[j] = kBf16 ? _mm512_dpbf16_ps(acc[j], ab, bb) : _mm512_fmadd_ps(acc[j], a, b);
  const double s = seconds_since(t0);
  float sum = 0;
  for (int j = 0; j < 16; ++j) sum += _mm512_reduce_add_ps(acc[j]);
  return sum == 1.0f ? 0 : iters * 16.0 * (kBf16 ? 64 : 32) / s;
}

// One run of fn on `threads` threads together: the sum of their rates, each bounded by the slowest thread's time
// (the threads run the same count).
double together(int threads, double (*fn)()) {
  double slowest = 1e30;
#pragma omp parallel num_threads(threads) reduction(min : slowest)
  slowest = fn();
  return slowest * threads;
}

bool amx_granted(bool int8) {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureTileData = 18;
  return (int8 ? __builtin_cpu_supports("amx-int8") : __builtin_cpu_supports("amx-bf16")) &&
         syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureTileData) == 0;
}

}  // namespace

enum class Needs { kAvx2, kAvx512, kBf16, kAmx, kAmxInt8, kVnni };

struct Loop {
  const char* name;
  double (*run)();
  Needs needs;
};

int main(int argc, char** argv) {
  for (auto& v : g_tiles) v = 0x3f80;  // bf16 1.0
  // Indexed by Needs, in its order.
  const bool has[] = {__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"),
                      __builtin_cpu_supports("avx512f") != 0, __builtin_cpu_supports("avx512bf16") != 0,
                      amx_granted(false), amx_granted(true), __builtin_cpu_supports("avx512vnni") != 0};
  const Loop loops[] = {
      {"amx", [] { return amx(400000, false); }, Needs::kAmx},
      {"amx+loads", [] { return amx(400000, true); }, Needs::kAmx},
      {"amx+stores", [] { return amx(400000, true, true); }, Needs::kAmx},
      {"fma", [] { return vector<false>(2000000); }, Needs::kAvx512},
      {"dpbf16", [] { return vector<true>(2000000); }, Needs::kBf16},
      {"fma256", [] { return vector256(2000000); }, Needs::kAvx2},
      {"amx-int8", [] { return amx_int8(400000); }, Needs::kAmxInt8},
      {"vnni", [] { return vnni(2000000); }, Needs::kVnni},
      {"int8-256", [] { return int8_256(2000000); }, Needs::kAvx2},
  };
  constexpr int kLoops = sizeof(loops) / sizeof(loops[0]);
  // Best of `reps` rounds; in each round every loop runs once in turn, so a slow phase of the machine hits all.
  const int threads[] = {1, omp_get_max_threads()}, reps = argc > 1 ? std::max(1, std::atoi(argv[1])) : 15;
  double top[2][kLoops] = {};
  for (int r = 0; r < reps; ++r)
    for (int t = 0; t < 2; ++t)
      for (int l = 0; l < kLoops; ++l)
        if (has[int(loops[l].needs)]) top[t][l] = std::max(top[t][l], together(threads[t], loops[l].run));
  std::printf("loop        threads  GFLOP/s\n");
  for (int t = 0; t < 2; ++t)
    for (int l = 0; l < kLoops; ++l)
      if (top[t][l] > 0) std::printf("%-10s  %7d  %7.0f\n", loops[l].name, threads[t], top[t][l] / 1e9);
}
