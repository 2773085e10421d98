"""Side-by-side benchmark: SGLang native vs SGLang's built-in transformers backend vs ours vs HF.

One invocation runs interleaved rounds (A B C D A B C D ...), each implementation in a
fresh process, and reports medians with min-max, ratios to native, a JSON file, a
markdown table and a PNG chart. Prompts are random token ids (fixed seed per round),
so the same checkpoints and workloads serve CPU and GPU runs with no tokenizer needed.

Implementations:
  native   sgl.Engine(model_impl="sglang")
  builtin  sgl.Engine(model_impl="transformers") with our general plugin switched off
           (SGLANG_PLUGINS keeps only our CPU platform, which a CPU-only machine needs)
  ours     sgl.Engine(model_impl="transformers") with sglang_hf_backend
  hf       plain transformers generate, one static batch (what a CPU user would run)
An SGLang implementation may name an attention backend and/or ask for torch.compile:
``ours+torch_native``, ``ours+compile`` (its compile time shows as ``warmup_s``).

Workloads (per implementation process): engine start-up time and peak RSS, offline
throughput (N prompts, ignore_eos) and its full-batch decode step, batch-1 decode latency;
and a serving run against ``launch_server`` at fixed concurrency (TTFT, TPOT, ITL) for the
SGLang implementations.

Usage:
  python scripts/bench.py --preset cpu [--models smollm2] [--rounds 3] [--out out/bench]
  python scripts/bench.py --preset gpu            # random-weight Llama-3.1-8B / Qwen3-4B shapes
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

IMPLS = ("native", "builtin", "ours", "hf")
SGLANG_IMPLS = ("native", "builtin", "ours")
CPU_PLATFORM_ONLY = "sglang_hf_backend_cpu"  # SGLANG_PLUGINS value for "builtin"


@dataclasses.dataclass
class Workload:
    prompts: int = 32
    input_len: int = 128
    output_len: int = 128
    latency_input_len: int = 128
    latency_output_len: int = 64
    serving_prompts: int = 32
    serving_concurrency: int = 8
    serving_output_len: int = 64


@dataclasses.dataclass
class ModelCase:
    name: str
    dtype: str
    workload: Workload
    engine_args: dict = dataclasses.field(default_factory=dict)
    serving: bool = True


def _cpu_engine_args() -> dict:
    return {"max_total_tokens": 65536}


PRESETS = {
    "cpu": [
        ModelCase("smollm2", "bfloat16", Workload(), _cpu_engine_args()),
        ModelCase(
            "llama-0.5b",
            "bfloat16",
            Workload(prompts=32, input_len=128, output_len=32, latency_output_len=32),
            _cpu_engine_args(),
            serving=False,
        ),
    ],
    "gpu": [
        ModelCase(
            "llama3.1-8b-shape",
            "bfloat16",
            Workload(
                prompts=256, input_len=1024, output_len=256, serving_prompts=256, serving_concurrency=32
            ),
            {"attention_backend": "flashinfer", "mem_fraction_static": 0.8},
        ),
        ModelCase(
            "qwen3-4b-shape",
            "bfloat16",
            Workload(
                prompts=256, input_len=1024, output_len=256, serving_prompts=256, serving_concurrency=32
            ),
            {"attention_backend": "flashinfer", "mem_fraction_static": 0.8},
        ),
    ],
}


# -- checkpoints ---------------------------------------------------------------------
def checkpoint_path(name: str, cache: Path) -> Path:
    """Build (once) and return the checkpoint a model case runs on."""
    if name == "smollm2":
        from sglang_hf_backend.assets import smollm2_checkpoint

        return smollm2_checkpoint()
    from sglang_hf_backend.testing.checkpoints import BENCH_MODELS, build_random_checkpoint

    return build_random_checkpoint(BENCH_MODELS[name], cache / name)


def prompt_ids(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 1) for _ in range(length)] for _ in range(count)]


def split_impl(spec: str) -> tuple[str, dict]:
    """``ours+torch_native+compile`` -> ("ours", {"attention_backend": "torch_native", ...})."""
    impl, *options = spec.split("+")
    if impl not in IMPLS or (options and impl == "hf"):
        raise SystemExit(
            f"unknown implementation {spec!r}; use {IMPLS}, optionally +<attention backend> and/or +compile"
        )
    overrides = {}
    for option in options:
        if option == "compile":
            overrides["enable_torch_compile"] = True
        else:
            overrides["attention_backend"] = option
    return impl, overrides


# -- measuring one implementation (runs in a fresh process) ------------------------------
class PeakRss:
    """Peak resident memory of this process and its children, sampled in a thread."""

    def __init__(self, interval: float = 0.2):
        import psutil

        self.process = psutil.Process()
        self.peak = 0
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _total(self) -> int:
        total = 0
        for proc in [self.process, *self.process.children(recursive=True)]:
            try:
                total += proc.memory_info().rss
            except Exception:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._total())
            time.sleep(self.interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self._total())


def measure_engine(spec: str, path: str, case: ModelCase, seed: int) -> dict:
    import sglang as sgl
    from transformers import AutoConfig

    impl, overrides = split_impl(spec)
    vocab = AutoConfig.from_pretrained(path).get_text_config().vocab_size
    w = case.workload
    rss = PeakRss()
    started = time.perf_counter()
    engine = sgl.Engine(
        model_path=path,
        model_impl="sglang" if impl == "native" else "transformers",
        dtype=case.dtype,
        skip_tokenizer_init=True,
        log_level="error",
        **{**case.engine_args, **overrides},
    )
    result = {"startup_s": time.perf_counter() - started}
    try:
        # Warm-up covers both shape classes a compiled model specialises on: 1 token and many.
        started = time.perf_counter()
        for batch in (2, 1):
            engine.generate(
                input_ids=prompt_ids(batch, 16, vocab, seed + 99), sampling_params={"max_new_tokens": 4}
            )
        result["warmup_s"] = time.perf_counter() - started

        def offline(ids, new_tokens):
            sampling = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
            engine.generate(input_ids=ids, sampling_params=sampling)

        result.update(_offline_metrics(offline, vocab, w, seed))
        result["latency_ms_per_token"] = _engine_latency(engine, vocab, w, seed)
    finally:
        engine.shutdown()
    result["peak_rss_mb"] = rss.stop() / 2**20
    return result


def _offline_metrics(generate, vocab: int, w: Workload, seed: int) -> dict:
    """Offline throughput of one batch, and its decode step.

    An untimed prefill of the full batch shape comes first: the first large batch of a
    process pays a one-time cost (about 1.5 s here) that would bias whichever timed run
    met it. Then the batch shape runs prefill-only, timed; subtracted from the full run's
    time it leaves the ``output_len - 1`` decode steps at full batch size. All prompts
    differ, so no run hits the radix cache.
    """
    generate(prompt_ids(w.prompts, w.input_len, vocab, seed + 700), 1)
    started = time.perf_counter()
    generate(prompt_ids(w.prompts, w.input_len, vocab, seed + 500), 1)
    prefill = time.perf_counter() - started
    started = time.perf_counter()
    generate(prompt_ids(w.prompts, w.input_len, vocab, seed), w.output_len)
    elapsed = time.perf_counter() - started
    return {
        "offline_output_tok_s": w.prompts * w.output_len / elapsed,
        "offline_total_tok_s": w.prompts * (w.input_len + w.output_len) / elapsed,
        "prefill_s": prefill,
        "decode_step_ms": (elapsed - prefill) / (w.output_len - 1) * 1000,
    }


def _engine_latency(engine, vocab: int, w: Workload, seed: int) -> float:
    """Batch-1 decode: ms per output token after the first, median of 3 requests."""
    samples = []
    for i in range(3):
        (ids,) = prompt_ids(1, w.latency_input_len, vocab, seed + 1000 + i)
        started = time.perf_counter()
        engine.generate(input_ids=ids, sampling_params={"temperature": 0.0, "max_new_tokens": 1})
        first = time.perf_counter() - started
        (ids,) = prompt_ids(1, w.latency_input_len, vocab, seed + 2000 + i)
        started = time.perf_counter()
        engine.generate(
            input_ids=ids,
            sampling_params={"temperature": 0.0, "max_new_tokens": w.latency_output_len, "ignore_eos": True},
        )
        total = time.perf_counter() - started
        samples.append((total - first) / (w.latency_output_len - 1) * 1000)
    return statistics.median(samples)


def measure_hf(path: str, case: ModelCase, seed: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    w = case.workload
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rss = PeakRss()
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, case.dtype)).to(device).eval()
    result = {"startup_s": time.perf_counter() - started}
    vocab = model.config.get_text_config().vocab_size

    def generate(ids, new_tokens):
        batch = torch.tensor(ids, device=device)
        with torch.no_grad():
            model.generate(
                batch,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                attention_mask=torch.ones_like(batch),
                pad_token_id=0,
            )
        if device == "cuda":
            torch.cuda.synchronize()

    generate(prompt_ids(2, 16, vocab, seed + 99), 4)
    result.update(_offline_metrics(generate, vocab, w, seed))
    samples = []
    for i in range(3):
        ids = prompt_ids(1, w.latency_input_len, vocab, seed + 1000 + i)
        started = time.perf_counter()
        generate(ids, 1)
        first = time.perf_counter() - started
        started = time.perf_counter()
        generate(ids, w.latency_output_len)
        samples.append((time.perf_counter() - started - first) / (w.latency_output_len - 1) * 1000)
    result["latency_ms_per_token"] = statistics.median(samples)
    result["peak_rss_mb"] = rss.stop() / 2**20
    return result


def measure_serving(spec: str, path: str, case: ModelCase, seed: int) -> dict:
    """launch_server + a streaming client at fixed concurrency (bench_serving-style metrics)."""
    import requests
    from transformers import AutoConfig

    impl, overrides = split_impl(spec)
    vocab = AutoConfig.from_pretrained(path).get_text_config().vocab_size
    w = case.workload
    port = _free_port()
    args = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        path,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        case.dtype,
        "--skip-tokenizer-init",
        "--log-level",
        "error",
        "--model-impl",
        "sglang" if impl == "native" else "transformers",
    ]
    for key, value in {**case.engine_args, **overrides}.items():
        flag = f"--{key.replace('_', '-')}"
        args += [flag] if value is True else [flag, str(value)]
    log = tempfile.TemporaryFile()
    server = subprocess.Popen(args, env=_impl_env(spec), stdout=subprocess.DEVNULL, stderr=log)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_until_healthy(server, log, url, requests)
        ids = prompt_ids(w.serving_prompts, w.input_len, vocab, seed)
        return asyncio.run(_serve_requests(url, ids, w))
    finally:
        server.terminate()
        server.wait(timeout=120)
        log.close()


def _wait_until_healthy(server: subprocess.Popen, log, url: str, requests, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"server exited with {server.returncode}: {log.read().decode()[-2000:]}")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            time.sleep(1)
    raise TimeoutError(f"server not healthy after {timeout:.0f} s")


async def _serve_requests(url: str, ids: list[list[int]], w: Workload) -> dict:
    import aiohttp

    semaphore = asyncio.Semaphore(w.serving_concurrency)
    ttfts, itls, tpots = [], [], []

    async def one(session, prompt):
        async with semaphore:
            body = {
                "input_ids": prompt,
                "stream": True,
                "sampling_params": {
                    "temperature": 0.0,
                    "max_new_tokens": w.serving_output_len,
                    "ignore_eos": True,
                },
            }
            started = time.perf_counter()
            arrivals = []
            async with session.post(f"{url}/generate", json=body) as reply:
                async for raw in reply.content:
                    line = raw.strip()
                    if line.startswith(b"data:") and line != b"data: [DONE]":
                        arrivals.append(time.perf_counter())
            ttfts.append(arrivals[0] - started)
            itls.extend(b - a for a, b in zip(arrivals, arrivals[1:]))
            tpots.append((arrivals[-1] - arrivals[0]) / max(1, w.serving_output_len - 1))

    started = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await asyncio.gather(*(one(session, p) for p in ids))
    elapsed = time.perf_counter() - started
    return {
        "serving_req_s": len(ids) / elapsed,
        "serving_output_tok_s": len(ids) * w.serving_output_len / elapsed,
        "ttft_ms_median": statistics.median(ttfts) * 1000,
        "tpot_ms_median": statistics.median(tpots) * 1000,
        "itl_ms_median": statistics.median(itls) * 1000,
    }


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _impl_env(spec: str) -> dict:
    env = dict(os.environ)
    if split_impl(spec)[0] == "builtin":
        env["SGLANG_PLUGINS"] = CPU_PLATFORM_ONLY
    return env


# -- orchestration ------------------------------------------------------------------------
def run_worker(kind: str, impl: str, path: str, case: ModelCase, seed: int) -> dict:
    """Measure in a fresh process; returns its JSON result (or the error it died with)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
        out_path = out.name
    command = [
        sys.executable,
        __file__,
        "--worker",
        kind,
        "--impl",
        impl,
        "--path",
        path,
        "--case",
        json.dumps(dataclasses.asdict(case)),
        "--seed",
        str(seed),
        "--result",
        out_path,
    ]
    done = subprocess.run(command, env=_impl_env(impl), capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": done.stderr.strip()[-2000:]}
    return json.loads(Path(out_path).read_text())


def summarise(results: list[dict]) -> dict:
    """Per (model, impl, metric): median, min, max over rounds."""
    summary: dict = {}
    for r in results:
        for metric, value in r["metrics"].items():
            if isinstance(value, (int, float)):
                summary.setdefault(r["model"], {}).setdefault(r["impl"], {}).setdefault(metric, []).append(
                    value
                )
    return {
        model: {
            impl: {
                m: {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}
                for m, v in metrics.items()
            }
            for impl, metrics in impls.items()
        }
        for model, impls in summary.items()
    }


# (result key, table label, drawn in the chart)
METRICS = [
    ("offline_output_tok_s", "offline output tok/s", True),
    ("prefill_s", "full-batch prefill s", False),
    ("decode_step_ms", "full-batch decode step ms", True),
    ("latency_ms_per_token", "batch-1 ms/token", True),
    ("serving_output_tok_s", "serving output tok/s", True),
    ("ttft_ms_median", "TTFT ms", True),
    ("tpot_ms_median", "TPOT ms", False),
    ("itl_ms_median", "ITL ms", False),
    ("startup_s", "start-up s", False),
    ("warmup_s", "warm-up (compile) s", False),
    ("peak_rss_mb", "peak RSS MB", False),
]


def markdown(summary: dict, impls: list[str]) -> str:
    lines = []
    for model, by_impl in summary.items():
        lines += [
            f"**{model}** (median [min-max]; ratio to native; higher is better for tok/s)",
            "",
            "| metric | " + " | ".join(impls) + " |",
            "|---|" + "---|" * len(impls),
        ]
        native = by_impl.get("native", {})
        for key, label, _ in METRICS:
            if not any(key in by_impl.get(i, {}) for i in impls):
                continue
            cells = []
            for impl in impls:
                stat = by_impl.get(impl, {}).get(key)
                if stat is None:
                    cells.append("n/a")
                    continue
                cell = f"{stat['median']:.1f} [{stat['min']:.1f}-{stat['max']:.1f}]"
                if key in native and impl != "native":
                    cell += f" ({stat['median'] / native[key]['median']:.2f}x)"
                cells.append(cell)
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def chart(summary: dict, impls: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (model, key, label)
        for model, by_impl in summary.items()
        for key, label, charted in METRICS
        if charted and any(key in by_impl.get(i, {}) for i in impls)
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6), squeeze=False)
    palette = {"native": "#4c72b0", "builtin": "#dd8452", "ours": "#55a868", "hf": "#8172b3"}
    for ax, (model, key, label) in zip(axes[0], panels):
        names, medians, low, high = [], [], [], []
        for impl in impls:
            stat = summary[model].get(impl, {}).get(key)
            if stat:
                names.append(impl)
                medians.append(stat["median"])
                low.append(stat["median"] - stat["min"])
                high.append(stat["max"] - stat["median"])
        colors = [palette.get(n, "#937860") for n in names]
        ax.bar(names, medians, yerr=[low, high], color=colors, capsize=4)
        ax.set_title(f"{model}\n{label}", fontsize=9)
        ax.tick_params(axis="x", labelsize=8, labelrotation=30)
        plt.setp(ax.get_xticklabels(), ha="right", rotation_mode="anchor")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--models", help="comma-separated subset of the preset's models")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-serving", action="store_true")
    parser.add_argument("--out", default="out/bench")
    parser.add_argument("--worker", choices=["engine", "serving"], help=argparse.SUPPRESS)
    parser.add_argument("--impl", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        raw = json.loads(args.case)
        case = ModelCase(**{**raw, "workload": Workload(**raw["workload"])})
        if args.worker == "serving":
            metrics = measure_serving(args.impl, args.path, case, args.seed)
        elif split_impl(args.impl)[0] == "hf":
            metrics = measure_hf(args.path, case, args.seed)
        else:
            metrics = measure_engine(args.impl, args.path, case, args.seed)
        Path(args.result).write_text(json.dumps(metrics))
        return

    impls = args.impls.split(",")
    for spec in impls:
        split_impl(spec)  # unknown names fail before anything runs
    cases = [c for c in PRESETS[args.preset] if not args.models or c.name in args.models.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(os.environ.get("SGLANG_HF_BACKEND_CACHE", ".cache")) / "bench-models"
    results = []
    for case in cases:
        path = str(checkpoint_path(case.name, cache))
        for round_index in range(args.rounds):
            for impl in impls:  # interleaved: A B C D, A B C D, ...
                metrics = run_worker("engine", impl, path, case, seed=round_index)
                serves = split_impl(impl)[0] in SGLANG_IMPLS
                if case.serving and not args.no_serving and serves and "error" not in metrics:
                    metrics.update(run_worker("serving", impl, path, case, seed=round_index))
                results.append({"model": case.name, "impl": impl, "round": round_index, "metrics": metrics})
                print(json.dumps(results[-1]), flush=True)
    summary = summarise(results)
    table = markdown(summary, impls)
    (out / "results.json").write_text(
        json.dumps({"preset": args.preset, "results": results, "summary": summary}, indent=1)
    )
    (out / "table.md").write_text(table)
    chart(summary, impls, out / "chart.png")
    print(table)


if __name__ == "__main__":
    main()
