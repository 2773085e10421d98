"""A CPU platform for SGLang, active only on machines without an accelerator.

SGLang 0.5.23's base CPU platform leaves three gaps on a plain CPU machine: native
rotary embeddings import vllm, ``get_device()`` finds no device for parameters that
are not replaced, and TP groups try PyNccl. An out-of-tree platform closes all three:
being out-of-tree selects the native rotary path, ``get_device`` answers "cpu" (so
``device="cpu"`` need not be given), and ``supports_pynccl=False`` keeps TP on gloo.
More gaps show where native models launch Triton kernels on any platform but NPU and
SGLang's own CPU engine (final-logit soft-capping for Gemma2, Qwen2-MoE's shared-expert
gate); ``install_cpu_kernel_fallbacks`` swaps in the same computation in torch. SGLang's
profiler also asks an out-of-tree platform for its profiler activity (CPU here).
SGLang's LoRA pins host buffers, which needs a CUDA driver: ``install_pinning_fallback``
runs those functions with pinning as a no-op (a pinned copy of a CPU tensor is the tensor),
and the platform serves LoRA with SGLang's ``torch_native`` backend (the others are Triton).
The platform also picks our batched CPU attention backend (``cpu_attention.py``), and with
``dtype="auto"`` serves in a type this CPU multiplies natively (bf16 where AMX/AVX512-BF16
exist, else fp32) instead of a half type torch runs on a slow path here (``cpu_dtype_choice``);
fp32 chosen that way is multiplied by oneDNN (``cpu_linear``), an explicit fp32 by torch.
In its worker processes glibc's malloc keeps large freed blocks for reuse
(``keep_freed_memory_for_reuse``) instead of faulting every prefill temporary in anew, and idle
schedulers wait for requests instead of polling for them (``sleep_when_idle``).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import logging
import multiprocessing
import os
from pathlib import Path

import torch
from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform

from sglang_hf_backend.args import switched_on

logger = logging.getLogger(__name__)

# The batched CPU attention backend (cpu_attention.py) this platform registers and picks.
BACKEND_NAME = "cpu_sdpa"
# --enable-torch-compile on a native model starts SGLang's CPU graph runner, which needs an
# attention backend that keeps CPU-graph state (intel_amx with sgl-kernel).
CPU_GRAPH_REFUSAL = (
    f"--attention-backend {BACKEND_NAME} does not support SGLang's CPU graph capture, which "
    "--enable-torch-compile starts for native models. Serve with --impl transformers "
    "(sglang_hf_backend compiles the decoder layers itself), or drop --enable-torch-compile."
)
# SGLang's one LoRA backend written in torch; its default (csgmv) and the others launch Triton.
LORA_BACKEND = "torch_native"
KEEP_FREED_MEMORY_ENV = "SGLANG_HF_BACKEND_KEEP_FREED_MEMORY"
SLEEP_WHEN_IDLE_ENV = "SGLANG_HF_BACKEND_SLEEP_WHEN_IDLE"
# Set by the platform, for its workers: dtype auto serves fp32 here (no native half type).
FP32_FOR_SPEED_ENV = "SGLANG_HF_BACKEND_FP32_FOR_SPEED"
# glibc's mallopt parameters, and how much freed memory a worker keeps for reuse.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
KEPT_FREE_BYTES = 1 << 30


def accelerator_present() -> bool:
    """True when torch sees any device SGLang has an in-tree platform for."""
    checks = (
        lambda: torch.cuda.is_available(),
        lambda: hasattr(torch, "xpu") and torch.xpu.is_available(),
        lambda: hasattr(torch, "npu") and torch.npu.is_available(),
        lambda: hasattr(torch, "mps") and torch.mps.is_available(),
        lambda: getattr(torch.version, "musa", None) is not None,
    )
    return any(check() for check in checks)


def serves_this_machine() -> bool:
    """Our platform is the one in charge: no accelerator, no request for SGLang's CPU engine."""
    return os.environ.get("SGLANG_USE_CPU_ENGINE", "0") != "1" and not accelerator_present()


def activate() -> str | None:
    """Entry point of ``sglang.srt.platforms``: our platform, or None to stand aside.

    Stands aside where an accelerator exists (its own platform serves it) and where
    the user asked for SGLang's own CPU engine (``SGLANG_USE_CPU_ENGINE=1``).
    """
    return f"{__name__}.{HFBackendCpuPlatform.__qualname__}" if serves_this_machine() else None


