// bfloat16 GEMM for linear layers: out[M, N] = x[M, K] @ w[N, K]^T (+ bias), fp32 accumulation.
//
// Why our own: oneDNN blocks for long K; SmolLM-class layers have K = 576 or 1536, and there
// it reached 500 GFLOP/s at batch 64 with weights streamed from DRAM (as in decode: 30 layers'
// weights do not fit in L3) and 26-30 GFLOP/s at batch 1. This kernel: 670-750 and 45-57
// (tools: /tmp-style sweeps recorded in docs/benchmarks.md).
//
// Packed weight: [P, K/2, NB, 2] with NB = 48 output columns per panel, i.e. for each pair of
// input features (k, k+1) the 48 columns' pairs lie side by side. That is the operand layout
// of vdpbf16ps (AVX512-BF16): one broadcast 32-bit load of x[m, k:k+2] times a 64-byte panel
// row gives 16 fp32 dot-product updates. A micro tile is 8 rows x 48 columns = 24 zmm
// accumulators, which walks the whole K (no K blocking: a panel of K=1536 is 147 KB and stays
// in L2 while every row block of x passes over it). Threads split panels (and row blocks
// of 256 when M is large); a panel is read from memory once per row block, and the first
// micro tile of each panel prefetches the thread's next panel into L2.
//
// Rounding: fp32 sums rounded once to bf16 (round to nearest even), like oneDNN, but summed
// in another order, so results differ from F.linear in the last bf16 bit now and then.
//
// AMX CPUs, up to AMX_MAX_ROWS rows (decode batches, verification, prompt chunks): the same
// panels are AMX B operands as they are (16 pairs of input features x 16 columns, rows 192
// bytes apart), so a tile product covers 16 rows x 16 columns x 32 inputs at once. One row
// streams the weight at memory speed either way; 4 rows cost 1.5x one on the vector path
// (the vdpbf16ps work grows with the rows) and about one on AMX. Every row count up to
// AMX_MAX_ROWS takes this path, so a row's result does not depend on the batch it is in.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstring>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif
#include "amx.h"
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define SWIFTSERVE_AMX_GEMM 1
#endif

namespace {

constexpr int NV = 3;         // zmm accumulators per row: 48 columns
constexpr int NB = 16 * NV;   // columns per packed panel
constexpr int MR = 8;         // rows per micro tile (8 x 3 = 24 accumulators of 32 zmm)
constexpr int64_t ROW_BLOCK = 256;  // rows per task when M is large (x block stays in L2)

#ifdef __AVX512BF16__
inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

// Rounds R rows x NB fp32 sums (+ bias) to bf16 and stores the first ncols columns.
template <int R>
inline void store_tile(__m512 (&acc)[R][NV], const uint16_t* bias, uint16_t* c, int64_t ldc, int ncols) {
  __m512 b[NV];
  for (int j = 0; j < NV; ++j) {
    const int left = ncols - 16 * j;
    const __mmask16 mk = left >= 16 ? 0xFFFF : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
    // bf16 -> fp32 is a 16-bit shift into the high half.
    b[j] = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, bias + 16 * j)), 16))
                : _mm512_setzero_ps();
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      const int left = ncols - 16 * j;
      if (left <= 0) break;
      __m256bh h = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][j], b[j]));
      const __mmask16 mk = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
      _mm256_mask_storeu_epi16(c + r * ldc + 16 * j, mk, reinterpret_cast<__m256i&>(h));
    }
}

