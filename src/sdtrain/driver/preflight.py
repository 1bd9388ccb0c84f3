"""Pre-flight checks of object storage, on the driver before Ray starts any worker.

Every s3:// URI a run reads or writes is probed with a few small requests (list one key, read
one object's head, write and delete an empty probe object), so that a missing bucket, an empty
prefix, missing or rejected credentials, a denied permission or an unreachable endpoint stops
the job in seconds with one paragraph naming the config key, the URI, what went wrong and the
likely fix, instead of failing on every worker. Other URI schemes are handed to pyarrow as they
are; local paths are checked where they are read.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from sdtrain.config.schema import Config
from sdtrain.errors import ConfigError, DataError, StorageUnavailable
from sdtrain.storage.s3 import CONNECT_TIMEOUT_S, configure_s3, s3_client, s3_endpoint, s3_max_attempts
from sdtrain.storage.uris import has_userinfo, redact, split_s3

# Error codes S3 (and S3-compatible stores) answer with, by what the user has to do about them.
_REJECTED_CREDENTIALS = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
}
_DENIED = {"AccessDenied", "403", "AllAccessDisabled", "AccountProblem"}
_MISSING_BUCKET = {"NoSuchBucket"}
_TRANSIENT = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "InternalError",
    "ServiceUnavailable",
    "500",
    "502",
    "503",
    "504",
}


def preflight(config: Config) -> None:
    """Apply ``config.storage`` to this process, then check every s3:// URI the config names.

    Data (data.train, data.val, model.pretrained, retrain.data_root) must be readable and hold
    objects; run.storage_path and retrain.models_root must be listable and writable. A path that still names the
    shipped configs' placeholder bucket is refused first, local or not.
    """
    config.refuse_placeholders()  # s3://YOUR-BUCKET/...: one line naming the key, not the store's answer for it
    configure_s3(config.storage.endpoint_url, config.storage.max_attempts)
    writable = {"run.storage_path", "retrain.models_root"}
    data_buckets = set()
    for key, uri in config.storage_uris():
        if uri.startswith("s3://"):
            if key.startswith(("data.train[", "data.val[")):
                # One spec a bucket shows the endpoint, credentials and read permission; each spec's own files are
                # the listing's to find, many at once (it names a spec that matches none). Checked here one by one,
                # a list of 1e5 files cost hours before anything ran.
                family_bucket = (key.partition("[")[0], split_s3(uri)[0])
                if family_bucket in data_buckets:
                    continue
                data_buckets.add(family_bucket)
            checked = (s3_endpoint()[0], uri, key in writable)
            if checked in _PASSED:  # retraining checks its roots, then its training run: each URI once a process
                continue
            check_s3(uri, key, write=key in writable)
            _PASSED.add(checked)


_PASSED: set[tuple[str | None, str, bool]] = set()
"""(endpoint, URI, writable) this process has checked and found usable."""


def check_s3(uri: str, key: str, write: bool) -> None:
    """Raise ConfigError (DataError for an empty data prefix) unless ``uri`` is usable as ``key`` needs."""
    endpoint, source = s3_endpoint()
    if endpoint is not None and has_userinfo(endpoint):
        raise ConfigError(
            f"{key}: {uri}: the S3 endpoint from {source} ({redact(endpoint)}) holds a user name or password; "
            "give the endpoint as http(s)://host[:port] and credentials through the AWS credential chain"
        )
    bucket, prefix = split_s3(uri)
    if not bucket:
        raise ConfigError(f"{key}: {uri} names no bucket; expected s3://bucket/prefix")
    # A spec may be one object, a "directory" or a glob: list under the part before any glob character.
    fixed = prefix[: min((prefix.index(c) for c in "*?[" if c in prefix), default=len(prefix))]
    where = _Where(key, uri, bucket, endpoint, source)
    client = where.call("create an S3 client", s3_client)
    where.url = client.meta.endpoint_url
    listed = where.call("list", lambda: client.list_objects_v2(Bucket=bucket, Prefix=fixed, MaxKeys=1))
    if write:
        probe = f"{prefix}/.sdtrain-write-probe-{uuid.uuid4().hex}".lstrip("/")
        # An empty object under a fresh random name: never overwrites anything, gone right after.
        where.call("write", lambda: client.put_object(Bucket=bucket, Key=probe, Body=b""))
        where.call("delete", lambda: client.delete_object(Bucket=bucket, Key=probe))
        return
    if not listed.get("Contents"):
        raise DataError(
            f"{key}: {uri}: bucket '{bucket}' holds no objects under '{fixed}'{where.at()}. Check the path "
            "(keys are case-sensitive, and the data may not be uploaded yet)"
        )
    first = listed["Contents"][0]["Key"]
    where.call("read", lambda: client.head_object(Bucket=bucket, Key=first))


class _Where:
    """What a check was about, to turn a boto3 exception into one actionable paragraph."""

    def __init__(self, key: str, uri: str, bucket: str, endpoint: str | None, source: str):
        self.key, self.uri, self.bucket, self.endpoint, self.source = key, uri, bucket, endpoint, source
        self.url = endpoint or "AWS S3"  # the URL the client really uses, once there is one

    def at(self) -> str:
        return f" at {redact(self.endpoint)} (from {self.source})" if self.endpoint else ""

    def call(self, action: str, request: Callable):
        try:
            return request()
        except (NoCredentialsError, PartialCredentialsError) as e:
            found = "incomplete AWS credentials" if isinstance(e, PartialCredentialsError) else "no AWS credentials"
            raise ConfigError(
                f"{self.key}: {self.uri}: {found} found (looked in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE and the shared config and credentials files, and the instance role). Provide them "
                "in the job's environment or attach a role with access to the bucket; sdtrain never takes "
                "credentials from its config"
            ) from None
        except BotoConnectionError as e:  # refused, reset, unknown host, connect timeout, TLS failure
            if isinstance(e, ConnectTimeoutError):
                how = f"no answer within {CONNECT_TIMEOUT_S:g}s"
            else:  # "[Errno 111] Connection refused", "[Errno 104] Connection reset by peer", ...
                errno = re.search(r"\[Errno -?\d+\] [^'\")]+", str(e.kwargs.get("error", "")))
                how = errno.group(0) if errno else type(e).__name__
            raise ConfigError(
                f"{self.key}: {self.uri}: cannot connect to the S3 endpoint {redact(self.url)} (from {self.source}; "
                f"{how}; {s3_max_attempts()} attempt(s) with backoff). Check the URL and port in "
                f"{self._endpoint_setting()}, that the server is running, and that this machine can reach it; if it "
                "can, the failure was transient: run again, or raise storage.max_attempts"
            ) from None
        except (ConnectionClosedError, ReadTimeoutError) as e:
            # Not bad input (exit 2): a failure for now (exit 75, sdtrain.errors.StorageUnavailable).
            raise StorageUnavailable(
                self._transient(action, f"the connection was dropped ({type(e).__name__})")
            ) from None
        except ClientError as e:
            raise self._client_error(action, e) from None
        except (BotoCoreError, ValueError) as e:  # ValueError: e.g. an endpoint URL botocore cannot parse
            raise ConfigError(f"{self.key}: {self.uri}: cannot {action}{self.at()}: {e}") from None

    def _client_error(self, action: str, error: ClientError) -> Exception:
        code = str(error.response.get("Error", {}).get("Code", ""))
        status = str(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        if code in _MISSING_BUCKET:
            return ConfigError(
                f"{self.key}: {self.uri}: bucket '{self.bucket}' does not exist{self.at()}. Create it, or fix the "
                f"bucket name in {self.key}"
                + (f" (or the endpoint in {self._endpoint_setting()})" if self.endpoint else "")
            )
        if code in _REJECTED_CREDENTIALS:
            return ConfigError(
                f"{self.key}: {self.uri}: the S3 endpoint{self.at()} rejected the credentials ({code}) when asked to "
                f"{action}. Check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) and that they are for "
                "this endpoint; temporary credentials may have expired"
            )
        if code in _DENIED or status == "403":
            needed = {
                "list": "s3:ListBucket",
                "read": "s3:GetObject",
                "write": "s3:PutObject",
                "delete": "s3:DeleteObject",
            }
            return ConfigError(
                f"{self.key}: {self.uri}: access denied: these credentials may not {action} in bucket "
                f"'{self.bucket}'{self.at()}. Grant {needed.get(action, 's3:*')} on it (for run storage and "
                "models: s3:ListBucket, s3:GetObject, s3:PutObject and s3:DeleteObject) to the user or role, or "
                "use credentials that have it"
            )
        if code in _TRANSIENT or status in _TRANSIENT:
            return StorageUnavailable(self._transient(action, f"{code or status}: the server is throttling or failing"))
        return ConfigError(
            f"{self.key}: {self.uri}: cannot {action}{self.at()}: {code}: "
            f"{error.response.get('Error', {}).get('Message', '')}"
        )

    def _transient(self, action: str, what: str) -> str:
        return (
            f"{self.key}: {self.uri}: could not {action}{self.at()} after {s3_max_attempts()} attempt(s) with "
            f"backoff: {what}. This is usually temporary: run again, or raise storage.max_attempts"
        )

    def _endpoint_setting(self) -> str:
        return self.source if self.endpoint else "storage.endpoint_url or AWS_ENDPOINT_URL (none is set: AWS S3)"
