"""Pooling capabilities: embeddings, and sequence-classification / reward scores.

Embeddings pool the backbone's hidden states with SGLang's ``Pooler`` the way the
checkpoint's sentence-transformers files declare (``modules.json``: a ``Pooling`` module
with CLS, mean or last-token pooling, then ``Normalize`` or not); without them, decoders
pool their last token and encoders their first, normalised, as SGLang's own embedding
models do. Classifiers and reward models keep the HF class's own head modules and code
(``heads.run_head``): each request's hidden states go through the real ``forward`` after
the backbone, so the head picks the last non-pad token, pools, applies BERT's pooler or a
RoBERTa classification head exactly as transformers does. SGLang's ``/v1/embeddings``,
``/classify`` and ``/v1/classify`` serve the results (labels from the config's ``id2label``),
and ``/v1/rerank`` scores sentence pairs with a cross-encoder (segment ids reach the backbone).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch
from sglang.srt.layers.activation import get_cross_encoder_activation_function
from sglang.srt.layers.pooler import EmbeddingPoolerOutput, Pooler, PoolingType
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.runtime_context import get_server_args
from transformers import PreTrainedModel

from sglang_hf_backend import diagnostics
from sglang_hf_backend.compat import IncompatibleModelError
from sglang_hf_backend.models.base import materialise_meta_parameters
from sglang_hf_backend.models.heads import run_head

# sentence-transformers pooling modes -> SGLang's pooling
_ST_POOLING = {
    "pooling_mode_cls_token": PoolingType.CLS,
    "pooling_mode_mean_tokens": PoolingType.MEAN,
    "pooling_mode_lasttoken": PoolingType.LAST,
}
_ST_MODULES = "sentence_transformers.models."


@dataclasses.dataclass(frozen=True)
class PoolingSpec:
    pooling: PoolingType
    normalize: bool
    source: str  # where the choice came from, for the decision log


def pooling_spec(model_path: str, causal: bool) -> PoolingSpec:
    """The checkpoint's sentence-transformers pooling, or SGLang's default for its kind."""
    modules_file = Path(model_path) / "modules.json"
    if not modules_file.is_file():
        pooling = PoolingType.LAST if causal else PoolingType.CLS
        return PoolingSpec(pooling, True, "default for a " + ("decoder" if causal else "encoder"))
    modules = json.loads(modules_file.read_text())
    kinds = [m["type"].removeprefix(_ST_MODULES) for m in modules]
    unsupported = [k for k in kinds if k not in ("Transformer", "Pooling", "Normalize")]
    if unsupported or "Pooling" not in kinds:
        raise IncompatibleModelError(
            f"{modules_file} lists sentence-transformers modules {kinds}; sglang_hf_backend applies "
            "Transformer, Pooling and Normalize only (no Dense or other layers after pooling)."
        )
    pooling_dir = next(m["path"] for m in modules if m["type"].endswith("Pooling"))
    config = json.loads((Path(model_path) / pooling_dir / "config.json").read_text())
    modes = [key for key, value in config.items() if key.startswith("pooling_mode_") and value]
    if len(modes) != 1 or modes[0] not in _ST_POOLING or not config.get("include_prompt", True):
        raise IncompatibleModelError(
            f"{pooling_dir}/config.json asks for pooling {modes} (include_prompt="
            f"{config.get('include_prompt', True)}); SGLang's pooler does one of "
            f"{sorted(_ST_POOLING)} over the whole prompt."
        )
    return PoolingSpec(_ST_POOLING[modes[0]], "Normalize" in kinds, "sentence-transformers modules.json")


class EmbeddingMixin:
    """Embeddings from the backbone's hidden states; the HF head, if any, is not served."""

    task = "embedding"

    def add_capabilities(self, hf_model: PreTrainedModel) -> None:
        super().add_capabilities(hf_model)
        causal = all(spec.causal for spec in self.attention_layers)
        self.pooling = pooling_spec(get_server_args().model_path, causal)
        self.pooler = Pooler(pooling_type=self.pooling.pooling, normalize=self.pooling.normalize)
        self.checkpoint_names.ignore_unexpected += unserved_children(hf_model)
        diagnostics.decision(
            "embeddings: %s pooling%s (%s)",
            self.pooling.pooling.name,
            ", normalised" if self.pooling.normalize else "",
            self.pooling.source,
        )
        if not causal or self.pooling.pooling != PoolingType.LAST:
            keep_prompts_whole(
                f"{self.pooling.pooling.name} pooling over {'bidirectional' if not causal else 'causal'} attention"
            )

    def output(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch
    ) -> EmbeddingPoolerOutput:
        return self.pooler(hidden, forward_batch)


