"""The part of fsspec's filesystem interface that :class:`zarrckpt.storage.store.Storage` uses, on obstore's
S3 client (Rust ``object_store``): faster than s3fs per request (``benchmarks/results/clients.md``).

Paths are fsspec's (``bucket/key``). Failures become the exceptions s3fs raises for the same
server answer (FileNotFoundError, FileExistsError, PermissionError, OSError(EINVAL) for a range
past the end), and transient ones carry their HTTP status or are ConnectionErrors, so
:mod:`zarrckpt.storage.retry` judges them as it judges s3fs's. obstore's own retries are off:
zarrckpt retries each request itself, and counts it once per attempt.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any, TypeVar

from zarrckpt.errors import ZarrckptError
from zarrckpt.storage.s3config import ObstoreSettings, Untranslatable

T = TypeVar("T")
log = logging.getLogger("zarrckpt")
_STATUS = re.compile(r"status code: (\d{3})")
_HTTP_KIND = re.compile(r"HttpError \{\s*kind: (\w+)")
_TRANSIENT_KINDS = {"Connect", "Request", "Timeout", "Interrupted", "Decode"}
_DELETE_BATCH = 1000  # S3's DeleteObjects limit
_SINGLE_PUT_LIMIT = 5 * 2**30  # S3's largest single PUT
_CREDENTIAL_LIFETIME = timedelta(minutes=5)  # how long obstore may cache botocore's refreshable credentials


class ObjectStoreError(OSError):
    """An S3 error answer (``status``: its HTTP status) or a failed HTTP exchange (``status`` None)."""

    def __init__(self, message: str, status: int | None) -> None:
        super().__init__(0, message)
        self.status = status


def _message(e: BaseException) -> str:
    text = str(e).split("\n\nDebug source", 1)[0].strip()
    return text if len(text) <= 600 else text[:600] + " ..."


_REQUEST = re.compile(r"Error performing (\w+) (\S+?)(?: in [\d.]+\S*)? - ")
_REASON = re.compile(r"status code: \d{3} ([A-Za-z][A-Za-z ]*)")
_XML_DOC = re.compile(r"(?:<\?xml.*?\?>)?\s*<Error>.*?</Error>", re.S)
_XML_FIELD = re.compile(r"<(Code|Message)>(.*?)</\1>", re.S)
_UNREADABLE = re.compile(r"Got invalid (?:[\w ]+ )?response|invalid (?:list|multipart|DeleteObjects) response", re.I)
# What an S3 error code means, and what to do about it, in plain words (the server's own message,
# where it gives one, comes first).
_MEANING = {
    "SignatureDoesNotMatch": (
        "the request signature the server computed does not match the one sent: check the secret key "
        "(storage_options 'secret', $AWS_SECRET_ACCESS_KEY) that goes with the access key"
    ),
    "InvalidAccessKeyId": (
        "the server knows no such access key: check the access key (storage_options 'key', $AWS_ACCESS_KEY_ID) "
        "and the endpoint"
    ),
    "AccessDenied": "the credentials are not allowed this request: check the key's permissions and the bucket policy",
    "ExpiredToken": "the session token has expired: get fresh credentials",
    "InvalidToken": "the session token is not valid: check storage_options 'token' / $AWS_SESSION_TOKEN",
    "TokenRefreshRequired": "the session token has expired: get fresh credentials",
    "RequestTimeTooSkewed": "this machine's clock is too far from the server's: set the clock right",
    "NoSuchBucket": "the bucket does not exist: check its name and the endpoint",
    "NoSuchKey": "no object of that name",
    "InvalidRange": "the range asked for starts past the object's end",
    "AuthorizationHeaderMalformed": "the credentials name another region than the bucket's: check the region",
    "PermanentRedirect": "the bucket lives at another endpoint or region: check the endpoint and the region",
    "InvalidBucketName": "that is no valid bucket name",
    "SlowDown": "the server asks for fewer requests at a time",
}


def _said(e: BaseException) -> str:
    """What obstore's error ``e`` says, in plain words: the S3 error code and what it means, the HTTP
    status and the request (never the raw XML error document, nor obstore's debug dump)."""
    text = _message(e)
    code = message = None
    doc = _XML_DOC.search(str(e))  # (the whole report: a long one is cut short in ``text``)
    if doc is not None:
        fields = dict(_XML_FIELD.findall(doc[0]))
        code, message = (fields.get("Code") or "").strip() or None, (fields.get("Message") or "").strip() or None
    found = _STATUS.search(text)
    if found is None and code is None:
        return text  # no server answer: a connection, a path, a configuration; obstore's words
    request = _REQUEST.search(text)
    reason = _REASON.search(text)
    http = f"HTTP {found.group(1)}" if found else "HTTP"
    http += f" {reason.group(1).strip()}" if reason else ""
    http += f" to {request.group(1)} {request.group(2)}" if request else ""
    meaning = _MEANING.get(code or "")
    if code is None:  # an answer without a body (HEAD): its status alone
        status = int(found.group(1)) if found else 0
        refused = "access denied, no reason given (a HEAD answer has no body): check the access key, the secret key "
        refused += "and the key's permissions"
        meaning = {403: refused, 404: "not found"}.get(status, "no S3 error code in the answer")
        return f"{meaning} ({http})"
    words = "; ".join(w for w in (message, meaning) if w) or "the server gave no message"
    return f"{code}: {words} ({http})"


def _translate_error(e: Exception, path: str) -> Exception:
    """The exception s3fs would raise for the failure obstore reported as ``e``, worded in plain words
    (:func:`_said`)."""
    from obstore import exceptions as ox

    msg = _said(e)
    if isinstance(e, FileNotFoundError) or type(e).__name__ == "NotFoundError":
        return FileNotFoundError(errno.ENOENT, msg, path)
    if isinstance(e, (ox.AlreadyExistsError, ox.PreconditionError)):
        return FileExistsError(errno.EEXIST, msg, path)
    if isinstance(e, (ox.PermissionDeniedError, ox.UnauthenticatedError)):
        return PermissionError(errno.EACCES, msg, path)
    if isinstance(e, (ox.InvalidPathError, ox.NotSupportedError, ox.UnknownConfigurationKeyError)):
        return ValueError(msg)
    found = _STATUS.search(str(e))
    if found:
        status = int(found.group(1))
        if status == 416:  # as s3fs: a range that starts at or past the end
            return OSError(errno.EINVAL, msg, path)
        if status == 403:
            return PermissionError(errno.EACCES, msg, path)
        if status == 404:  # a listing in a missing bucket (NoSuchBucket)
            return FileNotFoundError(errno.ENOENT, msg, path)
        return ObjectStoreError(msg, status)
    if _UNREADABLE.search(str(e)):  # an answer that does not parse (a listing's XML): damaged on the way
        return OSError(errno.EIO, f"the server's answer could not be read, damaged on the way? ({msg})", path)
    kind = _HTTP_KIND.search(str(e))
    if kind and kind.group(1) in _TRANSIENT_KINDS:
        return ConnectionError(errno.ECONNRESET, msg)
    return ObjectStoreError(msg, None) if kind is None else ValueError(msg)


def _call(path: str, fn: Callable[[], T]) -> T:
    from obstore.exceptions import BaseError

    try:
        return fn()
    except (BaseError, FileNotFoundError) as e:
        translated = _translate_error(e, path)
        log.debug("obstore failed on %s: %s", path, e)  # its whole report (debug dump, XML), for whoever needs it
    raise translated from None  # (its words say it all; obstore's report would print raw XML as the cause)


def _botocore_credentials(settings: ObstoreSettings) -> Callable[[], dict[str, Any]]:
    """A credential provider with s3fs's credential chain (botocore: env, profiles, SSO, instance
    metadata...), and the profile's region where none was given."""
    import botocore.session

    session = botocore.session.Session(profile=settings.profile)
    if "region" not in settings.config:
        region = session.get_config_variable("region")
        if region:
            settings.config["region"] = region
        elif "endpoint" not in settings.config:
            raise Untranslatable("no region (client_kwargs['region_name'], $AWS_REGION or a profile) for AWS")

    def provide() -> dict[str, Any]:
        found = session.get_credentials()
        if found is None:
            raise PermissionError(errno.EACCES, "no AWS credentials found (botocore's chain, as s3fs looks)")
        frozen = found.get_frozen_credentials()
        refreshes = hasattr(found, "refresh_needed")
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            "expires_at": datetime.now(UTC) + _CREDENTIAL_LIFETIME if refreshes else None,
        }

    return provide


