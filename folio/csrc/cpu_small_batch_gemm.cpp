// y = x W^T (+ b) for a handful to tens of rows of x, in bf16 or float32, streaming W once at memory speed.
//
// Decoding one to a few tens of sequences (or verifying speculated tokens) multiplies each weight matrix by a
// few vectors: the time is the time to read W. Each thread takes a contiguous range of W (one sequential
// stream of memory) and multiplies it by every row of x, so W is read once whatever M.
//
// bf16 (AVX512-BF16, any M): W is oneDNN's packed weight, read in place (folio/models/small_batch_gemm.py
// recognises the layout): blocks of NB = 16 * NV output columns, each [K/2][NB][2]. A pair of x's values,
// broadcast as one 32-bit lane, times a vector of the block (two bf16 along K for each of 16 columns) adds to
// 16 columns' sums at once with vdpbf16ps (products exact, sums in float32), so no sum is reduced across
// lanes. Rows of x go in chunks that fit the vector registers; each block comes from memory for the first chunk
// and from cache for the others. The bias is added in float32 and the sum rounded to bf16 once (round to
// nearest even), as oneDNN does; the sums run in another order than oneDNN's, so results may differ from its
// in the last bf16 bit.
//
// bf16 on AMX tiles (`linear_bf16_amx`, built where the compiler targets AMX-BF16; meant for 9-64 rows): with
// AMX the vector kernel above is bound by vdpbf16ps's rate from 16 rows on, and oneDNN's GEMM streamed the
// weights of 16-64 rows at 14-22 GB/s on 2 cores of an Emerald Rapids Xeon that read 30. The same packed blocks,
// read in place, go through folio's AMX tile loop (amx_tiles.h: chunks along K, the next one prefetched into L2
// during the tile work), then the vector kernel's epilogue (bias in float32, one rounding to bf16);
// `linear_bf16_amx_argmax` keeps, instead of storing them, each row's first largest of those rounded values: the
// argmax of a greedy step's logits without writing them; given the silu table (a gated MLP's gate/up whose weight
// lies as runs of 32 gates, each followed by the same outputs' ups), `linear_bf16_amx` writes SiLU-and-mul's
// result instead of the product, looked up as the bf16 op looks it up (bf16_silu_and_mul.h), bit for bit.
//
// float32 (AVX2+FMA or AVX-512F, any K, M <= MAX_M_F32): MKL's sgemm packs the whole weight matrix on every
// call with M >= 2 rows, so a 2-row product cost 2.3x a 1-row one and a 7-row one 2.9x (the 49152 x 576
// lm_head of SmolLM2 on an AVX2 EPYC: 14 ms, 33 ms, 41 ms), and oneDNN's GEMM took a batch-1 decode step twice
// this kernel's time; here the weight oneDNN packed as blocks [N / NB][K'][NB] is read in place, a piece of 64
// K rows at a time, by register tiles of up to 6 rows of x (one row over whole 64-column rows of the piece for
// one or two rows), with FMAs in float32 (sums in another order than MKL's and oneDNN's: results differ in the
// last bits). Against oneDNN's GEMM on the same blocks, all linear layers of the 0.5B Qwen2 from memory on 2
// cores of a shared Zen 3 EPYC: 1.3-1.6x as fast at 1-16 rows, 1.1-1.4x at 32, 1.0-1.2x at 48-64; 0.9-1.1x at
// 96-256, which oneDNN keeps (MAX_M_F32).
//
// The same float32 kernel reads bf16 blocks of that layout too: a float32 weight whose values are all bf16 ones
// (a bf16 checkpoint run in float32, folio/models/bf16_valued.py), kept in half the bytes. Up to WIDEN_FROM rows
// each vector of the block is widened as it is loaded (a zero-extension and a shift: exact); from there each
// piece is widened once into an L1 buffer that the tiles read as float32, since widening at every tile cost
// 8-15 % at 32-64 rows. The FMAs and their order are the float32 blocks', so are the results, bit for bit.
#include "parallel.h"
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define FOLIO_DPBF16 1
#else
#define FOLIO_DPBF16 0
#endif
#if FOLIO_DPBF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define FOLIO_AMX 1
#include "amx_tiles.h"
#else
#define FOLIO_AMX 0
#endif
#include "bf16_silu_and_mul.h"  // the silu table's size, which every build checks
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define FOLIO_F32_FMA 1
#else
#define FOLIO_F32_FMA 0
#endif

