// Linear layers over weights kept in llama.cpp's block formats: y = x W^T (+ b) with W in Q4_0,
// Q4_1 or Q8_0 blocks of 32 inputs, each with an fp16 scale d (and, for Q4_1, an fp16 minimum m),
// or in Q4_K super-blocks of 256 (8 blocks of 32 with 6-bit scales and mins under fp16 d, dmin):
//
//     Q4_0: w = d * (q - 8),  q in 0..15        Q4_1: w = d * q + m        Q8_0: w = d * q, q in -127..127
//     Q4_K: w = (d * scale) * q - dmin * min: Q4_1's arithmetic once a block's d and m are formed
//     Q6_K: w = (d * scale) * (q - 32), q in 0..63, a scale per 16 inputs: each half of a block
//           scaled on its own (so x's blocks also carry the sums of their halves)
//
// Each row of x is quantized when it arrives as llama.cpp's dot products quantize it (per block of
// 32: dx = max|x| / 127, xq = round(x / dx), and sx = the block's sum of xq), so a block's dot
// product is an exact int32 sum and the whole row costs one float multiply-add a block:
//
//     Q4_0: d dx (sum q xq - 8 sx)     Q4_1: d dx sum q xq + m dx sx     Q8_0: d dx (sum (q+128) xq - 128 sx)
//
// AVX512-VNNI's vpdpbusd multiplies unsigned by signed bytes: weights enter unsigned (Q8_0 as
// q + 128), activations signed, and the offsets come off through sx, known with x.
//
// Layout (`pack` in layers/block_quant.py): 16 output rows side by side, block by block, one
// contiguous stream per 16 rows: [groups][blocks][scales | qs], where scales are d[16] (and m[16])
// in fp16 and qs is 8 registers' worth (4 for the 4-bit formats, two nibbles a byte) of 64 bytes
// each: register j holds inputs 4j..4j+3 of each of the 16 rows (row r at bytes 4r..4r+3), so one
// broadcast of 4 activation bytes feeds 16 rows' dots and a block's 16 results land in the 16
// lanes of one register, ready to scale. For the 4-bit formats register k < 4 holds inputs
// 4k..4k+3 in its low nibbles and 16+4k..16+4k+3 in its high ones (GGUF's own pairing of nibbles).
//
// A row's result depends on that row alone (the same operations in the same order whatever the
// batch or the tile), so decoding is batch-invariant. Output rows go to threads by groups of 16.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <atomic>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#include "vector_math.h"
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kGroupRows = 16;
enum Format : int64_t { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2, kQ4_K = 3, kQ6_K = 4 };
constexpr bool valid_format(int64_t f) { return f >= kQ4_0 && f <= kQ6_K; }
constexpr bool is_k_quant(int64_t f) { return f == kQ4_K || f == kQ6_K; }

constexpr int64_t qs_bytes(int64_t f) { return f == kQ8_0 ? 512 : 256; }
constexpr int64_t scale_bytes(int64_t f) { return f == kQ4_1 ? 64 : 32; }
constexpr int64_t block_stride(int64_t f) { return qs_bytes(f) + scale_bytes(f); }
// Q4_K packs 8 blocks (a super-block of 256 inputs) together: the 16 rows' d and dmin (fp16), then
// each block's 6-bit scales and mins (a byte each, 16 + 16), then the 8 blocks' quants
constexpr int64_t kSuperBlocks = 8;
constexpr int64_t kSuperHead = 64 + kSuperBlocks * 32;
constexpr int64_t kSuperBytes = kSuperHead + kSuperBlocks * 256;
// Q6_K: the 16 rows' d (fp16), the 16 scales of 16 inputs (int8) of each row, then each block's
// low 4 bits as the 4-bit formats have them and its high 2 bits (two registers' worth: byte lane L
// of plane p holds, at bits 2k, those of register 4p + k's lane L)
constexpr int64_t kQ6Head = 32 + 16 * 16;
constexpr int64_t kQ6Block = 256 + 128;
constexpr int64_t kQ6Bytes = kQ6Head + kSuperBlocks * kQ6Block;
constexpr int64_t group_bytes(int64_t f, int64_t blocks) {
  return f == kQ4_K ? blocks / kSuperBlocks * kSuperBytes
                    : (f == kQ6_K ? blocks / kSuperBlocks * kQ6Bytes : blocks * block_stride(f));
}
constexpr bool has_min(int64_t f) { return f == kQ4_1 || f == kQ4_K; }

inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// Where block b of a group keeps its parts: the 16 rows' fp16 scales d, their fp16 minimums m
// (Q4_1) or dmin (Q4_K), the byte scales (Q4_K: 16 scales then 16 mins, unsigned; Q6_K: the two
// halves' 16 + 16, signed), and the quants. Absent parts are null.
struct BlockParts {
  const uint8_t* d;
  const uint8_t* m;
  const uint8_t* scales;
  const uint8_t* qs;
};

inline BlockParts block_parts(int64_t f, const uint8_t* wg, int64_t b) {
  if (f == kQ6_K) {
    const uint8_t* sp = wg + b / kSuperBlocks * kQ6Bytes;
    return {sp, nullptr, sp + 32 + b % kSuperBlocks * 32, sp + kQ6Head + b % kSuperBlocks * kQ6Block};
  }
  if (f == kQ4_K) {
    const uint8_t* sp = wg + b / kSuperBlocks * kSuperBytes;
    return {sp, sp + 32, sp + 64 + b % kSuperBlocks * 32, sp + kSuperHead + b % kSuperBlocks * 256};
  }
  const uint8_t* p = wg + b * block_stride(f);
  return {p, f == kQ4_1 ? p + 32 : nullptr, nullptr, p + scale_bytes(f)};
}

inline float half_at(const uint8_t* p, int64_t r) {
  uint16_t h;
  std::memcpy(&h, p + 2 * r, 2);
  return half_to_float(h);
}

// row r's scale d and minimum m (0 without one) of block b, as w = d q + m (Q4_0, Q8_0: the
// offsets 8 and 128 come off q separately); returns the block's quants. Q4_K's d is d * scale and
// its m is -(dmin * min): products exact in float32 (11 by 6 bits), llama.cpp's values. Q6_K: d
// and m are the scales of the block's two halves, d * scale (11 by 8 bits, exact)
inline const uint8_t* block_scalars(int64_t f, const uint8_t* wg, int64_t b, int64_t r, float& d, float& m) {
  const BlockParts parts = block_parts(f, wg, b);
  d = half_at(parts.d, r);
  m = f == kQ4_1 ? half_at(parts.m, r) : 0.f;
  if (f == kQ4_K) {
    m = -(half_at(parts.m, r) * static_cast<float>(parts.scales[16 + r]));
    d *= static_cast<float>(parts.scales[r]);
  } else if (f == kQ6_K) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(parts.scales);
    m = d * static_cast<float>(sc[16 + r]);
    d *= static_cast<float>(sc[r]);
  }
  return parts.qs;
}

// x row [in] (float or bfloat16) -> xq [in] int8, dx [blocks], sx [blocks][2] (each half's sum)
template <typename T>
void quantize_row(const T* x, int64_t blocks, int8_t* xq, float* dx, int32_t* sx) {
  for (int64_t b = 0; b < blocks; ++b) {
    const T* xb = x + b * kBlock;
    float amax = 0.f;
    for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(static_cast<float>(xb[i])));
    const float d = amax / 127.f;
    const float inv = d > 0.f ? 1.f / d : 0.f;
    int32_t sum[2] = {0, 0};
    for (int64_t i = 0; i < kBlock; ++i) {
      const int q = std::max(-127, std::min(127, static_cast<int>(std::nearbyint(static_cast<float>(xb[i]) * inv))));
      xq[b * kBlock + i] = static_cast<int8_t>(q);
      sum[i / 16] += q;
    }
    dx[b] = d;
    sx[2 * b] = sum[0];
    sx[2 * b + 1] = sum[1];
  }
}

