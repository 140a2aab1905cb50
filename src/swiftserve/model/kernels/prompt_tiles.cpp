// Tiled attention for prompt chunks on AMX CPUs (issue 24).
//
// The row kernel (paged_decode.cpp) answers every prompt row as its own query and so reads a
// request's whole K/V once per row; SDPA needs the context gathered out of the paged cache
// first. Here a query tile is 16 consecutive query positions of one query head: it walks the
// request's keys 32 at a time, reading K straight from the paged cache through the block
// table, and every K/V tile it loads serves 16 queries. A work item is up to 8 query tiles of
// one KV head's query heads; it takes the keys in chunks of 1,024 and runs every (tile, head)
// over a chunk while the chunk is in L2, so K and V come from L3 once per item, not once per
// tile (that alone took 20-25% off a 2,048-token chunk after 4k-10k tokens). Orientation
// (chosen so that nothing on the hot path needs a transpose):
//   S^T [32 keys x 16 queries] = K [keys x dims] . Q^T      (A = K rows as they sit in a block,
//                                                             B = Q^T packed once per item)
//   softmax runs down the key rows: one zmm holds 16 queries, so max/exp/sum are vertical ops
//   O^T [64 dims x 16 queries] += V^T [dims x keys] . P^T   (A = V^T packed once per request
//                                                             and KV head, B = P^T in pairs)
// O^T stays in four tile registers while a (tile, head) walks a chunk. Measured on the Xeon
// this was tuned on: the AMX and the vector work of a group do not overlap (their times add,
// even with no data dependence between them), so each side is kept short on its own.
// Online softmax with lazy rescaling:
// the running max used for exp only moves when a query's max grows by more than 2^8 (then
// the accumulators are rescaled once), so probabilities stay <= 256 and the usual per-block
// rescale of the output is skipped. Probabilities are rounded to bf16 for P.V, as PyTorch's
// CPU flash attention does for bf16 inputs; they are built as bf16 bits directly, from a
// 128-entry table of 2^(j/128) (see `probabilities`).
//
// q: [T, H, 64] bf16, rows may be strided (a view of the fused q/k/v output); caches [KVH, NB, BS, 64] bf16 with BS % 16 == 0;
// tables [R, nb] int64; runs [R, 3] int64 = (first query row, rows, position of the first
// row): row i of run r is a query at position runs[r,2] + i that sees keys up to itself
// (within `window` when window > 0). Results are written into `out` rows of the runs only.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>

#include "amx.h"
#include "ops.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define SWIFTSERVE_AMX 1
#include <omp.h>
#endif

