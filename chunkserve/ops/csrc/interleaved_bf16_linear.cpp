// bfloat16 mode's linear for decode steps (a few rows) on GGUF blocks repacked once at load
// ("interleaved", as llama.cpp calls its repacked layouts), with AVX512_BF16 pair dot products.
//
// A decode step reads every weight once and does two flops per row with it, so at a few rows it
// should run at the memory's streaming rate. The blocks as the file stores them keep each block's
// scale beside its 32 weights, one output feature's blocks after another: a kernel must expand
// each block on its own and reduce each feature across lanes, which at one row costs more than
// reading it (block_linear_avx512.cpp). Interleaved, 16 features' blocks of one position form one
// record, laid out so that each 32-bit lane works for one feature throughout:
//
//   Q4_0  d[16] (fp16) | nibbles[256]            288 bytes per 16 blocks (as the file's 16 x 18)
//   Q4_1  d[16] | m[16] | nibbles[256]           320 (16 x 20)
//   Q8_0  d[16] | (q + 128)[512]                 544 (16 x 34)
//
// For Q4, nibble byte 32c + 2f + p holds weight 2c + p of feature f in its low nibble and weight
// 16 + 2c + p in its high one; Q8_0's byte 32c + 2f + p holds weight 2c + p of feature f. Widened
// to 16 bits and ORed with 0x4300 (bfloat16 128.0, whose last 7 bits count units), a nibble u
// becomes the bfloat16 128 + u, exactly; each lane's pair then meets a row's pair of the same
// two positions in one `vdpbf16ps`, and each widened chunk serves every row of a tile. With
// S = sum x (128 + u) and sx = sum x over a block:
//
//   Q4_0  w = (u - 8) d        x . w = d (S - 136 sx)
//   Q4_1  w = u d + m          x . w = d (S - 128 sx) + m sx
//   Q8_0  q + 128 = 16 h + l   x . w = d (16 S_h + S_l - 2304 sx)
//
// x is rounded to bfloat16 (as every bfloat16-mode product rounds it) and sx summed from the
// rounded values; the weights are the file's exactly, and the sums float32. Each thread streams
// one run of records (16 features' whole rows) after another, front to back, the order the
// hardware prefetcher follows best.
#include "block_linear.h"
#include "cpu_isa.h"
#include "row_tiles.h"
#include "ops.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <cstring>
#include <vector>

