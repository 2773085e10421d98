"""Pipeline parallelism: each stage builds, loads and runs only its share of the decoder stack.

The decoder stack is the module list the model's ``base_model_pp_plan`` names, or else the one
whose entries hold the attention layers. The backbone's trace must show the stack called as a
chain: each layer's first input is the previous layer's only output, and nothing else reads
what a layer returns. That is what makes a cut between two layers exact; a model whose layers
reach across the stack is refused before any weight is read.

A stage keeps the HF forward as it is. Layers of other stages become ``SkippedLayer`` stand-ins
that pass hidden states through; the one just before the stage's first layer hands in the
hidden states received from the previous stage (whatever the embedding code computed is
dropped, so scaled or position-summed embeddings stay exact), and the one just after its last
layer keeps them to send on. Embeddings live on the first stage only (elsewhere a zero stand-in
without weights), the final norm and the LM head on the last; KV-cache slots cover the local layers
(``start_layer``/``end_layer``). Layers are split as SGLang splits its native models
(``get_pp_indices``, which honours ``SGLANG_PP_LAYER_PARTITION``).
"""

from __future__ import annotations

import dataclasses

import torch
from sglang.srt.layers.utils import PPMissingLayer
from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
from torch import nn
from torch.utils._pytree import tree_flatten

from sglang_hf_backend.compat import IncompatibleModelError
from sglang_hf_backend.surgery.trace import ModelTrace

HIDDEN_STATES = "hidden_states"  # the one tensor stages pass on


@dataclasses.dataclass(frozen=True)
class DecoderStack:
    """The module list a pipeline cuts, as found in the backbone."""

    path: str  # in the backbone: "layers", "h", "decoder.layers"
    num_layers: int
    source: str  # "the model's pp plan" | "inferred from the trace"
    returns_tensor: bool  # a layer returns its hidden states bare, not in a tuple
    after: tuple[str, ...]  # backbone children with weights run after the stack (the final norm)


def decoder_stack(backbone: nn.Module, trace: ModelTrace) -> DecoderStack:
    """The decoder stack of ``backbone`` and how its layers return, or why it cannot be cut."""
    name = type(backbone).__name__
    path, source = _planned_stack(backbone), "the model's pp plan"
    if path is None:
        path, source = _attention_stack(backbone, trace, name), "inferred from the trace"
    layers = backbone.get_submodule(path)
    layer_trace = trace.classes.get(type(layers[0]))
    backbone_trace = trace.classes[type(backbone)]
    _check_chain(backbone_trace, len(layers), name)
    returns_tensor = layer_trace is None or layer_trace.returns_tensor
    return DecoderStack(path, len(layers), source, returns_tensor, _run_after_stack(backbone, backbone_trace))


def _run_after_stack(backbone: nn.Module, backbone_trace) -> tuple[str, ...]:
    """Direct children with weights the backbone calls after its last decoder layer."""
    calls = [node.target for node in backbone_trace.nodes if node.kind == "module"]
    last_layer = max(i for i, target in enumerate(calls) if target.isdigit())
    children = dict(backbone.named_children())
    return tuple(
        target
        for target in calls[last_layer + 1 :]
        if target in children and next(children[target].parameters(), None) is not None
    )


def _planned_stack(backbone: nn.Module) -> str | None:
    plan = getattr(backbone, "_pp_plan", None) or getattr(backbone.config, "base_model_pp_plan", None) or {}
    lists = [path for path in plan if isinstance(_submodule(backbone, path), nn.ModuleList)]
    return lists[0] if len(lists) == 1 else None


def _attention_stack(backbone: nn.Module, trace: ModelTrace, name: str) -> str:
    names = {module: path for path, module in backbone.named_modules()}
    stacks = {_list_of(names[call.module]) for call in trace.attention_calls}
    if len(stacks) != 1 or None in stacks:
        raise IncompatibleModelError(
            f"{name} has no single module list holding its attention layers (found {sorted(map(str, stacks))}) "
            "and no base_model_pp_plan; pipeline parallelism cannot tell where to cut. Serve it with pp_size=1."
        )
    return stacks.pop()


