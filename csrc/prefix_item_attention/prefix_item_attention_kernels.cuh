// Kernels of the CUDA prefix_item_attention (design notes in prefix_item_attention_cuda.cu, which launches
// them). Kept in a header, free of inline PTX and host code, so tests/emu can run them on the host.
#pragma once
#include <cub/block/block_scan.cuh>

#include <climits>

#include "common/cuda_utils.cuh"
#include "common/mma_ptx.cuh"
#include "prefix_item_attention/prefix_item_attention.h"

namespace pyscore {
namespace attention_cuda {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kBlockM = 16 * kWarps;  // query rows per CTA: each warp owns one m16 slice
constexpr int kBlockN = 64;           // keys per K/V tile
constexpr int kMaxStackedHeads = 8;   // GQA heads stacked per CTA, so a tile always spans >= 8 tokens
constexpr float kLog2e = 1.4426950408889634f;
static_assert(kBlockM == 64 && kBlockN % 16 == 0, "tile shapes assumed by the fragment loops below");
static_assert(kMaxStackedHeads <= kBlockM, "a tile must hold at least one token");

// How a launch splits the work: GQA heads stacked per CTA and tokens per tile, and an upper bound on the
// tiles. Each run of L tokens makes ceil(L / tile_tokens) <= L / tile_tokens + 1 tiles; the lengths sum to T
// and there are at most S runs. Host code (the launcher and the tests/emu driver) shares it.
struct TileConfig {
  int head_chunks;    // CTAs per kv head along grid.y
  int heads_per_cta;  // stacked query heads per CTA (<= kMaxStackedHeads)
  int tile_tokens;    // tokens per tile: kBlockM / heads_per_cta (>= 8)
  int64_t max_tiles;  // grid.x
};

inline TileConfig tile_config(int num_q_heads, int num_kv_heads, int num_tokens, int num_segments) {
  TileConfig c;
  const int group = num_q_heads / num_kv_heads;
  c.head_chunks = ceil_div(group, kMaxStackedHeads);
  c.heads_per_cta = ceil_div(group, c.head_chunks);
  c.tile_tokens = kBlockM / c.heads_per_cta;
  c.max_tiles = ceil_div<int64_t>(num_tokens, c.tile_tokens) + num_segments;
  return c;
}

__device__ __forceinline__ int4 load_segment(const int32_t* seg, int i) {
  // Scalar loads: the table is only guaranteed 4-byte aligned.
  return make_int4(seg[4 * i], seg[4 * i + 1], seg[4 * i + 2], seg[4 * i + 3]);
}

// Segment i's cached keys (prefix_item_attention.h): (first, count, kind, 0); zeros without a cached table.
__device__ __forceinline__ int4 load_cached(const int32_t* cached, int i) {
  if (cached == nullptr) return make_int4(0, 0, 0, 0);
  return make_int4(cached[3 * i], cached[3 * i + 1], cached[3 * i + 2], 0);
}

// True when segment i extends the run of segment i - 1: it starts where i - 1 ends and sees the same prefix,
// cached keys included. Cached keys before a segment's own tokens are that segment's alone (every row of a tile
// sees the tile's cached keys), so such a segment is a run by itself.
__device__ __forceinline__ bool continues_run(const int32_t* seg, const int32_t* cached, int i) {
  if (i == 0) return false;
  const int4 a = load_segment(seg, i - 1);
  const int4 b = load_segment(seg, i);
  const int4 ca = load_cached(cached, i - 1);
  const int4 cb = load_cached(cached, i);
  if ((ca.y > 0 && ca.z == kCachedBeforeOwn) || (cb.y > 0 && cb.z == kCachedBeforeOwn)) return false;
  const bool same_cached = ca.y == cb.y && (ca.y == 0 || ca.x == cb.x);
  return b.x == a.x + a.y && b.w == a.w && (b.w == 0 || b.z == a.z) && same_cached;
}

struct MaxOp {
  __device__ __forceinline__ int operator()(int a, int b) const { return a > b ? a : b; }
};

// ---- planning ---------------------------------------------------------------------------------------------

constexpr int kPlanThreads = 1024;

// One block. Splits every run into tiles of `tile_tokens` tokens (the last one shorter) and writes one work
// entry per tile: (token begin, token end, prefix_start, prefix_length) and its cached blocks (first, count). A
// tile is listed by the segment that holds its first token, so the entries come out in table order. Two passes over the table, each a chunked
// block scan carrying its running value across chunks:
//   A: run head of every segment (inclusive max-scan of "i if i starts a run"), and each run's end token;
//   B: tiles starting inside each segment (exclusive sum-scan -> output offsets), then the entries.
__global__ void __launch_bounds__(kPlanThreads)
    plan_tiles_kernel(const int32_t* __restrict__ seg, const int32_t* __restrict__ cached, int num_segments,
                      int tile_tokens, int max_tiles, int* __restrict__ seg_head, int* __restrict__ run_end,
                      int4* __restrict__ work, int2* __restrict__ work_cached, int* __restrict__ num_work) {
  using Scan = cub::BlockScan<int, kPlanThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int carry;
  const int tid = threadIdx.x;

  if (tid == 0) carry = -1;
  __syncthreads();
  for (int base = 0; base < num_segments; base += kPlanThreads) {
    const int i = base + tid;
    const int is_head = (i < num_segments && !continues_run(seg, cached, i)) ? i : -1;
    int head;
    Scan(scan_storage).InclusiveScan(is_head, head, MaxOp());
    head = max(head, carry);  // segment 0 is always a head, so head >= 0 for every real i
    __syncthreads();          // all threads have read `carry` and are done with scan_storage
    if (tid == kPlanThreads - 1) carry = head;
    if (i < num_segments) {
      seg_head[i] = head;
      if (i == num_segments - 1 || !continues_run(seg, cached, i + 1)) {
        const int4 s = load_segment(seg, i);
        run_end[head] = s.x + s.y;
      }
    }
    __syncthreads();  // makes seg_head / run_end (global) and `carry` visible to the whole block
  }

  if (tid == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < num_segments; base += kPlanThreads) {
    const int i = base + tid;
    int count = 0, first = 0, run_start = 0, end = 0;
    int4 s = make_int4(0, 0, 0, 0);
    int4 c = make_int4(0, 0, 0, 0);
    if (i < num_segments) {
      s = load_segment(seg, i);
      c = load_cached(cached, i);
      const int head = seg_head[i];
      run_start = seg[4 * head];
      end = run_end[head];
      // Tile starts are run_start + k * tile_tokens; those inside [s.x, s.x + s.y) belong to this segment.
      first = ceil_div(s.x - run_start, tile_tokens);
      count = ceil_div(s.x + s.y - run_start, tile_tokens) - first;
    }
    int offset, total;
    Scan(scan_storage).ExclusiveSum(count, offset, total);
    offset += carry;
    __syncthreads();  // all threads have read `carry`
    if (tid == 0) carry += total;
    for (int j = 0; j < count; ++j) {
      if (offset + j >= max_tiles) break;  // only on a malformed table; the host bound covers valid ones
      const int begin = run_start + (first + j) * tile_tokens;
      work[offset + j] = make_int4(begin, min(begin + tile_tokens, end), s.z, s.w);
      work_cached[offset + j] = make_int2(c.x, c.y);
    }
    __syncthreads();
  }
  if (tid == 0) *num_work = min(carry, max_tiles);
}

// Start token of the segment holding each token (the lower end of the token's causal window).
__global__ void token_segment_start_kernel(const int32_t* __restrict__ seg, int num_segments, int num_tokens,
                                           int* __restrict__ tok_seg_start) {
  for (int i = blockIdx.x; i < num_segments; i += gridDim.x) {
    const int start = seg[4 * i], length = seg[4 * i + 1];
    for (int t = threadIdx.x; t < length; t += blockDim.x) {
      if (start + t < num_tokens) tok_seg_start[start + t] = start;
    }
  }
}

// ---- tensor-core attention ---------------------------------------------------------------------------------

template <int D>
constexpr int attention_smem_bytes() {
  return (kBlockM + 4 * kBlockN) * D * 2;  // Q + double-buffered K and V, 16-bit elements
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    prefix_item_attention_tc_kernel(PrefixItemAttentionParams p, const int4* __restrict__ work,
                                    const int2* __restrict__ work_cached, const int* __restrict__ num_work,
                                    const int* __restrict__ tok_seg_start, int heads_per_cta, int head_chunks) {
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  static_assert(sizeof(T) == 2, "tensor-core path is for 16-bit inputs");
  constexpr int kChunks = D / 8;  // 16-byte chunks per row

  if (static_cast<int>(blockIdx.x) >= *num_work) return;  // grid is an upper bound on the tiles

  PYSCORE_DYNAMIC_SMEM(smem);
  T* s_q = reinterpret_cast<T*>(smem);  // [kBlockM][D], swizzled
  T* s_k = s_q + kBlockM * D;           // [2][kBlockN][D]
  T* s_v = s_k + 2 * kBlockN * D;       // [2][kBlockN][D]
  __shared__ int s_row_token[kBlockM];  // -1: padding row (no token / head beyond the group)
  __shared__ int s_row_head[kBlockM];   // query head of the row
  __shared__ int s_row_lo[kBlockM];     // first key of the row's own segment

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int4 w = work[blockIdx.x];
  const int tok_begin = w.x, tok_end = w.y, prefix_start = w.z, prefix_len = w.w;
  const int2 wc = work_cached[blockIdx.x];  // cached blocks (first, count): key tiles before everything else
  const int group = p.num_q_heads / p.num_kv_heads;
  const int kv_head = blockIdx.y / head_chunks;
  const int head_base = (blockIdx.y % head_chunks) * heads_per_cta;  // first stacked head, within the group
  const int rows_used = (kBlockM / heads_per_cta) * heads_per_cta;

  // Row r = (token tok_begin + r / heads_per_cta, head head_base + r % heads_per_cta of this kv head's group).
  if (tid < kBlockM) {
    const int r = tid;
    const int tok = tok_begin + r / heads_per_cta;
    const int local_head = head_base + r % heads_per_cta;
    const bool valid = r < rows_used && tok < tok_end && local_head < group;
    s_row_token[r] = valid ? tok : -1;
    s_row_head[r] = kv_head * group + local_head;
    s_row_lo[r] = valid ? tok_seg_start[tok] : 0;
  }
  __syncthreads();

  // Row 0 is always valid (tok_begin < tok_end, head_base < group) and holds the run's earliest segment start.
  const int own_lo = s_row_lo[0];
  const int own_hi = tok_end;  // exclusive
  // Key tiles in order: cached (whole tiles, every key visible to every row), prefix, own. Cached keys come
  // first whatever they lead (a prefix or a causal sequence), which is where they sit in a run without the cache.
  const int tiles_per_block = p.block_tokens / kBlockN;
  const int n_cached = wc.y * tiles_per_block;
  const int n_prefix = n_cached + ceil_div(prefix_len, kBlockN);
  const int n_tiles = n_prefix + ceil_div(own_hi - own_lo, kBlockN);
  auto tile_first_key = [&](int n) {
    return n < n_prefix ? prefix_start + (n - n_cached) * kBlockN : own_lo + (n - n_prefix) * kBlockN;
  };

  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);

  for (int idx = tid; idx < kBlockM * kChunks; idx += kThreads) {
    const int r = idx / kChunks, c = (idx % kChunks) * 8;
    const int tok = s_row_token[r];
    const T* src = tok >= 0 ? q + tok * p.q_token_stride + s_row_head[r] * p.q_head_stride + c : q;
    cp_async_16(s_q + swizzle<D>(r, c), src, tok >= 0);
  }
  // Keys outside the tile's range are zero-filled: their probabilities are 0 and 0 * garbage could be NaN.
  auto load_kv = [&](int n, int buf) {
    T* dk = s_k + buf * kBlockN * D;
    T* dv = s_v + buf * kBlockN * D;
    if (n < n_cached) {  // one whole tile of a cached block
      const int64_t at = int64_t(p.cached_blocks[wc.x + n / tiles_per_block]) * p.cache_block_stride +
                         int64_t(n % tiles_per_block) * kBlockN * p.cache_token_stride + kv_head * p.cache_head_stride;
      const T* ck = static_cast<const T*>(p.cache_k) + at;
      const T* cv = static_cast<const T*>(p.cache_v) + at;
      for (int idx = tid; idx < kBlockN * kChunks; idx += kThreads) {
        const int r = idx / kChunks, c = (idx % kChunks) * 8;
        cp_async_16(dk + swizzle<D>(r, c), ck + r * p.cache_token_stride + c, true);
        cp_async_16(dv + swizzle<D>(r, c), cv + r * p.cache_token_stride + c, true);
      }
      return;
    }
    const int key0 = tile_first_key(n);
    const int key_end = n < n_prefix ? prefix_start + prefix_len : own_hi;
    for (int idx = tid; idx < kBlockN * kChunks; idx += kThreads) {
      const int r = idx / kChunks, c = (idx % kChunks) * 8;
      const int key = key0 + r;
      const bool valid = key < key_end;
      const T* src_k = valid ? k + key * p.k_token_stride + kv_head * p.k_head_stride + c : k;
      const T* src_v = valid ? v + key * p.v_token_stride + kv_head * p.v_head_stride + c : v;
      cp_async_16(dk + swizzle<D>(r, c), src_k, valid);
      cp_async_16(dv + swizzle<D>(r, c), src_v, valid);
    }
  };
  load_kv(0, 0);
  cp_async_commit();  // group 0: Q and the first K/V tile

  // This thread's two rows: warp * 16 + lane / 4 (fragment elements 0, 1) and that + 8 (elements 2, 3).
  const int row_a = warp * 16 + lane / 4;
  int row_lo[2], row_hi[2];  // inclusive window of own-run keys; padding rows see everything (finite, unused)
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = row_a + 8 * i;
    const bool valid = s_row_token[r] >= 0;
    row_lo[i] = valid ? s_row_lo[r] : INT_MIN;
    row_hi[i] = valid ? s_row_token[r] : INT_MAX;
  }
  const float scale_log2 = p.scale * kLog2e;  // scores kept in log2 units so exp2 is one instruction

