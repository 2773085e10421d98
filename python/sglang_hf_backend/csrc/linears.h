// What packed_linear.cpp routes to: the products that amx_linear.cpp and one_token_linear.cpp compute.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace sglang_hf_backend {

constexpr int64_t kAmxMaxRows = 32;  // tokens per AMX product: two tiles of 16 rows

// x [..., k] bf16 of up to kAmxMaxRows tokens times the [n, k] weight oneDNN packed at `packed`
// (in the layout `amx_layout_matches` accepts); bias [n] or none.
at::Tensor amx_product(const at::Tensor& x, int64_t n, const void* packed, const c10::optional<at::Tensor>& bias);

// x [..., in] holding one fp32 token times the plain fp32 weight [out, in]; bias [out] or none.
at::Tensor one_token_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);

// The packed weight's address and size: mkldnn tensors have no data_ptr of their own.
const void* packed_data(const at::Tensor& packed);
int64_t packed_bytes(const at::Tensor& packed);

}  // namespace sglang_hf_backend
