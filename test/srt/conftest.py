"""Session fixtures: one locally trained tokenizer and tiny checkpoints built on demand.

Tests under ``engine/`` start real SGLang engines or servers (or build real assets) and
are marked ``engine``; ``unit/`` tests run on meta tensors and tiny CPU probes in
seconds: ``pytest -m "not engine"``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_hf_backend.testing.checkpoints import build_checkpoint
from sglang_hf_backend.testing.tokenizer import train_tokenizer

ENGINE_DIR = Path(__file__).parent / "engine"


def pytest_report_header() -> str:
    """Which kind of machine ran the tests (kernels and dtypes differ between them)."""
    from sglang_hf_backend.benchmark.report import machine

    return "machine: {cpu}, torch CPU capability {torch_cpu_capability}, {cores} cores".format(**machine())


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if ENGINE_DIR in Path(item.fspath).parents:
            item.add_marker(pytest.mark.engine)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory, tokenizer_dir):
    """``checkpoint(name)`` -> path of that tiny checkpoint, built once per session."""
    root = tmp_path_factory.mktemp("checkpoints")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_checkpoint(name, root / name, tokenizer_dir)
        return built[name]

    return get


@pytest.fixture(scope="session")
def adapters(checkpoint, tmp_path_factory):
    """``adapters(model)`` -> {"attention": path, "mlp": path}: PEFT adapters, built once per model."""
    from sglang_hf_backend.testing.lora import adapter_targets, build_adapter

    built: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in built:
            root = tmp_path_factory.mktemp(f"lora-{name}")
            built[name] = {
                kind: build_adapter(checkpoint(name), root / kind, targets, seed=i)
                for i, (kind, targets) in enumerate(adapter_targets(name).items())
            }
        return built[name]

    return get


@pytest.fixture(scope="session")
def test_images(tmp_path_factory) -> dict:
    """{"wide": path, "square": path}: the vision-language tests' PNGs."""
    from sglang_hf_backend.testing.vision_language import write_test_images

    return write_test_images(tmp_path_factory.mktemp("images"))
