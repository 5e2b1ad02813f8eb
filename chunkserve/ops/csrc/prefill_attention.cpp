// Chunked-prefill attention that reads the paged KV cache in place (flash-attention tiling).
//
// A chunk's n queries sit at positions start .. start + n - 1; query i attends keys
// 0 .. start + i, all already in the cache (this step's keys are written before attention),
// found through the request's block table. No gather of the history into a contiguous tensor:
// each unit of work copies one tile of kKeyTile keys of one kv head, transposed, into a buffer
// that stays in L1, and runs every query row of the unit against it.
//
// Rows are (position, query head) pairs of one kv head's group, position-major, so a kv head's
// grouped query heads share every key tile (GQA). A unit is one kv head and kPositionTile
// positions; its running max, sum and weighted value sum per row (online softmax) live in a
// buffer of the unit's rows. Key tiles past a row's position are masked; tiles past every row
// of a micro-tile are skipped, so the causal half of the chunk's own keys costs nothing.
//
// The arithmetic is two small matrix products per (micro-tile, key tile): scores = Q K^T with
// the transposed keys broadcast against query scalars, and acc += P V with value rows
// broadcast against probabilities, both held in registers: 512-bit registers where the CPU has
// AVX-512 (active_cpu_isa: six rows by a whole 64-key tile, or by 64 value columns, in 24
// accumulators), AVX2 + FMA otherwise, a portable loop elsewhere. Units go to threads largest
// first (the causal last positions cost the most).
//
// The cache is float32 or bfloat16 (kv_element.h): a tile's keys, and for bfloat16 its values,
// are widened to float32 as they are copied into the tile's buffers, so the products above run
// on float32 alone. Except in bfloat16 mode's default path (a bfloat16 cache, not deterministic,
// AVX512_BF16, D a multiple of 64): there the two products are AVX512_BF16 pair dot products,
// two per lane and instruction, on the cached bfloat16 keys and values as they are, the queries
// and the probabilities rounded to bfloat16 and every sum in float32 (the scores, the softmax,
// the weighted value sums): half the instructions of the float32 products, which are most of a
// long prompt's attention. The tile's keys are stored as pairs of dimensions per key (a 32-bit
// transpose), its values as pairs of keys per column.
//
// Deterministic mode (issue 42): a row's arithmetic is already a function of its absolute
// position alone (key tiles at absolute positions 0, 64, ...; one online-softmax order; keys
// past the row add exact zeros), except for a micro-tile short of six rows, which takes other
// code; in the mode it is padded to six, or to three where AVX-512 has a three-row kernel
// whose rows run the six-row kernel's instructions (a decode's GQA group). Decode rows then
// run here as 1-row chunks (deterministic_decode_attention), so that decode, prefill and
// verification rows share their bits. Threads split (kv head, positions) units, independent
// outputs, never one row's keys.
#include "ops.h"
#include "cpu_isa.h"
#include "kv_element.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kKeyTile = 64;      // keys per tile (several blocks when block_size < 64)
// Query positions per unit of work: every unit copies each key tile it reads once, so longer
// units copy less per product, down to one unit per thread and kv head for a short chunk.
constexpr int64_t kPositionTile = 128;
constexpr int64_t kMicroRows = 6;     // query rows whose scores are computed together
// Deterministic mode pads a micro-tile of at most this many rows (a decode's GQA group of three)
// to it, not to kMicroRows, where AVX-512 computes it: half the work for a decode.
constexpr int64_t kHalfRows = 3;
constexpr float kNegInf = -1e30f;  // finite: the build uses -ffast-math

template <typename T>
struct Problem {
  const float* q;  // [n, H, D]
  const T* k_cache;
  const T* v_cache;  // [slots, KVH, D]
  const int64_t* table;
  int64_t start, H, KVH, D, G, block_size;
  float scale;
  int64_t slot(int64_t position) const { return table[position / block_size] * block_size + position % block_size; }
  // The query vector of row r (of kv head j's group): position r / G, head j * G + r % G.
  const float* query(int64_t j, int64_t first_position, int64_t r) const {
    return q + ((first_position + r / G) * H + j * G + r % G) * D;
  }
};

