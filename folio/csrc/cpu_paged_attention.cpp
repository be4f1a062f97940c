// Paged attention for CPUs, reading the paged KV cache in place.
//
// One call per layer does both halves of folio's AttentionBackend.forward:
//   1. writes the step's new K/V rows into the cache at slot_mapping;
//   2. computes attention for every request of the flattened batch (decodes and prefill chunks alike),
//      walking each request's block table directly: no gathered copy of the context is ever made.
//
// Work decomposition: an item is (request, kv heads, tile of query tokens, range of keys). A decode item
// covers all kv heads of its request, so that it reads whole cache rows [Hkv, D] (contiguous within a
// block); a prefill chunk is cut per kv head and per tile of up to 64 / G query tokens. The rows of an item
// are its query tokens times the G = Hq / Hkv query heads that share a kv head (grouped-query attention
// without repeating K/V). Keys are visited in tiles of 16 tokens with an online softmax (FlashAttention
// style: running max m, running sum l, float32 accumulator rescaled when the max grows); the next tile's
// rows are prefetched while this one is computed, since a block can be anywhere in the cache. Items run
// on OpenMP threads (dynamic schedule, longest first; while enough are left, a thread claims its next item
// before it runs the current one, so that the decode path below can prefetch the next one's first keys).
// Decodes of grouped-query heads with bf16 q (from a bf16 or 8-bit cache) take a path of their own: on AMX-BF16
// the scores and P.V as tile products of K's and V's rows in place, up to 256 keys a softmax step
// (paged_decode_amx.h), elsewhere vdpbf16ps after a transpose of K, 64 keys a step (attend_decode_bf16).
// When the batch has too few items to keep every thread busy (a single long decode), the keys of an item
// are split into partitions whose partial (m, l, acc) are merged afterwards (flash-decoding).
//
// The cache may be float32 or bfloat16. Softmax and accumulation are in float32. With a bf16 cache and
// AVX512-BF16 (head_dim a multiple of 32), q.k and P.V are vdpbf16ps dot products straight from the cache:
// products of bf16 are exact, sums float32, and P is rounded to bf16 for P.V (as torch's CPU flash attention
// and FlashAttention on GPUs do). Each tile of V is interleaved once by pairs of keys for that; an item of
// several rows per kv head (grouped-query decode, prefill tiles) also transposes each tile of K once into
// bf16 pairs, so that a row's 16 scores come out of D/2 dot products with a broadcast pair of q instead of
// 16 dot products and a horizontal sum. Other bf16 cases widen K and V tiles to float32. The AVX-512 path
// needs head_dim to be a multiple of 16 (16..256 listed in pick_kernel). A build with AVX2 and FMA but no
// AVX-512 takes the AVX2 path (cpu_paged_attention_avx2.h: float32 arithmetic, 8-lane vectors, tiles of 32 keys)
// for the head_dims it lists (32, 64, 80, 96, 128, 256); any other head_dim, or a build without either, uses the
// scalar path.
//
// 8-bit caches (folio.attention.kv_quant): a row is D codes, int8 (int8 cache) or fp8 e4m3 bits (uint8
// cache), followed by the 4 bytes of its float32 scale (max |value| / 127 or / 448); the new K/V rows are
// quantised here exactly as the torch reference does. The scalar path takes each key's scale out of its dot
// product and folds each value's into its probability. So do the bf16 tile paths (bf16 q, head_dim a
// multiple of 32, AVX512-BF16), which take a tile's codes exactly into bf16 (exact_codes) and then run as
// from a bf16 cache: scores (q . codes) times the key's scale, probabilities times the value's scale before
// their rounding to bf16. Elsewhere the AVX-512 path widens each tile's rows to float32 (codes times scale,
// as the reference dequantises them) and runs the float32 tile code on them.
//
// Sliding window W (0: none): query row at position p sees keys p - W < t <= p. An item's keys start at the
// window of its first query token, each row masks the keys before its own window, and a block wholly before
// the window of a request's first query is never read (its block table entry may be anything). Soft-capping
// (Gemma 2, cap > 0): scores s -> cap * tanh(s / cap) after the scale, before the mask and the softmax.
// Attention sinks (GPT-OSS, attention_sinks.h): a row's sum gains exp2(sink - m) once it ends (`with_sink`); a row
// whose keys were split into partitions leaves it out of every partition's sum and combine_group adds it once.
//
// Layouts: q [T, Hq, D], k/v [T, Hkv, D] (any token/head strides, unit stride along D); caches
// [num_blocks, block_size, Hkv, D] contiguous ([..., D + 4] bytes when 8-bit); reqs int32 [B, 3] = (first token in the batch, query length,
// context length including this step's tokens); block_tables int32 [B, max_blocks].

// Only the headers needed (not torch/extension.h): that keeps the first-use build near 15 s instead of 40 s.
#include "parallel.h"
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Exception.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "attention_sinks.h"
#include "avx512_math.h"
#include "exp2_approx.h"
#include "kv_cache_rows.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include "amx_tiles.h"
#endif

