"""LoRA adapters on our layers, served by SGLang's multi-adapter LoRA manager.

SGLang's manager (``--enable-lora``) wraps every SGLang linear whose path ends in one of
the adapters' targets inside a decoder layer (``layers.N``), after normalising PEFT names
to SGLang's fused ones (``q_proj``/``k_proj``/``v_proj`` -> ``qkv_proj``, ``gate_proj``/
``up_proj`` -> ``gate_up_proj``), which are the names our fusers give their layers. It
asks the model how wide each target is and how many shards a fused one packs; ``LoRALayers``
answers from the layers themselves, so no per-architecture table is involved, and refuses
an adapter at load time when one of its targets reaches none of our layers (with the
reason: unfused, embeddings, a layer list SGLang cannot number).

Three seams with SGLang's code, registered as hooks:
- the manager's LoRA layers take a flat ``[tokens, features]`` batch and return
  ``(output, bias)``; HF modules call ours with ``[batch, tokens, features]`` and expect a
  tensor, so each LoRA layer wrapped around one of ours is given ``HFLoRAOutput``;
- ``validate_new_adapter`` also runs the model's own adapter check;
- before SGLang stacks an adapter's q/k/v (gate/up) weights, the parts it leaves out get
  zeros (``complete_packed_parts``), from the packing our fusers declared.
"""

from __future__ import annotations

import functools
import json
import re
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

# SGLang's LoRA code numbers layers by this pattern (sglang.srt.layers.utils.get_layer_id).
LAYER_PATH = re.compile(r"layers\.(\d+)\.")
EMBEDDING_TARGETS = {"embed_tokens", "lm_head"}


class LoRAAdapterRefused(ValueError):
    """An adapter that targets something our layers cannot apply."""


def leaf(path: str) -> str:
    return path.rsplit(".", 1)[-1]


def is_numbered(path: str) -> bool:
    """Inside a decoder layer as SGLang's LoRA code numbers them."""
    return LAYER_PATH.search(path + ".") is not None


def reaches(target: str, path: str) -> bool:
    """SGLang's manager wraps ``path`` for a normalised ``target`` (its last one or two names)."""
    parts = path.split(".")
    return is_numbered(path) and target in (parts[-1], ".".join(parts[-2:]))


def check_adapter(
    name: str,
    config: dict,
    served: dict[str, str],
    class_name: str,
    max_rank: int | None = None,
    tp_size: int = 1,
) -> None:
    """Refuse adapter ``name`` (its PEFT config) unless every target reaches one of ``served``.

    ``served``: path -> TP kind ("column", "row", "replicate") of each linear the model
    serves, after fusion. Raises ``LoRAAdapterRefused`` with the reason and what to do.
    """
    from sglang.srt.lora.utils import get_normalized_target_modules

    rank = config.get("r")
    if max_rank is not None and rank is not None and rank > max_rank:
        raise LoRAAdapterRefused(
            f"LoRA adapter {name!r} has rank {rank}, above --max-lora-rank {max_rank}; raise it to {rank}."
        )
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        return  # "all-linear": SGLang resolves it to the layers the model has
    embeddings = get_normalized_target_modules(targets) & EMBEDDING_TARGETS
    if embeddings or config.get("modules_to_save"):
        raise LoRAAdapterRefused(
            f"LoRA adapter {name!r} trains {sorted(embeddings) or config['modules_to_save']}; "
            "sglang_hf_backend applies LoRA to attention and MLP projections only. Merge those "
            "weights into the base model instead."
        )
    for target in targets:
        normalised = next(iter(get_normalized_target_modules([target])))
        reached = {served[path] for path in served if reaches(normalised, path)}
        if not reached:
            raise LoRAAdapterRefused(
                f"LoRA adapter {name!r} targets {target!r}, which reaches no layer of {class_name}: "
                + why_unreachable(leaf(target), normalised, list(served))
            )
        expected = sglang_lora_split(normalised)
        if tp_size > 1 and reached != {expected}:
            raise LoRAAdapterRefused(
                f"LoRA adapter {name!r} targets {target!r}: at TP={tp_size} SGLang shards LoRA weights of "
                f"{normalised} {expected}-parallel, and {class_name} keeps it {'/'.join(sorted(reached))}. "
                "Serve it at TP=1."
            )


def why_unreachable(target: str, normalised: str, served: list[str]) -> str:
    present = [path for path in served if leaf(path) == target]
    if not present:
        reachable = sorted({leaf(path) for path in served if is_numbered(path)})
        return f"the model has no linear of that name (LoRA-capable layers: {reachable})."
    if normalised != target:
        return (
            f"SGLang applies {target} adapters to a fused {normalised}, and this model serves "
            f"{target} unfused (see the fusion log; SGLANG_HF_BACKEND_DISABLE_FUSIONS may have "
            "turned the fusion off)."
        )
    return (
        f"its decoder layers are at {layer_list_path(present[0])}, and SGLang's LoRA manager only "
        "numbers layers under a `layers.N` path."
    )


def sglang_lora_split(target: str) -> str:
    """How SGLang's LoRA memory pool shards a target's weights under TP (it goes by name)."""
    from sglang.srt.lora.utils import ROW_PARALLELISM_LINEAR_LORA_NAMES

    return "row" if target in ROW_PARALLELISM_LINEAR_LORA_NAMES else "column"


