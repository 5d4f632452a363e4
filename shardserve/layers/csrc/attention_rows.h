// Attention for a set of query rows over one kv head's paged keys and values (AVX-512): the one
// home of the arithmetic that the decode kernel (a sequence's G heads at its next position) and
// the prefill kernel (a tile of a chunk's tokens x G heads) both run, so that a token's attention
// output has the same bits whichever of them computed it. That is what makes a request resumed
// from its tokens (recomputed by prefill, with prefix-cache hits or in chunks) continue exactly as
// the uninterrupted run that decoded them, in bfloat16 as in float32.
//
// Per row, everything depends on the row's query, its position and the keys and values at or
// before it, never on the other rows:
//   - keys are taken in blocks of 32 at fixed absolute positions [32 b, 32 b + 32);
//   - a score is q . k (dot_lanes: 16 float32 lanes, each summing its share of head_dim in order;
//     bf16 pairs in the AVX512-BF16 dot instruction), its lanes added by one fixed tree
//     (sum_lanes16), times the scale;
//   - online softmax per block: running max, rescale factor alpha = e^(old max - new max), the
//     numerators e^(s - max) (zero where masked), running sums kept as 16 lanes;
//   - o = o alpha + sum over the block's 32 keys, in order, of p_j v_j (float32, from zero);
//   - the output: o / (the running sums' lanes added), rounded to the cache dtype.
// Positions at or past the context read a zero row, as masked positions contribute exact zeros.
// include after <ATen/ATen.h>, <immintrin.h> and "vector_math.h"
#pragma once

#if defined(__AVX512F__)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace attention_rows {

constexpr int64_t kKeys = 32;         // keys per block: two 16-lane registers of scores
constexpr int64_t kFewRows = 16;     // rows up to which attend_rows scores every block first
constexpr int64_t kMaxHeadDim = 256;  // the zero row's length

inline bool supported(int64_t head_dim) { return head_dim % 16 == 0 && head_dim <= kMaxHeadDim; }

// The 16 lanes' sums of v[0..15], in key order: one vector per 16 keys instead of a horizontal
// sum per key. Each key's lanes are added in the same tree whatever the other keys are:
// (l_i + l_i+8), then + the partner 4 apart, 2 apart, 1 apart.
__attribute__((always_inline)) inline __m512 sum_lanes16(const __m512 v[16]) {
  __m512 a[8], b[4], c[2];
  for (int m = 0; m < 8; ++m)  // halves: [key 2m: 8 sums | key 2m+1: 8 sums]
    a[m] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], 0xEE));
  for (int n = 0; n < 4; ++n)  // quarters: 128-bit lane q holds key 4n + q's 4 sums
    b[n] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * n], a[2 * n + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * n], a[2 * n + 1], 0xDD));
  for (int k = 0; k < 2; ++k)  // lane q: key 8k + q's 2 sums, then key 8k + 4 + q's
    c[k] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * k], b[2 * k + 1], 0x44), _mm512_shuffle_ps(b[2 * k], b[2 * k + 1], 0xEE));
  // element 4q + t holds key 4t + q: one permute back to key order
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}

// Whether q . k takes bf16 pairs through the dot instruction (exact products, float32 sums): where
// the build has it and head_dim is whole 32s; otherwise float32 multiply-adds over 16-wide chunks.
template <typename T>
constexpr bool dot_pairs() {
#if defined(__AVX512BF16__)
  return std::is_same_v<T, c10::BFloat16>;
#else
  return false;
#endif
}

template <typename T>
inline int64_t dot_chunk(int64_t head_dim) {
  return dot_pairs<T>() && head_dim % 32 == 0 ? 32 : 16;
}

// acc + one chunk's products, lane by lane
template <typename T>
inline __m512 dot_step(__m512 acc, const T* q, const T* k, int64_t chunk) {
#if defined(__AVX512BF16__)
  if constexpr (dot_pairs<T>()) {
    if (chunk == 32) return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q), (__m512bh)_mm512_loadu_si512(k));
  }
#endif
  return _mm512_fmadd_ps(load16(q), load16(k), acc);
}

// q . k as 16 lanes of partial sums (see sum_lanes16): each lane adds its share of the products,
// chunk after chunk in order
template <typename T>
inline __m512 dot_lanes(const T* q, const T* k, int64_t head_dim) {
  const int64_t chunk = dot_chunk<T>(head_dim);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t c = 0; c < head_dim; c += chunk) acc = dot_step(acc, q + c, k + c, chunk);
  return acc;
}

