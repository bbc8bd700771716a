"""The ``zarrckpt`` command line: ls, info, show, verify, diff, exit codes and error messages."""

from __future__ import annotations

import contextlib
import json
import math
import os
import pty
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import zarrckpt
from zarrckpt import demo, display
from zarrckpt.cli import commands as cli
from zarrckpt.cli import tensors as clitensors
from zarrckpt.convert import export
from zarrckpt.display import human
from zarrckpt.engine import commit as protocol
from zarrckpt.engine import markers
from zarrckpt.example import scenario
from zarrckpt.format.jsondoc import Unsettled
from zarrckpt.format.manifest import DELETING, HEAD_BYTES, MANIFEST, Manifest, ManifestHead
from zarrckpt.storage import s3options
from zarrckpt.storage.store import Storage
from zarrckpt.testing import RequestLog, s3_storage_options

CHECKOUT = Path(zarrckpt.__file__).parents[1]  # the directory holding this checkout's zarrckpt package
G = torch.Generator().manual_seed(11)
EXPERTS = torch.randn(8, 6, 10, generator=G)
BF = torch.randn(7, 5, generator=G).bfloat16()
KEY = "model.layers.3.mlp.experts.w1"


def state(**overrides: Any) -> dict[str, Any]:
    sd: dict[str, Any] = {
        "model": {
            "layers": {"3": {"mlp": {"experts": {"w1": EXPERTS.clone()}}}},
            "bf": BF.clone(),
            "scalar": torch.tensor(4.0),
            "count": torch.arange(5, dtype=torch.int64),
        },
        "trainer": {"step": 7, "config": {"lr": 0.1, "name": "run"}},
    }
    for path, value in overrides.items():
        node = sd
        *parents, last = path.split("__")
        for p in parents:
            node = node[p]
        node[last] = value
    return sd


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    u = str(tmp_path_factory.mktemp("cli") / "ck")
    zarrckpt.save(state(), u)
    return u


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_ls_table_pattern_and_json(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "ls", url)
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split() == ["KEY", "ROLE", "DTYPE", "SHAPE", "SIZE"]
    row = next(line for line in lines if line.startswith(KEY))
    assert "float32" in row and "[8, 6, 10]" in row and "1.9 KiB" in row
    assert any(line.startswith("model.bf ") and "bfloat16" in line and "70 B" in line for line in lines)
    assert "4 tensors" in lines[-1]

    rc, out, _ = run(capsys, "ls", url, "model.layers.*")
    assert rc == 0 and KEY in out and "model.bf" not in out and "1 tensors" in out

    rc, out, _ = run(capsys, "ls", url, "--json", "*.bf")
    rows = json.loads(out)
    assert rc == 0 and [r["key"] for r in rows] == ["model.bf"]
    assert rows[0]["shape"] == [7, 5] and rows[0]["dtype"] == "bfloat16" and rows[0]["bytes"] == 70


def test_info_text_and_json(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "info", url)
    assert rc == 0
    assert "tensors      4" in out and "world size   1" in out and '"lr": 0.1' in out and "library" in out

    rc, out, _ = run(capsys, "info", url, "--json")
    info = json.loads(out)
    total = EXPERTS.nbytes + BF.nbytes + 4 + 5 * 8
    assert rc == 0 and info["tensors"] == 4 and info["bytes"] == total
    assert sum(info["bytes_by_role"].values()) == total
    assert info["topology"] == {"world_size": 1}
    assert info["metadata"] == {"trainer": {"step": 7, "config": {"lr": 0.1, "name": "run"}}}
    assert info["created"] and info["save_id"] and info["library"].startswith("zarrckpt")


SLICES = [
    ("[5, :4, :4]", (5, slice(None, 4), slice(None, 4))),
    ("[-1]", (-1,)),
    ("[1:8:3, -2, ::-3]", (slice(1, 8, 3), -2, slice(None, None, -3))),
    ("[..., 4]", (..., 4)),
    ("[2, ...]", (2, ...)),
    ("[ 6:1:-2 , 0 ]", (slice(6, 1, -2), 0)),
    ("[5, 2, 3]", (5, 2, 3)),
    ("", ...),
]


@pytest.mark.parametrize(("text", "index"), SLICES, ids=[s for s, _ in SLICES])
def test_show_json_matches_saved(url: str, capsys: pytest.CaptureFixture[str], text: str, index: Any) -> None:
    rc, out, _ = run(capsys, "show", url, KEY + text, "--json")
    assert rc == 0
    got = json.loads(out)
    want = torch.from_numpy(np.array(EXPERTS.numpy()[index]))  # numpy: negative steps too
    assert got["key"] == KEY and got["dtype"] == "float32" and got["shape"] == list(want.shape)
    assert got["index"] == (text or None)
    assert torch.equal(torch.tensor(got["values"], dtype=torch.float32), want)