namespace {

constexpr int MAX_M_F32 = 64;
// bf16 weight elements ahead of the current pair of K to prefetch (8 KiB): 2 KiB added 7-10 % to the read rate
// on Zen 4; 8 KiB 6-7 % more at one row (a layer from memory, 30 alternating rounds), 4.5-6 % on a bf16 decode
// step of the 0.5B Qwen2; the same at 32 and 64 rows, where the kernel is compute-bound
constexpr int64_t PREFETCH = 4096;

#if FOLIO_DPBF16
// The 16 columns of a block from its column 16 v that lie within its width (masked), and their bias (0 without
// one), for the bf16 epilogues: the sums plus the bias in float32, rounded to bf16 once.
struct Lanes {
  __mmask16 mask;
  __m512 bias;
  Lanes(const c10::BFloat16* bias_row, int64_t n0, int64_t width, int v) {
    const int64_t lanes = std::min<int64_t>(16, width - v * 16);
    mask = lanes >= 16 ? __mmask16(0xffff) : __mmask16((1u << std::max<int64_t>(lanes, 0)) - 1);
    bias = bias_row ? _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(mask, bias_row + n0 + v * 16))
                    : _mm512_setzero_ps();
  }
  void store(c10::BFloat16* y, __m512 sum) const {
    _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sum, bias)));
  }
  // the values `store` writes, back in float32
  __m512 rounded(__m512 sum) const { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(_mm512_add_ps(sum, bias))); }
};

// One block of NV * 16 output columns for M rows: the block is [K/2][NV * 16][2], so each pair of x's values
// (broadcast as one 32-bit lane) times each 32-bit lane of the weight (two bf16 along K) adds to the column's
// sum with no horizontal reduction; NV * M independent chains.
template <int M, int NV>
void block(const c10::BFloat16* x, int64_t x_stride, const c10::BFloat16* w, const c10::BFloat16* bias,
           c10::BFloat16* y, int64_t y_stride, int64_t pairs, int64_t n0, int64_t width) {
  __m512 acc[M][NV];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  const int32_t* xp[M];
  for (int m = 0; m < M; ++m) xp[m] = reinterpret_cast<const int32_t*>(x + m * x_stride);
  for (int64_t p = 0; p < pairs; ++p, w += NV * 32) {
    __m512bh wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + v * 32);
    for (int v = 0; v < NV; ++v) _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH + v * 32), _MM_HINT_T0);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(xp[m][p]);
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], wv[v], xv);
    }
  }
  for (int v = 0; v < NV && v * 16 < width; ++v) {
    const Lanes lanes(bias, n0, width, v);
    for (int m = 0; m < M; ++m) lanes.store(y + m * y_stride + n0 + v * 16, acc[m][v]);
  }
}

// The rows of x in chunks of at most CHUNK (CHUNK * NV accumulators fit the 32 vector registers with the
// weight vectors): each block is read from memory once, by the first chunk, and from cache by the others.
template <int NV>
constexpr int chunk_rows() { return NV == 4 ? 6 : (NV == 3 ? 7 : 8); }

template <int M, int NV>
void chunk(int64_t m, const c10::BFloat16* x, int64_t xs, const c10::BFloat16* w, const c10::BFloat16* b,
           c10::BFloat16* y, int64_t N, int64_t pairs, int64_t n0, int64_t width) {
  if constexpr (M > 1) {
    if (m < M) return chunk<M - 1, NV>(m, x, xs, w, b, y, N, pairs, n0, width);
  }
  block<M, NV>(x, xs, w, b, y, N, pairs, n0, width);
}

template <int NV>
void blocks(int64_t M, const c10::BFloat16* x, int64_t xs, const c10::BFloat16* w, const c10::BFloat16* bias,
            c10::BFloat16* y, int64_t N, int64_t pairs, int64_t block_pairs, int64_t b0, int64_t b1) {
  constexpr int64_t NB = NV * 16;
  constexpr int CHUNK = chunk_rows<NV>();
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * NB, width = std::min(NB, N - n0);
    for (int64_t m0 = 0; m0 < M; m0 += CHUNK)
      chunk<CHUNK, NV>(std::min<int64_t>(CHUNK, M - m0), x + m0 * xs, xs, w + b * block_pairs * NB * 2, bias,
                       y + m0 * N, N, pairs, n0, width);
  }
}

