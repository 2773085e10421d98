"""torch.compile of the decoder layers on CPU, with attention kept out of the graph.

SGLang's own CPU answer to ``--enable-torch-compile`` (its CPU graph runner) compiles the
whole forward for every decode batch size and needs an attention backend that keeps
CPU-graph state (``intel_amx`` with ``sgl-kernel``). Per-op overhead on CPU lives in the
norms, RoPE, activations and glue between GEMMs, not in attention, so ours compiles each
decoder layer's forward with dynamic token counts and leaves the attention call opaque
(a graph break at the RadixAttention call, see ``attention.attend``). All layers of a
class share one compiled graph per shape class: tokens == 1 (batch-1 decode) and any
other count. On a GPU, SGLang's CUDA-graph path owns ``--enable-torch-compile``.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from sglang_hf_backend import diagnostics
from sglang_hf_backend.attention import RADIX_ATTRIBUTE


def wanted(device: str) -> bool:
    """Does this process compile the decoder layers itself?"""
    from sglang.srt.runtime_context import get_flags

    return device == "cpu" and get_flags().capture.enable_torch_compile


def compile_decoder_layers(backbone: nn.Module) -> int:
    """Compile every decoder layer in place, taking the flag over from SGLang's CPU graph runner.

    Returns how many layers were compiled.
    """
    from sglang.srt.runtime_context import get_flags

    layers = decoder_layers(backbone)
    if not layers:
        diagnostics.decision("torch.compile: no decoder layers found; serving eagerly")
        return 0
    for layer in layers:
        layer.forward = _timed_first_call(torch.compile(layer.forward, dynamic=True), type(layer).__name__)
    # SGLang's CPU graph runner would compile the whole forward again around ours.
    get_flags().capture.enable_torch_compile = False
    diagnostics.decision(
        "torch.compile: %d x %s compiled (dynamic token count, attention opaque); "
        "SGLang's CPU graph capture is left off",
        len(layers),
        type(layers[0]).__name__,
    )
    return len(layers)


def decoder_layers(backbone: nn.Module) -> list[nn.Module]:
    """The entries of module lists that hold an attention layer: HF's decoder layers."""
    return [
        layer
        for holder in backbone.modules()
        if isinstance(holder, nn.ModuleList)
        for layer in holder
        if any(hasattr(m, RADIX_ATTRIBUTE) for m in layer.modules())
    ]


_first_call_logged: set[str] = set()


def _timed_first_call(compiled, class_name: str):
    """Log how long the first call (which compiles) took, once per class."""

    def forward(*args, **kwargs):
        if class_name in _first_call_logged:
            return compiled(*args, **kwargs)
        started = time.perf_counter()
        out = compiled(*args, **kwargs)
        _first_call_logged.add(class_name)
        diagnostics.decision(
            "torch.compile: first %s forward took %.1f s (compiling)",
            class_name,
            time.perf_counter() - started,
        )
        return out

    return forward
