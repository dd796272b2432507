// Runs the CUDA kernels of csrc/ under the host emulator (cuda_emu.h) against float64 references and prints one
// line per case; exits non-zero on the first mismatch. Built and run by tests/ops/test_cuda_emulation.py:
//   g++ -std=c++20 -O1 -pthread -include tests/emu/cuda_emu.h -Itests/emu/include -Icsrc tests/emu/emu_check.cpp
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "decode_attention/decode_attention_kernels.cuh"
#include "gated_delta_rule/gated_delta_rule_kernels.cuh"
#include "label_logprobs/label_logprobs_kernels.cuh"
#include "prefix_item_attention/prefix_item_attention_kernels.cuh"

using namespace pyscore;

namespace {

int g_failures = 0;

void report(const std::string& name, double max_err, double mean_err, double max_tol, double mean_tol) {
  const bool ok = max_err <= max_tol && mean_err <= mean_tol;  // NaN fails both
  std::printf("%-4s %-60s max %.3g (tol %.3g) mean %.3g (tol %.3g)\n", ok ? "ok" : "FAIL", name.c_str(), max_err,
              max_tol, mean_err, mean_tol);
  std::fflush(stdout);
  if (!ok) ++g_failures;
}

template <typename T>
T to_t(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else {
    return __float2half_rn(x);
  }
}
template <typename T>
double to_d(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(x);
  } else {
    return __half2float(x);
  }
}

// ---- prefix_item_attention -----------------------------------------------------------------------------------

struct Segment {
  int start, length, prefix_start, prefix_length;
  int cached_first = 0, cached_count = 0, cached_kind = kCachedBeforeOwn;  // prefix_item_attention.h
};

// A packed stream: each group is a prefix (0 = plain causal sequences) followed by item lengths, optionally
// preceded by `cached` blocks of a block pool. An MIS group (a prefix, or `shared` cached blocks and no
// prefix: a fully cached one) lists its prefix row (cached blocks before its own tokens), then its items (cached
// blocks before the prefix); otherwise every length is its own causal sequence with `cached` blocks of its own.
struct Group {
  int prefix;
  std::vector<int> items;
  int cached = 0;
  bool shared = false;
};

// Cached blocks are numbered in order of use; entry b of the list is pool block (7 * b + 3) % pool_blocks, so
// the list is not the identity and some pool blocks stay unused.
struct Stream {
  std::vector<Segment> segs;
  std::vector<int32_t> cached_blocks;
  int pool_blocks = 1;
};

Stream pack(const std::vector<Group>& groups, int pool_blocks = 1) {
  Stream out;
  out.pool_blocks = pool_blocks;
  auto take = [&](int count) {
    const int first = int(out.cached_blocks.size());
    for (int b = 0; b < count; ++b) out.cached_blocks.push_back((7 * (first + b) + 3) % pool_blocks);
    return first;
  };
  int t = 0;
  for (const Group& g : groups) {
    if (g.prefix > 0 || g.shared) {
      const int first = g.cached > 0 ? take(g.cached) : 0;
      const int p0 = t;
      if (g.prefix > 0) out.segs.push_back({t, g.prefix, 0, 0, first, g.cached, kCachedBeforeOwn});
      t += g.prefix;
      for (int len : g.items) {
        out.segs.push_back({t, len, g.prefix > 0 ? p0 : 0, g.prefix, first, g.cached, kCachedBeforePrefix});
        t += len;
      }
    } else {
      for (int len : g.items) {
        const int first = g.cached > 0 ? take(g.cached) : 0;
        out.segs.push_back({t, len, 0, 0, first, g.cached, kCachedBeforeOwn});
        t += len;
      }
    }
  }
  return out;
}

