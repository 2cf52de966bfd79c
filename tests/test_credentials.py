"""Every spelling of every credential is kept out of fstab and masked wherever a value could show.

obstore lowercases its keys, so ``storage.AWS_SECRET_ACCESS_KEY`` is the secret as surely as
``secret_access_key``; each spelling below (obstore's S3, GCS and Azure aliases, the environment names it
mirrors, boto3's and fsspec's) goes through the mount helper (refused in one line that says where the
credential goes instead) and through the scrub a remote store applies to its logs and errors, the mount's
handed-off command line and the options' repr.
"""

from __future__ import annotations

import re

import pytest

from blockfs.cli.mount_commands import _secret_free
from blockfs.cli.mount_helper import blockfs_argv
from blockfs.core.location import StorageOptions
from blockfs.storage import remote
from blockfs.storage.credentials import is_credential

SECRET = "Sup3rS3cretValue+/="

S3 = [
    "access_key_id",
    "aws_access_key_id",
    "AWS_ACCESS_KEY_ID",
    "secret_access_key",
    "aws_secret_access_key",
    "AWS_SECRET_ACCESS_KEY",
    "Aws_Secret_Access_Key",
    "session_token",
    "aws_session_token",
    "AWS_SESSION_TOKEN",
    "aws_token",
    "AWS_TOKEN",
    "token",
    "sse_customer_key_base64",
    "aws_sse_customer_key_base64",
    "AWS_SSE_CUSTOMER_KEY_BASE64",
    "aws_security_token",
    "AWS_SECURITY_TOKEN",  # boto3's older name for the session token
    "key",
    "secret",
    "password",  # fsspec / s3fs
]
GCS = [
    "service_account_key",
    "google_service_account_key",
    "GOOGLE_SERVICE_ACCOUNT_KEY",
    "bearer_token",
    "google_bearer_token",
    "GOOGLE_BEARER_TOKEN",
]
AZURE = [
    "account_key",
    "access_key",
    "master_key",
    "azure_storage_account_key",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "azure_storage_access_key",
    "AZURE_STORAGE_ACCESS_KEY",
    "azure_storage_master_key",
    "AZURE_STORAGE_MASTER_KEY",
    "sas_key",
    "sas_token",
    "azure_storage_sas_key",
    "AZURE_STORAGE_SAS_KEY",
    "azure_storage_sas_token",
    "AZURE_STORAGE_SAS_TOKEN",
    "azure_storage_token",
    "AZURE_STORAGE_TOKEN",
    "client_secret",
    "azure_client_secret",
    "AZURE_CLIENT_SECRET",
    "azure_storage_client_secret",
    "AZURE_STORAGE_CLIENT_SECRET",
    "fabric_session_token",
    "azure_fabric_session_token",
    "AZURE_FABRIC_SESSION_TOKEN",
    "encryption_key",
    "azure_storage_encryption_key",
    "AZURE_STORAGE_ENCRYPTION_KEY",
    "AZURE_ENCRYPTION_KEY",
]
SPELLINGS = (
    [("s3://bucket/ds", k) for k in S3]
    + [("gs://bucket/ds", k) for k in GCS]
    + [("az://container/ds", k) for k in AZURE]
)

# Keys in obstore's configurations that are not credentials: names, switches, endpoints, and paths to
# files that hold one (where a credential belongs).  A key obstore adds must be placed on one side.
NOT_CREDENTIALS = {
    "aws_endpoint_url_s3",
    "bucket",
    "checksum_algorithm",
    "conditional_put",
    "container_credentials_relative_uri",
    "container_credentials_full_uri",
    "container_authorization_token_file",
    "copy_if_not_exists",
    "default_region",
    "disable_tagging",
    "disable_bulk_delete",
    "endpoint",
    "imdsv1_fallback",
    "metadata_endpoint",
    "region",
    "request_payer",
    "role_arn",
    "role_session_name",
    "s3_express",
    "server_side_encryption",
    "skip_signature",
    "sse_bucket_key_enabled",
    "sse_kms_key_id",
    "sts_endpoint",
    "unsigned_payload",
    "virtual_hosted_style_request",
    "web_identity_token_file",
    "service_account",
    "base_url",
    "application_credentials",
    "account_name",
    "client_id",
    "credential_type",
    "tenant_id",
    "authority_host",
    "use_emulator",
    "use_fabric_endpoint",
    "msi_endpoint",
    "object_id",
    "msi_resource_id",
    "federated_token_file",
    "use_azure_cli",
    "container_name",
    "fabric_token_service_url",
    "fabric_workload_host",
    "fabric_cluster_identifier",
}


