"""A sparse-MoE block's router and expert bank -> SGLang's TopK and FusedMoE.

Matched on a block that calls ``experts(hidden, indices, weights)`` on a bank of experts
(``roles.moe_roles``) with the indices and weights straight out of a router child, the
transformers 5 layout of every MoE family. The block's own code keeps running (shared
experts and their gates, reshapes); its router becomes ``MoERouter`` (the same logits,
then SGLang's ``TopK``) and its bank ``HFFusedMoE`` (SGLang's ``FusedMoE``, which splits
experts by TP and EP ranks). Nothing is read off names: the routing (softmax or sigmoid,
a selection-only correction bias, renormalisation, a constant scale) and the experts'
layout and activation are identified by running copies of the HF modules on probe
values and comparing with what SGLang computes. A block that matches none of these is
refused before any weight is read, naming the module and what differed.
Checkpoint experts load one ``[out, in]`` tensor per expert and shard straight into
this rank's slice, whether the checkpoint stores one tensor per expert (found through
transformers' conversion mapping) or transformers 5's stacked ``[experts, ...]`` tensors.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from sglang_hf_backend.compat import IncompatibleModelError
from sglang_hf_backend.surgery.fusers.base import Fuser, FusionContext, Match
from sglang_hf_backend.surgery.roles import calls_expert_bank, moe_roles
from sglang_hf_backend.surgery.trace import ModuleTrace
from sglang_hf_backend.weights import Load, Piece, load_key

DISABLE_HINT = "SGLANG_HF_BACKEND_DISABLE_FUSIONS=moe"
# activation name (as SGLang's FusedMoE takes it) -> reference
ACTIVATIONS = {
    "silu": F.silu,
    "gelu": lambda x: F.gelu(x, approximate="tanh"),  # FusedMoE's GeluAndMul is the tanh form
}


@dataclasses.dataclass(frozen=True)
class Routing:
    """What the HF router computes, in SGLang's TopK terms."""

    top_k: int
    scoring: str  # "softmax" | "sigmoid"
    renormalize: bool
    scale: float  # constant factor on the chosen weights
    weight: str  # the router's [experts, hidden] parameter
    correction_bias: str | None  # a [experts] tensor added to the scores for selection only
    outputs: tuple[str, ...]  # what the router returns, in order: "logits" | "weights" | "indices"

    def describe(self) -> str:
        parts = [f"top-{self.top_k}", self.scoring]
        if self.correction_bias:
            parts.append("correction bias")
        if self.renormalize:
            parts.append("renormalised")
        if self.scale != 1.0:
            parts.append(f"scaled x{self.scale:g}")
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """How the HF bank stores its experts and which activation joins gate and up."""

    gate_up: str  # parameter holding [gate; up] per expert
    down: str
    transposed: bool  # [experts, in, out] instead of [experts, out, in]
    activation: str
    num_experts: int
    hidden_size: int
    intermediate_size: int


@dataclasses.dataclass(frozen=True)
class MoEMatch(Match):
    router: str
    experts: str
    routing: Routing
    layout: ExpertLayout


class MoEFuser(Fuser[MoEMatch]):
    name = "moe"

    def match(self, trace: ModuleTrace, instance: nn.Module, ctx: FusionContext) -> MoEMatch | None:
        if not calls_expert_bank(trace, instance):
            return None
        owner = type(instance).__name__
        roles = moe_roles(trace, instance)
        try:
            if roles is None:
                raise _Unmappable(
                    "it calls its experts with indices and weights that do not come straight out "
                    "of one router module"
                )
            bank = getattr(instance, roles.experts)
            layout = identify_experts(bank)
            routing = identify_routing(getattr(instance, roles.router), layout, roles.router_outputs)
        except _Unmappable as reason:
            raise IncompatibleModelError(
                f"{owner} is a mixture-of-experts block that SGLang's TopK and FusedMoE cannot "
                f"reproduce exactly: {reason}. sglang_hf_backend refuses rather than approximating. "
                f"Run its experts as HF code, unfused and slower, with {DISABLE_HINT}, or serve the "
                "model with SGLang's native implementation (model_impl='sglang') if it has one."
            ) from None
        description = (
            f"router ({roles.router}) + {layout.num_experts} experts -> FusedMoE "
            f"({routing.describe()}, {layout.activation})"
        )
        return MoEMatch(type(instance), description, None, roles.router, roles.experts, routing, layout)

    def packings(self, match: MoEMatch) -> tuple["ExpertPacking", ...]:
        return (ExpertPacking(match.experts, match.layout),)

    def fuse(self, name: str, instance: nn.Module, match: MoEMatch, quant_config) -> nn.Module:
        layer_id = _layer_index(name)
        router = getattr(instance, match.router)
        setattr(instance, match.router, MoERouter(router, match.routing, match.layout, layer_id))
        layout = match.layout
        experts = HFFusedMoE(
            num_experts=layout.num_experts,
            hidden_size=layout.hidden_size,
            intermediate_size=layout.intermediate_size,
            layer_id=layer_id,
            top_k=match.routing.top_k,
            params_dtype=getattr(getattr(instance, match.experts), layout.gate_up).dtype,
            reduce_results=True,
            quant_config=None,  # SGLang's quantization configs do not apply to these experts here
            prefix=f"{name}.{match.experts}",
            activation=layout.activation,
        )
        setattr(instance, match.experts, experts)
        return instance


