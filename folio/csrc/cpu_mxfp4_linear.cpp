// MXFP4 weights (OCP microscaling FP4: GPT-OSS's experts) times float activations: y = x W^T (+ b), float32 sums.
//
// Weight format (folio.models.mxfp4, as checkpoints store it): blocks uint8 [N, K / 32, 16], per row and block of 32
// values 16 bytes of E2M1 codes, byte j holding value 2j in its low nibble and 2j + 1 in its high one; scales uint8
// [N, K / 32], one E8M0 exponent per block: W[n, k] = FP4[code] * 2^(s - 127). Every such value is a float32 (and a
// bf16) value, so decoding is exact and y differs from F.linear on the dequantised weight only in the order of its
// float32 sums.
//
// Decode reads every weight once per token: 17 bytes per 32 values against bf16's 64, so a memory-bound step reads
// about a quarter of the bytes. Per block and output row the table of FP4 values is scaled by the block's
// power of two once (exact), and the codes index it in registers:
//   AVX2: 8 values from 4 bytes broadcast and shifted right by 0, 4, .., 28 per 32-bit lane; vpermps takes the
//         low three bits (the magnitude) from the table of the 8 magnitudes, and the sign, shifted left to bit 31,
//         is xored in (one shuffle per 8 values: a positive and a negative table blended by the sign took two; on
//         Zen 3, one thread, a 2880 x 2880 layer at batch 1, 0.92-1.16 ms here against 1.25-1.40 with the blend).
//   AVX-512: 16 values from 8 bytes (each 4-byte word to 8 lanes, shifted likewise); vpermps on 16 lanes takes the
//         low four bits, sign included, from one table.
//   Scalar: the table per value.
// Each decoded vector is multiplied by up to MAX_MR rows of x (FMAs into per-row accumulators), so a weight row is
// read from memory once per call and from L1 for the further chunks of rows; a task is ROWS_PER_TASK output rows,
// whose weights (about 50 KB at K = 2880) stay in L2 while every chunk of x's rows passes over them.
//
// Instruction sets: one template over the ISA (Scalar, Avx2, Avx512); every one this -march=native build has is
// compiled and `isas()` lists them, best last, so tests run each one.
#include "parallel.h"
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#define FOLIO_AVX2 1
#include <immintrin.h>
#else
#define FOLIO_AVX2 0
#endif
#if defined(__AVX512F__)
#define FOLIO_AVX512 1
#else
#define FOLIO_AVX512 0
#endif

