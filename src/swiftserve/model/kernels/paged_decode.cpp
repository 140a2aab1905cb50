// Fused paged decode attention for CPU: one pass over each request's K/V blocks, no gather.
// q: [B, H, D]; caches: [KVH, NB, BS, D] (head-major); block_tables: [B, MAXNB] int64;
// positions: [B] int64 (query position; keys 0..pos are attended, within the window).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <cstring>
#include <type_traits>

#include "simd.h"
#include "split.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

// bf16 -> float is a 16-bit shift; written out so the compiler can vectorize it.
static inline float to_f(c10::BFloat16 x) {
  uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
static inline float to_f(float x) { return x; }
static inline float to_f(c10::Half x) { return static_cast<float>(x); }

// Dot product with 16 independent partial sums (vectorizes without -ffast-math).
template <typename T>
static inline float dot(const float* q, const T* k, int64_t n) {
  float part[16] = {0.f};
  int64_t d = 0;
  for (; d + 16 <= n; d += 16)
    for (int j = 0; j < 16; ++j) part[j] += q[d + j] * to_f(k[d + j]);
  float s = 0.f;
  for (int j = 0; j < 16; ++j) s += part[j];
  for (; d < n; ++d) s += q[d] * to_f(k[d]);
  return s;
}

#ifdef __AVX512F__
// Register-resident path for head_dim 64 and up to 4 query heads per KV head (Llama, Qwen2,
// SmolLM shapes): q, the K/V row and the G output accumulators stay in zmm registers. The
// generic loops below keep the accumulators in memory and widen rows through a scratch
// array; with K/V hot in cache they ran at ~32 GFLOP/s (0.88 ms per layer at batch 64).
static inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

template <int G, typename T>
static void scores_d64(const float* qf, const T* const* krows, int64_t len, float* scores) {
  __m512 q[G][4];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) q[g][c] = _mm512_loadu_ps(qf + g * 64 + 16 * c);
  for (int64_t i = 0; i < len; ++i) {
    __m512 kv[4];
    for (int c = 0; c < 4; ++c) kv[c] = load16(krows[i] + 16 * c);
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_mul_ps(q[g][0], kv[0]);
      for (int c = 1; c < 4; ++c) acc = _mm512_fmadd_ps(q[g][c], kv[c], acc);
      scores[g * len + i] = _mm512_reduce_add_ps(acc);
    }
  }
}

