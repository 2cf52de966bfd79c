"""``RemoteStore``: one prefix of an object store (S3 or S3-compatible, GCS, Azure, HTTP), through obstore.

Why obstore: it is Rust (``object_store``) and releases the GIL, so parallel ranged GETs from Python
threads overlap; measured on loopback it answers a 4 KiB GET in a fraction of boto3's time
(``tools/bench/bench_remote.py --clients``, figures in the README).  Its URL and option names are the ones users
know from fsspec, and the fsspec spellings (``endpoint_url``, ``key``, ``secret``, ``anon``) are accepted.

What this layer adds to the client:

* **Exact ranges.** A ranged GET must return exactly the bytes asked for.  A server that ignores ``Range``
  (``python -m http.server`` answers 200 with the whole object) is refused with a clear error, never
  served as the range.
* **Bounded retries, counted.** Timeouts, resets, 5xx and throttling replies are retried here (obstore's
  own retries are off so that each one is counted) with exponential backoff until ``retry_timeout``
  seconds have passed; then the request fails with an ``OSError`` (EIO) naming the object.  A missing
  object or a refused credential is not retried.
* **No secrets in messages.** Every message names objects by their redacted URL and passes the client's
  text through :func:`~blockfs.storage.urls.scrub`, which also masks the values of secret options.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Generator, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from ..errors import BlockfsError
from .credentials import secret_values
from .urls import is_remote, join, redact, scrub, store_kind

log = logging.getLogger(__name__)  # the client's raw text of a failure, at debug level (blockfs -v)

# Options blockfs itself reads (the rest go to the client); defaults chosen with tools/bench/bench_remote.py.
PART_SIZE = 8 << 20  # bytes per ranged GET when a whole block is fetched
CONCURRENCY = 16  # ranged GETs in flight per store
RETRY_TIMEOUT = 30.0  # seconds one request may spend retrying before it fails
REQUEST_TIMEOUT = 60.0  # seconds one HTTP request may take
CONNECT_TIMEOUT = 5.0

# fsspec / s3fs spellings users already type -> obstore's
ALIASES = {
    "endpoint_url": "endpoint",
    "key": "access_key_id",
    "secret": "secret_access_key",
    "token": "session_token",
    "anon": "skip_signature",
    "region_name": "region",
}


class RemoteError(BlockfsError, OSError):
    """A remote request failed for good (after any retries): ``errno`` says how (EIO, ENOENT, EACCES)."""

    errno: int  # always set, unlike OSError's (int | None)

    def __init__(self, code: int, message: str) -> None:
        super().__init__(code, message)
        self.errno = code  # BlockfsError's class-wide EIO would hide OSError's own

    def __str__(self) -> str:
        return self.strerror or super().__str__()


class RemoteConfigError(BlockfsError, ValueError):
    """A URL or storage option blockfs cannot use."""


class CredentialsRefusedError(RemoteError, PermissionError):
    """The store answered 401 or 403: the credentials are wrong, expired, or may not read this."""


class BucketNotFoundError(RemoteError, FileNotFoundError):
    """The bucket (or container) of the URL does not exist.  Not ENOENT, which says an object is missing:
    ``exists`` and the callers that ask it must not take a missing bucket for a missing object."""


class EndpointUnreachableError(RemoteError, ConnectionError):
    """No connection could be made to the store's endpoint before anything was ever read from it."""


@dataclass(frozen=True)
class RemoteSettings:
    part_size: int = PART_SIZE
    concurrency: int = CONCURRENCY
    retry_timeout: float = RETRY_TIMEOUT
    request_timeout: float = REQUEST_TIMEOUT
    connect_timeout: float = CONNECT_TIMEOUT


@dataclass(frozen=True)
class ObjectInfo:
    name: str  # relative to the store's prefix
    size: int
    mtime_ns: int


class RemoteCounters:
    """Requests, bytes, retries and failures, thread-safe (``stats.json``'s ``remote`` section)."""

    FIELDS = ("requests", "bytes", "retries", "failures", "puts", "bytes_put")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self.FIELDS, 0)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


_STATUS = re.compile(r"status(?: code)?:? (\d{3})")
_PAST_THE_END = re.compile(r"InvalidRangeRequest|Wanted range starting at")


