"""zarrckpt.open: lazy, read-only access; every index form against the fully loaded tensor."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

import zarrckpt

G = torch.Generator().manual_seed(3)
EXPERTS = torch.randn(8, 6, 10, generator=G)
BF = torch.randn(7, 5, generator=G).bfloat16()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> zarrckpt.Checkpoint:
    url = str(tmp_path_factory.mktemp("open") / "ck")
    state = {
        "model": {"layers": {"0": {"experts": {"w1": EXPERTS}}}, "bf": BF, "scalar": torch.tensor(4.0)},
        "trainer": {"step": 7, "config": {"lr": 0.1}},
    }
    zarrckpt.save(state, url, chunk_bytes=6 * 10 * 4)  # one expert per inner chunk
    return zarrckpt.open(url)


INDEXES: list[Any] = [
    5,
    -1,
    (5, 2),
    (5, -1, 3),
    slice(None),
    slice(2, 7),
    slice(1, 8, 3),
    slice(None, None, -2),
    slice(6, 1, -2),
    (slice(None), 3),
    (..., 4),
    (2, ...),
    (..., slice(1, 9, 4)),
    (slice(3, 3),),
    (slice(0, 8, 2), slice(5, 0, -1), slice(None, None, 3)),
    Ellipsis,
    (),
]


@pytest.mark.parametrize("index", INDEXES, ids=repr)
def test_every_index_form(ckpt: zarrckpt.Checkpoint, index: Any) -> None:
    got = ckpt["model.layers.0.experts.w1"][index]
    want = EXPERTS.numpy()[index]
    assert got.shape == want.shape and np.array_equal(got.numpy(), want)


def test_listing_and_metadata(ckpt: zarrckpt.Checkpoint) -> None:
    assert ckpt.keys() == ["model.bf", "model.layers.0.experts.w1", "model.scalar"]
    assert len(ckpt) == 3 and "model.bf" in ckpt and "nope" not in ckpt
    assert ckpt.metadata == {"trainer": {"step": 7, "config": {"lr": 0.1}}}
    row = {r["key"]: r for r in ckpt.tensors()}["model.layers.0.experts.w1"]
    assert row == {
        "key": "model.layers.0.experts.w1",
        "role": "main_weight",
        "shape": [8, 6, 10],
        "dtype": "float32",
        "bytes": 8 * 6 * 10 * 4,
        "shard": [8, 6, 10],
        "chunk": [1, 6, 10],
    }
    view = ckpt["model.bf"]
    assert (view.shape, view.dtype, view.role, view.nbytes) == ((7, 5), torch.bfloat16, "main_weight", 70)
    assert view.path.endswith("ck/model/bf")
    assert torch.equal(view.read(), BF) and torch.equal(view[2:4], BF[2:4])
    assert np.array_equal(view.numpy().view(np.uint16), BF.view(torch.uint16).numpy())
    assert view.numpy().dtype == ml_dtypes.bfloat16
    assert ckpt["model.scalar"].read().item() == 4.0 and ckpt["model.scalar"][()].item() == 4.0


def test_bad_keys_and_indexes(ckpt: zarrckpt.Checkpoint) -> None:
    with pytest.raises(zarrckpt.KeyNotFoundError, match=re.escape("did you mean 'model.layers.0.experts.w1'")):
        ckpt["model.layers.0.expert.w1"]
    view = ckpt["model.layers.0.experts.w1"]
    for bad, why in [
        (8, "out of range"),
        (-9, "out of range"),
        ((0, 0, 0, 0), "too many"),
        ("x", "unsupported"),
        ((..., ...), "at most one"),
    ]:
        with pytest.raises(zarrckpt.ZarrckptError, match=why):
            view[bad]


def test_open_refuses_missing_and_uncommitted(tmp_path: Path) -> None:
    with pytest.raises(zarrckpt.CheckpointNotFoundError):
        zarrckpt.open(str(tmp_path / "none"))
    zarrckpt.save({"w": torch.zeros(2)}, str(tmp_path / "ck"))
    (tmp_path / "ck" / "zarr.json").unlink()
    with pytest.raises(zarrckpt.IncompleteCheckpointError):
        zarrckpt.open(str(tmp_path / "ck"))


def test_verify_reports_every_problem(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    state = {"a": torch.randn(64, 64), "b": torch.randn(64, 64), "c": torch.arange(3.0)}  # c: not a constant array
    zarrckpt.save(state, url, chunk_bytes=4096)
    summary = zarrckpt.open(url).verify()
    assert summary["problems"] == [] and summary["tensors"] == 3 and summary["bytes_read"] >= 2 * 64 * 64 * 4
    shard = tmp_path / "ck/a/c.0.0"
    raw = bytearray(shard.read_bytes())
    raw[5000] ^= 1
    shard.write_bytes(bytes(raw))
    (tmp_path / "ck/b/c.0.0").unlink()
    problems = zarrckpt.open(url).verify()["problems"]
    assert len(problems) == 2
    assert "'a'" in problems[0] and "crc32c" in problems[0]
    assert "'b'" in problems[1] and "missing" in problems[1]


def test_verify_reads_many_tensors_side_by_side_and_reports_in_key_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many one-shard tensors (issue 41: 1,000 of them took 31-51 s, a GET after a GET): their
    ``zarr.json`` and shard GETs run side by side; the problems still come in key order."""
    import threading
    import time

    from zarrckpt.storage.store import Storage

    url = str(tmp_path / "ck")
    state = {f"t{i:03d}": torch.arange(16.0) + i for i in range(40)}  # (not constant: stored in chunks)
    zarrckpt.save(state, url)  # (arrays of several shards, verified one by one: test_request_budget.py)
    for key in ("t031", "t007", "t019"):
        (tmp_path / "ck" / key / "c.0").unlink()
    monkeypatch.setenv("ZARRCKPT_CONCURRENCY", "8")  # (local reads: as many as cores by default)
    ckpt = zarrckpt.open(url)
    lock, now, most = threading.Lock(), [0], [0]
    real = Storage.read

    def slow_read(self: Storage, *args: Any, **kw: Any) -> Any:
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        try:
            time.sleep(0.01)  # a round trip
            return real(self, *args, **kw)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(Storage, "read", slow_read)
    problems = ckpt.verify()["problems"]
    assert most[0] > 4, most[0]
    assert [p.split("'")[1] for p in problems] == ["t007", "t019", "t031"] and all("missing" in p for p in problems)


