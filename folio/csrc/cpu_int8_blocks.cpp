// int8 weight-only linear layers with the weight in column blocks, for float32 activations on AVX2.
//
// The row-major int8 kernel (cpu_quant_linear.cpp) widens every weight to float32 for each row of x and has
// no reuse across rows: on an AVX2 EPYC (Zen 3) the default model's 49152 x 576 lm_head took 2.1 ms at one row,
// 10.5 at 16 and 23 at 32, bound by widening, not by memory. Here each row of x is first rounded to 16-bit codes
// (int16_codes.h, as quant_reference.quantize_rows_int16) and the weight, packed once at load by `pack`, is laid
// out so that one 16-byte load sign-extended to 16-bit words holds the pairs (k = 2p, 2p + 1) of 8 columns:
//
//   codes   int8 [N / 64, K / 2, 128]: per block of 64 output columns and pair of K, column c's values at
//           k = 2p and 2p + 1 in bytes 2c and 2c + 1. Columns past N in the last block are zero.
//   scales  float32 [N / 64, K / G, 64]: each group's scale (G = K: one per output channel; 32: GGUF's Q8_0).
//
// vpmaddwd by x's codes at (2p, 2p + 1), broadcast as one 32-bit lane, adds q_2p x_2p + q_2p+1 x_2p+1 to 8
// columns' int32 sums exactly: 16 products per instruction. Per group, and per 256 pairs within a longer one
// (no sum exceeds 256 * 2 * 128 * 32639 < 2^31),
//     y += s_x s * float(sum).
// It runs every batch size: one or two rows widen a block's weights as they stream them, larger batches decode
// them once per panel of rows into int16_tiles.h's tiles (the same sums, bit for bit). 16 exact products per
// instruction beat MKL's float32 GEMM on the dequantised weight even at prefill sizes (Zen 3, 2 threads, before
// the tiles: the 49152 x 576 head at 1024 rows 421 against 685 ms, 576 x 3072 at 2048 rows 46 against 46).
#include "parallel.h"
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#define FOLIO_INT8_BLOCKS 1
#include <immintrin.h>
#else
#define FOLIO_INT8_BLOCKS 0
#endif
#include "int16_codes.h"
#include "int16_tiles.h"

namespace {

constexpr int64_t COLUMNS = 64;       // output columns per block
constexpr int64_t STEP_BYTES = 128;   // the codes of one pair of K for a block
constexpr int64_t PREFETCH = 2048;    // bytes of codes ahead of the current step
constexpr int64_t MAX_SUM_PAIRS = 256;  // pairs summed in int32 before a float32 update

struct Blocks {
  const int8_t* codes;  // [NB, K / 2, 128]
  const float* scales;  // [NB, ng, 64]
  int64_t N, K, G, ng;
  int64_t pairs() const { return K / 2; }
};

bool has_kernel() { return FOLIO_INT8_BLOCKS; }

Blocks checked(const at::Tensor& codes, const at::Tensor& scales, int64_t N) {
  TORCH_CHECK(FOLIO_INT8_BLOCKS, "built without AVX2 and FMA");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kChar && codes.is_contiguous() &&
                  codes.size(2) == STEP_BYTES,
              "codes must be contiguous int8 [N / 64, K / 2, 128]");
  const int64_t NB = codes.size(0), K = 2 * codes.size(1);
  TORCH_CHECK(scales.dim() == 3 && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.size(0) == NB && scales.size(2) == COLUMNS,
              "scales must be contiguous float32 [N / 64, K / G, 64]");
  const int64_t ng = scales.size(1);
  TORCH_CHECK(ng >= 1 && K % ng == 0 && (K / ng) % 32 == 0, "K (", K, ") must be split in groups of a multiple of 32");
  TORCH_CHECK(N > (NB - 1) * COLUMNS && N <= NB * COLUMNS, "N (", N, ") must lie within the last block");
  return Blocks{codes.data_ptr<int8_t>(), scales.data_ptr<float>(), N, K, K / ng, ng};
}