template <typename T, int D>
void check_attention(const std::string& name, const Stream& stream, int hq, int hkv, bool tensor_cores,
                     uint32_t seed, int block_tokens = 64) {
  const std::vector<Segment>& segs = stream.segs;
  int num_tokens = 0;
  for (const Segment& s : segs) num_tokens = std::max(num_tokens, s.start + s.length);
  const int num_segments = int(segs.size());
  // Padded token strides (multiples of 8 elements keep rows 16-byte aligned) exercise the stride arithmetic.
  const int64_t q_ts = int64_t(hq) * D + 8, kv_ts = int64_t(hkv) * D + 16, o_ts = int64_t(hq) * D + 8;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  auto fill = [&](std::vector<T>& x, size_t n, float scale) {
    x.resize(n);
    for (auto& e : x) e = to_t<T>(normal(rng) * scale);
  };
  std::vector<T> q, k, v;
  fill(q, num_tokens * q_ts, 1.5f);
  fill(k, num_tokens * kv_ts, 1.5f);
  fill(v, num_tokens * kv_ts, 1.f);
  const T sentinel = to_t<T>(12345.f);
  std::vector<T> o(num_tokens * o_ts, sentinel);
  std::vector<int32_t> table, cached_table;
  bool any_cached = false;
  for (const Segment& s : segs) {
    table.insert(table.end(), {s.start, s.length, s.prefix_start, s.prefix_length});
    cached_table.insert(cached_table.end(), {s.cached_first, s.cached_count, s.cached_kind});
    any_cached |= s.cached_count > 0;
  }
  // The block pool: [pool_blocks][block_tokens][hkv][D] with a padded token stride, K and V apart.
  const int64_t c_ts = int64_t(hkv) * D + 8, c_bs = block_tokens * c_ts + 24;
  std::vector<T> cache_k, cache_v;
  fill(cache_k, stream.pool_blocks * c_bs, 1.5f);
  fill(cache_v, stream.pool_blocks * c_bs, 1.f);

  PrefixItemAttentionParams p{};
  p.q = q.data();
  p.k = k.data();
  p.v = v.data() + 0;
  p.o = o.data();
  p.q_token_stride = q_ts, p.q_head_stride = D;
  p.k_token_stride = kv_ts, p.k_head_stride = D;
  p.v_token_stride = kv_ts, p.v_head_stride = D;
  p.o_token_stride = o_ts, p.o_head_stride = D;
  p.segments = table.data();
  p.num_segments = num_segments;
  p.num_tokens = num_tokens;
  p.num_q_heads = hq;
  p.num_kv_heads = hkv;
  p.head_dim = D;
  p.scale = 1.f / std::sqrt(float(D));
  if (any_cached) {
    p.cached = cached_table.data();
    p.cached_blocks = stream.cached_blocks.data();
    p.num_cached_blocks = int(stream.cached_blocks.size());
    p.block_tokens = block_tokens;
    p.cache_k = cache_k.data();
    p.cache_v = cache_v.data();
    p.cache_block_stride = c_bs, p.cache_token_stride = c_ts, p.cache_head_stride = D;
  }

  using namespace attention_cuda;
  if (tensor_cores) {
    if constexpr (sizeof(T) == 2 && D <= 128) {  // the tensor-core kernel's tiles cover head dims up to 128
      const TileConfig cfg = tile_config(hq, hkv, num_tokens, num_segments);
      const int max_tiles = int(cfg.max_tiles);
      std::vector<int4> work(max_tiles, int4{-1, -1, -1, -1});
      std::vector<int2> work_cached(max_tiles, int2{-1, -1});
      std::vector<int> seg_head(num_segments, -7), run_end(num_segments, -7), tok_seg_start(num_tokens, -7);
      int num_work = -7;
      emu::launch(dim3(1), dim3(kPlanThreads), 0, [&] {
        plan_tiles_kernel(table.data(), p.cached, num_segments, cfg.tile_tokens, max_tiles, seg_head.data(),
                          run_end.data(), work.data(), work_cached.data(), &num_work);
      });
      emu::launch(dim3(std::min(num_segments, 4096)), dim3(128), 0, [&] {
        token_segment_start_kernel(table.data(), num_segments, num_tokens, tok_seg_start.data());
      });
      // Tiles must cover every token exactly once.
      std::vector<int> covered(num_tokens, 0);
      for (int i = 0; i < num_work; ++i) {
        for (int t = work[i].x; t < work[i].y; ++t) covered[t] += 1;
        if (work[i].y - work[i].x > cfg.tile_tokens || work[i].y <= work[i].x) {
          std::printf("FAIL %s: bad tile [%d, %d)\n", name.c_str(), work[i].x, work[i].y);
          ++g_failures;
        }
      }
      for (int t = 0; t < num_tokens; ++t) {
        if (covered[t] != 1) {
          std::printf("FAIL %s: token %d covered %d times by %d tiles\n", name.c_str(), t, covered[t], num_work);
          ++g_failures;
          return;
        }
      }
      emu::launch(dim3(max_tiles, hkv * cfg.head_chunks), dim3(kThreads), attention_smem_bytes<D>(), [&] {
        prefix_item_attention_tc_kernel<T, D>(p, work.data(), work_cached.data(), &num_work, tok_seg_start.data(),
                                              cfg.heads_per_cta, cfg.head_chunks);
      });
    }
  } else {
    emu::launch(dim3(num_segments, hq), dim3(kSimpleWarps * 32), 0,
                [&] { prefix_item_attention_simple_kernel<T, D>(p); });
  }

  // float64 reference over the inputs as stored.
  const int group = hq / hkv;
  double max_err = 0, sum_err = 0;
  int64_t count = 0;
  for (const Segment& s : segs) {
    for (int t = s.start; t < s.start + s.length; ++t) {
      for (int h = 0; h < hq; ++h) {
        const int kvh = h / group;
        // Every key the token sees, as (K row, V row) pointers: cached, prefix, own up to itself.
        std::vector<std::pair<const T*, const T*>> keys;
        for (int j = 0; j < s.cached_count * block_tokens; ++j) {
          const int64_t at = int64_t(stream.cached_blocks[s.cached_first + j / block_tokens]) * c_bs +
                             (j % block_tokens) * c_ts + kvh * D;
          keys.push_back({cache_k.data() + at, cache_v.data() + at});
        }
        for (int j = s.prefix_start; j < s.prefix_start + s.prefix_length; ++j)
          keys.push_back({k.data() + j * kv_ts + kvh * D, v.data() + j * kv_ts + kvh * D});
        for (int j = s.start; j <= t; ++j)
          keys.push_back({k.data() + j * kv_ts + kvh * D, v.data() + j * kv_ts + kvh * D});
        std::vector<double> w(keys.size());
        double mx = -1e300;
        for (size_t i = 0; i < keys.size(); ++i) {
          double dot = 0;
          for (int d = 0; d < D; ++d) dot += to_d(q[t * q_ts + h * D + d]) * to_d(keys[i].first[d]);
          w[i] = dot * p.scale;
          mx = std::max(mx, w[i]);
        }
        double denom = 0;
        for (double& x : w) denom += (x = std::exp(x - mx));
        for (int d = 0; d < D; ++d) {
          double ref = 0;
          for (size_t i = 0; i < keys.size(); ++i) ref += w[i] * to_d(keys[i].second[d]);
          ref /= denom;
          const double err = std::fabs(to_d(o[t * o_ts + h * D + d]) - ref);
          max_err = std::max(max_err, std::isnan(err) ? INFINITY : err);
          sum_err += err;
          ++count;
        }
      }
      for (int e = hq * D; e < o_ts; ++e) {  // padding between tokens must stay untouched
        if (to_d(o[t * o_ts + e]) != to_d(sentinel)) max_err = INFINITY;
      }
    }
  }
  const bool exact = std::is_same_v<T, float>;
  report(name, max_err, sum_err / double(count), exact ? 1e-5 : 3e-2, exact ? 1e-6 : 4e-3);
}

