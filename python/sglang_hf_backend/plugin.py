"""Plugin wiring: what runs in every SGLang process through ``sglang.srt.plugins``.

SGLang calls ``register()`` once per process (launcher, schedulers, detokenizer).
It must stay cheap: SGLang's model registry imports every model module (seconds), so
our classes are put into it only when some process imports the registry anyway.
"""

from __future__ import annotations

import multiprocessing


def register() -> None:
    """Entry point of ``sglang.srt.plugins``."""
    from sglang_hf_backend import args, lora, platform, prefix_cache, validation
    from sglang_hf_backend.attention import register_attention_function
    from sglang_hf_backend.imports import when_imported

    register_attention_function()
    args.install()
    validation.install()
    lora.install()
    prefix_cache.install()
    if platform.serves_this_machine():
        platform.install_cpu_kernel_fallbacks()
        platform.install_pinning_fallback()
        # The CLI parser is built from the backend choices before SGLang resolves the
        # platform (which registers cpu_sdpa itself), so register it here as well.
        platform.register_cpu_attention_backend()
        if multiprocessing.parent_process() is None:  # the launcher, not a scheduler it spawned
            from sglang_hf_backend import cpu_kernels

            cpu_kernels.build_in_background()
    when_imported("sglang.srt.models.registry", _register_model_classes)


def _register_model_classes(registry_module) -> None:
    from sglang_hf_backend.models import ENTRY_CLASSES

    for cls in ENTRY_CLASSES:
        registry_module.ModelRegistry.models[cls.__name__] = cls
