"""torch.compile of the whole step on CPU: the backbone's forward as one graph, attention inside it.

SGLang's own CPU answer to ``--enable-torch-compile`` (its CPU graph runner) compiles the
whole forward for every decode batch size and needs an attention backend that keeps
CPU-graph state (``intel_amx`` with ``sgl-kernel``). Ours compiles the backbone's forward
once, with dynamic token counts. The RadixAttention call is a custom op with a fake
implementation (``attention.attend_in_graph``), so the graph does not break at attention:
norms, RoPE, activations and the glue between the GEMMs of all layers are generated as one
program, and the Python of HF's module calls runs only while tracing. The step's batch
(KV-cache indices, attention metadata) reaches the op outside the graph
(``attention.running_step``). Shape classes: one token (batch-1 decode) and any other count,
each compiled on its first step; inductor's on-disk cache (torch's default, in
``TORCHINDUCTOR_CACHE_DIR``) lets a second start reuse the generated code. Unquantized weights
are frozen into the graph (inductor's ``freezing``): its linears get oneDNN's prepacked weight
layouts, which nearly halve a bf16 batch-1 GEMM on CPU, at the cost of a packed copy of those
weights per shape class. On a GPU, SGLang's CUDA-graph path owns ``--enable-torch-compile``.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch._inductor import config as inductor_config

from sglang_hf_backend import diagnostics
from sglang_hf_backend.attention import RADIX_ATTRIBUTE, running_step


def wanted(device: str) -> bool:
    """Does this process compile the step itself?"""
    from sglang.srt.runtime_context import get_flags

    return device == "cpu" and get_flags().capture.enable_torch_compile


def eager_reason(pp_size: int, lora: bool, multimodal: bool = False) -> str | None:
    """Why a compiled step would not be exact or stable here (then the model runs eagerly)."""
    if multimodal:
        return (
            "a multimodal model's prefills switch between token ids and image embeddings (not compiled yet)"
        )
    if pp_size > 1:
        return "pipeline stages hand hidden states in and out through module state"
    if lora:
        return "LoRA layers read per-batch adapter indices in Python"
    return None


class CompiledStep:
    """The backbone's forward, compiled once; called with the batch and the backbone's inputs.

    ``freeze``: inline the weights as constants (prepacked); only for plain tensors, since
    quantized weights keep their own kernels.
    """

    def __init__(self, backbone: nn.Module, freeze: bool):
        from sglang.srt.runtime_context import get_flags

        self.backbone = backbone
        self.freeze = freeze
        self.attention = {
            getattr(module, RADIX_ATTRIBUTE).layer_id: module
            for module in backbone.modules()
            if hasattr(module, RADIX_ATTRIBUTE)
        }
        self.compiled = self.compile()
        self.compiled_shapes: set[str] = set()
        # SGLang's CPU graph runner would compile the whole forward again around ours.
        get_flags().capture.enable_torch_compile = False
        diagnostics.decision(
            "torch.compile: the backbone's forward is one graph (dynamic token count, %d attention "
            "layers inside it as a custom op, weights %s); SGLang's CPU graph capture is left off",
            len(self.attention),
            "frozen and prepacked" if freeze else "read as inputs (quantized)",
        )

    def compile(self):
        return torch.compile(self.hidden_states, dynamic=True)

    def weights_reloaded(self) -> None:
        """Frozen graphs hold copies of the weights: after new weights load, compile afresh."""
        if self.freeze and self.compiled_shapes:
            torch._dynamo.reset()
            self.compiled = self.compile()
            self.compiled_shapes.clear()
            diagnostics.decision("torch.compile: weights reloaded, the frozen step recompiles")

    def hidden_states(self, **inputs) -> torch.Tensor:
        return self.backbone(**inputs, use_cache=False, return_dict=True).last_hidden_state

    def __call__(self, forward_batch, **inputs) -> torch.Tensor:
        shape = "one token" if inputs["position_ids"].shape[-1] == 1 else "many tokens"
        started = time.perf_counter()
        # Inductor reads ``freezing`` from its global config when it compiles (``options`` of
        # torch.compile do not reach it), so it is set around the call, for this graph only.
        with running_step(self.attention, forward_batch), inductor_config.patch(freezing=self.freeze):
            out = self.compiled(**inputs)
        if shape not in self.compiled_shapes:
            self.compiled_shapes.add(shape)
            diagnostics.decision(
                "torch.compile: first step with %s took %.1f s (compiling)",
                shape,
                time.perf_counter() - started,
            )
        return out
