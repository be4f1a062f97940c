// The paged attention kernel's decode path for grouped-query heads on AMX tiles (cpu_paged_attention.cpp includes
// it inside its anonymous namespace, after the definitions it uses: Params, Item, key_rows, the prefetcher,
// start_row, finish_rows; and amx_tiles.h before that namespace).
//
// What bounded the vector decode path (attend_decode_bf16) on a Xeon with AMX was not reading the cache but the
// work per key: each tile of K transposed into bf16 pairs (the loads of its rows and 64 shuffles per 32 values)
// and then q . k as vdpbf16ps, G rows of q each broadcast pair by pair. Here the scores come transposed instead,
// S^T = K Q^T, one tile product per 16 keys and 32 values of head_dim: K's rows are the A tile as the cache holds
// them (16 consecutive slots of a block, a cache row apart), q the B tile, arranged once per item (pairs of
// head_dim by query head). The kv heads of the item sit side by side in the 16 lanes of a tile of sums (G query
// heads each, as many kv heads as fit): each kv head's q fills its own lanes of the B tile and zeros the others,
// so that all of them sum into the same four tiles and one store writes whole rows of 16 lanes a key. The online
// softmax then runs with a row of 16 lanes per key, with no horizontal reduction.
//
// P.V runs on tiles too, with V's rows as the cache holds them: a B tile is 16 keys' rows, 32 values each, read
// as 16 pairs (even value, odd value) a key; the A tile holds, for up to 8 query heads, each key's probability in
// the low half of a word (rows 0-7: their sums are the even values of P.V) and in the high half (rows 8-15: the
// odd values). So V needs no interleaving by pairs of keys, and the two halves of each slice of the output are
// put back in order once a chunk. The chunk: up to MAX_CHUNK keys whose scores wait in L2, one softmax step for
// all of them, their probabilities rounded to bf16 and turned lane by lane (16 keys at a time) into each kv
// head's A tiles, then P.V summed in tiles over the chunk's keys and added to the running sums once. A first or
// last group of 16 keys that holds keys outside the item is copied with those rows zero (the rows past a
// request's context are not written yet, and a zero probability must not meet a NaN).
//
// Measured on 2 cores of an Emerald Rapids Xeon, a layer with the KV from memory (`python
// benchmarks/attention_bench.py --versus-kernel ...`): against P.V with V interleaved by pairs of keys on tiles,
// 1.12-1.14x on Qwen2-0.5B (14 heads on 2, head_dim 64; batches 1-64, context 320), 1.18-1.20x at 2000 keys,
// Llama-3-8B's shape 1.19-1.24x, Qwen2.5-7B's 1.15-1.21x, int8 and fp8 caches 1.08-1.18x; that one against P.V
// with vdpbf16ps 64 keys a step 1.06-1.27x (chunks of 128, 256 or 512 keys alike); and that one against the
// vector path 1.15-1.22x on Qwen2-0.5B, 1.12-1.35x on 7-8B shapes, 1.18-1.30x with 8-bit caches.
//
// Arithmetic: as the vector path's, bf16 products summed in float32 (in another order), P rounded to bf16 for
// P.V. The keys start at the item's first key rounded down to a multiple of 16 (its block's slots before it are
// this request's own keys: a sliding window's start or a partition's) and keys outside the item are masked, so
// the path needs a block size that is a multiple of 16 and no more than 16 query heads per kv head. An 8-bit
// cache's rows are taken exactly into bf16 rows first (exact_codes), each key's scale multiplying its scores and
// each value's its probabilities before their rounding, as in the vector path: rows whose scales are powers of
// two attend bit for bit as a bf16 cache of the same values.
#pragma once

