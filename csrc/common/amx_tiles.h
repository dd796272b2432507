// The AMX tile configuration the tile kernels share (linear, prefix_item_attention, label_logprobs at tier amx):
// palette 1, tiles 0-7 each 16 rows x 64 bytes (a C tile of 16 x 16 fp32, an A or B tile of 16 x 32 bf16).
// Compiled only into *_avx512.cpp / *_amx.cpp (cmake/cpu_kernels.cmake gives them -mamx-tile). A kernel loads it at
// the start of a call on its thread and releases the tiles at the end: the tile state is per thread, and Linux
// grants it to the process once (cpu_amx_permitted in common/cpu_features.h).
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace pyscore {

struct alignas(64) AmxTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void load_amx_tiles_16x64() {
  AmxTileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace pyscore