void dispatch_bf16(int64_t M, int64_t nv, const c10::BFloat16* x, int64_t xs, const c10::BFloat16* w,
                   const c10::BFloat16* b, c10::BFloat16* y, int64_t N, int64_t pairs, int64_t block_pairs,
                   int64_t b0, int64_t b1) {
  switch (nv) {
    case 1: return blocks<1>(M, x, xs, w, b, y, N, pairs, block_pairs, b0, b1);
    case 2: return blocks<2>(M, x, xs, w, b, y, N, pairs, block_pairs, b0, b1);
    case 3: return blocks<3>(M, x, xs, w, b, y, N, pairs, block_pairs, b0, b1);
    default: return blocks<4>(M, x, xs, w, b, y, N, pairs, block_pairs, b0, b1);
  }
}
#endif

#if FOLIO_F32_FMA
#if defined(__AVX512F__)
using fvec = __m512;
constexpr int64_t LANES = 16;
inline fvec fload(const float* p) { return _mm512_loadu_ps(p); }
inline fvec fload(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline void fstore(float* p, fvec a) { _mm512_storeu_ps(p, a); }
inline fvec fbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline fvec ffma(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
#else
using fvec = __m256;
constexpr int64_t LANES = 8;
inline fvec fload(const float* p) { return _mm256_loadu_ps(p); }
inline fvec fload(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline void fstore(float* p, fvec a) { _mm256_storeu_ps(p, a); }
inline fvec fbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline fvec ffma(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
#endif

// Bytes of a block's pieces (64 K rows of a 64-column float32 block, 128 of a bf16 one): a piece stays in L1
// while the rows of x pass it, and each column span's first tile prefetches its share of the next piece. Without
// that prefetch the tiles, reading the piece's columns in 64-byte strides, waited on memory: 0.7-0.9x oneDNN's
// GEMM at 8-32 rows, where they now run 1.1-1.6x.
constexpr int64_t F32_PIECE_BYTES = 16384;
// Rows of x a tile takes at most: 6 rows times 2 vectors of columns is 12 sums in registers, 2 loads of the
// weight and 6 broadcasts of x for 12 FMAs, the shape that keeps AVX2's two FMA units busy.
constexpr int TILE_ROWS = 6;
// At most this many rows go one at a time over whole 64-column rows of the piece (8 sums, the weight loaded
// once a row): 1.1-1.2x the tiles' speed there, whose 2 or 4 sums wait on the FMAs' latency.
constexpr int64_t ONE_ROW_UP_TO = 2;
// bf16 blocks: from this many rows each piece is widened to float32 once, into L1, for the tiles to read (the
// 0.5B Qwen2's layers on a Zen 3 EPYC: widening at each tile's loads 1.06x as fast at 12 rows, 0.93x at 16,
// 0.81-0.88x at 20-62), in pieces of 64 K rows (16 KiB widened)
constexpr int64_t WIDEN_FROM = 14;
constexpr int64_t WIDE_PIECE_K = 64;

// Columns [0, V * LANES) of a block [K'][width] for R rows of x (row stride xs) over [k0, k1): their sums in
// sums[R][width] go on from the previous piece's. `ahead`, given to a column span's first tile, is where that
// span's share of the next piece lies: its bytes of each k are prefetched at that k, a line at a time (tiles of 2
// rows or more; piece_f32). Past the last piece of a thread's blocks that is the next thread's, or past the weight's end: a
// prefetch never faults.
template <int R, int V, class T>
void tile_f32(const float* x, int64_t xs, const T* w, int64_t width, int64_t k0, int64_t k1, float* sums,
              const char* ahead) {
  // Every loop over R and V unrolled outright: at -O3 GCC 12 otherwise kept the sums in memory, storing all 12
  // at each k (half the speed).
  constexpr int64_t SPAN_BYTES = V * LANES * sizeof(T);
  fvec acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) acc[r][v] = fload(sums + r * width + v * LANES);
  for (int64_t k = k0; k < k1; ++k) {
    if (R > 1 && ahead) {
      if constexpr (SPAN_BYTES >= 64) {
#pragma GCC unroll 8
        for (int l = 0; l < SPAN_BYTES / 64; ++l) _mm_prefetch(ahead + (k - k0) * SPAN_BYTES + l * 64, _MM_HINT_T0);
      } else if ((k - k0) * SPAN_BYTES % 64 == 0) {
        _mm_prefetch(ahead + (k - k0) * SPAN_BYTES, _MM_HINT_T0);
      }
    }
    const T* row = w + k * width;
    fvec b[V];
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) b[v] = fload(row + v * LANES);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const fvec a = fbroadcast(x + r * xs + k);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) acc[r][v] = ffma(a, b[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) fstore(sums + r * width + v * LANES, acc[r][v]);
}

// tile_f32 for R <= ROWS rows (R given at run time).
template <int ROWS, int V, class T>
void tile_rows(int R, const float* x, int64_t xs, const T* w, int64_t width, int64_t k0, int64_t k1, float* sums,
               const char* ahead) {
  static_assert(ROWS == 1 || ROWS == TILE_ROWS);
  if constexpr (ROWS == 1) {
    return tile_f32<1, V, T>(x, xs, w, width, k0, k1, sums, ahead);
  } else {
    switch (R) {
      case 1: return tile_f32<1, V, T>(x, xs, w, width, k0, k1, sums, ahead);
      case 2: return tile_f32<2, V, T>(x, xs, w, width, k0, k1, sums, ahead);
      case 3: return tile_f32<3, V, T>(x, xs, w, width, k0, k1, sums, ahead);
      case 4: return tile_f32<4, V, T>(x, xs, w, width, k0, k1, sums, ahead);
      case 5: return tile_f32<5, V, T>(x, xs, w, width, k0, k1, sums, ahead);
      default: return tile_f32<TILE_ROWS, V, T>(x, xs, w, width, k0, k1, sums, ahead);
    }
  }
}

// All M rows of x times a piece [k0, k1) of a block, in tiles of at most ROWS rows (as even as can be) and spans
// of V vectors of columns (single vectors past the last whole span), each span's first tile prefetching its
// share of the next piece. One row at a time (the only way a tile has one row) reads the piece's whole rows in
// order, which the hardware prefetcher follows: prefetching there too cost 10-14 % at one and two rows.
template <int ROWS, int V, class T>
void piece_f32(int64_t M, const float* x, int64_t xs, const T* w, int64_t width, int64_t k0, int64_t k1,
               float* sums, const char* next) {
  const int64_t chunks = (M + ROWS - 1) / ROWS, base = M / chunks, extra = M % chunks;
  constexpr int64_t SPAN = V * LANES;
  const int64_t whole_end = width / SPAN * SPAN, span_bytes = (k1 - k0) * SPAN * static_cast<int64_t>(sizeof(T));
  for (int64_t c = 0; c < width; c += c < whole_end ? SPAN : LANES) {
    for (int64_t i = 0, m0 = 0; i < chunks; m0 += base + (i < extra), ++i) {
      const int R = static_cast<int>(base + (i < extra));
      if (c < whole_end)
        tile_rows<ROWS, V, T>(R, x + m0 * xs, xs, w + c, width, k0, k1, sums + m0 * width + c,
                           i == 0 && next ? next + c / SPAN * span_bytes : nullptr);
      else
        tile_rows<ROWS, 1, T>(R, x + m0 * xs, xs, w + c, width, k0, k1, sums + m0 * width + c, nullptr);
    }
  }
}

// y's columns [n0, n0 + width) within N: the sums[M][width] plus the bias.
void add_bias(int64_t M, int64_t width, const float* bias, float* y, int64_t N, int64_t n0, const float* sums) {
  const int64_t columns = std::min(width, N - n0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < columns; ++j) y[m * N + n0 + j] = sums[m * width + j] + (bias ? bias[n0 + j] : 0.f);
}

// Rows [k0, k1) of a bf16 block [K'][width] widened to float32 in wide[k1 - k0][width], the next piece
// prefetched meanwhile.
void widen_piece(const c10::BFloat16* w, int64_t width, int64_t k0, int64_t k1, float* wide) {
  const c10::BFloat16* from = w + k0 * width;
  const char* next = reinterpret_cast<const char*>(w + k1 * width);
  for (int64_t i = 0, n = (k1 - k0) * width; i < n; i += LANES) {
    if (i % 32 == 0) _mm_prefetch(next + i * 2, _MM_HINT_T0);
    fstore(wide + i, fload(from + i));
  }
}

// One block of `width` output columns for M rows: y's columns [n0, n0 + width) within N get the sums (scratch
// sums[M][width]) plus the bias.
template <class T>
void block_f32(int64_t M, const float* x, int64_t xs, const T* w, int64_t width, int64_t K, const float* bias,
               float* y, int64_t N, int64_t n0, float* sums, float* wide) {
  std::fill(sums, sums + M * width, 0.f);
  if constexpr (!std::is_same_v<T, float>) {
    if (M >= WIDEN_FROM) {
      for (int64_t k0 = 0; k0 < K; k0 += WIDE_PIECE_K) {
        const int64_t k1 = std::min(K, k0 + WIDE_PIECE_K);
        widen_piece(w, width, k0, k1, wide);
        piece_f32<TILE_ROWS, 2, float>(M, x + k0, xs, wide, width, 0, k1 - k0, sums, nullptr);
      }
      return add_bias(M, width, bias, y, N, n0, sums);
    }
  }
  constexpr int64_t PIECE_K = F32_PIECE_BYTES / (64 * sizeof(T));
  for (int64_t k0 = 0; k0 < K; k0 += PIECE_K) {
    const int64_t k1 = std::min(K, k0 + PIECE_K);
    const char* next = reinterpret_cast<const char*>(w + k1 * width);
    if (M <= ONE_ROW_UP_TO)
      piece_f32<1, 64 / LANES, T>(M, x, xs, w, width, k0, k1, sums, next);
    else
      piece_f32<TILE_ROWS, 2, T>(M, x, xs, w, width, k0, k1, sums, next);
  }
  add_bias(M, width, bias, y, N, n0, sums);
}
#endif

bool has_kernel() { return FOLIO_DPBF16; }
bool has_f32_kernel() { return FOLIO_F32_FMA; }

// The checks both bf16 paths make: the blocks' shape, x's and N's agreement with it, the bias.
const c10::BFloat16* check_bf16(const at::Tensor& x, const at::Tensor& w, int64_t N,
                                const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x must be bf16 [M, K], unit stride");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.size(3) == 2 &&
                  w.size(2) % 16 == 0 && w.size(2) <= 64,
              "w must be contiguous bf16 blocks [N / NB, K / 2, NB, 2] with NB in 16, 32, 48, 64");
  const int64_t K = x.size(1), NB = w.size(2);
  TORCH_CHECK(x.size(0) >= 1, "x must have rows");
  TORCH_CHECK(K % 2 == 0 && K <= 2 * w.size(1) && N >= 1 && N <= w.size(0) * NB && N > (w.size(0) - 1) * NB,
              "shapes: x [M, K], K even, within the blocks' K; N within the last block");
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N, "bias must be bf16 [N]");
  return bias->data_ptr<c10::BFloat16>();
}

at::Tensor linear_bf16(at::Tensor x, at::Tensor w, int64_t N, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(FOLIO_DPBF16, "built without AVX512-BF16");
  const c10::BFloat16* bp = check_bf16(x, w, N, bias);
  const int64_t M = x.size(0), K = x.size(1), NB = w.size(2), block_pairs = w.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
#if FOLIO_DPBF16
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = w.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  const int64_t xs = x.stride(0);
  const folio::BlockStream streams[] = {{wp, w.stride(0) * 2}};
  folio::parallel_blocks(wp, w.size(0), streams, [&](int64_t b0, int64_t b1) {
    dispatch_bf16(M, NB / 16, xp, xs, wp, bp, yp, N, K / 2, block_pairs, b0, b1);
  });
#endif
  return y;
}

bool has_amx_kernel() {
#if FOLIO_AMX
  return folio::amx::permitted();
#else
  return false;
#endif
}

#if FOLIO_AMX
// Runs the tile loop over x's rows and every block of w: each thread's share [b0, b1) (whole runs of `unit`
// blocks) calls `share(b0, b1, run)`, and `run(epilogue)` multiplies the share with that epilogue (amx_tiles.h:
// multiply).
template <class Share>
void amx_shares(const at::Tensor& x, const at::Tensor& w, const Share& share, int64_t unit = 1) {
  const int64_t M = x.size(0), K = x.size(1), NB = w.size(2);
  folio::amx::Rows rows;
  std::vector<uint8_t> padded;
  folio::amx::add_groups(rows, reinterpret_cast<const uint8_t*>(x.data_ptr<c10::BFloat16>()), M, x.stride(0) * 2,
                         K * 2, padded);
  const auto* wp = w.data_ptr<c10::BFloat16>();
  const folio::amx::Weight weight{reinterpret_cast<const uint8_t*>(wp), w.stride(0) * 2, K / 32};
  const folio::BlockStream streams[] = {{wp, unit * w.stride(0) * 2}};
  folio::parallel_blocks(wp, w.size(0) / unit, streams, [&](int64_t u0, int64_t u1) {
    const int64_t b0 = u0 * unit, b1 = u1 * unit;
    share(b0, b1, [&](const auto& epilogue) {
      using folio::amx::Bf16;
      switch (NB / 16) {
        case 1: return folio::amx::multiply<Bf16, 1>(rows, weight, b0, b1, epilogue);
        case 2: return folio::amx::multiply<Bf16, 2>(rows, weight, b0, b1, epilogue);
        case 3: return folio::amx::multiply<Bf16, 3>(rows, weight, b0, b1, epilogue);
        default: return folio::amx::multiply<Bf16, 4>(rows, weight, b0, b1, epilogue);
      }
    });
  });
}

// Each row's largest value so far and its column, lane by lane (lane l sees columns l mod 16 in ascending
// order): a later column takes a lane only if strictly larger, or NaN over a number, so each lane keeps its
// first maximum (first NaN), as torch.argmax ranks them.
struct RowArgmax {
  std::vector<float> value;
  std::vector<int32_t> index;
  explicit RowArgmax(int64_t M)
      : value(M * 16, -std::numeric_limits<float>::infinity()), index(M * 16, std::numeric_limits<int32_t>::max()) {}
  void update(int64_t m, __m512 v, int64_t n0, __mmask16 mask) {
    static const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 best = _mm512_loadu_ps(&value[m * 16]);
    const __mmask16 take = _mm512_mask_cmp_ps_mask(mask, v, best, _CMP_GT_OQ) |
                           (_mm512_mask_cmp_ps_mask(mask, v, v, _CMP_UNORD_Q) & _mm512_cmp_ps_mask(best, best, _CMP_ORD_Q));
    if (!take) return;
    _mm512_storeu_ps(&value[m * 16], _mm512_mask_blend_ps(take, best, v));
    const __m512i at = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(n0)));
    _mm512_mask_storeu_epi32(&index[m * 16], take, at);
  }
};

