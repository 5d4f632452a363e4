// Paged decode attention on CPU: one query token per sequence, keys and values read straight
// from the block pool (no gather copy). Work items are (sequence, kv head) pairs, spread over
// OpenMP threads; the G query heads that share a kv head are handled together, so each cached
// key and value row is read from memory once for all G heads. Accumulation is in float32 whatever
// the cache dtype.
//
// At decode batch sizes the cache reads dominate and come from DRAM (a step touches every
// sequence's whole context, far more than the caches hold), at scattered 2 KB blocks. With
// AVX-512 and head_dim a multiple of 16 the kernel therefore prefetches the next key block (and
// the value block of the key block being scored) and keeps the arithmetic in vector registers: up
// to four heads' dot products and output sums live in registers while a row streams by, bf16 keys
// meet bf16 queries in the AVX512-BF16 dot instruction (exact products, float32 sums), widening
// bf16 values is a shift, exp is a vector polynomial. With AVX2 (and head_dim a multiple of 8) the
// same kernel runs on 8 lanes, bf16 keys widened like the values. Otherwise a portable loop does
// the same math.
//
//   q            [B, H, D]                 (float32 or bfloat16, contiguous)
//   k/v cache    [KV, num_blocks, bs, D]   (same dtype, contiguous)
//   block_table  [B, max_blocks] int64     context_lens [B] int64
//   out          [B, H, D]
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#include "vector_math.h"
#endif
#include "amx_tiles.h"

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
void attend_one_portable(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t context_len,
                int64_t kv_head, int64_t num_blocks, int64_t block_size, int64_t group, int64_t head_dim,
                float scale, T* out, std::vector<float>& scores, std::vector<float>& acc, std::vector<float>& qf,
                std::vector<float>& tile) {
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = to_float(q[g * head_dim + d]) * scale;
  scores.resize(group * context_len);
  for (int64_t start = 0; start < context_len; start += block_size) {
    const int64_t n = std::min(block_size, context_len - start);
    const T* keys = k_cache + (kv_head * num_blocks + table[start / block_size]) * block_size * head_dim;
    for (int64_t i = 0; i < n * head_dim; ++i) tile[i] = to_float(keys[i]);  // widen once, use G times
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = &qf[g * head_dim];
      float* s = &scores[g * context_len + start];
      for (int64_t t = 0; t < n; ++t) {
        const float* kt = &tile[t * head_dim];
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * kt[d];
        s[t] = dot;
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {  // softmax per query head
    float* s = &scores[g * context_len];
    float max_score = -INFINITY;
    for (int64_t t = 0; t < context_len; ++t) max_score = std::max(max_score, s[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < context_len; ++t) { s[t] = std::exp(s[t] - max_score); sum += s[t]; }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < context_len; ++t) s[t] *= inv;
  }
  acc.assign(group * head_dim, 0.f);
  for (int64_t start = 0; start < context_len; start += block_size) {
    const int64_t n = std::min(block_size, context_len - start);
    const T* values = v_cache + (kv_head * num_blocks + table[start / block_size]) * block_size * head_dim;
    for (int64_t i = 0; i < n * head_dim; ++i) tile[i] = to_float(values[i]);
    for (int64_t g = 0; g < group; ++g) {
      const float* p = &scores[g * context_len + start];
      float* a = &acc[g * head_dim];
      for (int64_t t = 0; t < n; ++t) {
        const float pt = p[t];
        const float* vt = &tile[t * head_dim];
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) a[d] += pt * vt[d];
      }
    }
  }
  for (int64_t i = 0; i < group * head_dim; ++i) out[i] = static_cast<T>(acc[i]);
}

// The cache block's lines on their way to L2 while the one before is used. Into L2, not L1:
// 32 prefetches into L1 at once fill its few miss buffers and the core stalls on them (the
// profile's hottest instructions); a 32@512 bf16 layer took 1.16 ms with T0, 1.01 with T1, 1.04
// with T1 two blocks ahead, 1.7 without (2 Sapphire Rapids cores, keys scored on tiles).
inline void prefetch_block(const void* block, int64_t num_bytes) {
  const char* p = static_cast<const char*>(block);
  for (int64_t i = 0; i < num_bytes; i += 64) __builtin_prefetch(p + i, 0, 2);  // prefetcht1
}

#if defined(__AVX512F__)
// s[g * s_stride + t] = scale * (q_g . keys[t]) for t < n, for GN query heads; qf is q * scale in
// float32. Each key row is loaded (and widened) once for all GN heads.
template <int GN, typename T>
inline void score_keys_widened(const T* keys, int64_t n, int64_t head_dim, const float* qf, float* s,
                               int64_t s_stride) {
  for (int64_t t = 0; t < n; ++t) {
    __m512 dot[GN];
    for (int g = 0; g < GN; ++g) dot[g] = _mm512_setzero_ps();
    for (int64_t c = 0; c < head_dim; c += 16) {
      const __m512 k = load16(keys + t * head_dim + c);
      for (int g = 0; g < GN; ++g) dot[g] = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * head_dim + c), k, dot[g]);
    }
    for (int g = 0; g < GN; ++g) s[g * s_stride + t] = _mm512_reduce_add_ps(dot[g]);
  }
}

