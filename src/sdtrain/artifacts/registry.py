"""Model versions and the production pointer, under ``retrain.models_root``::

    production.json              {"version": "v0002", "move": {from, to, kind, reason, by, at}}: replaced whole,
                                 never edited in place; the move that set it, for the log if its writer died
    retrain.lock                 held by the one retrain run allowed at a time (owner and lease inside)
    jobs/<job id>.json           the schedule date a job's first attempt pinned, for its retries
    versions/v0001/unet/         UNet2DConditionModel.save_pretrained (safetensors): the weights served (the EMA's
                                 if the run kept an EMA)
    versions/v0001/raw_unet/     only if the run kept an EMA: its trained weights, which a warm start continues
    versions/v0001/scheduler/    the noise schedule
    versions/v0001/sdtrain.json, unconditional_caption.npy
                                 what an export records of its model (sdtrain.artifacts.export): data shapes, latent
                                 scaling, the empty-prompt embedding, for load_model
    versions/v0001/manifest.json written last, whole: a version directory without it is incomplete
    production_log/00000001.json append-only: one entry per move of the pointer (from, to, kind, why, who)
    catalog.json                 copies of the manifests and log entries, rewritten after each version: a run reads
                                 it and what was written since, not every file (registry_reads.py)

A reader resolves production.json and loads that version. Because a version is complete
(manifest written) before the pointer can name it, and the pointer is replaced whole, a reader
never sees a pointer to a half-written version.

Writers coordinate through conditional writes, which work the same on a shared filesystem and on
S3: create-if-absent (a hard link of a staged file, or a put with If-None-Match: *) and
replace-if-unchanged (an exclusive swap marker, or a put with If-Match: <ETag>). A version
directory is created exclusively, the pointer is compared and swapped, and the lock is taken,
renewed, taken over when stale and released with the same two operations.

The conditional writes are in conditional_writes.py, the lock in registry_lock.py, the reads of versions, manifests
and the pointer log in registry_reads.py; this module holds the writes of versions, the production pointer and the
jobs' pinned dates.
"""

from __future__ import annotations

import datetime
import json
import posixpath
import re
import tempfile
from typing import Any

import pyarrow.fs as pafs
from diffusers import DDPMScheduler, UNet2DConditionModel

from sdtrain.artifacts.conditional_writes import SWAP_MARKER_STALE_S, RegistryConflict, _now, _whoami, wrote
from sdtrain.artifacts.export import model_sources, write_model_record
from sdtrain.artifacts.loading import LoadedModel
from sdtrain.artifacts.registry_lock import LOCK_FILE, LOCK_LEASE_S, RegistryBusy, RegistryLock
from sdtrain.artifacts.registry_reads import LOG_DIR, MANIFEST_FILE, RegistryReads
from sdtrain.artifacts.registry_reads import VERSION as _VERSION
from sdtrain.errors import ConfigError, DataError, SdtrainError
from sdtrain.model.unet import RAW_UNET_SUBFOLDER
from sdtrain.storage.run_layout import EXPORT_INFO_FILE

__all__ = [
    "LOCK_FILE",
    "LOCK_LEASE_S",
    "ModelRegistry",
    "PointerMoved",
    "RegistryBusy",
    "RegistryConflict",
    "RegistryLock",
]

PRODUCTION_FILE = "production.json"
JOBS_DIR = "jobs"
_JOB_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_UNCHECKED = object()


class PointerMoved(SdtrainError):
    """The production pointer no longer names the version a promotion was decided against."""

    def __init__(self, message: str, current: str | None):
        super().__init__(message)
        self.current = current


