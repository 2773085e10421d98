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
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
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
# A multimodal causal LM: images and text in, text out.
MULTIMODAL_CAUSAL = (
    ("AutoModelForImageTextToText", "AutoModelForVision2Seq", "AutoModelForCausalLM"),
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    "image-text-to-text",
)


class IncompatibleModelError(ValueError):
    """The checkpoint names a model that this backend cannot serve exactly."""


def resolve_hf_class(
    config: PretrainedConfig, trust_remote_code: bool, task: str = "causal", multimodal: bool = False
) -> type[PreTrainedModel]:
    """The transformers class that serves ``config`` for ``task`` (causal, embedding, classification).

    In order: the architecture named in config.json if transformers has it, the
    checkpoint's own code (``auto_map``, needs ``trust_remote_code``), then the class
    transformers maps this config type to for the task. An embedding model is served
    from any class's backbone; a classifier needs a class with its head.
    """
    if multimodal and task == "classification":
        raise IncompatibleModelError(
            "sglang_hf_backend serves multimodal models as causal LMs and embedding models; "
            "classifying images with text is not served yet. Serve it with SGLang's native "
            "implementation (model_impl='sglang') if SGLang has one."
        )
    auto_keys, mapping, what = MULTIMODAL_CAUSAL if multimodal and task == "causal" else TASKS[task]
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


def sglang_backend_class(
    model_path: str, trust_remote_code: bool, revision: str | None, is_embedding: bool
) -> str:
    """The ``Transformers...`` class SGLang will build for this checkpoint (its own resolution)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.utils import _get_transformers_backend_arch

    config = ModelConfig(
        model_path,
        trust_remote_code=trust_remote_code,
        revision=revision,
        is_embedding=is_embedding,
        model_impl="transformers",
    )
    return _get_transformers_backend_arch(config, config.hf_config.architectures or [])


def backend_task(class_name: str) -> str:
    """What one of SGLang's transformers-backend class names serves: causal, embedding or classification."""
    for suffix, task in (
        ("ForCausalLM", "causal"),
        ("EmbeddingModel", "embedding"),
        ("ForSequenceClassification", "classification"),
    ):
        if class_name.endswith(suffix):
            return task
    raise ValueError(f"{class_name!r} is not one of SGLang's transformers-backend class names")


def is_multimodal_class(class_name: str) -> bool:
    """Is this one of SGLang's ``TransformersMultiModal...`` names (media in besides text)?"""
    return class_name.startswith("TransformersMultiModal")
