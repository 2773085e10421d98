"""Our paged decode kernel against torch's SDPA over gathered K/V, on model shapes, one batch step.

Every layer of a decode step reads its slice of the KV pool once; in a served step the weights
stream through the cache between two reads of a layer, so the pool comes from memory. This
evicts it before each timed step (by writing a buffer larger than the cache), interleaves the
two implementations round by round and prints medians, ms per step of all layers, and the KV
read rate. The requests' cached tokens sit as SGLang's allocator leaves them: a prompt's slots
in a row, then one decode slot per request and step, interleaved across requests.

Usage:
  python scripts/bench_decode_kernel.py                     # SmolLM2's and the 0.5B Llama's shapes, bf16
  python scripts/bench_decode_kernel.py --dtype float32 --cached 512
"""

from __future__ import annotations

import argparse
import functools

import sglang.srt.platforms  # noqa: F401  (resolves the platform plugins before ours is imported)
import torch
import torch.nn.functional as F

from sglang_hf_backend import cpu_kernels
from sglang_hf_backend.benchmark.interleaved import median_seconds

# name: (query heads, KV heads, head_dim, layers)
SHAPES = {"smollm2": (9, 3, 64, 30), "llama-0.5b": (12, 4, 128, 16)}
PROMPT_SHARE = 0.75  # of the cached tokens, the prompt's (contiguous slots); the rest decoded


def slots_as_allocated(batch: int, cached: int) -> torch.Tensor:
    """[batch, cached] pool slots: each prompt in a row, then decode slots interleaved."""
    prompt = int(cached * PROMPT_SHARE)
    index = torch.empty(batch, cached, dtype=torch.long)
    for request in range(batch):
        index[request, :prompt] = 1 + request * prompt + torch.arange(prompt)
        index[request, prompt:] = 1 + batch * prompt + torch.arange(cached - prompt) * batch + request
    return index


def sdpa_over_gathered(query, k_buffer, v_buffer, index, scale):
    """What the backend runs without the kernel: gather, then torch's SDPA."""
    batch, cached = index.shape
    keys = k_buffer.index_select(0, index.reshape(-1)).view(batch, cached, *k_buffer.shape[1:])
    values = v_buffer.index_select(0, index.reshape(-1)).view(batch, cached, *v_buffer.shape[1:])
    return F.scaled_dot_product_attention(
        query[:, :, None], keys.transpose(1, 2), values.transpose(1, 2), scale=scale, enable_gqa=True
    )[:, :, 0]


def _all_layers(attend, pools) -> None:
    for k, v in pools:
        attend(k, v)


def bench_shape(
    name: str, batch: int, cached: int, dtype: torch.dtype, rounds: int, evict: torch.Tensor
) -> None:
    heads, kv_heads, dim, layers = SHAPES[name]
    generator = torch.Generator().manual_seed(0)
    slots = batch * cached + 1
    pools = [
        (
            torch.randn(slots, kv_heads, dim, generator=generator).to(dtype),
            torch.randn(slots, kv_heads, dim, generator=generator).to(dtype),
        )
        for _ in range(layers)
    ]
    index = slots_as_allocated(batch, cached)
    lengths = torch.full((batch,), cached, dtype=torch.long)
    query = torch.randn(batch, heads, dim, generator=generator).to(dtype)
    scale = dim**-0.5
    kernel = torch.ops.sglang_hf_backend_kernels.paged_decode_attention
    impls = {
        "kernel": lambda k, v: kernel(query, k, v, index, lengths, scale, 0.0, -1),
        "sdpa": lambda k, v: sdpa_over_gathered(query, k, v, index, scale),
    }
    medians = median_seconds(
        {impl: functools.partial(_all_layers, attend, pools) for impl, attend in impls.items()},
        rounds,
        before_each=evict.fill_,
    )
    kv_mb = 2 * layers * batch * cached * kv_heads * dim * query.element_size() / 1e6
    cells = [f"{impl} {s * 1000:.2f} ms ({kv_mb / (s * 1000):.1f} GB/s)" for impl, s in medians.items()]
    print(
        f"{name} ({heads}/{kv_heads} heads of {dim}, {layers} layers, {kv_mb:.0f} MB of KV): "
        + "; ".join(cells)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {list(SHAPES)}")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--cached", type=int, default=144, help="cached tokens per request")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--evict-mb", type=int, default=600, help="written before each step (> the cache)")
    args = parser.parse_args()
    why_not = cpu_kernels.load()
    if why_not is not None:
        raise SystemExit(f"the C++ kernels did not build here: {why_not}")
    evict = torch.empty(args.evict_mb * 1_000_000, dtype=torch.uint8)
    print(
        f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads"
    )
    for name in args.shapes.split(","):
        bench_shape(name, args.batch, args.cached, getattr(torch, args.dtype), args.rounds, evict)


if __name__ == "__main__":
    main()
