"""A step's linears on model shapes: torch's matmul, oneDNN's packed product, our AMX kernel.

A decode step multiplies every layer's weights once by the batch's tokens, so at these sizes
the linears are bound by reading the weights; a step's weights (SmolLM2: 212 MB of bf16, the
0.5B Llama: 906 MB) exceed the cache, so every product reads its weight from memory, as in a
served step. A prefill's token counts (hundreds to thousands) make them bound by the GEMM rate
instead. The implementations run interleaved, round by round; the script prints medians, ms
for all layers' linears, the rate they read the weights at and their GFLOP/s. The AMX kernel
is timed for bf16 at up to 32 tokens, on CPUs with AMX; our one-token kernel for fp32 at one
token.

Usage:
  python scripts/bench_linears.py                      # SmolLM2's and the 0.5B Llama's shapes, 1 and 32 tokens
  python scripts/bench_linears.py --tokens 1,8,32 --shapes smollm2
  python scripts/bench_linears.py --dtype float32 --tokens 512,4096 --rounds 3   # fp32 prefills (AVX2-only CPUs)
"""

from __future__ import annotations

import argparse
import functools

import sglang.srt.platforms  # noqa: F401  (resolves the platform plugins before ours is imported)
import torch
import torch.nn.functional as F

from sglang_hf_backend import cpu_kernels
from sglang_hf_backend.benchmark.interleaved import median_seconds

# name: (hidden, intermediate, query heads, KV heads, head_dim, layers); a layer's linears are
# the fused QKV, the output projection, the fused gate/up and the down projection.
SHAPES = {"smollm2": (576, 1536, 9, 3, 64, 30), "llama-0.5b": (1536, 4096, 12, 4, 128, 16)}


def layer_weights(name: str, dtype: torch.dtype) -> list[torch.Tensor]:
    hidden, intermediate, heads, kv_heads, dim, layers = SHAPES[name]
    shapes = [
        ((heads + 2 * kv_heads) * dim, hidden),
        (hidden, heads * dim),
        (2 * intermediate, hidden),
        (hidden, intermediate),
    ]
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=generator).to(dtype) for _ in range(layers) for shape in shapes]


def _all(multiply, weights, packed, inputs) -> None:
    for weight, packed_weight in zip(weights, packed):
        multiply(inputs[weight.shape[1]], weight, packed_weight)


def bench_shape(name: str, tokens: int, rounds: int, dtype: torch.dtype, with_kernels: bool) -> None:
    weights = layer_weights(name, dtype)
    packed = [torch.ops.mkldnn._reorder_linear_weight(weight, 32) for weight in weights]
    inputs = {size: torch.randn(tokens, size).to(dtype) for size in {w.shape[1] for w in weights}}
    impls = {
        "torch": lambda x, w, p: F.linear(x, w),
        "onednn-packed": lambda x, w, p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""),
    }
    if with_kernels and torch.cpu._is_amx_tile_supported() and dtype == torch.bfloat16 and tokens <= 32:
        kernel = torch.ops.sglang_hf_backend_kernels.amx_packed_linear
        impls["amx-kernel"] = lambda x, w, p: kernel(x, w, p, None)
    if with_kernels and dtype == torch.float32 and tokens == 1:
        one_token = torch.ops.sglang_hf_backend_kernels.one_token_linear
        impls["one-token-kernel"] = lambda x, w, p: one_token(x, w, None)
    medians = median_seconds(
        {
            impl: functools.partial(_all, multiply, weights, packed, inputs)
            for impl, multiply in impls.items()
        },
        rounds,
    )
    weight_mb = sum(weight.numel() * weight.element_size() for weight in weights) / 1e6
    gflop = 2 * tokens * sum(weight.numel() for weight in weights) / 1e9
    cells = [
        f"{impl} {s * 1000:.2f} ms ({weight_mb / (s * 1000):.1f} GB/s, {gflop / s:.0f} GFLOP/s)"
        for impl, s in medians.items()
    ]
    print(
        f"{name}, {tokens} tokens, {dtype} ({len(weights)} linears, {weight_mb:.0f} MB): " + "; ".join(cells)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {list(SHAPES)}")
    parser.add_argument("--tokens", default="1,32", help="comma-separated token counts")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        raise SystemExit(
            "oneDNN has no bf16 on this CPU (the packed bf16 products need AVX512-BF16 or AMX): "
            "time the float32 products it serves here with --dtype float32"
        )
    why_not = cpu_kernels.load()
    with_amx = why_not is None and torch.cpu._is_amx_tile_supported()
    print(
        f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads; "
        + ("AMX kernel timed" if with_amx else f"AMX kernel not timed ({why_not or 'no AMX on this CPU'})")
    )
    for name in args.shapes.split(","):
        for tokens in (int(count) for count in args.tokens.split(",")):
            bench_shape(name, tokens, args.rounds, dtype, why_not is None)


if __name__ == "__main__":
    main()
