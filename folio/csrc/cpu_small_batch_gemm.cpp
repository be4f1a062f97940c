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
// weights of 16-64 rows at 14-22 GB/s on 2 cores of an Emerald Rapids Xeon that read 30; PyTorch's brgemm
// called per block and 16 rows read each block from L2 (or L3) once per 16 rows and stalled on memory. Here
// the same packed blocks, read in place, are taken in chunks of CHUNK_BYTES along K; each chunk is multiplied by
// all of x, 32 rows at a time (2 x 2 tiles of sums where the block is 32 columns wide), while software
// prefetches spread over the chunk's tile work pull the thread's next chunk (blocks follow each other in
// memory) into L2; from 33 rows on, x's rows stay in L1 instead and the blocks stream past them in panels
// (`amx_panels`). A tile product multiplies 16 rows of x by 16 pairs of K of 16 columns (exact products,
// float32 sums); partial sums stay in the tile registers along a chunk and go to a float buffer between
// chunks; the epilogue is the vector kernel's (bias in float32, one rounding to bf16).
//
// float32 (AVX2+FMA or AVX-512F, any K, M <= MAX_M_F32): MKL's sgemm packs the whole weight matrix on every
// call with M >= 2 rows, so a 2-row product cost 2.3x a 1-row one and a 7-row one 2.9x (the 49152 x 576
// lm_head of SmolLM2 on an AVX2 EPYC: 14 ms, 33 ms, 41 ms); here plain row-major W is read once, with FMAs in
// float32 (sums in another order than MKL's: results differ in the last bits).
#include "parallel.h"
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
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
#include <sys/syscall.h>
#include <unistd.h>
#else
#define FOLIO_AMX 0
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define FOLIO_F32_FMA 1
#else
#define FOLIO_F32_FMA 0
#endif

