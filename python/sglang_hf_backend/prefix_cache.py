"""The radix cache for our multimodal models, which SGLang would switch off.

SGLang keeps the radix cache off for multimodal models of the transformers backend
(``kv_cache_builder.build_kv_cache``): its built-in class leaves image placeholder tokens
unpadded, so every image would look alike to the cache. Ours pads them with values hashed
from each image (``models/multimodal.py``), as native models do: equal images give equal
token ids and different images never share a prefix. So their cache is built as for a
native model. Kept apart from the model package so the plugin entry point stays cheap.
"""

from __future__ import annotations


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.mem_cache.kv_cache_builder.build_kv_cache", radix_cache_for_padded_models, HookType.AROUND
    )


def radix_cache_for_padded_models(original, *args, **kwargs):
    """AROUND-hook of ``build_kv_cache``: a model that pads image tokens is built as native."""
    from sglang.srt.configs.model_config import ModelImpl

    model = kwargs["tp_worker"].model_runner.model
    model_config = kwargs["model_config"]
    if not getattr(model, "pads_image_tokens", False):
        return original(*args, **kwargs)
    resolved = getattr(model_config, "_resolved_model_impl", None)
    model_config._resolved_model_impl = ModelImpl.SGLANG  # what get_resolved_model_impl answers
    try:
        return original(*args, **kwargs)
    finally:
        model_config._resolved_model_impl = resolved
