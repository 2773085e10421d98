// The product of a linear whose weight oneDNN has packed (cpu_linear.py), chosen here by size.
//
// A compiled step calls this op once per linear (~65 calls a step for the 0.5B Llama). Routing
// in Python cost ~6 us a call in a loop and more inside a step, where the weights' streams have
// evicted the interpreter's data: the handle's `int()`, the lookup of the packed tensor and of
// its address through two more dispatcher calls. Packing registers each weight here once, with
// its address and whether the AMX kernel multiplies it, so a call is one dispatch into C++.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "linears.h"

namespace {

constexpr int64_t kAmxMaxRows = 32;  // amx_linear.cpp's two tiles of 16 tokens

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

at::Tensor onednn_product(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                            c10::string_view, c10::List<c10::optional<at::Scalar>>, c10::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<c10::optional<at::Scalar>>(), c10::nullopt);
}

// x [..., k] times the registered weight `handle` (weight: its plain [n, k] copy); bias [n] or none.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& handle,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(handle.scalar_type() == at::kLong && handle.numel() == 1, "packed_linear: handle must be one int64");
  const int64_t index = *handle.const_data_ptr<int64_t>();
  const auto& weights = registry();
  TORCH_CHECK(index >= 0 && static_cast<size_t>(index) < weights.size() && weights[index].data,
              "packed_linear: no weight was registered under handle ", index);
  const PackedWeight& entry = weights[index];
  const int64_t k = x.size(-1), rows = k ? x.numel() / k : 0;
  const bool fp32 = x.scalar_type() == at::kFloat;
  if (!fp32 && rows > entry.plain_above) return at::linear(x, weight, bias);
  if (entry.amx && rows <= kAmxMaxRows) return sglang_hf_backend::amx_product(x, weight.size(0), entry.data, bias);
  if (fp32 && rows == 1) return sglang_hf_backend::one_token_linear(x, weight, bias);
  return onednn_product(x, entry.packed, bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sglang_hf_backend_kernels, m) {
  m.def("register_packed(int handle, Tensor packed, bool amx, int plain_above) -> ()");
  m.impl("register_packed", c10::DispatchKey::MkldnnCPU, &register_packed);
  m.impl("register_packed", c10::DispatchKey::CPU, &register_packed);
  m.def("packed_linear(Tensor x, Tensor weight, Tensor handle, Tensor? bias) -> Tensor");
  m.impl("packed_linear", c10::DispatchKey::CPU, &packed_linear);
}
