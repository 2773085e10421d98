"""Attention routing: HF attention modules call SGLang's RadixAttention over the paged KV cache.

HF modules that support attention backends call ``ALL_ATTENTION_FUNCTIONS[name](module,
query, key, value, attention_mask, scaling=..., **kwargs)``. We register one function
under our own name. During the meta trace it reports the call (shapes and per-layer
settings such as sliding window and softcap); while serving it hands the tensors to
the ``RadixAttention`` attached to that module, which reads and writes the KV cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Iterator

import torch
from torch import nn
from transformers import AttentionInterface

from sglang_hf_backend import cpu_kernels, graph_ops
from sglang_hf_backend.profiling import attention_range
from sglang_hf_backend.surgery.trace import AttentionCall, active_tracer

ATTENTION_NAME = "sglang_hf_backend"
RADIX_ATTRIBUTE = "sglang_attn"
# The layer's id as a tensor, for compiled steps: a graph input rather than a constant, so one
# compiled decoder layer serves every layer (``compilation.LayerRegions``).
LAYER_TENSOR_ATTRIBUTE = "sglang_layer_id"
# Whether a compiled step's attention node is the C++ op (``csrc/step_attention.cpp``, where the
# kernels built), which answers decode steps without Python: a plain bool on the module, which
# a saved step's guards can hold.
CPP_NODE_ATTRIBUTE = "sglang_attend_in_cpp"

# Settings an HF module may pass per call that change the result, and whether we honour them.
_HONOURED = ("scaling", "sliding_window", "softcap", "is_causal")
_UNSUPPORTED = {
    "s_aux": "attention sinks",
    "position_bias": "additive position bias (T5-style relative attention)",
}


def hf_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    forward_batch=None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The function HF modules call; shapes are ``[batch=1, heads, tokens, head_dim]``."""
    tracer = active_tracer()
    if tracer is not None:
        settings = {k: kwargs.get(k) for k in _HONOURED if k in kwargs}
        settings.update({k: True for k in _UNSUPPORTED if kwargs.get(k) is not None})
        settings["has_mask"] = attention_mask is not None
        batch, heads, tokens, _ = query.shape
        output = query.new_empty(batch, tokens, heads, value.shape[-1])
        tracer.record_attention(module, query, key, value, settings, output)
        return output, None
    if torch.compiler.is_compiling():
        attn = getattr(module, RADIX_ATTRIBUTE)
        layer = getattr(module, LAYER_TENSOR_ATTRIBUTE)
        heads, v_dim = attn.tp_q_head_num, attn.v_head_dim
        ops = (
            torch.ops.sglang_hf_backend_kernels
            if getattr(module, CPP_NODE_ATTRIBUTE)
            else torch.ops.sglang_hf_backend
        )
        return ops.attend(query, key, value, layer, heads, v_dim), None
    return attend(module, query, key, value, forward_batch), None


def attend(module: nn.Module, query, key, value, forward_batch) -> torch.Tensor:
    """One RadixAttention call: KV cache write and paged attention.

    On our CPU backend the layer goes to the backend directly (``attend_layer``), with the
    heads as views: RadixAttention's forward would only dispatch there, after checks that
    cost more than a decode step's attention.
    """
    attn = getattr(module, RADIX_ATTRIBUTE)
    q = _local_heads(query, attn.tp_q_head_num)
    k = _local_heads(key, attn.tp_k_head_num)
    v = _local_heads(value, attn.tp_v_head_num)
    tokens = q.shape[0]
    from sglang.srt.model_executor.forward_context import get_attn_backend

    direct = getattr(get_attn_backend(), "attend_layer", None)
    with attention_range():
        if direct is not None:
            out = direct(q, k, v, attn)
        else:
            out = attn(q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1), forward_batch)
    return out.view(1, tokens, attn.tp_q_head_num, attn.v_head_dim)


@dataclasses.dataclass
class _Step:
    attention: dict[int, nn.Module]  # layer id -> HF attention module with its RadixAttention
    forward_batch: Any


_RUNNING: list[_Step | None] = [None]


@contextlib.contextmanager
def running_step(attention: dict[int, nn.Module], forward_batch) -> Iterator[None]:
    """What a compiled step's attention op reads outside the graph: the layers and the batch
    (the KV pool, the batch's index tensors and the backend's dispatch change every step); in
    decode, the backend may hand the step to the C++ node instead."""
    from sglang.srt.model_executor.forward_context import get_attn_backend

    _RUNNING[0] = _Step(attention, forward_batch)
    publish = getattr(get_attn_backend(), "publish_decode_step", None)
    published = publish is not None and publish([getattr(m, RADIX_ATTRIBUTE) for m in attention.values()])
    try:
        yield
    finally:
        _RUNNING[0] = None
        if published:
            torch.ops.sglang_hf_backend_kernels.end_decode_step()


def give_layer_tensors(attention: dict[int, nn.Module]) -> None:
    """Attach each layer's id as a tensor, which compiled steps pass to the attention op, and
    which op that is (waiting for the kernels' build, before any trace)."""
    in_cpp = _cpp_node_available()
    for layer_id, module in attention.items():
        setattr(module, LAYER_TENSOR_ATTRIBUTE, torch.tensor(layer_id))
        setattr(module, CPP_NODE_ATTRIBUTE, in_cpp)


@functools.cache
def _cpp_node_available() -> bool:
    if cpu_kernels.load() is not None:
        return False
    torch.library.register_fake("sglang_hf_backend_kernels::attend", _attend_shape)
    return True


