// Linear layers over a few rows: y = x @ weight^T (+ bias), x [M, K] with M up to a few dozen.
//
// At decode batch sizes each weight is used by only a handful of rows, so a step is bound by
// reading the weights once. A general GEMM packs and tiles for reuse that is not there, and
// reads the weights well below the memory's streaming rate (measured: docs/benchmarks-log.md,
// "Decode steps: the C++ ops against plain torch").
// This kernel computes tiles of a few rows x a few features as dot products along K, in
// registers, and the rows of x stay in L1. The features (the weight rows) are split over the
// threads in slices whose weights fit in L1, so a batch of more than one tile of rows re-reads
// a slice from L1, not from memory.
//
// The weight is either float32 or GGUF blocks of 32 weights (Q4_0, Q4_1, Q8_0: 4.5 to 8.5 bits
// a weight instead of 32). Blocks are expanded a slice at a time into an L1 buffer, to exactly
// the floats gguf's `dequantize` gives, and the same dot products run on the buffer: the bytes
// read from memory shrink 3.8x (Q8_0) to 6.4x (Q4_1) and the arithmetic stays float32. Where
// the CPU has AVX-512, block_linear_avx512.cpp does the same with the blocks expanded in
// registers instead. bfloat16 mode's few-row steps (bf16_mode_block_linear) take bfloat16
// products on the same blocks from two rows (deterministic_linear.cpp's bf16_dot_linear).
#include "block_linear.h"
#include "cpu_isa.h"
#include "ops.h"
#include "simd.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <memory>

