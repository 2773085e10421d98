"""Mixture-of-experts capability: what a model whose sparse blocks run on SGLang's FusedMoE adds.

The blocks themselves are found and fused by ``surgery/fusers/moe.py`` for any model
(SGLang's ``TransformersMoE...`` names only say that SGLang expects experts); this mixin
reports what each rank holds of the experts and says, once, that torchao leaves them
in full precision: SGLang's FusedMoE has no torchao path.
"""

from __future__ import annotations

from transformers import PreTrainedModel

from sglang_hf_backend import diagnostics


class MoEMixin:
    def add_capabilities(self, hf_model: PreTrainedModel) -> None:
        super().add_capabilities(hf_model)
        self.moe_layers = diagnostics.moe_layers(self)
        if self.torchao is not None and self.moe_layers:
            diagnostics.decision(
                "torchao %s: the experts of %d MoE layers stay in full precision "
                "(SGLang's FusedMoE has no torchao path); dense linears are quantized",
                self.torchao.name,
                len(self.moe_layers),
            )

    def load_report_details(self) -> dict:
        details = super().load_report_details()
        details["moe_layers"] = len(self.moe_layers)
        details["expert_weight_bytes"] = sum(diagnostics.weight_bytes(layer) for layer in self.moe_layers)
        return details
