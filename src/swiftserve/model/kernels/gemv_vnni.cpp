// INT8 decode GEMV on AVX512-VNNI: int8 weights times int8-quantized activations (W8A8).
//
// The float kernel of gemv.cpp widens every 16 weights to float32 before its FMAs: at batch 1
// that is compute-bound at about half the memory bandwidth (SmolLM shape: INT8 0.92x of
// bfloat16's TPOT on the AMX machine). Here one vpdpbusd multiplies 64 weights of a row with
// 64 activations and sums them in 16 int32 lanes: a 64-byte weight load per instruction,
// which streams the weight at memory speed.
//
// The weight is the plain int8 [N, K] matrix (the same tensor the batch path hands to
// torch._int_mm): 4 consecutive rows per task are one contiguous stretch of memory.
// Activations are quantized per row and per group of 64 inputs (llama.cpp's Q8_0 idea):
// s = max|x| / 127, xq = round(x / s). vpdpbusd takes unsigned x signed bytes, so activations
// go in shifted, xq + 128, and the shift comes back out with the weight's group sums:
// sum w (xq + 128) = sum w xq + 128 sum w.
//
// out[m, n] = scale[n] * sum_g s[m, g] * (sum_{k in g} w[n, k] (xq[m, k] + 128) - 128 wsum[n, g])
//
// int8_mm_rows, for batches: one scale per activation row, oneDNN's int8 GEMM (torch._int_mm,
// AMX-INT8 where the CPU has it) on the same weight, the scales applied in one pass after.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#ifdef __AVX512BW__
#include <immintrin.h>
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define SWIFT_VNNI 1
#endif

namespace {

constexpr int GK = 64;    // activations per quantization group (one zmm of bytes)
constexpr int ROWS = 4;   // weight rows per task
constexpr int MAX_M = 4;  // activation rows per pass over the task's rows

// Per row and group: the shifted bytes xq + 128 and the scale.
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, uint8_t* xu, float* xs) {
  const int64_t groups = K / GK;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      const T* src = x + m * K + g * GK;
      float amax = 0.f;
      for (int j = 0; j < GK; ++j) amax = std::max(amax, std::fabs(static_cast<float>(src[j])));
      const float scale = amax > 0.f ? amax / 127.f : 1.f;
      const float inv = 1.f / scale;
      uint8_t* dst = xu + m * K + g * GK;
      for (int j = 0; j < GK; ++j) {
        const int v = static_cast<int>(std::nearbyint(static_cast<float>(src[j]) * inv));
        dst[j] = static_cast<uint8_t>(std::clamp(v, -127, 127) + 128);
      }
      xs[m * groups + g] = scale;
    }
}

