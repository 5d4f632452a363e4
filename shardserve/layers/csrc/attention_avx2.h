// Attention for one sequence position's G query heads over one kv head's paged keys and values
// on 8 lanes (AVX2 + FMA, CPUs without AVX-512): the one home of the arithmetic that the decode
// kernel (a sequence's next token) and the prefill kernel (each token of a chunk in turn) both
// run on such CPUs, so a token's attention output has the same bits whichever computed it (a
// resumed request, a prefix-cache hit or a later chunk continues exactly). A head's result
// depends on its query and the keys and values at or before its position only: scores in key
// order, the softmax's max and sum over 8 lanes by position, values accumulated in key order.
// include after <ATen/ATen.h>, <immintrin.h> and "vector_math.h"
#pragma once

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace attention_avx2 {

inline bool supported(int64_t head_dim) { return head_dim % 8 == 0; }

// The cache block's lines on their way to L2 while the one before is used (as attention_rows.h)
inline void prefetch_block(const void* block, int64_t num_bytes) {
  const char* p = static_cast<const char*>(block);
  for (int64_t i = 0; i < num_bytes; i += 64) __builtin_prefetch(p + i, 0, 2);  // prefetcht1
}

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

// The G heads' outputs out[g * head_dim, +head_dim) for a query at position context_len - 1
// (q: its G heads, [G, head_dim]; table: the sequence's block table), for head_dim % 8 == 0. The
// next cache block is prefetched while this one is used.
template <typename T>
void attend_one(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t context_len,
                int64_t kv_head, int64_t num_blocks, int64_t block_size, int64_t group, int64_t head_dim, float scale,
                T* out, std::vector<float>& scores, std::vector<float>& acc, std::vector<float>& qf) {
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

}  // namespace attention_avx2

#endif  // !__AVX512F__ && __AVX2__ && __FMA__
