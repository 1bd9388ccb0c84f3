"""Storage: URIs and paths to pyarrow filesystems (and boto3 S3 clients), and data specs (files,
directories, globs) to a sorted list of parquet files.

Every S3 client sdtrain creates, pyarrow or boto3, is made here with the same endpoint, retry
policy and connect timeout (``configure_s3``), and takes its credentials from the standard AWS
chain: nothing here reads or stores a secret.
"""

from __future__ import annotations

import datetime
import fnmatch
import glob
import os
import re
import tempfile
from dataclasses import dataclass

import pyarrow.fs as pafs

from sdtrain.errors import DataError

_GLOB_CHARS = "*?["

# Attempts per S3 request when nothing configured them (the storage.max_attempts default).
DEFAULT_MAX_ATTEMPTS = 5
# Seconds to wait for a TCP connection: a wrong or firewalled endpoint must fail in seconds,
# not after botocore's default minute.
CONNECT_TIMEOUT_S = 5.0
ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")  # the AWS SDKs' own order of precedence
# A user name or password after the scheme: ``KEY:SECRET@`` (AWS secrets may hold '/', so a ':'
# before the first '/' starts one too), or anything before an '@' that precedes the first '/'.
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)([^/@:]*:[^@]*@|[^/@]*@)")


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


def has_userinfo(uri: str) -> bool:
    """Whether ``uri`` carries a user name or password (``s3://KEY:SECRET@bucket``, ``http://u:p@host``)."""
    return _USERINFO.match(uri) is not None


def redact(uri: str) -> str:
    """``uri`` with any user name and password replaced by ``***``: safe for a message or a log line."""
    return _USERINFO.sub(r"\1***@", uri)


def split_s3(uri: str) -> tuple[str, str]:
    """(bucket, key prefix) of ``s3://bucket/prefix``; the prefix has no leading or trailing '/'."""
    bucket, _, key = uri[len("s3://") :].partition("/")
    return bucket, key.strip("/")


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


def is_uri(path: str) -> bool:
    return "://" in path


def uri_for(filesystem: pafs.FileSystem, path: str) -> str:
    """The URI of ``path`` on ``filesystem`` (pyarrow and Ray hand back paths without a scheme)."""
    if isinstance(filesystem, pafs.LocalFileSystem):
        return path
    return f"{filesystem.type_name}://{path}"


def local_copy(uri: str) -> str:
    """A local directory holding the directory at ``uri``, downloaded once per process and URI."""
    if uri not in _LOCAL_COPIES:
        fs, path = filesystem_for(uri)
        local = tempfile.mkdtemp(prefix="sdtrain-")
        pafs.copy_files(path, local, source_filesystem=fs)
        _LOCAL_COPIES[uri] = local
    return _LOCAL_COPIES[uri]


_LOCAL_COPIES: dict[str, str] = {}


def uri_prefix(path: str) -> str:
    """``s3://`` for ``s3://bucket/key``; empty for a local path (pyarrow paths drop the scheme)."""
    return path[: path.index("://") + 3] if is_uri(path) else ""


def absolute(path: str) -> str:
    """Local paths become absolute (Ray workers do not share the driver's cwd); URIs are kept."""
    return path if is_uri(path) else os.path.abspath(os.path.expanduser(path))


def resolve_parquet_files(specs: list[str], key: str) -> list[str]:
    """Every parquet file that ``specs`` names, in a stable order, with duplicates removed.

    Raises DataError naming ``key`` and the spec when a spec names nothing.
    """
    files: list[str] = []
    for spec in specs:
        found = _expand(spec)
        if not found:
            raise DataError(
                f"{key}: {spec} matches no parquet files; expected a .parquet file, a directory "
                "containing .parquet files, or a glob such as data/*.parquet"
            )
        files.extend(found)
    return list(dict.fromkeys(files))


def _expand(spec: str) -> list[str]:
    fs, path = filesystem_for(spec)
    prefix = uri_prefix(spec)
    if any(c in path for c in _GLOB_CHARS):
        if not prefix:
            return sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
        base = path[: min(path.index(c) for c in _GLOB_CHARS if c in path)].rsplit("/", 1)[0]
        infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        return sorted(prefix + i.path for i in infos if i.type == pafs.FileType.File and fnmatch.fnmatch(i.path, path))
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        return [spec]
    if info.type == pafs.FileType.Directory:
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
        return sorted(
            prefix + i.path
            for i in infos
            if i.type == pafs.FileType.File and i.path.endswith(".parquet") and not _hidden(i.path, path)
        )
    return []


def _hidden(path: str, root: str) -> bool:
    """Files under a '.' or '_' name (``_SUCCESS``, ``.tmp``) are writer by-products, not data."""
    return any(part.startswith((".", "_")) for part in path[len(root) :].split("/") if part)


def filesystems_for(paths: list[str]) -> list[tuple[pafs.FileSystem, str]]:
    """``filesystem_for`` of each path, with one filesystem per S3 bucket (many files, few buckets)."""
    buckets: dict[str, pafs.FileSystem] = {}
    out = []
    for path in paths:
        if not path.startswith("s3://"):
            out.append(filesystem_for(path))
            continue
        bucket, key = split_s3(path)
        if bucket not in buckets:
            buckets[bucket] = s3_filesystem(bucket)
        out.append((buckets[bucket], f"{bucket}/{key}"))
    return out


def filesystem_for(path: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem that holds ``path``, and the path within it."""
    if path.startswith("s3://"):
        # Not from_uri: it reads '?' (a glob character here) as the start of URI options, and
        # would not apply our endpoint and retries.
        bucket, key = split_s3(path)
        return s3_filesystem(bucket), f"{bucket}/{key}" if key else bucket
    if is_uri(path):
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path))


def ray_storage(path: str) -> tuple[pafs.FileSystem | None, str]:
    """(storage_filesystem, storage path) to hand Ray Train for ``path``: for a URI our own
    filesystem (endpoint and retries travel with it to the controller and workers) and the path
    within it; for a local path (None, its absolute path: Ray refuses relative ones), Ray's default."""
    if not is_uri(path):
        return None, absolute(path)
    return filesystem_for(path)


def set_aside(path: str) -> str | None:
    """Rename the directory at ``path`` (local or URI) to ``<path>.replaced-<UTC time>``; return
    the new location, or None if nothing is there. Object stores have no rename: copy, then delete."""
    fs, fs_path = filesystem_for(path)
    if fs.get_file_info(fs_path).type == pafs.FileType.NotFound:
        return None
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    target = f"{fs_path.rstrip('/')}.replaced-{stamp}"
    if isinstance(fs, pafs.LocalFileSystem):
        fs.move(fs_path, target)
    else:
        pafs.copy_files(fs_path, target, source_filesystem=fs, destination_filesystem=fs)
        fs.delete_dir(fs_path)
    return uri_prefix(path) + target
