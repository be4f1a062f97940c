// Fused elementwise kernels for the CPU decoder layers: (add +) RMSNorm, rotary embedding and SiLU-and-mul in bf16
// or float32.
//
// Each kernel reproduces, bit for bit, what folio/models/layers.py computes with eager torch ops on bf16
// (or float32) tensors (which is what Transformers computes), but in one pass over memory and without the float32
// temporaries, the broadcasts and the ~10 dispatcher calls per op:
//
//   * eager bf16 elementwise ops widen to float32, compute one float op and round back to bf16 (round to
//     nearest even; NaN -> 0xffff as ATen's AVX-512 conversion does), once per op: we do exactly that;
//   * RMSNorm's mean(h^2) is a float32 sum whose result depends on the order of the additions: we replay
//     ATen's cascade_sum order (SumKernel.cpp, vectorized_inner_sum: `lanes`-float vectors, 4 interleaved
//     accumulators, levels of 16 steps, in-order horizontal sum), then divide by H as at::mean does;
//     `lanes` is measured by folio/models/fused_ops.py against torch.sum (8 for torch 2.13 on x86);
//   * SiLU uses SLEEF's expf u10, the function ATen's vectorized silu calls: an inline copy (checked at
//     load time against torch's float32 silu) or libtorch_cpu's exported Sleef_expf16_u10 (AVX2:
//     Sleef_expf8_u10; weakly linked: without it and without the check passing, std::exp, no longer bit-exact),
//     and std::exp for the per-row tail that ATen runs through its scalar loop (bf16: the last I % 64 elements
//     of each row; float32: see silu_segment). A bf16 gate has 65536 values: the vector loop looks its rounded
//     silu up in a table of them that the same vector code made (silu_table).
//
//   * float32 tensors take the same formulas with no rounding to bf16 (Elem<float>); each eager op rounds its own
//     float result, so the file is built with -ffp-contract=off (fused_ops.py): a product and a sum never fuse
//     into one FMA where torch runs two ops.
//
// Vector paths need: RMSNorm any H (a scalar tail handles H % 16), rotary head_dim % 32 == 0, SiLU any I.
// Without AVX-512, and in float32, the norms and the rotary embedding run through the scalar versions of the same
// formulas (their element-wise loops left to the compiler's vectoriser); float32 SiLU has its own vector loop.
//
// Only the ATen headers needed (not torch/extension.h): keeps the first-use build short.
#include "bf16_silu_and_mul.h"
#include "parallel.h"
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define FOLIO_AVX512 1
extern "C" __m512 Sleef_expf16_u10(__m512) __attribute__((weak));
#else
#define FOLIO_AVX512 0
#endif
#if !FOLIO_AVX512 && defined(__AVX2__)
#include <immintrin.h>
#define FOLIO_AVX2 1
extern "C" __m256 Sleef_expf8_u10(__m256) __attribute__((weak));  // what ATen's AVX2 Vectorized<float>::exp calls
#else
#define FOLIO_AVX2 0
#endif

