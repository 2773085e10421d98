"""torch.compile of the whole step on CPU: the backbone's forward as one graph, attention inside it.

SGLang's own CPU answer to ``--enable-torch-compile`` (its CPU graph runner) compiles the
whole forward for every decode batch size and needs an attention backend that keeps
CPU-graph state (``intel_amx`` with ``sgl-kernel``). Ours compiles the backbone's forward
once, for any token count. The RadixAttention call is a custom op with a fake
implementation (``attention.attend_in_graph``), so the graph does not break at attention:
norms, RoPE, activations and the glue between the GEMMs of all layers are generated as one
program, and the Python of HF's module calls runs only while tracing. The step's batch
(KV-cache indices, attention metadata) reaches the op outside the graph
(``attention.running_step``). The token count is an unbacked size: torch would otherwise
specialise a one-token step (batch-1 decode) and trace HF's Python a second time, which is
most of a compile (SmolLM2 with a warm cache: 11.5 s for two graphs, 6.7 s for one); a check
that it is at least one is all the graph needs. The graph and break counts after the first
compile are logged and added to the load report. Inductor's on-disk cache (torch's default,
in ``TORCHINDUCTOR_CACHE_DIR``) lets a second start reuse the generated code. Weights stay
graph inputs rather than frozen constants: inductor's freezing would prepack them itself, but
its prepacked tensors cannot be cached, so every start would compile from scratch; packed
linears (``cpu_linear``) give the same kernels. On a GPU, SGLang's CUDA-graph path owns
``--enable-torch-compile``.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from sglang_hf_backend import diagnostics
from sglang_hf_backend.attention import RADIX_ATTRIBUTE, running_step

# The backbone's inputs and their dimension that is the step's token count.
TOKEN_DIMS = {"input_ids": -1, "position_ids": -1, "inputs_embeds": 1}


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
    """The backbone's forward, compiled once; called with the batch and the backbone's inputs."""

    def __init__(self, backbone: nn.Module):
        from sglang.srt.runtime_context import get_flags

        self.backbone = backbone
        self.attention = {
            getattr(module, RADIX_ATTRIBUTE).layer_id: module
            for module in backbone.modules()
            if hasattr(module, RADIX_ATTRIBUTE)
        }
        self.compiled = torch.compile(self.hidden_states, dynamic=True)
        self.traced = False
        # SGLang's CPU graph runner would compile the whole forward again around ours.
        get_flags().capture.enable_torch_compile = False
        diagnostics.decision(
            "torch.compile: the backbone's forward is one graph (dynamic token count, %d attention "
            "layers inside it as a custom op); SGLang's CPU graph capture is left off",
            len(self.attention),
        )

    def hidden_states(self, **inputs) -> torch.Tensor:
        for name, dim in token_dims(inputs):
            torch._check(inputs[name].shape[dim] >= 1)
        return self.backbone(**inputs, use_cache=False, return_dict=True).last_hidden_state

    def __call__(self, forward_batch, **inputs) -> torch.Tensor:
        started = time.perf_counter()
        if not self.traced:
            resolve_kernel_dispatch(self.backbone)
        # Every call, not only the first: a later recompile (a guard failing) traces these too.
        for name, dim in token_dims(inputs):
            torch._dynamo.decorators.mark_unbacked(inputs[name], dim)
        with running_step(self.attention, forward_batch):
            out = self.compiled(**inputs)
        if not self.traced:
            self.traced = True
            self.report_first_compile(time.perf_counter() - started)
        return out

    @staticmethod
    def report_first_compile(seconds: float) -> None:
        from torch._dynamo.utils import counters

        graphs = counters["stats"]["unique_graphs"]
        breaks = sum(counters["graph_break"].values())
        diagnostics.decision(
            "torch.compile: first step took %.1f s (compiling): %d graph(s), %d graph break(s)%s",
            seconds,
            graphs,
            breaks,
            "".join(f"; break: {reason}" for reason in list(counters["graph_break"])[:3]),
        )
        diagnostics.amend_load_report(compiled_graphs=graphs, graph_breaks=breaks)


def token_dims(inputs: dict) -> list[tuple[str, int]]:
    """(name, token dimension) of the backbone inputs given."""
    return [
        (name, dim % inputs[name].dim()) for name, dim in TOKEN_DIMS.items() if inputs.get(name) is not None
    ]


def resolve_kernel_dispatch(module: nn.Module) -> None:
    """Settle which kernel each SGLang fused op (RMSNorm, SiluAndMul, ...) runs before tracing.

    They pick it on their first call and store it; traced before that, the graph guards on the
    empty slot and the next call compiles the whole step again.
    """
    for sub in module.modules():
        if getattr(sub, "_forward_method", False) is None and hasattr(sub, "_resolve_forward_method"):
            sub._forward_method = sub._resolve_forward_method()
