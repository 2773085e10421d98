"""TransformersBase: an HF backbone rebuilt from SGLang parts, read top to bottom.

Construction, in order:
1. analyse the model (models/analysis.py): HF class, meta build, dataflow trace, TP layout;
2. swap linears and the token embedding for SGLang's parallel layers;
3. give every attention module a RadixAttention with its per-layer settings;
4. materialise the parameters HF keeps (norms) on the real device;
5. on CPU with ``--enable-torch-compile``, compile the backbone's forward as one graph (compilation.py).
Capability mixins add their parts on top (``add_capabilities``) and turn the backbone's
hidden states into the class's output (``output``: logits, embeddings or scores).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Iterable

import torch
from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, PPProxyTensors
from sglang.srt.runtime_context import get_parallel, get_server_args
from sglang.srt.utils import get_device
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from sglang_hf_backend import compat, compilation, cpu_linear, diagnostics, profiling, quantization
from sglang_hf_backend.attention import (
    attach_radix_attention,
    check_kv_cache_layout,
    layer_spec,
)
from sglang_hf_backend.lora import LoRALayers
from sglang_hf_backend.models.analysis import Analysis, analyse, check_pipeline_split
from sglang_hf_backend.models.pipeline import PipelineStage, split_backbone
from sglang_hf_backend.surgery.fusers import apply_fusions, declared_packed_modules
from sglang_hf_backend.surgery.linear import build_linear, is_linear
from sglang_hf_backend.surgery.tensor_parallel import TPLayout, local_input_features
from sglang_hf_backend.surgery.trace import ModelTrace
from sglang_hf_backend.weights import CheckpointNames, Routing, WeightLoader, check_all_loaded, materialised


class TransformersBase(LoRALayers, nn.Module):
    """Serves an HF backbone with SGLang's attention, parallel layers and KV cache."""

    # Read by SGLang's quantization configs before the model exists; each instance
    # replaces it with the names its own fusions packed.
    packed_modules_mapping = declared_packed_modules()
    task: str  # "causal" | "embedding" | "classification", set by the capability mixin
    multimodal = False  # media in besides text (the multimodal mixin serves them)

    def __init__(self, config: PretrainedConfig, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        self.text_config = config.get_text_config()
        self.quant_config = quant_config
        self.tp_size = get_parallel().tp_size

        analysis = analyse(
            config, get_server_args().trust_remote_code, self.tp_size, self.task, self.multimodal
        )
        hf_model = analysis.hf_model
        self.hf_class_name = type(hf_model).__name__
        self.backbone_path = analysis.backbone_path
        backbone = analysis.backbone
        self.model_trace: ModelTrace = analysis.trace
        self.tp_layout: TPLayout = analysis.tp_layout
        self.fusions = analysis.fusions
        self.torchao = quantization.spec_from_env()
        if self.torchao is not None:
            self.torchao.check_group_size(local_input_features(backbone, self.tp_layout, self.tp_size))
        # With torchao, linears get memory only when their weights arrive (see load_weights).
        with torch.device("meta") if self.torchao else contextlib.nullcontext():
            fused_routes = apply_fusions(backbone, self.model_trace, self.fusions, quant_config)
            replace_linears(backbone, self.tp_layout, self.tp_size, quant_config)
        # Unquantized CPU linears (and the LM head, causal.py) multiply prepacked weights.
        self.packs_weights = cpu_linear.wanted(get_device(), bool(self.torchao or quant_config))
        if self.packs_weights:
            diagnostics.decision(
                "%d linears multiply oneDNN-prepacked weights", cpu_linear.pack_linears(backbone)
            )
        self.weight_routes: dict[str, Routing] = {
            f"{self.backbone_path}.{name}": route.under(self.backbone_path)
            for name, route in fused_routes.items()
        }
        self.packed_modules_mapping = self.fusions.packed_modules_mapping()
        replace_input_embedding(backbone)
        self.pipeline = self.split_for_pipeline(analysis, backbone)
        self.start_layer, self.end_layer = self.pipeline.start, self.pipeline.end
        self.weight_routes = {
            name: route
            for name, route in self.weight_routes.items()
            if not self.pipeline.holds_elsewhere(name)
        }
        self.attention_layers = attach_attention(
            self.model_trace, backbone, self.tp_size, quant_config, range(self.start_layer, self.end_layer)
        )
        check_kv_cache_layout(self.attention_layers, config, self.tp_size)
        materialise_meta_parameters(backbone, keep_linears_on_meta=self.torchao is not None)
        # Under its HF name, so parameter names are the checkpoint's; a multimodal model's
        # language model comes with the HF child that holds it and the towers.
        if analysis.multimodal:
            top = self.backbone_path.split(".")[0]
            setattr(self, top, hf_model.get_submodule(top))
        else:
            setattr(self, self.backbone_path, backbone)
        self.checkpoint_names = CheckpointNames.of(hf_model)
        self.position_offset = position_offset(backbone)
        # Segment ids of sentence pairs (cross-encoder rerank) reach backbones that take them.
        self.takes_token_type_ids = "token_type_ids" in inspect.signature(backbone.forward).parameters
        self.add_capabilities(hf_model)
        self.log_decisions()
        self.compiled_step = self.compile_step() if compilation.wanted(get_device()) else None

    def split_for_pipeline(self, analysis: Analysis, backbone: nn.Module) -> PipelineStage:
        """This rank's pipeline stage; other stages' layers and embeddings become stand-ins."""
        parallel = get_parallel()
        if parallel.pp_size == 1:
            return PipelineStage.whole(self.text_config.num_hidden_layers)
        stack = check_pipeline_split(analysis, self.hf_class_name, self.task, parallel.pp_size)
        stage = split_backbone(backbone, self.backbone_path, stack, parallel.pp_rank, parallel.pp_size)
        diagnostics.decision(
            "pipeline stage %d of %d: decoder layers %d-%d of %s.%s (%s)%s%s",
            stage.rank,
            stage.size,
            stage.start,
            stage.end - 1,
            self.backbone_path,
            stack.path,
            stack.source,
            "" if stage.is_first else ", embeddings on the first stage",
            "" if stage.is_last else ", head on the last stage",
        )
        return stage

    def compile_step(self) -> compilation.CompiledStep | None:
        args = get_server_args()
        lora = bool(args.enable_lora or args.lora_paths)
        why_not = compilation.eager_reason(self.pipeline.size, lora, self.multimodal)
        if why_not is not None:
            diagnostics.decision("torch.compile: serving eagerly, since %s", why_not)
            return None
        return compilation.CompiledStep(self.backbone)

    def log_decisions(self) -> None:
        diagnostics.decision("serving %s with %s", self.hf_class_name, type(self).__name__)
        diagnostics.decision("attention: %s", describe_attention(self.attention_layers))
        for line in self.fusions.log_lines(self.hf_class_name):
            diagnostics.decision("%s", line)
        if self.tp_size > 1:
            diagnostics.decision(
                "tensor parallel over %d ranks (%s): %s",
                self.tp_size,
                "the model's tp_plan" if self.tp_layout.source == "plan" else "inferred from dataflow",
                self.tp_layout.summary(),
            )

    def add_capabilities(self, hf_model: PreTrainedModel) -> None:
        """Hook for capability mixins (LM head, ...), given the HF model built on meta."""

    @property
    def backbone(self) -> PreTrainedModel:
        return self.get_submodule(self.backbone_path)

    def get_input_embeddings(self) -> nn.Module:
        return self.backbone.get_input_embeddings()

    def get_attention_sliding_window_size(self) -> int | None:
        windows = {
            spec.sliding_window_size for spec in self.attention_layers if spec.sliding_window_size >= 0
        }
        return max(windows) if windows else None

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        pp_proxy_tensors=None,
        input_embeds: torch.Tensor | None = None,
        get_embedding: bool = False,
    ):
        """SGLang's model contract: the backbone's hidden states, then what the capability mixin
        makes of them (``output``: logits, embeddings or scores)."""
        with profiling.profiled_step(forward_batch):
            self.pipeline.hand_in(pp_proxy_tensors)
            hidden = self.backbone_forward(input_ids, positions, forward_batch, input_embeds)
            if not self.pipeline.is_last:
                return PPProxyTensors(self.pipeline.hand_on())
            return self.output(input_ids, hidden, forward_batch)

    def backbone_forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[tokens, hidden]`` for a flat batch of tokens."""
        segments = forward_batch.token_type_ids
        extra = (
            {"token_type_ids": segments[None]} if segments is not None and self.takes_token_type_ids else {}
        )
        inputs = dict(
            input_ids=None if input_embeds is not None else input_ids[None],
            inputs_embeds=None if input_embeds is None else input_embeds[None],
            position_ids=self.position_ids(positions, forward_batch),
            **extra,
        )
        if self.compiled_step is not None:
            return self.compiled_step(forward_batch, **inputs)[0]
        outputs = self.backbone(**inputs, use_cache=False, return_dict=True, forward_batch=forward_batch)
        return outputs.last_hidden_state[0]

    def position_ids(self, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """The backbone's ``position_ids`` ``[1, tokens]`` for SGLang's flat positions."""
        return positions[None] + self.position_offset

    # -- weights ---------------------------------------------------------------
    def tied_parameters(self) -> set[str]:
        return set()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        rss_before = diagnostics.max_rss_bytes()
        tied = self.tied_parameters()
        expected = self.expected_checkpoint_keys()
        quantizer = quantization.ShardQuantizer(self, self.torchao, expected) if self.torchao else None
        loader = WeightLoader(
            self,
            self.checkpoint_names,
            self.weight_routes,
            tied,
            on_loaded=quantizer and quantizer.loaded,
            held_elsewhere=self.pipeline.holds_elsewhere,
        )
        loaded = loader.load(weights)
        check_all_loaded(loaded, expected, tied)
        details = self.load_report_details()
        if quantizer is not None:
            details.update(quantizer.summary())
            diagnostics.decision(
                "torchao %s: quantized %d linears as they loaded; their weights %.1f MB -> %.1f MB on rank 0",
                self.torchao.name,
                details["quantized_linears"],
                details["quantized_bytes_before"] / 2**20,
                details["quantized_bytes_after"] / 2**20,
            )
        diagnostics.report_load(self, rss_before, details)
        return loaded

    def load_report_details(self) -> dict:
        """What tests and benchmarks read back about this rank's model."""
        return {
            "hf_class": self.hf_class_name,
            "tp_source": self.tp_layout.source,
            "layers": diagnostics.describe_layers(self.backbone),
            "fusions": self.fusions.log_lines(self.hf_class_name),
            "compiled_step": self.compiled_step is not None,
            "packed_weights": self.packs_weights,
        }

    def expected_checkpoint_keys(self) -> set[str]:
        """Parameter names, packed parameters expanded to one key per shard (and expert)."""
        routed = {key for route in self.weight_routes.values() for key in route.keys()}
        packed = {key.split(":")[0] for key in routed}
        return {name for name, _ in self.named_parameters() if name not in packed} | routed


