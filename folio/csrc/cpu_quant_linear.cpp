// Linear layers with quantised weights on the CPU: y = x W^T (+ b) where W is stored in 8 or 4 bits.
//
// Weight formats (folio.models.int8_linear, folio.models.int4_linear quantise into them):
//   int8: q int8 [N, K], scales float32 [N, K / G]: W[n, k] = q[n, k] * scales[n, k / G]. G = K is one scale per
//         output channel; G = 32 is GGUF's Q8_0.
//   int4: packed uint8 [N, K / 2] and scales, offsets float32 [N, K / G]: W[n, k] = q * scales + offsets with
//         q in [0, 15]; each 32 values of a row are 16 bytes, byte j holding value j in its low nibble and
//         value j + 16 in its high one (llama.cpp's Q4_0 order, so a 16-byte load yields 32 values by two
//         shifts).
//   K and G are multiples of 32 and G divides K.
//
// Two ways to multiply:
//   weight_only_linear (W8A16, W4A16): x stays in floating point. Each weight vector is widened to float32
//     once and multiplied with up to MAX_MR rows of x by FMAs; per group the sum is scaled (and for int4
//     the offset times the group's sum of x is added, sum_k x_k (s q_k + o) = s x.q + o sum x). Decode of
//     a few sequences is a read of W, so 8 bits read twice and 4 bits four times as fast as bf16.
//   w4a8_linear: int4 weights times x quantised to int8 per block of 32 values (a symmetric scale each, as
//     llama.cpp's Q8_0), the 4-bit x 8-bit products summed in int32 per block exactly (vpmaddubsw +
//     vpmaddwd: the weight's nibbles are the unsigned operand), then scaled by the block's x scale and the
//     group's weight scale in float32; the offsets multiply x's exact float group sums as above. Widening
//     4 bits to float32 made the weight-only kernel compute-bound on AVX2 (1.3x float32's speed at 5.3x
//     fewer bytes); here one multiply-add instruction does 32 products.
//   w8a8_linear: x is quantised per row (token) to int8 with a dynamic symmetric scale, and int8 x int8
//     products are summed in int32, exactly: y = float(acc) * (sx[m] * sw[n]) + b[n], the same float32
//     operations as the torch reference, so results are equal bit for bit. Products use the sign trick
//     (|x| unsigned times w with x's sign): vpmaddubsw + vpmaddwd on AVX2 and AVX512-BW, vpdpbusd with
//     AVX512-VNNI. Four times the multiply-adds per instruction of float32 FMAs: for prefill and large batches.
//     With `rotate`, each block of x's values (the largest power of two dividing K) is first multiplied by the
//     Walsh-Hadamard matrix of that order (the layer's
//     weight was rotated likewise when it was quantised, folio.models.int8_linear): an outlier channel then
//     spreads over its block instead of setting the whole row's scale.
//   quantize_rows_unsigned and scale_rows: the two ends of a W8A8 matmul run by oneDNN's int8 GEMM
//     (folio.models.onednn_int8), which takes an unsigned source on VNNI.
//   w8_int16_packed_linear (AVX512-VNNI): x quantised per row to 16-bit codes q = 256 h + l, h and l signed
//     bytes (l in [-128, 127], |q| <= 32639 so that h is one too), each byte times int8 W summed in int32
//     exactly by the W8A8 kernel's vpdpbusd, twice: y = (256 float(sum h w) + float(sum l w)) * (sx sw) + b.
//     As accurate as bf16 activations (15 bits per row against bf16's 8 per value), at W8A8's cost where
//     memory bounds it. quantize_rows_int16_bytes gives oneDNN's int8 GEMM the same two bytes (+ 128).
//
// Instruction sets: each kernel is one template over a vector type (Scalar, Avx2, Avx512); every one this
// build's -march=native has is compiled, and `isas()` lists them, best last, so tests run each one here.
// Sums run in different orders per ISA: weight-only results differ in float32 rounding only.
#include "amx_tiles.h"
#include "bf16_silu_and_mul.h"
#include "parallel.h"
#include "span_scale.h"
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#define FOLIO_AVX2 1
#include <immintrin.h>
#else
#define FOLIO_AVX2 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define FOLIO_AVX512 1
#else
#define FOLIO_AVX512 0
#endif

namespace {

enum Isa : int { SCALAR = 0, AVX2 = 1, AVX512 = 2 };
constexpr int BLOCK = 32;  // values per int4 block; K and G are multiples of it
constexpr int MAX_MR = 4;  // rows of x per pass over a weight row (accumulators in registers)
constexpr int64_t MIN_BYTES_PER_TASK = 16384;  // of weights: one sequential stream per thread
// Values of x or y per task of the row quantiser and the scaling epilogue (about ten microseconds of work): a
// batch of a few rows is done inline, a decode batch of tens of rows on both threads. With libgomp's default
// wait policy the threads spin between the step's regions, and a 62-row decode step of the 0.5B Qwen2 in `int8`
// on an Emerald Rapids Xeon took 1.2-1.7 % less time than with the rows inline (1 << 17 values a task: 62 x 896
// rows quantised on one thread, 19 us each), steps alternating in one engine. Where the threads sleep between
// regions (OMP_WAIT_POLICY=PASSIVE) a region costs more than such work: the quantisers and epilogues of a decode
// step in parallel regions took 5.8 and 7.3 ms there, against 1.4 and 2.9 ms inline.
constexpr int64_t MIN_VALUES_PER_TASK = 1 << 15;

// ---------------------------------------------------------------------------------------- vector types
struct Scalar {
  using F = float;
  using I = int32_t;
  static constexpr int W = 1;   // float lanes
  static constexpr int IB = 1;  // int8 values per integer step
  static F zero() { return 0.f; }
  static F set1(float v) { return v; }
  static F load(const float* p) { return *p; }
  static void store(float* p, F v) { *p = v; }
  static F add(F a, F b) { return a + b; }
  static F fma(F a, F b, F c) { return a * b + c; }
  static F mul(F a, F b) { return a * b; }
  static float hsum(F a) { return a; }
  static void i8_block(const int8_t* p, F* out) {
    for (int j = 0; j < BLOCK; ++j) out[j] = static_cast<float>(p[j]);
  }
  static void u4_block(const uint8_t* p, F* out) {
    for (int j = 0; j < BLOCK / 2; ++j) {
      out[j] = static_cast<float>(p[j] & 15);
      out[j + BLOCK / 2] = static_cast<float>(p[j] >> 4);
    }
  }
  static I izero() { return 0; }
  static I idot(I acc, const int8_t* xa, const int8_t* xq, const int8_t* w) {
    return acc + (*xq < 0 ? -*w : *w) * *xa;
  }
  static int32_t ihsum(I a) { return a; }
  // an int4 block of 32 values (16 bytes, see above) ready for u4dot, and its sum of products with int8 x
  using Q = const uint8_t*;
  static Q u4load(const uint8_t* w) { return w; }
  static I u4dot(Q w, const int8_t* x) {
    int32_t acc = 0;
    for (int j = 0; j < BLOCK / 2; ++j) acc += (w[j] & 15) * x[j] + (w[j] >> 4) * x[j + BLOCK / 2];
    return acc;
  }
  // the float sums of W consecutive blocks' products (one block here) for MR rows of x, ldx apart; the
  // weight blocks are unpacked once for all rows
  template <int MR>
  static void u4dots(const uint8_t* w, const int8_t* x, int64_t ldx, F* out) {
    for (int i = 0; i < MR; ++i) out[i] = static_cast<float>(u4dot(w, x + i * ldx));
  }
};

#if FOLIO_AVX2
struct Avx2 {
  using F = __m256;
  using I = __m256i;
  static constexpr int W = 8;
  static constexpr int IB = 32;
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static float hsum(F a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static void i8_block(const int8_t* p, F* out) {
    for (int j = 0; j < 4; ++j)
      out[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * j))));
  }
  static void u4_block(const uint8_t* p, F* out) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i lo = _mm_and_si128(v, _mm_set1_epi8(15)), hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(15));
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    out[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    out[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  }
  static I izero() { return _mm256_setzero_si256(); }
  // acc (8 x int32) += |x| * (w with x's sign), 32 products summed by fours; |x|, |w| <= 127 cannot saturate
  static I idot(I acc, const int8_t* xa, const int8_t* xq, const int8_t* w) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xa));
    const __m256i s = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)),
                                       _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, s), _mm256_set1_epi16(1)));
  }
  static int32_t ihsum(I a) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
  }
  // an int4 block of 32 values as 32 bytes in x's order: the 16 bytes in both 128-bit lanes, the high lane
  // shifted right by 4, so the low lane holds values 0..15 (low nibbles) and the high one 16..31
  using Q = __m256i;
  static Q u4load(const uint8_t* w) {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    return _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(15));
  }
  // 8 partial int32 sums of a block's products with 32 int8 values of x (the nibbles are the unsigned
  // operand; |sum of a pair| <= 2 * 15 * 128: no saturation)
  static I u4dot(Q q, const int8_t* x) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, xv);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), _mm256_set1_epi16(1));
#endif
  }
  // The sums of 8 blocks' partial sums, one block per lane: two rounds of hadd leave blocks 0-3 (s0123) and
  // 4-7 (s4567) with their first and second halves in the low and high 128-bit lanes, which one add joins.
  static F block_sums(const I* s) {
    const __m256i s0123 = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
    const __m256i s4567 = _mm256_hadd_epi32(_mm256_hadd_epi32(s[4], s[5]), _mm256_hadd_epi32(s[6], s[7]));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_permute2x128_si256(s0123, s4567, 0x20),
                                               _mm256_permute2x128_si256(s0123, s4567, 0x31)));
  }
  template <int MR>
  static void u4dots(const uint8_t* w, const int8_t* x, int64_t ldx, F* out) {
    I s[MR][W];
    for (int j = 0; j < W; ++j) {
      const Q q = u4load(w + j * (BLOCK / 2));
      for (int i = 0; i < MR; ++i) s[i][j] = u4dot(q, x + i * ldx + j * BLOCK);
    }
    for (int i = 0; i < MR; ++i) out[i] = block_sums(s[i]);
  }
};
#endif

