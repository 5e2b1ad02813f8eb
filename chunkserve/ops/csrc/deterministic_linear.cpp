// The linear layers of deterministic mode (`--deterministic`): each output element is one dot
// product whose order over K is the same for every row count and every position of the row in
// the batch, so a request's bits never depend on what else is in its step.
//
// Every kernel here accumulates an element in one vector register, lane j taking the products
// of the K positions j, j + 16, j + 32, ... in increasing order (bfloat16: a pair of positions
// per lane and step), then sums the lanes with one fixed tree (`_mm512_reduce_add_ps`'s). A tile
// of R rows x F features only decides how many rows share a weight load, and a long K is taken
// in runs whose sums are stored and reloaded exactly; neither changes an element's arithmetic,
// and threads split features, never K. So a row gets the same bits alone or in any batch; the
// tests (tests/ops/test_deterministic_linear.py) check it, as -ffast-math builds these files.
//
// - `dequantized_linear`: float32, on a GGUF layer's dequantized float weight. Its order is the
//   AVX-512 block kernel's (block_linear_avx512.cpp), so a row gets the same bits from the
//   blocks (few rows: fewer bytes) and from the floats (many rows: no expansion per row tile).
// - `bf16_dot_linear`: bfloat16 mode. x and the weight rounded to bfloat16 (round to nearest
//   even, once), products accumulated in float32 by AVX512_BF16's pair dot products, one
//   32-weight GGUF block per instruction; the weight either packed as bfloat16 (`round_to_bf16`)
//   or GGUF blocks expanded and rounded in registers by the same instruction, the same bits.
#include "block_expand_avx512.h"
#include "block_linear.h"
#include "cpu_isa.h"
#include "row_tiles.h"
#include "ops.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <memory>
#include <vector>

// The tiles are compiled once for both sources with CHUNKSERVE_AVX512_BF16_TARGET; the float32
// ones use no bfloat16 instruction, so they run on AVX-512 CPUs without AVX512_BF16 too.
namespace {

constexpr int kRowTile = 8;
constexpr int64_t kTileRowsBytes = 24 * 1024;  // the x of a row tile over a K run: half of L1
// Features of a thread's range done together over all rows: their weights stay in L2 while every
// row tile reads them.
constexpr int64_t kSliceFeatures = 144;
// Weight rows ahead that each tile prefetches (as block_linear_avx512.cpp: decode streams them).
constexpr int64_t kPrefetchRows = 16;
constexpr int64_t kBf16Lanes = 32;  // bfloat16 values in a register: one GGUF block

// Features per tile by rows: R x F accumulators, F weight registers and one of x under the 32
// registers. Any value gives the same bits; these give the fewest loads per product.
template <int R>
constexpr int kFeatureTile = R <= 2 ? 8 : (R <= 4 ? 6 : (R <= 6 ? 4 : 3));

// ----- weight sources: F weight rows, 16 (float32) or 32 (bfloat16) K positions at a time -----

struct FloatSource {  // float32 [N, K]
  using X = float;
  static constexpr int64_t kStep = 16;
  const float* data;
  int64_t K;
  CHUNKSERVE_AVX512_TARGET __m512 load(int64_t n, int64_t k) const { return _mm512_loadu_ps(data + n * K + k); }
  CHUNKSERVE_AVX512_TARGET static __m512 load_x(const float* x, int64_t k) { return _mm512_loadu_ps(x + k); }
  CHUNKSERVE_AVX512_TARGET static __m512 dot(__m512 acc, __m512 x, __m512 w) { return _mm512_fmadd_ps(x, w, acc); }
};

struct Bf16Source {  // bfloat16 [N, K], K a multiple of 32 (round_to_bf16 pads)
  using X = uint16_t;
  static constexpr int64_t kStep = kBf16Lanes;
  const uint16_t* data;
  int64_t K;
  CHUNKSERVE_AVX512_BF16_TARGET __m512bh load(int64_t n, int64_t k) const {
    const uint16_t* at = data + n * K + k;
    _mm_prefetch(reinterpret_cast<const char*>(at + kPrefetchRows * K), _MM_HINT_T0);
    return (__m512bh)_mm512_loadu_si512(at);
  }
  CHUNKSERVE_AVX512_BF16_TARGET static __m512bh load_x(const uint16_t* x, int64_t k) {
    return (__m512bh)_mm512_loadu_si512(x + k);
  }
  CHUNKSERVE_AVX512_BF16_TARGET static __m512 dot(__m512 acc, __m512bh x, __m512bh w) {
    return _mm512_dpbf16_ps(acc, x, w);
  }
};

template <int64_t Type>
struct Bf16BlockSource : Bf16Source {  // GGUF blocks [N, K / 32 blocks], each expanded and rounded
  const uint8_t* blocks;
  int64_t row_bytes;
  CHUNKSERVE_AVX512_BF16_TARGET __m512bh load(int64_t n, int64_t k) const {
    const uint8_t* block = blocks + n * row_bytes + k / kBlockWeights * block_bytes(Type);
    _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchRows * row_bytes), _MM_HINT_T0);
    __m512 low, high;
    expand_block_avx512<Type>(block, low, high);
    return _mm512_cvtne2ps_pbh(high, low);
  }
};

