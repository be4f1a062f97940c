// int4 weight-only linear layers with the weight in column blocks: for bf16 activations on AVX512-BF16, and
// for float32 ones on AVX2.
//
// Decode reads every weight once per token, so a 4-bit weight should take a quarter of bf16's time. The
// row-major int4 kernel (cpu_quant_linear.cpp) did not get there: per 32 values it widened the nibbles with a
// table permute, ran one vdpbf16ps and then an FMA for the group's scale and a horizontal sum per output, and
// streamed 15 GB/s where bf16's small-batch kernel streams 43 (on AVX2, widening to float32: 6.5 GB/s where
// float32's GEMM streams 13). Here the weight is laid out as that bf16 kernel reads oneDNN's (packed once at
// load by `pack`, from the row-major format):
//
//   codes   uint8 [N / 64, K / 2, 64]: per block of 64 output columns and pair of K (k = 2p, 2p + 1), 64 bytes
//           as 32 16-bit words; word i holds 4 nibbles, nibble v (bits 4v .. 4v + 3) the code of column
//           16v + i / 2 at k = 2p + i % 2. Columns past N in the last block are zero.
//   scales  [N / 64, K / G, 64]: 16 times each group's scale; offsets alike. For bf16 x in float16 (as GGUF's
//           Q4_0 and Q4_1 store them: 0.625 bytes per weight in groups of 32, where float32 took 0.75; Q4_K's
//           products of a scale and an integer round to within 2^-12, below bf16's resolution); for float32 x
//           in float32, which every format's scales are exact in.
//
// bf16 x: one 64-byte load gives four vectors of 32 bf16 values, each by one shift and one ternary-logic op: the
// bf16 with the exponent of 1 and the code in the top four bits of the mantissa is c = 1 + q / 16, exact.
// A pair of x's values broadcast as one 32-bit lane times such a vector adds to 16 columns' sums
// (vdpbf16ps, products exact, sums in float32), so no sum is reduced across lanes. Per group g and column,
// W = s q + o = 16 s (c - 1) + o, so
//     y += 16 s (sum_k x_k c_k - X_g) + o X_g,   X_g = sum of x over the group,
// two FMAs per 16 columns per group. Rows of x go in chunks of up to 4, a block read from memory for the
// first chunk and from cache for the others. (float32 x: see block_int16.)
//
// Batches that run the dense GEMM (bf16 only) take the weight (q s + o by one FMA in float32, rounded once to
// bf16) written into oneDNN's packed layout (`dequantize_packed`), or as W^T [K, N] (`dequantize_transposed`).
#include "parallel.h"
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define FOLIO_INT4_BLOCKS 1
#else
#define FOLIO_INT4_BLOCKS 0
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define FOLIO_INT4_F32 1
#else
#define FOLIO_INT4_F32 0
#endif
#if FOLIO_INT4_BLOCKS || FOLIO_INT4_F32
#include <immintrin.h>
#endif
#include "int16_codes.h"
#include "int16_tiles.h"

namespace {

constexpr int64_t COLUMNS = 64;      // output columns per block
constexpr int64_t STEP_BYTES = 64;   // the codes of one pair of K for a block
// Bytes of codes ahead of the current step (4 groups of 32), and groups ahead of the current one whose float16
// scales and offsets (two lines each, in arrays of their own) the bf16 kernel prefetches: past the block's last
// group, the next block's first. Batch-1 decode of the 0.5B Qwen2 in int4 (groups of 32) on Zen 4, steps
// alternating with variants of the kernel: the scales 4 groups ahead 3.7-5.5 % faster in three runs (2 ahead
// 5.1 %, 8 ahead 2-2.8 %); then the codes 4 KiB ahead rather than 2 KiB 2.0-6.9 % in two more (8 KiB 3.6-4 %).
constexpr int64_t PREFETCH = 4096;
constexpr int64_t SCALE_GROUPS_AHEAD = 4;
constexpr int64_t PREFETCH_AVX2 = 2048;  // the float32 (AVX2) kernel's: 2 KiB, as measured on Zen 3 when written
constexpr int MAX_CHUNK = 4;         // rows of x per pass over a block

struct Blocks {
  const uint8_t* codes;     // [NB, K / 2, 64]
  const void* scales;       // [NB, ng, 64], 16 x the group's scale: float16 for bf16 x, float32 for float32 x
  const void* offsets;      // [NB, ng, 64], the same dtype
  bool half;                // whether scales and offsets are float16
  int64_t N, K, G, ng;
  int64_t pairs() const { return K / 2; }
  template <class S>
  const S* scales_of(int64_t b) const { return static_cast<const S*>(scales) + b * ng * COLUMNS; }
  template <class S>
  const S* offsets_of(int64_t b) const { return static_cast<const S*>(offsets) + b * ng * COLUMNS; }
};

#if FOLIO_INT4_BLOCKS
// 16 float16 values as float32
inline __m512 halves(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The four vectors of one step's codes as bf16 1 + q / 16 (see above).
inline void unpack(const uint8_t* p, __m512bh (&c)[4]) {
  const __m512i w = _mm512_loadu_si512(p);
  const __m512i mask = _mm512_set1_epi16(0x78), one = _mm512_set1_epi16(0x3F80);
  // nibble v's lowest bit (4v) to bit 3, then (s & mask) | one
  c[0] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_slli_epi16(w, 3), mask, one, 0xEA);
  c[1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 1), mask, one, 0xEA);
  c[2] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 5), mask, one, 0xEA);
  c[3] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 9), mask, one, 0xEA);
}

