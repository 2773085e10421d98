"""Fresh Python processes for tests, run side by side (each import of SGLang takes seconds)."""

from __future__ import annotations

import subprocess
import sys


def run_side_by_side(
    commands: dict[str, list[str]], timeout: float = 120
) -> dict[str, subprocess.CompletedProcess]:
    """``python <args>`` for each named argument list, all started at once; their results by name."""
    started = {
        name: subprocess.Popen(
            [sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, args in commands.items()
    }
    results = {}
    for name, process in started.items():
        stdout, stderr = process.communicate(timeout=timeout)
        results[name] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    return results
