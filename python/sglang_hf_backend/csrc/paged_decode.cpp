// Decode attention straight from SGLang's paged KV pool, and writes into it, for CPUs.
//
// One query token per request attends to that request's cached tokens, which sit at arbitrary
// slots of the pool ([slots, kv_heads, dim] per layer). torch's SDPA needs them gathered into a
// padded [batch, kv_heads, length, dim] copy first; this kernel reads each cached row where it
// lies, once for all query heads that share its KV head, with an online softmax in fp32.
// Work is split over requests (or (request, KV head) pairs when requests are fewer than threads);
// arithmetic uses ATen's vector types, built for the widest vector unit this CPU has. Scores of a
// block of keys are summed lane-wise together (sum_lanes) rather than one horizontal reduction per
// key, and value rows are accumulated in independent chains. bf16 on CPUs with AVX512-BF16 takes
// its own path (decode_bf16_pairs), multiplying the rows as bf16 pairs. fp32 rows are read where
// they lie (other types are converted a block at a time), a query vector is loaded once for a
// block of keys, and value sums run eight chains: fp32 at SmolLM2's batch-32 shape (9 heads over 3
// KV heads of 64) with 192 cached tokens, on an AVX2-only EPYC, 30 layers 29.3 -> 20.7 ms with the
// KV in memory, 18.4 -> 13.1 ms in cache. `scripts/bench_decode_kernel.py` times it on model shapes.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kKeysPerBlock = 32;
constexpr int64_t kHalfBlock = kKeysPerBlock / 2;  // even: value rows go in pairs

using Vec = at::vec::Vectorized<float>;

// Row of n elements to fp32, a vector at a time for float, bf16 and fp16 (double: one by one).
template <typename scalar_t>
inline void to_float(const scalar_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<scalar_t, float>) {
    i = n;
    std::copy(src, src + n, dst);
  } else if constexpr (at::is_reduced_floating_point_v<scalar_t>) {
    for (; i + Vec::size() <= n; i += Vec::size()) {
      Vec x;
      at::vec::load_to_float(src + i, x);
      x.store(dst + i);
    }
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// out[j] = the sum of partials[j]'s lanes, for Vec::size() partials at once: a transposing add
// tree costs ~3 instructions per row where one horizontal reduction per row costs ~9.
inline void sum_lanes(const Vec* partials, float* out) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    const __m512 a = partials[2 * i], b = partials[2 * i + 1];
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: that lane's sum of rows 4i..4i+3
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i) {  // lanes: [quad 2i: L0+L1, L2+L3, quad 2i+1: L0+L1, L2+L3]
    const __m512 a = quads[2 * i], b = quads[2 * i + 1];
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  const __m512 a = halves[0], b = halves[1];
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1))));
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 pairs[4], quads[2];
  for (int i = 0; i < 4; ++i) {
    const __m256 a = partials[2 * i], b = partials[2 * i + 1];
    pairs[i] = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 2; ++i) {
    const __m256d a = _mm256_castps_pd(pairs[2 * i]), b = _mm256_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  const __m256 a = quads[0], b = quads[1];
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31)));
#else
  for (int64_t j = 0; j < Vec::size(); ++j) {
    Vec row = partials[j];
    out[j] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, row);
  }
#endif
}

// A cached row as fp32: the row itself where the pool is fp32, else converted into `scratch`.
template <typename scalar_t>
inline const float* as_float(const scalar_t* row, float* scratch, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return row;
  } else {
    to_float(row, scratch, n);
    return scratch;
  }
}

// scores[g * stride + j] = queries[g] . keys[j] for `group` query rows and `count` key rows (all
// fp32, `dim` a multiple of Vec::size()): per key a fused multiply-add chain left unreduced, then
// Vec::size() keys' chains summed together.
inline void dots(const float* queries, const float* const* keys, int64_t group, int64_t count, int64_t dim,
                 float* scores, int64_t stride) {
  const int64_t width = Vec::size();
  Vec partials[Vec::size()];
  float sums[Vec::size()];
  for (int64_t g = 0; g < group; ++g) {
    const float* q = queries + g * dim;
    for (int64_t first = 0; first < count; first += width) {
      const int64_t rows = std::min(width, count - first);
      for (int64_t j = 0; j < width; ++j) partials[j] = Vec(0.f);
      for (int64_t i = 0; i < dim; i += width) {
        const Vec qv = Vec::loadu(q + i);
        for (int64_t j = 0; j < rows; ++j) partials[j] = at::vec::fmadd(qv, Vec::loadu(keys[first + j] + i), partials[j]);
      }
      sum_lanes(partials, sums);
      std::copy(sums, sums + rows, scores + g * stride + first);
    }
  }
}

