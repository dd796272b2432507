// Shared pieces of the kernel check harness (kernel_check.cpp): tensors in a kernel dtype, seeded random inputs,
// the comparison that prints one line per check. References are computed in double from the values the kernel
// actually read (inputs already rounded to the dtype), so a difference is the kernel's own error.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "common/dtype.h"

namespace check {

using pyscore::DType;

inline const char* dtype_name(DType d) { return d == DType::kBFloat16 ? "bf16" : "fp32"; }

// A flat tensor stored in the kernel's dtype (fp32, or bf16 as uint16_t).
struct Buf {
  DType dtype;
  std::vector<float> f32;
  std::vector<uint16_t> b16;
  Buf(DType d, size_t n) : dtype(d) {
    if (d == DType::kBFloat16) b16.assign(n, 0); else f32.assign(n, 0.0f);
  }
  size_t size() const { return dtype == DType::kBFloat16 ? b16.size() : f32.size(); }
  void* data() { return dtype == DType::kBFloat16 ? static_cast<void*>(b16.data()) : f32.data(); }
  float get(size_t i) const { return dtype == DType::kBFloat16 ? pyscore::bf16_to_f32(b16[i]) : f32[i]; }
  void set(size_t i, float x) {
    if (dtype == DType::kBFloat16) b16[i] = pyscore::bf16_from_f32(x); else f32[i] = x;
  }
  uint32_t bits(size_t i) const {
    if (dtype == DType::kBFloat16) return b16[i];
    uint32_t u;
    std::memcpy(&u, &f32[i], 4);
    return u;
  }
};

inline std::mt19937& rng() {
  static std::mt19937 gen(1234);
  return gen;
}

inline void fill_uniform(Buf& b, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> u(lo, hi);
  for (size_t i = 0; i < b.size(); ++i) b.set(i, u(rng()));
}

inline std::vector<float> uniform(size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng());
  return v;
}

// The value a dtype store of x gives back (the kernels' intermediate roundings, where a contract names them).
inline double round_to(DType d, double x) {
  return d == DType::kBFloat16 ? pyscore::bf16_to_f32(pyscore::bf16_from_f32(float(x))) : float(x);
}

// Tolerance of an output stored in `out` computed from inputs of `in`: one rounding of the output plus fp32
// accumulation, at most a few units in the last place of |ref| <= ~1 (bf16: 2^-8 = two half-ulps at 1.0).
struct Tol {
  double abs, rel;
};
inline Tol tol_for(DType out) { return out == DType::kBFloat16 ? Tol{1.0 / 128, 1.0 / 128} : Tol{2e-5, 2e-5}; }

int& failures();

// Compares got[i] to want[i] (both given as functions of i) and prints one line: ok/FAIL, the name, the max |diff|.
template <class Got, class Want>
bool compare(const std::string& name, size_t n, Got got, Want want, Tol tol) {
  double max_diff = 0.0, sum_diff = 0.0;
  size_t worst = 0, bad = 0;
  for (size_t i = 0; i < n; ++i) {
    const double g = got(i), w = want(i);
    const bool same_inf = std::isinf(g) && std::isinf(w) && (g > 0) == (w > 0);
    const double d = same_inf ? 0.0 : std::fabs(g - w);
    if (!(d <= tol.abs + tol.rel * std::fabs(w))) ++bad;  // NaN counts as bad
    if (!(d <= max_diff)) max_diff = d, worst = i;
    sum_diff += same_inf ? 0.0 : d;
  }
  const bool ok = bad == 0;
  std::printf("%-4s %-58s n=%-6zu max|diff| %.3g (at %zu)  mean %.3g\n", ok ? "ok" : "FAIL", name.c_str(), n,
              max_diff, worst, n ? sum_diff / double(n) : 0.0);
  if (!ok) {
    std::printf("     %zu of %zu outside %.3g + %.3g |want|; at %zu: got %.9g want %.9g\n", bad, n, tol.abs, tol.rel,
                worst, double(got(worst)), double(want(worst)));
    ++failures();
  }
  return ok;
}

// A check that is a yes/no statement (a status, bitwise equality).
inline bool expect(const std::string& name, bool ok, const std::string& detail = "") {
  std::printf("%-4s %s%s%s\n", ok ? "ok" : "FAIL", name.c_str(), detail.empty() ? "" : ": ", detail.c_str());
  failures() += !ok;
  return ok;
}

inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
inline double silu(double x) { return x * sigmoid(x); }

}  // namespace check
