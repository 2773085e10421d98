"""Checkpoint loading: HF tensor names into the wrapped model, each rank taking its share.

Names are those of the HF causal-LM class (our wrapper keeps its module layout), after
transformers' own renames (``get_model_conversion_mapping``). Each tensor goes through
the owning module's load transform (transposes, packed reorders) and then the SGLang
parameter's ``weight_loader``, which narrows it to this rank. Fused layers register
routes from the original names to their packed parameters and shard ids. Anything left
unmatched or unloaded is an error that names the tensors, never a silent skip.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightRenaming

from sglang_hf_backend.surgery.linear import LOAD_TRANSFORM


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not match the model's parameters."""


@dataclasses.dataclass(frozen=True)
class Route:
    """Where a checkpoint tensor goes: a parameter, optionally a shard of a packed one."""

    param: str
    shard_id: str | int | None = None
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None

    def under(self, prefix: str) -> "Route":
        return dataclasses.replace(self, param=f"{prefix}.{self.param}")


@dataclasses.dataclass
class CheckpointNames:
    """How checkpoint names relate to the model, taken from the HF class."""

    renames: list  # transformers WeightTransform objects
    ignore_unexpected: list[re.Pattern]
    base_prefix: str  # the backbone attribute, e.g. "model" or "transformer"

    @classmethod
    def of(cls, hf_model: PreTrainedModel) -> "CheckpointNames":
        patterns = getattr(hf_model, "_keys_to_ignore_on_load_unexpected", None) or []
        return cls(
            renames=get_model_conversion_mapping(hf_model),
            ignore_unexpected=[re.compile(p) for p in patterns],
            base_prefix=hf_model.base_model_prefix,
        )

    def rename(self, name: str) -> str:
        for transform in self.renames:
            renamed, matched = transform.rename_source_key(name)
            if matched is None:
                continue
            if not isinstance(transform, WeightRenaming):
                raise CheckpointMismatchError(
                    f"Checkpoint tensor {name!r} needs transformers' {type(transform).__name__} "
                    "conversion (tensors merged or split on load), which sglang_hf_backend does "
                    "not apply. Re-save the checkpoint with transformers >= 5 (save_pretrained)."
                )
            name = renamed
        return name


class WeightLoader:
    """Loads one checkpoint into ``model`` and checks that it covered every parameter."""

    def __init__(
        self,
        model: nn.Module,
        names: CheckpointNames,
        routes: dict[str, Route],
        tied: set[str],
        on_loaded: Callable[[str], None] | None = None,
    ):
        self.model = model
        self.names = names
        self.routes = routes
        self.tied = tied  # parameters shared with another one: a checkpoint copy is skipped
        self.on_loaded = on_loaded  # told each loaded key ("param" or "param:shard")
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.buffers = {name for name, _ in model.named_buffers()}

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        unexpected: list[str] = []
        for raw_name, tensor in weights:
            name = self.names.rename(raw_name)
            route = self.route(name)
            if route is None:
                if not self._ignorable(name):
                    unexpected.append(raw_name)
                continue
            self._load_one(route, tensor)
            key = route.param if route.shard_id is None else f"{route.param}:{route.shard_id}"
            loaded.add(key)
            if self.on_loaded is not None:
                self.on_loaded(key)
        if unexpected:
            raise CheckpointMismatchError(
                f"{len(unexpected)} checkpoint tensor(s) match no parameter of the model: "
                f"{sorted(unexpected)[:8]}{' ...' if len(unexpected) > 8 else ''}. The checkpoint "
                "does not belong to this architecture or config (check config.json)."
            )
        return loaded

    def route(self, name: str) -> Route | None:
        for candidate in (name, f"{self.names.base_prefix}.{name}"):
            if candidate in self.routes:
                return self.routes[candidate]
            if candidate in self.params:
                return Route(candidate)
        return None

    def _ignorable(self, name: str) -> bool:
        """HF's own ignore list, tied duplicates and buffers the model computes itself."""
        if name in self.tied or name in self.buffers:
            return True
        if f"{self.names.base_prefix}.{name}" in self.buffers:
            return True
        return any(p.search(name) for p in self.names.ignore_unexpected)

    def _load_one(self, route: Route, tensor: torch.Tensor) -> None:
        param = self.params[route.param]
        owner_name, _, param_attr = route.param.rpartition(".")
        owner = self.model.get_submodule(owner_name)
        if param.is_meta:
            param = self._materialise(route.param, owner, param_attr, param)
        transform = getattr(owner, LOAD_TRANSFORM, {}).get(param_attr)
        if route.transform is not None:
            tensor = route.transform(tensor)
        if transform is not None:
            tensor = transform(tensor)
        loader = getattr(param, "weight_loader", _copy_whole)
        if route.shard_id is None:
            loader(param, tensor)
        else:
            loader(param, tensor, route.shard_id)

    def _materialise(self, name: str, owner: nn.Module, attr: str, param: nn.Parameter) -> nn.Parameter:
        """Give a parameter left on meta its memory, keeping SGLang's loader attributes."""
        from sglang.srt.utils import get_device

        real = nn.Parameter(torch.empty_like(param, device=get_device()), requires_grad=False)
        real.__dict__.update(param.__dict__)
        owner._parameters[attr] = real
        self.params[name] = real
        return real


def _copy_whole(param: nn.Parameter, tensor: torch.Tensor) -> None:
    if param.shape != tensor.shape:
        raise CheckpointMismatchError(
            f"checkpoint tensor of shape {tuple(tensor.shape)} does not fit a parameter of "
            f"shape {tuple(param.shape)}"
        )
    param.data.copy_(tensor)


def check_all_loaded(loaded: set[str], expected: set[str], tied: set[str]) -> None:
    """Every parameter (and every shard of a packed one) must have come from the checkpoint."""
    missing = sorted(k for k in expected if k not in loaded and k not in tied)
    if missing:
        raise CheckpointMismatchError(
            f"{len(missing)} parameter(s) are missing from the checkpoint: {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}. The checkpoint is incomplete or was saved "
            "for a different config."
        )