// Rows m .. m + MR of y for the 64 columns of block b (MR <= 4: the 4 MR accumulators fit the 32 vector
// registers with the codes; the per-column totals, updated once a group, stay in L1). With one row, two
// accumulator sets take alternate pairs, so that 8 chains hide vdpbf16ps's latency. Measured on Zen 5 against
// chunks of 3 rows with the totals in registers: the same at 1-3 rows, 1.03-1.17x at 4-64; chunks of 6 rows
// lost 4-16 % from 8 rows on.
template <int MR>
void block(const Blocks& w, int64_t b, const c10::BFloat16* x, int64_t xs, const float* xsum, const float* bias,
           c10::BFloat16* y, int64_t ys) {
  constexpr int SETS = MR == 1 ? 2 : 1;
  const int64_t gp = w.G / 2;  // pairs per group, a multiple of 16
  const uint8_t* codes = w.codes + b * w.pairs() * STEP_BYTES;
  const at::Half* sc = w.scales_of<at::Half>(b);
  const at::Half* of = w.offsets_of<at::Half>(b);
  const int32_t* xp[MR];
  for (int m = 0; m < MR; ++m) xp[m] = reinterpret_cast<const int32_t*>(x + m * xs);
  alignas(64) float tot[MR][4][16];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 4; ++v) _mm512_store_ps(tot[m][v], _mm512_setzero_ps());
  for (int64_t g = 0; g < w.ng; ++g) {
    for (int line = 0; line < 2; ++line) {  // 64 float16 values a group: two cache lines of each
      _mm_prefetch(reinterpret_cast<const char*>(sc + (g + SCALE_GROUPS_AHEAD) * COLUMNS) + 64 * line, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(of + (g + SCALE_GROUPS_AHEAD) * COLUMNS) + 64 * line, _MM_HINT_T0);
    }
    __m512 acc[SETS][MR][4];
    for (int s = 0; s < SETS; ++s)
      for (int m = 0; m < MR; ++m)
        for (int v = 0; v < 4; ++v) acc[s][m][v] = _mm512_setzero_ps();
    for (int64_t p = g * gp; p < (g + 1) * gp; p += SETS)
      for (int s = 0; s < SETS; ++s) {
        const uint8_t* step = codes + (p + s) * STEP_BYTES;
        _mm_prefetch(reinterpret_cast<const char*>(step + PREFETCH), _MM_HINT_T0);
        __m512bh c[4];
        unpack(step, c);
        for (int m = 0; m < MR; ++m) {
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(xp[m][p + s]);
          for (int v = 0; v < 4; ++v) acc[s][m][v] = _mm512_dpbf16_ps(acc[s][m][v], c[v], xv);
        }
      }
    for (int m = 0; m < MR; ++m) {
      const __m512 xg = _mm512_set1_ps(xsum[m * w.ng + g]);
      for (int v = 0; v < 4; ++v) {
        __m512 a = acc[0][m][v];
        for (int s = 1; s < SETS; ++s) a = _mm512_add_ps(a, acc[s][m][v]);
        const __m512 t = _mm512_fmadd_ps(_mm512_sub_ps(a, xg), halves(sc + g * COLUMNS + v * 16),
                                         _mm512_load_ps(tot[m][v]));
        _mm512_store_ps(tot[m][v], _mm512_fmadd_ps(halves(of + g * COLUMNS + v * 16), xg, t));
      }
    }
  }
  for (int v = 0; v < 4; ++v) {
    const int64_t n0 = b * COLUMNS + v * 16;
    const int64_t lanes = std::min<int64_t>(16, w.N - n0);
    if (lanes <= 0) break;
    const __mmask16 mask = lanes == 16 ? __mmask16(0xffff) : __mmask16((1u << lanes) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m)
      _mm256_mask_storeu_epi16(y + m * ys + n0, mask,
                               (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(tot[m][v]), bv)));
  }
}

