"""Everything decided about a model before any parameter exists, and the preflight.

The checkpoint's HF class (built-in or remote code) is resolved and gated, the model is
built on the meta device, its backbone traced once, its tensor-parallel layout planned
and its fusions matched. ``preflight`` runs this in the launching process as soon as
the arguments ask for the transformers implementation (a scheduler that fails takes its
launcher down with it, so the user gets the error there instead); ``analyse`` runs again
at the start of model construction in every scheduler.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import re
from pathlib import Path
from typing import Iterator

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from sglang_hf_backend import compat
from sglang_hf_backend.attention import ATTENTION_NAME
from sglang_hf_backend.lora import preflight_adapters
from sglang_hf_backend.models.pipeline import DecoderStack, decoder_stack
from sglang_hf_backend.surgery.fusers import FusionContext, FusionPlan, plan_fusions
from sglang_hf_backend.surgery.linear import is_linear
from sglang_hf_backend.surgery.roles import is_expert_bank
from sglang_hf_backend.surgery.tensor_parallel import TPLayout, local_input_features, plan_tensor_parallel
from sglang_hf_backend.surgery.trace import ModelTrace, trace_model
from sglang_hf_backend.weights import CheckpointNames, check_checkpoint_files


@dataclasses.dataclass
class Analysis:
    hf_model: PreTrainedModel  # on meta: parameters hold no memory
    trace: ModelTrace
    tp_layout: TPLayout
    fusions: FusionPlan


def analyse(
    config: PretrainedConfig, trust_remote_code: bool, tp_size: int, task: str = "causal"
) -> Analysis:
    hf_class = compat.resolve_hf_class(config, trust_remote_code, task)
    compat.check_attention_interface(hf_class)
    hf_model = build_on_meta(hf_class, without_cpu_padding(config))
    trace = trace_backbone(hf_model)
    layout = plan_tensor_parallel(hf_model.base_model, trace, tp_size)
    fusions = plan_fusions(trace, FusionContext(tp_size, layout))
    return Analysis(hf_model, trace, layout, fusions)


def preflight(
    model_path: str,
    trust_remote_code: bool,
    revision: str | None = None,
    tp_size: int = 1,
    torchao=None,
    is_embedding: bool = False,
    lora_paths=None,
    max_lora_rank: int | None = None,
    pp_size: int = 1,
) -> None:
    """Everything checkable before SGLang starts: path, class, attention gate, TP layout, fusions,
    quantization, the checkpoint's files (from their headers), the LoRA adapters named and
    where pipeline stages cut."""
    directory = local_checkpoint(model_path)
    class_name = compat.sglang_backend_class(model_path, trust_remote_code, revision, is_embedding)
    if "MultiModal" in class_name:
        raise compat.multimodal_refusal(class_name)
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code, revision=revision)
    analysis = analyse(config, trust_remote_code, tp_size, compat.backend_task(class_name))
    if pp_size > 1:
        check_pipeline_split(analysis, class_name, compat.backend_task(class_name), pp_size)
    if torchao is not None:
        backbone = analysis.hf_model.base_model
        torchao.check_group_size(local_input_features(backbone, analysis.tp_layout, tp_size))
    if directory is not None:
        check_checkpoint_files(directory, analysis.hf_model, CheckpointNames.of(analysis.hf_model))
    if lora_paths:
        packed = analysis.fusions.packed_modules_mapping()
        linears = linear_paths(analysis.hf_model, analysis.tp_layout)
        preflight_adapters(lora_paths, linears, packed, type(analysis.hf_model).__name__, max_lora_rank)


def check_pipeline_split(analysis: Analysis, class_name: str, task: str, pp_size: int) -> DecoderStack:
    """The decoder stack pipeline stages cut: causal LMs only, cut exactly, a layer or more each."""
    if task != "causal":
        raise compat.IncompatibleModelError(
            f"pipeline parallelism serves causal LMs; {class_name} serves {task}. Use pp_size=1."
        )
    stack = decoder_stack(analysis.hf_model, analysis.trace)
    if stack.num_layers < pp_size:
        raise compat.IncompatibleModelError(
            f"pp_size={pp_size} needs at least one decoder layer per stage; the model has {stack.num_layers}."
        )
    return stack


def linear_paths(hf_model: PreTrainedModel, layout: TPLayout) -> list[str]:
    """Paths (in the HF model) of the linears the backbone's layout places."""
    prefix = f"{hf_model.base_model_prefix}." if hf_model.base_model_prefix else ""
    return [
        f"{prefix}{name}" for name in layout.placements if is_linear(hf_model.base_model.get_submodule(name))
    ]