// The blocks of a row-major int8 weight (w int8 [N, K], scales float32 [N, K / G]): (codes, scales), padding
// columns zero.
std::vector<at::Tensor> pack(at::Tensor w, at::Tensor scales) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous(), "w must be contiguous int8 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "scales must be contiguous float32 [N, K / G]");
  const int64_t ng = scales.size(1), NB = (N + COLUMNS - 1) / COLUMNS;
  TORCH_CHECK(N >= 1 && ng >= 1 && K % ng == 0 && (K / ng) % 32 == 0, "K (", K, ") must be split in groups of a multiple of 32");
  at::Tensor codes = at::zeros({NB, K / 2, STEP_BYTES}, w.options());
  at::Tensor block_scales = at::zeros({NB, ng, COLUMNS}, scales.options());
  const int8_t* src = w.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  int8_t* cp = codes.data_ptr<int8_t>();
  float* bsp = block_scales.data_ptr<float>();
  folio::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t c = 0; c < std::min(COLUMNS, N - b * COLUMNS); ++c) {
        const int64_t col = b * COLUMNS + c;
        const int8_t* row = src + col * K;
        int8_t* dst = cp + b * (K / 2) * STEP_BYTES + 2 * c;
        for (int64_t p = 0; p < K / 2; ++p) {
          dst[p * STEP_BYTES] = row[2 * p];
          dst[p * STEP_BYTES + 1] = row[2 * p + 1];
        }
        for (int64_t g = 0; g < ng; ++g) bsp[(b * ng + g) * COLUMNS + c] = sp[col * ng + g];
      }
  });
  return {codes, block_scales};
}

#if FOLIO_INT8_BLOCKS
// The blocks as int16_tiles.h decodes them: a step's 16-byte vector i sign-extended is tile vector i.
static_assert(COLUMNS == TILE_COLUMNS, "a block is a tile's width");
struct Int8Tiles : TileShape {
  static constexpr int64_t max_run = MAX_SUM_PAIRS;
  const Blocks& w;
  explicit Int8Tiles(const Blocks& blocks) : TileShape{blocks.N, blocks.G, blocks.ng}, w(blocks) {}
  float unit(float sx) const { return sx; }
  const float* scales(int64_t b, int64_t g) const { return w.scales + (b * ng + g) * COLUMNS; }
  const float* offsets(int64_t, int64_t) const { return nullptr; }
  void decode(int64_t b, int64_t p0, int64_t np, int16_t* tile) const {
    const int8_t* codes = w.codes + (b * w.pairs() + p0) * STEP_BYTES;
    for (int64_t p = 0; p < np; ++p) {
      for (int l = 0; l < STEP_BYTES; l += 64)  // the next run's codes
        _mm_prefetch(reinterpret_cast<const char*>(codes + (np + p) * STEP_BYTES + l), _MM_HINT_T0);
      const auto* step = reinterpret_cast<const __m128i*>(codes + p * STEP_BYTES);
      auto* out = reinterpret_cast<__m256i*>(tile + p * TILE_PAIR_WORDS);
      for (int i = 0; i < 8; ++i) _mm256_store_si256(out + i, _mm256_cvtepi8_epi16(_mm_loadu_si128(step + i)));
    }
  }
};

