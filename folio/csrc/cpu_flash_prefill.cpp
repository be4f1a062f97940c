// Prefill attention from bf16 and 8-bit paged caches as tiled matrix products (FlashAttention style), through
// PyTorch's at::native::cpublas::brgemm, in float32 products or (bf16 caches) bf16 ones.
//
// The paged kernel (cpu_paged_attention.cpp) attends one query row and one key at a time; a long query (a prompt,
// a prefill chunk) is a matrix product, and a GEMM engine runs it many times faster. For each request given here:
//   1. pack: its context's K and V, per kv head and per tile of KEY_TILE keys, are gathered from the blocks of the
//      cache (block table, in place) into the layout brgemm reads as B (below; bf16 operands 16 keys at a time in
//      AVX-512 registers where head_dim is a multiple of 32);
//   2. attend: per (request, kv head, tile of query tokens), the query rows of the tile's tokens times the G query
//      heads of the kv head are stacked (rows r = token * G + g), so K and V are read once per group; per key
//      tile S = Q K^T by brgemm (only as far as the tile's rows see, on the diagonal), then scale, soft-cap,
//      causal and sliding-window masks and the online softmax (running max and sum, float32, base 2), and
//      O += P V by brgemm into a float32 accumulator rescaled when the max grows; finally O / sum in q's dtype.
// Products (T):
//   float32: K, V (an 8-bit row's codes times its scale, as folio.attention.kv_quant dequantises) and q widened,
//            K^T [D, KEY_TILE] and V [KEY_TILE, D] row-major; brgemm's float32 GEMM (MKL where oneDNN has no
//            kernel). For CPUs without AVX-512, where the paged kernel's loop is AVX2.
//   bf16:    bf16 q and caches as they are, in the pairs oneDNN's micro-kernel reads (AMX tiles where the CPU has
//            them, AVX512-BF16 elsewhere); P rounded to bf16 before P V, as the paged kernel's AVX512-BF16 loop
//            and PyTorch's flash attention round it, the sum taken of the rounded values. An 8-bit cache's codes
//            go in as bf16 (exactly: int8 codes and fp8 e4m3 values are bf16 values), their scales apart, one
//            per key: K's times the key's scores, V's times its probabilities before they are rounded. With
//            scales that are powers of two, an 8-bit cache attends exactly as a bf16 cache of the same values.
//
// Layouts: q, out [T, Hq, D] bf16 or float32 (unit stride along D); caches [num_blocks, block_size, Hkv, R]
// contiguous: bf16 rows (R = D), or 8-bit ones (folio.attention.kv_quant: R = D + 4, D int8 codes or fp8 e4m3
// bits then the row's float32 scale);
// reqs int32 [B, 3] = (first token in the batch, query length, context length including the query);
// block_tables int32 [B, max_blocks]. Sliding window W (0: none): the query at position p sees keys
// p - W < t <= p; keys before the window of a request's first query are never read. Soft-capping (cap > 0):
// s -> cap * tanh(s / cap) after the scale. Attention sinks (GPT-OSS: a logit per query head in the softmax's
// denominator, weighing no value): a row's sum gains exp2(sink - its running max) once, at the end.

// Only the headers needed (not torch/extension.h), as cpu_paged_attention.cpp: a faster first-use build.
#include "parallel.h"
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "attention_sinks.h"
#include "avx512_math.h"
#include "exp2_approx.h"
#include "kv_cache_rows.h"

// bf16 products: oneDNN's micro-kernel (brgemm with bf16 operands in pairs) needs AVX-512, the probabilities'
// rounding AVX512-BF16
#if defined(CPUBLAS_BRGEMM_BF16BF16F32) && defined(__AVX512F__) && defined(__AVX512BF16__)
#define FOLIO_BF16_PRODUCTS 1
#else
#define FOLIO_BF16_PRODUCTS 0
#endif

