// The product of a linear whose weight oneDNN has packed (cpu_linear.py), chosen here by size,
// and a merged gate/up projection's product with SiLU-and-multiply.
//
// A compiled step calls this op once per linear (~65 calls a step for the 0.5B Llama). Routing
// in Python cost ~6 us a call in a loop and more inside a step, where the weights' streams have
// evicted the interpreter's data: the handle's `int()`, the lookup of the packed tensor and of
// its address through two more dispatcher calls. Packing registers each weight here once, with
// its address and whether the AMX kernel multiplies it, so a call is one dispatch into C++.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "linears.h"

namespace {

struct PackedWeight {
  at::Tensor packed;             // oneDNN's packed copy of the weight
  const void* data = nullptr;    // its address
  bool amx = false;              // products of up to 32 tokens go to the AMX kernel
  int64_t plain_above = 0;       // half-precision products of more tokens use torch's plain matmul
};

std::vector<PackedWeight>& registry() {
  static std::vector<PackedWeight> weights;
  return weights;
}

// Packing (once per weight, again when weights are reloaded) names the weight by its handle.
void register_packed(int64_t handle, const at::Tensor& packed, bool amx, int64_t plain_above) {
  TORCH_CHECK(handle >= 0 && packed.is_mkldnn(), "register_packed: a handle and oneDNN's packed weight");
  auto& weights = registry();
  if (static_cast<size_t>(handle) >= weights.size()) weights.resize(handle + 1);
  weights[handle] = {packed, sglang_hf_backend::packed_data(packed), amx, plain_above};
}

// oneDNN's product on a packed or plain weight, with a unary post-op ("none", "swish", ...).
at::Tensor onednn_product(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                          c10::string_view post_op = "none") {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                            c10::string_view, c10::List<c10::optional<at::Scalar>>, c10::optional<c10::string_view>)>();
  return op.call(x, weight, bias, post_op, c10::List<c10::optional<at::Scalar>>(), c10::nullopt);
}

// oneDNN's product times `other`, the multiplication done as its post-op.
at::Tensor onednn_product_times(const at::Tensor& x, const at::Tensor& other, const at::Tensor& weight,
                                const c10::optional<at::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_linear_pointwise", "binary")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const c10::optional<at::Tensor>&, c10::string_view)>();
  return op.call(x, other, weight, bias, "mul");
}

const PackedWeight& registered(const at::Tensor& handle) {
  TORCH_CHECK(handle.scalar_type() == at::kLong && handle.numel() == 1, "packed_linear: handle must be one int64");
  const int64_t index = *handle.const_data_ptr<int64_t>();
  const auto& weights = registry();
  TORCH_CHECK(index >= 0 && static_cast<size_t>(index) < weights.size() && weights[index].data,
              "packed_linear: no weight was registered under handle ", index);
  return weights[index];
}

int64_t rows_of(const at::Tensor& x) { return x.size(-1) ? x.numel() / x.size(-1) : 0; }

// x [..., k] times the registered weight (weight: its plain [n, k] copy); bias [n] or none.
at::Tensor product(const PackedWeight& entry, const at::Tensor& x, const at::Tensor& weight,
                   const c10::optional<at::Tensor>& bias) {
  const int64_t rows = rows_of(x);
  const bool fp32 = x.scalar_type() == at::kFloat;
  if (!fp32 && rows > entry.plain_above) return at::linear(x, weight, bias);
  if (entry.amx && rows <= sglang_hf_backend::kAmxMaxRows)
    return sglang_hf_backend::amx_product(x, weight.size(0), entry.data, bias);
  if (fp32 && rows == 1) return sglang_hf_backend::one_token_linear(x, weight, bias);
  return onednn_product(x, entry.packed, bias);
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& handle,
                         const c10::optional<at::Tensor>& bias) {
  return product(registered(handle), x, weight, bias);
}

