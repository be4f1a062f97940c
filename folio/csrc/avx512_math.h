// The AVX-512 versions of the softmax's functions, shared by the kernels that attend (cpu_paged_attention.cpp,
// cpu_flash_prefill.cpp): 2^x of the scores shifted by their running max, tanh for soft-capped scores, and the
// 16 x 16 transpose of words that lays out bf16 pairs for the tiles.
// (folio.csrc_build hashes this folder's headers into every kernel's build key.)
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

// 2^x for scores shifted by their running max (x at most a few units; -inf gives 0): 2^round(x) times a polynomial
// in the fraction f, |f| <= 1/2, with coefficients c[0] + c[1] f + ... (Horner's rule, unrolled: N is constant).
template <int N>
inline __m512 exp2_polynomial_ps(__m512 x, const float (&c)[N]) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-200.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(c[N - 1]);
  for (int i = N - 2; i >= 0; --i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
  return _mm512_scalef_ps(p, n);
}

// A degree-5 polynomial (fitted near-minimax on [-1/2, 1/2]) gives 2^f to a relative 1.5e-7, about one float32
// rounding.
inline __m512 exp2_ps(__m512 x) {
  static constexpr float C[] = {1.0000001192092896f, 0.6931469440460205f, 0.24022120237350464f,
                                0.05550713464617729f, 0.00967547856271267f, 0.0013276268728077412f};
  return exp2_polynomial_ps(x, C);
}

// tanh to a few float32 ulps: Eigen's rational approximation (generic_fast_tanh_float), odd numerator of
// degree 13 over an even denominator of degree 6 on x clamped to [-7.9988, 7.9988]; x itself when |x| < 4e-4.
inline __m512 tanh_ps(__m512 a) {
  const __m512 x = _mm512_max_ps(_mm512_min_ps(a, _mm512_set1_ps(7.99881172180175781f)),
                                 _mm512_set1_ps(-7.99881172180175781f));
  const __m512 x2 = _mm512_mul_ps(x, x);
  __m512 p = _mm512_set1_ps(-2.76076847742355e-16f);
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(2.00018790482477e-13f));
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-8.60467152213735e-11f));
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(5.12229709037114e-08f));
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(1.48572235717979e-05f));
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(6.37261928875436e-04f));
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(4.89352455891786e-03f));
  p = _mm512_mul_ps(p, x);
  __m512 q = _mm512_set1_ps(1.19825839466702e-06f);
  q = _mm512_fmadd_ps(q, x2, _mm512_set1_ps(1.18534705686654e-04f));
  q = _mm512_fmadd_ps(q, x2, _mm512_set1_ps(2.26843463243900e-03f));
  q = _mm512_fmadd_ps(q, x2, _mm512_set1_ps(4.89352518554385e-03f));
  const __mmask16 tiny = _mm512_cmp_ps_mask(_mm512_abs_ps(a), _mm512_set1_ps(0.0004f), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(tiny, _mm512_div_ps(p, q), a);
}

// rows[k] = the k-th 32-bit word of each of the 16 rows given (a 16 x 16 transpose of words)
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
  }
}

}  // namespace
#endif
