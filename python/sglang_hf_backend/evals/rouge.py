"""ROUGE-L parity between implementations, the way SGLang's own regression check measures it.

Per prompt: the character-level ROUGE-L F-measure of the two generated texts (SGLang's
``calculate_rouge_l``: longest common subsequence over characters) and the largest
absolute difference between the top-k logprobs at every prompt position (prefill) and
every generated position (decode). SGLang's thresholds: ROUGE-L 1.0, logprob diff 5e-2.

The F-measure is computed here rather than imported: ``sglang.test.test_utils`` imports
SGLang's benchmark datasets, which need ``datasets`` (not in the CPU stack), and it scores
two empty texts 0.0, which would fail parity when both implementations stop at once.
"""

from __future__ import annotations

import dataclasses

from sglang_hf_backend.evals.runners import Generation

DEFAULT_ROUGE_THRESHOLD = 1.0
DEFAULT_LOGPROB_THRESHOLD = 5e-2


def lcs_length(a: str, b: str) -> int:
    previous = [0] * (len(b) + 1)
    for char in a:
        current = [0]
        for j, other in enumerate(b):
            current.append(previous[j] + 1 if char == other else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def rouge_l(a: str, b: str) -> float:
    """Character-level LCS F-measure (identical texts score 1.0, empty ones included)."""
    if a == b:
        return 1.0
    common = lcs_length(a, b)
    precision = common / len(a) if a else 0.0
    recall = common / len(b) if b else 0.0
    return 2 * precision * recall / (precision + recall) if precision + recall else 0.0


def max_logprob_diff(a: list[list[tuple[int, float]]], b: list[list[tuple[int, float]]]) -> float:
    """Largest |difference| of the sorted top-k logprob values, position by position."""
    worst = 0.0
    for row_a, row_b in zip(a, b):
        values_a = sorted((lp for _, lp in row_a), reverse=True)
        values_b = sorted((lp for _, lp in row_b), reverse=True)
        worst = max(worst, *(abs(x - y) for x, y in zip(values_a, values_b)))
    return worst


@dataclasses.dataclass
class PromptParity:
    prompt_tokens: int
    rouge_l: float
    prefill_logprob_diff: float
    decode_logprob_diff: float
    reference_text: str
    candidate_text: str

    def passes(self, rouge_threshold: float, logprob_threshold: float) -> bool:
        return (
            self.rouge_l >= rouge_threshold
            and self.prefill_logprob_diff <= logprob_threshold
            and self.decode_logprob_diff <= logprob_threshold
        )


def compare(
    prompts: list[list[int]], reference: list[Generation], candidate: list[Generation]
) -> list[PromptParity]:
    return [
        PromptParity(
            prompt_tokens=len(ids),
            rouge_l=rouge_l(ref.text, cand.text),
            prefill_logprob_diff=max_logprob_diff(ref.prefill_top, cand.prefill_top),
            decode_logprob_diff=max_logprob_diff(ref.decode_top, cand.decode_top),
            reference_text=ref.text,
            candidate_text=cand.text,
        )
        for ids, ref, cand in zip(prompts, reference, candidate)
    ]
