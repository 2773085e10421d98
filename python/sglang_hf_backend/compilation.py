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
compile are logged and added to the load report. A step traced as one graph is saved
(``saved_step``), so a second start loads it instead of tracing (SmolLM2: 6.8 s of warm-up
down to 0.8 s); one that breaks (TP > 1) takes torch.compile's ordinary path, where
inductor's on-disk cache still spares the code generation. Weights stay
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
from sglang_hf_backend.saved_step import SavedStep, guard_failure

# The backbone's inputs and their dimension that is the step's token count.
TOKEN_DIMS = {"input_ids": -1, "position_ids": -1, "inputs_embeds": 1}
RESTARTS = 3  # whole-graph traces dynamo may ask to start over before one must succeed


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
    """The backbone's forward, compiled on the first step; called with the batch and the backbone's inputs."""

    def __init__(self, backbone: nn.Module):
        from sglang.srt.runtime_context import get_flags

        self.backbone = backbone
        self.attention = {
            getattr(module, RADIX_ATTRIBUTE).layer_id: module
            for module in backbone.modules()
            if hasattr(module, RADIX_ATTRIBUTE)
        }
        self.run = None
        # SGLang's CPU graph runner would compile the whole forward again around ours.
        get_flags().capture.enable_torch_compile = False
        diagnostics.decision(
            "torch.compile: the backbone's forward is one graph (dynamic token count, %d attention "
            "layers inside it as a custom op); SGLang's CPU graph capture is left off",
            len(self.attention),
        )

    def __call__(self, forward_batch, **inputs) -> torch.Tensor:
        inputs = without_views(inputs)
        with running_step(self.attention, forward_batch):
            if self.run is not None:
                return self.run(self.backbone, **inputs)
            started = time.perf_counter()
            resolve_kernel_dispatch(self.backbone)
            self.run = first_step(self.backbone, inputs)
            out = self.run(self.backbone, **inputs)
        self.run.report(time.perf_counter() - started)
        return out


def backbone_hidden_states(backbone: nn.Module, **inputs) -> torch.Tensor:
    """What is compiled: the backbone's last hidden states for any token count."""
    for name, dim in token_dims(inputs):
        torch._check(inputs[name].shape[dim] >= 1)
    return backbone(**inputs, use_cache=False, return_dict=True).last_hidden_state


def first_step(backbone: nn.Module, inputs: dict) -> WholeStep | RecompilingStep:
    """The step saved by an earlier start, else one traced whole now (and saved), else (the
    trace breaks, or its guards cannot be saved) torch.compile's ordinary, recompiling path."""
    saved = SavedStep(backbone)
    step = saved.load(backbone_hidden_states, backbone, inputs)
    if step is not None:
        return WholeStep(step, "loaded", f"loaded from {saved.path}")
    why_not = saved.why_unsaveable()
    if why_not is None:
        try:
            step = trace_whole(backbone, inputs)
        except torch._dynamo.exc.TorchDynamoException as error:
            why_not = gist(error)
            saved.remember_unsaveable(why_not)
        else:
            where = f"saved to {saved.path}" if saved.save(step) else "not saved"
            return WholeStep(step, "traced", f"traced whole, {where}")
    return RecompilingStep(f"traced, not saved ({why_not})")


def trace_whole(backbone: nn.Module, inputs: dict):
    """``torch.compile``'s ahead-of-time compile of the step: one graph or an error."""
    mark_token_dims(inputs)
    whole = torch.compile(
        backbone_hidden_states,
        dynamic=True,
        fullgraph=True,
        options={"guard_filter_fn": SavedStep.guards_kept},
    )
    for _ in range(RESTARTS):
        try:
            return whole.aot_compile(((backbone,), inputs))
        except torch._dynamo.exc.RestartAnalysis:
            # Dynamo learned something (say, a float to specialise) and starts over, as its
            # ordinary compile does by itself; the ahead-of-time one leaves that to its caller.
            continue
    return whole.aot_compile(((backbone,), inputs))


class WholeStep:
    """One whole graph (traced now or loaded). Inputs its guards reject (another set of
    backbone inputs, say) go to a recompiling step, which traces a graph for them."""

    def __init__(self, step, source: str, how: str):
        step.disable_guard_check()  # checked here, once per call
        self.step = step
        self.source = source
        self.how = how
        self.others: RecompilingStep | None = None

    def __call__(self, backbone: nn.Module, **inputs) -> torch.Tensor:
        if self.step.guard_check(backbone, **inputs):
            return self.step(backbone, **inputs)
        if self.others is None:
            diagnostics.decision(
                "torch.compile: a step's inputs do not fit the whole graph (%s); tracing a graph for them",
                guard_failure(self.step, backbone, inputs),
            )
            self.others = RecompilingStep("traced for other inputs")
        return self.others(backbone, **inputs)

    def report(self, seconds: float) -> None:
        report_first_step(self.source, self.how, seconds, graphs=1, breaks=0)


class RecompilingStep:
    """torch.compile's ordinary path: graph breaks allowed, inputs its guards reject traced anew."""

    def __init__(self, how: str):
        self.compiled = torch.compile(backbone_hidden_states, dynamic=True)
        self.how = how

    def __call__(self, backbone: nn.Module, **inputs) -> torch.Tensor:
        # Every call, not only the first: a recompile traces these too.
        mark_token_dims(inputs)
        return self.compiled(backbone, **inputs)

    def report(self, seconds: float) -> None:
        report_first_step("traced (recompiling)", self.how, seconds, *counted_graphs())


def counted_graphs() -> tuple[int, int]:
    """Graphs dynamo traced and graph breaks it met in this process."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def report_first_step(source: str, how: str, seconds: float, graphs: int, breaks: int) -> None:
    diagnostics.decision(
        "torch.compile: first step took %.1f s: step %s; %d graph(s), %d graph break(s)",
        seconds,
        how,
        graphs,
        breaks,
    )
    diagnostics.amend_load_report(compiled_graphs=graphs, graph_breaks=breaks, compiled_step_source=source)


def gist(error: Exception) -> str:
    """A dynamo error in one line: what, its debug context, and the user code it stopped at."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    parts = lines[:1] + [line for line in lines if line.startswith("Developer debug context:")]
    parts += [line for line in lines if line.startswith("File ")][-1:]
    return f"{type(error).__name__}: {'; '.join(parts)}"


def without_views(inputs: dict) -> dict:
    """The token inputs as tensors of their own (``input_ids[None]`` is a view): dynamo guards
    the base of a view as well, whose token dimension would specialise at one token."""
    return {
        name: value.clone() if name in TOKEN_DIMS and value is not None and value._base is not None else value
        for name, value in inputs.items()
    }


def mark_token_dims(inputs: dict) -> None:
    for name, dim in token_dims(inputs):
        torch._dynamo.decorators.mark_unbacked(inputs[name], dim)


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
