"""Storage that fails some requests transiently: save and load retry and still round-trip bit-exactly;
storage that keeps failing gives a clear StorageError in bounded time; a missing object fails fast."""

from __future__ import annotations

import errno
import json
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import faulty
import pytest
import torch
from states import check_loaded, mixed_state

import zarrckpt
from zarrckpt.storage import retry
from zarrckpt.storage.retry import RetryPolicy, is_transient
from zarrckpt.storage.store import Storage
from zarrckpt.testing import spawn

RATE = 0.05


def _opts(tmp_path: Path, **kw: Any) -> dict[str, Any]:
    return {"rate": RATE, "seed": 3, "anchor": str(tmp_path), **kw}


def _url(tmp_path: Path, name: str = "ck") -> str:
    return f"faulty://{tmp_path / name}"


@pytest.fixture(autouse=True)
def _fresh_counters() -> None:
    faulty.reset()


def _many_tensors(seed: int, fill: bool = True) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    layers = {
        str(i): {
            "w": torch.randn(64, 48, generator=g) if fill else torch.zeros(64, 48),
            "b": torch.randn(48, generator=g).bfloat16() if fill else torch.zeros(48, dtype=torch.bfloat16),
            "idx": torch.randint(0, 1 << 40, (300,), generator=g) if fill else torch.zeros(300, dtype=torch.int64),
        }
        for i in range(24)
    }
    return {"model": {"layers": layers}, "step": seed if fill else 0, "blob": bytes([seed] * 9) if fill else b""}


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for i, layer in want["model"]["layers"].items():
        for name, tensor in layer.items():
            assert torch.equal(got["model"]["layers"][i][name].view(torch.uint8), tensor.view(torch.uint8)), (i, name)
    assert (got["step"], got["blob"]) == (want["step"], want["blob"])


