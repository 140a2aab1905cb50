// AMX GEMM for prompt chunks, with the layer's element-wise work in its epilogues (issue 24).
//
// Every bf16 linear of a small model takes this from 128 rows (packed_linear.add_amx_copies):
// on SmolLM-135M's prompts it ran 1.1-1.2x faster end to end than oneDNN's packed GEMM plus
// separate element-wise passes, each of which re-read a [T, N] output from L3. Epilogues:
// - SiLU-and-mul: the gate/up weight is packed so that each 32-column block holds 16 gate
//   columns and the 16 up columns that go with them; [T, 2I] is never written.
// - rotary: q/k/v packed so that a block holds 16 complete rotary pairs of a q or k head.
// - residual add + RMSNorm (amx_linear_add_rms): over each thread's rows once its sweep is
//   done, while they are still in its L2.
// - a bias (q/k/v of Qwen2), added to the fp32 sums before the one rounding, as oneDNN does.
//
// Blocking: C is computed 32 rows x 32 columns at a time in four fp32 tiles (two A tiles of
// rows x two B tiles of columns per 32-deep k step: the most reuse eight tiles allow). Threads
// split the rows; each takes the columns in chunks (their weights stay in L2) and runs
// every 32-row block of its rows across a chunk (the block's rows stay in L1); a block's
// epilogue (tiles to bf16 rows) runs while the next block's products are in flight. Tried
// and slower on the Xeon this was written on: software prefetch, sweeping all columns per
// panel of rows, splitting the columns across threads (better for one shape, worse for others).
//
// Weights are packed once (packed_linear.pack_amx): [N / 32][K / 32][2][16 pairs][16][2] bf16,
// i.e. per 32-column block and k step two B tiles of 16 columns each, 1 KB apiece.
// Accumulation order is oneDNN's (sums over k in steps of 32): the results were the same bits
// as oneDNN's on every shape tested; gate and up are rounded to bf16 before SiLU as in the
// unfused path, so the fused output is the unfused path's too.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "bf16_simd.h"
#include "ops.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define SWIFTSERVE_AMX_GEMM_TILES 1
#include <omp.h>
#endif

#ifdef SWIFTSERVE_AMX_GEMM_TILES
namespace {
using namespace swiftserve_amx;
using namespace swiftserve_bf16;

constexpr int64_t kRows = 32;    // rows per block (two A tiles)
// weight bytes per chunk of column blocks that a sweep keeps in L2 (16 blocks at K = 576; by
// bytes, as 16 blocks at K = 1,536 took 1.05-1.1x the time of 6)
constexpr int64_t kChunkBytes = 576 << 10;
constexpr int64_t kTileElems = 512;  // bf16 elements in one B tile (16 pairs x 16 columns x 2)

// Tiles 0-3 = the 32 rows at a (rows lda apart) times one 32-column block b, over K.
// `meanwhile` runs after the second k step: the previous block's epilogue, vector work that
// then overlaps this block's tile products instead of stalling them (1.0-1.2x the GEMM).
template <typename F>
inline void block_product(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b, int64_t ksteps,
                          F&& meanwhile) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t ks = 0; ks < ksteps; ++ks) {
    const c10::BFloat16* bk = b + ks * 2 * kTileElems;
    _tile_loadd(4, a + ks * 32, lda * 2);
    _tile_loadd(6, bk, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, bk + kTileElems, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a + 16 * lda + ks * 32, lda * 2);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    if (ks == std::min<int64_t>(1, ksteps - 1)) meanwhile();
  }
}

inline void store_tiles(float (*cb)[16][16]) {
  _tile_stored(0, cb[0], 64);
  _tile_stored(1, cb[1], 64);
  _tile_stored(2, cb[2], 64);
  _tile_stored(3, cb[3], 64);
}

// Epilogues: the first `valid` rows of block (m, nb)'s stored tiles into the output. Tile 0/2
// hold the block's first 16 columns for rows 0-15/16-31, tiles 1/3 its last 16.
inline const float* tile_row(const float (*cb)[16][16], int64_t r, int half) {
  return cb[(r < 16 ? 0 : 2) + half][r % 16];
}

// The block's 32 bias values (in the packed column order) as two fp32 halves; zeros without one.
inline void block_bias(const c10::BFloat16* bias, int64_t nb, __m512& lo, __m512& hi) {
  lo = bias ? bf16_load(bias + nb * 32) : _mm512_setzero_ps();
  hi = bias ? bf16_load(bias + nb * 32 + 16) : _mm512_setzero_ps();
}

struct Plain {  // bf16 columns nb * 32 .., + bias (added to the fp32 sums, rounded once, as oneDNN)
  c10::BFloat16* out;
  int64_t ldo;
  const c10::BFloat16* bias;
  void operator()(const float (*cb)[16][16], int64_t m, int64_t valid, int64_t nb) const {
    __m512 b0, b1;
    block_bias(bias, nb, b0, b1);
    for (int64_t r = 0; r < valid; ++r) {
      const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_add_ps(_mm512_load_ps(tile_row(cb, r, 1)), b1),
                                                _mm512_add_ps(_mm512_load_ps(tile_row(cb, r, 0)), b0));
      _mm512_storeu_si512(out + (m + r) * ldo + nb * 32, reinterpret_cast<const __m512i&>(both));
    }
  }
};

