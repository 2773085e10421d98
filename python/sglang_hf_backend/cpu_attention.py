"""A batched paged-attention backend for CPUs (``--attention-backend cpu_sdpa``).

SGLang's ``torch_native`` backend loops over requests in every layer: one SDPA call and
two cache gathers per request. Here, per forward batch, the positions of every request's
cached tokens are laid out once as a padded ``[batch, max_len]`` index (plus masks);
each layer then does one ``index_select`` of its K/V from the paged pool and one
attention call over the whole batch, with grouped-query attention done without copying
K/V per query head. Decode, prefill with radix-cache prefixes, chunked prefill and mixed
batches all reduce to "new tokens at known positions attending to cached tokens".
Decode reads the pool in place with our C++ kernel (``cpu_kernels``, ``csrc/paged_decode.cpp``):
no gathered copy of K/V, every cached row read once for the query heads that share it. A
forward's new K/V rows go into the pool through ``store_kv`` from the same file, both buffers in
one call (the 0.5B Llama's rows, bf16, per layer: 32 tokens 17.8 -> 2.9 us, 4096 tokens 1.10 ->
0.42 ms, against two ``index_copy_``). Prefill,
and decode where the kernel is switched off or did not build, use torch's CPU flash-attention
kernel (SDPA) over gathered K/V, except where batched grouped matmuls (``grouped_attention``)
are faster or needed: soft-capped layers, which SDPA cannot express, and half-precision decode
on CPUs without AMX, where SDPA's kernel is several times slower (``matmul_decode_pays``).
Prefills without cached prefixes give SDPA its own causal mask instead of ours, so it skips the
blocks above the diagonal (SmolLM2, 32 x 128: 3.2 -> 2.85 ms a layer, the same outputs); where
their requests are also of equal lengths, the queries and the forward's own K/V go in as they
are, with no padding and no gather from the pool (the 0.5B Llama's 32 x 128 prefill: attention
250-257 -> 156-158 ms of ~2 s).
Sliding windows and logit soft-capping are applied the way HF's eager attention does, and
a multimodal model whose image tokens attend to each other both ways (Gemma3) hands each
prefill's image spans to ``attend_within_spans``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc, MHATokenToKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from sglang_hf_backend import cpu_kernels
from sglang_hf_backend.diagnostics import decision

_SUPPORTED_MODES = {ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.IDLE}


@dataclasses.dataclass
class BatchLayout:
    """Where each request's tokens live, shared by all layers of one forward."""

    kv_index: torch.Tensor  # [B, L] slot of each cached token in the pool (0 where padded)
    kv_pos: torch.Tensor  # [L] key positions 0..L-1
    kv_len: torch.Tensor  # [B] tokens cached per request, new ones included
    q_pos: torch.Tensor  # [B, E] absolute position of each (padded) query
    q_valid: torch.Tensor  # [B, E] False for padding
    q_rows: torch.Tensor | None  # [T] row of each flat query in [B*E]; None where they coincide
    masks: dict[tuple[bool, int], torch.Tensor] = dataclasses.field(default_factory=dict)
    kv_span: torch.Tensor | None = None  # [B, L] which span (image) each key is in, -1 for none
    prefix_free: bool = False  # a prefill whose requests have no cached tokens before their new ones
    decode: bool = False  # one new token per request, each its request's last

    def within_spans(self, spans: list[list[tuple[int, int]]]) -> None:
        """Let the tokens of each (first, last) position span attend to the whole span."""
        kv_span = torch.full(self.kv_index.shape, -1, dtype=torch.long)
        for row, request_spans in enumerate(spans):
            for number, (first, last) in enumerate(request_spans):
                kv_span[row, first : last + 1] = number
        self.kv_span = kv_span
        self.masks.clear()

    def mask(self, causal: bool, window: int) -> torch.Tensor:
        """[B, 1, E, L] boolean "may attend" mask, built once per (causal, window)."""
        key = (causal, window)
        if key not in self.masks:
            k = self.kv_pos[None, None, :]
            q = self.q_pos[:, :, None]
            allowed = k < self.kv_len[:, None, None]
            if causal:
                allowed = allowed & ((k <= q) | self._same_span())
            if window >= 0:
                allowed = allowed & (k >= q - window)
            # Padded query rows attend to the first key only, so no row is empty (no NaN).
            allowed = allowed | (~self.q_valid[:, :, None] & (k == 0))
            self.masks[key] = allowed[:, None]
        return self.masks[key]

    def plain_causal(self, causal: bool, window: int) -> bool:
        """Is SDPA's own causal mask the same as ``mask`` here? In prefills without cached
        prefixes, windows or spans, valid query i sees keys 0..i, all of its own request (padded
        rows differ, and are dropped); the kernel then skips the blocks above the diagonal."""
        return causal and window < 0 and self.prefix_free and self.kv_span is None

    def _same_span(self) -> torch.Tensor | bool:
        """[B, E, L]: query and key lie in one span."""
        if self.kv_span is None:
            return False
        last = self.kv_span.shape[1] - 1
        q_span = self.kv_span.gather(1, self.q_pos.clamp(max=last)).masked_fill(~self.q_valid, -1)
        return (q_span[:, :, None] == self.kv_span[:, None, :]) & (q_span[:, :, None] >= 0)