namespace {

constexpr int TILE = 16;  // keys per softmax tile (one AVX-512 register of scores)
constexpr int MAX_ROWS = 64;  // target rows (query tokens x heads) per item
constexpr int TRANSPOSE_MIN_ROWS = 4;  // rows per kv head from which a tile's K is transposed once (measured)
constexpr float LOG2E = 1.4426950408889634f;

struct Params {
  const void* q;
  int64_t q_st, q_sh;
  void* out;
  void* k_cache;
  void* v_cache;
  const int32_t* reqs;
  const int32_t* block_tables;
  int64_t max_blocks;
  int block_size, Hkv, G, D;
  int RS;  // cache elements per (token, kv head) row: D, or D + 4 bytes in an 8-bit cache
  float scale_log2;  // softmax scale times log2(e): scores are kept in base 2
  int window;  // sliding window in keys, 0 for none
  float softcap2, inv_softcap2;  // soft-capping of the base-2 scores: cap * log2(e) and its inverse; 0: none
  const float* sinks;  // per query head, its sink times log2(e) (base 2, as the scores); null: none
};

// A row's sum of probabilities l (relative to its running max m) with its query head's sink added, where the layer
// has sinks: the denominator its accumulator is divided by.
inline float with_sink(const Params& P, int head, float m, float l) { return folio::with_sink(P.sinks, head, m, l); }

// First key of the tile starting at t0 that a query at position pos may see (0 when its window starts
// before the tile), for a window W (0: none).
inline int window_first(int window, int pos, int t0) { return window ? std::max(0, pos - window + 1 - t0) : 0; }

// Where keys t .. t + n - 1 of a request (block table bt) sit in the cache: out[j] = (block id * block_size +
// slot) * unit, unit being the size of a token's row [Hkv, ...] in elements or bytes.
inline void key_rows(const Params& P, const int32_t* bt, int t, int n, int64_t unit, int64_t* out) {
  int blk = t / P.block_size, o = t % P.block_size;
  for (int j = 0; j < n; ++j) {
    out[j] = ((int64_t)bt[blk] * P.block_size + o) * unit;
    if (++o == P.block_size) { o = 0; ++blk; }
  }
}

struct Item {
  int b, h0, h1, q0, q1, k0, k1;  // request, kv heads [h0, h1), query tokens [q0, q1), keys [k0, k1)
  int part;  // < 0: write the output; else the first row of its slot in the partial results
  int64_t cost;
};

struct Group {  // one (request, kv heads, query tile) whose keys were split into nparts partitions
  int b, h0, h1, q0, q1, part, nparts;
};

// Row r of an item: kv head h0 + r / RH, query token q0 + (r % RH) / G, query head (kv head) * G + r % G,
// with RH = (q1 - q0) * G rows per kv head.
struct ItemRows {
  int RH, NH, R;  // rows per kv head, kv heads, rows
  int qs, off;  // the request's first token in the batch, and its context before this step's queries
  int kend;  // the item reads keys [k0, kend)
  ItemRows(const Params& P, const Item& it)
      : RH((it.q1 - it.q0) * P.G), NH(it.h1 - it.h0), R(RH * NH), qs(P.reqs[3 * it.b]),
        off(P.reqs[3 * it.b + 2] - P.reqs[3 * it.b + 1]), kend(std::min(it.k1, off + it.q1)) {}
  // row r's q and its output row, D values each
  template <typename T>
  const T* q(const Params& P, const Item& it, int r) const {
    return static_cast<const T*>(P.q) + (int64_t)token(P, it, r) * P.q_st + (int64_t)head(P, it, r) * P.q_sh;
  }
  template <typename T>
  T* out(const Params& P, const Item& it, int r) const {
    return static_cast<T*>(P.out) + ((int64_t)token(P, it, r) * P.Hkv * P.G + head(P, it, r)) * P.D;
  }
  int token(const Params& P, const Item& it, int r) const { return qs + it.q0 + (r % RH) / P.G; }
  int head(const Params& P, const Item& it, int r) const { return (it.h0 + r / RH) * P.G + r % RH % P.G; }
};

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

// Scratch memory of one thread, grown on demand and reused across calls.
struct Scratch {
  std::vector<float> buf;
  float* get(size_t n) {
    if (buf.size() < n) buf.resize(n);
    return buf.data();
  }
};

// Row r of a key partition's partial result: running max, running sum, unnormalised accumulator [D].
inline void store_partial(float* partial, int r, int D, float m, float l, const float* acc) {
  float* p = partial + (size_t)r * (D + 2);
  p[0] = m;
  p[1] = l;
  std::memcpy(p + 2, acc, sizeof(float) * D);
}

Scratch& thread_scratch() {
  static thread_local Scratch s;
  return s;
}

// ------------------------------------------------------------------------------------------------------
// Scalar path (any head_dim, any ISA). Also the reference for the vector path's structure.
// ------------------------------------------------------------------------------------------------------
// q . the D values of a cache row (an 8-bit one's codes, before its scale), summed in DOT_LANES partial sums
// (vector lanes where the compiler has them: without AVX-512 this path is the one that runs) added up in a fixed
// tree, so that every cache type sums in the same order whatever its loop vectorises to.
constexpr int DOT_LANES = 16;
template <typename C>
inline float dot(const float* q, const C* row, int D) {
  float part[DOT_LANES] = {};
  int c = 0;
  for (; c + DOT_LANES <= D; c += DOT_LANES) {
#pragma omp simd
    for (int i = 0; i < DOT_LANES; ++i) part[i] += q[c + i] * Cache<C>::value(row[c + i]);
  }
  for (int w = DOT_LANES / 2; w > 0; w /= 2)  // a tree of halves: a few vector adds, not a chain of 16
    for (int i = 0; i < w; ++i) part[i] += part[i + w];
  float d = part[0];
  for (; c < D; ++c) d += q[c] * Cache<C>::value(row[c]);
  return d;
}

template <typename T, typename C>
void attend_item_scalar(const Params& P, const Item& it, float* partial, const Item*) {
  const int D = P.D, G = P.G;
  const ItemRows rows(P, it);
  const int RH = rows.RH, R = rows.R, off = rows.off, kend = rows.kend;

  float* mem = thread_scratch().get((size_t)R * (2 * D + TILE + 3));
  float* qf = mem;
  float* acc = qf + (size_t)R * D;
  float* S = acc + (size_t)R * D;
  float* m = S + (size_t)R * TILE;
  float* l = m + R;
  for (int r = 0; r < R; ++r) {
    const T* src = rows.q<T>(P, it, r);
    for (int c = 0; c < D; ++c) qf[(size_t)r * D + c] = to_f(src[c]) * P.scale_log2;
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
  }
  std::fill(acc, acc + (size_t)R * D, 0.f);

  const C* kc = static_cast<const C*>(P.k_cache);
  const C* vc = static_cast<const C*>(P.v_cache);
  const int32_t* bt = P.block_tables + it.b * P.max_blocks;
  const int64_t row_stride = (int64_t)P.Hkv * P.RS;
  for (int t0 = it.k0; t0 < kend; t0 += TILE) {
    const int nt = std::min(TILE, kend - t0);
    int64_t tok[TILE];
    key_rows(P, bt, t0, nt, row_stride, tok);
    for (int r = 0; r < R; ++r) {
      const int hh = r / RH, rr = r % RH;
      const int64_t hoff = (int64_t)(it.h0 + hh) * P.RS;
      const int pos = off + it.q0 + rr / G;
      const int lim = std::min(nt, pos + 1 - t0);  // keys [first, lim) of this tile are the row's to see
      const int first = window_first(P.window, pos, t0);
      if (lim <= first) continue;
      float* s = S + (size_t)r * TILE;
      float mt = -std::numeric_limits<float>::infinity();
      for (int j = first; j < lim; ++j) {
        const C* kr = kc + tok[j] + hoff;
        float d = dot(qf + (size_t)r * D, kr, D);
        if (Cache<C>::QUANTIZED) d *= Cache<C>::scale(kr, D);
        if (P.softcap2 > 0.f) d = P.softcap2 * std::tanh(d * P.inv_softcap2);
        s[j] = d;
        mt = std::max(mt, d);
      }
      const float mn = std::max(m[r], mt);
      const float corr = std::exp2(m[r] - mn);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int j = first; j < lim; ++j) {
        s[j] = exp2_approx(s[j] - mn);
        sum += s[j];
      }
      l[r] = l[r] * corr + sum;
      m[r] = mn;
      float* a = acc + (size_t)r * D;
      for (int c = 0; c < D; ++c) a[c] *= corr;
      for (int j = first; j < lim; ++j) {
        const C* vr = vc + tok[j] + hoff;
        const float p = Cache<C>::QUANTIZED ? s[j] * Cache<C>::scale(vr, D) : s[j];
        for (int c = 0; c < D; ++c) a[c] += p * Cache<C>::value(vr[c]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const float* a = acc + (size_t)r * D;
    if (partial) {
      store_partial(partial, r, D, m[r], l[r], a);
    } else {
      T* dst = rows.out<T>(P, it, r);
      const float sum = with_sink(P, rows.head(P, it, r), m[r], l[r]);
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      for (int c = 0; c < D; ++c) dst[c] = static_cast<T>(a[c] * inv);
    }
  }
}

// ------------------------------------------------------------------------------------------------------
// Prefetching of the next keys' rows (the AVX-512 and AVX2 paths), and the AVX2 path.
// ------------------------------------------------------------------------------------------------------
#if defined(__AVX2__)
// Issues the prefetches of a tile's K and V rows (up to N keys) into L2, a few keys (step) or a few cache lines
// (step_lines) at a time.
template <int N = TILE>
struct LinePrefetcher {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t rows[N];  // byte offset of each key's row
  int n = 0, lines = 0, per_step = 0, j = 0;
  int lines_per_step = 0, line = 0;  // step_lines: lines of K and of V a step, the next line of key j
  inline void step() {
    for (const int end = std::min(n, j + per_step); j < end; ++j) {
      for (int e = 0; e < lines; ++e) {
        _mm_prefetch(k + rows[j] + 64 * e, _MM_HINT_T1);
        _mm_prefetch(v + rows[j] + 64 * e, _MM_HINT_T1);
      }
    }
  }
  inline void step_lines() {
    for (int i = 0; i < lines_per_step && j < n; ++i) {
      _mm_prefetch(k + rows[j] + 64 * line, _MM_HINT_T1);
      _mm_prefetch(v + rows[j] + 64 * line, _MM_HINT_T1);
      if (++line == lines) { line = 0; ++j; }
    }
  }
};

// Aims pf at N keys of an item's request from key t on (its kv heads' K and V rows), to be issued over `steps`
// calls of pf.step() or of pf.step_lines().
template <typename C, int N>
void aim(LinePrefetcher<N>& pf, const Params& P, const Item& it, int t, int steps) {
  const int64_t row_bytes = (int64_t)P.Hkv * P.RS * (int64_t)sizeof(C);
  pf.n = std::min(N, it.k1 - t);
  pf.lines = ((it.h1 - it.h0) * P.RS * (int)sizeof(C) + 63) / 64;
  pf.k = static_cast<const char*>(P.k_cache) + (int64_t)it.h0 * P.RS * (int64_t)sizeof(C);
  pf.v = static_cast<const char*>(P.v_cache) + (int64_t)it.h0 * P.RS * (int64_t)sizeof(C);
  key_rows(P, P.block_tables + it.b * P.max_blocks, t, pf.n, row_bytes, pf.rows);
  pf.per_step = (pf.n + steps - 1) / steps;
  pf.lines_per_step = (pf.n * pf.lines + steps - 1) / steps;
}

#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include "cpu_paged_attention_avx2.h"
#endif

// ------------------------------------------------------------------------------------------------------
// AVX-512 path: head_dim = 16 * NV.
// ------------------------------------------------------------------------------------------------------
#if defined(__AVX512F__)

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(at::BFloat16* p, __m512 x) {
  // round to nearest even, as c10::BFloat16 does; NaN stays NaN
  __m512i u = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

// The accumulators of rows r0 .. r0 + rc (rc <= RC, D = 16 NV floats each) into registers, each times its
// row's softmax correction, and back.
template <int NV, int RC>
inline void load_corrected(__m512 (&av)[RC][NV], const float* acc, const float* corr, int r0, int rc) {
  for (int i = 0; i < RC; ++i) {  // to RC with a test, not to rc: indices known at compile time keep av in registers
    if (i < rc) {
      const __m512 cr = _mm512_set1_ps(corr[r0 + i]);
      for (int c = 0; c < NV; ++c)
        av[i][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (size_t)(r0 + i) * NV * 16 + 16 * c), cr);
    }
  }
}

template <int NV, int RC>
inline void store_rows(const __m512 (&av)[RC][NV], float* acc, int r0, int rc) {
  for (int i = 0; i < RC; ++i) {
    if (i < rc) {
      for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + (size_t)(r0 + i) * NV * 16 + 16 * c, av[i][c]);
    }
  }
}

// Sums each of 16 vectors: lane j of the result is the sum of a[j]'s lanes.
inline __m512 hsum16(__m512 a[16]) {
  __m512 c[8];
  for (int i = 0; i < 8; ++i) {  // 256-bit halves: lanes 0-7 partials of a[2i], 8-15 of a[2i+1]
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  }
  __m512 d[4];
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes: lane k of d[i] holds 4 partials of a[4i + k]
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  const __m512 e0 = _mm512_add_ps(_mm512_unpacklo_ps(d[0], d[1]), _mm512_unpackhi_ps(d[0], d[1]));
  const __m512 e1 = _mm512_add_ps(_mm512_unpacklo_ps(d[2], d[3]), _mm512_unpackhi_ps(d[2], d[3]));
  const __m512 f = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(e0), _mm512_castps_pd(e1))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(e0), _mm512_castps_pd(e1))));
  // f lane 4k + i holds the sum of a[4i + k]: transpose the 4x4 back
  const __m512i idx = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(idx, f);
}