void chunk(int64_t mr, const Blocks& w, int64_t b, const c10::BFloat16* x, int64_t xs, const float* xsum,
           const float* bias, c10::BFloat16* y, int64_t ys) {
  static_assert(MAX_CHUNK == 4, "one case per row count");
  switch (mr) {
    case 1: return block<1>(w, b, x, xs, xsum, bias, y, ys);
    case 2: return block<2>(w, b, x, xs, xsum, bias, y, ys);
    case 3: return block<3>(w, b, x, xs, xsum, bias, y, ys);
    default: return block<4>(w, b, x, xs, xsum, bias, y, ys);
  }
}

// Sums of each row of x over each group: xsum [M, ng], float32.
void group_sums(const c10::BFloat16* x, int64_t xs, int64_t M, int64_t K, int64_t G, float* xsum) {
  const int64_t ng = K / G;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < ng; ++g) {
      __m512 s = _mm512_setzero_ps();
      for (int64_t k = g * G; k < (g + 1) * G; k += 16)
        s = _mm512_add_ps(s, _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(
                                 reinterpret_cast<const __m256i*>(x + m * xs + k))));
      xsum[m * ng + g] = _mm512_reduce_add_ps(s);
    }
}
#endif

#if FOLIO_INT4_F32
// ------------------------------------------------------------------------------------------ float32 x
// The same blocks times float32 x on AVX2, each row of x first quantised to 16-bit codes (q_x = round(x *
// INT16_CODE_MAX / max |x|), s_x = max |x| / INT16_CODE_MAX: span_scale.h, as quant_reference.quantize_rows_int16),
// so that the products are integer ones:
// vpmaddwd multiplies 16 pairs of int16 and adds adjacent pairs into 8 int32 lanes in one instruction, where float32
// needed a conversion and an FMA per 8 products (Zen 3, one thread, a block in cache: 13.4 against 17.3 ns a step at
// 2 rows; at one row from memory both are bound by memory). Read as eight 32-bit lanes, the half h of a step (bytes
// 32 h .. 32 h + 31) holds in lane j the codes of column 16 v + 8 h + j (v = 0..3) at k = 2p (nibble v of the low
// word) and at 2p + 1 (of the high word): nibble v of both words isolated in place gives the pair (q_2p, q_2p+1)
// times f_v (1, 16, 16, 1 for v = 0..3: one AND, one AND, a shift and an AND, one shift), and vpmaddwd by x's codes
// at (2p, 2p + 1), broadcast as one 32-bit lane, adds f_v (q_2p q_x,2p + q_2p+1 q_x,2p+1) to column j's int32 sum,
// exactly. Per group, and per 64 pairs within a longer one (so that no sum exceeds 64 * 2 * 240 * 32639 < 2^31),
//     y += s_x s 2^-4 / f_v * float(sum) + o X_g,   X_g = the float32 sum of x over the group.
// The codes of x cost 2^-16 of its row's largest value: far below int4's rounding of the weight (2^-4 of the
// group's range), and llama.cpp's CPU kernels round activations to 8 bits for the same product.

constexpr int64_t MAX_SUM_PAIRS = 64;      // pairs summed in int32 before a float32 update

