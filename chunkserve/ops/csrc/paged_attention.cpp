// Decode attention that reads the paged KV cache in place (split-K, as flash-decoding).
//
// One query row per request attends that request's keys 0 .. context_len - 1, found through
// its block table (slot = table[p / block_size] * block_size + p % block_size): no gather of
// the history into a contiguous tensor, no padding. A request's positions are cut into
// partitions of kPartitionBlocks blocks; each (request, partition) is one unit of parallel
// work that reads whole slot rows (every kv head at once, so each block is one contiguous run
// of memory the prefetcher can follow) and keeps a running max, sum and weighted value sum per
// query head (online softmax). The partitions of a request are then merged.
//
// The kernel is bound by memory, not arithmetic: the blocks lie anywhere in the pool, and the
// hardware prefetcher only starts on a block once its first lines have missed. So while a
// block is computed, its heads' iterations each prefetch a share of the next block's K and V
// lines (all at once would overflow the L1 miss buffers). Measured: docs/benchmarks-log.md,
// "Decode steps: the C++ ops against plain torch" (paged_attention.cpp).
//
// Where the CPU has AVX-512 and heads are 64 wide, a block's keys and values are loaded once
// per kv head for up to three of its query heads together (GQA), in 512-bit registers, instead
// of once per query head. That path computes faster than its prefetches used to land, so it
// issues them a few lines per key, and during a partition's last block it prefetches the first
// block of the thread's next unit.
//
// The cache is float32 or bfloat16 (kv_element.h); either is widened to float32 as it is
// loaded, and q, the softmax and the accumulators stay float32.
#include "ops.h"
#include "cpu_isa.h"
#include "kv_element.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kPartitionBlocks = 16;
constexpr int64_t kHeadTile = 3;  // query heads of one kv head sharing each loaded key (AVX-512 path)
constexpr int64_t kKeyChunk = 16;

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, group, block_size;
  float scale;
};

// The running softmax state of one partition: per head, max, sum of exp, and sum of exp * v.
struct Partial {
  float* max;
  float* sum;
  float* acc;  // [num_heads, head_dim]
};

// scores[i] = scale * q . key_i for the n keys of a block (slot_stride elements apart).
#ifdef CHUNKSERVE_AVX2
template <int DV, typename T>  // head_dim = 8 * DV: four keys at a time, four independent FMA chains
void block_scores_avx2(const float* q, const T* keys, int64_t slot_stride, int64_t n, float scale,
                       float* scores) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const T* key = keys + i * slot_stride;
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
#pragma GCC unroll 16
    for (int v = 0; v < DV; ++v) {
      const __m256 query = _mm256_loadu_ps(q + 8 * v);
      s0 = _mm256_fmadd_ps(query, kv::load8(key + 8 * v), s0);
      s1 = _mm256_fmadd_ps(query, kv::load8(key + slot_stride + 8 * v), s1);
      s2 = _mm256_fmadd_ps(query, kv::load8(key + 2 * slot_stride + 8 * v), s2);
      s3 = _mm256_fmadd_ps(query, kv::load8(key + 3 * slot_stride + 8 * v), s3);
    }
    scores[i] = horizontal_sum(s0) * scale;
    scores[i + 1] = horizontal_sum(s1) * scale;
    scores[i + 2] = horizontal_sum(s2) * scale;
    scores[i + 3] = horizontal_sum(s3) * scale;
  }
  for (; i < n; ++i) {
    __m256 sum = _mm256_setzero_ps();
#pragma GCC unroll 16
    for (int v = 0; v < DV; ++v)
      sum = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * v), kv::load8(keys + i * slot_stride + 8 * v), sum);
    scores[i] = horizontal_sum(sum) * scale;
  }
}

