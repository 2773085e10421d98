"""Arguments we add to SGLang: ``impl`` (an alias of ``model_impl``) and ``torchao_config``.

``sgl.Engine(impl="transformers")`` and ``launch_server --impl transformers`` are the
spellings the transformers-backend pull requests used; SGLang itself calls the field
``model_impl``. Both work; giving both with different values is an error.
``torchao_config`` / ``--torchao-config`` (see ``quantization.py``) is validated here and
handed to the scheduler processes. When the arguments ask for the transformers
implementation, the model is checked here, in the launching process, before any
subprocess starts (``models.analysis.preflight``).
"""

from __future__ import annotations

import argparse
import functools
import os
from typing import Any

MODEL_IMPLS = ("auto", "sglang", "transformers", "mindspore")


class ArgumentConflictError(ValueError):
    """Two spellings of one setting were given with different values."""


def switched_on(env: str, what_1_does: str) -> bool:
    """An environment switch of ours: 1 (the default) or 0; any other value is refused."""
    setting = os.environ.get(env, "1")
    if setting not in ("0", "1"):
        raise ValueError(f"{env}={setting!r}: use 1 ({what_1_does}, the default) or 0")
    return setting == "1"


def resolve_model_impl(impl: str | None, model_impl: str | None) -> str:
    """The implementation asked for by either spelling (``auto`` when neither is given)."""
    for name, value in (("impl", impl), ("model_impl", model_impl)):
        if value is not None and value not in MODEL_IMPLS:
            raise ValueError(f"{name}={value!r} is not one of {MODEL_IMPLS}.")
    if impl is not None and model_impl is not None and impl != model_impl:
        raise ArgumentConflictError(
            f"impl={impl!r} and model_impl={model_impl!r} disagree. impl is an alias of "
            "model_impl (--impl / --model-impl); give one of them, or the same value to both."
        )
    return impl or model_impl or "auto"


def resolve_torchao(name: str | None, model_impl: str):
    """The validated torchao setting (or None), published to the scheduler processes."""
    from sglang_hf_backend.quantization import TorchaoConfigError, TorchaoSpec, publish

    spec = TorchaoSpec.parse(name) if name else None
    if spec is not None:
        if model_impl != "transformers":
            raise TorchaoConfigError(
                f"torchao_config={name!r} is applied by sglang_hf_backend's transformers implementation; "
                f"pass impl='transformers' (got model_impl={model_impl!r})."
            )
        import torch

        spec.check_device("cuda" if torch.cuda.is_available() else "cpu", torch.bfloat16)
    publish(spec)
    return spec


def preflight_if_transformers(model_impl: str, options: dict, torchao=None) -> None:
    """Check the model in this process when the transformers implementation is explicit."""
    if model_impl == "transformers" and options.get("model_path"):
        from sglang_hf_backend.models.analysis import preflight
        from sglang_hf_backend.models.multimodal import chosen_prefill_backend

        preflight(
            options["model_path"],
            bool(options.get("trust_remote_code")),
            options.get("revision"),
            int(options.get("tp_size") or 1),
            torchao,
            bool(options.get("is_embedding")),
            options.get("lora_paths"),
            options.get("max_lora_rank"),
            int(options.get("pp_size") or 1),
            chosen_prefill_backend(options),
        )


def build_engine_server_args(server_args_class, **kwargs: Any):
    """What ``sgl.Engine`` uses to build its ServerArgs: our keywords translated first."""
    model_impl = resolve_model_impl(kwargs.pop("impl", None), kwargs.pop("model_impl", None))
    torchao = resolve_torchao(kwargs.pop("torchao_config", None), model_impl)
    preflight_if_transformers(model_impl, kwargs, torchao)
    return server_args_class(model_impl=model_impl, **kwargs)


def add_cli_args(_result, parser: argparse.ArgumentParser) -> None:
    """AFTER-hook of ``ServerArgs.add_cli_args``."""
    parser.add_argument(
        "--impl",
        choices=MODEL_IMPLS,
        default=None,
        help="Alias of --model-impl (e.g. --impl transformers).",
    )
    parser.add_argument(
        "--torchao-config",
        default=None,
        help="Quantize each rank's linear weights with torchao as they load: int8wo, int8dq, "
        "int4wo-<group_size>, fp8wo, fp8dq-per_row, fp8dq-per_tensor (needs --impl transformers).",
    )
    # None marks "not given", so an explicit --model-impl can be told from the default.
    parser.set_defaults(model_impl=None)


def from_cli_args(cls, args: argparse.Namespace) -> None:
    """BEFORE-hook of ``ServerArgs.from_cli_args``: fold --impl into --model-impl."""
    args.model_impl = resolve_model_impl(getattr(args, "impl", None), getattr(args, "model_impl", None))
    torchao = resolve_torchao(getattr(args, "torchao_config", None), args.model_impl)
    for ours in ("impl", "torchao_config"):
        if hasattr(args, ours):
            delattr(args, ours)
    preflight_if_transformers(args.model_impl, vars(args), torchao)


def install() -> None:
    """Hook the two ways SGLang builds ServerArgs: Engine keywords and the CLI parser."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_hf_backend.imports import when_imported

    HookRegistry.register("sglang.srt.server_args.ServerArgs.add_cli_args", add_cli_args, HookType.AFTER)
    HookRegistry.register("sglang.srt.server_args.ServerArgs.from_cli_args", from_cli_args, HookType.BEFORE)
    when_imported("sglang.srt.entrypoints.engine", _patch_engine)


def _patch_engine(engine_module) -> None:
    engine_cls = engine_module.Engine
    if getattr(engine_cls.server_args_class, "func", None) is build_engine_server_args:
        return
    engine_cls.server_args_class = staticmethod(
        functools.partial(build_engine_server_args, engine_cls.server_args_class)
    )