template <int G, typename T>
static void values_d64(const float* probs, const T* const* vrows, int64_t len, float* acc_out) {
  __m512 a[G][4];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) a[g][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < len; ++i) {
    __m512 vv[4];
    for (int c = 0; c < 4; ++c) vv[c] = load16(vrows[i] + 16 * c);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(probs[g * len + i]);
      for (int c = 0; c < 4; ++c) a[g][c] = _mm512_fmadd_ps(p, vv[c], a[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc_out + g * 64 + 16 * c, a[g][c]);
}

template <typename T>
static bool fast_path(int64_t G, const float* qf, const T* const* krows, const T* const* vrows,
                      int64_t len, float* scores, float* acc, bool values) {
  if constexpr (std::is_same_v<T, c10::Half>) {
    return false;
  } else {
    switch (G) {
      case 1: values ? values_d64<1>(scores, vrows, len, acc) : scores_d64<1>(qf, krows, len, scores); return true;
      case 2: values ? values_d64<2>(scores, vrows, len, acc) : scores_d64<2>(qf, krows, len, scores); return true;
      case 3: values ? values_d64<3>(scores, vrows, len, acc) : scores_d64<3>(qf, krows, len, scores); return true;
      case 4: values ? values_d64<4>(scores, vrows, len, acc) : scores_d64<4>(qf, krows, len, scores); return true;
      default: return false;
    }
  }
}
#endif

#ifdef __AVX512BF16__
// AVX512-BF16 path (bf16 caches, head_dim 64, 1-4 query heads per KV head): vdpbf16ps takes
// the bf16 rows as they are (no widening), and 16 tokens' partial sums are reduced together
// by a transpose tree instead of one horizontal sum per token. The probabilities are rounded
// to bf16 for the P.V products, as PyTorch's CPU flash attention does for bf16 inputs.
static inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

template <int G>
static void scores_bf16(const c10::BFloat16* q, const c10::BFloat16* const* krows, int64_t len,
                        float scale, float* scores, const c10::BFloat16* const* vrows) {
  __m512bh qv[G][2];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 2; ++c) qv[g][c] = as_bh(_mm512_loadu_si512(q + g * 64 + 32 * c));
  const __m512 sc = _mm512_set1_ps(scale);
  auto fetch = [&](const c10::BFloat16* const* rows, int64_t from, int64_t to) {
    for (int64_t r = from; r < std::min(to, len); ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(rows[r]), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(rows[r] + 32), _MM_HINT_T0);
    }
  };
  fetch(krows, 0, 32);
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    fetch(krows, i + 32, i + 48);  // K two chunks ahead
    fetch(vrows, i, i + 16);       // V for the second pass
    for (int g = 0; g < G; ++g) {  // the 16 rows stay in L1 across the G heads
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) {
        const __m512i k0 = _mm512_loadu_si512(krows[i + j]);
        const __m512i k1 = _mm512_loadu_si512(krows[i + j] + 32);
        acc[j] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], as_bh(k0)), qv[g][1],
                                  as_bh(k1));
      }
      _mm512_storeu_ps(scores + g * len + i, _mm512_mul_ps(reduce16(acc), sc));
    }
  }
  for (; i < len; ++i) {
    const __m512i k0 = _mm512_loadu_si512(krows[i]);
    const __m512i k1 = _mm512_loadu_si512(krows[i] + 32);
    for (int g = 0; g < G; ++g) {
      const __m512 a = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], as_bh(k0)),
                                        qv[g][1], as_bh(k1));
      scores[g * len + i] = _mm512_reduce_add_ps(a) * scale;
    }
  }
}

// acc_out[g * 64 + d] = sum_i probs[g * len + i] * v_i[d]; pb: scratch for G * (len + 1) bf16.
template <int G>
static void values_bf16(const float* probs, const c10::BFloat16* const* vrows, int64_t len,
                        float* acc_out, uint16_t* pb) {
  const int64_t stride = len + 1;  // one zero past the end pairs an odd last token
  for (int g = 0; g < G; ++g) {
    for (int64_t i = 0; i < len; i += 16) {
      const __mmask16 m = len - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (len - i)) - 1);
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, probs + g * len + i));
      _mm256_mask_storeu_epi16(pb + g * stride + i, m, reinterpret_cast<const __m256i&>(h));
    }
    pb[g * stride + len] = 0;
  }
  __m512 a[G][4];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) a[g][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < len; i += 2) {
    const c10::BFloat16* r0 = vrows[i];
    const c10::BFloat16* r1 = i + 1 < len ? vrows[i + 1] : r0;  // its probability is 0
    const __m512i x0 = _mm512_loadu_si512(r0), x1 = _mm512_loadu_si512(r0 + 32);
    const __m512i y0 = _mm512_loadu_si512(r1), y1 = _mm512_loadu_si512(r1 + 32);
    // (v_i[d], v_{i+1}[d]) pairs: per 128-bit lane L, lo holds d = 8L..8L+3, hi d = 8L+4..8L+7
    const __m512i v[4] = {_mm512_unpacklo_epi16(x0, y0), _mm512_unpackhi_epi16(x0, y0),
                          _mm512_unpacklo_epi16(x1, y1), _mm512_unpackhi_epi16(x1, y1)};
    for (int g = 0; g < G; ++g) {
      uint32_t pair;
      std::memcpy(&pair, pb + g * stride + i, sizeof(pair));
      const __m512bh pp = as_bh(_mm512_set1_epi32(static_cast<int>(pair)));
      for (int c = 0; c < 4; ++c) a[g][c] = _mm512_dpbf16_ps(a[g][c], as_bh(v[c]), pp);
    }
  }
  alignas(64) float tmp[16];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) {
      _mm512_store_ps(tmp, a[g][c]);
      const int base = 32 * (c / 2) + 4 * (c % 2);
      for (int L = 0; L < 4; ++L)
        for (int e = 0; e < 4; ++e) acc_out[g * 64 + base + 8 * L + e] = tmp[4 * L + e];
    }
}