#if FOLIO_AVX512
struct Avx512 {
  using F = __m512;
  using I = __m512i;
  static constexpr int W = 16;
  static constexpr int IB = 64;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static float hsum(F a) { return _mm512_reduce_add_ps(a); }
  static void i8_block(const int8_t* p, F* out) {
    for (int j = 0; j < 2; ++j)
      out[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * j))));
  }
  static void u4_block(const uint8_t* p, F* out) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, _mm_set1_epi8(15))));
    out[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(15))));
  }
  static I izero() { return _mm512_setzero_si512(); }
  static I idot(I acc, const int8_t* xa, const int8_t* xq, const int8_t* w) {
    const __m512i a = _mm512_loadu_si512(xa);
    const __m512i wv = _mm512_loadu_si512(w);
    const __m512i s = _mm512_mask_sub_epi8(wv, _mm512_movepi8_mask(_mm512_loadu_si512(xq)), _mm512_setzero_si512(), wv);
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, a, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(a, s), _mm512_set1_epi16(1)));
#endif
  }
  static int32_t ihsum(I a) { return _mm512_reduce_add_epi32(a); }
};
#endif

// sum_k a[k] b[k] over n floats: V::W at a time, then one by one
template <class V>
float dot(const float* a, const float* b, int64_t n) {
  typename V::F acc = V::zero();
  int64_t k = 0;
  for (; k + V::W <= n; k += V::W) acc = V::fma(V::load(a + k), V::load(b + k), acc);
  float v = V::hsum(acc);
  for (; k < n; ++k) v += a[k] * b[k];
  return v;
}

// ------------------------------------------------------------------------------------- weight formats
// Fmt::block<V>(row, k, out): W[n, k .. k + 32) as BLOCK / V::W float vectors (before scales), k % 32 == 0.
struct Int8Fmt {
  static int64_t row_bytes(int64_t K) { return K; }
  template <class V>
  static void block(const uint8_t* row, int64_t k, typename V::F* out) {
    V::i8_block(reinterpret_cast<const int8_t*>(row) + k, out);
  }
};
struct Int4Fmt {
  static int64_t row_bytes(int64_t K) { return K / 2; }
  template <class V>
  static void block(const uint8_t* row, int64_t k, typename V::F* out) { V::u4_block(row + k / 2, out); }
};

// --------------------------------------------------------------------------------------- weight-only
struct WeightOnly {
  const float* x;        // [M, K] float32
  const uint8_t* w;      // [N, row_bytes]
  const float* scales;   // [N, ng]
  const float* offsets;  // [N, ng] or null (int8)
  const float* xsum;     // [M, ng]: sums of x per group, when offsets
  const float* bias;     // [N] or null
  float* y;              // [M, N]
  int64_t M, N, K, G, ng, row_bytes;
};

// Column n of rows m0 .. m0 + MR of y from a row of W, given group_dot(g, dst): dst[i] += the scaled dot
// product of group g with row m0 + i of x. Each group's scaled sum is one FMA into the row's total; with groups
// of 32 that FMA chain is the critical path, so TOT totals take consecutive groups in turn. Then the offsets
// times x's group sums (a vector dot: a scalar chain of K / 32 FMAs bounded the int4 kernels at 13 GB/s) and
// the bias. (Indices into the accumulator arrays are compile-time constants, so they stay in registers.)
template <class V, int MR, class GroupDot>
void weight_only_column(const WeightOnly& a, int64_t m0, int64_t n, const GroupDot& group_dot) {
  using F = typename V::F;
  constexpr int TOT = MR == 1 ? 4 : 2;
  F tot[TOT][MR];
  for (int t = 0; t < TOT; ++t)
    for (int i = 0; i < MR; ++i) tot[t][i] = V::zero();
  int64_t g = 0;
  for (; g + TOT <= a.ng; g += TOT)
    for (int t = 0; t < TOT; ++t) group_dot(g + t, tot[t]);
  for (; g < a.ng; ++g) group_dot(g, tot[0]);
  for (int i = 0; i < MR; ++i) {
    for (int t = 1; t < TOT; ++t) tot[0][i] = V::add(tot[0][i], tot[t][i]);
    float v = V::hsum(tot[0][i]);
    if (a.offsets) v += dot<V>(a.offsets + n * a.ng, a.xsum + (m0 + i) * a.ng, a.ng);
    a.y[(m0 + i) * a.N + n] = a.bias ? v + a.bias[n] : v;
  }
}

// Rows m0 .. m0 + MR of y, columns n0 .. n1, x float32. CH independent accumulator chains per row hide FMA
// latency inside a group.
template <class V, class Fmt, int MR>
void weight_only_tile(const WeightOnly& a, int64_t m0, int64_t n0, int64_t n1) {
  using F = typename V::F;
  constexpr int SUB = BLOCK / V::W;  // vectors per block of 32
  constexpr int CH = std::max(1, std::min(SUB, 4 / MR));
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = a.w + n * a.row_bytes;
    weight_only_column<V, MR>(a, m0, n, [&](int64_t g, F (&dst)[MR]) {
      F acc[MR][CH];
      for (int i = 0; i < MR; ++i)
        for (int c = 0; c < CH; ++c) acc[i][c] = V::zero();
      for (int64_t kb = g * a.G; kb < (g + 1) * a.G; kb += BLOCK) {
        F wv[SUB];
        Fmt::template block<V>(row, kb, wv);
        for (int j = 0; j < SUB; ++j)
          for (int i = 0; i < MR; ++i)
            acc[i][j % CH] = V::fma(V::load(a.x + (m0 + i) * a.K + kb + j * V::W), wv[j], acc[i][j % CH]);
      }
      const F s = V::set1(a.scales[n * a.ng + g]);
      for (int i = 0; i < MR; ++i)
        for (int c = 0; c < CH; ++c) dst[i] = V::fma(acc[i][c], s, dst[i]);
    });
  }
}

#if FOLIO_AVX512 && defined(__AVX512BF16__)
// int8 weight-only with bf16 x on AVX512-BF16: the codes are exact in bf16 (-127..127), so each block of 32
// values is one vdpbf16ps with x's 32 bf16 values (products exact, sums in float32), where the float32 path
// widens both to float32 and takes two FMAs per 16. (int4 with bf16 x has its own kernel on column blocks,
// folio/csrc/cpu_int4_blocks.cpp; a row-major int4 weight takes the float32 path.)
inline __m512bh int8_block_bf16(const uint8_t* row, int64_t k) {
  const int8_t* p = reinterpret_cast<const int8_t*>(row) + k;
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);  // lo -> values 0..15, hi -> 16..31
}

// weight_only_tile for int8 with x bf16 [M, K]: CH chains of vdpbf16ps per row inside a group.
template <int MR>
void weight_only_bf16_tile(const WeightOnly& a, const at::BFloat16* x, int64_t m0, int64_t n0, int64_t n1) {
  constexpr int CH = MR == 1 ? 4 : MR == 2 ? 2 : 1;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = a.w + n * a.row_bytes;
    weight_only_column<Avx512, MR>(a, m0, n, [&](int64_t g, __m512 (&dst)[MR]) {
      __m512 acc[MR][CH];
      for (int i = 0; i < MR; ++i)
        for (int c = 0; c < CH; ++c) acc[i][c] = _mm512_setzero_ps();
      auto block_dots = [&](int64_t kb, int c) {
        const __m512bh q = int8_block_bf16(row, kb);
        for (int i = 0; i < MR; ++i)
          acc[i][c] = _mm512_dpbf16_ps(acc[i][c], (__m512bh)_mm512_loadu_si512(x + (m0 + i) * a.K + kb), q);
      };
      int64_t kb = g * a.G;
      const int64_t ke = kb + a.G;
      for (; kb + CH * BLOCK <= ke; kb += CH * BLOCK)
        for (int c = 0; c < CH; ++c) block_dots(kb + c * BLOCK, c);
      for (; kb < ke; kb += BLOCK) block_dots(kb, 0);
      const __m512 s = _mm512_set1_ps(a.scales[n * a.ng + g]);
      for (int i = 0; i < MR; ++i)
        for (int c = 0; c < CH; ++c) dst[i] = _mm512_fmadd_ps(acc[i][c], s, dst[i]);
    });
  }
}
#define FOLIO_BF16_DOT 1
#else
#define FOLIO_BF16_DOT 0
#endif

// Tasks own contiguous ranges of output columns; inside one, NB columns at a time pass over all rows of x,
// so that those columns' weights stay in cache while every tile of x uses them.
template <class Tile>
void over_tiles(int64_t M, int64_t N, int64_t row_bytes, const Tile& tile) {
  constexpr int64_t NB = 16;
  const int64_t grain = std::max<int64_t>(1, MIN_BYTES_PER_TASK / std::max<int64_t>(1, row_bytes));
  folio::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t nb = n0; nb < n1; nb += NB) {
      const int64_t ne = std::min(n1, nb + NB);
      for (int64_t m0 = 0; m0 < M; m0 += MAX_MR) tile(m0, std::min<int64_t>(MAX_MR, M - m0), nb, ne);
    }
  });
}

// fn(std::integral_constant<int, mr>) for a tile's 1 .. MAX_MR rows: each row count is its own instantiation
template <class Fn>
void by_rows(int64_t mr, const Fn& fn) {
  static_assert(MAX_MR == 4, "one case per row count");
  switch (mr) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    default: fn(std::integral_constant<int, 4>{}); break;
  }
}

