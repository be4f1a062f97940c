// One mixture-of-experts feed-forward in one call: out[t] = sum over t's chosen experts e (ascending e) of
// w[t, e] * down_e(act(gate_e(x[t]), up_e(x[t]))), for unquantised experts stacked as
// w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I], in float32 or bf16; float32 activations may take
// bf16 experts (a bf16 checkpoint's, held in half the bytes: folio.models.fused_moe), each value widened exactly.
// act is SiLU(gate) * up, or GPT-OSS's clamped SwiGLU (`Activation`); GPT-OSS's experts also have biases, b13
// [E, 2I] on gate/up and b2 [E, H] on down (float32), added to the float32 products.
//
// Why: a decode step of a batch of B sequences sends about B * top_k / E rows to each expert: a handful.
// Run expert by expert from Python, that is ~10 torch ops per expert per layer, each tiny matmul threaded
// on its own. Here the (token, slot) choices are grouped by expert (a stable counting sort: tokens keep
// their order, as in folio.models.moe's per-expert path) and the work is split into tasks of
// (expert, block of output columns) shared by all threads at once: each weight row is read once, by one
// thread, for all of its expert's rows. An expert with at least `gemm_min_rows` rows (a prefill) runs
// ATen's GEMMs instead, which are faster there.
//
// Numerics: dot products, SiLU and the weighted sum are in float32; a token's expert outputs are added in
// ascending expert order, as the per-expert path's index_add_ does. In float32 the result equals that
// path's to rounding (another summation order in the dot products); in bf16 it rounds less (the per-expert
// path rounds gate/up, the product and each expert's output to bf16), so it differs by about a bf16 ulp.
#include <ATen/ATen.h>
#include "parallel.h"
#include <c10/util/BFloat16.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