#if defined(__AVX512BF16__)
// A tile's K rows (nt <= 16 keys of D = 32 * NC bf16; keys past nt read as zero) transposed into bf16 pairs,
// kt[d2 * TILE + j] = (k_j[2 d2], k_j[2 d2 + 1]), by 16 x 16 dword transposes (64 shuffles per 32 values).
template <int NC>
inline void transpose_k_tile(const at::BFloat16* const* kp, int nt, uint32_t* kt) {
  for (int c = 0; c < NC; ++c) {
    __m512i r[16], t[16];
    for (int j = 0; j < 16; ++j) r[j] = j < nt ? _mm512_loadu_si512(kp[j] + 32 * c) : _mm512_setzero_si512();
    for (int k = 0; k < 8; ++k) {
      t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
      t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    for (int k = 0; k < 4; ++k) {  // then r[4k + cc], 128-bit lane L: keys 4k..4k+3 of dword column 4L + cc
      r[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
      r[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
      r[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
      r[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
    }
    for (int cc = 0; cc < 4; ++cc) {  // 4 x 4 transpose of 128-bit lanes
      const __m512i v0 = _mm512_shuffle_i32x4(r[cc], r[4 + cc], 0x44);
      const __m512i v1 = _mm512_shuffle_i32x4(r[cc], r[4 + cc], 0xEE);
      const __m512i v2 = _mm512_shuffle_i32x4(r[8 + cc], r[12 + cc], 0x44);
      const __m512i v3 = _mm512_shuffle_i32x4(r[8 + cc], r[12 + cc], 0xEE);
      uint32_t* dst = kt + (16 * c + cc) * TILE;  // dword column 4L + cc goes to dst + 4L * TILE
      _mm512_storeu_si512(dst, _mm512_shuffle_i32x4(v0, v2, 0x88));
      _mm512_storeu_si512(dst + 4 * TILE, _mm512_shuffle_i32x4(v0, v2, 0xDD));
      _mm512_storeu_si512(dst + 8 * TILE, _mm512_shuffle_i32x4(v1, v3, 0x88));
      _mm512_storeu_si512(dst + 12 * TILE, _mm512_shuffle_i32x4(v1, v3, 0xDD));
    }
  }
}

// A tile's V rows interleaved by pairs of keys, for P.V with vdpbf16ps: vector i * 2NC + 2c + h holds the
// bf16 pairs (v_2i[d], v_2i+1[d]) for the 16 values d = 32c + 8L + 4h + 0..3 (L = 128-bit lane). Keys past
// nt read as zero, so that a zero probability never meets a NaN from an unwritten row.
template <int NC>
inline void interleave_v_tile(const at::BFloat16* const* vp, int nt, uint32_t* vt) {
  for (int i = 0; 2 * i < nt; ++i) {
    for (int c = 0; c < NC; ++c) {
      const __m512i a = _mm512_loadu_si512(vp[2 * i] + 32 * c);
      const __m512i b = 2 * i + 1 < nt ? _mm512_loadu_si512(vp[2 * i + 1] + 32 * c) : _mm512_setzero_si512();
      _mm512_storeu_si512(vt + (i * 2 * NC + 2 * c) * 16, _mm512_unpacklo_epi16(a, b));
      _mm512_storeu_si512(vt + (i * 2 * NC + 2 * c + 1) * 16, _mm512_unpackhi_epi16(a, b));
    }
  }
}
// P.V of a tile with vdpbf16ps: av[i] += the probabilities of row i (bf16 pairs of keys, pair jp of row i at
// pb[i * row_stride + jp * pair_stride]) times the tile's V interleaved by pairs (interleave_v_tile), for rc <= RC
// rows over nt keys; step(jp) runs before each pair of keys.
template <int NV, int RC, class Step>
inline void pv_pairs_bf16(__m512 (&av)[RC][NV], const uint32_t* pb, int64_t row_stride, int64_t pair_stride,
                          const uint32_t* vt, int nt, int rc, const Step& step) {
  for (int jp = 0; 2 * jp < nt; ++jp) {
    step(jp);
    __m512bh vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vt + (jp * NV + c) * 16);
    for (int i = 0; i < RC; ++i) {
      if (i < rc) {
        const __m512bh pj = (__m512bh)_mm512_set1_epi32((int)pb[i * row_stride + jp * pair_stride]);
        for (int c = 0; c < NV; ++c) av[i][c] = _mm512_dpbf16_ps(av[i][c], vv[c], pj);
      }
    }
  }
}
#endif

// 16 values of an 8-bit cache row (codes times the row's scale) as float32.
inline __m512 load16_codes(const int8_t* p, __m512 scale) {
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))), scale);
}
inline __m512 load16_codes(const uint8_t* p, __m512 scale) {  // fp8 e4m3 bits: the value table
  const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_mul_ps(_mm512_i32gather_ps(idx, FP8_E4M3_VALUES.data(), 4), scale);
}

#if defined(__AVX512BF16__)
// Key j of a tile of N keys from an 8-bit cache (its K row kr, V row vr) for the bf16 tile code: its codes into
// bf16 rows j (K) and N + j (V) of dst, D = 32 NC apart (kp[j], vp[j] pointing to them), its rows' scales into
// ks[j] and vs[j], which multiply its scores and its probabilities.
template <int NC, int N, typename C>
inline void exact_key(const C* kr, const C* vr, int j, at::BFloat16* dst, const at::BFloat16** kp,
                      const at::BFloat16** vp, float* ks, float* vs) {
  constexpr int D = 32 * NC;
  ks[j] = Cache<C>::scale(kr, D);
  vs[j] = Cache<C>::scale(vr, D);
  kp[j] = dst + (size_t)j * D;
  vp[j] = dst + (size_t)(N + j) * D;
  exact_codes(kr, dst + (size_t)j * D, NC);
  exact_codes(vr, dst + (size_t)(N + j) * D, NC);
}
#endif

// Row r's online-softmax state before its first key: accumulator (16 NV floats) and per-lane sums zero, max -inf.
template <int NV>
inline void start_row(float* acc, float* lv, float* m, int r) {
  for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + (size_t)r * NV * 16 + 16 * c, _mm512_setzero_ps());
  _mm512_storeu_ps(lv + (size_t)r * TILE, _mm512_setzero_ps());
  m[r] = -std::numeric_limits<float>::infinity();
}

