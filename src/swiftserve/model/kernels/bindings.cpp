// Python bindings of the CPU kernels (one extension module, several translation units).
#include <torch/extension.h>

#include "ops.h"

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
  m.def("bf16_gemm_amx_rows", &bf16_gemm_amx_rows, "the most rows bf16_linear runs on AMX tiles for K inputs (0: none)");
  m.def("decoder_stack", &decoder_stack, "every decoder layer of a bf16 model in one call (fused path)");
  m.def("decoder_stack_stage", &decoder_stack_stage, "a pipeline stage's decoder layers in one call (fused path)");
  m.def("int8_gemv", &int8_gemv, "x @ (w * scale).T for a few rows x, int8 w, per-row scale");
  m.def("int8_vnni_available", &int8_vnni_available, "whether int8_gemv_vnni was compiled (AVX512-VNNI)");
  m.def("int8_gemv_vnni", &int8_gemv_vnni, "W8A8 decode GEMV: int8 w [N, K], x quantized per 64 inputs");
  m.def("int8_mm_rows", &int8_mm_rows, "W8A8 for batches: x quantized per row, oneDNN int8 GEMM");
  m.def("quantize_rows_int8", &quantize_rows_int8, "bf16 rows to int8 (u8 with shift) and their scales");
  m.def("scale_rows_bf16", &scale_rows_bf16, "acc * row_scale[:, None] * col_scale[None, :] as bf16");
  m.attr("INT8_VNNI_MAX_ROWS") = INT8_VNNI_MAX_ROWS;
  m.def("write_kv_int8_", &write_kv_int8_, "quantize new K/V rows into an int8 cache (row: D int8 + f32 scale)");
  m.def("amx_gemm_available", &amx_gemm_available, "whether amx_linear runs here (AMX, OS permission)");
  m.def("amx_linear", &amx_linear, "x @ W^T (+ bias) over an AMX-packed weight; silu_mul: SiLU(gate) * up of 16-column pairs",
        py::arg("x"), py::arg("wp"), py::arg("N"), py::arg("silu_mul"), py::arg("bias") = py::none());
  m.def("amx_linear_rope", &amx_linear_rope, "q/k/v (+ bias) over an AMX-packed weight with the rotary of q and k heads",
        py::arg("x"), py::arg("wp"), py::arg("N"), py::arg("cos"), py::arg("sin"), py::arg("rope_cols"),
        py::arg("bias") = py::none());
  m.def("amx_linear_add_rms", &amx_linear_add_rms, "x @ W^T, then residual += it and its RMS norm (residual in place)");
  m.def("prompt_tiles_available", &prompt_tiles_available, "whether prompt_tiles runs here (AMX, OS permission)");
  m.def("prompt_tiles", &prompt_tiles, "tiled causal attention of prompt runs over the paged cache (AMX)");
  m.def("paged_decode_int8", &paged_decode_int8, "paged decode attention over an int8 KV cache");
}
