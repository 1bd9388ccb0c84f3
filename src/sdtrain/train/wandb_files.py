"""What W&B's local run files hold: which steps a killed worker's W&B service wrote before it died.

W&B logs through a service process that writes each run's records to a transaction log
(``<save_dir>/wandb/<offline-run|run>-<time>-<id>/run-<id>.wandb``) and, online, uploads them. A worker
killed outright takes that process with it, and whatever it had not yet written is gone; a restarted
worker reads these files to log those steps again from the checkpoint's history (sdtrain.train.trackers).
"""

from __future__ import annotations

import glob
import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from sdtrain.private import wandb as wandb_private

STEP_KEY = "trainer/global_step"  # where Lightning's WandbLogger puts the trainer's step

# The log's layout: a 7-byte header (":W&B", a 2-byte magic, a version byte), then LevelDB's log format:
# 32 KiB blocks of records, each a 7-byte header (CRC-32 of type and data, little-endian length, type).
_HEADER = 7
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


@dataclass
class RunFile:
    """One W&B transaction log."""

    path: str
    """The ``.wandb`` file."""
    run_id: str = ""
    """The run's id from its run record ("" when the service died before writing it)."""
    history: list[dict[str, str]] = field(default_factory=list)
    """Its history rows in order: key (nested keys joined with /) -> value as JSON."""
    artifacts: list[str] = field(default_factory=list)
    """The names of the artifacts it logged."""

    def steps(self, key: str | None = None) -> list[int]:
        """The trainer steps of its history rows.

        Args:
            key: only rows that hold this key (None: all rows).
        """
        return [int(row[STEP_KEY]) for row in self.history if STEP_KEY in row and (key is None or key in row)]


def run_files(save_dir: str, run_id: str | None = None) -> list[RunFile]:
    """The W&B runs under ``save_dir`` (offline and online), oldest first.

    Args:
        save_dir: the directory W&B was given (it writes under its wandb/).
        run_id: only the files of this run (named by their directory), or all.
    """
    pattern = os.path.join(save_dir, "wandb", f"*run-*-{run_id or '*'}", "run-*.wandb")
    # Directory names start with the run's start time (YYYYMMDD_HHMMSS): sorted is oldest first.
    paths = sorted(glob.glob(pattern), key=lambda p: os.path.basename(os.path.dirname(p)).split("-", 2)[-1])
    return [read_run_file(path) for path in paths]


def read_run_file(path: str) -> RunFile:
    """Read one transaction log up to its last whole record (a killed writer leaves a torn tail).

    Args:
        path: the ``.wandb`` file.
    """
    from google.protobuf.message import DecodeError

    with open(path, "rb") as f:
        data = f.read()
    run = RunFile(path)
    for payload in _records(data):
        record = wandb_private.run_file_record()
        try:
            record.ParseFromString(payload)
        except DecodeError:
            break
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.run_id = record.run.run_id
        elif kind == "history":
            run.history.append({item.key or "/".join(item.nested_key): item.value_json for item in record.history.item})
        elif kind == "artifact":
            run.artifacts.append(record.artifact.name)
    return run


def _records(data: bytes) -> Iterator[bytes]:
    if data[:4] != b":W&B":
        return
    position, parts = _HEADER, b""
    while position + 7 <= len(data):
        left = _BLOCK - position % _BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        checksum, length, kind = struct.unpack("<IHB", data[position : position + 7])
        payload = data[position + 7 : position + 7 + length]
        if kind == 0 or len(payload) < length or zlib.crc32(payload, zlib.crc32(bytes([kind]))) != checksum:
            return  # zero padding, or a record the writer did not finish
        position += 7 + length
        parts += payload
        if kind in (_FULL, _LAST):
            yield parts
            parts = b""
