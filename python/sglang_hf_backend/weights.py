"""Checkpoint loading: HF tensor names into the wrapped model, each rank taking its share.

Names are those of the HF class (our wrapper keeps its module layout) after transformers'
own conversion mapping (``get_model_conversion_mapping``): renames apply as transformers
applies them, and a tensor that transformers would merge into a larger parameter
(``MergeModulelist`` / ``Concatenate``, e.g. one expert's ``w1`` into ``gate_up_proj``) is
recognised as that parameter's ``Piece`` and loaded straight into its slice, without
merging. Each tensor reaches the parameter's ``weight_loader`` (which narrows it to this
rank) through a ``Route``: plain for most parameters, to a shard of a packed parameter
for fused layers, to an expert and shard for fused experts. Anything left unmatched or
unloaded is an error that names the tensors, never a silent skip.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Callable, Iterable, Iterator, Protocol

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Concatenate,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
    rename_source_key,
)


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not match the model's parameters."""


@dataclasses.dataclass(frozen=True)
class Piece:
    """Which slice of a model parameter one checkpoint tensor is.

    ``index`` along dim 0 of the parameter (one module of a merged module list, e.g. an
    expert), then ``part`` of ``parts`` equal sections along ``part_dim`` of that slice.
    """

    index: int | None = None
    part: int = 0
    parts: int = 1
    part_dim: int = 0

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This piece of a whole parameter-shaped ``tensor``."""
        if self.index is not None:
            tensor = tensor[self.index]
        return tensor.chunk(self.parts, dim=self.part_dim)[self.part] if self.parts > 1 else tensor


@dataclasses.dataclass(frozen=True)
class Load:
    """One call of a parameter's weight loader."""

    param: str
    tensor: torch.Tensor
    shard_id: str | int | None = None
    expert_id: int | None = None
    piece: Piece | None = None  # for parameters without a loader: the slice to copy into


def load_key(param: str, shard_id=None, expert_id=None) -> str:
    """The key a load is checked off under ("param", "param:shard", "param:shard:expert")."""
    parts = [param] + [str(p) for p in (shard_id, expert_id) if p is not None]
    return ":".join(parts)


class Routing(Protocol):
    """Turns one checkpoint tensor (or piece of one) into weight-loader calls."""

    def under(self, prefix: str) -> "Routing":
        """The same route with ``prefix.`` before the parameter name."""

    def loads(self, tensor: torch.Tensor, piece: Piece | None) -> Iterator[Load]: ...

    def keys(self) -> Iterator[str]:
        """Every key a complete checkpoint loads through this route."""


@dataclasses.dataclass(frozen=True)
class Route:
    """A parameter, or one shard of a packed parameter (``weight_loader(param, t, shard_id)``)."""

    param: str
    shard_id: str | int | None = None

    def under(self, prefix: str) -> "Route":
        return dataclasses.replace(self, param=f"{prefix}.{self.param}")

    def loads(self, tensor: torch.Tensor, piece: Piece | None) -> Iterator[Load]:
        if piece is not None and self.shard_id is not None:
            raise CheckpointMismatchError(
                f"a checkpoint tensor holds a slice of a parameter that loads into shard "
                f"{self.shard_id!r} of {self.param}; sglang_hf_backend cannot load such slices."
            )
        yield Load(self.param, tensor, self.shard_id, piece=piece)

    def keys(self) -> Iterator[str]:
        yield load_key(self.param, self.shard_id)


@dataclasses.dataclass
class CheckpointNames:
    """How checkpoint names relate to the model, taken from the HF class."""

    renamings: list[WeightRenaming]
    converters: list[WeightConverter]
    ignore_unexpected: list[re.Pattern]
    base_prefix: str  # the backbone attribute, e.g. "model" or "transformer"

    @classmethod
    def of(cls, hf_model: PreTrainedModel) -> "CheckpointNames":
        transforms = get_model_conversion_mapping(hf_model)
        patterns = getattr(hf_model, "_keys_to_ignore_on_load_unexpected", None) or []
        return cls(
            renamings=[t for t in transforms if isinstance(t, WeightRenaming)],
            converters=[t for t in transforms if isinstance(t, WeightConverter)],
            ignore_unexpected=[re.compile(p) for p in patterns],
            base_prefix=hf_model.base_model_prefix,
        )

    def resolve(self, name: str) -> tuple[str, Piece | None]:
        """The model's name for checkpoint tensor ``name``, and which piece of it the tensor is."""
        renamed, pattern = rename_source_key(name, self.renamings, self.converters)
        if pattern is None:
            return renamed, None
        converter = next(c for c in self.converters if pattern in c.source_patterns)
        return renamed, _piece(name, pattern, converter)


