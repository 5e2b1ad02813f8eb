// The linear over GGUF blocks with 8-bit activations (`--int8-activations`): llama.cpp's
// numerics, AVX-512 VNNI's integer dot products.
//
// Each row of x is quantized per 32-value block as llama.cpp's Q8_0 (scale max|x| / 127, values
// rounded to int8), once per call. A pair of weight blocks then meets the pair of x blocks in
// one `vpdpbusd` (64 unsigned-by-signed byte products summed in fours into 16 int32 lanes), and
// each lane's integer sum is scaled by its two blocks' scales in float32:
//
//   Q4_0  w = (q - 8) d      x . w = d dx (sum q qx - 8 sum qx)
//   Q4_1  w = q d + m        x . w = d dx sum q qx + m dx sum qx
//   Q8_0  w = q d            x . w = d dx (sum (q + 128) qx - 128 sum qx)
//
// that is, exactly x's Q8_0 round trip (qx dx) times the dequantized weights, summed in float32.
//
// The weights' bytes are read as the file stores them (no repacking); x's bytes are laid out
// per pair of blocks in the order the weights unpack to, so the unpacking is a few shifts and
// masks. The sums of qx per lane are the accumulator's starting value (the -8 and -128 terms)
// and cost nothing per weight. Only where the CPU has AVX512_VNNI, and for K a multiple of 64
// (a whole number of block pairs; block_quantized_linear checks both).
#include "block_linear.h"
#include "cpu_isa.h"
#include "row_tiles.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#define CHUNKSERVE_VNNI_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

namespace {

constexpr int kRowTile = 4;
// Weight rows ahead that each tile prefetches, position for position, as block_linear_avx512.cpp.
constexpr int64_t kPrefetchRows = 16;
constexpr int64_t kSliceBytes = 32 * 1024;
constexpr int64_t kPairWeights = 2 * kBlockWeights;

template <int R>
constexpr int kFeatureTile = R == 1 ? 8 : 4;

// One row of x for a pair of blocks, as the kernel reads it (64-byte aligned, 256 bytes).
struct alignas(64) PairActivations {
  int8_t q[kPairWeights];  // the two blocks' int8 values in the weights' unpacked order
  float scale[16];         // each int32 lane's x scale (its block's)
  int32_t start[16];       // the accumulator's starting value per lane (the -8 / -128 terms)
  float sum[16];           // each lane's four quantized x values summed, times their scale (Q4_1's m term)
};

// Where values 0-15 and 16-31 of block b (0: A, 1: B) of a pair go in the unpacked order. Q4_0
// and Q4_1: [A 0-15 | B 0-15 | A 16-31 | B 16-31] (the low nibbles of both blocks, then the
// high); Q8_0: [A 0-31 | B 0-31]. Lanes (four bytes each) never straddle two blocks.
inline int64_t first_half_at(int64_t type, int b) { return type == kQ8_0 ? b * 32 : b * 16; }
inline int64_t second_half_at(int64_t type, int b) { return type == kQ8_0 ? b * 32 + 16 : 32 + b * 16; }

// The lanes of each block: lane -> 0 (A) or 1 (B).
CHUNKSERVE_VNNI_TARGET inline __m512i lane_blocks(int64_t type) {
  return type == kQ8_0 ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                       : _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
}

// x's rows [M, K] quantized and laid out per pair of blocks for weights of `type`.
CHUNKSERVE_VNNI_TARGET void quantize_rows(const float* x, int64_t M, int64_t K, int64_t type,
                                          PairActivations* out) {
  const int64_t pairs = K / kPairWeights;
  const int32_t offset = type == kQ4_0 ? 8 : (type == kQ8_0 ? 128 : 0);
  const __m512 sign_off = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t p = 0; p < pairs; ++p) {
      PairActivations& a = out[r * pairs + p];
      const float* values = x + r * K + p * kPairWeights;
      float block_scale[2];
      for (int b = 0; b < 2; ++b) {
        const __m512 low = _mm512_loadu_ps(values + b * kBlockWeights);
        const __m512 high = _mm512_loadu_ps(values + b * kBlockWeights + 16);
        const float amax = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_and_ps(low, sign_off), _mm512_and_ps(high, sign_off)));
        block_scale[b] = amax / 127.f;
        const __m512 inverse = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        // rounded to the nearest (ties to even), within [-127, 127] by the scale
        _mm_store_si128(reinterpret_cast<__m128i*>(a.q + first_half_at(type, b)),
                        _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(low, inverse))));
        _mm_store_si128(reinterpret_cast<__m128i*>(a.q + second_half_at(type, b)),
                        _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(high, inverse))));
      }
      const __m512i q_sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), _mm512_load_si512(a.q));
      _mm512_store_si512(a.start, _mm512_mullo_epi32(q_sums, _mm512_set1_epi32(-offset)));
      const __m512 scales = _mm512_permutexvar_ps(
          lane_blocks(type), _mm512_castps128_ps512(_mm_setr_ps(block_scale[0], block_scale[1], 0.f, 0.f)));
      _mm512_store_ps(a.scale, scales);
      _mm512_store_ps(a.sum, _mm512_mul_ps(_mm512_cvtepi32_ps(q_sums), scales));
    }
  }
}