struct SiluMul {  // 16 gate columns, then their 16 up columns: silu(gate) * up at nb * 16 ..
  c10::BFloat16* out;
  int64_t ldo;
  void operator()(const float (*cb)[16][16], int64_t m, int64_t valid, int64_t nb) const {
    for (int64_t r = 0; r < valid; ++r) {
      const __m512 gate = bf16_round_fast(_mm512_load_ps(tile_row(cb, r, 0)));
      const __m512 up = bf16_round_fast(_mm512_load_ps(tile_row(cb, r, 1)));
      bf16_store_fast(out + (m + r) * ldo + nb * 16, silu_mul_ps(gate, up));
    }
  }
};

// q/k/v with the rotary of q and k heads (head_dim 64): below rope_blocks, block nb holds dims
// 16s .. 16s + 15 and 32 + 16s .. of head nb / 2 (s = nb % 2), i.e. 16 complete rotary pairs;
// the rest (v) are plain. Row m + r's cos and sin are row m + r of the tables.
struct Rope {
  c10::BFloat16* out;
  int64_t ldo, rope_blocks;
  const c10::BFloat16 *cos, *sin, *bias;  // bias in the packed (rotary pair) order, or null
  void operator()(const float (*cb)[16][16], int64_t m, int64_t valid, int64_t nb) const {
    if (nb >= rope_blocks) return Plain{out, ldo, bias}(cb, m, valid, nb);
    const int64_t col = nb / 2 * 64 + nb % 2 * 16;
    __m512 b0, b1;
    block_bias(bias, nb, b0, b1);
    for (int64_t r = 0; r < valid; ++r) {
      const __m512 x1 = bf16_round_fast(_mm512_add_ps(_mm512_load_ps(tile_row(cb, r, 0)), b0));
      const __m512 x2 = bf16_round_fast(_mm512_add_ps(_mm512_load_ps(tile_row(cb, r, 1)), b1));
      c10::BFloat16* o = out + (m + r) * ldo + col;
      const int64_t t = (m + r) * 64 + nb % 2 * 16;
      rope_pairs_bf16(x1, x2, cos + t, sin + t, 32, o, o + 32);
    }
  }
};

// Rows [m0, m1) of x against every column block: per chunk of column blocks (their weights,
// kChunkBytes, stay in L2), each 32-row block of x meets the chunk's blocks in turn (it stays in
// L1 across them). A last block of fewer than 32 rows is copied into zero-padded scratch
// first (tile loads read 32 rows). Each block's epilogue runs during the next one's product.
template <typename Epilogue>
void sweep(const c10::BFloat16* x, int64_t K, const c10::BFloat16* wp, int64_t blocks, int64_t m0, int64_t m1,
           const Epilogue& epilogue) {
  alignas(64) float cb[2][4][16][16];  // the block being stored, the one being written out
  const int64_t ksteps = K / 32;
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / (K * 32 * 2));
  std::vector<c10::BFloat16> pad;
  int64_t pending = 0, pending_m = 0, pending_rows = 0, pending_nb = -1;  // tiles in cb[pending & 1]
  const auto finish = [&] {
    if (pending_nb >= 0) epilogue(cb[pending & 1], pending_m, pending_rows, pending_nb);
  };
  for (int64_t c0 = 0; c0 < blocks; c0 += chunk) {
    const int64_t c1 = std::min(blocks, c0 + chunk);
    for (int64_t m = m0; m < m1; m += kRows) {
      const int64_t valid = std::min(kRows, m1 - m);
      const c10::BFloat16* a = x + m * K;
      if (valid < kRows) {
        if (pad.empty()) {  // only the last block of all can be short: the same rows every time
          pad.assign(kRows * K, c10::BFloat16(0.f));
          std::memcpy(pad.data(), a, valid * K * sizeof(c10::BFloat16));
        }
        a = pad.data();
      }
      for (int64_t nb = c0; nb < c1; ++nb) {
        block_product(a, K, wp + nb * ksteps * 2 * kTileElems, ksteps, finish);
        store_tiles(cb[++pending & 1]);
        pending_m = m;
        pending_rows = valid;
        pending_nb = nb;
      }
    }
  }
  finish();
}

