// Linear layers over a few rows: y = x @ weight^T (+ bias), x [M, K] with M up to a few dozen.
//
// At decode batch sizes each weight is used by only a handful of rows, so a step is bound by
// reading the weights once. A general GEMM packs and tiles for reuse that is not there (MKL
// reaches 8-10 GB/s of weight reads here at M = 8, against ~29 GB/s for this kernel at M = 1).
// This kernel streams every weight row once per 8 rows of x: 8 dot products share each vector
// of weights, with one accumulator per row, and the rows of x stay in L1. The features (the
// weight rows) are split over the threads in slices whose weights fit in L1, so a batch of more
// than 8 rows re-reads a slice from L1, not from memory.
#include "ops.h"
#include "simd.h"

#include <ATen/Parallel.h>

#include <algorithm>

namespace {

constexpr int kRowTile = 8;
constexpr int64_t kSliceBytes = 32 * 1024;

#ifdef CHUNKSERVE_AVX2
// y[r * ldy] = x[r] . w for r < Rows (one feature, Rows rows of x).
template <int Rows>
inline void dot_rows(const float* x, int64_t K, const float* w, float* y, int64_t ldy) {
  __m256 acc[Rows];
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) acc[r] = _mm256_setzero_ps();
  const int64_t k8 = K - K % 8;
  for (int64_t k = 0; k < k8; k += 8) {
    const __m256 weights = _mm256_loadu_ps(w + k);
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), weights, acc[r]);
  }
  for (int r = 0; r < Rows; ++r) {
    float sum = horizontal_sum(acc[r]);
    for (int64_t k = k8; k < K; ++k) sum += x[r * K + k] * w[k];
    y[r * ldy] = sum;
  }
}
#else
template <int Rows>
inline void dot_rows(const float* x, int64_t K, const float* w, float* y, int64_t ldy) {
  for (int r = 0; r < Rows; ++r) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t k = 0; k < K; ++k) sum += x[r * K + k] * w[k];
    y[r * ldy] = sum;
  }
}
#endif

template <int Rows>
void features(const float* x, int64_t K, const float* w, float* y, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) dot_rows<Rows>(x, K, w + n * K, y + n, N);
}

using FeaturesFn = void (*)(const float*, int64_t, const float*, float*, int64_t, int64_t, int64_t);
constexpr FeaturesFn kFeaturesByRows[kRowTile + 1] = {
    nullptr, features<1>, features<2>, features<3>, features<4>, features<5>, features<6>, features<7>, features<8>};

}  // namespace

torch::Tensor small_batch_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32,
              "small_batch_linear: float32 only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "small_batch_linear: x must be [M, K] and weight [N, K]");
  TORCH_CHECK(weight.is_contiguous(), "small_batch_linear: the weight must be contiguous");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* x_data = x.data_ptr<float>();
  const float* w_data = weight.data_ptr<float>();
  float* y_data = y.data_ptr<float>();
  const int64_t slice = std::max<int64_t>(1, kSliceBytes / (K * static_cast<int64_t>(sizeof(float))));
  at::parallel_for(0, N, std::max<int64_t>(slice, 64), [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; s += slice) {
      const int64_t s_end = std::min(end, s + slice);
      for (int64_t m = 0; m < M; m += kRowTile) {
        const int64_t rows = std::min<int64_t>(kRowTile, M - m);
        kFeaturesByRows[rows](x_data + m * K, K, w_data, y_data + m * N, N, s, s_end);
      }
    }
  });
  if (bias.has_value()) y.add_(*bias);
  return y;
}
