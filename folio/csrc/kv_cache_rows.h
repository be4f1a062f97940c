// The rows of a paged KV cache as the CPU attention kernels read and write them (cpu_paged_attention.cpp writes
// and attends, cpu_flash_prefill.cpp reads): float32 and bf16 rows of values, or the 8-bit rows of
// folio.attention.kv_quant (D int8 codes or fp8 e4m3 bits, then the row's float32 scale).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// How a cache of element type C stores a row: Cache<C>::value(row[c]) * Cache<C>::scale(row, D) is its c-th
// value. float32 and bf16 caches hold values; int8 and uint8 (fp8 e4m3 bits) ones codes and a scale.
template <typename C>
struct Cache {
  static constexpr bool QUANTIZED = false;
  static constexpr int SCALE_BYTES = 0;
  static float value(C x) { return static_cast<float>(x); }
  static float scale(const C*, int) { return 1.f; }
};
template <typename C>
struct QuantizedCache {
  static constexpr bool QUANTIZED = true;
  static constexpr int SCALE_BYTES = 4;
  static float scale(const C* row, int D) {
    float s;
    std::memcpy(&s, row + D, sizeof(float));
    return s;
  }
  static void store_scale(C* row, int D, float s) { std::memcpy(row + D, &s, sizeof(float)); }
};
template <>
struct Cache<int8_t> : QuantizedCache<int8_t> {
  static constexpr float MAX = 127.f;
  static float value(int8_t x) { return static_cast<float>(x); }
  static int8_t encode(float x) { return static_cast<int8_t>(std::min(MAX, std::max(-MAX, std::nearbyint(x)))); }
};
// the float of every fp8 e4m3 code, filled as the library loads (no initialisation guard in the read loops)
const std::array<float, 256> FP8_E4M3_VALUES = [] {
  std::array<float, 256> v{};
  for (int i = 0; i < 256; ++i)
    v[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
  return v;
}();
template <>
struct Cache<uint8_t> : QuantizedCache<uint8_t> {
  static constexpr float MAX = 448.f;
  static float value(uint8_t x) { return FP8_E4M3_VALUES[x]; }
  static uint8_t encode(float x) { return c10::Float8_e4m3fn(x).x; }  // round to nearest even, as torch
};

#if defined(__AVX512BF16__)
// The 32 * chunks codes of an 8-bit row as the bf16 of their values, exactly (an int8 code or an e4m3 value has
// at most 8 significant bits and bf16's exponent range), for the kernels that multiply bf16 operands: the row's
// scale is applied to the scores and probabilities. int8: through float32, 16 codes a conversion.
inline void exact_codes(const int8_t* row, c10::BFloat16* dst, int chunks) {
  auto f = [](const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  };
  for (int c = 0; c < chunks; ++c)
    _mm512_storeu_si512(dst + 32 * c, (__m512i)_mm512_cvtne2ps_pbh(f(row + 32 * c + 16), f(row + 32 * c)));
}

// The bf16 bits of the e4m3 values with the sign bit clear (codes 0 .. 127; 127, e4m3's NaN, is never written).
alignas(64) const std::array<uint16_t, 128> FP8_E4M3_BF16 = [] {
  std::array<uint16_t, 128> v{};
  for (int i = 0; i < 128; ++i) v[i] = c10::BFloat16(FP8_E4M3_VALUES[i]).x;
  return v;
}();

// fp8 e4m3: 32 codes a step, each code's 7 bits of magnitude looked up in FP8_E4M3_BF16 (two 64-entry word
// permutes, bit 6 choosing between them), its sign bit moved to bf16's.
inline void exact_codes(const uint8_t* row, c10::BFloat16* dst, int chunks) {
  const __m512i t0 = _mm512_load_si512(FP8_E4M3_BF16.data()), t1 = _mm512_load_si512(FP8_E4M3_BF16.data() + 32),
                t2 = _mm512_load_si512(FP8_E4M3_BF16.data() + 64), t3 = _mm512_load_si512(FP8_E4M3_BF16.data() + 96);
  for (int c = 0; c < chunks; ++c) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * c)));
    const __m512i low = _mm512_permutex2var_epi16(t0, w, t1), high = _mm512_permutex2var_epi16(t2, w, t3);
    const __m512i mag = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(w, _mm512_set1_epi16(0x40)), low, high);
    const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8);
    _mm512_storeu_si512(dst + 32 * c, _mm512_or_si512(mag, sign));
  }
}
#endif

}  // namespace