namespace {

constexpr int kRowTile = 4;
constexpr int64_t kSliceBytes = 32 * 1024;
// bfloat16 mode (bf16_mode_block_linear) on the file's blocks, where a weight has no interleaved
// copy: from this many rows the products are bfloat16. One row on the file's blocks is bound by
// expanding them, which the float32 kernel does with fewer instructions (a table lookup per 16
// weights); from two rows each expanded block serves more products, and AVX512_BF16's pair dot
// products take two per instruction. Measured: docs/benchmarks-log.md, "bfloat16 products for
// decode steps of 2-19 rows". The interleaved copy's kernel is faster than either at every row
// count it takes (docs/benchmarks-log.md, "Decode rows on interleaved blocks").
constexpr int64_t kBf16DotMinRows = 2;

// Feature tile per row count (benchmarks/kernels/small_batch_linear.py): a tile of R rows x F features
// keeps R x F independent FMA chains (an FMA waits ~5 cycles for the one before it in its
// chain) and loads R + F vectors for R x F FMAs, the loads being the limit here.
template <int R>
constexpr int kFeatureTile = R == 1 ? 4 : (R == 2 ? 4 : 3);

#ifdef CHUNKSERVE_AVX2
// y[r * ldy + f] = x[r] . w[f] for r < R, f < F: R rows of x (K floats apart) against F weight
// rows (K floats apart), vectorized along K. Each weight vector serves R rows and each vector of
// x serves F features, so a step loads R + F vectors for R x F FMAs.
template <int R, int F>
inline void dot_tile(const float* x, int64_t K, const float* w, float* y, int64_t ldy) {
  __m256 acc[R][F];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int f = 0; f < F; ++f) acc[r][f] = _mm256_setzero_ps();
  const int64_t k8 = K - K % 8;
#pragma GCC unroll 2  // two steps of K in flight: the loads of the next overlap the FMAs of this one
  for (int64_t k = 0; k < k8; k += 8) {
    __m256 weights[F];
#pragma GCC unroll 8
    for (int f = 0; f < F; ++f) {
      weights[f] = _mm256_loadu_ps(w + f * K + k);
      asm("" : "+x"(weights[f]));  // keep it in a register: folded into each FMA it would be loaded R times
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 row = _mm256_loadu_ps(x + r * K + k);
#pragma GCC unroll 8
      for (int f = 0; f < F; ++f) acc[r][f] = _mm256_fmadd_ps(row, weights[f], acc[r][f]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int f = 0; f < F; ++f) {
      float sum = horizontal_sum(acc[r][f]);
      for (int64_t k = k8; k < K; ++k) sum += x[r * K + k] * w[f * K + k];
      y[r * ldy + f] = sum;
    }
}
#else
template <int R, int F>
inline void dot_tile(const float* x, int64_t K, const float* w, float* y, int64_t ldy) {
  for (int r = 0; r < R; ++r)
    for (int f = 0; f < F; ++f) {
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t k = 0; k < K; ++k) sum += x[r * K + k] * w[f * K + k];
      y[r * ldy + f] = sum;
    }
}
#endif

// The last `count` < F features of a slice, with a tile of exactly that many.
template <int R, int F>
inline void feature_tail(int64_t count, const float* x, int64_t K, const float* w, float* y, int64_t ldy) {
  if constexpr (F > 1) {
    if (count == F - 1) return dot_tile<R, F - 1>(x, K, w, y, ldy);
    return feature_tail<R, F - 1>(count, x, K, w, y, ldy);
  }
}

// y[r * N + n] = x[r] . w[n] for the R rows of x and the features n < count of w.
template <int R>
void features(const float* x, int64_t K, const float* w, float* y, int64_t N, int64_t count) {
  constexpr int F = kFeatureTile<R>;
  int64_t n = 0;
  for (; n + F <= count; n += F) dot_tile<R, F>(x, K, w + n * K, y + n, N);
  if (n < count) feature_tail<R, F>(count - n, x, K, w + n * K, y + n, N);
}

using FeaturesFn = void (*)(const float*, int64_t, const float*, float*, int64_t, int64_t);
constexpr FeaturesFn kFeaturesByRows[kRowTile + 1] = {nullptr, features<1>, features<2>, features<3>, features<4>};

// ----- weight sources: a slice of features as float rows -------------------------------

struct FloatWeight {
  static constexpr bool kNeedsBuffer = false;
  const float* data;
  int64_t K;
  const float* rows(int64_t first, int64_t /*count*/, float* /*buffer*/) const { return data + first * K; }
};

inline float half_to_float(const uint8_t* bytes) {
  uint16_t bits;
  std::memcpy(&bits, bytes, sizeof(bits));
#ifdef __F16C__
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// Nibbles: byte j holds weight j (low half) and weight j + 16 (high half).
template <int64_t Type>
inline void expand_block(const uint8_t* block, float* out) {
  const float d = half_to_float(block);
#ifdef CHUNKSERVE_AVX2
  const __m256 scale = _mm256_set1_ps(d);
  if constexpr (Type == kQ8_0) {
    for (int i = 0; i < 4; ++i) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * i));
      _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), scale));
    }
  } else {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (Type == kQ4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(packed, mask), high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
    const __m128i halves[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
    const __m256 offset = _mm256_set1_ps(Type == kQ4_1 ? half_to_float(block + 2) : 8.f);
    for (int i = 0; i < 4; ++i) {
      const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(halves[i]));
      _mm256_storeu_ps(out + 8 * i, Type == kQ4_1 ? _mm256_add_ps(_mm256_mul_ps(q, scale), offset)
                                                  : _mm256_mul_ps(_mm256_sub_ps(q, offset), scale));
    }
  }
#else
  if constexpr (Type == kQ8_0) {
    for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(static_cast<int8_t>(block[2 + i])) * d;
  } else {
    const uint8_t* nibbles = block + (Type == kQ4_1 ? 4 : 2);
    const float m = Type == kQ4_1 ? half_to_float(block + 2) : 0.f;
    for (int i = 0; i < 16; ++i) {
      const float low = static_cast<float>(nibbles[i] & 0x0F), high = static_cast<float>(nibbles[i] >> 4);
      out[i] = Type == kQ4_1 ? low * d + m : (low - 8.f) * d;
      out[i + 16] = Type == kQ4_1 ? high * d + m : (high - 8.f) * d;
    }
  }
#endif
}

template <int64_t Type>
struct BlockWeight {
  static constexpr bool kNeedsBuffer = true;
  const uint8_t* data;
  int64_t K;
  const float* rows(int64_t first, int64_t count, float* buffer) const {
    const int64_t row_bytes = K / kBlockWeights * block_bytes(Type);
    for (int64_t n = 0; n < count; ++n) {
      const uint8_t* row = data + (first + n) * row_bytes;
      for (int64_t b = 0; b < K / kBlockWeights; ++b)
        expand_block<Type>(row + b * block_bytes(Type), buffer + n * K + b * kBlockWeights);
    }
    return buffer;
  }
};

