// Linear layer on x86 CPUs: y [M, N] = x [M, K] W^T (+ bias), float32 sums; with AVX-512,
// bfloat16 (with AVX512-BF16) or float32 in and out; with only AVX2 and FMA, float32 or bfloat16
// (each bf16 widened to float32 in registers: no bf16 arithmetic there, where oneDNN's bf16
// matmul ran at ~5 GFLOP/s).
//
// At decode batch sizes (M of 1-64 rows) every weight byte is used M times and then not again
// until the next step: the weights stream from DRAM, and a layer's matmul is short enough that
// the fork/join, packing and cache misses of a general GEMM cost as much as the arithmetic. This
// kernel is built for that shape:
//   - W is repacked once into panels of P output columns (two vector registers: 32 with AVX-512,
//     16 with AVX2) with kw consecutive k values interleaved ([N/P][K/kw][P][kw]; kw = 2 for
//     bf16, 1 for float32), so one panel is one contiguous stream and each load feeds one dot
//     (bf16 pairs) or multiply-add;
//   - a panel (32 x K, 36 KB in bf16 at K = 576) stays in L1 where it fits (L2 for larger K or a
//     32 KB L1) while every block of up to R rows of x runs over it (R = 12 with AVX-512's 32
//     registers, 6 with AVX2's 16): 2R float32 accumulators live in registers and each x value
//     (pair) is a broadcast;
//   - while a thread works on one panel it prefetches its next one into L2, so the DRAM stream
//     overlaps the arithmetic instead of stalling it;
//   - panels are split over threads once per call (static, no work queue); with many rows
//     (prefill) each thread takes the rows a chunk at a time, so the chunk stays in L2 while the
//     thread's panels pass over it.
// Each output is a sum over k in a fixed order that does not depend on M: a row gets the same
// result whatever else is in the batch. Where the CPU has AMX, bf16 runs on tiles instead
// (amx_panel.h), over the same packed panels, for every row count.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include "vector_math.h"
#endif
#include "amx_panel.h"

namespace {

#if defined(__AVX512F__)
#define SHARDSERVE_PANEL_KERNEL 1
constexpr int64_t kPanel = 32;    // output columns per panel: two 16-lane registers
constexpr int64_t kMaxRows = 12;  // rows of x per register block: 24 accumulators
#elif defined(__AVX2__) && defined(__FMA__)
#define SHARDSERVE_PANEL_KERNEL 1
constexpr int64_t kPanel = 16;    // two 8-lane registers
constexpr int64_t kMaxRows = 6;   // 12 accumulators, 2 weight vectors and a broadcast: 15 of 16 registers
#else
constexpr int64_t kPanel = 32;    // (no kernel: pack() and linear() refuse every dtype)
constexpr int64_t kMaxRows = 1;
#endif
constexpr int64_t kRowChunk = 8 * kMaxRows;  // rows a thread takes at a time (x's chunk stays in L2)
constexpr int64_t kMinThreadWork = 1 << 16;  // multiply-adds
#if defined(SHARDSERVE_AMX)
constexpr int64_t kBf16KAlign = amx::kStepK;  // bf16 weights padded in k to whole tile steps
#else
constexpr int64_t kBf16KAlign = 2;  // to whole pairs
#endif

// Threads only where each gets enough work to repay waking it (and its spinning afterwards,
// which on a small host takes cores from the server's other threads): tiny layers run serially.
inline int64_t panel_grain(int64_t m, int64_t k) {
  return std::max<int64_t>(1, kMinThreadWork / std::max<int64_t>(1, m * kPanel * k));
}

#if defined(__AVX512F__)
// One block of R rows against one panel, in float32 sums. Per step of the k loop: two 64-byte
// weight loads (32 columns x kw k values), one broadcast of each row's kw x values, two
// multiply-adds per row. bf16: kw = 2, the dot instruction sums the pair; float32: kw = 1.
template <typename T, int R>
inline void panel_rows(const T* x, int64_t ldx, const T* panel, int64_t ksteps, const float* bias, T* y,
                       int64_t ldy, int64_t cols, const T* prefetch) {
  constexpr int64_t kw = std::is_same_v<T, float> ? 1 : 2;
  __m512 acc[R][2];
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    acc[r][0] = b0;
    acc[r][1] = b1;
  }
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);  // one 32-bit lane: a float, or a bf16 pair
  const int64_t ldx_steps = ldx / kw;
  for (int64_t p = 0; p < ksteps; ++p) {
    const T* w = panel + p * kw * kPanel;
    const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + kw * kPanel / 2);
    // The next panel only as far as L2: a panel (36 KB at K = 576) fills a 32 KB L1 by itself, so
    // pulling the next one into L1 evicted the one the other row blocks still read. On a Zen 4
    // host (2026-12-04, 30 layers' weights streamed from DRAM): T0 -> T2 took a step's matmuls
    // from 13.7 to 8.8 ms at 8 rows, 26.4 to 24.0 ms at 32 (prefetching into L1 was no better
    // than no prefetch at all); T2 beat T1 by 5-12%.
    if (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + p * kw * kPanel), _MM_HINT_T2);
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + p * kw * kPanel + kw * kPanel / 2), _MM_HINT_T2);
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512i xb = _mm512_set1_epi32(xp[r * ldx_steps + p]);
      if constexpr (kw == 1) {
        acc[r][0] = _mm512_fmadd_ps(_mm512_castsi512_ps(xb), _mm512_castsi512_ps(w0), acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(_mm512_castsi512_ps(xb), _mm512_castsi512_ps(w1), acc[r][1]);
      } else {
#if defined(__AVX512BF16__)
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)xb, (__m512bh)w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)xb, (__m512bh)w1);
#endif
      }
    }
  }
  const __mmask16 m0 = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  for (int r = 0; r < R; ++r) {
    if constexpr (kw == 1) {
      _mm512_mask_storeu_ps(y + r * ldy, m0, acc[r][0]);
      _mm512_mask_storeu_ps(y + r * ldy + 16, m1, acc[r][1]);
    } else {
#if defined(__AVX512BF16__)
      // float32 -> bfloat16 rounds to nearest even, as torch's conversion does
      _mm256_mask_storeu_epi16(y + r * ldy, m0, (__m256i)_mm512_cvtneps_pbh(acc[r][0]));
      _mm256_mask_storeu_epi16(y + r * ldy + 16, m1, (__m256i)_mm512_cvtneps_pbh(acc[r][1]));
#endif
    }
  }
}

