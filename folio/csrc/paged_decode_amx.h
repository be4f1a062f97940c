// The paged attention kernel's decode path for grouped-query heads on AMX tiles (cpu_paged_attention.cpp includes
// it inside its anonymous namespace, after the definitions it uses: Params, Item, key_rows, the prefetcher, the
// V interleave and P.V of the bf16 path, start_row, finish_rows; and amx_tiles.h before that namespace).
//
// What bounded the vector decode path (attend_decode_bf16) on a Xeon with AMX was not reading the cache but the
// work per key: each tile of K transposed into bf16 pairs (the loads of its rows and 64 shuffles per 32 values)
// and then q . k as vdpbf16ps, G rows of q each broadcast pair by pair. Here the scores come transposed instead,
// S^T = K Q^T, one tile product per 16 keys and 32 values of head_dim: K's rows are the A tile as the cache holds
// them (16 consecutive slots of a block, a cache row apart), q the B tile, arranged once per item (pairs of
// head_dim by query head). A tile of sums is then 16 keys by the query heads of one kv head; the kv heads of the
// item sit side by side in its 16 lanes (G query heads each, as many kv heads as fit), so that the online softmax
// runs with a row of 16 lanes per key: the running max of every query head moves once per 64 keys, with no
// horizontal reduction. P.V stays with vdpbf16ps on V interleaved by pairs of keys, the probabilities of a pair
// of keys for each query head made by one conversion and one permutation per pair. (P.V on tiles as well, P
// transposed to lanes by pairs of keys and V interleaved as the B tile, measured 0.92-1.02x on Qwen2-0.5B: the
// kernel then waits on the cache rows' arrival, and a tile load of what vector stores just wrote stalls.)
// Measured on 2 cores of an Emerald Rapids Xeon against the vector path, a layer with the KV from memory:
// Qwen2-0.5B (14 heads on 2, head_dim 64) at batch 64 and context 320 1.15-1.22x, Qwen2.5-7B's and Llama-3-8B's
// shapes 1.12-1.35x, int8 and fp8 caches 1.18-1.30x.
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

constexpr int KEYS = 64;  // keys per softmax step
constexpr int SUBS = KEYS / 16;  // tiles of 16 keys per step
constexpr int LANES = 16;  // query heads of the kv heads side by side in one tile of sums
constexpr int PF_PV_EVERY = 2;  // the next keys' prefetches step every PF_PV_EVERY pairs of keys in P.V
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// Tiles 0-3: S^T of the 4 tiles of 16 keys (16 keys x G float32); 4, 5: K rows (16 keys x 32 bf16, in turn);
// 6: q arranged as pairs (16 pairs of head_dim x G query heads).
struct alignas(64) ScoresConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  explicit ScoresConfig(int G) {
    for (int t = 0; t < 7; ++t) {
      rows[t] = 16;
      colsb[t] = t == 4 || t == 5 ? 64 : static_cast<uint16_t>(4 * G);
    }
  }
};

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
inline void zero_score_tiles() {
  if constexpr (U < SUBS) {
    folio::amx::tile_zero<U>();
    zero_score_tiles<U + 1>();
  }
}

// Tile U's 16 x G sums into rows 16 U .. of s (16 floats a key), at lane `lane`.
template <int U = 0>
inline void store_score_tiles(float* s, int lane, int nsub) {
  if constexpr (U < SUBS) {
    if (U < nsub) {
      folio::amx::tile_store<U>(s + 16 * LANES * U + lane, 4 * LANES);
      store_score_tiles<U + 1>(s, lane, nsub);
    }
  }
}

}  // namespace amx_decode