namespace {

enum Isa : int { SCALAR = 0, AVX2 = 1, AVX512 = 2 };
constexpr int64_t BLOCK = 32;         // values per scale
constexpr int64_t BLOCK_BYTES = 16;   // their codes
constexpr int64_t ROWS_PER_TASK = 32;  // output rows per task of the threads
constexpr int MAX_MR = 8;             // rows of x per pass over a weight row (accumulators in registers)
constexpr float FP4[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                           -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// 2^(s - 127) for each E8M0 byte, as torch.ldexp computes it (s = 0: the subnormal 2^-127; s = 255: inf).
const std::array<float, 256>& scale_values() {
  static const std::array<float, 256> values = [] {
    std::array<float, 256> v{};
    for (int s = 0; s < 256; ++s) v[s] = std::ldexp(1.0f, s - 127);
    return v;
  }();
  return values;
}

struct Scalar {
  using V = float;
  static constexpr int PER_BLOCK = 32;  // vectors per block of 32 values
  struct Lut {
    float v[16];
  };
  static Lut lut(float s) {
    Lut l;
    for (int i = 0; i < 16; ++i) l.v[i] = FP4[i] * s;
    return l;
  }
  static V decode(const Lut& l, const uint8_t* q, int j) { return l.v[(q[j >> 1] >> ((j & 1) * 4)) & 15]; }
  static V zero() { return 0.0f; }
  static V load(const float* x, int j) { return x[j]; }
  static void store(float* y, int j, V v) { y[j] = v; }
  static V fma(V a, V b, V c) { return std::fma(a, b, c); }
  static V add(V a, V b) { return a + b; }
  static float sum(V v) { return v; }
};

#if FOLIO_AVX2
struct Avx2 {
  using V = __m256;
  static constexpr int PER_BLOCK = 4;
  struct Lut {
    __m256 magnitudes;
  };
  static Lut lut(float s) {
    return {_mm256_mul_ps(_mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f), _mm256_set1_ps(s))};
  }
  // Values 8j .. 8j + 7 of the block: nibble i of bytes 4j .. 4j + 3 (low nibble first) in lane i, its magnitude by
  // vpermps (bits 0-2 after shifting right by 4i), its sign (bit 4i + 3) shifted left to bit 31 and xored in.
  static V decode(const Lut& l, const uint8_t* q, int j) {
    int32_t word;
    std::memcpy(&word, q + 4 * j, 4);
    const __m256i w = _mm256_set1_epi32(word);
    const __m256i codes = _mm256_srlv_epi32(w, _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    const __m256i signs = _mm256_sllv_epi32(w, _mm256_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0));
    return _mm256_xor_ps(_mm256_permutevar8x32_ps(l.magnitudes, codes),
                         _mm256_and_ps(_mm256_castsi256_ps(signs), _mm256_set1_ps(-0.0f)));
  }
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* x, int j) { return _mm256_loadu_ps(x + 8 * j); }
  static void store(float* y, int j, V v) { _mm256_storeu_ps(y + 8 * j, v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static float sum(V v) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
  }
};
#endif

#if FOLIO_AVX512
struct Avx512 {
  using V = __m512;
  static constexpr int PER_BLOCK = 2;
  struct Lut {
    __m512 v;
  };
  static Lut lut(float s) { return {_mm512_mul_ps(_mm512_loadu_ps(FP4), _mm512_set1_ps(s))}; }
  // Values 16j .. 16j + 15: word 0 of bytes 8j .. 8j + 7 in lanes 0-7, word 1 in lanes 8-15, shifted to nibble i % 8.
  static V decode(const Lut& l, const uint8_t* q, int j) {
    const __m512i words = _mm512_castsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * j)));
    const __m512i spread = _mm512_permutexvar_epi32(
        _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), words);
    const __m512i codes = _mm512_srlv_epi32(
        spread, _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28));
    return _mm512_permutexvar_ps(codes, l.v);
  }
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* x, int j) { return _mm512_loadu_ps(x + 16 * j); }
  static void store(float* y, int j, V v) { _mm512_storeu_ps(y + 16 * j, v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
};
#endif

struct Weight {
  const uint8_t* blocks;  // [N, G, 16]
  const uint8_t* scales;  // [N, G]
  int64_t N, K, G;
};

// out[m] = x[m] . W[n] for MR rows of x (row stride xs). With few rows, several accumulators per row take
// alternate vectors of a block, so that enough FMA chains run at once to hide their latency.
template <class I, int MR>
void dot_rows(const Weight& w, int64_t n, const float* x, int64_t xs, float* out) {
  constexpr int SETS = std::min(4, std::max(1, I::PER_BLOCK / MR));
  const uint8_t* q = w.blocks + n * w.G * BLOCK_BYTES;
  const uint8_t* s = w.scales + n * w.G;
  const auto& scales = scale_values();
  typename I::V acc[MR][SETS];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < SETS; ++t) acc[m][t] = I::zero();
  for (int64_t g = 0; g < w.G; ++g) {
    const auto lut = I::lut(scales[s[g]]);
    const uint8_t* qb = q + g * BLOCK_BYTES;
    const float* xb = x + g * BLOCK;
    for (int j = 0; j < I::PER_BLOCK; ++j) {
      const typename I::V v = I::decode(lut, qb, j);
      for (int m = 0; m < MR; ++m) acc[m][j % SETS] = I::fma(v, I::load(xb + m * xs, j), acc[m][j % SETS]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    typename I::V total = acc[m][0];
    for (int t = 1; t < SETS; ++t) total = I::add(total, acc[m][t]);
    out[m] = I::sum(total);
  }
}

template <class I, int MR = MAX_MR>
void dot_rows_upto(int mr, const Weight& w, int64_t n, const float* x, int64_t xs, float* out) {
  if constexpr (MR > 1) {
    if (mr < MR) return dot_rows_upto<I, MR - 1>(mr, w, n, x, xs, out);
  }
  dot_rows<I, MR>(w, n, x, xs, out);
}

template <class I>
void linear_rows(const Weight& w, const float* x, int64_t M, const float* bias, float* y) {
  const folio::BlockStream streams[] = {{w.blocks, ROWS_PER_TASK * w.G * BLOCK_BYTES}, {w.scales, ROWS_PER_TASK * w.G}};
  const int64_t tasks = (w.N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
  folio::parallel_blocks(w.blocks, tasks, streams, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n1 = std::min(w.N, (t + 1) * ROWS_PER_TASK);
      for (int64_t m0 = 0; m0 < M; m0 += MAX_MR) {
        const int mr = static_cast<int>(std::min<int64_t>(MAX_MR, M - m0));
        for (int64_t n = t * ROWS_PER_TASK; n < n1; ++n) {
          float sums[MAX_MR];
          dot_rows_upto<I>(mr, w, n, x + m0 * w.K, w.K, sums);
          for (int m = 0; m < mr; ++m) y[(m0 + m) * w.N + n] = bias ? sums[m] + bias[n] : sums[m];
        }
      }
    }
  });
}

template <class I>
void dequantize_rows(const Weight& w, float* out) {
  const auto& scales = scale_values();
  folio::parallel_for(0, w.N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t g = 0; g < w.G; ++g) {
        const auto lut = I::lut(scales[w.scales[n * w.G + g]]);
        const uint8_t* qb = w.blocks + (n * w.G + g) * BLOCK_BYTES;
        for (int j = 0; j < I::PER_BLOCK; ++j) I::store(out + n * w.K + g * BLOCK, j, I::decode(lut, qb, j));
      }
  });
}

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

