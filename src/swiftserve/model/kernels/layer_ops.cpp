// Fused per-layer element-wise ops for CPU: residual-add + RMSNorm, rotary embedding of q and k
// in place, SiLU-and-multiply. Each replaces 3-10 PyTorch kernel launches per layer, which at
// small batch cost more than the arithmetic. Rounding follows the PyTorch path step by step
// (round to the storage dtype where PyTorch would), so bfloat16 results agree with it.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include "bf16_simd.h"

namespace {

template <typename T>
inline float rnd(float x) { return static_cast<float>(static_cast<T>(x)); }
template <>
inline float rnd<float>(float x) { return x; }

#ifdef __AVX512F__
using namespace swiftserve_bf16;

// The bfloat16 rotary of one head, 16 pairs at a time (half % 16 == 0).
inline void rope_head_bf16(c10::BFloat16* x, const c10::BFloat16* c, const c10::BFloat16* s, int64_t half) {
  for (int64_t i = 0; i < half; i += 16)
    rope_pairs_bf16(bf16_load(x + i), bf16_load(x + i + half), c + i, s + i, half, x + i, x + i + half);
}

// bf16 SiLU-and-mul, 16 lanes: bf16(bf16(g * sigmoid(g)) * u), as the PyTorch path rounds.
inline void silu_mul_bf16(const c10::BFloat16* g, const c10::BFloat16* u, c10::BFloat16* o, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    bf16_store_fast(o + i, silu_mul_ps(bf16_load(g + i), bf16_load(u + i)));
  }
  for (; i < n; ++i) {
    const float x = static_cast<float>(g[i]);
    o[i] = static_cast<c10::BFloat16>(rnd<c10::BFloat16>(x / (1.0f + std::exp(std::min(-x, 88.f)))) *
                                      static_cast<float>(u[i]));
  }
}

#endif

// out[r] = weight * to_T(x32 * rsqrt(mean(x32^2) + eps)) for each row r.
template <typename T>
void rms_rows(const T* x, const T* w, T* out, int64_t rows, int64_t n, double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
      float part[16] = {0.f};
      int64_t i = 0;
      for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; ++j) {
          const float v = static_cast<float>(xr[i + j]);
          part[j] += v * v;
        }
      float ss = 0.f;
      for (int j = 0; j < 16; ++j) ss += part[j];
      for (; i < n; ++i) ss += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
      T* o = out + r * n;
      for (int64_t k = 0; k < n; ++k)
        o[k] = static_cast<T>(static_cast<float>(w[k]) * rnd<T>(static_cast<float>(xr[k]) * inv));
    }
  });
}

template <typename T>
void add_rows(T* residual, const T* x, int64_t total) {
  at::parallel_for(0, total, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      residual[i] = static_cast<T>(static_cast<float>(residual[i]) + static_cast<float>(x[i]));
  });
}

// Rotate-half rotary on the first `heads` heads of each row of `qkv` (row stride = qkv width).
template <typename T>
void rope_rows(T* qkv, const T* cos, const T* sin, int64_t rows, int64_t width, int64_t heads,
               int64_t d) {
  const int64_t half = d / 2;
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * d;
      const T* s = sin + t * d;
      for (int64_t h = 0; h < heads; ++h) {
        T* x = qkv + t * width + h * d;
#ifdef __AVX512F__
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          if (half % 16 == 0) {
            rope_head_bf16(x, c, s, half);
            continue;
          }
        }
#endif
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
          const float a = rnd<T>(x1 * static_cast<float>(c[i])) + rnd<T>(-x2 * static_cast<float>(s[i]));
          const float b =
              rnd<T>(x2 * static_cast<float>(c[i + half])) + rnd<T>(x1 * static_cast<float>(s[i + half]));
          x[i] = static_cast<T>(a);
          x[i + half] = static_cast<T>(b);
        }
      }
    }
  });
}

template <typename T>
void silu_mul_rows(const T* gu, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* g = gu + t * 2 * inter;
      const T* u = g + inter;
      T* o = out + t * inter;
#ifdef __AVX512F__
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        silu_mul_bf16(g, u, o, inter);  // the scalar loop ran at a third of memory speed
        continue;
      }
#endif
      for (int64_t i = 0; i < inter; ++i) {
        const float x = static_cast<float>(g[i]);
        // e^-x capped at e^88: -ffast-math assumes no inf, and x / inf came out NaN
        o[i] = static_cast<T>(rnd<T>(x / (1.0f + std::exp(std::min(-x, 88.f)))) * static_cast<float>(u[i]));
      }
    }
  });
}

