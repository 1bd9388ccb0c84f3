"""An evaluation's result file, ``<run dir>/evaluation/step_<N>.json`` (its metrics, or its error): written by the
evaluation task (:mod:`sdtrain.evaluation.checkpoint_eval`), read by rank 0 and the driver. Light on purpose: the
training workers import it, and nothing here loads a model."""

from __future__ import annotations

import json
import posixpath
from typing import Any

from sdtrain.storage.filesystems import read_bytes, write_bytes
from sdtrain.storage.run_layout import EVALUATION_DIR, evaluation_file


def write_evaluation(run_dir: str, step: int, result: dict[str, Any]) -> None:
    write_bytes(posixpath.join(run_dir, EVALUATION_DIR, evaluation_file(step)), json.dumps(result).encode())


def read_evaluation(run_dir: str, step: int) -> dict[str, Any] | None:
    """The result of the evaluation of ``step``'s checkpoint, or None while there is none."""
    data = read_bytes(posixpath.join(run_dir, EVALUATION_DIR, evaluation_file(step)))
    return json.loads(data) if data is not None else None
