"""The checks an ``s3://`` URL's ``storage_options`` get before any client sees them.

s3fs passes an option it does not know on to aiobotocore, which fails on the first request with
``TypeError: AioSession.__init__() got an unexpected keyword argument``, and a key without its
secret fails there too, with botocore's ``PartialCredentialsError``: :func:`check` says either at
once, naming the option and, where one is obvious, the option meant. Which names s3fs takes is read
from its own signatures, and only when an option is not one of the common ones below (s3fs is not
imported where obstore serves the URL with common options).
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from typing import Any

from zarrckpt.errors import ZarrckptError

# s3fs's own options, fsspec's that S3FileSystem passes on, and aiobotocore's session's (a test keeps
# this a subset of what their signatures take)
# fmt: off
COMMON = frozenset({
    "anon", "endpoint_url", "key", "secret", "token", "use_ssl", "client_kwargs", "config_kwargs",
    "s3_additional_kwargs", "requester_pays", "version_aware", "session", "username", "password", "profile",
    "skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths", "default_block_size",
    "default_fill_cache", "default_cache_type", "fixed_upload_size", "cache_regions",
})
COMMON_CLIENT = frozenset({
    "region_name", "api_version", "use_ssl", "verify", "endpoint_url", "aws_access_key_id",
    "aws_secret_access_key", "aws_session_token", "config", "aws_account_id",
})
COMMON_CONFIG = frozenset({
    "region_name", "signature_version", "connect_timeout", "read_timeout", "max_pool_connections", "s3",
    "retries", "tcp_keepalive", "proxies",
})
# fmt: on
_REGION = 'client_kwargs=\'{"region_name": "..."}\''
# what users write for what s3fs calls otherwise (the AWS CLI's, boto3's, other tools' names)
MEANT = {
    "endpoint": "endpoint_url",
    "endpointurl": "endpoint_url",
    "endpoint-url": "endpoint_url",
    "url": "endpoint_url",
    "host": "endpoint_url",
    "aws_endpoint_url": "endpoint_url",
    "s3_endpoint": "endpoint_url",
    "region": _REGION,
    "region_name": _REGION,
    "aws_region": _REGION,
    "access_key": "key",
    "access_key_id": "key",
    "aws_access_key_id": "key",
    "secret_key": "secret",
    "secret_access_key": "secret",
    "aws_secret_access_key": "secret",
    "session_token": "token",
    "aws_session_token": "token",
    "verify": "client_kwargs='{\"verify\": false}'",
    "verify_ssl": "client_kwargs='{\"verify\": false}'",
    "anonymous": "anon",
}
MEANT_CLIENT = {"region": "region_name", "endpoint": "endpoint_url", "key": "aws_access_key_id"}
MEANT_CLIENT |= {"secret": "aws_secret_access_key", "token": "aws_session_token"}
MEANT_CONFIG = {"region": "region_name", "timeout": "connect_timeout or read_timeout"}
MEANT_CONFIG["addressing_style"] = '"s3": {"addressing_style": ...}'


def _accepted() -> set[str]:
    """Every top-level option S3FileSystem takes, read from the installed s3fs (and aiobotocore)."""
    from aiobotocore.session import AioSession
    from s3fs import S3FileSystem

    names = {p for p in inspect.signature(S3FileSystem.__init__).parameters if p not in ("self", "kwargs")}
    names |= {p for p in inspect.signature(AioSession.__init__).parameters if p != "self"}
    return names | {"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths"}


def _accepted_client() -> set[str]:
    """What ``client_kwargs`` may hold: botocore's ``create_client`` parameters."""
    from botocore.session import Session

    return {p for p in inspect.signature(Session.create_client).parameters if p not in ("self", "service_name")}


def _accepted_config() -> set[str]:
    """What ``config_kwargs`` may hold: botocore ``Config``'s options."""
    from botocore.config import Config

    return set(Config.OPTION_DEFAULTS)


def _unknown(name: str, where: str, meant: Mapping[str, str], known: set[str]) -> ZarrckptError:
    guess = meant.get(name.lower()) or next(iter(difflib.get_close_matches(name, sorted(known), n=1)), None)
    hint = f"; did you mean {guess}?" if guess else ""
    return ZarrckptError(
        f"unknown S3 storage option {where}{hint} (s3fs takes, among others: endpoint_url, key, secret, token, "
        "profile, anon, client_kwargs, config_kwargs)"
    )


def check(url: str, options: Mapping[str, Any] | None) -> None:
    """Raise ZarrckptError for an option s3fs would refuse only once a request is sent: a name it does
    not take (top level, in ``client_kwargs`` or ``config_kwargs``), or a key, secret or token given
    without the others."""
    opts = dict(options or {})
    strange = sorted(set(opts) - COMMON)
    if strange:
        known = _accepted()
        for name in strange:
            if name not in known:
                raise _unknown(name, repr(name), MEANT, known)
    for option, common, meant, accepted in (
        ("client_kwargs", COMMON_CLIENT, MEANT_CLIENT, _accepted_client),
        ("config_kwargs", COMMON_CONFIG, MEANT_CONFIG, _accepted_config),
    ):
        inner = opts.get(option)
        if inner is not None and not isinstance(inner, Mapping):
            raise ZarrckptError(f"S3 storage option {option} must be a JSON object, not {inner!r}")
        strange = sorted(set(inner or {}) - common)
        if strange:
            known = accepted()
            for name in strange:
                if name not in known:
                    raise _unknown(name, f"{option}[{name!r}]", meant, known)
    key, secret = opts.get("key") or opts.get("username"), opts.get("secret") or opts.get("password")
    if bool(key) != bool(secret) or (opts.get("token") and not (key and secret)):
        given = ", ".join(n for n in ("key", "secret", "token") if opts.get(n))
        missing = " and ".join(n for n, v in (("key", key), ("secret", secret)) if not v)
        raise ZarrckptError(
            f"incomplete S3 credentials for {url!r}: {given} given without {missing}; give key and secret "
            "together (--storage-option key=... --storage-option secret=...), or neither, to use the "
            "environment's ($AWS_ACCESS_KEY_ID and $AWS_SECRET_ACCESS_KEY, ~/.aws, a profile)"
        )
