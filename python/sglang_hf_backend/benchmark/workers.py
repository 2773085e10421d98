"""Measuring one implementation, in a fresh process per measurement.

``run_worker`` starts ``python -m sglang_hf_backend.benchmark.workers`` with the case as
JSON and reads its result back, so every engine, HF model or server starts clean (and a
crash becomes an error entry instead of ending the benchmark). Prompts are random token
ids with a fixed seed per round, so no tokenizer is needed.

Workloads: engine start-up time and peak RSS; offline throughput (N prompts, ignore_eos)
with its full-batch prefill and decode step; batch-1 decode latency; and, for the SGLang
implementations, a serving run against ``launch_server`` at fixed concurrency (TTFT,
TPOT, ITL).
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

from sglang_hf_backend.benchmark.presets import (
    ModelCase,
    Workload,
    cache_dir,
    lora_adapter_paths,
    split_impl,
)

CPU_PLATFORM_ONLY = "sglang_hf_backend_cpu"  # SGLANG_PLUGINS value for "builtin"


def prompt_ids(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 1) for _ in range(length)] for _ in range(count)]


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

    impl = split_impl(spec)
    vocab = AutoConfig.from_pretrained(path).get_text_config().vocab_size
    w = case.workload
    adapters = lora_adapter_paths(path, case.lora_adapters, cache_dir()) if case.lora_adapters else {}
    lora = dict(enable_lora=True, lora_paths=adapters, max_lora_rank=8) if adapters else {}
    rss = PeakRss()
    started = time.perf_counter()
    engine = sgl.Engine(
        model_path=path,
        model_impl="sglang" if impl.name == "native" else "transformers",
        dtype=impl.dtype_for(case),
        skip_tokenizer_init=True,
        log_level="error",
        **{**case.engine_args, **lora, **impl.engine_args},
    )
    result = {"startup_s": time.perf_counter() - started, "dtype": engine_dtype(impl.dtype_for(case), path)}
    try:
        # Warm-up covers both shape classes a compiled model specialises on: 1 token and many.
        started = time.perf_counter()
        for batch in (2, 1):
            engine.generate(
                input_ids=prompt_ids(batch, 16, vocab, seed + 99), sampling_params={"max_new_tokens": 4}
            )
        result["warmup_s"] = time.perf_counter() - started
        result["ready_s"] = result["startup_s"] + result["warmup_s"]

        names = list(adapters)

        def offline(ids, new_tokens):
            sampling = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
            mixed = [names[i % len(names)] for i in range(len(ids))] if names else None
            engine.generate(input_ids=ids, sampling_params=sampling, lora_path=mixed)

        result.update(_offline_metrics(offline, vocab, w, seed))
        result["latency_ms_per_token"] = _engine_latency(engine, vocab, w, seed, names[0] if names else None)
    finally:
        engine.shutdown()
    result["peak_rss_mb"] = rss.stop() / 2**20
    return result


def engine_dtype(requested: str, path: str) -> str:
    """The dtype an SGLang engine serves here (on CPU, ``auto`` is our platform's choice)."""
    import torch

    if torch.cuda.is_available():
        return requested
    from sglang_hf_backend.platform import served_dtype

    return served_dtype(requested, path)


OFFLINE_RUNS = 3  # prefill-only and full runs of the batch per round, alternating


def _offline_metrics(generate, vocab: int, w: Workload, seed: int) -> dict:
    """Offline throughput of one batch, and its decode step.

    An untimed prefill of the full batch shape comes first: the first large batch of a
    process pays a one-time cost (about 1.5 s here) that would bias whichever timed run
    met it. Then the batch shape runs prefill-only and in full, alternating, ``OFFLINE_RUNS``
    times each; the difference of the two medians leaves the ``output_len - 1`` decode steps at
    full batch size. (One pair of runs left the step to one prefill's noise: the 0.5B Llama's
    prefill varies by ~0.3 s, which moved its 31-step difference by ~10 ms a step.) All prompts
    differ, so no run hits the radix cache.
    """
    generate(prompt_ids(w.prompts, w.input_len, vocab, seed + 700), 1)
    prefills, fulls = [], []
    for run in range(OFFLINE_RUNS):
        started = time.perf_counter()
        generate(prompt_ids(w.prompts, w.input_len, vocab, seed + 500 + run), 1)
        prefills.append(time.perf_counter() - started)
        started = time.perf_counter()
        generate(prompt_ids(w.prompts, w.input_len, vocab, seed + 600 + run), w.output_len)
        fulls.append(time.perf_counter() - started)
    prefill, elapsed = statistics.median(prefills), statistics.median(fulls)
    return {
        "offline_output_tok_s": w.prompts * w.output_len / elapsed,
        "offline_total_tok_s": w.prompts * (w.input_len + w.output_len) / elapsed,
        "prefill_s": prefill,
        "decode_step_ms": (elapsed - prefill) / (w.output_len - 1) * 1000,
    }


def _engine_latency(engine, vocab: int, w: Workload, seed: int, adapter: str | None = None) -> float:
    """Batch-1 decode: ms per output token after the first, median of 3 requests."""
    samples = []
    for i in range(3):
        (ids,) = prompt_ids(1, w.latency_input_len, vocab, seed + 1000 + i)
        started = time.perf_counter()
        engine.generate(
            input_ids=ids, sampling_params={"temperature": 0.0, "max_new_tokens": 1}, lora_path=adapter
        )
        first = time.perf_counter() - started
        (ids,) = prompt_ids(1, w.latency_input_len, vocab, seed + 2000 + i)
        started = time.perf_counter()
        engine.generate(
            input_ids=ids,
            sampling_params={"temperature": 0.0, "max_new_tokens": w.latency_output_len, "ignore_eos": True},
            lora_path=adapter,
        )
        total = time.perf_counter() - started
        samples.append((total - first) / (w.latency_output_len - 1) * 1000)
    return statistics.median(samples)


def measure_hf(spec: str, path: str, case: ModelCase, seed: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    w = case.workload
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = split_impl(spec).dtype_for(case)  # "auto": the checkpoint's stored type
    dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    rss = PeakRss()
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    result = {"startup_s": time.perf_counter() - started, "dtype": str(model.dtype).removeprefix("torch.")}
    result["ready_s"] = result["startup_s"]
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
    """launch_server + a streaming client at fixed concurrency (bench_serving-style metrics).

    The client is ours: SGLang's ``sglang.benchmark.serving`` imports its dataset loaders,
    which need ``datasets`` (not in the CPU stack).
    """
    import requests
    from sglang.srt.utils.network import get_free_port_below_ephemeral
    from transformers import AutoConfig

    impl = split_impl(spec)
    vocab = AutoConfig.from_pretrained(path).get_text_config().vocab_size
    w = case.workload
    port = get_free_port_below_ephemeral()  # bound after loading: outside the ephemeral range
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
        impl.dtype_for(case),
        "--skip-tokenizer-init",
        "--log-level",
        "error",
        "--model-impl",
        "sglang" if impl.name == "native" else "transformers",
    ]
    for key, value in {**case.engine_args, **impl.engine_args}.items():
        flag = f"--{key.replace('_', '-')}"
        args += [flag] if value is True else [flag, str(value)]
    log = tempfile.TemporaryFile()
    server = subprocess.Popen(args, env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=log)
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


def impl_env(spec: str, scratch: Path) -> dict:
    """The worker's environment: the built-in backend without our plugin; cold caches in
    ``scratch`` (a fresh directory) for ``+cold``."""
    impl = split_impl(spec)
    env = dict(os.environ)
    if impl.name == "builtin":
        env["SGLANG_PLUGINS"] = CPU_PLATFORM_ONLY
    if impl.cold_cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(scratch / "inductor")
        env["TORCH_EXTENSIONS_DIR"] = str(scratch / "extensions")
    return env


def run_worker(kind: str, impl: str, path: str, case: ModelCase, seed: int) -> dict:
    """Measure in a fresh process; returns its JSON result (or the error it died with)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
        out_path = out.name
    command = [
        sys.executable,
        "-m",
        __name__,
        "--kind",
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
    with tempfile.TemporaryDirectory(prefix="bench-caches-") as scratch:
        done = subprocess.run(command, env=impl_env(impl, Path(scratch)), capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": done.stderr.strip()[-2000:]}
    return json.loads(Path(out_path).read_text())


def main() -> None:
    """Worker entry point: measure one (kind, implementation, case, seed) and write JSON."""
    parser = argparse.ArgumentParser()
    for flag in ("--kind", "--impl", "--path", "--case", "--result"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    raw = json.loads(args.case)
    case = ModelCase(**{**raw, "workload": Workload(**raw["workload"])})
    if args.kind == "serving":
        metrics = measure_serving(args.impl, args.path, case, args.seed)
    elif split_impl(args.impl).name == "hf":
        metrics = measure_hf(args.impl, args.path, case, args.seed)
    else:
        metrics = measure_engine(args.impl, args.path, case, args.seed)
    Path(args.result).write_text(json.dumps(metrics))


if __name__ == "__main__":
    main()