template <class V, class Fmt>
void weight_only(const WeightOnly& a) {
  over_tiles(a.M, a.N, a.row_bytes, [&](int64_t m0, int64_t mr, int64_t n0, int64_t n1) {
    by_rows(mr, [&](auto rows) { weight_only_tile<V, Fmt, decltype(rows)::value>(a, m0, n0, n1); });
  });
}

#if FOLIO_BF16_DOT
void weight_only_bf16(const WeightOnly& a, const at::BFloat16* x) {
  over_tiles(a.M, a.N, a.row_bytes, [&](int64_t m0, int64_t mr, int64_t n0, int64_t n1) {
    by_rows(mr, [&](auto rows) { weight_only_bf16_tile<decltype(rows)::value>(a, x, m0, n0, n1); });
  });
}
#endif

// float32 -> bf16, rounding to nearest even as c10::BFloat16 does for finite values (16 lanes at a time with
// AVX-512).
void store_bf16(const float* src, at::BFloat16* dst, int64_t n) {
  int64_t i = 0;
#if FOLIO_AVX512
  for (; i + 16 <= n; i += 16) {
    const __m512i bits = _mm512_castps_si512(_mm512_loadu_ps(src + i));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(rounded));
  }
#endif
  for (; i < n; ++i) dst[i] = src[i];
}

// ------------------------------------------------------------------------------------------ dequantize
// oneDNN's packed bf16 layout for its GEMM (folio.models.onednn_layout): value (n, k) at [n / W][k / 2][n % W][k % 2]
// of a [N' / W, K' / 2, W, 2] buffer, each column's pair of K one 32-bit word; padding (k >= K, n >= N) untouched.
struct PackedBf16 {
  uint32_t* base;
  int64_t W, half_kp;
  // row n, already bf16 [K]: its pairs to their words, W words apart
  void store_row(int64_t n, const at::BFloat16* row, int64_t K) const {
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(row);
    uint32_t* dst = base + (n / W) * half_kp * W + n % W;
    for (int64_t p = 0; p < K / 2; ++p) dst[p * W] = pairs[p];
  }
};

// W as float32 or bf16 [N, K] (out: float* or at::BFloat16*), or bf16 in oneDNN's packed layout (PackedBf16),
// for batches that run the dense GEMM on it: q * scale (+ offset) per group, the reference's operations (the
// compiler may fuse the multiply and add: one rounding fewer), then for bf16 one rounding of each value, row by
// row through a buffer in cache.
template <class V, class Fmt, class Out>
void dequantize_rows(const WeightOnly& a, Out out) {
  using F = typename V::F;
  constexpr int SUB = BLOCK / V::W;
  constexpr bool to_float = std::is_same<Out, float*>::value;
  constexpr bool packed = std::is_same<Out, PackedBf16>::value;
  folio::parallel_for(0, a.N, std::max<int64_t>(1, MIN_BYTES_PER_TASK / a.row_bytes), [&](int64_t n0, int64_t n1) {
    std::vector<float> buf(to_float ? 0 : a.K);
    std::vector<at::BFloat16> row_bf16(packed ? a.K : 0);
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = a.w + n * a.row_bytes;
      float* dst;
      if constexpr (to_float) dst = out + n * a.K;
      else dst = buf.data();
      for (int64_t g = 0; g < a.ng; ++g) {
        const F s = V::set1(a.scales[n * a.ng + g]);
        const F o = V::set1(a.offsets ? a.offsets[n * a.ng + g] : 0.f);
        for (int64_t kb = g * a.G; kb < (g + 1) * a.G; kb += BLOCK) {
          F q[SUB];
          Fmt::template block<V>(row, kb, q);
          for (int j = 0; j < SUB; ++j)
            V::store(dst + kb + j * V::W, a.offsets ? V::add(V::mul(q[j], s), o) : V::mul(q[j], s));
        }
      }
      if constexpr (packed) {
        store_bf16(buf.data(), row_bf16.data(), a.K);
        out.store_row(n, row_bf16.data(), a.K);
      } else if constexpr (!to_float) {
        store_bf16(buf.data(), out + n * a.K, a.K);
      }
    }
  });
}

// ----------------------------------------------------------------------------------------------- W8A8
struct W8A8 {
  const int8_t* xq;  // [M, K] x quantised per row
  const int8_t* xa;  // [M, K] |xq|
  const float* sx;   // [M]
  const int8_t* w;   // [N, K]
  const float* sw;   // [N]
  float* y;
  int64_t M, N, K;
};

template <class V, int MR>
void w8a8_tile(const W8A8& a, int64_t m0, int64_t n0, int64_t n1) {
  using I = typename V::I;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = a.w + n * a.K;
    I acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = V::izero();
    for (int64_t k = 0; k < a.K; k += V::IB)
      for (int i = 0; i < MR; ++i) acc[i] = V::idot(acc[i], a.xa + (m0 + i) * a.K + k, a.xq + (m0 + i) * a.K + k, row + k);
    // the reference's float32 operations, in its order: float(acc) * (sx * sw); the bias is added by a
    // separate op, since the compiler may fuse a multiply and an add here into one FMA (one rounding fewer)
    for (int i = 0; i < MR; ++i) a.y[(m0 + i) * a.N + n] = static_cast<float>(V::ihsum(acc[i])) * (a.sx[m0 + i] * a.sw[n]);
  }
}

template <class V>
void w8a8(const W8A8& a) {
  over_tiles(a.M, a.N, a.K, [&](int64_t m0, int64_t mr, int64_t n0, int64_t n1) {
    by_rows(mr, [&](auto rows) { w8a8_tile<V, decltype(rows)::value>(a, m0, n0, n1); });
  });
}

// ------------------------------------------------------------------ W8A8 on oneDNN's packed weight (VNNI)
// For the batches under oneDNN's threshold, on CPUs with VNNI: the weight as oneDNN packs it for its int8 GEMM
// (folio.models.onednn_int8), read in place so that a layer keeps one copy: blocks of 64 output columns, each
// [K/4][64][4]. Four unsigned codes of x (q + 128, the codes oneDNN takes) broadcast as one 32-bit lane times a
// vector of the block (four values along K for each of 16 columns) add to 16 columns' sums at once (vpdpbusd),
// with no sum reduced across lanes; the sum less 128 times the column's sum of w is the exact int32 sum of
// q * w, scaled as w8a8 scales it, so results are the reference's bit for bit. Rows of x go MAX_MR at a time;
// a block comes from memory for the first of them and from cache for the others. With 16-bit codes of x
// (PASSES = 2) each quad of the block meets both bytes of each row (each + 128, corrected by the column sums
// as above), MAX_MR / 2 rows at a time.
#if FOLIO_AVX512 && defined(__AVX512VNNI__)
#define FOLIO_PACKED_W8A8 1
constexpr int64_t PACKED_COLUMNS = 64;
// bytes ahead of the current quad row. On Zen 4, one row, layers from memory in 30-40 alternating rounds: 8 KiB
// read 4-11 % faster than 2 KiB (9728 x 896 +10 %, 896 x 4864 +11 %, the 151936 x 896 head +5-6 %), 16 and 32
// KiB no faster than 8; the same at 8 rows
constexpr int64_t PACKED_PREFETCH = 8192;

struct PackedW8A8 {
  const uint8_t* xu;      // [M, K] x's codes + 128 (16-bit codes: their high bytes + 128)
  const uint8_t* xl;      // [M, K] 16-bit codes' low bytes + 128, or null (int8 codes)
  const float* sx;        // [M]
  const int8_t* w;        // [N / 64, block_quads, 64, 4]
  const int32_t* colsum;  // [N] sums of w's columns
  const float* sw;        // [N]
  const float* bias;      // [N] or null
  float* y;               // [M, N] float32, or null when yb is set
  at::BFloat16* yb;       // [M, N] bf16 (the float32 result rounded to nearest even), or null; gated: [M, N / 2]
  int64_t M, N, K, block_quads;
  // a gated weight's SiLU-and-mul (bf16 y only): each block's columns are the gates (0-31) and the ups (32-63)
  // of outputs 32 b .. 32 b + 31 (onednn_int8.prepack's gated layout), and y gets rnd(rnd(silu(gate)) * up) as
  // bf16 silu_and_mul computes it from the rounded gate and up, looked up in its table (bf16_silu_and_mul.h)
  const int* silu = nullptr;
};

