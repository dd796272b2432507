// The decoder's other CPU ops against naive references (see kernel_check.cpp): linear (plain and gated, bias,
// residual, odd K), linear_int8 (exact integer sums, the contract's quantization and epilogue), add_rms_norm, rotary
// (with and without qk-norm), silu_mul, and Qwen3.5's causal_conv1d and gated_delta_rule, where an MIS item
// continuing its prefix must equal the item's whole sequence run from scratch.
// Where a contract names intermediate roundings to the dtype, the reference makes the same ones.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "add_rms_norm/add_rms_norm.h"
#include "check_util.h"
#include "gated_delta_rule/gated_delta_rule.h"
#include "linear/linear.h"
#include "rotary/rotary.h"
#include "silu_mul/silu_mul.h"

using namespace check;

namespace {

// ---- linear ------------------------------------------------------------------------------------------------------

// linear.h's packed column order for N outputs: packed column c holds weight row operator()(c), -1 for padding
// (gated: units of 32 columns, 16 gate rows then the same 16 outputs' up rows, rows [0, N) gate and [N, 2N) up).
struct PackedColumns {
  int32_t n;
  bool gated;
  int32_t operator()(int32_t c) const {
    if (!gated) return c < n ? c : -1;
    const int32_t unit = c / 32, j = c % 32, o = 16 * unit + j % 16;
    return o >= n ? -1 : (j < 16 ? o : n + o);
  }
  int32_t n_packed() const { return ((gated ? (n + 15) / 16 * 32 : n) + 63) / 64 * 64; }
};

// The packed weight of linear/linear.h: packed column c of row-major `w` [rows, k] is weight row row_of(c) (or
// zeros when row_of(c) < 0), in blocks of 64 columns laid out [K_pad / pack][64][pack].
template <class RowOf>
Buf pack_weight(const Buf& w, int32_t k, int32_t n_packed, RowOf row_of) {
  const int32_t pack = w.dtype == DType::kBFloat16 ? 2 : 1, k_pad = (k + pack - 1) / pack * pack;
  Buf out(w.dtype, size_t(n_packed) * k_pad);
  for (int32_t c = 0; c < n_packed; ++c) {
    const int32_t row = row_of(c);
    if (row < 0) continue;
    for (int32_t i = 0; i < k; ++i)
      out.set(size_t(c / 64) * k_pad * 64 + (size_t(i / pack) * 64 + c % 64) * pack + i % pack,
              w.get(size_t(row) * k + i));
  }
  return out;
}

// weight_dtype bf16 under fp32 x: the bf16_weight mode (fp32 serving of a bf16 checkpoint's projections).
void check_linear_case(DType dtype, bool gated, DType weight_dtype, int32_t m = 7) {
  const int32_t k = 37, n = gated ? 20 : 70;  // gated: I = 20 (a half-empty second unit)
  const int32_t rows = gated ? 2 * n : n, x_stride = k + 3, res_stride = n + 1;
  Buf x(dtype, size_t(m) * x_stride), w(weight_dtype, size_t(rows) * k), residual(dtype, size_t(m) * res_stride),
      out(dtype, size_t(m) * n);
  fill_uniform(x);
  fill_uniform(w, -0.3f, 0.3f);
  fill_uniform(residual);
  const PackedColumns row_of{n, gated};
  const int32_t n_packed = row_of.n_packed();
  Buf packed = pack_weight(w, k, n_packed, row_of);
  std::vector<float> bias(n_packed, 0.0f);
  for (int32_t c = 0; c < n_packed; ++c)
    if (row_of(c) >= 0) bias[c] = 0.1f * float(row_of(c) % 7) - 0.3f;
  pyscore::LinearParams p{};
  p.x = x.data();
  p.x_row_stride = x_stride;
  p.w_packed = packed.data();
  p.bias = bias.data();
  p.residual = residual.data();
  p.residual_row_stride = res_stride;
  p.out = out.data();
  p.out_row_stride = n;
  p.m = m;
  p.k = k;
  p.n_packed = n_packed;
  p.n_out = n;
  p.gated = gated;
  p.dtype = dtype;
  p.bf16_weight = weight_dtype != dtype;
  const std::string name = std::string("linear ") + dtype_name(dtype) + (p.bf16_weight ? " bf16 weight" : "") +
                           (gated ? " gated" : "") + " M=" + std::to_string(m) + " K=37 N=" + std::to_string(n) +
                           " bias residual";
  if (!expect(name + " runs", pyscore::linear_cpu(p) == pyscore::kOk)) return;
  std::vector<double> bias_of_row(rows);
  for (int32_t c = 0; c < n_packed; ++c)
    if (row_of(c) >= 0) bias_of_row[row_of(c)] = bias[c];
  auto v = [&](int32_t i, int32_t row) {
    double acc = bias_of_row[row];
    for (int32_t j = 0; j < k; ++j) acc += double(x.get(size_t(i) * x_stride + j)) * w.get(size_t(row) * k + j);
    return acc;
  };
  std::vector<double> want(out.size());
  for (int32_t i = 0; i < m; ++i)
    for (int32_t o = 0; o < n; ++o)
      want[size_t(i) * n + o] =
          residual.get(size_t(i) * res_stride + o) + (gated ? silu(v(i, o)) * v(i, n + o) : v(i, o));
  compare(name, out.size(), [&](size_t i) { return out.get(i); }, [&](size_t i) { return want[i]; }, tol_for(dtype));
}

// ---- linear_int8 --------------------------------------------------------------------------------------------------

// One x row quantized as linear.h's int8 section states it (fp32: scale max|x| / 127, codes round_half_even(x * (127 /
// max|x|)), each a single fp32 operation).
// x[at, at + k) quantized in groups of `group` (linear.h's int8 section): codes, and each group's scale in scales.
std::vector<int32_t> quantize_row(const Buf& x, size_t at, int32_t k, int32_t group, std::vector<float>& scales) {
  std::vector<int32_t> codes(k);
  scales.assign(size_t((k + group - 1) / group), 0.0f);
  for (int32_t g = 0; g * group < k; ++g) {
    const int32_t i0 = g * group, i1 = std::min(k, i0 + group);
    float amax = 0.0f;
    for (int32_t j = i0; j < i1; ++j) amax = std::max(amax, std::fabs(x.get(at + j)));
    scales[g] = amax / 127.0f;
    const float factor = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int32_t j = i0; j < i1; ++j)
      codes[j] = int32_t(std::max(-127.0f, std::min(127.0f, std::nearbyint(x.get(at + j) * factor))));
  }
  return codes;
}

