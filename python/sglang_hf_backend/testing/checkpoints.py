"""Tiny random-weight checkpoints (fp32 safetensors + local tokenizer), built on demand.

Each entry of ``TINY_MODELS`` is a config for one architecture, small enough to build
in about a second, with the settings that make the architecture special switched on
(Gemma2's soft-caps and a sliding window shorter than the test prompts, Granite's
multipliers, GPT-NeoX's partial rotary, MoE routers with and without renormalisation
and a shared expert, ...). Weights come from a fixed seed, so a checkpoint is the same
in every run. ``save_pretrained`` writes MoE experts one tensor per expert (Mixtral's
``block_sparse_moe.experts.N.w1``, Qwen's ``experts.N.gate_proj``); the names in
``STACKED_EXPERTS`` are saved with transformers 5's stacked ``[experts, ...]`` tensors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import torch
import transformers
from safetensors.torch import save_file
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    GenerationConfig,
    PretrainedConfig,
)
from transformers.dynamic_module_utils import get_class_from_dynamic_module

from sglang_hf_backend.testing.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, with_pair_template

REMOTE_CODE_DIR = Path(__file__).parent / "remote_code"

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
    max_position_embeddings=2048,
)
TINY_DECODER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    **_COMMON,
)


def _config(class_name: str, **overrides) -> Callable[[], PretrainedConfig]:
    def make() -> PretrainedConfig:
        params = dict(TINY_DECODER)
        params.update(overrides)
        return getattr(transformers, class_name)(**params)

    return make


# renormalised top-k, as the released Qwen3-MoE checkpoints are
_QWEN3_MOE = dict(
    head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True
)

TINY_MODELS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": _config("LlamaConfig"),
    "llama-tied": _config("LlamaConfig", tie_word_embeddings=True),
    "llama-mqa": _config("LlamaConfig", num_key_value_heads=1),
    # mostly projection weights, to measure what each TP rank holds
    "llama-wide": _config(
        "LlamaConfig",
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
    ),
    "qwen2": _config("Qwen2Config"),
    "qwen3": _config("Qwen3Config", head_dim=16),
    "mistral": _config("MistralConfig", sliding_window=4096),
    "mistral-swa": _config("MistralConfig", sliding_window=6),  # window shorter than the prompts
    "granite": _config(
        "GraniteConfig",
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.2,
        logits_scaling=4.0,
    ),
    "gpt_neox": _config(
        "GPTNeoXConfig", num_key_value_heads=None, rotary_pct=0.5, use_parallel_residual=True
    ),
    "olmo2": _config("Olmo2Config"),
    "gemma2": _config(
        "Gemma2Config",
        num_hidden_layers=4,
        head_dim=16,
        sliding_window=8,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
        query_pre_attn_scalar=16,
        initializer_range=0.2,
        hidden_act="gelu_pytorch_tanh",  # SGLang's native Gemma2 reads this older name
    ),
    "phi3": _config("Phi3Config", pad_token_id=PAD_ID),
    "gpt2": lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, **_COMMON),
    # its LM head reaches the backbone's decoder: self.model.decoder(...)
    "opt": lambda: transformers.OPTConfig(
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        word_embed_proj_dim=64,
        **_COMMON,
    ),
    # mixture of experts
    "qwen3_moe": _config("Qwen3MoeConfig", **_QWEN3_MOE),
    "mixtral": _config("MixtralConfig", intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": _config(  # shared expert behind a sigmoid gate, no renormalisation
        "Qwen2MoeConfig",
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
    ),
    "olmoe": _config("OlmoeConfig", intermediate_size=32, num_experts=8, num_experts_per_tok=2),
}
STACKED_EXPERTS = {"olmoe"}
# name -> (class, config overrides)
REMOTE_MODELS = {
    "remote": ("TinyLMForCausalLM", {}),
    "remote-eager": ("TinyLMEagerForCausalLM", {"use_attention_interface": False}),
    "remote-moe": ("TinyLMForCausalLM", {"num_experts": 4}),  # a router SGLang cannot reproduce
    "remote-mixed": ("TinyLMForCausalLM", {"mix_layer_outputs": True}),  # cannot be cut into stages
}
INCOMPATIBLE_MODELS: dict[str, Callable[[], PretrainedConfig]] = {
    "gptj": lambda: transformers.GPTJConfig(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, **_COMMON),
}


# Encoders (non-causal attention), served by SGLang's native classes as embedding models.
ENCODER_MODELS: dict[str, Callable[[], PretrainedConfig]] = {
    "bert": lambda: transformers.BertConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=512,
        pad_token_id=PAD_ID,
        position_embedding_type="absolute",  # SGLang's native BERT reads this older field
    ),
}


_BERT = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    pad_token_id=PAD_ID,
)
# Embedding and classification models: name -> (auto class, config, sentence-transformers pooling).
# The embedders ship sentence-transformers files (modules.json, 1_Pooling, Normalize).
POOLING_MODELS: dict[str, tuple[type, Callable[[], PretrainedConfig], str | None]] = {
    # a decoder embedder in the Qwen3-Embedding layout: last-token pooling, Matryoshka dimensions
    "qwen3-embedding": (
        AutoModel,
        lambda: transformers.Qwen3Config(**{**TINY_DECODER, "head_dim": 16, "is_matryoshka": True}),
        "pooling_mode_lasttoken",
    ),
    "bert-embedding": (
        AutoModel,
        lambda: transformers.BertConfig(**_BERT, max_position_embeddings=512),
        "pooling_mode_mean_tokens",
    ),
    "qwen3-classifier": (
        AutoModelForSequenceClassification,
        lambda: transformers.Qwen3Config(
            **{**TINY_DECODER, "head_dim": 16}, id2label={0: "negative", 1: "neutral", 2: "positive"}
        ),
        None,
    ),
    # RoBERTa numbers positions from padding_idx + 1 and classifies from its first token
    "roberta-classifier": (
        AutoModelForSequenceClassification,
        lambda: transformers.RobertaConfig(**_BERT, max_position_embeddings=514, num_labels=2),
        None,
    ),
    "qwen3_moe-classifier": (
        AutoModelForSequenceClassification,
        _config("Qwen3MoeConfig", **_QWEN3_MOE, num_labels=2),
        None,
    ),
    # scores sentence pairs (segment ids 0/1) for /v1/rerank
    "bert-cross-encoder": (
        AutoModelForSequenceClassification,
        lambda: transformers.BertConfig(
            **_BERT, max_position_embeddings=512, num_labels=1, initializer_range=0.3
        ),
        None,
    ),
    # one score per sequence, as reward models give
    "llama-reward": (
        AutoModelForSequenceClassification,
        lambda: transformers.LlamaConfig(**TINY_DECODER, num_labels=1),
        None,
    ),
}


def build_checkpoint(name: str, out_dir: str | Path, tokenizer_dir: str | Path, seed: int = 0) -> Path:
    """Write checkpoint ``name`` (a key of the tables above) to ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if name in POOLING_MODELS:
        return _pooling_model(name, out_dir, tokenizer_dir)
    from sglang_hf_backend.testing.vision_language import (
        VISION_LANGUAGE_MODELS,
        build_vision_language_checkpoint,
    )

    if name in VISION_LANGUAGE_MODELS:
        return build_vision_language_checkpoint(name, out_dir, tokenizer_dir)
    if name in REMOTE_MODELS:
        model = _remote_model(*REMOTE_MODELS[name], out_dir)
    elif name in ENCODER_MODELS:
        model = AutoModel.from_config(ENCODER_MODELS[name](), dtype=torch.float32)
    else:
        config = {**TINY_MODELS, **INCOMPATIBLE_MODELS}[name]()
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        do_sample=False,
        use_cache=name not in REMOTE_MODELS,  # TinyLM keeps no KV cache
    )
    model.save_pretrained(out_dir)
    if name in STACKED_EXPERTS:
        _save_as_modelled(model, out_dir)
    for item in Path(tokenizer_dir).iterdir():
        shutil.copy(item, out_dir / item.name)
    return out_dir