// acc += sum_i weights[i] * value_i, the accumulator held in registers across the block.
template <int DV, typename T>
void accumulate_values_avx2(const float* weights, const T* values, int64_t slot_stride, int64_t n, float* acc) {
  __m256 sum[DV];
#pragma GCC unroll 16
  for (int v = 0; v < DV; ++v) sum[v] = _mm256_loadu_ps(acc + 8 * v);
  for (int64_t i = 0; i < n; ++i) {
    const __m256 weight = _mm256_set1_ps(weights[i]);
#pragma GCC unroll 16
    for (int v = 0; v < DV; ++v)
      sum[v] = _mm256_fmadd_ps(weight, kv::load8(values + i * slot_stride + 8 * v), sum[v]);
  }
#pragma GCC unroll 16
  for (int v = 0; v < DV; ++v) _mm256_storeu_ps(acc + 8 * v, sum[v]);
}
#endif

// Up to kKeyChunk keys (key i at keys + i * slot_stride) for the Heads query heads at q (64
// floats each, consecutive): their scores, the online softmax update of each head's max, sum
// and 64-float accumulator, and the values' weighted sum, with each key and value row widened
// once for all the heads.
template <int Heads, typename T>
CHUNKSERVE_AVX512_TARGET void attend_keys_avx512(const float* q, const T* keys, const T* values, int64_t slot_stride,
                                                 int64_t n, float scale, float* max, float* sum, float* acc,
                                                 const char* prefetch_k, const char* prefetch_v,
                                                 int64_t prefetch_lines) {
  const int64_t lines_per_key = (prefetch_lines + n - 1) / n;
  __m512 query[Heads][4];
  for (int g = 0; g < Heads; ++g)
    for (int c = 0; c < 4; ++c) query[g][c] = _mm512_loadu_ps(q + g * 64 + 16 * c);
  alignas(64) float scores[Heads][kKeyChunk];
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t line = i * lines_per_key; line < std::min((i + 1) * lines_per_key, prefetch_lines); ++line)
      __builtin_prefetch(prefetch_k + line * 64, 0, 3);
    const T* key = keys + i * slot_stride;
    const __m512 k0 = kv::load16(key), k1 = kv::load16(key + 16), k2 = kv::load16(key + 32), k3 = kv::load16(key + 48);
    for (int g = 0; g < Heads; ++g) {
      __m512 dot = _mm512_mul_ps(query[g][0], k0);
      dot = _mm512_fmadd_ps(query[g][1], k1, dot);
      dot = _mm512_fmadd_ps(query[g][2], k2, dot);
      dot = _mm512_fmadd_ps(query[g][3], k3, dot);
      scores[g][i] = _mm512_reduce_add_ps(dot);
    }
  }
  const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
  __m512 weights[Heads];
  float rescale[Heads];
  for (int g = 0; g < Heads; ++g) {
    const __m512 scaled = _mm512_mul_ps(_mm512_maskz_loadu_ps(live, scores[g]), _mm512_set1_ps(scale));
    const float new_max = std::max(max[g], _mm512_mask_reduce_max_ps(live, scaled));
    rescale[g] = std::exp(max[g] - new_max);  // 0 for the first keys
    _mm512_store_ps(scores[g], _mm512_sub_ps(scaled, _mm512_set1_ps(new_max)));
#pragma omp simd
    for (int64_t i = 0; i < kKeyChunk; ++i) scores[g][i] = std::exp(scores[g][i]);
    weights[g] = _mm512_maskz_load_ps(live, scores[g]);
    sum[g] = sum[g] * rescale[g] + _mm512_reduce_add_ps(weights[g]);
    max[g] = new_max;
  }
  __m512 out[Heads][4];
  for (int g = 0; g < Heads; ++g)
    for (int c = 0; c < 4; ++c) out[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * 64 + 16 * c), _mm512_set1_ps(rescale[g]));
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t line = i * lines_per_key; line < std::min((i + 1) * lines_per_key, prefetch_lines); ++line)
      __builtin_prefetch(prefetch_v + line * 64, 0, 3);
    const T* value = values + i * slot_stride;
    const __m512 v0 = kv::load16(value), v1 = kv::load16(value + 16), v2 = kv::load16(value + 32),
                 v3 = kv::load16(value + 48);
    for (int g = 0; g < Heads; ++g) {
      const __m512 weight = _mm512_set1_ps(scores[g][i]);
      out[g][0] = _mm512_fmadd_ps(weight, v0, out[g][0]);
      out[g][1] = _mm512_fmadd_ps(weight, v1, out[g][1]);
      out[g][2] = _mm512_fmadd_ps(weight, v2, out[g][2]);
      out[g][3] = _mm512_fmadd_ps(weight, v3, out[g][3]);
    }
  }
  for (int g = 0; g < Heads; ++g)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + g * 64 + 16 * c, out[g][c]);
}

