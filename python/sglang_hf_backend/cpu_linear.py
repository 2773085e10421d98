"""Linears with oneDNN-prepacked weights on CPU: the LM head and every unquantized linear of ours.

torch's CPU half-precision matmul hands a plain weight to oneDNN, which reorders it into its
blocked layout on every call; at decode sizes that reorder costs as much as the product.
Packing once after loading (``mkldnn._reorder_linear_weight``) and multiplying with
``mkldnn._linear_pointwise`` runs the same oneDNN kernel without it: bit-identical outputs and
about twice the speed at 1-32 tokens (Xeon with AMX, bf16, SmolLM2's shapes: gate/up at one
token 0.121 -> 0.057 ms, the 49152 x 576 head 2.22 -> 1.15 ms); prefills of more tokens keep the
plain product, which is as fast there. Half types that oneDNN computes natively are packed
where the packed product is bit-identical (``should_pack``, checked once per process and
dtype). fp32 rounds differently in oneDNN, so it is packed only where dtype auto chose fp32
because the CPU has no native half type (``platform.fp32_served_for_speed``): there torch's
fp32 matmul (MKL) streams weights slowly at decode sizes (AVX2-only EPYC, SmolLM2's 121
linears of a step: 45 -> 27.5 ms at 1 token, 178 -> 107 ms at 32; prefill sizes too), so
packed fp32 is used at every size, except one token (batch-1 decode), which our C++ kernel
(``csrc/one_token_linear.cpp``) multiplies on the plain weight where the kernels built: 0.7-0.8x
oneDNN's time there. An explicit ``dtype="float32"``, what exact comparisons ask for, keeps
torch's product. bf16 products of up to 32 tokens on CPUs with AMX go through our C++ kernel
(``csrc/amx_linear.cpp``) on oneDNN's packed tensor itself: bit-identical, and it streams the
weight faster than oneDNN at these sizes (``scripts/bench_linears.py``, SmolLM2's 120 layer
linears on a 2-core Xeon: 14.1 -> 10.0 ms at one token, 17.6 -> 12.9 ms at 32); larger products
stay with oneDNN, which splits their sums differently. ``SGLANG_HF_BACKEND_AMX_LINEAR=0`` leaves
them all to oneDNN (for comparisons).

The layers keep their plain weight (weight reloads, LoRA and load reports read it) and hold a
handle into ``_PACKED``: an mkldnn tensor cannot be an input of a compiled graph, whose cache
key pickles its inputs, so a compiled step passes the handle to the ``packed_linear`` op. The
handle is a tensor, an input of the graph rather than a constant in it, so one compiled decoder
layer serves every layer (``compilation.LayerRegions``). Where our C++ kernels built, the op is
theirs (``csrc/packed_linear.cpp``): packing registers each weight there under its handle, and a
call picks the product by size in C++ (routing in Python cost ~6 us a call, ~65 calls a decode
step of the 0.5B Llama); elsewhere it is ``_onednn_linear``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from sglang.srt.layers.quantization.unquant import UnquantizedEmbeddingMethod, UnquantizedLinearMethod
from torch import nn

from sglang_hf_backend import cpu_kernels, graph_ops
from sglang_hf_backend.args import switched_on
from sglang_hf_backend.diagnostics import decision
from sglang_hf_backend.platform import fp32_served_for_speed

PACKED_WEIGHTS_ENV = "SGLANG_HF_BACKEND_PACKED_WEIGHTS"
AMX_LINEAR_ENV = "SGLANG_HF_BACKEND_AMX_LINEAR"
_PACKED: list[torch.Tensor] = []  # handle -> packed weight
_AMX_MAX_TOKENS = 32
_TOKENS_HINT = 32  # the batch size oneDNN packs for
# Above this many tokens (prefill) the plain bf16 product is as fast or faster (SmolLM2's four
# linears: 0.31 vs 0.50 ms at 64 tokens, 0.94 vs 1.12 at 256, 1.97 vs 1.80 at 512). Packed fp32
# (AVX2-only EPYC) stays faster at every size: 0.87-0.97x torch's time from 256 to 4096 tokens.
_PACKED_MAX_TOKENS = 256


def _onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The packed product where our C++ kernels did not build (their ``packed_linear`` routes
    the same way, with the AMX and one-token kernels added)."""
    if x.dtype != torch.float32 and x.numel() > _PACKED_MAX_TOKENS * x.shape[-1]:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, _PACKED[int(handle)], bias, "none", [], "")