#ifdef SWIFT_VNNI
template <int MB, typename T>
inline void task(const uint8_t* xu, const float* xs, const int8_t* w, const int32_t* wsum, const T* scale,
                 T* out, int64_t N, int64_t K, int64_t n0) {
  const int64_t groups = K / GK;
  __m512 y[MB][ROWS];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < ROWS; ++r) y[m][r] = _mm512_setzero_ps();
  const int8_t* rows = w + n0 * K;
  for (int64_t g = 0; g < groups; ++g) {
    __m512i wv[ROWS], shift[ROWS];
    for (int r = 0; r < ROWS; ++r) {
      wv[r] = _mm512_loadu_si512(rows + r * K + g * GK);
      // the shift's -128 sum w starts lane 0: each group's dot product is exact in int32
      // (and in float32: |sum| < 2^24), no large terms cancel in float
      shift[r] = _mm512_maskz_set1_epi32(1, -128 * wsum[(n0 + r) * groups + g]);
    }
    for (int m = 0; m < MB; ++m) {
      const __m512i xv = _mm512_loadu_si512(xu + m * K + g * GK);
      const __m512 s = _mm512_set1_ps(xs[m * groups + g]);
      for (int r = 0; r < ROWS; ++r) {
        const __m512i dot = _mm512_dpbusd_epi32(shift[r], xv, wv[r]);
        y[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, y[m][r]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < ROWS; ++r) {
      const int64_t n = n0 + r;
      out[m * N + n] = static_cast<T>(_mm512_reduce_add_ps(y[m][r]) * static_cast<float>(scale[n]));
    }
}
#endif

template <typename T>
void gemv(const T* x, const int8_t* w, const int32_t* wsum, const T* scale, T* out, int64_t M, int64_t N,
          int64_t K) {
#ifdef SWIFT_VNNI
  const int64_t groups = K / GK;
  std::vector<uint8_t> xu(M * K);
  std::vector<float> xs(M * groups);
  quantize_rows(x, M, K, xu.data(), xs.data());
  // Grain: 16 tasks (64 rows) per thread at least; every activation row passes the task's
  // rows while they are in L1, so the weight leaves DRAM once per call.
  at::parallel_for(0, N / ROWS, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
        const uint8_t* xp = xu.data() + m0 * K;
        const float* sp = xs.data() + m0 * groups;
        T* op = out + m0 * N;
        switch (std::min<int64_t>(MAX_M, M - m0)) {
          case 1: task<1>(xp, sp, w, wsum, scale, op, N, K, t * ROWS); break;
          case 2: task<2>(xp, sp, w, wsum, scale, op, N, K, t * ROWS); break;
          case 3: task<3>(xp, sp, w, wsum, scale, op, N, K, t * ROWS); break;
          default: task<4>(xp, sp, w, wsum, scale, op, N, K, t * ROWS); break;
        }
      }
  });
#else
  TORCH_CHECK(false, "int8_gemv_vnni: built without AVX512-VNNI");
#endif
}

}  // namespace

bool int8_vnni_available() {
#ifdef SWIFT_VNNI
  return true;
#else
  return false;
#endif
}

torch::Tensor int8_gemv_vnni(torch::Tensor x, torch::Tensor w, torch::Tensor wsum, torch::Tensor scale) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kChar && w.is_contiguous(), "w must be int8 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % ROWS == 0 && K % GK == 0, "int8_gemv_vnni: N % 4 == 0 and K % 64 == 0");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.is_contiguous() && x.device().is_cpu(), "x must be [M, K]");
  TORCH_CHECK(wsum.scalar_type() == torch::kInt && wsum.numel() == N * (K / GK) && wsum.is_contiguous(),
              "wsum must be int32 [N, K / 64]");
  TORCH_CHECK(scale.scalar_type() == x.scalar_type() && scale.numel() == N && scale.is_contiguous(),
              "scale must be [N] in x's dtype");
  const int64_t M = x.size(0);
  auto out = torch::empty({M, N}, x.options());
  const int8_t* wp = w.data_ptr<int8_t>();
  const int32_t* sp = wsum.data_ptr<int32_t>();
  if (x.scalar_type() == torch::kBFloat16) {
    using T = c10::BFloat16;
    gemv<T>(x.data_ptr<T>(), wp, sp, scale.data_ptr<T>(), out.data_ptr<T>(), M, N, K);
  } else if (x.scalar_type() == torch::kFloat) {
    gemv<float>(x.data_ptr<float>(), wp, sp, scale.data_ptr<float>(), out.data_ptr<float>(), M, N, K);
  } else {
    TORCH_CHECK(false, "int8_gemv_vnni: x must be float32 or bfloat16");
  }
  return out;
}

namespace {
// max |x| over n bf16 values; 16 at a time where the CPU has AVX-512 (prompt chunks quantize
// millions of activations a step: the scalar loop was 40% of an INT8 model's time to first token)
float abs_max(const c10::BFloat16* x, int64_t n) {
  float amax = 0.f;
  int64_t i = 0;
#ifdef __AVX512BW__
  __m512 m = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
    m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))));
  }
  amax = _mm512_reduce_max_ps(m);
#endif
  for (; i < n; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
  return amax;
}