#ifdef SWIFTSERVE_AMX
namespace {
using namespace swiftserve_amx;

constexpr int64_t TQ = 16;  // query positions per item (tile columns)
constexpr int64_t TK = 32;  // keys per step (two 16-key tiles; one P^T tile)
constexpr int64_t D = 64;   // head_dim covered (O^T = 4 tiles of 16 dims)
constexpr float kRescaleAt = 8.f;  // log2 units: rescale when a max grows past 2^8

struct Run {
  int64_t row, n, pos;  // first query row, rows, position of the first row
  int64_t lo, groups;   // first packed key (a multiple of TK) and how many TK-key groups
  int64_t packed;       // offset of this run's V^T in the packed buffer (bf16 elements)
};

struct Problem {
  const c10::BFloat16 *q, *kc, *vc;
  c10::BFloat16* out;
  const int64_t* tables;
  int64_t H, KVH, G, NB, BS, nb, window;
  int64_t q_stride;  // elements between query rows
  float c;  // scale * log2(e): scores go straight to exp2 units
  const Run* runs;
  c10::BFloat16* vt;  // packed V^T: per (run, kv head, group) [64 dims][32 keys]
};

inline const c10::BFloat16* cache_row(const Problem& p, const c10::BFloat16* cache, int64_t r, int64_t h,
                                      int64_t key) {
  const int64_t block = p.tables[r * p.nb + key / p.BS];
  return cache + ((h * p.NB + block) * p.BS + key % p.BS) * D;
}

// V^T of one group of 32 keys: dst[d * 32 + k] = V[lo + 32 * group + k][d]; zero past the run's
// last key (rows there may hold anything, and 0 * NaN would poison the sums).
void pack_values(const Problem& p, int64_t r, int64_t h, int64_t group) {
  const Run& run = p.runs[r];
  c10::BFloat16* dst = p.vt + run.packed + (h * run.groups + group) * D * TK;
  const int64_t end = run.pos + run.n;
  for (int64_t half = 0; half < 2; ++half) {  // dims 0-31, then 32-63
    __m512i m[32];
    for (int64_t k = 0; k < TK; ++k) {
      const int64_t key = run.lo + group * TK + k;
      m[k] = key < end ? _mm512_loadu_si512(cache_row(p, p.vc, r, h, key) + half * 32) : _mm512_setzero_si512();
    }
    transpose32x32_u16(m);
    for (int64_t d = 0; d < 32; ++d) _mm512_store_si512(dst + (half * 32 + d) * TK, m[d]);
  }
}

constexpr int64_t kMaxGroup = 8;     // query heads per KV head handled in one item
constexpr int64_t kChunkGroups = 32;  // 1,024 keys (256 KB of K and V^T) stay in L2 across an item
constexpr int64_t kItemTiles = 8;    // query tiles per item: each chunk of K/V serves them all
constexpr int64_t kSlots = kMaxGroup * kItemTiles;

struct Scratch {
  alignas(64) uint32_t qt[kSlots][2][16][16];  // Q^T pairs per (tile, head), per 32-dim half
  alignas(64) float o[kSlots][D][16];          // O^T per (tile, head) between key chunks
  alignas(64) float m[kSlots][16];             // max used for exp2, per (tile, head) and query
  alignas(64) float l[kSlots][16];             // softmax denominators
  alignas(64) float s[TK][16];                    // S^T of the current 32 keys
  alignas(64) uint16_t pt[2][16][32];             // P^T pairs: [key pair][query][2], two groups
  alignas(64) float tmp[D][16];                   // O^T during a rescale
};

struct Query {
  int64_t qa, qb;     // first and last query position of the item
  __m512i pos;        // per lane (padding lanes repeat the last position)
};

inline void store_o(float (*o)[16]) {
  _tile_stored(0, o[0], 64);
  _tile_stored(1, o[16], 64);
  _tile_stored(2, o[32], 64);
  _tile_stored(3, o[48], 64);
}

inline void load_o(float (*o)[16]) {
  _tile_loadd(0, o[0], 64);
  _tile_loadd(1, o[16], 64);
  _tile_loadd(2, o[32], 64);
  _tile_loadd(3, o[48], 64);
}

// Starts S^T (tiles 4-5: [key][query]) of the 32 keys from k0 for one head; the caller stores
// it once the previous group's softmax is under way, so the AMX unit and the vector units
// overlap.
inline void issue_scores(const Problem& p, int64_t r, int64_t h, int64_t k0, const Query& qy,
                         uint32_t (*qt)[16][16]) {
  _tile_zero(4);
  _tile_zero(5);
  const c10::BFloat16* k_lo = cache_row(p, p.kc, r, h, k0);
  const bool hi_live = k0 + 16 <= qy.qb;  // else those keys are all in the future
  const c10::BFloat16* k_hi = hi_live ? cache_row(p, p.kc, r, h, k0 + 16) : nullptr;
  for (int64_t half = 0; half < 2; ++half) {
    _tile_loadd(7, qt[half], 64);
    _tile_loadd(6, k_lo + half * 32, D * 2);
    _tile_dpbf16ps(4, 6, 7);
    if (hi_live) {
      _tile_loadd(6, k_hi + half * 32, D * 2);
      _tile_dpbf16ps(5, 6, 7);
    }
  }
}

// 2^(j/128) for j = 0..127 as the 7 mantissa bits of a bf16 (rounded to nearest even): one
// 128-byte table, two zmm, that a single vpermt2b looks up for 32 probabilities at once.
struct ExpTable {
  alignas(64) uint8_t mant[128];
  ExpTable() {
    for (int j = 0; j < 128; ++j) {
      const float v = std::exp2(static_cast<float>(j) / 128.f);
      uint32_t b;
      std::memcpy(&b, &v, 4);
      b += 0x7fff + ((b >> 16) & 1);
      mant[j] = static_cast<uint8_t>((b >> 16) & 0x7f);
    }
  }
};
const ExpTable kExpTable;
constexpr float kSteps = 128.f;  // x is rounded to 1/128: 2^x off by <= 0.27% before bf16's own 0.39%

// P^T pairs (bf16) into pt from the scores, and their sum into l. Built straight as bf16 bits,
// 32 lanes at a time, instead of a float exp and a conversion (1.2x the kernel at depth):
// one fma gives u = 128 * (x + 127), x = s * c - m, rounded, as the low bits of a float (the
// 1.5 * 2^23 trick; m is a multiple of 1/128, so nothing else rounds); u's high bits are then
// exactly the bf16 exponent field of 2^x and its low 7 bits index the mantissa table. The sums
// are dot products of the bf16 probabilities with ones: the same rounded values that P.V uses.
inline void probabilities(const float (*s)[16], __m512 c, __m512 m_eff, __m512& l, uint16_t (*pt)[32]) {
  const __m512 magic = _mm512_set1_ps(12582912.f);
  const __m512 c_steps = _mm512_mul_ps(c, _mm512_set1_ps(kSteps));
  const __m512 bias = _mm512_sub_ps(_mm512_add_ps(magic, _mm512_set1_ps(127.f * kSteps)),
                                    _mm512_mul_ps(m_eff, _mm512_set1_ps(kSteps)));
  // x >= -126 (the least normal exponent): -inf and NaN scores (masked keys) come out ~1e-38
  const __m512 floor = _mm512_add_ps(magic, _mm512_set1_ps(kSteps));
  const __m512i tab_lo = _mm512_load_si512(kExpTable.mant), tab_hi = _mm512_load_si512(kExpTable.mant + 64);
  // word 2n = low word of lane n of the first vector, word 2n + 1 the same of the second
  const __m512i pair_idx = _mm512_set_epi16(62, 30, 60, 28, 58, 26, 56, 24, 54, 22, 52, 20, 50, 18, 48, 16, 46,
                                            14, 44, 12, 42, 10, 40, 8, 38, 6, 36, 4, 34, 2, 32, 0);
  const __m512i expo = _mm512_set1_epi16(static_cast<short>(0xff80));
  const __m512i one_bits = _mm512_set1_epi16(0x3f80);
  const __m512bh ones = reinterpret_cast<const __m512bh&>(one_bits);
  const auto pair = [&](int64_t j) {
    const __m512 t0 = _mm512_max_ps(_mm512_fmadd_ps(_mm512_load_ps(s[j]), c_steps, bias), floor);
    const __m512 t1 = _mm512_max_ps(_mm512_fmadd_ps(_mm512_load_ps(s[j + 1]), c_steps, bias), floor);
    const __m512i u = _mm512_permutex2var_epi16(_mm512_castps_si512(t0), pair_idx, _mm512_castps_si512(t1));
    // bytes: the low byte of each word indexes with u's bits 0-6 (its high byte is discarded)
    const __m512i mant = _mm512_permutex2var_epi8(tab_lo, u, tab_hi);
    const __m512i bits = _mm512_ternarylogic_epi32(u, expo, mant, 0xe2);  // (u & expo) | (mant & ~expo)
    _mm512_store_si512(pt[j / 2], bits);
    return reinterpret_cast<const __m512bh&>(bits);
  };
  // Two sums in named registers: an array indexed by the loop counter stayed in memory, and
  // its store-to-load chain was the longest path of the loop.
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  for (int64_t j = 0; j < TK; j += 4) {
    sum0 = _mm512_dpbf16_ps(sum0, pair(j), ones);
    sum1 = _mm512_dpbf16_ps(sum1, pair(j + 2), ones);
  }
  l = _mm512_add_ps(l, _mm512_add_ps(sum0, sum1));
}

// Scores of keys a query may not see (in its future, or out of the window) set to -inf.
inline void mask_scores(const Problem& p, int64_t k0, const Query& qy, float (*s)[16]) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i oldest = _mm512_sub_epi32(qy.pos, _mm512_set1_epi32(static_cast<int>(p.window)));
  for (int64_t j = 0; j < TK; ++j) {
    const __m512i key = _mm512_set1_epi32(static_cast<int>(k0 + j));
    __mmask16 ok = _mm512_cmple_epi32_mask(key, qy.pos);
    if (p.window > 0) ok &= _mm512_cmpgt_epi32_mask(key, oldest);
    _mm512_store_ps(s[j], _mm512_mask_blend_ps(ok, neg_inf, _mm512_load_ps(s[j])));
  }
}