namespace {

using bf16 = at::BFloat16;

// ---------------------------------------------------------------------------------------------- scalars
inline float bf(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ATen's vectorized float -> bf16 (round to nearest even, NaN -> 0xffff)
inline uint16_t rnd(float f) {
  if (std::isnan(f)) return 0xffff;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float rf(float f) { return bf(rnd(f)); }  // round through bf16

// An element of a tensor of type T as the formulas see it: bf16 bits (uint16_t) or float.
template <typename T>
struct Elem;
template <>
struct Elem<uint16_t> {
  static constexpr bool BF16 = true;
  static float get(uint16_t h) { return bf(h); }
  static uint16_t put(float f) { return rnd(f); }  // an eager op's rounding of its float result
  static float round(float f) { return rf(f); }  // the same, kept as a float for the next op
};
template <>
struct Elem<float> {
  static constexpr bool BF16 = false;
  static float get(float f) { return f; }
  static float put(float f) { return f; }
  static float round(float f) { return f; }
};

#if FOLIO_AVX512
// ---------------------------------------------------------------------------------------------- vectors
inline __m512 vload(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

inline __m256i vround(__m512 f) { return folio::round_bf16_aten(f); }  // = at::vec cvtfp32_bf16

inline __m512 vwiden(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
inline __m512 vrf(__m512 f) { return vwiden(vround(f)); }  // round through bf16
inline void vstore(uint16_t* p, __m256i h) { _mm256_storeu_si256((__m256i*)p, h); }

// SLEEF's xexpf (the u10 float exp that ATen's Vectorized<float>::exp calls), written out so that it
// inlines into the loop. fused_ops.py uses it only after checking silu_f32 with it against torch's
// float32 silu bit for bit (else it passes inline_exp=false and the kernel calls libtorch's
// Sleef_expf16_u10). (torch.exp itself uses another exp: do not compare against it.)
inline __m512 exp_sleef(__m512 d) {
  const __m512i q = _mm512_cvt_roundps_epi32(_mm512_mul_ps(d, _mm512_set1_ps(1.442695040888963407359924681001892137f)),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 qf = _mm512_cvtepi32_ps(q);
  __m512 s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-0.693145751953125f), d);
  s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-1.428606765330187045e-06f), s);
  __m512 u = _mm512_set1_ps(0.000198527617612853646278381f);
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00139304355252534151077271f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00833336077630519866943359f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.0416664853692054748535156f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.166666671633720397949219f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.5f));
  u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
  // ldexp2(u, q) = u * 2^(q >> 1) * 2^(q - (q >> 1))
  const __m512i q1 = _mm512_srai_epi32(q, 1), q2 = _mm512_sub_epi32(q, q1);
  auto pow2i = [](__m512i e) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(0x7f)), 23));
  };
  u = _mm512_mul_ps(_mm512_mul_ps(u, pow2i(q1)), pow2i(q2));
  u = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.f), _CMP_NLT_UQ), u);  // d < -104 -> 0
  u = _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(_mm512_set1_ps(100.f), d, _CMP_LT_OQ),
                         _mm512_set1_ps(INFINITY));  // d > 100 -> inf
  return u;
}

// rnd(silu(x)) of 16 bf16 values widened to float, as ATen's vector loop computes it (SLEEF's exp: inline_exp, the
// inline copy, else libtorch's Sleef_expf16_u10, which the caller checked is there).
inline __m512 silu_rounded(__m512 x, bool inline_exp) {
  const __m512 m = _mm512_sub_ps(_mm512_setzero_ps(), x);
  const __m512 e = inline_exp ? exp_sleef(m) : Sleef_expf16_u10(m);
  return vrf(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
}

// rnd(silu(x)) for every bf16 x, indexed by its bits: a bf16 gate takes 65536 values, and looking 16 of them up
// (one gather) costs a fraction of the exp and the division it replaces. Built on first use from silu_rounded, so
// the entries are the vector loop's own bits; one table per exp. The gather reads four bytes at each entry: one
// entry of padding.
struct SiluTable {
  alignas(64) uint16_t bits[folio::SILU_TABLE_ENTRIES];
  explicit SiluTable(bool inline_exp) {
    alignas(64) uint32_t lanes[16];
    for (uint32_t x = 0; x < 65536; x += 16) {
      for (uint32_t l = 0; l < 16; ++l) lanes[l] = (x + l) << 16;
      vstore(bits + x, vround(silu_rounded(_mm512_castsi512_ps(_mm512_load_si512(lanes)), inline_exp)));
    }
    std::fill(bits + 65536, bits + folio::SILU_TABLE_ENTRIES, uint16_t{0});
  }
};

inline const int* silu_table(bool inline_exp) {
  if (inline_exp) {
    static const SiluTable table(true);
    return reinterpret_cast<const int*>(table.bits);
  }
  static const SiluTable table(false);  // (the caller checked that libtorch's exp is there)
  return reinterpret_cast<const int*>(table.bits);
}
#endif

// Elements of work below which a kernel stays on the calling thread (an OpenMP fork costs a few us); also
// at::internal::GRAIN_SIZE (ATen/TensorIterator.h), by which TensorIterator's loops split a tensor over threads.
constexpr int64_t GRAIN_ELEMS = 32768;

inline int64_t row_grain(int64_t row_elems) { return std::max<int64_t>(1, GRAIN_ELEMS / std::max<int64_t>(1, row_elems)); }

// -------------------------------------------------------------------------------------------- RMSNorm
// Sums of a contiguous float row in ATen's cascade_sum order (vectorized_inner_sum / scalar_inner_sum).
inline int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  return 64 - __builtin_clzll((uint64_t)(x - 1));
}