// sums[i] = the sum of v[i]'s lanes by _mm512_reduce_add_ps's tree (lane i + i + 8, then + 4,
// + 2, + 1), so with its bits, for 16 registers at once: the tree's levels of 16 sums share their
// shuffles and additions, a third of the instructions of 16 reductions one by one.
CHUNKSERVE_AVX512_TARGET inline void reduce_16(const __m512* v, float* sums) {
  __m512 halves[8], quarters[4], eighths[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)  // [v[2i] lanes 0-7 + 8-15, v[2i+1] lanes 0-7 + 8-15]
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // 128-bit lane j: register 4i + j's lanes 0-3 + 4-7
    quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0x88),
                                _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0xDD));
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)  // lane j: [0 + 2, 1 + 3] of register 8i + j, then of 8i + 4 + j
    eighths[i] = _mm512_add_ps(_mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], 0x44),
                               _mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], 0xEE));
  // lane j: the sums of registers j, 4 + j, 8 + j, 12 + j
  const __m512 last = _mm512_add_ps(_mm512_shuffle_ps(eighths[0], eighths[1], 0x88),
                                    _mm512_shuffle_ps(eighths[0], eighths[1], 0xDD));
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, last);
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) sums[i] = lanes[i % 4 * 4 + i / 4];
}

// reduce_16 over `Count` registers, the last fewer than 16 one by one (the same tree).
template <int Count>
CHUNKSERVE_AVX512_TARGET inline void reduce_lanes(const __m512* v, float* sums) {
  int i = 0;
  for (; i + 16 <= Count; i += 16) reduce_16(v + i, sums + i);
#pragma GCC unroll 16
  for (; i < Count; ++i) sums[i] = _mm512_reduce_add_ps(v[i]);
}

// A run of K positions [begin, end) of a tile's dot products. The tile's sums start from zero at
// K's start, else from `partial`, where the run before left them; they end in y at K's end,
// else in `partial` (sum (r, f) at (f * kRowTile + r) * 16): the products and their order are
// those of one run over K, the sums stored and reloaded exactly.
struct KRun {
  int64_t begin, end;
  float* partial;
};

// y[r * ldy + f] = x[r] . w[first + f] for R rows of x (K apart) and F features, over `run`.
template <class Source, int R, int F>
CHUNKSERVE_AVX512_BF16_TARGET void tile(const Source& source, const typename Source::X* x, int64_t first, float* y,
                                        int64_t ldy, const KRun& run) {
  const int64_t K = source.K;
  __m512 acc[R][F];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int f = 0; f < F; ++f)
      acc[r][f] = run.begin == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(run.partial + (f * kRowTile + r) * 16);
  for (int64_t k = run.begin; k < run.end; k += Source::kStep) {
    decltype(source.load(0, 0)) w[F];
#pragma GCC unroll 8
    for (int f = 0; f < F; ++f) w[f] = source.load(first + f, k);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      auto row = Source::load_x(x + r * K, k);
      asm("" : "+v"(row));  // one load per row: folded into each product it would be loaded F times
#pragma GCC unroll 8
      for (int f = 0; f < F; ++f) acc[r][f] = Source::dot(acc[r][f], row, w[f]);
    }
  }
  if (run.end < K) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int f = 0; f < F; ++f) _mm512_storeu_ps(run.partial + (f * kRowTile + r) * 16, acc[r][f]);
    return;
  }
  float sums[R * F];
  reduce_lanes<R * F>(&acc[0][0], sums);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int f = 0; f < F; ++f) y[r * ldy + f] = sums[r * F + f];
}