// Whether (a, ia) ranks before (b, ib) in torch.argmax's order: NaN first, then larger, then lower index.
inline bool ranks_before(float a, int32_t ia, float b, int32_t ib) {
  const bool an = std::isnan(a), bn = std::isnan(b);
  if (an || bn) return an && (!bn || ia < ib);
  return a > b || (a == b && ia < ib);
}
#endif

// The checks both AMX paths make (check_bf16's, and the tiles' own), and the bias.
const c10::BFloat16* check_amx(const at::Tensor& x, const at::Tensor& w, int64_t N,
                               const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_amx_kernel(), "built without AMX-BF16, or the OS refused the tile registers");
  const c10::BFloat16* bp = check_bf16(x, w, N, bias);
  TORCH_CHECK(x.size(1) % 32 == 0, "the AMX path takes K a multiple of 32 (a tile's depth)");
  return bp;
}

// A gated weight's product as SiLU-and-mul's: blocks of 32 columns in pairs, 32 gates then the same outputs' ups
// (folio.models.gated_layout), so each thread takes whole pairs; the gate block's rounded values wait in the
// thread's buffer for the up block, which the tile loop finishes next for the same rows, and y [M, N / 2] gets
// rnd(table[gate] * up) from the values linear_bf16_amx would write, as bf16 silu_and_mul computes it.
at::Tensor linear_bf16_amx_silu(const at::Tensor& x, const at::Tensor& w, int64_t N, const at::Tensor& table) {
  const int64_t M = x.size(0), NB = w.size(2);
  TORCH_CHECK(NB == 32 && N % 64 == 0 && N == w.size(0) * NB, "a gated weight is whole pairs of 32-column blocks");
  TORCH_CHECK(table.scalar_type() == at::kInt && table.is_contiguous() && table.numel() == folio::SILU_TABLE_INTS,
              "the silu table must be the int32 [32776] of fused_ops.bf16_silu_table");
  at::Tensor y = at::empty({M, N / 2}, x.options());
#if FOLIO_AMX
  auto* yp = y.data_ptr<c10::BFloat16>();
  const int* silu = table.data_ptr<int>();
  amx_shares(x, w, [&](int64_t, int64_t, const auto& run) {
    std::vector<float> gates(M * 32);  // the last gate block's sums (plus the zero bias, as stored), rows of 32
    run([&](int64_t b, int64_t m0, int64_t m1, const auto& sums) {
      for (int v = 0; v < 2; ++v) {
        const Lanes lanes(nullptr, b * NB, NB, v);
        for (int64_t m = m0; m < std::min(m1, M); ++m) {
          const __m512 sum = _mm512_add_ps(_mm512_loadu_ps(static_cast<const float*>(sums(0, m, v))), lanes.bias);
          float* gate = &gates[m * 32 + v * 16];
          if (b % 2 == 0)
            _mm512_storeu_ps(gate, sum);
          else
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(yp + m * (N / 2) + (b / 2) * 32 + v * 16),
                                folio::silu_times_up_of_sums(silu, _mm512_loadu_ps(gate), sum));
        }
      }
    });
  }, 2);
