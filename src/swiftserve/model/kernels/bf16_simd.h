// bfloat16 <-> float32 lanes, e^x and SiLU-and-mul on AVX-512: shared by layer_ops.cpp and
// amx_gemm.cpp (the fused MLP epilogue), so both round exactly alike.
#pragma once
#ifdef __AVX512F__
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace swiftserve_bf16 {

// 16 bfloat16 <-> float32 lanes, rounding to nearest even like c10::BFloat16 (finite values).
inline __m512 bf16_load(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512i bf16_bits(__m512 x) {  // rounded value in the high 16 bits
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
}
inline __m512 bf16_round(__m512 x) {
  return _mm512_castsi512_ps(_mm512_and_si512(bf16_bits(x), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void bf16_store(c10::BFloat16* p, __m512 x) {
  const __m256i packed = _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(x), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
}

#ifdef __AVX512BF16__
// The same with the AVX512-BF16 conversion (round to nearest even in one instruction; it
// treats denormal inputs as zero, which c10::BFloat16 does not: far below what matters here).
inline void bf16_store_fast(c10::BFloat16* p, __m512 x) {
  const __m256bh h = _mm512_cvtneps_pbh(x);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<const __m256i&>(h));
}
inline __m512 bf16_round_fast(__m512 x) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(x)); }
#else
inline void bf16_store_fast(c10::BFloat16* p, __m512 x) { bf16_store(p, x); }
inline __m512 bf16_round_fast(__m512 x) { return bf16_round(x); }
#endif

// e^x to ~1 ulp: x = n ln2 + r (ln2 split in two for an exact product), e^r by a degree-6
// Taylor polynomial on |r| <= ln2/2, 2^n by scalef (overflow to inf, underflow to 0).
inline __m512 exp_ps(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// silu(g) * u of 16 lanes as the PyTorch path rounds, bf16(silu(g)) * u (g and u hold bf16
// values; the caller rounds the product when it stores it).
inline __m512 silu_mul_ps(__m512 x, __m512 u) {
  // e^-x capped at e^88 (finite): past it silu(x) is ~0 either way, and inf would give NaN
  const __m512 e = exp_ps(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), x), _mm512_set1_ps(88.f)));
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), e);
  // 1/d by rcp14 and one Newton step (~1 ulp; a division was the loop's bottleneck)
  const __m512 r0 = _mm512_rcp14_ps(d);
  const __m512 r = _mm512_mul_ps(r0, _mm512_fnmadd_ps(d, r0, _mm512_set1_ps(2.f)));
  return _mm512_mul_ps(bf16_round_fast(_mm512_mul_ps(x, r)), u);
}

// 16 rotary pairs as the PyTorch path rounds: x1 = dims i.., x2 = dims i + half.. of a head (bf16
// values), c and s pointing at dim i of the position's cos and sin rows; a and b stored at o1, o2.
inline void rope_pairs_bf16(__m512 x1, __m512 x2, const c10::BFloat16* c, const c10::BFloat16* s, int64_t half,
                            c10::BFloat16* o1, c10::BFloat16* o2) {
  const __m512 c1 = bf16_load(c), s1 = bf16_load(s);
  const __m512 c2 = bf16_load(c + half), s2 = bf16_load(s + half);
  const __m512 neg_x2 = _mm512_sub_ps(_mm512_setzero_ps(), x2);
  const __m512 a = _mm512_add_ps(bf16_round(_mm512_mul_ps(x1, c1)), bf16_round(_mm512_mul_ps(neg_x2, s1)));
  const __m512 b = _mm512_add_ps(bf16_round(_mm512_mul_ps(x2, c2)), bf16_round(_mm512_mul_ps(x1, s2)));
  bf16_store(o1, a);
  bf16_store(o2, b);
}

// One bf16 row: residual = bf16(residual + x) in place, then out = bf16(w * bf16(residual * inv))
// with inv = rsqrt(mean(residual^2) + eps); n % 16 == 0.
inline void add_rms_row_bf16(c10::BFloat16* res, const c10::BFloat16* x, const c10::BFloat16* w,
                             c10::BFloat16* out, int64_t n, float eps) {
  __m512 ss0 = _mm512_setzero_ps(), ss1 = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = bf16_round_fast(_mm512_add_ps(bf16_load(res + i), bf16_load(x + i)));
    bf16_store_fast(res + i, v);
    if ((i / 16) & 1)
      ss1 = _mm512_fmadd_ps(v, v, ss1);
    else
      ss0 = _mm512_fmadd_ps(v, v, ss0);
  }
  const float ss = _mm512_reduce_add_ps(_mm512_add_ps(ss0, ss1));
  const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(ss / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += 16)
    bf16_store_fast(out + i, _mm512_mul_ps(bf16_load(w + i), bf16_round_fast(_mm512_mul_ps(bf16_load(res + i), inv))));
}

}  // namespace swiftserve_bf16
#endif
