"""The heap trimmer (probe_mtp.heap): runs on the CPU on every few calls, skipped on other devices."""

from __future__ import annotations

import pytest
import torch

from probe_mtp.heap import heap_trimmer

pytestmark = pytest.mark.cpu_only  # glibc heap trimming of the host process


def test_heap_trimmer_runs_on_the_cpu_and_is_skipped_elsewhere():
    trim = heap_trimmer(torch.device("cpu"), every=3)
    if trim is not None:  # glibc: malloc_trim returns 0 or 1, on every third call only
        results = [trim() for _ in range(6)]
        assert results[0] is None and results[1] is None and results[3] is None and results[4] is None
        assert results[2] in (0, 1) and results[5] in (0, 1)
    assert heap_trimmer(torch.device("meta")) is None
    with pytest.raises(ValueError, match="every"):
        heap_trimmer(torch.device("cpu"), every=0)
