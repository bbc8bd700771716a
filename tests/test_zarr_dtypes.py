"""zarr-python can read TensorStore-written bfloat16 / float8 arrays (and vice versa)."""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import crc32c
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
import zarr

import zarrckpt_dtypes
import zarrckpt_dtypes.zarr_types as zarr_dtypes
from zarrckpt_dtypes.zarr_types import register_zarr_dtypes

EMPTY = 2**64 - 1
BYTES_LE = {"name": "bytes", "configuration": {"endian": "little"}}
SHARDED = [
    {
        "name": "sharding_indexed",
        "configuration": {
            "chunk_shape": [2, 4],
            "codecs": [BYTES_LE, {"name": "crc32c"}],
            "index_codecs": [BYTES_LE, {"name": "crc32c"}],
            "index_location": "start",
        },
    }
]
# zarr name -> (numpy dtype, unsigned int of the same width, special bit patterns)
DTYPES = {
    "bfloat16": (
        ml_dtypes.bfloat16,
        np.uint16,
        [0x7FC1, 0x7F81, 0xFFFF, 0x8000, 0x7F80],
    ),
    "float8_e4m3fn": (ml_dtypes.float8_e4m3fn, np.uint8, [0x7F, 0xFF, 0x80, 0x01]),
    "float8_e5m2": (ml_dtypes.float8_e5m2, np.uint8, [0x7F, 0x7D, 0xFF, 0x80, 0x7C]),
    "float16": (np.float16, np.uint16, [0x7E01, 0xFFFF, 0x8000, 0x7C00]),  # control
}
NAMES = list(DTYPES)


@pytest.fixture(autouse=True)
def _registered() -> None:
    register_zarr_dtypes()


def _ts_create(path: Path, data_type: str, fill_value: object = 0) -> ts.TensorStore:
    metadata = {
        "shape": [6, 4],
        "data_type": data_type,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4, 4]}},
        "fill_value": fill_value,
        "codecs": SHARDED,
    }
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}
    return ts.open({**spec, "metadata": metadata}, create=True).result()


def _bits(name: str) -> np.ndarray:
    _, uint, special = DTYPES[name]
    rng = np.random.default_rng(1234)
    bits = rng.integers(0, np.iinfo(uint).max, size=24, dtype=uint, endpoint=True)
    bits[: len(special)] = special
    return bits.reshape(6, 4)


@pytest.mark.parametrize("name", NAMES)
def test_tensorstore_sharded_array_reads_bit_exact(tmp_path: Path, name: str) -> None:
    np_dtype, uint, _ = DTYPES[name]
    bits = _bits(name)
    _ts_create(tmp_path, name).write(bits.view(np_dtype)).result()
    assert json.loads((tmp_path / "zarr.json").read_text())["data_type"] == name

    arr = zarr.open_array(tmp_path, mode="r", zarr_format=3)
    assert arr.dtype == np.dtype(np_dtype)
    got = arr[...]
    assert got.shape == (6, 4)
    np.testing.assert_array_equal(got.view(uint), bits)
    np.testing.assert_array_equal(arr[4:, 1:3].view(uint), bits[4:, 1:3])  # edge shard


@pytest.mark.parametrize("name", NAMES)
def test_edge_shard_out_of_bounds_chunk_is_empty_marker(tmp_path: Path, name: str) -> None:
    np_dtype, uint, _ = DTYPES[name]
    bits = _bits(name)
    _ts_create(tmp_path, name).write(bits.view(np_dtype)).result()

    shard = (tmp_path / "c" / "1" / "0").read_bytes()  # rows 4..7, only 4..5 exist
    index = shard[:32]
    assert struct.unpack("<I", shard[32:36])[0] == crc32c.crc32c(index)
    (off0, n0), (off1, n1) = np.frombuffer(index, dtype="<u8").reshape(2, 2).tolist()
    assert (off1, n1) == (EMPTY, EMPTY)  # inner chunk rows 6..7: entirely out of bounds
    itemsize = np.dtype(np_dtype).itemsize
    assert (off0, n0) == (36, 8 * itemsize + 4)  # data + crc32c, right after the index
    assert len(shard) == off0 + n0

    got = zarr.open_array(tmp_path, mode="r", zarr_format=3)[4:]
    np.testing.assert_array_equal(got.view(uint), bits[4:])