namespace {

constexpr int KEY_TILE = 256;  // keys per tile: the N of S = Q K^T and the K of P V
constexpr int KEY_STEP = 32;   // a tile's products stop at the keys its rows see, rounded up to this (causal)
static_assert(KEY_TILE % KEY_STEP == 0 && KEY_STEP % 32 == 0, "bf16 probabilities are stored 32 keys at a time");
constexpr int TARGET_ROWS = 128;  // query rows (tokens x heads of a group) per tile: the M of both products
constexpr float LOG2E = 1.4426950408889634f;

using bf16 = at::BFloat16;

struct Params {
  const void* q;
  int64_t q_st, q_sh;
  void* out;
  const void* k_cache;
  const void* v_cache;
  const int32_t* reqs;
  const int32_t* block_tables;
  int64_t max_blocks;
  int block_size, Hkv, G, D;
  int row_width;  // elements of a cache row: D, or D + 4 for an 8-bit cache
  float scale_log2;  // softmax scale times log2(e): scores are kept in base 2
  int window;  // 0: none
  float softcap2, inv_softcap2;  // soft-capping of the base-2 scores: cap * log2(e) and its inverse; 0: none
  const float* sinks;  // per query head, its sink times log2(e) (base 2, as the scores); null: none
};

// The operands of the two products: float32 (T = float: K^T [D, KEY_TILE] and V [KEY_TILE, D] row-major) or bf16
// (T = bf16: oneDNN's micro-kernel takes bf16 B in pairs along the reduced dimension, K^T as [D / 2, KEY_TILE, 2]
// and V as [KEY_TILE / 2, D, 2]). A tile holds KEY_TILE keys; in a context's last one, those past the context are
// zero up to the next KEY_STEP, as far as the products read (below).
template <typename T>
constexpr bool PAIRS = std::is_same<T, bf16>::value;

// Where request b's packed context starts and which keys it holds: keys [kbeg, ctx) in tiles of KEY_TILE from
// kbeg; each kv head's K (and V) take tiles * KEY_TILE * D elements from offset + head * that.
struct Span {
  int kbeg, tiles;
  int64_t offset;
};

// Key t of kv head h of request b: the element offset of its row in the cache.
inline int64_t cache_row(const Params& P, int b, int h, int t) {
  const int32_t block = P.block_tables[b * P.max_blocks + t / P.block_size];
  return (((int64_t)block * P.block_size + t % P.block_size) * P.Hkv + h) * P.row_width;
}

// bf16 products of an 8-bit cache: its codes go in as bf16, its scales apart (one per key)
template <typename C, typename T>
constexpr bool KEY_SCALES = PAIRS<T> && Cache<C>::QUANTIZED;

#if FOLIO_BF16_PRODUCTS
constexpr int VECTOR_PACK_MAX_D = 256;  // head dims the vector packing takes (multiples of 32 up to this)

// pack_tile's bf16 operands for a head_dim of a multiple of 32 up to VECTOR_PACK_MAX_D: 16 keys at a time, K's
// words transposed in registers, V's rows interleaved by pairs of keys (the same layout as the scalar loop's).
template <typename C>
void pack_pairs_avx512(const Params& P, int b, int h, int t0, int kt, bf16* kdst, bf16* vdst, float* kscale,
                       float* vscale) {
  const int D = P.D, W = D / 2;
  alignas(64) static const bf16 zeros[VECTOR_PACK_MAX_D] = {};
  alignas(64) bf16 kbuf[KEY_SCALES<C, bf16> ? 16 : 1][VECTOR_PACK_MAX_D];
  alignas(64) bf16 vbuf[KEY_SCALES<C, bf16> ? 16 : 1][VECTOR_PACK_MAX_D];
  // V pairs: elements 0-15 of two rows' 32, interleaved (lo), then 16-31 (hi)
  __m512i lo_idx, hi_idx;
  {
    alignas(64) int16_t lo[32], hi[32];
    for (int i = 0; i < 16; ++i) {
      lo[2 * i] = i, lo[2 * i + 1] = 32 + i;
      hi[2 * i] = 16 + i, hi[2 * i + 1] = 48 + i;
    }
    lo_idx = _mm512_load_si512(lo);
    hi_idx = _mm512_load_si512(hi);
  }
  uint32_t* kd = reinterpret_cast<uint32_t*>(kdst);
  for (int j0 = 0; j0 < kt; j0 += 16) {
    const int n = std::min(16, kt - j0);
    const bf16* krow[16];
    const bf16* vrow[16];
    for (int i = 0; i < 16; ++i) {
      if (i >= n) {
        krow[i] = vrow[i] = zeros;
        continue;
      }
      const int64_t row = cache_row(P, b, h, t0 + j0 + i);
      const C* k = static_cast<const C*>(P.k_cache) + row;
      const C* v = static_cast<const C*>(P.v_cache) + row;
      if constexpr (KEY_SCALES<C, bf16>) {
        kscale[j0 + i] = Cache<C>::scale(k, D);
        vscale[j0 + i] = Cache<C>::scale(v, D);
        exact_codes(k, kbuf[i], D / 32);
        exact_codes(v, vbuf[i], D / 32);
        krow[i] = kbuf[i];
        vrow[i] = vbuf[i];
      } else {
        krow[i] = k;
        vrow[i] = v;
      }
    }
    const __mmask16 keys = n == 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
    for (int w0 = 0; w0 < W; w0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(reinterpret_cast<const uint32_t*>(krow[i]) + w0);
      transpose16x16(r);
      for (int w = 0; w < 16; ++w) _mm512_mask_storeu_epi32(kd + (int64_t)(w0 + w) * KEY_TILE + j0, keys, r[w]);
    }
    for (int i = 0; i < n; i += 2) {  // j0 is even: keys j0 + i and j0 + i + 1 make a pair
      bf16* out = vdst + (int64_t)((j0 + i) >> 1) * D * 2;
      for (int d0 = 0; d0 < D; d0 += 32) {
        const __m512i a = _mm512_loadu_si512(vrow[i] + d0), c = _mm512_loadu_si512(vrow[i + 1] + d0);
        _mm512_storeu_si512(out + 2 * d0, _mm512_permutex2var_epi16(a, lo_idx, c));
        _mm512_storeu_si512(out + 2 * d0 + 32, _mm512_permutex2var_epi16(a, hi_idx, c));
      }
    }
  }
}
#endif

// Tile of kt keys from t0 into kdst (K^T) and vdst (V) in T's layout (above), widened to float32 (an 8-bit row's
// codes times its scale) or as they are (bf16 operands: an 8-bit row's codes, its scales into kscale and vscale
// [KEY_TILE]); keys from kt to the next multiple of KEY_STEP are zero.
template <typename C, typename T>
void pack_tile(const Params& P, int b, int h, int t0, int kt, T* kdst, T* vdst, float* kscale, float* vscale) {
  const int D = P.D;
  if (kt < KEY_TILE) {  // a context's last tile: zeros for the keys the products read past it (no NaN from stale
                        // memory reaches the output), before the packing writes pairs that straddle the end
    const int kr = std::min(KEY_TILE, (kt + KEY_STEP - 1) / KEY_STEP * KEY_STEP);
    if constexpr (PAIRS<T>) {  // K^T [D / 2][KEY_TILE] words, V [KEY_TILE / 2][D][2]
      uint32_t* kd = reinterpret_cast<uint32_t*>(kdst);
      for (int w = 0; w < D / 2; ++w) std::fill(kd + (int64_t)w * KEY_TILE + kt, kd + (int64_t)w * KEY_TILE + kr, 0u);
      std::fill(vdst + (int64_t)(kt >> 1) * D * 2, vdst + (int64_t)(kr >> 1) * D * 2, T(0));
    } else {  // K^T [D][KEY_TILE], V [KEY_TILE][D]
      for (int d = 0; d < D; ++d) std::fill(kdst + (int64_t)d * KEY_TILE + kt, kdst + (int64_t)d * KEY_TILE + kr, T(0));
      std::fill(vdst + (int64_t)kt * D, vdst + (int64_t)kr * D, T(0));
    }
    if (KEY_SCALES<C, T>) {
      std::fill(kscale + kt, kscale + kr, 0.f);
      std::fill(vscale + kt, vscale + kr, 0.f);
    }
  }
#if FOLIO_BF16_PRODUCTS
  if constexpr (PAIRS<T>) {
    if (D % 32 == 0 && D <= VECTOR_PACK_MAX_D) return pack_pairs_avx512<C>(P, b, h, t0, kt, kdst, vdst, kscale, vscale);
  }
#endif
  for (int j = 0; j < kt; ++j) {
    const int64_t row = cache_row(P, b, h, t0 + j);
    const C* k = static_cast<const C*>(P.k_cache) + row;
    const C* v = static_cast<const C*>(P.v_cache) + row;
    if (PAIRS<T>) {  // pairs of K's values as 32-bit words; V's values every other element
      T* vrow = vdst + (int64_t)(j >> 1) * D * 2 + (j & 1);
      if constexpr (KEY_SCALES<C, T>) {
        kscale[j] = Cache<C>::scale(k, D);
        vscale[j] = Cache<C>::scale(v, D);
        for (int w = 0; w < D / 2; ++w) {
          T* pair = kdst + ((int64_t)w * KEY_TILE + j) * 2;
          pair[0] = static_cast<T>(Cache<C>::value(k[2 * w]));
          pair[1] = static_cast<T>(Cache<C>::value(k[2 * w + 1]));
        }
        for (int d = 0; d < D; ++d) vrow[2 * d] = static_cast<T>(Cache<C>::value(v[d]));
      } else {  // bf16 rows (C = T)
        const uint32_t* kw = reinterpret_cast<const uint32_t*>(k);
        uint32_t* kd = reinterpret_cast<uint32_t*>(kdst);
        for (int w = 0; w < D / 2; ++w) kd[(int64_t)w * KEY_TILE + j] = kw[w];
        for (int d = 0; d < D; ++d) vrow[2 * d] = static_cast<T>(v[d]);
      }
    } else {
      const float ks = Cache<C>::scale(k, D), vs = Cache<C>::scale(v, D);
      for (int d = 0; d < D; ++d) kdst[(int64_t)d * KEY_TILE + j] = Cache<C>::value(k[d]) * ks;
      for (int d = 0; d < D; ++d) vdst[(int64_t)j * D + d] = Cache<C>::value(v[d]) * vs;
    }
  }
}

struct Item {
  int b, h, q0, q1;  // request, kv head, query tokens [q0, q1)
  int64_t cost;
};

// An array left as allocated: every element a tile uses is written before it is read, and std::vector would zero
// the scores' and probabilities' tiles (192 KB a thread and call in bf16), a tenth of a short prompt's time.
template <typename E>
struct Scratch {
  std::unique_ptr<E[]> elements;
  explicit Scratch(size_t n) : elements(new E[n]) {}
  E* data() { return elements.get(); }
  E& operator[](size_t i) { return elements[i]; }
};

// Per-thread buffers of one query tile of at most M rows: query rows [M, D] and probabilities [M, KEY_TILE] as
// operands (T), scores [M, KEY_TILE], the output accumulator [M, D], running max and sum (float32).
template <typename T>
struct TileBuffers {
  Scratch<T> q, p;
  Scratch<float> s, acc, m, l;
  TileBuffers(int M, int D)
      : q((size_t)M * D), p(PAIRS<T> ? (size_t)M * KEY_TILE : 0), s((size_t)M * KEY_TILE), acc((size_t)M * D), m(M),
        l(M) {}
  T* probabilities() { return PAIRS<T> ? p.data() : reinterpret_cast<T*>(s.data()); }  // float32: in place
};

// The running max and the sum of one row's probabilities over a key tile.
struct RowSoftmax {
  float max, sum;
};

// One row of a key tile: its scores s [KEY_TILE] (Q K^T) to probabilities 2^(scaled s - new max) for the keys
// [first, lim) the row sees, 0 for the others up to kn (the keys P V reads), in place (float32 products), given
// the row's max so far. (Float32 operands hold an 8-bit row's values with its scale: there are no key scales
// here, the last two are null.)
RowSoftmax probabilities(const Params& P, float* s, float* p, int first, int lim, int kn, float old_max,
                         const float*, const float*) {
  if (P.softcap2 > 0.f) {
    for (int j = first; j < lim; ++j) s[j] = P.softcap2 * std::tanh(s[j] * P.scale_log2 * P.inv_softcap2);
  } else {
    for (int j = first; j < lim; ++j) s[j] *= P.scale_log2;
  }
  float mt = -std::numeric_limits<float>::infinity();
  // (the reductions are omp simd loops: -O3 alone does not vectorise float maxima and sums)
#pragma omp simd reduction(max : mt)
  for (int j = first; j < lim; ++j) mt = std::max(mt, s[j]);
  const float mn = std::max(old_max, mt);
  for (int j = first; j < lim; ++j) p[j] = exp2_approx(s[j] - mn);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int j = first; j < lim; ++j) sum += p[j];
  std::fill(p, p + first, 0.f);
  std::fill(p + lim, p + kn, 0.f);
  return {mn, sum};
}

