// The CPU kernels' correctness checks, in C++ alone: every op through its launcher (each op's header / plan_cpu.h:
// plain structs of pointers and sizes, no torch, no pybind11) against a naive double-precision reference, on awkward
// sizes (odd lengths, 1-token items, empty prefixes, GQA ratios, ragged caches; fp32 and bf16). Built by
// tests/cpu/CMakeLists.txt with the module's own sources and flags, natively and cross-compiled for aarch64, where
// tests/ops/test_aarch64.py runs it under qemu-aarch64. The launchers dispatch on cpu_tier() as in the module
// (PYSCORE_CPU_TIER forces a lower tier). Prints one line per check and exits 1 if any check failed.
//
// This file: the attention ops and label_logprobs; kernel_check_layers.cpp: the decoder's other ops.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "check_util.h"
#include "common/cpu_features.h"
#include "decode_attention/decode_attention.h"
#include "label_logprobs/label_logprobs.h"
#include "prefix_item_attention/plan_cpu.h"

using namespace check;
using pyscore::Status;

int& check::failures() {
  static int n = 0;
  return n;
}

void check_layer_ops();  // kernel_check_layers.cpp

namespace {

// ---- prefix_item_attention ---------------------------------------------------------------------------------------

struct Seg {
  int32_t start, length, prefix_start, prefix_length;
};

// q, k and v as views into one fused projection output [T, (Hq + 2 Hkv) D], as the decoder passes them.
struct Qkv {
  int32_t tokens, hq, hkv, d;
  Buf data;
  Qkv(DType dtype, int32_t t, int32_t hq_, int32_t hkv_, int32_t d_)
      : tokens(t), hq(hq_), hkv(hkv_), d(d_), data(dtype, size_t(t) * (hq_ + 2 * hkv_) * d_) {}
  int64_t row() const { return int64_t(hq + 2 * hkv) * d; }
  size_t q_at(int32_t t, int32_t h) const { return t * row() + int64_t(h) * d; }
  size_t k_at(int32_t t, int32_t h) const { return t * row() + int64_t(hq + h) * d; }
  size_t v_at(int32_t t, int32_t h) const { return t * row() + int64_t(hq + hkv + h) * d; }
};

// Softmax attention of one query row over the listed keys, in double.
void attend_ref(const Qkv& x, int32_t t, int32_t h, const std::vector<int32_t>& keys, double scale, double* out) {
  const int32_t kvh = h / (x.hq / x.hkv);
  std::vector<double> s(keys.size());
  double mx = -INFINITY;
  for (size_t j = 0; j < keys.size(); ++j) {
    double dot = 0.0;
    for (int32_t i = 0; i < x.d; ++i)
      dot += double(x.data.get(x.q_at(t, h) + i)) * x.data.get(x.k_at(keys[j], kvh) + i);
    s[j] = dot * scale;
    mx = std::max(mx, s[j]);
  }
  double sum = 0.0;
  for (double& v : s) sum += (v = std::exp(v - mx));
  for (int32_t i = 0; i < x.d; ++i) {
    double acc = 0.0;
    for (size_t j = 0; j < keys.size(); ++j) acc += s[j] * x.data.get(x.v_at(keys[j], kvh) + i);
    out[i] = acc / sum;
  }
}

Status run_attention(const Qkv& x, const std::vector<Seg>& segs, float scale, Buf& o) {
  pyscore::AttentionPlanParams shape{};
  shape.segments = reinterpret_cast<const int32_t*>(segs.data());
  shape.num_segments = int32_t(segs.size());
  shape.num_tokens = x.tokens;
  shape.num_q_heads = x.hq;
  shape.num_kv_heads = x.hkv;
  shape.head_dim = x.d;
  shape.dtype = x.data.dtype;
  pyscore::AttentionCpuPlan plan;
  const Status status = pyscore::prefix_item_attention_plan_cpu(shape, &plan);
  if (status != pyscore::kOk) return status;
  pyscore::PrefixItemAttentionParams p{};
  static_cast<pyscore::AttentionPlanParams&>(p) = shape;
  Buf& data = const_cast<Buf&>(x.data);
  char* base = static_cast<char*>(data.data());
  const size_t elem = x.data.dtype == DType::kBFloat16 ? 2 : 4;
  p.q = base + x.q_at(0, 0) * elem;
  p.k = base + x.k_at(0, 0) * elem;
  p.v = base + x.v_at(0, 0) * elem;
  p.o = o.data();
  p.q_token_stride = p.k_token_stride = p.v_token_stride = x.row();
  p.q_head_stride = p.k_head_stride = p.v_head_stride = p.o_head_stride = x.d;
  p.o_token_stride = int64_t(x.hq) * x.d;
  p.scale = scale;
  return pyscore::prefix_item_attention_run_cpu(plan, p);
}

// A batch of every kind of segment: a 1-token SIS sequence; an MIS group (a 37-token prefix, items of 1, 5 and 70
// tokens, the last crossing a 64-key tile); a 67-token causal sequence; a 1-token prefix with items of 2 and 1.
std::vector<Seg> mixed_table() {
  return {{0, 1, 0, 0},    {1, 37, 0, 0},   {38, 1, 1, 37},   {39, 5, 1, 37}, {44, 70, 1, 37},
          {114, 67, 0, 0}, {181, 1, 0, 0},  {182, 2, 181, 1}, {184, 1, 181, 1}};
}

void check_attention_case(DType dtype, int32_t hq, int32_t hkv, int32_t d) {
  const std::vector<Seg> segs = mixed_table();
  const int32_t tokens = 185;
  Qkv x(dtype, tokens, hq, hkv, d);
  fill_uniform(x.data, -2.0f, 2.0f);
  Buf o(dtype, size_t(tokens) * hq * d);
  const float scale = 1.0f / std::sqrt(float(d));
  const std::string name = std::string("prefix_item_attention ") + dtype_name(dtype) + " Hq=" + std::to_string(hq) +
                           " Hkv=" + std::to_string(hkv) + " D=" + std::to_string(d);
  if (!expect(name + " runs", run_attention(x, segs, scale, o) == pyscore::kOk)) return;
  std::vector<double> want(o.size());
  for (const Seg& s : segs)
    for (int32_t t = s.start; t < s.start + s.length; ++t) {
      std::vector<int32_t> keys;
      for (int32_t j = s.prefix_start; j < s.prefix_start + s.prefix_length; ++j) keys.push_back(j);
      for (int32_t j = s.start; j <= t; ++j) keys.push_back(j);
      for (int32_t h = 0; h < hq; ++h) attend_ref(x, t, h, keys, scale, &want[(size_t(t) * hq + h) * d]);
    }
  compare(name, o.size(), [&](size_t i) { return o.get(i); }, [&](size_t i) { return want[i]; }, tol_for(dtype));

  // MIS = SIS bitwise: item 2 (5 tokens) run as its own sequence with the query as its prefix, elsewhere in a
  // different stream, gives the same bits (the kernel's per-row arithmetic never depends on the batch).
  Qkv y(dtype, 3 + 37 + 5, hq, hkv, d);
  fill_uniform(y.data);
  for (int32_t t = 0; t < 42; ++t) {
    const int32_t from = t < 37 ? 1 + t : 39 + (t - 37);
    for (int64_t i = 0; i < x.row(); ++i) y.data.set(y.q_at(3 + t, 0) + i, x.data.get(x.q_at(from, 0) + i));
  }
  Buf o2(dtype, size_t(y.tokens) * hq * d);
  run_attention(y, {{0, 3, 0, 0}, {3, 37, 0, 0}, {40, 5, 3, 37}}, scale, o2);
  bool same = true;
  for (int32_t t = 0; t < 5; ++t)
    for (int64_t i = 0; i < int64_t(hq) * d; ++i)
      same &= o2.bits((size_t(40 + t) * hq) * d + i) == o.bits((size_t(39 + t) * hq) * d + i);
  expect(name + " MIS item == SIS (query as prefix) bitwise", same);
}

void check_attention() {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    check_attention_case(dtype, 2, 2, 64);   // one query head per kv head
    check_attention_case(dtype, 6, 2, 64);   // GQA 3
    check_attention_case(dtype, 4, 1, 24);   // GQA 4, a head_dim the ISA kernels do not cover
  }
  // Bad tables are refused at planning: a token no segment covers, a prefix overlapping its own segment.
  Qkv x(DType::kFloat32, 4, 1, 1, 8);
  Buf o(DType::kFloat32, 4 * 8);
  expect("prefix_item_attention refuses a table that leaves a token out",
         run_attention(x, {{0, 3, 0, 0}}, 1.0f, o) == pyscore::kInvalidArgument);
  expect("prefix_item_attention refuses a prefix overlapping its segment",
         run_attention(x, {{0, 4, 2, 2}}, 1.0f, o) == pyscore::kInvalidArgument);
  Qkv empty(DType::kFloat32, 0, 1, 1, 8);
  expect("prefix_item_attention accepts an empty stream", run_attention(empty, {}, 1.0f, o) == pyscore::kOk);
}

