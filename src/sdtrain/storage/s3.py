"""S3 clients: every one sdtrain creates, pyarrow or boto3, is made here with the same endpoint,
retry policy and connect timeout (``configure_s3``), and takes its credentials from the standard
AWS chain: nothing here reads or stores a secret.
"""

from __future__ import annotations

import errno
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from sdtrain.errors import StorageUnavailable

# Attempts per S3 request when nothing configured them (the storage.max_attempts default).
DEFAULT_MAX_ATTEMPTS = 5


# Seconds to wait for a TCP connection: a wrong or firewalled endpoint must fail in seconds,
# not after botocore's default minute.
CONNECT_TIMEOUT_S = 5.0


ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")  # the AWS SDKs' own order of precedence


@dataclass(frozen=True)
class S3Settings:
    endpoint_url: str | None = None  # None: AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, else AWS S3
    max_attempts: int = DEFAULT_MAX_ATTEMPTS


_s3_settings = S3Settings()


def configure_s3(endpoint_url: str | None, max_attempts: int) -> None:
    """Use this endpoint (if not None) and retry budget for every S3 client this process creates.

    An explicit endpoint is also exported as AWS_ENDPOINT_URL and AWS_ENDPOINT_URL_S3: Ray Data
    and Ray Train resolve s3:// URIs with their own pyarrow calls, in this process and in the
    processes of a local Ray cluster started after this call, and the environment is what they
    read (pyarrow and boto3 read both variables themselves).
    """
    global _s3_settings
    _s3_settings = S3Settings(endpoint_url, max_attempts)
    if endpoint_url is not None:
        for var in ENDPOINT_VARS:
            os.environ[var] = endpoint_url


def s3_endpoint() -> tuple[str | None, str]:
    """(endpoint URL or None for AWS S3, where it came from): storage.endpoint_url, then the environment."""
    if _s3_settings.endpoint_url:
        return _s3_settings.endpoint_url, "storage.endpoint_url"
    for var in ENDPOINT_VARS:
        if os.environ.get(var):
            return os.environ[var], var
    return None, "the AWS default"


def s3_max_attempts() -> int:
    return _s3_settings.max_attempts


def resolved_s3_settings() -> S3Settings:
    """This process's S3 settings with the endpoint resolved now (config, else environment): what
    other processes of the job (Ray Train's controller and workers, Ray Data's tasks) must use.
    On a cluster started separately they see neither storage.endpoint_url nor the driver's
    environment, so the driver hands them this."""
    return S3Settings(s3_endpoint()[0], s3_max_attempts())


def apply_s3_settings(settings: S3Settings) -> None:
    """Use the driver's S3 settings in this process (a Ray worker)."""
    configure_s3(settings.endpoint_url, settings.max_attempts)


def s3_filesystem(bucket: str) -> pafs.S3FileSystem:
    """A pyarrow S3 filesystem for ``bucket`` with the configured endpoint and retries (it pickles
    with both, so one made on the driver works in any Ray process)."""
    endpoint, _ = s3_endpoint()
    # As pyarrow's own from_uri does on AWS: a bucket outside the SDK's default region answers
    # with a redirect that pyarrow does not follow. An S3-compatible endpoint has one region.
    region = None if endpoint else _bucket_region(bucket)
    return RetryingS3FileSystem(
        s3_max_attempts(), endpoint_override=endpoint, region=region, connect_timeout=CONNECT_TIMEOUT_S
    )


class RetryingS3FileSystem(pafs.S3FileSystem):
    """pyarrow's S3FileSystem with AWS's standard retries (exponential backoff, throttling and
    dropped connections retried), which survive pickling: pyarrow's own pickle of an
    S3FileSystem drops the retry strategy, and Ray pickles filesystems to its workers."""

    def __init__(self, max_attempts: int, **options):
        super().__init__(retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=max_attempts), **options)
        self.max_attempts = max_attempts

    def __reduce__(self):
        _, (options,) = super().__reduce__()
        return _rebuild_s3, (self.max_attempts, options)


def _rebuild_s3(max_attempts: int, options: dict) -> RetryingS3FileSystem:
    return RetryingS3FileSystem(max_attempts, **options)


def _bucket_region(bucket: str) -> str | None:
    if bucket not in _REGIONS:
        try:
            _REGIONS[bucket] = pafs.resolve_s3_region(bucket)
        except OSError:  # unknown for now (not cached): the SDK's default; the pre-flight check says why
            return None
    return _REGIONS[bucket]


_REGIONS: dict[str, str] = {}


def s3_client():
    """A boto3 S3 client with the configured endpoint, retries and connect timeout (for the checks
    and operations pyarrow has no call for)."""
    import boto3
    from botocore.config import Config as BotoConfig

    endpoint, _ = s3_endpoint()
    config = BotoConfig(
        connect_timeout=CONNECT_TIMEOUT_S,
        retries={"mode": "standard", "total_max_attempts": s3_max_attempts()},
    )
    # A fresh session: credentials are looked up now, from the environment as it is now.
    return boto3.session.Session().client("s3", endpoint_url=endpoint, config=config)


