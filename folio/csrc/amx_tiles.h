// folio's own AMX tile loop for matmuls of a few rows of x to a prefill chunk's by a packed weight read in place:
// bf16 (cpu_small_batch_gemm.cpp) and int8 (cpu_quant_linear.cpp) run the same loop, with their own tile product
// and epilogue.
//
// The weight is oneDNN's packed layout: column blocks of NV * 16 output columns, one after the other in memory,
// each a run of rows of NV * 64 bytes (a pair of bf16 along K, or four int8, for each column): one "tile step"
// multiplies 16 such rows (a B tile per 16 columns, the VNNI layout AMX reads) by 64 bytes of each row of x (an
// A tile of 16 rows). x comes as groups of 16 rows (the last may be a zero-padded copy: a tile load reads 16).
//
// Why not oneDNN or PyTorch's brgemm: on 2 cores of an Emerald Rapids Xeon oneDNN's GEMM streamed 16-64 rows'
// bf16 weights at 14-22 GB/s where the machine reads 30, and brgemm called per block and 16 rows reread each
// block from L2 or L3 once per 16 rows. Here each thread takes its blocks in chunks along K and prefetches its
// next chunk into L2 while the tiles work on the current one:
// - up to two groups of rows (`blocks`; int8 codes up to four, see multiply): each chunk (CHUNK_BYTES) times 32
//   rows at a time in 2 x 2 tiles of sums (one group at a time with four column tiles where the block has three
//   or four);
// - three or four groups (`panels`): x's rows stay in L1 for PANEL_STEPS tile steps while the 16-column slices
//   of PANEL_BLOCKS blocks stream past, each slice's G tiles of sums waiting in the panel's buffer (L2) between
//   pieces (with 2 x 2 tiles x's rows came from L2 for every block);
// - more (`gemm`, prefill chunks and large batches): the weight read once from memory in panels that stay in L2
//   while every pair of groups passes them in 2 x 2 tiles over each block's whole K (below).
// Sums stay in tile registers along a chunk, piece or block (float32 or int32, 16 x 16 a tile); a thread's
// finished rows of a block go to the caller's epilogue (`multiply`, at the end).
//
// Measured on the Emerald Rapids Xeon (bf16, against oneDNN's GEMM, all the 0.5B Qwen2's layers from memory):
// 1.2x at 16 rows, 1.3-1.7x at 32, 1.1x at 64; without the prefetches 64 rows took 1.19x longer; the panels
// 1.08-1.10x faster than 2 x 2 tiles in 32 KiB chunks at 40-64 rows; 16 and 64 KiB chunks ran as 32, panel pieces
// of 4 and 8 steps alike, 16 steps 1.14x slower. The AMX unit itself multiplies at its nominal rate there (16
// cycles a product: 3.2 TFLOP/s bf16, 6.5 TOPS int8 a core, from tiles in registers); what the loop loses is in its
// tile loads and the sums' round trips between pieces (a C++ copy of the panels took 12.2 ns a product with them,
// 7.6 without). 2 x 2 tiles over each block's whole K for four groups (sums stored once a block, the block read
// twice) measured 0.94-1.20x the panels from memory at 62-64 rows, run to run, and was not kept.
#pragma once

#if defined(__AMX_TILE__) && defined(__AVX512F__)
#include <c10/macros/Export.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <vector>

// PyTorch's brgemm state (ATen/native/CPUBlas.h, declared here alone: that header more than doubles the build of
// the attention kernel, which includes this one).
namespace at::native::cpublas {
TORCH_API void brgemm_release(bool is_vnni);
}

