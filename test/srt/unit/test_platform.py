"""The CPU platform takes over only machines without an accelerator."""

from __future__ import annotations

import importlib.metadata
import json

import pytest
import torch

from sglang_hf_backend import platform
from sglang_hf_backend.testing.processes import run_side_by_side


def test_registered_as_sglang_platform():
    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="sglang.srt.platforms")}
    assert names["sglang_hf_backend_cpu"] == "sglang_hf_backend.platform:activate"


def test_active_on_this_cpu_only_machine():
    assert not torch.cuda.is_available()
    assert platform.activate() == "sglang_hf_backend.platform.HFBackendCpuPlatform"


def test_resolved_by_sglang_as_current_platform():
    from sglang.srt.platforms import current_platform

    assert isinstance(current_platform, platform.HFBackendCpuPlatform)
    assert current_platform.is_out_of_tree()  # the native rotary path needs no vllm
    assert current_platform.get_device() == "cpu"  # device="cpu" need not be given
    assert not current_platform.capabilities.supports_pynccl  # TP runs on gloo


def test_stands_aside_for_sglangs_own_cpu_engine(monkeypatch):
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    assert platform.activate() is None


def test_stands_aside_when_a_gpu_is_present(monkeypatch):
    # No GPU here: torch's answer is the one thing this test has to stand in for.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert platform.activate() is None


def test_final_softcap_fallback_matches_sglang_formula():
    logits = torch.linspace(-100, 100, 11)
    expected = 30.0 * torch.tanh(logits / 30.0)
    assert torch.equal(platform.softcap_inplace(logits.clone(), 30.0), expected)


def test_pinning_is_a_no_op_only_inside_the_fallback():
    with pytest.raises(RuntimeError):  # no accelerator: torch cannot pin
        torch.tensor([1, 2], pin_memory=True)
    with platform.pinning_is_a_no_op():
        host = torch.tensor([1, 2], dtype=torch.int32, device="cpu", pin_memory=True)
        assert torch.equal(host.pin_memory(), host) and torch.empty(3, pin_memory=True).shape == (3,)
    with pytest.raises(RuntimeError):
        torch.zeros(2).pin_memory()


def test_lora_served_by_the_torch_backend():
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="unused", enable_lora=True, lora_backend="csgmv")
    platform.HFBackendCpuPlatform().apply_server_args_defaults(args)
    assert args.lora_backend == platform.LORA_BACKEND == "torch_native"


@pytest.mark.parametrize(("setting", "sleeps"), [(None, True), ("1", True), ("0", False)])
def test_idle_schedulers_sleep_unless_switched_off(monkeypatch, setting, sleeps):
    from sglang.srt.server_args import ServerArgs

    if setting is not None:
        monkeypatch.setenv(platform.SLEEP_WHEN_IDLE_ENV, setting)
    args = ServerArgs(model_path="unused")
    platform.HFBackendCpuPlatform().apply_server_args_defaults(args)
    assert args.sleep_on_idle is sleeps
    monkeypatch.setenv(platform.SLEEP_WHEN_IDLE_ENV, "yes")
    with pytest.raises(ValueError, match="SGLANG_HF_BACKEND_SLEEP_WHEN_IDLE='yes'"):
        platform.HFBackendCpuPlatform().apply_server_args_defaults(ServerArgs(model_path="unused"))


def test_native_half_types_follow_the_cpu_flags():
    flags = set(open("/proc/cpuinfo").read().split())
    native = platform.native_half_dtypes()
    assert (torch.bfloat16 in native) == bool({"amx_tile", "avx512_bf16"} & flags)
    assert (torch.float16 in native) == ("amx_fp16" in flags)


