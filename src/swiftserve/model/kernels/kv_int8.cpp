// INT8 KV cache on the CPU (kv_cache_dtype="int8"): the quantizing K/V write and the paged
// decode attention that reads it.
//
// A cache row (one token of one KV head) is D int8 values followed by their float32 scale
// (4 bytes): the cache is int8 [KVH, NB, BS, D + 4], so block tables, slots, the prefix cache
// and every signature that passes (k_cache, v_cache) stay as they are. Scale = max|x| / 127
// per row (symmetric); halves the bytes decode attention streams (68 vs 128 bytes a row at
// D = 64). model/kv_quant.py is the PyTorch reference of both.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"
#include "split.h"
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define SWIFT_KV_VNNI 1
#endif

namespace {

constexpr int64_t SCALE_BYTES = 4;

template <typename T>
void quantize_row(const T* x, int64_t D, int8_t* row) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(static_cast<float>(x[d])));
  const float scale = amax > 0.f ? amax / 127.f : 1.f;
  const float inv = 1.f / scale;
  for (int64_t d = 0; d < D; ++d) {
    const int v = static_cast<int>(std::nearbyint(static_cast<float>(x[d]) * inv));
    row[d] = static_cast<int8_t>(std::clamp(v, -127, 127));
  }
  std::memcpy(row + D, &scale, SCALE_BYTES);
}

inline float row_scale(const int8_t* row, int64_t D) {
  float s;
  std::memcpy(&s, row + D, SCALE_BYTES);
  return s;
}

template <typename T>
void write_impl(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& kc, torch::Tensor& vc,
                const int64_t* sp) {
  const int64_t T_ = k.size(0), KVH = k.size(1), D = k.size(2), R = D + SCALE_BYTES;
  const int64_t total = kc.numel() / (KVH * R);
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  int8_t* kcp = kc.data_ptr<int8_t>();
  int8_t* vcp = vc.data_ptr<int8_t>();
  const int64_t ks = k.stride(0), vs = v.stride(0);
  at::parallel_for(0, T_, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < KVH; ++h) {
        quantize_row(kp + t * ks + h * D, D, kcp + (h * total + sp[t]) * R);
        quantize_row(vp + t * vs + h * D, D, vcp + (h * total + sp[t]) * R);
      }
  });
}

#ifdef SWIFT_KV_VNNI
// head_dim 64, G <= 4 query heads per KV head. Scores: each query head is quantized to int8 as
// well (per head, max / 127) and shifted to unsigned, so one vpdpbusd takes a whole 64-byte key
// row: dot(q + 128, k) - dot(128, k) = dot(q, k), exact in int32; 16 rows' partial sums are
// reduced together (reduce16). Values: each row widened to float32 once for the G heads.
template <int G>
void scores_vnni(const float* qf, const int8_t* const* krows, int64_t len, float scale, float* scores) {
  constexpr int64_t D = 64;
  __m512i qv[G];
  float qs[G];
  for (int g = 0; g < G; ++g) {
    float amax = 0.f;
    for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(qf[g * D + d]));
    qs[g] = amax > 0.f ? amax / 127.f : 1.f;
    alignas(64) uint8_t bytes[D];
    const float inv = 1.f / qs[g];
    for (int64_t d = 0; d < D; ++d)
      bytes[d] = static_cast<uint8_t>(std::clamp(static_cast<int>(std::nearbyint(qf[g * D + d] * inv)), -127, 127) + 128);
    qv[g] = _mm512_load_si512(bytes);
  }
  const __m512i shift = _mm512_set1_epi8(static_cast<char>(128));
  int64_t i = 0;
  alignas(64) float ks[16];
  for (; i + 16 <= len; i += 16) {
    __m512 acc[G][16];
    for (int j = 0; j < 16; ++j) {
      const int8_t* row = krows[i + j];
      _mm_prefetch(reinterpret_cast<const char*>(krows[std::min(i + j + 16, len - 1)]), _MM_HINT_T0);
      const __m512i k = _mm512_loadu_si512(row);
      const __m512i corr = _mm512_dpbusd_epi32(_mm512_setzero_si512(), shift, k);
      for (int g = 0; g < G; ++g)
        acc[g][j] = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), qv[g], k), corr));
      ks[j] = row_scale(row, D);
    }
    const __m512 kscale = _mm512_load_ps(ks);
    for (int g = 0; g < G; ++g)
      _mm512_storeu_ps(scores + g * len + i, _mm512_mul_ps(_mm512_mul_ps(reduce16(acc[g]), kscale),
                                                           _mm512_set1_ps(qs[g] * scale)));
  }
  for (; i < len; ++i) {
    const __m512i k = _mm512_loadu_si512(krows[i]);
    const __m512i corr = _mm512_dpbusd_epi32(_mm512_setzero_si512(), shift, k);
    for (int g = 0; g < G; ++g) {
      const __m512i dot = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), qv[g], k), corr);
      scores[g * len + i] = static_cast<float>(_mm512_reduce_add_epi32(dot)) * row_scale(krows[i], D) * qs[g] * scale;
    }
  }
}