@functools.cache
def _kernels_built() -> bool:
    """Are our C++ kernels loaded here (asked once; packing asks first, at load time)? Where they
    are, their ``packed_linear`` (``csrc/packed_linear.cpp``: the same routing, plus the AMX and
    one-token kernels, and no Python per call) multiplies, given its fake for compiled graphs."""
    if cpu_kernels.load() is not None:
        return False
    torch.library.register_fake("sglang_hf_backend_kernels::packed_linear", _packed_linear_shape)
    torch.library.register_fake("sglang_hf_backend_kernels::packed_silu_and_mul", _silu_and_mul_shape)
    return True


def _packed_linear_shape(x, weight, handle, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _silu_and_mul_shape(x, weight, handle, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0] // 2)


# ``_onednn_linear`` as one opaque node of a compiled graph (the token count is known only when it runs).
graph_ops.define(
    "packed_linear(Tensor x, Tensor weight, Tensor handle, Tensor? bias) -> Tensor",
    _onednn_linear,
    _packed_linear_shape,
)


class PackedWeights:
    """What the packed methods share: packing after load, and the product."""

    kernels_built = False  # set when the weights are packed

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        # Waits for the kernels' build now, not in the first request; a plain bool, which a
        # saved compiled step's guards can hold (the op itself could not be pickled).
        self.kernels_built = _kernels_built()
        packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.data, _TOKENS_HINT)
        if getattr(layer, "packed_handle", None) is None:
            layer.packed_handle = torch.tensor(len(_PACKED))
            _PACKED.append(packed)
        else:  # reloaded weights: same handle, so compiled graphs stay valid
            _PACKED[int(layer.packed_handle)] = packed
        if self.kernels_built:
            # oneDNN picks its blocking per CPU and shape, so each weight's is checked for the
            # layout the AMX kernel reads (sizes multiples of 32, unpadded, 32-column blocks).
            kernels = torch.ops.sglang_hf_backend_kernels
            amx = amx_kernel_multiplies(layer.weight.dtype) and kernels.amx_layout_matches(
                layer.weight, packed
            )
            kernels.register_packed(int(layer.packed_handle), packed, amx, _PACKED_MAX_TOKENS)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.kernels_built:
            return torch.ops.sglang_hf_backend_kernels.packed_linear(
                x, layer.weight, layer.packed_handle, bias
            )
        return torch.ops.sglang_hf_backend.packed_linear(x, layer.weight, layer.packed_handle, bias)

    @property
    def computes_silu_and_mul(self) -> bool:
        """Can ``silu_and_mul`` multiply a merged gate/up projection here (``fusers.gate_up``)?"""
        return self.kernels_built

    def silu_and_mul(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``silu(gate) * up`` of a merged [gate; up] layer's product, in one C++ op: prefills
        never hold the [tokens, 2 x width] product (``csrc/packed_linear.cpp``)."""
        return torch.ops.sglang_hf_backend_kernels.packed_silu_and_mul(
            x, layer.weight, layer.packed_handle, bias
        )


class PackedLinearMethod(PackedWeights, UnquantizedLinearMethod):
    """SGLang's unquantized linear, multiplied with the packed weight."""


class PackedHeadMethod(PackedWeights, UnquantizedEmbeddingMethod):
    """The LM head's method (token lookups unchanged, logits from the packed weight).

    Its name is not one SGLang's logits processor treats as unquantized, so the processor
    calls ``apply`` instead of multiplying by ``weight`` itself.
    """


def pack_linears(module: nn.Module) -> int:
    """Give every unquantized SGLang linear under ``module`` the packed method; returns how many."""
    count = 0
    for layer in module.modules():
        if type(getattr(layer, "quant_method", None)) is UnquantizedLinearMethod:
            layer.quant_method = PackedLinearMethod()
            count += 1
    return count


def pack_head(head: nn.Module) -> None:
    """Compute logits from a packed copy of the head's (or tied embedding's) weight."""
    if type(head.quant_method) is UnquantizedEmbeddingMethod:
        head.quant_method = PackedHeadMethod()


@functools.cache
def should_pack(dtype: torch.dtype) -> bool:
    """Pack half types oneDNN computes natively here (bf16 needs AVX512 or AMX) where the packed
    product is bit-identical to torch's; decided and logged once per process and dtype.

    Not decided by timing the two: a machine's first start timed them while the C++ kernels
    built next to it, and a threshold on that flipped between starts, changing the speed and the
    saved step's key (``saved_step``) with it.
    """
    if not onednn_supports(dtype):
        return False
    identical = _packed_product_is_identical(dtype)
    decision(
        "%s linears: oneDNN computes them natively here and its prepacked product %s",
        str(dtype).removeprefix("torch."),
        "equals torch's matmul bit for bit; packing weights after loading"
        if identical
        else "differs from torch's matmul; weights stay unpacked",
    )
    return identical


@functools.cache
def amx_kernel_multiplies(dtype: torch.dtype) -> bool:
    """Does our AMX kernel multiply ``dtype`` products of few tokens here? bf16 where oneDNN packs
    it, the kernels built with AMX and the kernel's product equals torch's bit for bit (which also
    checks that oneDNN packs weights in the layout the kernel reads); decided and logged once per
    process."""
    if dtype != torch.bfloat16 or not onednn_supports(dtype):
        return False
    if not switched_on(AMX_LINEAR_ENV, "multiply few tokens with the AMX kernel"):
        return False
    why_not = cpu_kernels.load()
    if why_not is None:
        why_not = _amx_product_differs()
    decision(
        "bfloat16 linears of up to %d tokens: %s",
        _AMX_MAX_TOKENS,
        f"oneDNN's product ({why_not})"
        if why_not
        else "our AMX kernel multiplies oneDNN's packed weights (bit-identical to torch's matmul, faster to stream)",
    )
    return why_not is None


def _amx_product_differs() -> str | None:
    """Why the AMX kernel's product is not torch's (a 2048 x 1024 weight, 1, 17 and 32 tokens)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(2048, 1024, generator=generator).to(torch.bfloat16)
    bias = torch.randn(2048, generator=generator).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, _TOKENS_HINT)
    for tokens in (1, 17, 32):
        x = torch.randn(tokens, 1024, generator=generator).to(torch.bfloat16)
        try:
            product = torch.ops.sglang_hf_backend_kernels.amx_packed_linear(x, weight, packed, bias)
        except RuntimeError as error:
            return str(error).splitlines()[0]
        if not torch.equal(product, F.linear(x, weight, bias)):
            return f"the AMX kernel's product differs from torch's at {tokens} tokens"
    return None


def onednn_supports(dtype: torch.dtype) -> bool:
    """Does oneDNN multiply ``dtype`` on this CPU (the packed ops refuse it otherwise)?"""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False


def _packed_product_is_identical(dtype: torch.dtype) -> bool:
    """Does a 2048 x 1024 product at 1 and 32 tokens come out the same packed and plain?"""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(2048, 1024, generator=generator).to(dtype)
    packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, _TOKENS_HINT)
    for tokens in (1, 32):
        x = torch.randn(tokens, 1024, generator=generator).to(dtype)
        packed = torch.ops.mkldnn._linear_pointwise(x, packed_weight, None, "none", [], "")
        if not torch.equal(packed, F.linear(x, weight)):
            return False
    return True


def wanted(device: str, quantized: bool) -> bool:
    """Does this model pack its linears? On CPU, unquantized, where ``should_pack`` (fp32: where
    dtype auto chose it), unless ``SGLANG_HF_BACKEND_PACKED_WEIGHTS=0`` asks for torch's plain
    matmul (for comparisons)."""
    packing = switched_on(PACKED_WEIGHTS_ENV, "pack where oneDNN computes the dtype")
    if device != "cpu" or quantized or not packing:
        return False
    dtype = torch.get_default_dtype()
    if dtype != torch.float32:
        return should_pack(dtype)
    if not fp32_served_for_speed():
        return False
    _say_fp32_is_packed()
    return True


@functools.cache
def _say_fp32_is_packed() -> None:
    decision(
        "float32 linears: dtype auto serves float32 on this CPU (no native half type), so weights "
        "are packed for oneDNN's fp32 product (one token: our C++ kernel on the plain weight, %s), "
        "faster than torch's matmul and within fp32 rounding of it; an explicit dtype=float32 keeps "
        "torch's matmul",
        "built" if _kernels_built() else "not built here, so oneDNN's product",
    )