#elif defined(SHARDSERVE_PANEL_KERNEL)
// AVX2: one block of R rows against one 16-column panel. float32: per k, two 32-byte weight
// loads, one broadcast per row, two multiply-adds per row (each a single rounding, as AVX-512's).
// bfloat16 (kw = 2): per k pair, the same two loads hold both k values of the 16 columns; each
// is widened to float32 exactly (its bits moved up 16) and the pair's two products are added in
// k order, then the result is rounded to bf16 once, as torch rounds.
template <int R>
inline void panel_rows_bf16(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* panel, int64_t ksteps,
                            const float* bias, c10::BFloat16* y, int64_t ldy, int64_t cols,
                            const c10::BFloat16* prefetch) {
  __m256 acc[R][2];
  const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  for (int r = 0; r < R; ++r) {
    acc[r][0] = b0;
    acc[r][1] = b1;
  }
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);  // a bf16 pair per 32-bit lane
  const int64_t ldx_pairs = ldx / 2;
  for (int64_t p = 0; p < ksteps; ++p) {
    const c10::BFloat16* w = panel + p * 2 * kPanel;
    const __m256i raw0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256i raw1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kPanel));
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(prefetch + p * 2 * kPanel), _MM_HINT_T0);
    const __m256 even0 = _mm256_castsi256_ps(_mm256_slli_epi32(raw0, 16));
    const __m256 odd0 = _mm256_castsi256_ps(_mm256_and_si256(raw0, high));
    const __m256 even1 = _mm256_castsi256_ps(_mm256_slli_epi32(raw1, 16));
    const __m256 odd1 = _mm256_castsi256_ps(_mm256_and_si256(raw1, high));
    for (int r = 0; r < R; ++r) {
      const __m256i xb = _mm256_set1_epi32(xp[r * ldx_pairs + p]);
      const __m256 xe = _mm256_castsi256_ps(_mm256_slli_epi32(xb, 16));
      const __m256 xo = _mm256_castsi256_ps(_mm256_and_si256(xb, high));
      acc[r][0] = _mm256_fmadd_ps(xo, odd0, _mm256_fmadd_ps(xe, even0, acc[r][0]));
      acc[r][1] = _mm256_fmadd_ps(xo, odd1, _mm256_fmadd_ps(xe, even1, acc[r][1]));
    }
  }
  alignas(32) c10::BFloat16 out[kPanel];
  for (int r = 0; r < R; ++r) {
    if (cols == kPanel) {
      store8(y + r * ldy, acc[r][0]);
      store8(y + r * ldy + 8, acc[r][1]);
      continue;
    }
    store8(out, acc[r][0]);  // the last panel of a layer whose N is not a multiple of 16
    store8(out + 8, acc[r][1]);
    std::copy(out, out + cols, y + r * ldy);
  }
}