// Online softmax of w.s against (m, l) and O^T (tiles 0-3) += V^T . P^T.
inline void softmax(const Problem& p, int64_t k0, const Query& qy, __m512& m_used, __m512& l, bool started,
                    uint16_t (*pt)[32], Scratch& w) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m512 c = _mm512_set1_ps(p.c);
  const bool edge = k0 + TK - 1 > qy.qa || (p.window > 0 && k0 <= qy.qb - p.window);
  // Two passes over the scores in L1 (max, then exp) rather than 32 zmm held across both:
  // that many live registers spilled.
  if (edge) mask_scores(p, k0, qy, w.s);
  // four running maxima in named registers: one chain of 32 dependent vmaxps (or an array
  // indexed by the counter, which stays in memory) was on every group's critical path
  __m512 mx0 = _mm512_set1_ps(neg_inf), mx1 = mx0, mx2 = mx0, mx3 = mx0;
  for (int64_t j = 0; j < TK; j += 4) {
    mx0 = _mm512_max_ps(mx0, _mm512_load_ps(w.s[j]));
    mx1 = _mm512_max_ps(mx1, _mm512_load_ps(w.s[j + 1]));
    mx2 = _mm512_max_ps(mx2, _mm512_load_ps(w.s[j + 2]));
    mx3 = _mm512_max_ps(mx3, _mm512_load_ps(w.s[j + 3]));
  }
  const __m512 mx = _mm512_max_ps(_mm512_max_ps(mx0, mx1), _mm512_max_ps(mx2, mx3));
  // rounded up to a multiple of 1/128, so that x's steps line up with the table's exactly
  const __m512 m_new = _mm512_mul_ps(
      _mm512_roundscale_ps(_mm512_mul_ps(_mm512_mul_ps(mx, c), _mm512_set1_ps(kSteps)), _MM_FROUND_TO_POS_INF),
      _mm512_set1_ps(1.f / kSteps));
  const __mmask16 grow = _mm512_cmp_ps_mask(m_new, _mm512_add_ps(m_used, _mm512_set1_ps(kRescaleAt)), _CMP_GT_OQ);
  if (grow) {
    const __m512 alpha = _mm512_mask_blend_ps(grow, _mm512_set1_ps(1.f), exp2_ps(_mm512_sub_ps(m_used, m_new)));
    if (started) {
      store_o(w.tmp);
      for (int64_t d = 0; d < D; ++d) _mm512_store_ps(w.tmp[d], _mm512_mul_ps(_mm512_load_ps(w.tmp[d]), alpha));
      load_o(w.tmp);
    }
    l = _mm512_mul_ps(l, alpha);
    m_used = _mm512_mask_mov_ps(m_used, grow, m_new);
  }
  // lanes that have seen no key yet keep -inf: use 0 there (their scores are -inf too)
  const __m512 m_eff = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m_used, _mm512_set1_ps(neg_inf), _CMP_EQ_OQ),
                                            m_used, _mm512_setzero_ps());
  probabilities(w.s, c, m_eff, l, pt);
}

