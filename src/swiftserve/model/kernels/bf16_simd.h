// bfloat16 <-> float32 lanes, e^x and SiLU-and-mul on AVX-512: shared by layer_ops.cpp and
// amx_gemm.cpp (the fused MLP epilogue), so both round exactly alike.
#pragma once
#ifdef __AVX512F__
#include <c10/util/BFloat16.h>
#include <immintrin.h>

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

}  // namespace swiftserve_bf16
#endif