def _rows(html: str) -> list[list[str]]:
    """Cells of every table row (tags stripped, entities kept)."""
    return [re.findall(r"<t[dh]>(.*?)</t[dh]>", row) for row in re.findall(r"<tr>(.*?)</tr>", html)]


EXPERT_GRID = ["[8, 6, 10]", "[1, 6, 10]"]  # shard, inner chunk


def test_checkpoint_html(ckpt: zarrckpt.Checkpoint) -> None:
    html = ckpt._repr_html_()
    rows = _rows(html)
    summary = {r[0]: r[1] for r in rows if len(r) == 2}
    assert summary["url"] == f"<code>{ckpt.storage.url}</code>"
    assert summary["step / metadata"] == "trainer.step = 7"
    assert summary["world size at save"] == "1" and summary["tensors"] == "3"
    assert summary["created"] == ckpt.manifest.created and summary["library"] == "zarrckpt 0.1.0"
    total = 8 * 6 * 10 * 4 + 7 * 5 * 2 + 4
    assert summary["total"] == f"1.9 KiB ({total:,} bytes)"
    assert summary["by role"] == f"main_weight: {total / 1024:.1f} KiB"
    assert [r for r in rows if len(r) == 7] == [
        ["key", "role", "shape", "dtype", "size", "shard", "chunk"],
        ["<code>model.bf</code>", "main_weight", "[7, 5]", "bfloat16", "70 B", "[7, 5]", "[7, 5]"],
        ["<code>model.layers.0.experts.w1</code>", "main_weight", "[8, 6, 10]", "float32", "1.9 KiB", *EXPERT_GRID],
        ["<code>model.scalar</code>", "main_weight", "[]", "float32", "4 B", "[]", "[]"],
    ]
    assert "showing the first" not in html
    view = ckpt["model.layers.0.experts.w1"]
    assert {r[0]: r[1] for r in _rows(view._repr_html_())} == {
        "key": "<code>model.layers.0.experts.w1</code>",
        "role": "main_weight",
        "shape": "[8, 6, 10]",
        "dtype": "float32",
        "size": "1.9 KiB (1,920 bytes)",
        "shards": "1 of [8, 6, 10]",
        "inner chunks": "8 per shard, [1, 6, 10]",
        "saved by": "holders: 1, world_size: 1",
        "location": f"<code>{view.path}</code>",
    }