// Rows m0 .. m0 + rows of block b from their int32 sums, acc(pass, row, v) for the block's columns 16 v ..
// 16 v + 15: less 128 times the columns' sums (256 high + low for 16-bit codes), times the row's and the
// columns' scales, plus the bias, into y.
template <int PASSES, class Acc>
inline void packed_w8a8_epilogue(const PackedW8A8& a, int64_t m0, int64_t rows, int64_t b, const Acc& acc) {
  const int64_t n0 = b * PACKED_COLUMNS, lanes = std::min<int64_t>(PACKED_COLUMNS, a.N - n0);
  const int nv = static_cast<int>((lanes + 15) / 16);  // vectors with columns
  __mmask16 mask[4];
  __m512i shift[4];
  __m512 sw[4], bias[4];
  for (int v = 0; v < nv; ++v) {
    const int64_t l = std::min<int64_t>(16, lanes - 16 * v);
    mask[v] = l == 16 ? __mmask16(0xffff) : __mmask16((1u << l) - 1);
    shift[v] = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(mask[v], a.colsum + n0 + 16 * v), 7);  // 128 * colsum
    sw[v] = _mm512_maskz_loadu_ps(mask[v], a.sw + n0 + 16 * v);
    bias[v] = a.bias ? _mm512_maskz_loadu_ps(mask[v], a.bias + n0 + 16 * v) : _mm512_setzero_ps();
  }
  // row by row, a whole block's bf16 row as two full cache lines (column by column, 32-byte masked stores took
  // 1.03-1.09x as long at 1852 rows, 1.01-1.07x at 62)
  const bool whole_lines = a.yb && lanes == PACKED_COLUMNS;
  for (int64_t i = 0; i < rows; ++i) {
    const __m512 sx = _mm512_set1_ps(a.sx[m0 + i]);
    __m512 out[4];
    for (int v = 0; v < nv; ++v) {
      __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc(0, i, v), shift[v]));
      // 256 * high + low: the product by 256 is exact, so the FMA rounds as the reference's mul and add do
      if (PASSES == 2)
        sum = _mm512_fmadd_ps(sum, _mm512_set1_ps(256.f),
                              _mm512_cvtepi32_ps(_mm512_sub_epi32(acc(PASSES - 1, i, v), shift[v])));
      // the product rounded on its own (the _round_ form: no FMA contraction with the bias's add), then the
      // reference's float32 add of the bias
      out[v] = _mm512_mul_round_ps(sum, _mm512_mul_ps(sx, sw[v]), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      if (a.bias) out[v] = _mm512_add_ps(out[v], bias[v]);
    }
    if (a.silu) {
      const __m256i low = folio::silu_times_up_of_sums(a.silu, out[0], out[2]);
      const __m256i high = folio::silu_times_up_of_sums(a.silu, out[1], out[3]);
      _mm512_storeu_si512(a.yb + (m0 + i) * (a.N / 2) + n0 / 2,
                          _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1));
    } else if (whole_lines) {
      at::BFloat16* dst = a.yb + (m0 + i) * a.N + n0;
      _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(out[1], out[0]));
      _mm512_storeu_si512(dst + 32, (__m512i)_mm512_cvtne2ps_pbh(out[3], out[2]));
    } else {
      for (int v = 0; v < nv; ++v) {
        const int64_t at = (m0 + i) * a.N + n0 + 16 * v;
        if (a.yb) _mm256_mask_storeu_epi16(a.yb + at, mask[v], (__m256i)_mm512_cvtneps_pbh(out[v]));
        else _mm512_mask_storeu_ps(a.y + at, mask[v], out[v]);
      }
    }
  }
}

template <int MR, int PASSES>
void packed_w8a8_block(const PackedW8A8& a, int64_t m0, int64_t b) {
  const int8_t* w = a.w + b * a.block_quads * PACKED_COLUMNS * 4;
  // the epilogue's column sums, scales and bias, 256 bytes each, in arrays of their own: fetched while the block
  // streams, not after (batch-1 int8 decode of the 0.5B Qwen2 on Zen 4: 1.1-2.7 % faster in two runs)
  for (int line = 0; line < 4; ++line) {
    _mm_prefetch(reinterpret_cast<const char*>(a.colsum + b * PACKED_COLUMNS) + 64 * line, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(a.sw + b * PACKED_COLUMNS) + 64 * line, _MM_HINT_T0);
    if (a.bias) _mm_prefetch(reinterpret_cast<const char*>(a.bias + b * PACKED_COLUMNS) + 64 * line, _MM_HINT_T0);
  }
  __m512i acc[PASSES][MR][4];
  for (int s = 0; s < PASSES; ++s)
    for (int i = 0; i < MR; ++i)
      for (int v = 0; v < 4; ++v) acc[s][i][v] = _mm512_setzero_si512();
  const int32_t* x[PASSES][MR];
  for (int i = 0; i < MR; ++i) {
    x[0][i] = reinterpret_cast<const int32_t*>(a.xu + (m0 + i) * a.K);
    if (PASSES == 2) x[PASSES - 1][i] = reinterpret_cast<const int32_t*>(a.xl + (m0 + i) * a.K);
  }
  for (int64_t p = 0; p < a.K / 4; ++p, w += PACKED_COLUMNS * 4) {
    __m512i wv[4];
    for (int v = 0; v < 4; ++v) {
      wv[v] = _mm512_loadu_si512(w + v * 64);
      _mm_prefetch(reinterpret_cast<const char*>(w + PACKED_PREFETCH + v * 64), _MM_HINT_T0);
    }
    for (int s = 0; s < PASSES; ++s)
      for (int i = 0; i < MR; ++i) {
        const __m512i xv = _mm512_set1_epi32(x[s][i][p]);
        for (int v = 0; v < 4; ++v) acc[s][i][v] = _mm512_dpbusd_epi32(acc[s][i][v], xv, wv[v]);
      }
  }
  packed_w8a8_epilogue<PASSES>(a, m0, MR, b, [&](int s, int i, int v) { return acc[s][i][v]; });
}

template <int PASSES>
void packed_w8a8(const PackedW8A8& a) {
  constexpr int64_t rows_per_pass = MAX_MR / PASSES;  // the accumulators of MAX_MR rows of int8 codes
  // the weight's blocks, and per block its columns' sums and scales (the bias too small to matter)
  const folio::BlockStream streams[] = {{a.w, a.block_quads * PACKED_COLUMNS * 4},
                                        {a.colsum, PACKED_COLUMNS * 4}, {a.sw, PACKED_COLUMNS * 4}};
  folio::parallel_blocks(a.w, (a.N + PACKED_COLUMNS - 1) / PACKED_COLUMNS, streams, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t m0 = 0; m0 < a.M; m0 += rows_per_pass)
        by_rows(std::min(rows_per_pass, a.M - m0), [&](auto rows) {
          packed_w8a8_block<std::min<int>(decltype(rows)::value, rows_per_pass), PASSES>(a, m0, b);
        });
  });
}

// The tiles (meant for AMX-INT8, where oneDNN's int8 GEMM read 16-64 rows' weights at half the bandwidth): each
// block times all of x's codes by PyTorch's at::native::cpublas::brgemm (oneDNN's micro-kernel, unsigned by
// signed bytes into int32: AMX tiles where the CPU has them, and the block already in the VNNI layout it reads),
// then the epilogue above, so results are the reference's bit for bit here too.
#ifdef CPUBLAS_BRGEMM_U8I8I32
#define FOLIO_W8A8_TILES 1
template <int PASSES>
void packed_w8a8_tiles(const PackedW8A8& a) {
  const int64_t block_elems = a.block_quads * PACKED_COLUMNS * 4;
  folio::parallel_for(0, (a.N + PACKED_COLUMNS - 1) / PACKED_COLUMNS, 1, [&](int64_t b0, int64_t b1) {
    std::vector<int32_t> sums(PASSES * a.M * PACKED_COLUMNS);
    for (int64_t b = b0; b < b1; ++b) {
      for (int s = 0; s < PASSES; ++s)
        at::native::cpublas::brgemm(a.M, PACKED_COLUMNS, a.K, a.K, PACKED_COLUMNS, PACKED_COLUMNS, false,
                                    s == 0 ? a.xu : a.xl, a.w + b * block_elems,
                                    sums.data() + s * a.M * PACKED_COLUMNS, true);
      packed_w8a8_epilogue<PASSES>(a, 0, a.M, b, [&](int s, int64_t i, int v) {
        return _mm512_loadu_si512(sums.data() + (s * a.M + i) * PACKED_COLUMNS + v * 16);
      });
    }
    at::native::cpublas::brgemm_release();  // the thread's AMX tile state, where brgemm took it
  });
}
#endif

// The tiles on AMX-INT8 where K is a multiple of 64 (an int8 tile's depth): folio's own tile loop
// (amx_tiles.h), which streams the blocks with prefetches where brgemm per block reread each block once per 16
// rows, on the same packed blocks; the codes of both passes are groups of rows, then the epilogue above.
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define FOLIO_W8A8_AMX 1
template <int PASSES>
void packed_w8a8_amx(const PackedW8A8& a) {
  folio::amx::Rows rows;
  rows.passes = PASSES;
  std::vector<uint8_t> padded[PASSES];
  const uint8_t* codes[2] = {a.xu, a.xl};
  for (int s = 0; s < PASSES; ++s) folio::amx::add_groups(rows, codes[s], a.M, a.K, a.K, padded[s]);
  const folio::amx::Weight weight{reinterpret_cast<const uint8_t*>(a.w), a.block_quads * PACKED_COLUMNS * 4,
                                  a.K / 64};
  const auto epilogue = [&](int64_t b, int64_t m0, int64_t m1, const auto& sums) {
    packed_w8a8_epilogue<PASSES>(a, m0, std::min(m1, a.M) - m0, b, [&](int s, int64_t i, int v) {
      return _mm512_loadu_si512(sums(s, m0 + i, v));
    });
  };
  const folio::BlockStream streams[] = {{a.w, a.block_quads * PACKED_COLUMNS * 4},
                                        {a.colsum, PACKED_COLUMNS * 4}, {a.sw, PACKED_COLUMNS * 4}};
  folio::parallel_blocks(a.w, (a.N + PACKED_COLUMNS - 1) / PACKED_COLUMNS, streams, [&](int64_t b0, int64_t b1) {
    folio::amx::multiply<folio::amx::U8S8, PACKED_COLUMNS / 16>(rows, weight, b0, b1, epilogue);
  });
}
#endif
#else
#define FOLIO_PACKED_W8A8 0
#endif
#ifndef FOLIO_W8A8_TILES
#define FOLIO_W8A8_TILES 0
#endif
#ifndef FOLIO_W8A8_AMX
#define FOLIO_W8A8_AMX 0
#endif

// ----------------------------------------------------------------------------------------------- W4A8
struct W4A8 {
  const int8_t* xq;      // [M, K] x quantised per block of 32
  const float* xs;       // [M, K / 32] the blocks' scales
  const float* xsum;     // [M, ng] exact sums of x per group (the offsets multiply them)
  const uint8_t* w;      // [N, K / 2]
  const float* scales;   // [N, ng]
  const float* offsets;  // [N, ng]
  const float* bias;     // [N] or null
  float* y;              // [M, N]
  int64_t M, N, K, G, ng;
};

