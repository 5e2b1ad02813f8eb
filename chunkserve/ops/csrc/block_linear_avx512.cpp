// The linear over GGUF blocks (see small_batch_linear.cpp) with AVX-512: each block is expanded
// to its 32 float weights in two registers and used there, by every row of a tile of rows,
// without the round trip through an L1 buffer of the AVX2 path. A 512-bit register holds half
// a block, so one block costs a load, two zero-extensions, two conversions and two FMAs with
// its scale and minimum, shared by the rows of the tile. The weights are exactly the floats
// gguf's `dequantize` gives (one rounding, as q * d + m is fused), the arithmetic float32.
#include "block_expand_avx512.h"
#include "block_linear.h"
#include "cpu_isa.h"
#include "row_tiles.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>

namespace {

constexpr int kRowTile = 8;
// Weight rows ahead that each tile prefetches, position for position: a decode step streams
// every weight from memory once, and the hardware prefetcher alone reaches about a third of the
// streaming read rate there (docs/benchmarks-log.md, "Prefetching the weights").
constexpr int64_t kPrefetchRows = 16;
constexpr int64_t kSliceBytes = 32 * 1024;

// Features per tile, by rows: a tile keeps R x F accumulators, 2 F weight registers and the
// row's two halves, under the 32 registers; at one row more features keep more FMA chains going,
// from 5 rows two features let up to 8 rows share each expanded block (a tile of 4 rows expanded
// every block twice for an 8-row decode). Measured: docs/benchmarks-log.md, "The AVX-512 block
// kernel shares each expanded block among 8 rows".
template <int R>
constexpr int kFeatureTile = R == 1 ? 8 : (R <= 4 ? 4 : 2);

// y[r * ldy + f] = x[r] . w[f] for R rows of x (K floats apart) and F weight rows of blocks
// (row_bytes apart).
template <int64_t Type, int R, int F>
CHUNKSERVE_AVX512_TARGET void tile(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes, float* y,
                                   int64_t ldy) {
  constexpr int64_t kBytes = block_bytes(Type);
  __m512 acc[R][F];
  for (int r = 0; r < R; ++r)
    for (int f = 0; f < F; ++f) acc[r][f] = _mm512_setzero_ps();
  const int64_t blocks = K / kBlockWeights;
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 low[F], high[F];
#pragma GCC unroll 8
    for (int f = 0; f < F; ++f) {
      const uint8_t* block = w + f * row_bytes + b * kBytes;
      _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchRows * row_bytes), _MM_HINT_T0);
      expand_block_avx512<Type>(block, low[f], high[f]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 x_low = _mm512_loadu_ps(x + r * K + b * kBlockWeights);
      const __m512 x_high = _mm512_loadu_ps(x + r * K + b * kBlockWeights + 16);
#pragma GCC unroll 8
      for (int f = 0; f < F; ++f) acc[r][f] = _mm512_fmadd_ps(x_high, high[f], _mm512_fmadd_ps(x_low, low[f], acc[r][f]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int f = 0; f < F; ++f) y[r * ldy + f] = _mm512_reduce_add_ps(acc[r][f]);
}

// The features [first, first + count) of R rows.
template <int64_t Type, int R>
CHUNKSERVE_AVX512_TARGET void features(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes, float* y,
                                       int64_t N, int64_t first, int64_t count) {
  constexpr int F = kFeatureTile<R>;
  int64_t n = first;
  for (; n + F <= first + count; n += F) tile<Type, R, F>(x, K, w + n * row_bytes, row_bytes, y + n, N);
  for (; n < first + count; ++n) tile<Type, R, 1>(x, K, w + n * row_bytes, row_bytes, y + n, N);
}

// Features [begin, end) of every row, a slice of features at a time (its blocks stay in L1
// while each tile of rows reads them).
template <int64_t Type>
CHUNKSERVE_AVX512_TARGET void feature_range(const float* x, int64_t M, int64_t K, const uint8_t* w, float* y,
                                            int64_t N, int64_t begin, int64_t end) {
  const int64_t row_bytes = K / kBlockWeights * block_bytes(Type);
  const int64_t slice = std::max<int64_t>(1, kSliceBytes / row_bytes);
  for (int64_t s = begin; s < end; s += slice) {
    const int64_t count = std::min(end, s + slice) - s;
    for_each_row_tile<kRowTile>(M, [&](int64_t m, auto rows) {
      features<Type, decltype(rows)::value>(x + m * K, K, w, row_bytes, y + m * N, N, s, count);
    });
  }
}

using FeatureRangeFn = void (*)(const float*, int64_t, int64_t, const uint8_t*, float*, int64_t, int64_t, int64_t);

}  // namespace

void block_linear_avx512(const float* x, int64_t M, int64_t K, const uint8_t* blocks, int64_t type, float* y,
                         int64_t N) {
  const FeatureRangeFn range = type == kQ4_0 ? feature_range<kQ4_0>
                               : type == kQ4_1 ? feature_range<kQ4_1>
                                               : feature_range<kQ8_0>;
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) { range(x, M, K, blocks, y, N, begin, end); });
}
