"""Run code right after a module is imported, without importing it now.

SGLang's model registry and attention registry are expensive or order-sensitive to
import, so the plugin hooks them as they load: ``when_imported(name, callback)`` calls
``callback(module)`` at once if the module is already loaded, else right after its
import finishes (through a meta-path finder that wraps that one module's loader).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections import defaultdict
from typing import Callable

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