// The end of an item: each row's accumulator divided by its sum of probabilities into out, or the
// unnormalised (m, l, acc) into its partition's slot. lv holds each row's TILE per-lane partial sums. DP: the
// accumulator holds each 32 values of d permuted (interleave_v_tile): half h, lane 4L + i is d = 8L + 4h + i.
template <typename T, bool DP, int NV>
void finish_rows(const Params& P, const Item& it, int R, float* acc, const float* lv, const float* m,
                 float* partial) {
  constexpr int D = NV * 16;
  const ItemRows rows(P, it);
  alignas(64) static const int32_t lo_idx[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
  alignas(64) static const int32_t hi_idx[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
  for (int r = 0; r < R; ++r) {
    float* a = acc + (size_t)r * D;
    if constexpr (DP) {
      const __m512i li = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
      for (int c = 0; c < NV / 2; ++c) {
        const __m512 h0 = _mm512_loadu_ps(a + 32 * c), h1 = _mm512_loadu_ps(a + 32 * c + 16);
        _mm512_storeu_ps(a + 32 * c, _mm512_permutex2var_ps(h0, li, h1));
        _mm512_storeu_ps(a + 32 * c + 16, _mm512_permutex2var_ps(h0, hi, h1));
      }
    }
    const float l = _mm512_reduce_add_ps(_mm512_loadu_ps(lv + (size_t)r * TILE));
    if (partial) {
      store_partial(partial, r, D, m[r], l, a);
    } else {
      T* dst = rows.out<T>(P, it, r);
      const float sum = with_sink(P, rows.head(P, it, r), m[r], l);
      const __m512 inv = _mm512_set1_ps(sum > 0.f ? 1.f / sum : 0.f);
      for (int c = 0; c < NV; ++c) store16(dst + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(a + 16 * c), inv));
    }
  }
}

// T: the dtype of q and out; C: the cache's (T, or int8 / uint8 for 8-bit caches, whose rows are widened to
// float32 tiles as bf16 rows are where vdpbf16ps cannot take them).
template <typename T, typename C, int NV>
void attend_item_avx512(const Params& P, const Item& it, float* partial, const Item*) {
  constexpr int D = NV * 16;
  constexpr bool BF16 = std::is_same<T, at::BFloat16>::value;
  constexpr bool Q8 = Cache<C>::QUANTIZED;
  constexpr int RW = D + Cache<C>::SCALE_BYTES;  // elements of a cache row (8-bit: D codes, a scale's 4 bytes)
#if defined(__AVX512BF16__)
  // bf16 q, head_dim a multiple of 32: q.k and P.V with vdpbf16ps straight from a bf16 cache (products of
  // bf16 are exact, sums float32; P is rounded to bf16 for P.V, as torch's CPU flash attention does), or from
  // an 8-bit one's codes taken exactly into bf16 (exact_codes), each key's scale applied to its scores and to
  // its probabilities before their rounding. The accumulator then holds each 32 values of d permuted (see
  // interleave_v_tile) until the end.
  constexpr bool DP = BF16 && NV % 2 == 0;
#else
  constexpr bool DP = false;
#endif
  constexpr bool WIDEN = !DP && (BF16 || Q8);  // K and V rows widened into float tile buffers
  constexpr int RC = NV >= 24 ? 1 : 24 / NV;  // rows whose V accumulators stay in registers together

  const int G = P.G;
  const ItemRows rows(P, it);
  const int RH = rows.RH, NH = rows.NH, R = rows.R, off = rows.off, kend = rows.kend;

  float* mem = thread_scratch().get((size_t)R * (2 * D + 2 * TILE + 2) + (DP && Q8 ? 3 : 2) * TILE * D + 64);
  float* qf = mem;  // DP: raw bf16 q rows (D halves per row)
  float* acc = qf + (size_t)R * D;
  float* S = acc + (size_t)R * D;  // a tile's probabilities: float rows of TILE, or (DP) TILE / 2 bf16 pairs
  float* lv = S + (size_t)R * TILE;  // per-lane partial sums of the probabilities, TILE per row
  float* m = lv + (size_t)R * TILE;
  float* corr = m + R;
  float* kbuf = corr + R;  // a tile of K: widened floats, or (DP) transposed bf16 pairs
  float* vbuf = kbuf + TILE * D;  // a tile of V: widened floats, or (DP) interleaved bf16 pairs
  // DP, 8-bit: the tile's K and V codes as bf16 rows
  at::BFloat16* codes = reinterpret_cast<at::BFloat16*>(vbuf + TILE * D);
  constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

  const __m512 sc = _mm512_set1_ps(P.scale_log2);
  for (int r = 0; r < R; ++r) {
    const T* src = rows.q<T>(P, it, r);
    if constexpr (DP) {
      std::memcpy(reinterpret_cast<uint16_t*>(qf) + (size_t)r * D, src, sizeof(T) * D);
    } else {
      for (int c = 0; c < NV; ++c) store16(qf + (size_t)r * D + 16 * c, _mm512_mul_ps(load16(src + 16 * c), sc));
    }
    start_row<NV>(acc, lv, m, r);
  }

  const C* kc = static_cast<const C*>(P.k_cache);
  const C* vc = static_cast<const C*>(P.v_cache);
  const int32_t* bt = P.block_tables + it.b * P.max_blocks;
  const int64_t row_stride = (int64_t)P.Hkv * RW;
  const __m512 ninf = _mm512_set1_ps(NEG_INF);
  for (int t0 = it.k0; t0 < kend; t0 += TILE) {
    const int nt = std::min(TILE, kend - t0);
    int64_t tok[TILE];  // start of each key's row [Hkv, D] in the cache
    key_rows(P, bt, t0, nt, row_stride, tok);
    // Prefetch the next tile's rows (into L2), spread over the rows of this tile: its block may be anywhere
    // in the cache, so the hardware prefetchers cannot guess it. Measured on 2 cores: about 2x the KV
    // read rate of no prefetching, and 1.5x that of issuing them all at the start of the tile.
    LinePrefetcher<> pf;
    if (t0 + TILE < kend) {
      const int tn = t0 + TILE;
      pf.n = std::min(TILE, kend - tn);
      pf.lines = (NH * RW * (int)sizeof(C) + 63) / 64;
      pf.k = reinterpret_cast<const char*>(kc + (int64_t)it.h0 * RW);
      pf.v = reinterpret_cast<const char*>(vc + (int64_t)it.h0 * RW);
      key_rows(P, bt, tn, pf.n, row_stride * (int64_t)sizeof(C), pf.rows);
      pf.per_step = (pf.n + R - 1) / R;
    }
    for (int hh = 0; hh < NH; ++hh) {
      const int64_t hoff = (int64_t)(it.h0 + hh) * RW;
      const int rbeg = hh * RH, rend = rbeg + RH;
      const C* kp[TILE];
      const C* vp[TILE];
      const float* kr[TILE];
      const float* vr[TILE];
      const at::BFloat16* kb[TILE];  // DP: the rows as bf16 (an 8-bit cache's codes, see exact_key)
      const at::BFloat16* vb[TILE];
      alignas(64) float ks[TILE] = {}, vs[TILE] = {};  // DP, 8-bit: each key's scales (see exact_key)
      for (int j = 0; j < nt; ++j) {
        kp[j] = kc + tok[j] + hoff;
        vp[j] = vc + tok[j] + hoff;
        if constexpr (DP && Q8) {
#if defined(__AVX512BF16__)
          exact_key<NV / 2, TILE>(kp[j], vp[j], j, codes, kb, vb, ks, vs);
#endif
        } else if constexpr (DP) {
          kb[j] = reinterpret_cast<const at::BFloat16*>(kp[j]);
          vb[j] = reinterpret_cast<const at::BFloat16*>(vp[j]);
        } else if constexpr (Q8) {
          const __m512 ks = _mm512_set1_ps(Cache<C>::scale(kp[j], D)), vs = _mm512_set1_ps(Cache<C>::scale(vp[j], D));
          for (int c = 0; c < NV; ++c) store16(kbuf + j * D + 16 * c, load16_codes(kp[j] + 16 * c, ks));
          for (int c = 0; c < NV; ++c) store16(vbuf + j * D + 16 * c, load16_codes(vp[j] + 16 * c, vs));
          kr[j] = kbuf + j * D;
          vr[j] = vbuf + j * D;
        } else if constexpr (WIDEN) {
          for (int c = 0; c < NV; ++c) store16(kbuf + j * D + 16 * c, load16(kp[j] + 16 * c));
          for (int c = 0; c < NV; ++c) store16(vbuf + j * D + 16 * c, load16(vp[j] + 16 * c));
          kr[j] = kbuf + j * D;
          vr[j] = vbuf + j * D;
        } else {
          kr[j] = reinterpret_cast<const float*>(kp[j]);
          vr[j] = reinterpret_cast<const float*>(vp[j]);
        }
      }
#if defined(__AVX512BF16__)
      // Several rows per kv head (grouped-query decode, prefill tiles): transpose the tile's K once into
      // bf16 pairs, so that each row's 16 scores come out of D/2 dot products with a broadcast pair of q,
      // with no horizontal sums.
      const bool transposed = DP && RH >= TRANSPOSE_MIN_ROWS;
      uint32_t* kt = reinterpret_cast<uint32_t*>(kbuf);
      uint32_t* vt = reinterpret_cast<uint32_t*>(vbuf);
      if constexpr (DP) {
        if (transposed) transpose_k_tile<NV / 2>(kb, nt, kt);
        interleave_v_tile<NV / 2>(vb, nt, vt);
      }
#endif
      // the scale of each key's scores (the softmax's, times the key's own in an 8-bit cache), and what each
      // probability is multiplied by for P.V (an 8-bit cache's value scales; DP only)
      const __m512 ksc = DP && Q8 ? _mm512_mul_ps(_mm512_load_ps(ks), sc) : sc;
      const __m512 vsc = DP && Q8 ? _mm512_load_ps(vs) : _mm512_setzero_ps();
      // scores (base 2) and the online-softmax update, row by row
      for (int r = rbeg; r < rend; ++r) {
        pf.step();
        const int pos = off + it.q0 + (r - rbeg) / G;
        const int lim = std::min(nt, pos + 1 - t0);  // keys [first, lim) of the tile are row r's to see
        const int first = window_first(P.window, pos, t0);
        __m512 s;
        if (lim <= first) {
          s = ninf;
        } else {
          __m512 a[16];
          if constexpr (DP) {
#if defined(__AVX512BF16__)
            const uint16_t* qrow = reinterpret_cast<const uint16_t*>(qf) + (size_t)r * D;
            if (transposed) {
              const uint32_t* q2 = reinterpret_cast<const uint32_t*>(qrow);
              __m512 x[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
              for (int d2 = 0; d2 < D / 2; d2 += 4) {  // D / 2 is a multiple of 16 here
                for (int c = 0; c < 4; ++c)
                  x[c] = _mm512_dpbf16_ps(x[c], (__m512bh)_mm512_set1_epi32((int)q2[d2 + c]),
                                          (__m512bh)_mm512_loadu_si512(kt + (d2 + c) * TILE));
              }
              s = _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(x[0], x[1]), _mm512_add_ps(x[2], x[3])), ksc);
            } else {
              __m512bh qv[NV / 2];
              for (int c = 0; c < NV / 2; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qrow + 32 * c);
              for (int j = 0; j < 16; ++j) {
                if (j < nt) {
                  __m512 x = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(kb[j]));
                  for (int c = 1; c < NV / 2; ++c)
                    x = _mm512_dpbf16_ps(x, qv[c], (__m512bh)_mm512_loadu_si512(kb[j] + 32 * c));
                  a[j] = x;
                } else {
                  a[j] = _mm512_setzero_ps();
                }
              }
              s = _mm512_mul_ps(hsum16(a), ksc);
            }
#endif
          } else {
            __m512 qv[NV];
            for (int c = 0; c < NV; ++c) qv[c] = _mm512_loadu_ps(qf + (size_t)r * D + 16 * c);
            for (int j = 0; j < 16; ++j) {
              if (j < nt) {
                __m512 x = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr[j]));
                for (int c = 1; c < NV; ++c) x = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr[j] + 16 * c), x);
                a[j] = x;
              } else {
                a[j] = _mm512_setzero_ps();
              }
            }
            s = hsum16(a);
          }
          if (P.softcap2 > 0.f)
            s = _mm512_mul_ps(tanh_ps(_mm512_mul_ps(s, _mm512_set1_ps(P.inv_softcap2))), _mm512_set1_ps(P.softcap2));
          s = _mm512_mask_blend_ps((__mmask16)(((1u << lim) - 1u) & ~((1u << first) - 1u)), ninf, s);
        }
        const float mo = m[r];
        const float mn = std::max(mo, _mm512_reduce_max_ps(s));
        __m512 p = _mm512_setzero_ps();
        float cr = 1.f;
        if (mn != NEG_INF) {  // else nothing is visible to this row yet
          p = exp2_ps(_mm512_sub_ps(s, _mm512_set1_ps(mn)));
          cr = mn == mo ? 1.f : (mo == NEG_INF ? 0.f : std::exp2(mo - mn));
          m[r] = mn;
          float* lr = lv + (size_t)r * TILE;
          _mm512_storeu_ps(lr, _mm512_fmadd_ps(_mm512_loadu_ps(lr), _mm512_set1_ps(cr), p));
        }
        corr[r] = cr;
