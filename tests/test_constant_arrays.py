"""Constant arrays: metadata only, an exact fill value, "no chunks by design" in the commit record.

0-d tensors (Adam's ``step``) and parts of at most 64 KiB whose elements all have the same bits are
stored without shard objects; zarrckpt, zarr-python and TensorStore read them back bit for bit;
``verify()`` tells them from a lost object, and a chunk a peer adds later is reported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zarrckpt
from zarrckpt.errors import ModifiedCheckpointError
from zarrckpt.format import fill
from zarrckpt.testing import RequestLog, spawn

zarr = pytest.importorskip("zarr")
ts = pytest.importorskip("tensorstore")


def _bits_of(dtype: torch.dtype, pattern: int) -> torch.Tensor:
    """A 0-d tensor of ``dtype`` whose bits are ``pattern``."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.tensor(list(pattern.to_bytes(size, "little")), dtype=torch.uint8)
    return raw.view(dtype).reshape(())


CONSTANTS: dict[str, torch.Tensor] = {
    "neg_zero": torch.full((3, 4), -0.0),
    "nan": torch.full((5,), float("nan")),
    "inf": torch.full((2,), float("-inf"), dtype=torch.float64),
    "tiny": torch.full((2,), 5e-324, dtype=torch.float64),
    "half": torch.full((7,), 65504.0, dtype=torch.float16),
    "bf16": torch.full((4, 4), -2.5, dtype=torch.bfloat16),
    "bf16_neg_zero": _bits_of(torch.bfloat16, 0x8000).expand(3).clone(),
    "f8": torch.full((6,), 448.0, dtype=torch.float8_e4m3fn),
    "f8e5_neg": torch.full((2,), -0.0, dtype=torch.float8_e5m2),
    "cplx": torch.full((3,), complex(1.5, -0.0), dtype=torch.complex64),
    "i64_min": torch.full((2,), -(2**63), dtype=torch.int64),
    "u64_max": torch.full((2,), 2**64 - 1, dtype=torch.uint64),
    "flag": torch.ones(8, dtype=torch.bool),
    "step": torch.tensor(1234.0),
    "i8": torch.tensor(-7, dtype=torch.int8),
    "bytes": torch.full((10,), 7, dtype=torch.uint8),
}
WRITTEN: dict[str, torch.Tensor] = {  # not constant: stored as chunks
    "nan_payload": _bits_of(torch.float32, 0x7FC00001).expand(4).clone(),  # zarr-python drops payloads of some NaNs
    "signalling": _bits_of(torch.float32, 0x7F800001).expand(2).clone(),
    "mixed_zero": torch.tensor([0.0, -0.0]),  # equal values, different bits
    "big": torch.zeros(64 * 1024 // 4 + 1),  # over the 64 KiB a part is checked up to
}


def _same_bits(got: np.ndarray | torch.Tensor, want: torch.Tensor, what: str) -> None:
    if isinstance(got, torch.Tensor):
        got = got.contiguous().reshape(-1).view(torch.uint8).numpy()
    else:
        got = np.ascontiguousarray(got).reshape(-1).view(np.uint8)
    np.testing.assert_array_equal(got, want.contiguous().reshape(-1).view(torch.uint8).numpy(), err_msg=what)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("const") / "ck"
    zarrckpt.save({**CONSTANTS, **WRITTEN}, root)
    return root


def _doc(root: Path, key: str) -> dict[str, Any]:
    return json.loads((root / key / "zarr.json").read_text())


def test_constant_arrays_have_no_objects(saved: Path) -> None:
    for key, want in CONSTANTS.items():
        doc = _doc(saved, key)
        assert not list((saved / key).glob("c*")), key
        assert (
            doc["attributes"]["zarrckpt"]["constant"] is True and doc["attributes"]["zarrckpt"]["format_version"] == 4
        )
        assert (
            fill.from_json(doc["data_type"], doc["fill_value"])
            == want.reshape(-1)[:1].view(torch.uint8).numpy().tobytes()
        )
    for key in WRITTEN:
        assert "constant" not in _doc(saved, key)["attributes"]["zarrckpt"], key
        assert list((saved / key).glob("c.*")), key
    manifest = json.loads((saved / "zarr.json").read_text())["attributes"]["zarrckpt"]
    assert manifest["format_version"] == 4  # (chunk keys "c.0": every array is version 4)
    assert manifest["integrity"]["arrays"]["step"] == {
        "shape": [],
        "data_type": "float32",
        "meta_crc32c": manifest["integrity"]["arrays"]["step"]["meta_crc32c"],
        "constant": True,
    }
    # spelled as the readers take them: JSON numbers where exact, hex for -0.0 and non-core types
    assert _doc(saved, "step")["fill_value"] == 1234.0 and _doc(saved, "neg_zero")["fill_value"] == "0x80000000"
    assert _doc(saved, "bf16")["fill_value"] == "0xc020" and _doc(saved, "nan")["fill_value"] == "NaN"
    assert (
        _doc(saved, "cplx")["fill_value"] == [1.5, "0x80000000"] and _doc(saved, "u64_max")["fill_value"] == 2**64 - 1
    )


def test_loads_are_bit_exact(saved: Path) -> None:
    state = {**CONSTANTS, **WRITTEN}
    target: dict[str, Any] = {k: torch.empty_like(v) for k, v in state.items()}
    zarrckpt.load(target, saved)
    ckpt = zarrckpt.open(saved)
    for key, want in state.items():
        _same_bits(target[key], want, f"load {key}")
        _same_bits(ckpt[key].numpy(), want, f"open {key}")
        if want.dim():
            _same_bits(ckpt[key][1:], want[1:], f"open {key}[1:]")


def test_peers_read_them_bit_exact(saved: Path) -> None:
    group = zarr.open_group(str(saved), mode="r", zarr_format=3)
    for key, want in {**CONSTANTS, **WRITTEN}.items():
        _same_bits(group[key][...], want, f"zarr-python {key}")
        _same_bits(zarr.open_array(str(saved / key), mode="r", zarr_format=3)[...], want, f"zarr.open_array {key}")
        arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(saved / key)}}).result()
        _same_bits(arr.read().result(), want, f"tensorstore {key}")