template <int GN>
inline void score_keys(const float* keys, int64_t n, int64_t head_dim, const float* qf, const float* /*q*/,
                       float /*scale*/, float* s, int64_t s_stride) {
  score_keys_widened<GN>(keys, n, head_dim, qf, s, s_stride);
}

template <int GN>
inline void score_keys(const c10::BFloat16* keys, int64_t n, int64_t head_dim, const float* qf,
                       const c10::BFloat16* q, float scale, float* s, int64_t s_stride) {
#if defined(__AVX512BF16__)
  if (head_dim % 32 == 0) {  // bf16 pairs straight from the cache: 32 exact products per instruction
    for (int64_t t = 0; t < n; ++t) {
      __m512 dot[GN];
      for (int g = 0; g < GN; ++g) dot[g] = _mm512_setzero_ps();
      for (int64_t c = 0; c < head_dim; c += 32) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512(keys + t * head_dim + c);
        for (int g = 0; g < GN; ++g) dot[g] = _mm512_dpbf16_ps(dot[g], (__m512bh)_mm512_loadu_si512(q + g * head_dim + c), k);
      }
      for (int g = 0; g < GN; ++g) s[g * s_stride + t] = _mm512_reduce_add_ps(dot[g]) * scale;
    }
    return;
  }
#endif
  score_keys_widened<GN>(keys, n, head_dim, qf, s, s_stride);
}

// acc[g][c0 .. c0 + 16 CB) += sum over t < n of p[g * p_stride + t] * values[t][same], for GN
// query heads: GN x CB sums in registers, so each value row is loaded once and the FMAs of one
// row are independent (one chunk at a time waited on each sum's FMA latency). Each sum still
// adds the rows in order t = 0, 1, ...
template <int GN, int CB, typename T>
inline void accumulate_values(const T* values, int64_t n, int64_t head_dim, int64_t c0, const float* p,
                              int64_t p_stride, float* acc) {
  __m512 a[GN][CB];
  for (int g = 0; g < GN; ++g)
    for (int j = 0; j < CB; ++j) a[g][j] = _mm512_loadu_ps(acc + g * head_dim + c0 + 16 * j);
  for (int64_t t = 0; t < n; ++t) {
    __m512 v[CB];
    for (int j = 0; j < CB; ++j) v[j] = load16(values + t * head_dim + c0 + 16 * j);
    for (int g = 0; g < GN; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * p_stride + t]);
      for (int j = 0; j < CB; ++j) a[g][j] = _mm512_fmadd_ps(pg, v[j], a[g][j]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int j = 0; j < CB; ++j) _mm512_storeu_ps(acc + g * head_dim + c0 + 16 * j, a[g][j]);
}