// W = lanes of ATen's Vectorized<float> in the sum kernel (8 in torch 2.13's x86 builds even on AVX-512
// machines, where the sum kernel runs its AVX2 variant; fused_ops.py checks it against torch.sum at load).
// Lane-wise loops over plain arrays: each lane is an independent chain, so gcc vectorizes them without
// changing any rounding.
template <int W>
struct VecT {
  typedef float type __attribute__((vector_size(W * 4)));
};

template <int W>
float aten_row_sum_w(const float* in, int64_t n) {
  using V = typename VecT<W>::type;  // GCC vector: lane-wise IEEE adds, kept in registers
  auto ld = [](const float* p) { V v; std::memcpy(&v, p, sizeof(V)); return v; };
  const int64_t vec_size = n / W;
  const int64_t size_ilp = vec_size / 4;  // row_sum: ilp 4 -> multi_row_sum over rows of 4 vectors
  constexpr int L = 4;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(size_ilp) / L);
  const int64_t level_step = (int64_t)1 << level_power;
  const int64_t level_mask = level_step - 1;
  const V zero = {};
  V acc[L][4];
  for (int j = 0; j < L; ++j)
    for (int k = 0; k < 4; ++k) acc[j][k] = zero;
  int64_t i = 0;
  for (; i + level_step <= size_ilp;) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < 4; ++k) acc[0][k] += ld(in + (i * 4 + k) * W);
    for (int j = 1; j < L; ++j) {
      for (int k = 0; k < 4; ++k) {
        acc[j][k] += acc[j - 1][k];
        acc[j - 1][k] = zero;
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size_ilp; ++i)
    for (int k = 0; k < 4; ++k) acc[0][k] += ld(in + (i * 4 + k) * W);
  for (int j = 1; j < L; ++j)
    for (int k = 0; k < 4; ++k) acc[0][k] += acc[j][k];
  V p0 = acc[0][0];
  for (int64_t v = size_ilp * 4; v < vec_size; ++v) p0 += ld(in + v * W);
  for (int k = 1; k < 4; ++k) p0 += acc[0][k];
  float final_acc = 0.f;
  for (int64_t k = vec_size * W; k < n; ++k) final_acc += in[k];
  for (int l = 0; l < W; ++l) final_acc += p0[l];
  return final_acc;
}

// Scalar reduction order of ATen for rows shorter than one vector (row_sum with scalar loads, ilp 4).
float aten_row_sum_scalar(const float* in, int64_t n) {
  const int64_t size_ilp = n / 4;
  constexpr int L = 4;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(size_ilp) / L);
  const int64_t level_step = (int64_t)1 << level_power;
  const int64_t level_mask = level_step - 1;
  float acc[L][4] = {};
  int64_t i = 0;
  for (; i + level_step <= size_ilp;) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < 4; ++k) acc[0][k] += in[i * 4 + k];
    for (int j = 1; j < L; ++j) {
      for (int k = 0; k < 4; ++k) {
        acc[j][k] += acc[j - 1][k];
        acc[j - 1][k] = 0.f;
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size_ilp; ++i)
    for (int k = 0; k < 4; ++k) acc[0][k] += in[i * 4 + k];
  for (int j = 1; j < L; ++j)
    for (int k = 0; k < 4; ++k) acc[0][k] += acc[j][k];
  for (int64_t v = size_ilp * 4; v < n; ++v) acc[0][0] += in[v];
  for (int k = 1; k < 4; ++k) acc[0][0] += acc[0][k];
  return acc[0][0];
}

// sum of a contiguous float row in the order of ATen's sum kernel with `lanes`-wide vectors
float aten_row_sum(const float* in, int64_t n, int lanes) {
  if (n < lanes) return aten_row_sum_scalar(in, n);
  switch (lanes) {
    case 4: return aten_row_sum_w<4>(in, n);
    case 16: return aten_row_sum_w<16>(in, n);
    case 32: return aten_row_sum_w<32>(in, n);
    default: return aten_row_sum_w<8>(in, n);
  }
}