namespace folio::amx {

constexpr int64_t CHUNK_BYTES = 32768;
constexpr int64_t PANEL_STEPS = 8;  // 256 bf16 or 512 int8 values of K: 64 rows of x in 32 KiB
constexpr int64_t PANEL_BLOCKS = 16;

// Linux hands a process AMX's tile registers only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); oneDNN asks too, but this loop may run before any oneDNN AMX code has.
inline bool permitted() {
  static const bool ok = [] {
    constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// Palette 1 with all eight tiles 16 rows x 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// Loads a tile configuration. GCC's _tile_loadconfig does not tell the compiler that it reads the struct: in a
// clone of ThreadTiles' constructor it stored the palette byte and zeros over the first half, dropped the rows'
// counts as dead stores, and ldtilecfg faulted. The asm's memory operand is the whole struct.
template <class Config>
inline void load_config(const Config& config) {
  static_assert(sizeof(Config) == 64, "a tile configuration is 64 bytes");
  asm volatile("ldtilecfg %0" ::"m"(config));
}

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

#if defined(__AMX_BF16__)
// tmm C += tmm A (16 rows x 32 bf16) x tmm B (16 pairs x 16 columns x 2 bf16), in float32
struct Bf16 {
  static constexpr bool FOUR_GROUPS_ON_BLOCKS = false;  // (see multiply)
  template <int C, int A, int B>
  static void dot() {
    asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
  }
};
#endif
#if defined(__AMX_INT8__)
// tmm C += tmm A (16 rows x 64 unsigned bytes) x tmm B (16 quads x 16 columns x 4 signed bytes), in int32
struct U8S8 {
  static constexpr bool FOUR_GROUPS_ON_BLOCKS = true;  // (see multiply)
  template <int C, int A, int B>
  static void dot() {
    asm volatile("tdpbusd %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
  }
};
#endif

// x's rows in groups of 16: the first row's address and the row stride, in bytes. With `passes` > 1 the groups
// are that many passes over the same rows one after the other (int16 codes: their high bytes, then their low).
struct Rows {
  std::vector<const uint8_t*> groups;
  std::vector<int64_t> strides;
  int passes = 1;
  int64_t pass_groups() const { return static_cast<int64_t>(groups.size()) / passes; }
};

// Where a product's weight lies: blocks `block_bytes` apart, `steps` tile steps of K each.
struct Weight {
  const uint8_t* w;
  int64_t block_bytes;
  int64_t steps;
};

// The tile state of a thread's share: PyTorch's brgemm skips loading its tile configuration while the kernel
// it ran last on this thread is unreleased, so release it first (its next call then reloads over this one).
struct ThreadTiles {
  ThreadTiles() {
    at::native::cpublas::brgemm_release(true);
    const TileConfig config;
    load_config(config);
  }
  ~ThreadTiles() { _tile_release(); }
};

// The thread's buffer of sums, at least n values on a cache line: kept from call to call (a decode step makes
// ~100 products, and a panel's 64-256 KiB would come from the allocator each time).
inline uint32_t* sums_buffer(int64_t n) {
  thread_local std::vector<uint32_t> buffer;
  if (static_cast<int64_t>(buffer.size()) < n + 16) buffer.resize(n + 16);
  const uintptr_t at = reinterpret_cast<uintptr_t>(buffer.data());
  return reinterpret_cast<uint32_t*>((at + 63) / 64 * 64);
}

// Software prefetches of the thread's next chunk, spread evenly over the current chunk's tile steps.
struct ChunkPrefetch {
  const uint8_t* next = nullptr;
  const uint8_t* end = nullptr;
  int64_t per_step = 0;
  void start(const uint8_t* from, const uint8_t* to, int64_t steps) {
    next = from;
    end = to;
    per_step = to > from ? (to - from + steps * 64 - 1) / (steps * 64) * 64 : 0;
  }
  void step() {
    const uint8_t* stop = std::min(end, next + per_step);
    for (; next < stop; next += 64) _mm_prefetch(reinterpret_cast<const char*>(next), _MM_HINT_T1);
  }
};

// ------------------------------------------------------------------ blocks: one or two groups of rows (int8: up to four)

// The sums' tiles of C column tiles of a block NV tiles wide: (group r, column tile v) is tmm r * C + v; a block's
// sums are rows of NV * 16 lanes.
template <int R, int C, int NV, int T = 0>
inline void block_sums(uint32_t* c, bool load) {
  if constexpr (T < R * C) {
    if (load)
      tile_load<T>(c + (T / C) * 16 * NV * 16 + (T % C) * 16, NV * 64);
    else
      tile_zero<T>();
    block_sums<R, C, NV, T + 1>(c, load);
  }
}

template <int R, int C, int NV, int T = 0>
inline void store_block_sums(uint32_t* c) {
  if constexpr (T < R * C) {
    tile_store<T>(c + (T / C) * 16 * NV * 16 + (T % C) * 16, NV * 64);
    store_block_sums<R, C, NV, T + 1>(c);
  }
}

// One tile step: column tile V of C (in the B tiles left after the R tiles of x, in turn) times x's R tiles.
template <class Dot, int R, int C, int NV, int V = 0>
inline void step_columns(const uint8_t* wp) {
  if constexpr (V < C) {
    constexpr int B = 4 + R + V % (4 - R);
    tile_load<B>(wp + V * 64, NV * 64);
    Dot::template dot<V, 4, B>();
    if constexpr (R == 2) Dot::template dot<C + V, 5, B>();
    step_columns<Dot, R, C, NV, V + 1>(wp);
  }
}

// Tile steps [s0, s0 + steps) of C column tiles of a block NV tiles wide (`block` at the first of them) times R
// groups of x's rows (`a`, `xs`), the sums in `c` (at the first column tile's): loaded first unless `first`,
// stored after.
template <class Dot, int R, int C, int NV>
void chunk(const uint8_t* const* a, const int64_t* xs, const uint8_t* block, int64_t s0, int64_t steps,
           uint32_t* c, bool first, ChunkPrefetch& prefetch) {
  block_sums<R, C, NV>(c, !first);
  for (int64_t s = s0; s < s0 + steps; ++s) {
    tile_load<4>(a[0] + 64 * s, xs[0]);
    if constexpr (R == 2) tile_load<5>(a[1] + 64 * s, xs[1]);
    step_columns<Dot, R, C, NV>(block + s * 16 * NV * 64);
    prefetch.step();
  }
  store_block_sums<R, C, NV>(c);
}

template <class Dot, int NV, class Epilogue>
void blocks(const Rows& x, const Weight& wt, int64_t b0, int64_t b1, const Epilogue& epilogue) {
  constexpr int64_t NB = NV * 16, CHUNK_STEPS = CHUNK_BYTES / (16 * NV * 64);
  constexpr int R = NV <= 2 ? 2 : 1;
  const ThreadTiles tiles;
  const int64_t G = static_cast<int64_t>(x.groups.size());
  uint32_t* sums = sums_buffer(G * 16 * NB);
  const uint8_t* range_end = wt.w + b1 * wt.block_bytes;
  ChunkPrefetch prefetch;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* block = wt.w + b * wt.block_bytes;
    for (int64_t s0 = 0; s0 < wt.steps; s0 += CHUNK_STEPS) {
      const int64_t steps = std::min(CHUNK_STEPS, wt.steps - s0);
      // the next chunk in memory: the rest of this block, else the next block's start
      const uint8_t* next = s0 + CHUNK_STEPS < wt.steps ? block + (s0 + CHUNK_STEPS) * 16 * NV * 64
                                                        : block + wt.block_bytes;
      prefetch.start(next, std::min(range_end, next + CHUNK_BYTES), (G + R - 1) / R * steps);
      int64_t g = 0;
      for (; g + R <= G; g += R)
        chunk<Dot, R, NV, NV>(&x.groups[g], &x.strides[g], block, s0, steps, &sums[g * 16 * NB], s0 == 0,
                              prefetch);
      if (g < G)
        chunk<Dot, 1, NV, NV>(&x.groups[g], &x.strides[g], block, s0, steps, &sums[g * 16 * NB], s0 == 0,
                              prefetch);
    }
    epilogue(b, [&](int64_t row, int v) -> const void* { return &sums[row * NB + v * 16]; });
  }
}

// ------------------------------------------------------------------ panels: three or four groups of rows

// x's G tiles of rows (in tmm5-7 in turn) times the slice's tile in tmm4, into sums tmm0 .. G - 1.
template <class Dot, int G, int T = 0>
inline void rows_times_slice(const uint8_t* const* a, const int64_t* xs, int64_t s) {
  if constexpr (T < G) {
    constexpr int A = 5 + T % 3;
    tile_load<A>(a[T] + 64 * s, xs[T]);
    Dot::template dot<T, A, 4>();
    rows_times_slice<Dot, G, T + 1>(a, xs, s);
  }
}

// A slice's G tiles of sums, 1 KiB each and one after the other: loaded (or zeroed), stored.
template <int G, int T = 0>
inline void slice_sums(uint32_t* c, bool load) {
  if constexpr (T < G) {
    if (load)
      tile_load<T>(c + T * 256, 64);
    else
      tile_zero<T>();
    slice_sums<G, T + 1>(c, load);
  }
}

template <int G, int T = 0>
inline void store_slice_sums(uint32_t* c) {
  if constexpr (T < G) {
    tile_store<T>(c + T * 256, 64);
    store_slice_sums<G, T + 1>(c);
  }
}

template <class Dot, int NV, int G, class Epilogue>
void panels(const Rows& x, const Weight& wt, int64_t b0, int64_t b1, const Epilogue& epilogue) {
  constexpr int64_t STEP_BYTES = 16 * NV * 64;
  const ThreadTiles tiles;
  uint32_t* sums = sums_buffer(PANEL_BLOCKS * NV * G * 256);
  ChunkPrefetch prefetch;
  for (int64_t pb = b0; pb < b1; pb += PANEL_BLOCKS) {
    const int64_t pe = std::min(b1, pb + PANEL_BLOCKS);
    for (int64_t s0 = 0; s0 < wt.steps; s0 += PANEL_STEPS) {
      const int64_t steps = std::min(PANEL_STEPS, wt.steps - s0);
      for (int64_t b = pb; b < pe; ++b) {
        // the piece after this one: the next block's, else the panel's first block's next steps, else the
        // next panel's first piece
        int64_t nb = b + 1, ns = s0;
        if (nb == pe) {
          const bool more = s0 + PANEL_STEPS < wt.steps;
          nb = more ? pb : pe;
          ns = more ? s0 + PANEL_STEPS : 0;
        }
        const uint8_t* next = wt.w + nb * wt.block_bytes + ns * STEP_BYTES;
        prefetch.start(next, nb < b1 ? next + std::min(PANEL_STEPS, wt.steps - ns) * STEP_BYTES : next,
                       NV * steps);
        const uint8_t* block = wt.w + b * wt.block_bytes;
        for (int v = 0; v < NV; ++v) {
          uint32_t* c = &sums[((b - pb) * NV + v) * G * 256];
          slice_sums<G>(c, s0 > 0);
          for (int64_t s = s0; s < s0 + steps; ++s) {
            tile_load<4>(block + s * STEP_BYTES + v * 64, NV * 64);
            rows_times_slice<Dot, G>(x.groups.data(), x.strides.data(), s);
            prefetch.step();
          }
          store_slice_sums<G>(c);
        }
      }
    }
    for (int64_t b = pb; b < pe; ++b) {
      const uint32_t* c = &sums[(b - pb) * NV * G * 256];
      epilogue(b, [&](int64_t row, int v) -> const void* { return c + v * G * 256 + (row / 16) * 256 + (row % 16) * 16; });
    }
  }
}

// ------------------------------------------------------------------ gemm: five groups of rows or more
// A prefill's hundreds of rows: 2 x 2 tiles of sums (two groups of rows by two column tiles) over a block's whole
// K, stored once; the thread's blocks go in panels of about GEMM_PANEL_BYTES, which stay in L2 while every pair
// of groups passes them (x's rows of a pair from L1 or L2 along the panel). One core, operands in L1: 4.2-5.3 ns a
// product with four tile loads to four products, AMX's rate; on two cores, int8, 1856 rows of the 0.5B Qwen2's
// layers (their tiles' loop alone, no epilogue), 6.2-7.8 TOPS where oneDNN's int8 GEMM ran at 2.6-2.9. In bf16
// (x's rows twice the bytes, both operands from L2) it measured 0.91x oneDNN's GEMM at 1852 rows, so bf16
// batches past small_batch_gemm.AMX_ROWS stay on oneDNN. Software prefetches of the next panel and the next
// pair's rows measured no faster.
constexpr int64_t GEMM_PANEL_BYTES = 786432;
// more groups a pass than this take the gemm: at 48-64 rows, weights from memory, it measured 0.80-0.85x the
// panels (int8 and bf16), which stream each block once for all rows
constexpr int64_t GEMM_FROM_GROUPS = 4;

// One or two groups (`a`, `xs`) times a whole block, two column tiles at a time (the 2 x 2 tiles of sums), its
// sums as rows of NV * 16 lanes at `out`.
template <class Dot, int NV, int R>
inline void block_strips(const uint8_t* const* a, const int64_t* xs, const uint8_t* block, int64_t steps,
                         uint32_t* out) {
  ChunkPrefetch none;  // the panel is in L2
  for (int v = 0; v + 1 < NV; v += 2) chunk<Dot, R, 2, NV>(a, xs, block + v * 64, 0, steps, out + v * 16, true, none);
  if constexpr (NV % 2)
    chunk<Dot, R, 1, NV>(a, xs, block + (NV - 1) * 64, 0, steps, out + (NV - 1) * 16, true, none);
}

template <class Dot, int NV, class Epilogue>
void gemm(const Rows& x, const Weight& wt, int64_t b0, int64_t b1, const Epilogue& epilogue) {
  constexpr int64_t NB = NV * 16;
  const ThreadTiles tiles;
  const int64_t PG = x.pass_groups(), P = x.passes;
  const int64_t panel = std::max<int64_t>(1, GEMM_PANEL_BYTES / wt.block_bytes);
  uint32_t* sums = sums_buffer(P * 32 * NB);  // per pass, two groups of rows by the block's columns
  for (int64_t pb = b0; pb < b1; pb += panel) {
    const int64_t pe = std::min(b1, pb + panel);
    for (int64_t g = 0; g < PG; g += 2) {
      const bool two = g + 1 < PG;
      for (int64_t b = pb; b < pe; ++b) {
        const uint8_t* block = wt.w + b * wt.block_bytes;
        for (int64_t s = 0; s < P; ++s) {
          const int64_t i = s * PG + g;
          if (two) block_strips<Dot, NV, 2>(&x.groups[i], &x.strides[i], block, wt.steps, sums + s * 32 * NB);
          else block_strips<Dot, NV, 1>(&x.groups[i], &x.strides[i], block, wt.steps, sums + s * 32 * NB);
        }
        epilogue(b, 16 * g, 16 * (g + (two ? 2 : 1)), [&](int64_t s, int64_t m, int v) -> const void* {
          return &sums[(s * 32 + m - 16 * g) * NB + v * 16];
        });
      }
    }
  }
}

// The thread's blocks [b0, b1) times all of x's groups: panels for three or four groups a pass, blocks for one or
// two, gemm for more. The epilogue takes a block's rows [m0, m1) of every pass, `epilogue(b, m0, m1, sums)`, with
// sums(pass, row, v) the 16 sums of that row (m0 <= row < m1, rows past x's being padding) and the block's columns
// 16 v .. 16 v + 15. Four groups of int8 codes go to the blocks instead (Dot::FOUR_GROUPS_ON_BLOCKS: their blocks
// are four column tiles wide, so a group at a time keeps its four tiles of sums over a chunk of 8 steps, the chunk
// in L1 for the next group): the 0.5B Qwen2's layers at 62-64 rows from memory took the panels 1.07-1.10x as long,
// and int16 codes' two passes of two groups (17-32 rows) 1.11x, the two alternating in one process (W1 in
// `int8`, passes alternating in one engine: 1.00-1.07x, median 1.05x); bf16's two-tile blocks took 0.93-0.97x the
// panels' time, and three groups of either ran alike on both.
template <class Dot, int NV, class Epilogue>
void multiply(const Rows& x, const Weight& wt, int64_t b0, int64_t b1, const Epilogue& epilogue) {
  const int64_t pass_rows = 16 * x.pass_groups();
  const auto whole = [&](int64_t b, const auto& sums) {
    epilogue(b, 0, pass_rows, [&](int64_t s, int64_t m, int v) { return sums(s * pass_rows + m, v); });
  };
  switch (x.groups.size()) {
    case 3: return panels<Dot, NV, 3>(x, wt, b0, b1, whole);
    case 4:
      if (Dot::FOUR_GROUPS_ON_BLOCKS) return blocks<Dot, NV>(x, wt, b0, b1, whole);
      return panels<Dot, NV, 4>(x, wt, b0, b1, whole);
    default:
      if (x.pass_groups() > GEMM_FROM_GROUPS) return gemm<Dot, NV>(x, wt, b0, b1, epilogue);
      return blocks<Dot, NV>(x, wt, b0, b1, whole);
  }
}

// x [M rows, `row_bytes` of them used, rows `stride` bytes apart] as groups of 16 rows, the last rows copied
// zero-padded into `padded` (16 rows of row_bytes) where M is not a multiple of 16.
inline void add_groups(Rows& rows, const uint8_t* x, int64_t M, int64_t stride, int64_t row_bytes,
                       std::vector<uint8_t>& padded) {
  const int64_t full = M / 16, rest = M % 16;
  for (int64_t g = 0; g < full; ++g) {
    rows.groups.push_back(x + g * 16 * stride);
    rows.strides.push_back(stride);
  }
  if (rest) {
    padded.assign(16 * row_bytes, 0);
    for (int64_t r = 0; r < rest; ++r)
      std::copy_n(x + (full * 16 + r) * stride, row_bytes, padded.data() + r * row_bytes);
    rows.groups.push_back(padded.data());
    rows.strides.push_back(row_bytes);
  }
}

}  // namespace folio::amx
#endif