template <int G>
void values_vnni(const float* probs, const int8_t* const* vrows, int64_t len, float* acc_out) {
  constexpr int64_t D = 64;
  __m512 a[G][4];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) a[g][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < len; ++i) {
    const int8_t* row = vrows[i];
    _mm_prefetch(reinterpret_cast<const char*>(vrows[std::min(i + 8, len - 1)]), _MM_HINT_T0);
    const float s = row_scale(row, D);
    __m512 v[4];
    for (int c = 0; c < 4; ++c)
      v[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * c))));
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(probs[g * len + i] * s);
      for (int c = 0; c < 4; ++c) a[g][c] = _mm512_fmadd_ps(p, v[c], a[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc_out + g * D + 16 * c, a[g][c]);
}

// false when the shape has no fast path
bool fast_pass(int64_t G, bool values, const float* qf, const int8_t* const* rows, int64_t len, float scale,
               float* scores, float* acc) {
  switch (G) {
    case 1: values ? values_vnni<1>(scores, rows, len, acc) : scores_vnni<1>(qf, rows, len, scale, scores); return true;
    case 2: values ? values_vnni<2>(scores, rows, len, acc) : scores_vnni<2>(qf, rows, len, scale, scores); return true;
    case 3: values ? values_vnni<3>(scores, rows, len, acc) : scores_vnni<3>(qf, rows, len, scale, scores); return true;
    case 4: values ? values_vnni<4>(scores, rows, len, acc) : scores_vnni<4>(qf, rows, len, scale, scores); return true;
    default: return false;
  }
}
#endif