// Batches of one or two rows (int16_tiles.h takes larger ones): rows m .. m + MR of y for the 32 HP columns in
// halves h0 .. h0 + HP - 1 of block b's steps. One row takes both halves in one pass (8 accumulators), two rows
// one half at a time (the second half's codes then come from the L1 or L2 cache), so that the accumulators fit
// AVX2's 16 registers. xq: each row's codes as 32-bit pairs, sx: each row's scale.
template <int MR, int HP>
void block(const Blocks& w, int64_t b, int h0, const int32_t* const* xq, const float* sx, const float* bias,
           float* y, int64_t ys) {
  constexpr int NV = 4 * HP;  // vectors of 8 columns: columns 32 (h0 + h) + 8 j at index 4 h + j
  const int64_t gp = w.G / 2, run = std::min(gp, MAX_SUM_PAIRS);
  const int8_t* codes = w.codes + b * w.pairs() * STEP_BYTES + 64 * h0;
  const float* sc = w.scales + b * w.ng * COLUMNS;
  alignas(32) float tot[MR][NV][8];
  for (int m = 0; m < MR; ++m)
    for (int i = 0; i < NV; ++i) _mm256_store_ps(tot[m][i], _mm256_setzero_ps());
  for (int64_t g = 0; g < w.ng; ++g) {
    __m256 unit[MR][NV];  // s s_x per column
    for (int i = 0; i < NV; ++i) {
      const __m256 s = _mm256_loadu_ps(sc + g * COLUMNS + 32 * h0 + 8 * i);
      for (int m = 0; m < MR; ++m) unit[m][i] = _mm256_mul_ps(s, _mm256_set1_ps(sx[m]));
    }
    for (int64_t p0 = g * gp, end = (g + 1) * gp; p0 < end; p0 += run) {
      __m256i acc[MR][NV];
      UNROLL for (int m = 0; m < MR; ++m)
        UNROLL for (int i = 0; i < NV; ++i) acc[m][i] = _mm256_setzero_si256();
      for (int64_t p = p0; p < std::min(p0 + run, end); ++p) {
        const int8_t* step = codes + p * STEP_BYTES;
        if (h0 == 0) _mm_prefetch(reinterpret_cast<const char*>(step + PREFETCH), _MM_HINT_T0);
        __m256i xv[MR];
        UNROLL for (int m = 0; m < MR; ++m) xv[m] = _mm256_set1_epi32(xq[m][p]);
        UNROLL for (int i = 0; i < NV; ++i) {
          const __m256i c = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(step + 16 * i)));
          UNROLL for (int m = 0; m < MR; ++m) acc[m][i] = _mm256_add_epi32(acc[m][i], _mm256_madd_epi16(c, xv[m]));
        }
      }
      for (int m = 0; m < MR; ++m)
        for (int i = 0; i < NV; ++i)
          _mm256_store_ps(tot[m][i], _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][i]), unit[m][i], _mm256_load_ps(tot[m][i])));
    }
  }
  for (int i = 0; i < NV; ++i) {
    const int64_t n0 = b * COLUMNS + 32 * h0 + 8 * i, lanes = std::min<int64_t>(8, w.N - n0);
    for (int m = 0; m < MR; ++m)
      for (int64_t l = 0; l < lanes; ++l) y[m * ys + n0 + l] = bias ? tot[m][i][l] + bias[n0 + l] : tot[m][i][l];
  }
}
#endif

// y = x W^T (+ float32 bias [N]) in float32, x float32 [M, K] with unit stride.
at::Tensor linear(at::Tensor x, at::Tensor codes, at::Tensor scales, int64_t N, c10::optional<at::Tensor> bias) {
  const Blocks w = checked(codes, scales, N);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) == w.K && x.size(0) >= 1,
              "x must be float32 [M, ", w.K, "] with unit stride");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "bias must be float32 [N]");
    bp = bias->data_ptr<float>();
  }
  const int64_t M = x.size(0), xs = x.stride(0);
  at::Tensor y = at::empty({M, N}, x.options());
#if FOLIO_INT8_BLOCKS
  const float* xp = x.data_ptr<float>();
  const Int16Rows rows(xp, xs, M, w.K);
  float* yp = y.data_ptr<float>();
  if (M >= TILE_MIN_ROWS) {
    tiled_linear(Int8Tiles(w), rows, M, nullptr, bp, yp);
    return y;
  }
  folio::parallel_for(0, codes.size(0), 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int64_t m0 = 0;
      for (; m0 + 2 <= M; m0 += 2)
        for (int h0 = 0; h0 < 2; ++h0)
          block<2, 1>(w, b, h0, rows.xq.data() + m0, rows.sx.data() + m0, bp, yp + m0 * N, N);
      if (m0 < M) block<1, 2>(w, b, 0, rows.xq.data() + m0, rows.sx.data() + m0, bp, yp + m0 * N, N);
    }
  });
#endif
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  folio::bind_decode_threads(m);
  m.def("linear", &linear, "x W^T (+ b) for float32 x, W int8 in column blocks", pybind11::arg("x"),
        pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("N"), pybind11::arg("bias"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("pack", &pack, "(codes, scales) of a row-major int8 weight", pybind11::arg("w"), pybind11::arg("scales"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("has_kernel", &has_kernel, "whether the AVX2 kernel was compiled in");
}
