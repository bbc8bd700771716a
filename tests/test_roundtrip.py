"""Single-process behaviour on every backend (local, memory://, s3:// on moto, gs:// on the emulator)."""

from __future__ import annotations

import json
import math
import random
from typing import Any

import fsspec
import ml_dtypes
import numpy as np
import pytest
import torch

import zarrckpt
from zarrckpt.errors import InvalidKeyError, UnsupportedValueError


def _state(fill: bool = True) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(33, 17, generator=g) if fill else torch.empty(33, 17),
            "bf": torch.randn(9, 5, generator=g).bfloat16() if fill else torch.zeros(9, 5, dtype=torch.bfloat16),
            "scalar": torch.tensor(2.5) if fill else torch.tensor(0.0),
        },
        "optim": {
            "state": {
                "model.w": {"exp_avg": torch.zeros(33, 17), "step": torch.tensor(3.0) if fill else torch.tensor(0.0)}
            },
            "param_groups": [{"lr": 0.01 if fill else 0.0, "betas": [0.9, 0.99]}],
        },
        "step": 42 if fill else 0,
        "note": "hello" if fill else "",
        "blob": b"\x00\x01\xff" if fill else b"",
        "np": np.arange(6, dtype=np.int32).reshape(2, 3) if fill else np.zeros((2, 3), np.int32),
        "pyrng": random.Random(5).getstate() if fill else random.Random(0).getstate(),
        "shard": zarrckpt.LocalShard(torch.arange(6.0).reshape(2, 3) if fill else torch.zeros(2, 3), (2, 3), (0, 0)),
    }


def _assert_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    for key in ("w", "bf", "scalar"):
        assert torch.equal(got["model"][key], want["model"][key]), key
    assert torch.equal(got["optim"]["state"]["model.w"]["exp_avg"], want["optim"]["state"]["model.w"]["exp_avg"])
    assert got["optim"]["param_groups"] == want["optim"]["param_groups"]
    assert (got["step"], got["note"], got["blob"], got["pyrng"]) == (
        want["step"],
        want["note"],
        want["blob"],
        want["pyrng"],
    )
    assert isinstance(got["pyrng"], tuple) and isinstance(got["blob"], bytes)
    assert np.array_equal(got["np"], want["np"])
    assert torch.equal(got["shard"].data, want["shard"].data)


def test_round_trip(storage: tuple[str, dict[str, Any]]) -> None:
    url, opts = storage
    want = _state()
    zarrckpt.save(want, url, storage_options=opts, chunk_bytes=256)
    got = _state(fill=False)
    zarrckpt.load(got, url, storage_options=opts)
    _assert_equal(got, want)


def test_overwrite(storage: tuple[str, dict[str, Any]]) -> None:
    url, opts = storage
    zarrckpt.save({"w": torch.ones(4)}, url, storage_options=opts)
    with pytest.raises(zarrckpt.CheckpointExistsError, match="overwrite=True"):
        zarrckpt.save({"w": torch.zeros(4)}, url, storage_options=opts)
    zarrckpt.save({"v": torch.full((2, 2), 3.0)}, url, storage_options=opts, overwrite=True)
    got = {"v": torch.zeros(2, 2)}
    zarrckpt.load(got, url, storage_options=opts)
    assert torch.equal(got["v"], torch.full((2, 2), 3.0))
    fs, root = fsspec.core.url_to_fs(url, **opts)
    assert not any("/w/" in p for p in fs.find(root)), "the old checkpoint's objects must be gone"


def test_missing_and_uncommitted(storage: tuple[str, dict[str, Any]]) -> None:
    url, opts = storage
    with pytest.raises(zarrckpt.CheckpointNotFoundError, match="no checkpoint"):
        zarrckpt.load({"w": torch.zeros(4)}, url, storage_options=opts)
    zarrckpt.save({"w": torch.ones(4)}, url, storage_options=opts)
    fs, root = fsspec.core.url_to_fs(url, **opts)
    fs.rm_file(f"{root}/zarr.json")  # a save that died before its commit
    with pytest.raises(zarrckpt.IncompleteCheckpointError, match="never committed"):
        zarrckpt.load({"w": torch.zeros(4)}, url, storage_options=opts)


def test_credentials_are_not_stored(s3_url: tuple[str, dict[str, Any]]) -> None:
    url, opts = s3_url
    opts = {**opts, "key": "AKIASECRETKEYID123", "secret": "very-secret-value-987"}
    zarrckpt.save(_state(), url, storage_options=opts)
    fs, root = fsspec.core.url_to_fs(url, **opts)
    for path in fs.find(root):
        data = fs.cat_file(path)
        assert b"AKIASECRETKEYID123" not in data and b"very-secret-value-987" not in data, path