#endif
  return y;
}

at::Tensor linear_bf16_amx(at::Tensor x, at::Tensor w, int64_t N, c10::optional<at::Tensor> bias,
                           c10::optional<at::Tensor> silu_table) {
  const c10::BFloat16* bp = check_amx(x, w, N, bias);
  if (silu_table.has_value()) {
    TORCH_CHECK(bp == nullptr, "a gated product takes no bias");
    return linear_bf16_amx_silu(x, w, N, *silu_table);
  }
  const int64_t M = x.size(0), NB = w.size(2);
  at::Tensor y = at::empty({M, N}, x.options());
#if FOLIO_AMX
  auto* yp = y.data_ptr<c10::BFloat16>();
  const auto epilogue = [&](int64_t b, int64_t m0, int64_t m1, const auto& sums) {
    const int64_t n0 = b * NB, cols = std::min(NB, N - n0);
    for (int v = 0; v * 16 < cols; ++v) {
      const Lanes lanes(bp, n0, cols, v);
      for (int64_t m = m0; m < std::min(m1, M); ++m)
        lanes.store(yp + m * N + n0 + v * 16, _mm512_loadu_ps(static_cast<const float*>(sums(0, m, v))));
    }
  };
  amx_shares(x, w, [&](int64_t, int64_t, const auto& run) { run(epilogue); });
#endif
  return y;
}