#if defined(__AVX512F__)
// quantize_row's arithmetic on 16 lanes: the same max, scale, products and rounding (to nearest
// even), so the same bytes
template <typename T>
void quantize_row_vec(const T* x, int64_t blocks, int8_t* xq, float* dx, int32_t* sx) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 lo = load16(x + b * kBlock), hi = load16(x + b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
    const float d = amax / 127.f;
    const __m512 inv = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
    const __m512i top = _mm512_set1_epi32(127), bottom = _mm512_set1_epi32(-127);
    const __m512i qlo = _mm512_max_epi32(bottom, _mm512_min_epi32(top, _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv))));
    const __m512i qhi = _mm512_max_epi32(bottom, _mm512_min_epi32(top, _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * kBlock), _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * kBlock + 16), _mm512_cvtepi32_epi8(qhi));
    dx[b] = d;
    sx[2 * b] = _mm512_reduce_add_epi32(qlo);
    sx[2 * b + 1] = _mm512_reduce_add_epi32(qhi);
  }
}
#endif

// quant i of row r in a block's packed quants (Q8_0: q + 128)
inline int32_t quant(int64_t f, const uint8_t* qs, int64_t r, int64_t i) {
  if (f == kQ8_0) return qs[(i / 4) * 64 + r * 4 + i % 4];
  const int64_t j = i % 16;
  const uint8_t byte = qs[(j / 4) * 64 + r * 4 + j % 4];
  const int32_t low = i < 16 ? (byte & 0x0F) : (byte >> 4);
  if (f != kQ6_K) return low;
  const uint8_t high = qs[256 + (i / 16) * 64 + r * 4 + i % 4];
  return low | (((high >> (2 * (j / 4))) & 3) << 4);
}

struct Rows {  // the quantized rows of x
  const int8_t* xq;   // [N][in]
  const float* dx;    // [N][blocks]
  const int32_t* sx;  // [N][blocks][2]
  int64_t in, blocks;
};

