"""Our C++ CPU kernels (``csrc/``), built for this machine on first use and cached.

torch's extension builder compiles them with ``-O3 -march=native`` into its cache
(``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``) under a name that includes
a hash of this CPU's feature flags, so a cache shared between machines never hands one CPU code
built for another; later starts load the cached library in well under a second. The launcher
process starts the build in the background (``build_in_background``) while SGLang spawns its
schedulers and they import (SmolLM2's first start: the 9 s build no longer delays serving);
the sources include only the ATen headers they use (``ATen/ATen.h`` costs ~2 s a file: the
three built in 15.8 s with it, 11.2 s without, on a 2-core Xeon);
a scheduler that needs the kernels earlier waits on the build's lock and loads what it built.

``paged_decode_attention`` (``csrc/paged_decode.cpp``): decode attention reading the paged KV
pool in place; ``SGLANG_HF_BACKEND_DECODE_KERNEL=0`` keeps torch's SDPA over gathered K/V (for
comparisons). ``store_kv`` (same file): a forward's K and V rows written into the pool.
``one_token_linear`` (``csrc/one_token_linear.cpp``): fp32 linears of one token, used where
weights are packed for fp32 (``cpu_linear``). ``amx_packed_linear``
(``csrc/amx_linear.cpp``): bf16 linears of up to 32 tokens on oneDNN's packed weights, on CPUs
with AMX (``cpu_linear``). ``packed_linear`` (``csrc/packed_linear.cpp``): every packed linear's
product, routed to those by size in C++. ``attend`` (``csrc/step_attention.cpp``): a compiled
step's attention node, which writes and attends in C++ in decode (``attention``). Where the build
fails (no C++ compiler), the backend says so, attends with SDPA and multiplies with oneDNN.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
import time
from pathlib import Path

import torch

from sglang_hf_backend.args import switched_on

logger = logging.getLogger("sglang_hf_backend")

DECODE_KERNEL_ENV = "SGLANG_HF_BACKEND_DECODE_KERNEL"
SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "paged_decode.cpp",
        "one_token_linear.cpp",
        "amx_linear.cpp",
        "packed_linear.cpp",
        "step_attention.cpp",
    )
]


def decode_kernel_wanted() -> bool:
    """Use the paged decode kernel? Unless switched off, if it builds here."""
    return decode_kernel_setting() and load() is None


def decode_kernel_setting() -> bool:
    return switched_on(DECODE_KERNEL_ENV, "decode with the kernel where it builds")


def build_in_background() -> None:
    """Build (or load) the kernels in a daemon thread of the launcher. Also with the decode
    kernel switched off: fp32 one-token linears use them too, and would otherwise build them
    while the model loads. The switch's value is still checked here, before any worker starts."""
    decode_kernel_setting()
    threading.Thread(target=load, name="sglang_hf_backend C++ kernels", daemon=True).start()


def load() -> str | None:
    """Build (first time on this machine) and load the kernels; None, or why they are missing."""
    with _LOADING:
        return _load()


_LOADING = threading.Lock()


@functools.cache
def _load() -> str | None:
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    started = time.perf_counter()
    try:
        cpp_extension.load(
            name=f"sglang_hf_backend_kernels_{machine_tag()}",
            sources=[str(source) for source in SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp", *vector_flags()],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except (RuntimeError, OSError, ImportError) as error:
        why = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
        logger.warning("sglang_hf_backend: the C++ CPU kernels did not build (%s)", why)
        return why
    logger.debug("sglang_hf_backend: C++ CPU kernels ready in %.1f s", time.perf_counter() - started)
    return None


def vector_flags() -> list[str]:
    """Build ATen's vector types for the unit torch itself dispatches to on this CPU."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return ["-DCPU_CAPABILITY=DEFAULT"]
    return [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]


def machine_tag() -> str:
    """Short hash of what the build depends on besides the sources: CPU features and torch."""
    flags = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        flags = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
    capability = torch.backends.cpu.get_cpu_capability()
    return hashlib.sha256(f"{flags}|{capability}|{torch.__version__}".encode()).hexdigest()[:12]


def _put_ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH; the pinned ``ninja`` wheel puts it next to Python."""
    try:
        import ninja
    except ImportError:
        return
    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