def _layer_index(name: str) -> int:
    """The decoder layer a block sits in (``layers.3.mlp`` -> 3): SGLang keys MoE state by it."""
    found = re.search(r"(?:^|\.)(\d+)(?:\.|$)", name)
    return int(found.group(1)) if found else 0


class _Unmappable(Exception):
    """What about an MoE block SGLang's layers cannot reproduce."""


# -- routing ------------------------------------------------------------------------------
def identify_routing(router: nn.Module, layout: ExpertLayout, outputs: tuple[str, ...]) -> Routing:
    """Run a copy of ``router`` on probe values and find the TopK settings that reproduce it."""
    if outputs.count("logits") > 1 or len(outputs) > 3:
        raise _Unmappable(f"its router returns {len(outputs)} tensors, not (logits,) weights and indices")
    probe, weight, bias = _probe_router(router, layout)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, layout.hidden_size, generator=generator, dtype=torch.float32)
    with torch.no_grad():
        returned = probe(hidden)
    returned = dict(zip(outputs, returned if isinstance(returned, tuple) else (returned,)))
    logits = F.linear(hidden, getattr(probe, weight))
    if "logits" in returned and not torch.allclose(returned["logits"].float(), logits, rtol=1e-5, atol=1e-5):
        raise _Unmappable("its router logits are not a plain linear map of the hidden states")
    indices, weights = returned["indices"], returned["weights"].float()
    top_k = indices.shape[-1]
    for scoring in ("softmax", "sigmoid"):
        for renormalize in (False, True):
            expected_ids, expected = reference_topk(logits, top_k, scoring, renormalize, bias)
            scale = _constant_ratio(indices, weights, expected_ids, expected)
            if scale is not None:
                return Routing(top_k, scoring, renormalize, scale, weight, _bias_name(probe, bias), outputs)
    raise _Unmappable(
        f"its router ({type(router).__name__}) chooses experts or weights differently from every "
        "softmax/sigmoid top-k (with or without renormalisation, correction bias or a constant scale)"
    )


def _probe_router(router: nn.Module, layout: ExpertLayout):
    """A CPU copy of the router with random weights; its weight's name and correction bias."""
    probe = copy.deepcopy(router)
    generator = torch.Generator().manual_seed(1)
    weight, bias = None, None
    for name, tensor in list(probe.named_parameters(recurse=False)) + list(
        probe.named_buffers(recurse=False)
    ):
        value = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
        if tuple(tensor.shape) == (layout.num_experts, layout.hidden_size):
            weight, value = name, value * 0.2
        elif tuple(tensor.shape) == (layout.num_experts,):
            bias = name
        else:
            raise _Unmappable(f"its router holds a tensor {name!r} of shape {tuple(tensor.shape)}")
        _set_tensor(probe, name, value)
    if weight is None:
        raise _Unmappable("its router has no [experts, hidden] weight")
    return probe.float(), weight, getattr(probe, bias) if bias else None


def _set_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    if name in module._parameters:
        module._parameters[name] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[name] = value


def _bias_name(probe: nn.Module, bias: torch.Tensor | None) -> str | None:
    if bias is None:
        return None
    return next(n for n, t in list(probe.named_parameters()) + list(probe.named_buffers()) if t is bias)


def reference_topk(logits, top_k: int, scoring: str, renormalize: bool, bias=None):
    """Expert ids and weights as SGLang's torch-native top-k computes them (fp32)."""
    scores = logits.float().softmax(dim=-1) if scoring == "softmax" else logits.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()
    ids = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def _constant_ratio(ids, weights, expected_ids, expected) -> float | None:
    """The constant factor between two (ids, weights) choices, or None if they differ."""
    order, expected_order = ids.argsort(dim=-1), expected_ids.argsort(dim=-1)
    if not torch.equal(ids.gather(1, order), expected_ids.gather(1, expected_order)):
        return None
    ratio = weights.gather(1, order) / expected.gather(1, expected_order)
    scale = ratio.mean().item()
    if not torch.allclose(ratio, torch.full_like(ratio, scale), rtol=1e-4, atol=0):
        return None
    return 1.0 if abs(scale - 1.0) < 1e-5 else scale


