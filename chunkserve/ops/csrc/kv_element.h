// The KV cache's element types: float32, or bfloat16 (half the bytes to store and to read).
// Attention loads either as float32 and does all of its arithmetic in float32; a bfloat16 is
// the upper half of a float32, so widening one is exact (a shift).
#pragma once

#include "cpu_isa.h"
#include "simd.h"

#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <type_traits>

namespace kv {

// The one element as float32.
inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }

#ifdef CHUNKSERVE_AVX2
// Eight consecutive elements as float32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#endif

// Sixteen consecutive elements as float32, where the CPU has AVX-512 (active_cpu_isa).
CHUNKSERVE_AVX512_TARGET inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
CHUNKSERVE_AVX512_TARGET inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

}  // namespace kv

// Runs `body` with `scalar_t` bound to the cache's element type (float or c10::BFloat16).
#define CHUNKSERVE_DISPATCH_KV(cache_type, name, ...)                                                  \
  [&] {                                                                                             \
    if ((cache_type) == torch::kBFloat16) {                                                         \
      using scalar_t = c10::BFloat16;                                                               \
      return __VA_ARGS__();                                                                         \
    }                                                                                               \
    TORCH_CHECK((cache_type) == torch::kFloat32, name, ": the KV cache must be float32 or bfloat16"); \
    using scalar_t = float;                                                                         \
    return __VA_ARGS__();                                                                           \
  }()
