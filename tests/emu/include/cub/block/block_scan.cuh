// Emulator stand-in for cub::BlockScan (only the calls the kernels make); O(threads) per thread, plenty fast.
#pragma once

namespace cub {

template <typename T, int kThreads>
class BlockScan {
 public:
  struct TempStorage {
    T values[kThreads];
  };
  explicit BlockScan(TempStorage& storage) : s_(storage) {}

  template <class Op>
  void InclusiveScan(T input, T& output, Op op) {
    const int tid = threadIdx.x;
    s_.values[tid] = input;
    __syncthreads();
    T acc = s_.values[0];
    for (int i = 1; i <= tid; ++i) acc = op(acc, s_.values[i]);
    output = acc;
    __syncthreads();
  }

  void ExclusiveSum(T input, T& output, T& total) {
    const int tid = threadIdx.x;
    s_.values[tid] = input;
    __syncthreads();
    T acc = 0, all = 0;
    for (int i = 0; i < kThreads; ++i) {
      if (i < tid) acc += s_.values[i];
      all += s_.values[i];
    }
    output = acc;
    total = all;
    __syncthreads();
  }

 private:
  TempStorage& s_;
};

}  // namespace cub