def register_cpu_attention_backend() -> None:
    """Make ``cpu_sdpa`` a valid --attention-backend and build it when SGLang asks for it."""
    from sglang.srt.arg_groups import choices

    from sglang_hf_backend.imports import when_imported

    if BACKEND_NAME not in choices.ATTENTION_BACKEND_CHOICES:
        choices.add_attention_backend_choices([BACKEND_NAME])
    when_imported(
        "sglang.srt.layers.attention.attention_registry",
        lambda registry: registry.register_attention_backend(BACKEND_NAME)(_build_cpu_attention),
    )


def _build_cpu_attention(model_runner):
    from sglang_hf_backend.cpu_attention import CpuSdpaAttnBackend

    return CpuSdpaAttnBackend(model_runner, BACKEND_NAME)


def softcap_inplace(logits: torch.Tensor, softcap: float) -> torch.Tensor:
    """``softcap * tanh(logits / softcap)`` in place, as SGLang's Triton kernel computes it."""
    return logits.div_(softcap).tanh_().mul_(softcap)


def gate_sigmoid_mul(hidden_states, gate_weight, shared_output) -> torch.Tensor:
    """``sigmoid(hidden . gate) * shared`` per token in fp32, as SGLang's Triton kernel computes it."""
    gate = torch.sigmoid((hidden_states.float() * gate_weight.float()).sum(dim=-1, keepdim=True))
    return (gate * shared_output.float()).to(shared_output.dtype)


def gate_sigmoid_mul_add(hidden_states, gate_weight, shared_output, final_hidden_states) -> None:
    """``final += sigmoid(hidden . gate) * shared`` in place (Qwen2-MoE's shared-expert gate)."""
    gate = torch.sigmoid((hidden_states.float() * gate_weight.float()).sum(dim=-1, keepdim=True))
    final_hidden_states.copy_(gate * shared_output.float() + final_hidden_states.float())


def install_cpu_kernel_fallbacks() -> None:
    """Torch versions of the Triton kernels SGLang's native models launch on every platform."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    fallbacks = {
        "sglang.kernels.ops.activation.softcap.softcap_inplace_logits": softcap_inplace,
        "sglang.kernels.ops.elementwise.elementwise.fused_gate_sigmoid_mul": gate_sigmoid_mul,
        "sglang.kernels.ops.elementwise.elementwise.fused_gate_sigmoid_mul_add": gate_sigmoid_mul_add,
    }
    for target, fallback in fallbacks.items():
        HookRegistry.register(target, fallback, HookType.REPLACE)


# The LoRA manager's entry points; below them SGLang pins host buffers (LoRA layers, their
# adapter slots, the torch backend's per-batch segments).
PINNING_FUNCTIONS = tuple(
    f"sglang.srt.lora.lora_manager.LoRAManager.{method}"
    for method in (
        "__init__",
        "load_lora_adapter",
        "load_lora_adapter_from_tensors",
        "unload_lora_adapter",
        "prepare_lora_batch",
    )
)
_PINNING_FACTORIES = ("tensor", "empty", "zeros", "ones", "arange")


@contextlib.contextmanager
def pinning_is_a_no_op():
    """Inside, ``pin_memory`` (method or factory keyword) leaves CPU tensors as they are.

    Pinned memory only speeds up copies to an accelerator; without one, torch raises
    "Found no NVIDIA driver" instead. Patched process-wide while SGLang's pinning code
    runs; other threads see the same tensors they would get anyway.
    """
    originals = {name: getattr(torch, name) for name in _PINNING_FACTORIES}
    original_pin = torch.Tensor.pin_memory

    def unpinned(factory):
        def build(*args, pin_memory=False, **kwargs):
            return factory(*args, **kwargs)

        return build

    try:
        for name, factory in originals.items():
            setattr(torch, name, unpinned(factory))
        torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
        yield
    finally:
        for name, factory in originals.items():
            setattr(torch, name, factory)
        torch.Tensor.pin_memory = original_pin


def _without_pinning(original, *args, **kwargs):
    with pinning_is_a_no_op():
        return original(*args, **kwargs)


def install_pinning_fallback() -> None:
    """Run SGLang's pinning LoRA code with pinning as a no-op (CPU-only machines)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target in PINNING_FUNCTIONS:
        HookRegistry.register(target, _without_pinning, HookType.AROUND)