#if FOLIO_BF16_PRODUCTS
// bf16 products keep a row's running max where it is until a tile's max passes it by more than MAX_SLACK (base 2;
// FlashAttention-3's lazy rescaling): the probabilities are then at most 2^8, which float32 and bf16 hold at their
// full relative precision, and a row's sum and accumulator are rescaled only when its max grows that much, a few
// times a row instead of at most tiles. (The float32 products' path keeps the exact max: unmeasured there.)
constexpr float MAX_SLACK = 8.f;

inline float running_max(float tile_max, float old_max) {
  return tile_max <= old_max + MAX_SLACK ? old_max : tile_max;
}

// 2^x (x <= MAX_SLACK) for probabilities that are rounded to bf16 next (2^-9): a cubic in the fraction, fitted for
// the relative error on [-1/2, 1/2] (7.7e-5), in place of avx512_math.h's degree-5 exp2_ps (1.5e-7): a prefill
// layer 1.01-1.08x (`attention_bench.py --long-queries --versus-kernel`, Qwen2-0.5B's and Llama-3-8B's shapes).
inline __m512 exp2_probability_ps(__m512 x) {
  static constexpr float C[] = {0.9999289512634277f, 0.6932762265205383f, 0.24260404706001282f, 0.05508868396282196f};
  return exp2_polynomial_ps(x, C);
}