// accumulate_values over all of head_dim, up to 4 chunks of 16 at a time
template <int GN, typename T>
inline void accumulate_rows(const T* values, int64_t n, int64_t head_dim, const float* p, int64_t p_stride,
                            float* acc) {
  const int64_t chunks = head_dim / 16;
  int64_t c = 0;
  for (; c + 4 <= chunks; c += 4) accumulate_values<GN, 4>(values, n, head_dim, 16 * c, p, p_stride, acc);
  for (; c + 2 <= chunks; c += 2) accumulate_values<GN, 2>(values, n, head_dim, 16 * c, p, p_stride, acc);
  for (; c < chunks; ++c) accumulate_values<GN, 1>(values, n, head_dim, 16 * c, p, p_stride, acc);
}

#if defined(SHARDSERVE_AMX)
// Scores on AMX tiles (bf16 cache, head_dim a multiple of 32 up to 128, blocks of whole 16-key
// groups): S^T = K Q^T, so 16 keys of a cache block are an A tile read in place (a row per key,
// 32 dims per step) and the G queries a B tile, packed once per (sequence, kv head) with their
// dims in pairs, as the tile's dot product takes them:
//   qt[dp][g] = q[g][2 dp], q[g][2 dp + 1]       (one 32-bit pair; a tile row is dp, G pairs)
// C[16 keys][G heads] in float32: two dots per 16 keys at head_dim 64, where the vector path
// spent a dot and a horizontal sum per key and head.
//   tmm0: C    tmm1, tmm2: A (keys, alternate steps)    tmm3..tmm6: B (q^T, one per step)
namespace tile_scores {

constexpr int64_t kMaxHeadDim = 128;

inline bool fit(int64_t head_dim, int64_t block_size, int64_t group) {
  return head_dim % 32 == 0 && head_dim <= kMaxHeadDim && block_size % 16 == 0 && group <= 16 && amx::permitted();
}

inline amx::TileConfig config(int64_t group) {
  amx::TileConfig cfg;
  cfg.shape(0, 16, group * 4);
  cfg.shape(1, 16, 64);
  cfg.shape(2, 16, 64);
  for (int t = 3; t < 7; ++t) cfg.shape(t, 16, group * 4);
  return cfg;
}

// q [G][head_dim] -> qt (above), loaded into tmm3.. (one tile per 32 dims)
inline void load_queries(const c10::BFloat16* q, int64_t group, int64_t head_dim, uint32_t* qt) {
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(q);
  for (int64_t dp = 0; dp < head_dim / 2; ++dp)
    for (int64_t g = 0; g < group; ++g) qt[dp * group + g] = pairs[g * head_dim / 2 + dp];
  const int64_t stride = group * 4, steps = head_dim / 32;
  _tile_loadd(3, qt, stride);
  if (steps > 1) _tile_loadd(4, qt + 16 * group, stride);
  if (steps > 2) _tile_loadd(5, qt + 32 * group, stride);
  if (steps > 3) _tile_loadd(6, qt + 48 * group, stride);
}

// s[g * s_stride + t] = scale * (q_g . keys[t]) for the 16 keys at `keys` and the G heads
inline void score16(const c10::BFloat16* keys, int64_t head_dim, int64_t group, float scale, float* s,
                    int64_t s_stride) {
  const int64_t stride = head_dim * 2, steps = head_dim / 32;
  _tile_zero(0);
  _tile_loadd(1, keys, stride);
  if (steps > 1) _tile_loadd(2, keys + 32, stride);
  _tile_dpbf16ps(0, 1, 3);
  if (steps > 1) _tile_dpbf16ps(0, 2, 4);
  if (steps > 2) {
    _tile_loadd(1, keys + 64, stride);
    if (steps > 3) _tile_loadd(2, keys + 96, stride);
    _tile_dpbf16ps(0, 1, 5);
    if (steps > 3) _tile_dpbf16ps(0, 2, 6);
  }
  alignas(64) float sums[16][16];
  _tile_stored(0, &sums[0][0], 64);
  const __m512i rows = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  for (int64_t g = 0; g < group; ++g) {  // column g of C is head g's 16 scores
    const __m512 col = _mm512_i32gather_ps(_mm512_add_epi32(rows, _mm512_set1_epi32(static_cast<int>(g))), &sums[0][0], 4);
    _mm512_storeu_ps(s + g * s_stride, _mm512_mul_ps(col, _mm512_set1_ps(scale)));
  }
}

}  // namespace tile_scores
#endif

