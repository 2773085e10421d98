"""Tensor-parallel layout of an HF model, on SGLang's TP group.

The layout starts from the model's own TP plan (transformers' ``tp_plan``, merged
from the class, the config's ``base_model_tp_plan`` and children) when it has one,
and is inferred from the dataflow roles otherwise (GPT-2, OPT, remote code, and MLPs
a plan leaves out, such as an MoE block's shared expert):
projections into attention and MLP up-projections split by output features, their
consumers by input features, everything else replicated.

Two rules hold for every model because of how attention runs here: each rank runs
attention on its own heads (the KV cache is allocated per rank for those), so the
projection that consumes attention output always takes a split input; and with fewer
KV heads than ranks, key/value projections are replicated and each rank picks the
KV head its query heads use, as SGLang's ``QKVParallelLinear`` does. A sharded layout
is tried on meta tensors first; where a module's code cannot run on per-rank sizes
(e.g. ``split(self.split_size)``, or a norm over all heads) its attention inputs are
gathered instead, which keeps results exact.
"""

from __future__ import annotations

import dataclasses
import logging
import re

from torch import nn
from transformers.pytorch_utils import Conv1D

from sglang_hf_backend.surgery.linear import (
    COLUMN,
    REPLICATE,
    ROW,
    Placement,
    is_linear,
    linear_dims,
)
from sglang_hf_backend.surgery.roles import (
    AttentionRoles,
    attention_roles,
    child_linears,
    mlp_roles,
    sink_linears,
    split_parts,
)
from sglang_hf_backend.surgery.trace import AttentionCall, ModelTrace, rerun_attention

logger = logging.getLogger(__name__)

# transformers 5.19 styles -> how a linear is laid out. Styles that shard something
# other than a dense linear (experts, routers, norms) replicate here.
TP_STYLES: dict[str, Placement] = {
    "colwise": COLUMN,
    "colwise_gather_output": Placement("column", gather_output=True),
    "colwise_rep": Placement("column", gather_output=True),
    "rowwise": ROW,
    "rowwise_split_input": Placement("row", input_is_parallel=False),
    "rowwise_rep": Placement("row", input_is_parallel=False),
    "packed_colwise": Placement("column", packed=2),
    "packed_rowwise": Placement("row", packed=2),
    "embedding_rowwise": REPLICATE,  # the embedding itself is always vocab-parallel
    "sequence_parallel": REPLICATE,
    "replicated_with_grad_allreduce": REPLICATE,
    "all_reduce": REPLICATE,
    "grouped_gemm": REPLICATE,
    "ep_router": REPLICATE,
    "ep_dispatch_experts": REPLICATE,
    "megamoe_router": REPLICATE,
    "moe_tp_experts": REPLICATE,
    "megamoe_experts": REPLICATE,
    "moe_identity_expert": REPLICATE,
    "mla_kv_a_proj": REPLICATE,
}


class TensorParallelError(ValueError):
    """The model cannot be split across the requested number of ranks."""


@dataclasses.dataclass
class TPLayout:
    """Placement of every linear (by qualified name under the backbone) plus provenance."""

    placements: dict[str, Placement]
    source: str  # "plan" or "inferred"
    notes: list[str] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        """Compact ``pattern -> placement`` lines for the log, layers folded to ``*``."""
        folded: dict[str, str] = {}
        for name, placement in self.placements.items():
            if placement.kind != "replicate":
                folded.setdefault(re.sub(r"\.\d+\.", ".*.", name), placement.describe())
        lines = [f"{pattern} -> {desc}" for pattern, desc in folded.items()]
        return "; ".join(lines + self.notes) or "all replicated"


def model_tp_plan(backbone: nn.Module) -> dict[str, str]:
    """The backbone's merged plan (keys relative to the backbone)."""
    return dict(getattr(backbone, "tp_plan", None) or {})


def style_of(name: str, plan: dict[str, str]) -> str | None:
    return plan.get(re.sub(r"\.\d+(?=\.|$)", ".*", name))


def placement_of_style(style: str, name: str) -> Placement:
    try:
        return TP_STYLES[style]
    except KeyError:
        raise TensorParallelError(
            f"Unknown tensor-parallel style {style!r} for {name!r} in the model's tp_plan; "
            f"sglang_hf_backend knows {sorted(TP_STYLES)}."
        ) from None