// ---- decode_attention --------------------------------------------------------------------------------------------

void check_decode_case(DType dtype, int32_t hq, int32_t hkv, int32_t d) {
  const std::vector<int32_t> lengths = {1, 37, 300};  // 300 > one 256-key chunk: two chunks merged
  const int32_t layers = 2, layer = 1, b_count = int32_t(lengths.size()), block = 16;  // the CPU store's pages
  const int64_t token_stride = int64_t(hkv) * d, layer_stride = block * token_stride;
  const int64_t block_stride = layers * layer_stride;
  // One paged pool; each sequence's block table lists its pages in reverse pool order (a table must be followed).
  int32_t pages = 0, width = 0;
  for (int32_t b = 0; b < b_count; ++b) {
    const int32_t n = (lengths[b] + 3 * b + block - 1) / block;
    pages += n;
    width = std::max(width, n);
  }
  std::vector<int32_t> table(size_t(b_count) * width, 0);
  for (int32_t b = 0, next = 0; b < b_count; ++b)
    for (int32_t i = 0; i < (lengths[b] + 3 * b + block - 1) / block; ++i, ++next)
      table[size_t(b) * width + i] = pages - 1 - next;
  Buf k_pool(dtype, size_t(pages) * block_stride), v_pool(dtype, size_t(pages) * block_stride);
  fill_uniform(k_pool);
  fill_uniform(v_pool);
  auto at = [&](int32_t b, int32_t t) {
    return table[size_t(b) * width + t / block] * block_stride + layer * layer_stride + (t % block) * token_stride;
  };
  Buf q(dtype, size_t(b_count) * hq * d), o(dtype, q.size()), k_new(dtype, size_t(b_count) * hkv * d),
      v_new(dtype, k_new.size());
  fill_uniform(q, -2.0f, 2.0f);
  fill_uniform(k_new);
  fill_uniform(v_new);
  pyscore::DecodeAttentionParams p{};
  p.q = q.data();
  p.q_seq_stride = int64_t(hq) * d;
  p.q_head_stride = d;
  p.o = o.data();
  p.o_seq_stride = int64_t(hq) * d;
  p.o_head_stride = d;
  p.k_new = k_new.data();
  p.v_new = v_new.data();
  p.new_seq_stride = int64_t(hkv) * d;
  p.new_head_stride = d;
  p.k_pool = k_pool.data();
  p.v_pool = v_pool.data();
  p.block_stride = block_stride;
  p.layer_stride = layer_stride;
  p.token_stride = token_stride;
  p.head_stride = d;
  p.layer = layer;
  p.block_table = table.data();
  p.block_table_stride = width;
  p.block_tokens = block;
  p.lengths = lengths.data();
  p.max_length = 300;
  p.num_seqs = b_count;
  p.num_q_heads = hq;
  p.num_kv_heads = hkv;
  p.head_dim = d;
  p.scale = 1.0f / std::sqrt(float(d));
  p.dtype = dtype;
  const std::string name = std::string("decode_attention ") + dtype_name(dtype) + " Hq=" + std::to_string(hq) +
                           " Hkv=" + std::to_string(hkv) + " D=" + std::to_string(d) + " lengths 1,37,300";
  if (!expect(name + " runs", pyscore::decode_attention_cpu(p) == pyscore::kOk)) return;
  std::vector<double> want(o.size());
  bool written = true;
  for (int32_t b = 0; b < b_count; ++b) {
    for (int32_t h = 0; h < hq; ++h) {
      const int32_t kvh = h / (hq / hkv);
      std::vector<double> s(lengths[b]);
      double mx = -INFINITY;
      for (int32_t t = 0; t < lengths[b]; ++t) {
        double dot = 0.0;
        for (int32_t i = 0; i < d; ++i)
          dot += double(q.get((size_t(b) * hq + h) * d + i)) * k_pool.get(at(b, t) + kvh * d + i);
        mx = std::max(mx, s[t] = dot * p.scale);
      }
      double sum = 0.0;
      for (double& v : s) sum += (v = std::exp(v - mx));
      for (int32_t i = 0; i < d; ++i) {
        double acc = 0.0;
        for (int32_t t = 0; t < lengths[b]; ++t) acc += s[t] * v_pool.get(at(b, t) + kvh * d + i);
        want[(size_t(b) * hq + h) * d + i] = acc / sum;
      }
    }
    for (int32_t i = 0; i < hkv * d; ++i)  // the new token was written at lengths[b] - 1 before anything read it
      written &= k_pool.bits(at(b, lengths[b] - 1) + i) == k_new.bits(size_t(b) * hkv * d + i) &&
                 v_pool.bits(at(b, lengths[b] - 1) + i) == v_new.bits(size_t(b) * hkv * d + i);
  }
  expect(name + " writes the new keys and values", written);
  compare(name, o.size(), [&](size_t i) { return o.get(i); }, [&](size_t i) { return want[i]; }, tol_for(dtype));
}