// ---- label_logprobs ---------------------------------------------------------------------------------------------

enum class LmPath { kTensorCores, kSimple, kLogits };

template <typename T>
void check_labels(const std::string& name, int rows, int hidden_size, int vocab, int num_labels, LmPath path,
                  uint32_t seed) {
  using namespace label_cuda;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  const bool logits_given = path == LmPath::kLogits;
  const int width = logits_given ? vocab : hidden_size;
  const int64_t h_stride = width + 8, w_stride = hidden_size + 8;
  std::vector<T> hidden(rows * h_stride), weight(logits_given ? 0 : vocab * w_stride);
  for (auto& e : hidden) e = to_t<T>(normal(rng) * (logits_given ? 3.f : 1.f));
  for (auto& e : weight) e = to_t<T>(normal(rng) * 0.2f);
  std::vector<int32_t> labels(rows * num_labels);
  std::uniform_int_distribution<int> pick(-1, vocab - 1);
  for (auto& l : labels) l = pick(rng);
  if (num_labels >= 2) labels[1] = labels[0];                         // duplicate label
  for (int k = 0; k < num_labels && rows > 1; ++k) labels[num_labels + k] = -1;  // row 1: padding only
  if (num_labels >= 1) labels[num_labels - 1] = vocab - 1;            // last vocab entry (tail chunk)

  const int num_chunks = logits_given ? ceil_div(vocab, kLogitsChunk) : ceil_div(vocab, kVocabTile);
  std::vector<MaxSum> partials(rows * num_chunks, MaxSum{NAN, NAN});
  std::vector<float> logprobs(rows * num_labels, NAN), softmax(rows * num_labels, NAN), logz(rows, NAN);
  const T* w = logits_given ? nullptr : weight.data();
  if (path == LmPath::kLogits) {
    emu::launch(dim3(num_chunks, rows), dim3(kCombineThreads), 0,
                [&] { logits_partials_kernel<T>(hidden.data(), h_stride, vocab, partials.data()); });
  } else if (path == LmPath::kTensorCores) {
    if constexpr (sizeof(T) == 2) {
      const int threads = ceil_div(rows, kRowsPerWarp) * 32;
      emu::launch(dim3(num_chunks), dim3(threads), size_t(kStages) * stage_elems(threads) * sizeof(T), [&] {
        lm_head_partials_tc_kernel<T>(hidden.data(), h_stride, w, w_stride, rows, hidden_size, vocab,
                                      partials.data());
      });
    }
  } else {
    emu::launch(dim3(num_chunks), dim3(kSimpleWarps * 32), 0, [&] {
      lm_head_partials_simple_kernel<T>(hidden.data(), h_stride, w, w_stride, rows, hidden_size, vocab,
                                        partials.data());
    });
  }
  // The combine kernel is written for any whole-warp block size; many rows run with 2 warps here only to keep
  // the emulation (one OS thread per CUDA thread) quick.
  emu::launch(dim3(rows), dim3(rows > 64 ? 64 : kCombineThreads), 0, [&] {
    combine_kernel<T>(partials.data(), num_chunks, hidden.data(), h_stride, w, w_stride, hidden_size, vocab,
                      labels.data(), num_labels, logprobs.data(), softmax.data(), logz.data());
  });

  double max_err = 0, sum_err = 0;
  int64_t count = 0;
  auto account = [&](double got, double want) {
    double err;
    if (std::isinf(want) && want < 0) {
      err = (std::isinf(got) && got < 0) ? 0 : INFINITY;
    } else {
      err = std::fabs(got - want);
      if (std::isnan(err)) err = INFINITY;
    }
    max_err = std::max(max_err, err);
    sum_err += std::isinf(err) ? 0 : err;
    ++count;
  };
  for (int r = 0; r < rows; ++r) {
    std::vector<double> logit(vocab);
    double mx = -1e300;
    for (int v = 0; v < vocab; ++v) {
      double x = 0;
      if (logits_given) {
        x = to_d(hidden[r * h_stride + v]);
      } else {
        for (int d = 0; d < hidden_size; ++d) x += to_d(hidden[r * h_stride + d]) * to_d(weight[v * w_stride + d]);
      }
      logit[v] = x;
      mx = std::max(mx, x);
    }
    double z = 0;
    for (double x : logit) z += std::exp(x - mx);
    const double log_z = mx + std::log(z);
    account(logz[r], log_z);
    double lmx = -INFINITY;
    for (int k = 0; k < num_labels; ++k) {
      const int l = labels[r * num_labels + k];
      if (l >= 0) lmx = std::max(lmx, logit[l]);
    }
    double lsum = 0;
    for (int k = 0; k < num_labels; ++k) {
      const int l = labels[r * num_labels + k];
      if (l >= 0) lsum += std::exp(logit[l] - lmx);
    }
    for (int k = 0; k < num_labels; ++k) {
      const int l = labels[r * num_labels + k];
      account(logprobs[r * num_labels + k], l >= 0 ? logit[l] - log_z : -INFINITY);
      account(softmax[r * num_labels + k], l >= 0 ? std::exp(logit[l] - lmx) / lsum : 0.0);
    }
  }
  report(name, max_err, sum_err / double(count), 2e-5, 2e-6);
}

