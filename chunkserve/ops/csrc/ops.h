// The C++ ops of the CPU worker; bound to Python in ops.cpp, loaded by ops/cpp_ops.py.
#pragma once

#include <torch/extension.h>

#include <string>

// q: [B, heads, head_dim]; caches: [num_slots, kv_heads, head_dim]; block_tables: [B, max_blocks]
// (int64); context_lens: [B] (int64). Returns [B, heads, head_dim]. q and the result float32, the
// caches float32 or bfloat16 (widened as read: the arithmetic is float32).
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     int64_t block_size, double scale);

// One prefill chunk: q [n, heads, head_dim] at positions start .. start + n - 1, its keys and
// the history's already in the caches [num_slots, kv_heads, head_dim]; block_table [blocks]
// (int64). Query i attends keys 0 .. start + i (causal). Returns [n, heads, head_dim]. q and the
// result float32, the caches float32 or bfloat16. Where `deterministic`, each row's bits depend
// only on its query, its absolute position and the keys, never on start, n or its place in the chunk.
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                      torch::Tensor block_table, int64_t start, int64_t block_size, double scale,
                                      bool deterministic);

// paged_decode_attention's arguments and result, each decode attended as a 1-row chunk of
// paged_prefill_attention(deterministic): the bits of a decode row equal those of the same query
// at the same position in any chunk, whatever else is in the batch.
torch::Tensor deterministic_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                             torch::Tensor block_tables, torch::Tensor context_lens,
                                             int64_t block_size, double scale);

// x: [M, K], weight: [N, K], bias: [N] or None; float32. Returns x @ weight^T + bias, [M, N].
torch::Tensor small_batch_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);

// The same with the weight as GGUF blocks: blocks [N, K / 32 * block bytes] (uint8) of ggml type
// Q4_0 (2), Q4_1 (3) or Q8_0 (8); the result equals x @ dequantize(blocks)^T + bias. With
// int8_activations, x is quantized to 8 bits per block of 32 first, as llama.cpp does, and the
// products are integer (AVX-512 VNNI; raises where the CPU has none): the result is then within
// the int8 mode's contract (docs/PRECISION.md) of that, not equal to it.
torch::Tensor block_quantized_linear(torch::Tensor x, torch::Tensor blocks, int64_t ggml_type,
                                     c10::optional<torch::Tensor> bias, bool int8_activations);
// bfloat16 mode's linear on GGUF blocks for a step of a few rows (decode), where this CPU has
// AVX512_BF16: interleaved_bf16_linear on `interleaved` (the blocks repacked) where given, else
// bf16_dot_linear's bfloat16 products on the blocks from two rows; else (int8_activations, no
// AVX512_BF16, one row without `interleaved`) block_quantized_linear's.
torch::Tensor bf16_mode_block_linear(torch::Tensor x, torch::Tensor blocks, int64_t ggml_type,
                                     c10::optional<torch::Tensor> bias, bool int8_activations,
                                     c10::optional<torch::Tensor> interleaved);
// GGUF blocks [N, K / 32 * bytes] (N a multiple of 16) in interleaved_bf16_linear's layout
// (interleaved_bf16_linear.cpp): as many bytes, 16 features' blocks of one position together.
torch::Tensor pack_interleaved_blocks(torch::Tensor blocks, int64_t ggml_type);
// x (float32 [M, K]) @ weight^T (+ bias) on pack_interleaved_blocks' bytes: x rounded to
// bfloat16, the weights exact, float32 sums. Needs AVX512_BF16 (bf16_dot_supported).
torch::Tensor interleaved_bf16_linear(torch::Tensor x, torch::Tensor packed, int64_t ggml_type,
                                     c10::optional<torch::Tensor> bias);