// Keys [32 j, 32 j + 32) of a tile, their probabilities in ea (the first 16) and eb: rounded to bf16 into p (times
// their V scales first where vscale, an 8-bit cache's, is given), and the rounded values added to sum (vdpbf16ps
// by ones: each lane adds a pair). One rounding and one store for two vectors.
inline void store_pair(bf16* p, int j, __m512 ea, __m512 eb, const float* vscale, __m512& sum) {
  const __m512bh rounded = _mm512_cvtne2ps_pbh(eb, ea);  // ea's in the low half
  const __m512bh operand = vscale ? _mm512_cvtne2ps_pbh(_mm512_mul_ps(eb, _mm512_loadu_ps(vscale + 32 * j + 16)),
                                                        _mm512_mul_ps(ea, _mm512_loadu_ps(vscale + 32 * j)))
                                  : rounded;
  _mm512_storeu_si512(p + 32 * j, (__m512i)operand);
  sum = _mm512_dpbf16_ps(sum, rounded, (__m512bh)_mm512_set1_epi16(0x3f80));
}

// A row that sees keys [0, lim) of the tile, without soft cap (most rows: a window's start or a soft cap take the
// general path below): lim / 16 whole vectors and the first lim % 16 lanes of the next, no masks on the whole
// ones, four chains of maxima (vmaxps' latency): the scale times the max of the scores (the max of the scaled
// ones), the exponent in one fused multiply-subtract, as the general path does. An 8-bit cache takes this path too,
// each score first times its key's K scale, so one with scales of powers of two attends bit for bit as a bf16
// cache of its values. WHOLE: lim >= KEY_TILE (a long prompt's rows before the diagonal), with no tail to test;
// SCALED_KEYS: an 8-bit cache's (kscale).
template <bool WHOLE, bool SCALED_KEYS>
RowSoftmax plain_probabilities(const Params& P, const float* s, bf16* p, int lim, int kn, float old_max,
                               const float* kscale, const float* vscale) {
  constexpr int NV = KEY_TILE / 16;
  const int full = WHOLE ? NV : lim / 16, rest = WHOLE ? 0 : lim % 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << rest) - 1);
  const auto score = [&](int i) {  // vector i's scores, times their keys' K scales
    const __m512 v = _mm512_loadu_ps(s + 16 * i);
    return SCALED_KEYS ? _mm512_mul_ps(v, _mm512_loadu_ps(kscale + 16 * i)) : v;
  };
  const __m512 none = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 mx[4] = {none, none, none, none};
  for (int i = 0; i < full; ++i) mx[i % 4] = _mm512_max_ps(mx[i % 4], score(i));
  if (rest) mx[full % 4] = _mm512_mask_max_ps(mx[full % 4], tail, mx[full % 4], score(full));
  const float raw_max = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(mx[0], mx[1]), _mm512_max_ps(mx[2], mx[3])));
  const float mn = running_max(raw_max * P.scale_log2, old_max);
  const __m512 scale = _mm512_set1_ps(P.scale_log2), m = _mm512_set1_ps(mn);
  const auto probabilities_of = [&](int i) {  // vector i's: 2^(scale s - max), 0 past lim
    if (i > full || (i == full && !rest)) return _mm512_setzero_ps();
    const __m512 e = exp2_probability_ps(_mm512_fmsub_ps(score(i), scale, m));
    return i < full ? e : _mm512_maskz_mov_ps(tail, e);
  };
  __m512 sums[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  const int pairs = (full + (rest ? 1 : 0) + 1) / 2;
  for (int j = 0; j < pairs; ++j) store_pair(p, j, probabilities_of(2 * j), probabilities_of(2 * j + 1), vscale, sums[j % 2]);
  for (int j = pairs; j < kn / 32; ++j) _mm512_storeu_si512(p + 32 * j, _mm512_setzero_si512());
  return {mn, _mm512_reduce_add_ps(_mm512_add_ps(sums[0], sums[1]))};
}