namespace {

constexpr int MAX_M_F32 = 8;
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

#if FOLIO_AMX
// Bytes of a block per chunk on AMX (256 pairs of K of the 32-column blocks oneDNN packs for AMX): the chunk
// stays in L1/L2 while every 32 rows of x take it. On the Emerald Rapids Xeon 16 KiB and 64 KiB ran the same
// within noise; without the prefetches 64 rows took 1.19x longer, 32 rows 1.19x, 16 rows 1.11x.
constexpr int64_t CHUNK_BYTES = 32768;

// Linux hands a process AMX's tile registers only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); oneDNN asks too, but this kernel may run before any oneDNN AMX code has.
bool amx_permitted() {
  static const bool ok = [] {
    constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// Palette 1 with all eight tiles 16 rows x 64 bytes: R x NV sums (16 rows x 16 columns of float32 each) in
// tmm0-3, R tiles of 16 rows of x x 32 values of K from tmm4, and the block's 16 pairs of K x 16 columns in the
// tiles left (loaded in turn, so that a load overlaps the product before it).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// Software prefetches of the thread's next chunk, spread evenly over the current chunk's tile steps.
struct ChunkPrefetch {
  const char* next = nullptr;
  const char* end = nullptr;
  int64_t per_step = 0;
  void start(const char* from, const char* to, int64_t steps) {
    next = from;
    end = to;
    per_step = to > from ? (to - from + steps * 64 - 1) / (steps * 64) * 64 : 0;
  }
  void step() {
    const char* stop = std::min(end, next + per_step);
    for (; next < stop; next += 64) _mm_prefetch(next, _MM_HINT_T1);
  }
};

// The tile instructions with the tile's number a template argument: GCC's intrinsics paste it into their
// assembly as a literal token ("%tmm" #T), so they take no constant expression; "%c" prints the constant.
template <int T>
inline void tile_load(const void* base, int64_t stride) {
  asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"(stride), "i"(T) : "memory");
}
template <int T>
inline void tile_store(void* base, int64_t stride) {
  asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(base), "r"(stride), "i"(T) : "memory");
}
template <int T>
inline void tile_zero() {
  asm volatile("tilezero %%tmm%c0" ::"i"(T));
}
// tmm C += tmm A (16 rows x 32 bf16) x tmm B (16 pairs x 16 columns x 2 bf16), in float32
template <int C, int A, int B>
inline void tile_dot() {
  asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
}

// The sums' tiles: (row group r, column tile v) is tmm r * NV + v; C's rows are NB float32 apart.
template <int R, int NV, int T = 0>
inline void sums_tiles(float* c, int64_t nb, bool load) {
  if constexpr (T < R * NV) {
    if (load)
      tile_load<T>(c + (T / NV) * 16 * nb + (T % NV) * 16, nb * 4);
    else
      tile_zero<T>();
    sums_tiles<R, NV, T + 1>(c, nb, load);
  }
}

template <int R, int NV, int T = 0>
inline void store_sums(float* c, int64_t nb) {
  if constexpr (T < R * NV) {
    tile_store<T>(c + (T / NV) * 16 * nb + (T % NV) * 16, nb * 4);
    store_sums<R, NV, T + 1>(c, nb);
  }
}

// One step of 16 pairs of K: column tile V of the block (in the B tiles in turn) times the R tiles of x.
template <int R, int NV, int V = 0>
inline void step_columns(const c10::BFloat16* wp, int64_t row_bytes) {
  if constexpr (V < NV) {
    constexpr int B = 4 + R + V % (4 - R);
    tile_load<B>(wp + V * 32, row_bytes);
    tile_dot<V, 4, B>();
    if constexpr (R == 2) tile_dot<NV + V, 5, B>();
    step_columns<R, NV, V + 1>(wp, row_bytes);
  }
}

// Pairs [p0, p0 + steps * 16) of a block (NV * 16 columns) times R groups of 16 rows of x (`a`, rows xs elements
// apart), the sums in `c` (16 R rows x NV * 16 float32): loaded first unless `first`, stored after.
template <int R, int NV>
void chunk_tiles(const c10::BFloat16* const* a, const int64_t* xs, const c10::BFloat16* w, int64_t p0,
                 int64_t steps, float* c, bool first, ChunkPrefetch& prefetch) {
  constexpr int64_t NB = NV * 16, ROW_BYTES = NB * 4;
  sums_tiles<R, NV>(c, NB, !first);
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t p = p0 + s * 16;
    tile_load<4>(a[0] + 2 * p, xs[0] * 2);
    if constexpr (R == 2) tile_load<5>(a[1] + 2 * p, xs[1] * 2);
    step_columns<R, NV>(w + p * NB * 2, ROW_BYTES);
    prefetch.step();
  }
  store_sums<R, NV>(c, NB);
}

// Blocks [b0, b1) for all M rows of x (`groups`: 16 rows each, the last maybe a zero-padded copy), two groups
// at a time where the sums' tiles allow it.
template <int NV>
void amx_blocks(int64_t M, const std::vector<const c10::BFloat16*>& groups, const std::vector<int64_t>& strides,
                const c10::BFloat16* w, int64_t block_elems, const c10::BFloat16* bias, c10::BFloat16* y,
                int64_t N, int64_t pairs, int64_t b0, int64_t b1) {
  constexpr int64_t NB = NV * 16, ROW_BYTES = NB * 4, CHUNK_PAIRS = CHUNK_BYTES / ROW_BYTES;
  constexpr int R = NV <= 2 ? 2 : 1;
  // PyTorch's brgemm skips loading its tile configuration while the kernel it ran last on this thread is
  // unreleased: release it, so that its next call reloads over the configuration loaded here
  at::native::cpublas::brgemm_release();
  const TileConfig config;
  _tile_loadconfig(&config);
  const int64_t G = static_cast<int64_t>(groups.size());
  std::vector<float> sums(G * 16 * NB);
  const char* range_end = reinterpret_cast<const char*>(w + b1 * block_elems);
  ChunkPrefetch prefetch;
  for (int64_t b = b0; b < b1; ++b) {
    const c10::BFloat16* wb = w + b * block_elems;
    for (int64_t p0 = 0; p0 < pairs; p0 += CHUNK_PAIRS) {
      const int64_t steps = std::min(CHUNK_PAIRS, pairs - p0) / 16;
      // the next chunk in memory: the rest of this block, else the next block's start (blocks are contiguous)
      const char* next = reinterpret_cast<const char*>(p0 + CHUNK_PAIRS < pairs ? wb + (p0 + CHUNK_PAIRS) * NB * 2
                                                                                : wb + block_elems);
      prefetch.start(next, std::min(range_end, next + CHUNK_BYTES), (G + R - 1) / R * steps);
      int64_t g = 0;
      for (; g + R <= G; g += R)
        chunk_tiles<R, NV>(&groups[g], &strides[g], wb, p0, steps, sums.data() + g * 16 * NB, p0 == 0, prefetch);
      if (g < G)
        chunk_tiles<1, NV>(&groups[g], &strides[g], wb, p0, steps, sums.data() + g * 16 * NB, p0 == 0, prefetch);
    }
    const int64_t n0 = b * NB, cols = std::min(NB, N - n0);
    for (int v = 0; v * 16 < cols; ++v) {
      const Lanes lanes(bias, n0, cols, v);
      for (int64_t m = 0; m < M; ++m) lanes.store(y + m * N + n0 + v * 16, _mm512_loadu_ps(&sums[m * NB + v * 16]));
    }
  }
  _tile_release();
}
#endif

#if FOLIO_AMX
// The x-stationary loop for 33-64 rows (three or four tiles of rows). There amx_blocks' 2 x 2 tiles read x's
// rows from L2 for every block (they do not fit L1 along the whole of K). Here the thread's blocks go in panels
// of PANEL_BLOCKS, each panel along K in pieces of PANEL_PAIRS pairs: x's rows for a piece (64 x 256 values,
// 32 KiB) stay in L1 while every 16-column slice of the panel's blocks passes, one tile of the slice (from
// memory, prefetched a piece ahead) times each tile of x's rows; each slice's sums wait in a float buffer (the
// panel's, in L2) between pieces. On the Emerald Rapids Xeon, against amx_blocks in one process: the 0.5B
// Qwen2's layers 1.08-1.10x faster at 40, 48 and 64 rows, its 151936-row lm_head 1.0-1.5x; 64 and 128 pairs a
// piece ran alike, 256 slower (1.14x the time).
constexpr int64_t PANEL_PAIRS = 128;
constexpr int64_t PANEL_BLOCKS = 16;

// x's G tiles of rows (in tmm5-7 in turn) times the slice's tile in tmm4, into sums tmm0..G-1.
template <int G, int T = 0>
inline void rows_times_slice(const c10::BFloat16* const* a, const int64_t* xs, int64_t p) {
  if constexpr (T < G) {
    constexpr int A = 5 + T % 3;
    tile_load<A>(a[T] + 2 * p, xs[T] * 2);
    tile_dot<T, A, 4>();
    rows_times_slice<G, T + 1>(a, xs, p);
  }
}

// A slice's G tiles of sums, 1 KiB each and contiguous in `c`: loaded (or zeroed), stored.
template <int G, int T = 0>
inline void slice_sums(float* c, bool load) {
  if constexpr (T < G) {
    if (load)
      tile_load<T>(c + T * 256, 64);
    else
      tile_zero<T>();
    slice_sums<G, T + 1>(c, load);
  }
}

template <int G, int T = 0>
inline void store_slice_sums(float* c) {
  if constexpr (T < G) {
    tile_store<T>(c + T * 256, 64);
    store_slice_sums<G, T + 1>(c);
  }
}

template <int NV, int G>
void amx_panels(int64_t M, const std::vector<const c10::BFloat16*>& groups, const std::vector<int64_t>& strides,
                const c10::BFloat16* w, int64_t block_elems, const c10::BFloat16* bias, c10::BFloat16* y,
                int64_t N, int64_t pairs, int64_t b0, int64_t b1) {
  constexpr int64_t NB = NV * 16, ROW_BYTES = NB * 4;
  at::native::cpublas::brgemm_release();  // as in amx_blocks
  const TileConfig config;
  _tile_loadconfig(&config);
  std::vector<float> sums(PANEL_BLOCKS * NV * G * 256);
  ChunkPrefetch prefetch;
  for (int64_t pb = b0; pb < b1; pb += PANEL_BLOCKS) {
    const int64_t pe = std::min(b1, pb + PANEL_BLOCKS);
    for (int64_t p0 = 0; p0 < pairs; p0 += PANEL_PAIRS) {
      const int64_t steps = std::min(PANEL_PAIRS, pairs - p0) / 16;
      for (int64_t b = pb; b < pe; ++b) {
        // the piece after this one: the next block's, else the panel's first block's next pairs, else the next
        // panel's first piece
        int64_t nb = b + 1, np = p0;
        if (nb == pe) {
          nb = p0 + PANEL_PAIRS < pairs ? pb : pe;
          np = p0 + PANEL_PAIRS < pairs ? p0 + PANEL_PAIRS : 0;
        }
        const char* next = reinterpret_cast<const char*>(w + nb * block_elems + np * NB * 2);
        prefetch.start(next, nb < b1 ? next + std::min(PANEL_PAIRS, pairs - np) * ROW_BYTES : next, NV * steps);
        const c10::BFloat16* wb = w + b * block_elems;
        for (int v = 0; v < NV; ++v) {
          float* c = sums.data() + ((b - pb) * NV + v) * G * 256;
          slice_sums<G>(c, p0 > 0);
          for (int64_t s = 0; s < steps; ++s) {
            const int64_t p = p0 + s * 16;
            tile_load<4>(wb + p * NB * 2 + v * 32, ROW_BYTES);
            rows_times_slice<G>(groups.data(), strides.data(), p);
            prefetch.step();
          }
          store_slice_sums<G>(c);
        }
      }
    }
    for (int64_t b = pb; b < pe; ++b) {
      const int64_t n0 = b * NB, cols = std::min(NB, N - n0);
      for (int v = 0; v * 16 < cols; ++v) {
        const Lanes lanes(bias, n0, cols, v);
        const float* c = sums.data() + ((b - pb) * NV + v) * G * 256;
        for (int64_t m = 0; m < M; ++m)
          lanes.store(y + m * N + n0 + v * 16, _mm512_loadu_ps(c + (m / 16) * 256 + (m % 16) * 16));
      }
    }
  }
  _tile_release();
}

// The thread's blocks for all of x: the x-stationary loop for three or four tiles of rows, else amx_blocks.
template <int NV>
void amx_range(int64_t M, const std::vector<const c10::BFloat16*>& groups, const std::vector<int64_t>& strides,
               const c10::BFloat16* w, int64_t block_elems, const c10::BFloat16* bias, c10::BFloat16* y, int64_t N,
               int64_t pairs, int64_t b0, int64_t b1) {
  switch (groups.size()) {
    case 3: return amx_panels<NV, 3>(M, groups, strides, w, block_elems, bias, y, N, pairs, b0, b1);
    case 4: return amx_panels<NV, 4>(M, groups, strides, w, block_elems, bias, y, N, pairs, b0, b1);
    default: return amx_blocks<NV>(M, groups, strides, w, block_elems, bias, y, N, pairs, b0, b1);
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
  return amx_permitted();
#else
  return false;
#endif
}

at::Tensor linear_bf16_amx(at::Tensor x, at::Tensor w, int64_t N, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(has_amx_kernel(), "built without AMX-BF16, or the OS refused the tile registers");
  const c10::BFloat16* bp = check_bf16(x, w, N, bias);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 32 == 0, "the AMX path takes K a multiple of 32 (a tile's depth)");
  at::Tensor y = at::empty({M, N}, x.options());
#if FOLIO_AMX
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const int64_t xs = x.stride(0), full = M / 16, rest = M % 16;
  std::vector<const c10::BFloat16*> groups;
  std::vector<int64_t> strides;
  for (int64_t g = 0; g < full; ++g) {
    groups.push_back(xp + g * 16 * xs);
    strides.push_back(xs);
  }
  at::Tensor padded;  // the last rows, zero-padded to a tile's 16: a tile load reads 16 rows
  if (rest) {
    padded = at::zeros({16, K}, x.options());
    padded.narrow(0, 0, rest).copy_(x.narrow(0, full * 16, rest));
    groups.push_back(padded.data_ptr<c10::BFloat16>());
    strides.push_back(K);
  }
  const auto* wp = w.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  const folio::BlockStream streams[] = {{wp, w.stride(0) * 2}};
  folio::parallel_blocks(wp, w.size(0), streams, [&](int64_t b0, int64_t b1) {
    const int64_t be = w.stride(0), pairs = K / 2;
    switch (w.size(2) / 16) {
      case 1: return amx_range<1>(M, groups, strides, wp, be, bp, yp, N, pairs, b0, b1);
      case 2: return amx_range<2>(M, groups, strides, wp, be, bp, yp, N, pairs, b0, b1);
      case 3: return amx_range<3>(M, groups, strides, wp, be, bp, yp, N, pairs, b0, b1);
      default: return amx_range<4>(M, groups, strides, wp, be, bp, yp, N, pairs, b0, b1);
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
  folio::parallel_for(0, N, row_grain(4 * K), [&](int64_t n0, int64_t n1) {
    dispatch_f32<MAX_M_F32>(M, xp, xs, wp, bp, yp, N, K, n0, n1);
  });
#endif
  return y;
}



}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  folio::bind_decode_threads(m);
  m.def("linear_bf16", &linear_bf16, "x W^T (+ b) for bf16 x, W in oneDNN's packed blocks [N / NB, K / 2, NB, 2]",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("linear_bf16_amx", &linear_bf16_amx, "x W^T (+ b) for bf16 x, the same blocks, on AMX tiles (K a multiple of 32)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("linear_f32", &linear_f32, "x W^T (+ b) for float32 x of at most MAX_M_F32 rows, W row-major",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("has_kernel", &has_kernel, "whether the AVX512-BF16 kernel was compiled in");
  m.def("has_amx_kernel", &has_amx_kernel, "whether the AMX-BF16 path was compiled in and may use the tiles");
  m.def("has_f32_kernel", &has_f32_kernel, "whether the float32 FMA kernel was compiled in");
  m.attr("MAX_M_F32") = MAX_M_F32;
}
