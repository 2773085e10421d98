"""LoRA adapters on our layers, served by SGLang's multi-adapter LoRA manager.

SGLang's manager (``--enable-lora``) addresses linears by name: it numbers decoder layers
by a ``layers.N`` path, keys its weight buffers by a module name unique in a layer, and
stacks PEFT's ``q_proj``/``k_proj``/``v_proj`` into a ``qkv_proj`` by name. HF models name
things their own way (GPT-2: ``transformer.h.N``, ``c_proj`` in attention and in the MLP)
and our fusers decide per model what is fused. ``LoRANames`` translates: from the linears a
model serves and the packing its fusers declare, it gives each linear in the decoder stack
the shortest name that tells it apart (``c_attn``, ``attn.c_proj``, ``qkv_proj``, or ``q_proj``
when unfused), maps PEFT targets onto those names, and numbers layers along the model's own
layer list. No per-architecture table is involved.

Seams with SGLang's code, registered as hooks (each falls through to SGLang's own code for
native models, whose names already follow SGLang's conventions):
- layer numbering, target-name normalisation, "all" targets and buffer shapes ask the
  ``LoRANames`` of the model being served (set when the manager is built);
- an adapter's weights are stacked into our fused layers from the packing our fusers
  declared (missing parts zero-filled; native models get the zero-fill too);
- the manager's LoRA layers take a flat ``[tokens, features]`` batch and return
  ``(output, bias)``; HF modules call ours with ``[batch, tokens, features]`` and expect a
  tensor, so each LoRA layer wrapped around one of ours is given ``HFLoRAOutput``;
- ``validate_new_adapter`` also runs the model's own adapter check, which names the target
  or rank at fault.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
from collections import Counter
from pathlib import Path

import torch
from sglang.srt.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from torch import nn

from sglang_hf_backend.surgery.linear import TensorOutputLinear

logger = logging.getLogger(__name__)

EMBEDDING_TARGETS = {"embed_tokens", "lm_head"}
PEFT_PREFIX = "base_model.model."


class LoRAAdapterRefused(ValueError):
    """An adapter that targets something our layers cannot apply."""


def layer_position(path: str) -> tuple[str, int] | None:
    """(layer list, index) of a path inside a numbered module list: ``("transformer.h", 3)``."""
    parts = path.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return None if index is None else (".".join(parts[:index]), int(parts[index]))


def in_layer_list(path: str, layer_list: str | None) -> bool:
    position = layer_position(path)
    return position is not None and position[0] == layer_list


def peft_matches(target: str, path: str) -> bool:
    """PEFT's rule for a ``target_modules`` entry: the whole path or a dotted suffix of it."""
    return path == target or path.endswith("." + target)


@dataclasses.dataclass(frozen=True)
class LoRANames:
    """The names SGLang's LoRA code addresses a model's linears by."""

    served: list[str]  # paths of the linears served (after fusion)
    packed: dict[str, list[str]]  # fused name -> its parts, in shard order
    layer_list: str | None  # the decoder stack: the module list most linears sit in
    names: dict[str, str]  # path -> its LoRA name, for linears SGLang can address

    @classmethod
    def of(cls, served: list[str], packed: dict[str, list[str]]) -> LoRANames:
        lists = Counter(position[0] for path in served if (position := layer_position(path)))
        layer_list = lists.most_common(1)[0][0] if lists else None
        in_stack = [path for path in served if in_layer_list(path, layer_list)]
        names = {path: name for path in in_stack if (name := distinct_name(path, in_stack))}
        return cls(served, packed, layer_list, addressable(names))

    def layer_id(self, name: str) -> int | None:
        """Decoder layer index of a module or adapter weight name (SGLang's ``get_layer_id``)."""
        if self.layer_list is None:
            return None
        found = re.search(rf"(?:^|\.){re.escape(self.layer_list)}\.(\d+)\.", name + ".")
        return int(found.group(1)) if found else None

    def hf_paths(self, path: str) -> list[str]:
        """The HF module paths a served linear stands for (a fused layer: its parts)."""
        parent, _, name = path.rpartition(".")
        return [f"{parent}.{part}" for part in self.packed[name]] if name in self.packed else [path]

    def reached(self, target: str) -> list[str]:
        """Addressable linears whose HF modules PEFT's ``target`` matches."""
        return [path for path in self.names if self.matches(target, path)]

    def matches(self, target: str, path: str) -> bool:
        return any(peft_matches(target, hf) for hf in self.hf_paths(path))

    def target_names(self, targets, sglang_names) -> set[str]:
        """LoRA names for PEFT targets (SGLang's ``get_normalized_target_modules``); a target
        that reaches none of our linears keeps SGLang's name (``sglang_names``), which SGLang
        then reports."""
        found = set()
        for target in targets:
            reached = self.reached(target)
            found |= {self.names[path] for path in reached} if reached else sglang_names([target])
        return found

    def served_of(self, hf_path: str) -> tuple[str, int | None] | None:
        """(served linear, part index) an adapter's module lands in; index None: the whole layer."""
        if hf_path in self.names:
            return hf_path, None
        parent, _, name = hf_path.rpartition(".")
        for fused, parts in self.packed.items():
            if name in parts and f"{parent}.{fused}" in self.names:
                return f"{parent}.{fused}", parts.index(name)
        return None

    def why_unreachable(self, target: str) -> str:
        named = [path for path in self.served if self.matches(target, path)]
        if not named:
            return f"the model has no linear of that name (LoRA-capable: {sorted(set(self.names.values()))})."
        if not any(in_layer_list(path, self.layer_list) for path in named):
            return f"it is outside the decoder layers ({self.layer_list}.N), where SGLang applies LoRA."
        return (
            f"another linear in the same layer has the same name ({named[0]}), so SGLang's "
            "name-keyed LoRA buffers cannot tell them apart."
        )


