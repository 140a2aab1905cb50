// The whole decoder stack of a bfloat16 Llama-family model in one call, for steps whose every
// row goes through the fused attention kernel. Each linear is our bf16 panel GEMM or, in a
// quantized model, the kernel its layer would call: INT8 W8A8 on an AVX512-VNNI CPU
// (kernels/gemv_vnni.cpp), INT4 PyTorch's _weight_int4pack_mm_for_cpu.
//
// Why: a decode step of SmolLM-135M makes ~600 Python-level calls (30 layers x norms, four
// linears, rotary, K/V write, attention, SiLU-and-mul, module __call__s). Single-stream that
// was ~3 ms of an ~8.8 ms token, more than the attention math. This loop calls the same C++
// functions in the same order as model/llama.py does with kernels on, so its results are
// bit-identical to the Python path (tests/test_layer_stack.py); it only removes the
// interpreter between them.
#include <torch/extension.h>

#include <vector>

#include "ops.h"

namespace {
// input_norm, qkv (w, scale, wsum), qkv_bias, o (3), post_norm, gate_up (3), down (3)
constexpr size_t PER_LAYER = 15;

c10::optional<torch::Tensor> maybe(const torch::Tensor& t) {
  return t.defined() && t.numel() > 0 ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

// w[0..2]: a bf16 panel-packed weight and two empty tensors; an INT8 weight, its per-row scale
// and group sums; or an INT4 weight packed by PyTorch (uint8) and its [groups, N, 2] scales and
// zeros. The bias is added after, as Int8Linear / Int4Linear.forward do.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor* w, int64_t n, c10::optional<torch::Tensor> bias) {
  if (w[1].numel() == 0) return bf16_linear(x, w[0], n, bias);
  torch::Tensor out;
  if (w[0].scalar_type() == torch::kChar) {
    out = x.size(0) <= INT8_VNNI_MAX_ROWS ? int8_gemv_vnni(x, w[0], w[2], w[1]) : int8_mm_rows(x, w[0], w[1]);
  } else {
    out = at::_weight_int4pack_mm_for_cpu(x, w[0], x.size(1) / w[1].size(0), w[1]);
  }
  return bias ? out + *bias : out;
}
}  // namespace

// h: [T, hidden] embeddings, or a pipeline stage's input (the previous stage's output, with
// its residual stream in ``residual``; undefined before the first layer). layers: PER_LAYER
// tensors per layer (packed weights as made by PanelLinear or Int8Linear, an empty scale for
// a bf16 one; an empty qkv_bias means none). dims: {num_heads, num_kv_heads, head_dim,
// hidden, intermediate}; scale: the attention scale as Python computes it. Runs the layers;
// ``residual`` holds the residual stream after, the result is the last layer's output.
static torch::Tensor run_layers(torch::Tensor h, torch::Tensor& residual, const std::vector<torch::Tensor>& layers,
                                const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                                const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& tables,
                                const torch::Tensor& positions, const torch::Tensor& slots,
                                const std::vector<int64_t>& dims, double eps, double scale, int64_t window) {
  TORCH_CHECK(dims.size() == 5, "dims: {num_heads, num_kv_heads, head_dim, hidden, intermediate}");
  const int64_t H = dims[0], KVH = dims[1], D = dims[2], hidden = dims[3], inter = dims[4];
  const size_t L = k_caches.size();
  TORCH_CHECK(layers.size() == L * PER_LAYER && v_caches.size() == L, "one set of weights and caches per layer");
  TORCH_CHECK(h.dim() == 2 && h.size(1) == hidden, "h must be [T, hidden]");
  const int64_t T = h.size(0), q_size = H * D, kv_size = KVH * D;
  const bool int8_kv = L > 0 && k_caches[0].scalar_type() == torch::kChar;  // kv_cache_dtype="int8"
  for (size_t l = 0; l < L; ++l) {
    const torch::Tensor* w = &layers[l * PER_LAYER];
    if (!residual.defined()) {
      residual = h;
      h = rms_norm(h, w[0], eps);
    } else {
      h = add_rms_norm(h, residual, w[0], eps);  // residual += h, in place
    }
    auto qkv = linear(h, w + 1, q_size + 2 * kv_size, maybe(w[4]));
    rope_qk_(qkv, cos, sin, H + KVH, D);
    auto q = qkv.narrow(1, 0, q_size).view({T, H, D});
    auto k = qkv.narrow(1, q_size, kv_size).view({T, KVH, D});
    auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, KVH, D});
    torch::Tensor attn;
    if (int8_kv) {
      write_kv_int8_(k, v, k_caches[l], v_caches[l], slots);
      attn = paged_decode_int8(q.contiguous(), k_caches[l], v_caches[l], tables, positions, scale, window);
    } else {
      write_kv_(k, v, k_caches[l], v_caches[l], slots);
      attn = paged_decode(q.contiguous(), k_caches[l], v_caches[l], tables, positions, scale, window);
    }
    h = linear(attn.view({T, q_size}), w + 5, hidden, c10::nullopt);
    h = add_rms_norm(h, residual, w[8], eps);
    auto act = silu_and_mul(linear(h, w + 9, 2 * inter, c10::nullopt));
    h = linear(act, w + 12, hidden, c10::nullopt);
  }
  return h;
}

// Every layer from the embeddings ``h``; returns the final-normed hidden states [T, hidden].
torch::Tensor decoder_stack(torch::Tensor h, std::vector<torch::Tensor> layers, std::vector<torch::Tensor> k_caches,
                            std::vector<torch::Tensor> v_caches, torch::Tensor final_norm, torch::Tensor cos,
                            torch::Tensor sin, torch::Tensor tables, torch::Tensor positions, torch::Tensor slots,
                            std::vector<int64_t> dims, double eps, double scale, int64_t window) {
  torch::Tensor residual;
  h = run_layers(h, residual, layers, k_caches, v_caches, cos, sin, tables, positions, slots, dims, eps, scale,
                 window);
  return add_rms_norm(h, residual, final_norm, eps);
}

// A pipeline stage's layers: ``residual`` empty on the first stage. Returns {output, residual}
// for the next stage or, when ``last``, {final-normed hidden states, empty}.
std::vector<torch::Tensor> decoder_stack_stage(torch::Tensor h, torch::Tensor residual, std::vector<torch::Tensor> layers,
                                               std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
                                               torch::Tensor final_norm, torch::Tensor cos, torch::Tensor sin,
                                               torch::Tensor tables, torch::Tensor positions, torch::Tensor slots,
                                               std::vector<int64_t> dims, double eps, double scale, int64_t window,
                                               bool last) {
  torch::Tensor res = residual.numel() ? residual : torch::Tensor();
  h = run_layers(h, res, layers, k_caches, v_caches, cos, sin, tables, positions, slots, dims, eps, scale, window);
  if (last) return {add_rms_norm(h, res, final_norm, eps), torch::empty({0}, h.options())};
  return {h, res};
}
