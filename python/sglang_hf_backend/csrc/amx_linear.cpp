// bf16 linears of up to 32 tokens with AMX tiles, on the weight oneDNN has already packed.
//
// At decode sizes a linear is bound by reading its weight once. oneDNN's packed product reads it
// at 10-14 GB/s on a 2-core Xeon with AMX where two threads stream ~24 GB/s. This multiplies the
// same packed tensor (so no second copy of the weights) in one pass: each thread walks its own
// 32-column blocks front to back, and software-prefetches the weight `kPrefetchBytes` ahead of
// the tiles it loads. scripts/bench_linears.py, SmolLM2's 120 layer linears from memory: 14.1 ->
// 10.0 ms at one token, 17.6 -> 12.9 ms at 32.
//
// oneDNN packs a [n, k] bf16 weight whose sizes are multiples of 32 as [n/32][k/32] blocks of
// 2 KB, each 16 pair-rows x 32 columns x 2 values: a 16-column B tile is every 128-byte row's
// first or second half. A and C hold the tokens' rows (two tiles of up to 16 rows). Sums run
// in oneDNN's order (one tile chain over all of k), so outputs are bit-identical to oneDNN's and
// torch's bf16 matmul at these sizes; `cpu_linear` checks that once per process before using it,
// and each weight's packed layout (`amx_layout_matches`; a padded or other layout is left to oneDNN).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "linears.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define SGLANG_HF_BACKEND_AMX 1
#endif

namespace {

constexpr int64_t kColumns = 32;      // output columns per block: two 16-column tiles
constexpr int64_t kDepth = 32;        // inner-dimension values per block and tile multiply
constexpr int64_t kBlockValues = kDepth * kColumns;
constexpr int64_t kPrefetchBytes = 8192;  // four blocks ahead: 2-16 KB within ~5%, 8 KB the best

#ifdef SGLANG_HF_BACKEND_AMX

// Linux hands out AMX state only to processes that ask (oneDNN asks too; asking twice is fine).
bool amx_permitted() {
  constexpr int kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
  constexpr int kTileData = 18;               // XFEATURE_XTILEDATA
  static const bool permitted = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return permitted;
}

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-1: tokens 0-15 and 16-31 (A); 2-3: the block's two column halves (B);
// 4-5: tokens 0-15 x halves 0-1 (C); 6-7: tokens 16-31 x halves 0-1.
void configure_tiles(int first_rows, int second_rows) {
  TileConfig config;
  const auto set = [&](int tile, int rows) {
    config.rows[tile] = rows;
    config.bytes_per_row[tile] = rows ? 64 : 0;
  };
  set(0, first_rows);
  set(1, second_rows);
  set(2, 16);
  set(3, 16);
  set(4, first_rows);
  set(5, first_rows);
  set(6, second_rows);
  set(7, second_rows);
  _tile_loadconfig(&config);
}

// sums[row][column] (fp32, 32 x 32) = x rows . one 32-column block of the packed weight.
template <bool kSecondTile>
inline void multiply_block(const at::BFloat16* x, int64_t k, const at::BFloat16* block, float* sums) {
  _tile_zero(4);
  _tile_zero(5);
  if (kSecondTile) {
    _tile_zero(6);
    _tile_zero(7);
  }
  const int64_t x_stride = k * sizeof(at::BFloat16);
  constexpr int64_t kRowBytes = kColumns * 2 * sizeof(at::BFloat16);
  for (int64_t depth = 0; depth < k; depth += kDepth, block += kBlockValues) {
    const char* ahead = reinterpret_cast<const char*>(block) + kPrefetchBytes;
    for (int64_t line = 0; line < kBlockValues * 2; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    _tile_loadd(2, block, kRowBytes);
    _tile_loadd(3, block + 32, kRowBytes);
    _tile_loadd(0, x + depth, x_stride);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 0, 3);
    if (kSecondTile) {
      _tile_loadd(1, x + 16 * k + depth, x_stride);
      _tile_dpbf16ps(6, 1, 2);
      _tile_dpbf16ps(7, 1, 3);
    }
  }
  constexpr int64_t kSumsStride = kColumns * sizeof(float);
  _tile_stored(4, sums, kSumsStride);
  _tile_stored(5, sums + 16, kSumsStride);
  if (kSecondTile) {
    _tile_stored(6, sums + 16 * kColumns, kSumsStride);
    _tile_stored(7, sums + 16 * kColumns + 16, kSumsStride);
  }
}

// out[row][0:32] = bf16(sums[row] + bias), rounding to nearest even as oneDNN does.
inline void store_block(const float* sums, int rows, const float* bias, at::BFloat16* out, int64_t out_stride) {
  for (int row = 0; row < rows; ++row) {
    for (int half = 0; half < 2; ++half) {
      __m512 values = _mm512_loadu_ps(sums + row * kColumns + 16 * half);
      if (bias) values = _mm512_add_ps(values, _mm512_loadu_ps(bias + 16 * half));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + row * out_stride + 16 * half),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(values)));
    }
  }
}

void multiply(const at::BFloat16* x, int64_t rows, int64_t k, const at::BFloat16* weight, int64_t n,
              const float* bias, at::BFloat16* out) {
  const int first_rows = std::min<int64_t>(rows, 16), second_rows = rows - first_rows;
  at::parallel_for(0, n / kColumns, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[sglang_hf_backend::kAmxMaxRows * kColumns];
    configure_tiles(first_rows, second_rows);  // tile state is per thread
    for (int64_t column_block = begin; column_block < end; ++column_block) {
      const at::BFloat16* block = weight + column_block * kColumns * k;
      if (second_rows)
        multiply_block<true>(x, k, block, sums);
      else
        multiply_block<false>(x, k, block, sums);
      store_block(sums, rows, bias ? bias + column_block * kColumns : nullptr, out + column_block * kColumns, n);
    }
    _tile_release();
  });
}

