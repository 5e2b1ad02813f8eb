// The small per-layer ops of a decoder layer, fused: RMS norm (with the residual add before
// it), rotary embedding in place, SiLU-and-multiply. At decode batch sizes their arithmetic
// is negligible and a chain of separate torch calls costs more than the math; each of these is
// one call. Rows are split over threads only when there are enough of them to pay for it.
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

namespace {

constexpr int64_t kElementsPerTask = 32 * 1024;

int64_t row_grain(int64_t row_elements) { return std::max<int64_t>(1, kElementsPerTask / row_elements); }

inline void normalize_row(const float* x, const float* weight, float eps, int64_t D, float* out) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t d = 0; d < D; ++d) squares += x[d] * x[d];
  const float inverse = 1.f / std::sqrt(squares / static_cast<float>(D) + eps);
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) out[d] = x[d] * inverse * weight[d];
}

void check_float(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, ": float32 only");
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_float(x, "rms_norm");
  x = x.contiguous();
  const int64_t D = x.size(-1), rows = x.numel() / D;
  TORCH_CHECK(weight.numel() == D && weight.is_contiguous(), "rms_norm: weight must have the last dim's size");
  auto out = torch::empty_like(x);
  const float *x_data = x.data_ptr<float>(), *w = weight.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  at::parallel_for(0, rows, row_grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) normalize_row(x_data + r * D, w, static_cast<float>(eps), D, out_data + r * D);
  });
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                                                      double eps) {
  check_float(x, "add_rms_norm");
  check_float(residual, "add_rms_norm");
  TORCH_CHECK(residual.is_contiguous() && x.sizes() == residual.sizes(),
              "add_rms_norm: residual must be contiguous and shaped as x");
  x = x.contiguous();
  const int64_t D = x.size(-1), rows = x.numel() / D;
  TORCH_CHECK(weight.numel() == D && weight.is_contiguous(), "add_rms_norm: weight must have the last dim's size");
  auto out = torch::empty_like(x);
  const float *x_data = x.data_ptr<float>(), *w = weight.data_ptr<float>();
  float *res = residual.data_ptr<float>(), *out_data = out.data_ptr<float>();
  at::parallel_for(0, rows, row_grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = res + r * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) row[d] += x_data[r * D + d];
      normalize_row(row, w, static_cast<float>(eps), D, out_data + r * D);
    }
  });
  return {out, residual};
}

namespace {

// x: [T, heads, D] with unit stride in D and heads D apart; rotated in place (neox layout).
void rotate_in_place(torch::Tensor& x, const float* cos, const float* sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rotary_embedding: q and k must be [T, heads, head_dim] with contiguous heads");
  const int64_t T = x.size(0), heads = x.size(1), D = x.size(2), half = D / 2, row_stride = x.stride(0);
  float* data = x.data_ptr<float>();
  at::parallel_for(0, T, row_grain(heads * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *c = cos + t * half, *s = sin + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        float* x1 = data + t * row_stride + h * D;
        float* x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], b = x2[i];
          x1[i] = a * c[i] - b * s[i];
          x2[i] = b * c[i] + a * s[i];
        }
      }
    }
  });
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> rotary_embedding(torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                                                          torch::Tensor sin) {
  check_float(q, "rotary_embedding");
  check_float(k, "rotary_embedding");
  cos = cos.contiguous();
  sin = sin.contiguous();
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == q.size(0) && cos.size(1) * 2 == q.size(2) && sin.sizes() == cos.sizes(),
              "rotary_embedding: cos and sin must be [T, head_dim / 2]");
  rotate_in_place(q, cos.data_ptr<float>(), sin.data_ptr<float>());
  rotate_in_place(k, cos.data_ptr<float>(), sin.data_ptr<float>());
  return {q, k};
}

torch::Tensor silu_and_mul(torch::Tensor x) {
  check_float(x, "silu_and_mul");
  x = x.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: x must be [T, 2 * intermediate]");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  auto out = torch::empty({T, I}, x.options());
  const float* in = x.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  at::parallel_for(0, T, row_grain(I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *gate = in + t * 2 * I, *up = gate + I;
      float* row = out_data + t * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) row[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
  return out;
}