def check_heads_divisible(calls: list[AttentionCall], tp_size: int) -> None:
    for call in calls:
        owner = type(call.module).__name__
        if call.num_heads % tp_size:
            raise TensorParallelError(
                f"{owner} has {call.num_heads} attention heads, which cannot be split across "
                f"tp_size={tp_size}; use a tp_size that divides {call.num_heads}."
            )
        kv = call.num_kv_heads
        if (kv >= tp_size and kv % tp_size) or (kv < tp_size and tp_size % kv):
            raise TensorParallelError(
                f"{owner} has {kv} key/value heads, which cannot be split or replicated across "
                f"tp_size={tp_size}; use a tp_size that divides {kv} or is a multiple of it."
            )


def plan_tensor_parallel(backbone: nn.Module, trace: ModelTrace, tp_size: int) -> TPLayout:
    """Placement for every linear of ``backbone`` across ``tp_size`` ranks."""
    plan = model_tp_plan(backbone)
    placements: dict[str, Placement] = {}
    for name, module in backbone.named_modules():
        if is_linear(module):
            style = style_of(name, plan)
            placement = placement_of_style(style, name) if style else REPLICATE  # unknown styles raise
            placements[name] = placement if tp_size > 1 else REPLICATE
    layout = TPLayout(placements, "plan" if plan else "inferred")
    if tp_size == 1:
        return layout
    check_heads_divisible(trace.attention_calls, tp_size)
    for module_class, class_trace in trace.classes.items():
        instances = trace.class_instances.get(module_class, [])
        if not instances:
            continue
        _, first = instances[0]
        roles = attention_roles(class_trace, first)
        mlp = mlp_roles(class_trace, first) if roles is None else None
        if roles is not None:
            local = _attention_layout(first, class_trace, roles, layout, plan, tp_size)
            if roles.out is None:
                _place_output_projection_elsewhere(backbone, trace, class_trace.instance, layout)
        elif mlp is not None and not _planned(class_trace.instance, mlp.up + (mlp.down,), plan):
            local = {up: Placement("column", packed=split_parts(class_trace, up)) for up in mlp.up}
            local[mlp.down] = ROW
            if plan:
                layout.notes.append(f"{module_class.__name__}: not in the model's tp_plan, inferred")
        else:
            continue
        for instance_name, _ in instances:
            prefix = f"{instance_name}." if instance_name else ""
            for child, placement in local.items():
                layout.placements[prefix + child] = placement
    _check_divisible(backbone, layout, tp_size)
    return layout


def _planned(instance: str, children: tuple[str, ...], plan: dict[str, str]) -> bool:
    prefix = f"{instance}." if instance else ""
    return any(style_of(prefix + child, plan) for child in children)


def _attention_layout(
    module: nn.Module,
    class_trace,
    roles: AttentionRoles,
    layout: TPLayout,
    plan: dict[str, str],
    tp_size: int,
) -> dict[str, Placement]:
    """q/k/v/out placements for one attention class, checked on meta tensors."""
    prefix = f"{class_trace.instance}." if class_trace.instance else ""
    local = {
        child: layout.placements[prefix + child]
        if plan
        else Placement("column", packed=split_parts(class_trace, child))
        for child in roles.inputs
    }
    if roles.out is not None:
        local[roles.out] = ROW  # attention output is always this rank's heads
    if _first_call(class_trace).num_kv_heads < tp_size and roles.k != roles.q:
        for child in {roles.k, roles.v}:
            local[child] = REPLICATE  # each rank picks its KV head from the full output
    if not _runs_sharded(module, class_trace, local, tp_size):
        gathered = Placement("column", gather_output=True)
        local.update({child: gathered for child in roles.inputs})
        layout.notes.append(f"{type(module).__name__}: attention inputs gathered (its code needs all heads)")
    return local