def _retriable(e: Exception) -> bool:
    """Whether a failed request may succeed if sent again: connection trouble, timeouts, 5xx, 408, 429."""
    from obstore.exceptions import GenericError

    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    if not isinstance(e, GenericError):
        return False
    if _PAST_THE_END.search(str(e)):
        return False  # the client's own check of a range against the object's size: no status, not transient
    m = _STATUS.search(str(e))
    if m is None:
        return True  # no HTTP status: the connection failed or timed out
    status = int(m.group(1))
    return status >= 500 or status in (408, 429)


class RangeNotServedError(RemoteError):
    """The server answered a ranged GET with more than the range: a limit of the server, not damage."""


# Connection trouble, as obstore (reqwest, hyper) words it, and what to call it in a message.
_CONNECT = re.compile(r"kind: Connect\b|tcp connect error|dns error|error trying to connect|ConnectionRefused", re.I)
_CONNECT_WHY = (
    (re.compile(r"ConnectionRefused|connection refused", re.I), "connection refused"),
    (re.compile(r"dns error|failed to lookup|Name or service not known", re.I), "the host name does not resolve"),
    (re.compile(r"TimedOut|timed out|deadline", re.I), "no answer"),
)
_REQUEST_URI = re.compile(r"(https?://[^/\s,)\"']+)")
_ERROR_CODE = re.compile(r"<Code>([A-Za-z.]{1,64})</Code>")
_NO_BUCKET = re.compile(r"<Code>(NoSuchBucket|ContainerNotFound)</Code>")
# The fix for refused credentials, by kind of store.
CHECK_CREDENTIALS = {
    "s3": "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or the access_key_id/secret_access_key options, "
    "or AWS_PROFILE), that they have not expired, and that they may read this bucket",
    "gcs": "check GOOGLE_APPLICATION_CREDENTIALS (or the service_account_path option) and that the account "
    "may read this bucket",
    "azure": "check AZURE_STORAGE_ACCOUNT_KEY or the SAS token (the account_key/sas_key options), that it has "
    "not expired, and that it may read this container",
    "http": "check the URL (a signed URL may have expired) and that the server lets this machine read it",
}
# Where a store's secrets may come from besides the options: never in a message or a log line.
SECRET_VARIABLES = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_SAS_KEY",
    "AZURE_CLIENT_SECRET",
    "GOOGLE_SERVICE_ACCOUNT_KEY",
)


def _connect_failure(e: BaseException) -> bool:
    return isinstance(e, ConnectionError) or bool(_CONNECT.search(str(e)))


def _connect_why(text: str) -> str:
    return next((why for pattern, why in _CONNECT_WHY if pattern.search(text)), "the connection failed")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def parse_options(pairs: list[str] | None) -> dict[str, str]:
    """``["key=value", ...]`` (the CLI's ``--storage-option``) as a dict."""
    options: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise RemoteConfigError(f"--storage-option {key.strip() or pair!r}: expected KEY=VALUE")
        options[key.strip()] = value
    return options


def split_options(options: Mapping[str, object] | None) -> tuple[RemoteSettings, dict[str, str]]:
    """blockfs's own settings, and the client's options with fsspec spellings translated."""
    given = dict(options or {})
    ours: dict[str, Any] = {}
    for field, kind in (
        ("part_size", int),
        ("concurrency", int),
        ("retry_timeout", float),
        ("request_timeout", float),
        ("connect_timeout", float),
    ):
        if field in given:
            raw: Any = given.pop(field)  # whatever the caller gave: int() or float() judges it
            try:
                ours[field] = kind(raw)
            except (TypeError, ValueError):
                raise RemoteConfigError(f"storage option {field}: expected a number, got {raw!r}") from None
            if ours[field] <= 0 and field != "retry_timeout":
                raise RemoteConfigError(f"storage option {field}: must be > 0")
    client: dict[str, str] = {}
    for key, value in given.items():
        key = ALIASES.get(key, key)
        if isinstance(value, bool):
            value = "true" if value else "false"
        client[key] = str(value)
    return RemoteSettings(**ours), client


def _no_obstore() -> str:
    """Why there is no obstore, and the fix: on Python 3.10 there is none to install."""
    if sys.version_info < (3, 11):
        return (
            f"remote datasets (URLs) need Python >= 3.11: their client, obstore, has no wheel for Python "
            f"{sys.version_info[0]}.{sys.version_info[1]}; run blockfs with Python 3.11 or later (local paths "
            "work on 3.10)"
        )
    return "remote datasets (URLs) need the 'obstore' package: pip install 'blockfs[remote]'"


