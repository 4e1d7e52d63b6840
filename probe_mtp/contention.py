"""Whether other work took the processors while something was timed.

A measurement that decides something for good (``dtype="auto"`` keeps its choice per machine) must
not be taken while another process, or a virtual machine's neighbours, held the cores it runs on:
a few seconds of someone else's work can double every pass timed in them.  On Linux the machine's
busy time (``/proc/stat``, time stolen by the hypervisor included) less this process's own
(``os.times``) is the time others took; what exceeds the cores this process leaves free is what
they took from it.  Elsewhere nothing is known (``None``).
"""

from __future__ import annotations

import os
import time
from typing import Callable, TypeVar

T = TypeVar("T")

# the share of its cores' time others may take from a measurement before it is called contended:
# a machine's own background (kernel threads, a terminal) stays well under it
QUIET_SHARE = 0.05

# /proc/stat's "cpu" line: user nice system idle iowait irq softirq steal guest guest_nice (guest
# time is counted in user time already); the busy fields, steal among them
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


def machine_busy_seconds(stat_path: str = "/proc/stat") -> float | None:
    """Seconds all processors have spent busy (or stolen) since boot; None where unknown."""
    try:
        with open(stat_path, encoding="ascii") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return sum(int(fields[1 + i]) for i in _BUSY_FIELDS) / ticks


def own_seconds() -> float:
    """Processor seconds this process (every thread) has used."""
    used = os.times()
    return used.user + used.system


def contended_share(others: float, wall: float, threads: int, cpus: int) -> float:
    """The share of ``threads`` cores over ``wall`` seconds that others' ``others`` seconds took,
    beyond the ``cpus - threads`` cores this process left them."""
    spare = max(cpus - threads, 0) * wall
    return max(others - spare, 0.0) / max(wall * threads, 1e-9)


def run_watched(run: Callable[[], T], threads: int, busy: Callable[[], float | None] = machine_busy_seconds,
                ) -> tuple[T, float | None]:
    """``(run(), the share of this process's cores that other work took while it ran)``; the share
    is None where the machine's busy time cannot be read."""
    cpus = os.cpu_count() or threads
    before, own_before, start = busy(), own_seconds(), time.perf_counter()
    result = run()
    after, own_after, wall = busy(), own_seconds(), time.perf_counter() - start
    if before is None or after is None:
        return result, None
    others = (after - before) - (own_after - own_before)
    return result, contended_share(others, wall, max(1, min(threads, cpus)), cpus)
