"""Side-by-side benchmark: SGLang native vs SGLang's built-in transformers backend vs ours vs HF.

One invocation runs interleaved rounds (A B C D A B C D ...), each implementation in a
fresh process, and reports medians with min-max, ratios to native, a JSON file, a
markdown table and a PNG chart (``sglang_hf_backend.benchmark``).

Implementations:
  native   sgl.Engine(model_impl="sglang")
  builtin  sgl.Engine(model_impl="transformers") with our general plugin switched off
           (SGLANG_PLUGINS keeps only our CPU platform, which a CPU-only machine needs)
  ours     sgl.Engine(model_impl="transformers") with sglang_hf_backend
  hf       plain transformers generate, one static batch (what a CPU user would run)
An SGLang implementation may name an attention backend and/or ask for torch.compile:
``ours+torch_native``, ``ours+compile`` (its compile time shows as ``warmup_s``), with
``+cold`` on empty compile caches (a machine's first start); any implementation may name a
dtype: ``hf+fp32``, ``ours+bf16``. Ratios are to native and, where HF runs, to HF's faster dtype.

Usage:
  python scripts/bench.py --preset cpu [--models smollm2] [--rounds 3] [--out out/bench]
  python scripts/bench.py --preset moe            # random-weight Qwen3-MoE shape, 16 experts
  python scripts/bench.py --preset lora --impls native,ours   # SmolLM2, 4 adapters mixed vs none
  python scripts/bench.py --preset gpu            # random-weight Llama-3.1-8B / Qwen3-4B shapes
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sglang_hf_backend.benchmark import report
from sglang_hf_backend.benchmark.presets import (
    IMPLS,
    PRESETS,
    SGLANG_IMPLS,
    cache_dir,
    checkpoint_path,
    split_impl,
)
from sglang_hf_backend.benchmark.workers import run_worker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--models", help="comma-separated subset of the preset's models")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-serving", action="store_true")
    parser.add_argument("--out", default="out/bench")
    args = parser.parse_args()

    impls = args.impls.split(",")
    for spec in impls:
        split_impl(spec)  # unknown names fail before anything runs
    cases = [c for c in PRESETS[args.preset] if not args.models or c.name in args.models.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = cache_dir()
    results = []
    for case in cases:
        path = str(checkpoint_path(case.name, cache))
        for round_index in range(args.rounds):
            for impl in [spec for spec in impls if split_impl(spec).name in case.impls]:  # A B C D, A B C D
                metrics = run_worker("engine", impl, path, case, seed=round_index)
                serves = split_impl(impl).name in SGLANG_IMPLS
                if case.serving and not args.no_serving and serves and "error" not in metrics:
                    metrics.update(run_worker("serving", impl, path, case, seed=round_index))
                results.append({"model": case.label, "impl": impl, "round": round_index, "metrics": metrics})
                print(json.dumps(results[-1]), flush=True)
    summary = report.summarise(results)
    measured_on = report.machine()
    table = report.markdown(summary, impls, measured_on, report.served_dtypes(results))
    (out / "results.json").write_text(
        json.dumps(
            {"preset": args.preset, "machine": measured_on, "results": results, "summary": summary}, indent=1
        )
    )
    (out / "table.md").write_text(table)
    report.chart(summary, impls, out / "chart.png")
    print(table)


if __name__ == "__main__":
    main()
