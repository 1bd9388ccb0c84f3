"""W&B's private names that sdtrain relies on: the protobuf of its local run files (its transaction log), read to
know which steps a killed worker's W&B service wrote before it died (sdtrain.train.wandb_files). Imported only when
called; wandb is pinned exactly (pyproject.toml), and ``tests/test_private_apis.py`` names it when it moves."""

from __future__ import annotations

from typing import Any

from sdtrain.private._lookup import private

NAMES = {("wandb.proto.wandb_internal_pb2", "Record"): "one record of a W&B run file (history rows, artifacts)"}
"""(module, name) -> what it serves."""


def run_file_record() -> Any:
    """A new, empty record of W&B's run file format, to parse one into."""
    return private("wandb.proto.wandb_internal_pb2", "Record", "wandb", NAMES[next(iter(NAMES))])()
