"""Paths and URIs as strings: which is which, their scheme, credentials kept out of messages."""

from __future__ import annotations

import os
import re

# A user name or password after the scheme: ``KEY:SECRET@`` (AWS secrets may hold '/', so a ':'
# before the first '/' starts one too), or anything before an '@' that precedes the first '/'.
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)([^/@:]*:[^@]*@|[^/@]*@)")


def has_userinfo(uri: str) -> bool:
    """Whether ``uri`` carries a user name or password (``s3://KEY:SECRET@bucket``, ``http://u:p@host``)."""
    return _USERINFO.match(uri) is not None


def redact(uri: str) -> str:
    """``uri`` with any user name and password replaced by ``***``: safe for a message or a log line."""
    return _USERINFO.sub(r"\1***@", uri)


def is_uri(path: str) -> bool:
    return "://" in path


def uri_prefix(path: str) -> str:
    """``s3://`` for ``s3://bucket/key``; empty for a local path (pyarrow paths drop the scheme)."""
    return path[: path.index("://") + 3] if is_uri(path) else ""


def absolute(path: str) -> str:
    """Local paths become absolute (Ray workers do not share the driver's cwd); URIs are kept."""
    return path if is_uri(path) else os.path.abspath(os.path.expanduser(path))


def split_s3(uri: str) -> tuple[str, str]:
    """(bucket, key prefix) of ``s3://bucket/prefix``; the prefix has no leading or trailing '/'."""
    bucket, _, key = uri[len("s3://") :].partition("/")
    return bucket, key.strip("/")
