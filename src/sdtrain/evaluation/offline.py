"""An offline evaluation (entrypoints/evaluate.py, docs/evaluation.md): one or two models scored by the
:class:`~sdtrain.evaluation.checkpoint_eval.Evaluator` of training's evaluations, on a fixed set the user names, from
the same seeded noise for both:

- ``--captions DATA``: parquet rows as data.val holds them (latents, captions as embeddings or token ids, the caption
  text for clip_score), e.g. COCO-30k's images and captions through entrypoints/preprocess.py;
- ``--prompts FILE``: prompts in words, one a line, each model's own text encoder encoding them.

The Frechet distances compare the samples with a reference: DATA's own images (its latents decoded by the same VAE,
as in training), another parquet set's (``--reference DATA``), or the statistics an earlier call wrote
(``--reference DIR``, :func:`read_reference`). A set can be measured in parts (:func:`measure_part`: one part a Ray
task, one GPU each) whose measures add up to the whole set's, sample for sample.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from sdtrain.artifacts.loading import LoadedModel, Weights, load_model
from sdtrain.config.schema import Config
from sdtrain.errors import DataError
from sdtrain.evaluation.checkpoint_eval import CaptionsOf, Evaluator, text_encoder_of
from sdtrain.evaluation.eval_rows import EvalRows, ShapeGroup, read_eval_rows
from sdtrain.evaluation.image_metrics import FeatureStats
from sdtrain.evaluation.measures import Measures
from sdtrain.model.conditioning import Conditioning
from sdtrain.storage.filesystems import read_bytes, write_bytes

FRECHET = {"fd_dinov2": "dinov2", "fd_inception": "inception"}
"""The Frechet distances, and the eval key of each one's feature model."""
REFERENCE_INFO = "reference.json"
"""The file that makes a directory reference statistics (``--reference DIR``), beside one <metric>.npz each."""


@dataclass(frozen=True)
class OfflineSet:
    """What every part of an offline evaluation samples and measures, as plain data (a Ray task's argument)."""

    config: dict[str, Any]
    """The evaluation's Config as a dict: eval (the metrics' models, num_samples, batch_size), sample_grid (sampler,
    steps, guidance), train.seed, data's columns."""
    models: list[str]
    weights: Weights
    vae: str | None
    """What decodes samples (and the reference's latents); None when no metric needs images."""
    captions: str | None = None
    """Parquet rows (--captions); or prompts."""
    prompts: list[str] | None = None
    """Prompts in words (--prompts: the first eval.num_samples)."""
    prompts_file: str | None = None
    text_encoder: str | None = None
    """Encodes the prompts for every model (--text-encoder); None: each model's own."""
    latent_shape: tuple[int, int, int] | None = None
    """(C, H, W) prompts are sampled at: the first model's."""
    reference: str | None = None
    """Parquet rows whose images are the reference; None: the set's own (--captions) or statistics given."""
    reference_width: int | None = None
    """Values a row of the reference's caption column (read, not used)."""
    measure_reference: bool = True
    """Whether the parts measure the reference (False: its statistics were given)."""


@dataclass
class PartResult:
    """A part's measures: each model's, and the reference's (its share of the reference rows), as sums."""

    measures: list[Measures]
    reference: dict[str, FeatureStats] = field(default_factory=dict)

    def merged(self, other: PartResult) -> PartResult:
        from sdtrain.evaluation.measures import merged_stats

        return PartResult(
            [a.merged(b) for a, b in zip(self.measures, other.measures, strict=True)],
            {m: merged_stats(self.reference[m], other.reference[m]) for m in self.reference},
        )


def measure_part(task: OfflineSet, part: tuple[int, int], loaded: list[LoadedModel] | None = None) -> PartResult:
    """Part k of n = ``part`` of the set, sampled by each model and measured (the whole set: (0, 1)); its share of
    the reference rows measured too, unless the reference's statistics were given. Only the part's rows of the set
    and of the reference are read and held (a task of --tasks n: 1/n of each).

    Args:
        loaded: the models, if already loaded (in-process); else loaded here (a Ray task).
    """
    config = Config.from_dict(task.config)
    models = loaded or [load_model(model, task.weights) for model in task.models]
    evaluator = Evaluator(config, None, task.vae)
    rows = set_rows(task, config, models[0], part)
    captions_of = _prompt_captions(task, rows, evaluator.device) if task.prompts is not None else None
    result = PartResult([evaluator.measure(model, rows, part, captions_of) for model in models])
    if evaluator.features and task.measure_reference:
        reference = rows if task.reference is None else _reference_rows(task, config, models[0], part)
        result.reference = evaluator.reference_stats(reference, models[0], part)
    return result


def merge_parts(parts: list[PartResult]) -> PartResult:
    """The measures of the whole set from those of its parts."""
    merged = parts[0]
    for part in parts[1:]:
        merged = merged.merged(part)
    return merged