#if defined(__AVX512VNNI__)
inline __m512 load_halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load_bytes(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load_signed_bytes(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// block_scalars for the 16 rows at once (the same products)
template <int64_t F>
inline const uint8_t* block_vectors(const uint8_t* wg, int64_t b, __m512& d, __m512& m) {
  const BlockParts parts = block_parts(F, wg, b);
  d = load_halves(parts.d);
  if constexpr (F == kQ4_1) m = load_halves(parts.m);
  if constexpr (F == kQ4_K) {
    m = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(load_halves(parts.m), load_bytes(parts.scales + 16)));
    d = _mm512_mul_ps(d, load_bytes(parts.scales));
  }
  if constexpr (F == kQ6_K) {
    m = _mm512_mul_ps(d, load_signed_bytes(parts.scales + 16));
    d = _mm512_mul_ps(d, load_signed_bytes(parts.scales));
  }
  return parts.qs;
}

// y[n0 + t, 16 g + lane] for t < NT into out[t][16], without bias
template <int64_t F, int NT>
inline void group_tile(const Rows& x, int64_t n0, const uint8_t* wg, float* out) {
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  constexpr int64_t offset = F == kQ4_0 ? 8 : (F == kQ8_0 ? 128 : 0);
  for (int64_t b = 0; b < x.blocks; ++b) {
    __m512 d, m;
    const uint8_t* qs = block_vectors<F>(wg, b, d, m);
    __m512i w[8];
    if constexpr (F == kQ8_0) {
      for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(qs + 64 * j);
    } else {
      for (int k = 0; k < 4; ++k) {
        const __m512i v = _mm512_loadu_si512(qs + 64 * k);
        w[k] = _mm512_and_si512(v, low);
        w[4 + k] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      if constexpr (F == kQ6_K) {  // the high 2 bits, into bits 4-5 (16-bit shifts: the mask drops what crosses bytes)
        const __m512i top = _mm512_set1_epi8(0x30);
        for (int p = 0; p < 2; ++p) {
          const __m512i h = _mm512_loadu_si512(qs + 256 + 64 * p);
          w[4 * p + 0] = _mm512_or_si512(w[4 * p + 0], _mm512_and_si512(_mm512_slli_epi16(h, 4), top));
          w[4 * p + 1] = _mm512_or_si512(w[4 * p + 1], _mm512_and_si512(_mm512_slli_epi16(h, 2), top));
          w[4 * p + 2] = _mm512_or_si512(w[4 * p + 2], _mm512_and_si512(h, top));
          w[4 * p + 3] = _mm512_or_si512(w[4 * p + 3], _mm512_and_si512(_mm512_srli_epi16(h, 2), top));
        }
      }
    }
    for (int t = 0; t < NT; ++t) {
      const int64_t n = n0 + t;
      const int8_t* xb = x.xq + n * x.in + b * kBlock;
      // 4 activation bytes broadcast from memory (as a float: GCC moves an int through a general
      // register first)
      const float* xf = reinterpret_cast<const float*>(xb);
      auto xw = [xf](int j) { return _mm512_castps_si512(_mm512_set1_ps(xf[j])); };
      // two chains, one a half of the block (inputs 0..15, 16..31)
      __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], xw(0));
      __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[4], xw(4));
      s0 = _mm512_dpbusd_epi32(s0, w[1], xw(1));
      s1 = _mm512_dpbusd_epi32(s1, w[5], xw(5));
      s0 = _mm512_dpbusd_epi32(s0, w[2], xw(2));
      s1 = _mm512_dpbusd_epi32(s1, w[6], xw(6));
      s0 = _mm512_dpbusd_epi32(s0, w[3], xw(3));
      s1 = _mm512_dpbusd_epi32(s1, w[7], xw(7));
      const float dx = x.dx[n * x.blocks + b];
      const int32_t* sxh = x.sx + 2 * (n * x.blocks + b);
      const __m512 ddx = _mm512_mul_ps(d, _mm512_set1_ps(dx));
      if constexpr (F == kQ6_K) {
        s0 = _mm512_sub_epi32(s0, _mm512_set1_epi32(32 * sxh[0]));
        s1 = _mm512_sub_epi32(s1, _mm512_set1_epi32(32 * sxh[1]));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), ddx, acc[t]);
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(m, _mm512_set1_ps(dx)), acc[t]);
        continue;
      }
      const int32_t sx = sxh[0] + sxh[1];
      __m512i s = _mm512_add_epi32(s0, s1);
      if constexpr (offset != 0) s = _mm512_sub_epi32(s, _mm512_set1_epi32(offset * sx));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), ddx, acc[t]);
      if constexpr (has_min(F)) acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(dx * static_cast<float>(sx)), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) _mm512_storeu_ps(out + t * kGroupRows, acc[t]);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2 (CPUs without AVX512-VNNI: no AVX-512 at all, or Skylake's without VNNI): a block's 16
// rows as two halves of 8 lanes, one pass over the group each. vpmaddubsw multiplies unsigned by
// signed bytes into int16 pairs, exact here: the 4-bit quants (0..15) by xq sum to at most 3,810
// a pair, four registers' pairs to 15,240; Q6_K's (0..63) to 16,002 a pair, widened at once; Q8_0
// enters signed (its stored q + 128 back to q) as |q| times xq with q's sign, at most 32,258 a pair. So each block dot is the exact int32 the
// VNNI path forms (Q8_0 without the 128 sx it takes off), and the float operations are its own,
// lane by lane: the same bits.
inline __m256 load_halves8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load_bytes8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load_signed_bytes8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// the VNNI path's block_vectors for the 8 rows of half h
template <int64_t F>
inline const uint8_t* block_vectors8(const uint8_t* wg, int64_t b, int h, __m256& d, __m256& m) {
  const BlockParts parts = block_parts(F, wg, b);
  d = load_halves8(parts.d + 16 * h);
  if constexpr (F == kQ4_1) m = load_halves8(parts.m + 16 * h);
  if constexpr (F == kQ4_K) {
    m = _mm256_sub_ps(_mm256_setzero_ps(),
                      _mm256_mul_ps(load_halves8(parts.m + 16 * h), load_bytes8(parts.scales + 16 + 8 * h)));
    d = _mm256_mul_ps(d, load_bytes8(parts.scales + 8 * h));
  }
  if constexpr (F == kQ6_K) {
    m = _mm256_mul_ps(d, load_signed_bytes8(parts.scales + 16 + 8 * h));
    d = _mm256_mul_ps(d, load_signed_bytes8(parts.scales + 8 * h));
  }
  return parts.qs;
}

template <int64_t F, int NT>
inline void group_tile(const Rows& x, int64_t n0, const uint8_t* wg, float* out) {
  constexpr int32_t offset = F == kQ4_0 ? 8 : 0;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < x.blocks; ++b) {
      __m256 d, m;
      const uint8_t* qs = block_vectors8<F>(wg, b, h, d, m);
      __m256i w[8];  // Q8_0: |q|, its sign in sign[]
      __m256i sign[F == kQ8_0 ? 8 : 1];
      if constexpr (F == kQ8_0) {
        for (int j = 0; j < 8; ++j) {
          sign[j] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64 * j + 32 * h)),
                                     _mm256_set1_epi8(static_cast<char>(0x80)));
          w[j] = _mm256_abs_epi8(sign[j]);
        }
      } else {
        for (int k = 0; k < 4; ++k) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64 * k + 32 * h));
          w[k] = _mm256_and_si256(v, low);
          w[4 + k] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        if constexpr (F == kQ6_K) {  // the high 2 bits, into bits 4-5
          const __m256i top = _mm256_set1_epi8(0x30);
          for (int p = 0; p < 2; ++p) {
            const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 256 + 64 * p + 32 * h));
            w[4 * p + 0] = _mm256_or_si256(w[4 * p + 0], _mm256_and_si256(_mm256_slli_epi16(hb, 4), top));
            w[4 * p + 1] = _mm256_or_si256(w[4 * p + 1], _mm256_and_si256(_mm256_slli_epi16(hb, 2), top));
            w[4 * p + 2] = _mm256_or_si256(w[4 * p + 2], _mm256_and_si256(hb, top));
            w[4 * p + 3] = _mm256_or_si256(w[4 * p + 3], _mm256_and_si256(_mm256_srli_epi16(hb, 2), top));
          }
        }
      }
      for (int t = 0; t < NT; ++t) {
        const int64_t n = n0 + t;
        const int8_t* xb = x.xq + n * x.in + b * kBlock;
        auto xw = [xb](int j) {
          int32_t v;
          std::memcpy(&v, xb + 4 * j, 4);
          return _mm256_set1_epi32(v);
        };
        auto pairs = [&](int j) {  // int16 pairs of w[j] x the 4 activation bytes of register j
          if constexpr (F == kQ8_0) return _mm256_maddubs_epi16(w[j], _mm256_sign_epi8(xw(j), sign[j]));
          else return _mm256_maddubs_epi16(w[j], xw(j));
        };
        auto half_dot = [&](int j0) {  // the int32 dot of inputs 4 j0 .. 4 j0 + 15 (registers j0 .. j0 + 3)
          if constexpr (F == kQ8_0 || F == kQ6_K) {
            __m256i s = _mm256_madd_epi16(pairs(j0), ones);
            for (int j = j0 + 1; j < j0 + 4; ++j) s = _mm256_add_epi32(s, _mm256_madd_epi16(pairs(j), ones));
            return s;
          } else {
            const __m256i p = _mm256_add_epi16(_mm256_add_epi16(pairs(j0), pairs(j0 + 1)),
                                               _mm256_add_epi16(pairs(j0 + 2), pairs(j0 + 3)));
            return _mm256_madd_epi16(p, ones);
          }
        };
        __m256i s0 = half_dot(0), s1 = half_dot(4);
        const float dx = x.dx[n * x.blocks + b];
        const int32_t* sxh = x.sx + 2 * (n * x.blocks + b);
        const __m256 ddx = _mm256_mul_ps(d, _mm256_set1_ps(dx));
        if constexpr (F == kQ6_K) {
          s0 = _mm256_sub_epi32(s0, _mm256_set1_epi32(32 * sxh[0]));
          s1 = _mm256_sub_epi32(s1, _mm256_set1_epi32(32 * sxh[1]));
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), ddx, acc[t]);
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(m, _mm256_set1_ps(dx)), acc[t]);
          continue;
        }
        const int32_t sx = sxh[0] + sxh[1];
        __m256i s = _mm256_add_epi32(s0, s1);
        if constexpr (offset != 0) s = _mm256_sub_epi32(s, _mm256_set1_epi32(offset * sx));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), ddx, acc[t]);
        if constexpr (has_min(F)) acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(dx * static_cast<float>(sx)), acc[t]);
      }
    }
    for (int t = 0; t < NT; ++t) _mm256_storeu_ps(out + t * kGroupRows + 8 * h, acc[t]);
  }
}
#else
// a CPU without AVX512-VNNI or AVX2: the same exact block dots and the same float operations, lane by lane
template <int64_t F, int NT>
inline void group_tile(const Rows& x, int64_t n0, const uint8_t* wg, float* out) {
  constexpr int32_t offset = F == kQ4_0 ? 8 : (F == kQ8_0 ? 128 : 0);
  for (int t = 0; t < NT; ++t)
    for (int64_t r = 0; r < kGroupRows; ++r) {
      const int64_t n = n0 + t;
      float acc = 0.f;
      for (int64_t b = 0; b < x.blocks; ++b) {
        float d, m;
        const uint8_t* qs = block_scalars(F, wg, b, r, d, m);
        const int8_t* xb = x.xq + n * x.in + b * kBlock;
        int32_t dot[2] = {0, 0};
        for (int64_t i = 0; i < kBlock; ++i) dot[i / 16] += quant(F, qs, r, i) * xb[i];
        const float dx = x.dx[n * x.blocks + b];
        const int32_t* sxh = x.sx + 2 * (n * x.blocks + b);
        if (F == kQ6_K) {
          acc = std::fma(static_cast<float>(dot[0] - 32 * sxh[0]), d * dx, acc);
          acc = std::fma(static_cast<float>(dot[1] - 32 * sxh[1]), m * dx, acc);
          continue;
        }
        const int32_t sx = sxh[0] + sxh[1];
        acc = std::fma(static_cast<float>(dot[0] + dot[1] - offset * sx), d * dx, acc);
        if (has_min(F)) acc = std::fma(m, dx * static_cast<float>(sx), acc);
      }
      out[t * kGroupRows + r] = acc;
    }
}
#endif

