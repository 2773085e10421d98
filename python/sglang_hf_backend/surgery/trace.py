"""Dataflow traces of HF module classes, recorded from one forward on the meta device.

Every later decision (which modules are attention layers, what can be fused, which
projections shard column- or row-wise) is read off these traces instead of off
per-model tables or attribute names. One forward of the whole backbone on meta
tensors costs no memory and records, for the first instance of each module class,
the torch ops of its own ``forward`` with its child modules kept opaque (a call of a
child is one node). Unlike ``torch.fx`` symbolic tracing, running the real code
copes with Python control flow, shape unpacking and remote-code quirks.

Attention calls are recorded by our attention function (see ``attention.py``), which
reports each call to the active tracer instead of computing attention. Modules whose
code cannot run on meta tensors at all (a bank of experts that picks its tokens with
data-dependent indexing) can be kept opaque: they are recorded as one call in their
parent and answer with an empty tensor shaped like their first input.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten


@dataclasses.dataclass
class Node:
    """One step of a module's forward: a torch op, a child-module call or an attention call."""

    kind: str  # "op" | "module" | "attention"
    target: str  # op name, child attribute name, or "attention"
    inputs: list[int]
    outputs: list[int]
    attention: "AttentionCall | None" = None  # set on attention nodes


@dataclasses.dataclass
class ModuleTrace:
    """The recorded forward of one module class (from its first instance)."""

    module_class: type
    instance: str  # qualified name of the traced instance
    call: tuple[tuple, dict]  # the meta args/kwargs it was called with, for re-runs
    inputs: list[int]
    outputs: list[int] = dataclasses.field(default_factory=list)
    nodes: list[Node] = dataclasses.field(default_factory=list)
    returns_tensor: bool = True  # a bare tensor, not a tuple or model output

    def producer(self, value: int) -> Node | None:
        for node in self.nodes:
            if value in node.outputs:
                return node
        return None

    def consumers(self, value: int) -> list[Node]:
        return [node for node in self.nodes if value in node.inputs]

    def module_calls(self, child: str) -> list[Node]:
        return [n for n in self.nodes if n.kind == "module" and n.target == child]

    def attention_calls(self) -> list[Node]:
        return [n for n in self.nodes if n.kind == "attention"]


@dataclasses.dataclass
class AttentionCall:
    """What one attention module passed to the attention function during the trace."""

    module: nn.Module
    order: int  # position among all attention calls of the forward
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    kwargs: dict[str, Any]


@dataclasses.dataclass
class ModelTrace:
    """Traces per module class plus every attention call, from one meta forward."""

    classes: dict[type, ModuleTrace]
    attention_calls: list[AttentionCall]
    class_instances: dict[type, list[tuple[str, nn.Module]]]


_ACTIVE: "_Tracer | None" = None

# Python code that branches on tensor values (GPT-2 checks whether a pad token is in
# input_ids) cannot read meta tensors; such reads answer "zero / false" during a trace.
_VALUE_READS = {
    torch.Tensor.item: 0,
    torch.Tensor.__bool__: False,
    torch.Tensor.__contains__: False,
    torch.Tensor.__int__: 0,
    torch.Tensor.__index__: 0,
    torch.Tensor.__float__: 0.0,
}


def _has_meta_tensor(args) -> bool:
    leaves, _ = tree_flatten(args)
    return any(isinstance(x, torch.Tensor) and x.is_meta for x in leaves)


def active_tracer() -> "_Tracer | None":
    """The tracer of the meta forward in progress, if any (read by the attention function)."""
    return _ACTIVE


class _Frame:
    def __init__(self, trace: ModuleTrace | None):
        self.trace = trace


