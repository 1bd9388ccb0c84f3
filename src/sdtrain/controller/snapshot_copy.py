"""sdtrain's last-good copy of Ray Train's record of a run's checkpoints, and what the driver reads in the run directory
beside that record before Ray Train starts.

Ray Train rewrites its record (checkpoint_manager_snapshot.json) with ``open_output_stream``: on local or NFS storage
that truncates the file in place, so a controller or head node killed during the write leaves it empty or cut short,
with every checkpoint intact (S3 writes one object, whole or not at all). :class:`SnapshotCopy` keeps a copy, written
atomically from a record that parses after each report Ray Train processes; the driver restores the record from it
(:func:`restore_snapshot`) before Ray Train reads it.
"""

from __future__ import annotations

import json
import posixpath
import re
from typing import Any

import pyarrow.fs as pafs
from ray.train import UserCallback

from sdtrain.config.schema import Config
from sdtrain.logs import log
from sdtrain.private import ray as ray_private
from sdtrain.storage.filesystems import ray_storage, write_bytes

COPY_FILE = "sdtrain_checkpoint_record_copy.json"
"""In the run directory: sdtrain's copy of Ray Train's record of the run's checkpoints, as it last parsed."""
_CHECKPOINT_DIR = re.compile(r"checkpoint_(\d+)")


class SnapshotCopy(UserCallback):
    """Runs on the Ray Train controller. Its checkpoint manager is the first of Ray Train's report callbacks, so by
    ``after_report`` the record holds this report; every report (with or without a checkpoint) refreshes the copy,
    which also picks up the record's rewrites after checkpoint evaluations finish."""

    def __init__(self, filesystem: pafs.FileSystem | None, run_dir: str):
        # The driver's filesystem: it carries the S3 endpoint, which the controller's environment may lack.
        self.filesystem = filesystem or pafs.LocalFileSystem()
        self.run_dir = run_dir
        self._copied: bytes | None = None

    @classmethod
    def of(cls, config: Config) -> SnapshotCopy:
        """On the driver: the callback for the run directory (run.storage_path/run.name)."""
        return cls(*ray_storage(config.run.directory))

    def after_report(self, run_context, metrics, checkpoint) -> None:
        try:
            copied = write_copy(self.filesystem, self.run_dir, self._copied)
        except Exception as error:  # the copy is a fallback: failing to write it must not stop training
            log.warning("%s: not updated: %s", posixpath.join(self.run_dir, COPY_FILE), error)
            return
        self._copied = copied if copied is not None else self._copied


def write_copy(filesystem: pafs.FileSystem, run_dir: str, previous: bytes | None = None) -> bytes | None:
    """Copy the run's record to COPY_FILE if it parses and differs from ``previous``; returns what was copied."""
    data = _read(filesystem, posixpath.join(run_dir, ray_private.checkpoint_record_file()))
    if data is None or data == previous or _parsed(data) is None:
        return None
    _write(filesystem, posixpath.join(run_dir, COPY_FILE), data)
    return data


def restore_snapshot(filesystem: pafs.FileSystem, run_dir: str, entries: dict[str, pafs.FileType]) -> None:
    """On the driver, before Ray Train starts: a record that is there but does not parse (empty or cut short) is
    replaced by sdtrain's copy, if that parses and its latest checkpoint is in the run directory (``entries``: its
    listing), less the checkpoints it names that are gone. Otherwise the record is left for Ray Train's reading to
    refuse."""
    record = posixpath.join(run_dir, ray_private.checkpoint_record_file())
    data = _read(filesystem, record) if ray_private.checkpoint_record_file() in entries else None
    if data is None or _parsed(data) is not None:
        return
    copy = _read(filesystem, posixpath.join(run_dir, COPY_FILE)) if COPY_FILE in entries else None
    parsed = _parsed(copy) if copy is not None else None
    if copy is None or parsed is None:
        return
    latest = str((parsed.get("latest_checkpoint_result") or {}).get("checkpoint_dir_name"))
    gone = {name for name in _recorded(parsed) if name not in entries}
    if latest in gone:
        return
    if gone:  # pruned since the copy (an evaluation's result reorders the kept ones without a report): left out
        copy = json.dumps(_without(parsed, gone)).encode()
    _write(filesystem, record, copy)
    log.warning(
        "%s was empty or cut short (a write interrupted on local or NFS storage, where Ray Train rewrites it in "
        "place); restored it from sdtrain's copy %s, written after Ray Train's last processed report%s: the run "
        "resumes from %s",
        record,
        posixpath.join(run_dir, COPY_FILE),
        f", less the checkpoints deleted since ({', '.join(sorted(gone))})" if gone else "",
        f"step {checkpoint_step(latest)} ({latest})",
    )