// Codes drawn in [-127, 127] (the extremes included), packed [N_pad / 64][K4 / 4][64][4], in groups of 16 along K
// (the last one 5 of K = 37); per packed column and group a scale and -128 * the group's codes' sum, and a bias;
// then the launcher against exact integer sums per group and the contract's fp32 epilogue.
void check_linear_int8_case(DType dtype, bool gated, int32_t m) {
  const int32_t k = 37, k4 = 40, group = 16, groups = 3, n = gated ? 20 : 70;
  const int32_t rows = gated ? 2 * n : n, x_stride = k + 3, res_stride = n + 1;
  Buf x(dtype, size_t(m) * x_stride), residual(dtype, size_t(m) * res_stride), out(dtype, size_t(m) * n);
  fill_uniform(x);
  fill_uniform(residual);
  std::uniform_int_distribution<int32_t> code(-127, 127);
  std::vector<int32_t> w(size_t(rows) * k);
  for (int32_t& c : w) c = code(rng());
  const PackedColumns row_of{n, gated};
  const int32_t n_packed = row_of.n_packed();
  std::vector<int8_t> packed(size_t(n_packed) * k4, 0);
  const size_t scales = size_t(n_packed) * groups;
  std::vector<float> scale(scales, 0.0f), bias(n_packed, 0.0f), scale_of_row(size_t(rows) * groups),
      bias_of_row(rows);
  std::vector<int32_t> base(scales, 0);
  for (int32_t c = 0; c < n_packed; ++c) {
    const int32_t row = row_of(c);
    if (row < 0) continue;
    for (int32_t i = 0; i < k; ++i) {
      packed[size_t(c / 64) * k4 * 64 + (size_t(i / 4) * 64 + c % 64) * 4 + i % 4] = int8_t(w[size_t(row) * k + i]);
      base[(size_t(c / 64) * groups + i / group) * 64 + c % 64] -= 128 * w[size_t(row) * k + i];
    }
    for (int32_t g = 0; g < groups; ++g)
      scale[(size_t(c / 64) * groups + g) * 64 + c % 64] = scale_of_row[size_t(row) * groups + g] =
          0.001f + 0.0005f * float((row + g) % 5);
    bias[c] = bias_of_row[row] = 0.1f * float(row % 7) - 0.3f;
  }
  pyscore::LinearInt8Params p{x.data(), x_stride, packed.data(), scale.data(), base.data(), bias.data(),
                              residual.data(), res_stride, out.data(), n, m, k, group, n_packed, n, gated, dtype};
  const std::string name = std::string("linear_int8 ") + dtype_name(dtype) + (gated ? " gated" : "") +
                           " M=" + std::to_string(m) + " K=37 N=" + std::to_string(n) + " bias residual";
  const pyscore::Status status = pyscore::linear_int8_cpu(p);
  if (status == pyscore::kUnsupportedDType && pyscore::cpu_tier() == pyscore::CpuTier::kGeneric) return;  // torch's
  if (!expect(name + " runs", status == pyscore::kOk)) return;
  std::vector<double> want(out.size());
  std::vector<float> x_scales;
  for (int32_t i = 0; i < m; ++i) {
    const std::vector<int32_t> q = quantize_row(x, size_t(i) * x_stride, k, group, x_scales);
    auto v = [&](int32_t row) {
      double sum = 0.0;
      for (int32_t g = 0; g < groups; ++g) {
        int64_t part = 0;
        for (int32_t j = g * group; j < std::min(k, (g + 1) * group); ++j) part += int64_t(q[j]) * w[size_t(row) * k + j];
        sum += double(part) * x_scales[g] * scale_of_row[size_t(row) * groups + g];
      }
      return sum + bias_of_row[row];
    };
    for (int32_t o = 0; o < n; ++o)
      want[size_t(i) * n + o] = residual.get(size_t(i) * res_stride + o) + (gated ? silu(v(o)) * v(n + o) : v(o));
  }
  compare(name, out.size(), [&](size_t i) { return out.get(i); }, [&](size_t i) { return want[i]; }, tol_for(dtype));
}