def _piece(name: str, pattern: str, converter: WeightConverter) -> Piece:
    """Where tensor ``name`` lands in the parameter ``converter`` builds from its sources."""
    index, part, part_dim = None, 0, 0
    for operation in converter.operations:
        if isinstance(operation, MergeModulelist) and operation.dim == 0:
            index = _wildcard_index(name, pattern)
        elif isinstance(operation, Concatenate):
            part = converter.source_patterns.index(pattern)
            part_dim = operation.dim - (1 if index is not None else 0)
        else:
            raise CheckpointMismatchError(
                f"Checkpoint tensor {name!r} needs transformers' {type(operation).__name__} conversion "
                "on load, which sglang_hf_backend does not apply. Re-save the checkpoint with "
                "transformers >= 5 (save_pretrained)."
            )
    return Piece(index, part, len(converter.source_patterns), part_dim)


def _wildcard_index(name: str, pattern: str) -> int:
    regex = re.escape(pattern).replace(r"\*", r"(\d+)")
    found = re.search(regex, name)
    if found is None:
        raise CheckpointMismatchError(f"cannot tell which module list entry {name!r} belongs to")
    return int(found.group(1))


class WeightLoader:
    """Loads one checkpoint into ``model`` and says which keys it covered."""

    def __init__(
        self,
        model: nn.Module,
        names: CheckpointNames,
        routes: dict[str, Routing],
        tied: set[str],
        on_loaded: Callable[[str], None] | None = None,
        held_elsewhere: Callable[[str], bool] = lambda name: False,
    ):
        self.model = model
        self.names = names
        self.routes = routes
        self.tied = tied  # parameters shared with another one: a checkpoint copy is skipped
        self.on_loaded = on_loaded  # told each loaded key (see load_key)
        self.held_elsewhere = held_elsewhere  # by another pipeline stage: its tensors are skipped
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.buffers = {name for name, _ in model.named_buffers()}

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        unexpected: list[str] = []
        for raw_name, tensor in weights:
            name, piece = self.names.resolve(raw_name)
            route = self.route(name)
            if route is None:
                if not self._ignorable(name):
                    unexpected.append(raw_name)
                continue
            for load in route.loads(tensor, piece):
                self._load_one(load)
                key = load_key(load.param, load.shard_id, load.expert_id)
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

    def route(self, name: str) -> Routing | None:
        for candidate in (name, f"{self.names.base_prefix}.{name}"):
            if candidate in self.routes:
                return self.routes[candidate]
            if candidate in self.params:
                return Route(candidate)
        return None

    def _ignorable(self, name: str) -> bool:
        """HF's own ignore list, tied duplicates, buffers the model computes itself and what
        another pipeline stage holds."""
        for candidate in (name, f"{self.names.base_prefix}.{name}"):
            if candidate in self.tied or candidate in self.buffers or self.held_elsewhere(candidate):
                return True
        return any(p.search(name) for p in self.names.ignore_unexpected)

    def _load_one(self, load: Load) -> None:
        param = self.params[load.param]
        if param.is_meta:
            param = self._materialise(load.param, param)
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            _copy_into(param, load.tensor, load.piece)
        elif load.expert_id is not None:
            # FusedMoE tells weights from scales by the name: give it the parameter's own
            loader(param, load.tensor, load.param, shard_id=load.shard_id, expert_id=load.expert_id)
        elif load.shard_id is not None:
            loader(param, load.tensor, load.shard_id)
        else:
            loader(param, load.tensor)

    def _materialise(self, name: str, param: nn.Parameter) -> nn.Parameter:
        from sglang.srt.utils import get_device

        owner_name, _, attr = name.rpartition(".")
        real = materialised(param, get_device())
        self.model.get_submodule(owner_name)._parameters[attr] = real
        self.params[name] = real
        return real


def materialised(param: nn.Parameter, device) -> nn.Parameter:
    """An uninitialised copy of a meta parameter on ``device``, keeping its loader attributes."""
    real = nn.Parameter(torch.empty_like(param, device=device), requires_grad=False)
    real.__dict__.update(param.__dict__)  # SGLang's weight_loader and friends
    return real


def _copy_into(param: nn.Parameter, tensor: torch.Tensor, piece: Piece | None) -> None:
    target = param.data if piece is None else piece.of(param.data)
    if target.shape != tensor.shape:
        raise CheckpointMismatchError(
            f"checkpoint tensor of shape {tuple(tensor.shape)} does not fit a parameter "
            f"{'slice ' if piece else ''}of shape {tuple(target.shape)}"
        )
    target.copy_(tensor)