// Features [first, stop) of R rows, over `run` (its partial sums those of feature `first` on).
template <class Source, int R>
CHUNKSERVE_AVX512_BF16_TARGET void features(const Source& source, const typename Source::X* x, float* y, int64_t N,
                                            int64_t first, int64_t stop, const KRun& run) {
  constexpr int F = kFeatureTile<R>;
  int64_t n = first;
  for (; n + F <= stop; n += F)
    tile<Source, R, F>(source, x, n, y + n, N, {run.begin, run.end, run.partial + (n - first) * kRowTile * 16});
  for (; n < stop; ++n)
    tile<Source, R, 1>(source, x, n, y + n, N, {run.begin, run.end, run.partial + (n - first) * kRowTile * 16});
}

// K positions per run: a row tile's x over a run stays in L1 beside the weights streaming past it
// (one run where K is short enough; the MLP's down projection takes two in float32).
template <class Source>
int64_t k_run(int64_t K) {
  const int64_t fits = kTileRowsBytes / (kRowTile * static_cast<int64_t>(sizeof(typename Source::X)));
  return std::min(K, std::max(Source::kStep, fits / Source::kStep * Source::kStep));
}

template <class Source>
void linear(const Source& source, const typename Source::X* x, int64_t M, float* y, int64_t N) {
  const int64_t K = source.K, run_length = k_run<Source>(K);
  at::parallel_for(0, N, kSliceFeatures, [&](int64_t begin, int64_t end) {
    const std::unique_ptr<float[]> partial(run_length < K ? new float[kSliceFeatures * kRowTile * 16] : nullptr);
    for (int64_t s = begin; s < end; s += kSliceFeatures) {
      const int64_t stop = std::min(end, s + kSliceFeatures);
      for_each_row_tile<kRowTile>(M, [&](int64_t m, auto rows) {
        for (int64_t k = 0; k < K; k += run_length) {
          const KRun run{k, std::min(K, k + run_length), partial.get()};
          features<Source, decltype(rows)::value>(source, x + m * K, y + m * N, N, s, stop, run);
        }
      });
    }
  });
}

// Rows [begin, end) of float32 [rows, K] -> bfloat16 [rows, padded] (padded a multiple of 32,
// zeros beyond K), rounded by the instruction that rounds the blocks in registers.
CHUNKSERVE_AVX512_BF16_TARGET void round_rows(const float* in, int64_t K, uint16_t* out, int64_t padded,
                                              int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r)
    for (int64_t k = 0; k < padded; k += kBf16Lanes) {
      const float* at = in + r * K + k;
      const int64_t left = K - k;
      const __mmask16 low = left >= 16 ? 0xFFFF : (left > 0 ? (1u << left) - 1 : 0);
      const __mmask16 high = left >= 32 ? 0xFFFF : (left > 16 ? (1u << (left - 16)) - 1 : 0);
      const __m512bh pairs = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(high, at + 16), _mm512_maskz_loadu_ps(low, at));
      _mm512_storeu_si512(out + r * padded + k, (__m512i)pairs);
    }
}

void round_to(const float* in, int64_t rows, int64_t K, uint16_t* out, int64_t padded) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) { round_rows(in, K, out, padded, begin, end); });
}

int64_t padded_k(int64_t K) { return (K + kBf16Lanes - 1) / kBf16Lanes * kBf16Lanes; }

bool cpu_has_avx512_bf16() {
  return active_cpu_isa() == CpuIsa::kAvx512 && __builtin_cpu_supports("avx512bf16");
}

torch::Tensor with_bias(torch::Tensor y, const c10::optional<torch::Tensor>& bias) {
  return bias.has_value() ? y.add_(*bias) : y;
}