// ---- add_rms_norm, rotary, silu_mul ------------------------------------------------------------------------------

void check_add_rms_norm_case(DType dtype, bool with_delta, bool weight_fp32) {
  const int32_t t = 5, h = 67;
  const float eps = 1e-6f;
  Buf x(dtype, size_t(t) * h), delta(dtype, x.size()), out(dtype, x.size()),
      w(weight_fp32 ? DType::kFloat32 : dtype, h);
  fill_uniform(x, -3.0f, 3.0f);
  fill_uniform(delta);
  fill_uniform(w, 0.5f, 1.5f);
  const Buf x0 = x;
  pyscore::AddRmsNormParams p{};
  p.x = x.data();
  p.x_row_stride = h;
  p.delta = with_delta ? delta.data() : nullptr;
  p.delta_row_stride = h;
  p.weight = w.data();
  p.out = out.data();
  p.out_row_stride = h;
  p.num_rows = t;
  p.hidden_size = h;
  p.eps = eps;
  p.weight_fp32 = weight_fp32;
  p.dtype = dtype;
  const std::string name = std::string("add_rms_norm ") + dtype_name(dtype) + " H=67" +
                           (with_delta ? " +delta" : "") + (weight_fp32 ? " fp32 weight" : "");
  if (!expect(name + " runs", pyscore::add_rms_norm_cpu(p) == pyscore::kOk)) return;
  std::vector<double> want_x(x.size()), want(x.size());
  for (int32_t r = 0; r < t; ++r) {
    double ss = 0.0;
    for (int32_t i = 0; i < h; ++i) {
      const size_t at = size_t(r) * h + i;
      want_x[at] = with_delta ? round_to(dtype, double(x0.get(at)) + delta.get(at)) : x0.get(at);
      ss += want_x[at] * want_x[at];
    }
    const double scale = 1.0 / std::sqrt(ss / h + eps);
    for (int32_t i = 0; i < h; ++i) {
      const size_t at = size_t(r) * h + i;
      want[at] = weight_fp32 ? w.get(i) * want_x[at] * scale : w.get(i) * round_to(dtype, want_x[at] * scale);
    }
  }
  const Tol tol = tol_for(dtype);
  compare(name + " residual", x.size(), [&](size_t i) { return x.get(i); }, [&](size_t i) { return want_x[i]; },
          Tol{0.0, tol.rel});
  compare(name, out.size(), [&](size_t i) { return out.get(i); }, [&](size_t i) { return want[i]; },
          Tol{tol.abs, 2 * tol.rel});
}

