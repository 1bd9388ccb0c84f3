"""Conditional writes to a registry root, the only way the model registry changes a file another
writer may touch. They work the same on a shared filesystem and on S3: create-if-absent (a hard
link of a staged file, or a put with If-None-Match: *) and replace-if-unchanged (an exclusive swap
marker, or a put with If-Match: <ETag>), plus a conditional delete and an exclusive directory claim.
"""

from __future__ import annotations

import datetime
import errno
import functools
import hashlib
import json
import os
import posixpath
import signal
import socket
import uuid
from typing import Any

import pyarrow.fs as pafs

from sdtrain.errors import ConfigError, SdtrainError
from sdtrain.storage.filesystems import filesystem_for
from sdtrain.storage.s3 import s3_client
from sdtrain.storage.uris import absolute

CHAOS_KILL_VAR = "SDTRAIN_CHAOS_KILL_AFTER_WRITES"
"""Chaos testing's hook (bench/retrain_chaos.py): with it set to N, a process SIGKILLs itself right after its Nth
registry write (a create, replace, delete, directory claim or version upload), so a kill lands between any two."""
_writes_made = 0


def wrote() -> None:
    """Count one registry write made by this process; see CHAOS_KILL_VAR."""
    global _writes_made
    _writes_made += 1
    limit = os.environ.get(CHAOS_KILL_VAR)
    if limit and _writes_made == int(limit):
        os.kill(os.getpid(), signal.SIGKILL)


SWAP_MARKER_STALE_S = 60.0
"""Age past which a local swap marker is taken for one a dead writer left (a swap takes milliseconds)."""


class RegistryConflict(SdtrainError):
    """A write the registry makes exclusively found someone else's: a version that exists, a lost lock."""


