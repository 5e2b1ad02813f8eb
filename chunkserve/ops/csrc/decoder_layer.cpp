// A whole decoder layer of a pure decode step in one call.
//
// A decode step of a small model is short enough that the way to its kernels shows: per layer
// the Python path makes nine calls into these ops and some twenty torch and module calls around
// them (slices, views, the KV write), each crossing the language boundary and the GIL. Here
// the same kernels run in the same order on the same tensors from one C++ call, so the result
// is bit for bit the Python path's (tests/model check it).
#include "block_linear.h"
#include "ops.h"

namespace {

using LinearFn = torch::Tensor (*)(const torch::Tensor& x, const torch::Tensor& weight, int64_t type,
                                   bool int8_activations, const c10::optional<torch::Tensor>& bias);
using AttentionFn = torch::Tensor (*)(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                      torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size,
                                      double scale);

// F.linear through the kernel the Python path picks for a decode-sized batch: the GGUF blocks
// where the weight has them (type >= 0), else the float32 weight (type < 0).
torch::Tensor float32_linear(const torch::Tensor& x, const torch::Tensor& weight, int64_t type, bool int8_activations,
                             const c10::optional<torch::Tensor>& bias) {
  return type >= 0 ? block_quantized_linear(x, weight, type, bias, int8_activations)
                   : small_batch_linear(x, weight, bias);
}

// Deterministic float32 mode's: the blocks as above, a float32 weight by the kernel whose order is
// the blocks' (dequantized_linear) where its K allows, else as above.
torch::Tensor deterministic_float32_linear(const torch::Tensor& x, const torch::Tensor& weight, int64_t type,
                                           bool /*int8*/, const c10::optional<torch::Tensor>& bias) {
  if (type >= 0) return block_quantized_linear(x, weight, type, bias, false);
  return weight.size(1) % kBlockWeights == 0 ? dequantized_linear(x, weight, bias) : small_batch_linear(x, weight, bias);
}

// Deterministic bfloat16 mode's: bfloat16 products on the GGUF blocks (its only fusable weights).
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& weight, int64_t type, bool /*int8*/,
                          const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(type >= 0, "bf16_decoder_layer: GGUF block weights only");
  return bf16_dot_linear(x, weight, type, bias);
}

std::tuple<torch::Tensor, torch::Tensor> layer_with(
    LinearFn linear, AttentionFn attention, torch::Tensor hidden, c10::optional<torch::Tensor> residual, torch::Tensor cos,
    torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping,
    torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size, std::vector<torch::Tensor> weights,
    std::vector<int64_t> types, c10::optional<torch::Tensor> qkv_bias, torch::Tensor input_norm,
    torch::Tensor post_attention_norm, double eps, int64_t num_heads, int64_t num_kv_heads, double scale,
    bool int8_activations) {
  TORCH_CHECK(weights.size() == 4 && types.size() == 4,
              "decoder_layer: four linears (qkv, o, gate_up, down), each a weight and its ggml type (-1: float32)");
  const int64_t rows = hidden.size(0), head_dim = k_cache.size(2);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  torch::Tensor normed;
  if (residual.has_value()) {
    std::tie(normed, hidden) = add_rms_norm(hidden, *residual, input_norm, eps);  // hidden: the stream now
  } else {
    normed = rms_norm(hidden, input_norm, eps);
  }
  const torch::Tensor stream = hidden;
  const torch::Tensor qkv = linear(normed, weights[0], types[0], int8_activations, qkv_bias);
  torch::Tensor q = qkv.narrow(1, 0, q_size).view({rows, num_heads, head_dim});
  torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({rows, num_kv_heads, head_dim});
  const torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, num_kv_heads, head_dim});
  std::tie(q, k) = rotary_embedding(q, k, cos, sin);
  k_cache.index_copy_(0, slot_mapping, k.to(k_cache.scalar_type()));  // rounded to a bfloat16 cache
  v_cache.index_copy_(0, slot_mapping, v.to(v_cache.scalar_type()));
  const torch::Tensor attended = attention(q, k_cache, v_cache, block_tables, context_lens, block_size, scale);
  const torch::Tensor attention_out =
      linear(attended.view({rows, q_size}), weights[1], types[1], int8_activations, c10::nullopt);
  auto [mlp_in, new_stream] = add_rms_norm(attention_out, stream, post_attention_norm, eps);
  const torch::Tensor mlp_out =
      linear(silu_and_mul(linear(mlp_in, weights[2], types[2], int8_activations, c10::nullopt)), weights[3],
             types[3], int8_activations, c10::nullopt);
  return {mlp_out, new_stream};
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> decoder_layer(
    torch::Tensor hidden, c10::optional<torch::Tensor> residual, torch::Tensor cos, torch::Tensor sin,
    torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping, torch::Tensor block_tables,
    torch::Tensor context_lens, int64_t block_size, std::vector<torch::Tensor> weights, std::vector<int64_t> types,
    c10::optional<torch::Tensor> qkv_bias, torch::Tensor input_norm, torch::Tensor post_attention_norm, double eps,
    int64_t num_heads, int64_t num_kv_heads, double scale, bool int8_activations) {
  return layer_with(float32_linear, paged_decode_attention, hidden, residual, cos, sin, k_cache, v_cache,
                    slot_mapping, block_tables, context_lens, block_size, weights, types, qkv_bias, input_norm,
                    post_attention_norm, eps, num_heads, num_kv_heads, scale, int8_activations);
}

std::tuple<torch::Tensor, torch::Tensor> deterministic_decoder_layer(
    torch::Tensor hidden, c10::optional<torch::Tensor> residual, torch::Tensor cos, torch::Tensor sin,
    torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping, torch::Tensor block_tables,
    torch::Tensor context_lens, int64_t block_size, std::vector<torch::Tensor> weights, std::vector<int64_t> types,
    c10::optional<torch::Tensor> qkv_bias, torch::Tensor input_norm, torch::Tensor post_attention_norm, double eps,
    int64_t num_heads, int64_t num_kv_heads, double scale, bool int8_activations) {
  return layer_with(deterministic_float32_linear, deterministic_decode_attention, hidden, residual, cos, sin,
                    k_cache, v_cache, slot_mapping, block_tables, context_lens, block_size, weights, types, qkv_bias, input_norm,
                    post_attention_norm, eps, num_heads, num_kv_heads, scale, int8_activations);
}

std::tuple<torch::Tensor, torch::Tensor> bf16_decoder_layer(
    torch::Tensor hidden, c10::optional<torch::Tensor> residual, torch::Tensor cos, torch::Tensor sin,
    torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping, torch::Tensor block_tables,
    torch::Tensor context_lens, int64_t block_size, std::vector<torch::Tensor> weights, std::vector<int64_t> types,
    c10::optional<torch::Tensor> qkv_bias, torch::Tensor input_norm, torch::Tensor post_attention_norm, double eps,
    int64_t num_heads, int64_t num_kv_heads, double scale, bool int8_activations) {
  return layer_with(bf16_linear, deterministic_decode_attention, hidden, residual, cos, sin, k_cache, v_cache,
                    slot_mapping, block_tables, context_lens, block_size, weights, types, qkv_bias, input_norm,
                    post_attention_norm, eps, num_heads, num_kv_heads, scale, int8_activations);
}
