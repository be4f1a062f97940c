// The AVX2 block kernels' path for batches of several rows (cpu_int4_blocks.cpp, cpu_int8_blocks.cpp).
//
// Their one- and two-row loops widen a block's codes again for every pair of rows: per 16 products by vpmaddwd
// they spend about one more instruction decoding nibbles or bytes, so at 32 rows the int4 kernel ran at about 41
// GMAC/s on one Zen 3 core. Here a task takes one block (64 columns) and a panel of up to TILE_PANEL rows: each
// run of pairs of K is decoded once into a tile of 16-bit words, then a register-blocked micro-kernel multiplies
// three rows by 32 columns of the tile (12 int32 accumulators; the weight vectors are read from L1 by vpmaddwd
// itself), so the panel's rows share the decoding. Prefill-sized batches take it too: 16 exact products per
// instruction beat MKL's float32 GEMM on the dequantised weight at every size measured.
//
// The arithmetic is the row loops' own, in the same order: the same exact int32 sums over the same runs of pairs,
// each flushed as tot = fma(float(sum), scale * unit(s_x), tot), then per group the format's offset term. Since
// the row loops' factors differ from unit's only by powers of two, every output is bit for bit what the row loops
// give, whatever the batch: a request's results do not depend on the batch it runs in.
#pragma once

#include "int16_codes.h"

#if defined(__AVX2__) && defined(__FMA__)
#include "parallel.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t TILE_COLUMNS = 64;  // a block's output columns: 8 vectors of 8
constexpr int64_t TILE_PAIR_WORDS = 2 * TILE_COLUMNS;  // int16 words of one pair of K in a tile
constexpr int TILE_MR = 3;            // rows per micro-kernel pass
constexpr int TILE_NR = 4;            // vectors of 8 columns per micro-kernel pass
constexpr int64_t TILE_PANEL = 48;    // rows per task, which share its decoded tiles
// Batches of at least this many rows take the tiles; one or two rows keep the row loops, which stream the codes
// with nothing written back (Zen 3, 2 threads, the default model's layers from memory: 1 row 4.3 against 5.9
// ms, 2 rows 4.6 against 5.8, 3 rows even, the head 1.14x faster from 3 rows).
constexpr int64_t TILE_MIN_ROWS = 3;

// One pass of rows xq[0 .. MR) over the tile's pairs 0 .. np (x's pairs p0 .. p0 + np) for the 32 columns of vectors
// j0 .. j0 + 3, flushed into tot: tot[m][c] = fma(float(sum), scale[c] * unit[m], tot[m][c]). Three rows by four
// vectors took 7.2 cycles a pair on Zen 3 in a loop of their own (the four vector pipes busy with the 12
// vpmaddwd, 12 vpaddd and 3 broadcasts), six rows by two 8.3 (6 broadcasts), four by three 7.6; best of runs on a
// shared machine, whose runs ranged up to 1.3x that.
template <int MR>
inline void tile_pass(const int16_t* tile, int64_t np, const int32_t* const* xq, int64_t p0, int j0,
                      const float* scale, const __m256* unit, float (*tot)[TILE_COLUMNS]) {
  __m256i acc[MR][TILE_NR];
  UNROLL for (int m = 0; m < MR; ++m)
    UNROLL for (int r = 0; r < TILE_NR; ++r) acc[m][r] = _mm256_setzero_si256();
  const int32_t* x[MR];
  UNROLL for (int m = 0; m < MR; ++m) x[m] = xq[m] + p0;
  const int16_t* wp = tile + 16 * j0;
  for (int64_t p = 0; p < np; ++p, wp += TILE_PAIR_WORDS) {
    __m256i wv[TILE_NR];
    UNROLL for (int r = 0; r < TILE_NR; ++r) wv[r] = _mm256_load_si256(reinterpret_cast<const __m256i*>(wp + 16 * r));
    UNROLL for (int m = 0; m < MR; ++m) {
      const __m256i xv = _mm256_set1_epi32(x[m][p]);
      UNROLL for (int r = 0; r < TILE_NR; ++r) acc[m][r] = _mm256_add_epi32(acc[m][r], _mm256_madd_epi16(wv[r], xv));
    }
  }
  for (int r = 0; r < TILE_NR; ++r) {
    const __m256 s = _mm256_loadu_ps(scale + 8 * (j0 + r));
    for (int m = 0; m < MR; ++m) {
      float* t = tot[m] + 8 * (j0 + r);
      _mm256_store_ps(t, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][r]), _mm256_mul_ps(s, unit[m]), _mm256_load_ps(t)));
    }
  }
}

