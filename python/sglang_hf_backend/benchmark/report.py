"""From interleaved rounds to a report: medians with min-max, ratios to native, table, chart."""

from __future__ import annotations

import os
import platform
import statistics
from pathlib import Path


def machine() -> dict:
    """What the numbers were measured on: figures from different CPUs do not compare."""
    import torch

    model = platform.processor() or "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [
            line.split(":", 1)[1].strip()
            for line in cpuinfo.read_text().splitlines()
            if line.startswith("model name")
        ]
        model = names[0] if names else model
    return {
        "cpu": model,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def summarise(results: list[dict]) -> dict:
    """Per (model, impl, metric): median, min, max over rounds."""
    summary: dict = {}
    for r in results:
        for metric, value in r["metrics"].items():
            if isinstance(value, (int, float)):
                summary.setdefault(r["model"], {}).setdefault(r["impl"], {}).setdefault(metric, []).append(
                    value
                )
    return {
        model: {
            impl: {
                m: {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}
                for m, v in metrics.items()
            }
            for impl, metrics in impls.items()
        }
        for model, impls in summary.items()
    }


# (result key, table label, drawn in the chart)
METRICS = [
    ("offline_output_tok_s", "offline output tok/s", True),
    ("prefill_s", "full-batch prefill s", False),
    ("decode_step_ms", "full-batch decode step ms", True),
    ("latency_ms_per_token", "batch-1 ms/token", True),
    ("serving_output_tok_s", "serving output tok/s", True),
    ("ttft_ms_median", "TTFT ms", True),
    ("tpot_ms_median", "TPOT ms", False),
    ("itl_ms_median", "ITL ms", False),
    ("startup_s", "start-up s", False),
    ("warmup_s", "warm-up (compile) s", False),
    ("ready_s", "ready (start-up + warm-up) s", False),
    ("peak_rss_mb", "peak RSS MB", False),
]


def served_dtypes(results: list[dict]) -> dict:
    """Per (model, impl): the dtype it ran in (``auto`` is the platform's choice on CPU)."""
    dtypes: dict = {}
    for r in results:
        if "dtype" in r["metrics"]:
            dtypes.setdefault(r["model"], {})[r["impl"]] = r["metrics"]["dtype"]
    return dtypes


def markdown(summary: dict, impls: list[str], measured_on: dict, dtypes: dict) -> str:
    on = f"{measured_on['cpu']}, torch CPU capability {measured_on['torch_cpu_capability']}, {measured_on['cores']} cores"
    if measured_on.get("gpu"):
        on += f", {measured_on['gpu']}"
    lines = [f"Measured on: {on}", ""]
    for model, by_impl in summary.items():
        lines += [
            f"**{model}** (median [min-max]; ratio to native, then to HF's faster dtype; "
            "higher is better for tok/s)",
            "",
            "| metric | " + " | ".join(impls) + " |",
            "|---|" + "---|" * len(impls),
        ]
        lines.append("| dtype | " + " | ".join(dtypes.get(model, {}).get(i, "n/a") for i in impls) + " |")
        native = by_impl.get("native", {})
        hf_runs = [i for i in impls if i.split("+")[0] == "hf"]
        for key, label, _ in METRICS:
            if not any(key in by_impl.get(i, {}) for i in impls):
                continue
            cells = []
            for impl in impls:
                stat = by_impl.get(impl, {}).get(key)
                if stat is None:
                    cells.append("n/a")
                    continue
                cell = f"{stat['median']:.1f} [{stat['min']:.1f}-{stat['max']:.1f}]"
                ratios = []
                if key in native and impl != "native":
                    ratios.append(f"{stat['median'] / native[key]['median']:.2f}x")
                hf = best_median(by_impl, hf_runs, key)
                if hf is not None and impl not in hf_runs:
                    ratios.append(f"{stat['median'] / hf:.2f}x hf")
                if ratios:
                    cell += f" ({', '.join(ratios)})"
                cells.append(cell)
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def best_median(by_impl: dict, impls: list[str], key: str) -> float | None:
    """The best median of ``key`` among ``impls`` (highest for throughputs, else lowest)."""
    medians = [by_impl[i][key]["median"] for i in impls if key in by_impl.get(i, {})]
    if not medians:
        return None
    return max(medians) if key.endswith(("_tok_s", "_req_s")) else min(medians)


def chart(summary: dict, impls: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (model, key, label)
        for model, by_impl in summary.items()
        for key, label, charted in METRICS
        if charted and any(key in by_impl.get(i, {}) for i in impls)
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6), squeeze=False)
    palette = {"native": "#4c72b0", "builtin": "#dd8452", "ours": "#55a868", "hf": "#8172b3"}
    for ax, (model, key, label) in zip(axes[0], panels):
        names, medians, low, high = [], [], [], []
        for impl in impls:
            stat = summary[model].get(impl, {}).get(key)
            if stat:
                names.append(impl)
                medians.append(stat["median"])
                low.append(stat["median"] - stat["min"])
                high.append(stat["max"] - stat["median"])
        colors = [palette.get(n.split("+")[0], "#937860") for n in names]
        ax.bar(names, medians, yerr=[low, high], color=colors, capsize=4)
        ax.set_title(f"{model}\n{label}", fontsize=9)
        ax.tick_params(axis="x", labelsize=8, labelrotation=30)
        plt.setp(ax.get_xticklabels(), ha="right", rotation_mode="anchor")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
