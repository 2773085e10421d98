"""Request checks that keep one bad request from taking a server down.

SGLang's scheduler trusts some per-request values: a prompt token id outside the
vocabulary fails in the embedding lookup, ``top_logprobs``/``logprobs`` larger than the
vocabulary fails in ``topk``, and either kills the scheduler, the server and every
request in flight. These checks run where SGLang validates each request before it
reaches a scheduler (``TokenizerManager._validate_one_request``, hooked through SGLang's
``HookRegistry``), so completions, chat, ``/generate``, token-id prompts and ``Engine``
calls all get a ``ValueError``: HTTP answers 400 with its message, ``Engine`` callers can
catch it. They apply to every model the server runs, native ones included.

Video and audio sent to a multimodal model of the transformers backend (our classes, which
run images only) are refused before the processor runs (``_validate_mm_limits``): SGLang's
processor for that backend passes no video on, so the prompt would run without it.

OpenAI-style requests naming a model the server does not serve get a 404
``model_not_found`` error, as OpenAI and vLLM answer; accepted names are the
``--served-model-name`` (the model path by default), ``default`` (the name SGLang's own
clients send) and ``<served name>:<LoRA adapter>``.
"""

from __future__ import annotations

from typing import Iterable

# OpenAI's documented limit on completions per request; each one is a full sequence to run.
MAX_PARALLEL_SAMPLES = 128


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
        check_request,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_mm_limits",
        images_only_for_our_multimodal_models,
        HookType.BEFORE,
    )
    HookRegistry.register(
        "sglang.srt.entrypoints.openai.serving_base.OpenAIServingBase.handle_request",
        served_models_only,
        HookType.AROUND,
    )


def check_request(_result, tokenizer_manager, obj, input_ids) -> None:
    """AFTER-hook of ``_validate_one_request``: raise ``ValueError`` for values a scheduler would die on."""
    config = tokenizer_manager.model_config
    vocab_size = config.vocab_size
    if input_ids is not None and not _has_multimodal_data(obj):
        _check_token_ids("prompt", input_ids, vocab_size)
    top_logprobs = getattr(obj, "top_logprobs_num", None)
    if isinstance(top_logprobs, int) and not 0 <= top_logprobs <= vocab_size:
        raise ValueError(
            f"top_logprobs / logprobs = {top_logprobs} asks for more alternatives than the vocabulary "
            f"has ({vocab_size} tokens); ask for at most {vocab_size}."
        )
    sampling = getattr(obj, "sampling_params", None) or {}
    if isinstance(sampling, dict):
        _check_token_ids("stop_token_ids", sampling.get("stop_token_ids") or [], vocab_size)
        samples = sampling.get("n", 1)
        if isinstance(samples, int) and samples > MAX_PARALLEL_SAMPLES:
            raise ValueError(
                f"n = {samples} completions per request is more than the {MAX_PARALLEL_SAMPLES} allowed."
            )
    embeds = getattr(obj, "input_embeds", None)
    if embeds is not None:
        _check_embedding_width(embeds, config.hidden_size)


def _check_token_ids(what: str, ids: Iterable, vocab_size: int) -> None:
    for position, token in enumerate(ids):
        if not isinstance(token, int) or not 0 <= token < vocab_size:
            raise ValueError(
                f"{what} token id {token!r} at position {position} is outside the vocabulary "
                f"[0, {vocab_size}); send ids of this model's tokenizer."
            )


def _check_embedding_width(embeds, hidden_size: int) -> None:
    rows = embeds if isinstance(embeds, list) else embeds.tolist()
    widths = {len(row) for row in rows if isinstance(row, list)}
    if widths and widths != {hidden_size}:
        raise ValueError(
            f"input_embeds rows have {sorted(widths)} values; this model's hidden size is {hidden_size}."
        )


def _has_multimodal_data(obj) -> bool:
    """Multimodal prompts carry placeholder ids outside the vocabulary; SGLang checks those."""
    return any(getattr(obj, name, None) is not None for name in ("image_data", "video_data", "audio_data"))


def images_only_for_our_multimodal_models(tokenizer_manager, obj) -> None:
    """BEFORE-hook of ``_validate_mm_limits``: ``ValueError`` for video or audio our models cannot see."""
    from sglang.srt.configs.model_config import ModelImpl
    from sglang.srt.model_loader.utils import get_resolved_model_impl

    if get_resolved_model_impl(tokenizer_manager.model_config) != ModelImpl.TRANSFORMERS:
        return
    sent = [kind for kind in ("video", "audio") if getattr(obj, f"{kind}_data", None)]
    if sent:
        raise ValueError(
            f"this request carries {' and '.join(sent)}; sglang_hf_backend serves multimodal models "
            "with image inputs only. Send images (image_url / image_data), or serve the model with "
            "SGLang's native implementation (--model-impl sglang) if it has one."
        )


def served_models_only(handle_request, serving, request, raw_request):
    """AROUND-hook of ``OpenAIServingBase.handle_request``: 404 for a model this server does not serve."""
    model = getattr(request, "model", None)
    if model is None or _is_served(serving, model):
        return handle_request(serving, request, raw_request)
    return _not_found(serving, model)


async def _not_found(serving, model: str):
    return serving.create_error_response(
        message=f"The model `{model}` does not exist; this server serves `{serving.tokenizer_manager.served_model_name}`.",
        err_type="NotFoundError",
        status_code=404,
        param="model",
    )


def _is_served(serving, model: str) -> bool:
    from sglang.srt.entrypoints.openai.protocol import DEFAULT_MODEL_NAME

    served = serving.tokenizer_manager.served_model_name
    base, _adapter = serving._parse_model_parameter(model)
    return model in (served, DEFAULT_MODEL_NAME) or base in (served, DEFAULT_MODEL_NAME)
