// Decode attention that reads the paged KV cache in place.
//
// One query row per request attends that request's keys 0 .. context_len - 1, found through
// its block table (slot = table[p / block_size] * block_size + p % block_size): no gather of
// the history into a contiguous tensor, no padding. Work is split over (request, kv head);
// the query heads that share a kv head (GQA) are done together, so each key and value row is
// read once per kv head.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

void decode_one(const float* q, const float* k_cache, const float* v_cache, float* out,
                const int64_t* table, int64_t context_len, int64_t block_size, int64_t kv_head,
                int64_t group, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                std::vector<float>& scores) {
  const int64_t slot_stride = num_kv_heads * head_dim;
  scores.resize(group * context_len);
  const int64_t first_head = kv_head * group;
  for (int64_t p = 0; p < context_len; ++p) {
    const int64_t slot = table[p / block_size] * block_size + p % block_size;
    const float* key = k_cache + slot * slot_stride + kv_head * head_dim;
    for (int64_t g = 0; g < group; ++g) {
      const float* query = q + (first_head + g) * head_dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += query[d] * key[d];
      scores[g * context_len + p] = dot * scale;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores.data() + g * context_len;
    const float top = *std::max_element(row, row + context_len);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t p = 0; p < context_len; ++p) {
      row[p] = std::exp(row[p] - top);
      total += row[p];
    }
    const float inverse = 1.f / total;
    for (int64_t p = 0; p < context_len; ++p) row[p] *= inverse;
  }
  for (int64_t g = 0; g < group; ++g) {
    float* result = out + (first_head + g) * head_dim;
    std::fill(result, result + head_dim, 0.f);
  }
  for (int64_t p = 0; p < context_len; ++p) {
    const int64_t slot = table[p / block_size] * block_size + p % block_size;
    const float* value = v_cache + slot * slot_stride + kv_head * head_dim;
    for (int64_t g = 0; g < group; ++g) {
      const float weight = scores[g * context_len + p];
      float* result = out + (first_head + g) * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) result[d] += weight * value[d];
    }
  }
}

}  // namespace

// q: [B, heads, head_dim]; caches: [num_slots, kv_heads, head_dim]; block_tables: [B, max_blocks]
// (int64); context_lens: [B] (int64). Returns [B, heads, head_dim]. float32, contiguous.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     int64_t block_size, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32 &&
              v_cache.scalar_type() == torch::kFloat32, "paged_decode_attention: float32 only");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt64,
              "paged_decode_attention: int64 block tables and context lengths");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode_attention: contiguous caches");
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "heads must be a multiple of kv heads");
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  auto out = torch::empty_like(q);
  const float* q_data = q.data_ptr<float>();
  const float* k_data = k_cache.data_ptr<float>();
  const float* v_data = v_cache.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t b = work / num_kv_heads, kv_head = work % num_kv_heads;
      decode_one(q_data + b * num_heads * head_dim, k_data, v_data, out_data + b * num_heads * head_dim,
                 tables + b * max_blocks, lens[b], block_size, kv_head, group, num_heads, num_kv_heads, head_dim,
                 static_cast<float>(scale), scores);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV cache, in place");
}