class _Tracer(TorchFunctionMode):
    def __init__(self, root: nn.Module):
        super().__init__()
        self.root = root
        self.names = {module: name for name, module in root.named_modules()}
        self.classes: dict[type, ModuleTrace] = {}
        self.attention_calls: list[AttentionCall] = []
        self.frames: list[_Frame] = []
        self.ids: dict[int, int] = {}
        self.keep_alive: list[torch.Tensor] = []

    # -- value identities ----------------------------------------------------
    def value_ids(self, tree: Any) -> list[int]:
        leaves, _ = tree_flatten(tree)
        return [self.value_id(leaf) for leaf in leaves if isinstance(leaf, torch.Tensor)]

    def value_id(self, tensor: torch.Tensor) -> int:
        key = id(tensor)
        if key not in self.ids:
            self.ids[key] = len(self.ids)
            self.keep_alive.append(tensor)  # ids stay unique while the trace lives
        return self.ids[key]

    # -- recording -------------------------------------------------------------
    def record(self, node: Node) -> None:
        if self.frames and self.frames[-1].trace is not None:
            self.frames[-1].trace.nodes.append(node)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _VALUE_READS and _has_meta_tensor(args):
            return _VALUE_READS[func]  # meta tensors hold no values: take the plain branch
        out = func(*args, **kwargs)
        if self.frames and self.frames[-1].trace is not None:
            inputs = self.value_ids((args, kwargs))
            outputs = self.value_ids(out)
            if inputs or outputs:
                name = getattr(func, "__name__", str(func))
                self.record(Node("op", name, inputs, outputs))
        return out

    def record_attention(self, module, query, key, value, kwargs, output) -> None:
        _, num_heads, _, head_dim = query.shape
        call = AttentionCall(
            module=module,
            order=len(self.attention_calls),
            num_heads=num_heads,
            num_kv_heads=key.shape[1],
            head_dim=head_dim,
            v_head_dim=value.shape[-1],
            kwargs=kwargs,
        )
        self.attention_calls.append(call)
        inputs = self.value_ids((query, key, value))
        self.record(Node("attention", "attention", inputs, self.value_ids(output), call))

    # -- module boundaries -----------------------------------------------------
    def pre_hook(self, module, args, kwargs):
        inputs = self.value_ids((args, kwargs))
        first_of_class = type(module) not in self.classes
        trace = None
        if first_of_class:
            trace = ModuleTrace(type(module), self.names.get(module, ""), (args, kwargs), inputs)
        if trace is not None:
            self.classes[type(module)] = trace
        self.frames.append(_Frame(trace))

    def post_hook(self, module, args, kwargs, output):
        frame = self.frames.pop()
        outputs = self.value_ids(output)
        if frame.trace is not None:
            frame.trace.outputs = outputs
            frame.trace.returns_tensor = isinstance(output, torch.Tensor)
        parent = self.names.get(module, "")
        child_name = parent.rsplit(".", 1)[-1]
        self.record(Node("module", child_name, self.value_ids((args, kwargs)), outputs))


@contextlib.contextmanager
def _buffers_on_meta(model: nn.Module) -> Iterator[None]:
    """Meta copies of all buffers for the trace; the real ones come back afterwards."""
    saved = []
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.device.type != "meta":
                saved.append((module, name, buf))
                module._buffers[name] = buf.to("meta")
    try:
        yield
    finally:
        for module, name, buf in saved:
            module._buffers[name] = buf


@contextlib.contextmanager
def _opaque(modules: list[nn.Module]) -> Iterator[None]:
    """Stand-in forwards for ``modules``: an empty tensor shaped like the first input."""

    def stand_in(*args, **kwargs):
        first = next(x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor))
        return torch.empty_like(first)

    for module in modules:
        module.forward = stand_in
    try:
        yield
    finally:
        for module in modules:
            del module.forward


def _run_traced(root: nn.Module, run, opaque: Callable[[nn.Module], bool] | None = None) -> _Tracer:
    """Run ``run()`` with every module of ``root`` hooked and torch ops recorded."""
    global _ACTIVE
    tracer = _Tracer(root)
    handles = []
    for module in root.modules():
        handles.append(module.register_forward_pre_hook(tracer.pre_hook, with_kwargs=True))
        handles.append(module.register_forward_hook(tracer.post_hook, with_kwargs=True))
    stand_ins = [m for m in root.modules() if opaque is not None and opaque(m)]
    _ACTIVE = tracer
    try:
        with _buffers_on_meta(root), _opaque(stand_ins), torch.no_grad(), tracer:
            run()
    finally:
        _ACTIVE = None
        for handle in handles:
            handle.remove()
    return tracer


def trace_model(
    backbone: nn.Module, opaque: Callable[[nn.Module], bool] | None = None, seq_len: int = 8
) -> ModelTrace:
    """Run ``backbone`` once on meta inputs and return what each module class did.

    Modules for which ``opaque(module)`` is true are not run (see the module docstring).
    """
    input_ids = torch.zeros((1, seq_len), dtype=torch.long, device="meta")
    position_ids = torch.arange(seq_len, device="meta")[None]
    tracer = _run_traced(
        backbone,
        lambda: backbone(input_ids=input_ids, position_ids=position_ids, use_cache=False),
        opaque,
    )
    instances: dict[type, list[tuple[str, nn.Module]]] = {}
    for name, module in backbone.named_modules():
        instances.setdefault(type(module), []).append((name, module))
    return ModelTrace(tracer.classes, tracer.attention_calls, instances)


def rerun_attention(module: nn.Module, trace: ModuleTrace) -> list[AttentionCall]:
    """Re-run ``module`` on its traced meta inputs; the attention calls it makes now.

    Used to test a sharding layout before committing to it: children swapped for
    meta stand-ins of per-rank size either run through, or raise.
    """
    args, kwargs = trace.call
    return _run_traced(module, lambda: module(*args, **kwargs)).attention_calls