def tp_kind(module: nn.Module) -> str:
    if isinstance(module, RowParallelLinear):
        return "row"
    return "column" if isinstance(module, ColumnParallelLinear) else "replicate"


def fused_layer_of(packed: dict[str, list[str]]) -> dict[str, str]:
    """Part -> the fused layer it is packed into (``q_proj`` -> ``qkv_proj``)."""
    return {part: fused for fused, parts in packed.items() for part in parts}


def served_after_fusion(linears: dict[str, str], packed: dict[str, list[str]]) -> dict[str, str]:
    """Linears (path -> TP kind) once fusion has packed parts (``...q_proj``) into their fused
    layer (``...qkv_proj``), which is column-parallel like its parts."""
    fused_of = fused_layer_of(packed)
    served = {}
    for path, kind in linears.items():
        parent, _, name = path.rpartition(".")
        fused = fused_of.get(name)
        served[f"{parent}.{fused}" if fused else path] = kind
    return served


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


def preflight_adapters(
    lora_paths, linears: dict[str, str], packed, class_name: str, max_rank, tp_size: int
) -> None:
    """Check the adapters named at start-up in the caller's process, before SGLang starts."""
    served = served_after_fusion(linears, packed)
    for name, path in adapter_paths(lora_paths).items():
        check_adapter(name, read_adapter_config(path), served, class_name, max_rank, tp_size)


class LoRALayers:
    """What SGLang's LoRA manager asks the model, answered from its layers."""

    def should_apply_lora(self, module_name: str) -> bool:
        """Only our SGLang linears carry LoRA (SGLang then keeps those inside decoder layers)."""
        return isinstance(self.get_submodule(module_name), TensorOutputLinear)

    def served_linears(self) -> dict[str, LinearBase]:
        """Our linears by path; a LoRA-wrapped one under its own path (not ``.base_layer``)."""
        found = {}
        for name, module in self.named_modules():
            served = getattr(module, "base_layer", module)
            if isinstance(served, TensorOutputLinear) and not name.endswith(".base_layer"):
                found[name] = served
        return found

    def lora_layers(self, target: str, layer_id: int | None = None) -> list[LinearBase]:
        """Our linears SGLang's manager wraps for ``target`` (a normalised name), in one or all layers."""
        return [
            module
            for path, module in self.served_linears().items()
            if reaches(target, path)
            and (layer_id is None or int(LAYER_PATH.search(path + ".").group(1)) == layer_id)
        ]

    def get_hidden_dim(self, target: str, layer_idx: int) -> tuple[int, int]:
        """Full (all ranks) input and output widths of ``target`` in layer ``layer_idx``."""
        layers = self.lora_layers(target, layer_idx)
        if not layers:
            raise LoRAAdapterRefused(f"layer {layer_idx} of this model has no LoRA-capable {target}")
        return layers[0].input_size, layers[0].output_size

    def get_stacked_multiply(self, target: str) -> int:
        """How many projections a fused target packs (q/k/v: 3, gate/up: 2)."""
        layers = self.lora_layers(target)
        return shard_count(layers[0]) if layers else 1

    def check_lora_adapter(self, name: str, path: str, max_rank: int | None) -> None:
        served = {path: tp_kind(module) for path, module in self.served_linears().items()}
        config = read_adapter_config(path)
        check_adapter(name, config, served, self.hf_class_name, max_rank, self.tp_size)


def layer_list_path(module_name: str) -> str:
    """``transformer.h`` for ``transformer.h.0.attn.c_attn``: the path up to the first index."""
    parts = module_name.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), len(parts))
    return ".".join(parts[:index])


def served_path(peft_path: str) -> str:
    """Our module path for a PEFT weight's module (PEFT prefixes ``base_model.model.``)."""
    return peft_path.removeprefix("base_model.model.")


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
        layer = _submodule_or_none(model, f"{served_path(parent)}.{fused}") if fused else None
        if layer is None:
            continue
        sizes = full_output_sizes(getattr(layer, "base_layer", layer))
        for index, other in enumerate(packed[fused]):
            missing = f"{parent}.{other}.lora_{kind}"
            if missing not in weights:
                present = weights[name]
                shape = present.shape if kind.startswith("A") else (sizes[index], present.shape[1])
                weights[missing] = present.new_zeros(shape)


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


def _complete_packed_parts(original, adapter):
    if adapter.base_model is not None:
        for layer in adapter.layers:
            complete_packed_parts(adapter.base_model, layer.weights)
    return original(adapter)


def _model_checks_adapter(original, manager, lora_config, lora_ref):
    """The model's check first: it names the target or rank at fault, SGLang's pool check does not."""
    check = getattr(manager.base_model, "check_lora_adapter", None)
    if check is not None:
        # at start-up the manager validates adapters before it settles on a rank
        check(lora_ref.lora_name, lora_ref.lora_path, getattr(manager, "max_lora_rank", None))
    original(manager, lora_config, lora_ref)


def install() -> None:
    """Register the two hooks on SGLang's LoRA manager (every process; cheap)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    manager = "sglang.srt.lora.lora_manager.LoRAManager"
    HookRegistry.register(f"{manager}.set_lora_module", _wrap_for_hf_callers, HookType.AROUND)
    HookRegistry.register(f"{manager}.validate_new_adapter", _model_checks_adapter, HookType.AROUND)
    HookRegistry.register(
        "sglang.srt.lora.lora.LoRAAdapter._normalize_weights", _complete_packed_parts, HookType.AROUND
    )