template <int R>
inline void panel_rows_float(const float* x, int64_t ldx, const float* panel, int64_t ksteps, const float* bias,
                             float* y, int64_t ldy, int64_t cols, const float* prefetch) {
  __m256 acc[R][2];
  const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    acc[r][0] = b0;
    acc[r][1] = b1;
  }
  for (int64_t p = 0; p < ksteps; ++p) {
    const float* w = panel + p * kPanel;
    const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(prefetch + p * kPanel), _MM_HINT_T0);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + p);
      acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
  if (cols == kPanel) {
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(y + r * ldy, acc[r][0]);
      _mm256_storeu_ps(y + r * ldy + 8, acc[r][1]);
    }
    return;
  }
  // the last panel of a layer whose N is not a multiple of 16: lanes below `cols` only
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cols)), lane);
  const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cols) - 8), lane);
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    _mm256_maskstore_ps(y + r * ldy, m0, acc[r][0]);
    _mm256_maskstore_ps(y + r * ldy + 8, m1, acc[r][1]);
  }
}

template <typename T, int R>
inline void panel_rows(const T* x, int64_t ldx, const T* panel, int64_t ksteps, const float* bias, T* y,
                       int64_t ldy, int64_t cols, const T* prefetch) {
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    panel_rows_bf16<R>(x, ldx, panel, ksteps, bias, y, ldy, cols, prefetch);
  else
    panel_rows_float<R>(x, ldx, panel, ksteps, bias, y, ldy, cols, prefetch);
}
#endif

// What a call computes from its output panels and how it writes them:
//   kStore       y [M, n] = x W^T (+ bias), in x's dtype;
//   kStoreFloat  the same values widened to float32 (a logits head: no conversion pass after);
//   kSiluMul     W = [gate | up] (2n rows, n a multiple of 32): y [M, n] = silu(gate) * up, the
//                SwiGLU of the two halves in the matmul's last pass over its output, the same
//                bits as linear() then silu_mul (each half rounded to x's dtype first, as stored);
//   kArgmax      each row's argmax over the kStoreFloat values, y [M] int64, as torch.argmax
//                answers it (the first index of the largest value, a NaN the largest): greedy
//                decoding's token without writing (and reading back) [M, vocab] float32 logits.
// A panel's output block goes straight to y (kStore) or through a block of x's dtype in L1.
enum class Epilogue { kStore, kStoreFloat, kSiluMul, kArgmax };

constexpr int64_t sources(Epilogue e) { return e == Epilogue::kSiluMul ? 2 : 1; }

#if defined(__AVX512F__)
// Writes one output block from its source blocks (rows x 32, 32 apart, in T): see Epilogue.
template <Epilogue E, typename T>
inline void finish_block(const T* const* parts, int64_t rows, int64_t cols, void* y, int64_t ldy) {
  static_assert(E != Epilogue::kStore, "kStore blocks are written in place");
  const __mmask16 m0 = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < 32; c += 16) {
      const __m512 a = load16(parts[0] + r * 32 + c);
      if constexpr (E == Epilogue::kStoreFloat) {
        _mm512_mask_storeu_ps(static_cast<float*>(y) + r * ldy + c, c ? m1 : m0, a);
      } else {  // kSiluMul: whole panels, no mask
        store16(static_cast<T*>(y) + r * ldy + c, silu_mul16<T>(a, load16(parts[1] + r * 32 + c)));
      }
    }
  }
}
#endif