@pytest.mark.parametrize("fill_value", [0, 0.0, -0.0, 1.5, "NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("name", NAMES)
def test_fill_value_json_matches_tensorstore(tmp_path: Path, name: str, fill_value: object) -> None:
    _, uint, _ = DTYPES[name]
    expected = _ts_create(tmp_path, name, fill_value).read().result()  # nothing written
    got = zarr.open_array(tmp_path, mode="r", zarr_format=3)[...]
    np.testing.assert_array_equal(got.view(uint), expected.view(uint))


# zarr's empty-chunk check compares kind-"V" dtypes (bfloat16) without equal_nan.
@pytest.mark.filterwarnings("ignore:invalid value encountered in equal:RuntimeWarning")
@pytest.mark.parametrize("endian", ["little", "big"])
@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_zarr_python_writes_what_tensorstore_reads(tmp_path: Path, name: str, endian: str) -> None:
    np_dtype, uint, _ = DTYPES[name]
    bits = _bits(name)
    arr = zarr.create_array(
        tmp_path,
        shape=(6, 4),
        dtype=name,
        chunks=(2, 4),
        shards=(4, 4),
        serializer=zarr.codecs.BytesCodec(endian=endian),
        compressors=None,
        fill_value="NaN",
        zarr_format=3,
    )
    arr[...] = bits.view(np_dtype)
    meta = json.loads((tmp_path / "zarr.json").read_text())
    assert (meta["data_type"], meta["fill_value"]) == (name, "NaN")
    inner = meta["codecs"][0]["configuration"]["codecs"][0]
    if np.dtype(np_dtype).itemsize > 1:
        assert inner == {"name": "bytes", "configuration": {"endian": endian}}
    else:
        assert inner == {"name": "bytes"}

    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path)}}
    got = ts.open(spec).result().read().result()
    np.testing.assert_array_equal(got.view(uint), bits)


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_fill_value_json_round_trip(name: str) -> None:
    from zarr.dtype import data_type_registry

    zdtype = data_type_registry.get(name)()
    for value in (0, 0.0, -0.0, 2.0, "NaN", "Infinity", "-Infinity"):
        scalar = zdtype.from_json_scalar(value, zarr_format=3)
        again = zdtype.from_json_scalar(zdtype.to_json_scalar(scalar, zarr_format=3), zarr_format=3)
        assert np.asarray(again).tobytes() == np.asarray(scalar).tobytes()
    # Non-canonical NaN bit patterns survive as hex strings.
    width = 2 * zdtype.item_size
    hex_nan = "0x7fc1" if width == 4 else "0xff"
    scalar = zdtype.from_json_scalar(hex_nan, zarr_format=3)
    assert zdtype.to_json_scalar(scalar, zarr_format=3) == hex_nan
    with pytest.raises(TypeError):
        zdtype.from_json_scalar(True, zarr_format=3)
    with pytest.raises(TypeError):
        zdtype.from_json_scalar("banana", zarr_format=3)


def test_register_is_idempotent_and_respects_existing() -> None:
    from zarr.dtype import data_type_registry as registry

    register_zarr_dtypes()
    register_zarr_dtypes()
    assert registry.get("bfloat16") is zarr_dtypes.BFloat16
    assert registry.get("float8_e4m3fn") is zarr_dtypes.Float8E4M3FN
    assert registry.get("float8_e5m2") is zarr_dtypes.Float8E5M2

    class Theirs(zarr_dtypes.BFloat16):  # stands in for a future built-in bfloat16
        pass

    registry.register("bfloat16", Theirs)
    try:
        register_zarr_dtypes()
        assert registry.get("bfloat16") is Theirs
    finally:
        registry.unregister("bfloat16")
        register_zarr_dtypes()
    assert registry.get("bfloat16") is zarr_dtypes.BFloat16


