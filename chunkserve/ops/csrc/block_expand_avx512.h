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
    __m512 d, m;
    if constexpr (Type == kQ4_1) {
      uint32_t bits;  // d then m
      std::memcpy(&bits, block, sizeof(bits));
      const __m128 scales = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits)));
      d = _mm512_broadcastss_ps(scales);
      m = _mm512_broadcastss_ps(_mm_movehdup_ps(scales));
    } else {  // (q - 8) * d = q * d - 8 d, exactly: the fused form rounds once, as the product does
      uint16_t bits;
      std::memcpy(&bits, block, sizeof(bits));
      d = _mm512_set1_ps(_cvtsh_ss(bits));
      m = _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
    }
    // byte j holds weight j (low nibble) and weight j + 16 (high nibble)
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (Type == kQ4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m512 q_low = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(packed, mask)));
    const __m512 q_high = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(packed, 4), mask)));
    low = _mm512_fmadd_ps(q_low, d, m);
    high = _mm512_fmadd_ps(q_high, d, m);
  }
}