def warn_unregistered(run_dir: str, entries: dict[str, pafs.FileType], recorded: set[str], step: int) -> list[str]:
    """Warn of checkpoint directories above the committed ``step`` that Ray Train's record does not hold: uploaded,
    then the run was killed before Ray Train registered them. Nothing prunes them; returns their names."""
    unregistered = sorted(
        name
        for name, kind in entries.items()
        if kind == pafs.FileType.Directory
        and name not in recorded
        and (found := checkpoint_step(name)) is not None
        and found > step
    )
    if unregistered:
        log.warning(
            "%s: checkpoint directories uploaded but never committed by Ray Train (the run was stopped before it "
            "registered them): %s (steps %s). The run resumes from the committed step %d; they are never pruned "
            "and can be deleted",
            run_dir,
            ", ".join(unregistered),
            ", ".join(str(checkpoint_step(name)) for name in unregistered),
            step,
        )
    return unregistered


def run_entries(filesystem: pafs.FileSystem, run_dir: str) -> dict[str, pafs.FileType]:
    """The run directory's entries (name -> type), one listing, not recursive; none for a run not started."""
    infos = filesystem.get_file_info(pafs.FileSelector(run_dir, allow_not_found=True))
    return {info.base_name: info.type for info in infos}


def checkpoint_step(name: str) -> int | None:
    """The step in a checkpoint directory's name (sdtrain.storage.run_layout.checkpoint_dir_name), else None."""
    match = _CHECKPOINT_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def _without(record: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """``record`` less its entries of checkpoints ``names``, with what Ray Train keeps beside each (its list's partner
    of the same length) and the names it lists."""
    kept = dict(record)
    for key, partner in _PAIRED:
        entries, partners = record.get(key), record.get(partner)
        if not isinstance(entries, list):
            continue
        keep = [not (isinstance(e, dict) and e.get("checkpoint_dir_name") in names) for e in entries]
        kept[key] = [e for e, k in zip(entries, keep, strict=True) if k]
        if isinstance(partners, list) and len(partners) == len(entries):
            kept[partner] = [p for p, k in zip(partners, keep, strict=True) if k]
    for key in ("validated_checkpoint_dir_names", "timed_out_validation_checkpoint_dir_names"):
        if isinstance(record.get(key), list):
            kept[key] = [name for name in record[key] if name not in names]
    return kept


_PAIRED = (
    ("checkpoint_results", "checkpoint_report_indices"),
    ("pending_training_results", "pending_validation_specs"),
)
"""Ray Train's record (its CheckpointManager's state): lists of checkpoints, each with a list it keeps in step."""


def _recorded(record: dict[str, Any]) -> set[str]:
    entries: list[Any] = [record.get("latest_checkpoint_result")]
    for key in ("checkpoint_results", "pending_training_results"):
        entries += record.get(key) or []
    return {str(entry.get("checkpoint_dir_name")) for entry in entries if isinstance(entry, dict)}


def _parsed(data: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(data)
    except ValueError:  # UnicodeDecodeError is one
        return None
    return record if isinstance(record, dict) else None


def _read(filesystem: pafs.FileSystem, path: str) -> bytes | None:
    try:
        with filesystem.open_input_stream(path) as f:
            return f.read()
    except FileNotFoundError:
        return None
    except OSError:  # pyarrow's S3 says a missing key with a plain OSError
        if filesystem.get_file_info(path).type == pafs.FileType.NotFound:
            return None
        raise


def _write(filesystem: pafs.FileSystem, path: str, data: bytes) -> None:
    if isinstance(filesystem, pafs.LocalFileSystem):
        write_bytes(path, data)  # a temporary name, then an atomic rename
        return
    # An object store makes the object visible only when the stream closes: whole or not at all. Not write_bytes'
    # S3 client: it takes the endpoint from this process's environment, which the controller may lack.
    with filesystem.open_output_stream(path) as f:
        f.write(data)
