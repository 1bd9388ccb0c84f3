"""Rank 0's side of checkpoint evaluation (:mod:`sdtrain.evaluation.checkpoint_eval` runs it, in a Ray task of its
own): which checkpoints to have evaluated, and the finished evaluations' metrics into the run's rows.

At most one evaluation is in flight: a checkpoint due while one still runs is skipped (counted in
``evaluations_skipped``), never queued, so a slow evaluation cannot pile up work behind training; only the final
checkpoint's waits behind the one in flight. An evaluation is in flight until its result file appears or
eval.timeout_s has passed: Ray Train then cancels it with force, so it writes nothing, and rank 0 writes its result
(:data:`NO_RESULT`) and marks its row ``eval_failed``. After a restart, an evaluation asked for and without a result
is awaited but not in flight (it may have been killed with the group, or have timed out while no group ran): the
checkpoints due are evaluated, and its result goes into its row if it still comes, else it is recorded failed the same
way once eval.timeout_s has passed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from sdtrain.config.schema import Config
from sdtrain.evaluation.results import (
    awaited_results,
    awaits,
    merge_results,
    read_evaluation,
    record_no_result,
)
from sdtrain.logs import log


class CheckpointEvaluations:
    """Which checkpoints rank 0 asks Ray Train to evaluate, and their results as they come.

    Args:
        config: the run's config (eval, checkpoint.every_n_steps).
        run_dir: run.storage_path/run.name, where results are written.
        clock: seconds, monotonic (tests may pass their own).
    """

    def __init__(self, config: Config, run_dir: str, clock: Callable[[], float] = time.monotonic):
        self.every = config.eval.every_n_checkpoints * config.checkpoint.every_n_steps
        self.timeout_s = config.eval.timeout_s
        self.run_dir = run_dir
        self.clock = clock
        self.pending: tuple[int, float] | None = None
        """(step, when its task started at the latest) of the evaluation in flight: when it was asked for; for the
        final one, asked behind another, when that one's timeout ends."""
        self.awaited: dict[int, float] = {}
        """Evaluations asked for that are not in flight, by step: when to record them failed if no result came."""
        self.skipped = 0

    def started(self, history: list[dict[str, float]]) -> list[tuple[int, dict[str, Any]]]:
        """A worker group starts from the checkpoint whose rows are ``history``: results written since (while no
        group ran, or after that checkpoint) go into their rows; an evaluation asked for and without a result is
        awaited, not in flight: its task may have been killed with the group, or timed out while none ran. Returns
        the results added: (step, result)."""
        self.skipped = int(history[-1].get("evaluations_skipped", 0)) if history else 0
        added = merge_results(history, awaited_results(self.run_dir, history))
        # One still running (Ray Train's controller outlives a worker group) has ended by then, by its timeout.
        deadline = self.clock() + self.timeout_s
        self.awaited = {int(row["step"]): deadline for row in history if awaits(row)}
        return added

    def due(self, step: int, final: bool) -> bool:
        """Whether the checkpoint of ``step`` is to be evaluated: every eval.every_n_checkpoints-th, skipped if one is
        in flight; the final one always (Ray Train runs it after the one in flight, before the run ends)."""
        if not (final or step % self.every == 0):
            return False
        if self.pending is not None and not final:
            self.skipped += 1
            log.info(
                "evaluation of step %d still running: the checkpoint of step %d is not evaluated", self.pending[0], step
            )
            return False
        start = self.clock()
        if self.pending is not None:  # the final one queues behind it, which is still awaited
            self.awaited[self.pending[0]] = self.pending[1] + self.timeout_s
            start = max(start, self.pending[1] + self.timeout_s)
        self.pending = (step, start)
        return True

    def collect(self, history: list[dict[str, float]]) -> list[tuple[int, dict[str, Any]]]:
        """The results of the evaluations awaited that have come, merged into their rows of ``history``, and the
        record of those past eval.timeout_s without one: (step, result)."""
        awaited = dict(self.awaited)
        if self.pending is not None:
            awaited[self.pending[0]] = self.pending[1] + self.timeout_s
        results = {}
        for step, deadline in awaited.items():
            result = read_evaluation(self.run_dir, step)
            if result is None and self.clock() > deadline:
                log.warning("evaluation of step %d: no result within eval.timeout_s=%s s", step, self.timeout_s)
                result = record_no_result(self.run_dir, step, f"none came within eval.timeout_s={self.timeout_s:g} s")
            if result is not None:
                results[step] = result
                self.awaited.pop(step, None)
                if self.pending is not None and self.pending[0] == step:
                    self.pending = None
        return merge_results(history, results)