// The same computation as attend_one_portable, for head_dim % 16 == 0.
// With `tiles` (bf16, tile_scores::fit, tiles configured) the scores come from AMX tiles.
template <typename T>
void attend_one_avx512(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t context_len,
                       int64_t kv_head, int64_t num_blocks, int64_t block_size, int64_t group, int64_t head_dim,
                       float scale, T* out, std::vector<float>& scores, std::vector<float>& acc, std::vector<float>& qf,
                       bool tiles) {
  const int64_t block_elems = block_size * head_dim;
  const int64_t block_bytes = block_elems * static_cast<int64_t>(sizeof(T)), n_blocks = (context_len + block_size - 1) / block_size;
  const T* k_base = k_cache + kv_head * num_blocks * block_elems;
  const T* v_base = v_cache + kv_head * num_blocks * block_elems;
  if (!tiles)  // the scaled queries the vector scores use
    for (int64_t i = 0; i < group * head_dim; i += 16)
      _mm512_storeu_ps(&qf[i], _mm512_mul_ps(load16(q + i), _mm512_set1_ps(scale)));
  const int64_t padded = n_blocks * block_size;  // scores rows padded to whole blocks
  scores.resize(group * padded);
#if defined(SHARDSERVE_AMX)
  alignas(64) uint32_t qt[tile_scores::kMaxHeadDim / 2 * 16];
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    if (tiles) tile_scores::load_queries(q, group, head_dim, qt);
#endif
  prefetch_block(k_base + table[0] * block_elems, block_bytes);
  for (int64_t b = 0; b < n_blocks; ++b) {
    if (b + 1 < n_blocks) prefetch_block(k_base + table[b + 1] * block_elems, block_bytes);
    // the value block too: it is in L2 by the value pass, which then waits on nothing (prefetched
    // one block ahead in that pass instead, a 32@160 bf16 step of 30 layers took 1.22x as long)
    prefetch_block(v_base + table[b] * block_elems, block_bytes);
    const T* keys = k_base + table[b] * block_elems;
    const int64_t n = std::min(block_size, context_len - b * block_size);
#if defined(SHARDSERVE_AMX)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (tiles) {  // whole 16-key groups: a block's rows past the context are scored and unused
        for (int64_t t = 0; t < n; t += 16)
          tile_scores::score16(keys + t * head_dim, head_dim, group, scale, &scores[b * block_size + t], padded);
        continue;
      }
    }