def test_show_text_and_bf16(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "show", url, f"{KEY}[5, :4, :4]")
    assert rc == 0 and "shape=[4, 4]" in out and "dtype=float32" in out and "tensor(" in out
    rc, out, _ = run(capsys, "show", url, "model.bf[1:3]", "--json")
    got = json.loads(out)
    assert rc == 0 and got["dtype"] == "bfloat16" and got["values"] == BF[1:3].float().tolist()
    rc, out, _ = run(capsys, "show", url, "model.scalar[]", "--json")
    assert rc == 0 and json.loads(out)["values"] == 4.0


@pytest.mark.parametrize(
    ("target", "needle"),
    [
        (f"{KEY}[5, x]", "bad slice '[5, x]'"),
        (f"{KEY}[1:2:3:4]", "bad slice '[1:2:3:4]'"),
        (f"{KEY}[::0]", "step cannot be zero"),
        (f"{KEY}[__import__('os')]", "bad slice"),
        (f"{KEY}[5", "bad slice '[5'"),
        (f"{KEY}[9]", "out of range"),
        (f"{KEY}[1, 2, 3, 4]", "too many indices"),
        ("model.layers.3.mlp.experts.w2[0]", "did you mean 'model.layers.3.mlp.experts.w1'"),
    ],
)
def test_show_errors(url: str, capsys: pytest.CaptureFixture[str], target: str, needle: str) -> None:
    rc, out, err = run(capsys, "show", url, target)
    assert rc == 3 and out == ""
    assert err.startswith("error: ") and needle in err and "Traceback" not in err


def test_verify_ok_then_corrupt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    u = str(tmp_path / "ck")
    zarrckpt.save(state(), u)
    rc, out, err = run(capsys, "verify", u, "--progress")
    assert rc == 0 and out.startswith("OK: 4 tensors") and "verify 4/4" in err
    assert "\r" not in err, "stderr is no terminal: plain lines"
    rc, out, err = run(capsys, "verify", u)
    assert rc == 0 and out.startswith("OK: 4 tensors") and err == "", "no progress: stderr is no terminal"

    shard = next(p for p in (tmp_path / "ck" / "model" / "layers").rglob("*") if p.is_file() and p.name != "zarr.json")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    rc, out, _ = run(capsys, "verify", u)
    assert rc == 1 and "1 problem(s)" in out and "  - " in out

    rc, out, _ = run(capsys, "verify", u, "--json")
    assert rc == 1 and len(json.loads(out)["problems"]) == 1