// O^T (tiles 0-3) += V^T . P^T for one group of 32 keys.
inline void issue_values(const c10::BFloat16* vt, uint16_t (*pt)[32]) {
  _tile_loadd(7, pt, 64);
  _tile_loadd(6, vt, 64);
  _tile_dpbf16ps(0, 6, 7);
  _tile_loadd(6, vt + 16 * TK, 64);
  _tile_dpbf16ps(1, 6, 7);
  _tile_loadd(6, vt + 32 * TK, 64);
  _tile_dpbf16ps(2, 6, 7);
  _tile_loadd(6, vt + 48 * TK, 64);
  _tile_dpbf16ps(3, 6, 7);
}

// What an item keeps per query tile: positions, the groups of keys it sees, rows that exist.
struct Tiles {
  Query qy[kItemTiles];
  int64_t lo[kItemTiles], hi[kItemTiles], valid[kItemTiles];
  int64_t first_group = std::numeric_limits<int64_t>::max(), last_group = 0;
};

// The item's query tiles: their positions and key ranges, Q^T in pairs per (tile, head)
// (padding columns repeat the last query) and fresh softmax state.
void start_item(const Problem& p, int64_t r, int64_t h, int64_t tile0, int64_t tiles, int64_t g0, int64_t G,
                Tiles& ts, Scratch& w) {
  const Run& run = p.runs[r];
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t first = (tile0 + t) * TQ;
    ts.valid[t] = std::min<int64_t>(TQ, run.n - first);
    Query& qy = ts.qy[t];
    qy.qa = run.pos + first;
    qy.qb = qy.qa + ts.valid[t] - 1;
    qy.pos = _mm512_min_epi32(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(qy.qa)), lane),
                              _mm512_set1_epi32(static_cast<int>(qy.qb)));
    ts.lo[t] = p.window > 0 ? std::max<int64_t>(0, (qy.qa - p.window + 1 - run.lo) / TK) : 0;
    ts.hi[t] = (qy.qb - run.lo) / TK;
    ts.first_group = std::min(ts.first_group, ts.lo[t]);
    ts.last_group = std::max(ts.last_group, ts.hi[t]);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t slot = t * G + g;
      for (int64_t n = 0; n < TQ; ++n) {
        const int64_t row = run.row + first + std::min(n, ts.valid[t] - 1);
        const uint32_t* src = reinterpret_cast<const uint32_t*>(p.q + row * p.q_stride + (h * p.G + g0 + g) * D);
        for (int64_t half = 0; half < 2; ++half)
          for (int64_t pair = 0; pair < 16; ++pair) w.qt[slot][half][pair][n] = src[half * 16 + pair];
      }
      _mm512_store_ps(w.m[slot], _mm512_set1_ps(-std::numeric_limits<float>::infinity()));
      _mm512_store_ps(w.l[slot], _mm512_setzero_ps());
    }
  }
}

