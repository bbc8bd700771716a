"""Which client serves an ``s3://`` URL, and obstore's settings for it (pure: no I/O, no client imported).

zarrckpt talks to S3 through obstore (Rust ``object_store``) where it can say exactly what the
user's s3fs ``storage_options`` mean, and through s3fs otherwise, so a URL and its options mean
the same whichever client serves them. :func:`translate` turns s3fs options into obstore's, or
names the option it cannot carry over (then s3fs serves the URL; with ``$ZARRCKPT_S3_CLIENT=obstore``
that is an error instead). ``$ZARRCKPT_S3_CLIENT=s3fs`` always picks s3fs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zarrckpt.errors import ZarrckptError

CLIENTS = ("auto", "obstore", "s3fs")

# s3fs / fsspec options that change nothing zarrckpt's Storage relies on: fsspec's instance and
# listing caches (Storage asks for fresh listings), file-object buffering (Storage reads and writes
# whole objects or ranges), and botocore's connection pool and retries (Storage bounds its own
# requests in flight and retries them itself, see zarrckpt.storage.retry).
_NO_EFFECT = {
    "skip_instance_cache",
    "use_listings_cache",
    "listings_expiry_time",
    "max_paths",
    "default_block_size",
    "default_fill_cache",
    "default_cache_type",
    "fixed_upload_size",
}
_NO_EFFECT_CONFIG = {"max_pool_connections", "retries", "tcp_keepalive"}
_SSE = {"ServerSideEncryption": "server_side_encryption", "SSEKMSKeyId": "sse_kms_key_id"}


@dataclass
class ObstoreSettings:
    """What :class:`zarrckpt.storage.obstorefs.ObstoreFS` needs to build one ``S3Store`` per bucket."""

    config: dict[str, Any] = field(default_factory=dict)  # obstore S3Config keys
    client_options: dict[str, Any] = field(default_factory=dict)  # obstore ClientConfig keys
    credentials: str = "given"  # "given" (in config), "anonymous", or "botocore": its chain, as s3fs
    profile: str | None = None  # the botocore profile for "botocore" credentials


class Untranslatable(Exception):
    """An s3fs option obstore cannot be told the same thing by (the message names it)."""


def choice(env: Mapping[str, str]) -> str:
    """``$ZARRCKPT_S3_CLIENT``: ``auto`` (the default), ``obstore`` or ``s3fs``."""
    value = env.get("ZARRCKPT_S3_CLIENT", "").strip().lower() or "auto"
    if value not in CLIENTS:
        raise ZarrckptError(f"ZARRCKPT_S3_CLIENT must be one of {', '.join(CLIENTS)}, not {value!r}")
    return value


def _flag(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() in ("1", "true", "yes", "on")


def _timeout(value: Any) -> str:
    return f"{float(value)}s"


def translate(options: Mapping[str, Any] | None, env: Mapping[str, str]) -> ObstoreSettings:
    """obstore's settings for s3fs ``options`` (plus the environment botocore reads), or raise
    :class:`Untranslatable` naming the first option that has no exact obstore equivalent."""
    opts = dict(options or {})
    out = ObstoreSettings()
    cfg, client = out.config, out.client_options
    client_kwargs = dict(opts.pop("client_kwargs", None) or {})
    config_kwargs = dict(opts.pop("config_kwargs", None) or {})
    for name in _NO_EFFECT:
        opts.pop(name, None)

    endpoint = opts.pop("endpoint_url", None) or client_kwargs.pop("endpoint_url", None)
    endpoint = endpoint or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")  # botocore's order
    if endpoint:
        cfg["endpoint"] = str(endpoint).rstrip("/")
        client["allow_http"] = str(endpoint).startswith("http://")
    region = client_kwargs.pop("region_name", None) or config_kwargs.pop("region_name", None)
    region = region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        cfg["region"] = str(region)
    if "verify" in client_kwargs:
        verify = client_kwargs.pop("verify")
        if verify is not False and verify is not True:
            raise Untranslatable("client_kwargs['verify'] (a CA bundle path)")
        client["allow_invalid_certificates"] = not verify
    aliases = (("aws_access_key_id", "key"), ("aws_secret_access_key", "secret"), ("aws_session_token", "token"))
    for key, name in aliases:
        if key in client_kwargs:
            opts.setdefault(name, client_kwargs.pop(key))
    if client_kwargs:
        raise Untranslatable(f"client_kwargs[{sorted(client_kwargs)[0]!r}]")

    s3 = dict(config_kwargs.pop("s3", None) or {})
    cfg["unsigned_payload"] = not _flag(s3.pop("payload_signing_enabled", False))  # zarrckpt's s3fs default
    style = s3.pop("addressing_style", "auto")
    if style in ("virtual", "path"):
        cfg["virtual_hosted_style_request"] = style == "virtual"
    elif style != "auto":
        raise Untranslatable(f"config_kwargs['s3']['addressing_style']={style!r}")
    if s3:
        raise Untranslatable(f"config_kwargs['s3'][{sorted(s3)[0]!r}]")
    for key in ("connect_timeout", "read_timeout"):
        if key in config_kwargs:
            client[key] = _timeout(config_kwargs.pop(key))
    if config_kwargs.pop("signature_version", "s3v4") not in ("s3v4", "v4"):
        raise Untranslatable("config_kwargs['signature_version']")
    for name in _NO_EFFECT_CONFIG:
        config_kwargs.pop(name, None)
    if config_kwargs:
        raise Untranslatable(f"config_kwargs[{sorted(config_kwargs)[0]!r}]")

    extra = dict(opts.pop("s3_additional_kwargs", None) or {})
    for key, name in _SSE.items():
        if key in extra:
            cfg[name] = str(extra.pop(key))
    if extra:
        raise Untranslatable(f"s3_additional_kwargs[{sorted(extra)[0]!r}]")
    if _flag(opts.pop("requester_pays", False)):
        cfg["request_payer"] = True
    if _flag(opts.pop("version_aware", False)):
        raise Untranslatable("version_aware")
    if not _flag(opts.pop("use_ssl", True)) and not endpoint:
        raise Untranslatable("use_ssl=False without endpoint_url")

    key, secret, token = opts.pop("key", None), opts.pop("secret", None), opts.pop("token", None)
    profile = opts.pop("profile", None)
    if _flag(opts.pop("anon", False)):
        cfg["skip_signature"] = True
        out.credentials = "anonymous"
    elif key and secret:
        cfg["access_key_id"], cfg["secret_access_key"] = str(key), str(secret)
        if token:
            cfg["session_token"] = str(token)
    elif key or secret or token:
        raise Untranslatable("key/secret/token: one given without the others")
    else:
        out.credentials, out.profile = "botocore", str(profile) if profile else None
    if opts:
        raise Untranslatable(sorted(opts)[0])
    if "region" not in cfg and "endpoint" not in cfg and out.credentials != "botocore":
        # botocore follows a bucket's region redirect; object_store needs to be told the region.
        raise Untranslatable("no region (client_kwargs['region_name'] or $AWS_REGION) for an AWS bucket")
    return out