// Both passes for one (request, KV head); false when the shape is not covered.
static bool bf16_pass(int64_t G, bool values, const c10::BFloat16* q, const c10::BFloat16* const* rows,
                      const c10::BFloat16* const* vrows, int64_t len, float scale, float* scores,
                      float* acc, uint16_t* pb) {
  switch (G) {
    case 1: values ? values_bf16<1>(scores, rows, len, acc, pb) : scores_bf16<1>(q, rows, len, scale, scores, vrows); return true;
    case 2: values ? values_bf16<2>(scores, rows, len, acc, pb) : scores_bf16<2>(q, rows, len, scale, scores, vrows); return true;
    case 3: values ? values_bf16<3>(scores, rows, len, acc, pb) : scores_bf16<3>(q, rows, len, scale, scores, vrows); return true;
    case 4: values ? values_bf16<4>(scores, rows, len, acc, pb) : scores_bf16<4>(q, rows, len, scale, scores, vrows); return true;
    default: return false;
  }
}
#endif

template <typename T>
static void decode_impl(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc,
                        const torch::Tensor& tables, const torch::Tensor& positions,
                        torch::Tensor& out, double scale, int64_t window) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = kc.size(0), NB = kc.size(1), BS = kc.size(2);
  const int64_t G = H / KVH, MAXNB = tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  KeySplit split(B, KVH, G, D, pp, window);  // split.h: a few long rows use every thread
  at::parallel_for(0, split.work_items(B), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), kf(D), vf(D), inv(G), sums(G), maxes(G), scores;
    std::vector<const T*> krows, vrows;
    std::vector<uint16_t> pb;  // bf16 probabilities (AVX512-BF16 path)
    for (int64_t work = begin; work < end; ++work) {
      int64_t b, h, first, pos;  // this item's keys: all of the row's, or a chunk of them
      if (!split.keys(work, &b, &h, &first, &pos)) continue;
      const int64_t len = pos + 1 - first;
      scores.assign(G * len, 0.f);
      krows.resize(len);
      vrows.resize(len);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = to_f(qp[(b * H + h * G + g) * D + d]) * static_cast<float>(scale);
      bool self_fetch = false;  // the AVX512-BF16 path prefetches as it goes
#ifdef __AVX512BF16__
      self_fetch = std::is_same_v<T, c10::BFloat16> && D == 64 && G <= 4;
#endif
      // Block by block: a division per token cost as much as the attention math itself.
      for (int64_t t = first; t <= pos;) {
        const int64_t bi = t / BS, off = t - bi * BS, n = std::min(BS - off, pos + 1 - t);
        const int64_t block = tp[b * MAXNB + bi];
        const T* kb = kp + (h * NB + block) * BS * D;
        const T* vb = vp + (h * NB + block) * BS * D;
        // Latency-bound on K/V that the GEMMs evicted: at each block boundary ask for the next
        // block's K rows and this block's V rows (read by the second pass). Measured 1.5x faster
        // with cold caches.
        if (!self_fetch && off == 0 && bi + 1 < MAXNB) {
          const char* nk = reinterpret_cast<const char*>(kp + (h * NB + tp[b * MAXNB + bi + 1]) * BS * D);
          const char* nv = reinterpret_cast<const char*>(vb);
          for (int64_t byte = 0; byte < BS * D * (int64_t)sizeof(T); byte += 64) {
            __builtin_prefetch(nk + byte);
            __builtin_prefetch(nv + byte);
          }
        }
        for (int64_t o = 0; o < n; ++o) {
          krows[t - first + o] = kb + (off + o) * D;
          vrows[t - first + o] = vb + (off + o) * D;
        }
        t += n;
      }
      bool dot16 = false, fast = false;
#ifdef __AVX512BF16__
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        pb.resize(G * (len + 1));
        dot16 = D == 64 && bf16_pass(G, false, qp + (b * H + h * G) * D, krows.data(), vrows.data(), len,
                                     static_cast<float>(scale), scores.data(), nullptr, pb.data());
      }
