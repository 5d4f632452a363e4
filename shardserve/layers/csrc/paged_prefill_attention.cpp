// Paged prefill attention on CPU (AVX-512, or AVX2 below): the causal attention of prefill chunks,
// keys and values read from the block pool, where the chunk's own keys were stored just before (so
// a prefix-cache hit or an earlier chunk costs nothing extra: no gather copy, no mask tensor).
//
// Work is cut into tiles of one chunk's query tokens x one kv head: the G query heads sharing the
// kv head and QT tokens make a tile's R = G * QT query rows (QT = 96 / G), so each key and value
// is used R times while it sits in L1. Tiles late in a sequence see more keys: the threads take
// them costliest first, each the next one not yet taken, so they finish together.
//   - A tile is attention_rows::attend_rows (attention_rows.h), the decode kernel's arithmetic:
//     keys in blocks of 32 at fixed absolute positions, flash-attention style, every sum of a row
//     in an order fixed by its position alone. A query row's result does not depend on how its
//     sequence was chunked, on prefix-cache hits, on what else is in the batch, nor on whether
//     this kernel or the decode kernel computed it (a resumed request continues exactly).
//   - With AMX (bf16) and `tiles`, both products run on tiles instead (pack_keys_panel and
//     below): faster on such CPUs, but the tiles' sums are not the decode kernel's.
// Without AVX-512 but with AVX2 (head_dim a multiple of 8), each (token, kv head) is the decode
// kernel's item on such CPUs, attention_avx2::attend_one at the token's position: keys are read
// once per token instead of once per tile, and a token's output has the decode kernel's bits.
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
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#include "vector_math.h"
#endif
#if defined(__AVX512F__)
#include "attention_rows.h"
#endif
#include "attention_avx2.h"
#include "amx_panel.h"

namespace {

#if defined(__AVX512F__)
using attention_rows::kKeys;
constexpr int64_t kTileRows = 96;  // query rows per tile (G heads x QT tokens)

struct Tile {
  int64_t chunk, kv_head, token_begin, token_end, cost;
};

#if defined(SHARDSERVE_AMX)
// The cache row of position `pos` of one kv head, or null past the context.
inline const c10::BFloat16* cache_row(const c10::BFloat16* base, const int64_t* table, int64_t pos,
                                      int64_t context_len, int64_t block_size, int64_t head_dim) {
  if (pos >= context_len) return nullptr;
  return base + (table[pos / block_size] * block_size + pos % block_size) * head_dim;
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

// The step's tiles: each chunk's tokens in groups of QT, per kv head, costliest first (tiles late
// in a sequence see more keys), so that workers taking the next one not yet taken finish together.
std::vector<Tile> make_tiles(int64_t num_chunks, const int64_t* lens, const int64_t* ctx, int64_t num_kv_heads,
                             int64_t tile_tokens) {
  std::vector<Tile> tiles;
  for (int64_t c = 0; c < num_chunks; ++c)
    for (int64_t t0 = 0; t0 < lens[c]; t0 += tile_tokens) {
      const int64_t t1 = std::min(lens[c], t0 + tile_tokens);
      const int64_t last_pos = ctx[c] - lens[c] + t1 - 1;
      for (int64_t kv = 0; kv < num_kv_heads; ++kv) tiles.push_back({c, kv, t0, t1, (t1 - t0) * (last_pos + 1)});
    }
  std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) { return a.cost > b.cost; });
  return tiles;
}

// Vector path: a tile's rows (token t, head g) through attention_rows::attend_rows, the decode
// kernel's arithmetic, reading keys and values in place.
template <typename T>
void run_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
              const at::Tensor& query_starts, const at::Tensor& query_lens, const at::Tensor& context_lens, float scale,
              at::Tensor& out) {
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_table.size(1);
  const int64_t tile_tokens = std::max<int64_t>(1, kTileRows / group), head_elems = num_blocks * block_size * head_dim;
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  const int64_t* lens = query_lens.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_table.data_ptr<int64_t>();
  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const auto tiles = make_tiles(block_table.size(0), lens, ctx, num_kv_heads, tile_tokens);
  // Each worker takes the costliest tile not yet taken: the threads finish together (tiles dealt
  // round robin left one thread 14% more of a 128-token prefill, and the other spinning). A
  // tile's result does not depend on which thread computes it.
  const int64_t num_workers = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(tiles.size()));
  std::atomic<size_t> next_tile{0};
  at::parallel_for(0, num_workers, 1, [&](int64_t begin, int64_t end) {
    attention_rows::Workspace ws;
    std::vector<const T*> q_rows(tile_tokens * group);
    std::vector<T*> out_rows(tile_tokens * group);
    std::vector<int64_t> row_pos(tile_tokens * group);
    for (int64_t worker = begin; worker < end; ++worker) {
      for (size_t i = next_tile++; i < tiles.size(); i = next_tile++) {
        const Tile& tile = tiles[i];
        const int64_t c = tile.chunk, first_pos = ctx[c] - lens[c];
        int64_t rows = 0;  // row r = (token t, head g): query head kv * group + g
        for (int64_t t = tile.token_begin; t < tile.token_end; ++t)
          for (int64_t g = 0; g < group; ++g, ++rows) {
            const int64_t at = ((starts[c] + t) * num_heads + tile.kv_head * group + g) * head_dim;
            q_rows[rows] = q_ptr + at;
            out_rows[rows] = out_ptr + at;
            row_pos[rows] = first_pos + t;
          }
        attention_rows::attend_rows<T>(q_rows.data(), rows, row_pos.data(), k_ptr + tile.kv_head * head_elems,
                                       v_ptr + tile.kv_head * head_elems, tables + c * max_blocks, ctx[c],
                                       block_size, head_dim, scale, ws, out_rows.data());
      }
    }
  });
}

