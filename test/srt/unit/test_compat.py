"""The compatibility gate: clear errors, in the launching process, before any weight is read."""

from __future__ import annotations

import json
import shutil

import pytest
import sglang as sgl

from sglang_hf_backend import compat
from sglang_hf_backend.compat import IncompatibleModelError


@pytest.mark.parametrize("spelling", ["impl", "model_impl"])
def test_builtin_model_without_attention_interface_is_refused(checkpoint, spelling):
    with pytest.raises(IncompatibleModelError) as error:
        sgl.Engine(model_path=str(checkpoint("gptj")), **{spelling: "transformers"})
    message = str(error.value)
    assert "GPTJForCausalLM cannot be served by sglang_hf_backend" in message
    assert "_supports_attention_backend is False" in message
    assert "model_impl='sglang'" in message  # what would make it work


def test_remote_code_with_eager_attention_is_refused(checkpoint):
    with pytest.raises(IncompatibleModelError, match="TinyLMEagerForCausalLM cannot be served"):
        sgl.Engine(model_path=str(checkpoint("remote-eager")), impl="transformers", trust_remote_code=True)


def test_remote_code_needs_trust(checkpoint):
    # transformers refuses the checkpoint's own config class first, with the same advice
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        sgl.Engine(model_path=str(checkpoint("remote")), impl="transformers")


def test_unknown_architecture_is_named(checkpoint, tmp_path):
    path = tmp_path / "mystery"
    shutil.copytree(checkpoint("llama"), path)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="vit", architectures=["MysteryForCausalLM"])
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(IncompatibleModelError, match="Unknown architecture 'MysteryForCausalLM'"):
        sgl.Engine(model_path=str(path), impl="transformers")


def test_moe_router_sglang_cannot_reproduce_is_refused_before_start(checkpoint):
    with pytest.raises(IncompatibleModelError, match="TinyLMSparseBlock is a mixture-of-experts block"):
        sgl.Engine(model_path=str(checkpoint("remote-moe")), impl="transformers", trust_remote_code=True)


@pytest.mark.parametrize(
    ("name", "task"),
    [
        ("TransformersMoEForCausalLM", "causal"),
        ("TransformersEmbeddingModel", "embedding"),
        ("TransformersMultiModalForSequenceClassification", "classification"),
    ],
)
def test_backend_class_names_say_the_task(name, task):
    assert compat.backend_task(name) == task


def test_each_task_gets_its_hf_class(checkpoint):
    from transformers import AutoConfig

    classifier = AutoConfig.from_pretrained(checkpoint("qwen3-classifier"))
    assert (
        compat.resolve_hf_class(classifier, False, "classification").__name__
        == "Qwen3ForSequenceClassification"
    )
    embedder = AutoConfig.from_pretrained(checkpoint("qwen3-embedding"))
    assert compat.resolve_hf_class(embedder, False, "embedding").__name__ == "Qwen3Model"