def distinct_name(path: str, in_stack: list[str]) -> str | None:
    """The leaf, or parent.leaf, whichever no other linear of the same layer ends with."""
    layer = layer_position(path)
    siblings = [other for other in in_stack if other != path and layer_position(other) == layer]
    for depth in (1, 2):
        name = ".".join(path.split(".")[-depth:])
        if not any(peft_matches(name, other) for other in siblings):
            return name
    return None


def addressable(names: dict[str, str]) -> dict[str, str]:
    """Keep the names SGLang's substring lookup (longest match wins) resolves back to themselves."""
    from sglang.srt.lora.utils import get_target_module_name

    all_names = set(names.values())
    return {path: name for path, name in names.items() if get_target_module_name(path, all_names) == name}


def check_adapter(
    name: str, config: dict, names: LoRANames, class_name: str, max_rank: int | None = None
) -> None:
    """Refuse adapter ``name`` (its PEFT config) unless every target reaches our linears.

    Raises ``LoRAAdapterRefused`` with the reason and what to do.
    """
    from sglang.srt.lora.utils import get_normalized_target_modules

    rank = config.get("r")
    if max_rank is not None and rank is not None and rank > max_rank:
        raise LoRAAdapterRefused(
            f"LoRA adapter {name!r} has rank {rank}, above --max-lora-rank {max_rank}; raise it to {rank}."
        )
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        return  # "all-linear": every linear the model addresses
    embeddings = get_normalized_target_modules(targets) & EMBEDDING_TARGETS
    if embeddings or config.get("modules_to_save"):
        raise LoRAAdapterRefused(
            f"LoRA adapter {name!r} trains {sorted(embeddings) or config['modules_to_save']}; "
            "sglang_hf_backend applies LoRA to attention and MLP projections only. Merge those "
            "weights into the base model instead."
        )
    for target in targets:
        if not names.reached(target):
            raise LoRAAdapterRefused(
                f"LoRA adapter {name!r} targets {target!r}, which reaches no layer of {class_name}: "
                + names.why_unreachable(target)
            )


def fused_layer_of(packed: dict[str, list[str]]) -> dict[str, str]:
    """Part -> the fused layer it is packed into (``q_proj`` -> ``qkv_proj``)."""
    return {part: fused for fused, parts in packed.items() for part in parts}


def served_after_fusion(linears: list[str], packed: dict[str, list[str]]) -> list[str]:
    """Linear paths once fusion has packed parts (``...q_proj``) into their fused layer
    (``...qkv_proj``)."""
    fused_of = fused_layer_of(packed)
    served = {}
    for path in linears:
        parent, _, name = path.rpartition(".")
        fused = fused_of.get(name)
        served[f"{parent}.{fused}" if fused else path] = None
    return list(served)


def adapter_paths(lora_paths) -> dict[str, str]:
    """{name: directory} from any form SGLang takes (dict, "name=path", JSON dicts, LoRARef)."""
    if isinstance(lora_paths, dict):
        return dict(lora_paths)
    found = {}
    for entry in lora_paths or []:
        if isinstance(entry, str):
            name, _, path = entry.partition("=") if "=" in entry else (entry, "", entry)
        elif isinstance(entry, dict):
            name, path = entry["lora_name"], entry["lora_path"]
        else:
            name, path = entry.lora_name, entry.lora_path
        found[name] = path
    return found


