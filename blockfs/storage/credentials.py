"""Which storage options are credentials: one list, for the mount helper's refusal and for the scrub of
logs, errors, control files and command lines.

obstore takes each of its keys in several spellings (``secret_access_key``, ``aws_secret_access_key``,
``AWS_SECRET_ACCESS_KEY``: it lowercases the key), and users also type fsspec's and boto3's.  Every one of
them must be kept out of fstab and masked wherever a value could show, so a key is compared lowercased,
with ``-`` read as ``_``, against :data:`CREDENTIAL_KEYS`; a spelling not listed is still a credential
when it names a secret, a password, a token or a key (``*_token``, ``*_key``).  Paths to files that hold a
credential (``service_account_path``, ``web_identity_token_file``) are not credentials: a key file only
root can read is where a credential belongs.
"""

from __future__ import annotations

from collections.abc import Mapping

# The spellings of every credential obstore's S3, GCS and Azure configurations accept (read from its type
# stubs, each alias checked against obstore itself), with fsspec's and boto3's names and the environment
# variables they mirror, lowercased.
CREDENTIAL_KEYS = frozenset(
    {
        # S3 (obstore), boto3 and the AWS environment
        "access_key_id",
        "aws_access_key_id",
        "secret_access_key",
        "aws_secret_access_key",
        "session_token",
        "aws_session_token",
        "aws_token",
        "token",
        "security_token",
        "aws_security_token",
        "sse_customer_key_base64",
        "aws_sse_customer_key_base64",
        # fsspec / s3fs
        "key",
        "secret",
        "password",
        "client_secret",
        # GCS
        "service_account_key",
        "google_service_account_key",
        "bearer_token",
        "google_bearer_token",
        # Azure
        "account_key",
        "access_key",
        "master_key",
        "azure_storage_account_key",
        "azure_storage_access_key",
        "azure_storage_master_key",
        "sas_key",
        "sas_token",
        "azure_storage_sas_key",
        "azure_storage_sas_token",
        "azure_storage_token",
        "azure_client_secret",
        "azure_storage_client_secret",
        "fabric_session_token",
        "azure_fabric_session_token",
        "encryption_key",
        "azure_encryption_key",
        "azure_storage_encryption_key",
    }
)

_SECRET_WORDS = ("secret", "password", "passwd")
_SECRET_ENDINGS = ("token", "_key", "key_base64")


def normal_key(key: str) -> str:
    """``key`` as obstore reads it: lowercased (and ``-`` as ``_``, a spelling users may try)."""
    return key.strip().lower().replace("-", "_")


def is_credential(key: str) -> bool:
    """Whether the storage option ``key``, in any spelling, carries a credential."""
    k = normal_key(key)
    return k in CREDENTIAL_KEYS or any(w in k for w in _SECRET_WORDS) or k.endswith(_SECRET_ENDINGS)


def secret_values(options: Mapping[str, object]) -> list[str]:
    """The values of the credentials among ``options``: what a scrub must mask."""
    return [str(v) for k, v in options.items() if is_credential(k) and v not in (None, "")]


# Where a credential comes from instead of fstab, by kind of store: what the helper's refusal says.
WHERE_FROM = {
    "s3": "put it in the mount's environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN; for an "
    "fstab line, in an EnvironmentFile= only root reads, named in a drop-in of the mount unit), in "
    "/root/.aws/credentials (boto3 installed), or use an instance role",
    "gcs": "put it in a key file only root reads and name the file: storage.service_account_path=/etc/blockfs/key.json "
    "(or GOOGLE_APPLICATION_CREDENTIALS in the mount's environment)",
    "azure": "put it in the mount's environment (AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN; for an fstab "
    "line, in an EnvironmentFile= only root reads, named in a drop-in of the mount unit)",
}