def _place_output_projection_elsewhere(backbone: nn.Module, trace: ModelTrace, instance: str, layout) -> None:
    """Row-split the projection that consumes attention output in a sibling module.

    BERT-style layers compute attention in one module (``BertSelfAttention``) and project
    its output in the next one (``BertSelfOutput.dense``); the parent's trace shows the
    attention module's output flowing into that sibling. Each rank's attention output
    holds its own heads, so that projection must take a split input.
    """
    parent_name, _, attribute = instance.rpartition(".")
    parent = backbone.get_submodule(parent_name)
    parent_trace = trace.classes.get(type(parent))
    calls = parent_trace.module_calls(attribute) if parent_trace is not None else []
    if parent_trace is None or parent_trace.instance != parent_name or len(calls) != 1:
        raise _no_output_projection(instance)
    value = calls[0].outputs[0]
    for node in parent_trace.consumers(value):
        sibling = getattr(parent, node.target, None) if node.kind == "module" else None
        sibling_trace = trace.classes.get(type(sibling))
        if sibling_trace is None or sibling_trace.instance != f"{parent_name}.{node.target}":
            continue
        sinks = sink_linears(sibling_trace, value, child_linears(sibling))
        if len(sinks) == 1:
            (projection,) = sinks
            for name, _ in trace.class_instances[type(sibling)]:
                layout.placements[f"{name}.{projection}"] = ROW
            return
    raise _no_output_projection(instance)


def _no_output_projection(instance: str) -> TensorParallelError:
    return TensorParallelError(
        f"{instance}: no single projection consumes the attention output, so its per-rank heads "
        "cannot be joined again; serve this model with tp_size=1."
    )


def _first_call(class_trace) -> AttentionCall:
    return class_trace.attention_calls()[0].attention


def _runs_sharded(module: nn.Module, class_trace, local: dict[str, Placement], tp_size: int) -> bool:
    """Does the module's forward run, with local heads, when its children hold one rank's share?"""
    saved = {name: getattr(module, name) for name in local}
    try:
        for name, placement in local.items():
            setattr(module, name, _meta_stand_in(saved[name], placement, tp_size))
        calls = rerun_attention(module, class_trace)
    except Exception as exc:  # any failure means the code needs full-size tensors
        logger.debug("sharded layout of %s does not run: %s", type(module).__name__, exc)
        return False
    finally:
        for name, child in saved.items():
            setattr(module, name, child)
    return len(calls) == 1 and _heads_are_local(calls[0], class_trace, tp_size)


def _heads_are_local(call: AttentionCall, class_trace, tp_size: int) -> bool:
    full = _first_call(class_trace)
    kv_ok = call.num_kv_heads in {max(1, full.num_kv_heads // tp_size), full.num_kv_heads}
    return call.num_heads == full.num_heads // tp_size and kv_ok and call.head_dim == full.head_dim


def _meta_stand_in(child: nn.Module, placement: Placement, tp_size: int) -> nn.Module:
    in_features, out_features = linear_dims(child)
    if placement.kind == "column" and not placement.gather_output:
        out_features //= tp_size
    elif placement.kind == "row":
        in_features //= tp_size
    bias = child.bias is not None
    if isinstance(child, Conv1D):
        return Conv1D(out_features, in_features).to("meta")
    return nn.Linear(in_features, out_features, bias=bias, device="meta")


def _check_divisible(backbone: nn.Module, layout: TPLayout, tp_size: int) -> None:
    for name, placement in layout.placements.items():
        if placement.kind == "replicate":
            continue
        in_features, out_features = linear_dims(backbone.get_submodule(name))
        size, what = (out_features, "output") if placement.kind == "column" else (in_features, "input")
        if size % (tp_size * placement.packed):
            raise TensorParallelError(
                f"{name} has {size} {what} features, which cannot be split across "
                f"tp_size={tp_size}"
                + (f" in {placement.packed} packed parts" if placement.packed > 1 else "")
                + "; choose a tp_size that divides it."
            )


def local_input_features(backbone: nn.Module, layout: TPLayout, tp_size: int) -> dict[str, int]:
    """Input features each rank's share of every linear has (row-parallel ones are split)."""
    features = {}
    for name, placement in layout.placements.items():
        in_features, _ = linear_dims(backbone.get_submodule(name))
        features[name] = in_features // tp_size if placement.kind == "row" else in_features
    return features