#if defined(__AVX512BF16__)
        if constexpr (DP) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(S + (size_t)r * TILE),
                              (__m256i)_mm512_cvtneps_pbh(Q8 ? _mm512_mul_ps(p, vsc) : p));
          continue;
        }
#endif
        _mm512_storeu_ps(S + (size_t)r * TILE, p);
      }
      // acc_r = acc_r * corr_r + sum_j p_rj v_j, RC rows at a time with their accumulators in registers
      for (int r0 = rbeg; r0 < rend; r0 += RC) {
        const int rc = std::min(RC, rend - r0);
        __m512 av[RC][NV];
        load_corrected<NV, RC>(av, acc, corr, r0, rc);
        if constexpr (DP) {
#if defined(__AVX512BF16__)
          // row r: TILE / 2 pairs at r * TILE
          pv_pairs_bf16<NV, RC>(av, reinterpret_cast<const uint32_t*>(S) + (size_t)r0 * TILE, TILE, 1, vt, nt, rc,
                                [](int) {});
#endif
        } else {
          for (int j = 0; j < nt; ++j) {
            __m512 vv[NV];
            for (int c = 0; c < NV; ++c) vv[c] = _mm512_loadu_ps(vr[j] + 16 * c);
            for (int i = 0; i < RC; ++i) {
              if (i < rc) {
                const __m512 pj = _mm512_set1_ps(S[(size_t)(r0 + i) * TILE + j]);
                for (int c = 0; c < NV; ++c) av[i][c] = _mm512_fmadd_ps(pj, vv[c], av[i][c]);
              }
            }
          }
        }
        store_rows<NV, RC>(av, acc, r0, rc);
      }
    }
  }

  finish_rows<T, DP, NV>(P, it, R, acc, lv, m, partial);
}

#if defined(__AVX512BF16__)
// Decode of grouped-query heads with bf16 q, from a bf16 cache or an 8-bit one (its codes taken exactly into
// bf16 rows of the tile first, as the general path takes them): one query token, so every key of the item is
// visible to every row; G rows per kv head; head_dim 32 * NC. What bounded the general path here was not its dot
// products but what each row pays per tile of 16 keys: the running max (a horizontal max), the correction
// exp2, its accumulator rescaled through memory, the probabilities' store. This path takes the keys
// DECODE_TILE at a time, as DECODE_TILE / TILE sub-tiles laid out as the general path lays out one (K
// transposed into bf16 pairs, V interleaved by pairs of keys), so that those costs come once per 64 keys, and
// computes the scores of DECODE_RB rows together, each vector of transposed K loaded once for them. The same
// arithmetic as the general path's: vdpbf16ps products, float32 sums, P rounded to bf16 for P.V; sums in
// another order (the running max moves every 64 keys instead of 16).
constexpr int DECODE_TILE = 64;
constexpr int DECODE_SUBS = DECODE_TILE / TILE;
constexpr int DECODE_RB = 4;  // rows whose scores are computed together (DECODE_SUBS accumulators each)

