"""The arrays' ``zarr.json`` texts made from templates (zarrckpt.format.arraydoc) are, byte for byte,
what encoding each array's ``to_json()`` gives; so is the manifest made from them."""

from __future__ import annotations

import json
import random

import pytest

from zarrckpt.format import integrity
from zarrckpt.format.array import ArrayMeta
from zarrckpt.format.arraydoc import COMPACT, SPACED, ArrayDocs
from zarrckpt.format.manifest import Manifest
from zarrckpt.types import ArrayKind, Role

DTYPES = ("float32", "bfloat16", "float16", "uint8", "int64", "bool", "complex64", "float8_e4m3fn")
KEYS = ("w", "model.layers.{i}.weight", 'ü.ñ"am\\e.{i}', "a.b.c.d.e.{i}", "emoji.\U0001f600.{i}", "t{i}")
TOPOLOGIES = (
    {},
    {"world_size": 4, "holders": 2},
    {"mesh_shape": [2, 2], "mesh_dim_names": None, "placements": ["Shard(dim=0)", "Replicate()"], "world_size": 4},
    {"placements": ["LocalShard"], "world_size": 1, "holders": 1, "ü": [1.5, True, None]},
)


def _metas(n: int, seed: int) -> list[ArrayMeta]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        shape = tuple(rnd.randint(0, 70) for _ in range(rnd.randint(0, 4)))
        shard = tuple(max(1, s // rnd.randint(1, 3)) for s in shape)
        chunk = tuple(max(1, s // rnd.choice((1, 2))) for s in shard)
        kind = rnd.choice(list(ArrayKind))
        dtype = "uint8" if kind is ArrayKind.BYTES else rnd.choice(DTYPES)
        constant = None
        if rnd.random() < 0.2 and dtype in ("float32", "uint8", "int64"):
            constant = bytes(rnd.randrange(256) & 0x3F for _ in range({"float32": 4, "uint8": 1, "int64": 8}[dtype]))
        per_rank = rnd.choice(("", "", "tensor")) if shape else ""
        meta = ArrayMeta(
            key=rnd.choice(KEYS).format(i=i),
            shape=shape,
            dtype=dtype,
            shard_shape=shard,
            chunk_shape=chunk,
            role=rnd.choice(list(Role)),
            kind=kind,
            topology=dict(rnd.choice(TOPOLOGIES)),
            python_type=rnd.choice(("", "bytearray", "BytesIO")) if kind is ArrayKind.BYTES else "",
            constant=constant,
            per_rank=per_rank,
        )
        out.append(meta)
    return out


@pytest.mark.parametrize("seed", range(3))
def test_a_template_gives_the_encoded_document(seed: int) -> None:
    for meta in _metas(600, seed):
        assert SPACED.text(meta) == json.dumps(meta.to_json(), allow_nan=False), meta
        assert COMPACT.text(meta) == json.dumps(meta.to_json(), allow_nan=False, separators=(",", ":")), meta


def test_arrays_differing_in_shapes_and_keys_share_a_template() -> None:
    docs = ArrayDocs(json.JSONEncoder(allow_nan=False))
    metas = [ArrayMeta(f"m.l{i}.w", (i + 1, 3), "float32", (i + 1, 3), (1, 3), Role.MAIN_WEIGHT) for i in range(50)]
    assert [docs.text(m) for m in metas] == [json.dumps(m.to_json()) for m in metas]
    assert len(docs._templates) == 1


def test_a_document_a_template_cannot_make_is_encoded_whole() -> None:
    """A value spelled as a mark (a topology naming one) leaves the marks not found once: no template."""
    docs = ArrayDocs(json.JSONEncoder(allow_nan=False))
    meta = ArrayMeta("k", (2,), "float32", (2,), (2,), topology={"x": "\x00zarrckpt-key\x00"})
    assert docs.text(meta) == json.dumps(meta.to_json())
    assert list(docs._templates.values()) == [None]


def test_the_manifest_is_the_encoded_document() -> None:
    metas = {m.key: m for m in _metas(400, 7)}
    for unrecorded in ("", "no record"):
        manifest = Manifest(
            "id",
            metas,
            {"step": 3, "name": "ädam", "lr": 0.5},
            4,
            "2026-12-05T00:00:00Z",
            "zarrckpt test",
            {"objects": ["x"]},
            {m.path: {"shape": list(m.shape)} for m in metas.values()},
            integrity.table_ref(b"1234"),
            b"1234",
            unrecorded=unrecorded,
        )
        doc = manifest.to_json()
        if not unrecorded:
            attributes = doc["attributes"]["zarrckpt"]
            attributes[integrity.ATTRIBUTES_DIGEST] = integrity.attributes_digest(attributes)
        assert manifest.dumps() == json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()


def test_group_paths_are_every_parent() -> None:
    from zarrckpt.format.manifest import group_paths

    metas = _metas(300, 11)
    want = {"/".join(m.path.split("/")[:i]) for m in metas for i in range(1, m.path.count("/") + 1)}
    assert group_paths(metas) == sorted(want, key=lambda p: (p.count("/"), p))


def test_frozen_values_are_equal_exactly_when_their_json_is() -> None:
    from zarrckpt.format.jsondoc import frozen

    values: list[object] = [0, 1, True, False, 1.0, 0.0, -0.0, None, "1", "a", [1], (1,), [1.0], [], {}]
    values += [{"a": 1}, {"a": True}, {"a": 1, "b": 2}, {"b": 2, "a": 1}, {"a": [1, {"c": None}]}, {"a": [1, {"c": 0}]}]
    for sort_keys in (False, True):
        for a in values:
            for b in values:
                same = json.dumps(a, sort_keys=sort_keys) == json.dumps(b, sort_keys=sort_keys)
                assert (frozen(a, sort_keys) == frozen(b, sort_keys)) == same, (a, b, sort_keys)


def test_equal_tensor_specs_are_those_of_equal_documents() -> None:
    from zarrckpt.format.layout import Box
    from zarrckpt.plan.rankdesc import RankDescription, TensorSpec

    box = Box((0,), (4,))
    specs = [
        TensorSpec((4,), "float32", ArrayKind.TENSOR, box, {}),
        TensorSpec((4,), "float32", ArrayKind.TENSOR, box, {}),
        TensorSpec((4,), "float32", ArrayKind.TENSOR, box, {"mesh_shape": [2], "placements": ["Shard(dim=0)"]}),
        TensorSpec((4,), "float32", ArrayKind.TENSOR, box, {"placements": ["Shard(dim=0)"], "mesh_shape": [2]}),
        TensorSpec(
            (4,), "float32", ArrayKind.TENSOR, box, {"mesh_shape": [2], "placements": ["Shard(dim=0)"]}, "", "00"
        ),
        TensorSpec((4,), "bfloat16", ArrayKind.TENSOR, box, {}),
        TensorSpec((4,), "uint8", ArrayKind.BYTES, box, {}, "bytearray"),
    ]
    desc = RankDescription.of([(f"k{i}", s) for i, s in enumerate(specs)], {})
    canonical = [json.dumps(s.to_json(), sort_keys=True) for s in specs]
    assert [desc.tensors[f"k{i}"] for i in range(len(specs))] == [
        (sorted(set(canonical), key=canonical.index).index(c),) for c in canonical
    ]


def test_made_arrays_are_constructed_ones() -> None:
    """ArrayMeta.made sets every field (a field added to ArrayMeta but not to it fails here)."""
    from dataclasses import fields

    for meta in _metas(50, 5):
        names = [f.name for f in fields(ArrayMeta) if f.name not in ("committed_crc32c", "crc_segment")]
        made = ArrayMeta.made(**{name: getattr(meta, name) for name in names})
        assert made == meta and hash(made) == hash(meta) and made.topology == meta.topology
        assert set(made.__dict__) == {f.name for f in fields(ArrayMeta)}
        assert made.path == meta.path and made.committed_crc32c == b"" and made.crc_segment is None
