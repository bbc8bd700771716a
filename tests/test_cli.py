"""The ``zarrckpt`` command line: ls, info, show, verify, diff, exit codes and error messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import zarrckpt
from zarrckpt import cli

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
    rc, out, err = run(capsys, "verify", u)
    assert rc == 0 and out.startswith("OK: 4 tensors") and "verify 4/4" in err

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


def test_diff_in_row_blocks(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "BLOCK_BYTES", 6 * 10 * 4)  # one expert per block
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


def test_storage_option_parsing() -> None:
    opts = cli.parse_storage_options(["anon=true", "n=3", "profile=ckpt", 'kw={"a": 1}'])
    assert opts == {"anon": True, "n": 3, "profile": "ckpt", "kw": {"a": 1}}
    assert cli.parse_storage_options([]) is None


@pytest.mark.slow
def test_module_entry_point(url: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(cli.__file__).parents[1])}
    proc = subprocess.run(
        [sys.executable, "-m", "zarrckpt.cli", "ls", url, "--json", "model.*"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)) == 4
