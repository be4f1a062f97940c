// y = x W^T (+ b) for a handful of rows of x, in bf16 or float32, streaming W once at memory speed.
//
// Decoding one to a few sequences (or verifying a few speculated tokens of one) multiplies each weight matrix
// by a few vectors: the time is the time to read W. Each thread takes a contiguous range of output rows (one
// sequential stream of memory), and for each row n accumulates x[m] . W[n] for the M rows of x, so W is read
// once whatever M.
//
// bf16 (AVX512-BF16, K % 32 == 0, M <= MAX_M_BF16): oneDNN's bf16 GEMM reads its packed weights at 15-23 GB/s
// on a 2-core AVX512-BF16 machine, where this kernel reads plain row-major W at 25-31 GB/s. Products of bf16
// pairs with vdpbf16ps (exact, summed in float32), the bias added in float32, rounded to bf16 once (round to
// nearest even), as oneDNN does; the sums run in another order than oneDNN's, so results may differ from
// F.linear's in the last bf16 bit.
//
// float32 (AVX2+FMA or AVX-512F, any K, M <= MAX_M_F32): MKL's sgemm packs the whole weight matrix on every
// call with M >= 2 rows, so a 2-row product cost 2.3x a 1-row one and a 7-row one 2.9x (the 49152 x 576
// lm_head of SmolLM2 on an AVX2 EPYC: 14 ms, 33 ms, 41 ms); here W is read once, with FMAs in float32 (sums in
// another order than MKL's: results differ in the last bits).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define FOLIO_DPBF16 1
#else
#define FOLIO_DPBF16 0
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define FOLIO_F32_FMA 1
#else
#define FOLIO_F32_FMA 0
#endif

namespace {

constexpr int MAX_M_BF16 = 3;
constexpr int MAX_M_F32 = 8;

#if FOLIO_DPBF16
template <int M>
void rows(const c10::BFloat16* x, int64_t x_stride, const c10::BFloat16* w, const c10::BFloat16* bias,
          c10::BFloat16* y, int64_t y_stride, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const c10::BFloat16* row = w + n * K;
    __m512 acc[M][2];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {  // two chains per row: hides the dot product's latency
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(row + k);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(row + k + 32);
      for (int m = 0; m < M; ++m) {
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, (__m512bh)_mm512_loadu_si512(x + m * x_stride + k));
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, (__m512bh)_mm512_loadu_si512(x + m * x_stride + k + 32));
      }
    }
    if (k < K) {  // K % 64 == 32
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(row + k);
      for (int m = 0; m < M; ++m)
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, (__m512bh)_mm512_loadu_si512(x + m * x_stride + k));
    }
    const float b = bias ? static_cast<float>(bias[n]) : 0.f;
    for (int m = 0; m < M; ++m)
      y[m * y_stride + n] = c10::BFloat16(_mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1])) + b);
  }
}
#endif