// A partition's keys with AVX-512, for 64-wide heads: block by block, each kv head's keys and
// values loaded once for its query heads, kHeadTile at a time. The next block's lines are
// prefetched a few per key as the block is computed (issued all at once they would stall the core
// on its miss buffers); during a partition's last block, the first block of the thread's next
// unit (`following_offset`, `following_lines`; 0 lines where there is none).
template <typename T>
void attend_partition_avx512(const float* q, const T* k_cache, const T* v_cache, const int64_t* table,
                             int64_t first_position, int64_t end_position, const Shape& s, Partial partial,
                             int64_t following_offset, int64_t following_lines) {
  const int64_t slot_stride = s.num_kv_heads * s.head_dim, H = s.num_heads;
  std::fill(partial.max, partial.max + H, -std::numeric_limits<float>::infinity());
  std::fill(partial.sum, partial.sum + H, 0.f);
  std::fill(partial.acc, partial.acc + H * 64, 0.f);
  constexpr int64_t kLine = 64;
  for (int64_t start = first_position; start < end_position; start += s.block_size) {
    const int64_t n = std::min(s.block_size, end_position - start);
    const int64_t first_slot = table[start / s.block_size] * s.block_size;
    const int64_t next = start + s.block_size;
    const int64_t next_lines = next < end_position
                                   ? std::min(s.block_size, end_position - next) * slot_stride * int64_t(sizeof(T)) / kLine
                                   : following_lines;
    const int64_t next_offset = next < end_position ? table[next / s.block_size] * s.block_size * slot_stride
                                                    : following_offset;
    const char* next_k = reinterpret_cast<const char*>(k_cache + next_offset);
    const char* next_v = reinterpret_cast<const char*>(v_cache + next_offset);
    const int64_t lines_per_kv_head = (next_lines + s.num_kv_heads - 1) / s.num_kv_heads;
    for (int64_t j = 0; j < s.num_kv_heads; ++j) {
      const int64_t first_line = std::min(j * lines_per_kv_head, next_lines);
      const int64_t lines = std::min((j + 1) * lines_per_kv_head, next_lines) - first_line;
      const int64_t head_offset = first_slot * slot_stride + j * 64;
      for (int64_t i = 0; i < n; i += kKeyChunk) {
        const int64_t keys = std::min(kKeyChunk, n - i);
        const T* k = k_cache + head_offset + i * slot_stride;
        const T* v = v_cache + head_offset + i * slot_stride;
        for (int64_t g = 0; g < s.group; g += kHeadTile) {
          const int64_t h = j * s.group + g;
          const float* query = q + h * 64;
          float *max = partial.max + h, *sum = partial.sum + h, *acc = partial.acc + h * 64;
          // this kv head's share of the lines to prefetch, with its first chunk and head tile
          const int64_t prefetch = i == 0 && g == 0 ? lines : 0;
          const char* pk = next_k + first_line * kLine;
          const char* pv = next_v + first_line * kLine;
          switch (std::min(kHeadTile, s.group - g)) {
            case 1: attend_keys_avx512<1>(query, k, v, slot_stride, keys, s.scale, max, sum, acc, pk, pv, prefetch); break;
            case 2: attend_keys_avx512<2>(query, k, v, slot_stride, keys, s.scale, max, sum, acc, pk, pv, prefetch); break;
            default: attend_keys_avx512<3>(query, k, v, slot_stride, keys, s.scale, max, sum, acc, pk, pv, prefetch); break;
          }
        }
      }
    }
  }
}

