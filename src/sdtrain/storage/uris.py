"""Paths and URIs as strings: which is which, their scheme, credentials kept out of messages."""

from __future__ import annotations

import os
import re

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# One parameter of a query or fragment: its name (if it has one) and its value.
_PARAMETER = re.compile(r"([?#&;])(?:([^=?#&;]*)=)?([^?#&;]*)")
# Parameter names that carry a credential: tokens, signatures (presigned URLs: X-Amz-Signature, Azure's sig),
# passwords, keys (pyarrow's access_key/secret_key, api_key), credentials, session tokens.
_SECRET_NAME = re.compile(
    r"token|secret|passw|pwd|signature|credential|auth|session|apikey|jwt|(^|[-_.])sig($|[-_.])|key($|[-_.])",
    re.IGNORECASE,
)


def _userinfo_end(uri: str) -> int:
    """Where what follows the user name and password of ``uri`` starts (after its '@'); 0 if it has none.

    A secret may hold '/' (AWS's do), '@', '?' or '#', so the userinfo ends at the LAST '@' of the URI, not at the
    first, whenever the authority (up to the first '/', '?' or '#') holds an '@' or a ':' (``KEY:SE/CRET@``). This
    also takes ``host:port/path@x``'s path for one: redacting too much is the safe side."""
    scheme = _SCHEME.match(uri)
    if scheme is None:
        return 0
    rest = uri[scheme.end() :]
    authority = rest[: _first(rest, "/?#")]
    at = uri.rfind("@")
    return at + 1 if at >= scheme.end() and ("@" in authority or ":" in authority) else 0


def _first(text: str, chars: str) -> int:
    """The index of the first of ``chars`` in ``text``; its length if there is none."""
    found = re.search(f"[{re.escape(chars)}]", text)
    return found.start() if found else len(text)


def has_userinfo(uri: str) -> bool:
    """Whether ``uri`` carries a user name or password (``s3://KEY:SECRET@bucket``, ``http://u:p@host``)."""
    return _userinfo_end(uri) > 0


def secret_parameters(uri: str) -> list[str]:
    """The names of ``uri``'s query (or fragment) parameters that carry a credential: ``token``,
    ``access_token``, ``X-Amz-Signature``, ``sig``, ``secret_key`` ... ([] for a local path)."""
    if _SCHEME.match(uri) is None:
        return []
    rest = uri[_userinfo_end(uri) :]
    query = rest[_first(rest, "?#") :]
    return [m[2] for m in _PARAMETER.finditer(query) if m[2] and _SECRET_NAME.search(m[2])]


def redact(uri: str) -> str:
    """``uri`` with any user name and password, and the value of every query or fragment parameter, replaced by
    ``***``: safe for a message or a log line. A local path is kept as it is (``?`` is a file name's there)."""
    scheme = _SCHEME.match(uri)
    if scheme is None:
        return uri
    end = _userinfo_end(uri)
    head, rest = (scheme.group() + "***@", uri[end:]) if end else ("", uri)
    cut = _first(rest, "?#")
    hidden = _PARAMETER.sub(lambda m: f"{m[1]}{'' if m[2] is None else m[2] + '='}***", rest[cut:])
    return head + rest[:cut] + hidden


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


def collapse_slashes(uri: str) -> str:
    """``s3://bucket/a//b/`` as ``s3://bucket/a/b/``: repeated slashes in an s3:// URI's key collapsed to one (the
    scheme's ``//`` and any query kept). An environment variable that ends in '/' doubles the slash after it
    (``$ANYSCALE_ARTIFACT_STORAGE/sdtrain/runs``), and pyarrow refuses an empty path component. Anything else, and
    a URI without a bucket (``s3:///x``, refused where it is used), is returned as it is."""
    if not uri.startswith("s3://"):
        return uri
    rest = uri[len("s3://") :]
    cut = _first(rest, "?#")
    bucket, slash, key = rest[:cut].partition("/")
    if not bucket or not slash:
        return uri
    return "s3://" + bucket + "/" + re.sub(r"/{2,}", "/", key.lstrip("/")) + rest[cut:]
