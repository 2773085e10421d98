"""What each linear of a module class does, read off its dataflow trace.

Roles are found by following values through the trace, not by attribute names:
the projections whose outputs reach the attention call's query/key/value, the
projection that consumes the attention output, and an MLP's up- and down-projections.
Tensor parallelism and fusion both start from these roles.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from sglang_hf_backend.surgery.linear import is_linear
from sglang_hf_backend.surgery.trace import ModuleTrace, Node

SPLIT_OPS = {"split", "chunk", "unbind", "split_with_sizes", "tensor_split"}


@dataclasses.dataclass(frozen=True)
class AttentionRoles:
    """Child linears of an attention class; q/k/v may all name one packed projection."""

    q: str
    k: str
    v: str
    out: str | None

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((self.q, self.k, self.v)))


@dataclasses.dataclass(frozen=True)
class MlpRoles:
    up: tuple[str, ...]  # projections of the module input, combined elementwise
    down: str  # projection back to the hidden size


def child_linears(module: nn.Module) -> set[str]:
    return {name for name, child in module.named_children() if is_linear(child)}


def source_linears(trace: ModuleTrace, value: int, linears: set[str]) -> set[str]:
    """Linears whose outputs reach ``value`` without passing through another linear."""

    def producers(v: int):
        node = trace.producer(v)
        return [node] if node is not None else []

    return _first_linears(value, producers, lambda node: node.inputs, linears)


def sink_linears(trace: ModuleTrace, value: int, linears: set[str]) -> set[str]:
    """Linears that consume ``value`` (possibly after other ops), stopping at the first linear."""
    return _first_linears(value, trace.consumers, lambda node: node.outputs, linears)


def _first_linears(value: int, neighbours, onward, linears: set[str]) -> set[str]:
    """Walk the dataflow from ``value`` (either direction) up to the first linear on each path."""
    found, seen, stack = set(), set(), [value]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        for node in neighbours(current):
            if node.kind == "module" and node.target in linears:
                found.add(node.target)
            else:
                stack.extend(onward(node))
    return found


def linear_output(trace: ModuleTrace, child: str) -> int | None:
    calls = trace.module_calls(child)
    return calls[0].outputs[0] if calls and calls[0].outputs else None


def split_parts(trace: ModuleTrace, child: str) -> int:
    """How many parts a linear's output is cut into right away (1 if it is not)."""
    out = linear_output(trace, child)
    if out is None:
        return 1
    for node in trace.consumers(out):
        if node.kind == "op" and node.target in SPLIT_OPS and len(node.outputs) > 1:
            return len(node.outputs)
    return 1


def attention_roles(trace: ModuleTrace, module: nn.Module) -> AttentionRoles | None:
    """The projections around the (single) attention call of this class, if clear-cut."""
    calls = trace.attention_calls()
    if len(calls) != 1:
        return None
    call: Node = calls[0]
    linears = child_linears(module)
    sources = [source_linears(trace, value, linears) for value in call.inputs[:3]]
    if any(len(s) != 1 for s in sources):
        return None
    q, k, v = (next(iter(s)) for s in sources)
    sinks = sink_linears(trace, call.outputs[0], linears) if call.outputs else set()
    return AttentionRoles(q, k, v, next(iter(sinks)) if len(sinks) == 1 else None)


def mlp_roles(trace: ModuleTrace, module: nn.Module) -> MlpRoles | None:
    """Up-projections feeding one down-projection that produces the module output."""
    if trace.attention_calls() or not trace.outputs:
        return None
    linears = child_linears(module)
    downs = source_linears(trace, trace.outputs[0], linears)
    if len(downs) != 1:
        return None
    down = next(iter(downs))
    call = trace.module_calls(down)[0]
    ups = set().union(*(source_linears(trace, v, linears) for v in call.inputs))
    if not ups or down in ups:
        return None
    # Every up-projection must read the module input directly, not another linear.
    for up in ups:
        if source_linears(trace, trace.module_calls(up)[0].inputs[0], linears):
            return None
    return MlpRoles(tuple(sorted(ups)), down)


def is_expert_bank(module: nn.Module) -> bool:
    """A bank of experts: every expert's weights stacked as ``[experts, ...]`` parameters.

    transformers 5 stores MoE experts this way (``gate_up_proj``/``down_proj`` of shape
    ``[experts, out, in]``); any biases are ``[experts, out]``. Child modules, if any (an
    activation), hold no parameters.
    """
    params = list(module.parameters(recurse=False))
    if not params or not any(p.ndim == 3 for p in params) or any(p.ndim < 2 for p in params):
        return False
    if len({p.shape[0] for p in params}) != 1:
        return False
    return not any(True for child in module.children() for _ in child.parameters())


@dataclasses.dataclass(frozen=True)
class MoERoles:
    """A sparse-MoE block: a router child choosing experts for an expert-bank child."""

    router: str
    experts: str
    router_outputs: tuple[str, ...]  # each router output: "indices", "weights" or "logits"


# Ops that only change a value's dtype or layout: routing read through them is unchanged.
_PASS_THROUGH_OPS = {"to", "float", "type", "contiguous", "view", "reshape"}


def _bank_calls(trace: ModuleTrace, module: nn.Module) -> list[Node]:
    return [
        node
        for node in trace.nodes
        if node.kind == "module" and is_expert_bank(getattr(module, node.target, nn.Module()))
    ]


def calls_expert_bank(trace: ModuleTrace, module: nn.Module) -> bool:
    return bool(_bank_calls(trace, module))


def moe_roles(trace: ModuleTrace, module: nn.Module) -> MoERoles | None:
    """The router and expert bank of a block that calls ``experts(hidden, indices, weights)``.

    The expert choice (indices and weights) must come out of one child module's call, the
    router (dtype casts and reshapes between them aside); routing computed in the
    block's own code is not recognised.
    """
    banks = _bank_calls(trace, module)
    if len(banks) != 1 or len(banks[0].inputs) != 3:
        return None
    (router, indices), (other, weights) = (_origin(trace, value) for value in banks[0].inputs[1:])
    if router is None or router is not other or router.kind != "module":
        return None
    names = {indices: "indices", weights: "weights"}
    return MoERoles(router.target, banks[0].target, tuple(names.get(v, "logits") for v in router.outputs))


def _origin(trace: ModuleTrace, value: int) -> tuple[Node | None, int]:
    """The node that produced ``value`` and which of its outputs, looking through pass-through ops."""
    node = trace.producer(value)
    while node is not None and node.kind == "op" and node.target in _PASS_THROUGH_OPS and node.inputs:
        value = node.inputs[0]
        node = trace.producer(value)
    return node, value