template <typename C, int NC>
void attend_decode_bf16(const Params& P, const Item& it, float* partial, const Item* ahead) {
  constexpr int NV = 2 * NC, D = NV * 16, D2 = D / 2;
  constexpr int RC = NV >= 24 ? 1 : 24 / NV;  // rows whose V accumulators stay in registers together
  constexpr bool Q8 = Cache<C>::QUANTIZED;
  constexpr int RW = D + Cache<C>::SCALE_BYTES;  // elements of a cache row
  const int G = P.G, NH = it.h1 - it.h0, R = G * NH;
  const int qs = P.reqs[3 * it.b];

  float* mem = thread_scratch().get((size_t)R * (D + TILE + 2 + DECODE_TILE / 2) + DECODE_TILE * D * (Q8 ? 2 : 1) + 64);
  float* acc = mem;
  float* lv = acc + (size_t)R * D;  // per-lane partial sums of the probabilities, TILE per row
  float* m = lv + (size_t)R * TILE;
  float* corr = m + R;
  uint32_t* S = reinterpret_cast<uint32_t*>(corr + R);  // each row's probabilities, DECODE_TILE / 2 bf16 pairs
  uint32_t* kt = S + (size_t)R * DECODE_TILE / 2;  // DECODE_SUBS transposed sub-tiles of K, D2 * TILE each
  uint32_t* vt = kt + DECODE_TILE * D2;  // V interleaved by pairs of keys
  // 8-bit: the tile's codes as bf16 rows, K's then V's (DECODE_TILE * D each)
  at::BFloat16* codes = reinterpret_cast<at::BFloat16*>(vt + DECODE_TILE * D2);
  constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

  // row r is query head h0 * G + r; its q, D2 bf16 pairs, is read in place
  const at::BFloat16* q0 = static_cast<const at::BFloat16*>(P.q) + (int64_t)(qs + it.q0) * P.q_st +
                           (int64_t)it.h0 * G * P.q_sh;
  for (int r = 0; r < R; ++r) {
    start_row<NV>(acc, lv, m, r);
  }

  const C* kc = static_cast<const C*>(P.k_cache);
  const C* vc = static_cast<const C*>(P.v_cache);
  const int32_t* bt = P.block_tables + it.b * P.max_blocks;
  const int64_t row_stride = (int64_t)P.Hkv * RW;
  const __m512 sc = _mm512_set1_ps(P.scale_log2), ninf = _mm512_set1_ps(NEG_INF);
  // the prefetchers step every PF_SCORE_EVERY pairs of d in the scores and every PF_PV_EVERY pairs of keys in P.V
  constexpr int PF_SCORE_EVERY = 4, PF_PV_EVERY = 2;
  const int steps_per_tile = NH * (((G + DECODE_RB - 1) / DECODE_RB) * (D2 / PF_SCORE_EVERY) +
                                   ((G + RC - 1) / RC) * (DECODE_TILE / 2 / PF_PV_EVERY));
  {  // the first tile's rows, all at once (a thread's item before this one asked for them already, its first
     // item has nothing before it to hide them behind)
    LinePrefetcher<DECODE_TILE> first;
    aim<C>(first, P, it, it.k0, 1);
    first.step();
  }
  for (int t0 = it.k0; t0 < it.k1; t0 += DECODE_TILE) {
    const int nt = std::min(DECODE_TILE, it.k1 - t0);
    int64_t tok[DECODE_TILE];
    key_rows(P, bt, t0, nt, row_stride, tok);
    // the next tile's rows, spread over this tile's work; in the last tile, the first ones of the item this
    // thread runs next. Into L2, as the general path's: a tile's rows (32 KB for two kv heads of 64 in bf16)
    // prefetched into L1 evicted the tile being worked on from Zen 4's 32 KB (L2 instead: 1.24-1.50x a bf16
    // decode there, 1.02-1.18x an 8-bit one), and a burst into L1 at an item's start cost 30 % of a hot decode
    LinePrefetcher<DECODE_TILE> pf;
    if (t0 + DECODE_TILE < it.k1) aim<C>(pf, P, it, t0 + DECODE_TILE, steps_per_tile);
    else if (ahead) aim<C>(pf, P, *ahead, ahead->k0, steps_per_tile);
    __mmask16 valid[DECODE_SUBS];  // the lanes of each sub-tile that hold keys (all but in the last tile)
    for (int u = 0; u < DECODE_SUBS; ++u) {
      const int n = std::max(0, std::min(TILE, nt - TILE * u));
      valid[u] = n == TILE ? __mmask16(0xffff) : __mmask16((1u << n) - 1u);
    }
    for (int hh = 0; hh < NH; ++hh) {
      const int64_t hoff = (int64_t)(it.h0 + hh) * RW;
      const at::BFloat16* kp[DECODE_TILE];  // the rows as bf16: the cache's, or an 8-bit one's codes
      const at::BFloat16* vp[DECODE_TILE];
      alignas(64) float ks[DECODE_TILE] = {}, vs[DECODE_TILE] = {};  // 8-bit: each key's scales (see exact_key)
      for (int j = 0; j < nt; ++j) {
        const C* kr = kc + tok[j] + hoff;
        const C* vr = vc + tok[j] + hoff;
        if constexpr (Q8) {
          exact_key<NC, DECODE_TILE>(kr, vr, j, codes, kp, vp, ks, vs);
        } else {
          kp[j] = kr;
          vp[j] = vr;
        }
      }
      __m512 ksc[DECODE_SUBS], vsc[DECODE_SUBS];  // the same by sub-tile, K's times the softmax scale
      if constexpr (Q8) {
        for (int u = 0; u < DECODE_SUBS; ++u) {
          ksc[u] = _mm512_mul_ps(_mm512_load_ps(ks + TILE * u), sc);
          vsc[u] = _mm512_load_ps(vs + TILE * u);
        }
      }
      for (int u = 0; u < DECODE_SUBS; ++u)  // keys past nt transpose as zeros
        transpose_k_tile<NC>(kp + TILE * u, std::max(0, std::min(TILE, nt - TILE * u)), kt + u * D2 * TILE);
      interleave_v_tile<NC>(vp, nt, vt);

      const int rbeg = hh * G, rend = rbeg + G;
      for (int r0 = rbeg; r0 < rend; r0 += DECODE_RB) {  // scores (base 2), then each row's softmax update
        const int rb = std::min(DECODE_RB, rend - r0);
        __m512 s[DECODE_RB][DECODE_SUBS];
        for (int i = 0; i < DECODE_RB; ++i)
          for (int u = 0; u < DECODE_SUBS; ++u) s[i][u] = _mm512_setzero_ps();
        for (int d2 = 0; d2 < D2; ++d2) {
          if (d2 % PF_SCORE_EVERY == 0) pf.step();
          __m512bh kv[DECODE_SUBS];
          for (int u = 0; u < DECODE_SUBS; ++u) kv[u] = (__m512bh)_mm512_loadu_si512(kt + (u * D2 + d2) * TILE);
          for (int i = 0; i < DECODE_RB; ++i) {
            if (i < rb) {
              const __m512bh qv = (__m512bh)_mm512_set1_epi32(
                  (int)reinterpret_cast<const uint32_t*>(q0 + (int64_t)(r0 + i) * P.q_sh)[d2]);
              for (int u = 0; u < DECODE_SUBS; ++u) s[i][u] = _mm512_dpbf16_ps(s[i][u], qv, kv[u]);
            }
          }
        }
        for (int i = 0; i < rb; ++i) {
          const int r = r0 + i;
          __m512 mx = ninf;
          for (int u = 0; u < DECODE_SUBS; ++u) {
            __m512 x = _mm512_mul_ps(s[i][u], Q8 ? ksc[u] : sc);
            if (P.softcap2 > 0.f)
              x = _mm512_mul_ps(tanh_ps(_mm512_mul_ps(x, _mm512_set1_ps(P.inv_softcap2))), _mm512_set1_ps(P.softcap2));
            s[i][u] = _mm512_mask_blend_ps(valid[u], ninf, x);
            mx = _mm512_max_ps(mx, s[i][u]);
          }
          const float mo = m[r];
          const float mn = std::max(mo, _mm512_reduce_max_ps(mx));  // finite: every tile has a key
          corr[r] = mn == mo ? 1.f : (mo == NEG_INF ? 0.f : std::exp2(mo - mn));
          m[r] = mn;
          const __m512 mv = _mm512_set1_ps(mn);
          __m512 psum = _mm512_setzero_ps();
          for (int u = 0; u < DECODE_SUBS; ++u) {
            const __m512 p = exp2_ps(_mm512_sub_ps(s[i][u], mv));
            psum = _mm512_add_ps(psum, p);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(S + (size_t)r * DECODE_TILE / 2 + TILE / 2 * u),
                                (__m256i)_mm512_cvtneps_pbh(Q8 ? _mm512_mul_ps(p, vsc[u]) : p));
          }
          float* lr = lv + (size_t)r * TILE;
          _mm512_storeu_ps(lr, _mm512_fmadd_ps(_mm512_loadu_ps(lr), _mm512_set1_ps(corr[r]), psum));
        }
      }
      // acc_r = acc_r * corr_r + sum_j p_rj v_j, RC rows at a time with their accumulators in registers
      for (int r0 = rbeg; r0 < rend; r0 += RC) {
        const int rc = std::min(RC, rend - r0);
        __m512 av[RC][NV];
        load_corrected<NV, RC>(av, acc, corr, r0, rc);
        pv_pairs_bf16<NV, RC>(av, S + (size_t)r0 * DECODE_TILE / 2, DECODE_TILE / 2, 1, vt, nt, rc, [&](int jp) {
          if (jp % PF_PV_EVERY == 0) pf.step();
        });
        store_rows<NV, RC>(av, acc, r0, rc);
      }
    }
    pf.per_step = DECODE_TILE;  // what a short last tile's fewer steps left
    pf.step();
  }
  finish_rows<at::BFloat16, true, NV>(P, it, R, acc, lv, m, partial);
}
#if defined(__AMX_BF16__)
#include "paged_decode_amx.h"
#endif
#endif
#endif  // __AVX512F__

template <typename T>
// (params, item, its partial results' slot or null, the item this thread runs next or null: its first keys
// may be prefetched)
using ItemFn = void (*)(const Params&, const Item&, float*, const Item*);