class CpuSdpaAttnBackend(AttentionBackend):
    """Paged attention on CPU, one batched attention call per layer."""

    def __init__(self, model_runner, name: str):
        super().__init__()
        self.backend_name = name  # as registered by the platform, for error messages
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.forward_metadata: BatchLayout | None = None
        self.write_loc: torch.Tensor | None = None  # this forward's KV-cache slots, one per token
        self.plain_pool = is_plain_pool(self.token_to_kv_pool, model_runner.dtype)
        self.decode_kernel = self.plain_pool and cpu_kernels.decode_kernel_wanted()
        self.store_kernel = self.plain_pool and cpu_kernels.load() is None
        self.matmul_decode = matmul_decode_pays(model_runner.dtype)
        self._published_layers: tuple | None = None  # (layers, their settings) last handed to the C++ node
        decision(
            "%s decodes with %s (%s, torch CPU capability %s)",
            name,
            "our paged decode kernel, reading the KV pool in place"
            if self.decode_kernel
            else "grouped matmuls over gathered K/V"
            if self.matmul_decode
            else "torch's SDPA kernel over gathered K/V",
            model_runner.dtype,
            torch.backends.cpu.get_cpu_capability(),
        )
        if getattr(self.token_to_kv_pool, "swa_layer_nums", 0):
            raise ValueError(
                f"{self.backend_name} does not serve hybrid sliding-window KV pools; "
                "use --attention-backend torch_native for this model."
            )

    def init_cpu_graph_state(self, max_bs: int, max_num_token: int) -> None:
        """SGLang's CPU graph runner lands here; the platform refuses that combination up front."""
        raise ValueError(
            f"{self.backend_name} keeps no CPU-graph state, so SGLang's CPU graph capture cannot use it."
        )

    # -- per-batch layout ---------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        mode = forward_batch.forward_mode
        if mode not in _SUPPORTED_MODES:
            raise ValueError(
                f"{self.backend_name} cannot run forward mode {mode.name} (speculative "
                "decoding and other special modes); use --attention-backend torch_native."
            )
        if mode == ForwardMode.IDLE:
            self.forward_metadata = None
            return
        if forward_batch.encoder_lens is not None:
            raise ValueError(
                f"{self.backend_name} does not serve encoder-decoder models (cross "
                "attention); use --attention-backend torch_native."
            )
        self.forward_metadata = self._layout(forward_batch)
        self.write_loc = forward_batch.out_cache_loc

    def _layout(self, fb: ForwardBatch) -> BatchLayout:
        kv_len = fb.seq_lens.to(torch.long)
        max_len = int(kv_len.max())
        kv_pos = torch.arange(max_len)
        rows = self.req_to_token[fb.req_pool_indices.to(torch.long), :max_len].to(torch.long)
        kv_index = torch.where(kv_pos[None, :] < kv_len[:, None], rows, 0)
        if fb.forward_mode.is_decode():
            return BatchLayout(
                kv_index,
                kv_pos,
                kv_len,
                (kv_len - 1)[:, None],
                torch.ones_like(kv_len, dtype=torch.bool)[:, None],
                None,
                decode=True,
            )
        new = fb.extend_seq_lens.to(torch.long)
        prefix = fb.extend_prefix_lens.to(torch.long)
        width = int(new.max())
        offsets = torch.arange(width)
        q_valid = offsets[None, :] < new[:, None]
        # Requests of equal lengths (a batch of equal prompts) need no padding, so no scatter.
        padded = bool((new < width).any())
        q_rows = (torch.arange(len(new))[:, None] * width + offsets[None, :])[q_valid] if padded else None
        return BatchLayout(
            kv_index,
            kv_pos,
            kv_len,
            prefix[:, None] + offsets[None, :],
            q_valid,
            q_rows,
            prefix_free=not bool(prefix.any()),
        )

    def publish_decode_step(self, layers: list) -> bool:
        """Hand this step to a compiled step's C++ attention node (``csrc/step_attention.cpp``):
        its KV slots, each request's cached rows, and every layer's pool buffers and settings.
        Only in decode with both kernels, where ``attend_layer`` takes the same two."""
        layout = self.forward_metadata
        if not (self.decode_kernel and self.store_kernel and layout is not None and layout.decode):
            return False
        key = tuple(layers)
        if self._published_layers is None or self._published_layers[0] != key:
            self._published_layers = (key, self._layer_settings(layers))
        torch.ops.sglang_hf_backend_kernels.begin_decode_step(
            self.write_loc, layout.kv_index, layout.kv_len, *self._published_layers[1]
        )
        return True

    def _layer_settings(self, layers: list) -> tuple:
        """Layer ids, K and V buffers, scales, soft caps (0: none) and windows, as the op takes them."""
        pool = self.token_to_kv_pool
        local = [layer.layer_id - pool.start_layer for layer in layers]
        return (
            [layer.layer_id for layer in layers],
            [pool.k_buffer[i] for i in local],
            [pool.v_buffer[i] for i in local],
            [float(layer.scaling) for layer in layers],
            [float(_softcap(layer) or 0.0) for layer in layers],
            [int(layer.sliding_window_size) for layer in layers],
        )

    def attend_within_spans(self, spans: list[list[tuple[int, int]]]) -> None:
        """This forward's requests let the tokens of each span (first, last position) attend to
        the whole span, as a model whose image tokens see their whole image asks; the rest stays
        causal. Called by the model before its layers run."""
        if self.forward_metadata is not None and not self.forward_metadata.decode:
            self.forward_metadata.within_spans(spans)

    # -- attention ------------------------------------------------------------
    def attend_layer(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer) -> torch.Tensor:
        """One layer of this forward: ``[tokens, heads, dim]`` in, ``[tokens, heads * v_dim]`` out.

        What our models call directly: RadixAttention's own forward only dispatches to this
        backend on CPU, and its checks cost more than the attention at decode sizes.
        """
        self._save(layer, k, v)
        return self._attend_cached(q, layer, (k, v))

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, save_kv_cache)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, save_kv_cache)

    def _attend(self, q, k, v, layer, save_kv_cache: bool):
        if layer.is_cross_attention:
            raise ValueError(f"{self.backend_name} does not serve cross attention.")
        saved = save_kv_cache and k is not None
        if saved:
            self._save(layer, k, v)
        query = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        return self._attend_cached(query, layer, (k, v) if saved else None)

    def _save(self, layer, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this forward's K/V into the pool (directly where its layout is the plain one)."""
        pool = self.token_to_kv_pool
        if not self.plain_pool:
            pool.set_kv_buffer(layer, KVWriteLoc(self.write_loc, None), k, v)
            return
        local = layer.layer_id - pool.start_layer
        k_buffer, v_buffer = pool.k_buffer[local], pool.v_buffer[local]
        if self.store_kernel and k.dtype == k_buffer.dtype and v.dtype == v_buffer.dtype:
            torch.ops.sglang_hf_backend_kernels.store_kv(k_buffer, v_buffer, self.write_loc, k, v)
            return
        for buffer, new in ((k_buffer, k), (v_buffer, v)):
            buffer.index_copy_(0, self.write_loc, new.reshape(-1, *buffer.shape[1:]).to(buffer.dtype))

    def _attend_cached(self, query: torch.Tensor, layer, new: tuple | None = None) -> torch.Tensor:
        """Attention of ``query`` ``[tokens, heads, dim]`` over every request's cached K/V
        (``new``: this forward's K/V as the pool holds them, if at hand)."""
        layout = self.forward_metadata
        batch, width = layout.q_pos.shape
        heads, head_dim, v_dim = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
        softcap = _softcap(layer)
        if layout.decode and self.decode_kernel:
            local = layer.layer_id - self.token_to_kv_pool.start_layer
            out = torch.ops.sglang_hf_backend_kernels.paged_decode_attention(
                query,
                self.token_to_kv_pool.k_buffer[local],
                self.token_to_kv_pool.v_buffer[local],
                layout.kv_index,
                layout.kv_len,
                layer.scaling,
                softcap or 0.0,
                layer.sliding_window_size,
            )
            return out.view(batch, heads * v_dim)
        if layout.q_rows is not None:  # extend: scatter flat tokens into [B, E]
            padded = query.new_zeros(batch * width, heads, head_dim)
            query = padded.index_copy_(0, layout.q_rows, query)
        query = query.view(batch, width, heads, head_dim).transpose(1, 2)
        by_matmul = softcap is not None or (self.matmul_decode and layout.decode)
        keys, values = self._gather(layer, layout, query.dtype, contiguous=by_matmul, new=new)
        causal = layer.attn_type != AttentionType.ENCODER_ONLY
        window = layer.sliding_window_size
        if by_matmul:
            out = grouped_attention(query, keys, values, layout.mask(causal, window), layer.scaling, softcap)
        else:
            plain = layout.plain_causal(causal, window)
            out = F.scaled_dot_product_attention(
                query,
                keys,
                values,
                attn_mask=None if plain else layout.mask(causal, window),
                is_causal=plain,
                scale=layer.scaling,
                enable_gqa=heads != keys.shape[1],
            )
        out = out.transpose(1, 2).reshape(batch * width, heads * v_dim)
        if layout.q_rows is not None:
            out = out.index_select(0, layout.q_rows)
        return out

    def _new_are_all(self, layout: BatchLayout, new: tuple | None) -> bool:
        """Are this forward's K/V, as given, all that its requests attend to, in the gathered
        order? In prefills of equal lengths without cached prefixes, where the pool stores them
        unchanged."""
        return (
            new is not None
            and layout.prefix_free
            and layout.q_rows is None
            and self.plain_pool
            and new[0].dtype == new[1].dtype == self.token_to_kv_pool.dtype
        )

    def _gather(self, layer, layout: BatchLayout, dtype: torch.dtype, contiguous: bool, new: tuple | None):
        """This layer's K/V for every request: [B, kv_heads, L, dim], one gather each, or this
        forward's own where they are all (``contiguous`` for the matmul path, which the
        transposed view slows down)."""
        batch, length = layout.kv_index.shape
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        if self._new_are_all(layout, new):
            keys, values = new
        else:
            flat = layout.kv_index.reshape(-1)
            keys, values = k_cache.index_select(0, flat), v_cache.index_select(0, flat)
        keys = keys.reshape(batch, length, *k_cache.shape[1:])
        values = values.reshape(batch, length, *v_cache.shape[1:])
        keys, values = keys.transpose(1, 2).to(dtype), values.transpose(1, 2).to(dtype)
        if contiguous:
            return keys.contiguous(), values.contiguous()
        return keys, values

    def support_triton(self):
        return False


def _softcap(layer) -> float | None:
    return layer.logit_cap if layer.logit_cap and layer.logit_cap > 0 else None


def is_plain_pool(pool, dtype: torch.dtype) -> bool:
    """A pool whose K/V buffers are ``[slots, heads, dim]`` in the model's dtype, one per layer."""
    return (
        type(pool) is MHATokenToKVPool
        and not pool.is_quantized_kv_cache
        and pool.store_dtype == pool.dtype == dtype
        and pool.kv_cache_layout == "nhd"
    )


def matmul_decode_pays(dtype: torch.dtype) -> bool:
    """Whether grouped matmuls beat SDPA for decode: in bf16/fp16 on CPUs without AMX.

    There SDPA's flash kernel is 5-7x slower on decode (AMD EPYC, AVX512-BF16, bf16, 32
    requests x 256 cached tokens, 9/3 heads: 5.6 vs 0.82 ms per layer; 1024 tokens: 19.7
    vs 3.6 ms). With AMX, or in fp32, SDPA is the faster one (Xeon with AMX: 0.59 vs 1.15 ms).
    """
    half = dtype in (torch.bfloat16, torch.float16)
    return half and not torch.cpu._is_amx_tile_supported()


# Score elements per chunk of requests in grouped_attention (bounds its memory on long prefills).
_MAX_SCORES = 1 << 26


def grouped_attention(query, keys, values, mask, scaling: float, softcap: float | None) -> torch.Tensor:
    """Eager attention with query heads grouped by the KV head they share (GQA without copies).

    Used for soft-capped layers (SDPA has no soft-cap) and where ``matmul_decode_pays``.
    Soft-capping is applied as HF's eager attention does, ``softcap * tanh(scores /
    softcap)`` before masking.
    """
    batch, heads, width, dim = query.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    per_request = heads * width * length
    step = max(1, _MAX_SCORES // per_request)
    outputs = []
    for start in range(0, batch, step):
        rows = slice(start, start + step)
        grouped = query[rows].reshape(-1, kv_heads, group * width, dim)
        scores = torch.matmul(grouped, keys[rows].transpose(-1, -2)) * scaling
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.view(-1, kv_heads, group, width, length)
        scores = scores.masked_fill(~mask[rows, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        out = torch.matmul(probs.view(-1, kv_heads, group * width, length), values[rows])
        outputs.append(out.view(-1, heads, width, values.shape[-1]))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
