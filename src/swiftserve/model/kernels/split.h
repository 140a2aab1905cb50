// Splitting one request's keys across threads (decode attention at small batch), shared by the
// bf16/float and the INT8-cache decode kernels.
//
// One long request is only KVH work items (3 for SmolLM) for the threads, so its keys are cut
// into chunks, each computed with its own max and sum of exponentials, merged after.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

class KeySplit {
 public:
  // B rows at positions pp (keys 0..pp[b], the last `window` of them when window > 0), KVH KV
  // heads of G query heads each, head_dim D.
  KeySplit(int64_t B, int64_t KVH, int64_t G, int64_t D, const int64_t* pp, int64_t window)
      : KVH_(KVH), G_(G), D_(D), pp_(pp), window_(window) {
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; ++b) max_len = std::max(max_len, window > 0 ? std::min(pp[b] + 1, window) : pp[b] + 1);
    const int64_t items = B * KVH, threads = at::get_num_threads();
    if (items < 2 * threads && max_len >= 1024)
      S_ = std::max<int64_t>(1, std::min<int64_t>((2 * threads + items - 1) / items, max_len / 512));
    if (S_ > 1) {
      m_.resize(items * S_ * G);
      l_.resize(m_.size());
      acc_.resize(m_.size() * D);
    }
  }

  int64_t work_items(int64_t B) const { return B * KVH_ * S_; }

  // The row, KV head and keys [first, pos] of a work item; false when its chunk holds no key.
  bool keys(int64_t work, int64_t* b, int64_t* h, int64_t* first, int64_t* pos) {
    const int64_t item = work / S_, chunk = work % S_;
    *b = item / KVH_;
    *h = item % KVH_;
    const int64_t row_pos = pp_[*b];
    const int64_t row_first = window_ > 0 ? std::max<int64_t>(0, row_pos - window_ + 1) : 0;
    const int64_t step = (row_pos + 1 - row_first + S_ - 1) / S_;
    *first = row_first + chunk * step;
    *pos = std::min(row_pos, *first + step - 1);
    if (*first <= *pos) return true;
    for (int64_t g = 0; g < G_; ++g) l_[work * G_ + g] = 0.f;  // adds nothing to the merge
    return false;
  }

  // A split item keeps its unnormalized sums [G][D], maxima and sums of exp (true); an unsplit
  // one is written by the caller (false).
  bool keep(int64_t work, const float* maxes, const float* sums, const float* acc) {
    if (S_ == 1) return false;
    std::copy(maxes, maxes + G_, m_.begin() + work * G_);
    std::copy(sums, sums + G_, l_.begin() + work * G_);
    std::copy(acc, acc + G_ * D_, acc_.begin() + work * G_ * D_);
    return true;
  }

  // out [B, H, D]: every split item's chunks, each rescaled to the overall max.
  template <typename T>
  void merge(int64_t B, T* out) const {
    if (S_ == 1) return;
    at::parallel_for(0, B * KVH_, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> sum(D_);
      for (int64_t item = begin; item < end; ++item) {
        const float* m = &m_[item * S_ * G_];
        const float* l = &l_[item * S_ * G_];
        T* o = out + item * G_ * D_;  // (b * H + h * G) * D with H = KVH * G
        for (int64_t g = 0; g < G_; ++g) {
          float top = -std::numeric_limits<float>::infinity(), denom = 0.f;
          for (int64_t c = 0; c < S_; ++c)
            if (l[c * G_ + g] > 0.f) top = std::max(top, m[c * G_ + g]);
          std::fill(sum.begin(), sum.end(), 0.f);
          for (int64_t c = 0; c < S_; ++c) {
            if (l[c * G_ + g] == 0.f) continue;  // a chunk with no key
            const float w = std::exp(m[c * G_ + g] - top);
            denom += w * l[c * G_ + g];
            const float* a = &acc_[((item * S_ + c) * G_ + g) * D_];
            for (int64_t d = 0; d < D_; ++d) sum[d] += w * a[d];
          }
          for (int64_t d = 0; d < D_; ++d) o[g * D_ + d] = static_cast<T>(sum[d] / denom);
        }
      }
    });
  }

 private:
  int64_t KVH_, G_, D_;
  const int64_t* pp_;
  int64_t window_;
  int64_t S_ = 1;
  std::vector<float> m_, l_, acc_;
};