// Batches of one or two rows (int16_tiles.h takes larger ones, with the same arithmetic): rows m .. m + MR of y
// for the 32 HP columns in halves h0 .. h0 + HP - 1 of block b's steps. One row takes both halves in one pass
// (8 accumulators), two rows one half at a time (the second half's codes then come from the L1 or L2 cache), so
// that the accumulators, masks and codes fit AVX2's 16 registers. xq: each row's codes as 32-bit pairs, sx: each
// row's scale.
template <int MR, int HP>
void block_int16(const Blocks& w, int64_t b, int h0, const int32_t* const* xq, const float* sx, const float* xsum,
                 const float* bias, float* y, int64_t ys) {
  constexpr int NV = 4 * HP;  // vectors of 8 columns: (h, v) at NV index 4 h + v
  const int64_t gp = w.G / 2, run = std::min(gp, MAX_SUM_PAIRS);
  const uint8_t* codes = w.codes + b * w.pairs() * STEP_BYTES + 32 * h0;
  const float* sc = w.scales_of<float>(b);
  const float* of = w.offsets_of<float>(b);
  const __m256i low = _mm256_set1_epi16(0x000F), high = _mm256_set1_epi16(0x00F0);
  __m256 unit[MR][4];  // s_x 2^-4 / f_v
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 4; ++v) unit[m][v] = _mm256_set1_ps(sx[m] * (v == 1 || v == 2 ? 1.f / 256 : 1.f / 16));
  alignas(32) float tot[MR][NV][8];
  for (int m = 0; m < MR; ++m)
    for (int i = 0; i < NV; ++i) _mm256_store_ps(tot[m][i], _mm256_setzero_ps());
  for (int64_t g = 0; g < w.ng; ++g) {
    for (int64_t p0 = g * gp, end = (g + 1) * gp; p0 < end; p0 += run) {
      __m256i acc[MR][NV];
      UNROLL for (int m = 0; m < MR; ++m)
        UNROLL for (int i = 0; i < NV; ++i) acc[m][i] = _mm256_setzero_si256();
      for (int64_t p = p0; p < std::min(p0 + run, end); ++p) {
        const uint8_t* step = codes + p * STEP_BYTES;
        if (h0 == 0) _mm_prefetch(reinterpret_cast<const char*>(step + PREFETCH_AVX2), _MM_HINT_T0);
        __m256i xv[MR];
        UNROLL for (int m = 0; m < MR; ++m) xv[m] = _mm256_set1_epi32(xq[m][p]);
        UNROLL for (int h = 0; h < HP; ++h) {
          const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(step + 32 * h));
          const __m256i q[4] = {_mm256_and_si256(c, low), _mm256_and_si256(c, high),
                                _mm256_and_si256(_mm256_srli_epi16(c, 4), high), _mm256_srli_epi16(c, 12)};
          UNROLL for (int v = 0; v < 4; ++v)
            UNROLL for (int m = 0; m < MR; ++m)
              acc[m][4 * h + v] = _mm256_add_epi32(acc[m][4 * h + v], _mm256_madd_epi16(q[v], xv[m]));
        }
      }
      for (int h = 0; h < HP; ++h)
        for (int v = 0; v < 4; ++v) {
          const __m256 s = _mm256_loadu_ps(sc + g * COLUMNS + 16 * v + 8 * (h0 + h));
          for (int m = 0; m < MR; ++m)
            _mm256_store_ps(tot[m][4 * h + v], _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][4 * h + v]),
                                                               _mm256_mul_ps(s, unit[m][v]),
                                                               _mm256_load_ps(tot[m][4 * h + v])));
        }
    }
    for (int h = 0; h < HP; ++h)
      for (int v = 0; v < 4; ++v) {
        const __m256 o = _mm256_loadu_ps(of + g * COLUMNS + 16 * v + 8 * (h0 + h));
        for (int m = 0; m < MR; ++m)
          _mm256_store_ps(tot[m][4 * h + v], _mm256_fmadd_ps(o, _mm256_set1_ps(xsum[m * w.ng + g]),
                                                             _mm256_load_ps(tot[m][4 * h + v])));
      }
  }
  for (int h = 0; h < HP; ++h)
    for (int v = 0; v < 4; ++v) {
      const int64_t n0 = b * COLUMNS + 16 * v + 8 * (h0 + h);
      const int64_t lanes = std::min<int64_t>(8, w.N - n0);
      if (lanes <= 0) continue;  // (vectors run over columns 16 v + 8 h: not in increasing order)
      for (int m = 0; m < MR; ++m) {
        const float* t = tot[m][4 * h + v];
        float* dst = y + m * ys + n0;
        for (int64_t i = 0; i < lanes; ++i) dst[i] = bias ? t[i] + bias[n0 + i] : t[i];
      }
    }
}

