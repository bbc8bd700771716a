"""notebooks/explore_checkpoint.ipynb runs top to bottom in a fresh kernel, with no cell error."""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

import zarrckpt

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "explore_checkpoint.ipynb"


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("where", ["moto", "env-url"])
def test_notebook_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """Default: the notebook starts its own moto S3 server; with ZARRCKPT_NOTEBOOK_URL it saves there."""
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # tiny tensors on shared CPUs: more threads only spin
    monkeypatch.delenv("ZARRCKPT_NOTEBOOK_STORAGE_OPTIONS", raising=False)
    url = str(tmp_path / "ckpt")
    if where == "env-url":
        monkeypatch.setenv("ZARRCKPT_NOTEBOOK_URL", url)
    else:
        monkeypatch.delenv("ZARRCKPT_NOTEBOOK_URL", raising=False)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit the notebook without outputs"
    start = time.perf_counter()
    NotebookClient(nb, kernel_name="python3", timeout=120, resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert time.perf_counter() - start < 60
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    html = "".join(o.get("data", {}).get("text/html", "") for o in outputs)
    assert "<b>zarrckpt checkpoint</b>" in html and "<b>zarrckpt tensor</b>" in html
    assert "<code>model.layers.2.moe.experts.w1</code>" in html and "trainer.step = 60" in html
    assert "<b>OK</b>" in html  # verify()
    stdout = "".join(o.get("text", "") for o in outputs if o.get("name") == "stdout")
    assert "optim.state.model.layers.2.moe.experts.w1.exp_avg_sq" in stdout and "... 48 tensors in all" in stdout
    if where == "env-url":
        ckpt = zarrckpt.open(url)
        assert ckpt["model.layers.2.moe.experts.w1"].shape == (8, 64, 128)
        assert ckpt["optim.state.model.layers.2.moe.experts.w1.exp_avg_sq"].role == "second_moment"
        assert len(ckpt.metadata["trainer"]["bookkeeping"]["loss_window"]) == 32
    else:
        assert not Path(url).exists()
