"""What a model's samples measure before they become metrics, as sums: the measures of disjoint parts of a set add up
to those of the whole set, so a set can be split among tasks (an offline evaluation's Ray tasks, one GPU each) and
scored as one (pure logic: no model is loaded here).

The metrics themselves are :func:`metrics_of` these sums and the reference statistics, for the evaluation in training
(:class:`sdtrain.evaluation.checkpoint_eval.Evaluator`) and the offline one alike.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import numpy as np

from sdtrain.config.running import EVAL_METRICS, HIGHER_IS_BETTER
from sdtrain.config.schema import Config
from sdtrain.evaluation.image_metrics import FeatureStats, frechet_distance


def part_range(count: int, part: tuple[int, int]) -> tuple[int, int]:
    """The rows [first, stop) of ``count`` that part k of n = ``part`` takes: n consecutive shares as near equal as
    can be, together each row once."""
    k, n = part
    if not 0 <= k < n:
        raise ValueError(f"part {k} of {n}: expected 0 <= part < parts")
    return count * k // n, count * (k + 1) // n


@dataclass
class Measures:
    """One model's samples of some rows, measured: what its metrics are computed from."""

    samples: int = 0
    generated: dict[str, FeatureStats] = field(default_factory=dict)
    """The samples' feature statistics, by the Frechet distance each is for (fd_dinov2, fd_inception)."""
    clip_scores: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Each sample's CLIP score against its caption, in the order sampled."""
    agreeing: int = 0
    """Samples the latent classifier reads as their caption's label."""
    nonfinite: int = 0
    """Samples whose latents hold NaN or inf (the sampling diverged): counted, not measured."""

    def merged(self, other: Measures) -> Measures:
        """The measures of both parts' rows (disjoint)."""
        if set(self.generated) != set(other.generated):
            raise ValueError(f"Measures: cannot merge features {sorted(self.generated)} and {sorted(other.generated)}")
        return Measures(
            samples=self.samples + other.samples,
            generated={m: merged_stats(self.generated[m], other.generated[m]) for m in self.generated},
            clip_scores=np.concatenate([self.clip_scores, other.clip_scores]),
            agreeing=self.agreeing + other.agreeing,
            nonfinite=self.nonfinite + other.nonfinite,
        )


def merged_stats(a: FeatureStats, b: FeatureStats) -> FeatureStats:
    """The statistics of both sets of features (new; ``a`` and ``b`` are left as they are)."""
    out = FeatureStats.from_bytes(a.to_bytes())
    out.merge(b)
    return out


def metrics_of(config: Config, measures: Measures, references: dict[str, FeatureStats]) -> dict[str, float]:
    """The metrics config.eval asks for, from a model's measures and the reference statistics of each Frechet
    distance; with eval_samples, the number of samples they came from.

    Args:
        config: eval says which metrics.
        measures: the model's samples, measured.
        references: the reference's statistics, by metric (every Frechet distance measured).
    """
    asked = [
        *(["class_agreement"] if config.eval.class_agreement else []),
        *measures.generated,
        *(["clip_score"] if config.eval.clip is not None else []),
    ]
    if measures.nonfinite:
        # A diverged sample has no image to score (decoded, NaN became a black picture that scored as one): a model
        # that diverges on any row is worse than every model that does not, whatever its other rows score (with every
        # row diverged, none is measured). A stand-in ranks checkpoints, and is no measure to compare models with
        # (diverged_stand_in; the retraining gate's NaN).
        metrics = {metric: WORST_LOW if metric in HIGHER_IS_BETTER else WORST_HIGH for metric in asked}
    else:
        metrics = {metric: _metric(metric, measures, references) for metric in asked}
    metrics["eval_samples"] = float(measures.samples)
    metrics["eval_nonfinite_samples"] = float(measures.nonfinite)
    return metrics


def _metric(metric: str, measures: Measures, references: dict[str, FeatureStats]) -> float:
    if metric == "class_agreement":
        return measures.agreeing / measures.samples
    if metric == "clip_score":
        return float(np.mean(measures.clip_scores))
    return frechet_distance(measures.generated[metric], references[metric])


WORST_HIGH = sys.float_info.max
"""A lower-is-better metric (a Frechet distance) of a model with a diverged sample: the largest finite float (JSON
writes infinity as a non-standard token; Ray Train's checkpoint ranking ranks an unknown score the same)."""
WORST_LOW = 0.0
"""A higher-is-better metric (clip_score, class_agreement) of a model with a diverged sample: its lowest value."""


def diverged_stand_in(metric: str, value: float) -> bool:
    """Whether ``value`` is :func:`metrics_of`'s stand-in for ``metric`` of a model with a diverged sample
    (:data:`WORST_HIGH`, :data:`WORST_LOW`): no measure of the model, so no bar either. A manifest written before the
    retraining gate recorded such a value as null may hold it; a val_loss is never one."""
    return metric in EVAL_METRICS and value == (WORST_LOW if metric in HIGHER_IS_BETTER else WORST_HIGH)
