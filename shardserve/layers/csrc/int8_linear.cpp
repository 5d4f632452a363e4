// Weight-only int8 linear: y = x W^T (+ b) with W kept as int8 blocks of 32 inputs and one float
// scale per block (llama.cpp's Q8_0 blocks, packed by groups of 4 rows: see `Weight` below).
// Each row of x is quantized the same way when it arrives (per 32 inputs, scale = max|x| / 127,
// round to nearest), so a block's dot product is a sum of int8 x int8 products, exact in int32:
//
//     y[n, o] = sum_b  dx[n, b] * dw[o, b] * sum_{i < 32} xq[n, b, i] * wq[o, b, i]
//
// AVX512-VNNI's vpdpbusd multiplies unsigned by signed bytes, so x enters as xq + 128 and the
// extra 128 * sum_i wq[o, b, i] of each block is taken off after, through `cw` = dw * 128 * that
// sum (computed once, with the weight). Two blocks make one 512-bit dot; each weight block is
// loaded once for up to four rows of x. A row's result depends on that row alone: the same bits
// in any batch. Decode reads 1.06 bytes per weight instead of bfloat16's 2; output rows go to
// threads in chunks that stay in L1 while every row of x passes over them.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kRowsPerChunk = 16;  // 16 rows of 1,536 int8 inputs: 24 KiB, in L1 with x's rows
constexpr int64_t kXTile = 4;          // rows of x that share each weight block's load

// x row [in] (float or bfloat16) -> xq + 128 (uint8), scales [blocks]; zero padding past `in`.
template <typename T>
void quantize_row(const T* x, int64_t in, int64_t blocks, uint8_t* xu, float* dx) {
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t start = b * kBlock, stop = std::min(start + kBlock, in);
    float amax = 0.f;
    for (int64_t i = start; i < stop; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
    const float d = amax / 127.f;
    const float inv = d > 0.f ? 1.f / d : 0.f;
    dx[b] = d;
    for (int64_t i = start; i < start + kBlock; ++i) {
      const int q = i < stop ? static_cast<int>(std::nearbyint(static_cast<float>(x[i]) * inv)) : 0;
      xu[i] = static_cast<uint8_t>(std::max(-127, std::min(127, q)) + 128);
    }
  }
}

struct Rows {  // the quantized rows of x
  const uint8_t* xu;  // [N][in_pad]
  const float* dx;    // [N][blocks]
  const float* dxe;   // [N][blocks * 8]: dx with each scale repeated over the 8 lanes of its block
  int64_t in_pad, blocks;
};

// The weight, packed by groups of 4 output rows so that a group is one contiguous stream in the
// order the tile reads it (rows of 576 bytes, read side by side, were too short for the
// hardware prefetchers: 12 GB/s from memory against the bf16 panels' 30):
//     wq [groups][pairs][4 rows][64 bytes]   two blocks of one row per 64 bytes
//     dw [groups][pairs][4 rows][2]          their scales
//     cw [groups * 4][blocks]                dw * 128 * the block's sum of wq, row by row
struct Weight {
  const int8_t* wq;
  const float* dw;
  const float* cw;
  int64_t pairs;
};