class HFBackendCpuPlatform(CpuDeviceMixin, SRTPlatform):
    """SGLang on a CPU-only machine, through the out-of-tree platform seam."""

    _enum = PlatformEnum.OOT
    capabilities = PlatformCapabilities(supports_pynccl=False)

    def __init__(self) -> None:
        super().__init__()
        # The platform names cpu_sdpa as its default, so it registers it too: this
        # holds even where general plugins are switched off (SGLANG_PLUGINS).
        register_cpu_attention_backend()

    def get_device(self, device_id: int = 0) -> str:
        # SGLang's server-argument resolution splits this value as a string.
        return "cpu"

    def init_backend(self) -> None:
        """Called once in each process that runs a model."""
        if multiprocessing.parent_process() is not None:  # a worker SGLang spawned, not the user's process
            keep_freed_memory_for_reuse()

    def get_default_attention_backend(self) -> str:
        return BACKEND_NAME

    def is_pin_memory_available(self, device=None) -> bool:
        return False

    def get_torch_profiler_activity_str(self) -> str:
        return "CPU"  # asked for by SGLang's profiler on out-of-tree platforms

    def get_torch_profiler_activity(self) -> torch.profiler.ProfilerActivity:
        return torch.profiler.ProfilerActivity.CPU

    def apply_server_args_defaults(self, server_args) -> None:
        """Serve attention with our CPU backend unless the user picked another one.

        SGLang's CPU rule has already filled in ``intel_amx`` when nothing was chosen; that
        backend needs a CPU build of ``sgl_kernel`` (not on PyPI) and otherwise falls back
        to the per-request ``torch_native`` loop.
        """
        if server_args.attention_backend in (None, "intel_amx") and not _cpu_kernels_installed():
            server_args.attention_backend = BACKEND_NAME
        uses_cpu_graphs = server_args.enable_torch_compile and server_args.model_impl == "sglang"
        if uses_cpu_graphs and server_args.attention_backend == BACKEND_NAME:
            raise ValueError(CPU_GRAPH_REFUSAL)
        if (server_args.enable_lora or server_args.lora_paths) and server_args.lora_backend != LORA_BACKEND:
            logger.info(
                "LoRA backend %s launches Triton kernels; serving LoRA on the CPU with %s",
                server_args.lora_backend,
                LORA_BACKEND,
            )
            server_args.lora_backend = LORA_BACKEND
        self.choose_dtype(server_args)
        sleep_when_idle(server_args)

    @staticmethod
    def choose_dtype(server_args) -> None:
        """Serve in the fastest dtype this CPU computes natively when the user left it to us."""
        dtype, why = cpu_dtype_choice(
            server_args.dtype, checkpoint_dtype(server_args.model_path), native_half_dtypes()
        )
        if why:
            (logger.info if dtype != server_args.dtype else logger.warning)("%s", why)
        publish_fp32_for_speed(server_args.dtype == "auto" and dtype == "float32")
        server_args.dtype = dtype


def sleep_when_idle(server_args) -> None:
    """Idle schedulers wait on their request sockets (SGLang's ``--sleep-on-idle``).

    Without it SGLang's scheduler loop polls for requests without pause: on a GPU server that
    is one host core of many, on a CPU machine a core taken from the model's threads, the
    tokenizer, the detokenizer and the rest of the machine. An idle engine kept a whole core
    busy (5.0 s of CPU in 5 s), at tp_size 2 one and a half of this machine's two; sleeping,
    0.1 s. A request wakes the scheduler at once (a zmq poll on its sockets), and the other TP
    ranks then wait in their broadcast instead of spinning through empty ones.
    """
    if server_args.sleep_on_idle or not switched_on(SLEEP_WHEN_IDLE_ENV, "idle schedulers sleep"):
        return
    server_args.sleep_on_idle = True
    logger.info(
        "idle schedulers wait for requests instead of polling (sleep_on_idle; %s=0 polls)",
        SLEEP_WHEN_IDLE_ENV,
    )


def publish_fp32_for_speed(chosen: bool) -> None:
    """Tell this engine's workers (spawned children inherit the environment) whether fp32 is
    served because dtype auto chose it for speed, not because the user asked for fp32: only
    then may a linear trade torch's fp32 rounding for a faster product (``cpu_linear``)."""
    if chosen:
        os.environ[FP32_FOR_SPEED_ENV] = "1"
    else:
        os.environ.pop(FP32_FOR_SPEED_ENV, None)


def fp32_served_for_speed() -> bool:
    return os.environ.get(FP32_FOR_SPEED_ENV) == "1"


