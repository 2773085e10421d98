"""scripts/rouge_parity.py on the real SmolLM2 and a tiny checkpoint by path: must pass at fp32."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_hf_backend.evals.rouge import max_logprob_diff, rouge_l

SCRIPT = Path(__file__).resolve().parents[4] / "scripts" / "rouge_parity.py"


def run_script(model: str, impls: str, out: Path) -> tuple[subprocess.CompletedProcess, dict]:
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--model",
            model,
            "--impl",
            impls,
            "--dtype",
            "float32",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    print(done.stdout)
    return done, json.loads(out.read_text())


@pytest.mark.parametrize(
    ("model", "impls"),
    [
        ("smollm2", "hf,transformers,sglang"),
        ("gpt_neox", "hf,transformers"),  # a model path, an architecture SGLang has no class for
    ],
)
def test_parity_passes_at_fp32(checkpoint, tmp_path, model, impls):
    target = model if model == "smollm2" else str(checkpoint(model))
    done, report = run_script(target, impls, tmp_path / "report.json")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert report["passed"]
    for rows in report["results"].values():
        assert len(rows) == 5  # four short prompts and one of ~1000 tokens
        assert max(r["prompt_tokens"] for r in rows) >= 900
        assert all(r["rouge_l"] == 1.0 for r in rows)


def test_rouge_l_is_character_lcs_f_measure():
    assert rouge_l("abcd", "abcd") == 1.0
    assert rouge_l("abcd", "abxd") == pytest.approx(0.75)  # LCS "abd": precision = recall = 3/4
    assert rouge_l("", "abc") == 0.0


def test_logprob_diff_compares_sorted_top_values():
    assert max_logprob_diff([[(1, -0.5), (2, -1.0)]], [[(2, -1.02), (1, -0.5)]]) == pytest.approx(0.02)
