"""The cost curve measured on SmolLM2 and its disk cache (one file per model and processor)."""

from __future__ import annotations

import json

from probe_mtp import cost
from probe_mtp.cost import cost_curve_for, curve_key, curve_path, processor_name


def test_cost_curve_disk_cache(tmp_path, monkeypatch, smollm2):
    model, _ = smollm2
    monkeypatch.setenv("PROBE_MTP_CACHE_DIR", str(tmp_path))
    curve = cost_curve_for(model)
    path = curve_path(model)
    assert path.is_file() and path.parent == tmp_path
    assert curve.sizes[0] == 1 and all(s > 0 for s in curve.seconds)
    # a second call reads the file instead of measuring (a kept curve faster than now: kept)
    data = json.loads(path.read_text())
    data["curve"]["seconds"] = [s / 4 for s in curve.seconds]
    path.write_text(json.dumps(data))
    assert cost_curve_for(model).seconds == tuple(s / 4 for s in curve.seconds)
    # use_disk=False neither reads nor writes
    assert cost_curve_for(model, use_disk=False).seconds[0] > curve.seconds[0] / 4
    # a kept curve measured on a busy machine (ten times slower than a pass now) is measured again
    data["curve"]["seconds"] = [s * 10 for s in curve.seconds]
    path.write_text(json.dumps(data))
    again = cost_curve_for(model)
    assert again.seconds[0] < curve.seconds[0] * 5
    assert json.loads(path.read_text())["curve"]["seconds"][0] == again.seconds[0]  # and written over the stale one
    # a machine with another processor (a shared home directory) keeps its own curve
    assert curve_key(model)["processor"] == processor_name() != ""
    monkeypatch.setattr(cost, "processor_name", lambda: "another processor")
    assert curve_path(model) != path


def test_cost_curve_on_the_test_device_names_it_and_makes_no_tensor_elsewhere(smollm2):
    """On the session's device (``PROBE_MTP_TEST_DEVICE``): the key names the accelerator off the
    CPU, and a short curve measured with torch's default device set to ``meta`` is a sane one (every
    tensor made on the model's device; on an accelerator, device time from events)."""
    from probe_mtp.device_audit import meta_default_device

    model, _ = smollm2
    assert ("accelerator" in curve_key(model)) == (model.device.type != "cpu")
    with meta_default_device():
        curve = cost.measure_cost_curve(model, sizes=(1, 4), context=32, rounds=1, long_context=None)
    assert curve.sizes == (1, 4) and all(0 < s < 10 for s in curve.seconds)