def test_verify_tells_no_chunks_by_design_from_a_lost_object(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    zarrckpt.save({"step": torch.tensor(3.0), "m": torch.zeros(4, 4), "w": torch.arange(16.0).reshape(4, 4)}, root)
    assert zarrckpt.open(root).verify().ok
    (root / "w/c.0.0").unlink()
    problems = zarrckpt.open(root).verify()["problems"]
    assert len(problems) == 1 and "'w'" in problems[0] and "missing" in problems[0]


@pytest.mark.parametrize("key", ["step", "m"])
def test_a_chunk_a_peer_adds_is_reported(tmp_path: Path, key: str) -> None:
    root = tmp_path / "ck"
    zarrckpt.save({"step": torch.tensor(3.0), "m": torch.zeros(4, 4)}, root)
    if key == "step":  # zarr-python 3.1 cannot write a 0-d sharded array (IndexError): TensorStore can
        arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(root / key)}}).result()
        arr.write(np.float32(5.0)).result()
    else:  # zarr-python writes the shard it took for all fill value
        zarr.open_array(str(root / key), mode="r+", zarr_format=3)[...] = 5.0
    assert list((root / key).glob("c*"))  # ("c": a 0-d array's one chunk)
    problems = zarrckpt.open(root).verify()["problems"]
    assert len(problems) == 1 and "constant array" in problems[0] and "another writer" in problems[0]
    with pytest.raises(ModifiedCheckpointError, match="written after commit"):
        from zarrckpt.engine.verify import verify_array

        ckpt = zarrckpt.open(root)
        verify_array(ckpt.storage, ckpt.manifest.arrays[key])
    peer = zarrckpt.open(root, allow_modified=True)  # as it is now: the peer's values
    assert (peer[key].numpy() == 5.0).all() and peer.verify().ok
    target = {key: torch.zeros(()) if key == "step" else torch.zeros(4, 4)}
    zarrckpt.load(target, root, allow_modified=True, strict=False)
    assert (target[key] == 5.0).all()


def test_a_manifest_edit_of_the_constant_is_refused(tmp_path: Path) -> None:
    """The constant is part of the committed metadata: changing it (or the "constant" flag) is a modification."""
    root = tmp_path / "ck"
    zarrckpt.save({"step": torch.tensor(3.0), "w": torch.arange(4.0)}, root)
    manifest = root / "zarr.json"
    doc = json.loads(manifest.read_text())
    doc["consolidated_metadata"]["metadata"]["step"]["fill_value"] = 4.0
    manifest.write_text(json.dumps(doc))
    with pytest.raises(ModifiedCheckpointError, match="constant value"):
        zarrckpt.load({"step": torch.zeros(())}, root, strict=False)
    doc["consolidated_metadata"]["metadata"]["step"]["fill_value"] = 0.0  # now an ordinary array whose chunk is lost
    del doc["consolidated_metadata"]["metadata"]["step"]["attributes"]["zarrckpt"]["constant"]
    manifest.write_text(json.dumps(doc))
    with pytest.raises(ModifiedCheckpointError, match="constant value"):
        zarrckpt.load({"step": torch.zeros(())}, root, strict=False)