template <class Weight>
void linear_by_slices(const float* x, int64_t M, int64_t K, const Weight& weight, float* y, int64_t N) {
  const int64_t slice = std::max<int64_t>(1, kSliceBytes / (K * static_cast<int64_t>(sizeof(float))));
  at::parallel_for(0, N, std::max<int64_t>(slice, 64), [&](int64_t begin, int64_t end) {
    const std::unique_ptr<float[]> buffer(Weight::kNeedsBuffer ? new float[slice * K] : nullptr);
    for (int64_t s = begin; s < end; s += slice) {
      const int64_t count = std::min(end, s + slice) - s;
      const float* w = weight.rows(s, count, buffer.get());
      for (int64_t m = 0; m < M; m += kRowTile) {
        const int64_t rows = std::min<int64_t>(kRowTile, M - m);
        kFeaturesByRows[rows](x + m * K, K, w, y + m * N + s, N, count);
      }
    }
  });
}

torch::Tensor checked_input(torch::Tensor x, int64_t K, const char* op) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, op, ": float32 x only");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, op, ": x must be [M, ", K, "], got ", x.sizes());
  return x.contiguous();
}

}  // namespace

torch::Tensor small_batch_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.dim() == 2 && weight.is_contiguous(),
              "small_batch_linear: the weight must be a contiguous float32 [N, K]");
  const int64_t K = weight.size(1), N = weight.size(0);
  x = checked_input(x, K, "small_batch_linear");
  auto y = torch::empty({x.size(0), N}, x.options());
  linear_by_slices(x.data_ptr<float>(), x.size(0), K, FloatWeight{weight.data_ptr<float>(), K},
                   y.data_ptr<float>(), N);
  if (bias.has_value()) y.add_(*bias);
  return y;
}

torch::Tensor block_quantized_linear(torch::Tensor x, torch::Tensor blocks, int64_t ggml_type,
                                     c10::optional<torch::Tensor> bias, bool int8_activations) {
  const int64_t bytes = block_bytes(ggml_type);
  TORCH_CHECK(bytes > 0, "block_quantized_linear: ggml type ", ggml_type, " is not Q4_0 (2), Q4_1 (3) or Q8_0 (8)");
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.dim() == 2 && blocks.is_contiguous() &&
                  blocks.size(1) % bytes == 0,
              "block_quantized_linear: blocks must be contiguous uint8 [N, K / 32 * ", bytes, "]");
  const int64_t K = blocks.size(1) / bytes * kBlockWeights, N = blocks.size(0);
  x = checked_input(x, K, "block_quantized_linear");
  auto y = torch::empty({x.size(0), N}, x.options());
  const uint8_t* data = blocks.data_ptr<uint8_t>();
  const float* x_data = x.data_ptr<float>();
  float* y_data = y.data_ptr<float>();
  if (int8_activations && K % 64 == 0) {  // else (an odd number of blocks) float32 activations
    TORCH_CHECK(active_cpu_isa() == CpuIsa::kAvx512 && cpu_has_vnni(),
                "block_quantized_linear: 8-bit activations need AVX-512 with VNNI (avx512_vnni), which this CPU "
                "(or the instruction set set_cpu_isa chose) does not offer");
    block_linear_vnni(x_data, x.size(0), K, data, ggml_type, y_data, N);
    if (bias.has_value()) y.add_(*bias);
    return y;
  }
  if (active_cpu_isa() == CpuIsa::kAvx512) {
    block_linear_avx512(x_data, x.size(0), K, data, ggml_type, y_data, N);
    if (bias.has_value()) y.add_(*bias);
    return y;
  }
  if (ggml_type == kQ4_0) linear_by_slices(x_data, x.size(0), K, BlockWeight<kQ4_0>{data, K}, y_data, N);
  if (ggml_type == kQ4_1) linear_by_slices(x_data, x.size(0), K, BlockWeight<kQ4_1>{data, K}, y_data, N);
  if (ggml_type == kQ8_0) linear_by_slices(x_data, x.size(0), K, BlockWeight<kQ8_0>{data, K}, y_data, N);
  if (bias.has_value()) y.add_(*bias);
  return y;
}

torch::Tensor bf16_mode_block_linear(torch::Tensor x, torch::Tensor blocks, int64_t ggml_type,
                                     c10::optional<torch::Tensor> bias, bool int8_activations,
                                     c10::optional<torch::Tensor> interleaved) {
  if (int8_activations || x.dim() != 2 || !bf16_dot_supported())
    return block_quantized_linear(x, blocks, ggml_type, bias, int8_activations);
  if (interleaved.has_value()) return interleaved_bf16_linear(x, *interleaved, ggml_type, bias);
  if (x.size(0) < kBf16DotMinRows) return block_quantized_linear(x, blocks, ggml_type, bias, false);
  return bf16_dot_linear(x, blocks, ggml_type, bias);
}
