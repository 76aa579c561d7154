"""The one interface to S3: conditional writes only, so nothing here can replace an existing object.

Exceptions:

    StorageError            anything S3 refused or failed to do (message names the endpoint or s3:// key)
    ├── ObjectExists        a conditional write found the key taken (412; or 409 after retries); .existing_sha256
    ├── StorageAuthError    the endpoint refused the credentials (wrong secret, unknown key, access denied)
    ├── StorageUnreachable  connection refused, DNS failure, timeout: the message names the endpoint
    └── BucketMissing       the bucket does not exist

Secrets never appear in messages: they are `SecretStr` until the moment a boto3 client is built.
The only delete in this module is `ObjectStore.preflight`, which removes the probe object it just created
under a unique random key.
"""

from __future__ import annotations

import builtins
import hashlib
import io
import secrets
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    ReadTimeoutError,
)
from pydantic import SecretStr

from datagen.checks import CheckResult
from datagen.settings import Settings

__all__ = [
    "PREFLIGHT_DIR",
    "SHA256_METADATA_KEY",
    "BucketMissing",
    "ObjectExists",
    "ObjectInfo",
    "ObjectStore",
    "StorageAuthError",
    "StorageError",
    "StorageUnreachable",
    "s3_preflight",
    "sha256_file",
]

PREFLIGHT_DIR = "_preflight/"  # probe objects of `s3_preflight`; beside `_catalog/`, never a namespace
SHA256_METADATA_KEY = "sha256"  # user metadata (x-amz-meta-sha256): hex digest of the object's bytes
MiB = 1024 * 1024
_AUTH_CODES = frozenset(
    {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken"}
)
_PRECONDITION_CODES = frozenset({"412", "PreconditionFailed"})
_CONFLICT_CODES = frozenset({"409", "ConditionalRequestConflict"})
_MISSING_BUCKET_CODES = frozenset({"NoSuchBucket"})


class StorageError(Exception):
    """S3 refused or failed an operation."""


class ObjectExists(StorageError):
    """A conditional write found the key already taken; nothing was written."""

    def __init__(self, key: str, existing_sha256: str | None, uri: str | None = None) -> None:
        self.key = key
        self.existing_sha256 = existing_sha256
        where = uri or key
        found = f"sha256 {existing_sha256}" if existing_sha256 else "no sha256 metadata"
        super().__init__(f"{where} already exists ({found}); it was not replaced")


class StorageAuthError(StorageError):
    """The endpoint refused the credentials."""


class StorageUnreachable(StorageError):
    """The endpoint could not be reached."""


class BucketMissing(StorageError):
    """The bucket does not exist."""


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One stored object: key relative to the store's prefix; sha256 from metadata (None from listings)."""

    key: str
    size: int
    etag: str
    sha256: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)


