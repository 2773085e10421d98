"""Model classes that replace SGLang's built-in transformers backend.

They keep SGLang's class names: SGLang resolves the transformers backend to
``"Transformers" + ["MultiModal"] + ["MoE"] + ("ForCausalLM" | ...)`` and other code keys
off that prefix. Each class is a base plus capability mixins, one line each.
"""

from sglang_hf_backend.models.base import TransformersBase
from sglang_hf_backend.models.causal import CausalMixin
from sglang_hf_backend.models.moe import MoEMixin


class TransformersForCausalLM(CausalMixin, TransformersBase):
    """Any attention-interface HF causal LM, served with SGLang's machinery."""


class TransformersMoEForCausalLM(MoEMixin, CausalMixin, TransformersBase):
    """An HF causal LM whose sparse-MoE blocks run on SGLang's TopK and FusedMoE."""


ENTRY_CLASSES = [TransformersForCausalLM, TransformersMoEForCausalLM]
