// Paged prefill attention on CPU (AVX-512): the causal attention of prefill chunks, keys and values
// read from the block pool, where the chunk's own keys were stored just before (so a prefix-cache
// hit or an earlier chunk costs nothing extra: no gather copy, no mask tensor).
//
// Work is cut into tiles of one chunk's query tokens x one kv head: the G query heads sharing the
// kv head and QT tokens make a tile's R = G * QT query rows (QT = 96 / G), so each key and value
// is used R times while it sits in L1. The tile walks the context in key blocks of 32 positions,
// flash-attention style: S = Q K^T for the block, the running max and sum per row updated, the
// outputs rescaled and P V added; everything in float32 (bf16 widened exactly), 16 lanes.
//   - Before the tiles run, each (chunk, kv head)'s keys are packed once into transposed float32
//     blocks [D][32] (S's inner loop then broadcasts one query value against 16 keys) and its
//     values widened into [32][D]; positions past the context are zero.
//   - Key blocks sit at fixed absolute positions and a row's sums run over them in order, its
//     masked keys contributing exact zeros: a query row's result depends on its own position and
//     the keys before it only, not on how its sequence was chunked or what else is in the batch.
//   - Tiles late in a sequence see more keys: the threads take them longest first, each the
//     next one not yet taken, so they finish together.
//   - With AMX (bf16) both products run on tiles instead (pack_keys_panel and below); the
//     softmax stays in float32 on 16 lanes.
//
//   q            [T, H, D]                      (float32 or bfloat16, contiguous)
//   k/v cache    [KV, num_blocks, bs, D]        (same dtype, contiguous)
//   block_table  [C, max_blocks] int64          one row per chunk
//   query_starts, query_lens, context_lens [C] int64: chunk c's queries are rows
//                [query_starts[c], +query_lens[c]) of q, the last query_lens[c] positions of a
//                context of context_lens[c] tokens
//   out          [T, H, D]                      only the chunks' rows are written
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#include "vector_math.h"
#endif
#include "amx_panel.h"

