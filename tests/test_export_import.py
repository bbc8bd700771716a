"""``zarrckpt export`` (safetensors, streamed) and ``zarrckpt import`` (DCP, torch.save, safetensors)."""

from __future__ import annotations

import json
import os
import pickle
import re
import struct
import tracemalloc
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from states import SPECS, global_tensor, mixed_state

import zarrckpt
from zarrckpt.cli import commands as cli
from zarrckpt.convert.export import export_safetensors, parse_size
from zarrckpt.convert.importer import detect_kind, import_checkpoint
from zarrckpt.format.keys import flat_key, iter_leaves
from zarrckpt.testing import spawn

G = torch.Generator().manual_seed(5)


def bits(t: torch.Tensor) -> torch.Tensor:
    """float8 as raw bits (torch.equal does not support float8)."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def state() -> dict[str, Any]:
    w = torch.randn(24, 16, generator=G)
    return {
        "model": {
            "embed": {"weight": torch.randn(40, 8, generator=G)},
            "layers": {
                "0": {"w": w, "norm": torch.randn(16, generator=G).bfloat16()},
                "1": {
                    "w": torch.randn(24, 16, generator=G).half(),
                    "fp8": torch.randn(6, 4, generator=G).to(torch.float8_e4m3fn),
                },
            },
            "scale": torch.tensor(0.5),
            "empty": torch.zeros(0, 3),
            "mask": torch.tensor([True, False, True]),
            "ids": torch.arange(7, dtype=torch.int64),
            "small": torch.arange(-4, 4, dtype=torch.int8),
        },
        "optim": {
            "state": {
                "model.layers.0.w": {
                    "step": torch.tensor(3.0),
                    "exp_avg": torch.randn(24, 16, generator=G),
                    "exp_avg_sq": torch.rand(24, 16, generator=G),
                }
            },
            "param_groups": [{"lr": 0.01, "betas": [0.9, 0.95], "params": ["model.layers.0.w"]}],
        },
        "trainer": {"step": 12, "name": "run"},
    }


STATE = state()
FLAT = {flat_key(path): leaf for path, leaf in iter_leaves(STATE) if isinstance(leaf, torch.Tensor)}
WEIGHTS = [k for k in FLAT if k.startswith("model.") and FLAT[k].is_floating_point()]


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    u = str(tmp_path_factory.mktemp("exp") / "ck")
    zarrckpt.save(STATE, u, chunk_bytes=256)  # many small inner chunks
    return u


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def header(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0
    return dict(json.loads(raw[8 : 8 + n]))


# --- export -------------------------------------------------------------------------------------


def test_export_equals_checkpoint(url: str, tmp_path: Path) -> None:
    summary = export_safetensors(url, tmp_path / "out")
    assert summary["files"] == ["model.safetensors"] and summary["index"] is None
    assert sorted(os.listdir(tmp_path / "out")) == ["model.safetensors"]
    assert summary["tensors"] == len(FLAT) and summary["bytes"] == sum(t.nbytes for t in FLAT.values())
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(got) == sorted(FLAT)
    for key, want in FLAT.items():
        assert same(got[key], want), key
    hdr = header(tmp_path / "out" / "model.safetensors")
    assert hdr.pop("__metadata__") == {"format": "pt"}
    assert hdr["model.layers.1.fp8"]["dtype"] == "F8_E4M3" and hdr["model.scale"]["shape"] == []
    # every tensor starts aligned to its element size
    for entry in hdr.values():
        size = {"F64": 8, "I64": 8, "F32": 4, "F16": 2, "BF16": 2}.get(entry["dtype"], 1)
        assert entry["data_offsets"][0] % size == 0


def test_export_dtype_cast_role_include_strip(url: str, tmp_path: Path) -> None:
    s = export_safetensors(url, tmp_path / "a", dtype="bf16", roles=["main_weight"], strip_prefix="model.")
    got = load_file(tmp_path / "a" / "model.safetensors")
    assert s["dtype"] == "bfloat16" and sorted(got) == sorted(k.removeprefix("model.") for k in WEIGHTS)
    for key in WEIGHTS:
        assert same(got[key.removeprefix("model.")], FLAT[key].to(torch.bfloat16)), key

    export_safetensors(url, tmp_path / "b", roles=["first_moment", "second_moment"], dtype=torch.float16)
    got = load_file(tmp_path / "b" / "model.safetensors")
    moments = "optim.state.model.layers.0.w.exp_avg"
    assert sorted(got) == [moments, moments + "_sq"]
    assert same(got[moments], FLAT[moments].half())

    export_safetensors(url, tmp_path / "c", include=["model.layers.*", "*.ids"], dtype="fp32")
    got = load_file(tmp_path / "c" / "model.safetensors")
    assert sorted(got) == sorted(k for k in FLAT if k.startswith("model.layers.") or k == "model.ids")
    assert same(got["model.ids"], FLAT["model.ids"])  # integers are never cast
    assert same(got["model.layers.1.fp8"], FLAT["model.layers.1.fp8"].float())


def test_export_shards_and_index(url: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    limit = 2000  # 40x8 fp32 (1280 B) and the 24x16 fp32 (1536 B) tensors make files of their own
    s = export_safetensors(url, out, max_shard_bytes=limit)
    n = len(s["files"])
    assert n >= 4 and s["files"] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert s["index"] == "model.safetensors.index.json"
    assert sorted(os.listdir(out)) == sorted([*s["files"], s["index"]])
    index = json.loads((out / s["index"]).read_text())
    assert index["metadata"] == {"total_size": sum(t.nbytes for t in FLAT.values())}
    assert sorted(index["weight_map"]) == sorted(FLAT) and set(index["weight_map"].values()) == set(s["files"])
    for name in s["files"]:
        got = load_file(out / name)
        assert sorted(got) == sorted(k for k, f in index["weight_map"].items() if f == name)
        assert sum(t.nbytes for t in got.values()) <= limit or len(got) == 1
        for key, t in got.items():
            assert same(t, FLAT[key])
    # keys keep their sorted order across files (greedy packing)
    order = [index["weight_map"][k] for k in sorted(FLAT)]
    assert order == sorted(order)

    # overwrite replaces the earlier export, leaving no stale shards or index behind
    (out / "README.md").write_text("keep me")
    s2 = export_safetensors(url, out, overwrite=True)
    assert sorted(os.listdir(out)) == ["README.md", "model.safetensors"] and s2["files"] == ["model.safetensors"]


def test_export_refuses_a_checkpoint_replaced_meanwhile(tmp_path: Path) -> None:
    u = str(tmp_path / "ck")
    zarrckpt.save({"w": torch.zeros(64, 4)}, u)
    ckpt = zarrckpt.open(u)
    zarrckpt.save({"w": torch.ones(64, 4)}, u, overwrite=True)
    with pytest.raises(zarrckpt.IncompleteCheckpointError, match="overwritten"):
        export_safetensors(ckpt, tmp_path / "out", max_shard_bytes=512)
    assert os.listdir(tmp_path / "out") == []  # nothing half-published, no partial files


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 500 * 10**6
    assert parse_size("2GiB") == 2 << 30 and parse_size("1.5kb") == 1500 and parse_size(123) == 123
    for bad in ("5XB", "", "-1", "0", "GB"):
        with pytest.raises(zarrckpt.ZarrckptError, match="bad size"):
            parse_size(bad)


def test_export_errors(url: str, tmp_path: Path) -> None:
    with pytest.raises(zarrckpt.ZarrckptError, match=r"unknown role.*'weight'.*main_weight"):
        export_safetensors(url, tmp_path / "a", roles=["weight"])
    with pytest.raises(zarrckpt.ZarrckptError, match="cannot export as dtype 'int4'"):
        export_safetensors(url, tmp_path / "a", dtype="int4")
    with pytest.raises(zarrckpt.ZarrckptError, match="choose bf16, fp16 or fp32"):
        export_safetensors(url, tmp_path / "a", dtype=torch.int8)
    with pytest.raises(zarrckpt.ZarrckptError, match=r"no tensors to export.*include"):
        export_safetensors(url, tmp_path / "a", include="nothing.*")
    clash = str(tmp_path / "clash")
    zarrckpt.save({"w": torch.ones(1), "model": {"w": torch.zeros(1)}}, clash)
    with pytest.raises(zarrckpt.ZarrckptError, match=r"keys 'model\.w' and 'w' both become 'w'"):
        export_safetensors(clash, tmp_path / "a", strip_prefix="model.")
    export_safetensors(url, tmp_path / "a", include="model.layers.*.w", strip_prefix="model.layers.")
    assert sorted(load_file(tmp_path / "a" / "model.safetensors")) == ["0.w", "1.w"]
    with pytest.raises(zarrckpt.ZarrckptError, match="not empty"):
        export_safetensors(url, tmp_path / "a")
    with pytest.raises(zarrckpt.CheckpointNotFoundError):
        export_safetensors(tmp_path / "missing", tmp_path / "b")
    with pytest.raises(zarrckpt.ZarrckptError, match="local directory"):
        export_safetensors(url, "s3://bucket/out")
    assert not (tmp_path / "b").exists()


def test_export_streams_in_bounded_memory(tmp_path: Path) -> None:
    big = torch.randn(256, 2048, generator=G)  # 2 MiB, 32x the block bound
    wide = torch.randn(2, 65536, generator=G)  # one row (256 KiB) is 4x the block bound
    src = str(tmp_path / "ck")
    zarrckpt.save({"big": big, "wide": wide}, src, chunk_bytes=16 << 10)
    ckpt = zarrckpt.open(src)

    def peak(out: str, block: int) -> int:
        tracemalloc.start()
        try:
            export_safetensors(ckpt, tmp_path / out, block_bytes=block, dtype="fp32")
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    streamed = peak("streamed", 64 << 10)
    got = load_file(tmp_path / "streamed" / "model.safetensors")
    assert same(got["big"], big) and same(got["wide"], wide)
    assert streamed < 512 << 10, streamed  # ~2 blocks in flight, never a whole 2 MiB tensor
    whole = peak("whole", 64 << 20)  # the same check catches an export that reads tensors whole
    assert whole > big.nbytes, whole


# --- import -------------------------------------------------------------------------------------


def check_imported(u: str, want: dict[str, torch.Tensor], values: dict[str, Any] | None = None) -> None:
    ckpt = zarrckpt.open(u)
    assert ckpt.keys() == sorted(want)
    for key, t in want.items():
        assert same(ckpt[key].read(), t), key
    if values is not None:
        assert ckpt.metadata == values


SAVED_VALUES = {
    "optim": {"param_groups": {"0": {"lr": 0.01, "betas": [0.9, 0.95], "params": ["model.layers.0.w"]}}},
    "trainer": {"step": 12, "name": "run"},
}


def test_import_dcp(tmp_path: Path) -> None:
    src = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(STATE, checkpoint_id=src, no_dist=True)
    assert detect_kind(src) == "dcp"
    s = import_checkpoint(src, tmp_path / "ck")
    assert s["kind"] == "dcp" and s["tensors"] == len(FLAT) and s["values"] == 5
    check_imported(str(tmp_path / "ck"), FLAT, SAVED_VALUES)


def _dcp_save_rank(rank: int, world: int, path: str) -> None:
    dcp.save(mixed_state(rank, world, fill=True, save_world=world), checkpoint_id=path)


@pytest.mark.slow
def test_import_dcp_saved_by_two_ranks(tmp_path: Path) -> None:
    """DTensors sharded over 2 gloo ranks (several chunks per tensor), per-rank keys, bytes, RNG state."""
    src = tmp_path / "dcp"
    spawn(2, _dcp_save_rank, str(src))
    s = import_checkpoint(src, tmp_path / "ck")
    ckpt = zarrckpt.open(str(tmp_path / "ck"))
    assert s["kind"] == "dcp" and s["tensors"] == len(ckpt)
    for key in SPECS:
        assert same(ckpt[key].read(), global_tensor(key)), key
    for stage in range(2):
        assert same(ckpt[f"model.stage{stage}.w"].read(), torch.full((4, 3), float(stage + 1)))
    assert same(ckpt["rng.torch"].read(), torch.Generator().manual_seed(7).get_state())
    assert same(ckpt["rank1.blob"].read(), torch.tensor([1] * 5, dtype=torch.uint8))
    meta = ckpt.metadata
    assert meta["step"] == 1000 and meta["rank1"] == {"seed": 11}
    assert meta["config"] == {"name": "tiny-moe", "layers": [1, 2, 3], "lr": 3e-4, "flags": {"fused": True}}


def test_import_torch_save(tmp_path: Path) -> None:
    legacy_state = state()
    del legacy_state["model"]["layers"]["1"]["fp8"]  # torch's legacy format cannot hold float8
    for legacy, sd in ((False, STATE), (True, legacy_state)):
        src = tmp_path / f"state{legacy}.pt"
        torch.save(sd, src, _use_new_zipfile_serialization=not legacy)
        assert detect_kind(src) == "torch"
        s = import_checkpoint(src, tmp_path / f"ck{legacy}")
        want = {flat_key(path): leaf for path, leaf in iter_leaves(sd) if isinstance(leaf, torch.Tensor)}
        assert s["kind"] == "torch" and s["bytes"] == sum(t.nbytes for t in want.values())
        check_imported(str(tmp_path / f"ck{legacy}"), want, SAVED_VALUES)

    x = torch.randn(4, 6, generator=G)  # views share storage; a Parameter is a tensor
    views = {"x": x, "t": x.t(), "part": x[1:3, ::2], "p": torch.nn.Parameter(torch.ones(2))}
    torch.save(views, tmp_path / "views.pt")
    import_checkpoint(tmp_path / "views.pt", tmp_path / "views")
    check_imported(str(tmp_path / "views"), {k: v.detach().contiguous() for k, v in views.items()}, {})


def test_import_safetensors_single_and_sharded(tmp_path: Path) -> None:
    tensors = {k: v.contiguous() for k, v in FLAT.items()}
    save_file(tensors, tmp_path / "one.safetensors", metadata={"format": "pt"})
    assert detect_kind(tmp_path / "one.safetensors") == "safetensors"
    import_checkpoint(tmp_path / "one.safetensors", tmp_path / "ck1")
    check_imported(str(tmp_path / "ck1"), tensors, {})

    # HF-style sharding written by the safetensors library itself, plus an index
    shard_dir = tmp_path / "hf"
    shard_dir.mkdir()
    keys = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, ks in parts.items():
        save_file({k: tensors[k] for k in ks}, shard_dir / name)
    weight_map = {k: name for name, ks in parts.items() for k in ks}
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    for src in (shard_dir, shard_dir / "model.safetensors.index.json"):
        s = import_checkpoint(src, tmp_path / "ck2", overwrite=True)
        assert s["kind"] == "safetensors" and s["tensors"] == len(tensors)
        check_imported(str(tmp_path / "ck2"), tensors)


def test_round_trip_export_import(url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    export_safetensors(url, tmp_path / "st", max_shard_bytes="3kB")
    import_checkpoint(tmp_path / "st", tmp_path / "back")
    check_imported(str(tmp_path / "back"), FLAT)
    rc, out, _ = run(capsys, "diff", url, str(tmp_path / "back"), "--json")
    report = json.loads(out)
    assert rc == 1 and not any(report[k] for k in ("only_in_a", "only_in_b", "layout", "values"))
    assert {d["key"] for d in report["metadata"]} == {  # non-tensor values are not exported
        "optim.param_groups.0.lr",
        "optim.param_groups.0.betas",
        "optim.param_groups.0.params",
        "trainer.step",
        "trainer.name",
    }


class Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch pwned",))


def test_import_refuses_pickled_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    torch.save({"w": torch.ones(2), "evil": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(zarrckpt.errors.UnsupportedValueError, match="weights_only"):
        import_checkpoint(tmp_path / "evil.pt", tmp_path / "ck")

    src = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2)}, checkpoint_id=src, no_dist=True)
    (src / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(zarrckpt.ZarrckptError, match=r"refusing to load posix.system"):
        import_checkpoint(src, tmp_path / "ck")
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "ck").exists()


def test_import_rejects_bad_safetensors(tmp_path: Path) -> None:
    good = tmp_path / "good.safetensors"
    save_file({"a": torch.arange(4, dtype=torch.int32), "b": torch.ones(2)}, good)
    raw = good.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    doc = json.loads(raw[8 : 8 + n])
    cases = {
        "truncated": raw[:-3],
        "offsets": _with_header(doc, raw, a={"dtype": "I32", "shape": [4], "data_offsets": [0, 12]}),
        "shape": _with_header(doc, raw, a={"dtype": "I32", "shape": [5], "data_offsets": [0, 16]}),
        "dtype": _with_header(doc, raw, a={"dtype": "U16", "shape": [8], "data_offsets": [0, 16]}),
        "length": struct.pack("<Q", 1 << 40) + raw[8:],
    }
    for name, data in cases.items():
        bad = tmp_path / f"{name}.safetensors"
        bad.write_bytes(data)
        with pytest.raises(zarrckpt.ZarrckptError) as exc:
            import_checkpoint(bad, tmp_path / "ck", kind="safetensors")
        assert str(bad) in str(exc.value), name
    assert not (tmp_path / "ck").exists()


def _with_header(doc: dict[str, Any], raw: bytes, **entries: Any) -> bytes:
    (n,) = struct.unpack("<Q", raw[:8])
    new = json.dumps({**doc, **entries}).encode()
    new += b" " * (-len(new) % 8)
    return struct.pack("<Q", len(new)) + new + raw[8 + n :]


def test_import_errors(tmp_path: Path) -> None:
    with pytest.raises(zarrckpt.ZarrckptError, match="does not exist"):
        import_checkpoint(tmp_path / "nope", tmp_path / "ck")
    (tmp_path / "junk.bin").write_bytes(b"hello world, not a checkpoint")
    with pytest.raises(zarrckpt.ZarrckptError, match=r"cannot tell what kind.*--from"):
        import_checkpoint(tmp_path / "junk.bin", tmp_path / "ck")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(zarrckpt.ZarrckptError, match="cannot tell what kind of checkpoint the directory"):
        import_checkpoint(tmp_path / "emptydir", tmp_path / "ck")
    with pytest.raises(zarrckpt.ZarrckptError, match="unknown source kind 'onnx'"):
        import_checkpoint(tmp_path / "junk.bin", tmp_path / "ck", kind="onnx")
    with pytest.raises(zarrckpt.ZarrckptError, match=r"cannot read .* as a torch.save file"):
        import_checkpoint(tmp_path / "junk.bin", tmp_path / "ck", kind="torch")
    torch.save([torch.ones(1)], tmp_path / "list.pt")
    with pytest.raises(zarrckpt.errors.UnsupportedValueError, match="holds a list"):
        import_checkpoint(tmp_path / "list.pt", tmp_path / "ck")

    save_file({"w": torch.ones(3)}, tmp_path / "w.safetensors")
    import_checkpoint(tmp_path / "w.safetensors", tmp_path / "ck")
    with pytest.raises(zarrckpt.CheckpointExistsError, match="overwrite"):
        import_checkpoint(tmp_path / "w.safetensors", tmp_path / "ck")
    save_file({"w": torch.zeros(3)}, tmp_path / "w.safetensors")
    import_checkpoint(tmp_path / "w.safetensors", tmp_path / "ck", overwrite=True)
    check_imported(str(tmp_path / "ck"), {"w": torch.zeros(3)})


# --- CLI ----------------------------------------------------------------------------------------


def test_cli_export_import(url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    rc, text, err = run(
        capsys,
        "export",
        url,
        str(out),
        "--max-shard-size",
        "2kB",
        "--role",
        "main_weight",
        "--role",
        "buffer",
        "--dtype",
        "bf16",
        "--strip-prefix",
        "model.",
        "--json",
        "--progress",
    )
    summary = json.loads(text)
    assert rc == 0 and summary["index"] == "model.safetensors.index.json" and len(summary["files"]) >= 2
    n = summary["tensors"]  # the one progress line (display.Progress); stderr is no terminal: no \r redraws
    assert "\r" not in err and re.fullmatch(rf"export {n}/{n} tensors \[#{{30}}\] 100% [^\n]*/s\n", err), err
    index = json.loads((out / summary["index"]).read_text())
    want = {k.removeprefix("model."): v for k, v in FLAT.items() if k.startswith("model.")}
    assert sorted(index["weight_map"]) == sorted(want) and summary["tensors"] == len(want)
    for name, file in index["weight_map"].items():
        with safe_open(out / file, framework="pt") as f:
            t = f.get_tensor(name)
        assert same(t, want[name].bfloat16() if want[name].is_floating_point() else want[name]), name

    rc, text, _ = run(capsys, "import", str(out), str(tmp_path / "ck"), "--json")
    summary = json.loads(text)
    assert rc == 0 and summary["kind"] == "safetensors" and summary["tensors"] == len(want)
    assert zarrckpt.open(str(tmp_path / "ck"))["layers.0.w"].dtype == torch.bfloat16

    rc, text, _ = run(capsys, "export", url, str(tmp_path / "text"), "--include", "model.embed.*")
    assert rc == 0 and text.startswith("exported 1 tensors, 1.2 KiB") and "model.safetensors" in text
    rc, text, _ = run(capsys, "import", str(tmp_path / "text" / "model.safetensors"), str(tmp_path / "ck2"))
    assert rc == 0 and text.startswith("imported safetensors checkpoint") and "1 tensors" in text


@pytest.mark.parametrize(
    ("argv", "code", "needle"),
    [
        (["export", "{url}", "{tmp}/o", "--role", "weight"], 2, "invalid choice: 'weight'"),
        (["export", "{url}", "{tmp}/o", "--dtype", "int4"], 2, "invalid choice: 'int4'"),
        (["export", "{url}", "{tmp}/o", "--format", "gguf"], 2, "invalid choice: 'gguf'"),
        (["export", "{url}", "{tmp}/o", "--max-shard-size", "5XB"], 3, "bad size '5XB'"),
        (["export", "{tmp}/missing", "{tmp}/o"], 3, "no checkpoint at"),
        (["export", "nope://b/x", "{tmp}/o"], 3, "error: "),
        (["export", "{url}", "{tmp}/o", "--include", "zzz*"], 3, "no tensors to export"),
        (["export", "{url}", "{url}"], 3, "is not empty"),
        (["import", "{tmp}/missing", "{tmp}/ck"], 3, "does not exist"),
        (["import", "{tmp}/junk", "{tmp}/ck"], 3, "cannot tell what kind"),
        (["import", "{tmp}/junk", "{tmp}/ck", "--from", "onnx"], 2, "invalid choice: 'onnx'"),
        (["import", "{tmp}/w.safetensors", "{url}"], 3, "already exists"),
        (["import", "{tmp}/w.safetensors", "nope://b/x"], 3, "error: "),
    ],
)
def test_cli_errors(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], code: int, needle: str
) -> None:
    (tmp_path / "junk").write_bytes(b"not a checkpoint at all")
    save_file({"w": torch.ones(3)}, tmp_path / "w.safetensors")
    args = [a.format(url=url, tmp=tmp_path) for a in argv]
    if code == 2:
        with pytest.raises(SystemExit) as exc:
            cli.main(args)
        assert exc.value.code == 2 and needle in capsys.readouterr().err
        return
    rc, out, err = run(capsys, *args)
    assert rc == code and out == "" and needle in err and err.startswith("error: ") and "Traceback" not in err
    assert not (tmp_path / "o").exists() and not (tmp_path / "ck").exists()


def test_export_from_s3(s3_url: tuple[str, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    u, opts = s3_url
    zarrckpt.save(STATE, u, storage_options=opts)
    s = export_safetensors(u, tmp_path / "a", storage_options=opts, max_shard_bytes=4000, block_bytes=700)
    got: dict[str, torch.Tensor] = {}
    for name in s["files"]:
        got |= load_file(tmp_path / "a" / name)
    assert sorted(got) == sorted(FLAT) and all(same(got[k], FLAT[k]) for k in FLAT)

    options = [f"{k}={json.dumps(v)}" for k, v in opts.items()]
    argv = ["export", u, str(tmp_path / "b"), "--role", "second_moment", "--json"]
    rc, text, _ = run(capsys, *argv, *[x for o in options for x in ("--storage-option", o)])
    assert rc == 0 and json.loads(text)["tensors"] == 1
    key = "optim.state.model.layers.0.w.exp_avg_sq"
    assert same(load_file(tmp_path / "b" / "model.safetensors")[key], FLAT[key])

    s = import_checkpoint(tmp_path / "a", u, storage_options=opts, overwrite=True)
    assert s["tensors"] == len(FLAT)
    back = zarrckpt.open(u, storage_options=opts)
    assert back.metadata == {} and all(same(back[k].read(), FLAT[k]) for k in FLAT)


def test_export_complex_and_unsigned_and_refuse_complex128(tmp_path: Path) -> None:
    """safetensors has C64, U16, U32, U64 but no complex128: exported, and refused with a clear error."""
    g = torch.Generator().manual_seed(11)
    raw = torch.randint(0, 256, (4, 3, 8), generator=g, dtype=torch.uint8)
    state = {
        "c64": raw.view(torch.complex64).reshape(4, 3),
        "u16": raw[:, :, :2].contiguous().view(torch.uint16).reshape(4, 3),
        "u32": raw[:, :, :4].contiguous().view(torch.uint32).reshape(4, 3),
        "u64": raw.view(torch.uint64).reshape(4, 3),
        "c128": torch.zeros(2, dtype=torch.complex128),
    }
    u = str(tmp_path / "ck")
    zarrckpt.save(state, u)
    with pytest.raises(zarrckpt.UnsupportedValueError, match=r"'c128' is complex128, which safetensors cannot"):
        export_safetensors(u, tmp_path / "all")
    assert not (tmp_path / "all").exists() or not any((tmp_path / "all").iterdir())
    export_safetensors(u, tmp_path / "st", include=["c64", "u*"])
    got = load_file(tmp_path / "st" / "model.safetensors")
    assert {k: header(tmp_path / "st" / "model.safetensors")[k]["dtype"] for k in got} == {
        "c64": "C64",
        "u16": "U16",
        "u32": "U32",
        "u64": "U64",
    }
    for key, t in got.items():
        assert t.dtype == state[key].dtype and torch.equal(t.view(torch.uint8), state[key].view(torch.uint8)), key
    import_checkpoint(tmp_path / "st", tmp_path / "back")
    back = {k: torch.empty_like(state[k]) for k in got}
    zarrckpt.load(back, str(tmp_path / "back"))
    for key, t in back.items():
        assert torch.equal(t.view(torch.uint8), state[key].view(torch.uint8)), key
