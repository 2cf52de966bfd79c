"""An object store's failures as a user meets them (issue 28): refused credentials, a bucket that does not
exist, an endpoint nothing answers.  Each is one line naming the fix, exit status 2 from the CLI, nothing
left on disk, no credential in the message; the store's own text only with ``-v``."""

from __future__ import annotations

import subprocess
import sys
import tempfile

import pytest
from s3server import ACCESS_KEY, SECRET, closed_port, refusing_s3

from blockfs.cli import main
from blockfs.storage.remote import (
    BucketNotFoundError,
    CredentialsRefusedError,
    EndpointUnreachableError,
    RemoteStore,
)


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """The temporary directory blockfs would fetch a remote dataset's index into: must stay empty."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


@pytest.fixture
def s3_env(monkeypatch):
    """Credentials as the AWS variables give them; the endpoint is each test's."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    return monkeypatch


def failing(capsys, argv: list[str]) -> str:
    """``blockfs ARGV``'s stderr, checked to be one line (no traceback) and exit status 2."""
    pytest.importorskip("obstore")
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert SECRET not in err and ACCESS_KEY not in err
    return err


def test_refused_credentials_are_one_line_naming_what_to_check(capsys, s3_env, scratch):
    with refusing_s3() as endpoint:
        s3_env.setenv("AWS_ENDPOINT_URL", endpoint)
        err = failing(capsys, ["info", "s3://bucket/ds"])
        assert "the S3 store refused the credentials (GET: 403, InvalidAccessKeyId)" in err
        assert "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in err
        assert "<?xml" not in err and "Debug source" not in err
        assert not list(scratch.iterdir())
        # -v: the store's own words too, as a debug line, still without the secret
        verbose = subprocess.run(
            [sys.executable, "-m", "blockfs", "-v", "info", "s3://bucket/ds"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert verbose.returncode == 2
        assert "DEBUG: GET s3://bucket/ds/blockfs.json failed: " in verbose.stderr
        assert "InvalidAccessKeyId</Code>" in verbose.stderr and SECRET not in verbose.stderr
        with pytest.raises(CredentialsRefusedError) as raised:
            RemoteStore("s3://bucket/ds").get("blockfs.json")
        assert isinstance(raised.value, PermissionError) and raised.value.errno == 13


def test_a_bucket_that_does_not_exist_is_named_not_called_not_a_dataset(capsys, s3, scratch):
    err = failing(capsys, ["info", "s3://no-such-bucket-28/ds"])
    assert "bucket 'no-such-bucket-28' does not exist" in err and "check the bucket name in the URL" in err
    assert "not a packed dataset" not in err
    assert not list(scratch.iterdir())
    store = RemoteStore("s3://no-such-bucket-28/ds")
    with pytest.raises(BucketNotFoundError):
        store.get("blockfs.json")
    assert store.counters.snapshot()["retries"] == 0


def test_an_endpoint_nothing_answers_gives_up_after_the_connect_timeout_naming_it(capsys, s3_env, scratch):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    s3_env.setenv("AWS_ENDPOINT_URL", endpoint)
    err = failing(capsys, ["info", "s3://bucket/ds", "--storage-option", "connect_timeout=0.5"])
    assert f"cannot reach {endpoint} for s3://bucket/ds: connection refused" in err
    assert "connect_timeout is 0.5 s" in err and "check the endpoint" in err and "AWS_ENDPOINT_URL" in err
    assert "gave up after" not in err and "error sending request" not in err
    assert not list(scratch.iterdir())
    # Once the store has answered, a lost connection is retried for retry_timeout as before
    # (test_remote_store.py: a stopped server fails within the retry window); before, it ends early.
    store = RemoteStore("s3://bucket/ds", {"connect_timeout": 0.5, "retry_timeout": 60})
    with pytest.raises(EndpointUnreachableError):
        store.get("blockfs.json")


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "src" / "c").mkdir(parents=True)
    (tmp_path / "src" / "c" / "a.txt").write_bytes(b"a" * 100)
    return tmp_path / "src"


def test_packing_to_a_store_that_refuses_is_missing_or_unreachable_is_one_line_each(capsys, s3, tree, scratch):
    err = failing(capsys, ["pack", str(tree), "s3://no-such-bucket-28/ds"])
    assert "bucket 'no-such-bucket-28' does not exist" in err and "does the bucket exist" not in err
    with refusing_s3() as endpoint:
        err = failing(capsys, ["pack", str(tree), "s3://bucket/ds", "--storage-option", f"endpoint={endpoint}"])
        assert "the S3 store refused the credentials (LIST: 403, InvalidAccessKeyId)" in err
    endpoint = f"http://127.0.0.1:{closed_port()}"
    # The listing's stream, failed, must not be read again as an empty listing (then 30 s of HEADs).
    err = failing(
        capsys,
        [
            "pack",
            str(tree),
            "s3://bucket/ds",
            "--storage-option",
            f"endpoint={endpoint}",
            "--storage-option",
            "connect_timeout=0.5",
        ],
    )
    assert f"cannot reach {endpoint} for s3://bucket/ds: connection refused" in err
    assert not list(scratch.iterdir())  # no staging directory left behind