  uint32_t q_frag[D / 16][4];
  float o_acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) o_acc[j][0] = o_acc[j][1] = o_acc[j][2] = o_acc[j][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.f, 0.f};  // this thread's partial row sums; the quad sum happens once at the end

  for (int n = 0; n < n_tiles; ++n) {
    const int buf = n & 1;
    if (n + 1 < n_tiles) {
      load_kv(n + 1, buf ^ 1);  // buf ^ 1 was last read in iteration n - 1, which ended with __syncthreads
      cp_async_commit();
      cp_async_wait<1>();  // everything but the tile just issued has landed
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    if (n == 0) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        ldmatrix_x4(q_frag[kk], s_q + swizzle<D>(warp * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8));
      }
    }

    // S = Q K^T: B[k][n] = K[key n][dim k], i.e. K rows as stored, no transpose. One ldmatrix.x4 covers 16
    // keys x 16 dims: matrices (keys 0-7, dims 0-7), (keys 0-7, dims 8-15), (keys 8-15, dims 0-7), (8-15, 8-15).
    const T* k_tile = s_k + buf * kBlockN * D;
    float s[kBlockN / 8][4];
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int nb = 0; nb < kBlockN / 16; ++nb) {
        const int mat = lane >> 3;
        const int key = nb * 16 + (mat >> 1) * 8 + (lane & 7);
        const int col = kk * 16 + (mat & 1) * 8;
        uint32_t b[4];
        ldmatrix_x4(b, k_tile + swizzle<D>(key, col));
        mma_16816<T>(s[2 * nb], q_frag[kk], b[0], b[1]);
        mma_16816<T>(s[2 * nb + 1], q_frag[kk], b[2], b[3]);
      }
    }

    // Scale and mask. Element e of s[j] is (row_a + 8 * (e >> 1), key0 + 8 j + 2 (lane % 4) + (e & 1)).
    const int key0 = tile_first_key(n);
    const bool cached_tile = n < n_cached;
    const bool prefix_tile = n < n_prefix;
    const int prefix_end = prefix_start + prefix_len;
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + j * 8 + 2 * (lane & 3) + (e & 1);
        const int i = e >> 1;
        const bool visible =
            cached_tile || (prefix_tile ? key < prefix_end : (key >= row_lo[i] && key <= row_hi[i]));
        s[j][e] = visible ? s[j][e] * scale_log2 : -INFINITY;
      }
    }

    // Online softmax. A row can have no visible key in this tile (and none before it, e.g. the first rows of
    // a later segment against an earlier segment's keys): its max stays -inf, so subtract 0 instead to get
    // p = 0 and alpha = 0 rather than NaN from -inf - (-inf).
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * i], s[j][2 * i + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));  // the 4 lanes of a quad share the row
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run[i], mx);
      const float base = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = exp2f(m_run[i] - base);
      m_run[i] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
        s[j][2 * i] = exp2f(s[j][2 * i] - base);
        s[j][2 * i + 1] = exp2f(s[j][2 * i + 1] - base);
        sum += s[j][2 * i] + s[j][2 * i + 1];
      }
      l_run[i] = l_run[i] * alpha + sum;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        o_acc[j][2 * i] *= alpha;
        o_acc[j][2 * i + 1] *= alpha;
      }
    }

    // O += P V. The S accumulators of key tiles 2kc and 2kc+1 are exactly the A fragment of P for keys
    // [16kc, 16kc+16). B[k][n] = V[key k][dim n] needs the transpose of V as stored: ldmatrix.trans with
    // matrices (keys 0-7, dims 0-7), (keys 8-15, dims 0-7), (keys 0-7, dims 8-15), (keys 8-15, dims 8-15).
    const T* v_tile = s_v + buf * kBlockN * D;