// tile_scores for Rows rows with AVX-512: the tile's 64 keys in four registers per dimension,
// each row's query scalar broadcast against them. A row's products and sums are the same
// instructions in the same order whatever Rows (kMicroRows, or kHalfRows in deterministic mode).
template <int Rows>
CHUNKSERVE_AVX512_TARGET void tile_scores_avx512(const float* const* queries, const float* keys_t, int64_t D,
                                                 float* scores) {
  static_assert(kKeyTile == 64, "four 16-float registers per key tile");
  __m512 acc[Rows][4];
  for (int r = 0; r < Rows; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const float* keys = keys_t + d * kKeyTile;
    const __m512 k0 = _mm512_loadu_ps(keys), k1 = _mm512_loadu_ps(keys + 16);
    const __m512 k2 = _mm512_loadu_ps(keys + 32), k3 = _mm512_loadu_ps(keys + 48);
#pragma GCC unroll 6
    for (int r = 0; r < Rows; ++r) {
      const __m512 query = _mm512_set1_ps(queries[r][d]);
      acc[r][0] = _mm512_fmadd_ps(query, k0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(query, k1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(query, k2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(query, k3, acc[r][3]);
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(scores + r * kKeyTile + 16 * v, acc[r][v]);
}

// tile_values for Rows rows and D a multiple of 64, with AVX-512: 64 columns of each row's sum
// in four registers, each value row loaded once for all the rows (a row's arithmetic the same
// whatever Rows, as tile_scores_avx512's).
template <int Rows>
CHUNKSERVE_AVX512_TARGET void tile_values_avx512(const float* probs, const float* const* values, int64_t keys,
                                                 int64_t D, float* const* acc) {
  for (int64_t c = 0; c < D; c += 64) {
    __m512 sum[Rows][4];
    for (int r = 0; r < Rows; ++r)
      for (int v = 0; v < 4; ++v) sum[r][v] = _mm512_loadu_ps(acc[r] + c + 16 * v);
    for (int64_t k = 0; k < keys; ++k) {
      const float* value = values[k] + c;
      const __m512 v0 = _mm512_loadu_ps(value), v1 = _mm512_loadu_ps(value + 16);
      const __m512 v2 = _mm512_loadu_ps(value + 32), v3 = _mm512_loadu_ps(value + 48);
#pragma GCC unroll 6
      for (int r = 0; r < Rows; ++r) {
        const __m512 p = _mm512_set1_ps(probs[r * kKeyTile + k]);
        sum[r][0] = _mm512_fmadd_ps(p, v0, sum[r][0]);
        sum[r][1] = _mm512_fmadd_ps(p, v1, sum[r][1]);
        sum[r][2] = _mm512_fmadd_ps(p, v2, sum[r][2]);
        sum[r][3] = _mm512_fmadd_ps(p, v3, sum[r][3]);
      }
    }
    for (int r = 0; r < Rows; ++r)
      for (int v = 0; v < 4; ++v) _mm512_storeu_ps(acc[r] + c + 16 * v, sum[r][v]);
  }
}

// scores[r][k] = sum_d q_r[d] * keys_t[d][k], for `rows` (<= kMicroRows) rows and kKeyTile keys;
// with `half_tiles` (deterministic mode), kHalfRows rows take the AVX-512 kernel too (where the
// default mode keeps them on the portable loop, bit for bit as before).
void tile_scores(const float* const* queries, int64_t rows, const float* keys_t, int64_t D, float* scores,
                 bool avx512, bool half_tiles) {
  if (avx512 && rows == kMicroRows) return tile_scores_avx512<kMicroRows>(queries, keys_t, D, scores);
  if (avx512 && half_tiles && rows == kHalfRows) return tile_scores_avx512<kHalfRows>(queries, keys_t, D, scores);
#ifdef CHUNKSERVE_AVX2
  if (rows == kMicroRows) {
    for (int64_t k = 0; k < kKeyTile; k += 16) {
      __m256 acc[kMicroRows][2];
      for (int r = 0; r < kMicroRows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; ++d) {
        const __m256 k0 = _mm256_loadu_ps(keys_t + d * kKeyTile + k);
        const __m256 k1 = _mm256_loadu_ps(keys_t + d * kKeyTile + k + 8);
#pragma GCC unroll 6
        for (int r = 0; r < kMicroRows; ++r) {
          const __m256 query = _mm256_broadcast_ss(queries[r] + d);
          acc[r][0] = _mm256_fmadd_ps(query, k0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(query, k1, acc[r][1]);
        }
      }
      for (int r = 0; r < kMicroRows; ++r) {
        _mm256_storeu_ps(scores + r * kKeyTile + k, acc[r][0]);
        _mm256_storeu_ps(scores + r * kKeyTile + k + 8, acc[r][1]);
      }
    }
    return;
  }
#endif
  for (int64_t r = 0; r < rows; ++r) {
    float* row = scores + r * kKeyTile;
    std::fill(row, row + kKeyTile, 0.f);
    for (int64_t d = 0; d < D; ++d) {
      const float query = queries[r][d];
#pragma omp simd
      for (int64_t k = 0; k < kKeyTile; ++k) row[k] += query * keys_t[d * kKeyTile + k];
    }
  }
}

// acc_r += sum_k probs[r][k] * value_k, for `rows` rows, `keys` values (rows of D floats);
// `half_tiles` as tile_scores'.
void tile_values(const float* probs, int64_t rows, const float* const* values, int64_t keys, int64_t D,
                 float* const* acc, bool avx512, bool half_tiles) {
  if (avx512 && D % 64 == 0 && rows == kMicroRows) return tile_values_avx512<kMicroRows>(probs, values, keys, D, acc);
  if (avx512 && D % 64 == 0 && half_tiles && rows == kHalfRows)
    return tile_values_avx512<kHalfRows>(probs, values, keys, D, acc);
  int64_t r = 0;
#ifdef CHUNKSERVE_AVX2
  if (D % 32 == 0) {
    for (; r + 3 <= rows; r += 3) {  // three rows x 32 columns: 12 accumulators in registers
      for (int64_t c = 0; c < D; c += 32) {
        __m256 sum[3][4];
        for (int i = 0; i < 3; ++i)
          for (int v = 0; v < 4; ++v) sum[i][v] = _mm256_loadu_ps(acc[r + i] + c + 8 * v);
        for (int64_t k = 0; k < keys; ++k) {
          const float* value = values[k] + c;
          const __m256 v0 = _mm256_loadu_ps(value), v1 = _mm256_loadu_ps(value + 8);
          const __m256 v2 = _mm256_loadu_ps(value + 16), v3 = _mm256_loadu_ps(value + 24);
#pragma GCC unroll 3
          for (int i = 0; i < 3; ++i) {
            const __m256 p = _mm256_broadcast_ss(probs + (r + i) * kKeyTile + k);
            sum[i][0] = _mm256_fmadd_ps(p, v0, sum[i][0]);
            sum[i][1] = _mm256_fmadd_ps(p, v1, sum[i][1]);
            sum[i][2] = _mm256_fmadd_ps(p, v2, sum[i][2]);
            sum[i][3] = _mm256_fmadd_ps(p, v3, sum[i][3]);
          }
        }
        for (int i = 0; i < 3; ++i)
          for (int v = 0; v < 4; ++v) _mm256_storeu_ps(acc[r + i] + c + 8 * v, sum[i][v]);
      }
    }
  }
#endif
  for (; r < rows; ++r) {
    for (int64_t k = 0; k < keys; ++k) {
      const float p = probs[r * kKeyTile + k];
      const float* value = values[k];
      float* out = acc[r];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) out[d] += p * value[d];
    }
  }
}

// ----- bfloat16 products (bfloat16 cache, default mode, AVX512_BF16) ---------------------------

// Pair p of a row: its bfloat16 elements 2p (low half) and 2p + 1 (high half), as one 32-bit lane.
using Bf16Pair = uint32_t;

// scores[r][k] = sum_p query_pairs[r][p] . key_pairs[p][k] (each a pair dot product, float32
// sums), for Rows rows and the tile's kKeyTile keys; the tile's 64 keys in four registers per pair.
template <int Rows>
CHUNKSERVE_AVX512_BF16_TARGET void tile_scores_bf16(const Bf16Pair* const* query_pairs, const Bf16Pair* key_pairs,
                                                    int64_t D, float* scores) {
  __m512 acc[Rows][4];
  for (int r = 0; r < Rows; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < D / 2; ++p) {
    const Bf16Pair* keys = key_pairs + p * kKeyTile;
    __m512bh k[4];
    for (int v = 0; v < 4; ++v) k[v] = (__m512bh)_mm512_loadu_si512(keys + 16 * v);
#pragma GCC unroll 6
    for (int r = 0; r < Rows; ++r) {
      const __m512bh query = (__m512bh)_mm512_set1_epi32(static_cast<int>(query_pairs[r][p]));
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], query, k[v]);
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(scores + r * kKeyTile + 16 * v, acc[r][v]);
}

// acc_r += sum_k probs[r][k] * value_k for Rows rows, `keys` keys and D a multiple of 64: the
// probabilities rounded to bfloat16 pairs of keys, each against its keys' value pair of a column
// (value_pairs[k / 2][c]), 64 columns at a time in four registers a row.
template <int Rows>
CHUNKSERVE_AVX512_BF16_TARGET void tile_values_bf16(const float* probs, const Bf16Pair* value_pairs, int64_t keys,
                                                    int64_t D, float* const* acc) {
  alignas(64) Bf16Pair prob_pairs[Rows][kKeyTile / 2];
  for (int r = 0; r < Rows; ++r) {
    const float* row = probs + r * kKeyTile;
    for (int64_t k = 0; k < kKeyTile; k += 32)  // probabilities k .. k + 31 in order: the low 16 from the second
      _mm512_store_si512(prob_pairs[r] + k / 2,
                         (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + k + 16), _mm512_loadu_ps(row + k)));
  }
  const int64_t pairs = (keys + 1) / 2;
  for (int64_t c = 0; c < D; c += 64) {
    __m512 sum[Rows][4];
    for (int r = 0; r < Rows; ++r)
      for (int v = 0; v < 4; ++v) sum[r][v] = _mm512_loadu_ps(acc[r] + c + 16 * v);
    for (int64_t p = 0; p < pairs; ++p) {
      const Bf16Pair* values = value_pairs + p * D + c;
      __m512bh value[4];
      for (int v = 0; v < 4; ++v) value[v] = (__m512bh)_mm512_loadu_si512(values + 16 * v);
#pragma GCC unroll 6
      for (int r = 0; r < Rows; ++r) {
        const __m512bh prob = (__m512bh)_mm512_set1_epi32(static_cast<int>(prob_pairs[r][p]));
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) sum[r][v] = _mm512_dpbf16_ps(sum[r][v], prob, value[v]);
      }
    }
    for (int r = 0; r < Rows; ++r)
      for (int v = 0; v < 4; ++v) _mm512_storeu_ps(acc[r] + c + 16 * v, sum[r][v]);
  }
}

// The 16 rows r[0 .. 15] of a 16 x 16 block transposed in place: afterwards r[c] lane i holds what
// r[i] lane c held. Interleaved pairs, then 4 x 4 blocks within 128-bit lanes, then the lanes.
CHUNKSERVE_AVX512_TARGET inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {  // pairs of rows interleaved: 2x2 blocks
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // 4x4 blocks within each 128-bit lane
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes: rows 4q+i of groups 0,1 and 2,3
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// keys_t[d * kKeyTile + k] = element d of key row k widened, for k < keys, and 0 past them, with
// AVX-512 and D a multiple of 16: each 16 keys x 16 dims block transposed in registers.
template <typename T>
CHUNKSERVE_AVX512_TARGET void transpose_keys_avx512(const T* const* rows, int64_t keys, int64_t D, float* keys_t) {
  for (int64_t k0 = 0; k0 < kKeyTile; k0 += 16) {
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      __m512 r[16];
      for (int64_t i = 0; i < 16; ++i) r[i] = k0 + i < keys ? kv::load16(rows[k0 + i] + d0) : _mm512_setzero_ps();
      transpose16(r);
      for (int64_t c = 0; c < 16; ++c) _mm512_storeu_ps(keys_t + (d0 + c) * kKeyTile + k0, r[c]);
    }
  }
}

CHUNKSERVE_AVX512_TARGET inline void widen_row_avx512(const c10::BFloat16* row, int64_t D, float* out) {
  for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(out + d, kv::load16(row + d));
}

// key_pairs[p * kKeyTile + k] = pair p of key row k, for k < keys, and 0 past them (D a multiple of
// 32): the rows as 32-bit lanes, each 16 keys x 16 pairs block transposed in registers.
CHUNKSERVE_AVX512_BF16_TARGET void pair_keys_bf16(const c10::BFloat16* const* rows, int64_t keys, int64_t D,
                                                  Bf16Pair* key_pairs) {
  for (int64_t k0 = 0; k0 < kKeyTile; k0 += 16) {
    for (int64_t p0 = 0; p0 < D / 2; p0 += 16) {
      __m512 r[16];
      for (int64_t i = 0; i < 16; ++i)
        r[i] = k0 + i < keys ? _mm512_castsi512_ps(_mm512_loadu_si512(rows[k0 + i] + 2 * p0)) : _mm512_setzero_ps();
      transpose16(r);
      for (int64_t c = 0; c < 16; ++c)
        _mm512_storeu_ps(reinterpret_cast<float*>(key_pairs + (p0 + c) * kKeyTile + k0), r[c]);
    }
  }
}

// value_pairs[p * D + c] = (element c of value row 2p, of value row 2p + 1), for 2p < keys (a
// missing row 2p + 1 is zeros; D a multiple of 32): two rows interleaved element by element.
CHUNKSERVE_AVX512_BF16_TARGET void pair_values_bf16(const c10::BFloat16* const* rows, int64_t keys, int64_t D,
                                                    Bf16Pair* value_pairs) {
  alignas(64) uint16_t low[32], high[32];  // element i of the first and of the second 16 output lanes
  for (int i = 0; i < 16; ++i) {
    low[2 * i] = i, low[2 * i + 1] = 32 + i;
    high[2 * i] = 16 + i, high[2 * i + 1] = 48 + i;
  }
  const __m512i first = _mm512_load_si512(low), second = _mm512_load_si512(high);
  for (int64_t p = 0; 2 * p < keys; ++p) {
    for (int64_t c = 0; c < D; c += 32) {
      const __m512i even = _mm512_loadu_si512(rows[2 * p] + c);
      const __m512i odd = 2 * p + 1 < keys ? _mm512_loadu_si512(rows[2 * p + 1] + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(value_pairs + p * D + c, _mm512_permutex2var_epi16(even, first, odd));
      _mm512_storeu_si512(value_pairs + p * D + c + 16, _mm512_permutex2var_epi16(even, second, odd));
    }
  }
}

// One cache line into L1, as an instruction the optimizer keeps: GCC 12 drops __builtin_prefetch
// and _mm_prefetch from a loop it vectorizes or unswitches, as load_tile's is.
inline void prefetch_line(const void* address) {
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(address)));
}

// Asks for the key and value rows of kv head j at `position`: a tile's rows lie in blocks
// anywhere in the pool, where the hardware prefetcher does not follow.
template <typename T>
void prefetch_row(const Problem<T>& p, int64_t j, int64_t position) {
  const int64_t offset = (p.slot(position) * p.KVH + j) * p.D, row_bytes = p.D * int64_t(sizeof(T));
  const char* key = reinterpret_cast<const char*>(p.k_cache + offset);
  const char* value = reinterpret_cast<const char*>(p.v_cache + offset);
  for (int64_t line = 0; line < row_bytes; line += 64) {
    prefetch_line(key + line);
    prefetch_line(value + line);
  }
}

// The key rows to prefetch while a tile is loaded: positions [first, end) of kv head j of `p`
// (the unit's next tile, or the first tile of the thread's next unit; none where end == first).
template <typename T>
struct Upcoming {
  const Problem<T>* p;
  int64_t j, first, end;
};

// Key tile `tile` (`keys` keys) of kv head j into the unit's buffers, the rows of `next`
// prefetched: its keys transposed and widened into keys_t (0 past `keys`: those
// scores are never used), and values[k] key k's value row as float32 (in place in a float32
// cache, else widened into `widened`). A copy: its route (transposed in registers or element by
// element) never changes a bit of the result.
template <typename T>
void load_tile(const Problem<T>& p, int64_t j, int64_t tile, int64_t keys, const Upcoming<T>& next, float* keys_t,
               float* widened, const float** values, bool avx512) {
  const int64_t D = p.D;
  const T* rows[kKeyTile];
  for (int64_t k = 0; k < keys; ++k) {
    if (k < next.end - next.first) prefetch_row(*next.p, next.j, next.first + k);  // it arrives while this is computed
    const int64_t offset = (p.slot(tile + k) * p.KVH + j) * D;
    rows[k] = p.k_cache + offset;
    if constexpr (std::is_same_v<T, float>) {
      values[k] = p.v_cache + offset;
    } else {
      float* value = widened + k * D;
      if (avx512 && D % 16 == 0) {
        widen_row_avx512(p.v_cache + offset, D, value);
      } else {
        for (int64_t d = 0; d < D; ++d) value[d] = kv::widen(p.v_cache[offset + d]);
      }
      values[k] = value;
    }
  }
  for (int64_t k = keys; k < next.end - next.first; ++k) prefetch_row(*next.p, next.j, next.first + k);
  if (avx512 && D % 16 == 0) return transpose_keys_avx512(rows, keys, D, keys_t);
  for (int64_t k = 0; k < kKeyTile; ++k)
    for (int64_t d = 0; d < D; ++d) keys_t[d * kKeyTile + k] = k < keys ? kv::widen(rows[k][d]) : 0.f;
}

// load_tile for bfloat16 products: the tile's keys into key_pairs and its values into
// value_pairs, as the cache holds them (no widening); the rows of `next` prefetched.
void load_tile_pairs(const Problem<c10::BFloat16>& p, int64_t j, int64_t tile, int64_t keys,
                     const Upcoming<c10::BFloat16>& next, Bf16Pair* key_pairs, Bf16Pair* value_pairs) {
  const c10::BFloat16* key_rows[kKeyTile];
  const c10::BFloat16* value_rows[kKeyTile];
  for (int64_t k = 0; k < keys; ++k) {
    if (k < next.end - next.first) prefetch_row(*next.p, next.j, next.first + k);
    const int64_t offset = (p.slot(tile + k) * p.KVH + j) * p.D;
    key_rows[k] = p.k_cache + offset;
    value_rows[k] = p.v_cache + offset;
  }
  for (int64_t k = keys; k < next.end - next.first; ++k) prefetch_row(*next.p, next.j, next.first + k);
  pair_keys_bf16(key_rows, keys, p.D, key_pairs);
  pair_values_bf16(value_rows, keys, p.D, value_pairs);
}

// A row x of D floats (D a multiple of 32) as its bfloat16 pairs, rounded to nearest even.
CHUNKSERVE_AVX512_BF16_TARGET void round_to_pairs(const float* x, int64_t D, Bf16Pair* pairs) {
  for (int64_t d = 0; d < D; d += 32)
    _mm512_storeu_si512(pairs + d / 2,
                        (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + d + 16), _mm512_loadu_ps(x + d)));
}

// One unit of work, kv head j and positions [first, last) of a chunk: its buffers, and each row's
// running max, sum and weighted value sum (online softmax), fed one key tile at a time. Where
// `deterministic`, a micro-tile short of kMicroRows (kHalfRows) rows is padded with rows whose results are
// dropped, so that every row takes the full micro-tile's code whatever its place: its bits then
// depend only on its absolute position (the key tiles start at absolute positions already). With
// `bf16_products` (a bfloat16 cache only) the two products are bfloat16 pair dot products, every
// micro-tile padded to kMicroRows rows.
template <typename T>
class Unit {
 public:
  Unit(const Problem<T>& p, int64_t j, int64_t first, int64_t last, bool avx512, bool deterministic,
       bool bf16_products)
      : p_(p), j_(j), first_(first), rows_((last - first) * p.G), end_key_(p.start + last), avx512_(avx512),
        deterministic_(deterministic), bf16_products_(bf16_products),
        keys_t_(new float[bf16_products ? 0 : p.D * kKeyTile]),
        // float32 values are read in place
        widened_values_(new float[std::is_same_v<T, float> || bf16_products ? 0 : kKeyTile * p.D]),
        key_pairs_(new Bf16Pair[bf16_products ? p.D / 2 * kKeyTile : 0]),
        value_pairs_(new Bf16Pair[bf16_products ? kKeyTile / 2 * p.D : 0]),
        padding_acc_(deterministic || bf16_products ? p.D : 0),
        row_max_(rows_, kNegInf), row_sum_(rows_, 0.f), acc_(rows_ * p.D, 0.f), values_(kKeyTile) {
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (bf16_products_) {
        query_pairs_.resize(rows_ * p.D / 2);
        for (int64_t r = 0; r < rows_; ++r)
          round_to_pairs(p.query(j, first, r), p.D, query_pairs_.data() + r * p.D / 2);
      }
    }
  }

  int64_t end_key() const { return end_key_; }  // keys 0 .. end_key - 1 are seen by some row

  // The keys tile .. tile + kKeyTile - 1 (a multiple of kKeyTile) that are before end_key; during
  // the last tile, the rows of `following` are prefetched.
  void attend_tile(int64_t tile, const Upcoming<T>& following) {
    const int64_t keys = std::min(kKeyTile, end_key_ - tile);
    const int64_t next = tile + kKeyTile;
    const Upcoming<T> upcoming =
        next < end_key_ ? Upcoming<T>{&p_, j_, next, std::min(next + kKeyTile, end_key_)} : following;
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (bf16_products_) load_tile_pairs(p_, j_, tile, keys, upcoming, key_pairs_.get(), value_pairs_.get());
    }
    if (!bf16_products_)
      load_tile(p_, j_, tile, keys, upcoming, keys_t_.get(), widened_values_.get(), values_.data(), avx512_);
    for (int64_t r0 = 0; r0 < rows_; r0 += kMicroRows) attend_micro_tile(r0, tile, keys);
  }

  // Each row's output, acc / sum, into its place in `out` ([positions, heads, D] from `first`).
  void finish(float* out) const {
    for (int64_t i = 0; i < rows_; ++i) {
      const float inverse = 1.f / row_sum_[i];
      float* result = out + ((first_ + i / p_.G) * p_.H + j_ * p_.G + i % p_.G) * p_.D;
#pragma omp simd
      for (int64_t d = 0; d < p_.D; ++d) result[d] = acc_[i * p_.D + d] * inverse;
    }
  }

 private:
  void attend_micro_tile(int64_t r0, int64_t tile, int64_t keys) {
    const int64_t micro = std::min(kMicroRows, rows_ - r0);
    if (tile > p_.start + first_ + (r0 + micro - 1) / p_.G) return;  // every key is after every row's query
    const bool half = deterministic_ && avx512_ && micro <= kHalfRows;
    const int64_t computed =  // with the padding rows
        bf16_products_ || (deterministic_ && !half) ? kMicroRows : deterministic_ ? kHalfRows : micro;
    float* row_acc[kMicroRows];
    for (int64_t r = 0; r < computed; ++r) row_acc[r] = r < micro ? acc_.data() + (r0 + r) * p_.D : padding_acc_.data();
    if (bf16_products_) {
      const Bf16Pair* query_pairs[kMicroRows];
      for (int64_t r = 0; r < kMicroRows; ++r)
        query_pairs[r] = query_pairs_.data() + (r0 + (r < micro ? r : 0)) * p_.D / 2;
      tile_scores_bf16<kMicroRows>(query_pairs, key_pairs_.get(), p_.D, scores_);
    } else {
      const float* queries[kMicroRows];
      for (int64_t r = 0; r < computed; ++r) queries[r] = p_.query(j_, first_, r0 + (r < micro ? r : 0));
      tile_scores(queries, computed, keys_t_.get(), p_.D, scores_, avx512_, deterministic_);
    }
    std::fill(scores_ + micro * kKeyTile, scores_ + computed * kKeyTile, 0.f);  // padding rows add nothing
    for (int64_t r = 0; r < micro; ++r) {
      const int64_t seen =  // the tile's keys at or before the row's position
          std::clamp<int64_t>(p_.start + first_ + (r0 + r) / p_.G - tile + 1, 0, keys);
      softmax_step(r0 + r, scores_ + r * kKeyTile, seen, row_acc[r]);
    }
    if (bf16_products_) return tile_values_bf16<kMicroRows>(scores_, value_pairs_.get(), keys, p_.D, row_acc);
    tile_values(scores_, computed, values_.data(), keys, p_.D, row_acc, avx512_, deterministic_);
  }

  // Row i's scores of a tile -> its weights (exp relative to the new running max), its sum and
  // value sum rescaled to that max.
  void softmax_step(int64_t i, float* row, int64_t seen, float* row_acc) {
    float tile_max = kNegInf;
    for (int64_t k = 0; k < seen; ++k) tile_max = std::max(tile_max, row[k] * p_.scale);
    const float new_max = std::max(row_max_[i], tile_max);
    const float rescale = std::exp(row_max_[i] - new_max);  // 0 on the first tile
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t k = 0; k < seen; ++k) {
      row[k] = std::exp(row[k] * p_.scale - new_max);
      total += row[k];
    }
    std::fill(row + seen, row + kKeyTile, 0.f);
    row_sum_[i] = row_sum_[i] * rescale + total;
    row_max_[i] = new_max;
    if (rescale != 1.f) {
#pragma omp simd
      for (int64_t d = 0; d < p_.D; ++d) row_acc[d] *= rescale;
    }
  }

  const Problem<T>& p_;
  const int64_t j_, first_, rows_, end_key_;
  const bool avx512_, deterministic_, bf16_products_;
  // aligned: the vectorized loops over a row's scores never peel by the stack's address
  alignas(64) float scores_[kMicroRows * kKeyTile];
  // written by load_tile before each read: not cleared (a unit of a decode is short; clearing showed)
  std::unique_ptr<float[]> keys_t_, widened_values_;
  std::unique_ptr<Bf16Pair[]> key_pairs_, value_pairs_;  // bf16_products' tile buffers
  std::vector<Bf16Pair> query_pairs_;  // bf16_products: the unit's query rows as bfloat16 pairs
  std::vector<float> padding_acc_, row_max_, row_sum_, acc_;
  std::vector<const float*> values_;
};

