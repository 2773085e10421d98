"""Causal-LM capability: vocab-parallel LM head, logits processor, and a check of the HF head.

HF causal-LM classes post-process logits in ``forward`` (Granite divides by
``logits_scaling``, Gemma2 soft-caps, Cohere multiplies by ``logit_scale``). SGLang's
``LogitsProcessor`` can scale and soft-cap; we measure what the HF head does by running
its real ``forward`` on probe values (backbone and head stubbed out) and configure the
processor to match. Anything else it does is refused rather than served differently.
"""

from __future__ import annotations

import math

import torch
from sglang.srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from torch import nn
from transformers import PreTrainedModel

from sglang_hf_backend import cpu_linear
from sglang_hf_backend.compat import IncompatibleModelError
from sglang_hf_backend.models.heads import run_head
from sglang_hf_backend.weights import Route


class CausalMixin:
    """Adds the LM head under the HF class's own attribute name (``lm_head``, ...)."""

    task = "causal"

    def add_capabilities(self, hf_model: PreTrainedModel) -> None:
        super().add_capabilities(hf_model)
        self.head_name = output_embedding_name(hf_model)
        self.tie_word_embeddings = bool(getattr(self.text_config, "tie_word_embeddings", False))
        if self.pipeline.is_last:
            head = self.build_head(hf_model)
            if self.packs_weights:
                cpu_linear.pack_head(head)
            setattr(self, self.head_name, head)
        else:
            self.pipeline.held_elsewhere.append(self.head_name)
        scale = measure_head(hf_model, self.head_name)  # the soft-cap comes from the config
        self.logits_processor = LogitsProcessor(self.text_config, logit_scale=None if scale == 1.0 else scale)

    def build_head(self, hf_model: PreTrainedModel) -> nn.Module:
        """The LM head; a tied one is the input embedding, as SGLang's native models tie it,
        except on a last pipeline stage without the embedding, where it loads the same tensor."""
        if self.tie_word_embeddings and self.pipeline.is_first:
            return self.get_input_embeddings()
        vocab_size, hidden_size = hf_model.get_output_embeddings().weight.shape
        head = ParallelLMHead(vocab_size, hidden_size, quant_config=self.quant_config, prefix=self.head_name)
        if self.tie_word_embeddings:
            self.weight_routes[f"{self.embedding_path()}.weight"] = Route(f"{self.head_name}.weight")
        return head

    def embedding_path(self) -> str:
        embedding = self.get_input_embeddings()
        path = next(name for name, module in self.backbone.named_modules() if module is embedding)
        return f"{self.backbone_path}.{path}"

    def tied_parameters(self) -> set[str]:
        shared = self.tie_word_embeddings and self.pipeline.is_first and self.pipeline.is_last
        return {f"{self.head_name}.weight"} if shared else set()

    def output(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch
    ) -> LogitsProcessorOutput:
        head = getattr(self, self.head_name)
        return self.logits_processor(input_ids, hidden, head, forward_batch)


def output_embedding_name(hf_model: PreTrainedModel) -> str:
    head = hf_model.get_output_embeddings()
    for name, child in hf_model.named_children():
        if child is head:
            return name
    raise IncompatibleModelError(
        f"{type(hf_model).__name__} has no output embedding among its direct children; "
        "sglang_hf_backend cannot find its LM head."
    )


def measure_head(hf_model: PreTrainedModel, head_name: str) -> float:
    """The constant scale of the HF head's logit post-processing, checked over a range.

    The head is run with the backbone returning probe values and the projection
    replaced by identity, so what comes out is exactly the post-processing.
    """
    # fp32 whatever the default dtype: the probe measures, it does not serve.
    probe = torch.arange(-32.0, 32.0, dtype=torch.float32).reshape(1, 4, 16)  # has 1.0 and values past caps
    ids = torch.zeros(probe.shape[:2], dtype=torch.long)
    out = run_head(hf_model, probe, ids, replaced={head_name: nn.Identity()}).logits.float()
    softcap = getattr(hf_model.config.get_text_config(), "final_logit_softcapping", None) or None
    at_one = out[probe == 1.0].item()
    scale = softcap * math.atanh(at_one / softcap) if softcap else at_one
    if math.isclose(scale, 1.0, rel_tol=1e-6):
        scale = 1.0
    expected = probe * scale
    if softcap:
        expected = softcap * torch.tanh(expected / softcap)
    if out.shape != probe.shape or not torch.allclose(out, expected, rtol=1e-5, atol=1e-5):
        raise IncompatibleModelError(
            f"{type(hf_model).__name__}.forward transforms logits in a way SGLang's logits "
            "processor cannot reproduce (it supports one constant scale and a final soft-cap)."
        )
    return scale