constexpr int64_t kXTile = 4;  // rows of x that share each unpacked weight block

// The chunks [first, end) of a run not yet taken, in one atomic word (first << 32 | end): its owner
// takes from the front, other threads from the back, and neither takes a chunk twice.
struct alignas(64) ChunkRun {  // a cache line each: the owners' takes do not contend
  std::atomic<uint64_t> bounds{0};
  void reset(int64_t first, int64_t end) {
    bounds.store(static_cast<uint64_t>(first) << 32 | static_cast<uint64_t>(end));
  }
  int64_t take_front() { return take(true); }
  int64_t take_back() { return take(false); }

 private:
  int64_t take(bool front) {  // -1 when the run is empty
    uint64_t b = bounds.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t first = b >> 32, end = b & 0xffffffffu;
      if (first >= end) return -1;
      const uint64_t next = front ? (first + 1) << 32 | end : first << 32 | (end - 1);
      if (bounds.compare_exchange_weak(b, next, std::memory_order_relaxed))
        return static_cast<int64_t>(front ? first : end - 1);
    }
  }
};

template <int64_t F>
void tile(const Rows& x, int64_t n0, int64_t nt, const uint8_t* wg, float* out) {
  switch (nt) {
    case 1: group_tile<F, 1>(x, n0, wg, out); break;
    case 2: group_tile<F, 2>(x, n0, wg, out); break;
    case 3: group_tile<F, 3>(x, n0, wg, out); break;
    default: group_tile<F, 4>(x, n0, wg, out);
  }
}

