"""How embeddings pool: the checkpoint's sentence-transformers files, else SGLang's default."""

from __future__ import annotations

import json

import pytest
from sglang.srt.layers.pooler import PoolingType

from sglang_hf_backend.compat import IncompatibleModelError
from sglang_hf_backend.models.pooling import PoolingSpec, pooling_spec


def write_modules(path, kinds, pooling=None):
    modules = [
        {"idx": i, "name": str(i), "path": f"{i}_{kind}", "type": f"sentence_transformers.models.{kind}"}
        for i, kind in enumerate(kinds)
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    for i, kind in enumerate(kinds):
        (path / f"{i}_{kind}").mkdir()
        if kind == "Pooling":
            (path / f"{i}_{kind}" / "config.json").write_text(json.dumps(pooling))


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("pooling_mode_cls_token", PoolingType.CLS),
        ("pooling_mode_mean_tokens", PoolingType.MEAN),
        ("pooling_mode_lasttoken", PoolingType.LAST),
    ],
)
def test_sentence_transformers_pooling(tmp_path, mode, expected):
    write_modules(tmp_path, ["Transformer", "Pooling", "Normalize"], {mode: True})
    assert pooling_spec(str(tmp_path), causal=True) == PoolingSpec(
        expected, True, "sentence-transformers modules.json"
    )


def test_no_normalize_module_means_raw_vectors(tmp_path):
    write_modules(tmp_path, ["Transformer", "Pooling"], {"pooling_mode_mean_tokens": True})
    assert not pooling_spec(str(tmp_path), causal=False).normalize


def test_defaults_without_sentence_transformers_files(tmp_path):
    assert pooling_spec(str(tmp_path), causal=True).pooling == PoolingType.LAST
    assert pooling_spec(str(tmp_path), causal=False).pooling == PoolingType.CLS


def test_layers_after_pooling_are_refused(tmp_path):
    write_modules(tmp_path, ["Transformer", "Pooling", "Dense"], {"pooling_mode_mean_tokens": True})
    with pytest.raises(IncompatibleModelError, match="no Dense or other layers after pooling"):
        pooling_spec(str(tmp_path), causal=False)


def test_pooling_modes_sglang_cannot_do_are_refused(tmp_path):
    write_modules(tmp_path, ["Transformer", "Pooling"], {"pooling_mode_max_tokens": True})
    with pytest.raises(IncompatibleModelError, match=r"asks for pooling \['pooling_mode_max_tokens'\]"):
        pooling_spec(str(tmp_path), causal=False)