// R rows of x (row stride lda) times one panel ([K2][NB][2]); pf: the next panel to pull
// into L2 while this one is computed, or null.
template <int R>
void micro_tile(const uint16_t* a, int64_t lda, const uint16_t* panel, int64_t K2, const uint16_t* bias,
                uint16_t* c, int64_t ldc, int ncols, const char* pf) {
  __m512 acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_setzero_ps();
  const int32_t* ap[R];
  for (int r = 0; r < R; ++r) ap[r] = reinterpret_cast<const int32_t*>(a + r * lda);
  const __m512i* bp = reinterpret_cast<const __m512i*>(panel);
#pragma GCC unroll 2
  for (int64_t k = 0; k < K2; ++k) {
    __m512i b[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) b[j] = _mm512_loadu_si512(bp + NV * k + j);
    if (pf) {
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) _mm_prefetch(pf + 64 * (NV * k + j), _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh av = as_bh(_mm512_set1_epi32(ap[r][k]));
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], av, as_bh(b[j]));
    }
  }
  store_tile<R>(acc, bias, c, ldc, ncols);
}

// Rows [m0, m1) against one panel: full micro tiles, then one tile of the remaining rows.
void panel_rows(const uint16_t* a, int64_t lda, const uint16_t* panel, int64_t K2, const uint16_t* bias, uint16_t* c,
                int64_t ldc, int ncols, int64_t m0, int64_t m1, const char* pf) {
  if (m1 - m0 <= MR) pf = nullptr;  // one tile: the stream is its own prefetch
  int64_t m = m0;
  for (; m + MR <= m1; m += MR, pf = nullptr) micro_tile<MR>(a + m * lda, lda, panel, K2, bias, c + m * ldc, ldc, ncols, pf);
  const uint16_t* am = a + m * lda;
  uint16_t* cm = c + m * ldc;
  switch (m1 - m) {
    case 1: micro_tile<1>(am, lda, panel, K2, bias, cm, ldc, ncols, pf); break;
    case 2: micro_tile<2>(am, lda, panel, K2, bias, cm, ldc, ncols, pf); break;
    case 3: micro_tile<3>(am, lda, panel, K2, bias, cm, ldc, ncols, pf); break;
    case 4: micro_tile<4>(am, lda, panel, K2, bias, cm, ldc, ncols, pf); break;
    case 5: micro_tile<5>(am, lda, panel, K2, bias, cm, ldc, ncols, pf); break;
    case 6: micro_tile<6>(am, lda, panel, K2, bias, cm, ldc, ncols, pf); break;
    case 7: micro_tile<7>(am, lda, panel, K2, bias, cm, ldc, ncols, pf); break;
    default: break;
  }
}
#endif

#ifdef SWIFTSERVE_AMX_GEMM
constexpr int64_t AMX_BLOCK = 16;      // rows per tile product
constexpr int64_t AMX_MAX_ROWS = 256;  // steps up to this many rows take the AMX path

// Tiles: 0 the rows of x (M x 32 inputs), 1-3 the panel's three 16-column B operands, 4-6
// the M x 16 sums of each.
void amx_config(int rows) {
  swiftserve_amx::TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 7; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = static_cast<uint8_t>(t >= 1 && t <= 3 ? 16 : rows);
  }
  _tile_loadconfig(&cfg);
}

// M (<= AMX_BLOCK) rows of x against one panel; K2 a multiple of 16.
void amx_panel(const uint16_t* a, int64_t lda, const uint16_t* panel, int64_t K2, const uint16_t* bias, uint16_t* c,
               int64_t ldc, int ncols, int64_t M) {
  alignas(64) float sums[AMX_BLOCK][NB];
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  for (int64_t k2 = 0; k2 < K2; k2 += 16) {
    const uint16_t* b = panel + k2 * NB * 2;
    _tile_loadd(0, a + 2 * k2, lda * 2);
    _tile_loadd(1, b, NB * 4);
    _tile_loadd(2, b + 32, NB * 4);
    _tile_loadd(3, b + 64, NB * 4);
    _tile_dpbf16ps(4, 0, 1);
    _tile_dpbf16ps(5, 0, 2);
    _tile_dpbf16ps(6, 0, 3);
  }
  _tile_stored(4, &sums[0][0], NB * 4);
  _tile_stored(5, &sums[0][16], NB * 4);
  _tile_stored(6, &sums[0][32], NB * 4);
  for (int64_t r = 0; r < M; ++r) {
    __m512 acc[1][NV];
    for (int j = 0; j < NV; ++j) acc[0][j] = _mm512_load_ps(&sums[r][16 * j]);
    store_tile<1>(acc, bias, c + r * ldc, ldc, ncols);
  }
}

