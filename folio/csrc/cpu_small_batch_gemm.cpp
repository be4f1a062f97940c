// y = x W^T (+ b) for a handful of rows of x, in bf16, streaming W once at memory speed.
//
// Decoding one to three sequences multiplies each weight matrix by one to three vectors: the time is the
// time to read W. oneDNN's bf16 GEMM reads its packed weights at 15-23 GB/s on a 2-core AVX512-BF16
// machine, where this kernel reads plain row-major W at 25-31 GB/s: each thread takes a contiguous
// range of output rows (one sequential stream of memory), and for each row n it accumulates
// x[m] . W[n] for the M rows of x with vdpbf16ps (products of bf16 pairs, exact, summed in float32),
// then adds the bias in float32 and rounds to bf16 once (round to nearest even), as oneDNN does. The sums
// run in another order than oneDNN's, so results may differ from F.linear's in the last bf16 bit.
//
// Requires AVX512-BF16 and K % 32 == 0 (has_kernel() says whether it was compiled in); M <= MAX_M.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define FOLIO_DPBF16 1
#else
#define FOLIO_DPBF16 0
#endif

namespace {

constexpr int MAX_M = 3;

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

bool has_kernel() { return FOLIO_DPBF16; }

at::Tensor small_batch_linear(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(FOLIO_DPBF16, "built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x must be bf16 [M, K], unit stride");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(), "w must be contiguous bf16 [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && K % 32 == 0 && M >= 1 && M <= MAX_M, "shapes: x [M <= 3, K], w [N, K], K % 32 == 0");
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
  // contiguous row ranges, at least 16 KiB of W each: one sequential stream per thread
  const int64_t grain = std::max<int64_t>(1, 8192 / K);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    switch (M) {
      case 1: rows<1>(xp, xs, wp, bp, yp, N, K, n0, n1); break;
      case 2: rows<2>(xp, xs, wp, bp, yp, N, K, n0, n1); break;
      default: rows<3>(xp, xs, wp, bp, yp, N, K, n0, n1); break;
    }
  });
#endif
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_batch_linear", &small_batch_linear, "x W^T (+ b) for bf16 x of at most 3 rows",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("has_kernel", &has_kernel, "whether the AVX512-BF16 kernel was compiled in");
  m.attr("MAX_M") = MAX_M;
}
