// A block of up to 32 rows against one panel of 32 columns on AMX tiles (bfloat16, Sapphire
// Rapids and later): the panel linear kernel's inner step (panel_linear.cpp owns the packing and
// the threading) and both prefill-attention products (blocks of 32 keys, and of 32 values,
// packed as panels).
//
// A panel ([K/2][32 columns][2]: k in pairs, as the tile dot product takes them) read 16 k pairs
// at a time is two AMX B tiles side by side, rows 128 bytes apart:
//
//   panel bytes, k pair p:  | cols 0-15 x pair (64 B) | cols 16-31 x pair (64 B) |
//                             ^ B tile 0, row p % 16    ^ B tile 1, row p % 16
//
// One block of up to 32 rows of x against one panel keeps all eight tiles busy:
//   tmm0 tmm1   C: rows 0-15  x cols 0-15 | cols 16-31     (float32 sums)
//   tmm2 tmm3   C: rows 16-31 x cols 0-15 | cols 16-31
//   tmm4 tmm5   A: rows 0-15 | rows 16-31 of x, 32 k values
//   tmm6 tmm7   B: the panel's two column halves, 32 k values
// Each row's sums run over k in the same order whatever the block's height and whatever rows
// share it: a row's result does not depend on the batch.
#pragma once

#include "amx_tiles.h"

#if defined(SHARDSERVE_AMX)

namespace amx {

constexpr int64_t kBlockRows = 32;  // rows of x per block: two A tiles
constexpr int64_t kStepK = 32;      // k values per tile step: 16 pairs

// Tiles shaped for a block of `rows` (1..32) rows; a short block leaves the bottom ones unused.
inline TileConfig config_for(int64_t rows) {
  TileConfig cfg;
  const uint8_t top = static_cast<uint8_t>(std::min<int64_t>(rows, 16)), bottom = static_cast<uint8_t>(rows - top);
  const uint8_t height[8] = {top, top, bottom, bottom, top, bottom, 16, 16};
  for (int t = 0; t < 8; ++t) cfg.shape(t, height[t], height[t] ? 64 : 0);
  return cfg;
}

// How a block moves memory while it computes: `lines_per_step` cache lines from `from` pulled
// toward L2 at each k step (so a panel's blocks can share the next panel's stream between them;
// into L2: bursts into L1 stalled on its miss buffers, cold-weight steps at 128 rows 30.9 -> 22.9
// ms), and with `stream_panel` the panel's tiles loaded with the streaming hint, not kept in L1:
// a linear's weights pass once per block and would push x out of L1 (the model's 30 layers of
// linears: 0.97x the time at 64-128 rows, 0.98x at 512, unchanged at 1-32).
struct Prefetch {
  const char* from = nullptr;
  int64_t lines_per_step = 0;
  bool stream_panel = false;
};

// sums[r][0:32] (float32, rows `ld_sums` apart) = bias + x[r, :] . panel columns, for the rows
// the tiles were configured for (config_for). x: `ksteps` * 32 readable values per row, `ldx`
// apart; bias: 32 float32 values or null.
template <bool kTwoRowTiles>
inline void panel_sums(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* panel, int64_t ksteps,
                       const float* bias, float* sums, int64_t ld_sums, Prefetch prefetch = {}) {
  if (bias) {  // every row starts from the bias: a stride-0 load repeats one row
    _tile_loadd(0, bias, 0);
    _tile_loadd(1, bias + 16, 0);
    if constexpr (kTwoRowTiles) {
      _tile_loadd(2, bias, 0);
      _tile_loadd(3, bias + 16, 0);
    }
  } else {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (kTwoRowTiles) {
      _tile_zero(2);
      _tile_zero(3);
    }
  }
  const int64_t x_stride = ldx * 2;
  for (int64_t s = 0; s < ksteps; ++s) {
    const c10::BFloat16* w = panel + s * kStepK * 32;  // 16 pairs x 32 columns x 2
    for (int64_t line = 0; line < prefetch.lines_per_step; ++line)
      _mm_prefetch(prefetch.from + (s * prefetch.lines_per_step + line) * 64, _MM_HINT_T1);
    if (prefetch.stream_panel) {
      _tile_stream_loadd(6, w, 128);
      _tile_stream_loadd(7, w + 32, 128);
    } else {
      _tile_loadd(6, w, 128);
      _tile_loadd(7, w + 32, 128);
    }
    _tile_loadd(4, x + s * kStepK, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (kTwoRowTiles) {
      _tile_loadd(5, x + 16 * ldx + s * kStepK, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  const int64_t sums_stride = ld_sums * 4;
  _tile_stored(0, sums, sums_stride);
  _tile_stored(1, sums + 16, sums_stride);
  if constexpr (kTwoRowTiles) {
    _tile_stored(2, sums + 16 * ld_sums, sums_stride);
    _tile_stored(3, sums + 16 * ld_sums + 16, sums_stride);
  }
}

// panel_sums for a block of `rows` (1..32) rows; the tiles are shaped for it first unless this
// thread's `configured` height (0: none yet) already is that
inline void block_sums(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* panel, int64_t ksteps,
                       const float* bias, float* sums, int64_t ld_sums, int64_t rows, int64_t& configured,
                       Prefetch prefetch = {}) {
  if (rows != configured) {
    const TileConfig cfg = config_for(rows);
    _tile_loadconfig(&cfg);
    configured = rows;
  }
  if (rows > 16) panel_sums<true>(x, ldx, panel, ksteps, bias, sums, ld_sums, prefetch);
  else panel_sums<false>(x, ldx, panel, ksteps, bias, sums, ld_sums, prefetch);
}

// y[rows, cols] = x[rows, :] W_panel^T (+ bias) in bf16
inline void block(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* panel, int64_t ksteps,
                  const float* bias, c10::BFloat16* y, int64_t ldy, int64_t rows, int64_t cols, int64_t& configured,
                  Prefetch prefetch) {
  alignas(64) float sums[kBlockRows][32];
  block_sums(x, ldx, panel, ksteps, bias, &sums[0][0], 32, rows, configured, prefetch);
  const __mmask16 m0 = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  for (int64_t r = 0; r < rows; ++r) {  // float32 -> bfloat16 to nearest even, as torch rounds
    _mm256_mask_storeu_epi16(y + r * ldy, m0, (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(&sums[r][0])));
    _mm256_mask_storeu_epi16(y + r * ldy + 16, m1, (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(&sums[r][16])));
  }
}

}  // namespace amx
#endif  // SHARDSERVE_AMX