def test_register_never_raises(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(zarr_dtypes, "_SETUP_ERROR", ImportError("zarr too old"))
    with caplog.at_level(logging.DEBUG, logger=zarr_dtypes.__name__):
        register_zarr_dtypes()
    assert "zarr too old" in caplog.text


def test_one_table_agrees_with_torch_numpy_zarr_and_safetensors(tmp_path: Path) -> None:
    """zarrckpt_dtypes.TABLE is the one dtype table: check every row against the libraries."""
    import torch
    from safetensors.torch import save_file
    from zarr.dtype import data_type_registry, parse_data_type

    from zarrckpt.convert.export import SAFETENSORS_DTYPES
    from zarrckpt.format import dtypes

    assert tuple(d.name for d in zarrckpt_dtypes.TABLE) == dtypes.SUPPORTED
    assert len(set(dtypes.SUPPORTED)) == len(dtypes.SUPPORTED)
    for row in zarrckpt_dtypes.TABLE:
        t = getattr(torch, row.torch)
        values = zarrckpt_dtypes.value_dtype(row.name)
        assert torch.empty(0, dtype=t).element_size() == row.itemsize == values.itemsize, row
        assert dtypes.zarr_name(t) == row.name and dtypes.torch_dtype(row.name) is t
        assert dtypes.storage_dtype(row.name) == np.dtype(row.bits)
        # zarr-python: the core names are built in, the others are this package's classes
        assert row.in_zarr_python == (row.defined_by == "core"), row
        assert (data_type_registry.get(row.name).__module__ == "zarrckpt_dtypes.zarr_types") != row.in_zarr_python
        zdtype = parse_data_type(row.name, zarr_format=3)
        assert zdtype.to_native_dtype() == values, row
        zero = zdtype.from_json_scalar(zarrckpt_dtypes.fill_value(row.name), zarr_format=3)
        assert not np.asarray(zero).astype(np.float64 if row.kind != "complex" else np.complex128).any()
        # safetensors: the name it writes for this torch dtype, or it has none
        if row.safetensors is None:
            assert t not in SAFETENSORS_DTYPES
            with pytest.raises(Exception):  # noqa: B017 - whatever safetensors raises for a dtype it lacks
                save_file({"x": torch.zeros(2, dtype=t)}, tmp_path / "x.safetensors")
        else:
            assert SAFETENSORS_DTYPES[t] == row.safetensors
            save_file({"x": torch.zeros(2, dtype=t)}, tmp_path / "x.safetensors")
            raw = (tmp_path / "x.safetensors").read_bytes()
            header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
            assert header["x"]["dtype"] == row.safetensors, row


def test_float8_e4m3fn_is_not_an_alias_of_float8_e4m3() -> None:
    """zarr-extensions' float8_e4m3 has infinities; float8_e4m3fn (torch, TensorStore) has none."""
    from zarr.dtype import data_type_registry

    assert zarrckpt_dtypes.BY_NAME["float8_e4m3fn"].defined_by == "none"
    assert "float8_e4m3" not in zarrckpt_dtypes.BY_NAME
    with pytest.raises(KeyError):
        data_type_registry.get("float8_e4m3")
    # the encodings differ: 0x78 is +inf in float8_e4m3, 256 in float8_e4m3fn
    assert float(np.array(0x78, np.uint8).view(ml_dtypes.float8_e4m3fn)) == 256.0
    assert np.isinf(float(np.array(0x78, np.uint8).view(ml_dtypes.float8_e4m3)))


@pytest.mark.parametrize("name", [d.name for d in zarrckpt_dtypes.TABLE])
def test_tensorstore_accepts_every_name(tmp_path: Path, name: str) -> None:
    """Each data_type zarrckpt writes opens in TensorStore's zarr3 driver (FORMAT.md says so)."""
    fill = zarrckpt_dtypes.fill_value(name)
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path)}}
    store = ts.open({**spec, "metadata": {"shape": [3], "data_type": name, "fill_value": fill}}, create=True).result()
    assert store.dtype.numpy_dtype == zarrckpt_dtypes.value_dtype(name)


def test_tensorstore_refuses_zarr_extensions_float8_e4m3(tmp_path: Path) -> None:
    """Recorded in FORMAT.md: TensorStore (0.1.86) does not know zarr-extensions' float8_e4m3."""
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path)}}
    with pytest.raises(ValueError, match="float8_e4m3"):
        ts.open({**spec, "metadata": {"shape": [3], "data_type": "float8_e4m3", "fill_value": 0}}, create=True).result()


def test_format_md_lists_exactly_the_table() -> None:
    """docs/FORMAT.md's data type table says what zarrckpt_dtypes.TABLE says, row by row."""
    text = (Path(__file__).parent.parent / "docs" / "FORMAT.md").read_text()
    section = text[text.index("### Data types") : text.index("### Attributes")]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0].startswith("`") and cells[0] != "`data_type`":
            rows[cells[0].strip("`")] = cells
    assert list(rows) == [d.name for d in zarrckpt_dtypes.TABLE]
    for row in zarrckpt_dtypes.TABLE:
        _, torch_name, size, defined_by, in_zarr, tensorstore, safetensors = rows[row.name]
        assert torch_name == f"`torch.{row.torch}`" and int(size) == row.itemsize, row
        expected = {"core": "core spec", "zarr-extensions": "[zarr-extensions]", "none": "**not registered**"}
        assert defined_by.startswith(expected[row.defined_by]), row
        assert in_zarr == ("built in" if row.in_zarr_python else "`zarrckpt_dtypes`"), row
        assert tensorstore == "yes", row  # test_tensorstore_accepts_every_name
        assert safetensors.startswith(f"`{row.safetensors}`" if row.safetensors else "none"), row
