"""Decoder layers compiled once: one nested compile region per layer class, exact per layer.

A tiny HF Llama (no engine): its layers become one region, traced once and called for every
layer, with eager's hidden states. A layer whose code reads a different attribute (here its
attention scale) must not reuse another layer's code; torch guards that only when the region
is the forward of the layer's class, which is why layers are given a region subclass, and why
a forward a fuser bound to the instance moves into that class. Unmarking restores both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import torch
from torch._dynamo.testing import EagerAndRecordGraphs
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from sglang_hf_backend import compilation
from sglang_hf_backend.testing.tiny_backbones import eager, tiny_llama, token_inputs


def regions_of(backbone) -> compilation.LayerRegions:
    return compilation.LayerRegions(backbone, [layer.self_attn for layer in backbone.layers])


def compiled_once(backbone, inputs: dict) -> tuple[torch.Tensor, torch.fx.GraphModule]:
    """The backbone's hidden states through torch.compile, and the one graph it traced."""
    torch._dynamo.reset()
    recorder = EagerAndRecordGraphs()
    compiled = torch.compile(
        compilation.backbone_hidden_states, backend=recorder, dynamic=True, fullgraph=True
    )
    compilation.mark_token_dims(inputs)
    with compilation.constant_floats():
        out = compiled(backbone, **inputs)
    (graph,) = recorder.graphs
    return out, graph


def region_calls(graph: torch.fx.GraphModule) -> list[str]:
    """The subgraph each region call runs, in call order."""
    return [
        node.args[0].target
        for node in graph.graph.nodes
        if node.target is torch.ops.higher_order.invoke_subgraph
    ]


@torch.no_grad()
def test_layers_run_one_compiled_region():
    backbone = tiny_llama(layers=3)
    regions = regions_of(backbone)
    assert str(regions) == "LlamaDecoderLayer (x3)"
    regions.mark()
    inputs = token_inputs(5)
    out, graph = compiled_once(backbone, inputs)
    calls = region_calls(graph)
    assert len(calls) == 3 and len(set(calls)) == 1
    torch.testing.assert_close(out, eager(backbone, **inputs))


@torch.no_grad()
def test_a_layer_that_reads_other_values_gets_its_own_region():
    backbone = tiny_llama(layers=3)
    inputs = token_inputs(5)
    with_the_first_layers_scale = eager(backbone, **inputs)
    backbone.layers[1].self_attn.scaling = 0.5
    regions_of(backbone).mark()
    out, graph = compiled_once(backbone, inputs)
    calls = region_calls(graph)
    assert calls.count(calls[0]) == 2  # layers 0 and 2; layer 1 traced apart (torch may inline it)
    torch.testing.assert_close(out, eager(backbone, **inputs))
    assert not torch.allclose(out, with_the_first_layers_scale)


def scaled_forward(self, hidden_states, **kwargs):
    """A forward bound per instance, as fusers bind rewritten ones."""
    return LlamaDecoderLayer.forward(self, hidden_states * 2, **kwargs)


@torch.no_grad()
def test_a_forward_bound_to_the_instances_moves_into_the_region_class():
    backbone = tiny_llama(layers=2)
    for layer in backbone.layers:
        layer.forward = types.MethodType(scaled_forward, layer)
    inputs = token_inputs(4)
    expected = eager(backbone, **inputs)
    regions = regions_of(backbone)
    regions.mark()
    assert all(type(layer).__name__.startswith("LlamaDecoderLayer_") for layer in backbone.layers)
    assert all("forward" not in vars(layer) for layer in backbone.layers)
    out, graph = compiled_once(backbone, inputs)
    assert len(set(region_calls(graph))) == 1
    torch.testing.assert_close(out, expected)
    regions.unmark()
    assert all(type(layer) is LlamaDecoderLayer for layer in backbone.layers)
    torch.testing.assert_close(eager(backbone, **inputs), expected)


# Compiles `relu(x) * 2 + 1` with the inductor options given as JSON and prints whether it
# equals eager's (torch alone: importing SGLang would triple the test's time).
COMPILE_AND_COMPARE = """
import json, sys
import torch

def f(x):
    return torch.relu(x) * 2 + 1

x = torch.randn(37, 100)
compiled = torch.compile(f, dynamic=True, options=json.loads(sys.argv[1]))
print(torch.backends.cpu.get_cpu_capability(), torch.equal(compiled(x), f(x)))
"""


def test_inductors_cache_serves_each_vector_width_its_own_code(tmp_path, narrower_capability):
    """One inductor cache used under this CPU's capability, then a narrower one, then this one
    again (as by machines of both kinds sharing it): each gets code for its own vector width."""
    native = torch.backends.cpu.get_cpu_capability()
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    for capability in (native, narrower_capability, native):
        options = json.dumps(compilation.inductor_options(capability))
        run = subprocess.run(
            [sys.executable, "-c", COMPILE_AND_COMPARE, options],
            env={**env, "ATEN_CPU_CAPABILITY": capability.lower()},
            capture_output=True,
            text=True,
            check=True,
        )
        assert run.stdout.split() == [capability, "True"], run.stderr[-2000:]
