"""SGLang parallel linears that HF modules can call like ``nn.Linear``.

SGLang's linears return ``(output, bias)`` and shard by tensor-parallel rank inside
the layer; HF modules call ``self.q_proj(x)`` and expect a tensor. The classes here
bridge the two. ``Placement`` says how one HF linear is laid out across ranks;
``build_linear`` turns an HF ``nn.Linear`` or GPT-2 ``Conv1D`` into the SGLang layer,
whose parameters' weight loaders first reshape checkpoint tensors the way this layout
needs (a transposed ``Conv1D`` weight, packed sections reordered per rank) and then
narrow them to this rank as SGLang's loaders do.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from sglang.srt.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from torch import nn
from transformers.pytorch_utils import Conv1D


class TensorOutputLinear:
    """Return the output tensor alone, the way ``nn.Linear`` does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[0]


class HFReplicatedLinear(TensorOutputLinear, ReplicatedLinear):
    pass


class HFColumnParallelLinear(TensorOutputLinear, ColumnParallelLinear):
    pass


class HFRowParallelLinear(TensorOutputLinear, RowParallelLinear):
    pass


class HFQKVParallelLinear(TensorOutputLinear, QKVParallelLinear):
    @property
    def split_sizes(self) -> list[int]:
        """This rank's q, k and v widths in the fused output."""
        return [self.q_proj_shard_size, self.kv_proj_shard_size, self.v_proj_shard_size]


class HFMergedColumnParallelLinear(TensorOutputLinear, MergedColumnParallelLinear):
    @property
    def split_sizes(self) -> list[int]:
        """This rank's width of each merged projection."""
        return list(self.output_partition_sizes)


@dataclasses.dataclass(frozen=True)
class Placement:
    """How one linear is split across tensor-parallel ranks.

    kind: "replicate", "column" (output features split) or "row" (input features split).
    gather_output: column only, all-gather the output so every rank sees all features.
    input_is_parallel: row only, the input arrives already split (else the layer splits it).
    packed: the weight stacks this many equal parts along the split dimension (e.g. a
        packed gate/up projection); each rank takes its share of every part.
    """

    kind: str
    gather_output: bool = False
    input_is_parallel: bool = True
    packed: int = 1

    def describe(self) -> str:
        extras = []
        if self.gather_output:
            extras.append("gather output")
        if self.kind == "row" and not self.input_is_parallel:
            extras.append("split input")
        if self.packed > 1:
            extras.append(f"packed x{self.packed}")
        return self.kind + (f" ({', '.join(extras)})" if extras else "")


REPLICATE = Placement("replicate")
COLUMN = Placement("column")
ROW = Placement("row")


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, Conv1D))


def linear_dims(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features); GPT-2's Conv1D stores its weight as [in, out]."""
    if isinstance(module, Conv1D):
        return module.weight.shape[0], module.weight.shape[1]
    return module.in_features, module.out_features


def build_linear(
    module: nn.Module, placement: Placement, tp_size: int, quant_config, prefix: str
) -> nn.Module:
    """The SGLang layer that replaces ``module`` under ``placement``."""
    in_features, out_features = linear_dims(module)
    common = dict(
        bias=module.bias is not None,
        params_dtype=module.weight.dtype,
        quant_config=quant_config,
        prefix=prefix,
    )
    if placement.kind == "column":
        layer = HFColumnParallelLinear(
            in_features, out_features, gather_output=placement.gather_output, **common
        )
    elif placement.kind == "row":
        layer = HFRowParallelLinear(
            in_features, out_features, input_is_parallel=placement.input_is_parallel, **common
        )
    else:
        layer = HFReplicatedLinear(in_features, out_features, **common)
    for param_name, transform in _load_transforms(module, placement, tp_size).items():
        transform_before_loading(getattr(layer, param_name), transform)
    return layer


def transform_before_loading(param: nn.Parameter, transform: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Make ``param``'s weight loader see ``transform(tensor)`` instead of the checkpoint tensor."""
    loader = param.weight_loader

    def load(target: nn.Parameter, tensor: torch.Tensor, *args, **kwargs):
        return loader(target, transform(tensor), *args, **kwargs)

    param.weight_loader = load


def _load_transforms(
    module: nn.Module, placement: Placement, tp_size: int
) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    transpose = isinstance(module, Conv1D)
    interleave = placement.packed > 1 and tp_size > 1 and placement.kind != "replicate"
    if not (transpose or interleave):
        return {}
    split_dim = 0 if placement.kind == "column" else 1

    def weight(tensor: torch.Tensor) -> torch.Tensor:
        if transpose:
            tensor = tensor.t()
        if interleave:
            tensor = rank_major(tensor, split_dim, placement.packed, tp_size)
        return tensor

    transforms = {"weight": weight}
    if interleave and placement.kind == "column" and module.bias is not None:
        transforms["bias"] = lambda t: rank_major(t, 0, placement.packed, tp_size)
    return transforms


def rank_major(tensor: torch.Tensor, dim: int, parts: int, tp_size: int) -> torch.Tensor:
    """Reorder ``parts`` stacked sections so each rank's slices become contiguous.

    [p0 | p1] with p_i = [r0, r1] becomes [p0r0 p1r0 | p0r1 p1r1]; SGLang's loader then
    narrows rank r's contiguous block and gets its share of every part, in order.
    """
    size = tensor.shape[dim]
    if size % (parts * tp_size):
        raise ValueError(f"cannot split a packed dimension of {size} into {parts} parts x {tp_size} ranks")
    shape = tensor.shape[:dim] + (parts, tp_size, size // (parts * tp_size)) + tensor.shape[dim + 1 :]
    return tensor.reshape(shape).transpose(dim, dim + 1).reshape(tensor.shape)