// ------------------------------------------------------------------ float32 vectors, bf16 widened on load
#if defined(__AVX512F__)
using vec = __m512;
constexpr int VL = 16;
constexpr int MB = 4;  // rows of x per register tile: MB * NB accumulators of 32 zmm registers
constexpr int NB = 4;  // weight rows per register tile
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vload(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
#elif defined(__AVX2__) && defined(__FMA__)
using vec = __m256;
constexpr int VL = 8;
constexpr int MB = 2;  // rows of x per register tile: MB * NB accumulators of 16 ymm registers
constexpr int NB = 4;  // weight rows per register tile: 4 independent FMA chains even for one row of x
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vload(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
#else
using vec = float;
constexpr int VL = 1;
constexpr int MB = 2;
constexpr int NB = 4;
inline vec vzero() { return 0.f; }
inline vec vload(const float* p) { return *p; }
inline vec vload(const c10::BFloat16* p) { return static_cast<float>(*p); }
inline vec vfma(vec a, vec b, vec c) { return a * b + c; }
inline float vsum(vec a) { return a; }
#endif

constexpr int64_t COLS = 32;  // output columns per task: gate/up pairs, or down rows

// C[m * ldc + n] = A[m] . W[n] for M rows of A (float32) and N rows of W, all of length K.
template <typename T, int M, int N>
inline void tile(const float* A, int64_t lda, const T* W, int64_t ldw, int64_t K, float* C, int64_t ldc) {
  vec acc[M][N];
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) acc[m][n] = vzero();
  int64_t k = 0;
  for (; k + VL <= K; k += VL) {
    vec w[N];
    for (int n = 0; n < N; ++n) w[n] = vload(W + n * ldw + k);
    for (int m = 0; m < M; ++m) {
      const vec a = vload(A + m * lda + k);
      for (int n = 0; n < N; ++n) acc[m][n] = vfma(a, w[n], acc[m][n]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      float s = vsum(acc[m][n]);
      // fused as the vector loop's FMAs are, whatever the compiler would contract: bf16 and float32 weights of
      // the same values then give the same sums bit for bit
      for (int64_t j = k; j < K; ++j) s = std::fma(A[m * lda + j], static_cast<float>(W[n * ldw + j]), s);
      C[m * ldc + n] = s;
    }
}

template <typename T, int N>
inline void row_tiles(const float* A, int64_t lda, int64_t R, const T* W, int64_t ldw, int64_t K, float* C,
                      int64_t ldc) {
  int64_t r = 0;
  for (; r + MB <= R; r += MB) tile<T, MB, N>(A + r * lda, lda, W, ldw, K, C + r * ldc, ldc);
  switch (R - r) {
    case 3: tile<T, 3, N>(A + r * lda, lda, W, ldw, K, C + r * ldc, ldc); break;
    case 2: tile<T, 2, N>(A + r * lda, lda, W, ldw, K, C + r * ldc, ldc); break;
    case 1: tile<T, 1, N>(A + r * lda, lda, W, ldw, K, C + r * ldc, ldc); break;
    default: break;
  }
}

// C[r * ldc + n] = A[r] . W[n] for R rows of A and N rows of W: each block of NB weight rows is read from
// memory once and reused, from cache, for all R rows.
template <typename T>
void dots(const float* A, int64_t lda, int64_t R, const T* W, int64_t ldw, int64_t N, int64_t K, float* C,
          int64_t ldc) {
  int64_t n = 0;
  for (; n + NB <= N; n += NB) row_tiles<T, NB>(A, lda, R, W + n * ldw, ldw, K, C + n, ldc);
  for (; n < N; ++n) row_tiles<T, 1>(A, lda, R, W + n * ldw, ldw, K, C + n, ldc);
}

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// The experts' gated activation of a (gate, up) pair: SiLU(gate) * up, or, with limit > 0, GPT-OSS's clamped SwiGLU
// (Transformers' GptOssExperts._apply_gate, in its order of operations): the gate clamped above at limit, up to
// [-limit, limit], then gate * sigmoid(gate * alpha) * (up + 1).
struct Activation {
  float alpha, limit;
  bool clamped() const { return limit > 0.f; }
  float operator()(float g, float u) const {
    if (!clamped()) return silu(g) * u;
    g = std::min(g, limit);
    u = std::min(std::max(u, -limit), limit);
    return (u + 1.f) * (g * (1.f / (1.f + std::exp(-(g * alpha)))));
  }
  // the same on ATen tensors (the large experts' path), into out
  void apply_out(at::Tensor& out, const at::Tensor& gate, const at::Tensor& up) const {
    if (!clamped()) {
      at::mul_out(out, at::silu(gate), up);
      return;
    }
    const auto g = gate.clamp_max(limit);
    at::mul_out(out, up.clamp(-limit, limit) + 1, g * at::sigmoid(g * alpha));
  }
};

struct Task {
  int64_t expert, col;
};

// X: the activations' type (float32 or bf16), W: the experts' (X, or bf16 under float32 activations).
// b13, b2: the biases (float32), or null.
template <typename X, typename W>
void run(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const float* b13, const float* b2,
         const Activation act, const at::Tensor& weights, const at::Tensor& ids, int64_t gemm_min_rows,
         at::Tensor& out, at::Tensor& counts) {
  const int64_t T_ = x.size(0), H = x.size(1), K = ids.size(1), E = w13.size(0), I = w2.size(2);
  const int64_t S = T_ * K;
  const int64_t* id = ids.data_ptr<int64_t>();
  int64_t* count = counts.data_ptr<int64_t>();

  // Group the (token, slot) choices by expert: order[s] is the choice at sorted position s, pos its inverse.
  std::vector<int64_t> start(E + 1, 0), order(S), pos(S);
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(id[s] >= 0 && id[s] < E, "expert id ", id[s], " out of range [0, ", E, ")");
    ++count[id[s]];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] = start[e] + count[e];
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t s = 0; s < S; ++s) {
      order[next[id[s]]] = s;
      pos[s] = next[id[s]]++;
    }
  }
  std::vector<Task> gate_up_tasks, down_tasks;
  std::vector<int64_t> large;
  for (int64_t e = 0; e < E; ++e) {
    if (count[e] == 0) continue;
    if (count[e] >= gemm_min_rows) {
      large.push_back(e);
      continue;
    }
    for (int64_t c = 0; c < I; c += COLS) gate_up_tasks.push_back({e, c});
    for (int64_t c = 0; c < H; c += COLS) down_tasks.push_back({e, c});
  }

  const X* xp = x.data_ptr<X>();
  const W* w13p = w13.data_ptr<W>();
  const W* w2p = w2.data_ptr<W>();
  auto gated = at::empty({S, I}, x.options().dtype(at::kFloat));  // act(gate, up), per sorted choice
  auto y = at::empty({S, H}, x.options().dtype(at::kFloat));      // the expert's output, per sorted choice
  float* actp = gated.data_ptr<float>();
  float* yp = y.data_ptr<float>();

  // Small experts: their tokens' rows as float32, in sorted order (gathered once, read by every task).
  auto xs = at::empty({S, H}, x.options().dtype(at::kFloat));
  float* xsp = xs.data_ptr<float>();
  folio::parallel_for(0, S, 16, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      if (count[id[order[s]]] >= gemm_min_rows) continue;
      const X* src = xp + (order[s] / K) * H;
      for (int64_t h = 0; h < H; ++h) xsp[s * H + h] = static_cast<float>(src[h]);
    }
  });
  folio::parallel_for(0, static_cast<int64_t>(gate_up_tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> gate, up;
    for (int64_t t = t0; t < t1; ++t) {
      const auto [e, c] = gate_up_tasks[t];
      const int64_t rows = count[e], cols = std::min(COLS, I - c), s0 = start[e];
      gate.resize(rows * cols);
      up.resize(rows * cols);
      const W* w = w13p + e * 2 * I * H;
      dots(xsp + s0 * H, H, rows, w + c * H, H, cols, H, gate.data(), cols);
      dots(xsp + s0 * H, H, rows, w + (I + c) * H, H, cols, H, up.data(), cols);
      const float* gb = b13 ? b13 + e * 2 * I + c : nullptr;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < cols; ++j)
          actp[(s0 + r) * I + c + j] = gb ? act(gate[r * cols + j] + gb[j], up[r * cols + j] + gb[I + j])
                                          : act(gate[r * cols + j], up[r * cols + j]);
    }
  });
  folio::parallel_for(0, static_cast<int64_t>(down_tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const auto [e, c] = down_tasks[t];
      const int64_t rows = count[e], cols = std::min(COLS, H - c), s0 = start[e];
      dots(actp + s0 * I, I, rows, w2p + (e * H + c) * I, I, cols, I, yp + s0 * H + c, H);
      if (b2)
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < cols; ++j) yp[(s0 + r) * H + c + j] += b2[e * H + c + j];
    }
  });

  // Large experts: ATen's (threaded) GEMMs on the expert's rows, in the activations' dtype (bf16 experts of
  // float32 activations widened for the call: a copy of the expert, against GEMMs of gemm_min_rows rows or more).
  if (!large.empty()) {
    auto order_t = at::from_blob(order.data(), {S}, at::kLong);
    for (const int64_t e : large) {
      const auto tokens = at::div(order_t.narrow(0, start[e], count[e]), K, "floor");
      auto gate_up = at::linear(x.index_select(0, tokens), w13[e].to(x.scalar_type())).to(at::kFloat);
      if (b13) gate_up.add_(at::from_blob(const_cast<float*>(b13 + e * 2 * I), {2 * I}, at::kFloat));
      auto a = gated.narrow(0, start[e], count[e]);
      act.apply_out(a, gate_up.narrow(1, 0, I), gate_up.narrow(1, I, I));
      auto ye = y.narrow(0, start[e], count[e]);
      ye.copy_(at::linear(a.to(x.scalar_type()), w2[e].to(x.scalar_type())));
      if (b2) ye.add_(at::from_blob(const_cast<float*>(b2 + e * H), {H}, at::kFloat));
    }
  }

  // Each token's weighted sum of its experts' outputs, in ascending expert order.
  const float* wp = weights.data_ptr<float>();
  X* outp = out.data_ptr<X>();
  folio::parallel_for(0, T_, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> acc(H);
    std::vector<std::pair<int64_t, int64_t>> chosen(K);  // (expert, slot)
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t k = 0; k < K; ++k) chosen[k] = {id[t * K + k], t * K + k};
      std::sort(chosen.begin(), chosen.end());
      std::fill(acc.begin(), acc.end(), 0.f);
      for (const auto& [e, slot] : chosen) {
        const float w = wp[slot];
        const float* row = yp + pos[slot] * H;
        for (int64_t h = 0; h < H; ++h) acc[h] += w * row[h];
      }
      for (int64_t h = 0; h < H; ++h) outp[t * H + h] = static_cast<X>(acc[h]);
    }
  });
}

