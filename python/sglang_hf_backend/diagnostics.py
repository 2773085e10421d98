"""What the backend tells its user: decisions (logged once, by rank 0) and load reports.

Decision lines (which class serves the model, the TP layout, fusions, quantization)
are logged at INFO by TP rank 0 only, so a model logs each decision once. What differs
per rank (weight bytes held, memory peak while loading) is logged by every rank and,
when ``SGLANG_HF_BACKEND_LOAD_REPORT`` names a directory, also written there as
``rank<N>.json`` for tests and benchmarks to read.
"""

from __future__ import annotations

import json
import logging
import os
import resource
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger("sglang_hf_backend")

LOAD_REPORT_ENV = "SGLANG_HF_BACKEND_LOAD_REPORT"


def tp_rank() -> int:
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().tp_rank


# One load report per process, named by its placement.
REPORT_NAME = "rank{tp_rank}-pp{pp_rank}-dp{dp_rank}.json"


def placement() -> dict[str, int]:
    """This process's tensor-parallel rank, pipeline stage and data-parallel replica."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return {"tp_rank": parallel.tp_rank, "pp_rank": parallel.pp_rank, "dp_rank": parallel.dp_rank or 0}


def decision(message: str, *args) -> None:
    """Log a backend decision once per model (rank 0 only)."""
    if tp_rank() == 0:
        logger.info("sglang_hf_backend: " + message, *args)


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds, including the inner tensors of torchao's subclasses."""
    inner = getattr(tensor, "__tensor_flatten__", None)
    if inner is not None and type(tensor) not in (torch.Tensor, nn.Parameter):
        names, _ = inner()
        return sum(tensor_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def weight_bytes(model: nn.Module) -> int:
    return sum(tensor_bytes(p) for p in model.parameters())


def report_load(model: nn.Module, rss_before: int, extra: dict | None = None) -> dict:
    """Log and (optionally) write what this rank holds after loading its weights."""
    report = {
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        **placement(),
        "weight_bytes": weight_bytes(model),
        "peak_rss_growth_bytes": max(0, max_rss_bytes() - rss_before),
        **(extra or {}),
    }
    logger.info(
        "sglang_hf_backend: TP rank %d (pipeline stage %d) holds %.1f MB of weights (RSS peak grew %.1f MB while loading)",
        report["tp_rank"],
        report["pp_rank"],
        report["weight_bytes"] / 2**20,
        report["peak_rss_growth_bytes"] / 2**20,
    )
    directory = os.environ.get(LOAD_REPORT_ENV)
    if directory:
        Path(directory).mkdir(parents=True, exist_ok=True)
        Path(directory, REPORT_NAME.format(**report)).write_text(json.dumps(report))
    return report


def amend_load_report(**fields) -> None:
    """Add what is known only after serving has started (say, how a step compiled) to this
    rank's load report, where one is being written."""
    directory = os.environ.get(LOAD_REPORT_ENV)
    if not directory:
        return
    path = Path(directory, REPORT_NAME.format(**placement()))
    if path.exists():
        path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def describe_layers(model: nn.Module) -> dict[str, str]:
    """Each SGLang linear in ``model``: its SGLang class and how it splits across ranks."""
    from sglang.srt.layers.linear import LinearBase

    layers = {}
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase):
            continue
        base = next(c.__name__ for c in type(module).__mro__ if c.__module__.startswith("sglang.srt"))
        flags = []
        if getattr(module, "gather_output", False):
            flags.append("gather output")
        if getattr(module, "input_is_parallel", True) is False:
            flags.append("split input")
        layers[name] = base + (f" ({', '.join(flags)})" if flags else "")
    return layers


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """SGLang's FusedMoE layers in ``model`` (found by class name: importing it costs seconds)."""
    return [m for m in model.modules() if any(c.__name__ == "FusedMoE" for c in type(m).__mro__)]