// The blocks as int16_tiles.h decodes them: nibble v of a step's half h, plain (0 .. 15), is tile vector 2v + h
// (columns 16v + 8h .. 16v + 8h + 7). The scales are 16 times the group's: unit(s_x) = s_x / 16.
static_assert(COLUMNS == TILE_COLUMNS, "a block is a tile's width");
struct Int4Tiles : TileShape {
  static constexpr int64_t max_run = MAX_SUM_PAIRS;
  const Blocks& w;
  explicit Int4Tiles(const Blocks& blocks) : TileShape{blocks.N, blocks.G, blocks.ng}, w(blocks) {}
  float unit(float sx) const { return sx * (1.f / 16); }
  const float* scales(int64_t b, int64_t g) const { return w.scales_of<float>(b) + g * COLUMNS; }
  const float* offsets(int64_t b, int64_t g) const { return w.offsets_of<float>(b) + g * COLUMNS; }
  void decode(int64_t b, int64_t p0, int64_t np, int16_t* tile) const {
    const uint8_t* codes = w.codes + (b * w.pairs() + p0) * STEP_BYTES;
    const __m256i low = _mm256_set1_epi16(0x000F);
    for (int64_t p = 0; p < np; ++p) {
      _mm_prefetch(reinterpret_cast<const char*>(codes + (np + p) * STEP_BYTES), _MM_HINT_T0);  // the next run's
      for (int h = 0; h < 2; ++h) {
        const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + p * STEP_BYTES + 32 * h));
        __m256i* out = reinterpret_cast<__m256i*>(tile + p * TILE_PAIR_WORDS) + h;
        _mm256_store_si256(out, _mm256_and_si256(c, low));
        _mm256_store_si256(out + 2, _mm256_and_si256(_mm256_srli_epi16(c, 4), low));
        _mm256_store_si256(out + 4, _mm256_and_si256(_mm256_srli_epi16(c, 8), low));
        _mm256_store_si256(out + 6, _mm256_srli_epi16(c, 12));
      }
    }
  }
};

// Sums of each row of x over each group: xsum [M, ng], float32.
void group_sums_f32(const float* x, int64_t xs, int64_t M, int64_t K, int64_t G, float* xsum) {
  const int64_t ng = K / G;
  folio::parallel_for(0, M, PARALLEL_ROWS, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t g = 0; g < ng; ++g) {
        __m256 s = _mm256_setzero_ps();
        for (int64_t k = g * G; k < (g + 1) * G; k += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(x + m * xs + k));
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        xsum[m * ng + g] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
      }
  });
}
#endif

bool has_kernel() { return FOLIO_INT4_BLOCKS; }
bool has_f32_kernel() { return FOLIO_INT4_F32; }

Blocks checked(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets, int64_t N) {
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.size(2) == STEP_BYTES,
              "codes must be contiguous uint8 [N / 64, K / 2, 64]");
  const int64_t NB = codes.size(0), K = 2 * codes.size(1);
  const auto st = scales.scalar_type();
  TORCH_CHECK(scales.dim() == 3 && (st == at::kHalf || st == at::kFloat) && scales.is_contiguous() &&
                  scales.size(0) == NB && scales.size(2) == COLUMNS,
              "scales must be contiguous float16 or float32 [N / 64, K / G, 64]");
  TORCH_CHECK(offsets.sizes() == scales.sizes() && offsets.scalar_type() == st && offsets.is_contiguous(),
              "offsets must be shaped like scales, in their dtype");
  const int64_t ng = scales.size(1);
  TORCH_CHECK(ng >= 1 && K % ng == 0 && (K / ng) % 32 == 0, "K (", K, ") must be split in groups of a multiple of 32");
  TORCH_CHECK(N > (NB - 1) * COLUMNS && N <= NB * COLUMNS, "N (", N, ") must lie within the last block");
  return Blocks{codes.data_ptr<uint8_t>(), scales.data_ptr(), offsets.data_ptr(), st == at::kHalf, N, K, K / ng, ng};
}