// Rows m0 .. m0 + MR of y, columns n0 .. n1. Blocks go V::W at a time (a chunk): their exact int32 sums
// become one float vector, scaled lane by lane by the x block's and the weight group's scales (ws: one weight
// scale per block). The blocks past the last whole chunk are copied into a zero-padded chunk: zero x values
// and scales add nothing.
template <class V, int MR>
void w4a8_tile(const W4A8& a, int64_t m0, int64_t n0, int64_t n1) {
  using F = typename V::F;
  const int64_t nb = a.K / BLOCK, per_group = a.G / BLOCK, tail = nb % V::W, whole = nb - tail;
  alignas(64) int8_t x_tail[MR][V::W * BLOCK] = {};
  alignas(64) float xs_tail[MR][V::W] = {};
  alignas(64) uint8_t w_tail[V::W * BLOCK / 2] = {};
  alignas(64) float ws_tail[V::W] = {};
  for (int i = 0; i < MR; ++i) {
    std::memcpy(x_tail[i], a.xq + (m0 + i) * a.K + whole * BLOCK, tail * BLOCK);
    std::memcpy(xs_tail[i], a.xs + (m0 + i) * nb + whole, tail * sizeof(float));
  }
  std::vector<float> expanded(per_group == 1 ? 0 : nb);
  F acc[MR];
  // acc[i] += the chunk's block sums for row i, scaled; x rows ldx apart, their block scales ldxs apart
  const auto chunk = [&](const uint8_t* w, const float* ws, const int8_t* x, int64_t ldx, const float* xs,
                         int64_t ldxs) {
    F sums[MR];
    V::template u4dots<MR>(w, x, ldx, sums);
    const F w_scale = V::load(ws);
    for (int i = 0; i < MR; ++i) acc[i] = V::fma(sums[i], V::mul(w_scale, V::load(xs + i * ldxs)), acc[i]);
  };
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = a.w + n * (a.K / 2);
    const float* sc = a.scales + n * a.ng;
    const float* ws = sc;
    if (per_group != 1) {
      for (int64_t b = 0; b < nb; ++b) expanded[b] = sc[b / per_group];
      ws = expanded.data();
    }
    for (int i = 0; i < MR; ++i) acc[i] = V::zero();
    for (int64_t b = 0; b < whole; b += V::W)
      chunk(row + b * (BLOCK / 2), ws + b, a.xq + m0 * a.K + b * BLOCK, a.K, a.xs + m0 * nb + b, nb);
    if (tail) {
      std::memcpy(w_tail, row + whole * (BLOCK / 2), tail * (BLOCK / 2));
      std::memcpy(ws_tail, ws + whole, tail * sizeof(float));
      chunk(w_tail, ws_tail, x_tail[0], V::W * BLOCK, xs_tail[0], V::W);
    }
    for (int i = 0; i < MR; ++i) {
      const int64_t m = m0 + i;
      const float v = V::hsum(acc[i]) + dot<V>(a.offsets + n * a.ng, a.xsum + m * a.ng, a.ng);
      a.y[m * a.N + n] = a.bias ? v + a.bias[n] : v;
    }
  }
}

// whether V has the int4 x int8 block product (AVX-512 builds run it with the 256-bit AVX2 type)
template <class V, class = void>
struct HasU4 : std::false_type {};
template <class V>
struct HasU4<V, std::void_t<typename V::Q>> : std::true_type {};

template <class V>
void w4a8(const W4A8& a) {
  over_tiles(a.M, a.N, a.K / 2, [&](int64_t m0, int64_t mr, int64_t n0, int64_t n1) {
    by_rows(mr, [&](auto rows) { w4a8_tile<V, decltype(rows)::value>(a, m0, n0, n1); });
  });
}

// The largest |v| of K values (four running maxima: one was a chain of vmaxps latencies, a quarter of a row's
// quantisation).
float abs_max(const float* v, int64_t K) {
  float amax = 0.f;
  int64_t k = 0;
#if FOLIO_AVX512
  __m512 vmax[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (; k + 64 <= K; k += 64)
    for (int i = 0; i < 4; ++i) vmax[i] = _mm512_max_ps(vmax[i], _mm512_abs_ps(_mm512_loadu_ps(v + k + 16 * i)));
  for (; k + 16 <= K; k += 16) vmax[0] = _mm512_max_ps(vmax[0], _mm512_abs_ps(_mm512_loadu_ps(v + k)));
  amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(vmax[0], vmax[1]), _mm512_max_ps(vmax[2], vmax[3])));
#endif
  for (; k < K; ++k) amax = std::max(amax, std::fabs(v[k]));
  return amax;
}

// Symmetric int8 of n consecutive values of x (a row for W8A8, a block of 32 for W4A8): codes
// round_half_even(x * 127 / a) + offset (128 for an unsigned GEMM source, stored as uint8), scale a / 127
// (span_scale.h), as the reference; qa, when given, gets |q| (the W8A8 kernel's sign trick). Products are IEEE's
// in every lane, so the vector loop gives the scalar one's codes.
void quantize_span(const float* v, int64_t K, int offset, int8_t* q, int8_t* qa, float* scale, float amax = -1.f) {
  const SpanScale ss = span_scale(amax < 0.f ? abs_max(v, K) : amax, 127.f);
  *scale = ss.scale;
  const double inv = ss.inverse;
  int64_t k = 0;
#if FOLIO_AVX512
  const __m512d vinv = _mm512_set1_pd(inv);
  const __m512 vinv_f = _mm512_set1_ps(static_cast<float>(inv)), margin = _mm512_set1_ps(127.f * 0x1p-22f);
  const __m512i lim = _mm512_set1_epi32(127), off = _mm512_set1_epi32(offset);
  for (; k + 16 <= K; k += 16) {
    const __m512i c = span_codes_fast(_mm512_loadu_ps(v + k), vinv_f, vinv, lim, margin);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(_mm512_add_epi32(c, off)));
    if (qa) _mm_storeu_si128(reinterpret_cast<__m128i*>(qa + k), _mm512_cvtepi32_epi8(_mm512_abs_epi32(c)));
  }
#endif
  for (; k < K; ++k) {
    const int c = span_code(v[k], inv, 127);
    q[k] = static_cast<int8_t>(c + offset);
    if (qa) qa[k] = static_cast<int8_t>(std::abs(c));
  }
}

// One row's K values quantised symmetrically to 16-bit codes (q = round(v * INT16_CODE_MAX / a) within
// +-INT16_CODE_MAX, span_scale.h, half to even as torch.round), split as q = 256 h + l into two signed bytes stored
// + 128 (the unsigned codes vpdpbusd and oneDNN take, with the 128 * column-sum correction): u = q + 32896 is
// 256 (h + 128) + (l + 128), so hi = u >> 8 and lo = u & 255.
constexpr float INT16_CODE_MAX = 32639.f;  // 127 * 257: the largest q whose h = (q + 128) >> 8 is at most 127
void quantize_span16(const float* v, int64_t K, uint8_t* hi, uint8_t* lo, float* scale) {
  const SpanScale ss = span_scale(abs_max(v, K), INT16_CODE_MAX);
  *scale = ss.scale;
  const double inv = ss.inverse;
  int64_t k = 0;
#if FOLIO_AVX512
  const __m512d vinv = _mm512_set1_pd(inv);
  const __m512i lim = _mm512_set1_epi32(static_cast<int>(INT16_CODE_MAX));
  const __m512i off = _mm512_set1_epi32(32896), low = _mm512_set1_epi32(255);
  for (; k + 16 <= K; k += 16) {
    const __m512i u = _mm512_add_epi32(span_codes(_mm512_loadu_ps(v + k), vinv, lim), off);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + k), _mm512_cvtepi32_epi8(_mm512_srli_epi32(u, 8)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + k), _mm512_cvtepi32_epi8(_mm512_and_si512(u, low)));
  }
#endif
  for (; k < K; ++k) {
    const int u = span_code(v[k], inv, static_cast<int>(INT16_CODE_MAX)) + 32896;
    hi[k] = static_cast<uint8_t>(u >> 8);
    lo[k] = static_cast<uint8_t>(u & 255);
  }
}

// quantize_span over num_spans spans of `span` values of x.
void quantize_spans(const float* x, int64_t num_spans, int64_t span, int8_t* xq, float* scales) {
  folio::parallel_for(0, num_spans, std::max<int64_t>(1, 65536 / span), [&](int64_t s0, int64_t s1) {
    for (int64_t i = s0; i < s1; ++i) quantize_span(x + i * span, span, 0, xq + i * span, nullptr, scales + i);
  });
}

// ------------------------------------------------------------------------------- W8A8's row quantiser
// W8A8's activations: each row of x (float32 or bf16 [M, K]) widened to float32, rotated if asked (each block
// of B values times the Walsh-Hadamard matrix of order B, unnormalised: folio.models.quant_reference.rotate),
// then quantised by quantize_span, in one pass per row through a buffer in cache. The rotation's butterflies
// (a + b, a - b) run in the reference's stage order, so codes and scales equal the reference's bit for bit.
struct RowQuantizer {
  bool rotate;
  int offset;

  // blocks of B values, stages h = 1, 2, .. B / 2, as the reference runs them
  static void rotate_scalar(float* v, int64_t K, int64_t B) {
    for (float* b = v; b < v + K; b += B)
      for (int64_t h = 1; h < B; h *= 2)
        for (int64_t i = 0; i < B; i += 2 * h)
          for (int64_t j = i; j < i + h; ++j) {
            const float a = b[j], c = b[j + h];
            b[j] = a + c;
            b[j + h] = a - c;
          }
  }

#if FOLIO_AVX512
  // stage h inside one 16-lane register: lanes with bit h set get (partner - self), the others self + partner, as
  // self * sign + partner in one FMA (the product by +-1 is exact, so it rounds as the add or sub: one instruction
  // fewer a stage than an add and a masked sub)
  static __m512 butterfly(__m512 v, __m512 partner, __mmask16 high) {
    return _mm512_fmadd_ps(v, _mm512_mask_blend_ps(high, _mm512_set1_ps(1.f), _mm512_set1_ps(-1.f)), partner);
  }
  static __m512 in_register(__m512 v) {
    v = butterfly(v, _mm512_permute_ps(v, 0xB1), 0xAAAA);         // h = 1
    v = butterfly(v, _mm512_permute_ps(v, 0x4E), 0xCCCC);         // h = 2
    v = butterfly(v, _mm512_shuffle_f32x4(v, v, 0xB1), 0xF0F0);   // h = 4
    return butterfly(v, _mm512_shuffle_f32x4(v, v, 0x4E), 0xFF00);  // h = 8
  }
  static __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 load16(const at::BFloat16* p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }

  // 16 NV values of src widened to float32, through stages 1 .. 8 NV in registers (those inside a register, then
  // between registers), into out; `amax` takes their largest |value|. (Widened into the row first and taken
  // through memory stage by stage, these passes were two thirds of a rotated 4864-value row's quantisation.)
  template <int NV, class T>
  static __m512 rotate_block(const T* src, float* out, __m512 amax) {
    __m512 v[NV];
    for (int i = 0; i < NV; ++i) v[i] = in_register(load16(src + 16 * i));
    for (int h = 1; h < NV; h *= 2)
      for (int i = 0; i < NV; i += 2 * h)
        for (int j = i; j < i + h; ++j) {
          const __m512 a = v[j], c = v[j + h];
          v[j] = _mm512_add_ps(a, c);
          v[j + h] = _mm512_sub_ps(a, c);
        }
    for (int i = 0; i < NV; ++i) {
      _mm512_storeu_ps(out + 16 * i, v[i]);
      amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
    }
    return amax;
  }
#endif

  // K values of src (bf16 or float32) times the Walsh-Hadamard matrix in blocks of rotation_block(K), into out,
  // stage by stage as the reference: blocks of up to 256 values wholly in registers, the stages past them through
  // memory. Returns the largest |value| where the blocks were whole (found on the way), else -1.
  template <class T>
  static float rotate_row(const T* src, float* out, int64_t K) {
    const int64_t B = K & -K;  // quant_reference.rotation_block: the largest power of two dividing K
#if FOLIO_AVX512
    const int64_t part = std::min<int64_t>(B, 256);
    __m512 amax = _mm512_setzero_ps();
    const auto blocks = [&](auto nv) {
      for (int64_t b = 0; b < K; b += part) amax = rotate_block<decltype(nv)::value>(src + b, out + b, amax);
    };
    switch (part) {
      case 32: blocks(std::integral_constant<int, 2>{}); break;
      case 64: blocks(std::integral_constant<int, 4>{}); break;
      case 128: blocks(std::integral_constant<int, 8>{}); break;
      default: blocks(std::integral_constant<int, 16>{}); break;
    }
    if (B == part) return _mm512_reduce_max_ps(amax);
    for (int64_t h = part; h < B; h *= 2)
      for (int64_t g = 0; g < K; g += 2 * h)
        for (int64_t j = g; j < g + h; j += 16) {
          const __m512 a = _mm512_loadu_ps(out + j), c = _mm512_loadu_ps(out + j + h);
          _mm512_storeu_ps(out + j, _mm512_add_ps(a, c));
          _mm512_storeu_ps(out + j + h, _mm512_sub_ps(a, c));
        }
#else
    for (int64_t k = 0; k < K; ++k) out[k] = static_cast<float>(src[k]);
    rotate_scalar(out, K, B);
#endif
    return -1.f;
  }

  void run(const at::Tensor& x, int8_t* q, int8_t* qa, float* scales) const {
    const int64_t K = x.size(1);
    each_row(x, [&](const float* v, int64_t m, float amax) {
      quantize_span(v, K, offset, q + m * K, qa ? qa + m * K : nullptr, scales + m, amax);
    });
  }

  // span(v, m, amax) for each row m of x, v its K values widened to float32 (and rotated if asked) in a buffer,
  // amax their largest |value| where the rotation found it on the way (else -1)
  template <class Span>
  void each_row(const at::Tensor& x, const Span& span) const {
    const int64_t M = x.size(0), K = x.size(1);
    TORCH_CHECK(!rotate || K % BLOCK == 0, "K (", K, ") must be a multiple of 32 to rotate");
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    const float* xf = bf16 ? nullptr : x.data_ptr<float>();
    const at::BFloat16* xb = bf16 ? x.data_ptr<at::BFloat16>() : nullptr;
    folio::parallel_for(0, M, std::max<int64_t>(1, MIN_VALUES_PER_TASK / K), [&](int64_t m0, int64_t m1) {
      thread_local std::vector<float> buf;  // kept: a decode step quantises ~100 rows, each a call of its own
      if (static_cast<int64_t>(buf.size()) < K + 16) buf.resize(K + 16);
      // on a cache line: with vectors split across two lines a rotated 4864-value row took 1.31x as long
      float* row = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
      for (int64_t m = m0; m < m1; ++m) {
        float amax = -1.f;  // the row's largest |value|, where the rotation found it
        if (rotate) {
          amax = bf16 ? rotate_row(xb + m * K, row, K) : rotate_row(xf + m * K, row, K);
        } else if (bf16) {
          for (int64_t k = 0; k < K; ++k) row[k] = static_cast<float>(xb[m * K + k]);
        } else {
          std::memcpy(row, xf + m * K, K * sizeof(float));
        }
        span(row, m, amax);
      }
    });
  }
};


// Sums of each row of x over each group of G values (int4's offsets multiply them). Inline for a few rows: no
// parallel region, which costs milliseconds when another process holds a core.
void group_sums(const float* x, int64_t M, int64_t K, int64_t G, float* out) {
  folio::parallel_for(0, M, std::max<int64_t>(1, 65536 / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t g = 0; g < K / G; ++g) {
        float s = 0.f;
        for (int64_t k = g * G; k < (g + 1) * G; ++k) s += x[m * K + k];
        out[m * (K / G) + g] = s;
      }
  });
}

// ------------------------------------------------------------------------------------------ bindings
std::vector<int64_t> isas() {
  std::vector<int64_t> out{SCALAR};
#if FOLIO_AVX2
  out.push_back(AVX2);
#endif
#if FOLIO_AVX512
  out.push_back(AVX512);
#endif
  return out;
}

int64_t best_isa() { return isas().back(); }

// fn(V{}) with V the vector type of the instruction set asked for.
template <class Fn>
void by_isa(int64_t isa, const Fn& fn) {
  switch (isa) {
    case SCALAR: fn(Scalar{}); return;
#if FOLIO_AVX2
    case AVX2: fn(Avx2{}); return;
#endif
#if FOLIO_AVX512
    case AVX512: fn(Avx512{}); return;
#endif
    default: TORCH_CHECK(false, "instruction set ", isa, " is not compiled in this build");
  }
}

at::Tensor float_rows(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, ", K, "]");
  return x.to(at::kFloat).contiguous();
}

// x [M, K] as float32 or bf16, contiguous: the row quantiser's input.
at::Tensor rows_of(const at::Tensor& x, int64_t K) {
  return x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) == K ? x.contiguous() : float_rows(x, K);
}

const float* optional_f32(const c10::optional<at::Tensor>& t, int64_t n, const char* what) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == n, what, " must be float32 [", n, "]");
  return t->data_ptr<float>();
}

// The float32 result, in x's dtype.
at::Tensor as_input_dtype(at::Tensor y, const at::Tensor& x) {
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace

namespace {
// The weight fields of WeightOnly, checked: w int8 [N, K] or uint8 [N, K / 2] (int4 when offsets are given).
WeightOnly weight_fields(const at::Tensor& w, const at::Tensor& scales, const c10::optional<at::Tensor>& offsets) {
  const bool int4 = offsets.has_value();
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == (int4 ? at::kByte : at::kChar),
              "w must be contiguous ", int4 ? "uint8 [N, K / 2]" : "int8 [N, K]");
  const int64_t N = w.size(0), K = int4 ? 2 * w.size(1) : w.size(1);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "scales must be float32 [N, K / G]");
  const int64_t ng = scales.size(1);
  TORCH_CHECK(ng >= 1 && K % ng == 0 && (K / ng) % BLOCK == 0, "K (", K, ") must be split in groups of a multiple of 32");
  if (int4)
    TORCH_CHECK(offsets->sizes() == scales.sizes() && offsets->scalar_type() == at::kFloat && offsets->is_contiguous(),
                "offsets must be float32 shaped like scales");
  return WeightOnly{nullptr, static_cast<const uint8_t*>(w.data_ptr()), scales.data_ptr<float>(),
                    int4 ? offsets->data_ptr<float>() : nullptr, nullptr, nullptr, nullptr, 0, N, K, K / ng, ng,
                    int4 ? Int4Fmt::row_bytes(K) : Int8Fmt::row_bytes(K)};
}
}  // namespace