// An epilogue's output: float32 for kStoreFloat, int64 [M] for kArgmax, x's dtype otherwise
inline at::Tensor output_for(Epilogue e, const at::Tensor& x, int64_t n) {
  if (e == Epilogue::kArgmax) return at::empty({x.size(0)}, x.options().dtype(at::kLong));
  return at::empty({x.size(0), n}, e == Epilogue::kStoreFloat ? x.options().dtype(at::kFloat) : x.options());
}

// kArgmax: a row's best (value, column) so far; column -1: none yet. Each thread keeps one per
// row over the panels it ran (in column order), and the threads' are merged after.
struct RowBest {
  float value = 0.f;
  int64_t col = -1;
};

// Whether (v, col) beats `b`: a NaN beats any number, then the larger value, then the earlier column
inline bool beats(float v, int64_t col, const RowBest& b) {
  if (b.col < 0) return true;
  const bool v_nan = std::isnan(v), b_nan = std::isnan(b.value);
  if (v_nan || b_nan) return v_nan && (!b_nan || col < b.col);
  return v > b.value || (v == b.value && col < b.col);
}

#if defined(__AVX512F__)
// kArgmax's step: rows of one output block (32 values each, 32 apart, columns col..col+cols) into
// best[0, rows). Columns only grow within a thread, so a tie keeps the value already held.
template <typename T>
inline void argmax_block(const T* part, int64_t rows, int64_t cols, int64_t col, RowBest* best) {
  const __mmask16 m0 = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  const __m512 lowest = _mm512_set1_ps(-INFINITY);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 a = load16(part + r * 32), b = load16(part + r * 32 + 16);
    const uint32_t nan = _mm512_mask_cmp_ps_mask(m0, a, a, _CMP_UNORD_Q) |
                         static_cast<uint32_t>(_mm512_mask_cmp_ps_mask(m1, b, b, _CMP_UNORD_Q)) << 16;
    RowBest& held = best[r];
    if (nan) {  // the block's first NaN
      const int64_t lane = __builtin_ctz(nan);
      if (beats(std::nanf(""), col + lane, held)) held = {std::nanf(""), col + lane};
      continue;
    }
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_blend_ps(m0, lowest, a),
                                                         _mm512_mask_blend_ps(m1, lowest, b)));
    if (held.col >= 0 && (std::isnan(held.value) || !(top > held.value))) continue;
    const __m512 t = _mm512_set1_ps(top);
    const uint32_t at = _mm512_mask_cmp_ps_mask(m0, a, t, _CMP_EQ_OQ) |
                        static_cast<uint32_t>(_mm512_mask_cmp_ps_mask(m1, b, t, _CMP_EQ_OQ)) << 16;
    held = {top, col + __builtin_ctz(at)};
  }
}
#endif

// kArgmax's result: per row, the best of the threads' (`threads` blocks of m RowBest)
inline void merge_argmax(const std::vector<RowBest>& bests, int64_t threads, int64_t m, at::Tensor& y) {
  int64_t* out = y.data_ptr<int64_t>();
  for (int64_t r = 0; r < m; ++r) {
    RowBest best;
    for (int64_t t = 0; t < threads; ++t) {
      const RowBest& c = bests[t * m + r];
      if (c.col >= 0 && beats(c.value, c.col, best)) best = c;
    }
    out[r] = std::max<int64_t>(best.col, 0);
  }
}

#if defined(SHARDSERVE_PANEL_KERNEL)
template <typename T>
using PanelRowsFn = void (*)(const T*, int64_t, const T*, int64_t, const float*, T*, int64_t, int64_t, const T*);

template <typename T, int... Rs>
constexpr std::array<PanelRowsFn<T>, sizeof...(Rs)> make_table(std::integer_sequence<int, Rs...>) {
  return {&panel_rows<T, Rs + 1>...};
}