# What the AWS SDK (under pyarrow) and S3 say when a request failed for now, not for good: the
# network, throttling, a server error. Anything else from a read is about the object itself.
_TRANSIENT_MARKERS = (
    "NETWORK_CONNECTION",
    "curlCode",
    "SLOW_DOWN",
    "SlowDown",
    "THROTTLING",
    "Throttl",
    "REQUEST_TIMEOUT",
    "RequestTimeout",
    "SERVICE_UNAVAILABLE",
    "ServiceUnavailable",
    "INTERNAL_FAILURE",
    "InternalError",
    "Connection reset",
    "connection was reset",
    "timed out",
    "HTTP status 429",  # too many requests
    "HTTP status 500",
    "HTTP status 502",
    "HTTP status 503",  # S3's SlowDown, as the SDK reports it when it cannot parse the reply
    "HTTP status 504",
)


# What boto3's standard retry mode retries, by the code or HTTP status of the answer (botocore.retries.standard's
# throttled and transient lists): past the client's retries it is still a failure for now, not an answer about the
# object. Anything else (404, 403 AccessDenied, ...) is about the object or the credentials.
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "LimitExceededException",
        "ProvisionedThroughputExceededException",
        "PriorRequestNotComplete",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
    }
)
_TRANSIENT_STATUSES = frozenset({429, 500, 502, 503, 504})


# A shared filesystem's (NFS, EFS, Lustre) failures for now, as the OS reports them: a file handle gone stale when the
# server restarted or failed over, an I/O error or a timeout of a soft mount, an unreachable server. A local disk's
# EIO is as likely a bad disk, which a few restarts (failure.max_failures) do not hide either.
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.ESTALE,
        errno.EIO,
        errno.ETIMEDOUT,
        errno.ECONNRESET,
        errno.ENETDOWN,
        errno.ENETUNREACH,
        errno.EHOSTDOWN,
        errno.EHOSTUNREACH,
    }
)
_ERRNO_DETAIL = re.compile(r"\[errno (\d+)\]", re.IGNORECASE)  # pyarrow's "Detail: [errno 116] Stale file handle"


def _filesystem_errno(error: BaseException) -> int | None:
    """The OS error number of a filesystem failure that a later attempt can get past, else None."""
    if not isinstance(error, OSError):
        return None
    numbers = [error.errno, *(int(n) for n in _ERRNO_DETAIL.findall(str(error)))]
    return next((n for n in numbers if n in _TRANSIENT_ERRNOS), None)


def is_transient(error: BaseException) -> bool:
    """Whether ``error`` (from reading, listing or asking for an object, after the client's own retries) is a
    storage or network failure that a later attempt can get past, rather than a damaged or missing object or a
    denied request: the AWS SDK's errors under pyarrow (OSErrors) and boto3's alike, and a shared filesystem's (a
    stale NFS handle, EIO)."""
    if isinstance(error, StorageUnavailable):
        return True
    if isinstance(error, OSError) and any(marker in str(error) for marker in _TRANSIENT_MARKERS):
        return True
    if _filesystem_errno(error) is not None:
        return True
    # botocore is not imported here: Ray Data's read tasks call this, light on purpose. An error of botocore's
    # comes from a process that imported it.
    botocore = sys.modules.get("botocore.exceptions")
    if botocore is None:
        return False
    if isinstance(error, botocore.ClientError):
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return error.response.get("Error", {}).get("Code") in _TRANSIENT_CODES or status in _TRANSIENT_STATUSES
    # Refused, reset or timed-out connections and dropped answers: what boto3's standard retry mode retries.
    return isinstance(error, (botocore.ConnectionError, botocore.HTTPClientError))


def raise_if_unavailable(error: BaseException, what: str) -> None:
    """Raise the StorageUnavailable naming ``what`` (the config key and the file or folder) if ``error`` is
    transient (:func:`is_transient`); else return, and the caller says what is wrong with the input.

    Wherever it is raised it is no bad input: on the driver the command lines exit 75 (run again), in a Ray Train
    worker it fails the attempt (an OSError, no SdtrainError: the run restarts from its latest checkpoint), and a read
    under data.on_read_error=skip drops no rows for it."""
    if is_transient(error):
        raise storage_unavailable(error, what) from error


