"""How much of its cores other work took while something was timed (what makes dtype auto
measure a configuration again)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from probe_mtp import contention
from probe_mtp.contention import QUIET_SHARE, contended_share, machine_busy_seconds, run_watched


def test_the_share_counts_only_what_others_took_beyond_the_cores_left_free():
    assert contended_share(others=1.0, wall=2.0, threads=2, cpus=2) == pytest.approx(0.25)
    assert contended_share(others=1.0, wall=2.0, threads=2, cpus=4) == 0.0  # two idle cores held it
    assert contended_share(others=5.0, wall=2.0, threads=2, cpus=4) == pytest.approx(0.25)
    assert contended_share(others=-0.01, wall=2.0, threads=1, cpus=1) == 0.0  # tick rounding


def test_busy_time_is_read_from_proc_stat_steal_included_and_unknown_elsewhere(tmp_path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 20 30 5000 70 1 2 40 0 0\ncpu0 50 10 15 2500 35 0 1 20 0 0\n")
    ticks = contention.os.sysconf("SC_CLK_TCK")
    assert machine_busy_seconds(str(stat)) == pytest.approx((100 + 20 + 30 + 1 + 2 + 40) / ticks)
    assert machine_busy_seconds(str(tmp_path / "absent")) is None
    stat.write_text("intr 1 2 3\n")
    assert machine_busy_seconds(str(stat)) is None


def test_run_watched_returns_the_result_and_the_share_others_took():
    clock = iter([10.0, 10.5])  # others (and this process) kept busy: 0.5 s more than this process used
    result, share = run_watched(lambda: "done", 1, busy=lambda: next(clock))
    assert result == "done" and share is not None and share > 0
    assert run_watched(lambda: 3, 2, busy=lambda: None) == (3, None)


@pytest.mark.skipif(machine_busy_seconds() is None, reason="no /proc/stat here")
def test_a_busy_process_beside_the_timed_work_is_seen():
    """On the real machine: two processes spinning per core while the work runs are seen."""
    def work():
        end = time.perf_counter() + 0.6
        while time.perf_counter() < end:
            pass

    cores = contention.os.cpu_count() or 1
    spin = "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"
    spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2 * cores)]
    try:
        time.sleep(0.3)
        _, share = run_watched(work, 1)
    finally:
        for p in spinners:
            p.wait()
    assert share > QUIET_SHARE