template <typename C, int NC>
void attend_decode_amx(const Params& P, const Item& it, float* partial, const Item* ahead) {
  using namespace amx_decode;
  constexpr int NV = 2 * NC, D = NV * 16, D2 = D / 2;
  constexpr int RC = NV >= 24 ? 1 : 24 / NV;  // rows whose V accumulators stay in registers together
  constexpr bool Q8 = Cache<C>::QUANTIZED;
  constexpr int RW = D + Cache<C>::SCALE_BYTES;  // elements of a cache row
  const int G = P.G, NH = it.h1 - it.h0, R = G * NH;
  const int HL = LANES / G;  // kv heads side by side in the lanes
  const int NL = (NH + HL - 1) / HL;  // lane groups
  const int qs = P.reqs[3 * it.b];

  // acc [R, D], lv [R, TILE], m [R], each row's correction [R], the lane groups' running max and sum [NL, 16],
  // s [KEYS, 16], pairs [KEYS / 2, 16], vt [KEYS * D2], q pairs [NH, NC, 16, 16]; 8-bit: each key's K and V
  // scales by kv head of the lane group [KEYS, 16] each, the step's K and V codes as bf16 [HL, KEYS, D] each
  const size_t q8 = Q8 ? 2 * KEYS * LANES + (size_t)HL * KEYS * D : 0;
  float* mem = thread_scratch().get((size_t)R * (D + TILE + 2) + (size_t)NL * LANES * 2 + KEYS * LANES * 2 +
                                    KEYS * D2 + (size_t)NH * NC * 256 + q8 + 64);
  float* acc = mem;
  float* lv = acc + (size_t)R * D;
  float* m = lv + (size_t)R * TILE;
  float* corr = m + R;
  float* gmax = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(corr + R) + 63) & ~uintptr_t(63));
  float* gsum = gmax + (size_t)NL * LANES;
  float* s = gsum + (size_t)NL * LANES;  // aligned: the above are multiples of 16 floats
  uint32_t* pairs = reinterpret_cast<uint32_t*>(s + KEYS * LANES);
  uint32_t* vt = pairs + KEYS / 2 * LANES;
  uint32_t* qp = vt + KEYS * D2;
  float* kscale = reinterpret_cast<float*>(qp + (size_t)NH * NC * 256);
  float* vscale = kscale + KEYS * LANES;
  at::BFloat16* kcodes = reinterpret_cast<at::BFloat16*>(vscale + KEYS * LANES);
  at::BFloat16* vcodes = kcodes + (size_t)HL * KEYS * D;

  // q pairs for the B tile: qp[((hh * NC + c) * 16 + p) * 16 + g] = (q_g[64 c + 2 p], q_g[64 c + 2 p + 1]) of
  // query head (h0 + hh) * G + g
  const uint32_t* q0 = reinterpret_cast<const uint32_t*>(static_cast<const at::BFloat16*>(P.q) +
                                                         (int64_t)(qs + it.q0) * P.q_st + (int64_t)it.h0 * G * P.q_sh);
  for (int hh = 0; hh < NH; ++hh)
    for (int g = 0; g < G; ++g) {
      const uint32_t* qr = q0 + ((int64_t)(hh * G + g) * P.q_sh) / 2;
      for (int d2 = 0; d2 < D2; ++d2) qp[((hh * NC + d2 / 16) * 16 + d2 % 16) * 16 + g] = qr[d2];
    }
  for (int r = 0; r < R; ++r) start_row<NV>(acc, lv, m, r);
  for (int i = 0; i < NL * LANES; ++i) {
    gmax[i] = NEG_INF;
    gsum[i] = 0.f;
  }
  std::fill(s, s + KEYS * LANES, 0.f);  // the lanes no kv head fills stay finite
  alignas(64) int32_t head_of_lane[LANES];  // lane -> kv head of its lane group (8-bit scales)
  for (int l = 0; l < LANES; ++l) head_of_lane[l] = std::min(l / G, HL - 1);
  const __m512i lane_heads = _mm512_load_si512(head_of_lane);

  const ScoresConfig config(G);
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
  const int steps_per_tile = NH * ((G + RC - 1) / RC) * (KEYS / 2 / PF_PV_EVERY);
  {  // the first keys' rows at once (see attend_decode_bf16)
    LinePrefetcher<KEYS> first;
    aim<C>(first, P, it, it.k0, 1);
    first.step();
  }
  const int start = it.k0 & ~15;
  for (int t0 = start; t0 < it.k1; t0 += KEYS) {
    const int nt = std::min(KEYS, it.k1 - t0), nsub = (nt + 15) / 16;
    int64_t tok[KEYS];
    key_rows(P, bt, t0, nt, row_stride, tok);
    LinePrefetcher<KEYS> pf;
    if (t0 + KEYS < it.k1) aim<C>(pf, P, it, t0 + KEYS, steps_per_tile);
    else if (ahead) aim<C>(pf, P, *ahead, ahead->k0, steps_per_tile);
    const int lo = std::max(0, it.k0 - t0);  // keys [lo, nt) of the step are the item's

    for (int lg = 0; lg < NL; ++lg) {
      const int hb = lg * HL, he = std::min(NH, hb + HL);
      // scores: S^T of each kv head into its G lanes of s (an 8-bit cache's codes taken exactly into bf16 rows
      // first, with each key's scales, as the vector path takes them)
      for (int hh = hb; hh < he; ++hh) {
        const int64_t hoff = (int64_t)(it.h0 + hh) * RW;
        const uint8_t* a[SUBS];
        int64_t stride = row_stride * (int64_t)sizeof(C);
        if constexpr (Q8) {
          at::BFloat16* kd = kcodes + (size_t)(hh - hb) * KEYS * D;
          at::BFloat16* vd = vcodes + (size_t)(hh - hb) * KEYS * D;
          for (int j = 0; j < nt; ++j) {
            const C* kr = kc + tok[j] + hoff;
            const C* vr = vc + tok[j] + hoff;
            kscale[j * LANES + hh - hb] = Cache<C>::scale(kr, D);
            vscale[j * LANES + hh - hb] = Cache<C>::scale(vr, D);
            exact_codes(kr, kd + (size_t)j * D, NC);
            exact_codes(vr, vd + (size_t)j * D, NC);
          }
          for (int u = 0; u < nsub; ++u) a[u] = reinterpret_cast<const uint8_t*>(kd + (size_t)16 * u * D);
          stride = D * 2;
        } else {
          for (int u = 0; u < nsub; ++u) a[u] = reinterpret_cast<const uint8_t*>(kc + tok[16 * u] + hoff);
        }
        zero_score_tiles();
        for (int c = 0; c < NC; ++c) {
          folio::amx::tile_load<6>(qp + (size_t)(hh * NC + c) * 256, 64);
          const uint8_t* ac[SUBS];
          for (int u = 0; u < nsub; ++u) ac[u] = a[u] + 64 * c;
          score_tiles(ac, stride, nsub);
        }
        store_score_tiles(s, (hh - hb) * G, nsub);
      }
      // the online softmax of the lanes' query heads over the step's keys
      __m512 mx = ninf;
      for (int j = 0; j < nt; ++j) {
        const __m512 ks = Q8 ? _mm512_mul_ps(_mm512_permutexvar_ps(lane_heads, _mm512_load_ps(kscale + j * LANES)), sc)
                             : sc;
        __m512 x = _mm512_mul_ps(_mm512_load_ps(s + j * LANES), ks);
        if (P.softcap2 > 0.f)
          x = _mm512_mul_ps(tanh_ps(_mm512_mul_ps(x, _mm512_set1_ps(P.inv_softcap2))), _mm512_set1_ps(P.softcap2));
        if (j < lo) x = ninf;
        _mm512_store_ps(s + j * LANES, x);
        mx = _mm512_max_ps(mx, x);
      }
      const __m512 mo = _mm512_load_ps(gmax + lg * LANES);
      const __m512 mn = _mm512_max_ps(mo, mx);  // finite in the lanes that hold query heads
      const __m512 cr = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mo, mn, _CMP_EQ_OQ), exp2_ps(_mm512_sub_ps(mo, mn)),
                                             _mm512_set1_ps(1.f));
      _mm512_store_ps(gmax + lg * LANES, mn);
      alignas(64) float lane_corr[LANES];
      _mm512_store_ps(lane_corr, cr);
      for (int hh = hb; hh < he; ++hh)
        for (int g = 0; g < G; ++g) corr[hh * G + g] = lane_corr[(hh - hb) * G + g];
      // probabilities in bf16 pairs of keys (8-bit: times each value's scale first, as the vector path)
      auto probability = [&](int j) {
        if (j >= nt) return std::make_pair(_mm512_setzero_ps(), _mm512_setzero_ps());
        const __m512 p = exp2_ps(_mm512_sub_ps(_mm512_load_ps(s + j * LANES), mn));
        if constexpr (Q8)
          return std::make_pair(p, _mm512_mul_ps(p, _mm512_permutexvar_ps(lane_heads, _mm512_load_ps(vscale + j * LANES))));
        return std::make_pair(p, p);
      };
      __m512 sum = _mm512_mul_ps(_mm512_load_ps(gsum + lg * LANES), cr);
      for (int jp = 0; 2 * jp < nt; ++jp) {
        const auto [p0, w0] = probability(2 * jp);
        const auto [p1, w1] = probability(2 * jp + 1);
        sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
        _mm512_store_si512(pairs + jp * LANES,
                           _mm512_permutexvar_epi16(pair_idx, (__m512i)_mm512_cvtne2ps_pbh(w1, w0)));
      }
      _mm512_store_ps(gsum + lg * LANES, sum);
      // acc_r = acc_r * corr_r + sum_j p_rj v_j for each kv head's rows
      for (int hh = hb; hh < he; ++hh) {
        const at::BFloat16* vp[KEYS];
        for (int j = 0; j < nt; ++j) {
          if (j < lo) vp[j] = zero_row;
          else if constexpr (Q8) vp[j] = vcodes + ((size_t)(hh - hb) * KEYS + j) * D;
          else vp[j] = reinterpret_cast<const at::BFloat16*>(vc + tok[j] + (int64_t)(it.h0 + hh) * RW);
        }
        interleave_v_tile<NC>(vp, nt, vt);
        const int lane0 = (hh - hb) * G;
        for (int g0 = 0; g0 < G; g0 += RC) {
          const int rc = std::min(RC, G - g0), r0 = hh * G + g0;
          __m512 av[RC][NV];
          load_corrected<NV, RC>(av, acc, corr, r0, rc);
          pv_pairs_bf16<NV, RC>(av, pairs + lane0 + g0, 1, LANES, vt, nt, rc, [&](int jp) {
            if (jp % PF_PV_EVERY == 0) pf.step();
          });
          store_rows<NV, RC>(av, acc, r0, rc);
        }
      }
    }
    pf.per_step = KEYS;  // what a short last step's fewer pairs left
    pf.step();
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
