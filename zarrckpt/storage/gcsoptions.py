"""The check a ``gs://`` URL's ``storage_options`` get before gcsfs sees them.

gcsfs takes any keyword (``GCSFileSystem(**kwargs)`` hands the rest to fsspec, which keeps them
unused): an option it does not know is dropped without a word, and a misspelt endpoint
(``endpoint=...``) sends every request to ``storage.googleapis.com``, retried for minutes where that is
not reachable. :func:`check` names such an option at once, with the option meant where one is
obvious. Which names gcsfs takes is read from its own signature, and only when an option is not one
of the common ones below.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from typing import Any

from zarrckpt.errors import ZarrckptError

# gcsfs's own options and fsspec's that it passes on (a test keeps this a subset of what they take)
# fmt: off
COMMON = frozenset({
    "project", "access", "token", "block_size", "consistency", "cache_timeout", "secure_serialize",
    "check_connection", "requests_timeout", "requester_pays", "session_kwargs", "timeout", "endpoint_url",
    "default_location", "version_aware", "skip_instance_cache", "use_listings_cache", "listings_expiry_time",
    "max_paths", "asynchronous", "loop", "batch_size",
})
# fmt: on
_TOKEN = "token (a service account's JSON key file, 'google_default', 'cloud', 'anon' or a credentials object)"
# what users write for what gcsfs calls otherwise (the Google client libraries', other tools', S3's names)
MEANT = {
    "endpoint": "endpoint_url",
    "endpointurl": "endpoint_url",
    "endpoint-url": "endpoint_url",
    "url": "endpoint_url",
    "host": "endpoint_url",
    "api_endpoint": "endpoint_url",
    "emulator_host": "endpoint_url",
    "storage_emulator_host": "endpoint_url",
    "credentials": _TOKEN,
    "credentials_file": _TOKEN,
    "credentials_path": _TOKEN,
    "google_application_credentials": _TOKEN,
    "service_account": _TOKEN,
    "service_account_file": _TOKEN,
    "service_account_key": _TOKEN,
    "key_file": _TOKEN,
    "keyfile": _TOKEN,
    "key": _TOKEN,
    "secret": _TOKEN,
    "anon": "token='anon'",
    "anonymous": "token='anon'",
    "project_id": "project",
    "projectid": "project",
    "gcp_project": "project",
    "google_cloud_project": "project",
    "region": "default_location",
    "location": "default_location",
    "user_project": "requester_pays",
}


def _accepted() -> set[str]:
    """Every option GCSFileSystem takes, read from the installed gcsfs (and fsspec's instance cache)."""
    from gcsfs.core import GCSFileSystem

    names = {p for p in inspect.signature(GCSFileSystem.__init__).parameters if p not in ("self", "kwargs")}
    return names | {"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths", "batch_size"}


def check(url: str, options: Mapping[str, Any] | None) -> None:
    """Raise ZarrckptError for an option gcsfs would drop without a word."""
    strange = sorted(set(options or {}) - COMMON)
    if not strange:
        return
    known = _accepted()
    for name in strange:
        if name not in known:
            guess = MEANT.get(name.lower()) or next(iter(difflib.get_close_matches(name, sorted(known), n=1)), None)
            hint = f"; did you mean {guess}?" if guess else ""
            raise ZarrckptError(
                f"unknown GCS storage option {name!r} for {url!r}{hint} (gcsfs takes, among others: token, "
                "project, endpoint_url, requester_pays, default_location; it would ignore this one)"
            )
