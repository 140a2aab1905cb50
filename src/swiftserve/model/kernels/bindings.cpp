// Python bindings of the CPU kernels (one extension module, several translation units).
#include <torch/extension.h>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor tables,
                           torch::Tensor positions, double scale, int64_t window);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rope_qk_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t rot_heads, int64_t d);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
torch::Tensor int8_gemv(torch::Tensor x, torch::Tensor w, torch::Tensor scale);
void write_kv_(torch::Tensor k, torch::Tensor v, torch::Tensor kc, torch::Tensor vc, torch::Tensor slots);
bool bf16_gemm_available();
int64_t bf16_gemm_panel_width();
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor wp, int64_t N, c10::optional<torch::Tensor> bias);
torch::Tensor decoder_stack(torch::Tensor h, std::vector<torch::Tensor> layers, std::vector<torch::Tensor> k_caches,
                            std::vector<torch::Tensor> v_caches, torch::Tensor final_norm, torch::Tensor cos,
                            torch::Tensor sin, torch::Tensor tables, torch::Tensor positions, torch::Tensor slots,
                            std::vector<int64_t> dims, double eps, double scale, int64_t window);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "fused paged decode attention (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension");
  m.def("add_rms_norm", &add_rms_norm, "residual += x, then RMSNorm(residual)");
  m.def("rope_qk_", &rope_qk_, "rotary embedding of q and k, in place in the fused qkv output");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for a fused [T, 2I] gate_up output");
  m.def("write_kv_", &write_kv_, "store new K/V rows at their cache slots");
  m.def("bf16_gemm_available", &bf16_gemm_available, "whether bf16_linear was compiled (AVX512-BF16)");
  m.def("bf16_gemm_panel_width", &bf16_gemm_panel_width, "output columns per packed weight panel");
  m.def("bf16_linear", &bf16_linear, "x @ w.T (+ bias) in bf16 over a panel-packed weight");
  m.def("decoder_stack", &decoder_stack, "every decoder layer of a bf16 model in one call (fused path)");
  m.def("int8_gemv", &int8_gemv, "x @ (w * scale).T for a few rows x, int8 w, per-row scale");
}