// Output panels split over threads; for each chunk of rows a thread runs its panels in order, each
// panel's source panels (one, or gate then up) in turn, and prefetches the next source panel.
template <typename T, Epilogue E>
at::Tensor run_linear(const at::Tensor& x, const at::Tensor& packed, const float* bias, int64_t n) {
  static constexpr auto kTable = make_table<T>(std::make_integer_sequence<int, kMaxRows>{});
  constexpr int64_t S = sources(E);
  const int64_t m = x.size(0), ksteps = packed.size(1), kw = packed.size(3);
  auto y = output_for(E, x, n);
  const T* xd = x.data_ptr<T>();
  const T* wd = packed.data_ptr<T>();
  char* yd = static_cast<char*>(y.data_ptr());
  const int64_t ldx = x.size(1), panel_elems = ksteps * kw * kPanel, y_elem = y.element_size();
  const int64_t num_panels = (n + kPanel - 1) / kPanel, threads = at::get_num_threads();
  std::vector<RowBest> bests(E == Epilogue::kArgmax ? threads * m : 0);
  at::parallel_for(0, num_panels, panel_grain(m, S * ksteps * kw), [&](int64_t begin, int64_t end) {
    alignas(64) T scratch[S][kMaxRows * kPanel];
    RowBest* best = E == Epilogue::kArgmax ? &bests[at::get_thread_num() * m] : nullptr;
    for (int64_t chunk = 0; chunk < m; chunk += kRowChunk) {
      const int64_t chunk_end = std::min(m, chunk + kRowChunk);
      for (int64_t panel = begin; panel < end; ++panel) {
        const int64_t col = panel * kPanel, cols = std::min(kPanel, n - col);
        for (int64_t row = chunk; row < chunk_end; row += kMaxRows) {
          const int64_t rows = std::min(kMaxRows, chunk_end - row);
          for (int64_t s = 0; s < S; ++s) {
            const T* w = wd + (panel + s * num_panels) * panel_elems;
            // the first row block pulls the panel in and prefetches the next one
            const T* next = s + 1 < S ? wd + (panel + (s + 1) * num_panels) * panel_elems
                            : panel + 1 < end ? wd + (panel + 1) * panel_elems : nullptr;
            T* out = E == Epilogue::kStore ? reinterpret_cast<T*>(yd + (row * n + col) * y_elem) : scratch[s];
            kTable[rows - 1](xd + row * ldx, ldx, w, ksteps, bias ? bias + col : nullptr, out,
                             E == Epilogue::kStore ? n : kPanel, cols, row == chunk ? next : nullptr);
          }
#if defined(__AVX512F__)
          if constexpr (E == Epilogue::kArgmax) {
            argmax_block(scratch[0], rows, cols, col, best + row);
          } else if constexpr (E != Epilogue::kStore) {
            const T* parts[2] = {scratch[0], scratch[S - 1]};
            finish_block<E, T>(parts, rows, cols, yd + (row * n + col) * y_elem, n);
          }
#endif
        }
      }
    }
  });
  if constexpr (E == Epilogue::kArgmax) merge_argmax(bests, threads, m, y);
  return y;
}
#endif

#if defined(SHARDSERVE_AMX)
constexpr int64_t kAmxRowChunk = 4 * amx::kBlockRows;

