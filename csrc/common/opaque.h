// opaque(p): `p` unchanged, but opaque to the optimizer. In a register-blocked tile where each vector meets several
// rows' broadcast scalars, GCC hoists the broadcasts of all rows into registers across the vectors (12 for 6 rows of
// pairs) and then spills accumulators in the inner loop; loading the scalars through a pointer laundered per vector
// makes each broadcast single-use, so on AVX-512 it folds into the FMA as an embedded {1to16} memory operand.
#pragma once

namespace pyscore {

template <class T>
static inline const T* opaque(const T* p) {
  asm volatile("" : "+r"(p));  // volatile: identical statements must not be merged
  return p;
}

}  // namespace pyscore