// q = clamp(round(x * inv), -127, 127) + offset, as bytes
void round_bytes(const c10::BFloat16* x, int64_t n, float inv, int offset, uint8_t* q) {
  int64_t i = 0;
#ifdef __AVX512BW__
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), off = _mm512_set1_epi32(offset);
  for (; i + 16 <= n; i += 16) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
    const __m512 f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(f, vinv));  // round to nearest even, as nearbyint
    v = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(v, lo), hi), off);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(v));
  }
#endif
  for (; i < n; ++i) {
    const int v = static_cast<int>(std::nearbyint(static_cast<float>(x[i]) * inv));
    q[i] = static_cast<uint8_t>(std::clamp(v, -127, 127) + offset);
  }
}
}  // namespace

// Rows of x (bf16) to int8 with one scale each, s = max|x| / 127, or one scale for all of them
// (`per_tensor`); `shift` adds 128 (unsigned bytes, for oneDNN's u8 x s8 linear).
std::vector<torch::Tensor> quantize_rows_int8(torch::Tensor x, bool shift, bool per_tensor) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kBFloat16, "x must be bf16 [M, K]");
  using T = c10::BFloat16;
  const int64_t M = x.size(0), K = x.size(1);
  auto q = torch::empty({M, K}, x.options().dtype(shift ? torch::kByte : torch::kChar));
  auto scales = torch::empty({M, 1}, x.options().dtype(torch::kFloat));
  const T* xp = x.data_ptr<T>();
  uint8_t* qp = static_cast<uint8_t*>(q.data_ptr());
  float* sp = scales.data_ptr<float>();
  const int offset = shift ? 128 : 0;
  const float all = per_tensor ? abs_max(xp, M * K) : 0.f;  // the per-tensor maximum
  at::parallel_for(0, M, 4, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float amax = per_tensor ? all : abs_max(xp + m * K, K);
      const float s = amax > 0.f ? amax / 127.f : 1.f;
      round_bytes(xp + m * K, K, 1.f / s, offset, qp + m * K);
      sp[m] = s;
    }
  });
  return {q, scales};
}

// out[m, n] = acc[m, n] * row_scale[m] * col_scale[n] (col_scale empty: 1), as bf16.
torch::Tensor scale_rows_bf16(torch::Tensor acc, torch::Tensor row_scale, torch::Tensor col_scale) {
  TORCH_CHECK(acc.dim() == 2 && acc.is_contiguous() && row_scale.is_contiguous(), "acc [M, N], row_scale [M]");
  using T = c10::BFloat16;
  const int64_t M = acc.size(0), N = acc.size(1);
  auto out = torch::empty({M, N}, acc.options().dtype(torch::kBFloat16));
  const float* rs = row_scale.data_ptr<float>();
  const bool cols = col_scale.numel() == N;
  const T* cs = cols ? col_scale.data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  auto body = [&](auto* ap) {
    at::parallel_for(0, M, 4, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t n = 0; n < N; ++n) {
          const float c = cols ? static_cast<float>(cs[n]) : 1.f;
          op[m * N + n] = static_cast<T>(static_cast<float>(ap[m * N + n]) * rs[m] * c);
        }
    });
  };
  if (acc.scalar_type() == torch::kInt) {
    body(acc.data_ptr<int32_t>());
  } else {
    TORCH_CHECK(acc.scalar_type() == torch::kFloat, "acc must be int32 or float32");
    body(acc.data_ptr<float>());
  }
  return out;
}

// Batches: x quantized per row, int32 = xq @ w.T by oneDNN, then out = int32 * s[m] * scale[n].
torch::Tensor int8_mm_rows(torch::Tensor x, torch::Tensor w, torch::Tensor scale) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kChar && w.is_contiguous(), "w must be int8 [N, K]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.size(1) && x.is_contiguous() && x.device().is_cpu(), "x must be [M, K]");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "int8_mm_rows: x must be bfloat16");
  TORCH_CHECK(scale.scalar_type() == x.scalar_type() && scale.numel() == w.size(0), "scale must be [N] in x's dtype");
  auto q = quantize_rows_int8(x, false, false);
  return scale_rows_bf16(at::_int_mm(q[0], w.t()), q[1], scale);
}
