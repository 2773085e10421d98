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
    # The text backbone and its name: "model", "transformer", "model.language_model"; a base
    # class (BertModel) is its own backbone, named by its base_model_prefix.
    backbone: nn.Module
    backbone_path: str
    trace: ModelTrace
    tp_layout: TPLayout
    fusions: FusionPlan
    multimodal: bool = False  # the backbone is the language model of a multimodal model


def analyse(
    config: PretrainedConfig,
    trust_remote_code: bool,
    tp_size: int,
    task: str = "causal",
    multimodal: bool = False,
) -> Analysis:
    """Everything about the model that is decided before a parameter exists.

    For a multimodal model the backbone is its language model (what SGLang's attention,
    parallel layers and fusions serve); the vision tower and projector stay HF modules.
    """
    hf_class = compat.resolve_hf_class(config, trust_remote_code, task, multimodal)
    compat.check_attention_interface(hf_class)
    hf_model = build_on_meta(hf_class, without_cpu_padding(config))
    if multimodal:
        path = language_model_path(hf_model)
        backbone = hf_model.get_submodule(path)
    else:
        path, backbone = hf_model.base_model_prefix, hf_model.base_model
    trace = trace_backbone(hf_model, backbone)
    layout = plan_tensor_parallel(backbone, trace, tp_size)
    fusions = plan_fusions(trace, FusionContext(tp_size, layout))
    return Analysis(hf_model, backbone, path, trace, layout, fusions, multimodal)


def language_model_path(hf_model: PreTrainedModel) -> str:
    """Where a multimodal model keeps its language model (``model.language_model`` in transformers 5)."""
    decoder = hf_model.get_decoder()
    path = next((name for name, module in hf_model.named_modules() if module is decoder), None)
    if not path or decoder is hf_model.base_model:
        raise compat.IncompatibleModelError(
            f"{type(hf_model).__name__} has no language model apart from its other towers "
            "(get_decoder() finds none), so sglang_hf_backend cannot tell which part to serve "
            "on SGLang's attention."
        )
    return path


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
    attention_backend: str | None = None,
) -> None:
    """Everything checkable before SGLang starts: path, class, attention gate, TP layout, fusions,
    quantization, the checkpoint's files (from their headers), the LoRA adapters named, where
    pipeline stages cut, and whether the attention backend reproduces a VLM's image masks."""
    directory = local_checkpoint(model_path)
    class_name = compat.sglang_backend_class(model_path, trust_remote_code, revision, is_embedding)
    multimodal = compat.is_multimodal_class(class_name)
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code, revision=revision)
    analysis = analyse(config, trust_remote_code, tp_size, compat.backend_task(class_name), multimodal)
    if multimodal:
        check_no_lora(class_name, lora_paths)
        check_image_masks(analysis, class_name, attention_backend)
    if pp_size > 1:
        check_pipeline_split(analysis, class_name, compat.backend_task(class_name), pp_size)
    if torchao is not None:
        torchao.check_group_size(local_input_features(analysis.backbone, analysis.tp_layout, tp_size))
    if directory is not None:
        check_checkpoint_files(directory, analysis.hf_model, CheckpointNames.of(analysis.hf_model))
    if lora_paths:
        packed = analysis.fusions.packed_modules_mapping()
        linears = linear_paths(analysis)
        preflight_adapters(lora_paths, linears, packed, type(analysis.hf_model).__name__, max_lora_rank)


def check_image_masks(analysis: Analysis, class_name: str, attention_backend: str | None) -> None:
    """Masks over image tokens must be ones our attention reproduces, on the backend chosen."""
    from sglang_hf_backend.models.multimodal import check_span_backend, image_tokens_attend_both_ways

    if image_tokens_attend_both_ways(analysis.hf_model):
        check_span_backend(class_name, attention_backend)


def check_no_lora(class_name: str, lora) -> None:
    """LoRA adapters are served on text models only."""
    if lora:
        raise compat.IncompatibleModelError(
            f"{class_name}: sglang_hf_backend serves LoRA adapters on text models only; serve "
            "this multimodal model without --enable-lora / --lora-paths."
        )


def check_pipeline_split(analysis: Analysis, class_name: str, task: str, pp_size: int) -> DecoderStack:
    """The decoder stack pipeline stages cut: causal LMs only, cut exactly, a layer or more each."""
    if task != "causal" or analysis.multimodal:
        what = "a multimodal model" if analysis.multimodal else task
        raise compat.IncompatibleModelError(
            f"pipeline parallelism serves text causal LMs; {class_name} serves {what}. Use pp_size=1 "
            "(tp_size splits it instead)."
        )
    stack = decoder_stack(analysis.backbone, analysis.trace)
    if stack.num_layers < pp_size:
        raise compat.IncompatibleModelError(
            f"pp_size={pp_size} needs at least one decoder layer per stage; the model has {stack.num_layers}."
        )
    return stack


def linear_paths(analysis: Analysis) -> list[str]:
    """Paths (in the HF model) of the linears the backbone's layout places."""
    prefix = f"{analysis.backbone_path}." if analysis.backbone_path else ""
    return [
        f"{prefix}{name}"
        for name in analysis.tp_layout.placements
        if is_linear(analysis.backbone.get_submodule(name))
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


def trace_backbone(hf_model: PreTrainedModel, backbone: nn.Module) -> ModelTrace:
    """The backbone's trace (expert banks kept opaque); a model that cannot be traced is refused."""
    name = type(hf_model).__name__
    try:
        trace = trace_model(backbone, opaque=is_expert_bank)
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
            config, dtype=torch.get_default_dtype(), attn_implementation=attention_choice(config), **options
        )


def attention_choice(config: PretrainedConfig) -> str | dict[str, str]:
    """Our attention function for the language model; towers that see no KV cache (a vision
    encoder) keep torch's SDPA, since they run as HF code on each request's own inputs."""
    towers = [key for key in getattr(config, "sub_configs", {}) if key != "text_config"]
    if not towers:
        return ATTENTION_NAME
    return {"": ATTENTION_NAME, "text_config": ATTENTION_NAME, **{key: "sdpa" for key in towers}}


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
