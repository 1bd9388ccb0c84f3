"""Model versions and the production pointer, under ``retrain.models_root``::

    production.json              {"version": "v0002"}: replaced whole, never edited in place
    retrain.lock                 held by the one retrain run allowed at a time (owner and lease inside)
    jobs/<job id>.json           the schedule date a job's first attempt pinned, for its retries
    versions/v0001/unet/         UNet2DConditionModel.save_pretrained (safetensors)
    versions/v0001/scheduler/    the noise schedule
    versions/v0001/manifest.json written last, whole: a version directory without it is incomplete

A reader resolves production.json and loads that version. Because a version is complete
(manifest written) before the pointer can name it, and the pointer is replaced whole, a reader
never sees a pointer to a half-written version.

Writers coordinate through conditional writes, which work the same on a shared filesystem and on
S3: create-if-absent (a hard link of a staged file, or a put with If-None-Match: *) and
replace-if-unchanged (an exclusive swap marker, or a put with If-Match: <ETag>). A version
directory is created exclusively, the pointer is compared and swapped, and the lock is taken,
renewed, taken over when stale and released with the same two operations.
"""

from __future__ import annotations

import datetime
import errno
import functools
import hashlib
import json
import os
import posixpath
import re
import socket
import tempfile
import threading
import uuid
from typing import Any

import pyarrow.fs as pafs
from diffusers import DDPMScheduler, UNet2DConditionModel

from sdtrain.errors import ConfigError, DataError, SdtrainError
from sdtrain.storage.filesystems import filesystem_for
from sdtrain.storage.s3 import s3_client
from sdtrain.storage.uris import absolute

PRODUCTION_FILE = "production.json"
MANIFEST_FILE = "manifest.json"
LOCK_FILE = "retrain.lock"
JOBS_DIR = "jobs"
# A holder renews its lease every quarter of it: a holder that died (SIGKILL, lost node) blocks
# later runs for at most this long, and a live one survives three missed renewals.
LOCK_LEASE_S = 900.0
_VERSION = re.compile(r"v(\d{4,})")
_JOB_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_UNCHECKED = object()


SWAP_MARKER_STALE_S = 60.0
"""Age past which a local swap marker is taken for one a dead writer left (a swap takes milliseconds)."""


class RegistryBusy(SdtrainError):
    """Another retrain run holds the registry's lock (or is taking it over): this run did nothing."""


class RegistryConflict(SdtrainError):
    """A write the registry makes exclusively found someone else's: a version that exists, a lost lock."""


class PointerMoved(SdtrainError):
    """The production pointer no longer names the version a promotion was decided against."""

    def __init__(self, message: str, current: str | None):
        super().__init__(message)
        self.current = current