template <typename T>
void block_scores(const float* q, const T* keys, int64_t slot_stride, int64_t n, int64_t D, float scale,
                  float* scores) {
#ifdef CHUNKSERVE_AVX2
  if (D == 64) return block_scores_avx2<8>(q, keys, slot_stride, n, scale, scores);
  if (D == 128) return block_scores_avx2<16>(q, keys, slot_stride, n, scale, scores);
#endif
  for (int64_t i = 0; i < n; ++i) {
    const T* key = keys + i * slot_stride;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; ++d) dot += q[d] * kv::widen(key[d]);
    scores[i] = dot * scale;
  }
}

template <typename T>
void accumulate_values(const float* weights, const T* values, int64_t slot_stride, int64_t n, int64_t D,
                       float* acc) {
#ifdef CHUNKSERVE_AVX2
  if (D == 64) return accumulate_values_avx2<8>(weights, values, slot_stride, n, acc);
  if (D == 128) return accumulate_values_avx2<16>(weights, values, slot_stride, n, acc);
#endif
  for (int64_t i = 0; i < n; ++i) {
    const T* value = values + i * slot_stride;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] += weights[i] * kv::widen(value[d]);
  }
}

template <typename T>
void attend_partition(const float* q, const T* k_cache, const T* v_cache, const int64_t* table,
                      int64_t first_position, int64_t end_position, const Shape& s, Partial partial,
                      std::vector<float>& scores) {
  const int64_t slot_stride = s.num_kv_heads * s.head_dim, D = s.head_dim, H = s.num_heads;
  scores.resize(s.block_size);
  std::fill(partial.max, partial.max + H, -std::numeric_limits<float>::infinity());
  std::fill(partial.sum, partial.sum + H, 0.f);
  std::fill(partial.acc, partial.acc + H * D, 0.f);
  float* row = scores.data();
  constexpr int64_t kLine = 64;
  for (int64_t start = first_position; start < end_position; start += s.block_size) {
    const int64_t n = std::min(s.block_size, end_position - start);
    const int64_t first_slot = table[start / s.block_size] * s.block_size;
    const int64_t next = start + s.block_size;
    const int64_t next_lines =
        next < end_position ? std::min(s.block_size, end_position - next) * slot_stride * int64_t(sizeof(T)) / kLine : 0;
    const int64_t next_offset = next_lines ? table[next / s.block_size] * s.block_size * slot_stride : 0;
    const char* next_k = reinterpret_cast<const char*>(k_cache + next_offset);
    const char* next_v = reinterpret_cast<const char*>(v_cache + next_offset);
    const int64_t lines_per_head = (next_lines + H - 1) / H;
    for (int64_t h = 0; h < H; ++h) {  // the block's keys stay in L1 across the heads of a group
      for (int64_t line = h * lines_per_head; line < std::min((h + 1) * lines_per_head, next_lines); ++line) {
        __builtin_prefetch(next_k + line * kLine, 0, 3);
        __builtin_prefetch(next_v + line * kLine, 0, 3);
      }
      const int64_t head_offset = first_slot * slot_stride + (h / s.group) * D;
      block_scores(q + h * D, k_cache + head_offset, slot_stride, n, D, s.scale, row);
      const float block_max = *std::max_element(row, row + n);
      const float new_max = std::max(partial.max[h], block_max);
      const float rescale = std::exp(partial.max[h] - new_max);  // 0 for the first block
      float total = 0.f;
#pragma omp simd reduction(+ : total)
      for (int64_t i = 0; i < n; ++i) {
        row[i] = std::exp(row[i] - new_max);
        total += row[i];
      }
      partial.sum[h] = partial.sum[h] * rescale + total;
      partial.max[h] = new_max;
      float* acc = partial.acc + h * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) acc[d] *= rescale;
      accumulate_values(row, v_cache + head_offset, slot_stride, n, D, acc);
    }
  }
}