def test_diff(url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    same = str(tmp_path / "same")
    zarrckpt.save(state(), same)
    rc, out, _ = run(capsys, "diff", url, same)
    assert rc == 0 and "identical" in out

    changed = EXPERTS.clone()
    changed[2, 3, 4] += 0.5
    other = str(tmp_path / "other")
    extra = {"model__extra": torch.zeros(2), "trainer__step": 8, "model__count": torch.arange(6)}
    zarrckpt.save(state(model__layers__3__mlp__experts__w1=changed, **extra), other)
    rc, out, _ = run(capsys, "diff", url, other)
    assert rc == 1
    assert f"values:    {KEY}: max_abs_diff=0.5" in out
    assert "only in B: model.extra" in out
    assert "layout:    model.count" in out
    assert "metadata:  trainer.step: A 7 vs B 8" in out

    rc, out, _ = run(capsys, "diff", url, other, "--json")
    report = json.loads(out)
    assert rc == 1 and not report["identical"]
    (vals,) = report["values"]
    assert vals["key"] == KEY and vals["max_abs_diff"] == pytest.approx(0.5)
    assert vals["rel_l2"] == pytest.approx(0.5 / EXPERTS.double().norm().item(), rel=1e-5)


def test_diff_sees_imaginary_parts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    z = torch.complex(torch.ones(4), torch.zeros(4))
    zarrckpt.save({"freqs": z}, a)
    zarrckpt.save({"freqs": z + 0.25j}, b)  # the real parts are equal
    rc, out, _ = run(capsys, "diff", a, b, "--json")
    (vals,) = json.loads(out)["values"]
    assert rc == 1 and not vals["equal"] and vals["max_abs_diff"] == pytest.approx(0.25)
    assert vals["rel_l2"] == pytest.approx(0.25)


def test_diff_in_row_blocks(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(clitensors, "BLOCK_BYTES", 6 * 10 * 4)  # one expert per block
    changed = EXPERTS.clone()
    changed[7, 0, 0] -= 2.0
    other = str(tmp_path / "blocks")
    zarrckpt.save(state(model__layers__3__mlp__experts__w1=changed), other)
    rc, out, _ = run(capsys, "diff", url, other, "--json")
    (vals,) = json.loads(out)["values"]
    assert rc == 1 and vals["max_abs_diff"] == pytest.approx(2.0)


def test_missing_checkpoint_and_bad_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "ls", str(tmp_path / "nothing"))
    assert rc == 3 and out == "" and err.startswith("error: no checkpoint at") and "Traceback" not in err
    rc, _, err = run(capsys, "info", "nope://bucket/x")
    assert rc == 3 and err.startswith("error: ")
    rc, _, err = run(capsys, "ls", str(tmp_path), "--storage-option", "novalue")
    assert rc == 3 and "key=value" in err
    with pytest.raises(SystemExit) as exc:
        cli.main(["frobnicate"])
    assert exc.value.code == 2


def cli_options(opts: dict[str, Any], **changes: Any) -> list[str]:
    """``--storage-option`` arguments for ``opts`` with ``changes`` (None: the option left out)."""
    merged = {k: v for k, v in {**opts, **changes}.items() if v is not None and k != "skip_instance_cache"}
    return [f"--storage-option={k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in merged.items()]


# (command, URL: "{url}" the checkpoint, "{bucket}" its bucket; option changes; what the message must say)
BAD_S3_INPUT = {
    "a key without its secret": (
        "ls",
        "{url}",
        {"secret": None},
        ["incomplete S3 credentials", "key given without secret", "{url}"],
    ),
    "a secret without its key": ("info", "{url}", {"key": None}, ["incomplete S3 credentials", "secret given"]),
    "endpoint for endpoint_url": (
        "ls",
        "{url}",
        {"endpoint": "{endpoint}", "endpoint_url": None},
        ["unknown S3 storage option 'endpoint'", "did you mean endpoint_url?"],
    ),
    "a misspelt option": ("info", "{url}", {"anonn": True}, ["unknown S3 storage option 'anonn'", "anon"]),
    "region in client_kwargs": (
        "info",
        "{url}",
        {"client_kwargs": {"region": "us-west-2"}},
        ["unknown S3 storage option client_kwargs['region']", "did you mean region_name?"],
    ),
    "a misspelt config_kwargs": (
        "ls",
        "{url}",
        {"config_kwargs": {"read_timout": 5}},
        ["unknown S3 storage option config_kwargs['read_timout']", "did you mean read_timeout?"],
    ),
    "a missing bucket, read": (
        "info",
        "s3://no-such-bucket/x",
        {},
        ["no checkpoint at 's3://no-such-bucket/x'", "the bucket 'no-such-bucket' does not exist"],
    ),
    "a missing bucket, listed": (
        "ls",
        "s3://no-such-bucket/x",
        {},
        ["s3://no-such-bucket/x", "the bucket 'no-such-bucket' does not exist"],
    ),
    "a missing bucket, latest": ("latest", "s3://no-such-bucket/runs", {}, ["the bucket 'no-such-bucket' does not"]),
    "one slash too few": (
        "ls",
        "s3:/{bucket}/x",
        {},
        ["malformed URL 's3:/{bucket}/x'", "did you mean s3://{bucket}/x?", "./s3:/{bucket}/x"],
    ),
    "no slash": ("info", "gs:{bucket}/x", {}, ["malformed URL 'gs:{bucket}/x'", "did you mean gs://{bucket}/x?"]),
}


@pytest.mark.parametrize("client", ["obstore", "s3fs"])
@pytest.mark.parametrize("case", sorted(BAD_S3_INPUT))
def test_bad_s3_input_is_said_in_words(
    case: str,
    client: str,
    s3_server: str,
    s3_url: tuple[str, dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Mistyped options, half credentials, a missing bucket, a malformed URL: an error saying what is wrong
    and where, exit code 3, never a traceback (s3fs raised TypeError or PartialCredentialsError only at the
    first request; a missing bucket read as "nothing is stored there")."""
    monkeypatch.setenv("ZARRCKPT_S3_CLIENT", client)
    command, target, changes, words = BAD_S3_INPUT[case]
    url, opts = s3_url
    zarrckpt.save(state(), url, storage_options=opts)  # a checkpoint is there: only the input is wrong
    fill = {"url": url, "bucket": url.split("/")[2], "endpoint": s3_server}
    changes = {k: v.format(**fill) if isinstance(v, str) else v for k, v in changes.items()}
    rc, out, err = run(capsys, command, target.format(**fill), *cli_options(opts, **changes))
    assert rc == 3 and out == "" and err.startswith("error: ") and "Traceback" not in err, err
    for word in words:
        assert word.format(**fill) in err, err


@pytest.mark.parametrize(
    ("client", "said"),
    [
        ("obstore", "no AWS credentials found (botocore's chain, as s3fs looks)"),
        ("s3fs", "NoCredentialsError: Unable to locate credentials (no AWS credentials: give storage options key"),
    ],
)
def test_no_credentials_at_all_is_said_in_words(
    client: str,
    said: str,
    s3_url: tuple[str, dict[str, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No key in the options and none in botocore's chain: s3fs raised botocore's NoCredentialsError as a
    traceback (exit 1)."""
    url, opts = s3_url
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("ZARRCKPT_S3_CLIENT", client)
    rc, out, err = run(capsys, "info", url, *cli_options(opts, key=None, secret=None))
    assert rc == 3 and out == "" and "Traceback" not in err, err
    assert err.startswith(f"error: reading {url}/zarr.json failed: ") and said in err, err


def test_the_s3_options_known_without_s3fs_are_s3fs_options() -> None:
    """The names :mod:`zarrckpt.storage.s3options` passes without asking s3fs, and those it suggests, are
    ones the installed s3fs (and botocore, in client_kwargs) take."""
    assert s3options._accepted() >= s3options.COMMON
    assert s3options._accepted_client() >= s3options.COMMON_CLIENT
    assert s3options._accepted_config() >= s3options.COMMON_CONFIG
    assert {m for m in s3options.MEANT.values() if m.isidentifier()} <= s3options.COMMON
    assert set(s3options.MEANT_CLIENT.values()) <= s3options.COMMON_CLIENT
    assert {m for m in s3options.MEANT_CONFIG.values() if m.isidentifier()} <= s3options.COMMON_CONFIG


def test_a_file_is_no_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A torch.save file given where a checkpoint goes: it is said to be a file, with the command that
    converts it (it was a NotADirectoryError on reading ``plain.pt/zarr.json``)."""
    plain = tmp_path / "plain.pt"
    torch.save(state(), plain)
    for command in (["info"], ["ls"], ["ls", "-r"], ["verify"], ["show"]):
        rc, out, err = run(capsys, *command, str(plain), *(["model.bf"] if command == ["show"] else []))
        assert rc == 3 and out == "" and "Traceback" not in err, (command, err)
        assert err == f"error: {str(plain)!r} is a file, not a zarrckpt checkpoint (a checkpoint is a directory " + (
            f"holding a zarr.json manifest): a torch.save or safetensors file converts with `zarrckpt import {plain} "
            "NEW_URL`\n"
        ), (command, err)
    assert zarrckpt.lifecycle.scan(plain) == []
    rc, out, _ = run(capsys, "import", str(plain), str(tmp_path / "imported"))  # as the message says
    assert rc == 0 and "imported torch checkpoint" in out


def test_storage_option_parsing() -> None:
    opts = cli.parse_storage_options(["anon=true", "n=3", "profile=ckpt", 'kw={"a": 1}'])
    assert opts == {"anon": True, "n": 3, "profile": "ckpt", "kw": {"a": 1}}
    assert cli.parse_storage_options([]) is None


@pytest.mark.slow
def test_module_entry_point(url: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(CHECKOUT)}
    proc = subprocess.run(
        [sys.executable, "-m", "zarrckpt.cli", "ls", url, "--json", "model.*"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)) == 4


def python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter that imports this checkout's zarrckpt."""
    env = {**os.environ, "PYTHONPATH": str(CHECKOUT)}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_inspecting_commands_do_not_import_torch(url: str) -> None:
    code = """
import contextlib, io, sys
from zarrckpt import cli
url = sys.argv[1]
with contextlib.redirect_stdout(io.StringIO()):
    for argv in (["ls", url], ["ls", url, "--json"], ["info", url], ["verify", url], ["gc", url, "--dry-run"]):
        assert cli.main(argv) == 0, argv
    try:
        cli.main(["--help"])
    except SystemExit as e:
        assert e.code == 0
heavy = sorted(m for m in ("torch", "zarr", "ml_dtypes") if m in sys.modules)
assert not heavy, f"imported: {heavy}"
"""
    proc = python(code, url)
    assert proc.returncode == 0, proc.stderr


def test_public_api_still_imports() -> None:
    code = """
import sys
import zarrckpt
assert "torch" not in sys.modules
from zarrckpt import save, load, open, CheckpointManager, ZarrReader, LocalShard, register_zarr_dtypes
assert "torch" in sys.modules
assert set(zarrckpt.__all__) <= set(dir(zarrckpt))
for name in zarrckpt.__all__:
    getattr(zarrckpt, name)
assert zarrckpt.open is open and zarrckpt.save is save
try:
    zarrckpt.nonexistent
except AttributeError as e:
    assert "nonexistent" in str(e)
else:
    raise AssertionError("no AttributeError")
"""
    proc = python(code)
    assert proc.returncode == 0, proc.stderr


def test_zarr_learns_our_dtypes_when_imported_after_zarrckpt(url: str) -> None:
    code = """
import sys
import zarrckpt
assert "zarr" not in sys.modules
import zarr
from zarr.dtype import data_type_registry
assert data_type_registry.get("bfloat16").__module__ == "zarrckpt_dtypes.zarr_types"
arr = zarr.open_array(sys.argv[1] + "/model/bf", mode="r", zarr_format=3)
print(arr.dtype, arr.shape)
"""
    proc = python(code, url)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["bfloat16", "(7,", "5)"]


def test_cli_constants_match_the_library() -> None:
    from zarrckpt.convert.export import DEFAULT_MAX_SHARD_BYTES, parse_size
    from zarrckpt.convert.importer import SOURCE_KINDS

    assert cli.IMPORT_KINDS == SOURCE_KINDS
    assert parse_size(cli.DEFAULT_SHARD_SIZE) == DEFAULT_MAX_SHARD_BYTES


def test_ls_root_lists_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "run"
    manager = zarrckpt.CheckpointManager(str(root), interval=1, keep_last=5, async_save=False)
    manager.save(1, state())
    manager.save(20, state(trainer__step=20))
    manager.close()
    zarrckpt.save(state(trainer__step=33), str(root / "best"))  # no step in the name: trainer.step
    died = Storage(str(root / "step_0000000030"))  # a save that died before committing
    protocol.prepare(died, overwrite=False)
    died.write("model/bf/c.0.0", [b"partial"])
    deleting = Storage(str(root / "step_0000000005"))  # a deletion that died half-way
    zarrckpt.save(state(), deleting.url)
    deleting.write(DELETING, [json.dumps(markers.marker_doc("gone")).encode()])
    deleting.delete(MANIFEST)
    (root / "notes").mkdir()
    (root / "notes" / "readme.txt").write_text("not a checkpoint")

    rc, out, err = run(capsys, "ls", str(root))
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "STATE", "STEP", "TENSORS", "SIZE", "TIME"]
    rows = {line.split()[0]: line.split() for line in lines[1:6]}
    assert [line.split()[0] for line in lines[1:6]] == [
        "step_0000000001",
        "step_0000000005",
        "step_0000000020",
        "step_0000000030",
        "best",
    ], "sorted by step"
    total = human(EXPERTS.nbytes + BF.nbytes + 4 + 5 * 8).split()
    assert rows["step_0000000001"][1:6] == ["committed", "1", "4", *total]
    assert rows["best"][1:3] == ["committed", "33"]
    assert rows["step_0000000030"][1:5] == ["incomplete", "30", "-", "-"]
    assert rows["step_0000000005"][1:3] == ["deleting", "5"]
    created = zarrckpt.open(str(root / "best")).manifest.created
    assert rows["best"][-1] == created and rows["step_0000000030"][-1].startswith(created[:10])
    assert f"5 checkpoints under {root}: 3 committed, 1 incomplete, 1 deleting" in out
    assert f"zarrckpt gc {root}" in out and "notes" not in out

    rc, out, _ = run(capsys, "ls", str(root), "--json", "step_*")
    got = json.loads(out)
    assert rc == 0 and [r["name"] for r in got] == [f"step_{n:010d}" for n in (1, 5, 20, 30)]
    assert got[2] | {"time": None} == {
        "name": "step_0000000020",
        "url": str(root / "step_0000000020"),
        "state": "committed",
        "step": 20,
        "tensors": 4,
        "bytes": EXPERTS.nbytes + BF.nbytes + 4 + 5 * 8,
        "time": None,
    }
    assert got[3]["state"] == "incomplete" and got[3]["tensors"] is None and got[3]["time"]

    rc, out, _ = run(capsys, "ls", str(root / "step_0000000020"))  # one checkpoint: its tensors, as before
    assert rc == 0 and out.splitlines()[0].split() == ["KEY", "ROLE", "DTYPE", "SHAPE", "SIZE"]
    rc, _, err = run(capsys, "ls", str(root / "step_0000000030"))  # an incomplete one: still an error
    assert rc == 3 and "never committed" in err
    rc, _, err = run(capsys, "ls", str(root / "notes"))
    assert rc == 3 and err.startswith("error: ")


def test_ls_root_reads_only_the_head_of_large_manifests(
    s3_url: tuple[str, dict[str, Any]], s3_requests: RequestLog, capsys: pytest.CaptureFixture[str]
) -> None:
    root, opts = s3_url
    # 250 arrays of long names (constant: no shard objects), a manifest of ~310 KB
    big = {"model": {f"layer_{i:04d}_" + "x" * 100: torch.full((4,), 1.5) for i in range(250)}}
    for name, step in [("step_0000000001", 1), ("step_0000000002", 2), ("best", 42)]:
        zarrckpt.save(big | {"trainer": {"step": step}}, f"{root}/{name}", storage_options=opts)
    zarrckpt.save(state(), f"{root}/small", storage_options=opts)  # its manifest fits in the head read
    names = ["step_0000000001", "step_0000000002", "best", "small"]
    sizes = {n: len(Storage(f"{root}/{n}", opts).read(MANIFEST)) for n in names}
    assert min(sizes[n] for n in ["step_0000000001", "step_0000000002", "best"]) > 3 * HEAD_BYTES > sizes["small"]
    zarrckpt.save(state(), f"{root}/corrupt", storage_options=opts)  # a manifest that is no JSON: reported, as before
    Storage(f"{root}/corrupt", opts).write(MANIFEST, [b'{"zarr_format":3,"node_type":"group","attributes":{"zarr'])
    cli_opts = [a for k, v in opts.items() for a in ("--storage-option", f"{k}={json.dumps(v)}")]

    s3_requests.clear()
    rc, out, err = run(capsys, "ls", root, "--json", *cli_opts)
    assert rc == 0 and err == ""
    rows = {r["name"]: r for r in json.loads(out)}
    gets = [r for r in s3_requests.requests(root) if r.method == "GET" and r.path.endswith("/zarr.json")]
    read = {r.path.split("/")[-2]: r.bytes_sent for r in gets}
    assert len(gets) == len(read), "one GET per manifest"
    for name in ["step_0000000001", "step_0000000002", "best"]:
        assert read[name] == HEAD_BYTES < sizes[name], name  # not the whole manifest
        assert rows[name]["state"] == "committed" and rows[name]["time"]
        assert rows[name]["tensors"] is None and rows[name]["bytes"] is None
    assert read["small"] == sizes["small"]
    assert [rows[n]["step"] for n in ["step_0000000001", "step_0000000002", "best"]] == [1, 2, 42]
    assert rows["small"]["tensors"] == 4 and rows["small"]["bytes"] == EXPERTS.nbytes + BF.nbytes + 4 + 5 * 8
    assert "is invalid: not JSON" in rows["corrupt"]["error"]

    rc, out, _ = run(capsys, "ls", root, *cli_opts)  # the table says how to get the rest
    assert rc == 0 and "--sizes" in out and "corrupt: checkpoint manifest" in out
    rc, out, _ = run(capsys, "ls", root, "--json", "--sizes", *cli_opts)
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["best"]["tensors"] == 250 and rows["best"]["bytes"] == 250 * 4 * 4 and rows["best"]["step"] == 42


def test_manifest_head_parses_as_the_whole_manifest_does() -> None:
    full = Manifest("id", {}, {"trainer.step": 5, "x": [1, {"a": "}"}]}, 2, created="2026-01-01T00:00:00+00:00")
    raw = full.dumps()
    head = ManifestHead.parse(raw + b" " * 10, "w", whole=False)  # as if the prefix stopped short of the end
    assert (head.save_id, head.world_size, head.values, head.created) == ("id", 2, full.values, full.created)
    assert head.tensors is None and ManifestHead.parse(raw, "w", whole=True).tensors == 0
    for cut in [10, raw.index(b"values") + 12]:  # cut before the head's end: the whole manifest decides
        with pytest.raises(Unsettled):
            ManifestHead.parse(raw[:cut], "w", whole=False)
    newer = raw.replace(b'"format_version":1', b'"format_version":99')
    with pytest.raises(zarrckpt.InvalidCheckpointError, match="newer than this zarrckpt reads"):
        ManifestHead.parse(newer + b" ", "w", whole=False)
    with pytest.raises(zarrckpt.InvalidCheckpointError, match="not a Zarr v3 group"):
        ManifestHead.parse(raw.replace(b'"zarr_format":3', b'"zarr_format":2') + b" ", "w", whole=False)
    foreign = b'{"zarr_format":3,"node_type":"group","attributes":{"other":1},"consolidated_metadata":{'
    with pytest.raises(Unsettled):  # a plain Zarr group: the whole manifest says what it is
        ManifestHead.parse(foreign, "w", whole=False)
    reordered = json.dumps({"consolidated_metadata": {}, **json.loads(raw)}).encode()  # another tool's layout
    with pytest.raises(Unsettled):
        ManifestHead.parse(reordered, "w", whole=False)


def test_json_into_a_closed_pipe_exits_quietly(url: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(CHECKOUT)}
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody will read: every write fails with EPIPE
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "zarrckpt.cli", "ls", "--json", url],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            env=env,
        )
    finally:
        os.close(write_end)
    assert proc.returncode == cli.EXIT_BROKEN_PIPE == 141 and proc.stderr == ""

    big = str(tmp_path / "big")
    zarrckpt.save({"w": torch.randn(200_000, generator=G)}, big)
    proc = subprocess.run(
        f"{sys.executable} -m zarrckpt.cli show {big} w --json | head -c 10",
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 0 and len(proc.stdout) == 10 and proc.stderr == ""


def test_progress_only_on_a_terminal(url: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(CHECKOUT)}
    cmd = [sys.executable, "-m", "zarrckpt.cli"]

    def stderr_of(*argv: str) -> str:
        proc = subprocess.run([*cmd, *argv], capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0, proc.stderr
        return proc.stderr

    assert stderr_of("verify", url) == ""
    assert stderr_of("export", url, str(tmp_path / "a")) == ""
    err = stderr_of("verify", url, "--progress")  # asked for, into a pipe: plain lines
    assert "\r" not in err and re.fullmatch(r"verify 4/4 tensors \[#{30}\] 100% [^\n]*/s\n", err), err
    err = stderr_of("export", url, str(tmp_path / "b"), "--progress")
    assert "\r" not in err and re.fullmatch(r"export 4/4 tensors \[#{30}\] 100% [^\n]*/s\n", err), err

    primary, replica = pty.openpty()  # a terminal: redrawn in place
    try:
        proc = subprocess.run([*cmd, "verify", url], stdout=subprocess.PIPE, stderr=replica, timeout=120, env=env)
        os.close(replica)
        seen = b""
        with contextlib.suppress(OSError):  # EIO once the terminal has nothing more
            while chunk := os.read(primary, 4096):
                seen += chunk
    finally:
        os.close(primary)
    assert proc.returncode == 0 and b"\rverify 4/4 tensors [" in seen

    assert cli.human is display.human and export.Progress is display.Progress  # one of each
    assert not hasattr(export, "_Progress")


def test_info_cuts_long_lists(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    u = str(tmp_path / "ck")
    groups = [{"params": list(range(600)), "lr": 0.1}, {"params": [600, 601], "lr": 0.0}]
    zarrckpt.save(state(trainer__param_groups=groups, trainer__history=[[i, i * i] for i in range(40)]), u)
    rc, out, _ = run(capsys, "info", u)
    assert rc == 0 and '"lr": 0.1' in out
    assert '"params": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, ... (+590 more)]' in out
    assert '"params": [600, 601]' in out and "... (+30 more)" in out and "[9, 81]" in out
    assert len(out.splitlines()) < 60 and "599" not in out

    rc, out, _ = run(capsys, "info", u, "--max-items", "3")
    assert rc == 0 and '"params": [0, 1, 2, ... (+597 more)]' in out
    rc, out, _ = run(capsys, "info", u, "--full")
    assert rc == 0 and ", 598, 599]" in out and "more)" not in out
    rc, out, _ = run(capsys, "info", u, "--json")
    # lists of dicts are walked into keys, as DCP flattens them: param_groups.0.params
    assert rc == 0 and json.loads(out)["metadata"]["trainer"]["param_groups"] == {"0": groups[0], "1": groups[1]}


def test_diff_tolerance(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = EXPERTS.clone()
    base[0, 0, :2] = torch.tensor([math.inf, math.nan])  # equal in both: no difference
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    zarrckpt.save(state(model__layers__3__mlp__experts__w1=base), a)
    near = base.clone()
    near[1, 2, 3] += 1e-4
    near[4] *= 1.01  # within rtol 0.02 of B
    zarrckpt.save(state(model__layers__3__mlp__experts__w1=near), b)

    rc, out, _ = run(capsys, "diff", a, b)  # default: exact
    assert rc == 1 and out.splitlines()[-1].startswith("checkpoints differ: 4 tensors compared, 1 differ, max |a-b| ")
    rc, out, _ = run(capsys, "diff", a, b, "--json")
    report = json.loads(out)
    assert rc == 1 and not report["identical"] and not report["within_tolerance"]
    delta = (near.double() - base.double()).nan_to_num(0.0).abs().max().item()
    assert report["summary"] == {
        "compared": 4,
        "differing": 1,
        "beyond_tolerance": 1,
        "max_abs_diff": pytest.approx(delta),
        "atol": 0.0,
        "rtol": 0.0,
    }

    rc, out, _ = run(capsys, "diff", a, b, "--atol", "1e-3", "--rtol", "0.02")
    (last,) = [line for line in out.splitlines() if not line.startswith("values:")]
    assert rc == 0 and last.startswith("within tolerance (atol=0.001, rtol=0.02): 4 tensors compared, 1 differ")
    assert f"{KEY}: max_abs_diff=" in out and "(within tolerance)" in out
    rc, out, _ = run(capsys, "diff", a, b, "--atol", "1e-3")  # the 1% change is beyond 1e-3
    assert rc == 1 and "1 differ (1 beyond atol=0.001, rtol=0)" in out
    rc, out, _ = run(capsys, "diff", a, b, "--rtol", "0.02", "--json")  # 1e-4 of ~1 is within 2%
    assert rc == 0 and json.loads(out)["within_tolerance"] and not json.loads(out)["identical"]

    rc, out, _ = run(capsys, "diff", a, a, "--atol", "1")
    assert rc == 0 and out == "identical: 4 tensors compared, 0 differ, max |a-b| 0, metadata equal\n"
    other = str(tmp_path / "other")
    zarrckpt.save(state(model__layers__3__mlp__experts__w1=base, trainer__step=8), other)
    rc, out, _ = run(capsys, "diff", a, other, "--atol", "1")  # metadata differs: no tolerance helps
    assert rc == 1 and out.splitlines()[-1] == (
        "checkpoints differ: 4 tensors compared, 0 differ, max |a-b| 0; 1 metadata"
    )
    rc, _, err = run(capsys, "diff", a, b, "--atol", "-1")
    assert rc == 3 and "non-negative" in err


def test_python_dash_m_zarrckpt(url: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(CHECKOUT)}

    def run_m(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60, env=env)

    proc = run_m("-m", "zarrckpt", "ls", url, "--json", "model.*")
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)) == 4
    helps = [run_m("-m", m, "--help") for m in ("zarrckpt", "zarrckpt.cli")]
    assert helps[0].returncode == 0 and helps[0].stdout == helps[1].stdout
    assert helps[0].stdout.startswith("usage: zarrckpt ")
    proc = run_m("-m", "zarrckpt", "info", url + "-missing")
    assert proc.returncode == 3 and proc.stderr.startswith("error: no checkpoint at")


def test_the_demo_checks_its_location_before_it_trains(
    s3_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bucket that does not exist fails the demo in a second, said in words (it failed after run A's
    training, 22 s, inside a spawn traceback); a location it can write is left as it was."""

    def trained(*_: Any, **__: Any) -> None:
        raise AssertionError("the demo trained before it knew it could save")

    monkeypatch.setattr(scenario, "run", trained)
    argv = ["--url", "s3://no-such-bucket/x", "--k", "1", *cli_options(s3_storage_options(s3_server))]
    assert demo.main(argv) == 3
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("error: writing s3://no-such-bucket/x/demo-"), err
    assert "the bucket 'no-such-bucket' does not exist" in err, err
    demo.check_writable(str(tmp_path / "demo"), None)
    assert not (tmp_path / "demo").exists()


def test_the_gcs_emulator_module_says_its_help() -> None:
    """``python -m zarrckpt.testing.gcs --help`` prints its usage and starts nothing (it started an
    emulator that ran until Ctrl-C)."""
    env = {**os.environ, "PYTHONPATH": str(CHECKOUT)}
    proc = subprocess.run(
        [sys.executable, "-m", "zarrckpt.testing.gcs", "--help"], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m zarrckpt.testing.gcs") and "GCS emulator at" not in proc.stdout


def test_help_and_local_listing_import_neither_numpy_nor_fsspec(url: str) -> None:
    """``zarrckpt --help`` and ``zarrckpt ls`` of a local checkpoint (or of the folder holding it)
    start in about 0.1 s of CPU: numpy and fsspec alone would cost 0.25 s, so neither is imported
    (benchmarks/README.md has the measured times)."""
    code = """
import contextlib, io, os, sys
from zarrckpt.cli import commands
url = sys.argv[1]
with contextlib.redirect_stdout(io.StringIO()):
    for argv in (["ls", url], ["ls", url, "--json"], ["ls", os.path.dirname(url)], ["ls", "-r", os.path.dirname(url)]):
        assert commands.main(argv) == 0, argv
    try:
        commands.main(["--help"])
    except SystemExit as e:
        assert e.code == 0
heavy = sorted(m for m in ("numpy", "fsspec", "torch", "zarr") if m in sys.modules)
assert not heavy, f"imported: {heavy}"
"""
    proc = python(code, url)
    assert proc.returncode == 0, proc.stderr


def test_diff_shortens_long_metadata_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A long value is cut, saying how many characters were left out; a container is compared inside (issue 41)."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    w = torch.zeros(2)
    zarrckpt.save({"w": w, "notes": "x" * 5000, "cfg": ({"lr": 0.1, "paths": ["p"] * 400}, 3)}, a)
    zarrckpt.save({"w": w, "notes": "y" * 5000, "cfg": ({"lr": 0.2, "paths": ["p"] * 400}, 3)}, b)
    rc, out, _ = run(capsys, "diff", a, b)
    assert rc == 1
    cut = '"' + "x" * 159 + f"... (+{5002 - 160} characters)"
    assert f"metadata:  notes: A {cut} vs B " in out, out
    assert "metadata:  cfg[0].lr: A 0.1 vs B 0.2\n" in out, out  # not the 400 paths
    assert max(len(line) for line in out.splitlines()) < 500
    rc, out, _ = run(capsys, "diff", a, b, "--json")  # whole, for programs
    assert rc == 1 and {d["key"]: len(d["a"]) for d in json.loads(out)["metadata"]}["notes"] == 5000
