// An op's Python signature, declared in its header beside its params struct (no pybind11 here, so the kernel check
// harness and the aarch64 build include the headers without Python): PYSCORE_BIND(op, launcher, argument types...)
// names the CPU launcher the generated bindings bind as `op`, and the argument types the Python wrapper passes, one
// per params field (a Ptr, a number, a dtype name) or several (a (token, head) Strides pair: two; CacheStrides:
// three). cmake/kernel_table.cmake reads the line, so a new op is bound by its header alone; the CUDA module binds
// its launchers by hand with the same `op_bind_args` (common/bind_args.h checks each list against its struct).
#pragma once
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>

namespace pyscore {

// A tensor's address as the Python wrappers pass it (tensor.data_ptr(), an int; 0 for none), typed: it converts to
// whichever pointer a params field holds, so a binding fills its params struct directly (aggregate initialization,
// in the order the op header declares the fields).
struct Ptr {
  uintptr_t address = 0;
  template <class T>
  operator T*() const { return reinterpret_cast<T*>(address); }
};

using Strides = std::pair<int64_t, int64_t>;
// One layer's cached blocks: (block, token, head) strides in elements.
using CacheStrides = std::tuple<int64_t, int64_t, int64_t>;
using DTypeName = std::string;

// The Python argument types of an op, the same for both modules (a CUDA binding appends the stream).
template <class... A>
struct Args {};

// At the start of a line in an op header (namespace pyscore): the generated CPU bindings bind `launcher` as `op`.
#define PYSCORE_BIND(op, launcher, ...) using op##_bind_args = ::pyscore::Args<__VA_ARGS__>

}  // namespace pyscore