def _list_of(path: str) -> str | None:
    parts = path.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return None if index is None else ".".join(parts[:index])


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _check_chain(backbone_trace, num_layers: int, name: str) -> None:
    """Layer i+1's first input is layer i's only output, which nothing else reads."""
    calls = [node for node in backbone_trace.nodes if node.kind == "module" and node.target.isdigit()]
    why = None
    if [int(node.target) for node in calls] != list(range(num_layers)):
        why = "the backbone does not call each decoder layer once, in order"
    else:
        for before, after in zip(calls, calls[1:]):
            readers = [node for node in backbone_trace.consumers(before.outputs[0]) if node is not after]
            if len(before.outputs) != 1 or after.inputs[:1] != before.outputs:
                why = f"layer {after.target} does not take layer {before.target}'s hidden states as its first input"
            elif readers:
                why = f"layer {before.target}'s output is also read by {readers[0].target}"
            if why:
                break
    if why:
        raise IncompatibleModelError(
            f"{name} cannot be split into pipeline stages exactly: {why}. Serve it with pp_size=1."
        )


class SkippedLayer(nn.Module):
    """A layer another stage runs: passes hidden states through, hands in the received ones
    (stage entry) or keeps them to send on (stage exit)."""

    def __init__(self, index: int, returns_tensor: bool):
        super().__init__()
        self.index = index
        self.returns_tensor = returns_tensor
        self.received: torch.Tensor | None = None  # set per step on a stage's entry
        self.keeps = False  # a stage's exit keeps what passes for the next stage
        self.kept: torch.Tensor | None = None

    def forward(self, *args, **kwargs):
        hidden = next(x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor))
        if self.received is not None:
            hidden, self.received = self.received, None
        if self.keeps:
            self.kept = hidden
        return hidden if self.returns_tensor else (hidden,)


class ZeroEmbedding(nn.Module):
    """An embedding held by the first stage: zeros, which the stage entry replaces anyway."""

    def __init__(self, embedding_dim: int):
        super().__init__()
        self.embedding_dim = embedding_dim
        self.dtype = torch.get_default_dtype()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.embedding_dim, dtype=self.dtype, device=ids.device)


@dataclasses.dataclass
class PipelineStage:
    """This rank's share of the decoder stack, and the stand-ins at its two ends."""

    rank: int
    size: int
    start: int
    end: int
    held_elsewhere: list[str]  # module paths (in the wrapper) that other stages hold
    entry: SkippedLayer | None = None
    exit: SkippedLayer | None = None

    @classmethod
    def whole(cls, num_layers: int) -> PipelineStage:
        return cls(0, 1, 0, num_layers, [])

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def holds_elsewhere(self, name: str) -> bool:
        """A parameter or checkpoint tensor name under a module another stage holds."""
        return any(name == path or name.startswith(path + ".") for path in self.held_elsewhere)

    def hand_in(self, proxy) -> None:
        if self.entry is not None:
            self.entry.received = proxy[HIDDEN_STATES][None]

    def hand_on(self) -> dict[str, torch.Tensor]:
        kept, self.exit.kept = self.exit.kept, None
        return {HIDDEN_STATES: kept[0]}


def split_backbone(
    backbone: nn.Module, prefix: str, stack: DecoderStack, rank: int, size: int
) -> PipelineStage:
    """Replace what other stages hold in ``backbone`` (still on meta) with stand-ins."""
    from sglang.srt.distributed.utils import get_pp_indices

    start, end = get_pp_indices(stack.num_layers, rank, size)
    if start == end:
        raise IncompatibleModelError(
            f"pipeline stage {rank} of {size} gets no decoder layer ({stack.num_layers} layers); use a smaller pp_size."
        )
    stage = PipelineStage(rank, size, start, end, [])
    layers = backbone.get_submodule(stack.path)
    for index in [*range(start), *range(end, stack.num_layers)]:
        layers[index] = SkippedLayer(index, stack.returns_tensor)
        stage.held_elsewhere.append(f"{prefix}.{stack.path}.{index}")
    stage.entry = layers[start - 1] if start > 0 else None
    if end < stack.num_layers:
        stage.exit = layers[end]
        stage.exit.keeps = True
    if not stage.is_last:
        for path in stack.after:  # what they compute there is not sent on
            backbone.set_submodule(path, PPMissingLayer())
            stage.held_elsewhere.append(f"{prefix}.{path}")
    if not stage.is_first:
        for path, module in list(backbone.named_modules()):
            if isinstance(module, (nn.Embedding, VocabParallelEmbedding)) and not path.startswith(
                stack.path + "."
            ):
                backbone.set_submodule(path, ZeroEmbedding(module.embedding_dim))
                stage.held_elsewhere.append(f"{prefix}.{path}")
    return stage