void check_rotary_case(DType dtype, bool qk_norm) {
  const int32_t t = 5, hq = 3, hkv = 1, d = 18, positions = 10, row = (hq + 2 * hkv) * d;
  Buf qkv(dtype, size_t(t) * row), qn(dtype, d), kn(dtype, d);
  fill_uniform(qkv, -2.0f, 2.0f);
  fill_uniform(qn, 0.5f, 1.5f);
  fill_uniform(kn, 0.5f, 1.5f);
  const Buf before = qkv;
  std::vector<float> cos(size_t(positions) * d), sin(cos.size());
  for (int32_t pos = 0; pos < positions; ++pos)
    for (int32_t i = 0; i < d; ++i) {
      const double angle = pos * std::pow(10000.0, -2.0 * (i % (d / 2)) / d);
      cos[size_t(pos) * d + i] = float(std::cos(angle));
      sin[size_t(pos) * d + i] = float(std::sin(angle));
    }
  const std::vector<int64_t> pos = {9, 0, 3, 3, 7};
  const size_t elem = dtype == DType::kBFloat16 ? 2 : 4;
  pyscore::RotaryParams p{};
  p.q = qkv.data();
  p.k = static_cast<char*>(qkv.data()) + size_t(hq) * d * elem;
  p.q_token_stride = p.k_token_stride = row;
  p.q_head_stride = p.k_head_stride = d;
  p.positions = pos.data();
  p.cos = cos.data();
  p.sin = sin.data();
  p.num_positions = positions;
  p.q_norm = qk_norm ? qn.data() : nullptr;
  p.k_norm = qk_norm ? kn.data() : nullptr;
  p.eps = 1e-6f;
  p.num_tokens = t;
  p.num_q_heads = hq;
  p.num_kv_heads = hkv;
  p.head_dim = d;
  p.dtype = dtype;
  const std::string name =
      std::string("rotary ") + dtype_name(dtype) + " D=18 Hq=3 Hkv=1" + (qk_norm ? " qk-norm" : "");
  if (!expect(name + " runs", pyscore::rotary_cpu(p) == pyscore::kOk)) return;
  std::vector<double> want(qkv.size());
  for (size_t i = 0; i < want.size(); ++i) want[i] = before.get(i);  // v stays as it was
  for (int32_t tok = 0; tok < t; ++tok)
    for (int32_t head = 0; head < hq + hkv; ++head) {
      const size_t at = size_t(tok) * row + size_t(head) * d;
      const Buf& norm = head < hq ? qn : kn;
      std::vector<double> v(d);
      double ss = 0.0;
      for (int32_t i = 0; i < d; ++i) ss += double(before.get(at + i)) * before.get(at + i);
      const double r = 1.0 / std::sqrt(ss / d + 1e-6);
      for (int32_t i = 0; i < d; ++i)
        v[i] = qk_norm ? round_to(dtype, norm.get(i) * round_to(dtype, before.get(at + i) * r)) : before.get(at + i);
      const float* c = cos.data() + pos[tok] * d;
      const float* s = sin.data() + pos[tok] * d;
      for (int32_t i = 0; i < d / 2; ++i) {
        const int32_t j = i + d / 2;
        want[at + i] = round_to(dtype, v[i] * round_to(dtype, c[i])) - round_to(dtype, v[j] * round_to(dtype, s[i]));
        want[at + j] = round_to(dtype, v[j] * round_to(dtype, c[j])) + round_to(dtype, v[i] * round_to(dtype, s[j]));
      }
    }
  compare(name, qkv.size(), [&](size_t i) { return qkv.get(i); }, [&](size_t i) { return want[i]; }, tol_for(dtype));
}

void check_silu_mul_case(DType dtype) {
  const int32_t t = 3, width = 37;
  Buf gate_up(dtype, size_t(t) * 2 * width), out(dtype, size_t(t) * width);
  fill_uniform(gate_up, -6.0f, 6.0f);
  pyscore::SiluMulParams p{};
  p.gate = gate_up.data();
  p.up = static_cast<char*>(gate_up.data()) + size_t(width) * (dtype == DType::kBFloat16 ? 2 : 4);
  p.gate_row_stride = p.up_row_stride = 2 * width;
  p.out = out.data();
  p.out_row_stride = width;
  p.num_rows = t;
  p.width = width;
  p.dtype = dtype;
  const std::string name = std::string("silu_mul ") + dtype_name(dtype) + " I=37";
  if (!expect(name + " runs", pyscore::silu_mul_cpu(p) == pyscore::kOk)) return;
  compare(name, out.size(), [&](size_t i) { return out.get(i); },
          [&](size_t i) {
            const size_t r = i / width, c = i % width;
            return round_to(dtype, silu(gate_up.get(r * 2 * width + c))) * gate_up.get(r * 2 * width + width + c);
          },
          tol_for(dtype));
}