def replace_linears(backbone: nn.Module, layout: TPLayout, tp_size: int, quant_config) -> None:
    for name, module in list(backbone.named_modules()):
        if is_linear(module):
            layer = build_linear(module, layout.placements[name], tp_size, quant_config, prefix=name)
            backbone.set_submodule(name, layer)


def position_offset(backbone: nn.Module) -> int:
    """Where the model numbers a sequence's first token: 0, or RoBERTa's ``padding_idx + 1``.

    RoBERTa-family embeddings derive default positions from the input ids
    (``create_position_ids_from_input_ids``: ``padding_idx + 1`` onwards for unpadded
    tokens); SGLang counts from 0, so our positions are shifted to match.
    """
    for module in backbone.modules():
        padding_idx = getattr(module, "padding_idx", None)
        if hasattr(type(module), "create_position_ids_from_input_ids") and isinstance(padding_idx, int):
            return padding_idx + 1
    return 0


def replace_input_embedding(backbone: PreTrainedModel) -> None:
    """Vocab-parallel token embedding; keeps an HF ``embed_scale`` if the class has one."""
    old = backbone.get_input_embeddings()
    scale = getattr(old, "embed_scale", None)
    if scale is None and type(old).forward is not nn.Embedding.forward:
        raise compat.IncompatibleModelError(
            f"{type(old).__name__} computes token embeddings in its own way; sglang_hf_backend "
            "only replaces plain or constant-scaled embeddings with SGLang's vocab-parallel one."
        )
    new = ScaledVocabParallelEmbedding(
        old.num_embeddings, old.embedding_dim, org_num_embeddings=old.num_embeddings
    )
    if scale is not None:
        new.embed_scale = torch.as_tensor(scale, dtype=torch.float32).item()
    backbone.set_input_embeddings(new)


