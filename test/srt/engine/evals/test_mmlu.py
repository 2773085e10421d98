"""scripts/mmlu.py: 24 fixed questions, our backend vs native SGLang (and a running server)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from sglang_hf_backend.assets import mmlu_questions, smollm2_checkpoint
from sglang_hf_backend.evals import mmlu, rouge
from sglang_hf_backend.testing.engines import Server

SCRIPT = Path(__file__).resolve().parents[4] / "scripts" / "mmlu.py"


def run_script(out: Path, *extra: str) -> dict:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--num-examples", "24", "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    return json.loads((out / "mmlu.json").read_text())


def test_ours_and_native_answer_alike(tmp_path):
    result = run_script(tmp_path, "--impl", "transformers,sglang", "--dtype", "float32")
    answers = result["answers"]
    assert len(answers["transformers"]) == 24
    assert answers["transformers"] == answers["sglang"]
    assert result["differing"] == []
    assert result["scores"]["transformers"]["overall"] == result["scores"]["sglang"]["overall"]
    diff = result["letter_logprob_diff"]["sglang"]
    assert diff["against"] == "transformers"
    assert diff["max"] < rouge.DEFAULT_LOGPROB_THRESHOLD  # fp32: the logprobs agree, not just the argmax
    assert (tmp_path / "mmlu.md").read_text().startswith("| subject | transformers | sglang |")
    assert (tmp_path / "mmlu.html").exists()


def test_running_server_is_scored_through_the_openai_api(tmp_path):
    server = Server(
        [
            "--model-path",
            str(smollm2_checkpoint()),
            "--impl",
            "transformers",
            "--dtype",
            "float32",
            "--max-total-tokens",
            "16384",
        ],
        tmp_path / "server.log",
    )
    try:
        result = run_script(tmp_path / "out", "--server", server.url, "--num-examples", "8")
    finally:
        server.stop()
    assert len(result["answers"]["server"]) == 8
    assert set(result["answers"]["server"]) <= set("ABCD")


def test_sample_is_seeded_and_shots_are_disjoint():
    questions = mmlu_questions()
    assert len(questions) == 14042  # the two stray CSV header rows are dropped
    first = mmlu.select(questions, 40, None, seed=0)
    assert [q.question for q in first.questions] == [
        q.question for q in mmlu.select(questions, 40, None, 0).questions
    ]
    shot_texts = {q.question for pool in first.shots.values() for q in pool}
    assert not shot_texts & {q.question for q in first.questions}
    prompt = mmlu.format_prompt(first.questions[0], first.shots[first.questions[0].subject])
    assert prompt.count("Answer:") == 6 and prompt.endswith("Answer:")