def local_checkpoint(model_path: str) -> Path | None:
    """The checkpoint directory, None for a hub id, or an error naming a path that is not there."""
    path = Path(model_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise FileNotFoundError(f"model path {model_path!r} is a file; pass the checkpoint's directory.")
    if not _HUB_ID.fullmatch(model_path):
        raise FileNotFoundError(f"model path {model_path!r} does not exist (no such directory).")
    return None  # transformers resolves hub ids, and says so when it cannot


_HUB_ID = re.compile(r"[\w][\w.-]*(/[\w][\w.-]*)?")


def trace_backbone(hf_model: PreTrainedModel) -> ModelTrace:
    """The backbone's trace (expert banks kept opaque); a model that cannot be traced is refused."""
    name = type(hf_model).__name__
    try:
        trace = trace_model(hf_model.base_model, opaque=is_expert_bank)
    except Exception as reason:
        raise compat.IncompatibleModelError(
            f"{name} could not be run on meta tensors to find its layers "
            f"({type(reason).__name__}: {reason}); sglang_hf_backend cannot serve it. "
            "Use SGLang's native implementation (model_impl='sglang') if it has one."
        ) from reason
    if not trace.attention_calls:
        raise compat.IncompatibleModelError(
            f"{name} never called the attention interface during a trial "
            "forward, so its attention cannot be routed to SGLang; it is not compatible."
        )
    return trace


# SGLang pads head counts and intermediate sizes in the config on CPU when they do not
# divide by tp_size (``adjust_config_with_unaligned_cpu_tp``), keeping the originals as
# ``original_<name>``. HF modules must be built with the checkpoint's real sizes.
_CPU_PADDED = {
    "num_attention_heads": "original_num_attention_heads",
    "num_key_value_heads": "original_total_num_kv_heads",
    "intermediate_size": "original_intermediate_size",
    "moe_intermediate_size": "original_moe_intermediate_size",
    "shared_expert_intermediate_size": "original_shared_expert_intermediate_size",
}


def without_cpu_padding(config: PretrainedConfig) -> PretrainedConfig:
    """A copy of ``config`` with SGLang's CPU head/intermediate padding undone."""
    restored = copy.deepcopy(config)
    text_config = restored.get_text_config()
    for target in [restored] + ([text_config] if text_config is not restored else []):
        for name, original in _CPU_PADDED.items():
            value = getattr(target, original, None)
            if value is not None and hasattr(target, name):
                setattr(target, name, value)
    return restored


def build_on_meta(hf_class: type[PreTrainedModel], config: PretrainedConfig) -> PreTrainedModel:
    """The HF model with parameters on meta (no memory) and buffers computed for real.

    Expert banks get transformers' eager implementation: the MoE fuser runs them on probe
    values, which the grouped-matmul kernels refuse in fp32 on CPU.
    """
    options = {"experts_implementation": "eager"} if hf_class._can_set_experts_implementation() else {}
    with _parameters_on_meta():
        return hf_class._from_config(
            config, dtype=torch.get_default_dtype(), attn_implementation=ATTENTION_NAME, **options
        )


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Create parameters on meta while buffers (e.g. RoPE frequencies) stay real."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register