def storage_unavailable(error: BaseException, what: str) -> StorageUnavailable:
    """The StorageUnavailable naming ``what`` for ``error``, a transient failure (:func:`is_transient`), for a caller
    that raises it itself (:func:`raise_if_unavailable` raises it where ``error`` is transient). One named for another
    key is named for ``what`` instead, with the storage's own words once."""
    if isinstance(error, StorageUnavailable) and isinstance(error.__cause__, BaseException):
        error = error.__cause__
    reason = " ".join(str(error).split()) or type(error).__name__
    if _filesystem_errno(error) is not None:
        return StorageUnavailable(
            f"{what}: the filesystem failed ({reason}). This is a stale file handle, an I/O error or a server out of "
            "reach (NFS, EFS), not bad input: run again later"
        )
    return StorageUnavailable(
        f"{what}: object storage failed after {s3_max_attempts()} attempt(s) with backoff ({reason}). This is "
        "throttling, a server error or the network, not bad input: run again later, or raise storage.max_attempts"
    )


SINGLE_COPY_MAX = 5 << 30
"""S3's limit on one CopyObject or PutObject; a larger object is copied (UploadPartCopy) or sent (UploadPart) in
parts."""


def large_object_transfer(single_request_max: int = SINGLE_COPY_MAX) -> Any:
    """boto3's managed transfer as sdtrain uses it: an object up to ``single_request_max`` in one request, a larger one
    in 256 MiB parts, 4 at a time. A multipart upload is an object only once completed, so a reader never finds one half
    written; one whose sender was killed leaves parts S3 keeps (and bills) until a lifecycle rule aborts them."""
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=single_request_max + 1, multipart_chunksize=256 << 20, max_concurrency=4)


def copy_object(
    client: Any, source: tuple[str, str], target: tuple[str, str], size: int | None, single_request_max: int
) -> None:
    """One object copied by S3 itself, no byte through this process: one CopyObject where ``size`` (its bytes as
    listed) is known and at most ``single_request_max``; otherwise boto3's managed copy, which asks the size
    (HeadObject) and copies in one request or in parts (UploadPartCopy: one CopyObject is refused over 5 GiB).

    Args:
        client: a boto3 S3 client (:func:`s3_client`).
        source: the (bucket, key) copied.
        target: the (bucket, key) written.
        size: the source's bytes where a listing gave them, else None.
        single_request_max: the largest object copied in one request.
    """
    copy_source = {"Bucket": source[0], "Key": source[1]}
    if size is not None and size <= single_request_max:
        client.copy_object(Bucket=target[0], Key=target[1], CopySource=copy_source)
    else:
        client.copy(copy_source, target[0], target[1], Config=large_object_transfer(single_request_max))


def move_prefix(
    bucket: str, source: str, target: str, workers: int = 16, single_copy_max: int = SINGLE_COPY_MAX
) -> int:
    """Move every object under ``source/`` in ``bucket`` to ``target/`` by server-side copies, then delete the sources;
    returns the objects moved. S3 copies the bytes, none pass through this process. One CopyObject a file (pyarrow's
    copy_files) is refused over 5 GiB, and a checkpoint of an SD2-sized UNet (865M parameters) with its optimizer state
    and EMA is over 10 GB: those go in parts. Smaller ones stay one CopyObject each, as they were.

    Args:
        bucket: the bucket of both prefixes.
        source: the prefix moved, without a trailing slash.
        target: where its objects go, without a trailing slash.
        workers: objects copied at once.
        single_copy_max: the largest object copied in one request.
    """
    from concurrent.futures import ThreadPoolExecutor

    client = s3_client()
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{source}/")
    listed = [(item["Key"], item["Size"]) for page in pages for item in page.get("Contents", [])]
    keys = [key for key, _ in listed]

    def copy(item: tuple[str, int]) -> None:  # with its listed size: no HeadObject an object
        key, size = item
        copy_object(client, (bucket, key), (bucket, target + key[len(source) :]), size, single_copy_max)

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(copy, listed))  # raises the first failure: nothing is deleted then
    for start in range(0, len(keys), 1000):  # DeleteObjects takes 1000 keys a request
        batch = [{"Key": key} for key in keys[start : start + 1000]]
        failed = client.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True}).get("Errors", [])
        if failed:
            first = failed[0]
            raise OSError(
                f"s3://{bucket}/{source}: {len(failed)} object(s) copied to s3://{bucket}/{target} could not be "
                f"deleted, the first {first.get('Key')}: {first.get('Code')} {first.get('Message')}"
            )
    return len(keys)


DRIVER_READS = 128
"""Small reads (a footer, a marker: a few requests one after another) the driver keeps in flight against object
storage, on as many connections (:func:`s3_connections`): at 30 ms a request ~4,300 requests a second, under S3's
5,500 GET/HEAD a second per prefix. 16 at a time, 2e5 footers took ~21 min, 128 ~4 (simulated latency,
bench/results/2026-11-30-footer-reads.md)."""


@contextmanager
def s3_connections(threads: int) -> Iterator[None]:
    """S3 filesystems made inside keep ``threads`` connections: pyarrow's S3 client holds max(its IO threads, 25),
    fixed when the filesystem is made (without this, 128 threads shared 25 connections)."""
    before = pa.io_thread_count()
    pa.set_io_thread_count(max(before, threads))
    try:
        yield
    finally:
        pa.set_io_thread_count(before)