// The same loops as run_linear with a block of 32 rows on tiles; each thread configures its own
// tiles (the tile state is per thread) and releases them when its share is done.
template <Epilogue E>
at::Tensor run_linear_amx(const at::Tensor& x, const at::Tensor& packed, const float* bias, int64_t n) {
  using T = c10::BFloat16;
  constexpr int64_t S = sources(E);
  const int64_t m = x.size(0), k = packed.size(1) * 2, ksteps = k / amx::kStepK;
  auto y = output_for(E, x, n);
  const T* xd = x.data_ptr<T>();
  const T* wd = packed.data_ptr<T>();
  char* yd = static_cast<char*>(y.data_ptr());
  const int64_t ldx = x.size(1), panel_elems = k * kPanel, y_elem = y.element_size();
  const int64_t num_panels = (n + kPanel - 1) / kPanel, threads = at::get_num_threads();
  std::vector<RowBest> bests(E == Epilogue::kArgmax ? threads * m : 0);
  at::parallel_for(0, num_panels, panel_grain(m, S * k), [&](int64_t begin, int64_t end) {
    alignas(64) T scratch[S][kAmxRowChunk * kPanel];  // a chunk's source blocks (unused by kStore)
    RowBest* best = E == Epilogue::kArgmax ? &bests[at::get_thread_num() * m] : nullptr;
    int64_t configured = 0;  // the block height the tiles are shaped for
    for (int64_t chunk = 0; chunk < m; chunk += kAmxRowChunk) {
      const int64_t chunk_end = std::min(m, chunk + kAmxRowChunk);
      // the chunk's blocks share the stream of the next panel (2 KB, 32 lines, per k step)
      const int64_t num_blocks = (chunk_end - chunk + amx::kBlockRows - 1) / amx::kBlockRows;
      const int64_t lines_per_step = (32 + num_blocks - 1) / num_blocks;
      for (int64_t panel = begin; panel < end; ++panel) {
        const int64_t col = panel * kPanel, cols = std::min(kPanel, n - col);
        for (int64_t s = 0; s < S; ++s) {
          const T* w = wd + (panel + s * num_panels) * panel_elems;
          const T* next_panel = s + 1 < S ? wd + (panel + (s + 1) * num_panels) * panel_elems
                                : panel + 1 < end ? wd + (panel + 1) * panel_elems : nullptr;
          const char* next = reinterpret_cast<const char*>(next_panel);
          for (int64_t row = chunk, i = 0; row < chunk_end; row += amx::kBlockRows, ++i) {
            const int64_t rows = std::min(amx::kBlockRows, chunk_end - row);
            const amx::Prefetch prefetch{next ? next + i * lines_per_step * ksteps * 64 : nullptr,
                                         next ? std::min(lines_per_step, 32 - i * lines_per_step) : 0, true};
            if constexpr (E == Epilogue::kStore) {
              amx::block(xd + row * ldx, ldx, w, ksteps, bias ? bias + col : nullptr,
                         reinterpret_cast<T*>(yd + (row * n + col) * y_elem), n, rows, cols, configured, prefetch);
            } else {  // each row block keeps its sources' blocks until its last source is done
              const int64_t at = (row - chunk) * kPanel;
              amx::block(xd + row * ldx, ldx, w, ksteps, bias ? bias + col : nullptr, scratch[s] + at, kPanel, rows,
                         cols, configured, prefetch);
              if constexpr (E == Epilogue::kArgmax) {
                argmax_block(scratch[0] + at, rows, cols, col, best + row);
              } else if (s + 1 == S) {
                const T* parts[2] = {scratch[0] + at, scratch[S - 1] + at};
                finish_block<E, T>(parts, rows, cols, yd + (row * n + col) * y_elem, n);
              }
            }
          }
        }
      }
    }
    _tile_release();
  });
  if constexpr (E == Epilogue::kArgmax) merge_argmax(bests, threads, m, y);
  return y;
}
#endif

}  // namespace

bool supported(at::ScalarType dtype) {
#if defined(__AVX512BF16__) || (defined(SHARDSERVE_PANEL_KERNEL) && !defined(__AVX512F__))
  if (dtype == at::kBFloat16) return true;
#endif
#if defined(SHARDSERVE_PANEL_KERNEL)
  if (dtype == at::kFloat) return true;
#endif
  return false;
}

// The k extent of a packed weight (and of x as the kernels read it) for `k` input features.
int64_t padded_k(at::ScalarType dtype, int64_t k) {
  const int64_t align = dtype == at::kBFloat16 ? kBf16KAlign : 1;
  return (k + align - 1) / align * align;
}

// W [N, K] -> panels [ceil(N/P)][K'/kw][P][kw], zero-padded (kw: 2 for bf16, 1 for float32;
// K' = padded_k(K): whole pairs, or whole AMX tile steps where the build has the AMX kernel).
at::Tensor pack(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && supported(weight.scalar_type()), "pack: weight must be 2-D bfloat16 or float32");
  const int64_t kw = weight.scalar_type() == at::kBFloat16 ? 2 : 1;
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t n_pad = (n + kPanel - 1) / kPanel * kPanel, k_pad = padded_k(weight.scalar_type(), k);
  auto padded = weight;  // a zero-padded copy only where needed: packing a large weight must not
  if (n_pad != n || k_pad != k) {  // hold three copies of it at once
    padded = at::zeros({n_pad, k_pad}, weight.options());
    padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  }
  return padded.view({n_pad / kPanel, kPanel, k_pad / kw, kw}).permute({0, 2, 1, 3}).contiguous();
}

template <Epilogue E>
at::Tensor dispatch(const at::Tensor& x, const at::Tensor& packed, const float* bias, int64_t n) {
#if defined(SHARDSERVE_PANEL_KERNEL)
  if (x.scalar_type() == at::kFloat)  // float32 is its own float32 form
    return run_linear<float, E == Epilogue::kStoreFloat ? Epilogue::kStore : E>(x, packed, bias, n);
#endif
#if defined(SHARDSERVE_AMX)
  if (amx::permitted()) return run_linear_amx<E>(x, packed, bias, n);
#endif
#if defined(__AVX512BF16__) || (defined(SHARDSERVE_PANEL_KERNEL) && !defined(__AVX512F__))
  return run_linear<c10::BFloat16, E>(x, packed, bias, n);
#endif
  TORCH_CHECK(false, "linear: this build has no kernel for this dtype");
}

