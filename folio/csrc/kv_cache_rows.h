// The rows of a paged KV cache as the CPU attention kernels read and write them (cpu_paged_attention.cpp writes
// and attends, cpu_flash_prefill.cpp reads): float32 and bf16 rows of values, or the 8-bit rows of
// folio.attention.kv_quant (D int8 codes or fp8 e4m3 bits, then the row's float32 scale).
#pragma once

#include <c10/util/Float8_e4m3fn.h>

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

}  // namespace