// One (tile, head) over key groups [from, to]: O^T in tiles 0-3 (from w.o unless it starts
// here), software-pipelined: while the vector units run the softmax of group j, the AMX unit
// has P.V of group j - 1 and the scores of group j + 1 queued (issued just before).
void walk(const Problem& p, int64_t r, int64_t h, const Query& qy, int64_t from, int64_t to, int64_t slot,
          bool started, Scratch& w) {
  const Run& run = p.runs[r];
  const c10::BFloat16* vt = p.vt + run.packed + h * run.groups * D * TK;
  if (started) {
    load_o(w.o[slot]);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  __m512 m_used = _mm512_load_ps(w.m[slot]), l = _mm512_load_ps(w.l[slot]);
  issue_scores(p, r, h, run.lo + from * TK, qy, w.qt[slot]);
  for (int64_t grp = from; grp <= to; ++grp) {
    const int64_t k0 = run.lo + grp * TK;
    _tile_stored(4, w.s[0], 64);
    _tile_stored(5, w.s[16], 64);
    if (grp > from) {
      issue_values(vt + (grp - 1) * D * TK, w.pt[(grp - 1) & 1]);
      started = true;
    }
    if (grp < to) issue_scores(p, r, h, k0 + TK, qy, w.qt[slot]);
    softmax(p, k0, qy, m_used, l, started, w.pt[grp & 1], w);
  }
  issue_values(vt + to * D * TK, w.pt[to & 1]);
  store_o(w.o[slot]);
  _mm512_store_ps(w.m[slot], m_used);
  _mm512_store_ps(w.l[slot], l);
}

// O^T [64 dims][16 queries] / l into the first `valid` query rows at dst (rows `stride` apart),
// as bf16: row r of a 32x32 block holds dims r and r + 32 of all 16 queries; transposed, row n
// is dims 0-31 of query n and row n + 16 its dims 32-63 (a scalar loop here took ~3% at 12k).
inline void write_out(const float (*o)[16], __m512 l, c10::BFloat16* dst, int64_t stride, int64_t valid) {
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), l);
  __m512i m[32];
  for (int r = 0; r < 32; ++r) {
    const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_load_ps(o[r + 32]), inv),
                                              _mm512_mul_ps(_mm512_load_ps(o[r]), inv));
    m[r] = reinterpret_cast<const __m512i&>(both);
  }
  transpose32x32_u16(m);
  for (int64_t n = 0; n < valid; ++n) {
    _mm512_storeu_si512(dst + n * stride, m[n]);
    _mm512_storeu_si512(dst + n * stride + 32, m[n + 16]);
  }
}

