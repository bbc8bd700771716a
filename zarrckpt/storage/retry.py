"""When to retry a failed storage request, how long to wait first, and how to say what failed
(pure: no fsspec, no I/O).

Object stores fail a small share of requests transiently (connection resets, timeouts, HTTP 5xx,
throttling such as S3's 503 "SlowDown"). :class:`RetryPolicy` says how often and how patiently a
request is retried; :func:`is_transient` says which failures are worth retrying. It is
conservative: a missing object, a permission problem or a malformed request fails at once.
:func:`describe` words a failure for an error message (an S3 XML error document as its Code and
Message, an empty ``PermissionError`` as what to check).

A read whose bytes fail their check (a checksum) may have been damaged on the way, which no
status code says: :func:`read_again` runs such a read again, as often as the policy allows, until
its bytes pass, or until the same bytes come back twice (then they are what is stored, and fail
as they are).

The policy comes from ``$ZARRCKPT_RETRIES`` (retries after the first attempt; 0 disables retrying)
and ``$ZARRCKPT_RETRY_DELAY`` (seconds before the first retry), else from :data:`DEFAULT_POLICY`.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from zarrckpt.errors import ZarrckptError, causes

__all__ = [
    "DEFAULT_POLICY",
    "BadRead",
    "RetryPolicy",
    "current_policy",
    "describe",
    "from_client",
    "is_transient",
    "missing_bucket",
    "read_again",
]

T = TypeVar("T")
log = logging.getLogger("zarrckpt")


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff with jitter."""

    attempts: int = 6
    """Tries per request in all (1 = never retry)."""
    initial_delay: float = 0.05
    """Seconds to wait before the first retry."""
    multiplier: float = 2.0
    """Each further wait is this many times longer ..."""
    max_delay: float = 2.0
    """... up to this many seconds."""
    jitter: float = 0.5
    """Each wait is scaled by a random factor in ``[1 - jitter, 1]``, so ranks that fail together
    do not retry in lockstep."""

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.initial_delay < 0 or self.max_delay < 0 or self.multiplier < 1:
            raise ZarrckptError(f"invalid retry policy {self}: need attempts >= 1, delays >= 0, multiplier >= 1")
        if not 0 <= self.jitter <= 1:
            raise ZarrckptError(f"invalid retry policy {self}: jitter must lie in [0, 1]")

    def delay(self, retry: int, rand: float) -> float:
        """Seconds to wait before retry number ``retry`` (1, 2, ...); ``rand`` is uniform in [0, 1)."""
        base = min(self.max_delay, self.initial_delay * self.multiplier ** min(retry - 1, 64))
        return base * (1.0 - self.jitter * rand)

    def longest_wait(self) -> float:
        """The most time one request can spend waiting between its attempts."""
        return sum(self.delay(r, 0.0) for r in range(1, self.attempts))


DEFAULT_POLICY = RetryPolicy()


def current_policy() -> RetryPolicy:
    """:data:`DEFAULT_POLICY`, overridden by ``$ZARRCKPT_RETRIES`` / ``$ZARRCKPT_RETRY_DELAY``."""
    policy = DEFAULT_POLICY
    retries = os.environ.get("ZARRCKPT_RETRIES", "").strip()
    if retries:
        if not retries.isdigit():
            raise ZarrckptError(f"ZARRCKPT_RETRIES must be a whole number >= 0, not {retries!r}")
        policy = replace(policy, attempts=int(retries) + 1)
    delay = os.environ.get("ZARRCKPT_RETRY_DELAY", "").strip()
    if delay:
        try:
            seconds = float(delay)
        except ValueError:
            seconds = -1.0
        if not 0 <= seconds < float("inf"):
            raise ZarrckptError(f"ZARRCKPT_RETRY_DELAY must be a number of seconds >= 0, not {delay!r}")
        policy = replace(policy, initial_delay=seconds, max_delay=max(policy.max_delay, seconds))
    return policy


class BadRead(Exception):
    """One attempt of a checked read got bytes that fail their check: ``error`` says how (raised if
    they are what is stored), ``digest`` tells these bytes from another attempt's, ``chunks``
    (inner chunk numbers) are what the error concerns."""

    def __init__(self, error: ZarrckptError, digest: int, chunks: tuple[int, ...] = ()) -> None:
        super().__init__(str(error))
        self.error = error
        self.digest = digest
        self.chunks = chunks


