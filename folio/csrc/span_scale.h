// The scale of a span of values quantised symmetrically and the reciprocal its codes multiply by, as
// folio.models.quant_reference.symmetric_codes computes them: codes round(x * limit / a) within +-limit, scale
// a / limit, a = max(amax, 2^-100) (below it limit / a would overflow); a zero span's codes are 0 and its scale 1.
// One division per span: a vdivps per 16 values was a third of an int8 layer's time at decode sizes.
#pragma once

#include <algorithm>

struct SpanScale {
  float scale, inverse;
};

inline SpanScale span_scale(float amax, float limit) {
  if (amax == 0.f) return {1.f, 1.f};
  const float a = std::max(amax, 0x1p-100f);
  return {a / limit, limit / a};
}