def test_every_array_of_a_save_is_version_4(tmp_path: Path) -> None:
    """Arrays and manifest are version 4, the oldest that describes their chunk keys ("c.0"), with
    constant arrays or without."""
    root = tmp_path / "ck"
    zarrckpt.save({"w": torch.arange(4.0), "big": torch.zeros(20000)}, root)
    assert json.loads((root / "zarr.json").read_text())["attributes"]["zarrckpt"]["format_version"] == 4
    for key in ("w", "big"):
        doc = _doc(root, key)
        assert doc["attributes"]["zarrckpt"]["format_version"] == 4, key
        assert doc["chunk_key_encoding"] == {"name": "default", "configuration": {"separator": "."}}, key
    assert sorted(p.name for p in (root / "w").iterdir()) == ["c.0", "zarr.json"]


def test_invalid_constant_fill_value_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    zarrckpt.save({"step": torch.tensor(3.0)}, root)
    manifest = root / "zarr.json"
    doc = json.loads(manifest.read_text())
    doc["consolidated_metadata"]["metadata"]["step"]["fill_value"] = "three"
    manifest.write_text(json.dumps(doc))
    with pytest.raises(zarrckpt.InvalidCheckpointError, match="not a float32 value of a constant array"):
        zarrckpt.open(root)


# --- several ranks: all holders must agree ---


def _save_parts(rank: int, world: int, url: str, opts: dict[str, Any]) -> None:
    rows = 4
    lo = rank * rows
    state = {
        "zeros": zarrckpt.LocalShard(torch.zeros(rows, 8), (rows * world, 8), (lo, 0)),  # every part zero
        "split": zarrckpt.LocalShard(torch.full((rows, 8), float(rank == 0)), (rows * world, 8), (lo, 0)),
        "step": torch.tensor(10.0),  # replicated on every rank
    }
    zarrckpt.save(state, url, storage_options=opts, small_tensor_bytes=0)  # a shard per part, not one per tensor


def _puts(log: RequestLog, url: str) -> list[str]:
    prefix = url.split("://", 1)[1]
    return sorted(r.path.split(prefix, 1)[1] for r in log.requests(url) if r.kind == "PUT")


def test_save_on_s3_writes_no_object_for_agreeing_constants(
    s3_url: tuple[str, dict[str, Any]], s3_requests: RequestLog
) -> None:
    url, opts = s3_url
    spawn(2, _save_parts, url, opts)
    puts = _puts(s3_requests, url)
    shards = [p for p in puts if "/c." in p or p.endswith("/c")]
    assert shards == ["/split/c.0.0", "/split/c.1.0"]  # rank 1's part is all zeros but rank 0's is not
    assert "/zeros/zarr.json" in puts and "/step/zarr.json" in puts
    target = {"zeros": torch.ones(8, 8), "split": torch.zeros(8, 8), "step": torch.zeros(())}
    s3_requests.clear()
    zarrckpt.load(target, url, storage_options=opts)
    assert torch.equal(target["zeros"], torch.zeros(8, 8)) and target["step"].item() == 10.0
    assert torch.equal(target["split"], torch.cat([torch.ones(4, 8), torch.zeros(4, 8)]))
    prefix = url.split("://", 1)[1]
    gets = [r.path.split(prefix, 1)[1] for r in s3_requests.requests(url) if r.kind == "GET"]
    assert sorted(p for p in gets if not p.endswith("zarr.json")) == [
        "/.zarrckpt-crc32c",
        "/split/c.0.0",
        "/split/c.1.0",
    ]