#endif
    for (int64_t g0 = 0; g0 < group; g0 += 4) {  // up to 4 heads at a time, their dots in registers
      const int64_t off = g0 * head_dim;
      float* s = &scores[g0 * padded + b * block_size];
      switch (std::min<int64_t>(4, group - g0)) {
        case 1: score_keys<1>(keys, n, head_dim, &qf[off], q + off, scale, s, padded); break;
        case 2: score_keys<2>(keys, n, head_dim, &qf[off], q + off, scale, s, padded); break;
        case 3: score_keys<3>(keys, n, head_dim, &qf[off], q + off, scale, s, padded); break;
        default: score_keys<4>(keys, n, head_dim, &qf[off], q + off, scale, s, padded); break;
      }
    }
  }
  acc.assign(group * head_dim + group, 0.f);  // the sums, then each head's 1 / softmax denominator
  float* inv_sums = &acc[group * head_dim];
  for (int64_t g = 0; g < group; ++g) {  // softmax numerators in place; the 1/sum is applied at the end
    float* s = &scores[g * padded];
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= context_len; t += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + t));
    float max_score = _mm512_reduce_max_ps(vmax);
    for (; t < context_len; ++t) max_score = std::max(max_score, s[t]);
    const __m512 vm = _mm512_set1_ps(max_score);
    __m512 vsum = _mm512_setzero_ps();
    for (t = 0; t + 16 <= context_len; t += 16) {
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + t), vm));
      _mm512_storeu_ps(s + t, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    if (t < context_len) {
      const __mmask16 tail = static_cast<__mmask16>((1u << (context_len - t)) - 1);
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + t), vm));
      _mm512_mask_storeu_ps(s + t, tail, e);
      vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(tail, e));
    }
    inv_sums[g] = 1.f / _mm512_reduce_add_ps(vsum);
  }
  for (int64_t b = 0; b < n_blocks; ++b) {
    const T* values = v_base + table[b] * block_elems;
    const int64_t n = std::min(block_size, context_len - b * block_size);
    for (int64_t g0 = 0; g0 < group; g0 += 4) {  // up to 4 heads at a time, their sums in registers
      const float* p = &scores[g0 * padded + b * block_size];
      float* a = &acc[g0 * head_dim];
      switch (std::min<int64_t>(4, group - g0)) {
        case 1: accumulate_rows<1>(values, n, head_dim, p, padded, a); break;
        case 2: accumulate_rows<2>(values, n, head_dim, p, padded, a); break;
        case 3: accumulate_rows<3>(values, n, head_dim, p, padded, a); break;
        default: accumulate_rows<4>(values, n, head_dim, p, padded, a); break;
      }
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t c = 0; c < head_dim; c += 16)
      store16(out + g * head_dim + c, _mm512_mul_ps(_mm512_loadu_ps(&acc[g * head_dim + c]), _mm512_set1_ps(inv_sums[g])));
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// s[g * s_stride + t] = q_g . keys[t] for t < n, for GN query heads (qf: q * scale, float32)
template <int GN, typename T>
inline void score_keys8(const T* keys, int64_t n, int64_t head_dim, const float* qf, float* s, int64_t s_stride) {
  for (int64_t t = 0; t < n; ++t) {
    __m256 dot[GN];
    for (int g = 0; g < GN; ++g) dot[g] = _mm256_setzero_ps();
    for (int64_t c = 0; c < head_dim; c += 8) {
      const __m256 k = load8(keys + t * head_dim + c);
      for (int g = 0; g < GN; ++g) dot[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * head_dim + c), k, dot[g]);
    }
    for (int g = 0; g < GN; ++g) s[g * s_stride + t] = reduce_add8(dot[g]);
  }
}

// acc[g][:] += sum over t < n of p[g * p_stride + t] * values[t][:], for GN query heads
template <int GN, typename T>
inline void accumulate_values8(const T* values, int64_t n, int64_t head_dim, const float* p, int64_t p_stride,
                               float* acc) {
  for (int64_t c = 0; c < head_dim; c += 8) {
    __m256 a[GN];
    for (int g = 0; g < GN; ++g) a[g] = _mm256_loadu_ps(acc + g * head_dim + c);
    for (int64_t t = 0; t < n; ++t) {
      const __m256 v = load8(values + t * head_dim + c);
      for (int g = 0; g < GN; ++g) a[g] = _mm256_fmadd_ps(_mm256_set1_ps(p[g * p_stride + t]), v, a[g]);
    }
    for (int g = 0; g < GN; ++g) _mm256_storeu_ps(acc + g * head_dim + c, a[g]);
  }
}

