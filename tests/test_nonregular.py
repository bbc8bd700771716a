"""A FIFO, socket, device or directory where a checkpoint holds an object: an error naming the path
(for ``verify``, a problem it lists), at once. Never a read that blocks (opening a FIFO waits for a
writer, forever) or never ends (a device reads without an end).

Each read runs on a thread the test watches: one still blocked after a while fails the test (and
is let go: the test opens the FIFO for writing, which ends the reader's wait).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import zarrckpt
from zarrckpt import cli
from zarrckpt.errors import StorageError, ZarrckptError

SHARD = "w/c.0.0"
SECONDS = 20.0


def _save(tmp_path: Path) -> Path:
    url = tmp_path / "ck"
    zarrckpt.save({"w": torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64), "step": 7}, url, chunk_bytes=4096)
    return url


def _within(fn: Callable[[], Any], fifo: Path | None = None) -> Any:
    """``fn()`` on a thread: its result, or its exception raised here; fails the test when it is still
    running after SECONDS (blocked), after letting a reader blocked on ``fifo`` go."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as e:  # handed to the test's thread
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(SECONDS)
    if thread.is_alive():
        if fifo is not None:  # a writer that opens and closes: the blocked open returns, the read sees EOF
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(SECONDS)
        pytest.fail(f"still running after {SECONDS:.0f} s: blocked on {fifo or 'a read'}")
    if "error" in out:
        raise out["error"]
    return out.get("result")


def _fifo(path: Path) -> Path:
    path.unlink()
    os.mkfifo(path)
    return path


@contextlib.contextmanager
def _socket(path: Path) -> Iterator[Path]:
    path.unlink()
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        yield path


def test_a_fifo_in_place_of_a_shard_is_an_error_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = _save(tmp_path)
    fifo = _fifo(url / SHARD)
    named = rf"{fifo}.* is a FIFO \(named pipe\), not a regular file"
    with pytest.raises(StorageError, match=named):
        _within(lambda: zarrckpt.load({"w": torch.zeros(64, 64), "step": 0}, url), fifo)
    with pytest.raises(StorageError, match=named):
        _within(lambda: zarrckpt.open(url)["w"][3], fifo)
    summary = _within(lambda: zarrckpt.open(url).verify(), fifo)
    assert not summary.ok and any(f"{fifo} is a FIFO (named pipe)" in p for p in summary["problems"]), summary
    assert _within(lambda: cli.main(["show", str(url), "w[3]"]), fifo) != 0
    assert "is a FIFO (named pipe), not a regular file" in capsys.readouterr().err
    with pytest.raises(StorageError, match=named):
        _within(lambda: zarrckpt.export_safetensors(url, tmp_path / "out"), fifo)


def test_a_fifo_under_a_path_holding_416_is_not_taken_for_a_range_past_the_end(tmp_path: Path) -> None:
    """The CI run of 2026-12-05: pytest's base directory was ``pytest-416``, and a lazy read took the
    FIFO's error (whose message names the path) for an HTTP 416 answer, reporting a truncated shard."""
    url = _save(tmp_path / "pytest-416" / "step_416")
    fifo = _fifo(url / SHARD)
    with pytest.raises(StorageError, match=rf"{fifo}.* is a FIFO \(named pipe\), not a regular file"):
        _within(lambda: zarrckpt.open(url)["w"][3], fifo)


@pytest.mark.parametrize(
    ("said", "beyond"),
    [
        ("InvalidRange: the range asked for starts past the object's end (HTTP 416 Range Not Satisfiable)", True),
        ("Client error with status 416: range is not satisfiable", True),
        ("416 Requested range not satisfiable", True),
        ("/tmp/pytest-of-root/pytest-416/ck/w/c.0.0 is a FIFO (named pipe), not a regular file", False),
        ("s3://bucket/run/step_416/w/c.0.0: connection reset", False),
        ("/data/ckpt.416/w/c.0.0: permission denied", False),
    ],
)
def test_a_range_past_the_end_is_told_by_its_status_not_by_digits_in_a_path(said: str, beyond: bool) -> None:
    from zarrckpt.storage.retry import past_end

    assert past_end(StorageError(said)) is beyond
    outer = StorageError("reading s3://bucket/run/step_000416/w/c.0.0 failed")  # the answer as its cause
    outer.__cause__ = OSError(22, said)
    assert past_end(outer) is beyond


def test_a_fifo_in_place_of_the_manifest_is_an_error_naming_it(tmp_path: Path) -> None:
    url = _save(tmp_path)
    fifo = _fifo(url / "zarr.json")
    with pytest.raises(StorageError, match=rf"{fifo} is a FIFO \(named pipe\)"):
        _within(lambda: zarrckpt.open(url), fifo)
    with pytest.raises(StorageError, match=rf"{fifo} is a FIFO \(named pipe\)"):
        _within(lambda: zarrckpt.load({"w": torch.zeros(64, 64), "step": 0}, url), fifo)


def test_a_socket_in_place_of_a_shard_is_named_so(tmp_path: Path) -> None:
    url = _save(tmp_path)
    with _socket(url / SHARD) as path:
        with pytest.raises(StorageError, match=rf"{path} is a socket, not a regular file"):
            _within(lambda: zarrckpt.open(url)["w"][3])
        summary = _within(lambda: zarrckpt.open(url).verify())
        assert any(f"{path} is a socket" in p for p in summary["problems"]), summary


def test_a_directory_in_place_of_a_shard_is_named_so(tmp_path: Path) -> None:
    url = _save(tmp_path)
    (url / SHARD).unlink()
    (url / SHARD).mkdir()
    with pytest.raises(StorageError, match=rf"{url / SHARD} is a directory, not a regular file"):
        _within(lambda: zarrckpt.load({"w": torch.zeros(64, 64), "step": 0}, url))
    summary = _within(lambda: zarrckpt.open(url).verify())
    assert any("missing" in p and SHARD in p for p in summary["problems"]), summary


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_a_device_in_place_of_a_shard_is_named_so(tmp_path: Path) -> None:
    """A link to /dev/zero (tests/test_hostile.py: one in place of the manifest, read to its end)."""
    url = _save(tmp_path)
    (url / SHARD).unlink()
    (url / SHARD).symlink_to("/dev/zero")
    with pytest.raises(ZarrckptError, match=r"is a character device, not a regular file"):
        _within(lambda: zarrckpt.open(url)["w"][...])
    with pytest.raises(ZarrckptError, match=r"is a character device, not a regular file"):
        _within(lambda: zarrckpt.load({"w": torch.zeros(64, 64), "step": 0}, url))
    summary = _within(lambda: zarrckpt.open(url).verify())
    assert any("is a character device" in p for p in summary["problems"]), summary