// out[h] = sum_p exp(max_p - M) acc_p / sum_p exp(max_p - M) sum_p, M the largest max_p.
void merge_partitions(const float* max, const float* sum, const float* acc, int64_t parts, const Shape& s,
                      float* out) {
  const int64_t H = s.num_heads, D = s.head_dim;
  for (int64_t h = 0; h < H; ++h) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < parts; ++p) top = std::max(top, max[p * H + h]);
    float total = 0.f;
    float* result = out + h * D;
    std::fill(result, result + D, 0.f);
    for (int64_t p = 0; p < parts; ++p) {
      const float weight = std::exp(max[p * H + h] - top);
      total += weight * sum[p * H + h];
      const float* part = acc + (p * H + h) * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) result[d] += weight * part[d];
    }
    const float inverse = 1.f / total;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) result[d] *= inverse;
  }
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     int64_t block_size, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_decode_attention: q float32, the caches of one dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt64,
              "paged_decode_attention: int64 block tables and context lengths");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() &&
              k_cache.size(2) == q.size(2) && block_tables.dim() == 2 && block_tables.size(0) == q.size(0) &&
              context_lens.numel() == q.size(0) && block_size > 0,
              "paged_decode_attention: q [B, heads, D], caches [slots, kv_heads, D], tables [B, blocks], lens [B]");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode_attention: contiguous caches");
  const int64_t num_blocks = k_cache.size(0) / block_size;
  const int64_t* table_data = block_tables.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(table_data, table_data + block_tables.numel(),
                          [&](int64_t b) { return b >= 0 && b < num_blocks; }),
              "paged_decode_attention: a block id outside the cache");
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "heads must be a multiple of kv heads");
  const Shape shape{num_heads, num_kv_heads, head_dim, num_heads / num_kv_heads, block_size,
                    static_cast<float>(scale)};
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();

  // Units of work: (request, partition of kPartitionBlocks blocks), numbered request by request.
  const int64_t partition_len = kPartitionBlocks * block_size;
  std::vector<int64_t> first_unit(batch + 1, 0);
  std::vector<int64_t> unit_request;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * block_size, "context length out of the block table");
    const int64_t parts = (lens[b] + partition_len - 1) / partition_len;
    first_unit[b + 1] = first_unit[b] + parts;
    unit_request.insert(unit_request.end(), parts, b);
  }
  const int64_t units = first_unit[batch];
  std::vector<float> max(units * num_heads), sum(units * num_heads), acc(units * num_heads * head_dim);
  const float* q_data = q.data_ptr<float>();
  CHUNKSERVE_DISPATCH_KV(k_cache.scalar_type(), "paged_decode_attention", [&] {
    const scalar_t* k_data = k_cache.data_ptr<scalar_t>();
    const scalar_t* v_data = v_cache.data_ptr<scalar_t>();
    const bool avx512 = active_cpu_isa() == CpuIsa::kAvx512 && head_dim == 64;
    at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t b = unit_request[unit];
        const int64_t first_position = (unit - first_unit[b]) * partition_len;
        const Partial partial{max.data() + unit * num_heads, sum.data() + unit * num_heads,
                              acc.data() + unit * num_heads * head_dim};
        const int64_t end_position = std::min(lens[b], first_position + partition_len);
        if (avx512) {
          int64_t following_offset = 0, following_lines = 0;  // the first block of the next unit
          if (unit + 1 < end) {
            const int64_t b2 = unit_request[unit + 1], first2 = (unit + 1 - first_unit[b2]) * partition_len;
            following_offset = tables[b2 * max_blocks + first2 / block_size] * block_size * num_kv_heads * head_dim;
            following_lines = std::min(block_size, lens[b2] - first2) * num_kv_heads * head_dim *
                              int64_t(sizeof(scalar_t)) / 64;
          }
          attend_partition_avx512(q_data + b * num_heads * head_dim, k_data, v_data, tables + b * max_blocks,
                                  first_position, end_position, shape, partial, following_offset, following_lines);
        } else {
          attend_partition(q_data + b * num_heads * head_dim, k_data, v_data, tables + b * max_blocks, first_position,
                           end_position, shape, partial, scores);
        }
      }
    });
  });
  auto out = torch::empty_like(q);
  float* out_data = out.data_ptr<float>();
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t unit = first_unit[b];
      merge_partitions(max.data() + unit * num_heads, sum.data() + unit * num_heads,
                       acc.data() + unit * num_heads * head_dim, first_unit[b + 1] - unit, shape,
                       out_data + b * num_heads * head_dim);
    }
  });
  return out;
}
