"""A checkpoint without its commit record is unchecked, and zarrckpt says so (issue 38).

The outside trial: take a checkpoint saved by today's code, delete ``integrity`` and
``attributes_crc32c`` from its manifest, change a saved value, rewrite a chunk with zarr-python (a
fresh, valid crc32c). Nothing can then tell the edit from the committed data, so ``load`` and reads
refuse it, ``verify`` reports it, ``cp`` copies it only unrecorded; ``allow_modified=True`` reads it
as it is, with a logged warning of what is unchecked. Every save path writes the record, so only an
old checkpoint, a stripped one or an unchecked copy lacks it.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import zarrckpt
from zarrckpt.cli.commands import main as cli
from zarrckpt.errors import CorruptChunkError, ModifiedCheckpointError, causes

zarr = pytest.importorskip("zarr")

UNCHECKED = "has no commit record"  # what every refusal, problem and warning says
WHY = "written before zarrckpt recorded commits"
FIELDS = ("integrity", "attributes_crc32c")


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(16, 8, generator=g)}, "step": 7}


def _target() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(16, 8)}, "step": 0}


def _manifest(url: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((url / "zarr.json").read_text())
    return doc


def _strip(url: Path, fields: tuple[str, ...] = FIELDS, step: int | None = 8) -> None:
    """Delete ``fields`` from the manifest and (``step``) change the saved value."""
    doc = _manifest(url)
    info = doc["attributes"]["zarrckpt"]
    for name in fields:
        del info[name]
    if step is not None:
        info["values"]["step"] = step
    (url / "zarr.json").write_text(json.dumps(doc))


@pytest.fixture
def tampered(tmp_path: Path) -> Path:
    """The outside trial: record deleted, a value changed, a chunk rewritten with a fresh crc32c."""
    url = tmp_path / "ck"
    zarrckpt.save(_state(), url, chunk_bytes=128)  # 4 inner chunks of [4, 8]
    _strip(url)
    arr = zarr.open_array(str(url / "model/w"), mode="r+")
    arr[5, 3] = 99.0  # zarr-python rewrites the shard: chunk 1 gets a valid crc32c of the new bytes
    return url


def _tampered_w() -> torch.Tensor:
    w: torch.Tensor = _state()["model"]["w"].clone()
    w[5, 3] = 99.0
    return w


def test_load_refuses(tampered: Path) -> None:
    target = _target()
    with pytest.raises(ModifiedCheckpointError, match=UNCHECKED) as err:
        zarrckpt.load(target, tampered)
    message = str(err.value)
    assert str(tampered / "zarr.json") in message  # where
    assert "cannot be compared with what was committed" in message and WHY in message  # what and why
    assert "the record was removed after commit" in message and "allow_modified=True" in message  # what to pass
    assert "'integrity'" in message and "'attributes_crc32c'" in message
    assert target["step"] == 0 and not target["model"]["w"].any()  # nothing loaded


def test_open_read_refuses(tampered: Path) -> None:
    ckpt = zarrckpt.open(tampered)
    assert ckpt.keys() == ["model.w"]  # listing works
    with pytest.raises(ModifiedCheckpointError, match=UNCHECKED):
        ckpt["model.w"][...]
    with pytest.raises(ModifiedCheckpointError, match="allow_modified=True"):
        ckpt["model.w"][5, 3]


def _dcp_load(target: dict[str, Any], url: Path, **options: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to load in a single process"
        dcp.load(target, storage_reader=zarrckpt.ZarrReader(url, **options))


def test_dcp_reader_refuses(tampered: Path) -> None:
    with pytest.raises(BaseException) as err:  # DCP wraps it: CheckpointException, a BaseException
        _dcp_load(_target(), tampered)
    assert any(UNCHECKED in str(e) for e in causes(err.value))  # (torch 2.13 keeps only the message)
    got = _target()
    _dcp_load(got, tampered, allow_modified=True)
    assert got["step"] == 8 and torch.equal(got["model"]["w"], _tampered_w())


def test_verify_reports(tampered: Path) -> None:
    summary = zarrckpt.open(tampered).verify()
    assert not summary.ok
    (problem,) = summary["problems"]  # each chunk's own crc32c passes: the missing record is the problem
    assert UNCHECKED in problem and "own crc32c only" in problem


def test_cli_verify_exits_non_zero(tampered: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli(["verify", str(tampered)])
    out = capsys.readouterr().out
    assert rc == 1 and "1 problem(s)" in out and UNCHECKED in out
    assert not out.startswith("OK")


def test_cp_refuses(tampered: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ModifiedCheckpointError, match=UNCHECKED) as err:
        zarrckpt.copy_checkpoint(tampered, tmp_path / "copy")
    assert "--allow-modified" in str(err.value)
    assert not (tmp_path / "copy").exists()  # refused before writing anything
    rc = cli(["cp", str(tampered), str(tmp_path / "copy2")])
    assert rc == 3 and UNCHECKED in capsys.readouterr().err
    assert not (tmp_path / "copy2").exists()


def test_allow_modified_reads_it_and_logs_what_is_unchecked(tampered: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="zarrckpt")
    got = _target()
    zarrckpt.load(got, tampered, allow_modified=True)
    assert got["step"] == 8 and torch.equal(got["model"]["w"], _tampered_w())  # as it is now
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("unchecked" in m and UNCHECKED in m and str(tampered / "zarr.json") in m for m in warned), warned
    caplog.clear()
    ckpt = zarrckpt.open(tampered, allow_modified=True)
    assert torch.equal(ckpt["model.w"][...], _tampered_w())
    assert any("unchecked" in r.getMessage() and UNCHECKED in r.getMessage() for r in caplog.records)


def test_cp_with_allow_modified_stays_unrecorded(tampered: Path, tmp_path: Path) -> None:
    """The copy gets no record (nor a fresh attributes_crc32c): it is refused where it lands."""
    dst = tmp_path / "copy"
    summary = zarrckpt.copy_checkpoint(tampered, dst, allow_modified=True)
    assert summary["recorded"] is False
    info = _manifest(dst)["attributes"]["zarrckpt"]
    assert not set(FIELDS) & info.keys()
    with pytest.raises(ModifiedCheckpointError, match=UNCHECKED):
        zarrckpt.load(_target(), dst)
    assert not zarrckpt.open(dst).verify().ok
    got = _target()
    zarrckpt.load(got, dst, allow_modified=True)
    assert got["step"] == 8 and torch.equal(got["model"]["w"], _tampered_w())


def test_cp_with_allow_modified_drops_the_record_of_a_modified_source(tmp_path: Path) -> None:
    """A recorded source changed after commit: its record no longer checks its bytes, so the copy
    has none (a fresh attributes_crc32c over it would vouch for the edit)."""
    url, dst = tmp_path / "ck", tmp_path / "copy"
    zarrckpt.save(_state(), url, chunk_bytes=128)
    zarr.open_array(str(url / "model/w"), mode="r+")[5, 3] = 99.0
    with pytest.raises(CorruptChunkError, match="modified after commit") as err:  # found at the destination
        zarrckpt.copy_checkpoint(url, tmp_path / "refused")
    assert "--allow-modified" in str(err.value) and not (tmp_path / "refused" / "zarr.json").exists()
    assert zarrckpt.copy_checkpoint(url, dst, allow_modified=True)["recorded"] is False
    assert not set(FIELDS) & _manifest(dst)["attributes"]["zarrckpt"].keys()
    with pytest.raises(ModifiedCheckpointError, match=UNCHECKED):
        zarrckpt.load(_target(), dst)
    got = _target()
    zarrckpt.load(got, dst, allow_modified=True)
    assert got["step"] == 7 and torch.equal(got["model"]["w"], _tampered_w())
    assert zarrckpt.copy_checkpoint(dst, tmp_path / "again", allow_modified=True)["recorded"] is False


def test_cli_cp_allow_modified_says_unrecorded(
    tampered: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = cli(["cp", "--allow-modified", str(tampered), str(tmp_path / "copy")])
    out = capsys.readouterr().out
    assert rc == 0 and "WITHOUT a commit record" in out
    assert cli(["verify", str(tmp_path / "copy")]) == 1


def test_export_refuses_before_writing(tampered: Path, tmp_path: Path) -> None:
    with pytest.raises(ModifiedCheckpointError, match=UNCHECKED):
        zarrckpt.export_safetensors(tampered, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    from safetensors.torch import load_file

    zarrckpt.export_safetensors(zarrckpt.open(tampered, allow_modified=True), tmp_path / "out")
    assert torch.equal(load_file(tmp_path / "out" / "model.safetensors")["model.w"], _tampered_w())


@pytest.mark.parametrize("fields", [("integrity",), ("attributes_crc32c",)], ids=["no-integrity", "no-digest"])
def test_either_field_missing_is_unrecorded(tmp_path: Path, fields: tuple[str, ...]) -> None:
    url = tmp_path / "ck"
    zarrckpt.save(_state(), url, chunk_bytes=128)
    _strip(url, fields, step=None)  # nothing else changed: still unchecked
    with pytest.raises(ModifiedCheckpointError, match=f"no '{fields[0]}'"):
        zarrckpt.load(_target(), url)
    with pytest.raises(ModifiedCheckpointError, match=UNCHECKED):
        zarrckpt.copy_checkpoint(url, tmp_path / "copy")
    assert not zarrckpt.open(url).verify().ok


@pytest.mark.parametrize("version", [1, 2])
def test_the_format_version_does_not_excuse_it(tmp_path: Path, version: int) -> None:
    """An old checkpoint and a stripped one look alike, and a tamperer can edit the version too."""
    url = tmp_path / "ck"
    zarrckpt.save(_state(), url, chunk_bytes=128)
    _strip(url)
    doc = _manifest(url)
    doc["attributes"]["zarrckpt"]["format_version"] = version
    (url / "zarr.json").write_text(json.dumps(doc))
    with pytest.raises(ModifiedCheckpointError, match=UNCHECKED):
        zarrckpt.load(_target(), url)


def test_ls_and_info_work_and_say_unrecorded(
    tampered: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """They only show metadata: they work, with a warning (on stderr, outside pytest) that it is unchecked."""
    caplog.set_level(logging.WARNING, logger="zarrckpt")
    for argv, shown in ((["ls", str(tampered)], "model.w"), (["info", str(tampered)], '"step": 8')):
        caplog.clear()
        assert cli(argv) == 0
        assert shown in capsys.readouterr().out
        (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert UNCHECKED in warning and "shown unchecked" in warning and "allow_modified=True" in warning


def _save_dcp(state: dict[str, Any], url: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=zarrckpt.ZarrWriter(url))


def _import(kind: str) -> Callable[[dict[str, Any], Path], None]:
    def run(state: dict[str, Any], url: Path) -> None:
        src = url.parent / f"src-{kind}"
        if kind == "torch":
            src = src.with_suffix(".pt")
            torch.save(state, src)
        elif kind == "safetensors":
            from safetensors.torch import save_file

            src = src.with_suffix(".safetensors")
            save_file({"model.w": state["model"]["w"]}, src)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save(state, checkpoint_id=src, no_dist=True)
        zarrckpt.import_checkpoint(src, url, kind=kind)

    return run


def _copy(**options: Any) -> Callable[[dict[str, Any], Path], None]:
    def run(state: dict[str, Any], url: Path) -> None:
        zarrckpt.save(state, url.parent / "original")
        assert zarrckpt.copy_checkpoint(url.parent / "original", url, **options)["recorded"] is True

    return run


SAVE_PATHS: dict[str, Callable[[dict[str, Any], Path], None]] = {
    "save": lambda state, url: zarrckpt.save(state, url),
    "async_save": lambda state, url: zarrckpt.async_save(state, url).result(),
    "ZarrWriter": _save_dcp,
    "copy_checkpoint": _copy(),
    "copy_checkpoint-allow_modified": _copy(allow_modified=True),  # as committed: the record is kept
    "import-torch": _import("torch"),
    "import-safetensors": _import("safetensors"),
    "import-dcp": _import("dcp"),
}


@pytest.mark.parametrize("path", SAVE_PATHS)
def test_every_save_path_writes_the_record(tmp_path: Path, path: str) -> None:
    """So a manifest without one is never a fresh save of this zarrckpt: refusing it costs no user a
    checkpoint written today. (Passes before and after: it guards the premise of the refusal.)"""
    url = tmp_path / "ck"
    SAVE_PATHS[path](_state(), url)
    info = _manifest(url)["attributes"]["zarrckpt"]
    assert set(FIELDS) <= info.keys()
    assert "model/w" in info["integrity"]["arrays"]
    assert zarrckpt.open(url).verify().ok
    got = {"model": {"w": torch.zeros(16, 8)}}
    zarrckpt.load(got, url, strict=False)  # no allow_modified needed
    assert torch.equal(got["model"]["w"], _state()["model"]["w"])