def keep_freed_memory_for_reuse() -> None:
    """Make glibc's malloc reuse large freed blocks rather than hand them back to the OS.

    glibc maps every block above its mmap threshold (at most 32 MB, adapted up from 128 KB)
    afresh and unmaps it when freed, so each large temporary of a prefill is faulted in page
    by page on every use: a 64 MB block (the 0.5B Llama's gate/up output at 4096 tokens)
    costs 15 ms to allocate and fill against 1.6 ms reused. A 32 x 128 prefill of that Llama
    took ~400,000 page faults (1.6 GB) and 2.6-2.7 s; with one arena and 1 GiB mmap and trim
    thresholds, ~1,000 faults and 2.0-2.1 s. SGLang's CPU guide preloads tcmalloc for the
    same reason; with another allocator preloaded, or another C library, nothing is changed.
    """
    if not switched_on(KEEP_FREED_MEMORY_ENV, "keep freed blocks of up to 1 GiB for reuse"):
        return
    preloaded = os.environ.get("LD_PRELOAD", "")
    if any(name in preloaded for name in ("tcmalloc", "jemalloc", "mimalloc")):
        logger.info("malloc: %s is preloaded, so glibc's settings are left as they are", preloaded)
        return
    try:
        os.confstr("CS_GNU_LIBC_VERSION")
        libc = ctypes.CDLL("libc.so.6")
    except (OSError, ValueError):
        return  # not glibc: its own malloc, its own settings
    settings = {
        "arena_max": (M_ARENA_MAX, 1),
        "mmap_threshold": (M_MMAP_THRESHOLD, KEPT_FREE_BYTES),
        "trim_threshold": (M_TRIM_THRESHOLD, KEPT_FREE_BYTES),
    }
    refused = [name for name, (param, value) in settings.items() if libc.mallopt(param, value) != 1]
    logger.info(
        "malloc: freed blocks of up to %d MiB kept for reuse, one arena (glibc mallopt%s)",
        KEPT_FREE_BYTES >> 20,
        f"; refused: {', '.join(refused)}" if refused else "",
    )


HALF_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16}


def native_half_dtypes() -> set[torch.dtype]:
    """Half types this CPU multiplies natively (AMX / AVX512-BF16 for bf16, AMX-FP16 for fp16).

    Elsewhere torch's half-precision GEMMs fall to a slow path: measured on an AVX2-only EPYC,
    bf16 ~1.2 GFLOP/s against ~138 GFLOP/s in fp32.
    """
    native = set()
    if torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported():
        native.add(torch.bfloat16)
    if torch.cpu._is_amx_fp16_supported():
        native.add(torch.float16)
    return native


def checkpoint_dtype(model_path: str) -> torch.dtype | None:
    """The dtype a local checkpoint's config.json stores (None for a hub id or no entry)."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    stored = config.get("dtype") or config.get("torch_dtype")
    return HALF_DTYPES.get(stored) or (torch.float32 if stored == "float32" else None)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def sglang_auto_dtype(stored: torch.dtype) -> torch.dtype:
    """What SGLang's dtype auto serves a checkpoint stored in ``stored`` in."""
    return stored if stored in HALF_DTYPES.values() else torch.float16


def served_dtype(requested: str, model_path: str) -> str:
    """The dtype an engine on this CPU serves for ``requested`` (for reports)."""
    stored = checkpoint_dtype(model_path)
    dtype, _ = cpu_dtype_choice(requested, stored, native_half_dtypes())
    return dtype_name(sglang_auto_dtype(stored)) if dtype == "auto" and stored is not None else dtype


def cpu_dtype_choice(requested: str, stored: torch.dtype | None, native: set[torch.dtype]) -> tuple[str, str]:
    """(dtype to serve, why) for a ``--dtype`` on this CPU; ``why`` is empty when nothing is said.

    With ``auto`` SGLang serves a half checkpoint as stored and an fp32 one in fp16; where
    that half type is not native here, bf16 is served if it is native, else fp32.
    """
    capability = torch.backends.cpu.get_cpu_capability()
    if requested == "auto" and stored is not None:
        target = sglang_auto_dtype(stored)
        if target not in native:
            served = torch.bfloat16 if torch.bfloat16 in native else torch.float32
            return dtype_name(served), (
                f"dtype auto: serving in {dtype_name(served)}, not {dtype_name(target)} (what SGLang "
                f"picks for this {dtype_name(stored)} checkpoint): this CPU (torch capability "
                f"{capability}) has no native {dtype_name(target)} matmul, and torch runs it many "
                "times slower"
            )
    half = HALF_DTYPES.get(requested)
    if half is not None and half not in native:
        return requested, (
            f"dtype {requested} on a CPU without native {dtype_name(half)} matmul (torch capability "
            f"{capability}): expect it several times slower than float32 (3.4x at batch 32 on an "
            "AVX2-only EPYC); dtype=auto picks a native type"
        )
    return requested, ""


def _cpu_kernels_installed() -> bool:
    return importlib.util.find_spec("sgl_kernel") is not None