// s[j] = q . keys[j] for 16 keys (unscaled)
template <typename T>
inline void score16(const T* q, const T* const* keys, int64_t head_dim, float* s) {
  __m512 parts[16];
  for (int j = 0; j < 16; ++j) parts[j] = dot_lanes(q, keys[j], head_dim);
  _mm512_storeu_ps(s, sum_lanes16(parts));
}

// score16 for NC chunks of `chunk` (a compile-time count): the query's chunks stay in registers
// across the keys. The same steps in the same order.
template <int NC, typename T>
inline void score16_fixed(const T* q, const T* const* keys, int64_t chunk, float* s) {
  __m512 parts[16];
  if (chunk == 32) {  // bf16 pairs: q as raw 32-bit lanes
#if defined(__AVX512BF16__)
    if constexpr (dot_pairs<T>()) {
      __m512bh qc[NC];
      for (int c = 0; c < NC; ++c) qc[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
      for (int j = 0; j < 16; ++j) {
        __m512 acc = _mm512_setzero_ps();
        for (int c = 0; c < NC; ++c) acc = _mm512_dpbf16_ps(acc, qc[c], (__m512bh)_mm512_loadu_si512(keys[j] + 32 * c));
        parts[j] = acc;
      }
      _mm512_storeu_ps(s, sum_lanes16(parts));
      return;
    }
#endif
  }
  __m512 qc[NC];
  for (int c = 0; c < NC; ++c) qc[c] = load16(q + 16 * c);
  for (int j = 0; j < 16; ++j) {
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < NC; ++c) acc = _mm512_fmadd_ps(qc[c], load16(keys[j] + 16 * c), acc);
    parts[j] = acc;
  }
  _mm512_storeu_ps(s, sum_lanes16(parts));
}

// 32 scores of each of `rows` rows (s: 32 a row)
// (only the first 16 when the other 16 are all past the context: every row masks them)
template <typename T>
inline void score_rows(const T* const* q_rows, int64_t rows, const T* const* keys, int64_t num_keys,
                       int64_t head_dim, float* s) {
  const int64_t chunk = dot_chunk<T>(head_dim);
  auto each = [&](auto fn) {
    for (int64_t r = 0; r < rows; ++r) {
      fn(q_rows[r], keys, s + r * kKeys);
      if (num_keys > 16) fn(q_rows[r], keys + 16, s + r * kKeys + 16);
      else _mm512_storeu_ps(s + r * kKeys + 16, _mm512_setzero_ps());
    }
  };
  switch (head_dim / chunk) {
    case 2: each([&](const T* q, const T* const* k, float* o) { score16_fixed<2>(q, k, chunk, o); }); break;
    case 4: each([&](const T* q, const T* const* k, float* o) { score16_fixed<4>(q, k, chunk, o); }); break;
    case 8: each([&](const T* q, const T* const* k, float* o) { score16_fixed<8>(q, k, chunk, o); }); break;
    default: each([&](const T* q, const T* const* k, float* o) { score16(q, k, head_dim, o); }); break;
  }
}

// Online softmax over one block for `rows` rows: s (raw scores, 32 a row) becomes the block's
// numerators e^(scale s - max) (zero where masked), row_max the running max, alpha the factor
// that rescales a row's earlier sums and outputs, row_sums (16 lanes a row) the running
// denominators. Row r sees the keys at positions <= row_pos[r]. In three passes over the rows
// rather than one: each row alone is a chain of dependent steps (the max, then the exponentials,
// then the sums), and the passes let the core overlap many rows' chains; the rescale factors take
// one vector exponential per 16 rows (lane-wise: a row's factor is the same in any group).
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

// o[r] = o[r] * alpha[r] + sum_j p[r][j] * v[j] for RN rows of ND 16-lane vectors each, v[j] a
// row of the cache (or the zero row)
template <int ND, int RN, typename T>
inline void accumulate_block(const float* p, const T* const* v, int64_t keys, const float* alpha, float* o) {
  constexpr int64_t head_dim = ND * 16;
  __m512 acc[RN][ND];
#pragma GCC unroll 12
  for (int r = 0; r < RN; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < ND; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < keys; ++j) {
    __m512 vj[ND];
#pragma GCC unroll 8
    for (int c = 0; c < ND; ++c) vj[c] = load16(v[j] + c * 16);
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

// rows of o in register blocks of RN = 24 / ND rows (24 accumulators), the remainder as one
// block (a decode's G rows are all remainder: each value row widened once for all of them)
template <int ND, int RN = 24 / ND, typename T>
inline void accumulate_rows(const float* p, const T* const* v, int64_t keys, const float* alpha, float* o,
                            int64_t rows) {
  int64_t r = 0;
  for (; r + RN <= rows; r += RN) accumulate_block<ND, RN>(p + r * kKeys, v, keys, alpha + r, o + r * ND * 16);
  if constexpr (RN > 1) {
    if (r < rows) accumulate_rows<ND, RN - 1>(p + r * kKeys, v, keys, alpha + r, o + r * ND * 16, rows - r);
  }
}

// The generic head_dim (a multiple of 16): one 16-lane chunk at a time, rows one by one; the same
// sums in the same order as accumulate_block (each lane's own chain over j).
template <typename T>
inline void accumulate_any(const float* p, const T* const* v, int64_t keys, const float* alpha, float* o,
                           int64_t rows, int64_t head_dim) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < head_dim; c += 16) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t j = 0; j < keys; ++j) acc = _mm512_fmadd_ps(_mm512_set1_ps(p[r * kKeys + j]), load16(v[j] + c), acc);
      float* dst = o + r * head_dim + c;
      _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_loadu_ps(dst), _mm512_set1_ps(alpha[r]), acc));
    }
}

