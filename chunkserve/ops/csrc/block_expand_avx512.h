// A GGUF block's 32 weights expanded into two AVX-512 registers, shared by the kernels that read
// the blocks in registers (block_linear_avx512.cpp, deterministic_linear.cpp), so that they
// expand to the same floats.
#pragma once

#include "block_linear.h"
#include "cpu_isa.h"

#include <immintrin.h>

#include <cstring>

// The 32 weights of `block`, weights 0-15 in `low` and 16-31 in `high`.
template <int64_t Type>
CHUNKSERVE_AVX512_TARGET inline void expand_block_avx512(const uint8_t* block, __m512& low, __m512& high) {
  if constexpr (Type == kQ8_0) {
    uint16_t bits;
    std::memcpy(&bits, block, sizeof(bits));
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(bits));
    const __m128i q_low = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
    const __m128i q_high = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 18));
    low = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q_low)), d);
    high = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q_high)), d);
  } else {
    // The 16 weights a nibble can give, q * d + m for q = 0-15 (fused, one rounding, as gguf's
    // `dequantize` computes each), looked up by nibble: one permute per 16 weights in place of
    // a conversion and an FMA, with the same floats.
    const __m512 nibbles = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    // the block's first 8 bytes as halves: d, then m for Q4_1 (the rest are nibbles, unused)
    const __m512 halves =
        _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block))));
    const __m512 d = _mm512_broadcastss_ps(_mm512_castps512_ps128(halves));
    __m512 table;
    if constexpr (Type == kQ4_1) {
      table = _mm512_fmadd_ps(nibbles, d, _mm512_permutexvar_ps(_mm512_set1_epi32(1), halves));
    } else {  // (q - 8) * d = q * d - 8 d, exactly: the fused form rounds once, as the product does
      table = _mm512_fmadd_ps(nibbles, d, _mm512_mul_ps(d, _mm512_set1_ps(-8.f)));
    }
    // byte j holds weight j (low nibble) and weight j + 16 (high nibble); a permute reads only
    // its index's low 4 bits, so the low nibble needs no mask
    const __m512i packed = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (Type == kQ4_1 ? 4 : 2))));
    low = _mm512_permutexvar_ps(packed, table);
    high = _mm512_permutexvar_ps(_mm512_srli_epi32(packed, 4), table);
  }
}
