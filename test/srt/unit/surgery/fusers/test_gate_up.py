"""Two projections combined as act(a) * b -> one merged GEMM plus SGLang's act-and-mul."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang_hf_backend.surgery.fusers.gate_up import identify_activation
from sglang_hf_backend.testing.analysis import matches


def test_silu_mlp(analysis):
    match = matches(analysis("llama"), "mlp")["LlamaMLP"]
    assert (match.gate, match.up, match.activation) == ("gate_proj", "up_proj", "silu")
    assert (
        match.description == "gate_proj + up_proj -> gate_up_proj (MergedColumnParallelLinear) + SiluAndMul"
    )


def test_activation_found_by_behaviour_not_name(analysis):
    assert matches(analysis("gemma2"), "mlp")["Gemma2MLP"].activation == "gelu_tanh"
    remote = matches(analysis("remote"), "mlp")["TinyLMMLP"]  # nn.functional.silu(self.w1(x)) * self.w3(x)
    assert (remote.gate, remote.up, remote.activation) == ("w1", "w3", "silu")


def test_identify_activation():
    assert identify_activation(F.silu) == "silu"
    assert identify_activation(torch.nn.GELU()) == "gelu"
    assert identify_activation(torch.tanh) is None


def test_single_up_projection_is_no_pattern(analysis):
    assert matches(analysis("gpt2"), "mlp") == {}