// The same into bf16 probabilities (bf16 products), in registers: the sum is of the rounded probabilities, so that
// the output is an exact weighted mean of V's rows. With an 8-bit cache (kscale and vscale: the tile's keys'
// scales; else null) each score is first multiplied by its key's K scale, and each probability by its V scale
// before it is rounded (the sum stays of the rounded probabilities alone). Rows from the tile's first key without
// a soft cap take plain_probabilities; here, a window's first keys masked and soft-capped scores.
RowSoftmax probabilities(const Params& P, const float* s, bf16* p, int first, int lim, int kn, float old_max,
                         const float* kscale, const float* vscale) {
  constexpr int NV = KEY_TILE / 16;
  if (first == 0 && P.softcap2 <= 0.f) {
    if (kscale)
      return lim >= KEY_TILE ? plain_probabilities<true, true>(P, s, p, lim, kn, old_max, kscale, vscale)
                             : plain_probabilities<false, true>(P, s, p, lim, kn, old_max, kscale, vscale);
    return lim >= KEY_TILE ? plain_probabilities<true, false>(P, s, p, lim, kn, old_max, nullptr, vscale)
                           : plain_probabilities<false, false>(P, s, p, lim, kn, old_max, nullptr, vscale);
  }
  const __m512 none = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 x[NV];
  __mmask16 seen[NV];
  __m512 mx = none;
  // vectors wholly outside [first, lim) (half a diagonal tile's, on average) only get their zeros
  const int v0 = first / 16, v1 = (lim + 15) / 16;
  for (int i = 0; i < NV; ++i) {
    if (i < v0 || i >= v1) continue;
    const int lo = std::min(16, std::max(0, first - 16 * i)), hi = std::min(16, std::max(0, lim - 16 * i));
    seen[i] = static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));  // lanes [lo, hi)
    __m512 v = _mm512_loadu_ps(s + 16 * i);
    if (kscale) v = _mm512_mul_ps(v, _mm512_loadu_ps(kscale + 16 * i));
    if (P.softcap2 > 0.f)
      v = _mm512_mul_ps(_mm512_set1_ps(P.softcap2), tanh_ps(_mm512_mul_ps(v, _mm512_set1_ps(P.scale_log2 * P.inv_softcap2))));
    x[i] = _mm512_mask_mov_ps(none, seen[i], v);
    mx = _mm512_max_ps(mx, x[i]);
  }
  // x: base-2 scores where soft-capped, else scores the scale turns into base 2 (as plain_probabilities does)
  const float factor = P.softcap2 > 0.f ? 1.f : P.scale_log2;
  const float mn = running_max(_mm512_reduce_max_ps(mx) * factor, old_max);
  const __m512 scale = _mm512_set1_ps(factor), m = _mm512_set1_ps(mn);
  const auto probabilities_of = [&](int i) {
    if (i < v0 || i >= v1) return _mm512_setzero_ps();
    return _mm512_maskz_mov_ps(seen[i], exp2_probability_ps(_mm512_fmsub_ps(x[i], scale, m)));
  };
  __m512 sums[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int j = 0; j < kn / 32; ++j) {
    if (2 * j + 1 < v0 || 2 * j >= v1) {
      _mm512_storeu_si512(p + 32 * j, _mm512_setzero_si512());
      continue;
    }
    store_pair(p, j, probabilities_of(2 * j), probabilities_of(2 * j + 1), vscale, sums[j % 2]);
  }
  return {mn, _mm512_reduce_add_ps(_mm512_add_ps(sums[0], sums[1]))};
}
#endif