// ---- causal_conv1d and gated_delta_rule ------------------------------------------------------------------------

// A 2-token sequence (shorter than the conv window), a 4-token prefix continued by items of 1 and 3 tokens, and a
// 1-token prefix that no item continues.
const std::vector<int32_t> kLinearSegments = {0, 2, 0, 0, 2, 4, 0, 0, 6, 1, 2, 4, 7, 3, 2, 4, 10, 1, 0, 0};
constexpr int32_t kLinearTokens = 11, kLinearSegs = 5;

// The stream tokens of segment s's whole sequence, oldest first: its prefix's tokens, then its own.
std::vector<int32_t> sequence_of(int32_t s) {
  const int32_t* r = &kLinearSegments[4 * s];
  std::vector<int32_t> seq;
  for (int32_t j = r[2]; j < r[2] + r[3]; ++j) seq.push_back(j);
  for (int32_t j = r[0]; j < r[0] + r[1]; ++j) seq.push_back(j);
  return seq;
}

void check_conv_case(DType dtype) {
  const int32_t c = 12, taps = 4, x_stride = c + 2;
  Buf x(dtype, size_t(kLinearTokens) * x_stride), w(dtype, size_t(c) * taps), y(dtype, size_t(kLinearTokens) * c);
  fill_uniform(x);
  fill_uniform(w);
  pyscore::CausalConv1dParams p{};
  p.x = x.data();
  p.x_token_stride = x_stride;
  p.weight = w.data();
  p.y = y.data();
  p.y_token_stride = c;
  p.segments = kLinearSegments.data();
  p.num_segments = kLinearSegs;
  p.num_tokens = kLinearTokens;
  p.channels = c;
  p.kernel_size = taps;
  p.dtype = dtype;
  const std::string name = std::string("causal_conv1d ") + dtype_name(dtype) + " C=12 K=4 items continue prefix";
  if (!expect(name + " runs", pyscore::causal_conv1d_cpu(p) == pyscore::kOk)) return;
  std::vector<double> want(y.size());
  for (int32_t s = 0; s < kLinearSegs; ++s) {
    const std::vector<int32_t> seq = sequence_of(s);
    const int32_t own = kLinearSegments[4 * s + 1], first = int32_t(seq.size()) - own;
    for (int32_t i = first; i < int32_t(seq.size()); ++i)
      for (int32_t ch = 0; ch < c; ++ch) {
        double acc = 0.0;
        for (int32_t j = 0; j < taps; ++j) {
          const int32_t at = i - (taps - 1) + j;
          if (at >= 0) acc += double(w.get(size_t(ch) * taps + j)) * x.get(size_t(seq[at]) * x_stride + ch);
        }
        want[size_t(seq[i]) * c + ch] = silu(round_to(dtype, acc));
      }
  }
  compare(name, y.size(), [&](size_t i) { return y.get(i); }, [&](size_t i) { return want[i]; }, tol_for(dtype));
}

