"""Running an HF model's own head code on hidden states that SGLang's backbone computed.

HF classes put the logic after the backbone in their ``forward`` (Granite's logit scaling,
a classifier reading the last non-pad token, BERT's pooler and classifier). Rather than
re-implementing it per family, ``run_head`` calls that ``forward`` with the backbone
swapped for a stand-in returning the given hidden states: the head's real modules and
code do the rest, exactly as in HF.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPooling


def run_head(
    hf_model: PreTrainedModel,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    replaced: dict[str, nn.Module] | None = None,
    pooler: nn.Module | None = None,
):
    """``hf_model``'s output for ``hidden`` ``[batch, tokens, hidden]`` as the backbone's output.

    ``replaced`` swaps further children for the call (a projection for identity, say);
    ``pooler`` computes the backbone's ``pooler_output`` (BERT-style backbones pool
    inside the backbone, so their heads read it from the backbone's output).
    """
    stand_in = _ProbeBackbone(hidden, None if pooler is None else pooler(hidden))
    with _swapped(hf_model, {hf_model.base_model_prefix: stand_in, **(replaced or {})}):
        return hf_model(input_ids=input_ids, use_cache=False)


class _ProbeBackbone(nn.Module):
    """Stands in for the backbone and anything the head reaches through it.

    Heads call the backbone directly (``self.model(...)``) or a part of it (OPT's
    ``self.model.decoder(...)``); every attribute the stand-in lacks is the stand-in again.
    """

    def __init__(self, hidden: torch.Tensor, pooled: torch.Tensor | None):
        super().__init__()
        self.hidden = hidden
        self.pooled = pooled

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return self

    def forward(self, *args, **kwargs) -> "_ProbeOutput":
        return _ProbeOutput(last_hidden_state=self.hidden, pooler_output=self.pooled)


@dataclasses.dataclass
class _ProbeOutput(BaseModelOutputWithPooling):
    """The backbone output a head reads; fields it has no value for (MoE router logits) are None."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


@contextlib.contextmanager
def _swapped(module: nn.Module, replacements: dict[str, nn.Module]):
    saved = {name: getattr(module, name) for name in replacements}
    try:
        for name, child in replacements.items():
            setattr(module, name, child)
        yield
    finally:
        for name, child in saved.items():
            setattr(module, name, child)