// The same for any `dim`: one horizontal reduction per score.
inline void dots_any_dim(const float* queries, const float* const* keys, int64_t group, int64_t count, int64_t dim,
                         float* scores, int64_t stride) {
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t j = 0; j < count; ++j) {
      scores[g * stride + j] = at::vec::map2_reduce_all<float>(
          [](Vec x, Vec y) { return x * y; }, [](Vec x, Vec y) { return x + y; }, queries + g * dim,
          keys[j], dim);
    }
  }
}

// exp(x[i] - shift) in place, and their sum.
inline float exp_shifted(float* x, int64_t n, float shift) {
  const int64_t width = Vec::size();
  Vec sum(0.f);
  for (int64_t i = 0; i < n; i += width) {
    const int64_t count = std::min(width, n - i);
    const Vec e = (Vec::loadu(x + i, count) - Vec(shift)).exp_u20();
    e.store(x + i, count);
    sum = sum + Vec::set(Vec(0.f), e, count);
  }
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sum);
}

// The largest of s[0, n), n > 0.
inline float max_of(const float* s, int64_t n) {
  const Vec lowest(-std::numeric_limits<float>::infinity());
  Vec m = lowest;
  for (int64_t i = 0; i < n; i += Vec::size()) {
    const int64_t count = std::min<int64_t>(Vec::size(), n - i);
    m = at::vec::maximum(m, Vec::set(lowest, Vec::loadu(s + i, count), count));
  }
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, m);
}

// Each head's running score maximum and normaliser over the blocks seen so far (online softmax).
struct OnlineSoftmax {
  std::vector<float> row_max, row_sum;

  explicit OnlineSoftmax(int64_t heads) : row_max(heads), row_sum(heads) {}

  void reset() {
    std::fill(row_max.begin(), row_max.end(), -std::numeric_limits<float>::infinity());
    std::fill(row_sum.begin(), row_sum.end(), 0.f);
  }

  // Head h's block scores s[0, keys) become exp(s - running max) in place; returns the factor by
  // which the head's earlier value sums must be scaled (0 on the first block).
  float absorb(int64_t h, float* s, int64_t keys) {
    const float new_max = std::max(row_max[h], max_of(s, keys));
    const float rescale = std::exp(row_max[h] - new_max);
    row_sum[h] = row_sum[h] * rescale + exp_shifted(s, keys, new_max);
    row_max[h] = new_max;
    return rescale;
  }

  float inverse(int64_t h) const { return row_sum[h] > 0.f ? 1.f / row_sum[h] : 0.f; }
};

// The first cached key a request's query sees: all of them, or the last `window` + 1.
inline int64_t first_key(int64_t length, int64_t window) {
  return window >= 0 ? std::max<int64_t>(0, length - 1 - window) : 0;
}

// With enough requests to go round, a work item is one request and reads each cached row whole
// (all its KV heads); with fewer, items are (request, KV head) pairs. Returns items per request.
inline int64_t items_per_request(int64_t batch, int64_t kv_heads) {
  return batch >= at::get_num_threads() ? 1 : kv_heads;
}

// acc[0, C vectors) += sum_j weights[j] * values[j][0, C vectors): C independent fused
// multiply-add chains, so that the adds do not wait on each other's latency.
template <int C>
inline void weighted_sum_vectors(float* acc, const float* const* values, const float* weights, int64_t rows,
                                 int64_t offset) {
  constexpr int64_t width = Vec::size();
  Vec sum[C];
  for (int c = 0; c < C; ++c) sum[c] = Vec::loadu(acc + offset + c * width);
  for (int64_t j = 0; j < rows; ++j) {
    const Vec w(weights[j]);
    const float* row = values[j] + offset;
    for (int c = 0; c < C; ++c) sum[c] = at::vec::fmadd(w, Vec::loadu(row + c * width), sum[c]);
  }
  for (int c = 0; c < C; ++c) sum[c].store(acc + offset + c * width);
}

