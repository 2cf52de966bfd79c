"""Telling a URL from a path, and writing a URL where people will read it (logs, errors, ``stats.json``).

A URL may carry a secret (``https://user:token@host/``, an Azure SAS query string): :func:`redact` drops
the user part and the query, and every message about a remote object is built from the redacted form.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import TypeGuard
from urllib.parse import urlsplit, urlunsplit

# scheme -> the kind of store; fsspec's spellings are accepted, since they are what users already type
SCHEMES = {
    "s3": "s3",
    "s3a": "s3",
    "gs": "gcs",
    "gcs": "gcs",
    "az": "azure",
    "abfs": "azure",
    "abfss": "azure",
    "azure": "azure",
    "adl": "azure",
    "http": "http",
    "https": "http",
}


def is_remote(location: str | os.PathLike) -> TypeGuard[str]:
    """Whether ``location`` names an object store (a URL with a known scheme) rather than a local path."""
    if not isinstance(location, str):
        return False
    scheme, sep, _ = location.partition("://")
    return bool(sep) and scheme.lower() in SCHEMES


_URL = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*)://")


def check_scheme(location: str | os.PathLike) -> None:
    """Refuse a URL of a scheme blockfs does not read (``s4://``), naming the ones it does: such a
    location would otherwise be taken for a relative path."""
    match = _URL.match(location) if isinstance(location, str) else None
    if match and match.group(1).lower() not in SCHEMES:
        raise ValueError(
            f"{location!r}: unknown scheme '{match.group(1)}://'; blockfs reads s3://, gs://, az://, http:// and "
            f"https:// URLs (also {', '.join(k for k in SCHEMES if k not in ('s3', 'gs', 'az', 'http', 'https'))}) "
            "or a local path"
        )


def absolute(location: str | os.PathLike) -> str:
    """A URL as given; a path made absolute (libfuse 3 changes the working directory once mounted)."""
    check_scheme(location)
    return location if is_remote(location) else os.path.abspath(os.fspath(location))


def store_kind(url: str) -> str:
    """``"s3"``, ``"gcs"``, ``"azure"`` or ``"http"``."""
    return SCHEMES[url.partition("://")[0].lower()]


def redact(url: str) -> str:
    """The URL without user, password or query string: what may appear in a log line or an error."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    netloc = host if "@" in parts.netloc else parts.netloc
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


_USERINFO = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s@]+@")
_QUERY = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s?]*)\?[^\s]*")


def scrub(text: str, secrets: Sequence[str] = ()) -> str:
    """``text`` with every URL's user part and query string dropped and every secret value masked."""
    text = _QUERY.sub(r"\1", _USERINFO.sub(r"\1", text))
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    return text


def join(url: str, name: str) -> str:
    """``name`` under the prefix ``url`` (one slash between)."""
    return url.rstrip("/") + "/" + name.lstrip("/")
