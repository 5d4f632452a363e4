// AMX tile basics shared by the kernels that use tiles (Sapphire Rapids and later, bfloat16):
// the tile configuration and the process's permission to use the tile state.
//
// Tiles are per-thread state: a kernel's parallel body loads its configuration with
// _tile_loadconfig before the first tile instruction and calls _tile_release when done, so an
// idle thread does not carry 8 KB of tile state through context switches.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SHARDSERVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace amx {

// The 64-byte operand of ldtilecfg (palette 1). Tiles a kernel does not use keep zero rows and
// bytes, as the architecture requires.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row
  uint8_t rows[16] = {};

  void shape(int tile, int64_t num_rows, int64_t row_bytes) {
    rows[tile] = static_cast<uint8_t>(num_rows);
    colsb[tile] = static_cast<uint16_t>(row_bytes);
  }
};

// Linux hands the tile state only to a process that asks for it, once.
inline bool permitted() {
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtileData) == 0;
  }();
  return granted;
}

}  // namespace amx
#endif  // __AMX_TILE__ && __AMX_BF16__
