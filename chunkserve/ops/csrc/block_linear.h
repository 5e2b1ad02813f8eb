// GGUF block formats read by the linear kernels, shared by their instruction-set variants.
#pragma once

#include <cstdint>

constexpr int64_t kBlockWeights = 32;

// The GGML block types, by their ggml_type ids; each holds 32 weights, as gguf's numpy code reads them.
enum BlockType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

constexpr int64_t block_bytes(int64_t type) {
  switch (type) {
    case kQ4_0: return 18;  // fp16 d, 16 bytes of nibbles: w = (q - 8) * d
    case kQ4_1: return 20;  // fp16 d, fp16 m, 16 bytes of nibbles: w = q * d + m
    case kQ8_0: return 34;  // fp16 d, 32 int8: w = q * d
    default: return 0;
  }
}

// y [M, N] = x [M, K] @ dequantize(blocks [N, K / 32 blocks])^T with AVX-512, the weights
// expanded in registers; only where the CPU has AVX-512 (active_cpu_isa).
void block_linear_avx512(const float* x, int64_t M, int64_t K, const uint8_t* blocks, int64_t type, float* y,
                         int64_t N);

// The same with 8-bit activations (llama.cpp's numerics: x quantized per block of 32 as Q8_0)
// and AVX-512 VNNI integer dot products (block_linear_vnni.cpp); only where `cpu_has_vnni()`
// and for K a multiple of 64.
void block_linear_vnni(const float* x, int64_t M, int64_t K, const uint8_t* blocks, int64_t type, float* y,
                       int64_t N);
bool cpu_has_vnni();