// argmax(x W^T (+ b), dim=-1) of the bf16 product linear_bf16_amx writes, without writing it: a greedy step's
// lm_head (62 rows of Qwen2's 151936 columns: 18.8 MB of logits stored and read again by the argmax).
at::Tensor linear_bf16_amx_argmax(at::Tensor x, at::Tensor w, int64_t N, c10::optional<at::Tensor> bias) {
  const c10::BFloat16* bp = check_amx(x, w, N, bias);
  const int64_t M = x.size(0), NB = w.size(2);
  TORCH_CHECK(N <= std::numeric_limits<int32_t>::max(), "N must fit in int32");
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
#if FOLIO_AMX
  std::vector<float> value(M, -std::numeric_limits<float>::infinity());
  std::vector<int32_t> index(M, std::numeric_limits<int32_t>::max());
  std::mutex merging;
  amx_shares(x, w, [&](int64_t, int64_t, const auto& run) {
    RowArgmax share(M);
    run([&](int64_t b, int64_t m0, int64_t m1, const auto& sums) {
      const int64_t n0 = b * NB, cols = std::min(NB, N - n0);
      for (int v = 0; v * 16 < cols; ++v) {
        const Lanes lanes(bp, n0, cols, v);
        for (int64_t m = m0; m < std::min(m1, M); ++m)
          share.update(m, lanes.rounded(_mm512_loadu_ps(static_cast<const float*>(sums(0, m, v)))), n0 + v * 16,
                       lanes.mask);
      }
    });
    const std::lock_guard<std::mutex> lock(merging);
    for (int64_t m = 0; m < M; ++m)
      for (int l = 0; l < 16; ++l)
        if (ranks_before(share.value[m * 16 + l], share.index[m * 16 + l], value[m], index[m])) {
          value[m] = share.value[m * 16 + l];
          index[m] = share.index[m * 16 + l];
        }
  });
  // a lane no column took holds -inf at int32 max: a row of -inf alone keeps that, and its argmax is column 0
  auto* op = out.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) op[m] = index[m] == std::numeric_limits<int32_t>::max() ? 0 : index[m];