// One row: [res_out = rnd(x + res)]; h = float(sum); out = rnd(w * rnd(h * rsqrt(mean(h*h) + eps))).
// sq: scratch of H floats.
template <typename T>
void rms_row(const T* x, const T* res, T* res_out, const T* w, T* out, int64_t H, float eps, int lanes, float* sq) {
  using E = Elem<T>;
  const T* src = x;
  int64_t j = 0;
#if FOLIO_AVX512
  if constexpr (E::BF16) {
  if (res) {
    for (; j + 16 <= H; j += 16) {
      const __m256i s = vround(_mm512_add_ps(vload(x + j), vload(res + j)));
      vstore(res_out + j, s);
      const __m512 h = vwiden(s);
      _mm512_storeu_ps(sq + j, _mm512_mul_ps(h, h));
    }
  } else {
    for (; j + 16 <= H; j += 16) {
      const __m512 h = vload(x + j);
      _mm512_storeu_ps(sq + j, _mm512_mul_ps(h, h));
    }
  }
  }
#endif
  for (; j < H; ++j) {
    float h;
    if (res) {
      res_out[j] = E::put(E::get(x[j]) + E::get(res[j]));
      h = E::get(res_out[j]);
    } else {
      h = E::get(x[j]);
    }
    sq[j] = h * h;
  }
  if (res) src = res_out;
  const float sum = aten_row_sum(sq, H, lanes);
  const float mean = sum / (float)H;
  const float r = 1.0f / std::sqrt(mean + eps);
  j = 0;
#if FOLIO_AVX512
  if constexpr (E::BF16) {
    const __m512 rv = _mm512_set1_ps(r);
    for (; j + 16 <= H; j += 16) {
      const __m512 hb = vrf(_mm512_mul_ps(vload(src + j), rv));
      vstore(out + j, vround(_mm512_mul_ps(vload(w + j), hb)));
    }
  }
#endif
  for (; j < H; ++j) out[j] = E::put(E::get(w[j]) * E::round(E::get(src[j]) * r));
}

// bf16 or float32: the kernels' two element types
void check_rows(const at::Tensor& t, const char* name, int64_t H, at::ScalarType dtype) {
  TORCH_CHECK(t.scalar_type() == dtype && (dtype == at::kBFloat16 || dtype == at::kFloat), name,
              " must be bfloat16 or float32, as x");
  TORCH_CHECK(t.dim() == 2 && t.size(1) == H && t.stride(1) == 1, name, " must be [T, ", H, "] with unit stride");
}

template <typename T>
void rms_run(const at::Tensor& x, const at::Tensor* res, at::Tensor* res_out, const at::Tensor& w,
             at::Tensor& out, double eps, int64_t lanes) {
  const int64_t T_ = x.size(0), H = x.size(1);
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.dim() == 1 && w.size(0) == H && w.is_contiguous(),
              "weight must be contiguous [H], of x's dtype");
  const auto* xp = (const T*)x.data_ptr();
  const auto* rp = res ? (const T*)res->data_ptr() : nullptr;
  auto* rop = res_out ? (T*)res_out->data_ptr() : nullptr;
  const auto* wp = (const T*)w.data_ptr();
  auto* op = (T*)out.data_ptr();
  const int64_t xs = x.stride(0), rs = res ? res->stride(0) : 0, ros = res_out ? res_out->stride(0) : 0,
                os = out.stride(0);
  const float e = (float)eps;
  folio::parallel_for(0, T_, row_grain(H), [&](int64_t t0, int64_t t1) {
    std::vector<float> sq((size_t)H + 16);
    for (int64_t t = t0; t < t1; ++t)
      rms_row(xp + t * xs, rp ? rp + t * rs : nullptr, rop ? rop + t * ros : nullptr, wp, op + t * os, H, e,
              (int)lanes, sq.data());
  });
}

}  // namespace