// One item: query tiles [tile0, tile0 + tiles) of run r for query heads [g0, g1) of KV head h.
// Keys go in chunks of 1,024; each chunk, once in L2, is read by every (tile, head) of the
// item in turn (K and V^T come from L3 once per item rather than once per tile).
void attend(const Problem& p, int64_t r, int64_t h, int64_t tile0, int64_t tiles, int64_t g0, int64_t g1, Scratch& w) {
  const Run& run = p.runs[r];
  const int64_t G = g1 - g0;
  Tiles ts;
  start_item(p, r, h, tile0, tiles, g0, G, ts, w);
  bool started[kSlots] = {};
  for (int64_t chunk = ts.first_group / kChunkGroups * kChunkGroups; chunk <= ts.last_group; chunk += kChunkGroups)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t from = std::max(chunk, ts.lo[t]), to = std::min(ts.hi[t], chunk + kChunkGroups - 1);
      if (from > to) continue;
      for (int64_t g = 0; g < G; ++g) {
        walk(p, r, h, ts.qy[t], from, to, t * G + g, started[t * G + g], w);
        started[t * G + g] = true;
      }
    }
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t slot = t * G + g;
      c10::BFloat16* dst = p.out + ((run.row + (tile0 + t) * TQ) * p.H + h * p.G + g0 + g) * D;
      write_out(w.o[slot], _mm512_load_ps(w.l[slot]), dst, p.H * D, ts.valid[t]);
    }
}

}  // namespace
#endif

bool prompt_tiles_available() {
#ifdef SWIFTSERVE_AMX
  return request_amx();
#else
  return false;
#endif
}

