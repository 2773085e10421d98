"""``impl`` is an alias of ``model_impl`` for sgl.Engine and launch_server; conflicts are errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import sglang as sgl

from sglang_hf_backend.args import ArgumentConflictError, resolve_model_impl


@pytest.mark.parametrize(
    ("impl", "model_impl", "expected"),
    [
        ("transformers", None, "transformers"),
        (None, "transformers", "transformers"),
        ("transformers", "transformers", "transformers"),
        (None, None, "auto"),
        ("sglang", None, "sglang"),
    ],
)
def test_either_spelling_selects_the_implementation(impl, model_impl, expected):
    assert resolve_model_impl(impl, model_impl) == expected


def test_unknown_implementation_is_named():
    with pytest.raises(ValueError, match="impl='tranformers' is not one of"):
        resolve_model_impl("tranformers", None)


def test_engine_rejects_conflicting_spellings_before_starting(checkpoint):
    with pytest.raises(ArgumentConflictError, match="impl='transformers' and model_impl='sglang' disagree"):
        sgl.Engine(model_path=str(checkpoint("llama")), impl="transformers", model_impl="sglang")


def test_launch_server_rejects_conflicting_spellings(checkpoint):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(checkpoint("llama")),
            "--impl",
            "transformers",
            "--model-impl",
            "sglang",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "impl='transformers' and model_impl='sglang' disagree" in result.stderr


def test_launch_server_help_lists_impl():
    result = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--help"], capture_output=True, text=True, timeout=120
    )
    assert "--impl {auto,sglang,transformers,mindspore}" in result.stdout
    assert "Alias of --model-impl" in result.stdout