bool amx_gemm_ready() {
  static const bool ok = swiftserve_amx::request_amx();
  return ok;
}
#endif

}  // namespace

bool bf16_gemm_available() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

int64_t bf16_gemm_panel_width() { return NB; }

// The most rows bf16_linear takes through AMX tiles for in_features K, or 0 where it cannot
// (no AMX, no OS permission, K not a multiple of 32).
int64_t bf16_gemm_amx_rows(int64_t K) {
#ifdef SWIFTSERVE_AMX_GEMM
  return K % 32 == 0 && amx_gemm_ready() ? AMX_MAX_ROWS : 0;
#else
  (void)K;
  return 0;
#endif
}

// x: [M, K] bf16 (rows may be strided, columns contiguous, K even); wp: [P, K/2, NB, 2] bf16;
// bias: [N] bf16 or undefined. Returns [M, N] bf16.
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor wp, int64_t N, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(bf16_gemm_available(), "bf16_linear needs AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == torch::kBFloat16, "x must be [M, K] bf16");
  TORCH_CHECK(wp.dim() == 4 && wp.size(2) == NB && wp.size(3) == 2 && wp.is_contiguous() &&
                  wp.scalar_type() == torch::kBFloat16, "wp must be packed [P, K/2, NB, 2] bf16");
  const int64_t M = x.size(0), K = x.size(1), P = wp.size(0), K2 = wp.size(1);
  TORCH_CHECK(K2 * 2 == K && N > (P - 1) * NB && N <= P * NB, "shapes of x, wp and N disagree");
  const uint16_t* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous() && bias->scalar_type() == torch::kBFloat16, "bias");
    bp = reinterpret_cast<const uint16_t*>(bias->data_ptr());
  }
  auto out = torch::empty({M, N}, x.options());
#ifdef __AVX512BF16__
  const uint16_t* a = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* w = reinterpret_cast<const uint16_t*>(wp.data_ptr());
  uint16_t* c = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t lda = x.stride(0), panel_elems = K2 * NB * 2;
#ifdef SWIFTSERVE_AMX_GEMM
  if (M <= AMX_MAX_ROWS && K2 % 16 == 0 && amx_gemm_ready()) {
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      int64_t configured = 0;  // the tile rows loaded (a partial last block needs its own)
      for (int64_t p = p0; p < p1; ++p) {
        const int ncols = static_cast<int>(std::min<int64_t>(NB, N - p * NB));
        for (int64_t m0 = 0; m0 < M; m0 += AMX_BLOCK) {
          const int64_t rows = std::min<int64_t>(AMX_BLOCK, M - m0);
          if (rows != configured) amx_config(static_cast<int>(configured = rows));
          amx_panel(a + m0 * lda, lda, w + p * panel_elems, K2, bp ? bp + p * NB : nullptr, c + m0 * N + p * NB, N,
                    ncols, rows);
        }
      }
    });
    return out;
  }
#endif
  const int64_t row_block = M > 2 * ROW_BLOCK ? ROW_BLOCK : M;
  const int64_t blocks = (M + row_block - 1) / row_block;
  // Tasks run panel-major within a row block, so a thread's next task is usually the next
  // panel (the one prefetched).
  at::parallel_for(0, blocks * P, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t rb = t / P, p = t % P;
      const int64_t m0 = rb * row_block, m1 = std::min(M, m0 + row_block);
      const int ncols = static_cast<int>(std::min<int64_t>(NB, N - p * NB));
      const char* pf = t + 1 < t1 ? reinterpret_cast<const char*>(w + ((t + 1) % P) * panel_elems) : nullptr;
      panel_rows(a, lda, w + p * panel_elems, K2, bp ? bp + p * NB : nullptr, c + p * NB, N, ncols, m0, m1, pf);
    }
  });
#endif
  return out;
}
