// The paged attention kernel's decode path for grouped-query heads on AMX tiles (cpu_paged_attention.cpp includes
// it inside its anonymous namespace, after the definitions it uses: Params, Item, key_rows, the prefetcher, the
// V interleave of the bf16 path, start_row, finish_rows; and amx_tiles.h before that namespace).
//
// What bounded the vector decode path (attend_decode_bf16) on a Xeon with AMX was not reading the cache but the
// work per key: each tile of K transposed into bf16 pairs (the loads of its rows and 64 shuffles per 32 values)
// and then q . k as vdpbf16ps, G rows of q each broadcast pair by pair. Here the scores come transposed instead,
// S^T = K Q^T, one tile product per 16 keys and 32 values of head_dim: K's rows are the A tile as the cache holds
// them (16 consecutive slots of a block, a cache row apart), q the B tile, arranged once per item (pairs of
// head_dim by query head). The kv heads of the item sit side by side in the 16 lanes of a tile of sums (G query
// heads each, as many kv heads as fit): each kv head's q fills its own lanes of the B tile and zeros the others,
// so that all of them sum into the same four tiles of 16 keys and one store writes whole rows of 16 lanes a key
// (1.02-1.05x a store per kv head into its lanes). The online softmax then runs with a row of 16 lanes per key,
// with no horizontal reduction.
//
// P.V runs on tiles too, a chunk of up to MAX_CHUNK keys at a time: the chunk's scores (steps of 64 keys) go to
// L2 with V interleaved by pairs of keys as each step's rows arrive (the B tiles, written long before the tiles
// read them: a tile load of what vector stores have just written waits for them); then one softmax step for the
// chunk, its probabilities as bf16 pairs of keys transposed lane by lane (the A tile: all 16 lanes, each kv
// head's product against its own V keeping its G rows), and the chunk's P.V summed in four tiles of sums over
// the chunk's keys, added to the running accumulators once. Measured on 2 cores of an Emerald Rapids Xeon, a
// layer with the KV from memory (`python benchmarks/attention_bench.py --versus-kernel ...`), against P.V with
// vdpbf16ps, 64 keys a step: Qwen2-0.5B (14 heads on 2, head_dim 64) 1.06-1.08x (batches 1-64, contexts 320 and
// 2000), Llama-3-8B's shape 1.06-1.16x, Qwen2.5-7B's 1.16-1.27x, an int8 cache 1.09-1.15x; P.V on tiles 64 keys
// a step 1.07-1.09x; chunks of 128, 256 or 512 keys alike. (Before that, the vector path against this one with
// P.V in vdpbf16ps: Qwen2-0.5B at batch 64, context 320 1.15-1.22x, 7-8B shapes 1.12-1.35x, 8-bit caches
// 1.18-1.30x.)
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
constexpr int MAX_CHUNK = 256;  // keys whose P.V runs at once on tiles
constexpr int CHUNK_V_BYTES = 1 << 17;  // a chunk's interleaved V (all the item's kv heads) at most
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// The tiles (all 16 rows of 64 bytes: folio::amx::TileConfig): 0-3 sums (S^T of a step's four tiles of 16 keys,
// or a chunk's P.V for four slices of 16 values of head_dim); scores: 4, 5 K rows in turn, 6 the q pairs; P.V: 4
// the probabilities, 5, 6 V's pairs in turn.

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

// P.V of 32 keys (chunk kc of the chunk's pairs) for the value slices c0 .. c0 + 3 of head_dim (those below NV):
// tile U += the probabilities in tile 4 (16 lanes x 16 pairs of keys) x V's pairs for slice c0 + U (vt: pair i of
// keys at vt + i * 16 NV words, slice c 16 words of it).
template <int NV, int U = 0>
inline void pv_tiles(const uint32_t* vt, int c0, int kc) {
  if constexpr (U < 4) {
    if (c0 + U < NV) {
      folio::amx::tile_load<5 + U % 2>(vt + ((size_t)16 * kc * NV + c0 + U) * 16, NV * 64);
      folio::amx::Bf16::dot<U, 4, 5 + U % 2>();
      pv_tiles<NV, U + 1>(vt, c0, kc);
    }
  }
}