// x, residual [T, H] bf16 -> (out, new_residual): new_residual = x + residual; out = RMSNorm(new_residual).
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight,
                                                      double eps, int64_t lanes) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-d");
  const int64_t H = x.size(1);
  check_rows(x, "x", H, x.scalar_type());
  check_rows(residual, "residual", H, x.scalar_type());
  TORCH_CHECK(residual.size(0) == x.size(0), "x and residual differ in rows");
  at::Tensor out = at::empty({x.size(0), H}, x.options());
  at::Tensor new_res = at::empty({x.size(0), H}, x.options());
  if (x.scalar_type() == at::kFloat) rms_run<float>(x, &residual, &new_res, weight, out, eps, lanes);
  else rms_run<uint16_t>(x, &residual, &new_res, weight, out, eps, lanes);
  return {out, new_res};
}

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps, int64_t lanes) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-d");
  check_rows(x, "x", x.size(1), x.scalar_type());
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == at::kFloat) rms_run<float>(x, nullptr, nullptr, weight, out, eps, lanes);
  else rms_run<uint16_t>(x, nullptr, nullptr, weight, out, eps, lanes);
  return out;
}

// ------------------------------------------------------------------------------------------- rotary
namespace {

// One head in place: x[j] = rnd(rnd(x[j] c[j]) + rnd(rot[j] s[j])), rot = cat(-x[half:], x[:half]);
// cb/sb hold the cos/sin of the token rounded to T, as floats.
template <typename T>
inline void rope_head(T* x, const float* cb, const float* sb, int64_t D) {
  using E = Elem<T>;
  const int64_t half = D / 2;
  int64_t j = 0;
#if FOLIO_AVX512
  if constexpr (E::BF16) {
  if (half % 16 == 0) {
    for (; j < half; j += 16) {
      const __m512 x1 = vload(x + j), x2 = vload(x + half + j);
      const __m512 c1 = _mm512_loadu_ps(cb + j), c2 = _mm512_loadu_ps(cb + half + j);
      const __m512 s1 = _mm512_loadu_ps(sb + j), s2 = _mm512_loadu_ps(sb + half + j);
      const __m512 nx2 = _mm512_sub_ps(_mm512_setzero_ps(), x2);  // exact negation (as torch's neg)
      const __m256i o1 = vround(_mm512_add_ps(vrf(_mm512_mul_ps(x1, c1)), vrf(_mm512_mul_ps(nx2, s1))));
      const __m256i o2 = vround(_mm512_add_ps(vrf(_mm512_mul_ps(x2, c2)), vrf(_mm512_mul_ps(x1, s2))));
      vstore(x + j, o1);
      vstore(x + half + j, o2);
    }
    return;
  }
  }
#endif
  for (; j < half; ++j) {
    const float x1 = E::get(x[j]), x2 = E::get(x[half + j]);
    const T o1 = E::put(E::round(x1 * cb[j]) + E::round(-x2 * sb[j]));
    const T o2 = E::put(E::round(x2 * cb[half + j]) + E::round(x1 * sb[half + j]));
    x[j] = o1;
    x[half + j] = o2;
  }
}

// The rotation of q and k, their checks done.
template <typename T>
void rotate(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin) {
  const int64_t T_ = q.size(0), D = q.size(2);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* ct = cos.data_ptr<float>();
  const float* st = sin.data_ptr<float>();
  auto* qp = (T*)q.data_ptr();
  auto* kp = (T*)k.data_ptr();
  const int64_t Hq = q.size(1), Hk = k.size(1);
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  folio::parallel_for(0, T_, row_grain((Hq + Hk) * D), [&](int64_t t0, int64_t t1) {
    std::vector<float> buf(2 * (size_t)D + 32);
    float* cb = buf.data();
    float* sb = cb + D;
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = ct + pos[t] * D;
      const float* s = st + pos[t] * D;
      for (int64_t j = 0; j < D; ++j) {
        cb[j] = Elem<T>::round(c[j]);
        sb[j] = Elem<T>::round(s[j]);
      }
      for (int64_t h = 0; h < Hq; ++h) rope_head(qp + t * qs0 + h * qs1, cb, sb, D);
      for (int64_t h = 0; h < Hk; ++h) rope_head(kp + t * ks0 + h * ks1, cb, sb, D);
    }
  });
}

}  // namespace