class ModelRegistry:
    def __init__(self, root: str):
        self.root_uri = absolute(root)
        self.fs, self.root = filesystem_for(self.root_uri)

    def versions(self) -> list[str]:
        """Complete versions (with a manifest), oldest first."""
        return [v for v in self._version_dirs() if self._exists(self._path("versions", v, MANIFEST_FILE))]

    def manifest(self, version: str) -> dict[str, Any]:
        path = self._path("versions", version, MANIFEST_FILE)
        try:
            return json.loads(self._read(path))
        except json.JSONDecodeError as e:
            raise DataError(f"retrain.models_root: {path} is not valid JSON ({e}); restore or remove it") from None

    def production(self) -> str | None:
        return self._production()[0]

    def _production(self) -> tuple[str | None, str | None]:
        """(the version production names or None, the pointer's tag for a conditional replace)."""
        pointer = self._path(PRODUCTION_FILE)
        text, tag = self._read_tagged(pointer)
        if text is None:
            return None, None
        try:
            version = json.loads(text)["version"]
        except (json.JSONDecodeError, KeyError, TypeError):
            version = None
        # The name is joined into paths: anything but vNNNN could point outside the registry.
        if not isinstance(version, str) or not _VERSION.fullmatch(version):
            raise DataError(
                f'retrain.models_root: {pointer} must hold {{"version": "vNNNN"}}, not {text[:80]!r}; '
                "point it at a complete version under versions/"
            )
        return version, tag

    def location(self, version: str) -> str:
        """The version's directory (unet/ and scheduler/ inside): usable as ``model.pretrained``, and
        loaded by ``sdtrain.artifacts.loading.load_model``."""
        return posixpath.join(self.root_uri, "versions", version)

    def write_version(self, unet: UNet2DConditionModel, scheduler: DDPMScheduler, manifest: dict[str, Any]) -> str:
        """Write a new version (weights first, manifest last) and return its name. The next number
        is claimed exclusively: a writer that numbered from the same listing as another gets an
        error, never the other's directory."""
        return self._write_version_as(self.next_version(), unet, scheduler, manifest)

    def next_version(self) -> str:
        """The name the next version gets: one past the highest version directory, complete or not."""
        numbers = [int(v[1:]) for v in self._version_dirs()]  # every name matched _VERSION
        return f"v{max(numbers, default=0) + 1:04d}"

    def _write_version_as(
        self, version: str, unet: UNet2DConditionModel, scheduler: DDPMScheduler, manifest: dict[str, Any]
    ) -> str:
        destination = self._path("versions", version)
        self._claim_dir(destination)
        with tempfile.TemporaryDirectory() as local:
            unet.save_pretrained(posixpath.join(local, "unet"))
            scheduler.save_pretrained(posixpath.join(local, "scheduler"))
            pafs.copy_files(local, destination, destination_filesystem=self.fs)
        manifest_path = posixpath.join(destination, MANIFEST_FILE)
        if self._create(manifest_path, json.dumps({"version": version, **manifest}, indent=2)) is None:
            raise RegistryConflict(f"retrain.models_root: {manifest_path} was written by another writer meanwhile")
        return version

    def set_production(self, version: str, *, expected: Any = _UNCHECKED) -> None:
        """Point production at ``version``, only if it still names ``expected`` (a version, or None
        for no pointer yet); raises PointerMoved otherwise. Without ``expected`` (by hand), whatever
        it names is replaced, still as one conditional write."""
        if version not in self.versions():
            raise ValueError(f"version {version} is not a complete version under {self.root_uri}")
        pointer = self._path(PRODUCTION_FILE)
        current, tag = self._production()
        if expected is not _UNCHECKED and current != expected:
            raise PointerMoved(self._moved(pointer, expected, current), current)
        text = json.dumps({"version": version})
        swapped = self._create(pointer, text) if tag is None else self._replace(pointer, text, tag)
        if swapped is None:
            now = self.production()
            raise PointerMoved(self._moved(pointer, current, now), now)

    def _moved(self, pointer: str, expected: str | None, current: str | None) -> str:
        return (
            f"{self._uri(pointer)} names {current or 'nothing'}, not {expected or 'nothing'} as when the promotion "
            "was decided: another writer moved it; left as it is"
        )

    def lock(self, owner: dict[str, Any], lease_s: float = LOCK_LEASE_S, clock=None) -> RegistryLock:
        """The registry's lock for one retrain run (``with registry.lock(owner):``); see RegistryLock.

        Args:
            owner: what the lock says about its holder (run, date, job), besides host and pid.
            lease_s: how long the lock outlives its holder's last renewal.
            clock: the current UTC time (default: this machine's clock).
        """
        return RegistryLock(self, owner, lease_s, clock or _now)

    def pin_date(self, job_id: str, today: datetime.date) -> tuple[datetime.date, str]:
        """The schedule date of job ``job_id``: ``today`` if this is its first attempt (recorded in
        jobs/<job id>.json), else the date its first attempt recorded. Returns (date, pinned_at)."""
        if not _JOB_ID.fullmatch(job_id):
            raise ConfigError(f"job id {job_id!r} (ANYSCALE_PRODJOB_ID) may hold only letters, digits, '_', '.', '-'")
        path = self._path(JOBS_DIR, f"{job_id}.json")
        record = {"job": job_id, "date": today.isoformat(), "pinned_at": _now().isoformat()}
        if self._create(path, json.dumps(record)) is None:
            text, _ = self._read_tagged(path)
            try:
                record = json.loads(text or "")
                return datetime.date.fromisoformat(record["date"]), record["pinned_at"]
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                raise DataError(
                    f"retrain.models_root: {self._uri(path)} must hold the job's pinned date "
                    f'{{"date": "YYYY-MM-DD", ...}}, not {(text or "")[:80]!r}; remove it or set retrain.date'
                ) from None
        return today, record["pinned_at"]

    def _version_dirs(self) -> list[str]:
        infos = self.fs.get_file_info(pafs.FileSelector(self._path("versions"), allow_not_found=True))
        names = [posixpath.basename(i.path) for i in infos if i.type == pafs.FileType.Directory]
        return sorted((n for n in names if _VERSION.fullmatch(n)), key=lambda n: int(n[1:]))

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


