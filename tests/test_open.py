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
    zarrckpt.save({"a": torch.randn(64, 64), "b": torch.randn(64, 64), "c": torch.zeros(3)}, url, chunk_bytes=4096)
    summary = zarrckpt.open(url).verify()
    assert summary["problems"] == [] and summary["tensors"] == 3 and summary["bytes_read"] >= 2 * 64 * 64 * 4
    shard = tmp_path / "ck/a/c/0/0"
    raw = bytearray(shard.read_bytes())
    raw[5000] ^= 1
    shard.write_bytes(bytes(raw))
    (tmp_path / "ck/b/c/0/0").unlink()
    problems = zarrckpt.open(url).verify()["problems"]
    assert len(problems) == 2
    assert "'a'" in problems[0] and "crc32c" in problems[0]
    assert "'b'" in problems[1] and "missing" in problems[1]