// kscales, vscales: the packed keys' scales (KEY_SCALES; else null), one per key where kpack has a row of D
template <typename Q, typename T>
void attend_item(const Params& P, const Span& span, const T* kpack, const T* vpack, const float* kscales,
                 const float* vscales, const Item& it, TileBuffers<T>& buf) {
  const int D = P.D, G = P.G;
  const int32_t* rq = P.reqs + 3 * it.b;
  const int qs = rq[0], L = rq[2], off = L - rq[1];
  const int M = (it.q1 - it.q0) * G;
  for (int r = 0; r < M; ++r) {
    const Q* src =
        static_cast<const Q*>(P.q) + (int64_t)(qs + it.q0 + r / G) * P.q_st + (int64_t)(it.h * G + r % G) * P.q_sh;
    if (std::is_same<Q, T>::value) std::memcpy(&buf.q[(size_t)r * D], src, D * sizeof(T));
    else for (int d = 0; d < D; ++d) buf.q[(size_t)r * D + d] = static_cast<T>(static_cast<float>(src[d]));
  }
  std::fill(buf.m.data(), buf.m.data() + M, -std::numeric_limits<float>::infinity());
  std::fill(buf.l.data(), buf.l.data() + M, 0.f);

  // key tiles from the window of the first query token to the last token (causal)
  const int kfirst = P.window ? std::max(span.kbeg, off + it.q0 - P.window + 1) : 0;
  const int kend = off + it.q1;
  const int n0 = (kfirst - span.kbeg) / KEY_TILE, n1 = (kend - 1 - span.kbeg) / KEY_TILE;
  const int64_t head_off = span.offset + (int64_t)it.h * span.tiles * KEY_TILE * D;
  float* S = buf.s.data();
  T* tile_p = buf.probabilities();
  for (int n = n0; n <= n1; ++n) {
    const int t0 = span.kbeg + n * KEY_TILE;
    const int kt = std::min(KEY_TILE, L - t0);
    // the tile's keys any row sees, in whole steps of KEY_STEP: on the diagonal, up to the last row's position
    const int kn = std::min(KEY_TILE, (std::min(kt, kend - t0) + KEY_STEP - 1) / KEY_STEP * KEY_STEP);
    const T* kb = kpack + head_off + (int64_t)n * KEY_TILE * D;
    const T* vb = vpack + head_off + (int64_t)n * KEY_TILE * D;
    const int64_t tile_keys = head_off / D + (int64_t)n * KEY_TILE;
    const float* ks = kscales ? kscales + tile_keys : nullptr;
    const float* vs = vscales ? vscales + tile_keys : nullptr;
    at::native::cpublas::brgemm(M, kn, D, D, KEY_TILE, KEY_TILE, false, buf.q.data(), kb, S, PAIRS<T>);
    bool first_tile = n == n0;
    for (int r = 0; r < M; ++r) {
      const int pos = off + it.q0 + r / G;
      const int lim = std::min(kt, pos + 1 - t0);  // keys [first, lim) of this tile are the row's to see
      const int first = P.window ? std::max(0, pos - P.window + 1 - t0) : 0;
      float* s = S + (size_t)r * KEY_TILE;
      T* p = tile_p + (size_t)r * KEY_TILE;
      float* a = buf.acc.data() + (size_t)r * D;
      if (lim <= first) {  // no key of this tile for the row (before the diagonal or past its window)
        std::fill(p, p + kn, T(0));
        if (first_tile) std::fill(a, a + D, 0.f);
        continue;
      }
      const auto [mn, sum] = probabilities(P, s, p, first, lim, kn, buf.m[r], ks, vs);
      if (first_tile) {
        std::fill(a, a + D, 0.f);
        buf.l[r] = sum;
      } else {
        if (mn == buf.m[r]) {  // (bf16 products' max moves lazily: most tiles)
          buf.l[r] += sum;
        } else {
          const float corr = exp2_approx(buf.m[r] - mn);  // 2^-126 while the row has seen no key (m = -inf),
                                                            // where l and acc are still 0
          buf.l[r] = buf.l[r] * corr + sum;
          for (int d = 0; d < D; ++d) a[d] *= corr;
        }
      }
      buf.m[r] = mn;
    }
    at::native::cpublas::brgemm(M, D, kn, KEY_TILE, D, D, true, tile_p, vb, buf.acc.data(), PAIRS<T>);
  }
  for (int r = 0; r < M; ++r) {
    const float* a = buf.acc.data() + (size_t)r * D;
    const int head = it.h * G + r % G;
    const float sum = folio::with_sink(P.sinks, head, buf.m[r], buf.l[r]);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    Q* dst = static_cast<Q*>(P.out) + ((int64_t)(qs + it.q0 + r / G) * P.Hkv * G + head) * D;
    for (int d = 0; d < D; ++d) dst[d] = static_cast<Q>(a[d] * inv);
  }
}

