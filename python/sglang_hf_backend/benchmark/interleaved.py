"""Interleaved timing for the kernel scripts: every implementation once per round, medians."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(
    impls: dict[str, Callable[[], object]], rounds: int, before_each: Callable[[int], object] | None = None
) -> dict[str, float]:
    """Median wall time of each implementation over ``rounds`` rounds, after one warm-up round;
    ``before_each(round)`` runs untimed before every call (e.g. to evict caches)."""
    samples: dict[str, list[float]] = {name: [] for name in impls}
    for round_ in range(rounds + 1):
        for name, run in impls.items():
            if before_each is not None:
                before_each(round_)
            started = time.perf_counter()
            run()
            if round_:
                samples[name].append(time.perf_counter() - started)
    return {name: statistics.median(times) for name, times in samples.items()}
