"""Plugin wiring: what runs in every SGLang process through ``sglang.srt.plugins``.

SGLang calls ``register()`` once per process (launcher, schedulers, detokenizer).
It must stay cheap: SGLang's model registry imports every model module (seconds), so
our classes are put into it only when some process imports the registry anyway.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections import defaultdict
from typing import Callable


def register() -> None:
    """Entry point of ``sglang.srt.plugins``."""
    from sglang_hf_backend import args, platform
    from sglang_hf_backend.attention import register_attention_function

    register_attention_function()
    args.install()
    if platform.serves_this_machine():
        platform.install_cpu_kernel_fallbacks()
        # The CLI parser is built from the backend choices before SGLang resolves the
        # platform (which registers cpu_sdpa itself), so register it here as well.
        platform.register_cpu_attention_backend()
    when_imported("sglang.srt.models.registry", _register_model_classes)


def _register_model_classes(registry_module) -> None:
    from sglang_hf_backend.models import ENTRY_CLASSES

    for cls in ENTRY_CLASSES:
        registry_module.ModelRegistry.models[cls.__name__] = cls


# -- run code right after a module is imported, without importing it now -------
_callbacks: dict[str, list[Callable]] = defaultdict(list)


def when_imported(module_name: str, callback: Callable) -> None:
    """Call ``callback(module)`` now if ``module_name`` is loaded, else right after it loads."""
    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)
        return
    _callbacks[module_name].append(callback)
    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _callbacks:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _CallbackLoader(spec.loader, fullname)
        return spec


class _CallbackLoader(importlib.abc.Loader):
    def __init__(self, loader, fullname: str):
        self.loader = loader
        self.fullname = fullname

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        for callback in _callbacks.pop(self.fullname, []):
            callback(module)
