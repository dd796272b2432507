// Host-side CUDA helpers shared by the *_cuda.cu launchers: error mapping to Status and a device guard.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/dtype.h"

namespace pyscore {

// ---- host side -----------------------------------------------------------------------------------------

inline Status cuda_status(cudaError_t err) {
  if (err == cudaSuccess) return kOk;
  if (err == cudaErrorMemoryAllocation) return kOutOfMemory;
  return kCudaError;
}

// Evaluates a CUDA runtime call and returns its mapped Status from the enclosing function on failure.
#define PYSCORE_CUDA_TRY(expr)                                 \
  do {                                                         \
    const cudaError_t pyscore_err_ = (expr);                   \
    if (pyscore_err_ != cudaSuccess) {                         \
      (void)cudaGetLastError(); /* clear non-sticky errors */ \
      return ::pyscore::cuda_status(pyscore_err_);             \
    }                                                          \
  } while (0)

// Makes the device that owns `ptr` current for the guard's lifetime: the wrappers pass the stream of the
// tensors' device, which need not be the calling thread's current device.
class CudaDeviceGuard {
 public:
  CudaDeviceGuard() = default;
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;
  ~CudaDeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  cudaError_t set_from_pointer(const void* ptr) {
    cudaPointerAttributes attr{};
    cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
    if (err != cudaSuccess) return err;
    if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) return cudaErrorInvalidValue;
    int current = -1;
    err = cudaGetDevice(&current);
    if (err != cudaSuccess) return err;
    if (current != attr.device) {
      err = cudaSetDevice(attr.device);
      if (err != cudaSuccess) return err;
      previous_ = current;
    }
    return cudaSuccess;
  }

 private:
  int previous_ = -1;
};

inline bool aligned_to(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace pyscore