// acc += sum_j weights[j] * values[j] (rows of n floats), eight registers' worth of acc at a time
// where the row is long enough (at SmolLM2's fp32 batch-32 shape ~5% faster than four), then four,
// then one.
inline void weighted_sum(float* acc, const float* const* values, const float* weights, int64_t rows, int64_t n) {
  constexpr int64_t width = Vec::size();
  int64_t i = 0;
  for (; i + 8 * width <= n; i += 8 * width) weighted_sum_vectors<8>(acc, values, weights, rows, i);
  for (; i + 4 * width <= n; i += 4 * width) weighted_sum_vectors<4>(acc, values, weights, rows, i);
  for (; i + width <= n; i += width) weighted_sum_vectors<1>(acc, values, weights, rows, i);
  for (; i < n; ++i) {
    for (int64_t j = 0; j < rows; ++j) acc[i] += weights[j] * values[j][i];
  }
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// bf16 K/V on CPUs that multiply bf16 pairs (AVX512-BF16, e.g. every AMX Xeon): dpbf16 sums
// bf16 x bf16 products in fp32 straight from the pool's rows, with no fp32 copy of them. Scores
// are scaled after the product; probabilities enter the value sum rounded to bf16 (as in torch's
// CPU flash attention), their normaliser stays fp32. N = head_dim / 32: one register, 32 bf16.
// Work goes in units of a block of keys for one KV head. A unit's value rows are unpacked into
// pairs once for all query heads of the KV head, and the next unit's K and V rows are prefetched
// while it computes: the pool is read from memory each step (the weights stream through the cache
// in between), and without the prefetch the kernel waited on it for about half its time. 32
// requests x 144 cached tokens, KV evicted before each step, Xeon with AMX (2 cores): SmolLM2's
// shape (9 heads over 3 KV heads of 64, 30 layers) 12.3-12.8 -> 7.9-9.0 ms, the 0.5B Llama's (12
// over 4 of 128, 16 layers) 14.1 -> 9.9-11.2 ms, i.e. 9 -> 13 GB/s of KV. The prefetch goes out
// in shares spread over the unit's compute (before each half of its keys, for each query head's
// scores and for the value sums): issued at once, its few hundred lines filled the core's miss
// buffers and stalled the unit's own loads behind them. scripts/bench_decode_kernel.py, same
// setup, two runs each way: SmolLM2 7.66-7.71 -> 7.09-7.23 ms, the Llama 10.03-10.05 -> 9.43-9.87
// ms (13.30-13.60 -> 12.88-12.95 ms at 192 cached tokens); in the Llama's served batch-32 step
// (scripts/profile_step.py --compile) attention 10.3-10.5 -> 9.2-9.3 ms.
using Bf16Row = const uint16_t*;

// s[j] = q . key j (rows[j] + offset) for one query head over a block's keys, 16 at a time.
template <int N>
inline void pair_scores(const __m512bh* q, const Bf16Row* rows, int64_t offset, int64_t keys, float* s) {
  constexpr int64_t lanes = Vec::size();  // 16: the build is AVX512's
  for (int64_t first = 0; first < keys; first += lanes) {
    Vec partials[lanes];
    const int64_t count = std::min(lanes, keys - first);
    for (int64_t j = 0; j < lanes; ++j) {
      __m512 chain = _mm512_setzero_ps();
      if (j < count) {
        const Bf16Row key = rows[first + j] + offset;
        for (int c = 0; c < N; ++c) chain = _mm512_dpbf16_ps(chain, q[c], (__m512bh)_mm512_loadu_si512(key + 32 * c));
      }
      partials[j] = chain;
    }
    sum_lanes(partials, s + first);
  }
}

// acc_g[C chunks] += sum_j p_g[j] * value row j for G heads g sharing the rows: two rows at a time,
// their elements interleaved into bf16 pairs (once for all G heads) meet (p_g[j], p_g[j+1]). A
// chunk is 32 dims, two registers of acc in the interleaved order store_unpacked undoes; p_g is
// head g's probabilities rounded to bf16, two per 32-bit word, `p_stride` words after p_{g-1}.
template <int C, int G>
inline void add_value_chunks(float* acc, int64_t acc_stride, const Bf16Row* rows, int64_t offset, int64_t keys,
                             const uint32_t* p, int64_t p_stride) {
  __m512 sum[G][2 * C];
  for (int g = 0; g < G; ++g) {
    for (int r = 0; r < 2 * C; ++r) sum[g][r] = _mm512_loadu_ps(acc + g * acc_stride + 16 * r);
  }
  const auto add_pair = [&](const Bf16Row row0, const Bf16Row row1, int64_t word) {
    __m512bh w[G];
    for (int g = 0; g < G; ++g) w[g] = (__m512bh)_mm512_set1_epi32(p[g * p_stride + word]);
    for (int c = 0; c < C; ++c) {
      const __m512i x0 = _mm512_loadu_si512(row0 + 32 * c);
      const __m512i x1 = row1 ? _mm512_loadu_si512(row1 + 32 * c) : _mm512_setzero_si512();
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x0, x1), hi = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
      for (int g = 0; g < G; ++g) {
        sum[g][2 * c] = _mm512_dpbf16_ps(sum[g][2 * c], lo, w[g]);
        sum[g][2 * c + 1] = _mm512_dpbf16_ps(sum[g][2 * c + 1], hi, w[g]);
      }
    }
  };
  int64_t j = 0;
  for (; j + 1 < keys; j += 2) add_pair(rows[j] + offset, rows[j + 1] + offset, j / 2);
  if (j < keys) add_pair(rows[j] + offset, nullptr, j / 2);
  for (int g = 0; g < G; ++g) {
    for (int r = 0; r < 2 * C; ++r) _mm512_storeu_ps(acc + g * acc_stride + 16 * r, sum[g][r]);
  }
}