// ---- causal_conv1d + gated_delta_rule ------------------------------------------------------------------------------

// One linear-attention case: the conv kernel, then the recurrence (prepare, phase 0, phase 1) on its output's q/k/v
// split, against float64 references that run every segment's whole sequence (an item re-runs its prefix). Segments
// listed in `carried` get a caller state and conv tail in (random) and out (aliased in place, as decode does); a
// carried item gets its prefix's tail as its tail_in (a prefix resumed from the prefix cache), and no state. Every
// other segment without a prefix keeps a snapshot of its state halfway (state_snap), checked against the reference.
template <typename T>
void check_linear(const std::string& name, const std::vector<Segment>& segs, int hk, int hv, int dk, int dv, int taps,
                  const std::vector<int>& carried, uint32_t seed) {
  int num_tokens = 0;
  for (const Segment& s : segs) num_tokens = std::max(num_tokens, s.start + s.length);
  const int num_segments = int(segs.size());
  const int channels = 2 * hk * dk + hv * dv, hist = taps - 1;
  const int64_t x_ts = channels + 8;  // padded rows exercise the strides
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<T> x(num_tokens * x_ts), w(channels * taps), ab(num_tokens * 2 * hv);
  for (auto& e : x) e = to_t<T>(normal(rng));
  for (auto& e : w) e = to_t<T>(normal(rng) * 0.5f);
  for (auto& e : ab) e = to_t<T>(normal(rng));
  std::vector<float> a_log(hv), dt_bias(hv);
  for (int h = 0; h < hv; ++h) a_log[h] = normal(rng) * 0.5f, dt_bias[h] = normal(rng);
  std::vector<int32_t> table;
  for (const Segment& s : segs) table.insert(table.end(), {s.start, s.length, s.prefix_start, s.prefix_length});
  // The plan: one slot per prefix that has items.
  std::vector<int32_t> slot(num_segments, -1);
  int num_slots = 0;
  for (int s = 0; s < num_segments; ++s) {
    if (segs[s].prefix_length == 0) continue;
    for (int l = 0; l < num_segments; ++l) {
      if (segs[l].prefix_length == 0 && segs[l].start == segs[s].prefix_start && segs[l].length == segs[s].prefix_length) {
        if (slot[l] < 0) slot[l] = num_slots++;
        slot[s] = slot[l];
      }
    }
  }
  // Caller states: a conv tail [K-1, C] and a recurrent state [Hv, Dk, Dv] per carried segment (in == out).
  std::vector<std::vector<T>> tails(num_segments);
  std::vector<std::vector<float>> states(num_segments);
  std::vector<uint64_t> tail_ptr(num_segments, 0), state_ptr(num_segments, 0);
  std::vector<int> lead_of(num_segments);
  for (int s = 0; s < num_segments; ++s) {
    lead_of[s] = s;
    for (int l = 0; l < num_segments && segs[s].prefix_length > 0; ++l) {
      if (segs[l].prefix_length == 0 && segs[l].start == segs[s].prefix_start && segs[l].length == segs[s].prefix_length)
        lead_of[s] = l;
    }
  }
  for (int s : carried) {
    if (segs[s].prefix_length > 0) continue;
    tails[s].resize(size_t(hist) * channels);
    for (auto& e : tails[s]) e = to_t<T>(normal(rng));
    states[s].resize(size_t(hv) * dk * dv);
    for (auto& e : states[s]) e = normal(rng) * 0.3f;
    tail_ptr[s] = reinterpret_cast<uint64_t>(tails[s].data());
    state_ptr[s] = reinterpret_cast<uint64_t>(states[s].data());
  }
  for (int s : carried) {  // an item: its prefix's tail (the prefix must be carried), read as the item's own
    if (segs[s].prefix_length == 0) continue;
    tails[s] = tails[lead_of[s]];
    tail_ptr[s] = reinterpret_cast<uint64_t>(tails[s].data());
  }
  std::vector<int32_t> snap_at(num_segments, 0);
  std::vector<std::vector<float>> snaps(num_segments);
  std::vector<uint64_t> snap_ptr(num_segments, 0);
  for (int s = 0; s < num_segments; ++s) {
    if (segs[s].prefix_length > 0 || segs[s].length == 0 || s % 2 == 0) continue;
    snap_at[s] = (segs[s].length + 1) / 2;
    snaps[s].assign(size_t(hv) * dk * dv, NAN);
    snap_ptr[s] = reinterpret_cast<uint64_t>(snaps[s].data());
  }
  const auto tails0 = tails;
  const auto states0 = states;

  const T sentinel = to_t<T>(12345.f);
  std::vector<T> y(num_tokens * x_ts, sentinel);
  CausalConv1dParams cp{};
  cp.x = x.data(), cp.x_token_stride = x_ts, cp.weight = w.data(), cp.y = y.data(), cp.y_token_stride = x_ts;
  cp.segments = table.data(), cp.num_segments = num_segments, cp.num_tokens = num_tokens;
  cp.channels = channels, cp.kernel_size = taps, cp.tail_in = tail_ptr.data(), cp.tail_out = tail_ptr.data();
  using namespace linear_cuda;
  emu::launch(dim3(ceil_div(channels, kConvThreads), num_segments), dim3(kConvThreads), 0,
              [&] { causal_conv1d_kernel<T>(cp); });

  const int64_t o_ts = hv * dv + 8;
  std::vector<T> o(num_tokens * o_ts, sentinel);
  GatedDeltaRuleParams rp{};
  rp.q = y.data(), rp.q_token_stride = x_ts, rp.q_head_stride = dk;
  rp.k = y.data() + hk * dk, rp.k_token_stride = x_ts, rp.k_head_stride = dk;
  rp.v = y.data() + 2 * hk * dk, rp.v_token_stride = x_ts, rp.v_head_stride = dv;
  rp.a = ab.data(), rp.a_token_stride = 2 * hv, rp.b = ab.data() + hv, rp.b_token_stride = 2 * hv;
  rp.a_log = a_log.data(), rp.dt_bias = dt_bias.data();
  rp.o = o.data(), rp.o_token_stride = o_ts, rp.o_head_stride = dv;
  rp.segments = table.data(), rp.num_segments = num_segments, rp.num_tokens = num_tokens;
  rp.state_slot = slot.data(), rp.num_slots = num_slots;
  rp.num_k_heads = hk, rp.num_v_heads = hv, rp.k_dim = dk, rp.v_dim = dv, rp.scale = 1.f / std::sqrt(float(dk));
  rp.state_in = state_ptr.data(), rp.state_out = state_ptr.data();
  rp.state_snap = snap_ptr.data(), rp.snap_at = snap_at.data();
  std::vector<float> scratch_mem(size_t(num_tokens) * (2 * hk * dk + 2 * hv), NAN);
  const RuleScratch scratch{scratch_mem.data(), scratch_mem.data() + size_t(num_tokens) * hk * dk,
                            scratch_mem.data() + size_t(num_tokens) * 2 * hk * dk,
                            scratch_mem.data() + size_t(num_tokens) * (2 * hk * dk + hv)};
  std::vector<float> prefix_states(size_t(std::max(num_slots, 1)) * hv * dk * dv, NAN);
  emu::launch(dim3(num_tokens), dim3(kPrepThreads), 0, [&] { rule_prepare_kernel<T>(rp, scratch); });
  for (int phase = 0; phase < (num_slots > 0 ? 2 : 1); ++phase) {
    emu::launch(dim3(ceil_div(dv, kRuleCols), hv, num_segments), dim3(kRuleThreads), 0, [&] {
      if (dk <= 16) gated_delta_rule_kernel<T, 2>(rp, scratch, prefix_states.data(), phase);
      else gated_delta_rule_kernel<T, 4>(rp, scratch, prefix_states.data(), phase);
    });
  }

  // float64 references over the inputs as stored.
  const bool exact = std::is_same_v<T, float>;
  double conv_err = 0, rule_err = 0, state_err = 0;
  std::vector<double> yref(size_t(num_tokens) * channels, 0.0);  // the kernel's y as the rule's input (fair split)
  for (int s = 0; s < num_segments; ++s) {
    const Segment& g = segs[s];
    // x_seq: history inputs, then (prefix), then own tokens; one row per position.
    std::vector<const T*> rows;
    std::vector<std::vector<T>> zeros(1, std::vector<T>(channels, to_t<T>(0.f)));
    for (int i = 0; i < hist; ++i) rows.push_back(tails0[s].empty() ? zeros[0].data() : tails0[s].data() + i * channels);
    for (int t = 0; t < g.prefix_length; ++t) rows.push_back(x.data() + (g.prefix_start + t) * x_ts);
    const int own0 = int(rows.size());
    for (int t = 0; t < g.length; ++t) rows.push_back(x.data() + (g.start + t) * x_ts);
    for (int t = 0; t < g.length; ++t) {
      for (int c = 0; c < channels; ++c) {
        double acc = 0;
        for (int i = 0; i < taps; ++i) acc += to_d(w[c * taps + i]) * to_d(rows[own0 + t - hist + i][c]);
        const double conv = to_d(to_t<T>(float(acc)));
        const double want = conv / (1 + std::exp(-conv));
        const double got = to_d(y[(g.start + t) * x_ts + c]);
        conv_err = std::max(conv_err, std::fabs(got - want) / (exact ? 1.0 : std::max(1.0, std::fabs(want))));
      }
    }
    if (!tails0[s].empty()) {  // the new tail: the sequence's last K - 1 inputs
      for (int i = 0; i < hist; ++i) {
        for (int c = 0; c < channels; ++c) {
          const double err = std::fabs(to_d(tails[s][i * channels + c]) - to_d(rows[rows.size() - hist + i][c]));
          conv_err = std::max(conv_err, err);
        }
      }
    }
  }
  for (int t = 0; t < num_tokens; ++t) {
    for (int c = 0; c < channels; ++c) yref[size_t(t) * channels + c] = to_d(y[t * x_ts + c]);
    for (int e = channels; e < x_ts; ++e) {
      if (to_d(y[t * x_ts + e]) != to_d(sentinel)) conv_err = INFINITY;
    }
  }
  auto run = [&](int start, int length, int head, std::vector<double>& st, std::vector<double>* out, int base) {
    const int kh = head / (hv / hk);
    for (int t = start; t < start + length; ++t) {
      const double* row = yref.data() + size_t(t) * channels;
      std::vector<double> q(dk), k(dk);
      double qs = 0, ks = 0;
      for (int d = 0; d < dk; ++d) {
        q[d] = row[kh * dk + d], k[d] = row[hk * dk + kh * dk + d];
        qs += q[d] * q[d], ks += k[d] * k[d];
      }
      for (int d = 0; d < dk; ++d) q[d] *= 1 / std::sqrt(qs + 1e-6) / std::sqrt(double(dk)), k[d] /= std::sqrt(ks + 1e-6);
      const double a = to_d(ab[t * 2 * hv + head]), b = to_d(ab[t * 2 * hv + hv + head]);
      const double sp = a + dt_bias[head] > 20 ? a + dt_bias[head] : std::log1p(std::exp(a + dt_bias[head]));
      const double decay = std::exp(-std::exp(double(a_log[head])) * sp), beta = 1 / (1 + std::exp(-b));
      for (int j = 0; j < dv; ++j) {
        double kv = 0;
        for (int i = 0; i < dk; ++i) kv += (st[i * dv + j] *= decay) * k[i];
        const double delta = (row[2 * hk * dk + head * dv + j] - kv) * beta;
        double acc = 0;
        for (int i = 0; i < dk; ++i) acc += (st[i * dv + j] += k[i] * delta) * q[i];
        if (out) (*out)[size_t(t - base) * dv + j] = acc;
      }
    }
  };
  for (int s = 0; s < num_segments; ++s) {
    const Segment& g = segs[s];
    for (int h = 0; h < hv; ++h) {
      std::vector<double> st(size_t(dk) * dv, 0.0), out(size_t(g.length) * dv);
      const int first = lead_of[s];  // an item starts where its prefix did
      if (!states0[first].empty()) for (int e = 0; e < dk * dv; ++e) st[e] = states0[first][size_t(h) * dk * dv + e];
      if (g.prefix_length > 0) run(g.prefix_start, g.prefix_length, h, st, nullptr, 0);
      run(g.start, snap_at[s], h, st, &out, g.start);
      if (snap_at[s] > 0) {
        for (int e = 0; e < dk * dv; ++e) {
          const double err = std::fabs(snaps[s][size_t(h) * dk * dv + e] - st[e]);
          state_err = std::max(state_err, std::isnan(err) ? INFINITY : err);
        }
      }
      run(g.start + snap_at[s], g.length - snap_at[s], h, st, &out, g.start);
      for (int t = 0; t < g.length; ++t) {
        for (int j = 0; j < dv; ++j) {
          const double want = out[size_t(t) * dv + j], got = to_d(o[(g.start + t) * o_ts + h * dv + j]);
          const double err = std::fabs(got - want);
          rule_err = std::max(rule_err, std::isnan(err) ? INFINITY : err);
        }
      }
      if (!states0[s].empty()) {
        for (int e = 0; e < dk * dv; ++e) {
          state_err = std::max(state_err, std::fabs(states[s][size_t(h) * dk * dv + e] - st[e]));
        }
      }
    }
  }
  for (int t = 0; t < num_tokens; ++t) {
    for (int e = hv * dv; e < o_ts; ++e) {
      if (to_d(o[t * o_ts + e]) != to_d(sentinel)) rule_err = INFINITY;
    }
  }
  report(name + " conv", conv_err, conv_err, exact ? 1e-5 : 8e-3, exact ? 1e-5 : 8e-3);
  report(name + " rule", rule_err, rule_err, exact ? 2e-5 : 2e-2, exact ? 2e-5 : 2e-2);
  report(name + " states", state_err, state_err, 2e-5, 2e-5);
}