#if defined(SHARDSERVE_AMX)
// AMX path (bf16): each (chunk, kv head)'s keys and values packed once into panels, both products
// on tiles, the softmax the vector path's. Faster on such CPUs, but its sums are the tiles' and
// not the decode kernel's: chosen only when the caller allows it (`tiles`).
void run_amx(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
             const at::Tensor& query_starts, const at::Tensor& query_lens, const at::Tensor& context_lens, float scale,
             at::Tensor& out) {
  using T = c10::BFloat16;
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

  // pack each (chunk, kv head)'s keys and values once: block offsets per chunk; left
  // uninitialized: the packing writes every element
  std::vector<int64_t> block_offset(num_chunks + 1, 0);
  for (int64_t c = 0; c < num_chunks; ++c) block_offset[c + 1] = block_offset[c] + (ctx[c] + kKeys - 1) / kKeys;
  const int64_t block_elems = kKeys * head_dim, total_blocks = block_offset[num_chunks];
  std::unique_ptr<T[]> packed_k(new T[num_kv_heads * total_blocks * block_elems]);
  std::unique_ptr<T[]> packed_v(new T[num_kv_heads * total_blocks * block_elems]);
  auto packed_at = [&](std::unique_ptr<T[]>& buf, int64_t kv, int64_t c, int64_t b) {
    return buf.get() + ((kv * total_blocks) + block_offset[c] + b) * block_elems;
  };
  at::parallel_for(0, num_kv_heads * total_blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kv = item / total_blocks, flat = item % total_blocks;
      const int64_t c = std::upper_bound(block_offset.begin(), block_offset.end(), flat) - block_offset.begin() - 1;
      const int64_t b = flat - block_offset[c];
      const int64_t head_offset = kv * num_blocks * block_size * head_dim;
      pack_keys_panel(k_ptr + head_offset, tables + c * max_blocks, b, ctx[c], block_size, head_dim,
                      packed_at(packed_k, kv, c, b));
      pack_values_panels(v_ptr + head_offset, tables + c * max_blocks, b, ctx[c], block_size, head_dim,
                         packed_at(packed_v, kv, c, b));
    }
  });

  const auto tiles = make_tiles(num_chunks, lens, ctx, num_kv_heads, tile_tokens);
  const int64_t rows_max = tile_tokens * group;
  const int64_t num_workers = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(tiles.size()));
  std::atomic<size_t> next_tile{0};  // as run_rows: the costliest tile not yet taken
  at::parallel_for(0, num_workers, 1, [&](int64_t begin, int64_t end) {
    attention_rows::Workspace ws;
    ws.reserve(rows_max, head_dim);
    std::vector<T> qb(rows_max * head_dim), pb(rows_max * kKeys);  // the tile's queries and probabilities
    std::vector<int64_t> row_pos(rows_max);
    alignas(64) float sums[amx::kBlockRows * 32];
    int64_t configured = 0;  // the tile block height configured
    for (int64_t worker = begin; worker < end; ++worker) {
      for (size_t i = next_tile++; i < tiles.size(); i = next_tile++) {
        const Tile& tile = tiles[i];
        const int64_t c = tile.chunk, first_pos = ctx[c] - lens[c];
        const int64_t rows = (tile.token_end - tile.token_begin) * group;
        for (int64_t t = tile.token_begin; t < tile.token_end; ++t)
          for (int64_t g = 0; g < group; ++g) {
            const int64_t r = (t - tile.token_begin) * group + g;
            const T* src = q_ptr + ((starts[c] + t) * num_heads + tile.kv_head * group + g) * head_dim;
            std::copy(src, src + head_dim, qb.data() + r * head_dim);
            row_pos[r] = first_pos + t;
          }
        std::fill(ws.o.begin(), ws.o.begin() + rows * head_dim, 0.f);
        std::fill(ws.row_max.begin(), ws.row_max.begin() + rows, -INFINITY);
        std::fill(ws.row_sums.begin(), ws.row_sums.begin() + rows * 16, 0.f);
        const int64_t last_block = row_pos[rows - 1] / kKeys;
        for (int64_t b = 0; b <= last_block; ++b) {
          score_rows_tiles(qb.data(), head_dim, packed_at(packed_k, tile.kv_head, c, b), ws.s.data(), rows, configured);
          attention_rows::online_softmax(ws.s.data(), rows, row_pos.data(), b, scale, ws.row_max.data(),
                                         ws.new_max.data(), ws.alpha.data(), ws.row_sums.data());
          accumulate_tiles(ws.s.data(), packed_at(packed_v, tile.kv_head, c, b), ws.alpha.data(), ws.o.data(), rows,
                           head_dim, pb.data(), sums, configured);
        }
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t t = tile.token_begin + r / group, g = r % group;
          T* dst = out_ptr + ((starts[c] + t) * num_heads + tile.kv_head * group + g) * head_dim;
          const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(&ws.row_sums[r * 16])));
          for (int64_t d = 0; d < head_dim; d += 16)
            store16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(&ws.o[r * head_dim + d]), inv));
        }
      }
    }
    if (configured) _tile_release();
  });
}
#endif

