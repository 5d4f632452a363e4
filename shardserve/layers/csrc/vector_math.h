// Vector helpers shared by the native CPU kernels (AVX-512: 16 float32 lanes; AVX2 with FMA: 8;
// include after <ATen/ATen.h> and <immintrin.h>).
#pragma once

#if defined(__AVX512F__)

// 16 values widened to float32: bf16 -> f32 is the bits shifted into the high half
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// 16 float32 values rounded to bf16 as torch rounds them: to nearest even, NaN -> 0x7FC0
inline __m256i round_to_bf16(__m512 x) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
  // The conversion instruction rounds the same way but for NaN payloads and denormals (it flushes
  // them to zero): vectors holding either take the integer path below. A third of the ops, and
  // the elementwise kernels were bound on these integer ops.
  if (!_mm512_fpclass_ps_mask(x, 0x01 | 0x20 | 0x80))  // quiet NaN, denormal, signalling NaN
    return (__m256i)_mm512_cvtneps_pbh(x);
#endif
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}

// x as it reads back after a store in T (float32: unchanged; bf16: rounded)
inline __m512 as_stored(float, __m512 x) { return x; }
inline __m512 as_stored(c10::BFloat16, __m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(round_to_bf16(x)), 16));
}

inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(c10::BFloat16* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), round_to_bf16(x));
}

// e^x for x <= 0 (softmax scores minus their max; sigmoid's e^-|x|): x = n ln2 + r, |r| <= ln2 / 2,
// e^r by its Taylor series to degree 7 (relative error < 1e-8, below float32 rounding), times 2^n
// exactly.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));  // e^-87 is already below float32's normal range
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2 split in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// What SwiGLU stores for 16 lanes, before the store's own rounding: T(silu(gate)) * up, with
// silu(x) = x * sigmoid(x) and sigmoid from e^-|x| (no overflow either way). One home for the
// rule, so the elementwise op and the matmul that ends in it (panel_linear's gate/up epilogue)
// give the same bits.
template <typename T>
inline __m512 silu_mul16(__m512 x, __m512 up) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 neg_abs = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
  const __m512 e = exp_nonpositive(neg_abs);
  // 1 / (1 + e) as the reciprocal estimate (14 bits) and one Newton step (about 2^-27
  // relative): a division per 16 lanes took a third of the op
  const __m512 den = _mm512_add_ps(one, e), r0 = _mm512_rcp14_ps(den);
  const __m512 inv = _mm512_fmadd_ps(r0, _mm512_fnmadd_ps(den, r0, one), r0);
  const __m512 sigmoid = _mm512_mask_mul_ps(inv, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), e, inv);
  return _mm512_mul_ps(as_stored(T(), _mm512_mul_ps(x, sigmoid)), up);
}
#endif  // __AVX512F__

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// 8 float32 values rounded to bf16 as torch rounds them (as round_to_bf16 above)
inline __m128i round_to_bf16(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  // every lane is <= 0xFFFF, so the saturating pack is exact
  return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
}

inline __m256 as_stored(float, __m256 x) { return x; }
inline __m256 as_stored(c10::BFloat16, __m256 x) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(round_to_bf16(x)), 16));
}

inline void store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
inline void store8(c10::BFloat16* p, __m256 x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), round_to_bf16(x));
}

inline float reduce_add8(__m256 x) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

inline float reduce_max8(__m256 x) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

// e^x for x <= 0, as the AVX-512 version (2^n built in the exponent bits: n >= -126 stays normal)
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2n));
}
#endif  // __AVX2__ && __FMA__