namespace {

#if defined(__AVX512F__)
constexpr int64_t kKeys = 32;      // keys per block: two 16-lane registers of scores
constexpr int64_t kTileRows = 96;  // query rows per tile (G heads x QT tokens)
constexpr int64_t kScoreRows = 8;  // rows per S register block: 16 accumulators

struct Tile {
  int64_t chunk, kv_head, token_begin, token_end, cost;
};

// s[r][0:32] = sum_d qf[r][d] * kt[d][0:32] for RN rows (qf already scaled)
template <int RN>
inline void score_block(const float* qf, int64_t head_dim, const float* kt, float* s) {
  __m512 acc[RN][2];
#pragma GCC unroll 8
  for (int r = 0; r < RN; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; ++d) {
    const __m512 k0 = _mm512_loadu_ps(kt + d * kKeys), k1 = _mm512_loadu_ps(kt + d * kKeys + 16);
#pragma GCC unroll 8
    for (int r = 0; r < RN; ++r) {
      const __m512 qv = _mm512_set1_ps(qf[r * head_dim + d]);
      acc[r][0] = _mm512_fmadd_ps(qv, k0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(qv, k1, acc[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RN; ++r) {
    _mm512_storeu_ps(s + r * kKeys, acc[r][0]);
    _mm512_storeu_ps(s + r * kKeys + 16, acc[r][1]);
  }
}

// o[r] = o[r] * alpha[r] + sum_j p[r][j] * v[j] for RN rows of ND 16-lane vectors each
template <int ND, int RN>
inline void accumulate_block(const float* p, const float* v, const float* alpha, float* o) {
  constexpr int64_t head_dim = ND * 16;
  __m512 acc[RN][ND];
#pragma GCC unroll 12
  for (int r = 0; r < RN; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < ND; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < kKeys; ++j) {
    __m512 vj[ND];
#pragma GCC unroll 8
    for (int c = 0; c < ND; ++c) vj[c] = _mm512_loadu_ps(v + j * head_dim + c * 16);
#pragma GCC unroll 12
    for (int r = 0; r < RN; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r * kKeys + j]);
#pragma GCC unroll 8
      for (int c = 0; c < ND; ++c) acc[r][c] = _mm512_fmadd_ps(pr, vj[c], acc[r][c]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < RN; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 8
    for (int c = 0; c < ND; ++c) {
      float* dst = o + r * head_dim + c * 16;
      _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_loadu_ps(dst), a, acc[r][c]));
    }
  }
}

template <int RN>
void score_rows(const float* qf, int64_t head_dim, const float* kt, float* s, int64_t rows) {
  int64_t r = 0;
  for (; r + RN <= rows; r += RN) score_block<RN>(qf + r * head_dim, head_dim, kt, s + r * kKeys);
  switch (rows - r) {
    case 0: break;
    case 1: score_block<1>(qf + r * head_dim, head_dim, kt, s + r * kKeys); break;
    case 2: score_block<2>(qf + r * head_dim, head_dim, kt, s + r * kKeys); break;
    case 3: score_block<3>(qf + r * head_dim, head_dim, kt, s + r * kKeys); break;
    case 4: score_block<4>(qf + r * head_dim, head_dim, kt, s + r * kKeys); break;
    case 5: score_block<5>(qf + r * head_dim, head_dim, kt, s + r * kKeys); break;
    case 6: score_block<6>(qf + r * head_dim, head_dim, kt, s + r * kKeys); break;
    default: score_block<7>(qf + r * head_dim, head_dim, kt, s + r * kKeys); break;
  }
}

// rows of o in register blocks of RN = 24 / ND rows (24 accumulators), then the remainder one by one
template <int ND>
void accumulate_rows(const float* p, const float* v, const float* alpha, float* o, int64_t rows) {
  constexpr int RN = 24 / ND;
  int64_t r = 0;
  for (; r + RN <= rows; r += RN) accumulate_block<ND, RN>(p + r * kKeys, v, alpha + r, o + r * ND * 16);
  for (; r < rows; ++r) accumulate_block<ND, 1>(p + r * kKeys, v, alpha + r, o + r * ND * 16);
}

void accumulate(int64_t head_dim, const float* p, const float* v, const float* alpha, float* o, int64_t rows) {
  switch (head_dim) {
    case 32: accumulate_rows<2>(p, v, alpha, o, rows); break;
    case 64: accumulate_rows<4>(p, v, alpha, o, rows); break;
    default: accumulate_rows<8>(p, v, alpha, o, rows); break;
  }
}

// keys of positions [block * 32, +32) of one (chunk, kv head), transposed: kt[d][j]; values
// widened: v[j][d]; positions at or past context_len are zero
// Where position `pos`'s row starts in one kv head's cache (elements; the table maps its block).
inline int64_t row_offset(const int64_t* table, int64_t pos, int64_t block_size, int64_t head_dim) {
  return (table[pos / block_size] * block_size + pos % block_size) * head_dim;
}

template <typename T>
void pack_block(const T* k_base, const T* v_base, const int64_t* table, int64_t block, int64_t context_len,
                int64_t block_size, int64_t head_dim, float* kt, float* v) {
  for (int64_t j = 0; j < kKeys; ++j) {
    const int64_t pos = block * kKeys + j;
    if (pos >= context_len) {
      for (int64_t d = 0; d < head_dim; ++d) kt[d * kKeys + j] = 0.f;
      std::fill(v + j * head_dim, v + (j + 1) * head_dim, 0.f);
      continue;
    }
    const int64_t row = row_offset(table, pos, block_size, head_dim);
    for (int64_t d = 0; d < head_dim; d += 16) {
      alignas(64) float widened[16];
      _mm512_store_ps(widened, load16(k_base + row + d));
      for (int i = 0; i < 16; ++i) kt[(d + i) * kKeys + j] = widened[i];
      _mm512_storeu_ps(v + j * head_dim + d, load16(v_base + row + d));
    }
  }
}

#if defined(SHARDSERVE_AMX)
// The cache row of position `pos` of one kv head, or null past the context.
inline const c10::BFloat16* cache_row(const c10::BFloat16* base, const int64_t* table, int64_t pos,
                                      int64_t context_len, int64_t block_size, int64_t head_dim) {
  return pos < context_len ? base + row_offset(table, pos, block_size, head_dim) : nullptr;
}

// rows[i] (16 x 32-bit each) transposed in place: rows[i][j] <-> rows[j][i]
inline void transpose16(__m512i rows[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // 32-bit pairs
    t[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // 64-bit pairs
    rows[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    rows[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    rows[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    rows[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes: first across pairs of groups of 4 rows, then of 8
    t[i] = _mm512_shuffle_i32x4(rows[i], rows[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(rows[i], rows[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_i32x4(rows[i + 8], rows[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(rows[i + 8], rows[i + 12], 0xDD);
  }
  for (int i = 0; i < 8; ++i) {
    rows[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    rows[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
  }
}

// With AMX (bf16, head_dim a multiple of 32) both products run on tiles, as 32-column panels
// (amx_panel.h), zero past the context:
//   keys:   one panel, kp[d / 2][j] = the pair K[j][d], K[j][d + 1]; 32 query rows at a time meet
//           it as A tiles, unscaled (the scale is applied to S in float32);
//   values: head_dim / 32 panels, vp[p][j / 2][e] = the pair V[j][32 p + e], V[j + 1][32 p + e];
//           the probabilities, rounded to bf16 (as torch's CPU flash attention and GPU kernels
//           round them), are the A tiles, and the float32 sums are added to the outputs.
void pack_keys_panel(const c10::BFloat16* k_base, const int64_t* table, int64_t block, int64_t context_len,
                     int64_t block_size, int64_t head_dim, c10::BFloat16* panel) {
  uint32_t* kp = reinterpret_cast<uint32_t*>(panel);
  for (int64_t j0 = 0; j0 < kKeys; j0 += 16) {  // 16 keys x 16 dim pairs at a time, transposed
    const c10::BFloat16* key[16];
    for (int64_t j = 0; j < 16; ++j) key[j] = cache_row(k_base, table, block * kKeys + j0 + j, context_len, block_size, head_dim);
    for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
      __m512i rows[16];
      for (int j = 0; j < 16; ++j) rows[j] = key[j] ? _mm512_loadu_si512(key[j] + d0) : _mm512_setzero_si512();
      transpose16(rows);  // rows[i] = pair d0 / 2 + i of the 16 keys
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(kp + (d0 / 2 + i) * kKeys + j0, rows[i]);
    }
  }
}

void pack_values_panels(const c10::BFloat16* v_base, const int64_t* table, int64_t block, int64_t context_len,
                        int64_t block_size, int64_t head_dim, c10::BFloat16* panels) {
  // out[2 e + h] = row h's value e: the first 16 e from the low index vector, the next from the high
  struct Interleave {
    alignas(64) int16_t lo[32], hi[32];
    Interleave() {
      for (int k = 0; k < 32; ++k) {
        lo[k] = static_cast<int16_t>((k % 2) * 32 + k / 2);
        hi[k] = static_cast<int16_t>((k % 2) * 32 + 16 + k / 2);
      }
    }
  };
  static const Interleave index;  // built once, not per block
  const __m512i lo = _mm512_load_si512(index.lo), hi = _mm512_load_si512(index.hi);
  for (int64_t j = 0; j < kKeys; j += 2) {  // panel p, pair row j / 2: V[j][32 p + e], V[j + 1][32 p + e]
    const c10::BFloat16* a = cache_row(v_base, table, block * kKeys + j, context_len, block_size, head_dim);
    const c10::BFloat16* b = cache_row(v_base, table, block * kKeys + j + 1, context_len, block_size, head_dim);
    for (int64_t p = 0; p < head_dim / 32; ++p) {
      const __m512i va = a ? _mm512_loadu_si512(a + 32 * p) : _mm512_setzero_si512();
      const __m512i vb = b ? _mm512_loadu_si512(b + 32 * p) : _mm512_setzero_si512();
      c10::BFloat16* out = panels + p * kKeys * 32 + (j / 2) * 64;
      _mm512_storeu_si512(out, _mm512_permutex2var_epi16(va, lo, vb));
      _mm512_storeu_si512(out + 32, _mm512_permutex2var_epi16(va, hi, vb));
    }
  }
}

// o[r] = o[r] * alpha[r] + sum_j p[r][j] v[j] for `rows` rows: p (float32, 32 per row) rounded to
// bf16 into pb, products on tiles into sums, added in float32
void accumulate_tiles(const float* p, const c10::BFloat16* panels, const float* alpha, float* o, int64_t rows,
                      int64_t head_dim, c10::BFloat16* pb, float* sums, int64_t& configured) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 lo = _mm512_loadu_ps(p + r * kKeys), hi = _mm512_loadu_ps(p + r * kKeys + 16);
    _mm512_storeu_si512(pb + r * kKeys, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
  for (int64_t r = 0; r < rows; r += amx::kBlockRows) {
    const int64_t height = std::min(amx::kBlockRows, rows - r);
    for (int64_t panel = 0; panel < head_dim / 32; ++panel) {
      amx::block_sums(pb + r * kKeys, kKeys, panels + panel * kKeys * 32, 1, nullptr, sums, 32, height, configured);
      for (int64_t i = 0; i < height; ++i) {
        const __m512 a = _mm512_set1_ps(alpha[r + i]);
        float* dst = o + (r + i) * head_dim + panel * 32;
        _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_loadu_ps(dst), a, _mm512_loadu_ps(sums + i * 32)));
        _mm512_storeu_ps(dst + 16, _mm512_fmadd_ps(_mm512_loadu_ps(dst + 16), a, _mm512_loadu_ps(sums + i * 32 + 16)));
      }
    }
  }
}

// s[r][0:32] = q_r . keys of the panel, for `rows` rows of q (bf16, head_dim apart)
void score_rows_tiles(const c10::BFloat16* q, int64_t head_dim, const c10::BFloat16* panel, float* s, int64_t rows,
                      int64_t& configured) {
  for (int64_t r = 0; r < rows; r += amx::kBlockRows)
    amx::block_sums(q + r * head_dim, head_dim, panel, head_dim / 32, nullptr, s + r * kKeys, kKeys,
                    std::min(amx::kBlockRows, rows - r), configured);
}
#endif

// Online softmax over one block of 32 keys for `rows` query rows: s (raw scores, 32 a row) becomes
// the block's numerators e^(scale s - max) (zero where masked), row_max the running max, alpha
// the factor that rescales a row's earlier sums and outputs, row_sums (16 lanes a row) the
// running denominators. Row r sees the keys at positions <= row_pos[r]. In three passes over the
// rows rather than one: each row alone is a chain of dependent steps (the max, then the
// exponentials, then the sums), and the passes let the core overlap many rows' chains; the
// rescale factors take one vector exponential per 16 rows.
inline void online_softmax(float* s, int64_t rows, const int64_t* row_pos, int64_t block, float score_scale,
                           float* row_max, float* new_max, float* alpha, float* row_sums) {
  const __m512 vscale = _mm512_set1_ps(score_scale), neg_inf = _mm512_set1_ps(-INFINITY);
  auto masks = [&](int64_t r, __mmask16& m0, __mmask16& m1) {
    const int64_t valid = std::clamp<int64_t>(row_pos[r] - block * kKeys + 1, 0, kKeys);
    m0 = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
    m1 = valid >= 32 ? 0xFFFF : valid <= 16 ? 0 : static_cast<__mmask16>((1u << (valid - 16)) - 1);
  };
  for (int64_t r = 0; r < rows; ++r) {  // scaled scores and the new running max
    float* sr = s + r * kKeys;
    __mmask16 m0, m1;
    masks(r, m0, m1);
    const __m512 s0 = _mm512_mul_ps(_mm512_loadu_ps(sr), vscale), s1 = _mm512_mul_ps(_mm512_loadu_ps(sr + 16), vscale);
    _mm512_storeu_ps(sr, s0);
    _mm512_storeu_ps(sr + 16, s1);
    new_max[r] = std::max(row_max[r], _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_mov_ps(neg_inf, m0, s0),
                                                                         _mm512_mask_mov_ps(neg_inf, m1, s1))));
  }
  for (int64_t r = 0; r < rows; r += 16) {  // alpha = e^(old max - new max); 0 before any key (sums are 0 then)
    const __m512 old_max = _mm512_loadu_ps(row_max + r), max = _mm512_loadu_ps(new_max + r);
    const __mmask16 seen = _mm512_cmp_ps_mask(old_max, neg_inf, _CMP_NEQ_OQ);
    _mm512_storeu_ps(alpha + r, _mm512_maskz_mov_ps(seen, exp_nonpositive(_mm512_sub_ps(old_max, max))));
  }
  for (int64_t r = 0; r < rows; ++r) {  // numerators and running sums
    float* sr = s + r * kKeys;
    __mmask16 m0, m1;
    masks(r, m0, m1);
    const __m512 vmax = _mm512_set1_ps(new_max[r]);
    const __m512 p0 = _mm512_maskz_mov_ps(m0, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sr), vmax)));
    const __m512 p1 = _mm512_maskz_mov_ps(m1, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sr + 16), vmax)));
    _mm512_storeu_ps(sr, p0);
    _mm512_storeu_ps(sr + 16, p1);
    float* sum = row_sums + r * 16;
    _mm512_storeu_ps(sum, _mm512_fmadd_ps(_mm512_loadu_ps(sum), _mm512_set1_ps(alpha[r]), _mm512_add_ps(p0, p1)));
    row_max[r] = new_max[r];
  }
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
         const at::Tensor& query_starts, const at::Tensor& query_lens, const at::Tensor& context_lens, float scale,
         at::Tensor& out) {
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, num_chunks = block_table.size(0), max_blocks = block_table.size(1);
  const int64_t tile_tokens = std::max<int64_t>(1, kTileRows / group);
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  const int64_t* lens = query_lens.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_table.data_ptr<int64_t>();
  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();

  // pack each (chunk, kv head)'s keys and values once: block offsets per chunk
  std::vector<int64_t> block_offset(num_chunks + 1, 0);
  for (int64_t c = 0; c < num_chunks; ++c) block_offset[c + 1] = block_offset[c] + (ctx[c] + kKeys - 1) / kKeys;
  const int64_t block_floats = kKeys * head_dim, total_blocks = block_offset[num_chunks];
  bool use_amx = false;
#if defined(SHARDSERVE_AMX)
  use_amx = std::is_same_v<T, c10::BFloat16> && head_dim % 32 == 0 && amx::permitted();
#endif
  // keys as float32 [D][32] blocks and values as float32 [32][D], or both as bf16 panels for tiles;
  // left uninitialized: the packing writes every element (zeroing them first took 6% of a
  // 128-token prefill's attention)
  const int64_t packed_size = num_kv_heads * total_blocks * block_floats;
  std::unique_ptr<float[]> packed_k(new float[use_amx ? 0 : packed_size]);
  std::unique_ptr<float[]> packed_v(new float[use_amx ? 0 : packed_size]);
  std::unique_ptr<c10::BFloat16[]> packed_kp(new c10::BFloat16[use_amx ? packed_size : 0]);
  std::unique_ptr<c10::BFloat16[]> packed_vp(new c10::BFloat16[use_amx ? packed_size : 0]);
  auto block_index = [&](int64_t kv, int64_t c, int64_t b) { return (kv * total_blocks) + block_offset[c] + b; };
  auto packed_at = [&](std::unique_ptr<float[]>& buf, int64_t kv, int64_t c, int64_t b) {
    return buf.get() + block_index(kv, c, b) * block_floats;
  };
  at::parallel_for(0, num_kv_heads * total_blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kv = item / total_blocks, flat = item % total_blocks;
      const int64_t c = std::upper_bound(block_offset.begin(), block_offset.end(), flat) - block_offset.begin() - 1;
      const int64_t b = flat - block_offset[c];
      const int64_t head_offset = kv * num_blocks * block_size * head_dim;
#if defined(SHARDSERVE_AMX)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (use_amx) {
          const int64_t at = block_index(kv, c, b) * block_floats;
          pack_keys_panel(k_ptr + head_offset, tables + c * max_blocks, b, ctx[c], block_size, head_dim,
                          packed_kp.get() + at);
          pack_values_panels(v_ptr + head_offset, tables + c * max_blocks, b, ctx[c], block_size, head_dim,
                             packed_vp.get() + at);
          continue;
        }
      }
#endif
      pack_block<T>(k_ptr + head_offset, v_ptr + head_offset, tables + c * max_blocks, b, ctx[c], block_size,
                    head_dim, packed_at(packed_k, kv, c, b), packed_at(packed_v, kv, c, b));
    }
  });

  std::vector<Tile> tiles;
  for (int64_t c = 0; c < num_chunks; ++c)
    for (int64_t t0 = 0; t0 < lens[c]; t0 += tile_tokens) {
      const int64_t t1 = std::min(lens[c], t0 + tile_tokens);
      const int64_t last_pos = ctx[c] - lens[c] + t1 - 1;
      for (int64_t kv = 0; kv < num_kv_heads; ++kv) tiles.push_back({c, kv, t0, t1, (t1 - t0) * (last_pos + 1)});
    }
  std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) { return a.cost > b.cost; });

  // Each worker takes the costliest tile not yet taken: the threads finish together (tiles dealt
  // round robin left one thread 14% more of a 128-token prefill, and the other spinning).
  // A tile's result does not depend on which thread computes it.
  const int64_t num_workers = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(tiles.size()));
  std::atomic<size_t> next_tile{0};
  at::parallel_for(0, num_workers, 1, [&](int64_t begin, int64_t end) {
    const int64_t rows_max = tile_tokens * group;
    std::vector<float> qf(rows_max * head_dim), o(rows_max * head_dim), s(rows_max * kKeys);
    // row sums kept as 16 lanes per row, added up once at the end (no horizontal sum per block)
    // (+ 16: online_softmax reads and writes whole 16-row vectors of the per-row values)
    std::vector<float> row_max(rows_max + 16), new_max(rows_max + 16), row_sums(rows_max * 16), alpha(rows_max + 16);
    std::vector<int64_t> row_pos(rows_max);
    std::vector<T> qb(use_amx ? rows_max * head_dim : 0);  // the tile's query rows, unscaled, for the tiles
    std::vector<c10::BFloat16> pb(use_amx ? rows_max * kKeys : 0);  // and its probabilities
#if defined(SHARDSERVE_AMX)
    alignas(64) float sums[amx::kBlockRows * 32];
#endif
    const float score_scale = use_amx ? scale : 1.f;       // q was scaled in qf otherwise
    int64_t configured = 0;                              // the tile block height configured
    for (int64_t worker = begin; worker < end; ++worker) {
      for (size_t i = next_tile++; i < tiles.size(); i = next_tile++) {
        const Tile& tile = tiles[i];
        const int64_t c = tile.chunk, first_pos = ctx[c] - lens[c];
        const int64_t rows = (tile.token_end - tile.token_begin) * group;
        // row r = (token, head g): query head kv * group + g
        for (int64_t t = tile.token_begin; t < tile.token_end; ++t)
          for (int64_t g = 0; g < group; ++g) {
            const int64_t r = (t - tile.token_begin) * group + g;
            const T* src = q_ptr + ((starts[c] + t) * num_heads + tile.kv_head * group + g) * head_dim;
            if (use_amx) std::copy(src, src + head_dim, qb.data() + r * head_dim);
            else
              for (int64_t d = 0; d < head_dim; d += 16)
                _mm512_storeu_ps(&qf[r * head_dim + d], _mm512_mul_ps(load16(src + d), _mm512_set1_ps(scale)));
            row_pos[r] = first_pos + t;
          }
        std::fill(o.begin(), o.begin() + rows * head_dim, 0.f);
        std::fill(row_max.begin(), row_max.begin() + rows, -INFINITY);
        std::fill(row_sums.begin(), row_sums.begin() + rows * 16, 0.f);
        const int64_t last_block = row_pos[rows - 1] / kKeys;
        for (int64_t b = 0; b <= last_block; ++b) {
#if defined(SHARDSERVE_AMX)
          if constexpr (std::is_same_v<T, c10::BFloat16>) {
            if (use_amx)
              score_rows_tiles(qb.data(), head_dim, packed_kp.get() + block_index(tile.kv_head, c, b) * block_floats,
                               s.data(), rows, configured);
          }
#endif
          if (!use_amx) score_rows<kScoreRows>(qf.data(), head_dim, packed_at(packed_k, tile.kv_head, c, b), s.data(), rows);
          online_softmax(s.data(), rows, row_pos.data(), b, score_scale, row_max.data(), new_max.data(),
                         alpha.data(), row_sums.data());
#if defined(SHARDSERVE_AMX)
          if (use_amx) {
            accumulate_tiles(s.data(), packed_vp.get() + block_index(tile.kv_head, c, b) * block_floats,
                             alpha.data(), o.data(), rows, head_dim, pb.data(), sums, configured);
            continue;
          }
#endif
          accumulate(head_dim, s.data(), packed_at(packed_v, tile.kv_head, c, b), alpha.data(), o.data(), rows);
        }
        for (int64_t t = tile.token_begin; t < tile.token_end; ++t)
          for (int64_t g = 0; g < group; ++g) {
            const int64_t r = (t - tile.token_begin) * group + g;
            T* dst = out_ptr + ((starts[c] + t) * num_heads + tile.kv_head * group + g) * head_dim;
            const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(&row_sums[r * 16])));
            for (int64_t d = 0; d < head_dim; d += 16) store16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(&o[r * head_dim + d]), inv));
          }
      }
    }
