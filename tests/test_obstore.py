"""obstore serves s3:// (zarrckpt.storage.obstorefs), with s3fs as the oracle: the same Storage calls on both
clients give the same results, the same errors and the same requests at the moto server; options
obstore cannot mean exactly go to s3fs (zarrckpt.storage.s3config)."""

from __future__ import annotations

import hashlib
import logging
import re
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import zarrckpt
from zarrckpt.errors import StorageError, ZarrckptError
from zarrckpt.storage.retry import RetryPolicy
from zarrckpt.storage.s3config import Untranslatable, choice, translate
from zarrckpt.storage.store import Storage
from zarrckpt.testing import RequestLog, rgw, s3_storage_options, unique_url
from zarrckpt.testing.proxy import FaultProxy

CLIENTS = ("obstore", "s3fs")


@pytest.fixture
def client(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    def use(name: str) -> None:
        monkeypatch.setenv("ZARRCKPT_S3_CLIENT", name)

    return use


# -- the option translation (pure) ---------------------------------------------------------
def test_moto_options_translate_exactly():
    got = translate(s3_storage_options("http://127.0.0.1:9"), {})
    assert got.config == {
        "endpoint": "http://127.0.0.1:9",
        "region": "us-west-2",
        "access_key_id": "testing",
        "secret_access_key": "testing",
        "unsigned_payload": True,  # zarrckpt's s3fs default, payload_signing_enabled=False
    }
    assert got.client_options == {"allow_http": True} and got.credentials == "given"


def test_the_callers_choices_carry_over():
    opts = {
        "client_kwargs": {"endpoint_url": "https://s3.example:8443/", "region_name": "eu-west-1", "verify": False},
        "config_kwargs": {
            "s3": {"payload_signing_enabled": True, "addressing_style": "virtual"},
            "connect_timeout": 5,
            "read_timeout": 7.5,
            "max_pool_connections": 64,
        },
        "token": "t",
        "key": "k",
        "secret": "s",
        "s3_additional_kwargs": {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": "kid"},
        "requester_pays": True,
    }
    got = translate(opts, {})
    assert got.config == {
        "endpoint": "https://s3.example:8443",
        "region": "eu-west-1",
        "unsigned_payload": False,
        "virtual_hosted_style_request": True,
        "server_side_encryption": "aws:kms",
        "sse_kms_key_id": "kid",
        "request_payer": True,
        "access_key_id": "k",
        "secret_access_key": "s",
        "session_token": "t",
    }
    assert got.client_options == {
        "allow_http": False,
        "allow_invalid_certificates": True,
        "connect_timeout": "5.0s",
        "read_timeout": "7.5s",
    }


def test_environment_as_botocore_reads_it():
    env = {"AWS_ENDPOINT_URL": "http://b:1", "AWS_ENDPOINT_URL_S3": "http://a:1", "AWS_DEFAULT_REGION": "r2"}
    got = translate({"anon": True}, env)
    assert got.config["endpoint"] == "http://a:1" and got.config["region"] == "r2"
    assert got.credentials == "anonymous" and got.config["skip_signature"] is True
    assert translate({}, {"AWS_REGION": "r1", "AWS_DEFAULT_REGION": "r2"}).config["region"] == "r1"
    chain = translate({"profile": "dev"}, {})
    assert (chain.credentials, chain.profile) == ("botocore", "dev") and "access_key_id" not in chain.config


@pytest.mark.parametrize(
    ("opts", "named"),
    [
        ({"version_aware": True}, "version_aware"),
        ({"s3_additional_kwargs": {"ACL": "private"}}, "s3_additional_kwargs['ACL']"),
        ({"config_kwargs": {"s3": {"use_accelerate_endpoint": True}}}, "use_accelerate_endpoint"),
        ({"config_kwargs": {"proxies": {}}}, "config_kwargs['proxies']"),
        ({"client_kwargs": {"verify": "/etc/ca.pem"}}, "CA bundle"),
        ({"client_kwargs": {"use_ssl": False}}, "client_kwargs['use_ssl']"),
        ({"key": "k"}, "one given without the others"),
        ({"cache_regions": True}, "cache_regions"),
        ({"key": "k", "secret": "s"}, "no region"),  # an AWS bucket: botocore follows its region, obstore can't
    ],
)
def test_options_without_an_exact_equivalent_are_named(opts, named):
    with pytest.raises(Untranslatable, match=named.replace("[", r"\[").replace("]", r"\]")):
        translate(opts, {})


def test_client_choice_is_checked():
    assert choice({}) == "auto" and choice({"ZARRCKPT_S3_CLIENT": " S3FS "}) == "s3fs"
    with pytest.raises(ZarrckptError, match="ZARRCKPT_S3_CLIENT must be one of auto, obstore, s3fs"):
        choice({"ZARRCKPT_S3_CLIENT": "boto"})


# -- which client serves a URL --------------------------------------------------------------
def test_obstore_serves_s3_by_default_and_s3fs_on_request(s3_server, client, caplog):
    opts = s3_storage_options(s3_server)
    assert Storage("s3://zarrckpt-test/x", opts).client == "obstore"
    assert Storage("s3a://zarrckpt-test/x", opts).atomic_create
    client("s3fs")
    assert Storage("s3://zarrckpt-test/x", opts).client == "s3fs"
    client("auto")
    with caplog.at_level(logging.INFO, "zarrckpt"):
        odd = Storage("s3://zarrckpt-test/x", {**opts, "version_aware": True})
    assert odd.client == "s3fs" and "option version_aware has no obstore equivalent" in caplog.text
    client("obstore")
    with pytest.raises(ZarrckptError, match=r"cannot open 's3://zarrckpt-test/x' with obstore.*version_aware"):
        Storage("s3://zarrckpt-test/x", {**opts, "version_aware": True})
    client("nonsense")
    with pytest.raises(ZarrckptError, match="ZARRCKPT_S3_CLIENT"):
        Storage("s3://zarrckpt-test/x", opts)


def test_botocore_credentials_chain_as_s3fs(s3_server, client, monkeypatch, tmp_path):
    """No keys in the options: obstore asks botocore's chain (here a shared credentials file and a
    profile), as s3fs would; without any credentials the request fails clearly, unretried."""
    creds = tmp_path / "credentials"
    creds.write_text("[dev]\naws_access_key_id = testing\naws_secret_access_key = testing\n")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    base = {"endpoint_url": f"{s3_server}/", "client_kwargs": {"region_name": "us-west-2"}}
    url = unique_url("s3")
    for name in CLIENTS:
        client(name)
        st = Storage(url, {**base, "profile": "dev"})
        assert st.client == name
        st.write(f"by-{name}", [name.encode()])
        assert st.read(f"by-{name}") == name.encode()
    client("obstore")
    lost = Storage(url, base, retry=RetryPolicy(attempts=3, initial_delay=0))
    with pytest.raises(StorageError, match="no AWS credentials found") as got:
        lost.read("by-s3fs")
    assert "attempt" not in str(got.value)  # a permission problem is not retried


# -- s3fs as the oracle: same results, errors and requests ----------------------------------
def _storage_calls(url: str, opts: dict[str, Any]) -> list[tuple[str, Any]]:
    st = Storage(url, opts, retry=RetryPolicy(attempts=1))
    out: list[tuple[str, Any]] = []

    def do(name: str, fn: Callable[[], Any]) -> None:
        try:
            out.append((name, fn()))
        except Exception as e:
            out.append((name, type(e).__name__))

    def view(start: int, end: int) -> bytes:
        with st.reading("a/x", start, end) as got:
            return bytes(got)

    do("write", lambda: st.write("a/x", [b"0123", memoryview(b"456789")]))
    do("create", lambda: st.create("a/y", [b"yy"]))
    do("create again, same bytes", lambda: st.create("a/y", [b"yy"]))
    do("create again, other bytes", lambda: st.create("a/y", [b"zz"]))
    do("write create_only", lambda: st.write("a/z/w", [b"w"], create_only=True))
    do("read", lambda: st.read("a/x"))
    do("read from 0", lambda: st.read("a/x", 0))
    do("read from 7", lambda: st.read("a/x", 7))
    do("read range", lambda: st.read("a/x", 2, 5))
    do("read past the end", lambda: st.read("a/x", 8, 50))
    do("read beyond the end", lambda: st.read("a/x", 20, 30))
    do("reading", lambda: view(1, 4))
    do("read missing", lambda: st.read("a/nope"))
    do("exists object", lambda: st.exists("a/x"))
    do("exists prefix", lambda: st.exists("a/z"))
    do("exists missing", lambda: st.exists("a/q"))
    do("age", lambda: 0 <= (st.age("a/x") or -1) < 600)
    do("age missing", lambda: st.age("a/nope"))
    do("children", st.children)
    do("child's children", lambda: st.child("a").children())
    do("missing child's children", lambda: st.child("q").children())
    do("usage", st.usage)
    do("an object's own path: is_empty", lambda: st.child("a/x").is_empty())
    do("an object's own path: usage", lambda: st.child("a/x").usage())
    do("an object's own path: children", lambda: st.child("a/x").children())
    do("is_empty", st.is_empty)
    do("delete", lambda: st.delete("a/y"))
    do("delete missing", lambda: st.delete("a/y"))
    do("delete_all keep", lambda: st.delete_all(keep=["a/x"]))
    do("usage kept", st.usage)
    do("delete_all", st.delete_all)
    do("is_empty after", st.is_empty)
    gone = Storage("s3://no-such-bucket/ckpt", opts, retry=RetryPolicy(attempts=1))
    do("no bucket: read", lambda: gone.read("x"))
    do("no bucket: write", lambda: gone.write("x", [b"1"]))
    do("no bucket: children", gone.children)
    do("no bucket: is_empty", gone.is_empty)
    return out


def _requests(log: RequestLog, url: str) -> list[tuple[Any, ...]]:
    strip = url.split("://", 1)[1]
    return [(r.kind, r.path.replace(strip, "ROOT"), r.range, r.status, r.bytes_received) for r in log.requests()]


def test_storage_calls_match_s3fs(s3_server, s3_requests, client):
    seen = {}
    for name in CLIENTS:
        client(name)
        url = unique_url("s3")
        s3_requests.clear()
        seen[name] = _storage_calls(url, s3_storage_options(s3_server)), _requests(s3_requests, url)
    (got, sent), (want, oracle) = seen["obstore"], seen["s3fs"]
    assert got == want
    assert dict(want)["read range"] == b"234" and dict(want)["read beyond the end"] == "StorageError"
    assert dict(want)["create again, other bytes"] == "FileExistsError"
    assert dict(want)["usage kept"] == (1, 10) and dict(want)["no bucket: read"] == "FileNotFoundError"

    # The same writes and the same ranged reads; obstore reads a whole object in one GET where
    # s3fs first asks its size (HEAD), and lists and deletes in its own way, never with more requests.
    def only(requests: list[tuple[Any, ...]], kind: str) -> list[tuple[Any, ...]]:
        return [r for r in requests if r[0] == kind and (kind != "GET" or r[2])]

    assert only(sent, "PUT") == only(oracle, "PUT") and only(sent, "GET") == only(oracle, "GET")
    assert len(sent) < len(oracle)


def test_save_and_load_through_both_clients_read_alike(s3_server, client):
    """A checkpoint one client saved loads bit-identically through the other."""
    opts = s3_storage_options(s3_server)
    state = {"w": torch.randn(40, 24), "step": torch.tensor(3), "zeros": torch.zeros(7, dtype=torch.bfloat16)}
    for writer, reader in (("obstore", "s3fs"), ("s3fs", "obstore")):
        url = unique_url("s3")
        client(writer)
        zarrckpt.save(state, url, storage_options=opts)
        client(reader)
        back = {k: torch.empty_like(v) for k, v in state.items()}
        zarrckpt.load(back, url, storage_options=opts)
        assert all(torch.equal(back[k], v) for k, v in state.items())
        assert zarrckpt.open(url, storage_options=opts).verify().ok


# -- failures on the wire: a real HTTP proxy in front of moto that answers for it ----------------
@pytest.fixture
def proxy(s3_server) -> Iterator[FaultProxy]:
    p = FaultProxy(s3_server)
    yield p
    p.close()


@pytest.mark.parametrize("name", CLIENTS)
def test_transient_answers_are_retried_and_permanent_ones_are_not(proxy, client, name):
    client(name)
    st = Storage(unique_url("s3"), s3_storage_options(proxy.endpoint), retry=RetryPolicy(attempts=4, initial_delay=0))
    proxy.faults = [("PUT", "/obj", 503), ("PUT", "/obj", 500), ("GET", "/obj", 503), ("GET", "/obj", 0)]
    st.write("obj", [b"payload"])
    assert st.read("obj") == b"payload"
    answered = [a[2] for a in proxy.answered if a[0] != "HEAD"]  # s3fs asks an object's size first
    assert proxy.faults == [] and answered == [503, 500, 200, 503, 0, 200]
    proxy.answered.clear()
    proxy.faults = [("GET", "/obj", 403)]
    with pytest.raises(StorageError, match=r"reading .*/obj failed") as got:
        st.read("obj")
    assert "attempts" not in str(got.value) and [a[2] for a in proxy.answered if a[0] != "HEAD"] == [403]
    if name == "obstore":  # botocore also retries throttling itself, under s3fs: 4 answers don't exhaust it
        proxy.faults = [("GET", "/obj", 503)] * 4
        with pytest.raises(StorageError, match="failed after 4 attempts"):
            st.read("obj")
        assert proxy.faults == []


def test_a_refused_create_with_no_object_there_is_retried(proxy, client):
    """Ceph RGW can refuse a create (412) that races another before the other's object is visible:
    obstore's create is then tried again rather than reported as another writer's object."""
    client("obstore")
    st = Storage(unique_url("s3"), s3_storage_options(proxy.endpoint), retry=RetryPolicy(attempts=3, initial_delay=0))
    proxy.faults = [("PUT", "/new", 412)]
    st.create("new", [b"mine"])
    assert st.read("new") == b"mine"
    # the refused PUT, the check that nothing is there (HEAD, then a listing), the PUT again, the read
    want = [("PUT", 412), ("HEAD", 404), ("GET", 200), ("PUT", 200), ("GET", 200)]
    assert [(a[0], a[2]) for a in proxy.answered] == want


def test_payload_signing_on_the_wire(proxy, client):
    """As for s3fs (tests/test_rgw.py), obstore sends bodies unsigned unless the caller's options ask."""
    client("obstore")
    opts = s3_storage_options(proxy.endpoint)
    Storage(unique_url("s3"), opts).write("a", [b"x"])
    signing = {**opts, "config_kwargs": {"s3": {"payload_signing_enabled": True}}}
    Storage(unique_url("s3"), signing).write("a", [b"x"])
    assert proxy.signed == ["UNSIGNED-PAYLOAD", hashlib.sha256(b"x").hexdigest()]


# -- fork(): obstore's runtime does not survive it ----------------------------------------------------
def _in_forked_child(url: str, opts: dict[str, Any], inherited: Storage, out: Any) -> None:
    try:
        fresh = Storage(url, opts)
        got: list[Any] = [fresh.client, fresh.read("a")]
        try:
            inherited.read("a")
            got.append("read")
        except ZarrckptError as e:
            got.append(str(e))
        out.put(got)
    except BaseException as e:  # report, never hang the parent
        out.put(repr(e))


def test_a_forked_child_uses_s3fs_and_an_inherited_client_fails_clearly(s3_server, client):
    """A child forked after obstore ran would hang in obstore (its tokio runtime's threads are gone):
    a Storage opened in the child uses s3fs instead, and one inherited from the parent raises."""
    import multiprocessing

    client("auto")
    opts = s3_storage_options(s3_server)
    url = unique_url("s3")
    parent = Storage(url, opts)
    parent.write("a", [b"hello"])
    assert parent.client == "obstore" and parent.read("a") == b"hello"
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_in_forked_child, args=(url, opts, parent, out))
    child.start()
    try:
        got = out.get(timeout=60)
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    assert got[:2] == ["s3fs", b"hello"], got
    assert "obstore cannot run after fork()" in got[2] and "Open the checkpoint again" in got[2]
    assert child.exitcode == 0 and parent.read("a") == b"hello"  # the parent's client still works


@pytest.mark.parametrize("name", CLIENTS)
def test_a_chunk_a_peer_adds_to_a_0d_constant_is_reported(s3_server, client, name):
    """A 0-d array's only chunk is the object ``<array>/c`` itself: a listing of that path must find it."""
    client(name)
    opts = s3_storage_options(s3_server)
    url = unique_url("s3")
    zarrckpt.save({"step": torch.tensor(3.0)}, url, storage_options=opts)
    assert zarrckpt.open(url, storage_options=opts).verify().ok
    Storage(url, opts).write("step/c", [b"\x00" * 8])  # another writer's chunk, after the commit
    problems = zarrckpt.open(url, storage_options=opts).verify()["problems"]
    assert len(problems) == 1 and "constant array" in problems[0] and "another writer" in problems[0]


@pytest.mark.parametrize("name", CLIENTS)
def test_a_delete_the_store_partly_refuses_is_an_error(proxy, client, name):
    """A bulk delete can answer 200 and refuse keys inside (s3fs ignores those): zarrckpt.delete must
    not say it deleted, and what is left says what it is."""
    client(name)
    opts = s3_storage_options(proxy.endpoint)
    url = unique_url("s3")
    zarrckpt.save({"w": torch.randn(8, 8), "b": torch.randn(3)}, url, storage_options=opts)
    proxy.refuse_deletes = True
    with pytest.raises(StorageError, match=r"did not delete|DeleteObjects request failed"):
        zarrckpt.delete(url, storage_options=opts)
    proxy.refuse_deletes = False
    # the manifest was replaced by a tombstone first (one PUT), then the deletes failed: being deleted
    # (s3fs: the manifest went with one DELETE; obstore, which deletes even one object by bulk delete,
    # was refused at the manifest and kept the tombstone)
    with pytest.raises(zarrckpt.errors.IncompleteCheckpointError, match="being deleted"):
        zarrckpt.open(url, storage_options=opts)
    assert zarrckpt.list_checkpoints(url.rsplit("/", 1)[0], storage_options=opts)[url.rsplit("/", 1)[1]] == "deleting"
    zarrckpt.delete(url, storage_options=opts)  # allowed again: it finishes
    assert Storage(url, opts).is_empty()


# -- S3 error answers, said in words ------------------------------------------------------------------
def _no_xml_anywhere(error: BaseException) -> None:
    """Neither the message nor any exception chained to it (what a traceback prints) holds XML."""
    printed = "".join(traceback.format_exception(error))
    assert not re.search(r"<\?xml|<Error>|<Code>", printed), printed
    assert "Debug source" not in printed, printed


def test_a_wrong_secret_is_said_in_words_on_rgw(rgw_server, client):
    """A real S3 server (Ceph RGW) refuses the signature: the error names the S3 code and says what
    to check, and no exception in its chain dumps the server's XML (obstore's reports do)."""
    client("obstore")
    opts = {**rgw.rgw_storage_options(rgw_server), "secret": "not-the-secret"}
    with pytest.raises(StorageError) as err:
        zarrckpt.open(unique_url("s3"), storage_options=opts)
    message = str(err.value)
    assert "SignatureDoesNotMatch: the request signature" in message and "check the secret key" in message, message
    assert "HTTP 403 Forbidden to GET" in message, message
    _no_xml_anywhere(err.value)


@pytest.mark.parametrize(
    ("status", "code", "words"),
    [
        (403, "SignatureDoesNotMatch", "SignatureDoesNotMatch: injected; the request signature"),
        (403, "InvalidAccessKeyId", "InvalidAccessKeyId: injected; the server knows no such access key"),
        (503, "SlowDown", "SlowDown: injected"),
    ],
)
def test_s3_error_answers_are_said_in_words(proxy, client, status, code, words):
    """The same through the proxy in front of moto (which checks no signature): each answer's code,
    the server's message and what it means, its HTTP status and request; no XML in the chain."""
    client("obstore")
    opts = s3_storage_options(proxy.endpoint)
    url = unique_url("s3")
    proxy.faults = [("GET", "/zarr.json", status, code)] * 6
    with pytest.raises(StorageError) as err:
        Storage(url, opts, retry=RetryPolicy(attempts=1)).read("zarr.json")
    message = str(err.value)
    assert words in message and f"HTTP {status}" in message, message
    _no_xml_anywhere(err.value)