// Softmax numerators of s[0, n) in place (e^(s - max)); returns 1 / their sum.
inline float softmax_numerators8(float* s, int64_t n) {
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + t));
  float max_score = reduce_max8(vmax);
  for (int64_t i = t; i < n; ++i) max_score = std::max(max_score, s[i]);
  const __m256 vm = _mm256_set1_ps(max_score);
  __m256 vsum = _mm256_setzero_ps();
  for (t = 0; t + 8 <= n; t += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm));
    _mm256_storeu_ps(s + t, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  if (t < n) {
    const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - t)),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_maskload_ps(s + t, tail), vm));
    _mm256_maskstore_ps(s + t, tail, e);
    vsum = _mm256_add_ps(vsum, _mm256_and_ps(e, _mm256_castsi256_ps(tail)));
  }
  return 1.f / reduce_add8(vsum);
}

// The same computation as attend_one_portable, for head_dim % 8 == 0; the next cache block is
// prefetched while this one is used.
template <typename T>
void attend_one_avx2(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t context_len,
                     int64_t kv_head, int64_t num_blocks, int64_t block_size, int64_t group, int64_t head_dim,
                     float scale, T* out, std::vector<float>& scores, std::vector<float>& acc, std::vector<float>& qf) {
  const int64_t block_elems = block_size * head_dim, n_blocks = (context_len + block_size - 1) / block_size;
  const int64_t block_bytes = block_elems * static_cast<int64_t>(sizeof(T));
  const T* k_base = k_cache + kv_head * num_blocks * block_elems;
  const T* v_base = v_cache + kv_head * num_blocks * block_elems;
  for (int64_t i = 0; i < group * head_dim; i += 8)
    _mm256_storeu_ps(&qf[i], _mm256_mul_ps(load8(q + i), _mm256_set1_ps(scale)));
  const int64_t padded = n_blocks * block_size;
  scores.resize(group * padded);
  prefetch_block(k_base + table[0] * block_elems, block_bytes);
  for (int64_t b = 0; b < n_blocks; ++b) {
    if (b + 1 < n_blocks) prefetch_block(k_base + table[b + 1] * block_elems, block_bytes);
    else prefetch_block(v_base + table[0] * block_elems, block_bytes);
    const T* keys = k_base + table[b] * block_elems;
    const int64_t n = std::min(block_size, context_len - b * block_size);
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
      float* s = &scores[g0 * padded + b * block_size];
      const float* qg = &qf[g0 * head_dim];
      switch (std::min<int64_t>(4, group - g0)) {
        case 1: score_keys8<1>(keys, n, head_dim, qg, s, padded); break;
        case 2: score_keys8<2>(keys, n, head_dim, qg, s, padded); break;
        case 3: score_keys8<3>(keys, n, head_dim, qg, s, padded); break;
        default: score_keys8<4>(keys, n, head_dim, qg, s, padded); break;
      }
    }
  }
  std::vector<float> inv_sums(group);
  for (int64_t g = 0; g < group; ++g) inv_sums[g] = softmax_numerators8(&scores[g * padded], context_len);
  acc.assign(group * head_dim, 0.f);
  for (int64_t b = 0; b < n_blocks; ++b) {
    if (b + 1 < n_blocks) prefetch_block(v_base + table[b + 1] * block_elems, block_bytes);
    const T* values = v_base + table[b] * block_elems;
    const int64_t n = std::min(block_size, context_len - b * block_size);
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
      const float* p = &scores[g0 * padded + b * block_size];
      float* a = &acc[g0 * head_dim];
      switch (std::min<int64_t>(4, group - g0)) {
        case 1: accumulate_values8<1>(values, n, head_dim, p, padded, a); break;
        case 2: accumulate_values8<2>(values, n, head_dim, p, padded, a); break;
        case 3: accumulate_values8<3>(values, n, head_dim, p, padded, a); break;
        default: accumulate_values8<4>(values, n, head_dim, p, padded, a); break;
      }
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < head_dim; ++d) out[g * head_dim + d] = static_cast<T>(acc[g * head_dim + d] * inv_sums[g]);
}
#endif