def read_adapter_config(path: str) -> dict:
    """The PEFT ``adapter_config.json`` of a local adapter ({} for a hub id: SGLang fetches it)."""
    config_file = Path(path) / "adapter_config.json"
    return json.loads(config_file.read_text()) if config_file.is_file() else {}


def preflight_adapters(lora_paths, linears: list[str], packed, class_name: str, max_rank) -> None:
    """Check the adapters named at start-up in the caller's process, before SGLang starts."""
    names = LoRANames.of(served_after_fusion(linears, packed), packed)
    for name, path in adapter_paths(lora_paths).items():
        check_adapter(name, read_adapter_config(path), names, class_name, max_rank)


class LoRALayers:
    """What SGLang's LoRA manager asks the model, answered from its layers."""

    def served_linears(self) -> dict[str, LinearBase]:
        """Our linears by path (a LoRA-wrapped one under its own path), found once: LoRA
        wrapping keeps each path and each base layer."""
        if "_served_linears" not in self.__dict__:
            self.__dict__["_served_linears"] = {
                name: module
                for name, module in self.named_modules()
                if isinstance(module, TensorOutputLinear)
            }
        return self.__dict__["_served_linears"]

    def lora_names(self) -> LoRANames:
        if "_lora_names" not in self.__dict__:
            self.__dict__["_lora_names"] = LoRANames.of(list(self.served_linears()), packed_parts(self))
        return self.__dict__["_lora_names"]

    def should_apply_lora(self, module_name: str) -> bool:
        return module_name in self.lora_names().names

    def lora_layer(self, target: str, layer_id: int) -> LinearBase:
        """Our linear SGLang's manager knows as ``target`` in layer ``layer_id``."""
        names = self.lora_names()
        for path, name in names.names.items():
            if name == target and names.layer_id(path) == layer_id:
                return self.served_linears()[path]
        raise LoRAAdapterRefused(f"layer {layer_id} of this model has no LoRA-capable {target}")

    def get_hidden_dim(self, target: str, layer_idx: int) -> tuple[int, int]:
        """Full (all ranks) input and output widths of ``target`` in layer ``layer_idx``."""
        layer = self.lora_layer(target, layer_idx)
        return layer.input_size, layer.output_size

    def get_stacked_multiply(self, target: str) -> int:
        """How many projections a fused target packs (q/k/v: 3, gate/up: 2)."""
        names = self.lora_names()
        paths = [path for path, name in names.names.items() if name == target]
        return shard_count(self.served_linears()[paths[0]]) if paths else 1

    def lora_buffer_shape(self, target: str, layer_idx: int, rank: int, lora_type: str, slots: int):
        """One layer's A or B buffer for ``target``, as wide as this rank's shard of the layer."""
        layer = self.lora_layer(target, layer_idx)
        if lora_type == "A":
            width = (
                layer.input_size_per_partition if isinstance(layer, RowParallelLinear) else layer.input_size
            )
            return (slots, rank * shard_count(layer), width)
        height = (
            sum(layer.output_partition_sizes)
            if isinstance(layer, ColumnParallelLinear)
            else layer.output_size
        )
        return (slots, height, rank)

    def check_lora_adapter(self, name: str, path: str, max_rank: int | None) -> None:
        check_adapter(name, read_adapter_config(path), self.lora_names(), self.hf_class_name, max_rank)


def full_output_sizes(module: nn.Module) -> list[int]:
    """Each packed projection's output width over all ranks (checkpoint sizes)."""
    if isinstance(module, QKVParallelLinear):
        q = module.total_num_heads * module.head_size
        return [
            q,
            module.total_num_kv_heads * module.head_size,
            module.total_num_kv_heads * module.v_head_size,
        ]
    return list(module.output_sizes)


def shard_count(module: nn.Module) -> int:
    if isinstance(module, QKVParallelLinear):
        return 3
    if isinstance(module, MergedColumnParallelLinear):
        return len(module.output_sizes)
    return 1


class HFLoRAOutput:
    """A LoRA layer called like ``nn.Linear``: any leading dims in, a tensor out."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        out = super().forward(x.reshape(-1, x.shape[-1]), *args, **kwargs)[0]
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @property
    def split_sizes(self) -> list[int]:
        """A fused layer's per-projection widths, which the fused forward splits by."""
        return self.base_layer.split_sizes