def _adam_state() -> dict[str, Any]:
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.Adam(model.parameters())
    model.weight.grad = torch.randn_like(model.weight)
    model.bias.grad = torch.zeros_like(model.bias)  # its moments stay all zero
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def test_adam_state_on_s3(s3_url: tuple[str, dict[str, Any]], s3_requests: RequestLog) -> None:
    """Step counters and all-zero moments: no objects (counted at the server); the load is exact."""
    url, opts = s3_url
    torch.manual_seed(0)
    state = _adam_state()
    s3_requests.clear()
    zarrckpt.save(state, url, storage_options=opts, small_tensor_bytes=0)  # a shard per part, not one per tensor
    shards = sorted(p for p in _puts(s3_requests, url) if not p.endswith(".json"))
    assert shards == [
        "/.zarrckpt-crc32c",  # the commit record's chunk checksums (format version 3)
        "/model/bias/c.0",
        "/model/weight/c.0.0",
        "/optim/state/0/exp_avg/c.0.0",
        "/optim/state/0/exp_avg_sq/c.0.0",
    ]  # no object for optim.state.{0,1}.step nor for optim.state.1.exp_avg / exp_avg_sq
    ckpt = zarrckpt.open(url, storage_options=opts)
    assert {k for k, m in ckpt.manifest.arrays.items() if m.constant is not None} == {
        "optim.state.0.step",
        "optim.state.1.step",
        "optim.state.1.exp_avg",
        "optim.state.1.exp_avg_sq",
    }
    assert ckpt.verify().ok
    torch.manual_seed(1)
    target = _adam_state()
    zarrckpt.load(target, url, storage_options=opts)
    for key in ("weight", "bias"):
        assert torch.equal(target["model"][key], state["model"][key])
    for n in (0, 1):
        for name, want in state["optim"]["state"][n].items():
            _same_bits(target["optim"]["state"][n][name], want, f"{n}.{name}")


def test_a_peer_edit_of_the_arrays_own_document_is_reported(tmp_path: Path) -> None:
    """Generic Zarr readers go by the array's own zarr.json: verify() compares it with the manifest."""
    root = tmp_path / "ck"
    zarrckpt.save({"step": torch.tensor(3.0)}, root)
    doc = _doc(root, "step")
    doc["fill_value"] = 4.0
    (root / "step" / "zarr.json").write_text(json.dumps(doc))
    (problem,) = zarrckpt.open(root).verify()["problems"]
    assert "modified after commit" in problem and "(constant 3.0 -> 4.0)" in problem
    assert zarr.open_array(str(root / "step"), mode="r", zarr_format=3)[...] == 4.0  # what peers now read


def test_dcp_sees_a_constant_array_in_the_manifest(tmp_path: Path) -> None:
    """Read through ZarrReader: a constant array's chunks lie in the manifest (it has no objects),
    an ordinary array's in its shard objects; dcp.load fills both."""
    import torch.distributed.checkpoint as dcp

    url = tmp_path / "ckpt"
    zarrckpt.save({"step": torch.tensor(3.0), "w": torch.arange(4.0)}, url)
    md = zarrckpt.ZarrReader(url).read_metadata()
    where = {index.fqn: info for index, info in md.storage_data.items()}
    assert where["step"].relative_path == "zarr.json" and where["step"].length == (url / "zarr.json").stat().st_size
    assert (url / where["w"].relative_path).stat().st_size == where["w"].length
    target = {"step": torch.tensor(0.0), "w": torch.zeros(4)}
    dcp.load(target, storage_reader=zarrckpt.ZarrReader(url))
    assert target["step"].item() == 3.0 and torch.equal(target["w"], torch.arange(4.0))


_FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.integers(min_value=-(2**64), max_value=2**64).map(float),
    st.sampled_from([65504.0, 65519.99, 65520.0, 3.4028235e38, 3.4028236e38, 1e39, 5e-324, -0.0, 2.0**-25]),
)


@settings(max_examples=400, deadline=None)
@given(value=_FLOATS, name=st.sampled_from(["float16", "float32", "float64", "bfloat16", "float8_e4m3fn"]))
def test_fill_values_round_as_numpy_does(value: float, name: str) -> None:
    """``fill_value`` numbers become element bits without numpy for the core float types (so that
    reading a manifest imports none): numpy's own rounding is the oracle, overflow to infinity and
    NaN included, and the bits spell back as a fill value that means them again."""
    with np.errstate(over="ignore"):
        expected = np.array(value, dtype=np.float64).astype(fill.value_dtype(name)).tobytes()
    assert fill.from_json(name, value) == expected
    if fill.storable(name, expected):
        assert fill.from_json(name, fill.to_json(name, expected)) == expected
    else:  # only NaNs other than the type's canonical one cannot be constants
        assert np.isnan(np.frombuffer(expected, dtype=fill.value_dtype(name))[0])


def test_a_fill_value_beyond_float64_is_no_value() -> None:
    """A JSON integer too large for a float64 (crafted metadata) is no fill value of a float type:
    None, which the manifest's parser turns into InvalidCheckpointError (it raised OverflowError)."""
    for name in ("float16", "float32", "float64", "bfloat16", "complex64"):
        value: object = [10**400, 0] if name == "complex64" else 10**400
        assert fill.from_json(name, value) is None