// q [T, Hq, D], k [T, Hkv, D] bf16 or float32 rotated in place; positions int64 [T]; cos/sin float32 [P, D]
// contiguous.
void rotary_embedding(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3, "q and k must be 3-d [T, heads, head_dim]");
  TORCH_CHECK((q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat) &&
                  k.scalar_type() == q.scalar_type(), "q, k must be both bfloat16 or both float32");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "q, k need unit stride along head_dim");
  const int64_t T = q.size(0), D = q.size(2);
  TORCH_CHECK(k.size(0) == T && k.size(2) == D && D % 2 == 0, "q/k shapes do not match");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == D && cos.sizes() == sin.sizes(),
              "cos/sin must be contiguous float32 [max_positions, head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == T,
              "positions must be contiguous int64 [T]");
  const int64_t P = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "position ", pos[t], " out of range [0, ", P, ")");
  if (q.scalar_type() == at::kFloat) rotate<float>(positions, q, k, cos, sin);
  else rotate<uint16_t>(positions, q, k, cos, sin);
}

// ------------------------------------------------------------------------------------- SiLU and mul
at::Tensor silu_and_mul_f32(const at::Tensor& gate_up, bool inline_exp);

// gate_up [T, 2I] bf16 -> [T, I]: rnd(rnd(silu(gate)) * up), silu(g) = g / (1 + exp(-g)); float32: below.
at::Tensor silu_and_mul(at::Tensor gate_up, bool inline_exp) {
  TORCH_CHECK(gate_up.dim() == 2 && (gate_up.scalar_type() == at::kBFloat16 || gate_up.scalar_type() == at::kFloat) &&
                  gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be bfloat16 or float32 [T, 2I] with unit stride");
  if (gate_up.scalar_type() == at::kFloat) return silu_and_mul_f32(gate_up, inline_exp);
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, gs = gate_up.stride(0);
  at::Tensor out = at::empty({T, I}, gate_up.options());
  const auto* gp = (const uint16_t*)gate_up.data_ptr();
  auto* op = (uint16_t*)out.data_ptr();
  // ATen runs 64 bf16 at a time through the vector code (Sleef exp: here its results, silu_table), the rest of a
  // row through std::exp
  [[maybe_unused]] const int64_t vec_end = I - I % 64;
#if FOLIO_AVX512
  const int* table = inline_exp || Sleef_expf16_u10 != nullptr ? silu_table(inline_exp) : nullptr;
#endif
  folio::parallel_for(0, T, row_grain(2 * I), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint16_t* g = gp + t * gs;
      const uint16_t* u = g + I;
      uint16_t* o = op + t * I;
      int64_t j = 0;
#if FOLIO_AVX512
      for (; table && j < vec_end; j += 16) {
        const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + j)));
        vstore(o + j, folio::silu_times_up(table, x, vload(u + j)));
      }
#endif
      for (; j < I; ++j) {
        const float x = bf(g[j]);
        o[j] = rnd(rf(x / (1.0f + std::exp(-x))) * bf(u[j]));
      }
    }
  });
  return out;
}

// silu_and_mul of a product in the gated layout (folio.models.gated_layout): each row of gate_up [T, 2I] is runs
// of GATED_RUN gates, each followed by the same outputs' ups; out [T, I] in the outputs' order (the caller's `into`,
// rows of unit stride, or a new tensor). Every output through the vector code's table, as silu_and_mul takes a row
// whose I is a multiple of 64 (the caller's condition), so the results are that op's over the plain product, bit
// for bit.
constexpr int64_t GATED_RUN = 32;  // gated_layout.GATED_RUN
// Values ahead of the current run to prefetch (4 KiB): one stream a thread where the plain op has two, and without
// them the op on 1852 x 2 x 4864 products from memory took 1.2x the plain op's time on an Emerald Rapids Xeon;
// with them 0.75x (2 KiB 0.79x, 8 KiB as 4).
constexpr int64_t GATED_PREFETCH = 2048;