class ObstoreFS:
    """An S3 "filesystem" on obstore: one ``S3Store`` per bucket, made on first use."""

    atomic_create = True  # put(mode="create") is If-None-Match: *

    def __init__(self, settings: ObstoreSettings) -> None:
        from obstore.store import S3Store

        self._settings = settings
        self._pid = os.getpid()
        self._provider = _botocore_credentials(settings) if settings.credentials == "botocore" else None
        self._stores: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._make: Any = S3Store  # its TypedDicts are checked by obstore itself, at construction
        # Each request once: zarrckpt.storage.retry decides when to try again.
        self._retry = {"max_retries": 0, "retry_timeout": timedelta(seconds=1)}
        # botocore's defaults: 60 s to connect, 60 s without a byte read; no limit on a whole transfer.
        self._client = {"connect_timeout": "60s", "read_timeout": "60s", "timeout": "24h"} | settings.client_options

    def _store(self, path: str) -> tuple[Any, str]:
        if os.getpid() != self._pid:  # a Storage inherited through fork(): obstore would hang here
            raise ZarrckptError(
                f"an S3 client made in process {self._pid} is used in process {os.getpid()}, forked from it: "
                "obstore cannot run after fork(). Open the checkpoint again in this process (s3fs then "
                "serves it), or start processes with 'spawn'"
            )
        bucket, _, key = path.strip("/").partition("/")
        if not bucket:
            raise ZarrckptError(f"no bucket in S3 path {path!r}")
        with self._lock:
            store = self._stores.get(bucket)
            if store is None:
                store = self._make(
                    bucket,
                    config=self._settings.config,
                    client_options=self._client,
                    retry_config=self._retry,
                    credential_provider=self._provider,
                )
                self._stores[bucket] = store
        return store, key

    # -- objects --------------------------------------------------------------------------
    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **_: Any) -> Any:
        """One PUT (multipart above 5 GiB); returns obstore's ``PutResult`` (``e_tag``, ``version``)."""
        import obstore

        store, key = self._store(path)
        multipart = len(value) > _SINGLE_PUT_LIMIT
        if mode != "create":
            return _call(path, lambda: obstore.put(store, key, value, use_multipart=multipart))
        try:
            return _call(path, lambda: obstore.put(store, key, value, mode="create", use_multipart=multipart))
        except FileExistsError:
            if self.exists(path):
                raise
            # Measured on Ceph RGW: a create racing another can be refused before the other's
            # object is visible; try again (transient: retried with backoff) until one of them is.
            raise OSError(errno.EAGAIN, "create refused, yet no object is there: a racing create?", path) from None

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **_: Any) -> Any:
        """The object, or its bytes ``[start, end)``; a buffer (obstore ``Bytes``)."""
        import obstore

        store, key = self._store(path)
        if (start or 0) < 0 or (end or 0) < 0:
            raise ValueError(f"negative byte range [{start}, {end}) for {path}")
        if end is None:
            options: Any = None if start is None else {"range": {"offset": start}}  # as s3fs: bytes=0-
            return _call(path, lambda: obstore.get(store, key, options=options).bytes())
        lo = start or 0
        if end <= lo:
            return b""
        return _call(path, lambda: obstore.get_range(store, key, start=lo, end=end))

    def _head(self, path: str) -> dict[str, Any]:
        import obstore

        store, key = self._store(path)
        return dict(_call(path, lambda: obstore.head(store, key)))

    def exists(self, path: str) -> bool:
        """As s3fs: an object, or a prefix with objects below it."""
        if path.strip("/").partition("/")[2]:
            try:
                self._head(path)
                return True
            except FileNotFoundError:
                pass
        return next(self._list(path, chunk_size=1), None) is not None

    def info(self, path: str, **_: Any) -> dict[str, Any]:
        """fsspec's ``info`` of an object: name, size, type (one HEAD)."""
        return {"name": path, "size": int(self._head(path)["size"]), "type": "file"}

    def modified(self, path: str) -> datetime:
        stamp = self._head(path)["last_modified"]
        assert isinstance(stamp, datetime)
        return stamp

    def rm_file(self, path: str) -> None:
        import obstore

        store, key = self._store(path)
        _call(path, lambda: obstore.delete(store, key))

    def rm(self, path: str | list[str], recursive: bool = False, **_: Any) -> None:
        """Delete the objects named (a list), or ``path`` and, with ``recursive``, all below it."""
        import obstore

        if isinstance(path, str):
            names = [path] + ([e["name"] for e in self._entries(path)] if recursive else [])
        else:
            names = list(path)
        by_bucket: dict[str, list[str]] = {}
        for name in names:
            bucket, _, key = name.strip("/").partition("/")
            if key:
                by_bucket.setdefault(bucket, []).append(key)
        for bucket, keys in by_bucket.items():
            store = self._store(bucket)[0]
            for i in range(0, len(keys), _DELETE_BATCH):
                batch = keys[i : i + _DELETE_BATCH]
                _call(f"{bucket}/{batch[0]}", partial(obstore.delete, store, batch))

    # -- listings -------------------------------------------------------------------------
    def _list(self, path: str, chunk_size: int = 1000) -> Iterator[dict[str, Any]]:
        import obstore

        store, key = self._store(path)
        bucket = path.strip("/").partition("/")[0]
        stream = _call(path, lambda: obstore.list(store, key or None, chunk_size=chunk_size))
        while True:
            batch = _call(path, lambda: next(stream, None))
            if batch is None:
                return
            for meta in batch:
                yield {"name": f"{bucket}/{meta['path']}", "size": meta["size"], "type": "file"}

    def _entries(self, path: str) -> list[dict[str, Any]]:
        return list(self._list(path))

    def _itself(self, path: str) -> list[dict[str, Any]]:
        """As s3fs, a listing of an object's own path holds that object (a 0-d array's chunk "c"):
        object_store lists only what lies below it."""
        if not path.strip("/").partition("/")[2]:
            return []
        try:
            size = self._head(path)["size"]
        except FileNotFoundError:
            return []
        return [{"name": path.strip("/"), "size": size, "type": "file"}]

    def find(
        self, path: str, maxdepth: int | None = None, withdirs: bool = False, detail: bool = False, **_: Any
    ) -> Any:
        """Every object below ``path``, or ``path`` itself when it is one (names, or name -> info with ``detail``)."""
        if maxdepth is not None or withdirs:
            raise NotImplementedError("find: only the whole tree of objects")
        entries = self._entries(path) or self._itself(path)
        return {e["name"]: e for e in entries} if detail else [e["name"] for e in entries]

    def ls(self, path: str, detail: bool = False, **_: Any) -> list[Any]:
        """The objects and prefixes directly below ``path``; FileNotFoundError when there are none."""
        import obstore

        store, key = self._store(path)
        bucket = path.strip("/").partition("/")[0]
        found = _call(path, lambda: obstore.list_with_delimiter(store, key or None))
        dirs = [{"name": f"{bucket}/{p.rstrip('/')}", "size": 0, "type": "directory"} for p in found["common_prefixes"]]
        files = [{"name": f"{bucket}/{m['path']}", "size": m["size"], "type": "file"} for m in found["objects"]]
        entries = dirs + files or self._itself(path)
        if not entries:
            raise FileNotFoundError(errno.ENOENT, "nothing there", path)
        return entries if detail else [e["name"] for e in entries]

    def invalidate_cache(self, path: str | None = None) -> None:
        """Nothing is cached."""