class RegistryLock:
    """The one-run-at-a-time lock of a registry: ``retrain.lock`` under its root, holding the owner
    (host, pid, run, date, job), when it was taken and when its lease expires.

    Taken by an exclusive create. A live lock (lease not expired) refuses the next run with
    RegistryBusy, naming the file, the owner and the expiry; a stale one (its holder died without
    releasing it) is taken over by a conditional replace of exactly the stale content, so of two
    runs that find it stale, one wins; a lock of an earlier attempt of the same job counts as stale.
    The holder renews the lease from a thread every quarter of it, and releases the lock on exit (a
    conditional delete: never someone else's lock).
    """

    def __init__(self, registry: ModelRegistry, owner: dict[str, Any], lease_s: float, clock=None):
        self.registry, self.owner, self.lease_s = registry, owner, lease_s
        self.clock = clock or _now
        self.path = registry._path(LOCK_FILE)
        self.uri = registry._uri(self.path)
        self.token = uuid.uuid4().hex
        self._tag: str | None = None
        self._expires: datetime.datetime | None = None
        self._lost: str | None = None
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def __enter__(self) -> RegistryLock:
        self.acquire()
        return self

    def __exit__(self, kind, error, traceback) -> None:
        try:
            self.release()
        except Exception as e:
            if error is None:
                raise
            # The run's own error is what the operator needs; the lease ends the lock anyway.
            print(f"[sdtrain] could not release {self.uri} ({e}); it expires with its lease", flush=True)

    def acquire(self) -> None:
        registry = self.registry
        text = self._text(self.clock())
        if (tag := registry._create(self.path, text)) is not None:
            self._held(text, tag)
            return
        current, tag = registry._read_tagged(self.path)
        if current is None:  # released between the two calls: one more try, as a fresh contender
            if (tag := registry._create(self.path, text)) is not None:
                self._held(text, tag)
                return
            current, tag = registry._read_tagged(self.path)
        holder = _parse_lock(current or "")
        expires = holder.get("expires_at")
        if expires is None:
            raise RegistryBusy(
                f"{self.uri} exists but is not a lock sdtrain wrote ({(current or '')[:120]!r}); "
                "if no retrain run is going on, delete it"
            )
        same_job = holder.get("job") is not None and holder.get("job") == self.owner.get("job")
        # Anyscale starts a job's retry only once its previous attempt has ended: a lock held by an
        # earlier attempt of this job is stale whatever its lease says, and waiting would only
        # spend this attempt (and the next) on the refusal.
        if expires > self.clock() and not same_job:
            raise RegistryBusy(
                f"{self.uri} is held by {_describe(holder)} until {expires.isoformat(timespec='seconds')} (its lease, "
                "renewed while it runs): another retrain run is going on, so this one did nothing. If that run is "
                "dead, wait for the lease to expire, or delete the file"
            )
        text = self._text(self.clock())
        assert tag is not None  # the lock was read (current is not None), so it has a tag
        new_tag = registry._replace(self.path, text, tag)
        if new_tag is None:
            raise RegistryBusy(
                f"{self.uri} was stale (held by {_describe(holder)}, lease until "
                f"{expires.isoformat(timespec='seconds')}) and another run took it over first; this one did nothing"
            )
        why = (
            "an earlier attempt of this job, which ended without releasing it"
            if same_job
            else f"let its lease expire at {expires.isoformat(timespec='seconds')} without releasing it"
        )
        print(f"[sdtrain] took over {self.uri}: its holder ({_describe(holder)}) {why}", flush=True)
        self._held(text, new_tag)

    def renew(self) -> None:
        """Extend the lease; a lock that was taken over meanwhile is marked lost (ensure_held raises)."""
        with self._guard:
            if self._tag is None or self._lost:
                return
            text = self._text(self.clock())
            tag = self.registry._replace(self.path, text, self._tag)
            if tag is not None:
                self._remember(text, tag)
            else:
                self._lost = f"{self.uri} is no longer this run's: it was taken over or removed while held"

    def ensure_held(self) -> None:
        """Raise RegistryConflict unless this run still holds the lock (checked before each registry write)."""
        with self._guard:
            if self._lost is None and self._expires is not None and self.clock() >= self._expires:
                self._lost = f"this run's lease on {self.uri} expired at {self._expires.isoformat()} without renewal"
            if self._lost:
                raise RegistryConflict(f"{self._lost}; nothing more is written to the registry by this run")

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        with self._guard:
            if self._tag is not None and not self._lost and not self.registry._delete(self.path, self._tag):
                print(f"[sdtrain] {self.uri} was no longer this run's when it ended; left as it is", flush=True)
            self._tag = None

    def _held(self, text: str, tag: str) -> None:
        self._remember(text, tag)
        self._renewer = threading.Thread(target=self._renew_until_released, name="sdtrain-registry-lock", daemon=True)
        self._renewer.start()

    def _renew_until_released(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            try:
                self.renew()
            except Exception as e:  # storage trouble: the next renewal may get through, within the lease
                print(f"[sdtrain] could not renew {self.uri} ({e}); trying again", flush=True)

    def _remember(self, text: str, tag: str) -> None:
        self._tag = tag
        self._expires = _parse_lock(text)["expires_at"]

    def _text(self, now: datetime.datetime) -> str:
        expires = now + datetime.timedelta(seconds=self.lease_s)
        return json.dumps(
            {
                **_whoami(),
                **self.owner,
                "token": self.token,
                "taken_at": now.isoformat(),
                "expires_at": expires.isoformat(),
            }
        )


def _parse_lock(text: str) -> dict[str, Any]:
    try:
        holder = json.loads(text)
        holder["expires_at"] = datetime.datetime.fromisoformat(holder["expires_at"])
        return holder
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return {}


def _describe(holder: dict[str, Any]) -> str:
    keys = ("run", "date", "job", "host", "pid", "taken_at")
    return ", ".join(f"{k} {holder[k]}" for k in keys if holder.get(k) is not None)


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