// Threads split the rows in 32-row blocks; each sweeps its rows, then runs `after(m0, m1)`
// on them while they are still in its L2.
template <typename Epilogue, typename After>
void run(const torch::Tensor& x, const torch::Tensor& wp, int64_t N, const Epilogue& epilogue, const After& after) {
  TORCH_CHECK(amx_gemm_available(), "AMX tiles are not available to this process");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && wp.scalar_type() == torch::kBFloat16,
              "amx_linear: bfloat16 [M, K] input");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 32 == 0 && N % 32 == 0 && wp.numel() == N * K && wp.is_contiguous() && x.is_contiguous(),
              "amx_linear: K and N multiples of 32, weight packed by pack_amx");
  const auto* a = x.data_ptr<c10::BFloat16>();
  const auto* w = wp.data_ptr<c10::BFloat16>();
  const int64_t row_blocks = (M + kRows - 1) / kRows;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), row_blocks)));
#pragma omp parallel num_threads(threads)
  {
    load_tile_config();
    const int t = omp_get_thread_num();
    const int64_t m0 = std::min(M, t * row_blocks / threads * kRows);
    const int64_t m1 = std::min(M, (t + 1) * row_blocks / threads * kRows);
    sweep(a, K, w, N / 32, m0, m1, epilogue);
    _tile_release();
    after(m0, m1);
  }
}

}  // namespace
#endif

bool amx_gemm_available() {
#ifdef SWIFTSERVE_AMX_GEMM_TILES
  return request_amx();
#else
  return false;
#endif
}

#ifdef SWIFTSERVE_AMX_GEMM_TILES
namespace {
void nothing(int64_t, int64_t) {}
}  // namespace
#endif

#ifdef SWIFTSERVE_AMX_GEMM_TILES
namespace {
// bias [N] bf16 in the packed column order, or null
const c10::BFloat16* bias_ptr(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == torch::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
              "amx_linear: bias must be bf16 [N], contiguous");
  return bias->data_ptr<c10::BFloat16>();
}
}  // namespace
#endif

torch::Tensor amx_linear(torch::Tensor x, torch::Tensor wp, int64_t N, bool silu_mul,
                         c10::optional<torch::Tensor> bias) {
#ifdef SWIFTSERVE_AMX_GEMM_TILES
  x = x.contiguous();
  TORCH_CHECK(!(silu_mul && bias.has_value()), "amx_linear: no bias with silu_mul");
  auto out = torch::empty({x.size(0), silu_mul ? N / 2 : N}, x.options());
  auto* o = out.data_ptr<c10::BFloat16>();
  if (silu_mul)
    run(x, wp, N, SiluMul{o, N / 2}, nothing);
  else
    run(x, wp, N, Plain{o, N, bias_ptr(bias, N)}, nothing);
  return out;
#else
  TORCH_CHECK(false, "amx_linear: built without AMX");
#endif
}

torch::Tensor amx_linear_rope(torch::Tensor x, torch::Tensor wp, int64_t N, torch::Tensor cos, torch::Tensor sin,
                              int64_t rope_cols, c10::optional<torch::Tensor> bias) {
#ifdef SWIFTSERVE_AMX_GEMM_TILES
  x = x.contiguous();
  TORCH_CHECK(cos.scalar_type() == torch::kBFloat16 && sin.scalar_type() == torch::kBFloat16 &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * 64 &&
                  sin.numel() == cos.numel() && rope_cols % 64 == 0 && rope_cols <= N,
              "amx_linear_rope: bf16 cos/sin [T, 64], whole heads of 64");
  auto out = torch::empty({x.size(0), N}, x.options());
  run(x, wp, N,
      Rope{out.data_ptr<c10::BFloat16>(), N, rope_cols / 32, cos.data_ptr<c10::BFloat16>(),
           sin.data_ptr<c10::BFloat16>(), bias_ptr(bias, N)},
      nothing);
  return out;
#else
  TORCH_CHECK(false, "amx_linear_rope: built without AMX");
#endif
}

torch::Tensor amx_linear_add_rms(torch::Tensor x, torch::Tensor wp, int64_t N, torch::Tensor residual,
                                 torch::Tensor weight, double eps) {
#ifdef SWIFTSERVE_AMX_GEMM_TILES
  x = x.contiguous();
  TORCH_CHECK(residual.scalar_type() == torch::kBFloat16 && weight.scalar_type() == torch::kBFloat16 &&
                  residual.is_contiguous() && weight.is_contiguous() && residual.size(0) == x.size(0) &&
                  residual.numel() == x.size(0) * N && weight.numel() == N && N % 16 == 0,
              "amx_linear_add_rms: bf16 residual [T, N], weight [N]");
  auto out = torch::empty({x.size(0), N}, x.options());
  auto* o = out.data_ptr<c10::BFloat16>();
  auto* res = residual.data_ptr<c10::BFloat16>();
  const auto* w = weight.data_ptr<c10::BFloat16>();
  const float e = static_cast<float>(eps);
  // the product's rows, then residual += them and their norm, in place, while in L2
  run(x, wp, N, Plain{o, N, nullptr}, [&](int64_t m0, int64_t m1) {
    for (int64_t r = m0; r < m1; ++r) add_rms_row_bf16(res + r * N, o + r * N, w, o + r * N, N, e);
  });
  return out;
#else
  TORCH_CHECK(false, "amx_linear_add_rms: built without AMX");
#endif
}
