"""torch.compile of the whole step on CPU: the backbone's forward as one graph, attention inside it.

SGLang's own CPU answer to ``--enable-torch-compile`` (its CPU graph runner) compiles the
whole forward for every decode batch size and needs an attention backend that keeps
CPU-graph state (``intel_amx`` with ``sgl-kernel``). Ours compiles the backbone's forward
once, for any token count. The RadixAttention call is a custom op with a fake
implementation (``csrc/step_attention.cpp``, or ``attention.attend_in_graph`` where the C++
kernels did not build), so the graph does not break at attention: norms, RoPE, activations and
the glue between the GEMMs of all layers are generated as one program, and the Python of HF's
module calls runs only while tracing. The step's batch (KV-cache indices, attention metadata)
reaches the op outside the graph (``attention.running_step``). The token count is an unbacked size: torch would otherwise
specialise a one-token step (batch-1 decode) and trace HF's Python a second time, which is
most of a compile (SmolLM2 with a warm cache: 11.5 s for two graphs, 6.7 s for one); a check
that it is at least one is all the graph needs. Each decoder-layer class is traced and
generated once and called for every layer (``LayerRegions``; SmolLM2's first compile 39 -> 22 s),
and inductor's probes of the CPU's vector units run on another thread meanwhile. The graph and
break counts after the first compile are logged and added to the load report. A step traced as
one graph is saved (``saved_step``), so a second start loads it instead of tracing (SmolLM2:
6.8 s of warm-up down to 0.8 s); one that breaks (TP > 1) takes torch.compile's ordinary path,
layer by layer, where inductor's on-disk cache still spares the code generation. Weights stay
graph inputs rather than frozen constants: inductor's freezing would prepack them itself, but
its prepacked tensors cannot be cached, so every start would compile from scratch; packed
linears (``cpu_linear``) give the same kernels. On a GPU, SGLang's CUDA-graph path owns
``--enable-torch-compile``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import threading
import time
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from sglang_hf_backend import diagnostics
from sglang_hf_backend.attention import RADIX_ATTRIBUTE, give_layer_tensors, running_step
from sglang_hf_backend.saved_step import SavedStep, guard_failure
from sglang_hf_backend.surgery.fusers.rewrite import bind_forward

# The backbone's inputs and their dimension that is the step's token count.
TOKEN_DIMS = {"input_ids": -1, "position_ids": -1, "inputs_embeds": 1}
RESTARTS = 3  # whole-graph traces dynamo may ask to start over before one must succeed
MAX_LAYER_VARIANTS = 1024  # compiled decoder layers of one class, at most one per layer
# Vector width, in bits, of inductor's C++ code for each of torch's CPU capabilities.
VECTOR_BITS = {"AVX512": 512, "AVX2": 256}


def inductor_options(capability: str | None = None) -> dict:
    """What every compile of ours passes to inductor (on a CPU of torch's ``capability``, by
    default this process's).

    ``size_asserts`` off: inductor's generated code checks every input's and custom op output's
    sizes and strides on each call, ~10 checks a layer; the step's guards already check its
    inputs, and our ops' fake implementations are tested against their outputs. Without them
    (0.5B Llama, batch 32, two runs each way) the forward's Python/dispatch time went from
    5.1-5.4 to 3.9-4.4 ms a step.

    ``cpp.simdlen`` set to the width inductor would pick anyway (from torch's CPU capability,
    which ``ATEN_CPU_CAPABILITY`` can narrow): on CPU, inductor's on-disk graph cache is keyed by
    neither, so a cache shared by an AVX512 and an AVX2-only machine (or kept across a change of
    that variable) hands one the other's generated code, which assumes the other vector width
    and returns wrong numbers (torch 2.14.1: ``relu(x) * 2 + 1`` compiled under AVX512, then
    served under AVX2, or either way between AVX2 and AVX512). The setting is part of the key.
    """
    width = VECTOR_BITS.get(capability or torch.backends.cpu.get_cpu_capability())
    return {"size_asserts": False, **({"cpp.simdlen": width} if width else {})}


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
        probe_vector_units_in_background()
        give_layer_tensors(self.attention)
        self.regions = LayerRegions(backbone, self.attention.values())
        # SGLang's CPU graph runner would compile the whole forward again around ours.
        get_flags().capture.enable_torch_compile = False
        diagnostics.decision(
            "torch.compile: the backbone's forward is one graph (dynamic token count, %d attention "
            "layers inside it as a custom op; %s compiled once for all of its layers); SGLang's CPU "
            "graph capture is left off",
            len(self.attention),
            self.regions,
        )

    def __call__(self, forward_batch, **inputs) -> torch.Tensor:
        inputs = without_views(inputs)
        with running_step(self.attention, forward_batch):
            if self.run is not None:
                return self.run(self.backbone, **inputs)
            started = time.perf_counter()
            resolve_kernel_dispatch(self.backbone)
            self.run = first_step(self.backbone, inputs, self.regions)
            out = self.run(self.backbone, **inputs)
        self.run.report(time.perf_counter() - started)
        return out


def backbone_hidden_states(backbone: nn.Module, **inputs) -> torch.Tensor:
    """What is compiled: the backbone's last hidden states for any token count."""
    for name, dim in token_dims(inputs):
        torch._check(inputs[name].shape[dim] >= 1)
    return backbone(**inputs, use_cache=False, return_dict=True).last_hidden_state


def first_step(
    backbone: nn.Module, inputs: dict, regions: LayerRegions | None = None
) -> WholeStep | RecompilingStep:
    """The step saved by an earlier start, else one traced whole now (and saved), else (the
    trace breaks, or its guards cannot be saved) torch.compile's ordinary, recompiling path.
    The whole step compiles each decoder layer class once (``regions``); the recompiling path
    traces layers one by one, since a graph break inside a region is an error."""
    if regions is not None:
        regions.mark()
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
    if regions is not None:
        regions.unmark()
    return RecompilingStep(f"traced, not saved ({why_not})")


def trace_whole(backbone: nn.Module, inputs: dict):
    """``torch.compile``'s ahead-of-time compile of the step: one graph or an error."""
    mark_token_dims(inputs)
    whole = torch.compile(
        backbone_hidden_states,
        dynamic=True,
        fullgraph=True,
        options={"guard_filter_fn": SavedStep.guards_kept, **inductor_options()},
    )
    for _ in range(RESTARTS):
        try:
            with constant_floats():
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
            self.others = RecompilingStep("traced for other inputs", shared_layers=True)
        return self.others(backbone, **inputs)

    def report(self, seconds: float) -> None:
        report_first_step(self.source, self.how, seconds, graphs=1, breaks=0)


class RecompilingStep:
    """torch.compile's ordinary path: graph breaks allowed, inputs its guards reject traced anew."""

    def __init__(self, how: str, shared_layers: bool = False):
        self.compiled = torch.compile(backbone_hidden_states, dynamic=True, options=inductor_options())
        self.how = how
        # Only layers marked as regions need constant floats, and patching dynamo's config
        # costs ~50 us a call, so steps that trace unmarked layers do without.
        self.tracing_config = constant_floats if shared_layers else contextlib.nullcontext

    def __call__(self, backbone: nn.Module, **inputs) -> torch.Tensor:
        # Every call, not only the first: a recompile traces these too.
        mark_token_dims(inputs)
        with self.tracing_config():
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


def constant_floats():
    """Trace module floats (a norm's epsilon) as the constants they are: dynamo would otherwise
    make each an input read with ``.item()``, which a compiled region shared by layers cannot
    take from outside (torch fails to wire it to the next layer's call)."""
    return torch._dynamo.config.patch(specialize_float=True)


def mark_token_dims(inputs: dict) -> None:
    for name, dim in token_dims(inputs):
        torch._dynamo.decorators.mark_unbacked(inputs[name], dim)


def token_dims(inputs: dict) -> list[tuple[str, int]]:
    """(name, token dimension) of the backbone inputs given."""
    return [
        (name, dim % inputs[name].dim()) for name, dim in TOKEN_DIMS.items() if inputs.get(name) is not None
    ]


class LayerRegions:
    """The decoder layers as nested compile regions, one per layer class.

    torch then traces and generates one layer's code and calls it for every layer, instead of
    tracing and lowering 30 copies (SmolLM2's first compile: 39 -> 22 s). What differs between
    layers must be an input of the region: weights are, and so are the layer tensors that
    attention and packed linears take. Any other attribute a layer's code reads (a window size,
    a flag) is guarded, and a layer that differs gets a region of its own, but only when the
    region is the forward of the layer's class: torch does not guard attributes read by a
    forward bound to an instance (as our fusers bind rewritten ones). So a marked layer becomes
    an instance of a subclass whose ``forward`` is the region.
    """

    def __init__(self, backbone: nn.Module, attention: Iterable[nn.Module]):
        attention = set(attention)
        self.groups: dict[tuple[type, Callable], list[nn.Module]] = {}
        for layer in decoder_layers(backbone):
            forward = layer_forward(layer)
            if forward is not None and attention.intersection(layer.modules()):
                self.groups.setdefault((type(layer), forward), []).append(layer)

    def mark(self) -> None:
        for (cls, forward), layers in self.groups.items():
            for layer in layers:
                layer.__dict__.pop("forward", None)
                layer.__class__ = region_class(cls, forward)

    def unmark(self) -> None:
        """Back to the layers' own classes and forwards."""
        for (cls, forward), layers in self.groups.items():
            for layer in layers:
                layer.__class__ = cls
                if forward is not cls.forward:
                    bind_forward(layer, forward)

    def __str__(self) -> str:
        named = [f"{cls.__name__} (x{len(layers)})" for (cls, _), layers in self.groups.items()]
        return ", ".join(named) or "no decoder layer class"


def layer_forward(layer: nn.Module) -> Callable | None:
    """The function a layer runs as its forward: its class's, or one a fuser bound to it."""
    bound = layer.__dict__.get("forward")
    if bound is None:
        return type(layer).forward
    return bound.__func__ if getattr(bound, "__self__", None) is layer else None


@functools.cache
def region_class(cls: type, forward: Callable) -> type:
    """A subclass of ``cls`` whose forward is ``forward`` as a nested compile region.

    Saved steps pickle the layers' class with their guards, so it is a global of this module,
    its name that of ``cls`` and a digest of where it and the forward come from; printed
    modules keep the name of ``cls``.
    """
    code = forward.__code__
    origin = f"{cls.__module__}.{cls.__qualname__} {code.co_filename} {code.co_code.hex()} {code.co_names}"
    name = f"{cls.__name__}_{hashlib.sha256(origin.encode()).hexdigest()[:8]}"
    region = torch.compiler.nested_compile_region(forward, max_reuse_entries=MAX_LAYER_VARIANTS)
    namespace = {"forward": region, "_get_name": lambda self: cls.__name__, "__module__": __name__}
    subclass = type(name, (cls,), namespace)
    globals()[name] = subclass
    return subclass


def decoder_layers(backbone: nn.Module) -> Iterator[nn.Module]:
    """The entries of the backbone's module lists."""
    for module in backbone.modules():
        if isinstance(module, nn.ModuleList):
            yield from module


def probe_vector_units_in_background() -> None:
    """Inductor compiles ten tiny programs to learn which vector units this CPU has (8 s of a
    first compile on 2 cores; cached on disk after). Run them now, on another thread, so they
    are done while dynamo traces rather than after."""
    from torch._inductor import cpu_vec_isa

    threading.Thread(target=cpu_vec_isa.valid_vec_isa_list, name="inductor ISA probes", daemon=True).start()


def resolve_kernel_dispatch(module: nn.Module) -> None:
    """Settle which kernel each SGLang fused op (RMSNorm, SiluAndMul, ...) runs before tracing.

    They pick it on their first call and store it; traced before that, the graph guards on the
    empty slot and the next call compiles the whole step again.
    """
    for sub in module.modules():
        if getattr(sub, "_forward_method", False) is None and hasattr(sub, "_resolve_forward_method"):
            sub._forward_method = sub._resolve_forward_method()
