// Declarations of the kernel entry points (defined in the .cpp files of this folder), shared
// by the bindings and by layer_stack.cpp, which calls them directly.
#pragma once
#include <torch/extension.h>
#include <vector>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor tables,
                           torch::Tensor positions, double scale, int64_t window);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rope_qk_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t rot_heads, int64_t d);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
torch::Tensor int8_gemv(torch::Tensor x, torch::Tensor w, torch::Tensor scale);
bool int8_vnni_available();
torch::Tensor int8_gemv_vnni(torch::Tensor x, torch::Tensor w, torch::Tensor wsum, torch::Tensor scale);
torch::Tensor int8_mm_rows(torch::Tensor x, torch::Tensor w, torch::Tensor scale);
std::vector<torch::Tensor> quantize_rows_int8(torch::Tensor x, bool shift, bool per_tensor);
torch::Tensor scale_rows_bf16(torch::Tensor acc, torch::Tensor row_scale, torch::Tensor col_scale);
constexpr int64_t INT8_VNNI_MAX_ROWS = 8;  // the GEMV up to here, int8_mm_rows above (quant_linear.py)
void write_kv_(torch::Tensor k, torch::Tensor v, torch::Tensor kc, torch::Tensor vc, torch::Tensor slots);
bool bf16_gemm_available();
int64_t bf16_gemm_panel_width();
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor wp, int64_t N, c10::optional<torch::Tensor> bias);
int64_t bf16_gemm_amx_rows(int64_t K);
torch::Tensor decoder_stack(torch::Tensor h, std::vector<torch::Tensor> layers, std::vector<torch::Tensor> k_caches,
                            std::vector<torch::Tensor> v_caches, torch::Tensor final_norm, torch::Tensor cos,
                            torch::Tensor sin, torch::Tensor tables, torch::Tensor positions, torch::Tensor slots,
                            std::vector<int64_t> dims, double eps, double scale, int64_t window);
std::vector<torch::Tensor> decoder_stack_stage(torch::Tensor h, torch::Tensor residual, std::vector<torch::Tensor> layers,
                                               std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
                                               torch::Tensor final_norm, torch::Tensor cos, torch::Tensor sin,
                                               torch::Tensor tables, torch::Tensor positions, torch::Tensor slots,
                                               std::vector<int64_t> dims, double eps, double scale, int64_t window,
                                               bool last);
void write_kv_int8_(torch::Tensor k, torch::Tensor v, torch::Tensor kc, torch::Tensor vc, torch::Tensor slots);
torch::Tensor paged_decode_int8(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor tables,
                                torch::Tensor positions, double scale, int64_t window);
bool prompt_tiles_available();
void prompt_tiles(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor tables, torch::Tensor runs,
                  torch::Tensor out, double scale, int64_t window);
bool amx_gemm_available();
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor wp, int64_t N, bool silu_mul,
                         c10::optional<torch::Tensor> bias);
torch::Tensor amx_linear_rope(torch::Tensor x, torch::Tensor wp, int64_t N, torch::Tensor cos, torch::Tensor sin,
                              int64_t rope_cols, c10::optional<torch::Tensor> bias);
torch::Tensor amx_linear_add_rms(torch::Tensor x, torch::Tensor wp, int64_t N, torch::Tensor residual,
                                 torch::Tensor weight, double eps);
