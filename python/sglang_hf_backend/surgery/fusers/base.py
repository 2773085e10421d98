"""The contract every fuser meets, and the one declaration its weights come from.

A fuser looks for one pattern in a module class's dataflow trace (``match``, once per
class, on the first instance), returns a typed ``Match`` describing what it found, and
then fuses every instance of that class (``fuse``), returning the module that stands at
the instance's place afterwards (the instance itself when it was changed in place). Its
``packings`` declare, once, which original layers were packed into which fused layer in
which shard order: the checkpoint routes and ``packed_modules_mapping`` (what SGLang's
quantization configs and LoRA read) are both derived from that declaration.
A fuser that builds on another one's result names it in ``requires``; the planner runs
fusers in that order and tells each one what the others matched.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Callable, ClassVar, Generic, Protocol, TypeVar

from torch import nn

from sglang_hf_backend.surgery.linear import Placement
from sglang_hf_backend.surgery.tensor_parallel import TPLayout
from sglang_hf_backend.surgery.trace import ModuleTrace
from sglang_hf_backend.weights import Route


@dataclasses.dataclass(frozen=True)
class Match:
    """A pattern found in one module class; each fuser subclasses it with what it found."""

    module_class: type
    description: str  # the decision log says "Fused in <class>: <description>"
    forward: Callable | None  # the class's rewritten forward (bound to each instance), if any


class WeightPacking(Protocol):
    """How checkpoint tensors of the original layers reach a fused layer."""

    def routes(self, owner: str, module: nn.Module) -> dict[str, Route]:
        """Routes for one fused instance named ``owner`` (after fusion)."""

    def packed_modules(self) -> dict[str, list[str]]:
        """``packed_modules_mapping`` entries (fused name -> original names)."""


@dataclasses.dataclass(frozen=True)
class Packing:
    """Original child layers packed, in shard order, into one fused child layer."""

    fused: str  # the fused layer's attribute, e.g. "qkv_proj"
    parts: tuple[tuple[str, str | int], ...]  # (original attribute, shard id), e.g. ("q_proj", "q")

    def routes(self, owner: str, module: nn.Module) -> dict[str, Route]:
        prefix = f"{owner}." if owner else ""
        params = [name for name, _ in module.get_submodule(self.fused).named_parameters(recurse=False)]
        return {
            f"{prefix}{part}.{param}": Route(f"{prefix}{self.fused}.{param}", shard)
            for part, shard in self.parts
            for param in params
        }

    def packed_modules(self) -> dict[str, list[str]]:
        return {self.fused: [part for part, _ in self.parts]}


@dataclasses.dataclass
class FusionContext:
    """What a fuser may consult while matching: the TP layout and earlier fusers' matches."""

    tp_size: int
    layout: TPLayout
    matches: dict[str, list[Match]] = dataclasses.field(default_factory=dict)

    def placement(self, instance: str, child: str) -> Placement:
        return self.layout.placements[f"{instance}.{child}" if instance else child]

    def matched_classes(self, fuser_name: str) -> set[type]:
        return {match.module_class for match in self.matches.get(fuser_name, [])}


M = TypeVar("M", bound=Match)


class Fuser(abc.ABC, Generic[M]):
    name: ClassVar[str]  # how SGLANG_HF_BACKEND_DISABLE_FUSIONS names it
    requires: ClassVar[tuple[str, ...]] = ()  # fusers whose matches this one builds on
    # The fused layers under the names HF models usually give them: SGLang reads the model
    # class's packed_modules_mapping before any instance (and its own names) exists.
    usual_packings: ClassVar[tuple[Packing, ...]] = ()

    @abc.abstractmethod
    def match(self, trace: ModuleTrace, instance: nn.Module, ctx: FusionContext) -> M | None:
        """The pattern in ``instance``'s class, or None; raise RewriteError to say why it is left unfused."""

    @abc.abstractmethod
    def fuse(self, name: str, instance: nn.Module, match: M, quant_config) -> nn.Module:
        """Fuse one instance (``name`` under the backbone); return the module now standing there."""

    def packings(self, match: M) -> tuple[WeightPacking, ...]:
        """Which original layers this match packs into which fused layer (none by default)."""
        return ()