// One kv head j, positions [first, last) of the chunk: writes their rows of `out`; the rows of
// `following` are prefetched during its last tile.
template <typename T>
void attend_unit(const Problem<T>& p, int64_t j, int64_t first, int64_t last, float* out, bool avx512,
                 bool deterministic, bool bf16_products, const Upcoming<T>& following) {
  Unit<T> unit(p, j, first, last, avx512, deterministic, bf16_products);
  for (int64_t tile = 0; tile < unit.end_key(); tile += kKeyTile) unit.attend_tile(tile, following);
  unit.finish(out);
}

// The checks of both entry points: q float32 [rows, heads, D], the caches contiguous, of one dtype and
// [slots, kv_heads, D], heads a multiple of kv heads, and every block id of `tables` in the cache.
void check_inputs(const char* name, const torch::Tensor& q, const torch::Tensor& k_cache,
                  const torch::Tensor& v_cache, const torch::Tensor& tables, int64_t block_size) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == v_cache.scalar_type(), name,
              ": q float32, the caches of one dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), name, ": contiguous caches");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() &&
              k_cache.size(2) == q.size(2), name, ": q [n, heads, D], caches [slots, kv_heads, D]");
  TORCH_CHECK(k_cache.size(1) > 0 && q.size(1) % k_cache.size(1) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(tables.scalar_type() == torch::kInt64 && tables.is_contiguous() && block_size > 0, name,
              ": int64 block tables, a positive block size");
  const int64_t* blocks = tables.data_ptr<int64_t>();
  const int64_t num_blocks = k_cache.size(0) / block_size;
  TORCH_CHECK(std::all_of(blocks, blocks + tables.numel(), [&](int64_t b) { return b >= 0 && b < num_blocks; }),
              name, ": a block id outside the cache");
}

}  // namespace

torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                      torch::Tensor block_table, int64_t start, int64_t block_size, double scale,
                                      bool deterministic) {
  q = q.contiguous();
  block_table = block_table.contiguous();
  TORCH_CHECK(block_table.dim() == 1, "paged_prefill_attention: a 1-d int64 block table");
  check_inputs("paged_prefill_attention", q, k_cache, v_cache, block_table, block_size);
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
  TORCH_CHECK(start >= 0 && start + n <= block_table.size(0) * block_size, "chunk out of the block table");
  auto out = torch::empty_like(q);
  float* out_data = out.data_ptr<float>();
  // Units (kv head, position tile), the last position tiles (the most keys) first.
  const int64_t tiles = (n + kPositionTile - 1) / kPositionTile, units = tiles * KVH;
  CHUNKSERVE_DISPATCH_KV(k_cache.scalar_type(), "paged_prefill_attention", [&] {
    const Problem<scalar_t> problem{q.data_ptr<float>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                    block_table.data_ptr<int64_t>(), start, H, KVH, D, H / KVH, block_size,
                                    static_cast<float>(scale)};
    const bool avx512 = active_cpu_isa() == CpuIsa::kAvx512;
    const bool bf16_products =
        std::is_same_v<scalar_t, c10::BFloat16> && !deterministic && D % 64 == 0 && bf16_dot_supported();
    std::atomic<int64_t> next{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      for (int64_t unit = next++; unit < units; unit = next++) {
        const int64_t tile = tiles - 1 - unit / KVH, j = unit % KVH;
        attend_unit(problem, j, tile * kPositionTile, std::min(n, (tile + 1) * kPositionTile), out_data, avx512,
                    deterministic, bf16_products, Upcoming<scalar_t>{&problem, j, 0, 0});
      }
    });
  });
  return out;
}

