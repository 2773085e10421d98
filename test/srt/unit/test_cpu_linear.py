"""Prepacked CPU linears: the same numbers as torch's matmul, eagerly and inside a compiled graph."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from sglang.srt.layers.quantization.unquant import UnquantizedEmbeddingMethod, UnquantizedLinearMethod
from torch import nn

from sglang_hf_backend import cpu_linear, platform

# Where oneDNN has no bf16 (AVX2-only CPUs) nothing is packed in bf16; the method is then
# exercised in fp32, where oneDNN's packed product rounds differently from torch's.
DTYPE = torch.bfloat16 if cpu_linear.onednn_supports(torch.bfloat16) else torch.float32


@pytest.fixture(autouse=True)
def rank_zero():
    """Packing logs its decisions as rank 0's; no engine publishes a rank here."""
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(tp_rank=0):
        yield


def assert_same_product(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if DTYPE == torch.bfloat16:
        assert torch.equal(actual, expected)
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def packed_layer(out_features: int = 96, in_features: int = 64, bias: bool = True, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    layer = SimpleNamespace(
        weight=torch.randn(out_features, in_features, generator=generator).to(DTYPE),
        bias=torch.randn(out_features, generator=generator).to(DTYPE) if bias else None,
    )
    method = cpu_linear.PackedLinearMethod()
    method.process_weights_after_loading(layer)
    return layer, method


@pytest.mark.parametrize("shape", [(1, 64), (32, 64), (1, 7, 64), (300, 64)])  # 300: above the packed range
def test_packed_product_equals_torch_matmul_bit_for_bit(shape):
    layer, method = packed_layer()
    x = torch.randn(*shape).to(DTYPE)
    assert_same_product(method.apply(layer, x, layer.bias), F.linear(x, layer.weight, layer.bias))


def test_reloaded_weights_keep_their_handle():
    layer, method = packed_layer()
    handle = layer.packed_handle
    layer.weight = torch.randn_like(layer.weight, dtype=torch.float32).to(DTYPE)
    method.process_weights_after_loading(layer)
    x = torch.randn(2, 64).to(DTYPE)
    assert layer.packed_handle is handle
    assert_same_product(method.apply(layer, x), F.linear(x, layer.weight))


def test_product_where_the_kernels_did_not_build_is_the_same():
    """The Python op that multiplies where the C++ kernels did not build (no compiler)."""
    layer, _ = packed_layer()
    for tokens in (1, 32, 300):
        x = torch.randn(tokens, 64).to(DTYPE)
        product = torch.ops.sglang_hf_backend.packed_linear(x, layer.weight, layer.packed_handle, layer.bias)
        assert_same_product(product, F.linear(x, layer.weight, layer.bias))


def test_compiled_graph_calls_the_packed_op():
    layer, method = packed_layer(bias=False)

    def block(x):
        return torch.relu(method.apply(layer, x)) * 2

    compiled = torch.compile(block, dynamic=True)
    for tokens in (3, 5, 400):
        x = torch.randn(tokens, 64).to(DTYPE)
        assert_same_product(compiled(x), block(x))


def test_only_unquantized_layers_and_heads_change_method():
    plain = SimpleNamespace(quant_method=UnquantizedLinearMethod())
    other = SimpleNamespace(quant_method=object())
    module = torch.nn.Module()
    module.plain, module.other = torch.nn.Module(), torch.nn.Module()
    module.plain.quant_method, module.other.quant_method = plain.quant_method, other.quant_method
    assert cpu_linear.pack_linears(module) == 1
    assert isinstance(module.plain.quant_method, cpu_linear.PackedLinearMethod)
    assert module.other.quant_method is other.quant_method
    head = SimpleNamespace(quant_method=UnquantizedEmbeddingMethod())
    cpu_linear.pack_head(head)
    assert isinstance(head.quant_method, cpu_linear.PackedHeadMethod)
    # SGLang's logits processor multiplies by the weight itself for the names it knows as
    # unquantized; ours must not be among them, or the packed head would never be used.
    from sglang.srt.layers.logits_processor import _UNQUANTIZED_LM_HEAD_METHODS

    assert "PackedHeadMethod" not in _UNQUANTIZED_LM_HEAD_METHODS


def test_fp32_stays_unpacked_and_the_setting_is_checked(monkeypatch):
    assert not cpu_linear.should_pack(torch.float32)
    # bf16 is packed exactly where oneDNN computes it (AVX512/AMX): no timing decides it (a
    # threshold on timings flipped when a start measured while the C++ kernels were building).
    assert cpu_linear.should_pack(torch.bfloat16) == (DTYPE == torch.bfloat16)
    assert not cpu_linear.wanted("cpu", quantized=True)
    monkeypatch.setenv(cpu_linear.PACKED_WEIGHTS_ENV, "0")
    assert not cpu_linear.wanted("cpu", quantized=False)
    monkeypatch.setenv(cpu_linear.PACKED_WEIGHTS_ENV, "yes")
    with pytest.raises(ValueError, match="SGLANG_HF_BACKEND_PACKED_WEIGHTS='yes'"):
        cpu_linear.wanted("cpu", quantized=False)


def test_fp32_is_packed_only_where_dtype_auto_chose_it(monkeypatch):
    assert torch.get_default_dtype() == torch.float32
    monkeypatch.delenv(platform.FP32_FOR_SPEED_ENV, raising=False)
    assert not cpu_linear.wanted("cpu", quantized=False)  # an explicit fp32: torch's matmul
    monkeypatch.setenv(platform.FP32_FOR_SPEED_ENV, "1")
    assert cpu_linear.wanted("cpu", quantized=False)
    assert not cpu_linear.wanted("cpu", quantized=True)


def test_few_tokens_take_the_amx_kernel_where_it_multiplies(monkeypatch):
    """bf16 weights with sizes that are multiples of 32 go to the AMX kernel on CPUs with AMX;
    others (and every weight with the switch off) stay with oneDNN: the same numbers either way."""
    amx_here = cpu_linear.amx_kernel_multiplies(torch.bfloat16)
    assert amx_here == (DTYPE == torch.bfloat16 and torch.cpu._is_amx_tile_supported())
    routed, method = packed_layer(out_features=96)
    odd, _ = packed_layer(out_features=100)
    for layer, by_onednn in ((routed, not amx_here), (odd, True)):
        x = torch.randn(5, 64).to(DTYPE)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            product = method.apply(layer, x, layer.bias)
        assert any(e.name == "mkldnn::_linear_pointwise" for e in profile.events()) == by_onednn
        assert_same_product(product, F.linear(x, layer.weight, layer.bias))
    assert not cpu_linear.amx_kernel_multiplies(torch.float32)
    monkeypatch.setenv(cpu_linear.AMX_LINEAR_ENV, "0")
    cpu_linear.amx_kernel_multiplies.cache_clear()
    try:
        assert not cpu_linear.amx_kernel_multiplies(torch.bfloat16)
    finally:
        cpu_linear.amx_kernel_multiplies.cache_clear()


def assert_close_to_rounding(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to the served type's rounding (a few units in the last place)."""
    tolerance = 2**-6 if DTYPE == torch.bfloat16 else 1e-5
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tolerance, atol=tolerance)


class MergedProjection(nn.Module):
    """A merged [gate; up] projection as ``GatedActivation`` sees one (a packed SGLang linear)."""

    def __init__(self, layer, method):
        super().__init__()
        self.weight, self.bias, self.quant_method = layer.weight, layer.bias, method
        self.packed_handle, self.gather_output, self.skip_bias_add = layer.packed_handle, False, False

    def forward(self, x):
        return self.quant_method.apply(self, x, self.bias)


@pytest.mark.parametrize("tokens", [1, 5, 32, 300])  # 300: a prefill, SiLU and product as oneDNN post-ops
def test_silu_and_mul_of_a_merged_projection(tokens):
    layer, method = packed_layer(out_features=128)
    x = torch.randn(tokens, 64).to(DTYPE)
    gate, up = F.linear(x, layer.weight, layer.bias).chunk(2, dim=-1)
    assert_close_to_rounding(method.silu_and_mul(layer, x, layer.bias), F.silu(gate) * up)


def test_gated_activation_takes_the_packed_silu_and_mul_and_otherwise_sglangs():
    from sglang_hf_backend.surgery.fusers.gate_up import GatedActivation

    layer, method = packed_layer(out_features=128)
    projection = MergedProjection(layer, method)
    x = torch.randn(3, 64).to(DTYPE)
    gate, up = projection(x).chunk(2, dim=-1)
    for activation, reference, in_one_op in (("silu", F.silu, True), ("gelu", F.gelu, False)):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            out = GatedActivation(activation)(projection, x)
        names = {e.name for e in profile.events()}
        assert ("sglang_hf_backend_kernels::packed_silu_and_mul" in names) == in_one_op
        assert_close_to_rounding(out, reference(gate) * up)