// The blocks as a kernel for x in bf16 (float16 scales, AVX512-BF16) or float32 (float32 scales, AVX2) reads them.
Blocks checked_for(bool f32, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets, int64_t N) {
  const Blocks w = checked(codes, scales, offsets, N);
  TORCH_CHECK(f32 ? FOLIO_INT4_F32 : FOLIO_INT4_BLOCKS,
              f32 ? "built without AVX2 and FMA" : "built without AVX512-BF16");
  TORCH_CHECK(w.half != f32, f32 ? "float32 x takes blocks with float32 scales" : "bf16 x takes blocks with float16 scales");
  return w;
}

// The blocks of a weight in the row-major int4 format (cpu_quant_linear.cpp: packed uint8 [N, K / 2], 32
// values per 16 bytes, value j of a block in byte j's low nibble and j + 16 in its high one; scales and
// offsets float32 [N, K / G]): (codes, 16 x scales, offsets), the last two in float32 or (`half`) rounded to
// float16 (to nearest even, as torch rounds), padding columns zero.
std::vector<at::Tensor> pack(at::Tensor w, at::Tensor scales, at::Tensor offsets, bool half) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "w must be contiguous uint8 [N, K / 2]");
  const int64_t N = w.size(0), K = 2 * w.size(1);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  offsets.sizes() == scales.sizes() && offsets.scalar_type() == at::kFloat && offsets.is_contiguous(),
              "scales and offsets must be contiguous float32 [N, K / G]");
  const int64_t ng = scales.size(1), NB = (N + COLUMNS - 1) / COLUMNS;
  TORCH_CHECK(N >= 1 && ng >= 1 && K % ng == 0 && (K / ng) % 32 == 0, "K (", K, ") must be split in groups of a multiple of 32");
  at::Tensor codes = at::empty({NB, K / 2, STEP_BYTES}, w.options());
  at::Tensor block_scales = at::empty({NB, ng, COLUMNS}, scales.options().dtype(half ? at::kHalf : at::kFloat));
  at::Tensor block_offsets = at::empty_like(block_scales);
  void* bsp = block_scales.data_ptr();
  void* bop = block_offsets.data_ptr();
  const uint8_t* src = w.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* opp = offsets.data_ptr<float>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  const int64_t row_bytes = K / 2;
  folio::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      // each source row read once, in order; its codes or-ed into the block's words (little-endian uint16)
      uint16_t* words = reinterpret_cast<uint16_t*>(cp + b * (K / 2) * STEP_BYTES);
      std::fill(words, words + K * 32 / 2, uint16_t{0});
      for (int64_t c = 0; c < std::min(COLUMNS, N - b * COLUMNS); ++c) {
        const uint8_t* row = src + (b * COLUMNS + c) * row_bytes;
        const int v = static_cast<int>(c / 16), i0 = static_cast<int>(2 * (c % 16));
        for (int64_t k0 = 0; k0 < K; k0 += 32)
          for (int64_t j = 0; j < 16; ++j) {
            const uint8_t byte = row[k0 / 2 + j];
            for (const int64_t k : {k0 + j, k0 + 16 + j})  // low nibble: value j of the block, high: j + 16
              words[(k / 2) * 32 + i0 + k % 2] |= static_cast<uint16_t>(((k == k0 + j ? byte : byte >> 4) & 15) << (4 * v));
          }
      }
      for (int64_t g = 0; g < ng; ++g)
        for (int64_t c = 0; c < COLUMNS; ++c) {
          const int64_t col = b * COLUMNS + c, at = (b * ng + g) * COLUMNS + c;
          const float sv = col < N ? 16 * sp[col * ng + g] : 0.f, ov = col < N ? opp[col * ng + g] : 0.f;
          if (half) {
            static_cast<at::Half*>(bsp)[at] = at::Half(sv);
            static_cast<at::Half*>(bop)[at] = at::Half(ov);
          } else {
            static_cast<float*>(bsp)[at] = sv;
            static_cast<float*>(bop)[at] = ov;
          }
        }
    }
  });
  return {codes, block_scales, block_offsets};
}