#endif
#ifdef __AVX512F__
      fast = !dot16 && D == 64 &&
             fast_path<T>(G, qf.data(), krows.data(), vrows.data(), len, scores.data(), acc.data(), false);
#endif
      if (!fast && !dot16) {
        for (int64_t i = 0; i < len; ++i) {
          // Widen the K row once and reuse it for the G query heads that share this KV head.
          for (int64_t d = 0; d < D; ++d) kf[d] = to_f(krows[i][d]);
          for (int64_t g = 0; g < G; ++g) scores[g * len + i] = dot(&qf[g * D], kf.data(), D);
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t g = 0; g < G; ++g) {
        float* sg = &scores[g * len];
        float m = sg[0];  // len >= 1: the query attends at least to itself
        for (int64_t i = 1; i < len; ++i) m = std::max(m, sg[i]);
        float sum = 0.f;
        // With -ffast-math this loop calls glibc's vector expf (scalar expf was the bottleneck).
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < len; ++i) {
          sg[i] = std::exp(sg[i] - m);
          sum += sg[i];
        }
        inv[g] = 1.f / sum;
        maxes[g] = m;
        sums[g] = sum;
      }
#ifdef __AVX512BF16__
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (dot16) bf16_pass(G, true, nullptr, vrows.data(), nullptr, len, 0.f, scores.data(), acc.data(), pb.data());
      }
#endif
#ifdef __AVX512F__
      if (fast) fast_path<T>(G, qf.data(), krows.data(), vrows.data(), len, scores.data(), acc.data(), true);
#endif
      if (!fast && !dot16) {
        for (int64_t i = 0; i < len; ++i) {
          for (int64_t d = 0; d < D; ++d) vf[d] = to_f(vrows[i][d]);
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[g * len + i];
            float* a = &acc[g * D];
            for (int64_t d = 0; d < D; ++d) a[d] += p * vf[d];
          }
        }
      }
      if (split.keep(work, maxes.data(), sums.data(), acc.data())) continue;  // merged below
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          op[(b * H + h * G + g) * D + d] = static_cast<T>(acc[g * D + d] * inv[g]);
    }
  });
  split.merge(B, op);
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kc, torch::Tensor vc,
                           torch::Tensor tables, torch::Tensor positions, double scale,
                           int64_t window) {
  TORCH_CHECK(q.is_contiguous() && kc.is_contiguous() && vc.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(tables.scalar_type() == torch::kLong && positions.scalar_type() == torch::kLong,
              "int64 tables/positions");
  auto t = tables.contiguous();
  auto p = positions.contiguous();
  auto out = torch::empty_like(q);
  if (q.scalar_type() == torch::kBFloat16) {
    decode_impl<c10::BFloat16>(q, kc, vc, t, p, out, scale, window);
  } else if (q.scalar_type() == torch::kFloat) {
    decode_impl<float>(q, kc, vc, t, p, out, scale, window);
  } else if (q.scalar_type() == torch::kHalf) {
    decode_impl<c10::Half>(q, kc, vc, t, p, out, scale, window);
  } else {
    TORCH_CHECK(false, "unsupported dtype");
  }
  return out;
}

