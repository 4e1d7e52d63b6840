"""Wall-clock timing of whole generations on any device.

A report compares generations by the time a user waits for them.  On a CPU that is the time the
call takes; on an accelerator a call may return while the device still works through the kernels
it queued, so the clock is read only once the device has finished (and started only once the work
queued before the call has finished, so that no earlier work is charged to it).
"""

from __future__ import annotations

import time

import torch

from ..clock import DeviceClock


def wall_seconds(device: torch.device | str, fn, *args, **kwargs) -> tuple[object, float]:
    """``(fn(*args, **kwargs), seconds from its start until ``device`` finished its work)``; on a
    CPU the plain duration of the call."""
    clock = DeviceClock(device)
    clock.wait()
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    clock.wait()
    return result, time.perf_counter() - start
