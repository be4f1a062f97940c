// The scale of a span of values quantised symmetrically and the reciprocal its codes multiply by, as
// folio.models.quant_reference.symmetric_codes computes them: codes round(x * (limit / a)) within +-limit, in
// float64 (so that the codes are x * limit / a rounded once but where it lies within 2^-37 of a half), scale
// a / limit, a = max(amax, 2^-100); a zero span's codes are 0 and its scale 1. One division per span: a vdivps
// per 16 values was 40 % of an unrotated row's quantisation. (In float32 the reciprocal's own rounding moved the
// default model's int8 perplexity by up to 0.25 % with a change of one ulp: as much as the rounding noise of the
// scheme, so the codes are made as exact as a double allows instead.)
#pragma once

#include <algorithm>
#include <cmath>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

struct SpanScale {
  float scale;
  double inverse;
};

inline SpanScale span_scale(float amax, float limit) {
  if (amax == 0.f) return {1.f, 1.0};
  const float a = std::max(amax, 0x1p-100f);
  return {a / limit, static_cast<double>(limit) / static_cast<double>(a)};
}

// One value's code: x times the span's inverse in float64, rounded half to even, within +-limit.
inline int span_code(float x, double inverse, int limit) {
  return static_cast<int>(std::min<double>(limit, std::max<double>(-limit, std::nearbyint(x * inverse))));
}

#if defined(__AVX512F__)
// The same for 16 floats (vcvtpd2dq rounds half to even, MXCSR's default), as int32.
inline __m512i span_codes(__m512 x, __m512d inverse, __m512i limit) {
  const __m256i lo = _mm512_cvtpd_epi32(_mm512_mul_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(x)), inverse));
  const __m256i hi = _mm512_cvtpd_epi32(
      _mm512_mul_pd(_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1))), inverse));
  const __m512i c = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  return _mm512_min_epi32(limit, _mm512_max_epi32(_mm512_sub_epi32(_mm512_setzero_si512(), limit), c));
}

// span_codes' codes, decided from the float32 product x * inverse_f (inverse_f: the inverse rounded to float)
// where it lies clear of a half: that product is within 2 |x inverse| 2^-24 of the float64 one (two float
// roundings), which `margin` (limit 2^-22: twice that bound) exceeds, so the two round to the same integer.
// Only lanes within margin of a half (about one value in 10^4 for int8 codes) or NaN send the 16 to span_codes.
// (Rotated 1852 x 4864 bf16 rows: 1.05-1.1x the float64 codes throughout.)
inline __m512i span_codes_fast(__m512 x, __m512 inverse_f, __m512d inverse, __m512i limit, __m512 margin) {
  const __m512 p = _mm512_mul_ps(x, inverse_f);
  const __m512 r = _mm512_roundscale_ps(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 edge = _mm512_sub_ps(_mm512_set1_ps(0.5f), margin);
  if (_mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(p, r)), edge, _CMP_NLE_UQ)) return span_codes(x, inverse, limit);
  const __m512i c = _mm512_cvtps_epi32(r);
  return _mm512_min_epi32(limit, _mm512_max_epi32(_mm512_sub_epi32(_mm512_setzero_si512(), limit), c));
}
#endif