# -- experts --------------------------------------------------------------------------------
def identify_experts(bank: nn.Module) -> ExpertLayout:
    """Which of the bank's parameters are gate/up and down, their layout, and the activation.

    The bank runs on small random stand-ins of its parameters (its code reads sizes off
    them) and must equal ``sum_k w_k * down(act(gate x) * up x)`` for one known layout.
    """
    params = dict(bank.named_parameters(recurse=False))
    if len(params) != 2 or any(p.ndim != 3 for p in params.values()):
        shapes = {n: tuple(p.shape) for n, p in params.items()}
        raise _Unmappable(f"its experts hold {shapes}, not one gate/up and one down projection (no biases)")
    experts = next(iter(params.values())).shape[0]
    for (gate_up, a), (down, b) in (tuple(params.items()), tuple(params.items())[::-1]):
        for transposed in (False, True):
            sizes = _sizes(a.shape, b.shape, transposed)
            if sizes is None:
                continue
            for activation in ACTIVATIONS:
                if _bank_computes(bank, gate_up, down, transposed, activation):
                    return ExpertLayout(gate_up, down, transposed, activation, experts, *sizes)
    raise _Unmappable(
        f"its experts ({type(bank).__name__}) do not compute act(gate) * up -> down with "
        f"{' or '.join(ACTIVATIONS)} for any layout of {sorted(params)}"
    )


def _sizes(gate_up: torch.Size, down: torch.Size, transposed: bool) -> tuple[int, int] | None:
    """(hidden, intermediate) if the shapes fit [E, 2I, H] / [E, H, I] (or transposed)."""
    (_, up_out, up_in), (_, down_out, down_in) = gate_up, down
    if transposed:
        up_out, up_in, down_out, down_in = up_in, up_out, down_in, down_out
    if up_out % 2 or up_out // 2 != down_in or up_in != down_out:
        return None
    return up_in, down_in


def _bank_computes(bank: nn.Module, gate_up: str, down: str, transposed: bool, activation: str) -> bool:
    experts, hidden, inter, tokens, top_k = bank_probe_sizes(bank)
    generator = torch.Generator().manual_seed(2)
    fp32 = {"generator": generator, "dtype": torch.float32}  # whatever the serving dtype
    w13 = torch.randn(experts, 2 * inter, hidden, **fp32) * 0.3
    w2 = torch.randn(experts, hidden, inter, **fp32) * 0.3
    x = torch.randn(tokens, hidden, **fp32)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, **fp32)
    probe = copy.deepcopy(bank)
    _set_tensor(probe, gate_up, w13.transpose(1, 2) if transposed else w13)
    _set_tensor(probe, down, w2.transpose(1, 2) if transposed else w2)
    try:
        with torch.no_grad():
            got = probe(x, ids, weights)
    except Exception:
        return False
    gate, up = (w13[ids] @ x[:, None, :, None]).squeeze(-1).chunk(2, dim=-1)
    expected = (w2[ids] @ (ACTIVATIONS[activation](gate) * up)[..., None]).squeeze(-1)
    expected = (expected * weights[..., None]).sum(dim=1)
    return got.shape == expected.shape and torch.allclose(got, expected, rtol=1e-4, atol=1e-5)


def bank_probe_sizes(bank: nn.Module) -> tuple[int, int, int, int, int]:
    """(experts, hidden, intermediate, tokens, top-k) of the probe: small, but every expert used."""
    experts = next(bank.parameters()).shape[0]
    return experts, 12, 8, 12, min(2, experts)  # 2 * 8 != 12: a transposed layout cannot fit by chance


# -- serving ------------------------------------------------------------------------------
class MoERouter(nn.Module):
    """The HF router's logits (same parameters, same names), then SGLang's TopK."""

    def __init__(self, hf_router: nn.Module, routing: Routing, layout: ExpertLayout, layer_id: int):
        from sglang.srt.layers.moe.topk import TopK
        from sglang.srt.utils import get_device

        super().__init__()
        # Same names, so checkpoint tensors load as they are; a correction bias kept as a
        # buffer by HF becomes a parameter, so it loads too.
        tensors = list(hf_router.named_parameters(recurse=False)) + list(
            hf_router.named_buffers(recurse=False)
        )
        for name, tensor in tensors:
            self.register_parameter(
                name, nn.Parameter(torch.empty_like(tensor, device="meta"), requires_grad=False)
            )
        self.routing = routing
        bias = self._correction_bias()
        self.topk = TopK(
            routing.top_k,
            layer_id=layer_id,
            renormalize=routing.renormalize,
            scoring_func=routing.scoring,
            correction_bias=bias,
        )
        if str(get_device()).startswith("cpu"):
            self.topk.topk_config.torch_native = True  # SGLang's CPU kernels need sgl-kernel's CPU build
        self.num_experts = layout.num_experts

    def _correction_bias(self) -> torch.Tensor | None:
        name = self.routing.correction_bias
        return None if name is None else getattr(self, name)

    def forward(self, hidden_states: torch.Tensor):
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits = F.linear(hidden, getattr(self, self.routing.weight))
        chosen = self.topk(hidden, logits)
        weights = chosen.topk_weights
        if self.routing.scale != 1.0:
            weights = weights * self.routing.scale
        values = {"logits": logits, "weights": weights, "indices": chosen.topk_ids}
        returned = tuple(values[name] for name in self.routing.outputs)
        return returned if len(returned) > 1 else returned[0]