// x [T, H], w13 [E, 2I, H], w2 [E, H, I] (contiguous; all float32, all bf16, or float32 x with bf16 experts);
// b13 [E, 2I], b2 [E, H]: float32 biases, or None; weights [T, K] (any float dtype), ids [T, K] int64;
// swiglu_limit > 0: the clamped SwiGLU with swiglu_alpha (`Activation`), else SiLU(gate) * up. Returns
// (out [T, H] in x's dtype, counts [E] int64: rows per expert).
std::tuple<at::Tensor, at::Tensor> fused_moe(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                                             const at::Tensor& weights, const at::Tensor& ids, int64_t gemm_min_rows,
                                             const std::optional<at::Tensor>& b13,
                                             const std::optional<at::Tensor>& b2, double swiglu_alpha,
                                             double swiglu_limit) {
  TORCH_CHECK(x.dim() == 2 && w13.dim() == 3 && w2.dim() == 3 && ids.dim() == 2, "fused_moe: bad ranks");
  TORCH_CHECK(w13.scalar_type() == w2.scalar_type() &&
                  (x.scalar_type() == w13.scalar_type() ||
                   (x.scalar_type() == at::kFloat && w13.scalar_type() == at::kBFloat16)),
              "fused_moe: the experts share x's dtype, or are bf16 under float32 x");
  TORCH_CHECK(w13.size(1) == 2 * w2.size(2) && w13.size(2) == x.size(1) && w2.size(1) == x.size(1) &&
                  w13.size(0) == w2.size(0),
              "fused_moe: weight shapes do not match");
  TORCH_CHECK(weights.sizes() == ids.sizes() && ids.size(0) == x.size(0), "fused_moe: routing shapes");
  TORCH_CHECK(w13.is_contiguous() && w2.is_contiguous(), "fused_moe: expert weights must be contiguous");
  TORCH_CHECK(!b13 || (b13->scalar_type() == at::kFloat && b13->is_contiguous() &&
                       b13->sizes() == at::IntArrayRef({w13.size(0), w13.size(1)})),
              "fused_moe: b13 must be float32 [E, 2I]");
  TORCH_CHECK(!b2 || (b2->scalar_type() == at::kFloat && b2->is_contiguous() &&
                      b2->sizes() == at::IntArrayRef({w2.size(0), w2.size(1)})),
              "fused_moe: b2 must be float32 [E, H]");
  const float* b13p = b13 ? b13->data_ptr<float>() : nullptr;
  const float* b2p = b2 ? b2->data_ptr<float>() : nullptr;
  const Activation act{(float)swiglu_alpha, (float)swiglu_limit};
  const auto xc = x.contiguous();
  const auto wc = weights.to(at::kFloat).contiguous();
  const auto ic = ids.to(at::kLong).contiguous();
  auto out = at::empty_like(xc);
  auto counts = at::zeros({w13.size(0)}, ic.options());
  if (x.scalar_type() == at::kFloat && w13.scalar_type() == at::kFloat) {
    run<float, float>(xc, w13, w2, b13p, b2p, act, wc, ic, gemm_min_rows, out, counts);
  } else if (x.scalar_type() == at::kFloat) {
    run<float, c10::BFloat16>(xc, w13, w2, b13p, b2p, act, wc, ic, gemm_min_rows, out, counts);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "fused_moe: float32 or bf16 only");
    run<c10::BFloat16, c10::BFloat16>(xc, w13, w2, b13p, b2p, act, wc, ic, gemm_min_rows, out, counts);
  }
  return {out, counts};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  folio::bind_decode_threads(m);
  namespace py = pybind11;
  m.def("fused_moe", &fused_moe, py::arg("x"), py::arg("w13"), py::arg("w2"), py::arg("weights"), py::arg("ids"),
        py::arg("gemm_min_rows"), py::arg("b13") = py::none(), py::arg("b2") = py::none(),
        py::arg("swiglu_alpha") = 0.0, py::arg("swiglu_limit") = 0.0,
        "grouped mixture-of-experts feed-forward (float32 / bf16 experts; bf16 ones under float32 x too; optional "
        "biases and GPT-OSS's clamped SwiGLU)");
}