def test_layout_mismatch_lists_differences(tmp_path: Any) -> None:
    url = str(tmp_path / "ck")
    zarrckpt.save({"a": torch.zeros(4, 2), "b": torch.zeros(3), "c": torch.zeros(1), "n": 1}, url)
    target = {"a": torch.zeros(4, 3), "b": torch.zeros(3, dtype=torch.float64), "d": torch.zeros(1), "n": 0}
    with pytest.raises(zarrckpt.LayoutMismatchError) as err:
        zarrckpt.load(target, url)
    text = str(err.value)
    assert "a: shape [4, 2] saved vs [4, 3] expected" in text
    assert "b: dtype float32 saved vs float64 expected" in text
    assert "d: expected, not in the checkpoint" in text and "c: in the checkpoint, not expected" in text
    assert target["n"] == 0 and torch.equal(target["a"], torch.zeros(4, 3)), "nothing may be loaded"
    # strict=False loads the common keys; shape/dtype differences still refuse
    partial = {"c": torch.ones(1), "d": torch.ones(1), "n": 0}
    zarrckpt.load(partial, url, strict=False)
    assert torch.equal(partial["c"], torch.zeros(1)) and torch.equal(partial["d"], torch.ones(1)) and partial["n"] == 1
    with pytest.raises(zarrckpt.LayoutMismatchError, match="shape"):
        zarrckpt.load({"a": torch.zeros(5, 2)}, url, strict=False)


@pytest.mark.parametrize(
    "bad", [{"": torch.zeros(1)}, {"a..b": torch.zeros(1)}, {"a": {"__x": 1}}, {"a/b": 1}, {"a.": 1}]
)
def test_bad_keys_are_refused(tmp_path: Any, bad: dict[str, Any]) -> None:
    with pytest.raises(InvalidKeyError):
        zarrckpt.save(bad, str(tmp_path / "ck"))
    assert not (tmp_path / "ck").exists()


def test_leaf_that_is_also_a_prefix(tmp_path: Any) -> None:
    with pytest.raises(InvalidKeyError, match="both a leaf and the prefix"):
        zarrckpt.save({"a.b": torch.zeros(1), "a": {"b": {"c": torch.zeros(1)}}}, str(tmp_path / "ck"))


@pytest.mark.parametrize(
    "value",
    [
        object(),
        torch.zeros(2, dtype=torch.float8_e4m3fnuz),
        torch.zeros(2, dtype=torch.float8_e5m2fnuz),
        [object()],
        np.zeros(2, ">f4"),
        np.zeros(2, "U3"),
        np.zeros(2, ml_dtypes.bfloat16),
    ],
)
def test_unsupported_values_are_refused(tmp_path: Any, value: Any) -> None:
    with pytest.raises(UnsupportedValueError, match="'v'"):
        zarrckpt.save({"v": value}, str(tmp_path / "ck"))
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("value", [{1, 2}, float("nan"), [b"x", (1, 2)], -math.inf])
def test_typed_values_come_back_as_their_type(tmp_path: Any, value: Any) -> None:
    """Values that plain JSON cannot hold (refused before typed values existed) round-trip exactly."""
    zarrckpt.save({"v": value, "w": torch.ones(2)}, str(tmp_path / "ck"))
    target: dict[str, Any] = {"v": None, "w": torch.zeros(2)}
    zarrckpt.load(target, str(tmp_path / "ck"))
    got = target["v"]
    assert type(got) is type(value) and (got == value or (got != got and value != value)), (got, value)


def test_refuses_to_write_into_foreign_data(tmp_path: Any) -> None:
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "precious.txt").write_text("keep me")
    with pytest.raises(zarrckpt.ZarrckptError, match="not empty"):
        zarrckpt.save({"w": torch.zeros(1)}, str(tmp_path / "ck"), overwrite=True)
    assert (tmp_path / "ck" / "precious.txt").read_text() == "keep me"


def test_leftovers_of_a_failed_save(tmp_path: Any) -> None:
    """A save that died before committing blocks a plain save (it may still be running); overwrite replaces it."""
    url = str(tmp_path / "ck")
    zarrckpt.save({"w": torch.ones(3)}, url)
    (tmp_path / "ck" / "zarr.json").unlink()
    (tmp_path / "ck" / ".zarrckpt-pending.json").write_text('{"save_id": "dead", "started": "then"}')
    with pytest.raises(zarrckpt.IncompleteCheckpointError, match="in progress, or died"):
        zarrckpt.save({"w": torch.full((3,), 2.0)}, url)
    zarrckpt.save({"w": torch.full((3,), 2.0)}, url, overwrite=True)
    got = {"w": torch.zeros(3)}
    zarrckpt.load(got, url)
    assert torch.equal(got["w"], torch.full((3,), 2.0))


