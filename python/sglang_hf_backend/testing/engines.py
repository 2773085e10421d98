"""Real engines and servers next to HF references, for tests (and anyone checking parity).

Every engine here is a real ``sgl.Engine`` (scheduler subprocesses, paged KV cache) on a
real checkpoint; the reference is plain transformers ``generate`` in fp32 with eager
attention (the one HF implementation that applies every setting, soft-caps included).
Prompts are compared as token ids so that tokenizer loading differences between HF and
SGLang cannot hide or fake a mismatch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from functools import lru_cache
from pathlib import Path
from unittest import mock

import torch

PROMPTS = [
    "def foo(x):",
    "import os\nimport sys\n\nclass Parser(object):\n    def parse(self, text):\n        return",
    "for i in range(10):",
    "The quick brown fox jumps over the lazy dog and then runs away from the hunter",
]
NEW_TOKENS = 16
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS}
ENGINE_DEFAULTS = dict(dtype="float32", max_total_tokens=8192, log_level="error")
HEALTH_POLL_S = 0.2  # seconds between /health polls while a server starts (at 1 s, ~0.5 s lost per start)


def cpu_bind_env(ranks: int) -> dict:
    """SGLang's CPU backend wants one core list per rank once ranks outnumber NUMA nodes."""
    cores = os.cpu_count() or 1
    return {"SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(rank % cores) for rank in range(ranks))}


def prompt_ids(path: Path, trust_remote_code: bool = False) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    return [tokenizer(p).input_ids for p in PROMPTS]


@lru_cache(maxsize=None)
def _hf_model(path: str, trust_remote_code: bool):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", trust_remote_code=trust_remote_code
    ).eval()


def hf_greedy(path: Path, ids_list: list[list[int]], trust_remote_code: bool = False) -> list[list[int]]:
    """New tokens from HF ``generate`` (greedy, fp32, eager attention), one prompt at a time."""
    model = _hf_model(str(path), trust_remote_code)
    outputs = []
    with torch.no_grad():
        for ids in ids_list:
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
            outputs.append(out[0, len(ids) :].tolist())
    return outputs


class RunningEngine:
    """An ``sgl.Engine`` plus the load reports its ranks wrote."""

    def __init__(self, engine, report_dir: Path):
        self.engine = engine
        self.report_dir = report_dir

    def generate_ids(self, ids_list: list[list[int]], sampling=GREEDY) -> list[list[int]]:
        outs = self.engine.generate(input_ids=ids_list, sampling_params=sampling)
        return [o["output_ids"] for o in outs]

    def generate_each(self, ids_list: list[list[int]], sampling=GREEDY) -> list[list[int]]:
        return [
            self.engine.generate(input_ids=ids, sampling_params=sampling)["output_ids"] for ids in ids_list
        ]

    def load_reports(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.report_dir.glob("rank*.json"))]


@contextlib.contextmanager
def running_engine(model_path: Path, extra_env: dict | None = None, **kwargs):
    """Start a real engine on ``model_path``; shut it down afterwards."""
    import sglang as sgl

    from sglang_hf_backend.diagnostics import LOAD_REPORT_ENV

    options = {**ENGINE_DEFAULTS, **kwargs}
    ranks = options.get("tp_size", 1) * options.get("pp_size", 1) * options.get("dp_size", 1)
    if ranks > 1:
        extra_env = {**cpu_bind_env(ranks), **(extra_env or {})}
    with tempfile.TemporaryDirectory(prefix="load-report-") as report_dir:
        # SGLang's subprocesses inherit the environment as it is while the engine starts.
        with mock.patch.dict(os.environ, {LOAD_REPORT_ENV: report_dir, **(extra_env or {})}):
            engine = sgl.Engine(model_path=str(model_path), **options)
        try:
            yield RunningEngine(engine, Path(report_dir))
        finally:
            engine.shutdown()


class Server:
    """``python -m sglang.launch_server`` on 127.0.0.1, with its log kept for assertions."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        timeout: float = 180.0,
        env: dict | None = None,
        wait: bool = True,
    ):
        """Start the server; with ``wait`` (the default) return once it is healthy. A second
        node of a multi-node server is started with ``wait=False``: it only joins the first."""
        import subprocess
        import sys

        from sglang.srt.utils.network import get_free_port_below_ephemeral

        # The server binds its port only after loading; below the kernel's ephemeral range, no
        # outgoing connection (gloo's, ZMQ's) can be handed it as its source port in between.
        self.port = get_free_port_below_ephemeral()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *args,
        ]
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        if wait:
            self.wait_until_healthy(timeout)

    def wait_until_healthy(self, timeout: float) -> None:
        import time

        import requests

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(HEALTH_POLL_S)
        self.stop()
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait (SIGKILL if it does not exit in time); returns the exit code."""
        import signal
        import subprocess

        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode


def ours_server(model_path: Path, log_path: Path, *extra: str, **server_options) -> Server:
    """``launch_server --impl transformers`` with the engines' test defaults (fp32, small KV pool)."""
    args = [
        "--model-path",
        str(model_path),
        "--impl",
        "transformers",
        "--dtype",
        ENGINE_DEFAULTS["dtype"],
        "--max-total-tokens",
        str(ENGINE_DEFAULTS["max_total_tokens"]),
        *extra,
    ]
    return Server(args, log_path, **server_options)


@dataclasses.dataclass
class EngineCase:
    """What one engine produced for one architecture (the engine is shut down again)."""

    name: str
    path: Path
    ids: list[list[int]]
    reference: list[list[int]]  # HF generate
    batched: list[list[int]]
    one_at_a_time: list[list[int]]
    reports: list[dict]


_CASES: dict[tuple, EngineCase] = {}


def _case_key(name: str, impl: str, extra_env: dict | None, options: dict) -> tuple:
    """Equal for the same engine however its options are spelled (tp_size=1 or left out)."""
    settings = {"tp_size": 1, **options}
    return name, impl, tuple(sorted((extra_env or {}).items())), tuple(sorted(settings.items()))


def engine_case(
    checkpoint, name: str, impl: str = "transformers", extra_env: dict | None = None, **options
) -> EngineCase:
    """Run the prompts through an engine, batched and one at a time, next to HF's answer.

    Results are kept for the session: tests of different concerns that need the same
    engine (say, our llama at TP=1) share one run instead of starting it again.
    """
    key = _case_key(name, impl, extra_env, options)
    if key not in _CASES:
        trust = name.startswith("remote")
        path = checkpoint(name)
        ids = prompt_ids(path, trust)
        reference = hf_greedy(path, ids, trust)
        with running_engine(path, extra_env, model_impl=impl, trust_remote_code=trust, **options) as engine:
            batched, single = engine.generate_ids(ids), engine.generate_each(ids)
            reports = engine.load_reports()
        _CASES[key] = EngineCase(name, path, ids, reference, batched, single, reports)
    return _CASES[key]


@dataclasses.dataclass
class EncodeCase:
    """What one embedding or classification engine returned for the prompts."""

    name: str
    path: Path
    outputs: torch.Tensor  # one row per prompt: an embedding, or classification logits
    reports: list[dict]
    shortened: torch.Tensor | None  # embeddings asked for with dimensions=SHORT_DIMENSIONS


SHORT_DIMENSIONS = 32
_ENCODED: dict[tuple, EncodeCase] = {}


def encode_case(checkpoint, name: str, matryoshka: bool = False, **options) -> EncodeCase:
    """``Engine.encode`` of the prompts (batched, different lengths), kept for the session."""
    key = _case_key(name, "transformers", {"matryoshka": str(matryoshka)}, options)
    if key not in _ENCODED:
        path = checkpoint(name)
        with running_engine(path, impl="transformers", **options) as engine:
            outputs = torch.tensor([o["embedding"] for o in engine.engine.encode(PROMPTS)])
            shortened = None
            if matryoshka:
                encoded = engine.engine.encode(PROMPTS, dimensions=SHORT_DIMENSIONS)
                shortened = torch.tensor([o["embedding"] for o in encoded])
            _ENCODED[key] = EncodeCase(name, path, outputs, engine.load_reports(), shortened)
    return _ENCODED[key]


def hf_classifier_logits(path: Path) -> torch.Tensor:
    """HF ``AutoModelForSequenceClassification`` logits, fp32, eager, one prompt at a time."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        return torch.cat([model(**tokenizer(p, return_tensors="pt")).logits for p in PROMPTS])


def sentence_transformers_embeddings(path: Path) -> torch.Tensor:
    """What sentence-transformers computes for the prompts from the checkpoint's modules.json."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu").encode(PROMPTS, convert_to_tensor=True).float()
