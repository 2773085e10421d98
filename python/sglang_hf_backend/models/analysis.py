"""Everything decided about a model before any parameter exists.

The checkpoint's HF class (built-in or remote code) is resolved and gated, the model is
built on the meta device, its backbone traced once, its tensor-parallel layout planned
and its fusions matched. This runs in the launching process as a preflight (so bad input fails before
subprocesses start) and at the start of model construction in every scheduler.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Iterator

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from sglang_hf_backend import compat
from sglang_hf_backend.attention import ATTENTION_NAME
from sglang_hf_backend.surgery.fusers import FusionContext, FusionPlan, plan_fusions
from sglang_hf_backend.surgery.tensor_parallel import TPLayout, plan_tensor_parallel
from sglang_hf_backend.surgery.trace import ModelTrace, trace_model


@dataclasses.dataclass
class Analysis:
    hf_model: PreTrainedModel  # on meta: parameters hold no memory
    trace: ModelTrace
    tp_layout: TPLayout
    fusions: FusionPlan


def analyse(config: PretrainedConfig, trust_remote_code: bool, tp_size: int) -> Analysis:
    hf_class = compat.resolve_hf_class(config, trust_remote_code)
    compat.check_attention_interface(hf_class)
    hf_model = build_on_meta(hf_class, without_cpu_padding(config))
    trace = trace_model(hf_model.base_model)
    if not trace.attention_calls:
        raise compat.IncompatibleModelError(
            f"{hf_class.__name__} never called the attention interface during a trial "
            "forward, so its attention cannot be routed to SGLang; it is not compatible."
        )
    layout = plan_tensor_parallel(hf_model.base_model, trace, tp_size)
    fusions = plan_fusions(trace, FusionContext(tp_size, layout))
    return Analysis(hf_model, trace, layout, fusions)


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
    """The HF model with parameters on meta (no memory) and buffers computed for real."""
    with _parameters_on_meta():
        return hf_class._from_config(
            config, dtype=torch.get_default_dtype(), attn_implementation=ATTENTION_NAME
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
