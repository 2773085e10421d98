"""Model classes that replace SGLang's built-in transformers backend.

They keep SGLang's class names: SGLang resolves the transformers backend to
``"Transformers" + ... + "ForCausalLM"`` and other code keys off that prefix.
"""

from sglang_hf_backend.models.base import TransformersBase
from sglang_hf_backend.models.causal import CausalMixin


class TransformersForCausalLM(CausalMixin, TransformersBase):
    """Any attention-interface HF causal LM, served with SGLang's machinery."""


ENTRY_CLASSES = [TransformersForCausalLM]