#endif  // SGLANG_HF_BACKEND_AMX

}  // namespace

namespace sglang_hf_backend {

const void* packed_data(const at::Tensor& packed) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::data_ptr", "")
                             .typed<int64_t(const at::Tensor&)>();
  return reinterpret_cast<const void*>(op.call(packed));
}

int64_t packed_bytes(const at::Tensor& packed) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_nbytes", "")
                             .typed<int64_t(const at::Tensor&)>();
  return op.call(packed);
}

at::Tensor amx_product(const at::Tensor& x, int64_t n, const void* packed, const c10::optional<at::Tensor>& bias) {
#ifdef SGLANG_HF_BACKEND_AMX
  TORCH_CHECK(amx_permitted(), "amx_packed_linear: the kernel refused this process AMX state");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "amx_packed_linear: x must be bfloat16");
  const int64_t k = x.size(-1);
  TORCH_CHECK(n % kColumns == 0 && k % kDepth == 0, "amx_packed_linear: the weight's sizes must be multiples of 32");
  const auto input = x.reshape({-1, k}).contiguous();
  const int64_t rows = input.size(0);
  TORCH_CHECK(rows <= sglang_hf_backend::kAmxMaxRows, "amx_packed_linear: up to 32 tokens, got ", rows);
  const auto bias_values = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  TORCH_CHECK(!bias_values.defined() || bias_values.numel() == n, "amx_packed_linear: bias needs n values");
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto out = at::empty(sizes, x.options());
  if (rows == 0) return out;
  multiply(input.data_ptr<at::BFloat16>(), rows, k, static_cast<const at::BFloat16*>(packed), n,
           bias_values.defined() ? bias_values.data_ptr<float>() : nullptr, out.data_ptr<at::BFloat16>());
  return out;
#else
  TORCH_CHECK(false, "amx_packed_linear: built for a CPU without AMX-BF16");
#endif
}

}  // namespace sglang_hf_backend

namespace {

using sglang_hf_backend::packed_bytes;
using sglang_hf_backend::packed_data;

// x [..., k] bf16 of up to 32 tokens; weight: the plain [n, k] weight (its sizes); packed:
// oneDNN's packed copy of it (`mkldnn._reorder_linear_weight`); bias [n] or none.
at::Tensor amx_packed_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& packed,
                             const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "amx_packed_linear: x and weight must be bfloat16");
  TORCH_CHECK(packed.is_mkldnn(), "amx_packed_linear: packed must be oneDNN's packed weight");
  TORCH_CHECK(weight.dim() == 2 && x.size(-1) == weight.size(1), "amx_packed_linear: x and weight sizes differ");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kColumns == 0 && k % kDepth == 0 && packed_bytes(packed) == n * k * 2,
              "amx_packed_linear: the weight's sizes must be multiples of 32, packed unpadded");
  return sglang_hf_backend::amx_product(x, n, packed_data(packed), bias);
}

// Does `packed` hold `weight` in the layout the kernel reads? oneDNN chooses its blocking per
// CPU and shape, so each weight is checked where a different blocking would show: every value of
// the first, middle and last column blocks, and the first inner block of every column block.
bool amx_layout_matches(const at::Tensor& weight, const at::Tensor& packed) {
  if (!packed.is_mkldnn() || weight.dim() != 2 || weight.scalar_type() != at::kBFloat16) return false;
  const int64_t n = weight.size(0), k = weight.size(1);
  if (n % kColumns || k % kDepth || packed_bytes(packed) != n * k * 2) return false;
  const auto plain = weight.contiguous();
  const auto* w = reinterpret_cast<const uint16_t*>(plain.data_ptr<at::BFloat16>());
  const auto* p = static_cast<const uint16_t*>(packed_data(packed));
  // Value (row r, column c) of inner block `depth_block` of column block `column_block`.
  const auto matches = [&](int64_t column_block, int64_t depth_block) {
    const uint16_t* block = p + (column_block * (k / kDepth) + depth_block) * kBlockValues;
    for (int64_t pair = 0; pair < kDepth / 2; ++pair)
      for (int64_t column = 0; column < kColumns; ++column)
        for (int64_t half = 0; half < 2; ++half) {
          const int64_t row = column_block * kColumns + column, inner = depth_block * kDepth + 2 * pair + half;
          if (block[(pair * kColumns + column) * 2 + half] != w[row * k + inner]) return false;
        }
    return true;
  };
  const int64_t column_blocks = n / kColumns;
  for (const int64_t column_block : {int64_t{0}, column_blocks / 2, column_blocks - 1})
    for (int64_t depth_block = 0; depth_block < k / kDepth; ++depth_block)
      if (!matches(column_block, depth_block)) return false;
  for (int64_t column_block = 0; column_block < column_blocks; ++column_block)
    if (!matches(column_block, 0)) return false;
  return true;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sglang_hf_backend_kernels, m) {
  m.def("amx_layout_matches(Tensor weight, Tensor packed) -> bool");
  m.impl("amx_layout_matches", c10::DispatchKey::MkldnnCPU, &amx_layout_matches);
  m.impl("amx_layout_matches", c10::DispatchKey::CPU, &amx_layout_matches);
  m.def("amx_packed_linear(Tensor x, Tensor weight, Tensor packed, Tensor? bias) -> Tensor");
  // The packed weight is an mkldnn tensor, so calls dispatch on MkldnnCPU (CPU: to refuse a plain one).
  m.impl("amx_packed_linear", c10::DispatchKey::MkldnnCPU, &amx_packed_linear);
  m.impl("amx_packed_linear", c10::DispatchKey::CPU, &amx_packed_linear);
}