// Deterministic mode (deterministic_linear.cpp): every output element has one reduction order over
// K for any number of rows of x and any position of a row among them.
// x @ weight^T + bias on a float32 weight [N, K] (K a multiple of 32); where the weight is what GGUF
// blocks dequantize to, with the bits block_quantized_linear gives on those blocks.
torch::Tensor dequantized_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);
// bfloat16 mode: x (float32 [M, K]) and the weight rounded to bfloat16, products summed in float32;
// the weight round_to_bf16's [N, K padded to 32] (ggml_type -1) or GGUF blocks of ggml_type, the
// same bits from either. Returns float32 [M, N]. Needs AVX512_BF16 (bf16_dot_supported).
torch::Tensor bf16_dot_linear(torch::Tensor x, torch::Tensor weight, int64_t ggml_type,
                              c10::optional<torch::Tensor> bias);
// float32 [N, K] -> bfloat16 [N, K padded to a multiple of 32 with zeros], as bf16_dot_linear reads it.
torch::Tensor round_to_bf16(torch::Tensor weight);
// Whether this CPU (and the instruction set set_cpu_isa chose) runs bf16_dot_linear.
bool bf16_dot_supported();

// Over the last dim: x * rsqrt(mean(x^2) + eps) * weight. float32.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);

// residual += x (in place), then (rms_norm(residual), residual).
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                                                      double eps);

// Neox-style rotary embedding of q [T, heads, D] and k [T, kv_heads, D], in place; cos, sin [T, D / 2].
std::tuple<torch::Tensor, torch::Tensor> rotary_embedding(torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                                                          torch::Tensor sin);

// x [T, 2I] -> silu(x[:, :I]) * x[:, I:], [T, I].
torch::Tensor silu_and_mul(torch::Tensor x);

// Decoder layers of a pure decode step (every row a decode, one decode group, no TP) through the
// ops above, in turn, in the order and with the kernels of the Python path (model/llama.py
// DecoderLayer): hidden [B, hidden_size] is the last sublayer's output and residual the stream
// before it (None at the first layer: hidden is then the embeddings). Per layer i: k_caches[i] and
// v_caches[i], qkv_biases[i] (or None), input_norms[i] and post_attention_norms[i], and its four
// linears qkv, o, gate_up, down as weights[4i .. 4i + 3], each GGUF blocks (types[4i + j] its ggml
// type) or a float32 [out, in] weight (type -1), and interleaved[4i + j] the blocks as
// pack_interleaved_blocks made them or None (`interleaved` may be empty: none for every linear);
// int8_activations as block_quantized_linear's, for the blocks. Writes this step's K/V at
// slot_mapping in every layer's cache and returns (the last layer's MLP output, the stream before
// it). `kernels` names the mode's linears and attention:
// - "float32": the blocks by block_quantized_linear, a float32 weight by small_batch_linear;
//   paged_decode_attention;
// - "bfloat16": the blocks (its only fusable weights) by bf16_mode_block_linear, with their
//   interleaved copies; paged_decode_attention;
// - "deterministic_float32": the blocks by block_quantized_linear (float32 activations), a float32
//   weight by dequantized_linear where K is a multiple of 32; deterministic_decode_attention;
// - "deterministic_bfloat16": the blocks by bf16_dot_linear; deterministic_decode_attention.
std::tuple<torch::Tensor, torch::Tensor> decoder_layers(
    const std::string& kernels, torch::Tensor hidden, c10::optional<torch::Tensor> residual, torch::Tensor cos,
    torch::Tensor sin, std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
    torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size,
    std::vector<torch::Tensor> weights, std::vector<int64_t> types,
    std::vector<c10::optional<torch::Tensor>> interleaved, std::vector<c10::optional<torch::Tensor>> qkv_biases,
    std::vector<torch::Tensor> input_norms,
    std::vector<torch::Tensor> post_attention_norms, double eps, int64_t num_heads, int64_t num_kv_heads,
    double scale, bool int8_activations);

// Whether this CPU runs block_quantized_linear's int8_activations (AVX-512 with VNNI).
bool cpu_has_vnni();
