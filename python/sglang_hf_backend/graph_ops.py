"""Opaque ops for compiled graphs (``sglang_hf_backend::...``): attention and packed linears.

A compiled step calls each of them once per layer and linear, ~150 calls for a 30-layer model.
They are registered through ``torch.library.Library`` rather than ``torch.library.custom_op``,
whose Python wrappers (autograd, aliasing checks) cost about 4 us more per call (5.8 vs 1.6 us
measured); steps run under ``no_grad`` on CPU tensors, so the CPU kernel and a fake
implementation for tracing are all they need.
"""

from __future__ import annotations

from typing import Callable

import torch

NAMESPACE = "sglang_hf_backend"
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")


def define(schema: str, impl: Callable, fake: Callable) -> None:
    """Define ``sglang_hf_backend::<schema>`` with a CPU implementation and a fake one."""
    name = schema.split("(", 1)[0]
    _LIBRARY.define(schema)
    _LIBRARY.impl(name, impl, "CPU")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIBRARY)