Weight weight_of(const at::Tensor& blocks, const at::Tensor& scales) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && scales.scalar_type() == at::kByte,
              "MXFP4 blocks and scales must be uint8");
  TORCH_CHECK(blocks.dim() == 3 && blocks.size(2) == BLOCK_BYTES && scales.dim() == 2 &&
                  scales.size(0) == blocks.size(0) && scales.size(1) == blocks.size(1),
              "MXFP4 blocks must be [N, G, 16] and scales [N, G]");
  TORCH_CHECK(blocks.is_contiguous() && scales.is_contiguous(), "MXFP4 blocks and scales must be contiguous");
  const int64_t G = blocks.size(1);
  return {blocks.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), blocks.size(0), G * BLOCK, G};
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& scales,
                  const c10::optional<at::Tensor>& bias, int64_t isa) {
  const Weight w = weight_of(blocks, scales);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.K, "x must be [M, ", w.K, "]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bf16");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == w.N,
                "bias must be float32 [", w.N, "]");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({x.size(0), w.N}, xf.options());
  by_isa(isa, [&](auto v) { linear_rows<decltype(v)>(w, xf.data_ptr<float>(), x.size(0), b, y.data_ptr<float>()); });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

at::Tensor dequantize(const at::Tensor& blocks, const at::Tensor& scales, int64_t isa) {
  const Weight w = weight_of(blocks, scales);
  at::Tensor out = at::empty({w.N, w.K}, blocks.options().dtype(at::kFloat));
  by_isa(isa, [&](auto v) { dequantize_rows<decltype(v)>(w, out.data_ptr<float>()); });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  folio::bind_decode_threads(m);
  m.def("linear", &linear, "x W^T (+ b) with W in MXFP4, float32 sums, in x's dtype (float32 or bf16)",
        pybind11::arg("x"), pybind11::arg("blocks"), pybind11::arg("scales"), pybind11::arg("bias"),
        pybind11::arg("isa") = best_isa(), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("dequantize", &dequantize, "the MXFP4 weight [N, K] in float32", pybind11::arg("blocks"),
        pybind11::arg("scales"), pybind11::arg("isa") = best_isa(),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("isas", &isas, "instruction sets compiled in: 0 scalar, 1 AVX2+FMA, 2 AVX-512");
}
