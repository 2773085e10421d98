"""``impl`` is an alias of ``model_impl`` for sgl.Engine and launch_server; conflicts are errors."""

from __future__ import annotations

import pytest
import sglang as sgl

from sglang_hf_backend.args import ArgumentConflictError, resolve_model_impl
from sglang_hf_backend.testing.processes import run_side_by_side


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


@pytest.fixture(scope="module")
def launch_server_runs(checkpoint) -> dict:
    """``launch_server`` with both spellings disagreeing, and with ``--help``: two fresh
    processes (each imports SGLang for ~10 s), run side by side."""
    commands = {
        "conflict": [
            "--model-path",
            str(checkpoint("llama")),
            "--impl",
            "transformers",
            "--model-impl",
            "sglang",
        ],
        "help": ["--help"],
    }
    return run_side_by_side({name: ["-m", "sglang.launch_server", *args] for name, args in commands.items()})


def test_launch_server_rejects_conflicting_spellings(launch_server_runs):
    result = launch_server_runs["conflict"]
    assert result.returncode != 0
    assert "impl='transformers' and model_impl='sglang' disagree" in result.stderr


def test_launch_server_help_lists_impl(launch_server_runs):
    result = launch_server_runs["help"]
    assert "--impl {auto,sglang,transformers,mindspore}" in result.stdout
    assert "Alias of --model-impl" in result.stdout