// Q: the element type of q and out; C: the cache's; T: the products' operands.
template <typename Q, typename C, typename T>
void run(const Params& P, int B) {
  const int D = P.D, G = P.G, Hkv = P.Hkv;
  std::vector<Span> spans(B);
  int64_t total = 0;
  for (int b = 0; b < B; ++b) {
    const int32_t* rq = P.reqs + 3 * b;
    const int L = rq[2], off = L - rq[1];
    const int kbeg = P.window ? std::max(0, off - P.window + 1) : 0;
    const int tiles = (L - kbeg + KEY_TILE - 1) / KEY_TILE;
    spans[b] = {kbeg, tiles, total};
    total += (int64_t)Hkv * tiles * KEY_TILE * D;
  }
  const auto options = at::TensorOptions().dtype(PAIRS<T> ? at::kBFloat16 : at::kFloat);
  at::Tensor kbuf = at::empty({total}, options), vbuf = at::empty({total}, options);
  T* kpack = static_cast<T*>(kbuf.data_ptr());
  T* vpack = static_cast<T*>(vbuf.data_ptr());
  std::vector<float> kscale_buf(KEY_SCALES<C, T> ? total / D : 0), vscale_buf(kscale_buf.size());
  float* kscales = KEY_SCALES<C, T> ? kscale_buf.data() : nullptr;
  float* vscales = KEY_SCALES<C, T> ? vscale_buf.data() : nullptr;

  // 1. pack every (request, kv head, key tile)
  std::vector<int64_t> first_tile(B + 1, 0);  // running count of (kv head, key tile) pairs
  for (int b = 0; b < B; ++b) first_tile[b + 1] = first_tile[b] + (int64_t)Hkv * spans[b].tiles;
  folio::parallel_for(0, first_tile[B], 1, [&](int64_t begin, int64_t end) {
    int b = (int)(std::upper_bound(first_tile.begin(), first_tile.end(), begin) - first_tile.begin()) - 1;
    for (int64_t i = begin; i < end; ++i) {
      while (i >= first_tile[b + 1]) ++b;
      const Span& sp = spans[b];
      const int h = (int)((i - first_tile[b]) / sp.tiles), n = (int)((i - first_tile[b]) % sp.tiles);
      const int t0 = sp.kbeg + n * KEY_TILE, kt = std::min(KEY_TILE, P.reqs[3 * b + 2] - t0);
      const int64_t o = sp.offset + ((int64_t)h * sp.tiles + n) * KEY_TILE * D;
      pack_tile<C, T>(P, b, h, t0, kt, kpack + o, vpack + o, kscales ? kscales + o / D : nullptr,
                      vscales ? vscales + o / D : nullptr);
    }
  });

  // 2. attend every (request, kv head, query tile), longest first, each thread taking the next item
  const int qt = std::max(1, TARGET_ROWS / G);
  std::vector<Item> items;
  for (int b = 0; b < B; ++b) {
    const int qlen = P.reqs[3 * b + 1], off = P.reqs[3 * b + 2] - qlen;
    for (int h = 0; h < Hkv; ++h)
      for (int q0 = 0; q0 < qlen; q0 += qt) {
        const int q1 = std::min(qlen, q0 + qt);
        const int keys = off + q1 - (P.window ? std::max(spans[b].kbeg, off + q0 - P.window + 1) : 0);
        items.push_back({b, h, q0, q1, (int64_t)(q1 - q0) * keys});
      }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  const int64_t n = (int64_t)items.size();
  std::atomic<int64_t> next{0};
  folio::parallel_for(0, std::min<int64_t>(n, folio::num_threads()), 1, [&](int64_t, int64_t) {
    TileBuffers<T> buf(qt * G, D);
    for (int64_t i = next++; i < n; i = next++)
      attend_item<Q, T>(P, spans[items[i].b], kpack, vpack, kscales, vscales, items[i], buf);
    if (PAIRS<T>) at::native::cpublas::brgemm_release();  // the thread's AMX tile state, where brgemm took it
  });
}

// Whether the kernel runs bf16 products here (above: AMX tiles where the CPU has them, AVX512-BF16 elsewhere).
bool has_bf16_products() { return FOLIO_BF16_PRODUCTS; }

}  // namespace