class ScaledVocabParallelEmbedding(VocabParallelEmbedding):
    """VocabParallelEmbedding times a constant, as Gemma3-style scaled embeddings do."""

    embed_scale: float | None = None

    def forward(self, input_):
        out = super().forward(input_)
        if self.embed_scale is None:
            return out
        # HF rounds the scale to the weight dtype before multiplying; so do we.
        return out * torch.tensor(self.embed_scale, dtype=out.dtype)


def attach_attention(
    trace: ModelTrace, backbone: nn.Module, tp_size: int, quant_config, local_layers: range
) -> list:
    """RadixAttention for the attention modules this rank holds (its pipeline stage's)."""
    names = {module: name for name, module in backbone.named_modules()}
    specs = []
    for call in trace.attention_calls:
        if call.module not in names:
            continue  # in a layer another pipeline stage runs
        spec = layer_spec(call)
        attach_radix_attention(call, spec, tp_size, quant_config, prefix=names[call.module])
        specs.append(spec)
    layer_ids = [s.layer_id for s in specs]
    if sorted(layer_ids) != list(local_layers):
        raise compat.IncompatibleModelError(
            f"attention layers report layer_idx {layer_ids}; SGLang needs each layer to own "
            f"one distinct KV-cache slot {local_layers.start}..{local_layers.stop - 1}"
        )
    return specs