at::Tensor silu_and_mul_runs(at::Tensor gate_up, bool inline_exp, std::optional<at::Tensor> into) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kBFloat16 && gate_up.stride(1) == 1 &&
                  gate_up.size(1) % 128 == 0,
              "gate_up must be bfloat16 [T, 2I] with unit stride, I a multiple of 64");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, gs = gate_up.stride(0);
  at::Tensor out = into ? *into : at::empty({T, I}, gate_up.options());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == T && out.size(1) == I && out.scalar_type() == at::kBFloat16 &&
                  out.stride(1) == 1,
              "out must be bfloat16 [T, I] with unit stride");
  const int64_t os = out.stride(0);
#if FOLIO_AVX512
  TORCH_CHECK(inline_exp || Sleef_expf16_u10 != nullptr, "the gated layout's SiLU needs the vector exp");
  const int* table = silu_table(inline_exp);
  const auto* gp = (const uint16_t*)gate_up.data_ptr();
  auto* op = (uint16_t*)out.data_ptr();
  folio::parallel_for(0, T, row_grain(2 * I), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint16_t* g = gp + t * gs;
      uint16_t* o = op + t * os;
      for (int64_t j = 0; j < I; j += GATED_RUN, g += 2 * GATED_RUN) {
        _mm_prefetch(reinterpret_cast<const char*>(g + GATED_PREFETCH), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(g + GATED_PREFETCH + 32), _MM_HINT_T0);
        for (int k = 0; k < GATED_RUN; k += 16) {
          const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + k)));
          vstore(o + j + k, folio::silu_times_up(table, x, vload(g + GATED_RUN + k)));
        }
      }
    }
  });
#else
  TORCH_CHECK(false, "built without AVX-512");
#endif
  return out;
}

// sums of the rows of a contiguous float [R, n] tensor in ATen's order (to check `lanes` against torch.sum)
at::Tensor row_sums(at::Tensor x, int64_t lanes) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float [R, n]");
  at::Tensor out = at::empty({x.size(0)}, x.options());
  for (int64_t r = 0; r < x.size(0); ++r)
    out.data_ptr<float>()[r] = aten_row_sum(x.data_ptr<float>() + r * x.size(1), x.size(1), (int)lanes);
  return out;
}

bool has_avx512() { return FOLIO_AVX512 != 0; }

// The table bf16 silu_and_mul looks its gates up in with this exp (silu_table), as int32 [32776] over its 65552
// uint16 entries, for an epilogue that fuses the op (cpu_quant_linear.cpp); None where the op uses none (no
// AVX-512, or no vector exp). The table is static: the tensor does not own it.
at::Tensor bf16_silu_table(bool inline_exp) {
#if FOLIO_AVX512
  if (inline_exp || Sleef_expf16_u10 != nullptr)
    return at::from_blob(const_cast<int*>(silu_table(inline_exp)), {folio::SILU_TABLE_INTS},
                         at::TensorOptions().dtype(at::kInt));
#endif
  return at::Tensor();
}

// ------------------------------------------------------------------------------ float32 SiLU and mul
// ATen's float32 silu, x / (1 + exp(-x)), runs each contiguous segment TensorIterator hands its loop two
// Vectorized<float> at a time (Sleef's expf u10 at the vector width: 16 lanes with AVX-512, 8 with AVX2) and the
// last n % (2 lanes) values through std::exp. A tensor of GRAIN_ELEMS values or more is handed out by
// at::parallel_for over its elements, so that a thread's range may start or end inside a row: aten_segments
// replays that split (the same call, the same thread count) and silu_segment the loop, so the float32 results
// equal torch's bit for bit (fused_ops.py checks silu_f32 against torch at load; the multiply by up is one
// rounding as in torch).

// Whether the vector path exists: the exp it takes (inline_exp: the inline SLEEF copy, AVX-512 only) is at hand.
bool has_f32_silu(bool inline_exp) {
#if FOLIO_AVX512
  return inline_exp || Sleef_expf16_u10 != nullptr;
#elif FOLIO_AVX2
  return !inline_exp && Sleef_expf8_u10 != nullptr;
#else
  return false;
#endif
}