template <typename T, typename C>
ItemFn<T> pick_kernel(int D) {
#if defined(__AVX512F__)
  if (std::is_same<T, C>::value || Cache<C>::QUANTIZED) switch (D) {
    case 16: return attend_item_avx512<T, C, 1>;
    case 32: return attend_item_avx512<T, C, 2>;
    case 48: return attend_item_avx512<T, C, 3>;
    case 64: return attend_item_avx512<T, C, 4>;
    case 80: return attend_item_avx512<T, C, 5>;
    case 96: return attend_item_avx512<T, C, 6>;
    case 112: return attend_item_avx512<T, C, 7>;
    case 128: return attend_item_avx512<T, C, 8>;
    case 160: return attend_item_avx512<T, C, 10>;
    case 192: return attend_item_avx512<T, C, 12>;
    case 256: return attend_item_avx512<T, C, 16>;
    default: break;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (std::is_same<T, C>::value || Cache<C>::QUANTIZED) switch (D) {
    case 32: return avx2::attend_item<T, C, 4>;
    case 64: return avx2::attend_item<T, C, 8>;
    case 80: return avx2::attend_item<T, C, 10>;
    case 96: return avx2::attend_item<T, C, 12>;
    case 128: return avx2::attend_item<T, C, 16>;
    case 256: return avx2::attend_item<T, C, 32>;
    default: break;
  }
#endif
  return attend_item_scalar<T, C>;
}

// The decode paths for DECODE_MIN_G or more query heads per kv head, with bf16 q and out, a bf16 or 8-bit cache,
// AVX512-BF16 and head_dim a multiple of 32 (to 256): on AMX-BF16 attend_decode_amx, where a kv head has at most
// 16 query heads and blocks a multiple of 16 slots; else attend_decode_bf16. (With 2 or 3 query heads per kv head
// the general path reads the cache at the machine's bandwidth already, and the AMX path was 0.86-0.98x it.)
constexpr int DECODE_MIN_G = TRANSPOSE_MIN_ROWS;

enum class DecodePath { GENERAL, VECTOR, AMX };

template <typename T, typename C>
DecodePath decode_path_for(int D, int G, int block_size) {
#if defined(__AVX512BF16__)
  const bool types = std::is_same<T, at::BFloat16>::value && (std::is_same<C, T>::value || Cache<C>::QUANTIZED);
  if (!types || G < DECODE_MIN_G || D % 32 != 0 || D > 256 || D == 224) return DecodePath::GENERAL;
#if defined(__AMX_BF16__)
  if (G <= amx_decode::LANES && block_size % 16 == 0 && folio::amx::permitted()) return DecodePath::AMX;
#endif
  return DecodePath::VECTOR;
#else
  return DecodePath::GENERAL;
#endif
}

// The decode path's kernel for head_dim 32 NC (null: the general path).
template <typename T, typename C>
ItemFn<T> pick_decode_kernel(int D, int G, int block_size) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same<T, at::BFloat16>::value && (std::is_same<C, T>::value || Cache<C>::QUANTIZED)) {
    const DecodePath path = decode_path_for<T, C>(D, G, block_size);
    auto kernel = [&](auto nc) -> ItemFn<T> {
      constexpr int NC = decltype(nc)::value;
#if defined(__AMX_BF16__)
      if (path == DecodePath::AMX) return attend_decode_amx<C, NC>;
#endif
      return attend_decode_bf16<C, NC>;
    };
    if (path != DecodePath::GENERAL) switch (D / 32) {
      case 1: return kernel(std::integral_constant<int, 1>{});
      case 2: return kernel(std::integral_constant<int, 2>{});
      case 3: return kernel(std::integral_constant<int, 3>{});
      case 4: return kernel(std::integral_constant<int, 4>{});
      case 5: return kernel(std::integral_constant<int, 5>{});
      case 6: return kernel(std::integral_constant<int, 6>{});
      case 8: return kernel(std::integral_constant<int, 8>{});
      default: break;
    }
  }
#endif
  return nullptr;
}

// Merge the partial results of one group's key partitions and write the normalised output.
template <typename T>
void combine_group(const Params& P, const Group& g, const float* partials) {
  const int D = P.D, G = P.G;
  const int RH = (g.q1 - g.q0) * G, R = RH * (g.h1 - g.h0);
  const int qs = P.reqs[3 * g.b];
  std::vector<float> a(D);
  for (int r = 0; r < R; ++r) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int p = 0; p < g.nparts; ++p)
      mx = std::max(mx, partials[((size_t)g.part + (size_t)p * R + r) * (D + 2)]);
    std::fill(a.begin(), a.end(), 0.f);
    float lsum = 0.f;
    if (mx != -std::numeric_limits<float>::infinity()) {
      for (int p = 0; p < g.nparts; ++p) {
        const float* pp = partials + ((size_t)g.part + (size_t)p * R + r) * (D + 2);
        if (pp[1] == 0.f) continue;
        const float w = std::exp2(pp[0] - mx);
        lsum += pp[1] * w;
        for (int c = 0; c < D; ++c) a[c] += pp[2 + c] * w;
      }
    }
    const int hh = r / RH, rr = r % RH;
    const int qi = g.q0 + rr / G, head = (g.h0 + hh) * G + rr % G;
    lsum = with_sink(P, head, mx, lsum);  // once, not per partition
    const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
    T* dst = static_cast<T*>(P.out) + ((int64_t)(qs + qi) * P.Hkv * G + head) * D;
    for (int c = 0; c < D; ++c) dst[c] = static_cast<T>(a[c] * inv);
  }
}

// One (token, kv head) row into the cache: copied, or quantised with its own scale as kv_quant.py does.
template <typename T, typename C>
inline void store_row(C* dst, const T* src, int D) {
  if constexpr (Cache<C>::QUANTIZED) {
    float amax = 0.f;
    for (int c = 0; c < D; ++c) amax = std::max(amax, std::fabs(to_f(src[c])));
    const float s = amax > 0.f ? amax / Cache<C>::MAX : 1.f;
    for (int c = 0; c < D; ++c) dst[c] = Cache<C>::encode(to_f(src[c]) / s);
    Cache<C>::store_scale(dst, D, s);
  } else {
    std::memcpy(dst, src, sizeof(T) * D);
  }
}

template <typename T, typename C>
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping, int nthreads) {
  const int64_t T_ = k.size(0), H = k.size(1), D = k.size(2), RS = k_cache.size(3);
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  C* kc = static_cast<C*>(k_cache.data_ptr());
  C* vc = static_cast<C*>(v_cache.data_ptr());
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t kst = k.stride(0), ksh = k.stride(1), vst = v.stride(0), vsh = v.stride(1);
  const int64_t nslots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < T_; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < nslots, "slot_mapping[", t, "] = ", slots[t], " is out of range");
  auto body = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      C* kd = kc + slots[t] * H * RS;
      C* vd = vc + slots[t] * H * RS;
      for (int64_t h = 0; h < H; ++h) {
        store_row<T, C>(kd + h * RS, kp + t * kst + h * ksh, (int)D);
        store_row<T, C>(vd + h * RS, vp + t * vst + h * vsh, (int)D);
      }
    }
  };
  if (nthreads > 1 && T_ >= 64) {
    folio::parallel_for(0, T_, 16, body);
  } else {
    body(0, T_);
  }
}