namespace {

constexpr int64_t kFeatures = 16;  // features per record: one per 32-bit lane
constexpr int64_t kRowTile = 8;    // rows that share each widened chunk

// A record: 16 blocks' bytes, as in the file (the layout at the top).
constexpr int64_t record_bytes(int64_t type) { return kFeatures * block_bytes(type); }

// Byte offset of the weights in a record (after the scales).
constexpr int64_t weights_at(int64_t type) { return type == kQ4_1 ? 64 : 32; }

// Weight k of a file block's 32 as its unsigned integer: the nibble (Q4) or q + 128 (Q8_0).
int unsigned_weight(const uint8_t* block, int64_t type, int k) {
  if (type == kQ8_0) return static_cast<int8_t>(block[2 + k]) + 128;
  const uint8_t* nibbles = block + (type == kQ4_1 ? 4 : 2);
  return k < 16 ? nibbles[k] & 15 : nibbles[k - 16] >> 4;
}

// One row of x rounded to bfloat16 (`rounded`, K values) and each block's sum of the rounded values.
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

// The bfloat16 pair at `values` (two positions) in every 32-bit lane.
CHUNKSERVE_AVX512_BF16_TARGET inline __m512bh broadcast_pair(const uint16_t* values) {
  int32_t pair;
  std::memcpy(&pair, values, sizeof(pair));
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
}

// y[r * ldy + 0..15] = x_r . w for R rows of x (their bfloat16 values `rounded`, K apart, and block
// sums `sums`, `blocks` apart) and the 16 features of a run of `blocks` records (the features'
// whole rows). Each widened chunk serves all R rows; a row keeps its own sums per block.
template <int64_t Type, int R>
CHUNKSERVE_AVX512_BF16_TARGET void record_run(const uint16_t* rounded, const float* sums, int64_t K, int64_t blocks,
                                              const uint8_t* records, float* y, int64_t ldy) {
  constexpr int64_t kRecord = record_bytes(Type);
  // chains of dot products per row and nibble half: enough in all (4 or more) that their latency overlaps
  constexpr int kChains = R == 1 ? 2 : 1;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* record = records + b * kRecord;
    const uint8_t* weights = record + weights_at(Type);
    __m512 low_sum[R][kChains], high_sum[R][kChains];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kChains; ++c) low_sum[r][c] = high_sum[r][c] = _mm512_setzero_ps();
    // each row's block b, its bfloat16 values read in pairs of positions
    const uint16_t* x[R];
    for (int r = 0; r < R; ++r) x[r] = rounded + r * K + b * kBlockWeights;
    constexpr int kChunks = Type == kQ8_0 ? 16 : 8;
#pragma GCC unroll 16
    for (int c = 0; c < kChunks; ++c) {
      __m512bh low, high;
      widen(weights + 32 * c, low, high);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        // Q8_0: both halves of a byte are one weight (pair c); Q4: the high nibbles are pair 8 + c
        const __m512bh pair = broadcast_pair(x[r] + 2 * c);
        const __m512bh high_pair = Type == kQ8_0 ? pair : broadcast_pair(x[r] + 16 + 2 * c);
        low_sum[r][c % kChains] = _mm512_dpbf16_ps(low_sum[r][c % kChains], low, pair);
        high_sum[r][c % kChains] = _mm512_dpbf16_ps(high_sum[r][c % kChains], high, high_pair);
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(record)));
    __m512 m = _mm512_setzero_ps();
    if constexpr (Type == kQ4_1) m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(record + 32)));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512 low_total = low_sum[r][0], high_total = high_sum[r][0];
      if constexpr (kChains == 2) {
        low_total = _mm512_add_ps(low_total, low_sum[r][1]);
        high_total = _mm512_add_ps(high_total, high_sum[r][1]);
      }
      const __m512 sum_x = _mm512_set1_ps(sums[r * blocks + b]);
      if constexpr (Type == kQ8_0) {
        const __m512 dot = _mm512_fmadd_ps(high_total, _mm512_set1_ps(16.f), low_total);
        acc[r] = _mm512_fmadd_ps(_mm512_fnmadd_ps(sum_x, _mm512_set1_ps(2304.f), dot), d, acc[r]);
      } else {
        const __m512 dot = _mm512_add_ps(low_total, high_total);
        const __m512 offset = _mm512_set1_ps(Type == kQ4_0 ? 136.f : 128.f);
        acc[r] = _mm512_fmadd_ps(_mm512_fnmadd_ps(sum_x, offset, dot), d, acc[r]);
        if constexpr (Type == kQ4_1) acc[r] = _mm512_fmadd_ps(m, sum_x, acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

// Every row of x (M, rounded and summed) against one run of records: rows a tile of up to
// kRowTile at a time, the run read again from L1 for each tile after the first.
template <int64_t Type>
CHUNKSERVE_AVX512_BF16_TARGET void rows_against_run(const uint16_t* rounded, const float* sums, int64_t M, int64_t K,
                                                    int64_t blocks, const uint8_t* records, float* y, int64_t N) {
  for_each_row_tile<kRowTile>(M, [&](int64_t m, auto rows) {
    record_run<Type, decltype(rows)::value>(rounded + m * K, sums + m * blocks, K, blocks, records, y + m * N, N);
  });
}

using RowsAgainstRunFn = void (*)(const uint16_t*, const float*, int64_t, int64_t, int64_t, const uint8_t*,
                                  float*, int64_t);

}  // namespace

torch::Tensor pack_interleaved_blocks(torch::Tensor blocks, int64_t ggml_type) {
  const int64_t bytes = block_bytes(ggml_type);
  TORCH_CHECK(bytes > 0, "pack_interleaved_blocks: ggml type ", ggml_type, " is not Q4_0 (2), Q4_1 (3) or Q8_0 (8)");
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.dim() == 2 && blocks.is_contiguous() &&
                  blocks.size(1) % bytes == 0 && blocks.size(0) % kFeatures == 0,
              "pack_interleaved_blocks: blocks must be contiguous uint8 [N, K / 32 * ", bytes,
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
              const int low = unsigned_weight(block, ggml_type, k);
              out[at + 32 * c + 2 * f + p] = static_cast<uint8_t>(
                  ggml_type == kQ8_0 ? low : low | unsigned_weight(block, ggml_type, 16 + k) << 4);
            }
          }
        }
      }
    }
  });
  return packed;
}

torch::Tensor interleaved_bf16_linear(torch::Tensor x, torch::Tensor packed, int64_t ggml_type,
                                     c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(block_bytes(ggml_type) > 0, "interleaved_bf16_linear: ggml type ", ggml_type,
              " is not Q4_0 (2), Q4_1 (3) or Q8_0 (8)");
  TORCH_CHECK(bf16_dot_supported(), "interleaved_bf16_linear: needs AVX-512 with AVX512_BF16, which this CPU (or the "
              "instruction set set_cpu_isa chose) does not offer");
  const int64_t record = record_bytes(ggml_type);
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.dim() == 2 && packed.is_contiguous() &&
                  packed.size(1) % record == 0,
              "interleaved_bf16_linear: packed must be pack_interleaved_blocks' [N / 16, K / 32 * ", record, "] bytes");
  const int64_t blocks = packed.size(1) / record, K = blocks * kBlockWeights, N = packed.size(0) * kFeatures;
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.size(1) == K,
              "interleaved_bf16_linear: x must be float32 [M, ", K, "], got ", x.scalar_type(), " ", x.sizes());
  x = x.contiguous();
  const int64_t M = x.size(0);
  std::vector<uint16_t> rounded(M * K);
  std::vector<float> sums(M * blocks);
  for (int64_t r = 0; r < M; ++r)
    round_row(x.data_ptr<float>() + r * K, K, rounded.data() + r * K, sums.data() + r * blocks);
  auto y = torch::empty({M, N}, x.options());
  const RowsAgainstRunFn run = ggml_type == kQ4_0   ? rows_against_run<kQ4_0>
                               : ggml_type == kQ4_1 ? rows_against_run<kQ4_1>
                                                    : rows_against_run<kQ8_0>;
  const uint8_t* records = packed.data_ptr<uint8_t>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, packed.size(0), 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      run(rounded.data(), sums.data(), M, K, blocks, records + g * packed.size(1), out + g * kFeatures, N);
  });
  if (bias.has_value()) y.add_(*bias);
  return y;
}