// ---- decode_attention -----------------------------------------------------------------------------------------

// Sequences of the given lengths (including the new token) in one paged pool of 64-token pages (2 layers, a padded
// token stride), each with a block table of ceil((length + 3) / 64) pages handed out in scrambled order (so a table
// must be followed, not assumed contiguous); the new token's k / v are passed separately when `with_new` and must
// land in its page.
template <typename T, int D>
void check_decode(const std::string& name, const std::vector<int>& lengths, int hq, int hkv, bool with_new,
                  uint32_t seed) {
  using namespace decode_cuda;
  const int batch = int(lengths.size()), layers = 2, layer = 1, block = 64;
  const int64_t token_stride = int64_t(hkv) * D + 8, head_stride = D;
  const int64_t layer_stride = block * token_stride, block_stride = layers * layer_stride;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  int pages = 0, width = 0, max_length = 0;
  for (int n : lengths) {
    pages += ceil_div(n + 3, block);
    width = std::max(width, ceil_div(n + 3, block));
    max_length = std::max(max_length, n);
  }
  std::vector<int32_t> table(int64_t(batch) * width, 0);
  for (int b = 0, next = 0; b < batch; ++b)
    for (int i = 0; i < ceil_div(lengths[b] + 3, block); ++i, ++next)
      table[b * width + i] = pages - 1 - next;  // pages in reverse: a table walks backwards through the pool
  std::vector<T> k_pool(pages * block_stride), v_pool(pages * block_stride);
  for (auto* c : {&k_pool, &v_pool})
    for (auto& e : *c) e = to_t<T>(normal(rng) * 1.5f);
  const int64_t q_seq = int64_t(hq) * D + 8, new_seq = int64_t(hkv) * D + 4;
  std::vector<T> q(batch * q_seq), k_new(batch * new_seq), v_new(batch * new_seq);
  for (auto* x : {&q, &k_new, &v_new})
    for (auto& e : *x) e = to_t<T>(normal(rng) * 1.5f);
  const T sentinel = to_t<T>(12345.f);
  std::vector<T> o(batch * q_seq, sentinel);

  DecodeAttentionParams p{};
  p.q = q.data(), p.q_seq_stride = q_seq, p.q_head_stride = D;
  p.o = o.data(), p.o_seq_stride = q_seq, p.o_head_stride = D;
  p.k_new = with_new ? k_new.data() : nullptr, p.v_new = with_new ? v_new.data() : nullptr;
  p.new_seq_stride = new_seq, p.new_head_stride = D;
  p.k_pool = k_pool.data(), p.v_pool = v_pool.data(), p.layer = layer;
  p.block_stride = block_stride, p.layer_stride = layer_stride, p.token_stride = token_stride, p.head_stride = head_stride;
  p.block_table = table.data(), p.block_table_stride = width, p.block_tokens = block;
  p.lengths = lengths.data(), p.max_length = max_length;
  p.num_seqs = batch, p.num_q_heads = hq, p.num_kv_heads = hkv, p.head_dim = D;
  p.scale = 1.f / std::sqrt(float(D));

  const int max_chunks = ceil_div(max_length, kDecodeChunk);
  const int64_t parts = int64_t(batch) * hq * max_chunks;
  std::vector<float> o_parts(parts * D, NAN), lse_parts(parts, NAN);
  emu::launch(dim3(max_chunks, hkv * row_slices(hq / hkv), batch), dim3(kThreads), 0,
              [&] { decode_partial_kernel<T, D>(p, max_chunks, o_parts.data(), lse_parts.data()); });
  if (max_chunks > 1)
    emu::launch(dim3(ceil_div<int64_t>(int64_t(batch) * hq, kMergeChunkWarps)), dim3(kMergeChunkWarps * 32), 0,
                [&] { merge_chunks_kernel<T, D>(p, max_chunks, o_parts.data(), lse_parts.data()); });

  double max_err = 0, sum_err = 0;
  int64_t count = 0;
  const int group = hq / hkv;
  for (int b = 0; b < batch; ++b) {
    const int n = lengths[b];
    auto cache_at = [&](const std::vector<T>&, int t, int h) {
      return table[b * width + t / block] * block_stride + layer * layer_stride + (t % block) * token_stride +
             h * head_stride;
    };
    if (with_new) {  // the new token must have been written, exactly
      for (int h = 0; h < hkv; ++h)
        for (int d = 0; d < D; ++d)
          if (to_d(k_pool[cache_at(k_pool, n - 1, h) + d]) != to_d(k_new[b * new_seq + h * D + d]) ||
              to_d(v_pool[cache_at(v_pool, n - 1, h) + d]) != to_d(v_new[b * new_seq + h * D + d]))
            max_err = INFINITY;
    }
    for (int hqi = 0; hqi < hq; ++hqi) {
      const int h = hqi / group;
      std::vector<double> w(n);
      double mx = -1e300;
      for (int t = 0; t < n; ++t) {
        double dot = 0;
        for (int d = 0; d < D; ++d)
          dot += to_d(q[b * q_seq + hqi * D + d]) * to_d(k_pool[cache_at(k_pool, t, h) + d]);
        w[t] = dot * p.scale;
        mx = std::max(mx, w[t]);
      }
      double denom = 0;
      for (double& x : w) denom += (x = std::exp(x - mx));
      for (int d = 0; d < D; ++d) {
        double ref = 0;
        for (int t = 0; t < n; ++t) ref += w[t] * to_d(v_pool[cache_at(v_pool, t, h) + d]);
        const double err = std::fabs(to_d(o[b * q_seq + hqi * D + d]) - ref / denom);
        max_err = std::max(max_err, std::isnan(err) ? INFINITY : err);
        sum_err += err;
        ++count;
      }
    }
    for (int64_t e = int64_t(hq) * D; e < q_seq; ++e)  // padding between sequences must stay untouched
      if (to_d(o[b * q_seq + e]) != to_d(sentinel)) max_err = INFINITY;
  }
  const bool exact = std::is_same_v<T, float>;
  report(name, max_err, sum_err / double(count), exact ? 1e-5 : 2e-2, exact ? 1e-6 : 3e-3);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string only = argc > 1 ? argv[1] : "";
  auto want = [&](const char* part) { return only.empty() || only == part; };

  if (want("attention")) {
    // Two MIS groups (items of 1..70 tokens, one longer than a tile), plain causal sequences back to back
    // (runs of several segments), a 1-token sequence, and a short sequence right after a 130-token one (its
    // rows share a tile whose first key tiles they cannot see at all: the -inf row-max case).
    const Stream mixed = pack({{70, {1, 5, 17, 70}}, {0, {33, 1, 9}}, {3, {2, 64, 9}}, {0, {130, 5}}});
    // The same stream with the table rows reordered (groups stay contiguous) plus a zero-length row.
    Stream reordered = pack({{70, {1, 5, 17, 70}}, {0, {33, 1, 9}}, {3, {2, 64, 9}}, {0, {130, 5}}});
    std::rotate(reordered.segs.begin(), reordered.segs.begin() + 5, reordered.segs.end());
    std::swap(reordered.segs[0], reordered.segs[1]);
    reordered.segs.push_back({reordered.segs[2].start, 0, 0, 0});
    // Cached blocks: an MIS group with a cached head and an uncached rest, a fully cached MIS group, causal
    // sequences continuing cached tokens next to plain ones (runs must break around them).
    const Stream cached = pack({{40, {3, 70}, 2}, {0, {5, 1}, 1, true}, {0, {9, 20}, 1}, {0, {7}}, {0, {66}, 2}}, 5);
    check_attention<__nv_bfloat16, 64>("attn tc bf16 D64 MHA 4/4", mixed, 4, 4, true, 1);
    check_attention<__nv_bfloat16, 64>("attn tc bf16 D64 GQA 6/2 (3 stacked)", mixed, 6, 2, true, 2);
    check_attention<__nv_bfloat16, 128>("attn tc bf16 D128 GQA 8/1 (8 stacked)", mixed, 8, 1, true, 3);
    check_attention<__half, 128>("attn tc fp16 D128 GQA 12/1 (2 x 6 stacked)", mixed, 12, 1, true, 4);
    check_attention<__nv_bfloat16, 64>("attn tc bf16 D64 GQA 8/2, reordered table", reordered, 8, 2, true, 5);
    check_attention<float, 64>("attn simple fp32 D64 GQA 6/2", mixed, 6, 2, false, 6);
    check_attention<__nv_bfloat16, 128>("attn simple bf16 D128 GQA 4/1, reordered", reordered, 4, 1, false, 7);
    check_attention<__nv_bfloat16, 64>("attn tc bf16 D64 GQA 6/2, cached blocks", cached, 6, 2, true, 8);
    check_attention<__nv_bfloat16, 128>("attn tc bf16 D128 GQA 8/1, cached 128-key blocks", cached, 8, 1, true, 9,
                                        128);
    check_attention<float, 64>("attn simple fp32 D64 GQA 6/2, cached blocks", cached, 6, 2, false, 10);
  }

  if (want("attention-quick")) {
    check_attention<__nv_bfloat16, 64>("attn tc bf16 D64 GQA 6/2 (3 stacked)",
                                       pack({{70, {1, 5, 17}}, {0, {100, 3}}}), 6, 2, true, 2);
    check_attention<__nv_bfloat16, 256>("attn simple bf16 D256 GQA 4/1 (Qwen3.5 heads)",
                                        pack({{9, {1, 4}}, {0, {6}}}), 4, 1, false, 9);
    // Cached blocks before an MIS prefix, a fully cached group, a causal sequence continuing cached tokens.
    check_attention<__nv_bfloat16, 64>("attn tc bf16 D64 GQA 6/2, cached blocks",
                                       pack({{9, {3, 20}, 1}, {0, {2, 1}, 1, true}, {0, {30, 4}, 1}}, 3), 6, 2, true,
                                       11);
    check_attention<float, 64>("attn simple fp32 D64 GQA 4/2, cached blocks",
                               pack({{9, {3, 20}, 1}, {0, {2, 1}, 1, true}, {0, {30, 4}, 1}}, 3), 4, 2, false, 12);
  }

  if (want("decode")) {
    // One-token and chunk-edge lengths, a 3-chunk sequence; GQA 3 (SmolLM2), 2 (Qwen3-0.6B), 12 (two row slices).
    check_decode<__nv_bfloat16, 64>("decode bf16 D64 GQA 9/3, new token", {1, 33, 256, 257}, 9, 3, true, 21);
    check_decode<__nv_bfloat16, 128>("decode bf16 D128 GQA 4/2, 3 chunks", {600, 2}, 4, 2, true, 22);
    check_decode<float, 64>("decode fp32 D64 GQA 12/1 (2 row slices)", {5, 300}, 12, 1, false, 23);
    check_decode<__half, 128>("decode fp16 D128 MHA 2/2", {17}, 2, 2, true, 24);
  }

  if (want("labels")) {
    check_labels<__nv_bfloat16>("labels tc bf16 R=3 H=72 V=1000 K=5", 3, 72, 1000, 5, LmPath::kTensorCores, 11);
    check_labels<__half>("labels tc fp16 R=37 H=200 V=777 K=3", 37, 200, 777, 3, LmPath::kTensorCores, 12);
    check_labels<__nv_bfloat16>("labels tc bf16 R=256 H=64 V=130 K=4", 256, 64, 130, 4, LmPath::kTensorCores, 13);
    check_labels<float>("labels simple fp32 R=5 H=50 V=300 K=4", 5, 50, 300, 4, LmPath::kSimple, 14);
    check_labels<__nv_bfloat16>("labels logits bf16 R=4 V=9000 K=6", 4, 0, 9000, 6, LmPath::kLogits, 15);
    check_labels<float>("labels logits fp32 R=2 V=100 K=300", 2, 0, 100, 300, LmPath::kLogits, 16);
  }
  if (want("linear")) {
    // Two MIS groups (items of 1..5 tokens and one longer than a staging chunk; a prefix shorter than the conv
    // window), plain sequences, a zero-length row and two sequences continuing from caller states (decode-style,
    // one of them a single token).
    const std::vector<Segment> mixed = pack({{7, {1, 2, 3, 4, 20}}, {0, {5, 1, 17}}, {2, {3, 1}}}).segs;
    std::vector<Segment> with_empty = mixed;
    with_empty.push_back({mixed[6].start, 0, 0, 0});
    check_linear<float>("linear fp32 Hk 2 Hv 4 Dk 16 Dv 24 K 4", with_empty, 2, 4, 16, 24, 4, {7, 8}, 21);
    check_linear<__nv_bfloat16>("linear bf16 Hk 1 Hv 2 Dk 32 Dv 16 K 4", mixed, 1, 2, 32, 16, 4, {6, 9, 10, 11}, 22);
    check_linear<float>("linear fp32 Hk 2 Hv 2 Dk 13 Dv 20 K 3", pack({{0, {1, 9}}, {4, {2, 6}}}).segs, 2, 2, 13, 20,
                        3, {0, 1}, 23);
  }
  std::printf("%s\n", g_failures ? "FAILED" : "ALL OK");
  return g_failures ? 1 : 0;
}
