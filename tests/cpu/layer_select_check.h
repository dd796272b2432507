// A check of the vector layer's names that kernel texts shared across ISAs use in place of raw intrinsics (lane
// masks and select, the bf16 row interleave), written once against `V`: simd_check_avx2.cpp and
// simd_check_neon.cpp include it after declaring `namespace V` as their layer, as the kernels do.
#pragma once
#include <cstdint>
#include <cstring>

namespace {

// Mismatches of: select(first_lanes(n), yes, no) keeps lanes < n of yes and the others of no, for every n; and
// store_zip writes a[i], b[i] alternately, 2 * kZipDims elements and no more, a null row as zeros.
long select_and_zip_mismatches() {
  long bad = 0;
  float yes[V::kLanes], no[V::kLanes], got[V::kLanes];
  for (int l = 0; l < V::kLanes; ++l) yes[l] = float(l + 1), no[l] = -float(l + 1);
  for (int n = 0; n <= V::kLanes; ++n) {
    V::store(got, V::select(V::first_lanes(n), V::load(yes), V::load(no)));
    for (int l = 0; l < V::kLanes; ++l) bad += got[l] != (l < n ? yes[l] : no[l]);
  }
  constexpr int n = V::kZipDims;
  uint16_t a[n], b[n], out[2 * n + 2];
  for (int i = 0; i < n; ++i) a[i] = uint16_t(0x100 + i), b[i] = uint16_t(0x200 + i);
  for (int null_row = 0; null_row < 3; ++null_row) {  // none, a, b
    std::memset(out, 0xAB, sizeof(out));
    V::store_zip(out + 1, null_row == 1 ? nullptr : a, null_row == 2 ? nullptr : b);
    for (int i = 0; i < n; ++i)
      bad += out[1 + 2 * i] != (null_row == 1 ? 0 : a[i]) || out[2 + 2 * i] != (null_row == 2 ? 0 : b[i]);
    bad += out[0] != 0xABAB || out[2 * n + 1] != 0xABAB;
  }
  return bad;
}

}  // namespace