KIND_NAMES = {"s3": "S3", "gcs": "GCS", "azure": "Azure", "http": "HTTP"}
OWN_OPTIONS = ("part_size", "concurrency", "retry_timeout", "request_timeout", "connect_timeout")
# The store's configuration keys most people need, when obstore's stubs cannot be read for the full list.
COMMON_KEYS = {
    "s3": (
        "access_key_id",
        "secret_access_key",
        "session_token",
        "region",
        "endpoint",
        "skip_signature",
        "virtual_hosted_style_request",
        "role_arn",
    ),
    "gcs": ("service_account_path", "service_account_key", "application_credentials", "skip_signature"),
    "azure": (
        "account_name",
        "account_key",
        "sas_key",
        "client_id",
        "client_secret",
        "tenant_id",
        "use_emulator",
        "endpoint",
        "skip_signature",
    ),
}
_STUBS = {"s3": ("_aws.pyi", "S3Config"), "gcs": ("_gcs.pyi", "GCSConfig"), "azure": ("_azure.pyi", "AzureConfig")}
# What each kind of store reads its credentials from, for the error when it finds none.
CREDENTIALS = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, with boto3 installed), or pass "
    "--storage-option access_key_id=... and secret_access_key=...; a public bucket: --storage-option anon=true",
    "gcs": "set GOOGLE_APPLICATION_CREDENTIALS=/path/to/key.json, or pass --storage-option "
    "service_account_path=/path/to/key.json; a public bucket: --storage-option anon=true",
    "azure": "set AZURE_STORAGE_ACCOUNT_KEY (or a SAS token: --storage-option sas_key=...), or pass "
    "--storage-option account_key=...; a public container: --storage-option anon=true",
}
# obstore's words when no credentials were found anywhere and it fell back to a cloud metadata service
_NO_CREDENTIALS = re.compile(
    r"169\.254\.169\.254|latest/api/token|computeMetadata|metadata/identity|token request|no credentials", re.I
)


def valid_keys(kind: str) -> list[str]:
    """The storage options a store of ``kind`` takes: obstore's own list (read from its type stubs, the only
    place it is written down), else the common ones."""
    keys: list[str] = []
    stub, name = _STUBS.get(kind, ("", ""))
    try:
        import obstore

        path = os.path.join(os.path.dirname(obstore.__file__), "_store", stub)
        with open(path, encoding="utf-8") as f:
            inside = False
            for line in f:
                if line.startswith("class "):
                    inside = line.startswith(f"class {name}(")
                elif inside and re.match(r"    [a-z_]+:", line):
                    keys.append(line.split(":")[0].strip())
    except (ImportError, OSError):
        pass
    return keys or list(COMMON_KEYS.get(kind, ()))


# Options of the HTTP client rather than of the store; obstore takes them apart from the store's config.
CLIENT_OPTIONS = frozenset({"allow_http", "allow_invalid_certificates", "proxy_url", "user_agent"})