// out [T, Hq, D] (written for the requests in reqs only); see the top of the file.
void flash_prefill(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor reqs,
                   at::Tensor block_tables, double scale, int64_t window, double softcap,
                   std::optional<at::Tensor> sinks, bool bf16_products) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 4, "q, out must be 3-d and the caches 4-d");
  const auto qt = q.scalar_type(), ct = k_cache.scalar_type();
  TORCH_CHECK((qt == at::kBFloat16 || qt == at::kFloat) && out.scalar_type() == qt,
              "q and out must share a dtype, bfloat16 or float32");
  TORCH_CHECK((ct == at::kBFloat16 || ct == at::kChar || ct == at::kByte) && v_cache.scalar_type() == ct,
              "the caches must be bfloat16, or 8-bit rows (int8, or uint8 fp8 e4m3 bits)");
  const int64_t row_width = q.size(2) + (ct == at::kBFloat16 ? 0 : 4);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "caches must be contiguous [blocks, block_size, Hkv, row]");
  TORCH_CHECK(q.stride(2) == 1 && out.is_contiguous() && out.sizes() == q.sizes(),
              "q needs unit stride along head_dim, out must be contiguous and shaped like q");
  TORCH_CHECK(k_cache.size(3) == row_width && q.size(1) % k_cache.size(2) == 0,
              "q must be [T, Hkv * G, D] for caches [.., Hkv, D] (8-bit: D + 4)");
  TORCH_CHECK(reqs.scalar_type() == at::kInt && reqs.is_contiguous() && reqs.dim() == 2 && reqs.size(1) == 3,
              "reqs must be int32 [B, 3]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) == reqs.size(0), "block_tables must be int32 [B, M]");
  // (the bf16 softmax takes the max of the scores before the scale: the max of the scaled ones only for a scale > 0)
  TORCH_CHECK(scale > 0, "the softmax scale must be positive (flash_prefill.FlashPrefill.supports)");
  Params P;
  P.q = q.data_ptr();
  P.q_st = q.stride(0);
  P.q_sh = q.stride(1);
  P.out = out.data_ptr();
  P.k_cache = k_cache.data_ptr();
  P.v_cache = v_cache.data_ptr();
  P.reqs = reqs.data_ptr<int32_t>();
  P.block_tables = block_tables.data_ptr<int32_t>();
  P.max_blocks = block_tables.size(1);
  P.block_size = (int)k_cache.size(1);
  P.Hkv = (int)k_cache.size(2);
  P.D = (int)q.size(2);
  P.G = (int)(q.size(1) / P.Hkv);
  P.row_width = (int)row_width;
  P.scale_log2 = (float)scale * LOG2E;
  P.window = (int)std::max<int64_t>(0, window);
  P.softcap2 = softcap > 0 ? (float)softcap * LOG2E : 0.f;
  P.inv_softcap2 = softcap > 0 ? 1.f / P.softcap2 : 0.f;
  const std::vector<float> sinks2 = folio::sinks_base2(sinks, q.size(1));
  P.sinks = sinks ? sinks2.data() : nullptr;
  const int B = (int)reqs.size(0);
  const int64_t num_blocks = k_cache.size(0);
  for (int b = 0; b < B; ++b) {
    const int32_t* rq = P.reqs + 3 * b;
    TORCH_CHECK(rq[1] >= 1 && rq[2] >= rq[1] && rq[0] >= 0 && rq[0] + rq[1] <= q.size(0), "request ", b,
                ": bad first token / query length / context length");
    const int64_t blocks = (rq[2] + P.block_size - 1) / P.block_size;
    TORCH_CHECK(blocks <= P.max_blocks, "request ", b, ": block table too short for its context");
    const int kbeg = P.window ? std::max(0, rq[2] - rq[1] - P.window + 1) : 0;
    for (int64_t i = kbeg / P.block_size; i < blocks; ++i) {
      const int32_t id = P.block_tables[b * P.max_blocks + i];
      TORCH_CHECK(id >= 0 && id < num_blocks, "request ", b, ": block id ", id, " out of range");
    }
  }
  if (bf16_products) {
    TORCH_CHECK(has_bf16_products(), "bf16 products need AVX512-BF16 and oneDNN's micro-kernel");
    TORCH_CHECK(qt == at::kBFloat16 && P.D % 2 == 0, "bf16 products take bf16 q, head_dim even");
#if FOLIO_BF16_PRODUCTS
    if (ct == at::kChar) return run<bf16, int8_t, bf16>(P, B);
    if (ct == at::kByte) return run<bf16, uint8_t, bf16>(P, B);
    return run<bf16, bf16, bf16>(P, B);
#endif

  }
  auto go = [&](auto q_type) {
    using Q = decltype(q_type);
    if (ct == at::kChar) run<Q, int8_t, float>(P, B);
    else if (ct == at::kByte) run<Q, uint8_t, float>(P, B);
    else run<Q, bf16, float>(P, B);
  };
  if (qt == at::kFloat) go(float{});
  else go(bf16{});
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  folio::bind_decode_threads(m);
  m.def("flash_prefill", &flash_prefill, "attend long queries from a bf16 or 8-bit paged cache in tiled matrix products",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("has_bf16_products", &has_bf16_products, "whether bf16 operands run on oneDNN's micro-kernel here");
}