namespace amx_decode {

constexpr int KEYS = 64;  // keys per step of the scores
constexpr int SUBS = KEYS / 16;  // tiles of 16 keys per step
constexpr int LANES = 16;  // query heads of the kv heads side by side in one tile of sums
constexpr int MAX_CHUNK = 256;  // keys a softmax step and a run of P.V on tiles take
constexpr int CHUNK_V_BYTES = 1 << 17;  // a chunk's V rows (all the item's kv heads) at most
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// The tiles (all 16 rows of 64 bytes: folio::amx::TileConfig): 0-3 sums (S^T of a step's four tiles of 16 keys,
// or a chunk's P.V for four slices of 32 values of head_dim); scores: 4, 5 K rows in turn, 6 the q pairs; P.V: 4
// the probabilities, 5, 6 V rows in turn.

// S^T of the step's tiles of 16 keys (tile U at a[U], `stride` bytes between keys) for one kv head and 32 values
// of head_dim: tile U += K rows x the q pairs already in tile 6.
template <int U = 0>
inline void score_tiles(const uint8_t* const* a, int64_t stride, int nsub) {
  if constexpr (U < SUBS) {
    if (U < nsub) {
      folio::amx::tile_load<4 + U % 2>(a[U], stride);
      folio::amx::Bf16::dot<U, 4 + U % 2, 6>();
      score_tiles<U + 1>(a, stride, nsub);
    }
  }
}

template <int U = 0>
inline void zero_sum_tiles() {
  if constexpr (U < 4) {
    folio::amx::tile_zero<U>();
    zero_sum_tiles<U + 1>();
  }
}

// Tile U's 16 keys x 16 lanes into rows 16 U .. of s (16 floats a key).
template <int U = 0>
inline void store_score_tiles(float* s, int nsub) {
  if constexpr (U < SUBS) {
    if (U < nsub) {
      folio::amx::tile_store<U>(s + 16 * LANES * U, 4 * LANES);
      store_score_tiles<U + 1>(s, nsub);
    }
  }
}

// P.V of 16 keys for the value slices c0 .. c0 + 3 of head_dim (32 values each, those below NC): tile U += the
// probabilities in tile 4 (rows 0-7 even values' form, 8-15 odd values') x the 16 keys' V rows from v (`stride`
// bytes apart), 64 bytes of slice c0 + U each.
template <int NC, int U = 0>
inline void pv_tiles(const uint8_t* v, int64_t stride, int c0) {
  if constexpr (U < 4) {
    if (c0 + U < NC) {
      folio::amx::tile_load<5 + U % 2>(v + 64 * (c0 + U), stride);
      folio::amx::Bf16::dot<U, 4, 5 + U % 2>();
      pv_tiles<NC, U + 1>(v, stride, c0);
    }
  }
}

// Tile U's 16 rows x 16 sums into slice c0 + U of o's rows (16 NC floats a row).
template <int NC, int U = 0>
inline void store_pv_tiles(float* o, int c0) {
  if constexpr (U < 4) {
    if (c0 + U < NC) {
      folio::amx::tile_store<U>(o + 16 * (c0 + U), NC * 64);
      store_pv_tiles<NC, U + 1>(o, c0);
    }
  }
}

}  // namespace amx_decode

