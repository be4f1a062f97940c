// bf16 rounding as ATen does it, and bf16 SiLU-and-mul's vector step, shared by the fused elementwise ops
// (cpu_fused_ops.cpp: every rounding, and silu_and_mul) and the W8A8 epilogue that fuses SiLU-and-mul into a gated
// MLP's gate/up product (cpu_quant_linear.cpp): 16 outputs rnd(table[gate] * up) from the gates' bf16 bits,
// looked up in the op's table of every bf16 gate's rounded silu (which cpu_fused_ops.cpp builds and hands out),
// so the fused results are the op's bit for bit.
// (folio.csrc_build hashes this folder's headers into every kernel's build key.)
#pragma once

#include <cstdint>

namespace folio {

// The op's table: the rounded silu of every bf16 value, one uint16 each, padded by 16 entries; handed out as int32
constexpr int64_t SILU_TABLE_ENTRIES = 65536 + 16;
constexpr int64_t SILU_TABLE_INTS = SILU_TABLE_ENTRIES / 2;

}  // namespace folio

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace folio {

// float32 to bf16, round to nearest even, NaN to 0xffff: ATen's AVX-512 cvtfp32_bf16, which eager bf16 ops use
// (vcvtneps2bf16 where the 16 values are all finite normals, infinities or zeros: it rounds as this does, but it
// reads float32 denormals as zero and quiets a NaN's payload; 3 instructions for the integer rounding's 8, which
// made RMSNorm 1.13-1.19x and SiLU-and-mul 1.04-1.16x faster on an Emerald Rapids Xeon)
inline __m256i round_bf16_aten(__m512 f) {
#if defined(__AVX512BF16__)
  if (!_mm512_fpclass_ps_mask(f, 0xA1))  // 0x01 quiet NaN, 0x20 denormal, 0x80 signalling NaN
    return (__m256i)_mm512_cvtneps_pbh(f);
#endif
  const __m512i v = _mm512_castps_si512(f);
  __m512i t = _mm512_and_si512(_mm512_srli_epi32(v, 16), _mm512_set1_epi32(1));
  t = _mm512_add_epi32(_mm512_add_epi32(t, _mm512_set1_epi32(0x7fff)), v);
  t = _mm512_srli_epi32(t, 16);
  t = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(f, f, _CMP_ORD_Q), _mm512_set1_epi32(0xffff), t);
  return _mm512_cvtusepi32_epi16(t);
}

// rnd(silu(g) rounded * up) for 16 gates given as their bf16 bits (zero-extended to 32) and ups as floats;
// `table` holds the rounded silu of every bf16 value, one uint16 each, padded by one entry (the gather reads
// four bytes at each: the entry is their low half)
inline __m256i silu_times_up(const int* table, __m512i gate_bits, __m512 up) {
  const __m512 silu = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_i32gather_epi32(gate_bits, table, 2), 16));
  return round_bf16_aten(_mm512_mul_ps(silu, up));
}

#if defined(__AVX512BF16__)
// silu_times_up of 16 outputs from a product's float32 sums of their gates and ups, each rounded to bf16 as the
// product's epilogue stores it (vcvtneps2bf16): an epilogue that fuses the op gives the op's results over the
// product it would have written
inline __m256i silu_times_up_of_sums(const int* table, __m512 gate, __m512 up) {
  const __m512i gate_bits = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(gate));
  const __m512i up_bits = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(up));
  return silu_times_up(table, gate_bits, _mm512_castsi512_ps(_mm512_slli_epi32(up_bits, 16)));
}
#endif

}  // namespace folio
#endif