template <typename T, typename Y>
void run(int64_t format, const T* xp, int64_t n_rows, int64_t in, const uint8_t* w, int64_t groups, const T* bp,
         int64_t out, Y* yp) {
  const int64_t blocks = in / kBlock;
  std::vector<int8_t> xq(n_rows * in);
  std::vector<float> dx(n_rows * blocks);
  std::vector<int32_t> sx(n_rows * blocks * 2);
  auto quantize = [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
#if defined(__AVX512F__)
      quantize_row_vec(xp + n * in, blocks, xq.data() + n * in, dx.data() + n * blocks, sx.data() + 2 * n * blocks);
#else
      quantize_row(xp + n * in, blocks, xq.data() + n * in, dx.data() + n * blocks, sx.data() + 2 * n * blocks);
#endif
  };
  if (n_rows < 16) quantize(0, n_rows);  // waking the threads costs more than these rows
  else at::parallel_for(0, n_rows, 1, quantize);
  const Rows rows{xq.data(), dx.data(), sx.data(), in, blocks};
  const int64_t stride = group_bytes(format, blocks);
  // chunks of 4 groups (64 rows of W, 24-35 KiB at 576 inputs) stay in L1/L2 while x's rows pass.
  // Each thread owns a contiguous run of chunks and walks it front to back: one sequential stream
  // per thread, which the hardware prefetcher follows. (Dealt from one shared counter, the chunks
  // of two threads interleaved and broke each thread's stream every chunk: at batch 1 two threads
  // then read SmolLM2's 96 MB slower than one.) A thread done with its run takes chunks from the
  // back of the others': one the OS preempts (an HTTP thread or a client on the same 2 cores)
  // leaves the rest of its run to them instead of holding the region up. A chunk's outputs do not
  // depend on which thread computes it.
  constexpr int64_t kGroupsPerChunk = 4;
  const int64_t chunks = (groups + kGroupsPerChunk - 1) / kGroupsPerChunk;
  const int64_t num_runs = std::min<int64_t>(at::get_num_threads(), chunks);
  std::vector<ChunkRun> runs(num_runs);
  for (int64_t i = 0; i < num_runs; ++i) runs[i].reset(i * chunks / num_runs, (i + 1) * chunks / num_runs);
  at::parallel_for(0, num_runs, 1, [&](int64_t own_begin, int64_t own_end) {
    float buf[kXTile * kGroupRows];
    auto compute = [&](int64_t ch) {
      const int64_t g0 = ch * kGroupsPerChunk, g1 = std::min(groups, g0 + kGroupsPerChunk);
      for (int64_t n0 = 0; n0 < n_rows; n0 += kXTile) {
        const int64_t nt = std::min(kXTile, n_rows - n0);
        for (int64_t g = g0; g < g1; ++g) {
          const uint8_t* wg = w + g * stride;
          switch (format) {
            case kQ4_0: tile<kQ4_0>(rows, n0, nt, wg, buf); break;
            case kQ4_1: tile<kQ4_1>(rows, n0, nt, wg, buf); break;
            case kQ4_K: tile<kQ4_K>(rows, n0, nt, wg, buf); break;
            case kQ6_K: tile<kQ6_K>(rows, n0, nt, wg, buf); break;
            default: tile<kQ8_0>(rows, n0, nt, wg, buf);
          }
          const int64_t nr = std::min(kGroupRows, out - g * kGroupRows);  // rows past `out` are padding
          for (int64_t t = 0; t < nt; ++t)
            for (int64_t r = 0; r < nr; ++r) {
              const int64_t o = g * kGroupRows + r;
              const float v = buf[t * kGroupRows + r];
              yp[(n0 + t) * out + o] = static_cast<Y>(bp ? v + static_cast<float>(bp[o]) : v);
            }
        }
      }
    };
    for (int64_t i = own_begin; i < own_end; ++i)
      for (int64_t ch; (ch = runs[i].take_front()) >= 0;) compute(ch);
    for (int64_t k = 1; k < num_runs; ++k)
      for (int64_t ch; (ch = runs[(own_begin + k) % num_runs].take_back()) >= 0;) compute(ch);
  });
}