// x [M, K] float32 or bf16 times the weight of weight_fields.
at::Tensor weight_only_linear(at::Tensor x, at::Tensor w, at::Tensor scales, c10::optional<at::Tensor> offsets,
                              c10::optional<at::Tensor> bias, int64_t isa) {
  WeightOnly a = weight_fields(w, scales, offsets);
  // int8 with bf16 x on AVX512-BF16 is multiplied as it is; float32 x is needed otherwise
  const bool bf16_dot = FOLIO_BF16_DOT && isa == AVX512 && x.scalar_type() == at::kBFloat16 && !a.offsets;
  at::Tensor xr = bf16_dot ? rows_of(x, a.K) : float_rows(x, a.K);
  a.M = xr.size(0);
  at::Tensor y = at::empty({a.M, a.N}, xr.options().dtype(at::kFloat));
  a.x = xr.scalar_type() == at::kFloat ? xr.data_ptr<float>() : nullptr;
  a.y = y.data_ptr<float>();
  a.bias = optional_f32(bias, a.N, "bias");
  at::Tensor xsum;
  if (a.offsets) {
    xsum = at::empty({a.M, a.ng}, y.options());
    group_sums(a.x, a.M, a.K, a.G, xsum.data_ptr<float>());
    a.xsum = xsum.data_ptr<float>();
  }
#if FOLIO_BF16_DOT
  if (bf16_dot) {
    weight_only_bf16(a, xr.data_ptr<at::BFloat16>());
    return as_input_dtype(y, x);
  }
#endif
  by_isa(isa, [&](auto v) {
    using V = decltype(v);
    a.offsets ? weight_only<V, Int4Fmt>(a) : weight_only<V, Int8Fmt>(a);
  });
  return as_input_dtype(y, x);
}

// The weight [N, K] of weight_fields in dtype (float32, or bf16: the float32 values rounded once).
at::Tensor dequantize(at::Tensor w, at::Tensor scales, c10::optional<at::Tensor> offsets, at::ScalarType dtype,
                      int64_t isa) {
  const WeightOnly a = weight_fields(w, scales, offsets);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype must be float32 or bfloat16");
  at::Tensor out = at::empty({a.N, a.K}, scales.options().dtype(dtype));
  by_isa(isa, [&](auto v) {
    using V = decltype(v);
    auto run = [&](auto* o) {
      a.offsets ? dequantize_rows<V, Int4Fmt>(a, o) : dequantize_rows<V, Int8Fmt>(a, o);
    };
    dtype == at::kFloat ? run(out.data_ptr<float>()) : run(out.data_ptr<at::BFloat16>());
  });
  return out;
}

// The weight of weight_fields in bf16 written into out, a view of oneDNN's packed buffer: contiguous bf16
// [N' / W, K' / 2, W, 2] with N' >= N and K' >= K (PackedBf16).
void dequantize_packed(at::Tensor w, at::Tensor scales, c10::optional<at::Tensor> offsets, at::Tensor out,
                       int64_t isa) {
  const WeightOnly a = weight_fields(w, scales, offsets);
  TORCH_CHECK(out.dim() == 4 && out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.size(3) == 2 &&
                  2 * out.size(1) >= a.K && out.size(0) * out.size(2) >= a.N,
              "out must be contiguous bf16 [N' / W, K' / 2, W, 2] with K' >= K, N' >= N");
  const PackedBf16 o{reinterpret_cast<uint32_t*>(out.data_ptr<at::BFloat16>()), out.size(2), out.size(1)};
  by_isa(isa, [&](auto v) {
    using V = decltype(v);
    a.offsets ? dequantize_rows<V, Int4Fmt>(a, o) : dequantize_rows<V, Int8Fmt>(a, o);
  });
}

at::Tensor w4a8_linear(at::Tensor x, at::Tensor w, at::Tensor scales, at::Tensor offsets, c10::optional<at::Tensor> bias,
                       int64_t isa) {
  const WeightOnly wf = weight_fields(w, scales, offsets);  // int4: offsets given
  const int64_t N = wf.N, K = wf.K, G = wf.G, ng = wf.ng;
  if (isa == AVX512) isa = AVX2;  // a block of 32 int8 values is one 256-bit vector (with VNNI where the CPU has it)
  at::Tensor xf = float_rows(x, K);
  const int64_t M = xf.size(0);
  at::Tensor xq = at::empty({M, K}, xf.options().dtype(at::kChar));
  at::Tensor xs = at::empty({M, K / BLOCK}, xf.options());
  at::Tensor xsum = at::empty({M, ng}, xf.options());
  quantize_spans(xf.data_ptr<float>(), M * (K / BLOCK), BLOCK, xq.data_ptr<int8_t>(), xs.data_ptr<float>());
  group_sums(xf.data_ptr<float>(), M, K, G, xsum.data_ptr<float>());
  at::Tensor y = at::empty({M, N}, xf.options());
  W4A8 a{xq.data_ptr<int8_t>(), xs.data_ptr<float>(), xsum.data_ptr<float>(), w.data_ptr<uint8_t>(),
         scales.data_ptr<float>(), offsets.data_ptr<float>(), optional_f32(bias, N, "bias"), y.data_ptr<float>(),
         M, N, K, G, ng};
  by_isa(isa, [&](auto v) {
    using V = decltype(v);
    if constexpr (HasU4<V>::value) w4a8<V>(a);
  });
  return as_input_dtype(y, x);
}

at::Tensor w8a8_linear(at::Tensor x, at::Tensor w, at::Tensor scales, c10::optional<at::Tensor> bias, bool rotate,
                       int64_t isa) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kChar, "w must be contiguous int8 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(K % 32 == 0, "K (", K, ") must be a multiple of 32");
  if (isa == AVX512 && K % 64 != 0) isa = AVX2;  // AVX-512 steps 64 values at a time; its CPUs have AVX2
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N,
              "scales must be float32 [N] (one per output channel)");
  at::Tensor xr = rows_of(x, K);
  const int64_t M = xr.size(0);
  const auto f32 = xr.options().dtype(at::kFloat);
  at::Tensor xq = at::empty({M, K}, xr.options().dtype(at::kChar));
  at::Tensor xa = at::empty({M, K}, xr.options().dtype(at::kChar));
  at::Tensor sx = at::empty({M}, f32);
  RowQuantizer{rotate, 0}.run(xr, xq.data_ptr<int8_t>(), xa.data_ptr<int8_t>(), sx.data_ptr<float>());
  at::Tensor y = at::empty({M, N}, f32);
  W8A8 a{xq.data_ptr<int8_t>(), xa.data_ptr<int8_t>(), sx.data_ptr<float>(), w.data_ptr<int8_t>(),
         scales.data_ptr<float>(), y.data_ptr<float>(), M, N, K};
  by_isa(isa, [&](auto v) { w8a8<decltype(v)>(a); });
  if (bias.has_value()) y.add_(bias->to(at::kFloat));
  return as_input_dtype(y, x);
}

// The two quantisers below, into the caller's buffers: xr [M, K] rows_of(x); q, hi, lo [M, K]; sx [M].
void quantize_unsigned_into(const at::Tensor& xr, bool rotate, uint8_t* q, float* sx) {
  RowQuantizer{rotate, 128}.run(xr, reinterpret_cast<int8_t*>(q), nullptr, sx);
}

void quantize_int16_bytes_into(const at::Tensor& xr, uint8_t* hi, uint8_t* lo, float* sx) {
  const int64_t K = xr.size(1);
  RowQuantizer{false, 0}.each_row(xr, [&](const float* v, int64_t m, float) {
    quantize_span16(v, K, hi + m * K, lo + m * K, sx + m);
  });
}

// x [M, K] (rotated first if asked) quantised per row as w8a8_linear does, for an int8 GEMM whose source is
// unsigned (oneDNN's on VNNI): (codes q + 128 as uint8 [M, K], scales float32 [M]).
std::vector<at::Tensor> quantize_rows_unsigned(at::Tensor x, bool rotate) {
  at::Tensor xr = rows_of(x, x.size(-1));
  const int64_t M = xr.size(0), K = xr.size(1);
  at::Tensor q = at::empty({M, K}, xr.options().dtype(at::kByte));
  at::Tensor sx = at::empty({M}, xr.options().dtype(at::kFloat));
  quantize_unsigned_into(xr, rotate, q.data_ptr<uint8_t>(), sx.data_ptr<float>());
  return {q, sx};
}

// x [M, K] quantised per row to 16-bit codes as w8_int16_packed_linear does, for an int8 GEMM with an unsigned
// source run once per byte: (high bytes + 128, low bytes + 128, both uint8 [M, K]; scales float32 [M]).
std::vector<at::Tensor> quantize_rows_int16_bytes(at::Tensor x) {
  at::Tensor xr = rows_of(x, x.size(-1));
  const int64_t M = xr.size(0), K = xr.size(1);
  at::Tensor hi = at::empty({M, K}, xr.options().dtype(at::kByte)), lo = at::empty({M, K}, hi.options());
  at::Tensor sx = at::empty({M}, xr.options().dtype(at::kFloat));
  quantize_int16_bytes_into(xr, hi.data_ptr<uint8_t>(), lo.data_ptr<uint8_t>(), sx.data_ptr<float>());
  return {hi, lo, sx};
}