// Tile U's 16 lanes x 16 values into slice c0 + U of o's rows (16 NV floats a lane).
template <int NV, int U = 0>
inline void store_pv_tiles(float* o, int c0) {
  if constexpr (U < 4) {
    if (c0 + U < NV) {
      folio::amx::tile_store<U>(o + 16 * (c0 + U), NV * 64);
      store_pv_tiles<NV, U + 1>(o, c0);
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
  const int qs = P.reqs[3 * it.b];
  // keys a chunk: their scores, probabilities and interleaved V wait in L2 for P.V on tiles
  const int CH = std::max(KEYS, std::min(MAX_CHUNK, CHUNK_V_BYTES / (NH * D * 2) / KEYS * KEYS));

  auto aligned = [](void* p) {
    return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
  };
  const size_t q8 = Q8 ? 2 * (size_t)NL * MAX_CHUNK * LANES + 2 * (size_t)HL * KEYS * D / 2 : 0;
  float* mem = thread_scratch().get((size_t)R * (D + TILE + 1) + (size_t)NL * LANES * 2 +
                                    (size_t)NL * MAX_CHUNK * LANES + MAX_CHUNK / 2 * LANES * 2 +
                                    (size_t)NH * MAX_CHUNK * D2 + (size_t)NH * NC * 256 + (size_t)LANES * D + q8 +
                                    3 * 16);
  float* acc = aligned(mem);
  float* lv = aligned(acc + (size_t)R * D);
  float* m = lv + (size_t)R * TILE;
  float* gmax = aligned(m + R);
  float* gsum = gmax + (size_t)NL * LANES;
  float* s = gsum + (size_t)NL * LANES;  // [NL, CH, 16]: scores, then their scaled and masked values
  uint32_t* pairs = reinterpret_cast<uint32_t*>(s + (size_t)NL * MAX_CHUNK * LANES);  // [CH / 2, 16]
  uint32_t* pt = pairs + MAX_CHUNK / 2 * LANES;  // [16, MAX_CHUNK / 2]: P lane by lane, the A tiles of P.V
  uint32_t* vt = pt + MAX_CHUNK / 2 * LANES;  // [NH, MAX_CHUNK / 2, D]: V by pairs of keys, the B tiles
  uint32_t* qp = vt + (size_t)NH * MAX_CHUNK * D2;
  float* o = reinterpret_cast<float*>(qp + (size_t)NH * NC * 256);  // P.V of a chunk [16, D]
  float* kscale = o + (size_t)LANES * D;  // [NL, CH, 16]
  float* vscale = kscale + (size_t)NL * MAX_CHUNK * LANES;
  at::BFloat16* kcodes = reinterpret_cast<at::BFloat16*>(vscale + (size_t)NL * MAX_CHUNK * LANES);
  at::BFloat16* vcodes = kcodes + (size_t)HL * KEYS * D;

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

  const folio::amx::TileConfig config;
  at::native::cpublas::brgemm_release(true);  // see folio::amx::ThreadTiles
  folio::amx::load_config(config);

  const C* kc = static_cast<const C*>(P.k_cache);
  const C* vc = static_cast<const C*>(P.v_cache);
  const int32_t* bt = P.block_tables + it.b * P.max_blocks;
  const int64_t row_stride = (int64_t)P.Hkv * RW;  // elements between consecutive slots of a block
  const __m512 sc = _mm512_set1_ps(P.scale_log2), ninf = _mm512_set1_ps(NEG_INF);
  // (p0[h], p1[h]) bf16 pairs from cvtne2ps_pbh(p1, p0) = [p0 lanes | p1 lanes]
  alignas(64) static const uint16_t pair_order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i pair_idx = _mm512_load_si512(pair_order);
  alignas(64) static const at::BFloat16 zero_row[256] = {};
  {  // the first keys' rows at once (see attend_decode_bf16)
    LinePrefetcher<KEYS> first;
    aim<C>(first, P, it, it.k0, 1);
    first.step();
  }
  const int start = it.k0 & ~15;
  for (int c0 = start; c0 < it.k1; c0 += CH) {
    const int nch = std::min(CH, it.k1 - c0), npairs = (nch + 1) / 2, nkc = (npairs + 15) / 16;
    // the chunk's steps of 64 keys: scores on tiles into s, V interleaved into vt
    for (int t0 = c0; t0 < c0 + nch; t0 += KEYS) {
      const int nt = std::min(KEYS, c0 + nch - t0), nsub = (nt + 15) / 16, j0 = t0 - c0;
      int64_t tok[KEYS];
      key_rows(P, bt, t0, nt, row_stride, tok);
      LinePrefetcher<KEYS> pf;
      if (t0 + KEYS < it.k1) aim<C>(pf, P, it, t0 + KEYS, NH * SUBS);
      else if (ahead) aim<C>(pf, P, *ahead, ahead->k0, NH * SUBS);
      const int lo = std::max(0, it.k0 - t0);  // keys [lo, nt) of the step are the item's
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
            at::BFloat16* vd = vcodes + (size_t)(hh - hb) * KEYS * D;
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
          }
        }
        store_score_tiles(sl, nsub);
        for (int hh = hb; hh < he; ++hh) {
          const at::BFloat16* vp[KEYS];
          for (int j = 0; j < nt; ++j) {
            if (j < lo) vp[j] = zero_row;
            else if constexpr (Q8) vp[j] = vcodes + ((size_t)(hh - hb) * KEYS + j) * D;
            else vp[j] = reinterpret_cast<const at::BFloat16*>(vc + tok[j] + (int64_t)(it.h0 + hh) * RW);
          }
          uint32_t* vth = vt + ((size_t)hh * MAX_CHUNK / 2 + j0 / 2) * D;
          for (int u = 0; u < nsub; ++u) {
            interleave_v_tile<NC>(vp + 16 * u, std::min(16, nt - 16 * u), vth + (size_t)8 * u * D);
            pf.step();
          }
        }
      }
      pf.per_step = KEYS;  // what a short last step's fewer calls left
      pf.step();
    }
    const int mlo = std::max(0, it.k0 - c0);  // keys [mlo, nch) of the chunk are the item's
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
      // probabilities in bf16 pairs of keys (8-bit: times each value's scale first, as the vector path), zero
      // up to the last chunk of 32 keys' end
      auto probability = [&](int j) {
        if (j >= nch) return std::make_pair(_mm512_setzero_ps(), _mm512_setzero_ps());
        const __m512 p = exp2_ps(_mm512_sub_ps(_mm512_load_ps(sl + j * LANES), mn));
        if constexpr (Q8)
          return std::make_pair(
              p, _mm512_mul_ps(p, _mm512_permutexvar_ps(lane_heads, _mm512_load_ps(vsl + j * LANES))));
        return std::make_pair(p, p);
      };
      __m512 sum = _mm512_mul_ps(_mm512_load_ps(gsum + lg * LANES), cr);
      for (int jp = 0; jp < 16 * nkc; ++jp) {
        const auto [p0, w0] = probability(2 * jp);
        const auto [p1, w1] = probability(2 * jp + 1);
        sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
        _mm512_store_si512(pairs + jp * LANES,
                           _mm512_permutexvar_epi16(pair_idx, (__m512i)_mm512_cvtne2ps_pbh(w1, w0)));
      }
      _mm512_store_ps(gsum + lg * LANES, sum);
      for (int k = 0; k < nkc; ++k) {  // P lane by lane: pt[lane][pair]
        __m512i r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(pairs + (16 * k + i) * LANES);
        transpose16x16(r);
        for (int l = 0; l < LANES; ++l) _mm512_store_si512(pt + l * (MAX_CHUNK / 2) + 16 * k, r[l]);
      }
      // acc_r = acc_r * corr_r + sum_j p_rj v_j: P.V of all 16 lanes on tiles against each kv head's V, its G
      // rows kept
      for (int hh = hb; hh < he; ++hh) {
        uint32_t* vth = vt + (size_t)hh * MAX_CHUNK / 2 * D;
        std::fill(vth + (size_t)npairs * D, vth + (size_t)16 * nkc * D, 0u);  // past the chunk's keys
        for (int cv = 0; cv < NV; cv += 4) {
          zero_sum_tiles();
          for (int k = 0; k < nkc; ++k) {
            folio::amx::tile_load<4>(pt + 16 * k, 4 * (MAX_CHUNK / 2));
            pv_tiles<NV>(vth, cv, k);
          }
          store_pv_tiles<NV>(o, cv);
        }
        for (int g = 0; g < G; ++g) {
          const int r = hh * G + g, lane = (hh - hb) * G + g;
          const __m512 crr = _mm512_set1_ps(lane_corr[lane]);
          float* ar = acc + (size_t)r * D;
          const float* orow = o + (size_t)lane * D;
          for (int c = 0; c < NV; ++c)
            _mm512_store_ps(ar + 16 * c,
                            _mm512_fmadd_ps(_mm512_load_ps(ar + 16 * c), crr, _mm512_load_ps(orow + 16 * c)));
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
  finish_rows<at::BFloat16, true, NV>(P, it, R, acc, lv, m, partial);
}