// The same over all N chunks of a row, as many at once as 24 accumulator registers hold.
template <int N, int G>
inline void add_value_pairs(float* acc, int64_t acc_stride, const Bf16Row* rows, int64_t offset, int64_t keys,
                            const uint32_t* p, int64_t p_stride) {
  constexpr int C = 2 * G * N <= 24 ? N : (2 * G * 4 <= 24 ? 4 : (2 * G * 2 <= 24 ? 2 : 1));
  for (int c0 = 0; c0 < N; c0 += C) {
    add_value_chunks<C, G>(acc + 32 * c0, acc_stride, rows, offset + 32 * c0, keys, p, p_stride);
  }
}

// A KV head's `group` query heads, up to three at a time (four as two and two).
template <int N>
inline void add_values_of_group(float* acc, const Bf16Row* rows, int64_t offset, int64_t keys, const uint32_t* p,
                                int64_t p_stride, int64_t group) {
  constexpr int64_t dim = 32 * N;
  for (int64_t g = 0; g < group;) {
    const int64_t left = group - g, take = left == 4 ? 2 : std::min<int64_t>(3, left);
    float* a = acc + g * dim;
    const uint32_t* pg = p + g * p_stride;
    if (take == 3) add_value_pairs<N, 3>(a, dim, rows, offset, keys, pg, p_stride);
    else if (take == 2) add_value_pairs<N, 2>(a, dim, rows, offset, keys, pg, p_stride);
    else add_value_pairs<N, 1>(a, dim, rows, offset, keys, pg, p_stride);
    g += take;
  }
}

// s[0, n) *= scale, then soft-capped (HF's order) where cap > 0.
inline void scale_scores(float* s, int64_t n, float scale, float cap) {
  if (cap > 0.f) {
    for (int64_t j = 0; j < n; ++j) s[j] = cap * std::tanh(s[j] * scale / cap);
    return;
  }
  for (int64_t j = 0; j < n; j += Vec::size()) {
    const int64_t count = std::min<int64_t>(Vec::size(), n - j);
    (Vec::loadu(s + j, count) * Vec(scale)).store(s + j, count);
  }
}

// p[w] = s[2w], s[2w+1] rounded to bf16, for the block's keys (zero past `keys`).
inline void to_bf16_pairs(float* s, int64_t keys, uint32_t* p) {
  std::fill(s + keys, s + kKeysPerBlock, 0.f);
  for (int64_t j = 0; j < keys; j += 32) {
    const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + j + 16), _mm512_loadu_ps(s + j));
    _mm512_storeu_si512(p + j / 2, (__m512i)pair);
  }
}

// dst = acc * inverse in dim order: register 2c lane i holds dim 32c + 8(i/4) + i%4, register
// 2c+1 lane i that dim + 4 (unpacklo/hi work within 128-bit lanes).
template <int N>
inline void store_unpacked(const float* acc, float inverse, at::BFloat16* dst) {
  for (int64_t r = 0; r < 2 * N; ++r) {
    for (int64_t i = 0; i < 16; ++i) {
      dst[32 * (r / 2) + 8 * (i / 4) + 4 * (r % 2) + i % 4] = static_cast<at::BFloat16>(acc[16 * r + i] * inverse);
    }
  }
}