@functools.cache
def _fused_moe_class() -> type:
    """Built on first use: importing SGLang's MoE layers takes seconds, and most models have none."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    class HFFusedMoE(FusedMoE):
        """SGLang's FusedMoE called as HF calls its expert bank: ``(hidden, indices, weights)``."""

        def forward(self, hidden_states, top_k_index, top_k_weights):
            from sglang.srt.layers.moe.topk import StandardTopKOutput

            ids, weights = top_k_index.to(torch.int32), top_k_weights.to(torch.float32)
            if self.moe_ep_size > 1 and hidden_states.device.type == "cpu":
                ids, weights = self._local_experts_only(ids, weights)
            chosen = StandardTopKOutput(topk_weights=weights, topk_ids=ids, router_logits=weights)
            return super().forward(hidden_states, chosen)

        def _local_experts_only(self, ids: torch.Tensor, weights: torch.Tensor):
            """Point choices of other ranks' experts at unused local ones, with weight 0.

            SGLang marks them -1 for the kernels that skip them; its CPU expert loop
            indexes with that mark and fails, and counts a token once per distinct expert.
            So each such choice takes a local expert the token did not choose: adding
            0 times a finite output is exact, and the ranks' outputs are summed as usual.
            """
            first, count = self.moe_ep_rank * self.num_local_experts, self.num_local_experts
            local = (ids >= first) & (ids < first + count)
            slots = (ids - first).clamp(0, count - 1).long()
            used = torch.zeros(ids.shape[0], count, dtype=torch.int32).scatter_add_(1, slots, local.int())
            unused_first = torch.argsort((used > 0).int(), dim=1, stable=True)
            nth_foreign = (torch.cumsum(~local, dim=1) - 1).clamp(min=0)
            stand_in = unused_first.gather(1, nth_foreign).to(ids.dtype) + first
            return torch.where(local, ids, stand_in), torch.where(local, weights, 0.0)

    return HFFusedMoE


def HFFusedMoE(**kwargs) -> nn.Module:
    return _fused_moe_class()(**kwargs)


# -- weights --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ExpertRoute:
    """An HF ``[experts, out, in]`` parameter into FusedMoE, one expert and shard at a time."""

    param: str  # FusedMoE's w13_weight / w2_weight
    shard_ids: tuple[str, ...]  # sections of each expert's output features, in order
    transposed: bool
    num_experts: int

    def under(self, prefix: str) -> "ExpertRoute":
        return dataclasses.replace(self, param=f"{prefix}.{self.param}")

    def loads(self, tensor: torch.Tensor, piece: Piece | None) -> Iterator[Load]:
        if piece is not None:  # one expert (and section) from a per-expert checkpoint
            if piece.index is None:
                raise ValueError(f"a checkpoint tensor for {self.param} names no expert")
            yield Load(self.param, tensor, self.shard_ids[piece.part], piece.index)
            return
        for expert in range(self.num_experts):
            per_expert = tensor[expert].t() if self.transposed else tensor[expert]
            sections = per_expert.chunk(len(self.shard_ids), dim=0)
            for shard_id, section in zip(self.shard_ids, sections):
                yield Load(self.param, section, shard_id, expert)

    def keys(self) -> Iterator[str]:
        for expert in range(self.num_experts):
            for shard_id in self.shard_ids:
                yield load_key(self.param, shard_id, expert)


@dataclasses.dataclass(frozen=True)
class ExpertPacking:
    """The bank's gate/up and down parameters packed into FusedMoE's w13 and w2."""

    experts: str  # the bank's attribute in the block
    layout: ExpertLayout

    def routes(self, owner: str, module: nn.Module) -> dict:
        prefix = f"{owner}.{self.experts}" if owner else self.experts
        layout = self.layout
        return {
            f"{prefix}.{layout.gate_up}": ExpertRoute(
                f"{prefix}.w13_weight", ("w1", "w3"), layout.transposed, layout.num_experts
            ),
            f"{prefix}.{layout.down}": ExpertRoute(
                f"{prefix}.w2_weight", ("w2",), layout.transposed, layout.num_experts
            ),
        }

    def packed_modules(self) -> dict[str, list[str]]:
        return {}