#if defined(__AVX512VNNI__)
// y[n0 + t, 4 g + r] for t < NT, r < 4, without bias, into out[t * 4 + r]. Every (row of x, row
// of W) pair has its own accumulator: up to 16 independent dot chains in registers (the tile's
// sizes are compile-time), each weight block loaded once for all rows of x, each x block once
// for all rows of W.
template <int NT>
inline void dot_tile(const Rows& x, int64_t n0, const Weight& w, int64_t g, float* out) {
  constexpr int R = 4;
  __m512 acc[NT][R];
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
  const int8_t* wg = w.wq + g * w.pairs * R * 64;
  const float* dg = w.dw + g * w.pairs * R * 2;
  __m512i lanes[R];  // row r's two scales, each over the 8 lanes of its block
  for (int r = 0; r < R; ++r)
    lanes[r] = _mm512_set_epi32(2 * r + 1, 2 * r + 1, 2 * r + 1, 2 * r + 1, 2 * r + 1, 2 * r + 1, 2 * r + 1, 2 * r + 1,
                                2 * r, 2 * r, 2 * r, 2 * r, 2 * r, 2 * r, 2 * r, 2 * r);
  for (int64_t p = 0; p < w.pairs; ++p) {
    const __m512 scales = _mm512_castps256_ps512(_mm256_loadu_ps(dg + p * R * 2));
    __m512i wv[R];
    __m512 dwv[R];
    for (int r = 0; r < R; ++r) {
      wv[r] = _mm512_loadu_si512(wg + (p * R + r) * 64);
      dwv[r] = _mm512_permutexvar_ps(lanes[r], scales);
    }
    for (int t = 0; t < NT; ++t) {
      const __m512i xv = _mm512_loadu_si512(x.xu + (n0 + t) * x.in_pad + p * 64);
      const __m512 dxv = _mm512_loadu_ps(x.dxe + (n0 + t) * x.blocks * 8 + p * 16);
      for (int r = 0; r < R; ++r) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), xv, wv[r]);
        acc[t][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dxv, dwv[r]), acc[t][r]);
      }
    }
  }
  const int64_t blocks = x.blocks;
  for (int t = 0; t < NT; ++t) {
    const float* dx = x.dx + (n0 + t) * blocks;
    for (int r = 0; r < R; ++r) {
      const float* cw = w.cw + (g * R + r) * blocks;
      __m512 corr = _mm512_setzero_ps();
      for (int64_t b = 0; b < blocks; b += 16) {
        const __mmask16 m = blocks - b >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (blocks - b)) - 1);
        corr = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, dx + b), _mm512_maskz_loadu_ps(m, cw + b), corr);
      }
      out[t * R + r] = _mm512_reduce_add_ps(acc[t][r]) - _mm512_reduce_add_ps(corr);
    }
  }
}
#else
// a CPU without AVX512-VNNI: the same exact block dots, summed one block at a time
template <int NT>
inline void dot_tile(const Rows& x, int64_t n0, const Weight& w, int64_t g, float* out) {
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < 4; ++r) {
      const uint8_t* xu = x.xu + (n0 + t) * x.in_pad;
      const float* dx = x.dx + (n0 + t) * x.blocks;
      float acc = 0.f;
      for (int64_t b = 0; b < x.blocks; ++b) {
        const int64_t slot = (g * w.pairs + b / 2) * 4 + r;
        const int8_t* wb = w.wq + slot * 64 + (b % 2) * kBlock;
        int32_t dot = 0;
        for (int64_t i = 0; i < kBlock; ++i) dot += (static_cast<int32_t>(xu[b * kBlock + i]) - 128) * wb[i];
        acc += static_cast<float>(dot) * (dx[b] * w.dw[slot * 2 + b % 2]);
      }
      out[t * 4 + r] = acc;
    }
}
#endif

}  // namespace

