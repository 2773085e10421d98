"""Two projections of one input combined as ``act(a) * b`` -> one merged GEMM (+ act-and-mul).

Matched on an MLP-shaped class: two up-projections (``nn.Linear``) read the same tensor
and feed one down-projection. When the code multiplies ``act(self.gate(x)) * self.up(x)``
and the activation is SiLU or GELU (checked numerically, not by name), the product
becomes SGLang's ``SiluAndMul``/``GeluAndMul`` on one ``MergedColumnParallelLinear``
(``GatedActivation``, which lets a packed CPU linear compute SiLU with its product);
otherwise the two projections are still merged and their outputs split apart.
"""

from __future__ import annotations

import ast
import dataclasses
from functools import partial

import torch
import torch.nn.functional as F
from sglang.srt.layers.activation import GeluAndMul, SiluAndMul
from torch import nn

from sglang_hf_backend.surgery.fusers.base import Fuser, FusionContext, Match, Packing
from sglang_hf_backend.surgery.fusers.rewrite import (
    ForwardSource,
    RewriteError,
    fuse_projection_calls,
    install_fused_layer,
    replace_node,
)
from sglang_hf_backend.surgery.linear import HFMergedColumnParallelLinear
from sglang_hf_backend.surgery.roles import mlp_roles
from sglang_hf_backend.surgery.trace import ModuleTrace

FUSED = "gate_up_proj"
ACT_AND_MUL = "act_and_mul"
# activation -> (reference function, the SGLang op computing act(x[..., :d]) * x[..., d:], label)
ACTIVATIONS = {
    "silu": (F.silu, SiluAndMul, "SiluAndMul"),
    "gelu": (partial(F.gelu, approximate="none"), partial(GeluAndMul, approximate="none"), "GeluAndMul"),
    "gelu_tanh": (
        partial(F.gelu, approximate="tanh"),
        partial(GeluAndMul, approximate="tanh"),
        "GeluAndMul(tanh)",
    ),
}


@dataclasses.dataclass(frozen=True)
class GateUpMatch(Match):
    gate: str
    up: str
    activation: str | None  # None: projections merged, activation left as written


class GateUpFuser(Fuser[GateUpMatch]):
    name = "mlp"
    usual_packings = (Packing(FUSED, (("gate_proj", 0), ("up_proj", 1))),)

    def match(self, trace: ModuleTrace, instance: nn.Module, ctx: FusionContext) -> GateUpMatch | None:
        roles = mlp_roles(trace, instance)
        if roles is None or len(roles.up) != 2 or hasattr(instance, FUSED):
            return None
        ups = [getattr(instance, name) for name in roles.up]
        if not all(type(p) is nn.Linear for p in ups):
            return None
        if ups[0].in_features != ups[1].in_features or (ups[0].bias is None) != (ups[1].bias is None):
            raise RewriteError("the two projections differ in input size or bias")
        if len({trace.module_calls(name)[0].inputs[0] for name in roles.up}) != 1:
            return None
        if any(ctx.placement(trace.instance, n).kind == "replicate" and ctx.tp_size > 1 for n in roles.up):
            raise RewriteError("the projections are not split across ranks in this layout")
        source = ForwardSource(type(instance))
        product = _act_times_up(source, instance, roles.up)
        if product is None:
            gate, up = roles.up
            fuse_projection_calls(source, [gate, up], FUSED, "split_sizes")
            activation, description = None, f"{gate} + {up} -> {FUSED} (MergedColumnParallelLinear)"
        else:
            node, gate, up, activation, argument = product
            gated = ast.Call(source.self_attribute(ACT_AND_MUL), [source.self_attribute(FUSED), argument], [])
            replace_node(source.function, node, gated)
            label = ACTIVATIONS[activation][2]
            description = f"{gate} + {up} -> {FUSED} (MergedColumnParallelLinear) + {label}"
        return GateUpMatch(type(instance), description, source.compile(), gate, up, activation)

    def packings(self, match: GateUpMatch) -> tuple[Packing, ...]:
        return (Packing(FUSED, ((match.gate, 0), (match.up, 1))),)

    def fuse(self, name: str, instance: nn.Module, match: GateUpMatch, quant_config) -> nn.Module:
        gate = getattr(instance, match.gate)
        fused = HFMergedColumnParallelLinear(
            gate.in_features,
            [gate.out_features, getattr(instance, match.up).out_features],
            bias=gate.bias is not None,
            params_dtype=gate.weight.dtype,
            quant_config=quant_config,
            prefix=f"{name}.{FUSED}",
        )
        install_fused_layer(instance, (match.gate, match.up), FUSED, fused, match.forward)
        if match.activation is not None:
            setattr(instance, ACT_AND_MUL, GatedActivation(match.activation))
        return instance


class GatedActivation(nn.Module):
    """``act(gate) * up`` of a merged gate/up projection, given the projection and its input.

    Where the projection's method computes SiLU-and-multiply with its product (packed CPU
    linears, ``cpu_linear``) that is one op, and a prefill never holds the [tokens, 2 x width]
    product; otherwise SGLang's act-and-mul on the projection's output.
    """

    def __init__(self, activation: str):
        super().__init__()
        self.silu = activation == "silu"
        self.act_and_mul = ACTIVATIONS[activation][1]()

    def forward(self, projection: nn.Module, x: torch.Tensor) -> torch.Tensor:
        method = getattr(projection, "quant_method", None)
        if self.silu and getattr(method, "computes_silu_and_mul", False) and not projection.gather_output:
            return method.silu_and_mul(projection, x, None if projection.skip_bias_add else projection.bias)
        return self.act_and_mul(projection(x))


def _act_times_up(source: ForwardSource, instance: nn.Module, ups: tuple[str, ...]):
    """Find ``act(self.a(x)) * self.b(x)`` (either order), each projection called only there.

    Returns (product node, gate, up, activation, x) or None.
    """
    if any(len(source.child_calls(u)) != 1 for u in ups):
        return None
    for node in ast.walk(source.function):
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)):
            continue
        for activated, plain in ((node.left, node.right), (node.right, node.left)):
            if not (isinstance(activated, ast.Call) and len(activated.args) == 1 and not activated.keywords):
                continue
            inner = activated.args[0]
            gate = next((u for u in ups if source.is_child_call(inner, u)), None)
            up = next((u for u in ups if source.is_child_call(plain, u)), None)
            if gate is None or up is None or gate == up:
                continue
            if ast.dump(source.single_argument(inner)) != ast.dump(source.single_argument(plain)):
                continue
            activation = identify_activation(_resolve(activated.func, source, instance))
            if activation is not None:
                return node, gate, up, activation, source.single_argument(plain)
    return None


def _resolve(expression: ast.expr, source: ForwardSource, instance: nn.Module):
    """The object an activation expression names (``self.act_fn``, ``nn.functional.silu``)."""
    code = compile(ast.Expression(body=expression), "<activation>", "eval")
    try:
        return eval(code, dict(source.globals), {source.self_name: instance})
    except Exception:
        return None


def identify_activation(fn) -> str | None:
    """Which known activation ``fn`` computes, judged by exact outputs on probe values."""
    if fn is None or not callable(fn):
        return None
    probes = [torch.linspace(-8, 8, 257, dtype=dtype) for dtype in (torch.float32, torch.bfloat16)]
    for name, (reference, _, _) in ACTIVATIONS.items():
        try:
            if all(torch.equal(fn(x), reference(x)) for x in probes):
                return name
        except Exception:
            return None
    return None
