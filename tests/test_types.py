"""The typed API (zarrckpt.types): its StrEnums store exactly the strings checkpoints always held."""

from __future__ import annotations

import io
import json
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import torch

import zarrckpt
from zarrckpt.convert.importer import SOURCE_KINDS
from zarrckpt.example.config import ExpertDP, ModelConfig, Topology
from zarrckpt.format.array import ARRAY_KINDS
from zarrckpt.format.keys import ROLES
from zarrckpt.types import ArrayKind, Role, SourceKind

# the strings written to (and accepted from) every checkpoint so far, spelled out: never to change
STORED_ROLES = ("main_weight", "first_moment", "second_moment", "optimizer_step", "buffer", "other")
STORED_KINDS = ("tensor", "bytes", "ndarray")


def test_enums_hold_the_stored_strings() -> None:
    assert tuple(Role) == ROLES == STORED_ROLES
    assert tuple(ArrayKind) == ARRAY_KINDS == STORED_KINDS
    assert tuple(SourceKind) == SOURCE_KINDS == ("dcp", "torch", "safetensors")
    assert all(type(r) is str for r in (*ROLES, *ARRAY_KINDS, *SOURCE_KINDS))  # plain strings, as before
    assert Role.MAIN_WEIGHT == "main_weight" and f"{Role.MAIN_WEIGHT}" == str(Role.MAIN_WEIGHT) == "main_weight"
    stored = json.dumps({"role": Role.FIRST_MOMENT, "kind": ArrayKind.BYTES})
    assert stored == '{"role": "first_moment", "kind": "bytes"}'


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("types") / "ck"
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {
        "model": {"fc": {"weight": weight}, "bn": {"running_mean": torch.zeros(4)}, "count": torch.arange(3)},
        "optim": {
            "state": {"0": {"exp_avg": torch.ones(3, 4), "exp_avg_sq": torch.ones(3, 4), "step": torch.tensor(5.0)}}
        },
        "trainer": {"blob": b"abc", "buf": io.BytesIO(b"de"), "table": np.arange(4, dtype=np.int16), "step": 5},
    }
    zarrckpt.save(state, str(path))
    return path


EXPECTED = {
    "model.fc.weight": ("main_weight", "tensor"),
    "model.bn.running_mean": ("buffer", "tensor"),
    "model.count": ("buffer", "tensor"),
    "optim.state.0.exp_avg": ("first_moment", "tensor"),
    "optim.state.0.exp_avg_sq": ("second_moment", "tensor"),
    "optim.state.0.step": ("optimizer_step", "tensor"),
    "trainer.blob": ("other", "bytes"),
    "trainer.buf": ("other", "bytes"),
    "trainer.table": ("other", "ndarray"),
}


@pytest.mark.parametrize("key", sorted(EXPECTED))
def test_array_zarr_json_bytes_hold_the_plain_strings(saved: Path, key: str) -> None:
    role, kind = EXPECTED[key]
    raw = (saved / key.replace(".", "/") / "zarr.json").read_bytes()
    doc = json.loads(raw)
    assert json.dumps(doc, allow_nan=False).encode() == raw  # the bytes plain strings give, exactly
    assert f'"role": "{role}", "kind": "{kind}"'.encode() in raw
    attrs = doc["attributes"]["zarrckpt"]
    assert (attrs["role"], attrs["kind"]) == (role, kind)


def test_manifest_bytes_hold_the_plain_strings(saved: Path) -> None:
    raw = (saved / "zarr.json").read_bytes()
    nodes = json.loads(raw)["consolidated_metadata"]["metadata"]
    for key, (role, kind) in EXPECTED.items():
        attrs = nodes[key.replace(".", "/")]["attributes"]["zarrckpt"]
        assert (attrs["role"], attrs["kind"]) == (role, kind)
    assert raw.count(b'"role":"main_weight","kind":"tensor"') == 1
    assert raw.count(b'"role":"other","kind":"bytes"') == 2
    assert raw.count(b'"role":"other","kind":"ndarray"') == 1


def test_reads_hand_out_the_enums(saved: Path) -> None:
    ckpt = zarrckpt.open(str(saved))
    view = ckpt["model.fc.weight"]
    assert view.role is Role.MAIN_WEIGHT and view.meta.kind is ArrayKind.TENSOR
    assert ckpt["trainer.table"].meta.kind is ArrayKind.NDARRAY
    rows = {r["key"]: r["role"] for r in ckpt.tensors()}
    assert rows == {k: role for k, (role, _) in EXPECTED.items()}
    assert json.loads(json.dumps(ckpt.tensors()))[0]["role"] == ckpt.tensors()[0]["role"]


def test_export_accepts_roles_as_enums_or_strings(saved: Path, tmp_path: Path) -> None:
    a = zarrckpt.export_safetensors(str(saved), tmp_path / "a", roles=[Role.MAIN_WEIGHT, "buffer"])
    b = zarrckpt.export_safetensors(str(saved), tmp_path / "b", roles=["main_weight", Role.BUFFER])
    assert a["tensors"] == b["tensors"] == 3


def test_saved_world_size_and_the_deprecated_topology(saved: Path) -> None:
    ckpt = zarrckpt.open(str(saved))
    assert ckpt.saved_world_size == 1
    with pytest.warns(DeprecationWarning, match="saved_world_size"):
        assert ckpt.topology == {"world_size": 1}


def test_expert_dp_is_an_enum_that_takes_its_names() -> None:
    topo = Topology(4, 1, 2, "sharded").resolved(ModelConfig())  # type: ignore[arg-type]  # as from JSON / argv
    assert topo.expert_dp is ExpertDP.SHARDED and str(topo) == "PP1xEP2xEP-DP2 (sharded)"
    assert Topology(4).resolved(ModelConfig()).expert_dp is ExpertDP.REPLICATED
    with pytest.raises(ValueError, match="expert_dp must be"):
        Topology(4, expert_dp="both").resolved(ModelConfig())  # type: ignore[arg-type]


@pytest.mark.parametrize("package", ["zarrckpt", "zarrckpt_dtypes"])
def test_packages_are_marked_typed(package: str) -> None:
    assert resources.files(package).joinpath("py.typed").is_file()
