"""Timing the device's work, not the host's.

On a CPU the host runs the kernels, so ``time.perf_counter`` around a forward pass measures it.
On an accelerator (CUDA, XPU, MPS) the host only queues kernels: a pass "returns" in the time it
takes to launch them, and a budget sized from that would think wide trees are free.  There a
:class:`DeviceClock` records events on the device's stream and reads the time between them once
the device has reached the second one (:meth:`DeviceClock.seconds` waits for that event only,
which a decoding step has reached anyway by the time it reads its results), so timing adds no
host synchronisation of its own.
"""

from __future__ import annotations

import time

import torch

# device types whose work runs asynchronously to the host and that torch gives timing events for
EVENT_DEVICES = ("cuda", "xpu", "mps")


def is_async(device: torch.device | str) -> bool:
    """Whether work on ``device`` runs asynchronously to the host."""
    return torch.device(device).type in EVENT_DEVICES


class DeviceClock:
    """``mark()`` a point on ``device``'s timeline; ``seconds(start, end)`` between two marks."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.uses_events = is_async(self.device)

    def mark(self):
        if not self.uses_events:
            return time.perf_counter()
        event = torch.Event(device=self.device, enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        if not self.uses_events:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000.0

    def wait(self) -> None:
        """Wait until the device has done all the work queued so far (nothing on a CPU)."""
        if self.uses_events:
            torch.accelerator.synchronize(self.device)

    def elapsed(self, fn, *args, **kwargs) -> tuple[object, float]:
        """``(fn(*args, **kwargs), seconds the device spent on it)``, waiting for it to finish: for
        measurements (cost curves), not for the decoding loop."""
        self.wait()
        start = self.mark()
        result = fn(*args, **kwargs)
        end = self.mark()
        return result, self.seconds(start, end)
