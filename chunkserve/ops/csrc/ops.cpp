#include "cpu_isa.h"
#include "ops.h"

// Every op releases the GIL while it computes: the server's event loop (detokenizing and
// streaming the last step's tokens) runs its Python during the engine's kernels instead of
// waiting for them to return, as it already does during torch's own ops.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV cache, in place",
        release_gil());
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal attention of a prefill chunk over the paged KV cache, in place", pybind11::arg("q"),
        pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_table"), pybind11::arg("start"),
        pybind11::arg("block_size"), pybind11::arg("scale"), pybind11::arg("deterministic") = false, release_gil());
  m.def("deterministic_decode_attention", &deterministic_decode_attention,
        "decode attention whose rows have the bits of the same rows in any prefill chunk", release_gil());
  m.def("small_batch_linear", &small_batch_linear, "x @ weight^T (+ bias) for a few rows of x", release_gil());
  m.def("block_quantized_linear", &block_quantized_linear, "x @ weight^T (+ bias), the weight as GGUF blocks",
        pybind11::arg("x"), pybind11::arg("blocks"), pybind11::arg("ggml_type"), pybind11::arg("bias"),
        pybind11::arg("int8_activations") = false, release_gil());
  m.def("bf16_mode_block_linear", &bf16_mode_block_linear,
        "bfloat16 mode's x @ weight^T (+ bias) on GGUF blocks for a few rows", pybind11::arg("x"),
        pybind11::arg("blocks"), pybind11::arg("ggml_type"), pybind11::arg("bias"),
        pybind11::arg("int8_activations") = false, pybind11::arg("interleaved") = pybind11::none(), release_gil());
  m.def("pack_interleaved_blocks", &pack_interleaved_blocks, "GGUF blocks repacked for interleaved_bf16_linear",
        release_gil());
  m.def("interleaved_bf16_linear", &interleaved_bf16_linear, "x @ weight^T (+ bias) for a few rows, bfloat16 products",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("ggml_type"), pybind11::arg("bias"), release_gil());
  m.def("dequantized_linear", &dequantized_linear, "x @ weight^T (+ bias), the bits of the weight's GGUF blocks",
        release_gil());
  m.def("bf16_dot_linear", &bf16_dot_linear, "x @ weight^T (+ bias) in bfloat16, one order per element",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("ggml_type"), pybind11::arg("bias"), release_gil());
  m.def("round_to_bf16", &round_to_bf16, "a float32 weight as bf16_dot_linear reads it", release_gil());
  m.def("bf16_dot_supported", &bf16_dot_supported, "whether bf16_dot_linear runs here");
  m.def("rms_norm", &rms_norm, "RMS norm over the last dim", release_gil());
  m.def("add_rms_norm", &add_rms_norm, "residual += x in place, then RMS norm of the residual", release_gil());
  m.def("rotary_embedding", &rotary_embedding, "neox rotary embedding of q and k, in place", release_gil());
  m.def("silu_and_mul", &silu_and_mul, "silu(first half) * second half", release_gil());
  m.def("decoder_layers", &decoder_layers, "decoder layers of a pure decode step in one call, with a mode's kernels",
        release_gil());
  m.def("cpu_has_vnni", &cpu_has_vnni, "whether block_quantized_linear can take int8_activations here");
  m.def("cpu_isa", &cpu_isa, "the instruction set the kernels run with: avx512, avx2 or portable");
  m.def("set_cpu_isa", &set_cpu_isa, "run the kernels with another instruction set this CPU has; returns the last");
}