template <typename T>
void dispatch_out(int64_t format, const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, int64_t out,
                  at::Tensor& y) {
  const T* bp = bias.defined() ? bias.data_ptr<T>() : nullptr;
  if (y.scalar_type() == at::kFloat)
    run<T, float>(format, x.data_ptr<T>(), x.size(0), x.size(1), w.data_ptr<uint8_t>(), w.size(0), bp, out,
                  y.data_ptr<float>());
  else
    run<T, T>(format, x.data_ptr<T>(), x.size(0), x.size(1), w.data_ptr<uint8_t>(), w.size(0), bp, out, y.data_ptr<T>());
}

}  // namespace

// x [N, in] float32 or bfloat16 (in a multiple of 32); w uint8 [groups, blocks * stride] packed as
// above; y [N, out] in x's dtype, or float32 with float_out
at::Tensor block_linear(at::Tensor x, at::Tensor w, int64_t format, c10::optional<at::Tensor> bias,
                        int64_t out_features, bool float_out) {
  TORCH_CHECK(valid_format(format), "block_linear: format 0 (Q4_0), 1 (Q4_1), 2 (Q8_0), 3 (Q4_K) or 4 (Q6_K)");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kBlock == 0, "block_linear: x [N, in], in a multiple of 32");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "block_linear: x float32 or bfloat16");
  const int64_t blocks = x.size(1) / kBlock;
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() &&
                  (!is_k_quant(format) || blocks % kSuperBlocks == 0) && w.size(1) == group_bytes(format, blocks) &&
                  out_features <= w.size(0) * kGroupRows &&
                  w.size(0) * kGroupRows - out_features < kGroupRows,
              "block_linear: w uint8 [ceil(out / 16), blocks * stride] for this format and x");
  const at::Tensor xc = x.contiguous();
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) bc = bias->to(x.scalar_type()).contiguous();
  at::Tensor y = at::empty({x.size(0), out_features}, x.options().dtype(float_out ? at::kFloat : x.scalar_type()));
  if (x.scalar_type() == at::kFloat) dispatch_out<float>(format, xc, w, bc, out_features, y);
  else dispatch_out<c10::BFloat16>(format, xc, w, bc, out_features, y);
  return y;
}