def read_again(
    attempt: Callable[[], T],
    policy: RetryPolicy,
    what: str,
    on_retry: Callable[[], None],
    failed: BadRead | None = None,
) -> T:
    """``attempt()``, run again while it raises :class:`BadRead` with bytes unlike every earlier
    attempt's, up to ``policy.attempts`` in all (no wait between: nothing was refused). Raises the
    last BadRead when the same bytes came back (they are what is stored) or the attempts ran out.
    ``failed``: the first attempt, made already, failed so. ``on_retry`` is told of each attempt
    after the first; ``what`` names the read for the log."""
    seen: set[int] = set()
    for n in range(1, policy.attempts + 1):
        try:
            if failed is not None:
                bad, failed = failed, None
                raise bad
            return attempt()
        except BadRead as bad:
            if bad.digest in seen or n == policy.attempts:
                raise
            seen.add(bad.digest)
            log.log(
                logging.DEBUG if n < 2 else logging.INFO,
                "reading %s again (attempt %d of %d got bytes that fail their check, damaged on the way?): %s",
                what,
                n,
                policy.attempts,
                bad.error,
            )
            on_retry()
    raise AssertionError("unreachable")


# Never retried, whatever caused them: the answer will not change by asking again.
_PERMANENT = (
    FileNotFoundError,
    FileExistsError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    ValueError,
    TypeError,
    KeyError,
    NotImplementedError,
    ZarrckptError,
)
# fmt: off
_TRANSIENT_ERRNOS = {
    getattr(errno, name)
    for name in [
        "EIO", "EAGAIN", "EINTR", "EBUSY", "ETIMEDOUT", "ECONNRESET", "ECONNABORTED", "ECONNREFUSED", "EPIPE",
        "ENETDOWN", "ENETUNREACH", "ENETRESET", "EHOSTDOWN", "EHOSTUNREACH", "EREMOTEIO", "ESTALE",
    ]
    if hasattr(errno, name)
}
_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
# Error codes of throttling / server-side trouble (S3 and other AWS-style APIs), whatever the HTTP status.
_TRANSIENT_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "RequestThrottledException", "TooManyRequestsException", "RequestLimitExceeded", "BandwidthLimitExceeded",
    "RequestTimeout", "RequestTimeoutException", "InternalError", "ServiceUnavailable", "PriorRequestNotComplete",
    # the body the server received is not the one the client's checksum describes: damaged on the way
    "BadDigest", "XAmzContentSHA256Mismatch", "XAmzContentChecksumMismatch", "BadChecksum",
}
# fmt: on
# Client-library exception classes (matched by name and package, so nothing is imported here).
_TRANSIENT_CLASSES = {
    "aiohttp": {"ClientConnectionError", "ClientPayloadError"},
    # FlexibleChecksumError: a response body that fails its checksum (damaged on the way back)
    "botocore": {"ConnectionError", "HTTPClientError", "IncompleteReadError", "FlexibleChecksumError"},
    "aiobotocore": {"ConnectionError", "HTTPClientError", "IncompleteReadError", "FlexibleChecksumError"},
    "urllib3": {"ProtocolError", "TimeoutError", "NewConnectionError"},
    "requests": {"ConnectionError", "Timeout", "ChunkedEncodingError"},
    "http": {"IncompleteRead", "RemoteDisconnected"},
}


def is_transient(error: BaseException) -> bool:
    """True when ``error`` is worth retrying: connection trouble, timeouts, HTTP 5xx, throttling, an
    answer the client could not parse (damaged on the way)."""
    if not isinstance(error, Exception) or isinstance(error, ZarrckptError):
        return False
    if _unparsable_answer(error):
        return True
    if isinstance(error, _PERMANENT):
        return False
    chain = list(causes(error))
    for e in chain:  # an HTTP status or service error code decides, wherever it sits in the chain
        verdict = _http_verdict(e)
        if verdict is not None:
            return verdict
    return any(_transient_kind(e) for e in chain)


_PARSERS = ("botocore/parsers.py", "aiobotocore/parsers.py")


def _unparsable_answer(error: BaseException) -> bool:
    """Whether botocore's parser failed on the server's answer (a ``ResponseParserError``, or a
    ``ValueError`` raised inside it, such as an unreadable timestamp in a listing): its bytes were
    damaged on the way, and asking again gets them whole."""
    for e in causes(error):
        if type(e).__name__ == "ResponseParserError":
            return True
        tb = e.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename.replace(os.sep, "/").endswith(_PARSERS):
                return True
            tb = tb.tb_next
    return False