template <int64_t Type>
void bf16_blocks(const uint16_t* x, int64_t M, int64_t K, const uint8_t* blocks, float* y, int64_t N) {
  Bf16BlockSource<Type> source{};
  source.K = K;
  source.blocks = blocks;
  source.row_bytes = K / kBlockWeights * block_bytes(Type);
  linear(source, x, M, y, N);
}

}  // namespace

bool bf16_dot_supported() { return cpu_has_avx512_bf16(); }

torch::Tensor round_to_bf16(torch::Tensor weight) {
  TORCH_CHECK(cpu_has_avx512_bf16(), "round_to_bf16: needs AVX512_BF16, which this CPU lacks");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.dim() == 2,
              "round_to_bf16: a float32 [N, K] weight only, got ", weight.sizes());
  weight = weight.contiguous();
  const int64_t N = weight.size(0), K = weight.size(1);
  auto out = torch::empty({N, padded_k(K)}, weight.options().dtype(torch::kBFloat16));
  round_to(weight.data_ptr<float>(), N, K, reinterpret_cast<uint16_t*>(out.data_ptr()), padded_k(K));
  return out;
}

torch::Tensor dequantized_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.size(1) % kBlockWeights == 0,
              "dequantized_linear: the weight must be a contiguous float32 [N, K], K a multiple of 32");
  if (active_cpu_isa() != CpuIsa::kAvx512) return small_batch_linear(x, weight, bias);  // the AVX2 block path's twin
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.size(1) == K,
              "dequantized_linear: x must be float32 [M, ", K, "], got ", x.sizes());
  x = x.contiguous();
  auto y = torch::empty({x.size(0), N}, x.options());
  linear(FloatSource{weight.data_ptr<float>(), K}, x.data_ptr<float>(), x.size(0), y.data_ptr<float>(), N);
  return with_bias(y, bias);
}

torch::Tensor bf16_dot_linear(torch::Tensor x, torch::Tensor weight, int64_t ggml_type,
                              c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(cpu_has_avx512_bf16(), "bf16_dot_linear: needs AVX512_BF16, which this CPU lacks");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "bf16_dot_linear: a contiguous 2-d weight");
  const bool blocks = ggml_type >= 0;
  const int64_t bytes = blocks ? block_bytes(ggml_type) : 0;
  TORCH_CHECK(!blocks || (bytes > 0 && weight.scalar_type() == torch::kUInt8 && weight.size(1) % bytes == 0),
              "bf16_dot_linear: blocks must be uint8 [N, K / 32 * block bytes] of Q4_0, Q4_1 or Q8_0");
  TORCH_CHECK(blocks || (weight.scalar_type() == torch::kBFloat16 && weight.size(1) % kBf16Lanes == 0),
              "bf16_dot_linear: the weight must be round_to_bf16's bfloat16 [N, K padded to 32]");
  const int64_t N = weight.size(0), K = blocks ? weight.size(1) / bytes * kBlockWeights : weight.size(1);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && padded_k(x.size(1)) == K,
              "bf16_dot_linear: x must be float32 [M, ", K, "], got ", x.sizes());
  x = x.contiguous();
  const int64_t M = x.size(0);
  std::vector<uint16_t> rounded(M * K);  // not a tensor: a decode step makes some 120 of these
  round_to(x.data_ptr<float>(), M, x.size(1), rounded.data(), K);
  const uint16_t* x_bf16 = rounded.data();
  auto y = torch::empty({M, N}, x.options());
  float* out = y.data_ptr<float>();
  if (!blocks) {
    linear(Bf16Source{reinterpret_cast<const uint16_t*>(weight.data_ptr()), K}, x_bf16, M, out, N);
  } else if (ggml_type == kQ4_0) {
    bf16_blocks<kQ4_0>(x_bf16, M, K, weight.data_ptr<uint8_t>(), out, N);
  } else if (ggml_type == kQ4_1) {
    bf16_blocks<kQ4_1>(x_bf16, M, K, weight.data_ptr<uint8_t>(), out, N);
  } else {
    bf16_blocks<kQ8_0>(x_bf16, M, K, weight.data_ptr<uint8_t>(), out, N);
  }
  return with_bias(y, bias);
}