// One call with any epilogue: the checks, the bias in float32 padded to whole panels (so the last
// panel's bias load stays in bounds), x padded in k to the packed weight's steps.
at::Tensor run(at::Tensor x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t n,
               Epilogue e) {
  TORCH_CHECK(x.dim() == 2 && supported(x.scalar_type()) && packed.scalar_type() == x.scalar_type(),
              "linear: x must be 2-D, of the packed weight's dtype");
  const int64_t k_pad = padded_k(x.scalar_type(), x.size(1));
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kPanel && packed.size(1) * packed.size(3) == k_pad,
              "linear: packed weight does not match x");
  TORCH_CHECK(packed.size(0) * kPanel >= sources(e) * n, "linear: packed weight has fewer than n rows");
  at::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    bias32 = at::zeros({packed.size(0) * kPanel}, x.options().dtype(at::kFloat));
    bias32.narrow(0, 0, n).copy_(*bias);
  }
  const float* b = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  x = x.contiguous();
  if (x.size(1) != k_pad) x = at::constant_pad_nd(x, {0, k_pad - x.size(1)});  // meets zero weights
  switch (e) {
    case Epilogue::kStore: return dispatch<Epilogue::kStore>(x, packed, b, n);
    case Epilogue::kStoreFloat: return dispatch<Epilogue::kStoreFloat>(x, packed, b, n);
    case Epilogue::kArgmax: return dispatch<Epilogue::kArgmax>(x, packed, b, n);
    default: return dispatch<Epilogue::kSiluMul>(x, packed, b, n);
  }
}

// Whether this build has the fused epilogues (linear_float for bf16, linear_silu_mul).
bool epilogues() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// x [M, K], packed from pack() (same dtype), bias [N] or None -> y [M, N].
at::Tensor linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias, int64_t n) {
  return run(x, packed, bias, n, Epilogue::kStore);
}

// linear(x, packed, bias, n) widened to float32 in the same pass.
at::Tensor linear_float(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias, int64_t n) {
  TORCH_CHECK(epilogues() || x.scalar_type() == at::kFloat, "linear_float: this build has no fused epilogue");
  return run(x, packed, bias, n, Epilogue::kStoreFloat);
}

// argmax(linear_float(x, packed, bias, n), dim=-1) -> int64 [M], without the [M, n] logits.
at::Tensor linear_argmax(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias, int64_t n) {
  TORCH_CHECK(epilogues(), "linear_argmax: this build has no fused epilogue");
  return run(x, packed, bias, n, Epilogue::kArgmax);
}

// packed from pack([gate; up]) with n rows each, n a multiple of 32 -> silu(x gate^T) * (x up^T),
// [M, n], the bits of linear() then silu_mul.
at::Tensor linear_silu_mul(at::Tensor x, at::Tensor packed, int64_t n) {
  TORCH_CHECK(epilogues(), "linear_silu_mul: this build has no fused epilogue");
  TORCH_CHECK(n % kPanel == 0 && packed.size(0) * kPanel == 2 * n, "linear_silu_mul: gate and up must be whole panels");
  return run(x, packed, c10::nullopt, n, Epilogue::kSiluMul);
}

// Registered as torch ops (not a pybind module: torch/extension.h alone took 24 s of each
// compile, ATen and the op registry 8 s). A torch op call lets go of the GIL, as a server
// running the engine in a thread beside its HTTP event loop needs.
TORCH_LIBRARY(shardserve_panel_linear, m) {
  m.def("supported(ScalarType dtype) -> bool", &supported);
  m.def("pack(Tensor weight) -> Tensor", &pack);
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor", &linear);
  m.def("epilogues() -> bool", &epilogues);
  m.def("linear_float(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor", &linear_float);
  m.def("linear_silu_mul(Tensor x, Tensor packed, int n) -> Tensor", &linear_silu_mul);
  m.def("linear_argmax(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor", &linear_argmax);
}