// Start loading `bytes` from `offset` of the rows at slots[0, count) of a pool buffer, for the next
// unit of work, so that they arrive while this one computes (as inline assembly, which the
// compiler does not drop).
inline void prefetch_rows(const uint16_t* buffer, const int64_t* slots, int64_t count, int64_t row_stride,
                          int64_t offset, int64_t bytes) {
  for (int64_t j = 0; j < count; ++j) {
    const char* row = reinterpret_cast<const char*>(buffer + slots[j] * row_stride + offset);
    for (int64_t byte = 0; byte < bytes; byte += 64) asm volatile("prefetcht0 %0" ::"m"(*(row + byte)));
  }
}

// The unit of work after the current one: its keys' slots, how many (0: none), its KV head.
struct NextUnit {
  const int64_t* slots = nullptr;
  int64_t keys = 0, kv_head = 0;
};

template <int N>
void decode_bf16_pairs(const at::Tensor& query, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                       const at::Tensor& kv_index, const at::Tensor& kv_len, at::Tensor& out, double scale,
                       double softcap, int64_t window) {
  constexpr int64_t dim = 32 * N, p_stride = kKeysPerBlock / 2;
  const int64_t batch = query.size(0), heads = query.size(1), kv_heads = k_buffer.size(1);
  const int64_t group = heads / kv_heads;
  const auto* q = reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>());
  const auto* k = reinterpret_cast<const uint16_t*>(k_buffer.data_ptr<at::BFloat16>());
  const auto* v = reinterpret_cast<const uint16_t*>(v_buffer.data_ptr<at::BFloat16>());
  const int64_t* index = kv_index.data_ptr<int64_t>();
  const int64_t* lens = kv_len.data_ptr<int64_t>();
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  const int64_t q_sb = query.stride(0), q_sh = query.stride(1);
  const int64_t k_sn = k_buffer.stride(0), k_sh = k_buffer.stride(1);
  const int64_t v_sn = v_buffer.stride(0), v_sh = v_buffer.stride(1);
  const int64_t index_sb = kv_index.stride(0);
  const float cap = static_cast<float>(softcap), q_scale = static_cast<float>(scale);
  const int64_t splits = items_per_request(batch, kv_heads);
  const int64_t item_kv_heads = kv_heads / splits, item_heads = item_kv_heads * group;

  at::parallel_for(0, batch * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(item_heads * dim), scores(group * kKeysPerBlock);
    std::vector<uint32_t> p_pairs(group * p_stride);
    OnlineSoftmax softmax(item_heads);
    Bf16Row k_rows[kKeysPerBlock], v_rows[kKeysPerBlock];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / splits, first_kv_head = (item % splits) * item_kv_heads;
      const int64_t length = lens[b];
      const int64_t first = first_key(length, window);
      std::fill(acc.begin(), acc.end(), 0.f);
      softmax.reset();
      for (int64_t start = first; start < length; start += kKeysPerBlock) {
        const int64_t keys = std::min(kKeysPerBlock, length - start);
        const int64_t* slots = index + b * index_sb + start;
        for (int64_t j = 0; j < keys; ++j) {
          k_rows[j] = k + slots[j] * k_sn;
          v_rows[j] = v + slots[j] * v_sn;
        }
        for (int64_t kh = 0; kh < item_kv_heads; ++kh) {
          const int64_t kv_head = first_kv_head + kh;
          // A unit of work is a block of keys for one KV head; the next is the block's next KV
          // head, the item's next block, or the next item's first block.
          NextUnit next;
          if (kh + 1 < item_kv_heads) {
            next = {slots, keys, kv_head + 1};
          } else if (start + kKeysPerBlock < length) {
            next = {slots + kKeysPerBlock, std::min(kKeysPerBlock, length - start - kKeysPerBlock), first_kv_head};
          } else if (item + 1 < end) {
            const int64_t next_b = (item + 1) / splits, next_first = first_key(lens[next_b], window);
            next = {index + next_b * index_sb + next_first, std::min(kKeysPerBlock, lens[next_b] - next_first),
                    ((item + 1) % splits) * item_kv_heads};
          }
          // The next unit's rows go out in two shares per query head's scores and two for the value
          // sums, one before each half of the block's keys.
          const int64_t shares = 2 * (group + 1), half = std::min(keys, kHalfBlock);
          const auto prefetch_share = [&](int64_t share) {
            if (next.keys == 0) return;
            const int64_t from = next.keys * share / shares, to = next.keys * (share + 1) / shares;
            prefetch_rows(k, next.slots + from, to - from, k_sn, next.kv_head * k_sh, 2 * dim);
            prefetch_rows(v, next.slots + from, to - from, v_sn, next.kv_head * v_sh, 2 * dim);
          };
          for (int64_t g = 0; g < group; ++g) {
            const int64_t h = kh * group + g;
            const uint16_t* q_row = q + b * q_sb + (first_kv_head * group + h) * q_sh;
            __m512bh q_regs[N];
            for (int c = 0; c < N; ++c) q_regs[c] = (__m512bh)_mm512_loadu_si512(q_row + 32 * c);
            float* s = scores.data() + g * kKeysPerBlock;
            prefetch_share(2 * g);
            pair_scores<N>(q_regs, k_rows, kv_head * k_sh, half, s);
            prefetch_share(2 * g + 1);
            pair_scores<N>(q_regs, k_rows + half, kv_head * k_sh, keys - half, s + half);
            scale_scores(s, keys, q_scale, cap);
            const float rescale = softmax.absorb(h, s, keys);
            if (rescale != 1.f) {
              float* a = acc.data() + h * dim;
              for (int64_t d = 0; d < dim; d += Vec::size()) (Vec::loadu(a + d) * Vec(rescale)).store(a + d);
            }
            to_bf16_pairs(s, keys, p_pairs.data() + g * p_stride);
          }
          float* group_acc = acc.data() + kh * group * dim;
          prefetch_share(2 * group);
          add_values_of_group<N>(group_acc, v_rows, kv_head * v_sh, half, p_pairs.data(), p_stride, group);
          prefetch_share(2 * group + 1);
          if (keys > half) {
            add_values_of_group<N>(group_acc, v_rows + half, kv_head * v_sh, keys - half, p_pairs.data() + half / 2,
                                   p_stride, group);
          }
        }
      }
      for (int64_t h = 0; h < item_heads; ++h) {
        const float inverse = softmax.inverse(h);
        store_unpacked<N>(acc.data() + h * dim, inverse, o + (b * heads + first_kv_head * group + h) * dim);
      }
    }
  });
}
// The pair kernel serves bf16 with head_dim 32, 64, 128 or 256 (and equal K and V dims).
bool decode_bf16_pairs_if_served(const at::Tensor& query, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                                 const at::Tensor& kv_index, const at::Tensor& kv_len, at::Tensor& out,
                                 double scale, double softcap, int64_t window) {
  const int64_t dim = query.size(2);
  if (query.scalar_type() != at::kBFloat16 || v_buffer.size(2) != dim) return false;
  const auto run = [&](auto registers_per_row) {
    decode_bf16_pairs<decltype(registers_per_row)::value>(query, k_buffer, v_buffer, kv_index, kv_len, out, scale,
                                                          softcap, window);
    return true;
  };
  switch (dim) {
    case 32: return run(std::integral_constant<int, 1>{});
    case 64: return run(std::integral_constant<int, 2>{});
    case 128: return run(std::integral_constant<int, 4>{});
    case 256: return run(std::integral_constant<int, 8>{});
    default: return false;
  }
}
#else
bool decode_bf16_pairs_if_served(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, at::Tensor&, double, double, int64_t) {
  return false;
}
#endif