#if defined(SHARDSERVE_AMX)
    if (configured) _tile_release();
#endif
  });
}
#endif  // __AVX512F__

}  // namespace

bool supported(at::ScalarType dtype, int64_t head_dim) {
#if defined(__AVX512F__)
  return (dtype == at::kFloat || dtype == at::kBFloat16) && (head_dim == 32 || head_dim == 64 || head_dim == 128);
#else
  return false;
#endif
}

void paged_prefill_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_table,
                             at::Tensor query_starts, at::Tensor query_lens, at::Tensor context_lens, double scale,
                             at::Tensor out) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous(),
              "inputs must be contiguous");
  TORCH_CHECK(supported(q.scalar_type(), q.size(2)), "paged_prefill_attention: unsupported dtype or head_dim");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(), "dtypes must match");
  for (const auto& t : {block_table, query_starts, query_lens, context_lens})
    TORCH_CHECK(t.scalar_type() == at::kLong, "block_table and lengths must be int64");
  if (block_table.size(0) == 0) return;
#if defined(__AVX512F__)
  const auto table = block_table.contiguous(), starts = query_starts.contiguous(), lens = query_lens.contiguous(),
             ctx = context_lens.contiguous();
  if (q.scalar_type() == at::kFloat)
    run<float>(q, k_cache, v_cache, table, starts, lens, ctx, static_cast<float>(scale), out);
  else
    run<c10::BFloat16>(q, k_cache, v_cache, table, starts, lens, ctx, static_cast<float>(scale), out);
#endif
}

// Registered as torch ops (not a pybind module, as the other kernels: compile time, and the op
// call lets go of the GIL).
TORCH_LIBRARY(shardserve_paged_prefill_attention, m) {
  m.def("supported(ScalarType dtype, int head_dim) -> bool", &supported);
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor query_starts, "
        "Tensor query_lens, Tensor context_lens, float scale, Tensor(a!) out) -> ()", &paged_prefill_attention);
}
