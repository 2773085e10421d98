"""Multimodal capability: the HF vision tower in front of our language model.

SGLang resolves vision-language checkpoints to ``TransformersMultiModal...``. Their language
model is served like any text backbone (RadixAttention, fusion, TP, torchao); the vision
tower and projector stay the HF modules, replicated on every TP rank, and turn each image
into the rows its placeholder tokens stand for (the class's own ``get_image_features``).
Images reach the model through SGLang's multimodal path: its processor runs the HF
processor on text and images, every image placeholder token is replaced by a value hashed
from the image (``pad_input_ids``), and SGLang's embedding routine puts the image features
where those values stand. Because equal images give equal token ids and different images
never do, the radix cache stays exact and stays on (SGLang turns it off for the
transformers backend, whose built-in class leaves placeholders unpadded).

What the language model needs besides the embeddings is read off the HF class:
- M-RoPE (Qwen2-VL): positions ``[3, tokens]`` (SGLang computes them from the image grids)
  instead of one row;
- masks that let an image's tokens attend to each other both ways (Gemma3), found by
  running the class's own ``create_masks_for_generate`` on a probe: served on ``cpu_sdpa``,
  which takes each prefill's image spans; refused on other attention backends.
Video and audio are refused per request (``validation.py``); images only.
"""

from __future__ import annotations

import copy
import inspect

import torch
from sglang.srt.managers.schedule_batch import MultimodalDataItem, MultimodalInputs
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.runtime_context import get_server_args
from transformers import PreTrainedModel

from sglang_hf_backend import diagnostics
from sglang_hf_backend.compat import IncompatibleModelError
from sglang_hf_backend.models.analysis import check_no_lora
from sglang_hf_backend.models.base import materialise_meta_parameters

# The attention backend that applies image spans (cpu_attention.CpuSdpaAttnBackend).
SPAN_BACKEND = "cpu_sdpa"


class MultiModalMixin:
    """Image features merged into the text embeddings before our language model runs."""

    multimodal = True
    # Read by prefix_cache.py: placeholders carry per-image values, so cached prefixes are exact.
    pads_image_tokens = True

    def add_capabilities(self, hf_model: PreTrainedModel) -> None:
        super().add_capabilities(hf_model)
        args = get_server_args()
        check_no_lora(type(self).__name__, args.enable_lora or args.lora_paths)
        self.towers = getattr(self, self.backbone_path.split(".")[0])  # holds the language model too
        if not hasattr(self.towers, "get_image_features"):
            raise IncompatibleModelError(
                f"{self.hf_class_name} has no get_image_features; sglang_hf_backend serves "
                "multimodal models that turn images into embeddings that way."
            )
        # the vision tower and projector, replicated; our linears wait on meta for quantized loading
        materialise_meta_parameters(self.towers, keep_linears_on_meta=self.torchao is not None)
        self.image_arguments = set(inspect.signature(self.towers.get_image_features).parameters)
        self.uses_mrope = "mrope_section" in (rope_parameters(self.text_config) or {})
        self.image_spans_bidirectional = image_tokens_attend_both_ways(hf_model)
        if self.image_spans_bidirectional:
            check_span_backend(self.hf_class_name, chosen_prefill_backend(args))
        diagnostics.decision(
            "multimodal: images through %s's own vision tower (HF code, replicated on every rank), "
            "placeholders padded per image (radix cache on); %s; %s",
            self.hf_class_name,
            "M-RoPE positions" if self.uses_mrope else "1-D positions",
            "an image's tokens attend to each other both ways"
            if self.image_spans_bidirectional
            else "causal attention over image tokens",
        )

    # -- SGLang's multimodal contract ---------------------------------------------
    def pad_input_ids(self, input_ids, mm_inputs: MultimodalInputs):
        """Each image's placeholder tokens become its hash-derived pad values."""
        from sglang.srt.managers.mm_utils import pad_mm_tokens

        return pad_mm_tokens(input_ids, mm_inputs)

    def get_image_feature(self, items: list[MultimodalDataItem]) -> torch.Tensor:
        """Rows ``[image tokens, hidden]`` for the images of ``items``, in order."""
        dtype = next(self.towers.parameters()).dtype
        rows = []
        for item in items:
            arguments = {
                name: _on_device(value, dtype)
                for name, value in (item.model_specific_data or {}).items()
                if name in self.image_arguments
            }
            output = self.towers.get_image_features(pixel_values=_on_device(item.feature, dtype), **arguments)
            rows.append(feature_rows(output))
        return torch.cat(rows)

    # -- the forward -------------------------------------------------------------
    def backbone_forward(self, input_ids, positions, forward_batch: ForwardBatch, input_embeds=None):
        if input_embeds is None and _has_images(forward_batch):
            from sglang.srt.managers.mm_utils import prepare_mm_inputs

            if self.image_spans_bidirectional:
                _attention_backend().attend_within_spans(image_spans(forward_batch))
            input_embeds = prepare_mm_inputs(input_ids, forward_batch, self, {}, multimodal_model=self)
        return super().backbone_forward(input_ids, positions, forward_batch, input_embeds)

    def position_ids(self, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        if self.uses_mrope:
            return forward_batch.mrope_positions[:, None, :]  # [3, batch=1, tokens]
        return super().position_ids(positions, forward_batch)

    def load_report_details(self) -> dict:
        details = super().load_report_details()
        details["tower_weight_bytes"] = diagnostics.weight_bytes(self.towers) - diagnostics.weight_bytes(
            self.backbone
        )
        return details


def rope_parameters(text_config) -> dict | None:
    return getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None)