def keep_prompts_whole(reason: str) -> None:
    """Turn the radix cache off in this scheduler before it is built.

    A reused prefix skips its tokens' forward pass: right for a decoder read at its last
    token, wrong when the output needs every token's hidden state or when attention is
    bidirectional (a cached token's keys depend on tokens after it). The model finds this
    out while it is built, which SGLang does before it builds the cache.
    """
    from sglang.srt.runtime_context import get_context, get_memory

    if not get_memory().disable_radix_cache:
        get_context().override("sglang_hf_backend", disable_radix_cache=True)
        diagnostics.decision("radix cache off: %s needs every prompt token computed", reason)


def unserved_children(hf_model: PreTrainedModel) -> list[re.Pattern]:
    """Checkpoint names of the HF model's parts outside the backbone (an LM head, say)."""
    backbone = hf_model.base_model_prefix
    return [re.compile(f"^{re.escape(name)}\\.") for name, _ in hf_model.named_children() if name != backbone]


class ClassificationMixin:
    """Scores from the HF class's own head, run on each request's hidden states."""

    task = "classification"

    def add_capabilities(self, hf_model: PreTrainedModel) -> None:
        super().add_capabilities(hf_model)
        backbone = hf_model.base_model_prefix
        self.head_names = [name for name, _ in hf_model.named_children() if name != backbone]
        for name in self.head_names:  # replicated on every rank; small
            head = getattr(hf_model, name)
            materialise_meta_parameters(head)
            setattr(self, name, head)
        # Kept outside the module tree: its backbone is ours, its heads are registered above.
        object.__setattr__(self, "hf_model", hf_model)
        # What SGLang's native cross-encoders apply to their scores: identity unless the config
        # names a sentence-transformers activation.
        self.score_activation = get_cross_encoder_activation_function(self.config)
        self.num_labels = self.head_outputs(torch.zeros(1, 2, self.text_config.hidden_size), [1, 2]).shape[-1]
        if not all(spec.causal for spec in self.attention_layers):
            keep_prompts_whole("bidirectional attention")
        elif not self.head_reads_only_the_last_token():
            keep_prompts_whole(f"{type(hf_model).__name__}'s head reads more than the last token")
        diagnostics.decision(
            "classification: %d label(s) from %s's own head (%s)",
            self.num_labels,
            type(hf_model).__name__,
            ", ".join(self.head_names),
        )

    def head_reads_only_the_last_token(self) -> bool:
        """Does the head's output ignore every position but the last? (Probed with two inputs.)"""
        generator = torch.Generator().manual_seed(0)
        hidden = torch.randn(2, 4, self.text_config.hidden_size, generator=generator)
        hidden[1, -1] = hidden[0, -1]
        first, second = (self.head_outputs(h[None], [5, 6, 7, 8]) for h in hidden)
        return torch.equal(first, second)

    def head_outputs(self, hidden: torch.Tensor, input_ids: list[int]) -> torch.Tensor:
        """Logits ``[1, labels]`` for one request's hidden states ``[1, tokens, hidden]``."""
        pooler = getattr(self.backbone, "pooler", None)  # BERT-style backbones pool inside
        ids = torch.tensor([input_ids], device=hidden.device)
        return run_head(self.hf_model, hidden, ids, pooler=pooler).logits

    def output(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch
    ) -> EmbeddingPoolerOutput:
        lengths = forward_batch.extend_seq_lens_cpu
        logits = [
            self.head_outputs(h[None], ids.tolist())
            for h, ids in zip(hidden.split(lengths), input_ids.split(lengths))
        ]
        return EmbeddingPoolerOutput(embeddings=self.score_activation(torch.cat(logits).float()))