def sha256_file(path: Path, chunk_size: int = 4 * MiB) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def _error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _client_error_in(exc: BaseException) -> ClientError | None:
    """The ClientError behind exc: s3transfer sometimes wraps it (S3UploadFailedError) with it on __context__."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, ClientError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _if_none_match(params: dict[str, Any], **_: Any) -> None:
    # boto3's managed transfers reject IfNoneMatch in ExtraArgs; setting it while the request is built makes
    # single-part PutObject and CompleteMultipartUpload both conditional.
    params["IfNoneMatch"] = "*"


class ObjectStore:
    """A bucket and key prefix on one S3 endpoint; every write is create-only (If-None-Match: *)."""

    def __init__(
        self,
        *,
        bucket: str,
        access_key_id: SecretStr,
        secret_access_key: SecretStr,
        endpoint_url: str | None = None,
        region: str = "us-east-1",
        prefix: str = "",
        multipart_threshold: int = 64 * MiB,
        multipart_chunksize: int = 16 * MiB,
        max_concurrency: int = 4,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 60.0,
        max_attempts: int = 3,
        conflict_retries: int = 3,
    ) -> None:
        self.bucket = bucket
        self.endpoint_url = endpoint_url
        self.region = region
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.conflict_retries = conflict_retries
        self.transfer_config = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=max_concurrency,
        )
        config = Config(
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            retries={"max_attempts": max_attempts, "mode": "standard"},
            max_pool_connections=max(10, 4 * max_concurrency),
            signature_version="s3v4",  # what requests use already; presigned URLs would otherwise get SigV2
        )
        # Empty credentials mean "use boto3's default chain" (instance role, AWS_PROFILE, ...).
        key_id = access_key_id.get_secret_value() or None
        secret = secret_access_key.get_secret_value() or None
        session = boto3.session.Session()
        kwargs: dict[str, Any] = {
            "endpoint_url": endpoint_url,
            "region_name": region,
            "aws_access_key_id": key_id,
            "aws_secret_access_key": secret,
            "config": config,
        }
        self._client: Any = session.client("s3", **kwargs)
        # A dedicated client for writes: its hooks make every PutObject and CompleteMultipartUpload conditional.
        self._put_client: Any = session.client("s3", **kwargs)
        events = self._put_client.meta.events
        events.register("before-parameter-build.s3.PutObject", _if_none_match)
        events.register("before-parameter-build.s3.CompleteMultipartUpload", _if_none_match)

    @classmethod
    def from_settings(cls, settings: Settings, **options: Any) -> ObjectStore:
        """A store for the bucket, prefix, endpoint and credentials in settings (options go to __init__)."""
        return cls(
            bucket=settings.s3_bucket,
            access_key_id=settings.s3_access_key_id,
            secret_access_key=settings.s3_secret_access_key,
            endpoint_url=settings.s3_endpoint_url,
            region=settings.s3_region,
            prefix=settings.s3_prefix,
            **options,
        )

    # --- names -------------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The endpoint, for messages."""
        return self.endpoint_url or f"AWS S3 ({self.region})"

    def uri(self, key: str = "") -> str:
        """s3://bucket/prefix/key."""
        return f"s3://{self.bucket}/{self.prefix}{key}"

    def presigned_get(self, key: str, expires_s: int) -> str:
        """A URL that GETs `key` with no credentials until it expires (a SigV4 query signature; no secret in it)."""
        params = {"Bucket": self.bucket, "Key": self._full(key)}
        return str(self._client.generate_presigned_url("get_object", Params=params, ExpiresIn=expires_s))

    def _full(self, key: str) -> str:
        if not key or key.startswith("/"):
            raise ValueError(f"invalid object key {key!r}")
        return self.prefix + key

    # --- error translation -------------------------------------------------------------------------

    def _translate(self, exc: BaseException, action: str, key: str | None = None) -> StorageError:
        """Map a boto3/botocore failure to the exception tree (messages name endpoint or key, never secrets)."""
        where = self.uri(key) if key is not None else self.uri()
        if isinstance(exc, EndpointConnectionError | ConnectTimeoutError | ConnectionClosedError | ReadTimeoutError):
            return StorageUnreachable(
                f"S3 endpoint {self.endpoint} is unreachable ({type(exc).__name__}) during {action}"
            )
        if isinstance(exc, NoCredentialsError):
            return StorageAuthError(f"no S3 credentials configured for {self.endpoint} (set DATAGEN_S3_ACCESS_KEY_ID)")
        client_error = _client_error_in(exc)
        if client_error is not None:
            code = _error_code(client_error)
            if code in _AUTH_CODES:
                return StorageAuthError(
                    f"the credentials were refused by {self.endpoint} ({code}) during {action} of {where}"
                )
            if code in _MISSING_BUCKET_CODES:
                return BucketMissing(f"bucket {self.bucket!r} does not exist at {self.endpoint}")
            message = client_error.response.get("Error", {}).get("Message", "")
            return StorageError(f"{action} of {where} failed at {self.endpoint}: {code} {message}".rstrip())
        if isinstance(exc, BotoCoreError):
            return StorageError(f"{action} of {where} failed at {self.endpoint}: {type(exc).__name__}")
        return StorageError(f"{action} of {where} failed: {type(exc).__name__}")

    # --- reads -------------------------------------------------------------------------------------

    def check_bucket(self) -> None:
        """Raise unless the bucket answers with these credentials."""
        try:
            self._client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            if _error_code(exc) in ("404", "NoSuchBucket"):
                raise BucketMissing(f"bucket {self.bucket!r} does not exist at {self.endpoint}") from None
            raise self._translate(exc, "head_bucket") from exc
        except BotoCoreError as exc:
            raise self._translate(exc, "head_bucket") from exc

    def head(self, key: str) -> ObjectInfo | None:
        """Size, ETag and metadata of key, or None when absent."""
        try:
            response = self._client.head_object(Bucket=self.bucket, Key=self._full(key))
        except ClientError as exc:
            if _error_code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise self._translate(exc, "head", key) from exc
        except BotoCoreError as exc:
            raise self._translate(exc, "head", key) from exc
        metadata = {str(k).lower(): str(v) for k, v in response.get("Metadata", {}).items()}
        return ObjectInfo(
            key=key,
            size=int(response["ContentLength"]),
            etag=str(response.get("ETag", "")),
            sha256=metadata.get(SHA256_METADATA_KEY),
            metadata=metadata,
        )

    def get_bytes(self, key: str) -> bytes:
        """The whole object (small objects: manifests, READMEs, tests)."""
        try:
            response = self._client.get_object(Bucket=self.bucket, Key=self._full(key))
            body: bytes = response["Body"].read()
        except (ClientError, BotoCoreError) as exc:
            raise self._translate(exc, "get", key) from exc
        return body

    def iter_lines(self, key: str, chunk_size: int = 1 * MiB) -> Iterator[bytes]:
        """An object's lines (split on newline bytes only, without them), streamed: never held whole."""
        try:
            body = self._client.get_object(Bucket=self.bucket, Key=self._full(key))["Body"]
            pending = b""
            for chunk in body.iter_chunks(chunk_size):
                lines = (pending + chunk).split(b"\n")
                pending = lines.pop()
                yield from lines
            if pending:
                yield pending
        except (ClientError, BotoCoreError) as exc:
            raise self._translate(exc, "get", key) from exc

    def list(self, prefix: str = "", page_size: int = 1000) -> Iterator[ObjectInfo]:
        """Every object whose key starts with prefix, in key order (paginated; sha256 is not in listings)."""
        paginator = self._client.get_paginator("list_objects_v2")
        pages = paginator.paginate(
            Bucket=self.bucket, Prefix=self.prefix + prefix, PaginationConfig={"PageSize": page_size}
        )
        try:
            for page in pages:
                for item in page.get("Contents", []):
                    yield ObjectInfo(
                        key=str(item["Key"])[len(self.prefix) :],
                        size=int(item["Size"]),
                        etag=str(item.get("ETag", "")),
                    )
        except (ClientError, BotoCoreError) as exc:
            raise self._translate(exc, "list", prefix) from exc

    def children(self, prefix: str = "") -> builtins.list[str]:
        """The names one level below prefix (S3's common prefixes with "/" as delimiter), in key order."""
        paginator = self._client.get_paginator("list_objects_v2")
        pages = paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix, Delimiter="/")
        try:
            return [
                str(item["Prefix"])[len(self.prefix) + len(prefix) :].rstrip("/")
                for page in pages
                for item in page.get("CommonPrefixes", [])
            ]
        except (ClientError, BotoCoreError) as exc:
            raise self._translate(exc, "list", prefix) from exc

    def exists(self, prefix: str) -> bool:
        """Whether any object's key starts with prefix."""
        try:
            response = self._client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix + prefix, MaxKeys=1)
        except (ClientError, BotoCoreError) as exc:
            raise self._translate(exc, "list", prefix) from exc
        return int(response.get("KeyCount", 0)) > 0

    # --- the only write ----------------------------------------------------------------------------

    def put_if_absent(
        self,
        key: str,
        data: bytes | Path,
        sha256: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> ObjectInfo:
        """Create key with data unless it exists (then raise ObjectExists); sha256 (hex) is stored as metadata.

        A given sha256 is trusted (callers that just hashed the file pass it to avoid a second read).
        Files above the multipart threshold go up in parts; the condition is checked at completion.
        """
        if sha256 is None:
            sha256 = sha256_file(data) if isinstance(data, Path) else hashlib.sha256(data).hexdigest()
        extra = {"Metadata": {**(metadata or {}), SHA256_METADATA_KEY: sha256}}
        size = data.stat().st_size if isinstance(data, Path) else len(data)
        full = self._full(key)
        for attempt in range(self.conflict_retries + 1):
            try:
                if isinstance(data, Path):
                    self._put_client.upload_file(
                        str(data), self.bucket, full, ExtraArgs=extra, Config=self.transfer_config
                    )
                else:
                    self._put_client.upload_fileobj(
                        io.BytesIO(data), self.bucket, full, ExtraArgs=extra, Config=self.transfer_config
                    )
            except Exception as exc:
                client_error = _client_error_in(exc)
                code = _error_code(client_error) if client_error is not None else ""
                if code in _PRECONDITION_CODES:
                    existing = self.head(key)
                    raise ObjectExists(key, existing.sha256 if existing else None, self.uri(key)) from None
                if code in _CONFLICT_CODES:
                    # Another conditional write to this key was in flight: retry, and if the key is now
                    # taken the next attempt answers 412.
                    if attempt < self.conflict_retries:
                        time.sleep(0.2 * 2**attempt)
                        continue
                    existing = self.head(key)
                    if existing is not None:
                        raise ObjectExists(key, existing.sha256, self.uri(key)) from None
                if isinstance(exc, ClientError | BotoCoreError) or client_error is not None:
                    raise self._translate(exc, "put", key) from exc
                raise
            return ObjectInfo(key=key, size=size, etag="", sha256=sha256, metadata=extra["Metadata"])
        raise StorageError(f"put of {self.uri(key)} kept conflicting with concurrent writes")

    # --- preflight ---------------------------------------------------------------------------------

    def preflight(self) -> str:
        """Create and remove one probe object under `_preflight/`; returns the probe key.

        Never inside a namespace: a check must leave no trace where a dataset is (or will be) published, and
        `_preflight/` cannot be a namespace (namespaces start with a letter or digit).
        """
        probe = f"{PREFLIGHT_DIR}{secrets.token_hex(16)}"
        self.put_if_absent(probe, b"datagen preflight probe\n")
        try:
            # The only delete in this module: the key is random and was created just above.
            self._client.delete_object(Bucket=self.bucket, Key=self._full(probe))
        except (ClientError, BotoCoreError) as exc:
            raise self._translate(exc, f"removing the preflight probe (left behind: {self.uri(probe)})", probe) from exc
        return probe

    def __repr__(self) -> str:
        return f"ObjectStore(endpoint={self.endpoint!r}, uri={self.uri()!r})"


def s3_preflight(store: ObjectStore, namespace: str, resume: bool) -> builtins.list[CheckResult]:
    """Checks before a run: credentials work, bucket reachable, namespace free of data (unless resume), writable."""
    ns = namespace.strip("/") + "/"
    results: builtins.list[CheckResult] = []

    def skip_rest(reason: str) -> builtins.list[CheckResult]:
        names = ["s3.bucket", "s3.namespace_free", "s3.namespace_writable"]
        done = {r.name for r in results}
        return results + [CheckResult(n, "skipped", reason) for n in names if n not in done]

    try:
        store.check_bucket()
    except StorageUnreachable as exc:
        results.append(CheckResult("s3.credentials", "fail", f"{exc}; check DATAGEN_S3_ENDPOINT_URL and the network"))
        return skip_rest("needs a reachable endpoint")
    except StorageAuthError as exc:
        results.append(
            CheckResult(
                "s3.credentials", "fail", f"{exc}; check DATAGEN_S3_ACCESS_KEY_ID / DATAGEN_S3_SECRET_ACCESS_KEY"
            )
        )
        return skip_rest("needs working credentials")
    except BucketMissing as exc:
        results.append(CheckResult("s3.credentials", "pass", f"accepted by {store.endpoint}"))
        results.append(CheckResult("s3.bucket", "fail", f"{exc}; create it or set DATAGEN_S3_BUCKET"))
        return skip_rest("needs the bucket")
    except StorageError as exc:
        results.append(CheckResult("s3.credentials", "fail", str(exc)))
        return skip_rest("needs a working endpoint")
    results.append(CheckResult("s3.credentials", "pass", f"accepted by {store.endpoint}"))
    results.append(CheckResult("s3.bucket", "pass", f"{store.uri()} reachable"))

    try:
        if store.head(ns + "abandoned.json") is not None:  # tasks.publishing.ABANDONED_NAME
            results.append(
                CheckResult(
                    "s3.namespace_free",
                    "fail",
                    f"{store.uri(ns + 'abandoned.json')} exists: namespace {namespace!r} was abandoned; "
                    "choose a new namespace",
                )
            )
        elif store.head(ns + "manifest.json") is not None:
            results.append(
                CheckResult(
                    "s3.namespace_free",
                    "fail",
                    f"{store.uri(ns + 'manifest.json')} exists: namespace {namespace!r} is published; "
                    "choose a new namespace",
                )
            )
        elif store.exists(ns):
            if resume:
                results.append(
                    CheckResult(
                        "s3.namespace_free",
                        "pass",
                        f"{store.uri(ns)} holds objects of an unfinished publish; resume will verify each by sha256",
                    )
                )
            else:
                results.append(
                    CheckResult(
                        "s3.namespace_free",
                        "fail",
                        f"{store.uri(ns)} already holds data; choose a new namespace (or resume that run)",
                    )
                )
        else:
            results.append(CheckResult("s3.namespace_free", "pass", f"{store.uri(ns)} is empty"))
    except StorageError as exc:
        results.append(CheckResult("s3.namespace_free", "fail", str(exc)))

    try:
        probe = store.preflight()
        results.append(
            CheckResult("s3.namespace_writable", "pass", f"probe object written and removed: {store.uri(probe)}")
        )
    except StorageError as exc:
        results.append(CheckResult("s3.namespace_writable", "fail", str(exc)))
    return results
