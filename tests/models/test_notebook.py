"""notebooks/cosine_alignment.ipynb runs top to bottom (a copy, in a temporary folder) and writes its
figures, so the committed notebook cannot rot."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.model  # the notebook loads the embedded SmolLM2 in its own kernel

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "cosine_alignment.ipynb"
FIGURES = ("cosine_by_layer.png", "hit_rate_vs_cosine.png", "mask_inits.png")


def test_cosine_alignment_notebook_executes(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.delenv("PROBE_MTP_NOTEBOOK_GEMMA", raising=False)
    # 3 prompts of 16 tokens: checks that it runs, in a quarter of the time
    monkeypatch.setenv("PROBE_MTP_NOTEBOOK_PER_TASK", "1")
    monkeypatch.setenv("PROBE_MTP_NOTEBOOK_NEW_TOKENS", "16")
    # the kernel is a process of its own: give it this test process's threads, not every core
    # (under pytest-xdist other workers use the rest; two threads per core stall each other)
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    copy = tmp_path / NOTEBOOK.name
    shutil.copy(NOTEBOOK, copy)
    nb = nbformat.read(copy, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError on any failing cell
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            assert output.get("output_type") != "error"
    for name in FIGURES:
        png = tmp_path / "figures" / name
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == len(FIGURES)  # each figure is also shown inline
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "50% threshold at cosine" in text and "accepted" in text


def test_committed_notebook_shows_its_figures():
    """Committed with outputs, so a code host renders the figures without running anything."""
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) >= len(FIGURES)
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == "error"]
    for name in FIGURES:
        assert (NOTEBOOK.parent / "figures" / name).is_file(), name
