"""Checkpoints written in the formats before version 4 still load, open, verify, export and copy,
every chunk still checked against its commit record: versions 1 and 2 (the record inline in the
manifest) and 3 (the record in the chunk checksum table), all three with chunk keys "c/0/1"
(tests/fixtures/old_formats.py wrote them with the old code)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
from safetensors.torch import load_file

import zarrckpt
from tests.fixtures.old_formats import HERE, expected

VERSIONS = (1, 2, 3)


@pytest.fixture(params=VERSIONS, ids=[f"format{v}" for v in VERSIONS])
def old(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[int, Path]:
    """A copy of the fixture (reads must not depend on its place, and tampering must not touch it)."""
    version = request.param
    where = tmp_path / f"format{version}"
    shutil.copytree(HERE / f"format{version}", where)
    return version, where


def _manifest(where: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((where / "zarr.json").read_bytes())["attributes"]["zarrckpt"]
    return doc


def test_the_fixtures_are_of_the_old_formats(old: tuple[int, Path]) -> None:
    version, where = old
    doc = _manifest(where)
    assert doc["format_version"] == version
    inline = [r for r in doc["integrity"]["arrays"].values() if "chunk_crc32c" in r]
    hidden = [p.name for p in where.iterdir() if p.name.startswith(".")]
    if version < 3:
        assert inline and all(isinstance(r["chunk_crc32c"], str) for r in inline)  # base64, in the manifest
        assert not hidden  # no table object beside it
    else:
        assert not inline and hidden == [".zarrckpt-crc32c"]
    arrays = [json.loads(p.read_bytes()) for p in where.rglob("zarr.json") if p.parent != where]
    arrays = [a for a in arrays if a["node_type"] == "array"]
    assert arrays and all(a["chunk_key_encoding"]["configuration"]["separator"] == "/" for a in arrays)
    assert (where / "model" / "embed" / "weight" / "c" / "1" / "0").is_file()


def test_loads_bit_exact(old: tuple[int, Path]) -> None:
    version, where = old
    tensors, values = expected(version)
    state: dict[str, Any] = {k: torch.zeros_like(t) for k, t in tensors.items()}
    state.update({k: type(v)() for k, v in values.items()})
    zarrckpt.load(state, str(where))
    for key, t in tensors.items():
        assert torch.equal(state[key], t), key
    assert {k: state[k] for k in values} == values


def test_opens_reads_and_verifies(old: tuple[int, Path]) -> None:
    version, where = old
    tensors, _ = expected(version)
    ckpt = zarrckpt.open(str(where))
    assert sorted(ckpt.keys()) == [*sorted(tensors), "trainer.blob"]
    assert torch.equal(ckpt["model.embed.weight"][40:50, 3:9], tensors["model.embed.weight"][40:50, 3:9])
    assert torch.equal(ckpt["model.experts.w1"][2], tensors["model.experts.w1"][2])
    summary = ckpt.verify()
    assert summary["problems"] == [] and summary["tensors"] == len(ckpt.keys())


def test_exports(old: tuple[int, Path], tmp_path: Path) -> None:
    version, where = old
    tensors, _ = expected(version)
    zarrckpt.export_safetensors(str(where), tmp_path / "out")
    got: dict[str, torch.Tensor] = {}
    for f in sorted((tmp_path / "out").glob("*.safetensors")):
        got.update(load_file(f))
    for key, t in tensors.items():
        assert torch.equal(got[key], t), key


def test_a_copy_is_of_todays_format_and_loads(old: tuple[int, Path], tmp_path: Path) -> None:
    version, where = old
    tensors, _ = expected(version)
    zarrckpt.copy_checkpoint(str(where), str(tmp_path / "copy"))
    assert _manifest(tmp_path / "copy")["format_version"] >= version
    assert (tmp_path / "copy" / "model" / "embed" / "weight" / "c" / "1" / "0").is_file()  # its chunk keys kept
    state: dict[str, Any] = {k: torch.zeros_like(t) for k, t in tensors.items()}
    zarrckpt.load(state, str(tmp_path / "copy"), keys=sorted(tensors))
    for key, t in tensors.items():
        assert torch.equal(state[key], t), key


def test_a_changed_chunk_is_still_caught(old: tuple[int, Path]) -> None:
    """The old record still checks: a chunk rewritten with a fresh, valid crc32c is refused."""
    _, where = old
    shard = where / "model" / "embed" / "weight" / "c" / "1" / "0"
    raw = bytearray(shard.read_bytes())
    doc = json.loads((where / "model" / "embed" / "weight" / "zarr.json").read_bytes())
    shard_rows, inner_rows = (
        doc["chunk_grid"]["configuration"]["chunk_shape"][0],
        doc["codecs"][0]["configuration"]["chunk_shape"][0],
    )
    n = (
        shard_rows // inner_rows
    )  # inner chunks per shard (FORMAT.md §5: the index first, then each chunk and its crc32c)
    start = 16 * n + 4
    end = start + int.from_bytes(raw[8:16], "little")  # the first chunk's nbytes (its crc32c included)
    raw[start] ^= 0xFF
    raw[end - 4 : end] = crc32c.crc32c(bytes(raw[start : end - 4])).to_bytes(4, "little")
    shard.write_bytes(bytes(raw))
    with pytest.raises(zarrckpt.ModifiedCheckpointError, match="modified after commit"):
        zarrckpt.open(str(where))["model.embed.weight"][32:40]
    problems = zarrckpt.open(str(where)).verify()["problems"]
    assert len(problems) == 1 and "model.embed.weight" in problems[0]