// x [M, K] times the weight in oneDNN's packed blocks int8 [N / 64, K' / 4, 64, 4] (K' >= K), its column sums
// int32 [N] and scales float32 [N], x's rows quantised to int8 (int16 = false) or int16 codes. With silu_table
// (fused_ops' bf16_silu_table) the weight is gated (PackedW8A8::silu) and the result SiLU-and-mul's [M, N / 2].
at::Tensor packed_linear(at::Tensor x, at::Tensor blocks, at::Tensor column_sums, at::Tensor scales,
                         c10::optional<at::Tensor> bias, bool rotate, bool int16, bool tiles,
                         c10::optional<at::Tensor> silu_table) {
  TORCH_CHECK(FOLIO_PACKED_W8A8, "built without AVX512-VNNI");
  TORCH_CHECK(!tiles || FOLIO_W8A8_TILES, "this PyTorch's brgemm has no int8 product");
  const int64_t N = scales.numel(), K = x.size(-1);
  const bool gated = silu_table.has_value() && silu_table->defined();
  TORCH_CHECK(!gated || (x.scalar_type() == at::kBFloat16 && N % 128 == 0 && silu_table->scalar_type() == at::kInt &&
                         silu_table->numel() == folio::SILU_TABLE_INTS),
              "a gated product takes bf16 x, N a multiple of 128 and the int32 [32776] silu table");
  TORCH_CHECK(blocks.dim() == 4 && blocks.scalar_type() == at::kChar && blocks.is_contiguous() &&
                  blocks.size(2) == 64 && blocks.size(3) == 4,
              "blocks must be contiguous int8 [N / 64, K / 4, 64, 4]");
  TORCH_CHECK(K % 4 == 0 && K <= 4 * blocks.size(1) && N > (blocks.size(0) - 1) * 64 && N <= blocks.size(0) * 64,
              "shapes: x [M, K], K % 4 == 0 and within the blocks' K; N within the last block");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous(), "scales must be float32 [N]");
  TORCH_CHECK(column_sums.scalar_type() == at::kInt && column_sums.is_contiguous() && column_sums.numel() == N,
              "column_sums must be int32 [N]");
  // x's codes + 128 (both bytes of 16-bit codes: high rows, then low rows), then the rows' scales, in buffers kept
  // per thread: the calls are small (a decode step makes ~100 of one row) and tensors cost microseconds each
  const at::Tensor xr = rows_of(x, K);
  const int64_t M = xr.size(0), bytes = (int16 ? 2 : 1) * M * K;
  thread_local std::vector<uint8_t> codes;
  thread_local std::vector<float> sx;
  if (static_cast<int64_t>(codes.size()) < bytes) codes.resize(bytes);
  if (static_cast<int64_t>(sx.size()) < M) sx.resize(M);
  if (int16) quantize_int16_bytes_into(xr, codes.data(), codes.data() + M * K, sx.data());
  else quantize_unsigned_into(xr, rotate, codes.data(), sx.data());
  // bf16 x: y in bf16 straight from the epilogue (bias and rounding included: no extra pass over y)
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::Tensor y = at::empty({M, gated ? N / 2 : N}, x.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  TORCH_CHECK(!b.defined() || b.numel() == N, "bias must have N values");
#if FOLIO_PACKED_W8A8
  const PackedW8A8 a{codes.data(), int16 ? codes.data() + M * K : nullptr, sx.data(),
                     blocks.data_ptr<int8_t>(), column_sums.data_ptr<int32_t>(), scales.data_ptr<float>(),
                     b.defined() ? b.data_ptr<float>() : nullptr, bf16 ? nullptr : y.data_ptr<float>(),
                     bf16 ? y.data_ptr<at::BFloat16>() : nullptr, M, N, K, blocks.size(1),
                     gated ? silu_table->data_ptr<int>() : nullptr};
#if FOLIO_W8A8_AMX
  if (tiles && K % 64 == 0 && folio::amx::permitted()) {
    if (int16) packed_w8a8_amx<2>(a);
    else packed_w8a8_amx<1>(a);
    return bf16 ? y : as_input_dtype(y, x);
  }
#endif
#if FOLIO_W8A8_TILES
  if (tiles) {
    if (int16) packed_w8a8_tiles<2>(a);
    else packed_w8a8_tiles<1>(a);
    return bf16 ? y : as_input_dtype(y, x);
  }
#endif
  if (int16) packed_w8a8<2>(a);
  else packed_w8a8<1>(a);
#endif
  return bf16 ? y : as_input_dtype(y, x);
}

// w8a8_linear's product with the weight in oneDNN's packed blocks (packed_linear).
at::Tensor w8a8_packed_linear(at::Tensor x, at::Tensor blocks, at::Tensor column_sums, at::Tensor scales,
                              c10::optional<at::Tensor> bias, bool rotate, bool tiles,
                              c10::optional<at::Tensor> silu_table) {
  return packed_linear(x, blocks, column_sums, scales, bias, rotate, false, tiles, silu_table);
}

// x's rows quantised to int16, times the weight in oneDNN's packed blocks (packed_linear).
at::Tensor w8_int16_packed_linear(at::Tensor x, at::Tensor blocks, at::Tensor column_sums, at::Tensor scales,
                                  c10::optional<at::Tensor> bias, bool tiles, c10::optional<at::Tensor> silu_table) {
  return packed_linear(x, blocks, column_sums, scales, bias, false, true, tiles, silu_table);
}

bool has_packed_w8a8() { return FOLIO_PACKED_W8A8; }
bool has_w8a8_tiles() { return FOLIO_PACKED_W8A8 && FOLIO_W8A8_TILES; }
bool has_w8a8_amx() {
#if FOLIO_PACKED_W8A8 && FOLIO_W8A8_AMX
  return folio::amx::permitted();
#else
  return false;
#endif
}

// out [M, N] (float32 or bf16) = y [M, N] float32 (sums already times the weight's scales) times each row's
// scale (+ bias): the epilogue of an int8 GEMM whose activation scale is per token. out may be rows of a larger
// tensor (a chunk of the batch), y in cache.
void scale_rows(at::Tensor y, at::Tensor row_scales, c10::optional<at::Tensor> bias, at::Tensor out) {
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == at::kFloat && y.is_contiguous(), "y must be contiguous float32 [M, N]");
  const int64_t M = y.size(0), N = y.size(1);
  TORCH_CHECK(row_scales.scalar_type() == at::kFloat && row_scales.is_contiguous() && row_scales.numel() == M,
              "row_scales must be float32 [M]");
  TORCH_CHECK(out.sizes() == y.sizes() && out.is_contiguous() &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "out must be contiguous float32 or bf16 shaped like y");
  const float* b = optional_f32(bias, N, "bias");
  const float* src = y.data_ptr<float>();
  const float* sx = row_scales.data_ptr<float>();
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  float* of = bf16 ? nullptr : out.data_ptr<float>();
  at::BFloat16* ob = bf16 ? out.data_ptr<at::BFloat16>() : nullptr;
  folio::parallel_for(0, M, std::max<int64_t>(1, MIN_VALUES_PER_TASK / N), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* r = src + m * N;
      int64_t n = 0;
#if FOLIO_AVX512
      const __m512 s = _mm512_set1_ps(sx[m]);
      for (; n + 16 <= N; n += 16) {
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(r + n), s);
        if (b) v = _mm512_add_ps(v, _mm512_loadu_ps(b + n));
        if (bf16) {
          alignas(64) float tmp[16];
          _mm512_store_ps(tmp, v);
          store_bf16(tmp, ob + m * N + n, 16);
        } else {
          _mm512_storeu_ps(of + m * N + n, v);
        }
      }
#endif
      for (; n < N; ++n) {
        volatile float v = r[n] * sx[m];  // rounded before the bias is added, as in the vector loop (no FMA)
        const float o = b ? v + b[n] : v;
        if (bf16) ob[m * N + n] = o;
        else of[m * N + n] = o;
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  folio::bind_decode_threads(m);
  m.def("weight_only_linear", &weight_only_linear, "x W^T (+ b) with int8 or int4 weights, float x",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("scales"), pybind11::arg("offsets"),
        pybind11::arg("bias"), pybind11::arg("isa") = best_isa(), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("dequantize_packed", &dequantize_packed, "the weight of an int8 or int4 layer into oneDNN's packed bf16 layout",
        pybind11::arg("w"), pybind11::arg("scales"), pybind11::arg("offsets"), pybind11::arg("out"),
        pybind11::arg("isa") = best_isa(), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("dequantize", &dequantize, "the weight of an int8 or int4 layer in dtype", pybind11::arg("w"),
        pybind11::arg("scales"), pybind11::arg("offsets"), pybind11::arg("dtype"), pybind11::arg("isa") = best_isa(),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("w4a8_linear", &w4a8_linear, "x W^T (+ b) with int4 weights and x quantised to int8 per block of 32",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("scales"), pybind11::arg("offsets"),
        pybind11::arg("bias"), pybind11::arg("isa") = best_isa(), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("w8a8_linear", &w8a8_linear, "x W^T (+ b) with int8 weights and x quantised per row to int8",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("scales"), pybind11::arg("bias"),
        pybind11::arg("rotate") = false, pybind11::arg("isa") = best_isa(),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("w8a8_packed_linear", &w8a8_packed_linear, "w8a8_linear with the weight in oneDNN's packed int8 blocks",
        pybind11::arg("x"), pybind11::arg("blocks"), pybind11::arg("column_sums"), pybind11::arg("scales"),
        pybind11::arg("bias"), pybind11::arg("rotate"), pybind11::arg("tiles") = false,
        pybind11::arg("silu_table") = pybind11::none(), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("w8_int16_packed_linear", &w8_int16_packed_linear,
        "x quantised per row to 16-bit codes times int8 W in oneDNN's packed blocks (+ b)", pybind11::arg("x"),
        pybind11::arg("blocks"), pybind11::arg("column_sums"), pybind11::arg("scales"), pybind11::arg("bias"),
        pybind11::arg("tiles") = false, pybind11::arg("silu_table") = pybind11::none(),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("quantize_rows_int16_bytes", &quantize_rows_int16_bytes,
        "x's rows quantised to 16-bit codes, as (high bytes + 128, low bytes + 128, scales)", pybind11::arg("x"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("has_packed_w8a8", &has_packed_w8a8, "whether w8a8_packed_linear was compiled in (AVX512-VNNI)");
  m.def("has_w8a8_tiles", &has_w8a8_tiles, "whether the packed W8A8 products can run on brgemm's tiles (tiles=True)");
  m.def("has_w8a8_amx", &has_w8a8_amx, "whether tiles=True runs folio's AMX tile loop (where K % 64 == 0)");
  m.def("quantize_rows_unsigned", &quantize_rows_unsigned, "x's rows as W8A8 quantises them, codes + 128 as uint8",
        pybind11::arg("x"), pybind11::arg("rotate"), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("scale_rows", &scale_rows, "out = y times each row's scale (+ bias)", pybind11::arg("y"),
        pybind11::arg("row_scales"), pybind11::arg("bias"), pybind11::arg("out"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("isas", &isas, "instruction sets compiled in: 0 scalar, 1 AVX2+FMA, 2 AVX-512 (BW; VNNI when the CPU has it)");
}