// The block's first `keys` keys (those before the context): the rest would add p v = 0 x 0,
// which leaves every sum as it is (a sum is never -0, it starts at +0), so where a block ends
// changes no bits.
template <typename T>
inline void accumulate(int64_t head_dim, const float* p, const T* const* v, int64_t keys, const float* alpha,
                       float* o, int64_t rows) {
  switch (head_dim) {
    case 32: accumulate_rows<2>(p, v, keys, alpha, o, rows); break;
    case 64: accumulate_rows<4>(p, v, keys, alpha, o, rows); break;
    case 128: accumulate_rows<8>(p, v, keys, alpha, o, rows); break;
    default: accumulate_any(p, v, keys, alpha, o, rows, head_dim); break;
  }
}

// A thread's buffers for up to `max_rows` rows (reused across calls)
struct Workspace {
  std::vector<float> s, o, row_max, new_max, alpha, row_sums;
  void reserve(int64_t max_rows, int64_t head_dim) {
    // + 16: online_softmax reads and writes whole 16-row vectors of the per-row values
    s.resize(max_rows * kKeys);
    o.resize(max_rows * head_dim);
    row_max.resize(max_rows + 16);
    new_max.resize(max_rows + 16);
    alpha.resize(max_rows + 16);
    row_sums.resize(max_rows * 16);
  }
};

template <typename T>
inline const T* zero_row() {
  alignas(64) static const T zeros[kMaxHeadDim] = {};
  return zeros;
}

// The cache lines of positions [32 b, 32 b + 32) of `base` (one kv head's keys or values) on
// their way to L2: at decode batch sizes they come from DRAM (a step reads every sequence's whole
// context) in scattered cache blocks the hardware prefetchers do not follow. Into L2, not L1: a
// burst of prefetches into L1 fills its few miss buffers and stalls the core.
template <typename T>
inline void prefetch_block(const T* base, const int64_t* table, int64_t b, int64_t context_len, int64_t block_size,
                           int64_t head_dim) {
  const int64_t first = b * kKeys, end = std::min(context_len, first + kKeys);
  for (int64_t cache_block = first / block_size; cache_block * block_size < end; ++cache_block) {
    const int64_t lo = std::max(first, cache_block * block_size), hi = std::min(end, (cache_block + 1) * block_size);
    const char* p = reinterpret_cast<const char*>(base + (table[cache_block] * block_size + lo - cache_block * block_size) * head_dim);
    const int64_t bytes = (hi - lo) * head_dim * static_cast<int64_t>(sizeof(T));
    // an asm statement, not __builtin_prefetch: GCC 12 at -O3 deleted this whole loop nest (a
    // prefetch has no effect it has to keep), and the kernel ran 1.8x slower for it
    for (int64_t i = 0; i < bytes; i += 64) asm volatile("prefetcht1 %0" : : "m"(p[i]));
  }
}

// The rows of positions [32 b, 32 b + 32) of `base`, the zero row past the context
template <typename T>
inline void block_rows(const T* base, const int64_t* table, int64_t b, int64_t context_len, int64_t block_size,
                       int64_t head_dim, const T** rows) {
  int64_t j = 0;
  for (int64_t pos = b * kKeys, end = std::min(context_len, pos + kKeys); pos < end;) {  // a cache block's rows at a time
    const int64_t cache_block = pos / block_size, run_end = std::min(end, (cache_block + 1) * block_size);
    const T* row = base + (table[cache_block] * block_size + pos - cache_block * block_size) * head_dim;
    for (; pos < run_end; ++pos, ++j, row += head_dim) rows[j] = row;
  }
  for (; j < kKeys; ++j) rows[j] = zero_row<T>();
}