// Block A's fp16 at `a` and block B's at `b` as floats [A, B, ...].
CHUNKSERVE_VNNI_TARGET inline __m512 two_halves(const uint8_t* a, const uint8_t* b) {
  uint16_t first, second;
  std::memcpy(&first, a, sizeof(first));
  std::memcpy(&second, b, sizeof(second));
  return _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(first | (uint32_t{second} << 16)))));
}

// A pair of weight blocks (A at `a`, B at `b`) as 64 unsigned bytes in the unpacked order,
// and its per-lane scales d (and Q4_1's minimums m).
template <int64_t Type>
CHUNKSERVE_VNNI_TARGET inline void unpack(const uint8_t* a, const uint8_t* b, __m512i& q, __m512& d, __m512& m) {
  const __m512i lane_block = lane_blocks(Type);
  d = _mm512_permutexvar_ps(lane_block, two_halves(a, b));
  if constexpr (Type == kQ8_0) {
    const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 2));
    const __m256i qb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    q = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(qa), qb, 1), _mm512_set1_epi8(-128));
  } else {
    constexpr int64_t kNibbles = Type == kQ4_1 ? 4 : 2;
    if constexpr (Type == kQ4_1) m = _mm512_permutexvar_ps(lane_block, two_halves(a + 2, b + 2));
    const __m256i packed = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + kNibbles))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kNibbles)), 1);
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i low = _mm256_and_si256(packed, mask);
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
    q = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
  }
}

// y[r * ldy + f] = x[r] . w[f] for R quantized rows (`pairs` pairs each) and F weight rows.
template <int64_t Type, int R, int F>
CHUNKSERVE_VNNI_TARGET void tile(const PairActivations* x, int64_t pairs, const uint8_t* w, int64_t row_bytes,
                                 float* y, int64_t ldy) {
  constexpr int64_t kBytes = block_bytes(Type);
  __m512 acc[R][F];
  for (int r = 0; r < R; ++r)
    for (int f = 0; f < F; ++f) acc[r][f] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i q[F];
    __m512 d[F], m[F];
#pragma GCC unroll 8
    for (int f = 0; f < F; ++f) {
      const uint8_t* a = w + f * row_bytes + 2 * p * kBytes;
      _mm_prefetch(reinterpret_cast<const char*>(a + kPrefetchRows * row_bytes), _MM_HINT_T0);
      unpack<Type>(a, a + kBytes, q[f], d[f], m[f]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const PairActivations& a = x[r * pairs + p];
      const __m512i qx = _mm512_load_si512(a.q);
      const __m512i start = _mm512_load_si512(a.start);
      const __m512 scale = _mm512_load_ps(a.scale);
#pragma GCC unroll 8
      for (int f = 0; f < F; ++f) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, q[f], qx));
        acc[r][f] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d[f], scale), acc[r][f]);
        if constexpr (Type == kQ4_1) acc[r][f] = _mm512_fmadd_ps(m[f], _mm512_load_ps(a.sum), acc[r][f]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int f = 0; f < F; ++f) y[r * ldy + f] = _mm512_reduce_add_ps(acc[r][f]);
}

template <int64_t Type, int R>
CHUNKSERVE_VNNI_TARGET void features(const PairActivations* x, int64_t pairs, const uint8_t* w, int64_t row_bytes,
                                     float* y, int64_t N, int64_t first, int64_t count) {
  constexpr int F = kFeatureTile<R>;
  int64_t n = first;
  for (; n + F <= first + count; n += F) tile<Type, R, F>(x, pairs, w + n * row_bytes, row_bytes, y + n, N);
  for (; n < first + count; ++n) tile<Type, R, 1>(x, pairs, w + n * row_bytes, row_bytes, y + n, N);
}

// Features [begin, end) of every row, a slice of features at a time (its blocks stay in L1
// while each tile of rows reads them), as block_linear_avx512.cpp.
template <int64_t Type>
CHUNKSERVE_VNNI_TARGET void feature_range(const PairActivations* x, int64_t M, int64_t K, const uint8_t* w,
                                          float* y, int64_t N, int64_t begin, int64_t end) {
  const int64_t row_bytes = K / kBlockWeights * block_bytes(Type), pairs = K / kPairWeights;
  const int64_t slice = std::max<int64_t>(1, kSliceBytes / row_bytes);
  for (int64_t s = begin; s < end; s += slice) {
    const int64_t count = std::min(end, s + slice) - s;
    for_each_row_tile<kRowTile>(M, [&](int64_t m, auto rows) {
      features<Type, decltype(rows)::value>(x + m * pairs, pairs, w, row_bytes, y + m * N, N, s, count);
    });
  }
}

using FeatureRangeFn = void (*)(const PairActivations*, int64_t, int64_t, const uint8_t*, float*, int64_t, int64_t,
                                int64_t);

}  // namespace

bool cpu_has_vnni() { return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw"); }

void block_linear_vnni(const float* x, int64_t M, int64_t K, const uint8_t* blocks, int64_t type, float* y,
                       int64_t N) {
  std::vector<PairActivations> quantized(M * (K / kPairWeights));
  quantize_rows(x, M, K, type, quantized.data());
  const FeatureRangeFn range = type == kQ4_0 ? feature_range<kQ4_0>
                               : type == kQ4_1 ? feature_range<kQ4_1>
                                               : feature_range<kQ8_0>;
  at::parallel_for(0, N, 64,
                   [&](int64_t begin, int64_t end) { range(quantized.data(), M, K, blocks, y, N, begin, end); });
}