void check_gated_delta_rule_case(DType dtype) {
  const int32_t hk = 1, hv = 2, dk = 16, dv = 40;  // Dv = 40: a full and a narrow 32-column state block
  Buf q(dtype, size_t(kLinearTokens) * hk * dk), k(dtype, q.size()), v(dtype, size_t(kLinearTokens) * hv * dv),
      a(dtype, size_t(kLinearTokens) * hv), b(dtype, a.size()), o(dtype, v.size());
  for (Buf* t : {&q, &k, &v, &a, &b}) fill_uniform(*t);
  const std::vector<float> a_log = uniform(hv, -1.0f, 0.5f), dt_bias = uniform(hv, -0.5f, 0.5f);
  const std::vector<int32_t> slot = {-1, 0, 0, 0, -1};
  const float scale = 1.0f / std::sqrt(float(dk));
  pyscore::GatedDeltaRuleParams p{};
  p.q = q.data();
  p.k = k.data();
  p.q_token_stride = p.k_token_stride = int64_t(hk) * dk;
  p.q_head_stride = p.k_head_stride = dk;
  p.v = v.data();
  p.v_token_stride = p.o_token_stride = int64_t(hv) * dv;
  p.v_head_stride = p.o_head_stride = dv;
  p.a = a.data();
  p.b = b.data();
  p.a_token_stride = p.b_token_stride = hv;
  p.a_log = a_log.data();
  p.dt_bias = dt_bias.data();
  p.o = o.data();
  p.segments = kLinearSegments.data();
  p.num_segments = kLinearSegs;
  p.num_tokens = kLinearTokens;
  p.state_slot = slot.data();
  p.num_slots = 1;
  p.num_k_heads = hk;
  p.num_v_heads = hv;
  p.k_dim = dk;
  p.v_dim = dv;
  p.scale = scale;
  p.dtype = dtype;
  const std::string name =
      std::string("gated_delta_rule ") + dtype_name(dtype) + " Hv=2 Dk=16 Dv=40 items continue prefix";
  if (!expect(name + " runs", pyscore::gated_delta_rule_cpu(p) == pyscore::kOk)) return;
  std::vector<double> want(o.size());
  auto normalized = [&](const Buf& x, size_t at, double extra) {
    std::vector<double> out(dk);
    double ss = 0.0;
    for (int32_t i = 0; i < dk; ++i) ss += double(x.get(at + i)) * x.get(at + i);
    for (int32_t i = 0; i < dk; ++i) out[i] = x.get(at + i) / std::sqrt(ss + 1e-6) * extra;
    return out;
  };
  for (int32_t s = 0; s < kLinearSegs; ++s) {
    const std::vector<int32_t> seq = sequence_of(s);
    const int32_t first = int32_t(seq.size()) - kLinearSegments[4 * s + 1];
    for (int32_t h = 0; h < hv; ++h) {
      std::vector<double> state(size_t(dk) * dv, 0.0);  // S [Dk, Dv]
      for (int32_t i = 0; i < int32_t(seq.size()); ++i) {
        const int32_t t = seq[i], kh = h / (hv / hk);
        const std::vector<double> qn = normalized(q, (size_t(t) * hk + kh) * dk, scale);
        const std::vector<double> kn = normalized(k, (size_t(t) * hk + kh) * dk, 1.0);
        const double x = a.get(size_t(t) * hv + h) + dt_bias[h];
        const double decay = std::exp(-std::exp(double(a_log[h])) * (x > 20 ? x : std::log1p(std::exp(x))));
        const double beta = sigmoid(b.get(size_t(t) * hv + h));
        for (double& e : state) e *= decay;
        for (int32_t col = 0; col < dv; ++col) {
          double sk = 0.0;
          for (int32_t r = 0; r < dk; ++r) sk += state[size_t(r) * dv + col] * kn[r];
          const double delta = (v.get((size_t(t) * hv + h) * dv + col) - sk) * beta;
          double out = 0.0;
          for (int32_t r = 0; r < dk; ++r) out += (state[size_t(r) * dv + col] += kn[r] * delta) * qn[r];
          if (i >= first) want[(size_t(t) * hv + h) * dv + col] = out;
        }
      }
    }
  }
  const Tol tol = tol_for(dtype);
  compare(name, o.size(), [&](size_t i) { return o.get(i); }, [&](size_t i) { return want[i]; },
          Tol{std::max(tol.abs, 1e-4), std::max(tol.rel, 1e-4)});
}

}  // namespace

void check_layer_ops() {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    check_linear_case(dtype, false, dtype);
    check_linear_case(dtype, true, dtype);
    for (bool gated : {false, true})
      for (int32_t m : {1, 7, 20}) check_linear_int8_case(dtype, gated, m);
    for (bool delta : {false, true}) check_add_rms_norm_case(dtype, delta, false);
    check_add_rms_norm_case(dtype, true, true);
    check_rotary_case(dtype, false);
    check_rotary_case(dtype, true);
    check_silu_mul_case(dtype);
    check_conv_case(dtype);
    check_gated_delta_rule_case(dtype);
  }
  // A bf16 weight under fp32 x: up to 10 rows (AVX2: pairs widened as read), more (AVX2: a widened panel), odd K.
  for (bool gated : {false, true})
    for (int32_t m : {7, 12, 20}) check_linear_case(DType::kFloat32, gated, DType::kBFloat16, m);
}