def set_rows(task: OfflineSet, config: Config, first: LoadedModel, part: tuple[int, int] = (0, 1)) -> EvalRows:
    """The set's rows: the first eval.num_samples of the parquet set (only those part k of n = ``part`` takes), or of
    the prompts (all: a few bytes each)."""
    if task.prompts is None:
        assert task.captions is not None and first.latent_shape is not None and first.caption_shape is not None
        shapes, pooled = (first.latent_shape, first.caption_shape), first.pooled_width
        return read_eval_rows(config, *shapes, [task.captions], "--captions", pooled_width=pooled, part=part)
    assert task.latent_shape is not None
    prompts = task.prompts[: config.eval.num_samples]
    return EvalRows(
        groups=[ShapeGroup(task.latent_shape, np.arange(len(prompts)), None)],
        captions=None,
        texts=prompts,
        labels=None,
        files=[task.prompts_file or ""],
        versions=[],
    )


def _reference_rows(task: OfflineSet, config: Config, first: LoadedModel, part: tuple[int, int]) -> EvalRows:
    """The rows of --reference DATA that part k of n = ``part`` measures."""
    assert task.reference is not None and task.reference_width is not None and first.latent_shape is not None
    width, source = (task.reference_width,), [task.reference]
    return read_eval_rows(config, first.latent_shape, width, source, "--reference", measured=False, part=part)


def _prompt_captions(task: OfflineSet, rows: EvalRows, device: str) -> CaptionsOf:
    """The prompts' embeddings by position, each model's from its text encoders (--text-encoder, else those it
    records; SDXL's two with their pooled embeddings), 64 prompts a batch."""
    from sdtrain.model.encoders import load_text_encoders

    assert rows.texts is not None
    texts = rows.texts
    loaded_encoders: dict[str, Any] = {}  # asked a chunk at a time (Evaluator.measure): loaded once, not per chunk

    def captions_of(loaded: LoadedModel, positions: np.ndarray) -> Conditioning:
        source = task.text_encoder or text_encoder_of(loaded)
        if source is None:  # the driver refuses this before any work
            raise DataError(f"--prompts: {loaded.source} records no text encoder; give --text-encoder")
        if source not in loaded_encoders:
            loaded_encoders.clear()  # one model's at a time
            loaded_encoders[source] = load_text_encoders(source, device)
        encoders = loaded_encoders[source]
        chosen = [texts[i] for i in positions]
        parts = [encoders.encode(chosen[i : i + 64]) for i in range(0, len(chosen), 64)]
        embeddings = torch.cat([hidden for hidden, _ in parts])
        if tuple(embeddings.shape[1:]) != tuple(loaded.caption_shape or embeddings.shape[1:]):
            raise DataError(
                f"--text-encoder: {source} gives prompt embeddings of shape {tuple(embeddings.shape[1:])}, but "
                f"{loaded.source} was trained on captions of shape {tuple(loaded.caption_shape or ())}"
            )
        pooled = [p for _, p in parts if p is not None]
        return Conditioning(embeddings, torch.cat(pooled) if pooled else None)

    return captions_of


def write_reference(directory: str, stats: dict[str, FeatureStats], info: dict[str, Any]) -> None:
    """Reference statistics, one ``<metric>.npz`` each (:meth:`FeatureStats.to_bytes`), and ``reference.json``: what
    they were computed from (``info``) and with which feature model each (``info["models"]``)."""
    for metric, reference in stats.items():
        write_bytes(posixpath.join(directory, f"{metric}.npz"), reference.to_bytes())
    write_bytes(posixpath.join(directory, REFERENCE_INFO), json.dumps(info, indent=2).encode())


def read_reference(directory: str, models: dict[str, str]) -> tuple[dict[str, FeatureStats], dict[str, Any]]:
    """The statistics :func:`write_reference` wrote to ``directory`` for each metric of ``models`` (metric -> the
    feature model it needs: eval.dinov2's, eval.inception's), with its info. Statistics of another feature model, or
    none for a metric, are refused naming both.

    Raises:
        DataError: naming --reference.
    """
    data = read_bytes(posixpath.join(directory, REFERENCE_INFO))
    if data is None:
        raise DataError(f"--reference: {directory} holds no {REFERENCE_INFO}")
    info = json.loads(data)
    stats = {}
    for metric, model in models.items():
        recorded = info.get("models", {}).get(metric)
        if recorded is None:
            raise DataError(f"--reference: {directory} holds no statistics for {metric} (it has {_names(info)})")
        if recorded != model:
            raise DataError(
                f"--reference: {directory}'s {metric} statistics are of the feature model {recorded}, not {model}"
            )
        raw = read_bytes(posixpath.join(directory, f"{metric}.npz"))
        if raw is None:
            raise DataError(f"--reference: {directory} lacks {metric}.npz, which its {REFERENCE_INFO} names")
        try:
            stats[metric] = FeatureStats.from_bytes(raw)
        except ValueError as error:
            raise DataError(f"--reference: {directory}/{metric}.npz: {error}") from None
    return stats, info


def _names(info: dict[str, Any]) -> str:
    return ", ".join(sorted(info.get("models", {}))) or "none"