void check_decode() {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    check_decode_case(dtype, 6, 2, 64);
    check_decode_case(dtype, 8, 2, 128);  // the x86 layers' other compile-time head dim; NEON's passes of 8 vectors
    check_decode_case(dtype, 5, 1, 48);   // a run-time head dim with a short last pass (AVX2, NEON)
    check_decode_case(dtype, 3, 3, 40);   // no vector layer's: the portable loops
  }
}

// ---- label_logprobs ----------------------------------------------------------------------------------------------

// weight_dtype bf16 under fp32 rows: the bf16_weight mode (fp32 serving of a bf16 checkpoint's LM head).
void check_label_case(DType dtype, int32_t rows, int32_t hidden, int32_t vocab, bool with_weight,
                      DType weight_dtype) {
  const int32_t k = 4;
  Buf h(dtype, size_t(rows) * (with_weight ? hidden : vocab));
  Buf w(weight_dtype, with_weight ? size_t(vocab) * hidden : 0);
  fill_uniform(h, -1.0f, 1.0f);
  fill_uniform(w, -0.5f, 0.5f);
  if (!with_weight)  // given logits: a wide range, and one row's maximum far above the rest
    for (size_t i = 0; i < h.size(); ++i) h.set(i, h.get(i) * 12.0f);
  std::vector<int32_t> labels;
  for (int32_t r = 0; r < rows; ++r) {
    // First and last entries of the vocabulary, a repeat, and padding (-1) on odd rows.
    labels.insert(labels.end(), {r % 2 ? -1 : 0, vocab - 1, 17 + r, 17 + r});
  }
  std::vector<float> logprobs(size_t(rows) * k), soft(logprobs.size()), logz(rows);
  pyscore::LabelLogprobsParams p{};
  p.hidden = h.data();
  p.hidden_row_stride = with_weight ? hidden : vocab;
  p.weight = with_weight ? w.data() : nullptr;
  p.weight_row_stride = hidden;
  p.labels = labels.data();
  p.logprobs = logprobs.data();
  p.label_softmax = soft.data();
  p.logz = logz.data();
  p.num_rows = rows;
  p.hidden_size = hidden;
  p.vocab_size = vocab;
  p.num_labels = k;
  p.dtype = dtype;
  p.bf16_weight = weight_dtype != dtype;
  const std::string name = std::string("label_logprobs ") + dtype_name(dtype) +
                           (p.bf16_weight ? " bf16 weight" : "") + " R=" + std::to_string(rows) +
                           (with_weight ? " H=" + std::to_string(hidden) : std::string(" logits")) +
                           " V=" + std::to_string(vocab);
  if (!expect(name + " runs", pyscore::label_logprobs_cpu(p) == pyscore::kOk)) return;
  std::vector<double> want_lp(logprobs.size()), want_soft(soft.size()), want_z(rows);
  for (int32_t r = 0; r < rows; ++r) {
    std::vector<double> logits(vocab);
    for (int32_t v = 0; v < vocab; ++v) {
      if (!with_weight) {
        logits[v] = h.get(size_t(r) * vocab + v);
        continue;
      }
      double dot = 0.0;
      for (int32_t i = 0; i < hidden; ++i) dot += double(h.get(size_t(r) * hidden + i)) * w.get(size_t(v) * hidden + i);
      logits[v] = dot;
    }
    const double mx = *std::max_element(logits.begin(), logits.end());
    double sum = 0.0;
    for (double x : logits) sum += std::exp(x - mx);
    want_z[r] = mx + std::log(sum);
    double label_max = -INFINITY, total = 0.0;
    for (int32_t j = 0; j < k; ++j)
      if (labels[r * k + j] >= 0) label_max = std::max(label_max, logits[labels[r * k + j]]);
    for (int32_t j = 0; j < k; ++j) {
      const int32_t label = labels[r * k + j];
      want_lp[r * k + j] = label >= 0 ? logits[label] - want_z[r] : -INFINITY;
      total += want_soft[r * k + j] = label >= 0 ? std::exp(logits[label] - label_max) : 0.0;
    }
    for (int32_t j = 0; j < k; ++j) want_soft[r * k + j] /= total;
  }
  // Outputs are fp32 whatever the input dtype; logits reach ~10, so the absolute error scales with them.
  const Tol tol{1e-4, 2e-5};
  compare(name + " logprobs", logprobs.size(), [&](size_t i) { return logprobs[i]; },
          [&](size_t i) { return want_lp[i]; }, tol);
  compare(name + " label softmax", soft.size(), [&](size_t i) { return soft[i]; },
          [&](size_t i) { return want_soft[i]; }, tol);
  compare(name + " logZ", logz.size(), [&](size_t i) { return logz[i]; }, [&](size_t i) { return want_z[i]; }, tol);
}

void check_labels() {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    check_label_case(dtype, 3, 67, 1037, true, dtype);  // odd hidden size, a vocabulary no tile divides
    check_label_case(dtype, 1, 64, 49, true, dtype);    // one row, a vocabulary smaller than one chunk
    check_label_case(dtype, 2, 0, 517, false, dtype);   // logits given
  }
  // A bf16 head under fp32 rows, an odd hidden size: 5 rows (widened in registers), 11 (by column).
  check_label_case(DType::kFloat32, 5, 67, 1037, true, DType::kBFloat16);
  check_label_case(DType::kFloat32, 11, 67, 1037, true, DType::kBFloat16);
}

}  // namespace

int main() {
  std::printf("cpu tier %s (hardware %s)\n", pyscore::tier_name(pyscore::cpu_tier()),
              pyscore::tier_name(pyscore::cpu_hardware_tier()));
  check_attention();
  check_decode();
  check_labels();
  check_layer_ops();
  std::printf("%s: %d failed\n", failures() ? "FAILED" : "passed", failures());
  return failures() ? 1 : 0;
}
