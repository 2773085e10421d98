"""Model classes that replace SGLang's built-in transformers backend.

SGLang resolves ``impl="transformers"`` to one of twelve names,
``"Transformers" + ["MultiModal"] + ["MoE"] + ("ForCausalLM" | "EmbeddingModel" |
"ForSequenceClassification")``, and other SGLang code keys off that prefix, so ours keep
those names. Each is a base plus capability mixins, one line each. The MoE part of a name
changes nothing for us (the MoE fuser finds sparse blocks in any model); the mixin reports
the experts. The multimodal mixin puts the HF vision tower in front of the language model.
"""

from sglang_hf_backend.models.base import TransformersBase
from sglang_hf_backend.models.causal import CausalMixin
from sglang_hf_backend.models.moe import MoEMixin
from sglang_hf_backend.models.multimodal import MultiModalMixin
from sglang_hf_backend.models.pooling import ClassificationMixin, EmbeddingMixin


class TransformersForCausalLM(CausalMixin, TransformersBase): ...


class TransformersMoEForCausalLM(MoEMixin, CausalMixin, TransformersBase): ...


class TransformersEmbeddingModel(EmbeddingMixin, TransformersBase): ...


class TransformersMoEEmbeddingModel(MoEMixin, EmbeddingMixin, TransformersBase): ...


class TransformersForSequenceClassification(ClassificationMixin, TransformersBase): ...


class TransformersMoEForSequenceClassification(MoEMixin, ClassificationMixin, TransformersBase): ...


class TransformersMultiModalForCausalLM(MultiModalMixin, CausalMixin, TransformersBase): ...


class TransformersMultiModalMoEForCausalLM(MultiModalMixin, MoEMixin, CausalMixin, TransformersBase): ...


class TransformersMultiModalEmbeddingModel(MultiModalMixin, EmbeddingMixin, TransformersBase): ...


class TransformersMultiModalMoEEmbeddingModel(
    MultiModalMixin, MoEMixin, EmbeddingMixin, TransformersBase
): ...


class TransformersMultiModalForSequenceClassification(
    MultiModalMixin, ClassificationMixin, TransformersBase
): ...


class TransformersMultiModalMoEForSequenceClassification(
    MultiModalMixin, MoEMixin, ClassificationMixin, TransformersBase
): ...


ENTRY_CLASSES = [
    TransformersForCausalLM,
    TransformersMoEForCausalLM,
    TransformersEmbeddingModel,
    TransformersMoEEmbeddingModel,
    TransformersForSequenceClassification,
    TransformersMoEForSequenceClassification,
    TransformersMultiModalForCausalLM,
    TransformersMultiModalMoEForCausalLM,
    TransformersMultiModalEmbeddingModel,
    TransformersMultiModalMoEEmbeddingModel,
    TransformersMultiModalForSequenceClassification,
    TransformersMultiModalMoEForSequenceClassification,
]
