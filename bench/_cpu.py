"""CPU time of the ledger's writer process, for the benchmarks' CPU columns."""

from __future__ import annotations

from pathlib import Path


def process_cpu(pid: int | None) -> float:
    """CPU seconds used so far by every thread of process ``pid``; 0 for None.

    Read from ``/proc/<pid>/task/*/schedstat`` (nanoseconds, Linux): a
    process that is not this one's waited-for child has no other clock.
    Elsewhere, or once the process is gone, it counts as nothing.
    """
    if pid is None:
        return 0.0
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            total += int((task / "schedstat").read_text().split()[0])
    except (OSError, ValueError):
        return 0.0
    return total / 1e9