template <typename scalar_t>
void decode(const at::Tensor& query, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
            const at::Tensor& kv_index, const at::Tensor& kv_len, at::Tensor& out, double scale,
            double softcap, int64_t window) {
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = k_buffer.size(1), v_dim = v_buffer.size(2);
  const int64_t group = heads / kv_heads;
  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* k = k_buffer.data_ptr<scalar_t>();
  const scalar_t* v = v_buffer.data_ptr<scalar_t>();
  const int64_t* index = kv_index.data_ptr<int64_t>();
  const int64_t* lens = kv_len.data_ptr<int64_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t q_sb = query.stride(0), q_sh = query.stride(1);
  const int64_t k_sn = k_buffer.stride(0), k_sh = k_buffer.stride(1);
  const int64_t v_sn = v_buffer.stride(0), v_sh = v_buffer.stride(1);
  const int64_t index_sb = kv_index.stride(0);
  const float cap = static_cast<float>(softcap);
  const float q_scale = static_cast<float>(scale);
  const auto score = dim % Vec::size() == 0 ? dots : dots_any_dim;
  const int64_t splits = items_per_request(batch, kv_heads);
  const int64_t item_kv_heads = kv_heads / splits, item_heads = item_kv_heads * group;

  at::parallel_for(0, batch * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(item_heads * dim), acc(item_heads * v_dim);
    std::vector<float> scores(item_heads * kKeysPerBlock);
    OnlineSoftmax softmax(item_heads);
    std::vector<float> kf(kKeysPerBlock * dim), vf(kKeysPerBlock * v_dim);
    const float* k_rows[kKeysPerBlock];
    const float* v_rows[kKeysPerBlock];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / splits, first_kv_head = (item % splits) * item_kv_heads;
      const int64_t length = lens[b];
      const int64_t first = first_key(length, window);
      for (int64_t h = 0; h < item_heads; ++h) {
        to_float(q + b * q_sb + (first_kv_head * group + h) * q_sh, qf.data() + h * dim, dim);
        if (cap <= 0.f) {
          for (int64_t d = 0; d < dim; ++d) qf[h * dim + d] *= q_scale;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      softmax.reset();
      for (int64_t start = first; start < length; start += kKeysPerBlock) {
        const int64_t keys = std::min(kKeysPerBlock, length - start);
        const int64_t* slots = index + b * index_sb + start;
        for (int64_t kh = 0; kh < item_kv_heads; ++kh) {
          for (int64_t j = 0; j < keys; ++j) {
            k_rows[j] = as_float(k + slots[j] * k_sn + (first_kv_head + kh) * k_sh, kf.data() + j * dim, dim);
          }
          score(qf.data() + kh * group * dim, k_rows, group, keys, dim,
                scores.data() + kh * group * kKeysPerBlock, kKeysPerBlock);
        }
        for (int64_t h = 0; h < item_heads; ++h) {
          float* s = scores.data() + h * kKeysPerBlock;
          if (cap > 0.f) {  // HF's order: scale, then soft-cap
            for (int64_t j = 0; j < keys; ++j) s[j] = cap * std::tanh(s[j] * q_scale / cap);
          }
          const float rescale = softmax.absorb(h, s, keys);
          for (int64_t d = 0; d < v_dim; ++d) acc[h * v_dim + d] *= rescale;
        }
        for (int64_t kh = 0; kh < item_kv_heads; ++kh) {
          for (int64_t j = 0; j < keys; ++j) {
            v_rows[j] = as_float(v + slots[j] * v_sn + (first_kv_head + kh) * v_sh, vf.data() + j * v_dim, v_dim);
          }
          for (int64_t g = 0; g < group; ++g) {
            const int64_t h = kh * group + g;
            weighted_sum(acc.data() + h * v_dim, v_rows, scores.data() + h * kKeysPerBlock, keys, v_dim);
          }
        }
      }
      for (int64_t h = 0; h < item_heads; ++h) {
        const float inverse = softmax.inverse(h);
        scalar_t* dst = o + (b * heads + first_kv_head * group + h) * v_dim;
        for (int64_t d = 0; d < v_dim; ++d) dst[d] = static_cast<scalar_t>(acc[h * v_dim + d] * inverse);
      }
    }
  });
}