// The keys a thread attends to next (one kv head's pool, the sequence's blocks, its length), or none
template <typename T>
struct Upcoming {
  const T* k_base = nullptr;
  const int64_t* table = nullptr;
  int64_t context_len = 0;
};

// out_rows[r] = attention of q_rows[r] (at position row_pos[r]) over one kv head's keys and values
// (k_base / v_base: that head's pool, [num_blocks][block_size][head_dim]; `table` the sequence's
// blocks) at positions < context_len, every row_pos < context_len. With few rows, `upcoming`'s keys
// are prefetched while this call's values are used.
template <typename T>
void attend_rows(const T* const* q_rows, int64_t rows, const int64_t* row_pos, const T* k_base, const T* v_base,
                 const int64_t* table, int64_t context_len, int64_t block_size, int64_t head_dim, float scale,
                 Workspace& ws, T* const* out_rows, const Upcoming<T>& upcoming = {}) {
  ws.reserve(rows, head_dim);
  std::fill(ws.o.begin(), ws.o.begin() + rows * head_dim, 0.f);
  std::fill(ws.row_max.begin(), ws.row_max.begin() + rows, -INFINITY);
  std::fill(ws.row_sums.begin(), ws.row_sums.begin() + rows * 16, 0.f);
  const int64_t num_blocks = *std::max_element(row_pos, row_pos + rows) / kKeys + 1;
  const T* keys[kKeys];
  const T* values[kKeys];
  auto keys_in = [&](int64_t b) { return std::min(kKeys, context_len - b * kKeys); };
  auto score_block = [&](int64_t b, float* s) {
    block_rows(k_base, table, b, context_len, block_size, head_dim, keys);
    score_rows(q_rows, rows, keys, keys_in(b), head_dim, s);
  };
  auto add_block = [&](int64_t b, float* s) {
    online_softmax(s, rows, row_pos, b, scale, ws.row_max.data(), ws.new_max.data(), ws.alpha.data(),
                   ws.row_sums.data());
    block_rows(v_base, table, b, context_len, block_size, head_dim, values);
    accumulate(head_dim, s, values, keys_in(b), ws.alpha.data(), ws.o.data(), rows);
  };
  if (rows <= kFewRows) {
    // Few rows (a decode): every block's scores first, each block's values prefetched meanwhile,
    // then the softmax and the values: the values are in L2 by then (without their prefetch the
    // kernel took 1.4x the time). The same sums as the other order: only the schedule differs.
    ws.s.resize(num_blocks * rows * kKeys);
    constexpr int64_t kAhead = 2;  // key blocks prefetched ahead (1: 1.08x the time on a Zen 4 host, 3: no better)
    for (int64_t b = 0; b < kAhead && b < num_blocks; ++b) prefetch_block(k_base, table, b, context_len, block_size, head_dim);
    for (int64_t b = 0; b < num_blocks; ++b) {
      if (b + kAhead < num_blocks) prefetch_block(k_base, table, b + kAhead, context_len, block_size, head_dim);
      prefetch_block(v_base, table, b, context_len, block_size, head_dim);
      score_block(b, &ws.s[b * rows * kKeys]);
    }
    // The next call's keys on their way meanwhile, spread evenly over this pass: the DRAM reads
    // then run through both passes instead of crowding into the scoring one (1.11-1.15x the
    // speed at batch 8-64, contexts 256-1,024, on a Zen 4 host, where the kernel then reads
    // 21-24 GB/s and a bare read of the same scattered blocks at most 25).
    const int64_t upcoming_blocks = upcoming.k_base ? (upcoming.context_len + kKeys - 1) / kKeys : 0;
    for (int64_t b = 0, issued = 0; b < num_blocks; ++b) {
      for (const int64_t due = (b + 1) * upcoming_blocks / num_blocks; issued < due; ++issued)
        prefetch_block(upcoming.k_base, upcoming.table, issued, upcoming.context_len, block_size, head_dim);
      add_block(b, &ws.s[b * rows * kKeys]);
    }
  } else {  // a prefill tile: each block's keys and values are reused by many rows while in L1
    for (int64_t b = 0; b < num_blocks; ++b) {
      score_block(b, ws.s.data());
      add_block(b, ws.s.data());
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(&ws.row_sums[r * 16])));
    for (int64_t d = 0; d < head_dim; d += 16)
      store16(out_rows[r] + d, _mm512_mul_ps(_mm512_loadu_ps(&ws.o[r * head_dim + d]), inv));
  }
}

}  // namespace attention_rows
#endif  // __AVX512F__