void prompt_tiles(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor tables, torch::Tensor runs,
                  torch::Tensor out, double scale, int64_t window) {
#ifdef SWIFTSERVE_AMX
  TORCH_CHECK(prompt_tiles_available(), "AMX tiles are not available to this process");
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && kc.scalar_type() == torch::kBFloat16 &&
                  vc.scalar_type() == torch::kBFloat16 && out.scalar_type() == torch::kBFloat16,
              "prompt_tiles: bfloat16 only");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && kc.is_contiguous() && vc.is_contiguous() &&
                  out.is_contiguous(),
              "prompt_tiles: contiguous inputs (q's rows may be strided)");
  TORCH_CHECK(q.size(2) == D && kc.size(3) == D, "prompt_tiles: head_dim 64 only");
  TORCH_CHECK(q.size(1) % kc.size(0) == 0 && q.size(1) / kc.size(0) <= kMaxGroup, "prompt_tiles: 1-8 query heads per KV head");
  TORCH_CHECK(kc.size(2) % 16 == 0, "prompt_tiles: block_size must be a multiple of 16");
  TORCH_CHECK(tables.scalar_type() == torch::kLong && runs.scalar_type() == torch::kLong, "int64 tables/runs");
  auto tab = tables.contiguous();
  auto rn = runs.contiguous();
  const int64_t R = rn.size(0), KVH = kc.size(0);
  std::vector<Run> list(R);
  int64_t packed = 0;
  const int64_t* rp = rn.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    Run& run = list[r];
    run.row = rp[3 * r];
    run.n = rp[3 * r + 1];
    run.pos = rp[3 * r + 2];
    run.lo = window > 0 ? std::max<int64_t>(0, run.pos - window + 1) / TK * TK : 0;
    run.groups = (run.pos + run.n - run.lo + TK - 1) / TK;
    run.packed = packed;
    packed += KVH * run.groups * D * TK;
  }
  // Reused across calls: a fresh multi-MB buffer per layer came back as fresh pages from the
  // OS each time (page faults cost more than the packing itself on small chunks).
  thread_local torch::Tensor vt;
  if (!vt.defined() || vt.numel() < packed) vt = torch::empty({std::max<int64_t>(packed, 1) * 5 / 4}, q.options());
  Problem p{q.data_ptr<c10::BFloat16>(), kc.data_ptr<c10::BFloat16>(), vc.data_ptr<c10::BFloat16>(),
            out.data_ptr<c10::BFloat16>(), tab.data_ptr<int64_t>(), q.size(1), KVH, q.size(1) / KVH,
            kc.size(1), kc.size(2), tab.size(1), window, q.stride(0), static_cast<float>(scale * 1.4426950408889634),
            list.data(), vt.data_ptr<c10::BFloat16>()};
  // Items: (run, kv head, tile of 16 queries, share of the G query heads); dealt dynamically
  // with the latest positions (the most keys) first, so the threads finish together. A small
  // chunk (a few tiles) splits its heads over items too, or most threads would wait.
  const int threads = at::get_num_threads();
  int64_t tiles = 0;
  for (int64_t r = 0; r < R; ++r) tiles += KVH * ((list[r].n + TQ - 1) / TQ);
  const int64_t shares = tiles < 4 * threads ? p.G : 1;
  // Several query tiles per item (K/V read from L3 once per item, then from L2 by each tile)
  // as long as that still leaves every thread 8 items to balance.
  int64_t per_item = kItemTiles;
  while (per_item > 1 && tiles < 8 * per_item * threads) per_item /= 2;
  std::vector<int64_t> pack_items, items;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < KVH; ++h) {
      for (int64_t grp = 0; grp < list[r].groups; ++grp) pack_items.push_back((r * KVH + h) << 32 | grp);
      const int64_t n_items = ((list[r].n + TQ - 1) / TQ + per_item - 1) / per_item;
      for (int64_t t = 0; t < n_items; ++t)
        for (int64_t share = 0; share < shares; ++share) items.push_back((r * KVH + h) << 32 | (t * shares + share));
    }
  std::stable_sort(items.begin(), items.end(), [&](int64_t a, int64_t b) {
    const int64_t ta = (a & 0xffffffff) / shares, tb = (b & 0xffffffff) / shares;
    return list[(a >> 32) / KVH].pos + ta * per_item * TQ > list[(b >> 32) / KVH].pos + tb * per_item * TQ;
  });
  const int64_t np = static_cast<int64_t>(pack_items.size()), ni = static_cast<int64_t>(items.size());
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < np; ++i) {
      const int64_t rh = pack_items[i] >> 32;
      pack_values(p, rh / KVH, rh % KVH, pack_items[i] & 0xffffffff);
    }
    load_tile_config();
    // ~400 KB per thread, kept: not on an OpenMP thread's stack, and not fresh pages per call
    thread_local std::unique_ptr<Scratch> scratch = std::make_unique<Scratch>();
    Scratch* w = scratch.get();
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < ni; ++i) {
      const int64_t rh = items[i] >> 32, ts = items[i] & 0xffffffff, share = ts % shares;
      const int64_t r = rh / KVH, t0 = ts / shares * per_item;
      const int64_t nt = std::min(per_item, (list[r].n + TQ - 1) / TQ - t0);
      attend(p, r, rh % KVH, t0, nt, share * p.G / shares, (share + 1) * p.G / shares, *w);
    }
    _tile_release();
  }
#else
  TORCH_CHECK(false, "prompt_tiles: built without AMX");
#endif
}
