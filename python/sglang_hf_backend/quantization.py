"""torchao quantization of each rank's own shard, applied as that shard loads.

``torchao_config="int8wo"`` (``--torchao-config``) names one of the configs SGLang used
to offer. It is checked when the arguments are read (unknown names, configs this device
cannot run, group sizes that do not divide a shard) and handed to every scheduler
process through ``SGLANG_HF_BACKEND_TORCHAO_CONFIG``. There, linears are created on the
meta device; each one gets memory when its first checkpoint tensor arrives and is
quantized as soon as its last one is loaded, so a rank never holds more than one
layer in full precision beyond its quantized weights. Embeddings and the LM head stay
unquantized.
"""

from __future__ import annotations

import dataclasses
import os
import re

import torch
from torch import nn

from sglang_hf_backend import diagnostics

TORCHAO_ENV = "SGLANG_HF_BACKEND_TORCHAO_CONFIG"
VALID_NAMES = ("int8wo", "int8dq", "int4wo-<group_size>", "fp8wo", "fp8dq-per_row", "fp8dq-per_tensor")


class TorchaoConfigError(ValueError):
    """The torchao setting cannot be used as given."""


@dataclasses.dataclass(frozen=True)
class TorchaoSpec:
    name: str
    group_size: int | None = None

    @classmethod
    def parse(cls, name: str) -> "TorchaoSpec":
        if name in ("int8wo", "int8dq", "fp8wo", "fp8dq-per_row", "fp8dq-per_tensor"):
            return cls(name)
        match = re.fullmatch(r"int4wo-(\d+)", name)
        if match and int(match.group(1)) > 0:
            return cls(name, int(match.group(1)))
        raise TorchaoConfigError(
            f"Unknown torchao config {name!r}; valid names: {', '.join(VALID_NAMES)} (e.g. int4wo-128)."
        )

    def config(self, device: str):
        """The torchao 0.18 config object for ``device``."""
        from torchao.quantization import (
            Float8DynamicActivationFloat8WeightConfig,
            Float8WeightOnlyConfig,
            Int4WeightOnlyConfig,
            Int8DynamicActivationInt8WeightConfig,
            Int8WeightOnlyConfig,
            IntxWeightOnlyConfig,
            PerRow,
            PerTensor,
        )
        from torchao.quantization.granularity import PerGroup

        if self.group_size is not None:
            if device == "cuda":
                return Int4WeightOnlyConfig(group_size=self.group_size)
            # torchao's packed int4 formats need GPU kernels; on CPU int4 values are stored
            # unpacked in int8 (IntxUnpackedToInt8Tensor)
            return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(self.group_size))
        return {
            "int8wo": lambda: Int8WeightOnlyConfig(),
            "int8dq": lambda: Int8DynamicActivationInt8WeightConfig(),
            "fp8wo": lambda: Float8WeightOnlyConfig(),
            "fp8dq-per_row": lambda: Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
            "fp8dq-per_tensor": lambda: Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor()),
        }[self.name]()

    def check_device(self, device: str, dtype: torch.dtype) -> None:
        """Quantize and run a tiny linear here; refuse the config if that fails."""
        from torchao.quantization import quantize_

        probe = nn.Linear(256, 256, device=device, dtype=dtype)
        try:
            quantize_(probe, self.config(device))
            probe(torch.randn(2, 256, device=device, dtype=dtype))
        except Exception as reason:
            raise TorchaoConfigError(
                f"torchao config {self.name!r} cannot run on this device ({device}, {dtype}): {reason}"
            ) from None

    def check_group_size(self, local_input_features: dict[str, int]) -> None:
        """Every linear's per-rank input must split into whole groups."""
        if self.group_size is None:
            return
        for name, features in local_input_features.items():
            if features % self.group_size:
                raise TorchaoConfigError(
                    f"{self.name}: group size {self.group_size} does not divide the {features} input "
                    f"features of {name} on each rank; pick a group size that divides {features}."
                )


def serving_device() -> str:
    """The device SGLang serves on in this process ("cpu", "cuda", ...)."""
    from sglang.srt.utils import get_device

    return str(get_device()).split(":")[0]


def spec_from_env() -> TorchaoSpec | None:
    name = os.environ.get(TORCHAO_ENV)
    return TorchaoSpec.parse(name) if name else None


def publish(spec: TorchaoSpec | None) -> None:
    """Hand the setting to the scheduler processes (spawned children inherit the environment)."""
    if spec is None:
        os.environ.pop(TORCHAO_ENV, None)
    else:
        os.environ[TORCHAO_ENV] = spec.name


class ShardQuantizer:
    """Quantizes each linear of a model as soon as all its checkpoint tensors are in."""

    def __init__(self, model: nn.Module, spec: TorchaoSpec, expected_keys: set[str]):
        from sglang.srt.layers.linear import LinearBase

        self.spec = spec
        self.config = spec.config(serving_device())
        self.modules = {name: m for name, m in model.named_modules() if isinstance(m, LinearBase)}
        self.pending: dict[str, set[str]] = {name: set() for name in self.modules}
        for key in expected_keys:
            owner = key.split(":")[0].rpartition(".")[0]
            if owner in self.pending:
                self.pending[owner].add(key)
        self.bytes_before = 0
        self.bytes_after = 0

    def loaded(self, key: str) -> None:
        owner = key.split(":")[0].rpartition(".")[0]
        waiting = self.pending.get(owner)
        if waiting is None or key not in waiting:
            return
        waiting.discard(key)
        if not waiting:
            self._quantize(self.modules[owner])

    def _quantize(self, module: nn.Module) -> None:
        from torchao.quantization import quantize_

        self.bytes_before += diagnostics.tensor_bytes(module.weight)
        quantize_(module, self.config, filter_fn=lambda m, _: m is module)
        self.bytes_after += diagnostics.tensor_bytes(module.weight)

    def summary(self) -> dict:
        types = sorted({type(m.weight).__name__ for m in self.modules.values()})
        return {
            "torchao": self.spec.name,
            "quantized_linears": len(self.modules),
            "quantized_weight_types": types,
            "quantized_bytes_before": self.bytes_before,
            "quantized_bytes_after": self.bytes_after,
        }