template <typename C, int NC>
void attend_decode_amx(const Params& P, const Item& it, float* partial, const Item* ahead) {
  using namespace amx_decode;
  constexpr int NV = 2 * NC, D = NV * 16, D2 = D / 2;
  constexpr bool Q8 = Cache<C>::QUANTIZED;
  constexpr int RW = D + Cache<C>::SCALE_BYTES;  // elements of a cache row
  const int G = P.G, NH = it.h1 - it.h0, R = G * NH;
  const int HL = LANES / G;  // kv heads side by side in the lanes
  const int NL = (NH + HL - 1) / HL;  // lane groups
  const int LB = (G + 7) / 8;  // blocks of up to 8 query heads a kv head's P.V takes at a time
  const int qs = P.reqs[3 * it.b];
  // keys a chunk: their scores wait in L2 for one softmax step and P.V on tiles (8-bit: their V codes too)
  const int CH = std::max(KEYS, std::min(MAX_CHUNK, CHUNK_V_BYTES / (NH * D * 2) / KEYS * KEYS));
  constexpr int GR = MAX_CHUNK / 16;  // groups of 16 keys a chunk at most

  auto aligned = [](void* p) {
    return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
  };
  const size_t q8 =
      Q8 ? 2 * (size_t)NL * MAX_CHUNK * LANES + (size_t)HL * KEYS * D / 2 + (size_t)NH * MAX_CHUNK * D2 : 0;
  float* mem = thread_scratch().get((size_t)R * (D + TILE + 1) + (size_t)NL * LANES * 2 +
                                    (size_t)NL * MAX_CHUNK * LANES + (size_t)NH * LB * GR * 256 +
                                    (size_t)NH * 2 * 16 * D2 + (size_t)NH * NC * 256 + (size_t)LANES * D2 + q8 +
                                    2 * 16);
  float* acc = aligned(mem);
  float* lv = acc + (size_t)R * D;  // (R D and R TILE floats keep the alignment)
  float* m = lv + (size_t)R * TILE;
  float* gmax = aligned(m + R);
  float* gsum = gmax + (size_t)NL * LANES;
  float* s = gsum + (size_t)NL * LANES;  // [NL, CH, 16]: scores, then their scaled and masked values
  // [NH, LB, CH / 16, 16, 16]: the A tiles of P.V, a kv head's probabilities for a group of 16 keys, bf16 in the
  // low half of each word for up to 8 query heads (rows 0-7: the even values of V) and in the high half (8-15: odd)
  uint32_t* pa = reinterpret_cast<uint32_t*>(s + (size_t)NL * MAX_CHUNK * LANES);
  // [NH, 2, 16, D] bf16: a chunk's first and last groups of V rows where some of their keys are not the item's
  at::BFloat16* vedge = reinterpret_cast<at::BFloat16*>(pa + (size_t)NH * LB * GR * 256);
  uint32_t* qp = reinterpret_cast<uint32_t*>(vedge + (size_t)NH * 2 * 16 * D);
  float* o = reinterpret_cast<float*>(qp + (size_t)NH * NC * 256);  // P.V of a chunk [16, D / 2]
  float* kscale = o + (size_t)LANES * D2;  // [NL, CH, 16]
  float* vscale = kscale + (size_t)NL * MAX_CHUNK * LANES;
  at::BFloat16* kcodes = reinterpret_cast<at::BFloat16*>(vscale + (size_t)NL * MAX_CHUNK * LANES);
  at::BFloat16* vcodes = kcodes + (size_t)HL * KEYS * D;  // [NH, CH, D]

  // q pairs for the B tile, the kv heads of a lane group in their own lanes (zero elsewhere):
  // qp[((hh * NC + c) * 16 + p) * 16 + lane] = (q_g[32 c + 2 p], q_g[32 c + 2 p + 1]), lane = (hh % HL) * G + g
  const uint32_t* q0 = reinterpret_cast<const uint32_t*>(static_cast<const at::BFloat16*>(P.q) +
                                                         (int64_t)(qs + it.q0) * P.q_st + (int64_t)it.h0 * G * P.q_sh);
  std::fill(qp, qp + (size_t)NH * NC * 256, 0u);
  for (int hh = 0; hh < NH; ++hh)
    for (int g = 0; g < G; ++g) {
      const uint32_t* qr = q0 + ((int64_t)(hh * G + g) * P.q_sh) / 2;
      const int lane = (hh % HL) * G + g;
      for (int d2 = 0; d2 < D2; ++d2) qp[((hh * NC + d2 / 16) * 16 + d2 % 16) * 16 + lane] = qr[d2];
    }
  for (int r = 0; r < R; ++r) start_row<NV>(acc, lv, m, r);
  for (int i = 0; i < NL * LANES; ++i) {
    gmax[i] = NEG_INF;
    gsum[i] = 0.f;
  }
  alignas(64) int32_t head_of_lane[LANES];  // lane -> kv head of its lane group (8-bit scales)
  for (int l = 0; l < LANES; ++l) head_of_lane[l] = std::min(l / G, HL - 1);
  const __m512i lane_heads = _mm512_load_si512(head_of_lane);
  // a slice's even and odd sums back in order: d = 32 c + 2 n + (odd)
  alignas(64) static const int32_t lo_idx[16] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
  alignas(64) static const int32_t hi_idx[16] = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i even_odd_lo = _mm512_load_si512(lo_idx), even_odd_hi = _mm512_load_si512(hi_idx);

  const folio::amx::TileConfig config;
  at::native::cpublas::brgemm_release(true);  // see folio::amx::ThreadTiles
  folio::amx::load_config(config);

  const C* kc = static_cast<const C*>(P.k_cache);
  const C* vc = static_cast<const C*>(P.v_cache);
  const int32_t* bt = P.block_tables + it.b * P.max_blocks;
  const int64_t row_stride = (int64_t)P.Hkv * RW;  // elements between consecutive slots of a block
  const __m512 sc = _mm512_set1_ps(P.scale_log2), ninf = _mm512_set1_ps(NEG_INF);
  {  // the first keys' rows at once (see attend_decode_bf16)
    LinePrefetcher<KEYS> first;
    aim<C>(first, P, it, it.k0, 1);
    first.step();
  }
  const int start = it.k0 & ~15;
  const uint8_t* vrows[GR];  // each group of 16 keys' V rows in the cache, kv head h0's (a bf16 cache)
  for (int c0 = start; c0 < it.k1; c0 += CH) {
    const int nch = std::min(CH, it.k1 - c0), ngr = (nch + 15) / 16;
    const int mlo = std::max(0, it.k0 - c0);  // keys [mlo, nch) of the chunk are the item's
    // the chunk's steps of 64 keys: scores on tiles into s
    for (int t0 = c0; t0 < c0 + nch; t0 += KEYS) {
      const int nt = std::min(KEYS, c0 + nch - t0), nsub = (nt + 15) / 16, j0 = t0 - c0;
      int64_t tok[KEYS];
      key_rows(P, bt, t0, nt, row_stride, tok);
      if constexpr (!Q8)
        for (int u = 0; u < nsub; ++u)
          vrows[j0 / 16 + u] = reinterpret_cast<const uint8_t*>(vc + tok[16 * u] + (int64_t)it.h0 * RW);
      LinePrefetcher<KEYS> pf;
      if (t0 + KEYS < it.k1) aim<C>(pf, P, it, t0 + KEYS, NH * NC);
      else if (ahead) aim<C>(pf, P, *ahead, ahead->k0, NH * NC);
      for (int lg = 0; lg < NL; ++lg) {
        const int hb = lg * HL, he = std::min(NH, hb + HL);
        float* sl = s + ((size_t)lg * MAX_CHUNK + j0) * LANES;
        zero_sum_tiles();
        for (int hh = hb; hh < he; ++hh) {
          const int64_t hoff = (int64_t)(it.h0 + hh) * RW;
          const uint8_t* a[SUBS];
          int64_t stride = row_stride * (int64_t)sizeof(C);
          if constexpr (Q8) {  // the codes taken exactly into bf16 rows, each key's scales apart
            at::BFloat16* kd = kcodes + (size_t)(hh - hb) * KEYS * D;
            at::BFloat16* vd = vcodes + ((size_t)hh * MAX_CHUNK + j0) * D;
            float* ks = kscale + ((size_t)lg * MAX_CHUNK + j0) * LANES + (hh - hb);
            float* vs = vscale + ((size_t)lg * MAX_CHUNK + j0) * LANES + (hh - hb);
            for (int j = 0; j < nt; ++j) {
              const C* kr = kc + tok[j] + hoff;
              const C* vr = vc + tok[j] + hoff;
              ks[j * LANES] = Cache<C>::scale(kr, D);
              vs[j * LANES] = Cache<C>::scale(vr, D);
              exact_codes(kr, kd + (size_t)j * D, NC);
              exact_codes(vr, vd + (size_t)j * D, NC);
            }
            for (int u = 0; u < nsub; ++u) a[u] = reinterpret_cast<const uint8_t*>(kd + (size_t)16 * u * D);
            stride = D * 2;
          } else {
            for (int u = 0; u < nsub; ++u) a[u] = reinterpret_cast<const uint8_t*>(kc + tok[16 * u] + hoff);
          }
          for (int c = 0; c < NC; ++c) {
            folio::amx::tile_load<6>(qp + (size_t)(hh * NC + c) * 256, 64);
            const uint8_t* ac[SUBS];
            for (int u = 0; u < nsub; ++u) ac[u] = a[u] + 64 * c;
            score_tiles(ac, stride, nsub);
            pf.step();
          }
        }
        store_score_tiles(sl, nsub);
      }
      pf.per_step = KEYS;  // what a short last step's fewer calls left
      pf.step();
    }
    // V rows of each kv head a group at a time (the B tiles): in place in the cache, or (8-bit cache) the staged
    // codes; a first or last group with keys outside the item is copied with those rows zero
    auto v_group = [&](int hh, int g) -> std::pair<const uint8_t*, int64_t> {
      const int jb = 16 * g, je = std::min(jb + 16, nch);
      const uint8_t* rows;
      int64_t stride;
      if constexpr (Q8) {
        rows = reinterpret_cast<const uint8_t*>(vcodes + ((size_t)hh * MAX_CHUNK + jb) * D);
        stride = D * 2;
      } else {
        rows = vrows[g] + (int64_t)hh * RW * (int64_t)sizeof(C);
        stride = row_stride * (int64_t)sizeof(C);
      }
      if (jb >= mlo && je - jb == 16) return {rows, stride};
      at::BFloat16* e = vedge + ((size_t)hh * 2 + (g == 0 ? 0 : 1)) * 16 * D;
      for (int j = 0; j < 16; ++j) {
        const bool in = jb + j >= mlo && jb + j < je;
        if (in) std::memcpy(e + (size_t)j * D, rows + j * stride, D * 2);
        else std::fill(e + (size_t)j * D, e + (size_t)(j + 1) * D, at::BFloat16(0.f));
      }
      return {reinterpret_cast<const uint8_t*>(e), (int64_t)D * 2};
    };
    for (int lg = 0; lg < NL; ++lg) {
      const int hb = lg * HL, he = std::min(NH, hb + HL);
      float* sl = s + (size_t)lg * MAX_CHUNK * LANES;
      const float* ksl = kscale + (size_t)lg * MAX_CHUNK * LANES;
      const float* vsl = vscale + (size_t)lg * MAX_CHUNK * LANES;
      // the online softmax of the lanes' query heads over the chunk's keys
      __m512 mx = ninf;
      for (int j = 0; j < nch; ++j) {
        const __m512 ks =
            Q8 ? _mm512_mul_ps(_mm512_permutexvar_ps(lane_heads, _mm512_load_ps(ksl + j * LANES)), sc) : sc;
        __m512 x = _mm512_mul_ps(_mm512_load_ps(sl + j * LANES), ks);
        if (P.softcap2 > 0.f)
          x = _mm512_mul_ps(tanh_ps(_mm512_mul_ps(x, _mm512_set1_ps(P.inv_softcap2))), _mm512_set1_ps(P.softcap2));
        if (j < mlo) x = ninf;
        _mm512_store_ps(sl + j * LANES, x);
        mx = _mm512_max_ps(mx, x);
      }
      const __m512 mo = _mm512_load_ps(gmax + lg * LANES);
      const __m512 mn = _mm512_max_ps(mo, mx);  // finite in the lanes that hold query heads
      const __m512 cr = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mo, mn, _CMP_EQ_OQ), exp2_ps(_mm512_sub_ps(mo, mn)),
                                             _mm512_set1_ps(1.f));
      _mm512_store_ps(gmax + lg * LANES, mn);
      alignas(64) float lane_corr[LANES];
      _mm512_store_ps(lane_corr, cr);
      // probabilities (8-bit: times each value's scale first, as the vector path) rounded to bf16, 16 keys at a
      // time turned lane by lane into each kv head's A tiles
      __m512 sum = _mm512_mul_ps(_mm512_load_ps(gsum + lg * LANES), cr);
      for (int g = 0; g < ngr; ++g) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) {
          const int j = 16 * g + i;
          if (j >= nch) {
            r[i] = _mm512_setzero_si512();
            continue;
          }
          const __m512 p = exp2_ps(_mm512_sub_ps(_mm512_load_ps(sl + j * LANES), mn));
          sum = _mm512_add_ps(sum, p);
          const __m512 w =
              Q8 ? _mm512_mul_ps(p, _mm512_permutexvar_ps(lane_heads, _mm512_load_ps(vsl + j * LANES))) : p;
          r[i] = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(w));
        }
        transpose16x16(r);  // r[lane]: its 16 keys, each bf16 in the low half of a word
        for (int hh = hb; hh < he; ++hh)
          for (int lb = 0; lb < LB; ++lb) {
            uint32_t* t = pa + (((size_t)hh * LB + lb) * GR + g) * 256;
            for (int i = 0; i < 8; ++i) {
              const int gq = 8 * lb + i;
              const __m512i e = gq < G ? r[(hh - hb) * G + gq] : _mm512_setzero_si512();
              _mm512_store_si512(t + 16 * i, e);
              _mm512_store_si512(t + 16 * (8 + i), _mm512_slli_epi32(e, 16));
            }
          }
      }
      _mm512_store_ps(gsum + lg * LANES, sum);
      // acc_r = acc_r * corr_r + sum_j p_rj v_j: P.V on tiles, up to 8 query heads of a kv head at a time
      for (int hh = hb; hh < he; ++hh) {
        std::pair<const uint8_t*, int64_t> vg[GR];
        for (int g = 0; g < ngr; ++g) vg[g] = v_group(hh, g);
        for (int lb = 0; lb < LB; ++lb) {
          for (int cv = 0; cv < NC; cv += 4) {
            zero_sum_tiles();
            for (int g = 0; g < ngr; ++g) {
              folio::amx::tile_load<4>(pa + (((size_t)hh * LB + lb) * GR + g) * 256, 64);
              pv_tiles<NC>(vg[g].first, vg[g].second, cv);
            }
            store_pv_tiles<NC>(o, cv);
          }
          for (int i = 0; i < 8 && 8 * lb + i < G; ++i) {
            const int gq = 8 * lb + i, r = hh * G + gq;
            const __m512 crr = _mm512_set1_ps(lane_corr[(hh - hb) * G + gq]);
            float* ar = acc + (size_t)r * D;
            for (int c = 0; c < NC; ++c) {
              const __m512 ev = _mm512_load_ps(o + (size_t)i * D2 + 16 * c);
              const __m512 od = _mm512_load_ps(o + (size_t)(8 + i) * D2 + 16 * c);
              _mm512_store_ps(ar + 32 * c, _mm512_fmadd_ps(_mm512_load_ps(ar + 32 * c), crr,
                                                           _mm512_permutex2var_ps(ev, even_odd_lo, od)));
              _mm512_store_ps(ar + 32 * c + 16, _mm512_fmadd_ps(_mm512_load_ps(ar + 32 * c + 16), crr,
                                                                _mm512_permutex2var_ps(ev, even_odd_hi, od)));
            }
          }
        }
      }
    }
  }
  _tile_release();
  for (int lg = 0; lg < NL; ++lg)  // each row's running max and sum where finish_rows takes them
    for (int hh = lg * HL; hh < std::min(NH, (lg + 1) * HL); ++hh)
      for (int g = 0; g < G; ++g) {
        const int r = hh * G + g, lane = (hh - lg * HL) * G + g;
        m[r] = gmax[lg * LANES + lane];
        lv[(size_t)r * TILE] = gsum[lg * LANES + lane];
      }
  finish_rows<at::BFloat16, false, NV>(P, it, R, acc, lv, m, partial);
}
