"""q/k/v projections of one input feeding attention -> one QKVParallelLinear plus a split.

Matched when the attention call's query, key and value each come from a distinct
``nn.Linear`` reading the same tensor. The fused layer is column-parallel by heads and
replicates KV heads across ranks when there are fewer than ranks, so TP needs no plan
for these projections. Checkpoint ``q/k/v`` tensors load into it as shards "q"/"k"/"v".
"""

from __future__ import annotations

import dataclasses

from torch import nn

from sglang_hf_backend.surgery.fusers import Fuser, FusionContext, Match
from sglang_hf_backend.surgery.fusers.rewrite import (
    ForwardSource,
    RewriteError,
    bind_forward,
    fuse_projection_calls,
)
from sglang_hf_backend.surgery.linear import HFQKVParallelLinear
from sglang_hf_backend.surgery.roles import attention_roles
from sglang_hf_backend.surgery.trace import ModuleTrace
from sglang_hf_backend.weights import Route

FUSED = "qkv_proj"


@dataclasses.dataclass(frozen=True)
class QKVDetail:
    q: str
    k: str
    v: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int


class QKVFuser(Fuser):
    name = "qkv"
    packed_modules_mapping = {FUSED: ["q_proj", "k_proj", "v_proj"]}

    def match(self, trace: ModuleTrace, instance: nn.Module, ctx: FusionContext) -> Match | None:
        roles = attention_roles(trace, instance)
        if roles is None or len(roles.inputs) != 3 or hasattr(instance, FUSED):
            return None
        q, k, v = (getattr(instance, name) for name in roles.inputs)
        if not all(type(p) is nn.Linear for p in (q, k, v)):
            return None
        if len({p.in_features for p in (q, k, v)}) != 1 or len({p.bias is None for p in (q, k, v)}) != 1:
            raise RewriteError("q/k/v differ in input size or bias")
        inputs = {trace.module_calls(name)[0].inputs[0] for name in roles.inputs}
        if len(inputs) != 1:
            return None  # not one shared input: nothing to fuse
        if any(ctx.placement(trace.instance, n).gather_output for n in roles.inputs):
            raise RewriteError("its code needs all heads' q/k/v, so they stay gathered and unfused")
        call = trace.attention_calls()[0].attention
        detail = QKVDetail(
            roles.q, roles.k, roles.v, call.num_heads, call.num_kv_heads, call.head_dim, call.v_head_dim
        )
        if (q.out_features, k.out_features, v.out_features) != (
            detail.num_heads * detail.head_dim,
            detail.num_kv_heads * detail.head_dim,
            detail.num_kv_heads * detail.v_head_dim,
        ):
            raise RewriteError("q/k/v sizes do not match the attention's head counts")
        source = ForwardSource(type(instance))
        fuse_projection_calls(source, [roles.q, roles.k, roles.v], FUSED, "split_sizes")
        description = f"{roles.q} + {roles.k} + {roles.v} -> {FUSED} (QKVParallelLinear)"
        return Match(self, type(instance), detail, source.compile(), description)

    def packed_names(self, match: Match) -> dict[str, list[str]]:
        return {FUSED: [match.detail.q, match.detail.k, match.detail.v]}

    def apply(self, root, name, instance, match: Match, quant_config) -> dict[str, Route]:
        detail: QKVDetail = match.detail
        q = getattr(instance, detail.q)
        fused = HFQKVParallelLinear(
            q.in_features,
            detail.head_dim,
            detail.num_heads,
            detail.num_kv_heads,
            bias=q.bias is not None,
            params_dtype=q.weight.dtype,
            quant_config=quant_config,
            prefix=f"{name}.{FUSED}",
            v_head_size=detail.v_head_dim,
        )
        for child in (detail.q, detail.k, detail.v):
            delattr(instance, child)
        setattr(instance, FUSED, fused)
        bind_forward(instance, match.forward)
        routes = {}
        for child, shard in ((detail.q, "q"), (detail.k, "k"), (detail.v, "v")):
            for param in ("weight", "bias") if fused.bias is not None else ("weight",):
                routes[f"{name}.{child}.{param}"] = Route(f"{name}.{FUSED}.{param}", shard)
        return routes
