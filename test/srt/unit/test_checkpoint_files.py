"""Broken checkpoints fail in the launching process, from the safetensors headers alone.

Each case breaks a copy of a tiny checkpoint the way downloads and conversions break, and
``sgl.Engine`` must raise, before any subprocess starts, an error that names the file and
the tensor; a model path that does not exist says so.
"""

from __future__ import annotations

import json
import shutil
import struct
import time

import pytest
import sglang as sgl
from safetensors.torch import load_file, save_file

from sglang_hf_backend.weights import CheckpointMismatchError


def broken(checkpoint, tmp_path, name: str):
    path = tmp_path / name
    shutil.copytree(checkpoint("llama"), path)
    return path, path / "model.safetensors"


def rewrite(file, change) -> None:
    tensors = load_file(str(file))
    change(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def truncate(file) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 1000])


def corrupt_header(file) -> None:
    data = bytearray(file.read_bytes())
    length = struct.unpack("<Q", data[:8])[0]
    data[8 : 8 + length] = b"{" * length  # not JSON any more
    file.write_bytes(bytes(data))


def drop(tensors) -> None:
    del tensors["model.layers.1.mlp.down_proj.weight"]


def add(tensors) -> None:
    tensors["model.layers.1.mlp.extra_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"].clone()


def reshape(tensors) -> None:
    tensors["model.layers.0.self_attn.q_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"][:32]


CASES = {
    "truncated file": (truncate, r"model.safetensors is truncated: \d+ bytes, but its header describes \d+"),
    "corrupt header": (corrupt_header, r"model.safetensors is not a readable safetensors file"),
    "missing tensor": (
        lambda f: rewrite(f, drop),
        r"are in none of \['model.safetensors'\].*layers.1.mlp.down_proj.weight",
    ),
    "extra tensor": (
        lambda f: rewrite(f, add),
        r"model.safetensors: tensor 'model.layers.1.mlp.extra_proj.weight' matches no parameter",
    ),
    "wrong shape": (
        lambda f: rewrite(f, reshape),
        r"model.safetensors: tensor 'model.layers.0.self_attn.q_proj.weight' has shape \(32, 64\), but .* \(64, 64\)",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_broken_checkpoint_fails_before_start_naming_file_and_tensor(checkpoint, tmp_path, case):
    damage, message = CASES[case]
    path, file = broken(checkpoint, tmp_path, case.replace(" ", "-"))
    damage(file)
    started = time.monotonic()
    with pytest.raises(CheckpointMismatchError, match=message):
        sgl.Engine(model_path=str(path), impl="transformers")
    elapsed = time.monotonic() - started
    print(f"{case}: refused after {elapsed:.1f} s")
    assert elapsed < 10  # before any scheduler loads weights (about 30 s in)


def test_a_missing_local_path_says_so(tmp_path):
    missing = tmp_path / "no" / "such" / "checkpoint"
    with pytest.raises(FileNotFoundError, match=f"model path '{missing}' does not exist"):
        sgl.Engine(model_path=str(missing), impl="transformers")


def test_sharded_checkpoint_index_is_not_mistaken_for_tensors(checkpoint, tmp_path):
    """A healthy sharded checkpoint (two files and an index) passes the header check and starts."""
    path, file = broken(checkpoint, tmp_path, "sharded")
    tensors = load_file(str(file))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    file.unlink()
    for shard, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(path / shard), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: shard for shard, keys in halves.items() for k in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    from sglang_hf_backend.models.analysis import preflight

    preflight(str(path), False)