#endif
  return out;
}

#if FOLIO_F32_FMA
// The float32 kernel over blocks of float32 or bf16 (a float32 weight whose every value is a bf16 one, kept in
// half the bytes: each vector of the block widened to float32 as it is loaded, the same FMAs on the same values).
template <class T>
void run_f32(const at::Tensor& x, const at::Tensor& w, int64_t N, const float* bp, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), width = w.size(2), K_blocks = w.size(1), xs = x.stride(0);
  const float* xp = x.data_ptr<float>();
  const T* wp = reinterpret_cast<const T*>(w.data_ptr());
  float* yp = y.data_ptr<float>();
  const folio::BlockStream streams[] = {{wp, w.stride(0) * static_cast<int64_t>(sizeof(T))}};
  folio::parallel_blocks(wp, w.size(0), streams, [&](int64_t b0, int64_t b1) {
    alignas(64) float sums[MAX_M_F32 * 64];  // on the heap at 16-byte alignment it cost 12 % at 16 rows
    alignas(64) float wide[std::is_same_v<T, float> ? 1 : WIDE_PIECE_K * 64];
    for (int64_t b = b0; b < b1; ++b)
      block_f32<T>(M, xp, xs, wp + b * K_blocks * width, width, K, bp, yp, N, b * width, sums, wide);
  });
}
#endif