def attend_in_graph(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: torch.Tensor, heads: int, v_dim: int
) -> torch.Tensor:
    step = _RUNNING[0]
    return attend(step.attention[int(layer)], query, key, value, step.forward_batch)


def _attend_shape(query, key, value, layer, heads, v_dim):
    return query.new_empty(1, query.shape[2], heads, v_dim)


# ``attend`` as one opaque node of a compiled step (it writes the KV cache, which no other
# node of the graph reads). The output's local heads and value size come as arguments, since
# the fake implementation cannot read the layer tensor.
graph_ops.define(
    "attend(Tensor query, Tensor key, Tensor value, Tensor layer, int heads, int v_dim) -> Tensor",
    attend_in_graph,
    _attend_shape,
)


def _local_heads(x: torch.Tensor, local: int) -> torch.Tensor:
    """``[1, heads, tokens, dim]`` -> this rank's ``[tokens, local, dim]``.

    Projections sharded by heads already give the local heads. Projections whose
    output is gathered (a TP plan's ``colwise_gather_output``, needed when a norm
    spans all heads) give all of them; the rank then takes its own slice, with KV
    heads replicated the way ``QKVParallelLinear`` replicates them.
    """
    x = x[0].transpose(0, 1)
    heads = x.shape[1]
    if heads == local:
        return x
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    # Rank r owns heads [r*H/tp, ...); with fewer KV heads than ranks that is head r*H//tp.
    start = parallel.tp_rank * heads // parallel.tp_size
    return x[:, start : start + local]


def register_attention_function() -> None:
    AttentionInterface.register(ATTENTION_NAME, hf_attention_forward)


@dataclasses.dataclass(frozen=True)
class AttentionLayerSpec:
    """Everything RadixAttention needs for one layer, read off the trace."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    scaling: float
    logit_cap: float
    sliding_window_size: int  # SGLang convention: HF window minus 1, -1 for none
    causal: bool


def layer_spec(call: AttentionCall) -> AttentionLayerSpec:
    """Translate one traced attention call; refuse settings we cannot honour."""
    module, kwargs = call.module, call.kwargs
    owner = type(module).__name__
    for key, what in _UNSUPPORTED.items():
        if kwargs.get(key):
            raise ValueError(
                f"{owner} passes {what} ({key!r}) to its attention function; RadixAttention "
                "cannot apply it, so sglang_hf_backend cannot serve this model exactly. "
                "Use SGLang's native implementation (model_impl='sglang') if it has one."
            )
    if kwargs.get("has_mask"):
        raise ValueError(
            f"{owner} builds its own attention mask and passes it to the attention function; "
            "paged attention masks by position only, so this model cannot be served exactly "
            "by sglang_hf_backend."
        )
    layer_idx = getattr(module, "layer_idx", None)
    window = kwargs.get("sliding_window")
    scaling = kwargs.get("scaling")
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", True)
    return AttentionLayerSpec(
        layer_id=layer_idx if isinstance(layer_idx, int) else call.order,
        num_heads=call.num_heads,
        num_kv_heads=call.num_kv_heads,
        head_dim=call.head_dim,
        v_head_dim=call.v_head_dim,
        scaling=float(scaling) if scaling is not None else call.head_dim**-0.5,
        logit_cap=float(kwargs.get("softcap") or 0.0),
        sliding_window_size=int(window) - 1 if window else -1,
        causal=bool(causal),
    )


def attach_radix_attention(
    call: AttentionCall, spec: AttentionLayerSpec, tp_size: int, quant_config, prefix: str
) -> None:
    """Give the HF attention module its RadixAttention, with this rank's head counts."""
    from sglang.srt.layers.radix_attention import AttentionType, RadixAttention

    attn = RadixAttention(
        num_heads=spec.num_heads // tp_size,
        head_dim=spec.head_dim,
        scaling=spec.scaling,
        num_kv_heads=max(1, spec.num_kv_heads // tp_size),
        layer_id=spec.layer_id,
        logit_cap=spec.logit_cap,
        v_head_dim=spec.v_head_dim,
        sliding_window_size=spec.sliding_window_size,
        attn_type=AttentionType.DECODER if spec.causal else AttentionType.ENCODER_ONLY,
        quant_config=quant_config,
        prefix=f"{prefix}.{RADIX_ATTRIBUTE}",
    )
    setattr(call.module, RADIX_ATTRIBUTE, attn)


def check_kv_cache_layout(specs: list[AttentionLayerSpec], config, tp_size: int) -> None:
    """SGLang sizes the KV cache from the config; the traced attention must fit it per rank."""
    from types import SimpleNamespace

    from sglang.srt.configs.model_config import ModelConfig

    text_config = config.get_text_config()
    view = SimpleNamespace(hf_config=config, hf_text_config=text_config, attention_arch=None)
    declared = {
        "key/value heads per rank": max(1, ModelConfig.get_total_num_kv_heads(view) // tp_size),
        "head_dim": getattr(text_config, "head_dim", None),
        "v_head_dim": getattr(text_config, "v_head_dim", None),
    }
    for spec in specs:
        used = {
            "key/value heads per rank": max(1, spec.num_kv_heads // tp_size),
            "head_dim": spec.head_dim,
            "v_head_dim": spec.v_head_dim,
        }
        for what, value in used.items():
            if declared[what] is not None and declared[what] != value:
                raise ValueError(
                    f"Layer {spec.layer_id} attends with {value} {what}, but the config declares "
                    f"{declared[what]}; SGLang sizes the KV cache from the config. Fix config.json."
                )