def _http_verdict(e: BaseException) -> bool | None:
    response = getattr(e, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        error = response.get("Error") or {}
        if error.get("Code") in _TRANSIENT_CODES:
            return True
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    else:  # aiohttp ClientResponseError (.status), gcsfs HttpError (.code), others (.status_code)
        status = next((getattr(e, a) for a in ("status", "status_code", "code") if hasattr(e, a)), None)
    if isinstance(status, str) and status.isdigit():
        status = int(status)
    if not isinstance(status, int) or isinstance(status, bool) or status < 400:
        return None
    return status in _TRANSIENT_STATUS


def _transient_kind(e: BaseException) -> bool:
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
        return True
    for cls in type(e).__mro__:
        names = _TRANSIENT_CLASSES.get(cls.__module__.split(".", 1)[0])
        if names and cls.__name__ in names:
            return True
    return False


_XML = re.compile(r"<\?xml.*?</Error>|<Error>.*?</Error>", re.S)
_XML_FIELD = re.compile(r"<(Code|Message)>(.*?)</\1>", re.S)


def describe(error: BaseException) -> str:
    """``Type: message`` of a storage error, with any S3 XML error document in it said in words
    (its Code and Message) instead of printed raw."""

    def words(match: re.Match[str]) -> str:
        fields = dict(_XML_FIELD.findall(match[0]))
        return ": ".join(v.strip() for v in (fields.get("Code"), fields.get("Message")) if v) or "an error document"

    said = _XML.sub(words, str(error))
    if said in ("", "None"):  # (s3fs: PermissionError(None) for a refused signature) the cause says more
        inner = next((c for c in causes(error) if c is not error and str(c) not in ("", "None")), None)
        said = _XML.sub(words, str(inner)) if inner is not None else "no reason given"
        if isinstance(error, PermissionError):
            said += " (access denied: check the credentials, key and secret, and the permissions)"
    if type(error).__name__ == "NoCredentialsError":  # botocore's, under s3fs
        said += (
            " (no AWS credentials: give storage options key and secret, or set $AWS_ACCESS_KEY_ID and "
            "$AWS_SECRET_ACCESS_KEY, a profile, or anon=true for a public bucket)"
        )
    return f"{type(error).__name__}: {said}"


def from_client(error: BaseException) -> bool:
    """Whether ``error`` is one of an S3 client library's own exception types (botocore's
    ``NoCredentialsError``, ``PartialCredentialsError``, ``ParamValidationError``, ...): a storage
    failure to say in words, not a bug to show as a traceback."""
    return type(error).__module__.split(".", 1)[0] in ("botocore", "aiobotocore", "s3fs", "gcsfs", "google")


_NO_BUCKET = re.compile(r"NoSuchBucket|bucket does not exist", re.I)
_GCS_OBJECT_LISTING = re.compile(r"b/[^/]+/o")  # gcsfs's 404 of a listing: the request's path, no object in it


def missing_bucket(error: BaseException) -> bool:
    """Whether ``error`` (a FileNotFoundError, mostly) says the bucket itself does not exist, not only
    the object: S3's ``NoSuchBucket``, however the client words it; gcsfs's "not found" of a listing's
    request (``b/<bucket>/o``: a listing in a bucket that exists finds nothing, or raises naming the
    prefix, never 404 on the bucket's object list)."""
    for e in causes(error):
        response = getattr(e, "response", None)
        if isinstance(response, dict) and (response.get("Error") or {}).get("Code") == "NoSuchBucket":
            return True
        if type(e).__name__ == "NoSuchBucket" or _NO_BUCKET.search(str(e)):
            return True
        if isinstance(e, FileNotFoundError) and _GCS_OBJECT_LISTING.fullmatch(str(e)):
            return True
    return False


# HTTP 416 in an error's words, not as part of a path or name (``pytest-416/``, ``step_416``)
_STATUS_416 = re.compile(r"(?<![\w/.\-])416(?![\w/.\-])")


def past_end(error: BaseException) -> bool:
    """Whether a storage error says the range read lies past the object's end (HTTP 416: S3's
    ``InvalidRange``), however the client words it."""
    said = " ".join(str(e) for e in causes(error)).lower()
    return bool(_STATUS_416.search(said)) or "invalidrange" in said or "range is not satisfiable" in said


def bucket_of(url: str) -> str:
    """The bucket an object store URL names (``s3://bucket/run/x`` -> ``bucket``)."""
    return url.partition("://")[2].lstrip("/").partition("/")[0]
