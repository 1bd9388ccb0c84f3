"""The scores Ray Train ranks a run's checkpoints by (checkpoint.score_attribute): the copy of a report's metrics it
gets (:func:`scored_metrics`), and the worst score that stands for one not known yet or not finite."""

from __future__ import annotations

import math
import sys

from sdtrain.config.running import EVAL_METRICS, HIGHER_IS_BETTER


def scored_metrics(metrics: dict[str, float], attribute: str | None) -> dict[str, float]:
    """``metrics`` as a checkpoint reports them to Ray Train, which ranks it by ``attribute``
    (checkpoint.score_attribute): a score not known yet, or not finite, is the worst one (:func:`worst_score`), so
    such a checkpoint is pruned first, once it is no longer the latest. Not known yet: an eval metric, until the
    checkpoint's evaluation reports it (Ray Train keeps a checkpoint whose evaluation is pending); val_loss, at a
    checkpoint off the validation schedule (a reclaim notice's). Not finite: loss is NaN for a report window whose
    steps all were, and val_loss is as the model computed it. Ray Train itself would rank a missing score the best: it
    scores it -inf, which mode min negates. Only this copy changes: the run's history keeps the real value."""
    if attribute is None:
        return metrics
    if attribute in metrics:
        if _finite(metrics[attribute]):
            return metrics
    elif attribute not in EVAL_METRICS and attribute != "val_loss":
        return metrics
    return {**metrics, attribute: worst_score(attribute)}


def worst_score(attribute: str) -> float:
    """The worst score of checkpoint.score_attribute ``attribute`` in Ray Train's ordering (the driver orders the
    HIGHER_IS_BETTER metrics max, the others min). The largest finite float, not infinity: Ray Train's snapshot of its
    checkpoints is JSON, which writes infinity and NaN as null, and the next controller of the run (a retry, the
    command re-run) failed on null at its first checkpoint."""
    return -UNSCORED if attribute in HIGHER_IS_BETTER else UNSCORED


UNSCORED = sys.float_info.max
"""The score of a checkpoint whose score is not known yet, as a loss (lower is better); negated for a higher-is-better
metric."""

SCORE_ATTRIBUTES = ("loss", "val_loss", *EVAL_METRICS)
"""Every metric checkpoint.score_attribute may name (sdtrain.config.running.CheckpointConfig)."""


def finite_scores(metrics: dict[str, float]) -> dict[str, float]:
    """An evaluation's ``metrics`` as Ray Train merges them into its checkpoint's: each score (a metric
    checkpoint.score_attribute may name) that is not a finite number becomes the worst one (:func:`worst_score`), as
    :func:`scored_metrics` does for a report, so Ray Train's record never holds a null. Only this copy changes: the
    evaluation's file keeps the real value, and the run's rows take theirs from it."""
    bad = {key: worst_score(key) for key in SCORE_ATTRIBUTES if key in metrics and not _finite(metrics[key])}
    return {**metrics, **bad} if bad else metrics


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
