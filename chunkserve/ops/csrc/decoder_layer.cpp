// The decoder layers of a pure decode step in one call: the whole stack, or one layer.
//
// A decode step of a small model is short enough that the way to its kernels shows: per layer
// the Python path makes nine calls into these ops and some twenty torch and module calls around
// them (slices, views, the KV write), each crossing the language boundary and the GIL. Here
// the same kernels run in the same order on the same tensors from one C++ call, so the result
// is bit for bit the Python path's (tests/model check it). A call for the whole stack also
// keeps the compute threads' team busy from layer to layer, where between two calls from Python
// it may outwait its bounded spin (GOMP_SPINCOUNT, set by the server) and sleep.
#include "block_linear.h"
#include "ops.h"

#include <string>
#include <utility>

namespace {

// `interleaved`: the weight as pack_interleaved_blocks made it, or none (the bfloat16 set reads it)
using LinearFn = torch::Tensor (*)(const torch::Tensor& x, const torch::Tensor& weight, int64_t type,
                                   bool int8_activations, const c10::optional<torch::Tensor>& bias,
                                   const c10::optional<torch::Tensor>& interleaved);
using AttentionFn = torch::Tensor (*)(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                      torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size,
                                      double scale);

// F.linear through the kernel the Python path picks for a decode-sized batch: the GGUF blocks
// where the weight has them (type >= 0), else the float32 weight (type < 0).
torch::Tensor float32_linear(const torch::Tensor& x, const torch::Tensor& weight, int64_t type, bool int8_activations,
                             const c10::optional<torch::Tensor>& bias,
                             const c10::optional<torch::Tensor>& /*interleaved*/) {
  return type >= 0 ? block_quantized_linear(x, weight, type, bias, int8_activations)
                   : small_batch_linear(x, weight, bias);
}

// Deterministic float32 mode's: the blocks as above, a float32 weight by the kernel whose order is
// the blocks' (dequantized_linear) where its K allows, else as above.
torch::Tensor deterministic_float32_linear(const torch::Tensor& x, const torch::Tensor& weight, int64_t type,
                                           bool /*int8*/, const c10::optional<torch::Tensor>& bias,
                                           const c10::optional<torch::Tensor>& /*interleaved*/) {
  if (type >= 0) return block_quantized_linear(x, weight, type, bias, false);
  return weight.size(1) % kBlockWeights == 0 ? dequantized_linear(x, weight, bias) : small_batch_linear(x, weight, bias);
}

// bfloat16 mode's: the GGUF blocks (its only fusable weights) by the rows' kernel.
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& weight, int64_t type, bool int8_activations,
                          const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& interleaved) {
  TORCH_CHECK(type >= 0, "bf16_decoder_layers: GGUF block weights only");
  return bf16_mode_block_linear(x, weight, type, bias, int8_activations, interleaved);
}

// Deterministic bfloat16 mode's: bfloat16 products on the GGUF blocks (its only fusable weights).
torch::Tensor deterministic_bf16_linear(const torch::Tensor& x, const torch::Tensor& weight, int64_t type,
                                        bool /*int8*/, const c10::optional<torch::Tensor>& bias,
                                        const c10::optional<torch::Tensor>& /*interleaved*/) {
  TORCH_CHECK(type >= 0, "deterministic_bf16_decoder_layers: GGUF block weights only");
  return bf16_dot_linear(x, weight, type, bias);
}

// One layer; its four linears (qkv, o, gate_up, down) are weights[0..3] with types[0..3] and
// interleaved copies interleaved[0..3].
std::tuple<torch::Tensor, torch::Tensor> layer_with(
    LinearFn linear, AttentionFn attention, torch::Tensor hidden, const c10::optional<torch::Tensor>& residual,
    const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor k_cache, torch::Tensor v_cache,
    const torch::Tensor& slot_mapping, const torch::Tensor& block_tables, const torch::Tensor& context_lens,
    int64_t block_size, const torch::Tensor* weights, const int64_t* types,
    const c10::optional<torch::Tensor>* interleaved, const c10::optional<torch::Tensor>& qkv_bias,
    const torch::Tensor& input_norm, const torch::Tensor& post_attention_norm, double eps, int64_t num_heads,
    int64_t num_kv_heads, double scale, bool int8_activations) {
  const int64_t rows = hidden.size(0), head_dim = k_cache.size(2);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  torch::Tensor normed;
  if (residual.has_value()) {
    std::tie(normed, hidden) = add_rms_norm(hidden, *residual, input_norm, eps);  // hidden: the stream now
  } else {
    normed = rms_norm(hidden, input_norm, eps);
  }
  const torch::Tensor stream = hidden;
  const torch::Tensor qkv = linear(normed, weights[0], types[0], int8_activations, qkv_bias, interleaved[0]);
  torch::Tensor q = qkv.narrow(1, 0, q_size).view({rows, num_heads, head_dim});
  torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({rows, num_kv_heads, head_dim});
  const torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, num_kv_heads, head_dim});
  std::tie(q, k) = rotary_embedding(q, k, cos, sin);
  k_cache.index_copy_(0, slot_mapping, k.to(k_cache.scalar_type()));  // rounded to a bfloat16 cache
  v_cache.index_copy_(0, slot_mapping, v.to(v_cache.scalar_type()));
  const torch::Tensor attended = attention(q, k_cache, v_cache, block_tables, context_lens, block_size, scale);
  const torch::Tensor attention_out =
      linear(attended.view({rows, q_size}), weights[1], types[1], int8_activations, c10::nullopt, interleaved[1]);
  auto [mlp_in, new_stream] = add_rms_norm(attention_out, stream, post_attention_norm, eps);
  const torch::Tensor mlp_out =
      linear(silu_and_mul(linear(mlp_in, weights[2], types[2], int8_activations, c10::nullopt, interleaved[2])),
             weights[3], types[3], int8_activations, c10::nullopt, interleaved[3]);
  return {mlp_out, new_stream};
}