template <typename T, typename C>
void run(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
         at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
         const at::Tensor& reqs, const at::Tensor& block_tables, double scale, int64_t window, double softcap,
         const std::optional<at::Tensor>& sinks, int64_t min_split_keys, int64_t min_parallel_work) {
  int nthreads = std::max(1, folio::num_threads());
  write_kv<T, C>(k, v, k_cache, v_cache, slot_mapping, nthreads);

  Params P;
  P.q = q.data_ptr<T>();
  P.q_st = q.stride(0);
  P.q_sh = q.stride(1);
  P.out = out.data_ptr<T>();
  P.k_cache = k_cache.data_ptr();
  P.v_cache = v_cache.data_ptr();
  P.reqs = reqs.data_ptr<int32_t>();
  P.block_tables = block_tables.data_ptr<int32_t>();
  P.max_blocks = block_tables.size(1);
  P.block_size = (int)k_cache.size(1);
  P.Hkv = (int)k_cache.size(2);
  P.D = (int)q.size(2);
  P.RS = (int)k_cache.size(3);
  P.G = (int)(q.size(1) / P.Hkv);
  P.scale_log2 = (float)scale * LOG2E;
  P.window = (int)std::max<int64_t>(0, window);
  P.softcap2 = softcap > 0 ? (float)softcap * LOG2E : 0.f;
  P.inv_softcap2 = softcap > 0 ? 1.f / P.softcap2 : 0.f;
  const std::vector<float> sinks2 = folio::sinks_base2(sinks, q.size(1));
  P.sinks = sinks ? sinks2.data() : nullptr;

  const int B = (int)reqs.size(0);
  const int G = P.G, Hkv = P.Hkv;
  const int qt = std::max(1, MAX_ROWS / G);  // query tokens per item
  for (int b = 0; b < B; ++b) {
    const int32_t* rq = P.reqs + 3 * b;
    TORCH_CHECK(rq[1] >= 1 && rq[2] >= rq[1], "request ", b, ": bad query length / context length");
    TORCH_CHECK((rq[2] + P.block_size - 1) / P.block_size <= P.max_blocks, "request ", b,
                ": block table too short for its context");
    TORCH_CHECK(rq[0] >= 0 && rq[0] + rq[1] <= q.size(0), "request ", b, ": tokens out of range");
  }
  // Too little work to be worth waking other threads (a parallel region costs microseconds when the cores
  // are free, and milliseconds when another process holds one and OpenMP threads spin-wait): stay on one.
  int64_t work = 0;  // (query row, key) pairs, upper bound
  for (int b = 0; b < B; ++b) {
    const int64_t qlen = P.reqs[3 * b + 1], L = P.reqs[3 * b + 2];
    work += qlen * (P.window ? std::min<int64_t>(L, P.window + qlen - 1) : L) * G * Hkv;
  }
  if (work < min_parallel_work) nthreads = 1;

  // Items: a decode covers all kv heads of its request (it then reads whole rows [Hkv, D] of the cache,
  // contiguous within a block); a prefill chunk is cut per kv head and per tile of qt query tokens.
  // When that gives too few items to keep every thread busy, the keys are split into partitions.
  auto heads_per_item = [&](int qlen) { return qlen == 1 ? Hkv : 1; };
  int64_t base = 0;
  for (int b = 0; b < B; ++b) {
    const int qlen = P.reqs[3 * b + 1];
    base += (int64_t)(Hkv / heads_per_item(qlen)) * ((qlen + qt - 1) / qt);
  }
  const int64_t want = 4 * (int64_t)nthreads;
  const bool split = nthreads > 1 && base < want && min_split_keys > 0;
  std::vector<Item> items;
  std::vector<Group> groups;
  int64_t partial_rows = 0;
  for (int b = 0; b < B; ++b) {
    const int32_t* rq = P.reqs + 3 * b;
    const int qlen = rq[1], L = rq[2], off = L - qlen;
    const int nh = heads_per_item(qlen);
    for (int h0 = 0; h0 < Hkv; h0 += nh) {
      for (int q0 = 0; q0 < qlen; q0 += qt) {
        const int q1 = std::min(qlen, q0 + qt);
        // the keys the item's rows see: from the window of its first query token to its last token
        const int kbeg = P.window ? std::max(0, off + q0 - P.window + 1) : 0, kend = off + q1;
        const int keys = kend - kbeg;
        const int R = (q1 - q0) * G * nh;
        int nparts = 1, per = keys;
        if (split) {
          const int64_t by_len = keys / min_split_keys;
          nparts = (int)std::max<int64_t>(1, std::min<int64_t>(by_len, (want + base - 1) / base));
          per = ((keys + nparts - 1) / nparts + TILE - 1) / TILE * TILE;  // boundaries on multiples of TILE
          nparts = (keys + per - 1) / per;
        }
        if (nparts <= 1) {
          items.push_back({b, h0, h0 + nh, q0, q1, kbeg, kend, -1, (int64_t)R * keys});
        } else {
          groups.push_back({b, h0, h0 + nh, q0, q1, (int)partial_rows, nparts});
          for (int p = 0; p < nparts; ++p) {
            const int k0 = kbeg + p * per, k1 = std::min(kend, k0 + per);
            items.push_back({b, h0, h0 + nh, q0, q1, k0, k1, (int)(partial_rows + (int64_t)p * R),
                             (int64_t)R * (k1 - k0)});
          }
          partial_rows += (int64_t)nparts * R;
        }
      }
    }
  }
  std::vector<float> partials((size_t)partial_rows * (P.D + 2));
  // longest items first, so that dynamic scheduling ends with the short ones
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });

  const ItemFn<T> fn = pick_kernel<T, C>(P.D), decode = pick_decode_kernel<T, C>(P.D, G, P.block_size);
  const int64_t n = (int64_t)items.size();
  const int nt = (int)std::min<int64_t>(nthreads, n);
  float* pbase = partials.data();
  const int D2 = P.D + 2;
  // dynamic scheduling, each thread claiming its next item before it runs the current one (so that the
  // current one's end can prefetch the next one's first keys) while enough are left to keep every thread
  // busy; the last ones are claimed as threads come free, as schedule(dynamic, 1) would
  std::atomic<int64_t> claimed{0};
  auto claim_items = [&](int64_t, int64_t) {
    for (int64_t i = claimed.fetch_add(1); i < n;) {
      const int64_t next = claimed.load(std::memory_order_relaxed) + nt < n ? claimed.fetch_add(1) : -1;
      const Item& it = items[i];
      (decode && P.reqs[3 * it.b + 1] == 1 ? decode : fn)(P, it, it.part < 0 ? nullptr : pbase + (size_t)it.part * D2,
                                                          next >= 0 && next < n ? &items[next] : nullptr);
      i = next >= 0 ? next : claimed.fetch_add(1);
    }
  };
  folio::parallel_for(0, nt, 1, claim_items);  // nt threads (one: inline), each claiming items
  const int64_t ng = (int64_t)groups.size();
  if (ng) {
    auto combine = [&](int64_t g0, int64_t g1) {
      for (int64_t i = g0; i < g1; ++i) combine_group<T>(P, groups[i], pbase);
    };
    if (nthreads > 1 && ng > 1)
      folio::parallel_for(0, ng, 1, combine);
    else
      combine(0, ng);
  }
}

}  // namespace

// Returns out [T, Hq, D] (contiguous) for q [T, Hq, D], k/v [T, Hkv, D]; see the top of the file. Allocated
// here: one Python-level torch.empty per layer per step costs microseconds at decode.
at::Tensor paged_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor k_cache,
                     at::Tensor v_cache, at::Tensor slot_mapping, at::Tensor reqs,
                     at::Tensor block_tables, double scale, int64_t window, double softcap,
                     std::optional<at::Tensor> sinks, int64_t min_split_keys, int64_t min_parallel_work) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be 3-d");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(), "caches must be contiguous [blocks, block_size, Hkv, D]");
  const auto dt = q.scalar_type(), ct = k_cache.scalar_type();
  const bool quantized = ct == at::kChar || ct == at::kByte;
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "unsupported dtype ", dt, " (float32 and bfloat16 only)");
  TORCH_CHECK(k.scalar_type() == dt && v.scalar_type() == dt && v_cache.scalar_type() == ct && (ct == dt || quantized),
              "q, k, v must share a dtype, the caches it or int8 / uint8 (fp8)");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "q, k, v need unit stride along head_dim");
  TORCH_CHECK(k.size(1) == k_cache.size(2) && k_cache.size(3) == k.size(2) + (quantized ? 4 : 0) &&
                  q.size(2) == k.size(2) && k.sizes() == v.sizes() && q.size(0) == k.size(0),
              "q/k/v shapes do not match the cache");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == k.size(0), "slot_mapping must be int64 [T]");
  TORCH_CHECK(reqs.scalar_type() == at::kInt && reqs.is_contiguous() && reqs.dim() == 2 && reqs.size(1) == 3,
              "reqs must be int32 [B, 3]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  block_tables.dim() == 2 && block_tables.size(0) == reqs.size(0), "block_tables must be int32 [B, M]");
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  auto go = [&](auto t, auto c) {
    run<decltype(t), decltype(c)>(out, q, k, v, k_cache, v_cache, slot_mapping, reqs, block_tables, scale, window,
                                  softcap, sinks, min_split_keys, min_parallel_work);
  };
  auto with_cache = [&](auto t) {
    if (ct == at::kChar) go(t, int8_t{});
    else if (ct == at::kByte) go(t, uint8_t{});
    else go(t, t);
  };
  if (dt == at::kFloat) with_cache(float{});
  else with_cache(at::BFloat16{});
  return out;
}

// Which path decodes a bf16 q with head_dim D, G query heads per kv head, blocks of block_size slots, a bf16 or
// 8-bit cache: "amx" (attend_decode_amx), "vector" (attend_decode_bf16) or "general" (the per-item kernels).
std::string decode_path(int64_t D, int64_t G, int64_t block_size, bool quantized) {
  const DecodePath path = quantized ? decode_path_for<at::BFloat16, int8_t>((int)D, (int)G, (int)block_size)
                                    : decode_path_for<at::BFloat16, at::BFloat16>((int)D, (int)G, (int)block_size);
  return path == DecodePath::AMX ? "amx" : path == DecodePath::VECTOR ? "vector" : "general";
}

bool has_avx512() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  folio::bind_decode_threads(m);
  // the GIL is released while the kernel runs (a server thread in the same process keeps going)
  m.def("paged_attention", &paged_attention, "write new K/V into the paged cache and attend in place (returns out)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("has_avx512", &has_avx512, "whether the vector path was compiled");
  m.def("decode_path", &decode_path, "which path decodes bf16 q: amx, vector or general (head_dim, group, block_size, quantized)");
}