def test_a_save_that_lost_its_location_does_not_commit(tmp_path: Any) -> None:
    from zarrckpt.engine import commit as protocol
    from zarrckpt.engine import markers
    from zarrckpt.format.manifest import Manifest
    from zarrckpt.storage.store import Storage

    storage = Storage(str(tmp_path / "ck"))
    first = protocol.prepare(storage, overwrite=False)
    markers.abandon(storage, first)  # it counts as dead (a running save is never replaced), yet goes on
    protocol.prepare(storage, overwrite=False)  # a second save takes over
    with pytest.raises(zarrckpt.ZarrckptError, match="took this location over"):
        protocol.commit(storage, Manifest(first, {}, {}, 1))
    assert not (tmp_path / "ck" / "zarr.json").exists()


def test_corrupt_and_truncated_chunks(tmp_path: Any) -> None:
    url = str(tmp_path / "ck")
    zarrckpt.save({"model": {"w": torch.randn(64, 64)}}, url, chunk_bytes=4096)
    shard = tmp_path / "ck/model/w/c.0.0"
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 0x40
    shard.write_bytes(bytes(raw))
    with pytest.raises(zarrckpt.CorruptChunkError) as err:
        zarrckpt.load({"model": {"w": torch.zeros(64, 64)}}, url)
    assert err.value.key == "model.w" and "model/w/c.0.0" in str(err.value) and "crc32c" in str(err.value)
    shard.write_bytes(bytes(raw[:-500]))
    with pytest.raises(zarrckpt.CorruptChunkError, match="truncated"):
        zarrckpt.load({"model": {"w": torch.zeros(64, 64)}}, url)
    shard.unlink()
    with pytest.raises(zarrckpt.CorruptChunkError, match="missing"):
        zarrckpt.load({"model": {"w": torch.zeros(64, 64)}}, url)


def test_corrupt_manifest_and_unknown_version(tmp_path: Any) -> None:
    url = str(tmp_path / "ck")
    zarrckpt.save({"w": torch.zeros(2)}, url)
    manifest = tmp_path / "ck/zarr.json"
    doc = json.loads(manifest.read_text())
    doc["attributes"]["zarrckpt"]["format_version"] = 99
    manifest.write_text(json.dumps(doc))
    with pytest.raises(zarrckpt.InvalidCheckpointError, match="format version 99"):
        zarrckpt.load({"w": torch.zeros(2)}, url)
    manifest.write_text("{not json")
    with pytest.raises(zarrckpt.InvalidCheckpointError, match="not JSON"):
        zarrckpt.load({"w": torch.zeros(2)}, url)


def test_partial_read_fetches_only_needed_chunks(tmp_path: Any) -> None:
    """A rank that needs one row block reads its chunks, not the whole shard."""
    from zarrckpt.engine.commit import read_manifest
    from zarrckpt.engine.reader import Request, read_regions
    from zarrckpt.format.layout import Box
    from zarrckpt.storage.store import Storage

    url = str(tmp_path / "ck")
    full = torch.randn(256, 256)
    zarrckpt.save({"w": full}, url, chunk_bytes=16 * 1024)  # 16 rows per inner chunk
    storage = Storage(url)
    meta = read_manifest(storage, table=True).arrays["w"]
    dest = np.empty((16, 256), np.float32)
    fetched = read_regions(storage, [Request(meta, Box((32, 0), (16, 256)), dest)])
    assert np.array_equal(dest, full[32:48].numpy())
    assert fetched == 16 * 256 * 4 + 4 + (16 * 16 + 4), "one inner chunk plus the shard index"


def test_bad_urls(s3_url: tuple[str, dict[str, Any]]) -> None:
    with pytest.raises(zarrckpt.ZarrckptError, match="cannot open storage"):
        zarrckpt.save({"w": torch.zeros(1)}, "nosuchproto://bucket/ckpt")
    with pytest.raises(zarrckpt.ZarrckptError, match="empty checkpoint URL"):
        zarrckpt.load({"w": torch.zeros(1)}, "")
    _, opts = s3_url
    with pytest.raises(zarrckpt.ZarrckptError, match="no-such-bucket"):
        zarrckpt.save({"w": torch.zeros(1)}, "s3://no-such-bucket/ckpt", storage_options=opts)
    with pytest.raises(zarrckpt.CheckpointNotFoundError):
        zarrckpt.load({"w": torch.zeros(1)}, "s3://no-such-bucket/ckpt", storage_options=opts)


def test_file_url(tmp_path: Any) -> None:
    url = (tmp_path / "ck").as_uri()  # file:///...
    assert url.startswith("file://")
    want = _state()
    zarrckpt.save(want, url)
    got = _state(fill=False)
    zarrckpt.load(got, url)
    _assert_equal(got, want)
    assert (tmp_path / "ck" / "zarr.json").exists()