// rows `ids` of the weight, dequantized as llama.cpp dequantizes (d (q - 8), d q + m, d q in float32),
// in `dtype`: an embedding's lookup in its LM head's blocks
at::Tensor block_rows(at::Tensor w, int64_t format, at::Tensor ids, int64_t cols, at::ScalarType dtype) {
  TORCH_CHECK(valid_format(format), "block_rows: format 0 to 4");
  const int64_t blocks = cols / kBlock;
  TORCH_CHECK(cols % kBlock == 0 && (!is_k_quant(format) || blocks % kSuperBlocks == 0) && w.dim() == 2 &&
                  w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) == group_bytes(format, blocks),
              "block_rows: w does not match cols");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "block_rows: ids int64 [T]");
  const at::Tensor idc = ids.contiguous();
  const int64_t n = idc.size(0), rows = w.size(0) * kGroupRows;
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) TORCH_CHECK(id[t] >= 0 && id[t] < rows, "block_rows: id out of range");
  at::Tensor out = at::empty({n, cols}, at::kFloat);
  float* o = out.data_ptr<float>();
  for (int64_t t = 0; t < n; ++t) {
    const int64_t r = id[t] % kGroupRows;
    const uint8_t* wg = w.data_ptr<uint8_t>() + id[t] / kGroupRows * w.size(1);
    for (int64_t b = 0; b < blocks; ++b) {
      float d, m;
      const uint8_t* qs = block_scalars(format, wg, b, r, d, m);
      float* ob = o + t * cols + b * kBlock;
      for (int64_t i = 0; i < kBlock; ++i) {
        const float q = static_cast<float>(quant(format, qs, r, i));
        if (format == kQ6_K) ob[i] = (q - 32.f) * (i < 16 ? d : m);
        else ob[i] = format == kQ4_0 ? (q - 8.f) * d : (format == kQ8_0 ? (q - 128.f) * d : q * d + m);
      }
    }
  }
  return out.to(dtype);
}

TORCH_LIBRARY(shardserve_block_linear, m) {
  m.def("block_linear(Tensor x, Tensor w, int format, Tensor? bias, int out_features, bool float_out) -> Tensor",
        &block_linear);
  m.def("block_rows(Tensor w, int format, Tensor ids, int cols, ScalarType dtype) -> Tensor", &block_rows);
}