#pragma unroll
    for (int kc = 0; kc < kBlockN / 16; ++kc) {
      const uint32_t a[4] = {pack2<T>(s[2 * kc][0], s[2 * kc][1]), pack2<T>(s[2 * kc][2], s[2 * kc][3]),
                             pack2<T>(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                             pack2<T>(s[2 * kc + 1][2], s[2 * kc + 1][3])};
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        const int mat = lane >> 3;
        const int key = kc * 16 + (mat & 1) * 8 + (lane & 7);
        const int col = dp * 16 + (mat >> 1) * 8;
        uint32_t b[4];
        ldmatrix_x4_trans(b, v_tile + swizzle<D>(key, col));
        mma_16816<T>(o_acc[2 * dp], a, b[0], b[1]);
        mma_16816<T>(o_acc[2 * dp + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // the next iteration's prefetch overwrites this buffer
  }

  T* o = static_cast<T*>(p.o);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float l = l_run[i];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = l > 0.f ? 1.f / l : 0.f;  // every real row sees at least its own token, so l > 0
    const int r = row_a + 8 * i;
    const int tok = s_row_token[r];
    if (tok < 0) continue;
    T* dst = o + tok * p.o_token_stride + s_row_head[r] * p.o_head_stride + 2 * (lane & 3);
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      *reinterpret_cast<uint32_t*>(dst + j * 8) = pack2<T>(o_acc[j][2 * i] * inv, o_acc[j][2 * i + 1] * inv);
    }
  }
}