// y = x W^T (+ bias) in x's dtype, x bf16 (AVX512-BF16 kernel) or float32 (AVX2 kernel) [M, K] with unit stride.
at::Tensor linear(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor offsets, int64_t N,
                  c10::optional<at::Tensor> bias) {
  const bool f32 = x.scalar_type() == at::kFloat;
  const int64_t K = codes.dim() == 3 ? 2 * codes.size(1) : -1;  // (checked_for says what is wrong with codes)
  TORCH_CHECK(x.dim() == 2 && (f32 || x.scalar_type() == at::kBFloat16) && x.stride(1) == 1 && x.size(1) == K &&
                  x.size(0) >= 1,
              "x must be bf16 or float32 [M, ", K, "] with unit stride");
  const Blocks w = checked_for(f32, codes, scales, offsets, N);
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "bias must be float32 [N]");
    bp = bias->data_ptr<float>();
  }
  const int64_t M = x.size(0), xs = x.stride(0);
  at::Tensor y = at::empty({M, N}, x.options());
  std::vector<float> xsum(M * w.ng);
#if FOLIO_INT4_F32
  if (f32) {
    const float* xp = x.data_ptr<float>();
    group_sums_f32(xp, xs, M, w.K, w.G, xsum.data());
    const Int16Rows rows(xp, xs, M, w.K);
    float* yp = y.data_ptr<float>();
    if (M >= TILE_MIN_ROWS) {
      tiled_linear(Int4Tiles(w), rows, M, xsum.data(), bp, yp);
      return y;
    }
    folio::parallel_for(0, codes.size(0), 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        int64_t m0 = 0;
        for (; m0 + 2 <= M; m0 += 2)
          for (int h0 = 0; h0 < 2; ++h0)
            block_int16<2, 1>(w, b, h0, rows.xq.data() + m0, rows.sx.data() + m0, xsum.data() + m0 * w.ng, bp,
                              yp + m0 * N, N);
        if (m0 < M)
          block_int16<1, 2>(w, b, 0, rows.xq.data() + m0, rows.sx.data() + m0, xsum.data() + m0 * w.ng, bp,
                            yp + m0 * N, N);
      }
    });
    return y;
  }
#endif
#if FOLIO_INT4_BLOCKS
  const auto* xp = x.data_ptr<c10::BFloat16>();
  group_sums(xp, xs, M, w.K, w.G, xsum.data());
  auto* yp = y.data_ptr<c10::BFloat16>();
  const int64_t scale_bytes = w.ng * COLUMNS * 2;  // float16
  const folio::BlockStream streams[] = {{w.codes, w.pairs() * STEP_BYTES}, {w.scales, scale_bytes},
                                        {w.offsets, scale_bytes}};
  folio::parallel_blocks(w.codes, codes.size(0), streams, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t m0 = 0; m0 < M; m0 += MAX_CHUNK)
        chunk(std::min<int64_t>(MAX_CHUNK, M - m0), w, b, xp + m0 * xs, xs, xsum.data() + m0 * w.ng, bp,
              yp + m0 * N, N);
  });
#endif
  return y;
}

#if FOLIO_INT4_BLOCKS
// Every weight of the blocks as float32, q s + o by one FMA (s the group's scale), handed 16 columns at a time:
// emit(p, n0, mask, even, odd) gets columns n0 .. n0 + 15 (mask: those below N) at k = 2p and 2p + 1. Read as 16
// 32-bit lanes, a step's 64 bytes hold in lane j the codes of column 16 v + j at k = 2p (nibble v of the low
// word) and 2p + 1 (of the high word). Blocks are spread over the threads.
template <class Emit>
void dequantized_columns(const Blocks& w, int64_t num_blocks, const Emit& emit) {
  const int64_t gp = w.G / 2;
  folio::parallel_for(0, num_blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* codes_b = w.codes + b * w.pairs() * STEP_BYTES;
      const int64_t nv = std::min<int64_t>(4, (w.N - b * COLUMNS + 15) / 16);  // vectors of columns in this block
      for (int64_t g = 0; g < w.ng; ++g) {
        __m512 s[4], o[4];
        for (int v = 0; v < nv; ++v) {
          s[v] = _mm512_mul_ps(halves(w.scales_of<at::Half>(b) + g * COLUMNS + v * 16), _mm512_set1_ps(1.f / 16));
          o[v] = halves(w.offsets_of<at::Half>(b) + g * COLUMNS + v * 16);
        }
        for (int64_t p = g * gp; p < (g + 1) * gp; ++p) {
          const __m512i codes_p = _mm512_loadu_si512(codes_b + p * STEP_BYTES);
          for (int v = 0; v < nv; ++v) {
            const int64_t n0 = b * COLUMNS + v * 16;
            const __mmask16 mask = w.N - n0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (w.N - n0)) - 1);
            const __m512i d = _mm512_srli_epi32(codes_p, 4 * v);
            const __m512i even = _mm512_and_si512(d, _mm512_set1_epi32(15));
            const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(d, 16), _mm512_set1_epi32(15));
            emit(p, n0, mask, _mm512_fmadd_ps(_mm512_cvtepi32_ps(even), s[v], o[v]),
                 _mm512_fmadd_ps(_mm512_cvtepi32_ps(odd), s[v], o[v]));
          }
        }
      }
    }
  });
}
#endif