template <typename T>
void attend_one(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t context_len,
                int64_t kv_head, int64_t num_blocks, int64_t block_size, int64_t group, int64_t head_dim,
                float scale, T* out, std::vector<float>& scores, std::vector<float>& acc, std::vector<float>& qf,
                std::vector<float>& tile, bool tiles) {
#if defined(__AVX512F__)
  if (head_dim % 16 == 0) {
    attend_one_avx512<T>(q, k_cache, v_cache, table, context_len, kv_head, num_blocks, block_size, group, head_dim,
                         scale, out, scores, acc, qf, tiles);
    return;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (head_dim % 8 == 0) {
    attend_one_avx2<T>(q, k_cache, v_cache, table, context_len, kv_head, num_blocks, block_size, group, head_dim,
                       scale, out, scores, acc, qf);
    return;
  }
#endif
  attend_one_portable<T>(q, k_cache, v_cache, table, context_len, kv_head, num_blocks, block_size, group, head_dim,
                         scale, out, scores, acc, qf, tile);
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_table, const at::Tensor& context_lens, double scale, at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_table.size(1);
  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  const int64_t* table_ptr = block_table.data_ptr<int64_t>();
  const int64_t* len_ptr = context_lens.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
  bool tiles = false;
#if defined(SHARDSERVE_AMX)
  tiles = std::is_same_v<T, c10::BFloat16> && tile_scores::fit(head_dim, block_size, group);
  const amx::TileConfig cfg = tile_scores::config(group);
#endif
  // Sequences longest first, each thread taking the next item not yet taken, so threads finish
  // together when contexts differ (a static split in batch order left one thread with most of
  // the long ones). An item's result does not depend on which thread computes it.
  std::vector<int64_t> order(num_seqs);
  for (int64_t i = 0; i < num_seqs; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return len_ptr[a] > len_ptr[b]; });
  const int64_t num_items = num_seqs * num_kv_heads;
  const int64_t num_workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  std::atomic<int64_t> next_item{0};
  at::parallel_for(0, num_workers, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc, qf(group * head_dim), tile(block_size * head_dim);
#if defined(SHARDSERVE_AMX)
    if (tiles) _tile_loadconfig(&cfg);
#endif
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t item = next_item++; item < num_items; item = next_item++) {
        const int64_t seq = order[item / num_kv_heads], kv_head = item % num_kv_heads;
        const int64_t offset = (seq * num_heads + kv_head * group) * head_dim;
        attend_one<T>(q_ptr + offset, k_ptr, v_ptr, table_ptr + seq * max_blocks, len_ptr[seq], kv_head,
                      num_blocks, block_size, group, head_dim, static_cast<float>(scale), out_ptr + offset,
                      scores, acc, qf, tile, tiles);
      }
    }
#if defined(SHARDSERVE_AMX)
    if (tiles) _tile_release();
#endif
  });
}

}  // namespace

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor block_table, at::Tensor context_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_table and context_lens must be int64");
  auto out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat) {
    run<float>(q, k_cache, v_cache, block_table.contiguous(), context_lens.contiguous(), scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    run<c10::BFloat16>(q, k_cache, v_cache, block_table.contiguous(), context_lens.contiguous(), scale, out);
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports float32 and bfloat16");
  }
  return out;
}

// Registered as torch ops (not a pybind module: torch/extension.h alone took 24 s of each
// compile, ATen and the op registry 8 s). A torch op call lets go of the GIL, as a server
// running the engine in a thread beside its HTTP event loop needs.
TORCH_LIBRARY(shardserve_paged_decode_attention, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor context_lens, float scale) -> Tensor", &paged_decode_attention);
}
