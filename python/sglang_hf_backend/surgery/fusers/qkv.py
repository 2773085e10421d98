"""q/k/v projections of one input feeding attention -> one QKVParallelLinear plus a split.

Matched when the attention call's query, key and value each come from a distinct
``nn.Linear`` reading the same tensor. The fused layer is column-parallel by heads and
replicates KV heads across ranks when there are fewer than ranks, so TP needs no plan
for these projections. Checkpoint ``q/k/v`` tensors load into it as shards "q"/"k"/"v".
"""

from __future__ import annotations

import dataclasses

from torch import nn

from sglang_hf_backend.surgery.fusers.base import Fuser, FusionContext, Match, Packing
from sglang_hf_backend.surgery.fusers.rewrite import (
    ForwardSource,
    RewriteError,
    fuse_projection_calls,
    install_fused_layer,
)
from sglang_hf_backend.surgery.linear import HFQKVParallelLinear
from sglang_hf_backend.surgery.roles import attention_roles
from sglang_hf_backend.surgery.trace import ModuleTrace

FUSED = "qkv_proj"


@dataclasses.dataclass(frozen=True)
class QKVMatch(Match):
    q: str
    k: str
    v: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int


class QKVFuser(Fuser[QKVMatch]):
    name = "qkv"
    usual_packings = (Packing(FUSED, (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"))),)

    def match(self, trace: ModuleTrace, instance: nn.Module, ctx: FusionContext) -> QKVMatch | None:
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
        sizes = (q.out_features, k.out_features, v.out_features)
        if sizes != (
            call.num_heads * call.head_dim,
            call.num_kv_heads * call.head_dim,
            call.num_kv_heads * call.v_head_dim,
        ):
            raise RewriteError("q/k/v sizes do not match the attention's head counts")
        source = ForwardSource(type(instance))
        fuse_projection_calls(source, [roles.q, roles.k, roles.v], FUSED, "split_sizes")
        return QKVMatch(
            module_class=type(instance),
            description=f"{roles.q} + {roles.k} + {roles.v} -> {FUSED} (QKVParallelLinear)",
            forward=source.compile(),
            q=roles.q,
            k=roles.k,
            v=roles.v,
            num_heads=call.num_heads,
            num_kv_heads=call.num_kv_heads,
            head_dim=call.head_dim,
            v_head_dim=call.v_head_dim,
        )

    def packings(self, match: QKVMatch) -> tuple[Packing, ...]:
        return (Packing(FUSED, ((match.q, "q"), (match.k, "k"), (match.v, "v"))),)

    def fuse(self, name: str, instance: nn.Module, match: QKVMatch, quant_config) -> nn.Module:
        q = getattr(instance, match.q)
        fused = HFQKVParallelLinear(
            q.in_features,
            match.head_dim,
            match.num_heads,
            match.num_kv_heads,
            bias=q.bias is not None,
            params_dtype=q.weight.dtype,
            quant_config=quant_config,
            prefix=f"{name}.{FUSED}",
            v_head_size=match.v_head_dim,
        )
        install_fused_layer(instance, (match.q, match.k, match.v), FUSED, fused, match.forward)
        return instance