def describe_attention(specs: list) -> str:
    first = specs[0]
    windows = sorted({s.sliding_window_size + 1 for s in specs if s.sliding_window_size >= 0})
    caps = sorted({s.logit_cap for s in specs if s.logit_cap})
    parts = [
        f"{len(specs)} layers on RadixAttention",
        f"{first.num_heads} heads / {first.num_kv_heads} KV heads",
        f"head_dim {first.head_dim}",
    ]
    if windows:
        sliding = sum(s.sliding_window_size >= 0 for s in specs)
        parts.append(f"sliding window {windows} on {sliding} layers")
    if caps:
        parts.append(f"logit soft-cap {caps}")
    return ", ".join(parts)


def materialise_meta_parameters(module: nn.Module, keep_linears_on_meta: bool = False) -> None:
    """Parameters HF keeps (norms, biases) move from meta to the device, to be loaded.

    With ``keep_linears_on_meta`` SGLang linears stay on meta: the weight loader gives each
    one memory when its first tensor arrives (quantized loading keeps peaks low this way).
    """
    from sglang.srt.layers.linear import LinearBase

    device = get_device()
    for sub in module.modules():
        if keep_linears_on_meta and isinstance(sub, LinearBase):
            continue
        for name, param in list(sub._parameters.items()):
            if param is not None and param.device.type == "meta":
                sub._parameters[name] = materialised(param, device)
