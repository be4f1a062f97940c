// Rows of float32 activations as symmetric 16-bit codes, for the AVX2 kernels that multiply them with integer
// weights by vpmaddwd (cpu_int4_blocks.cpp, cpu_int8_blocks.cpp): 16 products summed exactly in int32 per
// instruction, where float32 took a conversion and an FMA per 8. The codes cost 2^-16 of the row's largest
// value, far below the weights' own rounding.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include "parallel.h"
#include "span_scale.h"
#include <immintrin.h>

#include <cstdint>
#include <vector>

namespace {

constexpr float INT16_CODE_MAX = 32639.f;  // quant_reference.INT16_CODE_MAX
constexpr int64_t PARALLEL_ROWS = 64;      // rows of x from which their preparation is spread over the threads

// For the kernels' step loops over these codes: unrolled early, so that GCC keeps the accumulator arrays in
// registers (without it two of the int4 kernel's eight were spilled to the stack: one row of a 3072 x 576 layer
// in cache 7.4 against 6.6 ns a step, Zen 3).
#define UNROLL _Pragma("GCC unroll 8")

// A row of x [K] (K a multiple of 16) as 16-bit codes into q [K], written by vector stores only (the kernels read
// the buffer back as 32-bit pairs: give it int32 storage); returns s_x. Bit for bit
// quant_reference.quantize_rows_int16: q = round(x * INT16_CODE_MAX / a) half to even, within +-INT16_CODE_MAX,
// s_x = a / INT16_CODE_MAX (span_scale.h).
inline float quantize_row_int16(const float* x, int64_t K, int16_t* q) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float a = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  const SpanScale ss = span_scale(a, INT16_CODE_MAX);
  const __m256d vinv = _mm256_set1_pd(ss.inverse);
  const __m256i lim = _mm256_set1_epi32(static_cast<int>(INT16_CODE_MAX)), neg = _mm256_set1_epi32(-static_cast<int>(INT16_CODE_MAX));
  for (int64_t k = 0; k < K; k += 16) {
    __m256i c[2];
    for (int i = 0; i < 2; ++i) {  // x * inverse in float64, rounded half to even (span_scale.h)
      const __m256 v = _mm256_loadu_ps(x + k + 8 * i);
      const __m128i lo = _mm256_cvtpd_epi32(_mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), vinv));
      const __m128i hi = _mm256_cvtpd_epi32(_mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)), vinv));
      c[i] = _mm256_max_epi32(neg, _mm256_min_epi32(lim, _mm256_set_m128i(hi, lo)));
    }
    // packs works within 128-bit lanes: (c0 lo, c1 lo, c0 hi, c1 hi), put back in order
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[1]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), packed);
  }
  return ss.scale;
}

// Every row of x [M, K] (row stride xs) as 16-bit codes: row m's codes as 32-bit pairs (k = 2p, 2p + 1 in lane p)
// at xq[m], its scale at sx[m]. Made once per call, before the kernels' parallel loop.
struct Int16Rows {
  std::vector<int32_t> pairs;
  std::vector<float> sx;
  std::vector<const int32_t*> xq;
  Int16Rows(const float* x, int64_t xs, int64_t M, int64_t K) : pairs(M * K / 2), sx(M), xq(M) {
    // spread over the threads for prefill-sized batches (a decode batch's few rows stay on this one)
    folio::parallel_for(0, M, PARALLEL_ROWS, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) {
        xq[m] = pairs.data() + m * K / 2;
        sx[m] = quantize_row_int16(x + m * xs, K, reinterpret_cast<int16_t*>(pairs.data() + m * K / 2));
      }
    });
  }
};

}  // namespace
#endif
