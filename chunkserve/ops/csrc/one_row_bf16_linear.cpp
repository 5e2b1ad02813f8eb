// bfloat16 mode's linear for a step of one row (a single decode) on GGUF blocks repacked once at
// load, with AVX512_BF16 pair dot products.
//
// A one-row step reads every weight once and does two flops with it, so it should run at the
// memory's streaming rate. The blocks as the file stores them keep each block's scale beside its
// 32 weights, one output feature's blocks after another: a kernel must expand each block on its
// own and reduce each feature across lanes, which costs more than reading it (block_linear_avx512.cpp).
// Repacked, 16 features' blocks of one position form one record, laid out so that each 32-bit
// lane works for one feature throughout:
//
//   Q4_0  d[16] (fp16) | nibbles[256]            288 bytes per 16 blocks (as the file's 16 x 18)
//   Q4_1  d[16] | m[16] | nibbles[256]           320 (16 x 20)
//   Q8_0  d[16] | (q + 128)[512]                 544 (16 x 34)
//
// For Q4, nibble byte 32c + 2f + p holds weight 2c + p of feature f in its low nibble and weight
// 16 + 2c + p in its high one; Q8_0's byte 32c + 2f + p holds weight 2c + p of feature f. Widened
// to 16 bits and ORed with 0x4300 (bfloat16 128.0, whose last 7 bits count units), a nibble u
// becomes the bfloat16 128 + u, exactly; each lane's pair then meets the row's pair of the same
// two positions in one `vdpbf16ps`. With S = sum x (128 + u) and sx = sum x over a block:
//
//   Q4_0  w = (u - 8) d        x . w = d (S - 136 sx)
//   Q4_1  w = u d + m          x . w = d (S - 128 sx) + m sx
//   Q8_0  q + 128 = 16 h + l   x . w = d (16 S_h + S_l - 2304 sx)
//
// x is rounded to bfloat16 (as every bfloat16-mode product rounds it) and sx summed from the
// rounded values; the weights are the file's exactly, and the sums float32. Each thread streams
// one run of records front to back, the order the hardware prefetcher follows best.
#include "block_linear.h"
#include "cpu_isa.h"
#include "ops.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <cstring>
#include <vector>

namespace {

constexpr int64_t kFeatures = 16;  // features per record: one per 32-bit lane

int64_t record_bytes(int64_t type) { return type == kQ4_0 ? 288 : (type == kQ4_1 ? 320 : 544); }

// Byte offset of the weights in a record (after the scales).
constexpr int64_t weights_at(int64_t type) { return type == kQ4_1 ? 64 : 32; }

// Weight k of a file block's 32 as its unsigned integer: the nibble (Q4) or q + 128 (Q8_0).
int unsigned_weight(const uint8_t* block, int64_t type, int k) {
  if (type == kQ8_0) return static_cast<int8_t>(block[2 + k]) + 128;
  const uint8_t* nibbles = block + (type == kQ4_1 ? 4 : 2);
  return k < 16 ? nibbles[k] & 15 : nibbles[k - 16] >> 4;
}

// x's one row rounded to bfloat16 (`rounded`, K values) and each block's sum of the rounded values.
CHUNKSERVE_AVX512_BF16_TARGET void round_row(const float* x, int64_t K, uint16_t* rounded, float* sums) {
  for (int64_t b = 0; b < K / kBlockWeights; ++b) {
    const float* values = x + b * kBlockWeights;
    const __m512bh pairs = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(values + 16), _mm512_loadu_ps(values));
    _mm512_storeu_si512(rounded + b * kBlockWeights, reinterpret_cast<__m512i>(pairs));
    const __m256bh low = reinterpret_cast<__m256bh>(_mm512_castsi512_si256(reinterpret_cast<__m512i>(pairs)));
    const __m256bh high = reinterpret_cast<__m256bh>(_mm512_extracti64x4_epi64(reinterpret_cast<__m512i>(pairs), 1));
    sums[b] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_cvtpbh_ps(low), _mm512_cvtpbh_ps(high)));
  }
}

// 32 weights' bytes (one chunk) widened to 16 bits: the low nibbles and the high ones (Q4), or
// the low and high halves of each byte (Q8_0), as bfloat16 128 + u.
CHUNKSERVE_AVX512_BF16_TARGET inline void widen(const uint8_t* chunk, __m512bh& low, __m512bh& high) {
  const __m512i bias = _mm512_set1_epi16(0x4300);
  const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk)));
  low = reinterpret_cast<__m512bh>(_mm512_ternarylogic_epi32(words, _mm512_set1_epi16(15), bias, 0xEA));  // a & b | c
  high = reinterpret_cast<__m512bh>(_mm512_or_si512(_mm512_srli_epi16(words, 4), bias));
}