inline void tile_pass_rows(int mr, const int16_t* tile, int64_t np, const int32_t* const* xq, int64_t p0, int j0,
                           const float* scale, const __m256* unit, float (*tot)[TILE_COLUMNS]) {
  static_assert(TILE_MR == 3, "one case per row count");
  switch (mr) {
    case 1: return tile_pass<1>(tile, np, xq, p0, j0, scale, unit, tot);
    case 2: return tile_pass<2>(tile, np, xq, p0, j0, scale, unit, tot);
    default: return tile_pass<3>(tile, np, xq, p0, j0, scale, unit, tot);
  }
}

// What every format shares: its output size, group size and groups per row of W.
struct TileShape {
  int64_t N, G, ng;
  int64_t num_blocks() const { return (N + TILE_COLUMNS - 1) / TILE_COLUMNS; }
};

// y [M, N] = x W^T (+ bias) over the format's blocks, every (panel of rows, block) a task. The format is a
// TileShape and gives: max_run: the most pairs one int32 sum may take;
//   decode(b, p0, np, tile): block b's pairs p0 .. p0 + np as int16 [np][64][2] (vector j: columns 8j .. 8j + 7,
//     each as its pair (q_2p, q_2p+1));
//   scales(b, g): the group's 64 scales; unit(s_x): the factor of a row's scale they are multiplied by;
//   offsets(b, g): the group's 64 offsets, added times the row's group sum xsum[m * ng + g] (nullptr: none).
template <class Format>
void tiled_linear(const Format& f, const Int16Rows& rows, int64_t M, const float* xsum, const float* bias,
                  float* y) {
  const int64_t NB = f.num_blocks(), panels = (M + TILE_PANEL - 1) / TILE_PANEL;
  const int64_t gp = f.G / 2, run = std::min<int64_t>(gp, Format::max_run);
  folio::parallel_for(0, panels * NB, 1, [&](int64_t t0, int64_t t1) {
    std::vector<__m256i> tile_store(run * TILE_PAIR_WORDS / 16);
    int16_t* tile = reinterpret_cast<int16_t*>(tile_store.data());
    alignas(32) float tot[TILE_PANEL][TILE_COLUMNS];
    __m256 unit[TILE_PANEL];
    for (int64_t t = t0; t < t1; ++t) {
      // rows spread evenly over the panels (64 rows: two of 32, not 48 and 16)
      const int64_t panel = t / NB, b = t % NB, m0 = panel * (M / panels) + std::min(panel, M % panels);
      const int mp = static_cast<int>(M / panels + (panel < M % panels));
      const int passes = (mp + TILE_MR - 1) / TILE_MR;  // rows spread evenly over the passes
      const int32_t* const* xq = rows.xq.data() + m0;
      for (int m = 0; m < mp; ++m) {
        unit[m] = _mm256_set1_ps(f.unit(rows.sx[m0 + m]));
        for (int64_t c = 0; c < TILE_COLUMNS; c += 8) _mm256_store_ps(tot[m] + c, _mm256_setzero_ps());
      }
      for (int64_t g = 0; g < f.ng; ++g) {
        const float* scale = f.scales(b, g);
        if (g + 1 < f.ng)  // the next group's scales and offsets, while this one's runs compute
          for (int64_t c = 0; c < TILE_COLUMNS; c += 16) {
            _mm_prefetch(reinterpret_cast<const char*>(f.scales(b, g + 1) + c), _MM_HINT_T0);
            if (const float* offset = f.offsets(b, g + 1))
              _mm_prefetch(reinterpret_cast<const char*>(offset + c), _MM_HINT_T0);
          }
        for (int64_t p0 = g * gp, end = (g + 1) * gp; p0 < end; p0 += run) {
          const int64_t np = std::min(run, end - p0);
          f.decode(b, p0, np, tile);
          for (int i = 0, r0 = 0; i < passes; ++i) {
            const int mr = mp / passes + (i < mp % passes);
            for (int j0 = 0; j0 < 8; j0 += TILE_NR)
              tile_pass_rows(mr, tile, np, xq + r0, p0, j0, scale, unit + r0, tot + r0);
            r0 += mr;
          }
        }
        if (const float* offset = f.offsets(b, g))
          for (int m = 0; m < mp; ++m) {
            const __m256 xg = _mm256_set1_ps(xsum[(m0 + m) * f.ng + g]);
            for (int64_t c = 0; c < TILE_COLUMNS; c += 8)
              _mm256_store_ps(tot[m] + c, _mm256_fmadd_ps(_mm256_loadu_ps(offset + c), xg, _mm256_load_ps(tot[m] + c)));
          }
      }
      const int64_t n0 = b * TILE_COLUMNS, lanes = std::min(TILE_COLUMNS, f.N - n0);
      for (int m = 0; m < mp; ++m) {
        float* dst = y + (m0 + m) * f.N + n0;
        for (int64_t c = 0; c < lanes; ++c) dst[c] = bias ? tot[m][c] + bias[n0 + c] : tot[m][c];
      }
    }
  });
}

}  // namespace
#endif
