"""What the kernel says of a thread's time (``/proc/.../schedstat``: nanoseconds on a CPU,
nanoseconds waiting for one while runnable, times put on a CPU), for the benchmarks that split
a span's wall time into CPU time and waits for a CPU (``scripts/bench_engine.py``,
``scripts/bench_forward.py`` through ``decode_steps``). Zeros where the kernel keeps none."""

from __future__ import annotations

import os
import threading

_OPEN: dict[int, int] = {}  # thread id -> its open /proc/thread-self/schedstat


def run_delay() -> float:
    """Seconds the calling thread has waited for a CPU while runnable (the second field; the
    file is kept open per thread and read again from its start, a few microseconds, so a timed
    span holds no open); 0 where the kernel keeps no schedstats."""
    thread = threading.get_ident()
    try:
        descriptor = _OPEN.get(thread)
        if descriptor is None:
            descriptor = _OPEN[thread] = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        return int(os.pread(descriptor, 128, 0).split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def thread_schedstat(path: str) -> tuple[float, float, int]:
    """A thread's schedstat at ``path``: seconds on a CPU, seconds waiting for one while
    runnable, and the times it was put on a CPU (zeros where the file is missing)."""
    try:
        with open(path, "rb") as handle:
            fields = handle.read(128).split()
        return int(fields[0]) / 1e9, int(fields[1]) / 1e9, int(fields[2])
    except (OSError, IndexError, ValueError):
        return 0.0, 0.0, 0
