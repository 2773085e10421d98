"""Profile of one step against the hardware bound (``scripts/profile_step.py``).

Runs an engine with ``SGLANG_HF_BACKEND_PROFILE`` set (``profiling.py``) through three
workloads: batch-1 decode, batch-32 decode (after one batched prefill) and that prefill,
then folds each step class into one row: wall time split into GEMMs, attention, other
ops, Python/dispatch inside the model and time outside it, next to the bound: reading
every weight once at the measured memory bandwidth, or the step's matmul FLOPs at the
measured GEMM rate, whichever is longer.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from sglang_hf_backend.benchmark.workers import prompt_ids
from sglang_hf_backend.profiling import PROFILE_ENV

PARTS = ("gemm_ms", "attention_ms", "other_ops_ms", "python_ms", "outside_ms")


@dataclasses.dataclass
class Machine:
    bandwidth_gb_s: float  # streaming copy, read + write
    gemm_gflop_s: float  # one large matmul in the served dtype


def measure_machine(dtype: torch.dtype) -> Machine:
    """This CPU's streaming bandwidth and matmul rate, measured now (medians of 5)."""
    source = torch.empty(256 * 2**20, dtype=torch.uint8).fill_(1)
    target = torch.empty_like(source)
    copies = []
    for _ in range(5):
        started = time.perf_counter()
        target.copy_(source)
        copies.append(time.perf_counter() - started)
    a = torch.randn(1024, 2048, dtype=dtype)
    b = torch.randn(2048, 2048, dtype=dtype)
    a @ b
    matmuls = []
    for _ in range(5):
        started = time.perf_counter()
        a @ b
        matmuls.append(time.perf_counter() - started)
    return Machine(
        bandwidth_gb_s=2 * source.numel() / statistics.median(copies) / 1e9,
        gemm_gflop_s=2 * 1024 * 2048 * 2048 / statistics.median(matmuls) / 1e9,
    )


@dataclasses.dataclass
class ModelSize:
    weight_bytes: int  # every parameter once (a tied head counted once)
    body_parameters: int  # multiplied by every token
    head_parameters: int  # multiplied by each request's last token only

    @classmethod
    def of(cls, model_path: str, dtype: torch.dtype) -> ModelSize:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        total = sum(p.numel() for p in model.parameters())
        head = model.get_output_embeddings().weight.numel()
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        embedding = 0 if tied else model.get_input_embeddings().weight.numel()
        return cls(total * dtype.itemsize, total - head - embedding, head)


def bound_ms(size: ModelSize, tokens: int, requests: int, machine: Machine) -> float:
    """The longer of reading the weights once and the step's matmul FLOPs (2 per weight use)."""
    memory = size.weight_bytes / (machine.bandwidth_gb_s * 1e9)
    flops = 2 * (size.body_parameters * tokens + size.head_parameters * requests)
    return max(memory, flops / (machine.gemm_gflop_s * 1e9)) * 1000


def fold(lines: list[dict], mode: str, batch: int, between_steps: bool = True) -> dict:
    """One row from the step lines of one class (mode, batch size); ``outside_ms`` only for
    consecutive steps (decode), not for separate requests."""
    steps = [line for line in lines if line["mode"] == mode and line["batch"] == batch]
    timed = [line for line in steps if not line["profiled"]]
    profiled = [line for line in steps if line["profiled"]]
    if not timed or not profiled:
        raise RuntimeError(f"no {mode} steps at batch {batch} were recorded (got {len(steps)})")
    row = {"steps": len(steps), "tokens": steps[0]["tokens"], "batch": batch}
    row["wall_ms"] = statistics.median(line["wall_ms"] for line in timed)
    for part in ("gemm_ms", "attention_ms", "other_ops_ms"):
        row[part] = statistics.median(line[part] for line in profiled)
    row["python_ms"] = max(0.0, row["wall_ms"] - row["gemm_ms"] - row["attention_ms"] - row["other_ops_ms"])
    gaps = [line["outside_ms"] for line in timed if line["outside_ms"] is not None]
    row["outside_ms"] = statistics.median(gaps) if gaps and between_steps else None
    row["top_ops"] = profiled[-1].get("top_ops", {})  # where the last profiled step spent its op time
    return row


def run(
    model_path: str, dtype: str, input_len: int = 128, output_len: int = 32, batch: int = 32, **engine_options
) -> dict:
    """Profile the three workloads on one engine; rows keyed by workload name."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_path).get_text_config().vocab_size
    engine, directory = profiled_engine(model_path, dtype, **engine_options)
    sampling = {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True}
    try:
        engine.generate(input_ids=prompt_ids(2, 16, vocab, 99), sampling_params={"max_new_tokens": 4})
        lines_before = _lines(directory)
        engine.generate(input_ids=prompt_ids(1, input_len, vocab, 1)[0], sampling_params=sampling)
        single = _lines(directory)[len(lines_before) :]
        engine.generate(input_ids=prompt_ids(batch, input_len, vocab, 2), sampling_params=sampling)
        batched = _lines(directory)[len(lines_before) + len(single) :]
    finally:
        engine.shutdown()
    # prefill runs once per batch: profile it alone, twice, so one run is timed and one profiled
    prefill = _prefill_lines(model_path, dtype, vocab, input_len, batch, engine_options)
    return {
        "decode, batch 1": fold(single, "decode", 1),
        f"decode, batch {batch}": fold(batched, "decode", batch),
        f"prefill, {batch} x {input_len}": fold(prefill, "extend", batch, between_steps=False),
    }


def profiled_engine(model_path: str, dtype: str, **engine_options):
    """Our engine with step profiling on, and the directory its ranks write to."""
    import sglang as sgl

    directory = Path(tempfile.mkdtemp(prefix="step-profile-"))
    # a compiled step's kernels then show up in the profile by name (profiling.py)
    env = {PROFILE_ENV: str(directory), "TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE": "1"}
    with mock.patch.dict("os.environ", env):
        engine = sgl.Engine(
            model_path=model_path,
            impl="transformers",
            dtype=dtype,
            skip_tokenizer_init=True,
            max_total_tokens=65536,
            log_level="error",
            **engine_options,
        )
    return engine, directory


def _prefill_lines(
    model_path: str, dtype: str, vocab: int, input_len: int, batch: int, engine_options: dict
) -> list[dict]:
    engine, directory = profiled_engine(model_path, dtype, **engine_options)
    try:
        for seed in range(3, 8):  # distinct prompts (no radix-cache hits); the first one is cold
            ids = prompt_ids(batch, input_len, vocab, seed)
            engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})
    finally:
        engine.shutdown()
    return _lines(directory)


def _lines(directory: Path) -> list[dict]:
    path = directory / "rank0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def markdown(rows: dict, size: ModelSize, machine: Machine) -> str:
    """The table: ms per step by part, the bound, and how close the whole step comes to it."""
    lines = [
        "| step | forward ms | GEMM | attention | other ops | Python/dispatch | outside model "
        "| bound ms | % of bound |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        requests = row["batch"]
        bound = bound_ms(size, row["tokens"], requests, machine)
        step = row["wall_ms"] + (row["outside_ms"] or 0.0)
        cells = ["n/a" if row[part] is None else f"{row[part]:.1f}" for part in PARTS]
        lines.append(
            f"| {name} | {row['wall_ms']:.1f} | "
            + " | ".join(cells)
            + f" | {bound:.1f} | {100 * bound / step:.0f}% |"
        )
    return "\n".join(lines) + "\n"
