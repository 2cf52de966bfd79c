"""``RemoteStore`` against a real S3-compatible server and a real HTTP server: exact ranges, parallel parts,
bounded retries, listing, and no secrets in messages."""

from __future__ import annotations

import errno
import http.server
import os
import threading

import pytest
from s3server import SECRET

from blockfs.storage.remote import RemoteConfigError, RemoteError, RemoteStore, parse_options
from blockfs.storage.urls import redact, scrub


@pytest.fixture
def bucket(s3):
    return s3.new_bucket()


def test_ranges_whole_objects_and_parts_come_back_exact(s3, bucket):
    store = RemoteStore(f"s3://{bucket}/data", {"part_size": 1000, "concurrency": 4})
    payload = os.urandom(10_123)
    store.put_bytes("x.bin", payload)
    assert store.get("x.bin") == payload
    assert bytes(store.get_range("x.bin", 17, 4000)) == payload[17:4017]
    out = bytearray(9_000)
    store.get_into("x.bin", 100, memoryview(out))
    assert bytes(out) == payload[100:9100]
    before = store.counters.snapshot()["requests"]
    store.get_into("x.bin", 0, memoryview(bytearray(10_000)))
    assert store.counters.snapshot()["requests"] - before == 10  # one GET per part
    with pytest.raises(RemoteError) as e:
        store.get_range("x.bin", 10_000, 500)  # past the end
    assert e.value.errno == errno.EIO or e.value.errno == errno.ENOENT
    store.close()


def test_a_missing_object_is_enoent_and_not_retried(s3, bucket):
    store = RemoteStore(f"s3://{bucket}/none")
    with pytest.raises(RemoteError) as e:
        store.get("nope")
    assert e.value.errno == errno.ENOENT and "s3://" in str(e.value) and "nope" in str(e.value)
    assert store.counters.snapshot()["retries"] == 0


def test_upload_from_a_file_in_parts_and_list_in_pages(s3, bucket, tmp_path):
    store = RemoteStore(f"s3://{bucket}/up", {"part_size": 5 << 20, "concurrency": 2})
    big = tmp_path / "big"
    big.write_bytes(os.urandom(11 << 20))  # three parts of a multipart upload
    store.put_file("big", big)
    assert store.get("big") == big.read_bytes()
    for i in range(3):
        store.put_bytes(f"dir/f{i}", b"x" * i)
    listed = sorted((o.name, o.size) for page in store.list("dir/") for o in page)
    assert listed == [("dir/f0", 0), ("dir/f1", 1), ("dir/f2", 2)]
    store.delete("dir/f0")
    store.delete("dir/f0")  # gone already: not an error
    assert not store.exists("dir/f0") and store.exists("dir/f1")


def test_a_stopped_server_fails_within_the_retry_window_and_is_counted(s3, bucket):
    store = RemoteStore(f"s3://{bucket}/r", {"retry_timeout": 1.0, "connect_timeout": 0.5})
    store.put_bytes("a", b"abc")
    s3.stop()
    try:
        with pytest.raises(RemoteError) as e:
            store.get("a")
        assert e.value.errno == errno.EIO and "gave up after" in str(e.value)
        counts = store.counters.snapshot()
        assert counts["retries"] >= 2 and counts["failures"] == 1
    finally:
        s3.start()
    assert store.get("a") == b"abc"  # the same store works once the server is back


class _NoRangeHandler(http.server.SimpleHTTPRequestHandler):
    """What ``python -m http.server`` does: ignores Range and answers 200 with the whole file."""

    def log_message(self, *args) -> None:
        pass


def test_an_http_server_that_ignores_range_is_refused_not_served(tmp_path):
    (tmp_path / "obj").write_bytes(bytes(range(256)) * 64)
    handler = lambda *a, **k: _NoRangeHandler(*a, directory=str(tmp_path), **k)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        store = RemoteStore(f"http://127.0.0.1:{server.server_address[1]}/")
        assert store.get("obj") == (tmp_path / "obj").read_bytes()  # a whole object is fine
        with pytest.raises(RemoteError) as e:
            store.get_range("obj", 100, 50)
        assert e.value.errno == errno.EIO and "range" in str(e.value).lower()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_secrets_never_appear_in_errors_or_reprs(s3, bucket, monkeypatch):
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    store = RemoteStore(f"s3://{bucket}/s", {"key": "AKIAWRONGWRONGWRONG0", "secret": SECRET})
    with pytest.raises(RemoteError) as e:
        store.get("missing-or-refused")
    assert SECRET not in str(e.value) and SECRET not in repr(store)
    assert redact("https://user:pw@host:8443/a/b?sig=abc") == "https://host:8443/a/b"
    assert scrub("GET https://u:p@h/x?X-Amz-Signature=1 failed; token sekrit-1", ["sekrit-1"]) == (
        "GET https://h/x failed; token ***"
    )


def test_storage_options_are_checked_and_translated():
    assert parse_options(["endpoint_url=http://x", "anon=true"]) == {"endpoint_url": "http://x", "anon": "true"}
    with pytest.raises(RemoteConfigError, match="KEY=VALUE"):
        parse_options(["novalue"])
    with pytest.raises(RemoteConfigError, match="part_size"):
        RemoteStore("s3://b/p", {"part_size": "lots"})


def test_5xx_and_throttling_are_retried_and_counted_but_404_is_not(tmp_path):
    from httpserver import serving

    (tmp_path / "obj").write_bytes(bytes(range(256)) * 16)
    with serving(tmp_path) as (base, faults):
        store = RemoteStore(base + "/")
        for status in (503, 429, 500):
            faults.fail_status, faults.fail_next = status, 2
            before = store.counters.snapshot()["retries"]
            assert bytes(store.get_range("obj", 10, 20)) == (bytes(range(256)) * 16)[10:30]
            assert store.counters.snapshot()["retries"] - before == 2
        faults.fail_status, faults.fail_next = 403, 1
        with pytest.raises(RemoteError):
            store.get_range("obj", 0, 4)
        assert store.counters.snapshot()["retries"] == 6  # a refusal is not retried
        with pytest.raises(RemoteError) as e:
            store.get("missing")
        assert e.value.errno == errno.ENOENT and store.counters.snapshot()["retries"] == 6


@pytest.mark.parametrize(
    "url, options, kind",
    [
        ("gs://bucket/prefix", {"anon": "true"}, "GCSStore"),
        ("az://container/prefix", {"account_name": "acct", "anon": "true"}, "AzureStore"),
        ("abfs://container/prefix", {"account_name": "acct", "anon": "true"}, "AzureStore"),
        ("s3a://bucket/prefix", {"anon": True}, "S3Store"),
    ],
)
def test_gcs_azure_and_fsspec_schemes_reach_the_right_client(url, options, kind):
    """No emulator for GCS or Azure runs here: this checks the URL and options reach the right client
    (no request is sent), so a typo in a scheme or an option name is caught."""
    store = RemoteStore(url, options)
    assert type(store._store).__name__ == kind and "prefix" in repr(store._store)
    with pytest.raises(RemoteConfigError, match="no_such_option"):
        RemoteStore(url, {**options, "no_such_option": "1"})


def test_http_client_options_such_as_allow_http_are_taken_not_a_crash(s3, bucket):
    """``allow_http`` belongs to the HTTP client, not the S3 store: given as a storage option (as fsspec
    users do), obstore panicked on it; it is now passed where it belongs and the store works."""
    store = RemoteStore(f"s3://{bucket}/data", {"allow_http": "true"})
    store.put_bytes("y.bin", b"plain http")
    assert store.get("y.bin") == b"plain http"
    store.close()
