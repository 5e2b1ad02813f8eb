#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV cache, in place");
  m.def("small_batch_linear", &small_batch_linear, "x @ weight^T (+ bias) for a few rows of x");
}