class ConditionalStore:
    """A registry root (local, shared filesystem or s3://) and the conditional writes to files under it."""

    def __init__(self, root: str):
        self.root_uri = absolute(root)
        self.fs, self.root = filesystem_for(self.root_uri)

    def _path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def _uri(self, path: str) -> str:
        return f"s3://{path}" if self._s3 else path

    @functools.cached_property
    def _client(self):
        return s3_client()  # boto3 clients are thread-safe: the lock's renewal thread shares it

    @property
    def _s3(self) -> bool:
        return isinstance(self.fs, pafs.S3FileSystem)

    def _exists(self, path: str) -> bool:
        return self.fs.get_file_info(path).type == pafs.FileType.File

    def _read(self, path: str) -> str:
        with self.fs.open_input_stream(path) as f:
            return f.read().decode()

    # --- conditional writes: the only way the registry changes a file another writer may touch ---

    def _check_conditional(self) -> None:
        if not self._s3 and not isinstance(self.fs, pafs.LocalFileSystem):
            raise ConfigError(
                f"retrain.models_root: {self.root_uri}: registry writes need conditional writes, which sdtrain "
                "makes on a local or shared filesystem and on s3:// only"
            )

    def _read_tagged(self, path: str) -> tuple[str | None, str | None]:
        """(text or None if absent, the tag a conditional replace compares: the ETag on S3, the
        content itself on a filesystem)."""
        if self._s3:
            bucket, key = path.split("/", 1)
            try:
                reply = self._client.get_object(Bucket=bucket, Key=key)
            except Exception as e:  # botocore's ClientError, without importing botocore here
                if _s3_code(e) in ("NoSuchKey", "404"):
                    return None, None
                raise
            return reply["Body"].read().decode(), reply["ETag"]
        if not self._exists(path):
            return None, None
        try:
            text = self._read(path)
        except FileNotFoundError:  # removed since: as absent
            return None, None
        return text, text

    def _create(self, path: str, text: str) -> str | None:
        done = self._create_once(path, text)
        if done is not None and done is not False:
            wrote()
        return done

    def _create_once(self, path: str, text: str) -> str | None:
        """Write ``path`` whole if nothing is there and return its new tag; None if something is
        there (it is never overwritten)."""
        self._check_conditional()
        if self._s3:
            bucket, key = path.split("/", 1)
            put = _s3_conditional(lambda: self._client.put_object(Bucket=bucket, Key=key, Body=text, IfNoneMatch="*"))
            return put if put is not None else self._if_ours(path, text)
        staged = self._stage(path, text)
        try:
            os.link(staged, path)  # atomic, and fails if the name exists: the file appears whole or not at all
            return text
        except FileExistsError:
            return None
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            # A filesystem without hard links: still exclusive, though a reader may briefly see it partly written.
            return self._create_exclusive(path, text)
        finally:
            os.unlink(staged)

    @staticmethod
    def _create_exclusive(path: str, text: str) -> str | None:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return None
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        return text

    def _replace(self, path: str, text: str, tag: str) -> str | None:
        done = self._replace_once(path, text, tag)
        if done is not None and done is not False:
            wrote()
        return done

    def _replace_once(self, path: str, text: str, tag: str) -> str | None:
        """Replace ``path`` whole with ``text`` if it is still what was read with ``tag``, and
        return the new tag; None if it is not."""
        self._check_conditional()
        if self._s3:
            bucket, key = path.split("/", 1)
            put = _s3_conditional(lambda: self._client.put_object(Bucket=bucket, Key=key, Body=text, IfMatch=tag))
            return put if put is not None else self._if_ours(path, text)
        return text if self._local_swap(path, tag, lambda: os.replace(self._stage(path, text), path)) else None

    def _if_ours(self, path: str, text: str) -> str | None:
        """The tag of ``path`` if it holds ``text``: a put whose reply was lost and whose retry the
        condition then refused did land (what the writers here write is unique to them)."""
        current, tag = self._read_tagged(path)
        return tag if current == text else None

    def _delete(self, path: str, tag: str) -> bool:
        done = self._delete_once(path, tag)
        if done is not None and done is not False:
            wrote()
        return done

    def _delete_once(self, path: str, tag: str) -> bool:
        """Delete ``path`` if it is still what was read with ``tag``; False if not."""
        self._check_conditional()
        if self._s3:
            bucket, key = path.split("/", 1)
            return _s3_conditional(lambda: self._client.delete_object(Bucket=bucket, Key=key, IfMatch=tag)) is not None
        return self._local_swap(path, tag, lambda: os.unlink(path))

    def _local_swap(self, path: str, tag: str, change) -> bool:
        """Compare-and-swap on a filesystem: the swap marker for this content is created exclusively,
        so of the writers that read the same content one changes it; the others find the marker, or
        (once it is gone) other content."""
        marker = f"{path}.swap-{hashlib.sha256(tag.encode()).hexdigest()[:16]}"
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            self._check_leftover(marker, path, tag)
            return False
        try:
            if self._read_tagged(path)[1] != tag:
                return False
            change()
            return True
        finally:
            os.unlink(marker)

    def _check_leftover(self, marker: str, path: str, tag: str) -> None:
        """A swap takes milliseconds: a marker much older than that, for content ``path`` still holds, was left by
        a writer that died mid-swap, and would refuse every later swap as if another writer had moved the file."""
        try:
            age = datetime.datetime.now().timestamp() - os.stat(marker).st_mtime
        except FileNotFoundError:  # its writer just finished
            return
        if age > SWAP_MARKER_STALE_S and self._read_tagged(path)[1] == tag:
            raise RegistryConflict(
                f"{marker} was left {age:.0f} s ago by a writer that stopped in the middle of changing "
                f"{path}, which it did not change; no other swap of it can run while the marker is there. Check that "
                "no retrain run is writing the registry, remove the marker and re-run"
            )

    def _stage(self, path: str, text: str) -> str:
        os.makedirs(posixpath.dirname(path), exist_ok=True)
        staged = f"{posixpath.dirname(path)}/.{posixpath.basename(path)}.{uuid.uuid4().hex}.tmp"
        with open(staged, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        return staged

    def _claim_dir(self, directory: str) -> None:
        """Create ``directory`` for this writer alone (S3 has no directories: a claim object in it)."""
        self._check_conditional()
        if self._s3:
            claimed = (
                self._create(posixpath.join(directory, ".claim"), json.dumps({**_whoami(), "token": uuid.uuid4().hex}))
                is not None
            )
        else:
            os.makedirs(posixpath.dirname(directory), exist_ok=True)
            try:
                os.mkdir(directory)
                claimed = True
            except FileExistsError:
                claimed = False
        if not claimed:
            raise RegistryConflict(
                f"retrain.models_root: {self._uri(directory)} already exists: another writer numbered a version "
                "from the same listing (two retrain runs at once, one without the lock?); nothing was written"
            )
        wrote()


def _whoami() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid()}


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _s3_code(error: Exception) -> str | None:
    response = getattr(error, "response", None)
    return response.get("Error", {}).get("Code") if isinstance(response, dict) else None


def _s3_conditional(request) -> str | None:
    """Make a conditional S3 request and return the object's new ETag ("" for a delete); None if
    its condition failed (412), the object it was to match is gone (404), or a concurrent
    conditional write to the key won (409)."""
    try:
        return request().get("ETag", "")
    except Exception as e:
        if _s3_code(e) in ("PreconditionFailed", "412", "NoSuchKey", "404", "ConditionalRequestConflict", "409"):
            return None
        raise