#if FOLIO_F32_FMA
#if defined(__AVX512F__)
using fvec = __m512;
constexpr int64_t LANES = 16;
inline fvec fzero() { return _mm512_setzero_ps(); }
inline fvec fload(const float* p) { return _mm512_loadu_ps(p); }
inline fvec ffma(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
inline float fsum(fvec a) { return _mm512_reduce_add_ps(a); }
#else
using fvec = __m256;
constexpr int64_t LANES = 8;
inline fvec fzero() { return _mm256_setzero_ps(); }
inline fvec fload(const float* p) { return _mm256_loadu_ps(p); }
inline fvec ffma(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
inline float fsum(fvec a) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#endif

// R rows of W at a time, one FMA chain each per row of x: R streams of memory in flight, and M * R independent
// chains to hide the FMA's latency, within AVX2's 16 vector registers (M * R accumulators, R weight vectors).
template <int M>
constexpr int rows_at_once() { return M <= 2 ? 4 : (M <= 4 ? 2 : 1); }

template <int M, int R>
void rows_f32(const float* x, int64_t x_stride, const float* w, const float* bias, float* y, int64_t y_stride,
              int64_t K, int64_t n) {
  fvec acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = fzero();
  int64_t k = 0;
  for (; k + LANES <= K; k += LANES) {
    for (int r = 0; r < R; ++r) {
      const fvec wr = fload(w + (n + r) * K + k);
      for (int m = 0; m < M; ++m) acc[m][r] = ffma(wr, fload(x + m * x_stride + k), acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      const float* row = w + (n + r) * K;
      float sum = fsum(acc[m][r]);
      for (int64_t j = k; j < K; ++j) sum += row[j] * x[m * x_stride + j];
      y[m * y_stride + n + r] = sum + (bias ? bias[n + r] : 0.f);
    }
}

template <int M>
void row_range_f32(const float* x, int64_t x_stride, const float* w, const float* bias, float* y,
                   int64_t y_stride, int64_t K, int64_t n0, int64_t n1) {
  constexpr int R = rows_at_once<M>();
  int64_t n = n0;
  for (; n + R <= n1; n += R) rows_f32<M, R>(x, x_stride, w, bias, y, y_stride, K, n);
  for (; n < n1; ++n) rows_f32<M, 1>(x, x_stride, w, bias, y, y_stride, K, n);
}

template <int M>
void dispatch_f32(int64_t m, const float* x, int64_t xs, const float* w, const float* b, float* y, int64_t N,
                  int64_t K, int64_t n0, int64_t n1) {
  if constexpr (M > 1) {
    if (m < M) return dispatch_f32<M - 1>(m, x, xs, w, b, y, N, K, n0, n1);
  }
  row_range_f32<M>(x, xs, w, b, y, N, K, n0, n1);
}
#endif

bool has_kernel() { return FOLIO_DPBF16; }
bool has_f32_kernel() { return FOLIO_F32_FMA; }

// contiguous row ranges, at least 16 KiB of W each: one sequential stream per thread
int64_t row_grain(int64_t row_bytes) { return std::max<int64_t>(1, 16384 / row_bytes); }

at::Tensor linear_bf16(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(FOLIO_DPBF16, "built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x must be bf16 [M, K], unit stride");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(), "w must be contiguous bf16 [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && K % 32 == 0 && M >= 1 && M <= MAX_M_BF16, "shapes: x [M <= 3, K], w [N, K], K % 32 == 0");
  const c10::BFloat16* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N, "bias must be bf16 [N]");
    bp = bias->data_ptr<c10::BFloat16>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
#if FOLIO_DPBF16
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = w.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, N, row_grain(2 * K), [&](int64_t n0, int64_t n1) {
    switch (M) {
      case 1: rows<1>(xp, xs, wp, bp, yp, N, K, n0, n1); break;
      case 2: rows<2>(xp, xs, wp, bp, yp, N, K, n0, n1); break;
      default: rows<3>(xp, xs, wp, bp, yp, N, K, n0, n1); break;
    }
  });
#endif
  return y;
}

at::Tensor linear_f32(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(FOLIO_F32_FMA, "built without AVX2+FMA or AVX-512F");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x must be float32 [M, K], unit stride");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous(), "w must be contiguous float32 [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && M >= 1 && M <= MAX_M_F32, "shapes: x [M <= 8, K], w [N, K]");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "bias must be float32 [N]");
    bp = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
#if FOLIO_F32_FMA
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, N, row_grain(4 * K), [&](int64_t n0, int64_t n1) {
    dispatch_f32<MAX_M_F32>(M, xp, xs, wp, bp, yp, N, K, n0, n1);
  });
#endif
  return y;
}

at::Tensor small_batch_linear(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  return x.scalar_type() == at::kFloat ? linear_f32(x, w, bias) : linear_bf16(x, w, bias);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_batch_linear", &small_batch_linear,
        "x W^T (+ b) for bf16 x of at most MAX_M_BF16 rows or float32 x of at most MAX_M_F32",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("has_kernel", &has_kernel, "whether the AVX512-BF16 kernel was compiled in");
  m.def("has_f32_kernel", &has_f32_kernel, "whether the float32 FMA kernel was compiled in");
  m.attr("MAX_M_BF16") = MAX_M_BF16;
  m.attr("MAX_M_F32") = MAX_M_F32;
}