class ModelRegistry(RegistryReads):
    def production(self) -> str | None:
        return self._production()[0]

    def _production(self) -> tuple[str | None, str | None]:
        """(the version production names or None, the pointer's tag for a conditional replace)."""
        version, tag, _ = self._pointer()
        return version, tag

    def _pointer(self) -> tuple[str | None, str | None, dict[str, Any] | None]:
        """(the version production names or None, the pointer's tag, the move that set it: None where the pointer
        predates recording it, or a hand edit left one that is not about this version)."""
        pointer = self._path(PRODUCTION_FILE)
        text, tag = self._read_tagged(pointer)
        if text is None:
            return None, None, None
        try:
            record = json.loads(text)
            version, move = record["version"], record.get("move")
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            version, move = None, None
        # The name is joined into paths: anything but vNNNN could point outside the registry.
        if not isinstance(version, str) or not _VERSION.fullmatch(version):
            raise DataError(
                f'retrain.models_root: {pointer} must hold {{"version": "vNNNN"}}, not {text[:80]!r}; '
                "point it at a complete version under versions/"
            )
        if not isinstance(move, dict) or move.get("to") != version or not isinstance(move.get("kind"), str):
            move = None
        return version, tag, move

    def location(self, version: str) -> str:
        """The version's directory (unet/ and scheduler/ inside): usable as ``model.pretrained`` (a warm start: the
        trained weights of raw_unet/ where there is one, their EMA starting from unet/), and loaded by
        ``sdtrain.artifacts.loading.load_model`` (unet/)."""
        return posixpath.join(self.root_uri, "versions", version)

    def write_version(
        self,
        unet: UNet2DConditionModel,
        scheduler: DDPMScheduler,
        manifest: dict[str, Any],
        lock: RegistryLock | None = None,
        *,
        trained: LoadedModel | None = None,
        raw_unet: UNet2DConditionModel | None = None,
    ) -> str:
        """Write a new version (weights first, manifest last) and return its name. The next number
        is claimed exclusively: a writer that numbered from the same listing as another gets an
        error, never the other's directory. With ``lock`` (the run's), the lock is checked still
        held before the directory is claimed and before the manifest makes the version complete:
        a run whose lease lapsed during a long evaluation writes nothing (RegistryConflict).

        Args:
            trained: the model ``unet`` and ``scheduler`` are of (load_model's): what an export records of it goes
                with them, so that load_model gives the version's data shapes and empty-prompt embedding.
            raw_unet: a run that kept an EMA (``unet`` is the EMA's): its trained weights, for warm starts.
        """
        if lock is not None:
            lock.ensure_held()
        version = self.next_version()
        return self._write_version_as(version, unet, scheduler, manifest, lock, trained=trained, raw_unet=raw_unet)

    def next_version(self) -> str:
        """The name the next version gets: one past the highest version directory, complete or not."""
        numbers = [int(v[1:]) for v in self._version_dirs()]  # every name matched _VERSION
        return f"v{max(numbers, default=0) + 1:04d}"

    def _write_version_as(
        self,
        version: str,
        unet: UNet2DConditionModel,
        scheduler: DDPMScheduler,
        manifest: dict[str, Any],
        lock: RegistryLock | None = None,
        *,
        trained: LoadedModel | None = None,
        raw_unet: UNet2DConditionModel | None = None,
    ) -> str:
        destination = self._path("versions", version)
        self._forget_before_claiming(version)
        self._claim_dir(destination)
        with tempfile.TemporaryDirectory() as local:
            unet.save_pretrained(posixpath.join(local, "unet"))
            scheduler.save_pretrained(posixpath.join(local, "scheduler"))
            if raw_unet is not None:
                raw_unet.save_pretrained(posixpath.join(local, RAW_UNET_SUBFOLDER))
            if trained is not None:
                record = write_model_record(trained, local, model_sources(trained))
                with open(posixpath.join(local, EXPORT_INFO_FILE), "wb") as f:
                    f.write(record)
            pafs.copy_files(local, destination, destination_filesystem=self.fs)
        wrote()
        manifest_path = posixpath.join(destination, MANIFEST_FILE)
        if lock is not None:  # the weights' upload may have outlasted the lease: an incomplete version is ignored
            lock.ensure_held()
        if self._create(manifest_path, json.dumps({"version": version, **manifest}, indent=2)) is None:
            raise RegistryConflict(f"retrain.models_root: {manifest_path} was written by another writer meanwhile")
        self._write_catalog()
        return version

    def set_production(
        self,
        version: str,
        *,
        expected: Any = _UNCHECKED,
        kind: str = "set",
        reason: str = "set by hand",
        by: dict[str, Any] | None = None,
    ) -> None:
        """Point production at ``version``, only if it still names ``expected`` (a version, or None
        for no pointer yet); raises PointerMoved otherwise. Without ``expected`` (by hand), whatever
        it names is replaced, still as one conditional write. The move is then appended to the
        pointer log.

        Args:
            version: the complete version production is to name.
            expected: what production must name now for the swap to happen (unchecked if not given).
            kind: the move's kind in the log: promote, rollback or set.
            reason: why it moved, for the log.
            by: who moved it (run, job), besides host and pid.
        """
        if not self._is_complete(version):
            raise ValueError(f"version {version} is not a complete version under {self.root_uri}")
        pointer = self._path(PRODUCTION_FILE)
        self.settle_log()
        current, tag = self._production()
        if expected is not _UNCHECKED and current != expected:
            raise PointerMoved(self._moved(pointer, expected, current), current)
        move = {
            "from": current,
            "to": version,
            "kind": kind,
            "reason": reason,
            "by": {**_whoami(), **(by or {})},
            "at": _now().isoformat(),
        }
        # The move goes in the same write as the version: a writer killed before its log entry leaves it to be
        # logged as it was (a rollback stays a rollback, with its reason), not guessed from the manifests.
        text = json.dumps({"version": version, "move": move})
        swapped = self._create(pointer, text) if tag is None else self._replace(pointer, text, tag)
        if swapped is None:
            now = self.production()
            raise PointerMoved(self._moved(pointer, current, now), now)
        self._append_log(move)

    # --- the pointer log: every version production has named, in order ---------------------------

    def settle_log(self, by: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Record a move of the pointer the log does not have yet, and return its entry (None if the
        log agrees with the pointer): a writer that died between the swap and the log entry, or a
        hand edit of production.json. The move production.json records with its version is logged as
        it was; a pointer without one (written before pointers recorded it, or by hand) is recorded as
        the promotion of a promoted version whose parent the log last named, anything else as ``unlogged``.

        Args:
            by: who settles (run, job), for a move the pointer does not record.
        """
        current, _, move = self._pointer()
        log = self.pointer_log()
        last = log[-1]["to"] if log else None
        if current == last or current is None:
            return None
        if move is not None:
            return self._append_log(move)
        manifest = self.manifest(current) if self._is_complete(current) else {}
        if manifest.get("promoted") and manifest.get("parent") == last:
            kind, reason = "promote", "the promotion's writer stopped between moving the pointer and logging it"
        else:
            kind, reason = "unlogged", f"production.json named {current} without a log entry (changed by hand?)"
        by = {**_whoami(), **(by or {})}
        return self._append_log({"from": last, "to": current, "kind": kind, "reason": reason, "by": by})

    def _append_log(self, move: dict[str, Any]) -> dict[str, Any]:
        """Append ``move`` ({from, to, kind, reason, by, at}; ``at`` now if absent) as the next log entry, unless
        it already is the last one."""
        move = {**move, "at": move.get("at") or _now().isoformat()}
        for _ in range(5):  # a writer without the lock may take a number first: the next one
            log = self.pointer_log()
            # A rollback takes no lock: a run may have settled its move from the pointer between its swap and here.
            if log and {k: v for k, v in log[-1].items() if k != "seq"} == move:
                return log[-1]
            entry = {"seq": len(log) + 1, **move}
            if self._create(self._path(LOG_DIR, f"{entry['seq']:08d}.json"), json.dumps(entry)) is not None:
                return entry
        raise RegistryConflict(f"retrain.models_root: could not append to {self._uri(self._path(LOG_DIR))}")

    def served(self) -> list[str]:
        """The versions production has named and no rollback abandoned since (see :func:`_abandoned`), oldest first;
        the one it names now always."""
        log = self.pointer_log()
        abandoned = _abandoned(log)
        named = [e["to"] for e in log]
        current = self.production()
        if current is not None:
            named.append(current)
        return [v for v in dict.fromkeys(named) if v not in abandoned or v == current]

    def rollback(self, to: str | None = None, reason: str = "", by: dict[str, Any] | None = None) -> tuple[str, str]:
        """Move production back to ``to`` (default: the latest other version it named that no rollback abandoned,
        see :func:`_abandoned`), recorded in the pointer log as a rollback; returns (from, to). A retrain run never
        moves production back to a version that was rolled back from."""
        self.settle_log(by)
        current = self.production()
        if current is None:
            raise ConfigError(f"{self.root_uri}: production names no version: nothing to roll back")
        if to is None:
            log = self.pointer_log()
            abandoned = _abandoned(log)
            earlier = [e["to"] for e in log if e["to"] != current and e["to"] not in abandoned]
            if not earlier:
                raise ConfigError(
                    f"{self.root_uri}: production never named a version before {current} that a rollback did not "
                    "abandon: nothing to roll back to (name one: --rollback vNNNN)"
                )
            to = earlier[-1]  # the latest other version production named
        if not self._is_complete(to):
            raise ConfigError(f"{to} is not a complete version under {self.root_uri} (complete: {self.versions()})")
        if to == current:
            raise ConfigError(f"production already names {to}")
        self.set_production(to, expected=current, kind="rollback", reason=reason or "rolled back by hand", by=by)
        return current, to

    def _moved(self, pointer: str, expected: str | None, current: str | None) -> str:
        if current == expected:  # the compare-and-swap lost to a swap still in flight (a fresh swap marker)
            return (
                f"{self._uri(pointer)} still names {current or 'nothing'}, but another writer is changing it right "
                f"now (its swap marker is beside it); left as it is. Re-run once that writer is done (a marker left "
                f"by a writer that died is reported as such after {SWAP_MARKER_STALE_S:.0f} s)"
            )
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


def _abandoned(log: list[dict[str, Any]]) -> set[str]:
    """The versions a rollback moved production off and that it has not named again since, from the pointer log
    (oldest first). A rollback abandons every version that served after its target's last time in production, up to
    the one rolled back from (all trained on from the target, whatever was wrong with the latest): a target that
    never served abandons the one rolled back from alone. A later move to an abandoned version (a re-promotion, a
    rollback to it) makes it served again."""
    abandoned: set[str] = set()
    last_named: dict[str, int] = {}
    for i, entry in enumerate(log):
        if entry["kind"] == "rollback":
            start = last_named.get(entry["to"])
            if start is not None:
                abandoned.update(e["to"] for e in log[start + 1 : i])
            if entry["from"] is not None:
                abandoned.add(entry["from"])
        abandoned.discard(entry["to"])
        last_named[entry["to"]] = i
    return abandoned
