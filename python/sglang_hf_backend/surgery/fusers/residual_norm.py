"""Residual add followed by a fused-capable norm -> the norm's ``forward(x, residual)`` form.

Matched in a layer's forward where three statements read
``h = residual + h; residual = h; h = self.<norm>(h)`` and ``<norm>`` was replaced by
an SGLang norm (``rms_norm.py``). They become ``h, residual = self.<norm>(h, residual)``,
which SGLang's kernels compute in one pass; the native path computes the same sum.
"""

from __future__ import annotations

import ast
import dataclasses

from torch import nn

from sglang_hf_backend.surgery.fusers.base import Fuser, FusionContext, Match
from sglang_hf_backend.surgery.fusers.rewrite import ForwardSource, bind_forward
from sglang_hf_backend.surgery.fusers.rms_norm import RMSNormFuser
from sglang_hf_backend.surgery.trace import ModuleTrace


@dataclasses.dataclass(frozen=True)
class ResidualMatch(Match):
    norms: tuple[str, ...]


class ResidualNormFuser(Fuser[ResidualMatch]):
    name = "residual"
    requires = (RMSNormFuser.name,)  # only SGLang's norms take the residual

    def match(self, trace: ModuleTrace, instance: nn.Module, ctx: FusionContext) -> ResidualMatch | None:
        fused_norms = ctx.matched_classes(RMSNormFuser.name)
        norms = {name for name, child in instance.named_children() if type(child) in fused_norms}
        if not norms:
            return None
        source = ForwardSource(type(instance))
        fused = []
        body = source.function.body
        index = 0
        while index + 2 < len(body):
            norm = _add_then_norm(source, body[index : index + 3], norms)
            if norm is None:
                index += 1
                continue
            hidden, residual = body[index].targets[0].id, body[index + 1].targets[0].id
            body[index : index + 3] = [_fused_statement(source, norm, hidden, residual)]
            fused.append(norm)
            index += 1
        if not fused:
            return None
        description = " + ".join(f"residual add + {n}" for n in fused) + " -> fused add-norm"
        return ResidualMatch(type(instance), description, source.compile(), tuple(fused))

    def fuse(self, name: str, instance: nn.Module, match: ResidualMatch, quant_config) -> nn.Module:
        bind_forward(instance, match.forward)
        return instance


def _add_then_norm(source: ForwardSource, statements: list[ast.stmt], norms: set[str]) -> str | None:
    """The norm's name if the statements are ``h = r + h; r = h; h = self.norm(h)``."""
    add, keep, normalise = statements
    if not all(isinstance(s, ast.Assign) and len(s.targets) == 1 for s in statements):
        return None
    if not all(isinstance(s.targets[0], ast.Name) for s in statements):
        return None
    hidden = add.targets[0].id
    if not (isinstance(add.value, ast.BinOp) and isinstance(add.value.op, ast.Add)):
        return None
    operands = [add.value.left, add.value.right]
    if not all(isinstance(o, ast.Name) for o in operands):
        return None
    names = [o.id for o in operands]
    if hidden not in names or len(set(names)) != 2:
        return None
    residual = next(n for n in names if n != hidden)
    if not (keep.targets[0].id == residual and isinstance(keep.value, ast.Name) and keep.value.id == hidden):
        return None
    call = normalise.value
    if normalise.targets[0].id != hidden:
        return None
    norm = next((n for n in norms if source.is_child_call(call, n)), None)
    if (
        norm is None
        or len(call.args) != 1
        or not isinstance(call.args[0], ast.Name)
        or call.args[0].id != hidden
    ):
        return None
    return norm


def _fused_statement(source: ForwardSource, norm: str, hidden: str, residual: str) -> ast.Assign:
    call = ast.Call(
        func=source.self_attribute(norm),
        args=[ast.Name(id=hidden, ctx=ast.Load()), ast.Name(id=residual, ctx=ast.Load())],
        keywords=[],
    )
    targets = ast.Tuple(
        elts=[ast.Name(id=hidden, ctx=ast.Store()), ast.Name(id=residual, ctx=ast.Store())], ctx=ast.Store()
    )
    return ast.Assign(targets=[targets], value=call)
