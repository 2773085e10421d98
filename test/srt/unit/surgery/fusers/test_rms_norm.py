"""RMS norms recognised by behaving bit-identically to one of SGLang's variants."""

from __future__ import annotations

from sglang_hf_backend.testing.analysis import matches


def test_variants(analysis):
    assert matches(analysis("llama"), "norm")["LlamaRMSNorm"].variant.label == "RMSNorm"
    assert matches(analysis("olmo2"), "norm")["Olmo2RMSNorm"].variant.label == "RMSNorm (cast after weight)"
    assert matches(analysis("gemma2"), "norm")["Gemma2RMSNorm"].variant.label == "GemmaRMSNorm"


def test_layer_norm_is_not_an_rms_norm(analysis):
    assert matches(analysis("gpt_neox"), "norm") == {}