def test_html_escapes_and_truncates(tmp_path: Path) -> None:
    url = str(tmp_path / "ck<&>")
    state: dict[str, Any] = {f"t{i:02d}": torch.zeros(2) for i in range(60)}
    state["a<script>alert(1)<&>"] = torch.ones(1)
    state["trainer"] = {"step": "<b>9</b>", "note": "</pre><img src=x onerror=alert(1)>"}
    zarrckpt.save(state, url)
    ckpt = zarrckpt.open(url)
    html = ckpt._repr_html_()
    assert "<script>" not in html and "<img" not in html and "<b>9" not in html and html.count("</pre>") == 1
    assert "<code>a&lt;script&gt;alert(1)&lt;&amp;&gt;</code>" in html and "ck&lt;&amp;&gt;" in html
    assert "trainer.step = &lt;b&gt;9&lt;/b&gt;" in html and "&lt;/pre&gt;&lt;img src=x" in html
    tensor_rows = [r for r in _rows(html) if len(r) == 7][1:]
    assert [r[0] for r in tensor_rows] == ["<code>a&lt;script&gt;alert(1)&lt;&amp;&gt;</code>"] + [
        f"<code>t{i:02d}</code>" for i in range(49)
    ]
    assert "showing the first 50 of 61 tensors" in html
    view_html = ckpt["a<script>alert(1)<&>"]._repr_html_()
    assert "<script>" not in view_html and "<code>a&lt;script&gt;alert(1)&lt;&amp;&gt;</code>" in view_html


def test_verify_progress_and_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = str(tmp_path / "ck")
    state = {"a": torch.randn(64, 64), "b": torch.randn(64, 64), "c": torch.arange(3.0)}  # c: not a constant array
    zarrckpt.save(state, url, chunk_bytes=4096)
    summary = zarrckpt.open(url).verify(progress=True)
    read = 2 * (16 * 4 + 4 + 4 * (4096 + 4)) + (16 + 4 + 12 + 4)  # 2 x (index + 4 chunks), c: index + 1 chunk
    read += sum((tmp_path / f"ck/{k}/zarr.json").stat().st_size for k in "abc")  # compared with the manifest
    assert {k: v for k, v in summary.items() if k != "seconds"} == {"tensors": 3, "bytes_read": read, "problems": []}
    kib = re.escape(f"{read / 1024:.1f} KiB")
    assert summary.ok and re.fullmatch(rf"verify OK: 3 tensors, {kib} read in \d+\.\d\d s", str(summary))
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.count("\n") == 1
    final = err.rsplit("\r", 1)[-1]
    assert re.fullmatch(rf"verify 3/3 tensors \[#{{30}}\] 100% {kib}, [\d.]+ [KMG]?i?B/s\s*\n", final), final
    assert "status</td><td><b>OK</b>" in summary._repr_html_()
    (tmp_path / "ck/b/c.0.0").unlink()
    bad = zarrckpt.open(url).verify()
    assert not bad.ok and capsys.readouterr().err == ""  # no progress bar unless asked
    lines = str(bad).splitlines()
    kib = re.escape(f"{(read - (16 * 4 + 4 + 4 * (4096 + 4))) / 1024:.1f} KiB")  # all but b's shard
    assert re.fullmatch(rf"verify 1 problem\(s\): 3 tensors, {kib} read in \d+\.\d\d s", lines[0])
    assert len(lines) == 2 and lines[1].startswith("  - ") and "'b'" in lines[1] and "missing" in lines[1]
