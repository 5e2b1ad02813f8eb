#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV cache, in place");
  m.def("small_batch_linear", &small_batch_linear, "x @ weight^T (+ bias) for a few rows of x");
  m.def("block_quantized_linear", &block_quantized_linear, "x @ weight^T (+ bias), the weight as GGUF blocks");
  m.def("rms_norm", &rms_norm, "RMS norm over the last dim");
  m.def("add_rms_norm", &add_rms_norm, "residual += x in place, then RMS norm of the residual");
  m.def("rotary_embedding", &rotary_embedding, "neox rotary embedding of q and k, in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(first half) * second half");
}