// out[i] = silu(gate[i]) * up[i], silu rounded to the type first, as HF's MLP computes it.
template <typename scalar_t>
void silu_times_row(const scalar_t* gate, const scalar_t* up, scalar_t* out, int64_t width) {
  using Vec = at::vec::Vectorized<float>;
  int64_t i = 0;
  if constexpr (std::is_same_v<scalar_t, float>) {
    for (; i + Vec::size() <= width; i += Vec::size()) {
      const Vec g = Vec::loadu(gate + i);
      (g / (Vec(1.0f) + g.neg().exp()) * Vec::loadu(up + i)).store(out + i);
    }
  } else {
    using Half = at::vec::Vectorized<scalar_t>;
    for (; i + Half::size() <= width; i += Half::size()) {
      auto [g0, g1] = at::vec::convert_to_float<scalar_t>(Half::loadu(gate + i));
      auto [u0, u1] = at::vec::convert_to_float<scalar_t>(Half::loadu(up + i));
      const Half silu = at::vec::convert_from_float<scalar_t>(g0 / (Vec(1.0f) + g0.neg().exp()),
                                                              g1 / (Vec(1.0f) + g1.neg().exp()));
      auto [s0, s1] = at::vec::convert_to_float<scalar_t>(silu);
      at::vec::convert_from_float<scalar_t>(s0 * u0, s1 * u1).store(out + i);
    }
  }
  for (; i < width; ++i) {
    const float g = static_cast<float>(gate[i]);
    const scalar_t silu = static_cast<scalar_t>(g / (1.0f + std::exp(-g)));
    out[i] = static_cast<scalar_t>(static_cast<float>(silu) * static_cast<float>(up[i]));
  }
}

// both [..., 2 x width] (gate, then up) -> [..., width].
at::Tensor silu_and_mul(const at::Tensor& both) {
  const int64_t width = both.size(-1) / 2, rows = rows_of(both);
  const auto in = both.contiguous();
  auto sizes = both.sizes().vec();
  sizes.back() = width;
  auto out = at::empty(sizes, both.options());
  const auto rows_per_task = std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1));
  const auto run = [&](auto* typed_in) {
    using scalar_t = std::remove_const_t<std::remove_pointer_t<decltype(typed_in)>>;
    auto* typed_out = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, rows_per_task, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row)
        silu_times_row(typed_in + row * 2 * width, typed_in + row * 2 * width + width, typed_out + row * width, width);
    });
  };
  switch (both.scalar_type()) {
    case at::kFloat: run(in.const_data_ptr<float>()); break;
    case at::kBFloat16: run(in.const_data_ptr<at::BFloat16>()); break;
    case at::kHalf: run(in.const_data_ptr<at::Half>()); break;
    default: TORCH_CHECK(false, "packed_silu_and_mul: float32, bfloat16 or float16, got ", both.scalar_type());
  }
  return out;
}

// silu(x . gate^T) * (x . up^T) for the registered merged weight [gate; up] (rows split in two
// halves); bias [n] or none. Prefills of half types, which take torch's plain product, take
// oneDNN's with SiLU and the multiplication as post-ops of the two halves' products instead, so
// the [tokens, n] product is never written and read back (the 0.5B Llama's MLP at 4096 tokens:
// ~88 -> ~82 ms a layer); other sizes multiply as `packed_linear` does, then apply them.
at::Tensor packed_silu_and_mul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& handle,
                               const c10::optional<at::Tensor>& bias) {
  const PackedWeight& entry = registered(handle);
  const int64_t width = weight.size(0) / 2;
  TORCH_CHECK(weight.size(0) == 2 * width, "packed_silu_and_mul: the weight must stack two equal halves");
  if (x.scalar_type() != at::kFloat && rows_of(x) > entry.plain_above) {
    const auto half = [&](int64_t start) {
      return bias.has_value() ? c10::optional<at::Tensor>(bias->narrow(0, start, width)) : c10::nullopt;
    };
    const auto gate = onednn_product(x, weight.narrow(0, 0, width), half(0), "swish");
    return onednn_product_times(x, gate, weight.narrow(0, width, width), half(width));
  }
  return silu_and_mul(product(entry, x, weight, bias));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sglang_hf_backend_kernels, m) {
  m.def("register_packed(int handle, Tensor packed, bool amx, int plain_above) -> ()");
  m.impl("register_packed", c10::DispatchKey::MkldnnCPU, &register_packed);
  m.impl("register_packed", c10::DispatchKey::CPU, &register_packed);
  m.def("packed_linear(Tensor x, Tensor weight, Tensor handle, Tensor? bias) -> Tensor");
  m.impl("packed_linear", c10::DispatchKey::CPU, &packed_linear);
  m.def("packed_silu_and_mul(Tensor x, Tensor weight, Tensor handle, Tensor? bias) -> Tensor");
  m.impl("packed_silu_and_mul", c10::DispatchKey::CPU, &packed_silu_and_mul);
}
