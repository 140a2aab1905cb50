// Matrix-vector products for decode (a few rows of activations against a large weight), CPU.
//
// Decode reads every weight once per step, so these kernels are about streaming the weight at
// memory speed. Weights are pre-packed as [N/4, K/16, 4, 16]: the 4 rows a task computes
// together are interleaved in 16-weight pieces, so each task reads ONE sequential stream
// (64 bytes per step for int8, the hardware prefetcher's best case) instead of 4 strided
// ones. 16 weights at a time are widened to float32 in registers and multiplied with up to 4
// activation rows held in float32. Measured here (SmolLM-135M layer shapes, weights streamed
// from DRAM): oneDNN bf16 and PyTorch's _weight_int8pack_mm reach 16-24 GB/s at batch 1.
//
// int8_gemv:  out[m, n] = scale[n] * sum_k x[m, k] * w[n, k]   (w int8, one scale per row)
// pack: w [N, K] -> [N/4, K/16, 4, 16] (see pack_rows4 in model/quant_linear.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cstdint>
#include <cstring>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int ROWS = 4;  // weight rows per inner task
constexpr int MAX_M = 4;  // activation rows per pass

inline float load_f(const int8_t* p) { return static_cast<float>(*p); }

#ifdef __AVX512F__
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#endif

// acc[m][r] = dot(x[m], w[r]) over K, for MB activation rows and the 4 rows of a packed tile
// (w points at the tile: K/16 pieces of [4][16]).
template <int MB, typename W>
inline void dot_tile(const float* x, int64_t K, const W* w, float acc[MAX_M][ROWS]) {
#ifdef __AVX512F__
  // Two accumulator sets (even and odd 16-wide pieces) for one activation row: the FMA
  // latency chains, not the loads, limit a single row otherwise.
  constexpr int U = MB == 1 ? 2 : 1;
  __m512 va[MB][ROWS][U];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < ROWS; ++r)
      for (int u = 0; u < U; ++u) va[m][r][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 * U <= K; k += 16 * U, w += ROWS * 16 * U) {
    for (int u = 0; u < U; ++u) {
      __m512 wv[ROWS];
      for (int r = 0; r < ROWS; ++r) wv[r] = load16(w + (u * ROWS + r) * 16);
      for (int m = 0; m < MB; ++m) {
        const __m512 xv = _mm512_loadu_ps(x + m * K + k + 16 * u);
        for (int r = 0; r < ROWS; ++r) va[m][r][u] = _mm512_fmadd_ps(wv[r], xv, va[m][r][u]);
      }
    }
  }
  for (; k < K; k += 16, w += ROWS * 16) {  // an odd last piece when U == 2
    for (int r = 0; r < ROWS; ++r) {
      const __m512 wv = load16(w + r * 16);
      for (int m = 0; m < MB; ++m)
        va[m][r][0] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * K + k), va[m][r][0]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < ROWS; ++r) {
      __m512 sum = va[m][r][0];
      for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, va[m][r][u]);
      acc[m][r] = _mm512_reduce_add_ps(sum);
    }
#else
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < ROWS; ++r) acc[m][r] = 0.f;
  for (int64_t k = 0; k < K; k += 16, w += ROWS * 16)
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < ROWS; ++r)
        for (int j = 0; j < 16; ++j) acc[m][r] += x[m * K + k + j] * load_f(w + r * 16 + j);
#endif
}

template <int MB, typename W, typename T>
inline void tile_rows(const float* x, const W* w, const T* scale, T* out, int64_t N, int64_t K, int64_t t) {
  float acc[MAX_M][ROWS];
  dot_tile<MB>(x, K, w + t * ROWS * K, acc);
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < ROWS; ++r) {
      const int64_t n = t * ROWS + r;
      const float s = scale ? static_cast<float>(scale[n]) : 1.0f;
      out[m * N + n] = static_cast<T>(acc[m][r] * s);
    }
}

template <typename W, typename T>
void gemv(const T* x, const W* w, const T* scale, T* out, int64_t M, int64_t N, int64_t K) {
  std::vector<float> xf(M * K);
  for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(x[i]);
  // Grain: at least 16 tiles (64 rows) per thread, so small layers stay on one core. All
  // activation rows go past a weight tile while it is in L1: the weight leaves DRAM once.
  at::parallel_for(0, N / ROWS, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
        const float* xp = xf.data() + m0 * K;
        T* op = out + m0 * N;
        switch (std::min<int64_t>(MAX_M, M - m0)) {
          case 1: tile_rows<1>(xp, w, scale, op, N, K, t); break;
          case 2: tile_rows<2>(xp, w, scale, op, N, K, t); break;
          case 3: tile_rows<3>(xp, w, scale, op, N, K, t); break;
          default: tile_rows<4>(xp, w, scale, op, N, K, t); break;
        }
      }
  });
}

// w is packed [N/4, K/16, 4, 16].
void check_x(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 4 && w.size(2) == ROWS && w.size(3) == 16, "w must be packed [N/4, K/16, 4, 16]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.size(1) * 16, "x must be [M, K]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "x and w must be contiguous");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "CPU tensors expected");
}

}  // namespace

torch::Tensor int8_gemv(torch::Tensor x, torch::Tensor w, torch::Tensor scale) {
  check_x(x, w);
  TORCH_CHECK(w.scalar_type() == torch::kChar, "w must be int8");
  const int64_t M = x.size(0), N = w.size(0) * ROWS, K = x.size(1);
  TORCH_CHECK(scale.scalar_type() == x.scalar_type() && scale.numel() == N && scale.is_contiguous(),
              "scale must be [N] in x's dtype");
  auto out = torch::empty({M, N}, x.options());
  const int8_t* wp = w.data_ptr<int8_t>();
  if (x.scalar_type() == torch::kBFloat16) {
    using T = c10::BFloat16;
    gemv<int8_t, T>(x.data_ptr<T>(), wp, scale.data_ptr<T>(), out.data_ptr<T>(), M, N, K);
  } else if (x.scalar_type() == torch::kFloat) {
    gemv<int8_t, float>(x.data_ptr<float>(), wp, scale.data_ptr<float>(), out.data_ptr<float>(), M, N, K);
  } else {
    TORCH_CHECK(false, "int8_gemv: x must be float32 or bfloat16");
  }
  return out;
}