class HFReplicatedLoRAOutput(HFLoRAOutput):
    """SGLang's replicated LoRA layer (what TP=1 layers get) calls the LoRA backend without
    the host copy of its output offsets, which the torch backend requires; pass it."""

    def set_lora_info(self, A_buffer: torch.Tensor, B_buffer: torch.Tensor) -> None:
        super().set_lora_info(A_buffer, B_buffer)
        self.output_offset_host = self._output_offset.cpu()

    def apply_lora(self, base_output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.first_output_dim:
            return super().apply_lora(base_output, x)
        lora_a_output = self.lora_backend.run_lora_a_sgemm(x, self.A_buffer)
        return self.lora_backend.run_lora_b_sgemm(
            x=lora_a_output,
            weights=self.B_buffer,
            output_offset=self._output_offset,
            output_offset_cpu=self.output_offset_host,
            base_output=base_output,
        )


@functools.cache
def _hf_called(lora_class: type) -> type:
    from sglang.srt.lora.layers import ReplicatedLinearWithLoRA

    bridge = HFReplicatedLoRAOutput if issubclass(lora_class, ReplicatedLinearWithLoRA) else HFLoRAOutput
    return type(f"HF{lora_class.__name__}", (bridge, lora_class), {})


def _wrap_for_hf_callers(original, manager, module_name, module, **kwargs):
    lora_layer = original(manager, module_name, module, **kwargs)
    if isinstance(module, TensorOutputLinear):
        lora_layer.__class__ = _hf_called(type(lora_layer))
    return lora_layer


def weight_parts(name: str) -> tuple[str, str]:
    """(module path without PEFT's prefix, ``A.weight``/``B.weight``) of an adapter weight."""
    module_path, _, kind = name.partition(".lora_")
    return module_path.removeprefix(PEFT_PREFIX), kind


def complete_packed_parts(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Zeros for the parts of a fused layer an adapter leaves out (it may train only k_proj).

    SGLang stacks q/k/v (gate/up) LoRA weights into the fused layer's only around the
    first part, and a batch with an adapter holding the others alone kills the scheduler.
    A zero A/B pair changes nothing, so every fused layer an adapter touches gets all the
    parts the model packs into it (``packed_modules_mapping``, which our fusers declare; or
    the stacked-parameter table of SGLang's native models, which this fixes as well).
    """
    packed = packed_parts(model)
    fused_of = fused_layer_of(packed)
    for name in list(weights):
        module_path, _, kind = name.partition(".lora_")
        parent, _, part = module_path.rpartition(".")
        fused = fused_of.get(part)
        layer = _submodule_or_none(model, f"{parent.removeprefix(PEFT_PREFIX)}.{fused}") if fused else None
        if layer is None:
            continue
        sizes = full_output_sizes(getattr(layer, "base_layer", layer))
        for index, other in enumerate(packed[fused]):
            missing = f"{parent}.{other}.lora_{kind}"
            if missing not in weights:
                present = weights[name]
                shape = present.shape if kind.startswith("A") else (sizes[index], present.shape[1])
                weights[missing] = present.new_zeros(shape)


def stack_for_served_layers(
    names: LoRANames, shards: dict[str, int], weights: dict[str, torch.Tensor]
) -> None:
    """Key an adapter's weights by the linears we serve, in SGLang's stacked layout.

    Parts of a fused layer (complete, see ``complete_packed_parts``) are concatenated in
    shard order, A on A and B on B; an adapter trained on a whole multi-shard layer (GPT-2's
    ``c_attn``) has its A repeated once per shard, since SGLang applies one A slice per
    shard. ``shards``: served path -> shard count.
    """
    stacks: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name in list(weights):
        module_path, kind = weight_parts(name)
        landing = names.served_of(module_path)
        if landing is None:
            continue  # SGLang's loader reports weights no target matches
        served, index = landing
        weight = weights.pop(name)
        if index is None:
            whole = weight.repeat(shards[served], 1) if kind.startswith("A") else weight
            weights[f"{PEFT_PREFIX}{served}.lora_{kind}"] = whole
        else:
            stacks.setdefault((served, kind), {})[index] = weight
    for (served, kind), parts in stacks.items():
        weights[f"{PEFT_PREFIX}{served}.lora_{kind}"] = torch.cat([parts[i] for i in sorted(parts)])


def packed_parts(model: nn.Module) -> dict[str, list[str]]:
    """Fused layer -> its parts, in shard order."""
    packed = getattr(model, "packed_modules_mapping", None)
    if packed:
        return packed
    stacked = getattr(model, "bitsandbytes_stacked_params_mapping", None) or {}
    found: dict[str, list[str]] = {}
    for part, (fused, _) in sorted(stacked.items(), key=lambda item: item[1][1]):
        found.setdefault(fused.strip("."), []).append(part.strip("."))
    return found


def _submodule_or_none(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


# The LoRA names of the model the LoRA manager of this process serves (None: a native model).
_SERVED: list[LoRANames | None] = [None]


def served_names() -> LoRANames | None:
    return _SERVED[0]


def _note_served_model(manager, base_model, *args, **kwargs):
    names = getattr(base_model, "lora_names", None)
    _SERVED[0] = names() if names is not None else None


def _layer_id(original, name):
    found = original(name)
    names = served_names()
    return names.layer_id(name) if found is None and names is not None else found


def _target_names(original, targets):
    names = served_names()
    if names is None or isinstance(targets, str):
        return original(targets)
    return names.target_names(targets, original)


def _all_targets(original, model):
    names = served_names()
    return set(names.names.values()) if names is not None else original(model)


def _without_embedding_targets(original, manager, *args, **kwargs):
    """``--lora-target-modules all`` adds the embeddings, which our models do not adapt
    (adapters training them are refused), so their buffers are never made."""
    original(manager, *args, **kwargs)
    if served_names() is not None and manager.target_modules & EMBEDDING_TARGETS:
        manager.target_modules -= EMBEDDING_TARGETS
        logger.info("LoRA targets on this model: %s (no embedding LoRA)", sorted(manager.target_modules))


def _buffer_shape(lora_type: str):
    def shape(original, pool, module_name, base_model, max_lora_dim, layer_idx):
        names = served_names()
        if names is None or module_name not in names.names.values():
            return original(pool, module_name, base_model, max_lora_dim, layer_idx)
        return base_model.lora_buffer_shape(
            module_name, layer_idx, max_lora_dim, lora_type, pool.max_loras_per_batch
        )

    return shape


def _normalise_adapter_weights(original, adapter):
    model = adapter.base_model
    if model is None:
        return original(adapter)
    for layer in adapter.layers:
        complete_packed_parts(model, layer.weights)
    names = served_names()
    if names is None:
        return original(adapter)
    shards = {path: shard_count(layer) for path, layer in model.served_linears().items()}
    for layer in adapter.layers:
        stack_for_served_layers(names, shards, layer.weights)


def _model_checks_adapter(original, manager, lora_config, lora_ref):
    """The model's check first: it names the target or rank at fault, SGLang's pool check does not."""
    check = getattr(manager.base_model, "check_lora_adapter", None)
    if check is not None:
        # at start-up the manager validates adapters before it settles on a rank
        check(lora_ref.lora_name, lora_ref.lora_path, getattr(manager, "max_lora_rank", None))
    original(manager, lora_config, lora_ref)


def install() -> None:
    """Register the hooks on SGLang's LoRA code (every process; cheap)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    manager = "sglang.srt.lora.lora_manager.LoRAManager"
    pool = "sglang.srt.lora.mem_pool.LoRAMemoryPool"
    utils = "sglang.srt.lora.utils"
    HookRegistry.register(f"{manager}.__init__", _note_served_model, HookType.BEFORE)
    HookRegistry.register(f"{manager}.set_lora_module", _wrap_for_hf_callers, HookType.AROUND)
    HookRegistry.register(f"{manager}.validate_new_adapter", _model_checks_adapter, HookType.AROUND)
    HookRegistry.register(f"{manager}.init_lora_shapes", _without_embedding_targets, HookType.AROUND)
    HookRegistry.register("sglang.srt.layers.utils.common.get_layer_id", _layer_id, HookType.AROUND)
    HookRegistry.register(f"{utils}.get_normalized_target_modules", _target_names, HookType.AROUND)
    HookRegistry.register(f"{utils}.auto_detect_lora_target_modules", _all_targets, HookType.AROUND)
    HookRegistry.register(f"{pool}.get_lora_A_shape", _buffer_shape("A"), HookType.AROUND)
    HookRegistry.register(f"{pool}.get_lora_B_shape", _buffer_shape("B"), HookType.AROUND)
    HookRegistry.register(
        "sglang.srt.lora.lora.LoRAAdapter._normalize_weights", _normalise_adapter_weights, HookType.AROUND
    )