torch::Tensor deterministic_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                             torch::Tensor block_tables, torch::Tensor context_lens,
                                             int64_t block_size, double scale) {
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  check_inputs("deterministic_decode_attention", q, k_cache, v_cache, block_tables, block_size);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && context_lens.numel() == q.size(0) &&
              context_lens.scalar_type() == torch::kInt64,
              "deterministic_decode_attention: tables [B, blocks], int64 lens [B]");
  const int64_t batch = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  std::vector<int64_t> order(batch);  // the longest contexts first
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * block_size, "context length out of the block table");
    order[b] = b;
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return lens[a] > lens[b]; });
  auto out = torch::empty_like(q);
  float* out_data = out.data_ptr<float>();
  const int64_t units = batch * KVH;  // (decode, kv head): independent rows
  CHUNKSERVE_DISPATCH_KV(k_cache.scalar_type(), "deterministic_decode_attention", [&] {
    const bool avx512 = active_cpu_isa() == CpuIsa::kAvx512;
    std::vector<Problem<scalar_t>> rows;  // each decode as a 1-row chunk at its position
    for (int64_t b = 0; b < batch; ++b)
      rows.push_back({q.data_ptr<float>() + b * H * D, k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                      block_tables.data_ptr<int64_t>() + b * max_blocks, lens[b] - 1, H, KVH, D, H / KVH, block_size,
                      static_cast<float>(scale)});
    std::atomic<int64_t> next{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      // a thread takes its next unit before computing this one, to prefetch that one's first tile
      for (int64_t unit = next++, following = next++; unit < units; unit = following, following = next++) {
        const int64_t b = order[unit / KVH], j = unit % KVH;
        const Upcoming<scalar_t> upcoming =
            following < units ? Upcoming<scalar_t>{&rows[order[following / KVH]], following % KVH, 0,
                                                   std::min(kKeyTile, lens[order[following / KVH]])}
                              : Upcoming<scalar_t>{&rows[b], j, 0, 0};
        attend_unit(rows[b], j, 0, 1, out_data + b * H * D, avx512, true, false, upcoming);
      }
    });
  });
    return out;
}