@pytest.mark.parametrize(
    "requested, stored, native, served, says",
    [
        ("auto", torch.bfloat16, set(), "float32", "serving in float32, not bfloat16"),
        ("auto", torch.bfloat16, {torch.bfloat16}, "auto", ""),
        ("auto", torch.float32, set(), "float32", "not float16 (what SGLang picks for this float32"),
        ("auto", torch.float32, {torch.bfloat16}, "bfloat16", "no native float16 matmul"),
        ("auto", torch.float16, {torch.bfloat16, torch.float16}, "auto", ""),
        ("auto", None, set(), "auto", ""),
        ("bfloat16", torch.bfloat16, set(), "bfloat16", "expect it several times slower than float32"),
        ("float16", torch.bfloat16, {torch.bfloat16}, "float16", "without native float16 matmul"),
        ("float32", torch.bfloat16, set(), "float32", ""),
    ],
)
def test_dtype_by_cpu(requested, stored, native, served, says):
    dtype, why = platform.cpu_dtype_choice(requested, stored, native)
    assert dtype == served and (says in why if says else why == "")


def test_auto_dtype_on_this_cpu(tmp_path, monkeypatch):
    from sglang.srt.server_args import ServerArgs

    monkeypatch.delenv(platform.FP32_FOR_SPEED_ENV, raising=False)
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    assert platform.checkpoint_dtype(str(tmp_path)) == torch.bfloat16
    args = ServerArgs(model_path=str(tmp_path))
    platform.HFBackendCpuPlatform.choose_dtype(args)
    bf16_native = torch.bfloat16 in platform.native_half_dtypes()
    assert args.dtype == ("auto" if bf16_native else "float32")
    assert platform.served_dtype("auto", str(tmp_path)) == ("bfloat16" if bf16_native else "float32")
    # the workers hear whether fp32 was auto's choice (for speed) or asked for (for exactness)
    assert platform.fp32_served_for_speed() == (not bf16_native)
    platform.HFBackendCpuPlatform.choose_dtype(ServerArgs(model_path=str(tmp_path), dtype="float32"))
    assert not platform.fp32_served_for_speed()


MALLOC_PROBE = """
import ctypes, json, sys
import sglang.srt.platforms  # noqa: F401  (resolves the platform plugins before ours is imported)
import torch
from sglang_hf_backend import platform

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "keep":
    platform.keep_freed_memory_for_reuse()
block = torch.empty(64 << 20, dtype=torch.uint8)
held = libc.mallinfo2()
del block
freed = libc.mallinfo2()
print(json.dumps({"mapped_held": held.hblkhd, "heap_held": held.arena, "heap_after_free": freed.arena}))
"""


@pytest.fixture(scope="module")
def malloc_probes() -> dict[str, dict]:
    """The probe with and without our setting, in two processes run side by side."""
    runs = run_side_by_side({mode: ["-c", MALLOC_PROBE, mode] for mode in ("keep", "default")})
    sizes = {}
    for mode, run in runs.items():
        assert run.returncode == 0, run.stderr[-2000:]
        sizes[mode] = json.loads(run.stdout.strip().splitlines()[-1])
    return sizes


@pytest.mark.parametrize("mode", ["keep", "default"])
def test_large_blocks_stay_in_the_heap_for_reuse(malloc_probes, mode):
    """A 64 MiB temporary comes from the heap and stays there when freed (reused by the next
    prefill instead of faulted in again); glibc's default maps and unmaps it."""
    sizes = malloc_probes[mode]
    if mode == "keep":
        assert sizes["mapped_held"] < 64 << 20 <= sizes["heap_held"]
        assert sizes["heap_after_free"] >= 64 << 20  # not trimmed back to the OS
    else:
        assert sizes["mapped_held"] >= 64 << 20


def test_keeping_freed_memory_can_be_switched_off(monkeypatch, caplog):
    monkeypatch.setenv(platform.KEEP_FREED_MEMORY_ENV, "0")
    with caplog.at_level("INFO"):
        platform.keep_freed_memory_for_reuse()
    assert "malloc" not in caplog.text
    monkeypatch.setenv(platform.KEEP_FREED_MEMORY_ENV, "2")
    with pytest.raises(ValueError, match="SGLANG_HF_BACKEND_KEEP_FREED_MEMORY='2'"):
        platform.keep_freed_memory_for_reuse()