// o[j] = silu(g[j]) (* u[j] unless u is null) for j < n, as ATen's vectorized loop computes a segment of n values.
inline void silu_segment(const float* g, const float* u, float* o, int64_t n, bool inline_exp) {
  int64_t j = 0;
#if FOLIO_AVX512
  const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
  auto vec = [&](int64_t i) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 m = _mm512_xor_ps(x, sign);  // Vectorized::neg
    const __m512 s = _mm512_div_ps(x, _mm512_add_ps(one, inline_exp ? exp_sleef(m) : Sleef_expf16_u10(m)));
    _mm512_storeu_ps(o + i, u ? _mm512_mul_ps(s, _mm512_loadu_ps(u + i)) : s);
  };
  constexpr int64_t L = 16;
#elif FOLIO_AVX2
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  auto vec = [&](int64_t i) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, Sleef_expf8_u10(_mm256_xor_ps(x, sign))));
    _mm256_storeu_ps(o + i, u ? _mm256_mul_ps(s, _mm256_loadu_ps(u + i)) : s);
  };
  constexpr int64_t L = 8;
#endif
#if FOLIO_AVX512 || FOLIO_AVX2
  for (; j + 2 * L <= n; j += 2 * L) {
    vec(j);
    vec(j + L);
  }
#endif
  for (; j < n; ++j) {
    const float s = g[j] / (1.0f + std::exp(-g[j]));
    o[j] = u ? s * u[j] : s;
  }
}

// seg(t, c, n) for the pieces (row t, columns c .. c + n) of a [T, I] tensor that ATen's TensorIterator hands its
// loop, on the threads it would run them on.
template <class Seg>
void aten_segments(int64_t T, int64_t I, const Seg& seg) {
  auto range = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end;) {
      const int64_t t = i / I, c = i % I, n = std::min(I - c, end - i);
      seg(t, c, n);
      i += n;
    }
  };
  if (T * I < GRAIN_ELEMS || folio::num_threads() == 1) range(0, T * I);
  else folio::parallel_for(0, T * I, GRAIN_ELEMS, range);
}

// gate_up float32 [T, 2I] (unit stride along rows) -> silu(gate) * up [T, I].
at::Tensor silu_and_mul_f32(const at::Tensor& gate_up, bool inline_exp) {
  TORCH_CHECK(has_f32_silu(inline_exp), "no vector exp for float32 silu here");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, gs = gate_up.stride(0);
  at::Tensor out = at::empty({T, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  aten_segments(T, I, [&](int64_t t, int64_t c, int64_t n) {
    silu_segment(gp + t * gs + c, gp + t * gs + I + c, op + t * I + c, n, inline_exp);
  });
  return out;
}

// float32 silu of a contiguous tensor as silu_and_mul computes it (as one row): to check against torch's own.
at::Tensor silu_f32(at::Tensor x, bool inline_exp) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float");
  TORCH_CHECK(has_f32_silu(inline_exp), "no vector exp for float32 silu here");
  at::Tensor out = at::empty(x.sizes(), x.options());
  const float* p = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  aten_segments(1, x.numel(), [&](int64_t, int64_t c, int64_t n) { silu_segment(p + c, nullptr, o + c, n, inline_exp); });
  return out;
}

bool has_sleef() {
#if FOLIO_AVX512
  return Sleef_expf16_u10 != nullptr;
#elif FOLIO_AVX2
  return Sleef_expf8_u10 != nullptr;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  folio::bind_decode_threads(m);
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "(x + residual) -> (RMSNorm(x + residual), x + residual)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm(x)", pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rotary_embedding", &rotary_embedding, "neox rotary embedding of q and k in place",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up", pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("silu_and_mul_runs", &silu_and_mul_runs, "silu(gate) * up of a product in the gated layout (into out)",
        pybind11::arg("gate_up"), pybind11::arg("inline_exp"), pybind11::arg("out") = std::nullopt,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("row_sums", &row_sums, "row sums in ATen's cascade order with lanes-wide vectors");
  m.def("bf16_silu_table", &bf16_silu_table, "the table of bf16 silu_and_mul's rounded silu (None: none used)");
  m.def("silu_f32", &silu_f32, "float32 silu as the kernel computes it (checks)");
  m.def("has_avx512", &has_avx512, "whether the vector paths were compiled");
  m.def("has_sleef", &has_sleef, "whether Sleef_expf16_u10 (AVX2: Sleef_expf8_u10) was found in libtorch_cpu");
  m.def("has_f32_silu", &has_f32_silu, "whether float32 silu has its vector path with this exp");
}