@pytest.mark.parametrize(("url", "key"), SPELLINGS, ids=[k for _, k in SPELLINGS])
def test_the_mount_helper_refuses_every_credential_spelling_in_one_line_saying_where_it_goes(url, key):
    with pytest.raises(ValueError) as raised:
        blockfs_argv(url, "/mnt/x", [f"ro,storage.{key}={SECRET}"])
    message = str(raised.value)
    assert "is a credential" in message and key in message and SECRET not in message and "\n" not in message
    assert re.search(r"environment|key file", message)  # where the credential comes from instead


@pytest.mark.parametrize(("url", "key"), SPELLINGS, ids=[k for _, k in SPELLINGS])
def test_the_scrub_masks_every_credential_spelling(url, key, monkeypatch):
    monkeypatch.setattr(remote.RemoteStore, "_build", lambda self, config: None)  # no client: the scrub alone
    store = remote.RemoteStore(url, {key: SECRET, "region": "us-east-1"})
    assert SECRET not in store._scrub(f"request failed: {SECRET} was refused")  # every log line and error
    argv = ["mount", url, "/mnt/x", "--storage-option", f"{key}={SECRET}", f"--storage-opt={key}={SECRET}"]
    assert not any(SECRET in token for token in _secret_free(argv, url))  # the serving process's command line
    assert SECRET not in repr(StorageOptions({key: SECRET}))  # a repr in a log line


@pytest.mark.parametrize(
    "key",
    [
        "service_account_path",
        "google_service_account",
        "web_identity_token_file",
        "endpoint",
        "region",
        "anon",
        "sse_kms_key_id",
        "client_id",
    ],
)
def test_paths_and_settings_are_not_credentials_and_pass_the_helper(key):
    assert not is_credential(key)
    assert f"{key}=/etc/blockfs/x" in blockfs_argv("gs://b/ds", "/mnt/x", [f"storage.{key}=/etc/blockfs/x"])


@pytest.mark.parametrize("kind", ["s3", "gcs", "azure"])
def test_every_key_of_obstores_configuration_is_placed_on_one_side(kind):
    """obstore's own list (its type stubs): every key is a credential or a named non-credential, so a key a
    new obstore adds (``foo_token``) cannot pass unnoticed."""
    keys = remote.valid_keys(kind)
    if keys == list(remote.COMMON_KEYS[kind]):
        pytest.skip("obstore's type stubs are not installed")
    unplaced = [k for k in keys if not is_credential(k) and k not in NOT_CREDENTIALS]
    assert not unplaced
    assert not [k for k in keys if is_credential(k) and k in NOT_CREDENTIALS]


@pytest.mark.parametrize(
    ("url", "key"),
    [s for s in SPELLINGS if s[1] not in ("key", "secret", "password")],
    ids=[k for _, k in SPELLINGS if k not in ("key", "secret", "password")],
)
def test_every_listed_spelling_is_one_obstore_or_boto3_takes(url, key):
    """The list is not made up: obstore knows each key (fsspec's ``key``/``secret``/``password`` are
    blockfs's aliases; boto3's security token and the environment's AZURE_ENCRYPTION_KEY are not obstore's
    keys)."""
    store = pytest.importorskip("obstore.store")
    from obstore.exceptions import UnknownConfigurationKeyError

    if key.lower() in ("aws_security_token", "azure_encryption_key"):
        return
    make = {"s3": store.S3Store, "gs": store.GCSStore, "az": store.AzureStore}[url.partition(":")[0]]
    try:
        make("bucket", config={key: "x"})
    except UnknownConfigurationKeyError:
        pytest.fail(f"obstore does not know {key!r}")
    except Exception:  # noqa: BLE001 - a known key with a value it cannot use: known all the same
        pass