// x and y in T (float or bfloat16): read and written in place of a conversion pass each, which
// with their allocations cost as much as a small layer's matmul at batch 1
template <typename T>
void run(const T* xp, int64_t n_rows, int64_t in, const Weight& w, const T* bp, int64_t out, T* yp) {
  const int64_t in_pad = w.pairs * 64, blocks = w.pairs * 2;
  std::vector<uint8_t> xu(n_rows * in_pad);
  std::vector<float> dx(n_rows * blocks), dxe(n_rows * blocks * 8);
  auto quantize = [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      quantize_row(xp + n * in, in, blocks, xu.data() + n * in_pad, dx.data() + n * blocks);
      for (int64_t b = 0; b < blocks; ++b)
        std::fill_n(dxe.data() + (n * blocks + b) * 8, 8, dx[n * blocks + b]);
    }
  };
  if (n_rows < 16) quantize(0, n_rows);  // waking the threads costs more than these rows
  else at::parallel_for(0, n_rows, 1, quantize);
  const Rows rows{xu.data(), dx.data(), dxe.data(), in_pad, blocks};
  const int64_t groups = (out + 3) / 4, groups_per_chunk = kRowsPerChunk / 4;
  at::parallel_for(0, (groups + groups_per_chunk - 1) / groups_per_chunk, 1, [&](int64_t begin, int64_t end) {
    float tile[kXTile * 4];
    for (int64_t ch = begin; ch < end; ++ch) {
      const int64_t g0 = ch * groups_per_chunk, g1 = std::min(groups, g0 + groups_per_chunk);
      for (int64_t n0 = 0; n0 < n_rows; n0 += kXTile) {
        const int64_t nt = std::min(kXTile, n_rows - n0);
        for (int64_t g = g0; g < g1; ++g) {
          switch (nt) {
            case 1: dot_tile<1>(rows, n0, w, g, tile); break;
            case 2: dot_tile<2>(rows, n0, w, g, tile); break;
            case 3: dot_tile<3>(rows, n0, w, g, tile); break;
            default: dot_tile<4>(rows, n0, w, g, tile);
          }
          const int64_t nr = std::min<int64_t>(4, out - 4 * g);  // rows past `out` are padding
          for (int64_t t = 0; t < nt; ++t)
            for (int64_t r = 0; r < nr; ++r) {
              const int64_t o = 4 * g + r;
              const float v = tile[t * 4 + r];
              yp[(n0 + t) * out + o] = static_cast<T>(bp ? v + static_cast<float>(bp[o]) : v);
            }
        }
      }
    }
  });
}

at::Tensor int8_linear(at::Tensor x, at::Tensor wq, at::Tensor dw, at::Tensor cw, c10::optional<at::Tensor> bias,
                       int64_t out_features) {
  TORCH_CHECK(x.dim() == 2, "int8_linear: x [N, in]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "int8_linear: x float32 or bfloat16");
  TORCH_CHECK(wq.dim() == 4 && wq.size(2) == 4 && wq.size(3) == 64 && dw.dim() == 4 && dw.size(3) == 2 &&
                  wq.scalar_type() == at::kChar && dw.scalar_type() == at::kFloat && cw.scalar_type() == at::kFloat &&
                  wq.is_contiguous() && dw.is_contiguous() && cw.is_contiguous(),
              "int8_linear: wq int8 [groups, pairs, 4, 64], dw float32 [groups, pairs, 4, 2], cw float32 "
              "[groups * 4, blocks], contiguous");
  const int64_t n_rows = x.size(0), in = x.size(1), out = out_features, groups = wq.size(0), pairs = wq.size(1);
  TORCH_CHECK(in <= pairs * 64 && pairs * 64 - in < 64 && out <= groups * 4 && groups * 4 - out < 4 &&
                  dw.size(0) == groups && dw.size(1) == pairs && cw.size(0) == groups * 4 && cw.size(1) == pairs * 2,
              "int8_linear: shapes do not match");
  const at::Tensor xc = x.contiguous();
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) bc = bias->to(x.scalar_type()).contiguous();
  at::Tensor y = at::empty({n_rows, out}, x.options());
  const Weight w{wq.data_ptr<int8_t>(), dw.data_ptr<float>(), cw.data_ptr<float>(), pairs};
  if (x.scalar_type() == at::kFloat)
    run<float>(xc.data_ptr<float>(), n_rows, in, w, bc.defined() ? bc.data_ptr<float>() : nullptr, out,
               y.data_ptr<float>());
  else
    run<c10::BFloat16>(xc.data_ptr<c10::BFloat16>(), n_rows, in, w,
                       bc.defined() ? bc.data_ptr<c10::BFloat16>() : nullptr, out, y.data_ptr<c10::BFloat16>());
  return y;
}

TORCH_LIBRARY(shardserve_int8_linear, m) {
  m.def("int8_linear(Tensor x, Tensor wq, Tensor dw, Tensor cw, Tensor? bias, int out_features) -> Tensor", &int8_linear);
}