// One record's row of 16 features, y[0..15] = x . w over the features' blocks, for `blocks`
// records (a feature's whole row) from `records`.
template <int64_t Type>
CHUNKSERVE_AVX512_BF16_TARGET void record_run(const uint16_t* rounded, const float* sums, int64_t blocks,
                                              const uint8_t* records, float* y) {
  constexpr int64_t kRecord = Type == kQ4_0 ? 288 : (Type == kQ4_1 ? 320 : 544);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* record = records + b * kRecord;
    const uint8_t* weights = record + weights_at(Type);
    const uint32_t* x = reinterpret_cast<const uint32_t*>(rounded + b * kBlockWeights);  // pairs of positions
    // four chains of dot products, so that their latency overlaps
    __m512 s[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    if constexpr (Type == kQ8_0) {
#pragma GCC unroll 16
      for (int c = 0; c < 16; ++c) {
        __m512bh low, high;
        widen(weights + 32 * c, low, high);
        const __m512bh pair = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[c])));
        s[c & 1] = _mm512_dpbf16_ps(s[c & 1], low, pair);
        s[2 + (c & 1)] = _mm512_dpbf16_ps(s[2 + (c & 1)], high, pair);
      }
    } else {
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        __m512bh low, high;
        widen(weights + 32 * c, low, high);
        const int chain = 2 * (c & 1);
        s[chain] = _mm512_dpbf16_ps(s[chain], low, reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[c]))));
        s[chain + 1] = _mm512_dpbf16_ps(s[chain + 1], high,
                                        reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[8 + c]))));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(record)));
    const __m512 sum_x = _mm512_set1_ps(sums[b]);
    if constexpr (Type == kQ8_0) {
      const __m512 dot = _mm512_fmadd_ps(_mm512_add_ps(s[2], s[3]), _mm512_set1_ps(16.f), _mm512_add_ps(s[0], s[1]));
      acc = _mm512_fmadd_ps(_mm512_fnmadd_ps(sum_x, _mm512_set1_ps(2304.f), dot), d, acc);
    } else {
      const __m512 dot = _mm512_add_ps(_mm512_add_ps(s[0], s[1]), _mm512_add_ps(s[2], s[3]));
      acc = _mm512_fmadd_ps(_mm512_fnmadd_ps(sum_x, _mm512_set1_ps(Type == kQ4_0 ? 136.f : 128.f), dot), d, acc);
      if constexpr (Type == kQ4_1) {
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(record + 32)));
        acc = _mm512_fmadd_ps(m, sum_x, acc);
      }
    }
  }
  _mm512_storeu_ps(y, acc);
}

using RecordRunFn = void (*)(const uint16_t*, const float*, int64_t, const uint8_t*, float*);

}  // namespace

torch::Tensor pack_blocks_for_one_row(torch::Tensor blocks, int64_t ggml_type) {
  const int64_t bytes = block_bytes(ggml_type);
  TORCH_CHECK(bytes > 0, "pack_blocks_for_one_row: ggml type ", ggml_type, " is not Q4_0 (2), Q4_1 (3) or Q8_0 (8)");
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.dim() == 2 && blocks.is_contiguous() &&
                  blocks.size(1) % bytes == 0 && blocks.size(0) % kFeatures == 0,
              "pack_blocks_for_one_row: blocks must be contiguous uint8 [N, K / 32 * ", bytes,
              "] with N a multiple of 16, got ", blocks.sizes());
  const int64_t groups = blocks.size(0) / kFeatures, per_row = blocks.size(1) / bytes;
  const int64_t record = record_bytes(ggml_type), at = weights_at(ggml_type);
  auto packed = torch::empty({groups, per_row * record}, blocks.options());
  const uint8_t* source = blocks.data_ptr<uint8_t>();
  uint8_t* target = packed.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t b = 0; b < per_row; ++b) {
        uint8_t* out = target + (g * per_row + b) * record;
        for (int64_t f = 0; f < kFeatures; ++f) {
          const uint8_t* block = source + (g * kFeatures + f) * blocks.size(1) + b * bytes;
          std::memcpy(out + 2 * f, block, 2);                                 // d
          if (ggml_type == kQ4_1) std::memcpy(out + 32 + 2 * f, block + 2, 2);  // m
          for (int c = 0; c < (ggml_type == kQ8_0 ? 16 : 8); ++c) {
            for (int p = 0; p < 2; ++p) {
              const int k = 2 * c + p;
              out[at + 32 * c + 2 * f + p] = static_cast<uint8_t>(
                  ggml_type == kQ8_0 ? unsigned_weight(block, ggml_type, k)
                                     : unsigned_weight(block, ggml_type, k) | unsigned_weight(block, ggml_type, 16 + k) << 4);
            }
          }
        }
      }
    }
  });
  return packed;
}

torch::Tensor one_row_bf16_linear(torch::Tensor x, torch::Tensor packed, int64_t ggml_type,
                                  c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(block_bytes(ggml_type) > 0, "one_row_bf16_linear: ggml type ", ggml_type,
              " is not Q4_0 (2), Q4_1 (3) or Q8_0 (8)");
  TORCH_CHECK(bf16_dot_supported(), "one_row_bf16_linear: needs AVX-512 with AVX512_BF16, which this CPU (or the "
              "instruction set set_cpu_isa chose) does not offer");
  const int64_t record = record_bytes(ggml_type);
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.dim() == 2 && packed.is_contiguous() &&
                  packed.size(1) % record == 0,
              "one_row_bf16_linear: packed must be pack_blocks_for_one_row's [N / 16, K / 32 * ", record, "] bytes");
  const int64_t blocks = packed.size(1) / record, K = blocks * kBlockWeights, N = packed.size(0) * kFeatures;
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.size(0) == 1 && x.size(1) == K,
              "one_row_bf16_linear: x must be float32 [1, ", K, "], got ", x.scalar_type(), " ", x.sizes());
  x = x.contiguous();
  std::vector<uint16_t> rounded(K);
  std::vector<float> sums(blocks);
  round_row(x.data_ptr<float>(), K, rounded.data(), sums.data());
  auto y = torch::empty({1, N}, x.options());
  const RecordRunFn run = ggml_type == kQ4_0 ? record_run<kQ4_0> : ggml_type == kQ4_1 ? record_run<kQ4_1>
                                                                                     : record_run<kQ8_0>;
  const uint8_t* records = packed.data_ptr<uint8_t>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, packed.size(0), 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) run(rounded.data(), sums.data(), blocks, records + g * packed.size(1), out + g * kFeatures);
  });
  if (bias.has_value()) y.add_(*bias);
  return y;
}