// query [batch, heads, dim] (dim contiguous), k/v_buffer [slots, kv_heads, dim] (rows
// contiguous), kv_index [batch, >= max length] int64 slots, kv_len [batch] int64 cached tokens
// (the new one included); window: keys back from the query (SGLang's convention), -1 for none;
// softcap <= 0 for none. Returns [batch, heads, v_dim].
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_buffer,
                                  const at::Tensor& v_buffer, const at::Tensor& kv_index,
                                  const at::Tensor& kv_len, double scale, double softcap,
                                  int64_t window) {
  TORCH_CHECK(query.dim() == 3 && k_buffer.dim() == 3 && v_buffer.dim() == 3,
              "paged_decode_attention: query and buffers must be 3-d");
  TORCH_CHECK(query.stride(2) == 1 && k_buffer.stride(2) == 1 && v_buffer.stride(2) == 1,
              "paged_decode_attention: the head dimension must be contiguous");
  TORCH_CHECK(query.scalar_type() == k_buffer.scalar_type() &&
                  k_buffer.scalar_type() == v_buffer.scalar_type(),
              "paged_decode_attention: query and KV buffers must share a dtype");
  TORCH_CHECK(kv_index.scalar_type() == at::kLong && kv_len.scalar_type() == at::kLong,
              "paged_decode_attention: kv_index and kv_len must be int64");
  TORCH_CHECK(query.size(1) % k_buffer.size(1) == 0,
              "paged_decode_attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(query.size(2) == k_buffer.size(2), "paged_decode_attention: head_dim mismatch");
  const auto index = kv_index.contiguous();
  const auto lens = kv_len.contiguous();
  auto out = at::empty({query.size(0), query.size(1), v_buffer.size(2)}, query.options());
  if (decode_bf16_pairs_if_served(query, k_buffer, v_buffer, index, lens, out, scale, softcap, window)) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode", [&] {
    decode<scalar_t>(query, k_buffer, v_buffer, index, lens, out, scale, softcap, window);
  });
  return out;
}