// The transposed weight [K, N] in bf16 (as W^T it feeds the GEMM without a transpose), of blocks with float16
// scales: each value q s + o by one FMA, rounded once to bf16; each row of W^T gets 16 contiguous values per store.
// (float32 layers take the kernel at every batch size: int16_tiles.h.)
at::Tensor dequantize_transposed(at::Tensor codes, at::Tensor scales, at::Tensor offsets, int64_t N) {
  const Blocks w = checked_for(false, codes, scales, offsets, N);
  at::Tensor out = at::empty({w.K, N}, codes.options().dtype(at::kBFloat16));
#if FOLIO_INT4_BLOCKS
  auto* op = out.data_ptr<c10::BFloat16>();
  dequantized_columns(w, codes.size(0), [&](int64_t p, int64_t n0, __mmask16 mask, __m512 even, __m512 odd) {
    _mm256_mask_storeu_epi16(op + 2 * p * N + n0, mask, (__m256i)_mm512_cvtneps_pbh(even));
    _mm256_mask_storeu_epi16(op + (2 * p + 1) * N + n0, mask, (__m256i)_mm512_cvtneps_pbh(odd));
  });
#endif
  return out;
}

// The bf16 weight written into oneDNN's packed layout for its GEMM (folio.models.onednn_layout): out bf16
// [NB', K' / 2, W, 2], value (n, k) at [n / W][k / 2][n % W][k % 2], W a multiple of 16; the padding (k >= K,
// n >= N) is left as it is (oneDNN's zeros). The same values as dequantize_transposed. 16 columns of a block
// fall in one W block, each column's pair (k = 2p, 2p + 1) one 32-bit lane: 16 contiguous lanes per store.
void dequantize_packed(at::Tensor codes, at::Tensor scales, at::Tensor offsets, int64_t N, at::Tensor out) {
  const Blocks w = checked_for(false, codes, scales, offsets, N);
  TORCH_CHECK(out.dim() == 4 && out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.size(3) == 2 &&
                  out.size(2) % 16 == 0 && 2 * out.size(1) >= w.K && out.size(0) * out.size(2) >= N,
              "out must be contiguous bf16 [N' / W, K' / 2, W, 2] with W a multiple of 16, K' >= K, N' >= N");
#if FOLIO_INT4_BLOCKS
  uint32_t* op = reinterpret_cast<uint32_t*>(out.data_ptr<c10::BFloat16>());
  const int64_t W = out.size(2), half_kp = out.size(1);
  dequantized_columns(w, codes.size(0), [&](int64_t p, int64_t n0, __mmask16 mask, __m512 even, __m512 odd) {
    const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(even));
    const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(odd));
    _mm512_mask_storeu_epi32(op + ((n0 / W) * half_kp + p) * W + n0 % W, mask,
                             _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
  });
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  folio::bind_decode_threads(m);
  m.def("linear", &linear, "x W^T (+ b) for bf16 x, W int4 in column blocks", pybind11::arg("x"),
        pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("offsets"), pybind11::arg("N"),
        pybind11::arg("bias"), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("dequantize_transposed", &dequantize_transposed, "the bf16 weight of int4 blocks as [K, N]",
        pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("offsets"), pybind11::arg("N"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("dequantize_packed", &dequantize_packed, "the bf16 weight of int4 column blocks into oneDNN's packed layout",
        pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("offsets"), pybind11::arg("N"),
        pybind11::arg("out"), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("pack", &pack, "(codes, 16 x scales, offsets) of a row-major int4 weight", pybind11::arg("w"),
        pybind11::arg("scales"), pybind11::arg("offsets"), pybind11::arg("half"), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("has_kernel", &has_kernel, "whether the AVX512-BF16 kernel was compiled in");
  m.def("has_f32_kernel", &has_f32_kernel, "whether the float32 (AVX2) kernel was compiled in");
}
