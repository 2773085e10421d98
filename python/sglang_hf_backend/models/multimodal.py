"""Multimodal models: not served yet, and said so before anything is built."""

from __future__ import annotations

from sglang_hf_backend.compat import multimodal_refusal


class MultiModalRefusal:
    """SGLang resolved a ``TransformersMultiModal...`` class: refuse with the alternatives."""

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        raise multimodal_refusal(type(self).__name__)