// `x` [tokens, ...] as [tokens, row] with each token's row contiguous: a view where it already is
// (a fused QKV projection's V is such a token-strided slice), else a contiguous copy.
at::Tensor token_rows(const at::Tensor& x, int64_t tokens, int64_t row) {
  const auto rows = x.reshape({tokens, row});
  return rows.stride(1) == 1 ? rows : rows.contiguous();
}

// This forward's K and V rows (k, v: [tokens, ...] with a slot's values per token) written into
// the pool's slots `loc`, both buffers in one pass, tokens split over threads where there are
// many (a prefill); torch's index_copy_ takes a call per buffer and copies rows one by one.
void store_kv(at::Tensor& k_buffer, at::Tensor& v_buffer, const at::Tensor& loc, const at::Tensor& k,
              const at::Tensor& v) {
  TORCH_CHECK(k_buffer.dim() == 3 && v_buffer.dim() == 3 && k_buffer.is_contiguous() && v_buffer.is_contiguous(),
              "store_kv: the buffers must be contiguous [slots, heads, dim]");
  TORCH_CHECK(k.scalar_type() == k_buffer.scalar_type() && v.scalar_type() == v_buffer.scalar_type(),
              "store_kv: k and v must have their buffers' dtypes");
  TORCH_CHECK(loc.scalar_type() == at::kLong && loc.dim() == 1, "store_kv: loc must be 1-d int64");
  const int64_t tokens = loc.numel(), k_row = k_buffer.stride(0), v_row = v_buffer.stride(0);
  TORCH_CHECK(k.numel() == tokens * k_row && v.numel() == tokens * v_row,
              "store_kv: k and v must hold one slot's values per token");
  const auto slots = loc.contiguous();
  const auto keys = token_rows(k, tokens, k_row), values = token_rows(v, tokens, v_row);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t capacity = std::min(k_buffer.size(0), v_buffer.size(0));
  for (int64_t i = 0; i < tokens; ++i) {
    TORCH_CHECK(slot[i] >= 0 && slot[i] < capacity, "store_kv: slot ", slot[i], " is outside the pool");
  }
  const int64_t k_bytes = k_row * k_buffer.element_size(), v_bytes = v_row * v_buffer.element_size();
  const int64_t k_step = keys.stride(0) * keys.element_size(), v_step = values.stride(0) * values.element_size();
  auto* k_out = static_cast<char*>(k_buffer.data_ptr());
  auto* v_out = static_cast<char*>(v_buffer.data_ptr());
  const auto* k_in = static_cast<const char*>(keys.data_ptr());
  const auto* v_in = static_cast<const char*>(values.data_ptr());
  constexpr int64_t kTokensPerTask = 256;  // a decode step's few rows stay on one thread
  at::parallel_for(0, tokens, kTokensPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(k_out + slot[i] * k_bytes, k_in + i * k_step, k_bytes);
      std::memcpy(v_out + slot[i] * v_bytes, v_in + i * v_step, v_bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY(sglang_hf_backend_kernels, m) {
  m.def(
      "paged_decode_attention(Tensor query, Tensor k_buffer, Tensor v_buffer, Tensor kv_index, "
      "Tensor kv_len, float scale, float softcap, int window) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
  m.def("store_kv(Tensor(a!) k_buffer, Tensor(b!) v_buffer, Tensor loc, Tensor k, Tensor v) -> ()");
  m.impl("store_kv", c10::DispatchKey::CPU, &store_kv);
}
