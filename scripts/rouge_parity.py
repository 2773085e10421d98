"""ROUGE-L and logprob parity: HF generate vs our backend vs native SGLang, greedy.

For each prompt (short ones and ~1k-token ones) every implementation generates greedily
with top-5 logprobs; each is compared with the first implementation listed (HF by
default): character-level ROUGE-L and the max |diff| of top-5 prefill and decode
logprobs. Exits non-zero when a prompt misses the thresholds; writes a JSON report.

Usage:
  python scripts/rouge_parity.py --model smollm2 --impl hf,transformers,sglang --dtype float32
  python scripts/rouge_parity.py --model path/to/ckpt --impl hf,transformers --tp-size 2
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import sys
import textwrap
from pathlib import Path

SHORT_PROMPTS = [
    "Apple is red. Banana is Yellow. The sky is blue. Grass is",
    "The capital of France is",
    "def add(a, b):\n    return",
    "Here are three tips for staying healthy:",
]


def long_prompt_ids(tokenizer, length: int = 1000) -> list[int]:
    """~``length`` tokens of fixed, real text (a standard-library module's source)."""
    return tokenizer.encode(inspect.getsource(textwrap), add_special_tokens=False)[:length]


def main() -> int:
    from sglang_hf_backend.evals import rouge
    from sglang_hf_backend.evals.runners import RunnerOptions, make_runner, resolve_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="checkpoint path, or 'smollm2'")
    parser.add_argument(
        "--impl", default="hf,transformers,sglang", help="comma list; the first is the reference"
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--torchao-config")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--prompts", default="short,long", help="short, long or both")
    parser.add_argument("--rouge-threshold", type=float, default=rouge.DEFAULT_ROUGE_THRESHOLD)
    parser.add_argument("--logprob-threshold", type=float, default=rouge.DEFAULT_LOGPROB_THRESHOLD)
    parser.add_argument("--out", default="out/rouge_parity.json")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=args.trust_remote_code)
    prompts = []
    if "short" in args.prompts:
        prompts += [tokenizer.encode(p) for p in SHORT_PROMPTS]
    if "long" in args.prompts:
        prompts.append(long_prompt_ids(tokenizer))
    served = RunnerOptions(path, args.dtype, args.tp_size, args.torchao_config, args.trust_remote_code)
    reference_options = dataclasses.replace(served, tp_size=1, torchao_config=None)
    impls = args.impl.split(",")
    generations = {}
    for impl in impls:
        runner = make_runner(impl, reference_options if impl == "hf" else served)
        try:
            generations[impl] = runner.generate(prompts, args.max_new_tokens)
        finally:
            runner.close()

    reference, report, failed = impls[0], {"model": path, "reference": impls[0], "results": {}}, False
    print(
        f"reference: {reference}; thresholds: ROUGE-L >= {args.rouge_threshold}, logprob diff <= {args.logprob_threshold}"
    )
    for impl in impls[1:]:
        rows = rouge.compare(prompts, generations[reference], generations[impl])
        report["results"][impl] = [dataclasses.asdict(r) for r in rows]
        for i, row in enumerate(rows):
            ok = row.passes(args.rouge_threshold, args.logprob_threshold)
            failed |= not ok
            print(
                f"{impl:>12} prompt {i} ({row.prompt_tokens:4d} tok): ROUGE-L {row.rouge_l:.3f}  "
                f"prefill diff {row.prefill_logprob_diff:.2e}  decode diff {row.decode_logprob_diff:.2e}  "
                f"{'ok' if ok else 'FAIL'}"
            )
    report["passed"] = not failed
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"{'PASS' if not failed else 'FAIL'}; report written to {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