// The layers of `k_caches` in turn, each through layer_with; per layer i its weights, types and
// interleaved copies are entries 4i to 4i + 3 of `weights`, `types` and `interleaved` (where
// `interleaved` is empty, none).
std::tuple<torch::Tensor, torch::Tensor> layers_with(
    LinearFn linear, AttentionFn attention, torch::Tensor hidden, c10::optional<torch::Tensor> residual,
    const torch::Tensor& cos, const torch::Tensor& sin, const std::vector<torch::Tensor>& k_caches,
    const std::vector<torch::Tensor>& v_caches, const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
    const torch::Tensor& context_lens, int64_t block_size, const std::vector<torch::Tensor>& weights,
    const std::vector<int64_t>& types, std::vector<c10::optional<torch::Tensor>> interleaved,
    const std::vector<c10::optional<torch::Tensor>>& qkv_biases, const std::vector<torch::Tensor>& input_norms,
    const std::vector<torch::Tensor>& post_attention_norms, double eps, int64_t num_heads, int64_t num_kv_heads,
    double scale, bool int8_activations) {
  const size_t layers = k_caches.size();
  TORCH_CHECK(layers > 0 && v_caches.size() == layers && weights.size() == 4 * layers && types.size() == 4 * layers &&
                  (interleaved.empty() || interleaved.size() == 4 * layers) && qkv_biases.size() == layers &&
                  input_norms.size() == layers && post_attention_norms.size() == layers,
              "decoder_layers: per layer a K and a V cache, four linears (qkv, o, gate_up, down: a weight and its "
              "ggml type, -1 for float32, and an interleaved copy or None, or no interleaved copies at all), a "
              "qkv bias or None and two norms; got ", k_caches.size(), " K caches, ", v_caches.size(), " V caches, ",
              weights.size(), " weights, ", types.size(), " types, ", interleaved.size(), " interleaved copies, ",
              qkv_biases.size(),
              " biases, ", input_norms.size(), " and ", post_attention_norms.size(), " norms");
  if (interleaved.empty()) interleaved.resize(4 * layers);
  for (size_t i = 0; i < layers; ++i) {
    torch::Tensor stream;
    std::tie(hidden, stream) = layer_with(linear, attention, hidden, residual, cos, sin, k_caches[i], v_caches[i],
                                          slot_mapping, block_tables, context_lens, block_size, &weights[4 * i],
                                          &types[4 * i], &interleaved[4 * i], qkv_biases[i], input_norms[i],
                                          post_attention_norms[i], eps,
                                          num_heads, num_kv_heads, scale, int8_activations);
    residual = stream;
  }
  return {hidden, *residual};
}

// The linear and the attention kernels of each named set (decoder_layers' `kernels`).
std::pair<LinearFn, AttentionFn> kernels_named(const std::string& name) {
  if (name == "float32") return {float32_linear, paged_decode_attention};
  if (name == "bfloat16") return {bf16_linear, paged_decode_attention};
  if (name == "deterministic_float32") return {deterministic_float32_linear, deterministic_decode_attention};
  if (name == "deterministic_bfloat16") return {deterministic_bf16_linear, deterministic_decode_attention};
  TORCH_CHECK(false, "decoder_layers: kernels must be float32, bfloat16, deterministic_float32 or "
              "deterministic_bfloat16, got ", name);
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> decoder_layers(
    const std::string& kernels, torch::Tensor hidden, c10::optional<torch::Tensor> residual, torch::Tensor cos,
    torch::Tensor sin, std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
    torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size,
    std::vector<torch::Tensor> weights, std::vector<int64_t> types,
    std::vector<c10::optional<torch::Tensor>> interleaved, std::vector<c10::optional<torch::Tensor>> qkv_biases,
    std::vector<torch::Tensor> input_norms,
    std::vector<torch::Tensor> post_attention_norms, double eps, int64_t num_heads, int64_t num_kv_heads,
    double scale, bool int8_activations) {
  const auto [linear, attention] = kernels_named(kernels);
  return layers_with(linear, attention, hidden, residual, cos, sin, k_caches, v_caches, slot_mapping, block_tables,
                     context_lens, block_size, weights, types, std::move(interleaved), qkv_biases, input_norms,
                     post_attention_norms, eps,
                     num_heads, num_kv_heads, scale, int8_activations);
}
