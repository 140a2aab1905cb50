// Splitting one request's keys across threads (decode attention at small batch), shared by the
// bf16/float and the INT8-cache decode kernels.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

// Chunks per (row, KV head): one long request is only KVH work items (3 for SmolLM) for the
// threads, so its keys are cut into chunks, each with its own max and sum, merged after.
inline int64_t key_splits(int64_t items, int64_t max_len) {
  const int64_t threads = at::get_num_threads();
  if (items >= 2 * threads || max_len < 1024) return 1;
  return std::max<int64_t>(1, std::min<int64_t>((2 * threads + items - 1) / items, max_len / 512));
}

// The chunk c of S over keys [first, pos]: [lo, hi], empty when lo > hi.
inline void key_chunk(int64_t first, int64_t pos, int64_t c, int64_t S, int64_t* lo, int64_t* hi) {
  const int64_t len = pos + 1 - first, step = (len + S - 1) / S;
  *lo = first + c * step;
  *hi = std::min(pos, *lo + step - 1);
}

// out[g][d] = sum_c w_c acc_c[g][d] / sum_c w_c l_c[g], w_c = exp(m_c[g] - max_c m_c[g]):
// partials of S chunks, each [G] maxima, [G] sums of exp, [G][D] unnormalized sums.
template <typename T>
void merge_chunks(const float* m, const float* l, const float* acc, int64_t S, int64_t G, int64_t D, T* out) {
  for (int64_t g = 0; g < G; ++g) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < S; ++c) top = std::max(top, m[c * G + g]);
    float denom = 0.f;
    std::vector<float> sum(D, 0.f);
    for (int64_t c = 0; c < S; ++c) {
      if (l[c * G + g] == 0.f) continue;  // a chunk with no key
      const float w = std::exp(m[c * G + g] - top);
      denom += w * l[c * G + g];
      for (int64_t d = 0; d < D; ++d) sum[d] += w * acc[(c * G + g) * D + d];
    }
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<T>(sum[d] / denom);
  }
}
