"""sglang-hf-backend: serve any attention-interface Hugging Face model through SGLang.

Installed next to SGLang, the plugin (``plugin.register``) replaces SGLang's built-in
transformers backend with ``models.TransformersForCausalLM``, adds the ``impl`` argument,
and, on machines without an accelerator, a CPU platform (``platform``).
"""

__version__ = "0.1.0"
