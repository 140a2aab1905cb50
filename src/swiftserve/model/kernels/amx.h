// AMX and AVX-512 helpers of the tiled prompt attention (prompt_tiles.cpp): the tile
// configuration and the OS permission, a fast exp2, a 32x32 16-bit register transpose.
#pragma once
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

namespace swiftserve_amx {

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Linux hands out AMX state only on request (once per process).
inline bool request_amx() {
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Eight tiles of 16 rows x 64 bytes (prompt_tiles.cpp: 0-3 O^T, 4-5 S^T, 6 and 7 operands).
inline void load_tile_config() {
  // static: GCC may drop the stores to a local that only the ldtilecfg builtin reads
  static const TileConfig cfg = [] {
    TileConfig c;
    std::memset(&c, 0, sizeof(c));
    c.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = 64;
      c.rows[t] = 16;
    }
    return c;
  }();
  _tile_loadconfig(&cfg);
}

// 2^x for x <= ~8: round to nearest, a degree-3 polynomial for 2^f on [-0.5, 0.5] (fitted;
// relative error below 7.5e-5, far under the bf16 rounding of the probabilities), 2^n built in
// the exponent bits. Rounding by the 1.5 * 2^23 trick and an integer shift issue on both
// vector ports, where roundscale + scalef both went to one. -inf, NaN and anything below
// -126 come out as ~1e-38 (negligible beside a sum >= 1; V^T past a run's end is zeroed).
inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 magic = _mm512_set1_ps(12582912.f);
  __m512 t = _mm512_add_ps(x, magic);
  __asm__("" : "+v"(t));  // opaque values: -ffast-math would fold (x + magic) - magic to x
  __m512 n = _mm512_sub_ps(t, magic);
  __asm__("" : "+v"(n));
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(0.05517161f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24261117f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.693261f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99992807f));
  const __m512i e = _mm512_slli_epi32(_mm512_castps_si512(t), 23);  // round(x) << 23
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
}

// A 32x32 transpose of 16-bit elements in registers: five butterfly levels; at level b, rows
// i and i + b swap their off-diagonal b-wide blocks (two vpermt2w per pair of rows).
inline void transpose32x32_u16(__m512i (&m)[32]) {
  for (int b = 16; b >= 1; b /= 2) {
    alignas(64) uint16_t lo_idx[32], hi_idx[32];
    for (int d = 0; d < 32; ++d) {
      lo_idx[d] = static_cast<uint16_t>((d & b) ? 32 + d - b : d);
      hi_idx[d] = static_cast<uint16_t>((d & b) ? 32 + d : d + b);
    }
    const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
    for (int i = 0; i < 32; ++i) {
      if (i & b) continue;
      const __m512i a = m[i], c = m[i + b];
      m[i] = _mm512_permutex2var_epi16(a, lo, c);
      m[i + b] = _mm512_permutex2var_epi16(a, hi, c);
    }
  }
}

}  // namespace swiftserve_amx
#endif
