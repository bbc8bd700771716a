"""Which filesystem serves a URL: obstore for ``s3://`` where it can mean exactly what the options
say (:mod:`zarrckpt.storage.s3config`), else fsspec's (s3fs, gcsfs, local files, memory, ...)."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import sys
import threading
from typing import Any

from zarrckpt.errors import ZarrckptError
from zarrckpt.storage import gcsoptions, s3config, s3options
from zarrckpt.storage.localfs import LocalFiles, local_path

log = logging.getLogger("zarrckpt")
_S3 = ("s3", "s3a")
_cache: dict[tuple[int, str], Any] = {}  # (pid, options) -> ObstoreFS: its connection pools are reused
_lock = threading.Lock()
_told: set[str] = set()
_forked = False  # this process was forked from one that had imported obstore


def _after_fork_in_child() -> None:
    """obstore's tokio runtime does not survive fork(): a child using it hangs (obstore#441). A child
    of a process that had imported obstore therefore uses s3fs (fsspec resets its event loop)."""
    global _forked
    _forked = _forked or "obstore" in sys.modules


os.register_at_fork(after_in_child=_after_fork_in_child)


# The storage clients' own randomness (retry jitter, connection-pool shuffles) drawn from a private
# generator, never from Python's global one, which a training run may seed and draw from itself.
_PRIVATE_RANDOM = random.Random()
_RANDOM_USERS = (  # modules that `import random` and call it
    "gcsfs.retry",
    "aiohttp.connector",
    "botocore.retryhandler",
    "botocore.retries.standard",
    "google.auth._exponential_backoff",
)
_isolated: set[str] = set()


def isolate_randomness() -> None:
    """Point the storage client modules that are imported at a private random generator, so that no
    save, load or retry draws from Python's global one (a run's data order may depend on it). Only
    each module's own name ``random`` changes (and botocore's standard-retry backoff default): their
    callers elsewhere are untouched. Called before every storage request (a dictionary lookup once
    all are done), since some of them are imported only when a client first sends one."""
    if len(_isolated) == len(_RANDOM_USERS):
        return
    for name in _RANDOM_USERS:
        module = sys.modules.get(name)
        if module is None or name in _isolated:
            continue
        if getattr(module, "random", None) is random:
            module.random = _PRIVATE_RANDOM  # type: ignore[attr-defined]
        backoff = getattr(module, "ExponentialBackoff", None)  # botocore: random=random.random bound at def time
        init = getattr(backoff, "__init__", None)
        defaults = getattr(init, "__defaults__", None)
        if init is not None and defaults and any(d is random.random for d in defaults):
            init.__defaults__ = tuple(_PRIVATE_RANDOM.random if d is random.random else d for d in defaults)
        _isolated.add(name)


def with_defaults(url: str, options: dict[str, Any] | None) -> dict[str, Any]:
    """``options`` plus zarrckpt's s3fs defaults, wherever the caller's ``config_kwargs`` leave them unset:
    no SHA-256 of each request body (``payload_signing_enabled=False``; botocore hashes every body sent
    over plain http, and the server hashes it again: 40% of the client's CPU per PUT byte against Ceph RGW,
    benchmarks/README.md). Over https botocore already skips it for bodies that carry a checksum."""
    import fsspec

    opts = dict(options or {})
    protocol = fsspec.core.split_protocol(url)[0]
    if protocol in _S3 and fsspec.get_filesystem_class(protocol).__module__.startswith("s3fs"):
        config = dict(opts.get("config_kwargs") or {})
        opts["config_kwargs"] = {**config, "s3": {"payload_signing_enabled": False, **(config.get("s3") or {})}}
    return opts


# a scheme of object storage followed by anything but "//" ("s3:/bucket/x", "gs:bucket"): a local path
# to everything that reads it, which a save would create as directories named "s3:" and a load find empty
_MISSPELT = re.compile(r"(s3a?|gcs|gs|az|abfss?|adl|hf|https?|memory):(?!//)/*(.*)", re.S)


def _malformed(url: str) -> ZarrckptError | None:
    found = _MISSPELT.fullmatch(url)
    if found is None:
        return None
    scheme, rest = found.groups()
    return ZarrckptError(
        f"malformed URL {url!r}: a URL begins {scheme}:// (did you mean {scheme}://{rest}?); "
        f"a local path that begins so is written ./{url}"
    )


def open_filesystem(url: str, options: dict[str, Any] | None) -> tuple[Any, str, str]:
    """(filesystem, root path on it, client name) for ``url``; ZarrckptError when none can serve it, or
    when it is a URL with one slash too few (``s3:/bucket/x``)."""
    path = local_path(url)
    if path is not None:
        malformed = _malformed(url)
        if malformed is not None:
            raise malformed
        return LocalFiles(), path, "local"
    import fsspec  # not for local files: `zarrckpt ls ./ckpt` starts without it

    protocol, path = fsspec.core.split_protocol(url)
    if protocol in _S3:
        s3options.check(url, options)  # what s3fs would refuse only at the first request
        fs = _obstore(url, options)
        if fs is not None:
            return fs, path.rstrip("/"), "obstore"
    fs, root = fsspec_filesystem(url, options)
    return fs, root, type(fs).__module__.split(".", 1)[0]


def fsspec_filesystem(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """(an fsspec filesystem, the path on it) for ``url`` with ``storage_options``, as zarrckpt makes
    it where it does not use obstore: gcsfs's core class for ``gs://`` (its default class first asks
    the bucket's type over gRPC, which where nothing answers waits 60 s a call), and for ``s3://``
    s3fs without a SHA-256 of each request body. For a framework's own file operations next to
    zarrckpt's (Lightning's ``ModelCheckpoint``, Ray Train's ``storage_filesystem``), so that they go to
    the same endpoint with the same credentials.

    Raises:
        ZarrckptError: no filesystem serves ``url``, or the options do not fit it.
    """
    options = storage_options
    import fsspec

    protocol = fsspec.core.split_protocol(url)[0]
    if protocol in ("gs", "gcs"):
        gcsoptions.check(url, options)  # what gcsfs would ignore without a word
    try:
        if protocol in ("gs", "gcs") and _GCS_EXTENDED not in os.environ:
            fs, root = _gcs(url, options)
        else:
            fs, root = fsspec.core.url_to_fs(url, **with_defaults(url, options))
    except (ValueError, ImportError, TypeError) as e:
        raise ZarrckptError(f"cannot open storage for {url!r}: {e}") from e
    isolate_randomness()  # (the client's modules are imported now)
    return fs, root


_GCS_EXTENDED = "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"


def _gcs(url: str, options: dict[str, Any] | None) -> tuple[Any, str]:
    """gs:// through gcsfs's core filesystem. gcsfs, unless ``$GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` says
    otherwise, serves gs:// with its experimental zonal / HNS class, which first asks the bucket's type
    over gRPC and, where nothing answers (an emulator; some networks), waits 60 s on every call. zarrckpt
    writes no zonal buckets: it takes the core class without touching the environment; set the
    variable (to anything) to let gcsfs choose."""
    from gcsfs.core import GCSFileSystem

    return GCSFileSystem(**(options or {})), GCSFileSystem._strip_protocol(url)


def _obstore(url: str, options: dict[str, Any] | None) -> Any:
    """An ObstoreFS for ``url``, or None where s3fs is to serve it (chosen, or needed)."""
    wanted = s3config.choice(os.environ)
    if wanted == "s3fs":
        return None
    if _forked:
        why = "this process was forked from one that had imported obstore, whose runtime does not survive fork()"
        if wanted == "obstore":
            raise ZarrckptError(f"cannot open {url!r} with obstore: {why}; start processes with 'spawn'")
        if why not in _told:
            _told.add(why)
            log.warning("s3fs serves %s: %s (start processes with 'spawn' to keep obstore)", url, why)
        return None
    try:
        key = json.dumps(options or {}, sort_keys=True, default=repr)
    except (TypeError, ValueError):
        key = repr(options)
    with _lock:
        fs = _cache.get((os.getpid(), key))
        if fs is not None:
            return fs
        try:
            from zarrckpt.storage.obstorefs import ObstoreFS

            fs = ObstoreFS(s3config.translate(options, os.environ))
        except (ImportError, s3config.Untranslatable) as e:
            why = "obstore is not installed" if isinstance(e, ImportError) else f"option {e} has no obstore equivalent"
            if wanted == "obstore":
                raise ZarrckptError(f"cannot open {url!r} with obstore ($ZARRCKPT_S3_CLIENT=obstore): {why}") from e
            if why not in _told:
                _told.add(why)
                log.info("s3fs serves %s: %s", url, why)
            return None
        _cache[(os.getpid(), key)] = fs
    return fs
