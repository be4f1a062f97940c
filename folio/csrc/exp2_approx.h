// exp2_approx: the scalar 2^x of the kernels' softmax loops, written to vectorise (shared by
// cpu_flash_prefill.cpp and cpu_paged_attention.cpp; folio.csrc_build hashes this folder's headers into every
// kernel's build key).
#pragma once

#include <cstdint>
#include <cstring>

#include <algorithm>

// 2^x for x <= 0 (scores shifted by their running max; -inf gives 2^-126), to 2.5e-7 relative: a degree-5
// polynomial on the fraction (avx512_math.h's exp2_ps). Integer bit operations only, no float
// compare or conversion, so that the loops calling it vectorise under the default -ftrapping-math.
inline float exp2_approx(float x) {
  uint32_t xb;
  std::memcpy(&xb, &x, sizeof(xb));
  xb = std::min(xb, 0xC2FC0000u);  // for x <= 0 the bits grow with |x|: clamp at -126
  std::memcpy(&x, &xb, sizeof(x));
  const float t = x + 12582912.f;  // 1.5 * 2^23: round(x) lands in the low bits of t
  int32_t ti;
  std::memcpy(&ti, &t, sizeof(ti));
  const float f = x - (t - 12582912.f);  // |f| <= 1/2
  float p = 0.0013276268728077412f;
  p = p * f + 0.00967547856271267f;
  p = p * f + 0.05550713464617729f;
  p = p * f + 0.24022120237350464f;
  p = p * f + 0.6931469440460205f;
  p = p * f + 1.0000001192092896f;
  const int32_t bits = (ti - 0x4B400000 + 127) << 23;  // 2^round(x)
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}