void check(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

#define DISPATCH_FLOATS(dtype, ...)                                      \
  switch (dtype) {                                                       \
    case torch::kFloat: { using T = float; __VA_ARGS__; break; }         \
    case torch::kBFloat16: { using T = c10::BFloat16; __VA_ARGS__; break; } \
    case torch::kHalf: { using T = c10::Half; __VA_ARGS__; break; }      \
    default: TORCH_CHECK(false, "unsupported dtype");                    \
  }

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check(x, "x");
  check(weight, "weight");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight dtype must match x");
  auto out = torch::empty_like(x);
  const int64_t n = x.size(-1), rows = x.numel() / n;
  DISPATCH_FLOATS(x.scalar_type(),
                  rms_rows<T>(x.data_ptr<T>(), weight.data_ptr<T>(), out.data_ptr<T>(), rows, n, eps));
  return out;
}

// residual += x (in place); returns rms_norm(residual).
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check(x, "x");
  check(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(), "shape/dtype");
  const int64_t n = x.size(-1), rows = x.numel() / n;
#ifdef __AVX512F__
  if (x.scalar_type() == torch::kBFloat16 && n % 16 == 0) {  // one pass over the rows, vectorized
    check(weight, "weight");
    TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.numel() == n, "weight dtype/size");
    auto out = torch::empty_like(x);
    auto* rp = residual.data_ptr<c10::BFloat16>();
    const auto* xp = x.data_ptr<c10::BFloat16>();
    const auto* wp = weight.data_ptr<c10::BFloat16>();
    auto* op = out.data_ptr<c10::BFloat16>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        add_rms_row_bf16(rp + r * n, xp + r * n, wp, op + r * n, n, static_cast<float>(eps));
    });
    return out;
  }
#endif
  DISPATCH_FLOATS(x.scalar_type(), add_rows<T>(residual.data_ptr<T>(), x.data_ptr<T>(), x.numel()));
  return rms_norm(residual, weight, eps);
}

// Rotates q and k in place inside the fused qkv output [T, (H + 2 KVH) * D].
void rope_qk_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t rot_heads, int64_t d) {
  check(qkv, "qkv");
  check(cos, "cos");
  check(sin, "sin");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(), "dtype");
  const int64_t rows = qkv.size(0), width = qkv.size(1);
  TORCH_CHECK(cos.numel() == rows * d && sin.numel() == rows * d, "cos/sin must be [T, D]");
  TORCH_CHECK(rot_heads * d <= width && d % 2 == 0, "bad head layout");
  DISPATCH_FLOATS(qkv.scalar_type(), rope_rows<T>(qkv.data_ptr<T>(), cos.data_ptr<T>(),
                                                  sin.data_ptr<T>(), rows, width, rot_heads, d));
}

torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = torch::empty({rows, inter}, gate_up.options());
  DISPATCH_FLOATS(gate_up.scalar_type(),
                  silu_mul_rows<T>(gate_up.data_ptr<T>(), out.data_ptr<T>(), rows, inter));
  return out;
}

// k, v: [T, KVH, D] views into the fused qkv output (rows strided, heads contiguous);
// caches: [KVH, slots, D]. Replaces two index_copy_ calls per layer (~60 us each at decode).
void write_kv_(torch::Tensor k, torch::Tensor v, torch::Tensor kc, torch::Tensor vc, torch::Tensor slots) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "k, v must be [T, KVH, D]");
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2);
  for (const auto& x : {k, v})
    TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == D && x.scalar_type() == kc.scalar_type(), "k/v layout");
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && vc.sizes() == kc.sizes(), "caches");
  TORCH_CHECK(kc.size(0) == KVH && kc.size(-1) == D, "cache shape");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous() && slots.numel() == T, "slots");
  const int64_t total = kc.numel() / (KVH * D), es = k.element_size();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < total, "slot out of range");
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kcp = static_cast<char*>(kc.data_ptr());
  char* vcp = static_cast<char*>(vc.data_ptr());
  const int64_t ks = k.stride(0), vs = v.stride(0);
  at::parallel_for(0, T, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < KVH; ++h) {
        std::memcpy(kcp + ((h * total + sp[t]) * D) * es, kp + (t * ks + h * D) * es, D * es);
        std::memcpy(vcp + ((h * total + sp[t]) * D) * es, vp + (t * vs + h * D) * es, D * es);
      }
  });
}
