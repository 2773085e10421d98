"""Compiled steps saved on disk, so a second start neither traces nor compiles.

Inductor's cache (``TORCHINDUCTOR_CACHE_DIR``) keeps generated code, but a start still has to
trace HF's Python to find it: most of a warm start's compile (SmolLM2: 6.8 s of warm-up). A
step traced as one graph is saved with ``torch.compile``'s ahead-of-time API
(``aot_compile`` / ``load_compiled_function``) next to inductor's cache, and loaded instead
(0.8 s). The file name hashes what the trace read that the saved guards do not check: package
versions, this CPU and dtype, the rank, inductor's settings, the backbone's config and module
tree, each linear's method, and the sources of the backbone's module classes (and their bases)
and of this package. The guards it keeps (parameter and input shapes, dtypes, constants, grad
mode) are checked against the live backbone before a loaded step is used.
A step that cannot be saved (the trace breaks, as at TP > 1, or a guard cannot be written)
leaves a note with the reason, so later starts go straight to the ordinary compile. The files
are trusted as inductor's own cache is (it imports generated code from the same directory).
"""

from __future__ import annotations

import hashlib
import inspect
import os
import pickle
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from sglang_hf_backend import cpu_kernels, diagnostics


class SavedStep:
    """Where this backbone's compiled step is saved, and loading, saving and notes about it."""

    def __init__(self, backbone: nn.Module):
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        digest = hashlib.sha256()
        for part in step_identity(backbone):
            digest.update(part.encode())
            digest.update(b"\0")
        stem = Path(cache_dir(), "sglang_hf_backend", f"step-{digest.hexdigest()[:32]}")
        self.path = stem.with_suffix(".bin")
        self.note_path = stem.with_suffix(".unsaveable")

    def load(self, traced: Callable, backbone: nn.Module, inputs: dict):
        """The saved step of ``traced`` if there is one and its guards accept ``backbone`` and
        ``inputs``."""
        if not self.path.exists():
            return None
        try:
            with self.path.open("rb") as file:
                step = torch.compiler.load_compiled_function(file, f_globals=traced.__globals__)
            fits = step.guard_check(backbone, **inputs)
        except Exception as error:  # written by another torch, truncated, ...: trace instead
            diagnostics.decision("torch.compile: saved step %s unusable (%s); tracing", self.path, error)
            return None
        if not fits:
            diagnostics.decision(
                "torch.compile: saved step %s does not fit this backbone (%s); tracing",
                self.path,
                guard_failure(step, backbone, inputs),
            )
            return None
        return step

    def save(self, step) -> bool:
        """Write the step for later starts (a temporary file, then a rename); whether it was."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            step.save_compiled_function(str(self.path))
        except (OSError, RuntimeError, pickle.PicklingError) as error:
            diagnostics.decision("torch.compile: could not save the step to %s (%s)", self.path, error)
            return False
        return True

    def why_unsaveable(self) -> str | None:
        """Why an earlier start could not save this step, if one could not."""
        return self.note_path.read_text() if self.note_path.exists() else None

    def remember_unsaveable(self, why: str) -> None:
        self.note_path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.note_path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(why)
        partial.replace(self.note_path)

    @staticmethod
    def guards_kept(entries) -> list[bool]:
        """Guards a saved step can carry: those on the step's arguments (the backbone's tensors,
        sizes and constants) and global state, not identity checks of live objects."""
        from torch._dynamo.guards import CheckFunctionManager

        unsupported = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
        return [
            not entry.is_global
            and entry.guard_type not in unsupported
            and not unsupported.intersection(entry.derived_guard_types)
            for entry in entries
        ]


def step_identity(backbone: nn.Module) -> Iterator[str]:
    """What a saved step depends on beyond its guards (see the module docstring)."""
    import sglang
    import transformers

    import sglang_hf_backend

    yield f"{torch.__version__} {transformers.__version__} {sglang.__version__} {sglang_hf_backend.__version__}"
    yield f"{cpu_kernels.machine_tag()} {torch.get_default_dtype()} {diagnostics.placement()}"
    yield repr(sorted(torch._inductor.config.save_config_portable().items()))
    config = getattr(backbone, "config", None)
    yield config.to_json_string() if config is not None else ""
    yield str(backbone)
    for name, module in backbone.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            yield f"{name} {type(method).__qualname__}"
    classes = {
        cls for module in backbone.modules() for cls in type(module).__mro__ if issubclass(cls, nn.Module)
    }
    sources = {inspect.getsourcefile(cls) for cls in classes}
    sources |= {str(path) for path in Path(__file__).parent.rglob("*.py")}
    for source in sorted(filter(None, sources)):
        yield Path(source).read_text()


def guard_failure(step, backbone: nn.Module, inputs: dict) -> str:
    """Which of a compiled step's guards rejects these arguments."""
    arguments = step.prepare_f_locals(backbone, **inputs)
    return "; ".join(step._artifacts.guard_manager.check_verbose(arguments).verbose_code_parts)