// ---- simple path -----------------------------------------------------------------------------------------

constexpr int kSimpleWarps = 4;

// grid (segment, query head); each warp takes tokens of the segment in turn. Lane l holds dims l, l + 32, ...
template <typename T, int D>
__global__ void __launch_bounds__(kSimpleWarps * 32)
    prefix_item_attention_simple_kernel(PrefixItemAttentionParams p) {
  static_assert(D % 32 == 0, "lanes split head_dim evenly");
  constexpr int kPerLane = D / 32;
  const int4 s = load_segment(p.segments, blockIdx.x);
  const int head = blockIdx.y;
  const int kv_head = head / (p.num_q_heads / p.num_kv_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k) + kv_head * p.k_head_stride;
  const T* v = static_cast<const T*>(p.v) + kv_head * p.v_head_stride;
  T* o = static_cast<T*>(p.o);
  // log2 units: exp2f is a single ex2.approx (2 ulp) under --use_fast_math, while __expf's error grows with |x|.
  const float scale_log2 = p.scale * kLog2e;

  for (int t = s.x + warp; t < s.x + s.y; t += kSimpleWarps) {
    const T* qr = q + t * p.q_token_stride + head * p.q_head_stride;
    float qv[kPerLane], acc[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      qv[i] = to_float(qr[lane + 32 * i]) * scale_log2;
      acc[i] = 0.f;
    }
    float m = -INFINITY, l = 0.f;  // running max (log2 units) and sum
    auto visit_row = [&](const T* kr, const T* vr) {
      float dot = 0.f;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) dot += qv[i] * to_float(kr[lane + 32 * i]);
      dot = warp_sum(dot);  // every lane gets the score
      const float m_new = fmaxf(m, dot);
      const float alpha = exp2f(m - m_new);  // m = -inf on the first key: alpha = 0
      const float prob = exp2f(dot - m_new);
      l = l * alpha + prob;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) acc[i] = acc[i] * alpha + prob * to_float(vr[lane + 32 * i]);
      m = m_new;
    };
    auto visit = [&](int key) { visit_row(k + key * p.k_token_stride, v + key * p.v_token_stride); };
    // Cached keys first (prefix_item_attention.h: where they sit without the cache), then the prefix, then the own tokens.
    const int4 c = load_cached(p.cached, blockIdx.x);
    for (int b = 0; b < c.y; ++b) {
      const int64_t at = int64_t(p.cached_blocks[c.x + b]) * p.cache_block_stride + kv_head * p.cache_head_stride;
      for (int j = 0; j < p.block_tokens; ++j) {
        visit_row(static_cast<const T*>(p.cache_k) + at + j * p.cache_token_stride,
                  static_cast<const T*>(p.cache_v) + at + j * p.cache_token_stride);
      }
    }
    for (int key = s.z; key < s.z + s.w; ++key) visit(key);
    for (int key = s.x; key <= t; ++key) visit(key);
    T* dst = o + t * p.o_token_stride + head * p.o_head_stride;
    const float inv = 1.f / l;  // l >= 1: the row's max contributes e^0
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) dst[lane + 32 * i] = from_float<T>(acc[i] * inv);
  }
}

}  // namespace attention_cuda
}  // namespace pyscore