def feature_rows(output) -> torch.Tensor:
    """``get_image_features``' result as one ``[tokens, hidden]`` tensor (transformers 5 returns a
    model output whose ``pooler_output`` is a tensor or one tensor per image)."""
    features = getattr(output, "pooler_output", output)
    if isinstance(features, (list, tuple)):
        return torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
    return features.reshape(-1, features.shape[-1])


def _on_device(value, dtype: torch.dtype):
    from sglang.srt.utils import get_device

    if not isinstance(value, torch.Tensor):
        return value
    value = value.to(get_device())
    return value.to(dtype) if value.is_floating_point() else value


def _has_images(forward_batch: ForwardBatch) -> bool:
    return not forward_batch.forward_mode.is_decode() and forward_batch.contains_mm_inputs()


def image_spans(forward_batch: ForwardBatch) -> list[list[tuple[int, int]]]:
    """Per request, the (first, last) positions of each image's placeholder tokens."""
    spans = []
    for mm_inputs in forward_batch.mm_inputs:
        items = mm_inputs.mm_items if mm_inputs is not None else []
        spans.append([tuple(span) for item in items if item.is_image() for span in item.offsets or []])
    return spans


def _attention_backend():
    from sglang.srt.model_executor.forward_context import get_attn_backend

    return get_attn_backend()


# -- what the HF class's masks do with image tokens ---------------------------------
_PROBE_TOKEN_TYPES = [0, 0, 1, 1, 1, 0, 1, 1, 0, 0]  # text, an image of 3, text, an image of 2, text


def image_tokens_attend_both_ways(hf_model: PreTrainedModel) -> bool:
    """Do the HF class's masks let an image's tokens see each other both ways (Gemma3)?

    Generation builds masks through the class's ``create_masks_for_generate``; a class whose
    masks depend on token types takes ``token_type_ids`` there. Run on a probe, its masks must
    be causal attention, or causal attention plus each image's tokens attending to the whole
    image (a sliding window applied on top): what paged attention can reproduce.
    """
    build = getattr(type(hf_model), "create_masks_for_generate", None)
    if build is None or "token_type_ids" not in inspect.signature(build).parameters:
        return False
    text_config = copy.deepcopy(hf_model.config.get_text_config())
    text_config._attn_implementation = "eager"
    token_types = torch.tensor([_PROBE_TOKEN_TYPES])
    length = token_types.shape[1]
    masks = build(
        config=text_config,
        inputs_embeds=torch.zeros(1, length, 1),
        attention_mask=torch.ones(1, length, dtype=torch.long),
        past_key_values=None,
        position_ids=torch.arange(length)[None],
        token_type_ids=token_types,
        is_first_iteration=True,
    )
    masks = masks if isinstance(masks, dict) else {"full_attention": masks}
    window = getattr(text_config, "sliding_window", None) or length
    kinds = {_mask_kind(name, mask, token_types[0], window) for name, mask in masks.items()}
    if None in kinds or len(kinds) > 1:
        raise IncompatibleModelError(
            f"{type(hf_model).__name__} masks image tokens in a way paged attention cannot reproduce: "
            "its masks are neither all causal nor all causal with each image attending to itself."
        )
    return kinds == {"spans"}


def _mask_kind(name: str, mask: torch.Tensor, token_types: torch.Tensor, window: int) -> str | None:
    """ "causal", "spans" (causal, plus each image's tokens seeing the whole image) or None;
    a sliding-window mask (named so by transformers) within its window."""
    length = len(token_types)
    q, k = torch.arange(length)[:, None], torch.arange(length)[None, :]
    band = q - k < (window if "sliding" in name else length)
    image = token_types == 1
    starts = image & ~torch.nn.functional.pad(image, (1, 0))[:-1]
    block = torch.where(image, torch.cumsum(starts.int(), 0), -1)
    same_image = (block[:, None] == block[None, :]) & (block[:, None] >= 0)
    allowed = mask[0, 0] if mask.dtype == torch.bool else mask[0, 0] == 0
    if torch.equal(allowed, (k <= q) & band):
        return "causal"
    if torch.equal(allowed, ((k <= q) | same_image) & band):
        return "spans"
    return None


def check_span_backend(class_name: str, chosen: str | None) -> None:
    """Prefills must run on the backend that applies image spans (``chosen``: the prefill or
    attention backend the arguments name, None for the platform's default)."""
    prefill = chosen or platform_default_backend()
    if prefill != SPAN_BACKEND:
        raise IncompatibleModelError(
            f"{class_name} lets an image's tokens attend to each other in both directions; "
            f"sglang_hf_backend applies that with --attention-backend {SPAN_BACKEND} only "
            f"(prefills would run on {prefill}, which attends causally and so changes the outputs)."
        )


def chosen_prefill_backend(options) -> str | None:
    """The backend the arguments name for prefills (``ServerArgs`` or the Engine's keywords)."""
    read = options.get if isinstance(options, dict) else lambda name: getattr(options, name, None)
    return read("prefill_attention_backend") or read("attention_backend")


def platform_default_backend() -> str:
    """What SGLang picks when no backend is named (it resolves that after building the model)."""
    from sglang.srt.platforms import current_platform

    if current_platform.is_out_of_tree():
        return current_platform.get_default_attention_backend()
    return "this platform's default backend"