PAIR_MODELS = {"bert-cross-encoder"}


def _pooling_model(name: str, out_dir: Path, tokenizer_dir: str | Path) -> Path:
    auto_class, make_config, pooling_mode = POOLING_MODELS[name]
    model = auto_class.from_config(make_config(), dtype=torch.float32)
    model.save_pretrained(out_dir)
    if pooling_mode is not None:
        _write_sentence_transformers_files(out_dir, pooling_mode, model.config.hidden_size)
    for item in Path(tokenizer_dir).iterdir():
        shutil.copy(item, out_dir / item.name)
    if name in PAIR_MODELS:
        with_pair_template(out_dir)
    return out_dir


def _write_sentence_transformers_files(out_dir: Path, pooling_mode: str, hidden_size: int) -> None:
    """The files sentence-transformers reads: Transformer -> Pooling -> Normalize."""
    kinds = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (path, kind) in enumerate(kinds)
    ]
    (out_dir / "modules.json").write_text(json.dumps(modules, indent=1))
    (out_dir / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 512, "do_lower_case": False})
    )
    (out_dir / "1_Pooling").mkdir(exist_ok=True)
    modes = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_lasttoken")
    pooling = {"word_embedding_dimension": hidden_size, "include_prompt": True}
    pooling.update({mode: mode == pooling_mode for mode in modes})
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=1))
    (out_dir / "2_Normalize").mkdir(exist_ok=True)


def _save_as_modelled(model, out_dir: Path) -> None:
    """Rewrite the weights under the model's own parameter names (stacked experts, no conversion)."""
    (out_dir / "model.safetensors").unlink()
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def _remote_model(class_name: str, overrides: dict, out_dir: Path):
    """Instantiate TinyLM from files copied into the checkpoint, as the hub would ship them."""
    for source in REMOTE_CODE_DIR.glob("*.py"):
        shutil.copy(source, out_dir / source.name)
    config_class = get_class_from_dynamic_module("configuration_tinylm.TinyLMConfig", str(out_dir))
    model_class = get_class_from_dynamic_module(f"modeling_tinylm.{class_name}", str(out_dir))
    config = config_class(**{k: v for k, v in _COMMON.items() if k != "max_position_embeddings"}, **overrides)
    config.auto_map = {
        "AutoConfig": "configuration_tinylm.TinyLMConfig",
        "AutoModelForCausalLM": f"modeling_tinylm.{class_name}",
    }
    config.architectures = [class_name]
    return model_class(config).to(torch.float32)