// One (row, KV head): scores over the int8 keys, softmax, then the int8 values, in float32.
template <typename T>
void decode_impl(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc,
                 const torch::Tensor& tables, const torch::Tensor& positions, torch::Tensor& out, double scale,
                 int64_t window) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = kc.size(0), NB = kc.size(1), BS = kc.size(2), R = D + SCALE_BYTES;
  const int64_t G = H / KVH, MAXNB = tables.size(1);
  const T* qp = q.data_ptr<T>();
  const int8_t* kp = kc.data_ptr<int8_t>();
  const int8_t* vp = vc.data_ptr<int8_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  KeySplit split(B, KVH, G, D, pp, window);  // split.h: a few long rows use every thread
  at::parallel_for(0, split.work_items(B), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores, kf(D), maxes(G), sums(G);
    std::vector<const int8_t*> krows, vrows;
    for (int64_t work = begin; work < end; ++work) {
      int64_t b, h, first, pos;  // this item's keys: all of the row's, or a chunk of them
      if (!split.keys(work, &b, &h, &first, &pos)) continue;
      const int64_t len = pos + 1 - first;
      scores.resize(G * len);
      krows.resize(len);
      vrows.resize(len);
      bool fast = false;
#ifdef SWIFT_KV_VNNI
      fast = D == 64 && G <= 4;
#endif
      // the fast path folds the softmax scale in after the integer dot products
      const float qscale = fast ? 1.f : static_cast<float>(scale);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = static_cast<float>(qp[(b * H + h * G + g) * D + d]) * qscale;
      for (int64_t t = first; t <= pos;) {  // block by block: no division per token
        const int64_t bi = t / BS, off = t - bi * BS, n = std::min(BS - off, pos + 1 - t);
        const int64_t base = (h * NB + tp[b * MAXNB + bi]) * BS;
        for (int64_t o = 0; o < n; ++o) {
          krows[t - first + o] = kp + (base + off + o) * R;
          vrows[t - first + o] = vp + (base + off + o) * R;
        }
        t += n;
      }
#ifdef SWIFT_KV_VNNI
      if (fast) fast_pass(G, false, qf.data(), krows.data(), len, static_cast<float>(scale), scores.data(), nullptr);
#endif
      for (int64_t i = 0; i < len && !fast; ++i) {
        const int8_t* row = krows[i];
        for (int64_t d = 0; d < D; ++d) kf[d] = static_cast<float>(row[d]);  // widened once for G heads
        const float s = row_scale(row, D);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = &qf[g * D];
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * kf[d];
          scores[g * len + i] = dot * s;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t g = 0; g < G; ++g) {
        float* sg = &scores[g * len];
        const float m = *std::max_element(sg, sg + len);
        float sum = 0.f;
        for (int64_t i = 0; i < len; ++i) {
          sg[i] = std::exp(sg[i] - m);  // left unnormalized: the sum divides at the end
          sum += sg[i];
        }
        maxes[g] = m;
        sums[g] = sum;
      }
#ifdef SWIFT_KV_VNNI
      if (fast) fast_pass(G, true, nullptr, vrows.data(), len, 0.f, scores.data(), acc.data());
#endif
      for (int64_t i = 0; i < len && !fast; ++i) {
        const int8_t* row = vrows[i];
        for (int64_t d = 0; d < D; ++d) kf[d] = static_cast<float>(row[d]);
        const float s = row_scale(row, D);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * len + i] * s;
          float* a = &acc[g * D];
          for (int64_t d = 0; d < D; ++d) a[d] += p * kf[d];
        }
      }
      if (split.keep(work, maxes.data(), sums.data(), acc.data())) continue;  // merged below
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) op[(b * H + h * G + g) * D + d] = static_cast<T>(acc[g * D + d] / sums[g]);
    }
  });
  split.merge(B, op);
}

}  // namespace

void write_kv_int8_(torch::Tensor k, torch::Tensor v, torch::Tensor kc, torch::Tensor vc, torch::Tensor slots) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "k, v must be [T, KVH, D]");
  const int64_t T_ = k.size(0), KVH = k.size(1), D = k.size(2);
  for (const auto& x : {k, v}) TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == D, "k/v layout");
  TORCH_CHECK(kc.scalar_type() == torch::kChar && kc.is_contiguous() && vc.is_contiguous() &&
                  vc.sizes() == kc.sizes() && kc.size(0) == KVH && kc.size(-1) == D + SCALE_BYTES,
              "int8 caches [KVH, NB, BS, D + 4]");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous() && slots.numel() == T_, "slots");
  const int64_t total = kc.numel() / (KVH * (D + SCALE_BYTES));
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < total, "slot out of range");
  if (k.scalar_type() == torch::kBFloat16) {
    write_impl<c10::BFloat16>(k, v, kc, vc, sp);
  } else if (k.scalar_type() == torch::kFloat) {
    write_impl<float>(k, v, kc, vc, sp);
  } else {
    TORCH_CHECK(false, "write_kv_int8_: k must be float32 or bfloat16");
  }
}

torch::Tensor paged_decode_int8(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor tables,
                                torch::Tensor positions, double scale, int64_t window) {
  TORCH_CHECK(q.is_contiguous() && kc.is_contiguous() && vc.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(kc.scalar_type() == torch::kChar && kc.size(-1) == q.size(2) + SCALE_BYTES, "int8 caches [.., D + 4]");
  TORCH_CHECK(tables.scalar_type() == torch::kLong && positions.scalar_type() == torch::kLong, "int64 tables/positions");
  auto t = tables.contiguous();
  auto p = positions.contiguous();
  auto out = torch::empty_like(q);
  if (q.scalar_type() == torch::kBFloat16) {
    decode_impl<c10::BFloat16>(q, kc, vc, t, p, out, scale, window);
  } else if (q.scalar_type() == torch::kFloat) {
    decode_impl<float>(q, kc, vc, t, p, out, scale, window);
  } else {
    TORCH_CHECK(false, "paged_decode_int8: q must be float32 or bfloat16");
  }
  return out;
}
