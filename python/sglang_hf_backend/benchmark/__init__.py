"""Side-by-side benchmark of SGLang native, SGLang's built-in transformers backend, ours and HF.

``presets.py`` says what runs (models, workloads, engine settings), ``workers.py`` measures
one implementation in a fresh process, ``report.py`` turns interleaved rounds into
medians, ratios, a markdown table and a chart. ``scripts/bench.py`` is the command line.
``interleaved.py`` times implementations side by side in one process for the kernel scripts
(``scripts/bench_decode_kernel.py``, ``scripts/bench_linears.py``).
"""