class RemoteStore:
    """Objects under one URL prefix: GET (whole, ranged, in parallel parts), PUT, DELETE and LIST."""

    def __init__(self, url: str, options: Mapping[str, object] | None = None) -> None:
        if not is_remote(url):
            raise RemoteConfigError(f"{url!r} is not a remote URL (s3://, gs://, az://, http(s)://)")
        try:
            import obstore  # noqa: F401
        except ImportError:
            raise RemoteConfigError(_no_obstore()) from None
        self.url = url.rstrip("/")
        self.display = redact(self.url)
        self.kind = store_kind(url)
        self.settings, client_options = split_options(options)
        self._secrets = secret_values(client_options)
        self._secrets += [os.environ[k] for k in SECRET_VARIABLES if os.environ.get(k)]
        self._endpoint = client_options.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL") or ""
        self._reached = False  # whether any request has had an answer: until then, connect failures end early
        self._store = self._build(client_options)
        self.counters = RemoteCounters()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def _build(self, config: dict[str, str]):
        from obstore.exceptions import BaseError
        from obstore.store import from_url

        s = self.settings
        client_options = {"timeout": f"{s.request_timeout}s", "connect_timeout": f"{s.connect_timeout}s"}
        endpoint = config.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT")
        if (endpoint or self.url).startswith("http://"):
            client_options["allow_http"] = "true"
        for key in CLIENT_OPTIONS & config.keys():  # the HTTP client's, not the store's
            client_options[key] = config.pop(key)
        # config holds the user's keys as strings; obstore checks them (its typed dicts list the known ones)
        kwargs: dict[str, Any] = {"client_options": client_options, "retry_config": {"max_retries": 0}}
        if self.kind != "http":
            kwargs["config"] = config
            provider = self._profile_credentials(config)
            if provider is not None:
                kwargs["credential_provider"] = provider
        elif config:
            raise RemoteConfigError(f"{self.display}: an HTTP store takes no storage options except blockfs's own")
        try:
            return from_url(self.url, **kwargs)
        except BaseError as e:
            text = self._scrub(_first_line(e))
            bad = re.search(r"key: '([^']*)' is not valid", text)
            if bad:
                raise RemoteConfigError(
                    f"{self.display}: --storage-option {bad.group(1)} is not an option of {KIND_NAMES[self.kind]}; valid keys: "
                    f"{', '.join(valid_keys(self.kind))}; blockfs's own: {', '.join(OWN_OPTIONS)}; fsspec "
                    f"spellings: {', '.join(ALIASES)}"
                ) from None
            if "Account must be specified" in text:
                raise RemoteConfigError(
                    f"{self.display}: no Azure storage account given: set AZURE_STORAGE_ACCOUNT_NAME or pass "
                    "--storage-option account_name=NAME"
                ) from None
            raise RemoteConfigError(f"{self.display}: {text}") from None
        except BaseException as e:  # obstore panics (a BaseException, not its BaseError) on some keys
            if type(e).__name__ != "PanicException":
                raise
            raise RemoteConfigError(
                f"{self.display}: a storage option was not understood ({self._scrub(_first_line(e))}); "
                f"given: {', '.join(sorted(config)) or 'none'}"
            ) from None

    def _profile_credentials(self, config: dict[str, str]):
        """AWS profiles (``~/.aws``, ``AWS_PROFILE``), which obstore does not read, through boto3's chain
        when boto3 is installed and no keys were given another way."""
        if self.kind != "s3" or "access_key_id" in config or config.get("skip_signature") == "true":
            return None
        if os.environ.get("AWS_ACCESS_KEY_ID") or os.environ.get("AWS_WEB_IDENTITY_TOKEN_FILE"):
            return None
        if not (os.environ.get("AWS_PROFILE") or os.path.exists(os.path.expanduser("~/.aws/credentials"))):
            return None
        try:
            from obstore.auth.boto3 import Boto3CredentialProvider
        except ImportError:
            return None
        return Boto3CredentialProvider()

    # --- naming ----------------------------------------------------------------------------------------
    def where(self, name: str) -> str:
        """The object's URL as it may appear in a message (redacted)."""
        return join(self.display, name)

    def _scrub(self, text: str) -> str:
        return scrub(text, self._secrets)

    # --- requests ----------------------------------------------------------------------------------------
    def _call(self, what: str, name: str, request):
        """``request()`` with bounded, counted retries; a failure becomes a RemoteError naming the object."""
        from obstore.exceptions import (
            BaseError,
            NotFoundError,
            NotSupportedError,
            PermissionDeniedError,
            UnauthenticatedError,
        )

        started = time.monotonic()
        delay, tries = 0.05, 0
        while True:
            tries += 1
            self.counters.add("requests")
            try:
                result = request()
                self._reached = True
                return result
            except (NotFoundError, FileNotFoundError) as e:
                self._reached = True
                self._failed(what, name, e)
                if _NO_BUCKET.search(str(e)):
                    raise self._no_bucket() from None
                raise RemoteError(errno.ENOENT, f"{self.where(name)}: no such object") from None
            except NotSupportedError as e:  # e.g. a ranged GET answered with the whole object
                self._failed(what, name, e)
                raise RemoteError(
                    errno.EOPNOTSUPP, f"{self.where(name)}: {what} not supported: {self._scrub(_first_line(e))}"
                ) from None
            except (PermissionDeniedError, UnauthenticatedError, PermissionError) as e:
                self._reached = True
                self._failed(what, name, e)
                raise self._refused(what, name, e) from None
            except (BaseError, OSError) as e:  # the client's errors, and a connection's
                if self.kind in CREDENTIALS and _NO_CREDENTIALS.search(str(e)):
                    self._failed(what, name, e)
                    raise RemoteError(
                        errno.EACCES,
                        f"{self.where(name)}: no {KIND_NAMES[self.kind]} credentials found: {CREDENTIALS[self.kind]}",
                    ) from None
                status = _STATUS.search(str(e))
                if status is not None:  # an answer (a LIST's errors come as generic ones, status in the text)
                    self._reached = True
                    if status.group(1) in ("401", "403"):
                        self._failed(what, name, e)
                        raise self._refused(what, name, e) from None
                    if _NO_BUCKET.search(str(e)):
                        self._failed(what, name, e)
                        raise self._no_bucket() from None
                waited = time.monotonic() - started
                # Before the store ever answered, a connection that fails is more likely a wrong endpoint or
                # a server that is down than a blip: give up after connect_timeout, not retry_timeout.
                unreached = not self._reached and _connect_failure(e)
                window = (
                    min(self.settings.connect_timeout, self.settings.retry_timeout)
                    if unreached
                    else self.settings.retry_timeout
                )
                if not _retriable(e) or waited + delay > window:
                    self._failed(what, name, e)
                    if unreached:
                        raise self._unreachable(e, waited) from None
                    gave_up = f" (gave up after {tries} tries in {waited:.1f} s)" if tries > 1 else ""
                    raise RemoteError(
                        errno.EIO, f"{self.where(name)}: {what} failed: {self._scrub(_first_line(e))}{gave_up}"
                    ) from None
                self.counters.add("retries")
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    # --- what a failure is called ------------------------------------------------------------------------
    def _failed(self, what: str, name: str, e: BaseException) -> None:
        """Count a failure; the client's whole text goes to the debug log (``blockfs -v``), scrubbed."""
        self.counters.add("failures")
        log.debug("%s %s failed: %s", what, self.where(name), self._scrub(str(e)))

    def _where_endpoint(self, text: str = "") -> str:
        """The endpoint a request went to: the option's, else the one in the client's text, else the URL."""
        found = _REQUEST_URI.search(text)
        return redact(self._endpoint or (found.group(1) if found else self.display))

    def _refused(self, what: str, name: str, e: BaseException) -> RemoteError:
        text = str(e)
        status = next(iter(_STATUS.findall(text)), None)
        code = _ERROR_CODE.search(text)
        said = ", ".join(x for x in (status, code.group(1) if code else None) if x) or "refused"
        return CredentialsRefusedError(
            errno.EACCES,
            f"{self.where(name)}: the {KIND_NAMES[self.kind]} store refused the credentials ({what}: {said}): "
            f"{CHECK_CREDENTIALS[self.kind]}",
        )

    def _no_bucket(self) -> RemoteError:
        bucket = self.url.split("://", 1)[1].split("/", 1)[0]
        where = f" at {redact(self._endpoint)}" if self._endpoint else ""
        kind = "container" if self.kind == "azure" else "bucket"
        return BucketNotFoundError(
            errno.EIO,
            f"{kind} {bucket!r} does not exist{where} ({self.display}): check the {kind} name in the URL"
            + (" and the endpoint" if self._endpoint else ""),
        )

    def _unreachable(self, e: BaseException, waited: float) -> RemoteError:
        endpoint = self._where_endpoint(str(e))
        fix = (
            "check the endpoint (the endpoint storage option or AWS_ENDPOINT_URL) and that the server is running"
            if self._endpoint
            else "check the URL, and this machine's network and proxy settings"
        )
        return EndpointUnreachableError(
            errno.EIO,
            f"cannot reach {endpoint} for {self.display}: {_connect_why(str(e))} (tried for "
            f"{waited:.1f} s; connect_timeout is {self.settings.connect_timeout:g} s): {fix}",
        )

    def get(self, name: str) -> bytes:
        """The whole object."""
        import obstore

        data = self._call("GET", name, lambda: obstore.get(self._store, name).bytes())
        self.counters.add("bytes", len(data))
        return bytes(data)

    def get_range(self, name: str, start: int, length: int) -> memoryview:
        """Exactly ``length`` bytes from ``start``, or a RemoteError (EIO) that says why not."""
        import obstore

        if length == 0:
            return memoryview(b"")
        try:
            data = self._call("GET", name, lambda: obstore.get_range(self._store, name, start=start, length=length))
        except RemoteError as e:
            if e.errno != errno.EOPNOTSUPP:
                raise
            raise self._range_ignored(name, start, length, "the whole object") from None
        view = memoryview(data)
        self.counters.add("bytes", len(view))
        if len(view) > length:
            self.counters.add("failures")
            raise self._range_ignored(name, start, length, f"{len(view)} bytes")
        if len(view) < length:
            self.counters.add("failures")
            raise RemoteError(
                errno.EIO,
                f"{self.where(name)}: the object ends early ({len(view)} of {length} bytes at {start}): "
                "it changed or was cut short",
            )
        return view

    def _range_ignored(self, name: str, start: int, length: int, got: str) -> RemoteError:
        """The error for a server that answered a ranged GET with more than the range (HTTP 200)."""
        return RangeNotServedError(
            errno.EIO,
            f"{self.where(name)}: the server cannot serve byte ranges: it ignored the byte range (asked for {length} bytes at {start}, got "
            f"{got}): blockfs needs a store that answers ranged GETs (HTTP 206); serve the dataset from one that "
            "does (S3, GCS, Azure, nginx, a CDN), not 'python -m http.server'",
        )

    def get_into(self, name: str, start: int, view: memoryview) -> None:
        """Fill ``view`` from the object's bytes at ``start``: parallel ranged GETs of ``part_size``."""
        part = self.settings.part_size
        size = len(view)
        if size <= part:
            view[:] = self.get_range(name, start, size)
            return

        def fetch(offset: int) -> None:
            n = min(part, size - offset)
            view[offset : offset + n] = self.get_range(name, start + offset, n)

        futures = [self.pool.submit(fetch, offset) for offset in range(0, size, part)]
        try:
            for f in futures:
                f.result()
        finally:
            # On a failure, parts not started are dropped, and the ones running are waited for: none may
            # write into ``view`` once the caller has it back (a cache reuses a failed load's memory).
            for f in futures:
                f.cancel()
            wait(futures)

    @property
    def pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.settings.concurrency, thread_name_prefix="blockfs-get")
            return self._pool

    def exists(self, name: str) -> bool:
        import obstore

        try:
            self._call("HEAD", name, lambda: obstore.head(self._store, name))
        except RemoteError as e:
            if e.errno == errno.ENOENT:
                return False
            raise
        return True

    def version(self, name: str) -> tuple:
        """(ETag, size) of the object now: what tells a restored or replaced object from the one before."""
        import obstore

        meta = self._call("HEAD", name, lambda: obstore.head(self._store, name))
        return (meta.get("e_tag"), meta.get("version"), int(meta["size"]))

    def put_bytes(self, name: str, data: bytes) -> None:
        import obstore

        self._call("PUT", name, lambda: obstore.put(self._store, name, data))
        self.counters.add("puts")
        self.counters.add("bytes_put", len(data))

    def put_file(self, name: str, path: str | os.PathLike) -> None:
        """Upload a local file: multipart for a big one, ``part_size`` pieces, ``concurrency`` at once, so
        memory stays bounded whatever the file's size."""
        import obstore

        s = self.settings
        size = os.path.getsize(path)

        def put() -> None:
            with open(path, "rb") as f:
                obstore.put(
                    self._store,
                    name,
                    f,
                    chunk_size=s.part_size,
                    max_concurrency=s.concurrency,
                    use_multipart=size > s.part_size,
                )

        if self.kind == "http":
            raise RemoteConfigError(f"{self.display}: an HTTP store is read-only; pack to s3://, gs:// or az://")
        self._call("PUT", name, put)
        self.counters.add("puts")
        self.counters.add("bytes_put", size)

    def delete(self, name: str) -> None:
        """Remove an object; one that is not there is not an error."""
        import obstore

        try:
            self._call("DELETE", name, lambda: obstore.delete(self._store, name))
        except RemoteError as e:
            if e.errno != errno.ENOENT:
                raise

    def list(self, prefix: str = "") -> Generator[list[ObjectInfo], None, None]:
        """The objects under ``prefix`` (relative to the store's), a page at a time (close() ends the listing)."""
        import obstore

        stream: dict[str, Any] = {"pages": None, "yielded": False, "broken": False}

        def next_page():
            # A stream that failed ends (next() gives None), so a retry must not read it again: before any
            # page it starts the listing anew; after one, the listing cannot resume and fails.
            if stream["broken"]:
                raise OSError(errno.EIO, "the listing broke off after its first pages")
            if stream["pages"] is None:
                stream["pages"] = obstore.list(self._store, prefix=prefix or None, chunk_size=1000)
            try:
                return next(stream["pages"], None)
            except BaseException:
                stream["pages"] = None
                stream["broken"] = stream["yielded"]
                raise

        while True:
            page = self._call("LIST", prefix or "/", next_page)
            if page is None:
                return
            stream["yielded"] = True
            yield [ObjectInfo(o["path"], int(o["size"]), int(o["last_modified"].timestamp() * 1e9)) for o in page]

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None

    def __repr__(self) -> str:
        return f"RemoteStore({self.display!r})"