class _FakeClock:
    """Stands in for ``time`` in zarrckpt.storage.store: the retry backoff's waits are recorded, not slept."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _FakeClock:
    from zarrckpt.storage import store as storage

    fake = _FakeClock()
    monkeypatch.setattr(storage, "time", fake)
    return fake


@pytest.fixture
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> RetryPolicy:
    monkeypatch.setenv("ZARRCKPT_RETRIES", "2")
    monkeypatch.setenv("ZARRCKPT_RETRY_DELAY", "0.001")
    return retry.current_policy()


def test_save_and_load_through_a_store_that_fails_5_percent(tmp_path: Path) -> None:
    url, opts = _url(tmp_path), _opts(tmp_path)
    start = time.perf_counter()
    with faulty.retry_log() as log:
        zarrckpt.save(_many_tensors(1), url, storage_options=opts, chunk_bytes=4096)
        want = _many_tensors(2)  # overwrite: un-commit, delete everything, write again
        zarrckpt.save(want, url, storage_options=opts, chunk_bytes=4096, overwrite=True)
        got = _many_tensors(0, fill=False)
        zarrckpt.load(got, url, storage_options=opts)  # whole shards, one GET each
        _assert_same(got, want)
        # a sub-region of every tensor: shard index plus ranged GETs of the needed inner chunks
        parts = {i: zarrckpt.LocalShard(torch.zeros(20, 48), (64, 48), (25, 0)) for i in want["model"]["layers"]}
        zarrckpt.load(
            {"model": {"layers": {i: {"w": p} for i, p in parts.items()}}},
            url,
            storage_options=opts,
            strict=False,
        )
        for i, part in parts.items():
            assert torch.equal(part.data, want["model"]["layers"][i]["w"][25:45]), i
    faults = sum(faulty.FAULTS.values())
    print(f"\n{sum(faulty.CALLS.values())} requests, {faults} faults {dict(faulty.FAULTS)}, {log.retries} retries")
    print(f"took {time.perf_counter() - start:.2f}s")
    assert faults >= 10, "the test must really inject faults"
    assert {"pipe_file", "cat_file"} <= faulty.FAULTS.keys()
    assert log.retries == faults, "every injected fault is retried exactly once, none swallowed"


def test_every_storage_request_is_retried(tmp_path: Path) -> None:
    """The first two calls of every operation on every path fail; every Storage method still works."""
    s = Storage(_url(tmp_path), _opts(tmp_path, rate=0.0, fail_calls=2))
    with faulty.retry_log() as log:
        assert s.is_empty()
        s.write("a/x", [b"hello ", memoryview(b"world")])
        assert s.exists("a/x") and not s.exists("a/y")
        assert s.read("a/x") == b"hello world"
        with s.reading("a/x", 6, 11) as view:
            assert bytes(view) == b"world"
        assert not s.is_empty() and s.children() == ["a"] and s.usage() == (1, 11)
        s.delete("a/x")
        s.delete("a/never-written")
        s.write("b/y", [b"1"])
        s.delete_all()
        assert s.is_empty()
    assert set(faulty.FAULTS) == {"find", "pipe_file", "exists", "cat_file", "ls", "rm_file", "rm"}
    assert log.retries == sum(faulty.FAULTS.values())
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").rglob("*.*"))


@pytest.mark.parametrize("files", ["unnamed", "named"])
def test_local_files_retry_transient_os_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fast_retries: RetryPolicy, files: str
) -> None:
    """The local fast paths (unnamed or temp file + link, pooled ``reading()``, vectored ``read_into()``)
    retry too."""
    import os

    import zarrckpt.storage.local as local_backend  # the local fast paths call open() there

    monkeypatch.setitem(local_backend._UNNAMED, "works", files == "unnamed")

    injected: Counter[str] = Counter()
    errors = [OSError(errno.EIO, "I/O error"), OSError(errno.EAGAIN, "try again"), TimeoutError("slow disk")]
    per_thread, lock = threading.local(), threading.Lock()

    def flaky(name: str, fn: Any) -> Any:
        def call(*args: Any, **kw: Any) -> Any:
            if name not in ("os.preadv", "os.link") and not str(args[0]).startswith(str(tmp_path)):
                return fn(*args, **kw)
            calls = per_thread.__dict__.setdefault("calls", Counter())
            n = calls[name]
            calls[name] += 1
            if n % 5 == 0:  # every 5th call of each thread, the first included (so never twice in a row)
                with lock:
                    injected[name] += 1
                raise errors[n % 2 + (name in ("os.replace", "os.link"))]
            return fn(*args, **kw)

        return call

    monkeypatch.setattr(local_backend, "open", flaky("open", open), raising=False)
    for name in ("open", "replace", "link", "preadv"):
        monkeypatch.setattr(os, name, flaky(f"os.{name}", getattr(os, name)))
    url = str(tmp_path / "ck")
    want = _many_tensors(5)
    with faulty.retry_log() as log:
        zarrckpt.save(want, url, chunk_bytes=4096)
        got = _many_tensors(0, fill=False)
        zarrckpt.load(got, url)
        part = zarrckpt.LocalShard(torch.zeros(20, 48), (64, 48), (25, 0))
        zarrckpt.load({"model": {"layers": {"3": {"w": part}}}}, url, strict=False)
    monkeypatch.undo()
    _assert_same(got, want)
    assert torch.equal(part.data, want["model"]["layers"]["3"]["w"][25:45])
    print(f"\nlocal: {dict(injected)} injected, {log.retries} retries")
    named = {"open"} if files == "named" else set()  # (markers and the manifest: no temporary file with unnamed ones)
    assert set(injected) == {"os.open", "os.link", "os.preadv"} | named, injected  # new objects are linked in
    assert log.retries == sum(injected.values())
    assert not list((tmp_path / "ck").rglob("*.tmp")), "failed attempts leave no temp files"


def _save_worker(rank: int, world: int, url: str, opts: dict[str, Any], stats: str) -> None:
    faulty.reset()
    with faulty.retry_log() as log:
        zarrckpt.save(mixed_state(rank, world, fill=True, save_world=world), url, storage_options=opts, chunk_bytes=64)
    _dump(stats, f"save{rank}", log)


def _load_worker(rank: int, world: int, url: str, opts: dict[str, Any], stats: str, save_world: int) -> None:
    faulty.reset()
    state = mixed_state(rank, world, fill=False, save_world=save_world)
    with faulty.retry_log() as log:
        zarrckpt.load(state, url, storage_options=opts)
    check_loaded(state, rank, world, save_world)
    _dump(stats, f"load{rank}", log)


def _dump(stats: str, name: str, log: faulty.RetryLog) -> None:
    doc = {"faults": sum(faulty.FAULTS.values()), "calls": sum(faulty.CALLS.values()), "retries": log.retries}
    (Path(stats) / f"{name}.json").write_text(json.dumps(doc))


@pytest.mark.slow
def test_4_ranks_save_3_ranks_load_through_a_faulty_store(tmp_path: Path) -> None:
    url, opts, stats = _url(tmp_path), _opts(tmp_path), tmp_path / "stats"
    stats.mkdir()
    spawn(4, _save_worker, url, opts, str(stats))
    spawn(3, _load_worker, url, opts, str(stats), 4)
    docs = [json.loads(p.read_text()) for p in sorted(stats.iterdir())]
    assert len(docs) == 7
    total = {k: sum(d[k] for d in docs) for k in ("calls", "faults", "retries")}
    print(f"\n7 processes: {total}")
    assert total["faults"] > 0 and total["retries"] == total["faults"]


def _no_commit(tmp_path: Path) -> None:
    assert not (tmp_path / "ck" / "zarr.json").exists(), "nothing may be committed"


def test_storage_that_always_fails_gives_storage_error(
    tmp_path: Path, fast_retries: RetryPolicy, clock: _FakeClock
) -> None:
    assert fast_retries.attempts == 3
    url, opts = _url(tmp_path), _opts(tmp_path, rate=1.0)
    with pytest.raises(zarrckpt.StorageError, match=r"listing .*ck/ failed after 3 attempts") as err:  # prepare's
        zarrckpt.save({"w": torch.ones(100)}, url, storage_options=opts)
    # bounded: the first request's 3 attempts and 2 waits, then the error; nothing else is tried
    assert sum(faulty.CALLS.values()) == 3 and len(clock.waits) == 2, (faulty.CALLS, clock.waits)
    assert sum(clock.waits) <= fast_retries.longest_wait()
    assert isinstance(err.value.__cause__, (OSError, faulty.ServerBusy))
    _no_commit(tmp_path)
    with pytest.raises(zarrckpt.StorageError, match=r"reading .*ck/zarr\.json failed after 3 attempts"):
        zarrckpt.load({"w": torch.zeros(100)}, url, storage_options=opts)


def test_a_shard_that_cannot_be_written_leaves_no_commit(tmp_path: Path, fast_retries: RetryPolicy) -> None:
    url = _url(tmp_path)
    state = {"a": torch.ones(64, 64), "b": torch.arange(64 * 64.0).reshape(64, 64)}  # b: not a constant array
    with pytest.raises(zarrckpt.StorageError, match=r"writing .*ck/b/c.0.0 failed after 3 attempts"):
        zarrckpt.save(state, url, storage_options=_opts(tmp_path, rate=0.0, fail_paths="*/b/c.0.0"), chunk_bytes=4096)
    _no_commit(tmp_path)
    assert (tmp_path / "ck" / ".zarrckpt-pending.json").exists()
    with pytest.raises(zarrckpt.IncompleteCheckpointError, match="never committed"):
        zarrckpt.load({"a": torch.zeros(64, 64), "b": torch.zeros(64, 64)}, url, storage_options={"rate": 0.0})
    # and a second save over the debris, through the 5 % faulty store, succeeds
    zarrckpt.save(state, url, storage_options=_opts(tmp_path), chunk_bytes=4096, overwrite=True)
    got = {"a": torch.zeros(64, 64), "b": torch.ones(64, 64)}
    zarrckpt.load(got, url, storage_options=_opts(tmp_path))
    assert torch.equal(got["a"], state["a"]) and torch.equal(got["b"], state["b"])


def test_default_policy_gives_up_in_bounded_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clock: _FakeClock
) -> None:
    monkeypatch.delenv("ZARRCKPT_RETRIES", raising=False)
    monkeypatch.delenv("ZARRCKPT_RETRY_DELAY", raising=False)
    policy = retry.current_policy()
    assert policy == RetryPolicy() and policy.attempts == 6
    with pytest.raises(zarrckpt.StorageError, match="failed after 6 attempts"):
        zarrckpt.load({"w": torch.zeros(1)}, _url(tmp_path), storage_options=_opts(tmp_path, rate=1.0))
    # one request (the manifest's): 6 attempts, 5 backoff waits that together stay within the policy's bound
    assert sum(faulty.CALLS.values()) == 6 and len(clock.waits) == 5, (faulty.CALLS, clock.waits)
    assert policy.longest_wait() * (1 - policy.jitter) <= sum(clock.waits) <= policy.longest_wait()
    for n, wait in enumerate(clock.waits, start=1):
        assert policy.delay(n, 1.0) <= wait <= policy.delay(n, 0.0), (n, wait)


def test_permission_errors_are_not_retried(tmp_path: Path, clock: _FakeClock) -> None:
    opts = _opts(tmp_path, rate=0.0, fail_paths="*/w/c.0", fail_with="permission")
    with pytest.raises(zarrckpt.StorageError, match=r"writing .*ck/w/c.0 failed: PermissionError"):
        zarrckpt.save({"w": torch.arange(8.0)}, _url(tmp_path), storage_options=opts)  # not constant: a shard
    assert clock.waits == []
    assert faulty.calls_on("pipe_file", "/ck/w/c.0") == 1
    _no_commit(tmp_path)


@pytest.mark.parametrize("backend", ["local", "faulty"])
def test_missing_shard_fails_fast_without_retries(tmp_path: Path, backend: str, clock: _FakeClock) -> None:
    """FileNotFoundError is never retried: a deleted shard is a CorruptChunkError at once (default policy)."""
    local = str(tmp_path / "ck")
    url, opts = (local, {}) if backend == "local" else (_url(tmp_path), _opts(tmp_path, rate=0.0))
    zarrckpt.save({"model": {"w": torch.randn(64, 64)}}, url, storage_options=opts, chunk_bytes=4096)
    (tmp_path / "ck/model/w/c.0.0").unlink()
    before = faulty.calls_on("cat_file", "/ck/model/w/c.0.0")  # (the save read its objects back: unverified store)
    with faulty.retry_log() as log, pytest.raises(zarrckpt.CorruptChunkError, match="missing"):
        zarrckpt.load({"model": {"w": torch.zeros(64, 64)}}, url, storage_options=opts)
    assert log.retries == 0 and clock.waits == []
    if backend == "faulty":
        assert faulty.calls_on("cat_file", "/ck/model/w/c.0.0") - before == 1
    with pytest.raises(FileNotFoundError):
        Storage(url, opts).read("model/w/c.0.0")


# -- what counts as transient ----------------------------------------------------------------------


def _client_error(code: str, status: int) -> Exception:
    from botocore.exceptions import ClientError

    response: Any = {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return ClientError(response, "GetObject")


def _s3fs(code: str, status: int) -> Exception:
    from s3fs.errors import translate_boto_error

    return translate_boto_error(_client_error(code, status))


def _aiohttp(kind: str, status: int = 0) -> Exception:
    import aiohttp

    if kind == "response":
        return aiohttp.ClientResponseError(None, (), status=status)  # type: ignore[arg-type]
    return {"disconnected": aiohttp.ServerDisconnectedError(), "payload": aiohttp.ClientPayloadError("cut")}[kind]


def _gcs(code: int) -> Exception:
    from gcsfs.retry import HttpError

    return HttpError({"code": code, "message": "x"})


TRANSIENT = [
    lambda: ConnectionResetError(errno.ECONNRESET, "reset"),
    lambda: BrokenPipeError(errno.EPIPE, "pipe"),
    lambda: TimeoutError("timed out"),
    lambda: OSError(errno.EIO, "i/o error"),
    lambda: OSError(errno.EAGAIN, "again"),
    lambda: _s3fs("SlowDown", 503),
    lambda: _s3fs("InternalError", 500),
    lambda: _s3fs("RequestTimeout", 400),
    lambda: _client_error("ThrottlingException", 400),
    lambda: _client_error("Whatever", 502),
    lambda: _aiohttp("response", 503),
    lambda: _aiohttp("response", 429),
    lambda: _aiohttp("disconnected"),
    lambda: _aiohttp("payload"),
    lambda: _gcs(503),
    lambda: __import__("botocore.exceptions").exceptions.EndpointConnectionError(endpoint_url="http://x"),
    lambda: __import__("botocore.exceptions").exceptions.ReadTimeoutError(endpoint_url="http://x"),
    lambda: __import__("requests").exceptions.ConnectionError("refused"),
    lambda: faulty.ServerBusy("503"),
]
PERMANENT = [
    lambda: FileNotFoundError(errno.ENOENT, "missing"),
    lambda: PermissionError(errno.EACCES, "denied"),
    lambda: IsADirectoryError(errno.EISDIR, "dir"),
    lambda: NotADirectoryError(errno.ENOTDIR, "not dir"),
    lambda: ValueError("bad"),
    lambda: OSError(errno.EINVAL, "invalid"),
    lambda: OSError(errno.ENOSPC, "full"),
    lambda: _s3fs("NoSuchKey", 404),
    lambda: _s3fs("AccessDenied", 403),
    lambda: _s3fs("InvalidObjectName", 400),  # s3fs: OSError(EIO); the 400 decides
    lambda: _client_error("InvalidRange", 416),
    lambda: _aiohttp("response", 404),
    lambda: _gcs(400),
    lambda: __import__("botocore.exceptions").exceptions.NoCredentialsError(),
    lambda: zarrckpt.StorageError("given up"),
    lambda: RuntimeError("bug"),
]


@pytest.mark.parametrize("make", TRANSIENT, ids=range(len(TRANSIENT)))
def test_transient_errors(make: Any) -> None:
    error = make()
    assert is_transient(error), repr(error)


@pytest.mark.parametrize("make", PERMANENT, ids=range(len(PERMANENT)))
def test_permanent_errors(make: Any) -> None:
    error = make()
    assert not is_transient(error), repr(error)


def test_backoff_doubles_with_jitter_up_to_a_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    p = RetryPolicy()
    assert [p.delay(r, 0.0) for r in range(1, 8)] == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0])
    assert p.delay(3, 0.999) == pytest.approx(0.2 * (1 - 0.5 * 0.999)) and p.delay(10**6, 0.0) == 2.0
    assert p.longest_wait() == pytest.approx(1.55)
    monkeypatch.setenv("ZARRCKPT_RETRIES", "0")
    assert retry.current_policy().attempts == 1
    monkeypatch.setattr(retry, "DEFAULT_POLICY", RetryPolicy(attempts=9))
    monkeypatch.delenv("ZARRCKPT_RETRIES")
    assert retry.current_policy().attempts == 9
    for name, bad in [("ZARRCKPT_RETRIES", "-1"), ("ZARRCKPT_RETRIES", "x"), ("ZARRCKPT_RETRY_DELAY", "nan")]:
        monkeypatch.setenv(name, bad)
        with pytest.raises(zarrckpt.ZarrckptError, match=name):
            retry.current_policy()
        monkeypatch.delenv(name)
    with pytest.raises(zarrckpt.ZarrckptError):
        RetryPolicy(attempts=0)


def test_causes_reach_into_dcp_checkpoint_exceptions() -> None:
    """DCP wraps each rank's failure as (exception, traceback summary) in ``CheckpointException.failures``
    (a BaseException): ``causes`` finds the exception inside, so the importer can re-raise a zarrckpt
    error DCP wrapped, and nothing hides a zarrckpt error behind DCP's wrapper."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from zarrckpt.errors import causes

    inner = zarrckpt.CorruptChunkError("chunk 0 of 'w' fails its checksum")
    wrapped = CheckpointException("CheckpointException ranks:dict_keys([1])", {1: (inner, traceback.StackSummary())})
    assert inner in list(causes(wrapped))
