// The flat Python arguments of the bindings (bindings_cpu.cpp, bindings_cuda.cpp): pointers arrive as ints
// (tensor.data_ptr()), taken as Ptr, strides as (token, head) tuples, dtypes by name; bind_op binds an op from its
// params struct and argument types (common/op_args.h: the op header's PYSCORE_BIND line), the same for both modules.
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "common/dtype.h"
#include "common/op_args.h"

namespace pyscore {

inline DType dtype_or_throw(const std::string& name) {
  DType dt;
  if (!parse_dtype(name, &dt)) throw std::invalid_argument("unknown dtype '" + name + "'");
  return dt;
}

inline void throw_on_error(Status status, const char* op) {
  switch (status) {
    case kOk: return;
    case kUnsupportedDType: throw std::invalid_argument(std::string(op) + ": unsupported dtype for this device");
    case kUnsupportedHeadDim: throw std::invalid_argument(std::string(op) + ": unsupported head_dim");
    case kInvalidArgument: throw std::invalid_argument(std::string(op) + ": invalid argument");
    case kOutOfMemory: throw std::runtime_error(std::string(op) + ": out of memory");
    default: throw std::runtime_error(std::string(op) + ": kernel failed with status " + std::to_string(status));
  }
}

// ---- One binding per op ------------------------------------------------------------------------------------------
// An op's Python wrapper passes its params struct's fields in declaration order; each Python argument gives one
// field (a Ptr, a number, a dtype name) or several (a (token, head) Strides pair: two; CacheStrides: three), and
// params_from aggregate-initializes the struct from them. A field missing or extra, a pointer where the struct
// declares a number, a narrowing conversion: each fails to compile, so an argument list cannot drift from its struct.

template <class T>
std::tuple<T> fields_of(const T& x) { return {x}; }
inline std::tuple<DType> fields_of(const std::string& dtype) { return {dtype_or_throw(dtype)}; }
inline std::tuple<int64_t, int64_t> fields_of(const Strides& s) { return {s.first, s.second}; }
inline CacheStrides fields_of(const CacheStrides& s) { return s; }

// Converts to anything: probes whether a struct takes one more field.
struct AnyField {
  template <class T>
  operator T() const;
};

template <class Params, class Fields, class = void>
struct takes_more_fields : std::false_type {};
template <class Params, class... F>
struct takes_more_fields<Params, std::tuple<F...>, std::void_t<decltype(Params{std::declval<F>()..., AnyField{}})>>
    : std::true_type {};

template <class Params, class... A>
Params params_from(const A&... args) {
  auto fields = std::tuple_cat(fields_of(args)...);
  static_assert(!takes_more_fields<Params, decltype(fields)>::value, "the arguments leave fields of Params unset");
  return std::apply([](const auto&... f) { return Params{f...}; }, fields);
}

// CPU: `name`(args...) runs launch(params) with the GIL released (the decoder's elementwise ops too, tens of
// microseconds each: the server's event loop is never held up by model work); the status becomes an exception.
template <class Params, class... A>
void bind_op(pybind11::module_& m, const char* name, Status (*launch)(const Params&), Args<A...>) {
  m.def(name, [name, launch](A... args) {
    const Params p = params_from<Params>(args...);
    Status status;
    {
      pybind11::gil_scoped_release release;
      status = launch(p);
    }
    throw_on_error(status, name);
  });
}

// CUDA: `name`(args..., stream) queues launch(params, stream) (asynchronous: the GIL is not worth releasing).
template <class Params, class... A>
void bind_op(pybind11::module_& m, const char* name, Status (*launch)(const Params&, void*), Args<A...>) {
  m.def(name, [name, launch](A... args, uintptr_t stream) {
    throw_on_error(launch(params_from<Params>(args...), reinterpret_cast<void*>(stream)), name);
  });
}

}  // namespace pyscore

namespace pybind11::detail {

template <>
struct type_caster<pyscore::Ptr> {
  PYBIND11_TYPE_CASTER(pyscore::Ptr, const_name("int"));
  bool load(handle src, bool convert) {
    make_caster<uintptr_t> address;
    if (!address.load(src, convert)) return false;
    value.address = cast_op<uintptr_t>(address);
    return true;
  }
  static handle cast(pyscore::Ptr p, return_value_policy policy, handle parent) {
    return make_caster<uintptr_t>::cast(p.address, policy, parent);
  }
};

}  // namespace pybind11::detail
