"""Which transformers class serves a checkpoint, and may it be served at all.

Plain checks on the config and the class, before anything is built; they depend on
nothing else in this package. ``models/analysis.py`` runs them first, in the launching
process (preflight) and again in each scheduler.
"""

from __future__ import annotations

import transformers
from transformers import PretrainedConfig, PreTrainedModel
from transformers.dynamic_module_utils import get_class_from_dynamic_module
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
    MODEL_MAPPING,
)

# task -> (auto_map keys a checkpoint's own code may use, transformers' class mapping, what for)
TASKS = {
    "causal": (("AutoModelForCausalLM",), MODEL_FOR_CAUSAL_LM_MAPPING, "causal-LM"),
    "embedding": (("AutoModel", "AutoModelForCausalLM"), MODEL_MAPPING, "base-model"),
    "classification": (
        ("AutoModelForSequenceClassification",),
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
        "sequence-classification",
    ),
}


class IncompatibleModelError(ValueError):
    """The checkpoint names a model that this backend cannot serve exactly."""


def resolve_hf_class(
    config: PretrainedConfig, trust_remote_code: bool, task: str = "causal"
) -> type[PreTrainedModel]:
    """The transformers class that serves ``config`` for ``task`` (causal, embedding, classification).

    In order: the architecture named in config.json if transformers has it, the
    checkpoint's own code (``auto_map``, needs ``trust_remote_code``), then the class
    transformers maps this config type to for the task. An embedding model is served
    from any class's backbone; a classifier needs a class with its head.
    """
    auto_keys, mapping, what = TASKS[task]
    architecture = (getattr(config, "architectures", None) or [None])[0]
    builtin = getattr(transformers, architecture, None) if architecture else None
    if isinstance(builtin, type) and issubclass(builtin, PreTrainedModel):
        return builtin
    auto_map = getattr(config, "auto_map", None) or {}
    remote_ref = next((auto_map[key] for key in auto_keys if key in auto_map), None)
    if remote_ref:
        if not trust_remote_code:
            raise IncompatibleModelError(
                f"{architecture or 'This model'} is defined by code inside the checkpoint "
                f"({remote_ref}); pass trust_remote_code=True (--trust-remote-code) to load it."
            )
        return get_class_from_dynamic_module(remote_ref, config._name_or_path)
    if type(config) in mapping:
        return mapping[type(config)]
    raise IncompatibleModelError(
        f"Unknown architecture {architecture!r} (model_type {getattr(config, 'model_type', None)!r}): "
        f"transformers {transformers.__version__} has no class of that name, the checkpoint's "
        f"config.json has no auto_map entry ({' or '.join(auto_keys)}) for its own code, and no "
        f"{what} class is registered for its config type. Check the model path, upgrade "
        "transformers, or add an auto_map entry pointing at the modeling file."
    )


def check_attention_interface(model_class: type[PreTrainedModel]) -> None:
    """Refuse classes whose attention bypasses transformers' attention interface."""
    if getattr(model_class, "_supports_attention_backend", False):
        return
    raise IncompatibleModelError(
        f"{model_class.__name__} cannot be served by sglang_hf_backend: its attention layers do not "
        "call transformers' attention interface (_supports_attention_backend is False), so their "
        "attention cannot be routed to SGLang's paged RadixAttention. Serve it with SGLang's native "
        "implementation (model_impl='sglang') if SGLang has one, or use a model whose modeling code "
        "calls ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...) and sets "
        "_supports_attention_backend = True."
    )