def check_all_loaded(loaded: set[str], expected: set[str], tied: set[str]) -> None:
    """Every parameter (and every shard of a packed one) must have come from the checkpoint."""
    missing = sorted(k for k in expected if k not in loaded and k not in tied)
    if missing:
        raise CheckpointMismatchError(
            f"{len(missing)} parameter(s) are missing from the checkpoint: {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}. The checkpoint is incomplete or was saved "
            "for a different config."
        )


def check_checkpoint_files(directory: Path, hf_model: PreTrainedModel, names: CheckpointNames) -> None:
    """The checkpoint's safetensors files against the model, from their headers alone.

    Every file must be readable and as long as its header says; every tensor must belong to
    a parameter (or be one HF ignores) with that parameter's shape; every parameter must be
    covered. Run before SGLang starts, so a broken checkpoint fails in seconds, in the
    caller's process, naming the file and the tensor.
    """
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return  # other formats are checked as they load
    params, duplicates = _parameters(hf_model)
    covered: dict[str, set] = {}
    for file in files:
        for key, shape in read_safetensors_shapes(file).items():
            name, piece = names.resolve(key)
            param = next((n for n in _candidates(name, names.base_prefix) if n in params), None)
            if param is None:
                if not (
                    set(_candidates(name, names.base_prefix)) & duplicates
                    or _hf_ignores(name, hf_model, names)
                ):
                    raise CheckpointMismatchError(
                        f"{file}: tensor {key!r} matches no parameter of {type(hf_model).__name__}; "
                        "the checkpoint belongs to another architecture or config (check config.json)."
                    )
                continue
            target = params[param] if piece is None else piece.of(params[param])
            if tuple(target.shape) != shape:
                raise CheckpointMismatchError(
                    f"{file}: tensor {key!r} has shape {shape}, but {param}"
                    f"{' (the slice it fills)' if piece else ''} has shape {tuple(target.shape)}; "
                    "the checkpoint was saved for a different config."
                )
            covered.setdefault(param, set()).add(
                None if piece is None else (piece.index, piece.part, piece.parts)
            )
    missing = [name for name, param in params.items() if not _complete(covered.get(name), param)]
    if missing:
        raise CheckpointMismatchError(
            f"{len(missing)} parameter(s) are in none of {[f.name for f in files]} in {directory}: "
            f"{missing[:8]}{' ...' if len(missing) > 8 else ''}. The checkpoint is incomplete."
        )


def read_safetensors_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor shapes from a safetensors header; a file that is unreadable or cut short is an error."""
    import json
    import struct

    size = file.stat().st_size
    try:
        with file.open("rb") as stream:
            (length,) = struct.unpack("<Q", stream.read(8))
            if length > size - 8:
                raise ValueError(f"header length {length} exceeds the file")
            header = json.loads(stream.read(length))
        end = max((info["data_offsets"][1] for k, info in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, struct.error) as reason:
        raise CheckpointMismatchError(
            f"{file} is not a readable safetensors file ({reason}); re-download or re-save the checkpoint."
        ) from None
    if size < 8 + length + end:
        raise CheckpointMismatchError(
            f"{file} is truncated: {size} bytes, but its header describes {8 + length + end}; "
            "re-download or re-save the checkpoint."
        )
    return {key: tuple(info["shape"]) for key, info in header.items() if key != "__metadata__"}


def _parameters(hf_model: PreTrainedModel) -> tuple[dict[str, torch.Tensor], set[str]]:
    """HF parameters by name, and the names that are only another name of a tied parameter."""
    params: dict[str, torch.Tensor] = {}
    duplicates: set[str] = set()
    seen: set[int] = set()
    for name, param in hf_model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            duplicates.add(name)
            continue
        seen.add(id(param))
        params[name] = param
    return params, duplicates


def _candidates(name: str, base_prefix: str) -> tuple[str, ...]:
    """A checkpoint name with and without the backbone prefix (base-model and head checkpoints)."""
    return name, f"{base_prefix}.{name}", name.removeprefix(f"{base_prefix}.")


def _hf_ignores(name: str, hf_model: PreTrainedModel, names: CheckpointNames) -> bool:
    buffers = {n for n, _ in hf_model.named_buffers()}
    return bool(set(_candidates(name, names.base_prefix)) & buffers) or any(
        p.search(name) for p in names.ignore_unexpected
    )


def _complete(pieces: set | None, param: torch.Tensor) -> bool:
    """Covered whole, or by every (module-list entry, section) piece."""
    if not pieces:
        return False
    if None in pieces:
        return True
    index, _, parts = next(iter(pieces))
    return len(pieces) >= (param.shape[0] if index is not None else 1) * parts
