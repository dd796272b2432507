// Element types the kernels accept. The Python wrappers map torch dtypes to these by name.
#pragma once
#include <cstdint>
#include <string>

namespace pyscore {

enum class DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Returns false for an unknown name; `out` is untouched then.
inline bool parse_dtype(const std::string& name, DType* out) {
  if (name == "float32") { *out = DType::kFloat32; return true; }
  if (name == "bfloat16") { *out = DType::kBFloat16; return true; }
  if (name == "float16") { *out = DType::kFloat16; return true; }
  return false;
}

// Error codes returned by every launcher (0 = ok). Bindings turn them into Python exceptions.
enum Status : int32_t {
  kOk = 0,
  kUnsupportedDType = 1,
  kInvalidArgument = 2,
  kUnsupportedHeadDim = 3,
  kCudaError = 4,
  kOutOfMemory = 5,
};

}  // namespace pyscore