at::Tensor linear_f32(at::Tensor x, at::Tensor w, int64_t N, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(FOLIO_F32_FMA, "built without AVX2+FMA or AVX-512F");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x must be float32 [M, K], unit stride");
  TORCH_CHECK(w.dim() == 4 && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16) &&
                  w.is_contiguous() && w.size(3) == 1 && w.size(2) % LANES == 0 && w.size(2) <= 64,
              "w must be contiguous float32 or bf16 blocks [N / NB, K', NB, 1] with NB a multiple of ", LANES,
              " up to 64");
  const int64_t M = x.size(0), K = x.size(1), width = w.size(2);
  TORCH_CHECK(M >= 1 && M <= MAX_M_F32 && K <= w.size(1) && N >= 1 && N <= w.size(0) * width &&
                  N > (w.size(0) - 1) * width,
              "shapes: x [M <= MAX_M_F32, K], K within the blocks' K; N within the last block");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "bias must be float32 [N]");
    bp = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
#if FOLIO_F32_FMA
  if (w.scalar_type() == at::kFloat)
    run_f32<float>(x, w, N, bp, y);
  else
    run_f32<c10::BFloat16>(x, w, N, bp, y);
#endif
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  folio::bind_decode_threads(m);
  m.def("linear_bf16", &linear_bf16, "x W^T (+ b) for bf16 x, W in oneDNN's packed blocks [N / NB, K / 2, NB, 2]",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("linear_bf16_amx", &linear_bf16_amx,
        "x W^T (+ b) for bf16 x, the same blocks, on AMX tiles (K a multiple of 32); with silu_table, a gated "
        "weight's SiLU-and-mul, [M, N / 2]",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("N"), pybind11::arg("bias"),
        pybind11::arg("silu_table") = pybind11::none(), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("linear_bf16_amx_argmax", &linear_bf16_amx_argmax,
        "argmax over columns of the product linear_bf16_amx writes (int64 [M]: first maximum, first NaN), unwritten",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("linear_f32", &linear_f32, "x W^T (+ b) for float32 x of at most MAX_M_F32 rows, W float32 or bf16 blocks [N / NB, K', NB, 1]",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("has_kernel", &has_kernel, "whether the AVX512-BF16 kernel was compiled in");
  m.def("has_amx_kernel", &has_amx_kernel, "whether the AMX-BF16 path was compiled in and may use the tiles");
  m.def("has_f32_kernel", &has_f32_kernel, "whether the float32 FMA kernel was compiled in");
  m.attr("MAX_M_F32") = MAX_M_F32;
}