#endif  // __AVX512F__

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// Every (chunk token, kv head) item through the decode kernel's arithmetic at the token's position,
// the threads taking the costliest item not yet taken (the tokens latest in their contexts first).
template <typename T>
void run_avx2(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
              const at::Tensor& query_starts, const at::Tensor& query_lens, const at::Tensor& context_lens, float scale,
              at::Tensor& out) {
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_table.size(1);
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  const int64_t* lens = query_lens.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  struct Item {
    int64_t chunk, token, position;
  };
  std::vector<Item> items;
  for (int64_t c = 0; c < block_table.size(0); ++c)
    for (int64_t t = 0; t < lens[c]; ++t) items.push_back({c, t, ctx[c] - lens[c] + t});
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.position > b.position; });
  const int64_t num_items = static_cast<int64_t>(items.size()) * num_kv_heads;
  const int64_t num_workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  std::atomic<int64_t> next_item{0};
  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  at::parallel_for(0, num_workers, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc, qf(group * head_dim);
    for (int64_t w = begin; w < end; ++w)
      for (int64_t i = next_item++; i < num_items; i = next_item++) {
        const Item& item = items[i / num_kv_heads];
        const int64_t kv_head = i % num_kv_heads;
        const int64_t offset = ((starts[item.chunk] + item.token) * num_heads + kv_head * group) * head_dim;
        attention_avx2::attend_one<T>(q_ptr + offset, k_ptr, v_ptr,
                                      table + item.chunk * max_blocks, item.position + 1, kv_head, num_blocks,
                                      block_size, group, head_dim, scale, out_ptr + offset, scores, acc, qf);
      }
  });
}
#endif

}  // namespace

bool supported(at::ScalarType dtype, int64_t head_dim) {
#if defined(__AVX512F__)
  return (dtype == at::kFloat || dtype == at::kBFloat16) && attention_rows::supported(head_dim);
#elif defined(__AVX2__) && defined(__FMA__)
  return (dtype == at::kFloat || dtype == at::kBFloat16) && attention_avx2::supported(head_dim);
#else
  return false;
#endif
}

void paged_prefill_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_table,
                             at::Tensor query_starts, at::Tensor query_lens, at::Tensor context_lens, double scale,
                             at::Tensor out, bool tiles) {
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
#if defined(SHARDSERVE_AMX)
  if (tiles && q.scalar_type() == at::kBFloat16 && q.size(2) % 32 == 0 && q.size(2) <= 128 && amx::permitted()) {
    run_amx(q, k_cache, v_cache, table, starts, lens, ctx, static_cast<float>(scale), out);
    return;
  }
#endif
  if (q.scalar_type() == at::kFloat)
    run_rows<float>(q, k_cache, v_cache, table, starts, lens, ctx, static_cast<float>(scale), out);
  else
    run_rows<c10::BFloat16>(q, k_cache, v_cache, table, starts, lens, ctx, static_cast<float>(scale), out);
#elif defined(__AVX2__) && defined(__FMA__)
  const auto table = block_table.contiguous(), starts = query_starts.contiguous(), lens = query_lens.contiguous(),
             ctx = context_lens.contiguous();
  if (q.scalar_type() == at::kFloat)
    run_avx2<float>(q, k_cache, v_cache, table, starts, lens, ctx, static_cast<float>(scale), out);
  else
    run_avx2<c10::BFloat16>(q, k_cache, v_cache, table, starts, lens, ctx, static_cast<float>(scale), out);
#endif
}

// Registered as torch ops (not a pybind module, as the other kernels: compile time, and the op
// call lets go of the GIL).
TORCH_LIBRARY(shardserve_paged_prefill_attention, m) {
  m.def("supported(ScalarType dtype, int head_dim) -> bool", &supported);
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor query_starts, "
        "Tensor query_lens, Tensor context_lens, float scale, Tensor(a!) out, bool tiles=False) -> ()", &paged_prefill_attention);
}
