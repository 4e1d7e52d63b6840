"""Checks that decoding is ready for an accelerator, runnable without one.

- :class:`HostSyncCounter`: counts the calls that make the host wait for the device (``item``,
  ``tolist``, ``cpu``, ``numpy``, and ``bool`` / ``int`` / ``float`` / ``index`` of a tensor)
  whose nearest caller outside torch is in a given package (probe_mtp by default).  On CUDA each
  of them drains the device's queue; on a CPU they cost nothing, which is why they have to be
  counted rather than timed.
- :func:`meta_default_device`: torch's default device set to ``"meta"`` while the model and its
  inputs stay where they are.  A tensor made without an explicit device then has no data, so any
  place that forgets the model's device fails or gives other tokens.

Both are used by the test suite (``tests/unit/test_device_hygiene.py``) and by
``scripts/host_syncs.py``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

# the tensor methods that copy a value to the host (and so wait for the device to finish)
SYNCING_METHODS = frozenset(
    getattr(torch.Tensor, name)
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
)
_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.abspath(__file__)


class HostSyncCounter(TorchFunctionMode):
    """``with HostSyncCounter() as syncs: ...``; then ``syncs.total`` and ``syncs.sites``
    (``"file.py:line"`` -> count, the calling line in the package).  ``package``: the folder whose
    code is charged (default: probe_mtp's).

    A call that reads a tensor ``.cpu()`` has just brought to the host (``x.cpu().numpy()``,
    ``x.cpu().tolist()``: the same line of the same frame, right after) is not counted again: on
    a device that is one wait, not two.  With ``chained=True`` every call counts."""

    def __init__(self, package: str | None = None, chained: bool = False):
        super().__init__()
        self.package = os.path.abspath(package or os.path.dirname(_HERE)) + os.sep
        self.chained = chained
        self.sites: Counter[str] = Counter()
        self._last_cpu: tuple | None = None  # (frame, line) of the last counted .cpu()

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCING_METHODS:
            frame = self._caller()
            if frame is not None:
                here = (frame, frame.f_lineno)
                if self.chained or func is torch.Tensor.cpu or self._last_cpu != here:
                    name = os.path.relpath(frame.f_code.co_filename, os.path.dirname(self.package.rstrip(os.sep)))
                    self.sites[f"{name}:{frame.f_lineno}"] += 1
                self._last_cpu = here if func is torch.Tensor.cpu else None
        return func(*args, **(kwargs or {}))

    def _caller(self):
        """The nearest frame outside torch, if it is in the package."""
        frame = sys._getframe(2)
        while frame is not None:
            name = os.path.abspath(frame.f_code.co_filename)
            if name != _HERE and not name.startswith(_TORCH_DIR):
                return frame if name.startswith(self.package) else None
            frame = frame.f_back
        return None


@contextlib.contextmanager
def meta_default_device():
    """Run the block with torch's default device set to ``"meta"`` (restored after)."""
    previous = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(previous)
