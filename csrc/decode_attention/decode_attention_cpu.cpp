// CPU decode_attention (contract in decode_attention.h): keys read through each sequence's block table, a unit's chunk as
// tiles of kCpuKeyTile keys, each inside one page. Work units are (sequence, kv head, chunk of kDecodeChunk keys); a
// unit's rows are the GQA query heads of its kv head (the keys are read once for all of them). Units run on OpenMP
// threads (a chunk's kv heads in turn on one thread where chunks are many); a sequence with several chunks gets its
// partial states merged by log-sum-exp in chunk order, so its bits depend on its own length only, never on the
// batch or the thread count. When new keys / values are given they are written into the caches first (one pass,
// before any unit reads). The arithmetic lives in DecodeCpuOps: the kernel text decode_attention_simd.h on the running
// tier's vector layer (avx512, avx2 or neon), else the portable loops below.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/bf16.h"
#include "common/cpu_features.h"
#include "common/merge_state_cpu.h"
#include "common/threads.h"
#include "common/vec_portable.h"
#include "decode_attention/decode_attention.h"

namespace pyscore {
namespace {

// ---- portable ops ----------------------------------------------------------------------------------------------

// Two-pass softmax per row in loops the compiler vectorizes (common/vec_portable.h; NEON on aarch64).
template <class T>
void attend_portable(const void* q_, int64_t q_row_stride, int32_t rows, const void* const* k_tiles,
                     const void* const* v_tiles, int64_t token_stride, int32_t num_keys, int32_t head_dim, float scale,
                     float* o, float* lse) {
  const T* q = static_cast<const T*>(q_);
  auto key = [&](const void* const* tiles, int32_t t) {
    return static_cast<const T*>(tiles[t / kCpuKeyTile]) + (t % kCpuKeyTile) * token_stride;
  };
  std::vector<float> s(num_keys);
  for (int32_t r = 0; r < rows; ++r) {
    const T* qr = q + r * q_row_stride;
    for (int32_t t = 0; t < num_keys; ++t) s[t] = dot_portable(qr, key(k_tiles, t), head_dim) * scale;
    const float mx = max_portable(s.data(), num_keys, -std::numeric_limits<float>::infinity());
    const float sum = exp_sum_inplace(s.data(), num_keys, mx);
    float* orow = o + int64_t(r) * head_dim;
    std::fill(orow, orow + head_dim, 0.0f);
    for (int32_t t = 0; t < num_keys; ++t) {
      const T* vt = key(v_tiles, t);
      for (int32_t d = 0; d < head_dim; ++d) orow[d] += s[t] * to_f32(vt[d]);
    }
    for (int32_t d = 0; d < head_dim; ++d) orow[d] /= sum;
    lse[r] = mx + std::log(sum);
  }
}

template <class T>
void store_row_portable(const float* src, int32_t dim, void* dst) {
  for (int32_t d = 0; d < dim; ++d) store_f32(static_cast<T*>(dst) + d, src[d]);
}

const DecodeCpuOps kPortableBf16{attend_portable<uint16_t>, store_row_portable<uint16_t>};
const DecodeCpuOps kPortableF32{attend_portable<float>, store_row_portable<float>};

// The running tier's layer (common/dispatch.h); the AVX-512 ops' fp32 is 1.5-1.7x the AVX2 ops at tier avx512
// (bench/results/tiers/kernels/attention_avx512_fp32_ab.txt).
const DecodeCpuOps& choose_ops(DType dtype, int32_t head_dim) {
  KernelKey key;
  key.dtype = dtype, key.head_dim = head_dim;
  if (const DecodeCpuOps* fast = select_kernel<decode_ops_kernels>(key)) return *fast;
  return dtype == DType::kBFloat16 ? kPortableBf16 : kPortableF32;
}

// ---- plan and run ----------------------------------------------------------------------------------------------

size_t elem_size(DType dtype) { return dtype == DType::kBFloat16 ? 2 : 4; }

int32_t chunks_of(int32_t length) { return (length + kDecodeChunk - 1) / kDecodeChunk; }

// Element address helpers (offsets in elements, scaled by the element size).
const char* at(const void* base, int64_t elems, size_t elem) { return static_cast<const char*>(base) + elems * elem; }
char* at(void* base, int64_t elems, size_t elem) { return static_cast<char*>(base) + elems * elem; }

// Element offset of key `token` of kv head h of sequence b in this layer, from k_pool / v_pool.
int64_t cache_offset(const DecodeAttentionParams& p, int32_t b, int32_t h, int32_t token) {
  const int64_t page = p.block_table[b * p.block_table_stride + token / p.block_tokens];
  return page * p.block_stride + p.layer * p.layer_stride + (token % p.block_tokens) * p.token_stride +
         h * p.head_stride;
}

void write_new_token(const DecodeAttentionParams& p, int32_t b, int32_t h) {
  const size_t elem = elem_size(p.dtype);
  const int64_t src = b * p.new_seq_stride + h * p.new_head_stride;
  const int64_t dst = cache_offset(p, b, h, p.lengths[b] - 1);
  std::memcpy(at(const_cast<void*>(p.k_pool), dst, elem), at(p.k_new, src, elem), p.head_dim * elem);
  std::memcpy(at(const_cast<void*>(p.v_pool), dst, elem), at(p.v_new, src, elem), p.head_dim * elem);
}

struct Unit {
  int32_t seq, kv_head, chunk;
  int64_t scratch_row;  // first row of this unit's partial state in the scratch (multi-chunk sequences), or -1
};

// Units go sequence by sequence, chunk by chunk, kv head by kv head: a chunk's heads are num_kv_heads consecutive
// units, which one thread runs in turn where there are enough chunks (see decode_attention_cpu).
struct Plan {
  std::vector<Unit> units;
  std::vector<int64_t> first_unit;  // per (sequence, kv head): index of its chunk 0 unit (chunk c: + c * kv heads)
  int64_t scratch_rows = 0;
};

Plan make_plan(const DecodeAttentionParams& p, int32_t group) {
  Plan plan;
  for (int32_t b = 0; b < p.num_seqs; ++b) {
    const int32_t chunks = chunks_of(p.lengths[b]);
    for (int32_t h = 0; h < p.num_kv_heads; ++h) plan.first_unit.push_back(int64_t(plan.units.size()) + h);
    for (int32_t c = 0; c < chunks; ++c)
      for (int32_t h = 0; h < p.num_kv_heads; ++h) {
        plan.units.push_back({b, h, c, chunks > 1 ? plan.scratch_rows : -1});
        if (chunks > 1) plan.scratch_rows += group;
      }
  }
  return plan;
}

struct Scratch {
  std::vector<float> o, lse;  // single-chunk units' states (per thread)
};

void store_rows(const DecodeAttentionParams& p, const DecodeCpuOps& ops, int32_t b, int32_t h, int32_t group,
                const float* o) {
  const size_t elem = elem_size(p.dtype);
  for (int32_t r = 0; r < group; ++r)
    ops.store_row(o + int64_t(r) * p.head_dim, p.head_dim,
                  at(p.o, b * p.o_seq_stride + (int64_t(h) * group + r) * p.o_head_stride, elem));
}

void run_unit(const DecodeAttentionParams& p, const DecodeCpuOps& ops, const Unit& u, int32_t group, float* o_parts,
              float* lse_parts, Scratch& local) {
  const size_t elem = elem_size(p.dtype);
  const int32_t key0 = u.chunk * kDecodeChunk, keys = std::min(kDecodeChunk, p.lengths[u.seq] - key0);
  // The chunk's key tiles, each inside one page.
  const void* k_tiles[kDecodeChunk / kCpuKeyTile];
  const void* v_tiles[kDecodeChunk / kCpuKeyTile];
  for (int32_t t = 0; t * kCpuKeyTile < keys; ++t) {
    const int64_t kv = cache_offset(p, u.seq, u.kv_head, key0 + t * kCpuKeyTile);
    k_tiles[t] = at(p.k_pool, kv, elem);
    v_tiles[t] = at(p.v_pool, kv, elem);
  }
  const void* q = at(p.q, u.seq * p.q_seq_stride + int64_t(u.kv_head) * group * p.q_head_stride, elem);
  float* o = u.scratch_row >= 0 ? o_parts + u.scratch_row * p.head_dim : local.o.data();
  float* lse = u.scratch_row >= 0 ? lse_parts + u.scratch_row : local.lse.data();
  ops.attend(q, p.q_head_stride, group, k_tiles, v_tiles, p.token_stride, keys, p.head_dim, p.scale, o, lse);
  if (u.scratch_row < 0) store_rows(p, ops, u.seq, u.kv_head, group, o);
}

// Chunk partial states of one (sequence, kv head), merged into chunk 0's in chunk order, then stored; its chunk c
// is units[c * stride].
void merge_chunks(const DecodeAttentionParams& p, const DecodeCpuOps& ops, const Unit* units, int32_t chunks,
                  int32_t stride, int32_t group, float* o_parts, float* lse_parts) {
  float* o0 = o_parts + units[0].scratch_row * p.head_dim;
  float* lse0 = lse_parts + units[0].scratch_row;
  for (int32_t c = 1; c < chunks; ++c) {
    const Unit& u = units[int64_t(c) * stride];
    merge_state(o0, lse0, o_parts + u.scratch_row * p.head_dim, lse_parts + u.scratch_row, group, p.head_dim, o0,
                lse0);
  }
  store_rows(p, ops, units[0].seq, units[0].kv_head, group, o0);
}

Status check_params(const DecodeAttentionParams& p) {
  if (p.dtype != DType::kFloat32 && p.dtype != DType::kBFloat16) return kUnsupportedDType;
  if (p.head_dim <= 0 || (p.dtype == DType::kBFloat16 && p.head_dim % 2)) return kUnsupportedHeadDim;
  if (p.num_seqs < 0 || p.num_q_heads <= 0 || p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads || p.layer < 0)
    return kInvalidArgument;
  if (p.num_seqs == 0) return kOk;
  if (!p.q || !p.o || !p.k_pool || !p.v_pool || !p.block_table || !p.lengths || (!p.k_new != !p.v_new))
    return kInvalidArgument;
  if (p.block_tokens <= 0 || p.block_tokens % kCpuKeyTile) return kInvalidArgument;
  for (int32_t b = 0; b < p.num_seqs; ++b)
    if (p.lengths[b] < 1 || p.lengths[b] > p.max_length || p.lengths[b] > p.block_table_stride * p.block_tokens)
      return kInvalidArgument;
  return kOk;
}

}  // namespace

Status decode_attention_cpu(const DecodeAttentionParams& p) {
  Status status = check_params(p);
  if (status != kOk || p.num_seqs == 0) return status;
  const DecodeCpuOps& ops = choose_ops(p.dtype, p.head_dim);
  const int32_t group = p.num_q_heads / p.num_kv_heads;
  const Plan plan = make_plan(p, group);
  std::vector<float> o_parts(size_t(plan.scratch_rows) * p.head_dim), lse_parts(plan.scratch_rows);
  const int64_t num_units = int64_t(plan.units.size()), heads = int64_t(p.num_seqs) * p.num_kv_heads;
  const int64_t num_chunks = num_units / p.num_kv_heads;

#pragma omp parallel num_threads(kernel_threads())
  {
    Scratch local;
    local.o.resize(size_t(group) * p.head_dim);
    local.lse.resize(group);
    if (p.k_new) {
#pragma omp for schedule(static)
      for (int64_t i = 0; i < heads; ++i) write_new_token(p, int32_t(i / p.num_kv_heads), int32_t(i % p.num_kv_heads));
      // (implicit barrier: the new tokens are in the caches before any unit reads them)
    }
    // A chunk's kv heads in turn on one thread, instead of units dealt out one by one (which puts the heads of a
    // page, a head's 128 or 256 bytes a token apart, on both cores at once; why that reads slower is not measured,
    // this VM has no counters: bench/results/tiers/probes/decode_attention_memory_probes.txt). One layer's call at 8-32
    // generations of ~330 keys, tree against tree on a Zen 4: neutral at avx512bf16, up to 1.3x at avx2
    // (bench/results/tiers/kernels/decode_attention_heads_together.txt). With fewer chunks than two per thread the
    // units go one by one, so that a few long sequences still use every thread. Bits are the same either way.
    const int64_t together = num_chunks >= 2 * int64_t(omp_get_num_threads()) ? p.num_kv_heads : 1;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_units / together; ++i)
      for (int64_t j = i * together; j < (i + 1) * together; ++j)
        run_unit(p, ops, plan.units[j], group, o_parts.data(), lse_parts.data(), local);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < heads; ++i) {
      const int32_t chunks = chunks_of(p.lengths[i / p.num_kv_heads]);
      if (chunks > 1)
        merge_chunks(p, ops, &plan.units[plan.first_unit[i]], chunks, p.num_kv_heads, group, o_parts.data(),
                     lse_parts.data());
    }
  }
  return kOk;
}

}  // namespace pyscore
