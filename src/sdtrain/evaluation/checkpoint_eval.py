"""Image quality of a committed checkpoint, measured off the training ranks (docs/evaluation.md).

Ray Train runs :func:`evaluate_checkpoint` in a Ray task of its own (eval.num_cpus, eval.num_gpus; at the lowest CPU
priority: :mod:`sdtrain.evaluation.eval_task`) on a checkpoint it committed, while training goes on: it samples one
image for each of the first eval.num_samples rows of data.val (their captions, the same seeded noise every time,
sample_grid's sampler, steps and guidance), decodes them with the data's VAE and measures:

- ``fd_dinov2`` and ``fd_inception``: the Frechet distance between the DINOv2 (Inception) features of those images and
  of data.val's own images (the same rows' latents decoded by the same VAE: what the VAE can show, so the distance
  measures the UNet, not the VAE). Those reference statistics are computed once per run and kept in the run
  directory; restarts reuse them;
- ``clip_score``: the mean CLIP score of each image against its caption's text (data.val's eval.text_column);
- ``class_agreement``: the share of samples the model's latent classifier reads as their caption's label (a module
  the training data names: :mod:`sdtrain.sampling.latent_classifier`; nothing is decoded).

Each result is written to ``<run dir>/evaluation/step_<N>.json`` (an error too), where rank 0 and the driver read it
into metrics.csv, the trackers and the live files at the checkpoint's step (:mod:`sdtrain.train.evaluations`).
The retraining gate scores both of its models with the same :class:`Evaluator`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import posixpath
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import torch

from sdtrain.artifacts.loading import LoadedModel, load_model
from sdtrain.config.schema import Config
from sdtrain.data.footer import read_schema
from sdtrain.data.listing import list_dataset
from sdtrain.data.metadata import bucket_shapes
from sdtrain.data.position import DataPosition
from sdtrain.data.rows import RowReader
from sdtrain.errors import DataError
from sdtrain.evaluation.cpu_priority import cpu_policy
from sdtrain.evaluation.image_metrics import ClipScore, DinoFeatures, FeatureStats, InceptionFeatures, frechet_distance
from sdtrain.evaluation.results import measured_with, write_evaluation
from sdtrain.model.encoders import load_vae
from sdtrain.sampling.images import decode
from sdtrain.sampling.latent_classifier import load_latent_classifier
from sdtrain.sampling.sampler import sample_latents
from sdtrain.storage.filesystems import filesystem_for, write_bytes
from sdtrain.storage.run_layout import EVALUATION_DIR


@dataclass
class ShapeGroup:
    """The rows of data.val's first eval.num_samples of one latent shape (an aspect-ratio bucket)."""

    shape: tuple[int, int, int]
    """(C, H, W) of their latents: what they are sampled at."""
    rows: np.ndarray
    """Their positions among the rows (EvalRows.captions, .texts, .labels), ascending."""
    latents: np.ndarray
    """(n, C, H, W) as stored."""


@dataclass
class EvalRows:
    """The first eval.num_samples rows of data.val: what every evaluation of a run samples and compares against."""

    groups: list[ShapeGroup]
    """The rows by latent shape: one group for data of one shape; a bucket each for aspect-ratio buckets (each sample
    is generated at its row's bucket and compared with the images of the same rows)."""
    captions: np.ndarray
    """(N, L, D) embeddings, or (N, L) token ids."""
    texts: list[str] | None
    """eval.text_column's captions, when it is measured (clip_score)."""
    labels: np.ndarray | None
    """data.val's label column, for class_agreement."""
    files: list[str]
    """The files the rows came from (part of the reference statistics' key)."""
    versions: list[tuple[int, str]]
    """Their (size, version) as listed (the S3 ETag, or the local mtime in ns): a file rewritten in place changes it."""

    def __len__(self) -> int:
        return len(self.captions)


def read_eval_rows(config: Config, latent_shape: tuple[int, ...], caption_shape: tuple[int, ...]) -> EvalRows:
    """The first eval.num_samples rows of data.val in file order (fewer if it holds fewer): their columns only, and
    no more of a file than they need. Bucketed files are read at each row's bucket (the buckets their footer names).

    Args:
        latent_shape: (C, H, W) of a row's latents (of data of one shape).
        caption_shape: (L, D) of a caption embedding; a column of token ids holds (L,) a row.
    """
    extra = ([config.eval.text_column] if config.eval.clip is not None else []) + (
        ["label"] if config.eval.class_agreement else []
    )
    listing = list_dataset(list(config.data.val), "data.val")
    buckets = bucket_shapes(read_schema(listing.paths[0], "data.val").metadata, listing.paths[0])
    reader = RowReader(config.data.columns, tuple(latent_shape), tuple(caption_shape), extra=tuple(extra))
    reader = dataclasses.replace(reader, bucket_shapes=buckets)
    # Batch by batch, only as many rows as are wanted: a data.val file may hold gigabytes of caption embeddings.
    batches = list(reader.batches(listing.paths, "eval: data.val", batch_size=1024, limit=config.eval.num_samples))
    read = {batch.file for batch in batches}
    used = [i for i, file in enumerate(listing.paths) if file in read]

    def extra_column(name: str) -> pa.ChunkedArray:
        return pa.chunked_array([chunk for batch in batches for chunk in batch.extra[name].chunks])

    return EvalRows(
        groups=_by_shape([batch.latents for batch in batches if batch.latents is not None]),
        captions=np.concatenate([batch.captions for batch in batches]),
        texts=[str(t) for t in extra_column(config.eval.text_column).to_pylist()] if config.eval.clip else None,
        labels=extra_column("label").to_numpy() if config.eval.class_agreement else None,
        files=[listing.paths[i] for i in used],
        versions=[(listing.sizes[i], listing.versions[i]) for i in used],
    )


def _by_shape(latents: list[np.ndarray]) -> list[ShapeGroup]:
    """Batches of rows in order, each of one shape, as groups of one shape in the order their shapes first came."""
    positions: dict[tuple[int, int, int], list[np.ndarray]] = {}
    parts: dict[tuple[int, int, int], list[np.ndarray]] = {}
    first = 0
    for batch in latents:
        shape = (int(batch.shape[1]), int(batch.shape[2]), int(batch.shape[3]))
        positions.setdefault(shape, []).append(np.arange(first, first + len(batch)))
        parts.setdefault(shape, []).append(batch)
        first += len(batch)
    return [ShapeGroup(shape, np.concatenate(positions[shape]), np.concatenate(parts[shape])) for shape in parts]


class Evaluator:
    """The models and rows every evaluation of a run shares, loaded once: the VAE, the feature and CLIP models, the
    rows of data.val and the reference statistics.

    Args:
        config: the run's config (eval, data.val, sample_grid's sampler).
        run_dir: where the reference statistics are kept (None: computed, not kept: the retraining gate's).
        vae: the VAE that decodes latents (eval.vae, or the one data.val records: the driver resolves it); None when
            no metric needs images.
    """

    def __init__(self, config: Config, run_dir: str | None, vae: str | None):
        self.config = config
        self.run_dir = run_dir
        self.vae_source = vae
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.vae = load_vae(vae, self.device) if vae is not None else None
        self.features: dict[str, DinoFeatures | InceptionFeatures] = {}
        """The feature models, by the Frechet distance each measures."""
        if config.eval.dinov2:
            self.features["fd_dinov2"] = DinoFeatures(config.eval.dinov2, self.device)
        if config.eval.inception:
            self.features["fd_inception"] = InceptionFeatures(config.eval.inception, self.device)
        self.clip = ClipScore(config.eval.clip, self.device) if config.eval.clip else None
        self.rows: EvalRows | None = None
        self.references: dict[str, FeatureStats] = {}

    def evaluate(self, model: str | LoadedModel) -> dict[str, float]:
        """The metrics of the model at ``model`` (a checkpoint, export or registry version; or one loaded): eval_s
        and eval_samples with them."""
        started = time.perf_counter()
        loaded = load_model(model) if isinstance(model, str) else model
        assert loaded.latent_shape is not None and loaded.caption_shape is not None
        rows = self._rows(loaded)
        captions = torch.tensor(rows.captions)  # a copy: arrow's buffers are read-only
        if captions.dtype == torch.int32:
            captions = self._encode(loaded, captions)
        unet = loaded.unet.to(self.device)
        generated = {metric: FeatureStats(features.dim) for metric, features in self.features.items()}
        scores: list[np.ndarray] = []
        agreeing = 0
        for group in rows.groups:  # each at its own shape: one group, or a bucket each
            latents = self._sample(unet, loaded, captions[torch.from_numpy(group.rows)], group.shape)
            if rows.labels is not None:
                reader = load_latent_classifier(
                    loaded.latent_classifier or "", f"eval.class_agreement: {loaded.source}"
                )
                agreeing += int(reader.class_agreement(latents.numpy(), rows.labels[group.rows])["agreeing"])
            images = self._decode(latents, loaded) if self.vae is not None else None
            for metric, features in self.features.items():
                assert images is not None
                generated[metric].add(features(images, self.config.eval.batch_size))
            if self.clip is not None:
                assert rows.texts is not None and images is not None
                texts = [rows.texts[i] for i in group.rows]
                scores.append(np.asarray(self.clip(images, texts, self.config.eval.batch_size)))
        metrics: dict[str, float] = {}
        if rows.labels is not None:
            metrics["class_agreement"] = agreeing / len(rows)
        for metric in self.features:
            metrics[metric] = frechet_distance(generated[metric], self._reference(metric, loaded))
        if self.clip is not None:
            metrics["clip_score"] = float(np.mean(np.concatenate(scores)))
        metrics["eval_samples"] = float(len(rows))
        metrics["eval_s"] = time.perf_counter() - started
        return metrics

    def _sample(
        self, unet: Any, loaded: LoadedModel, captions: torch.Tensor, shape: tuple[int, int, int]
    ) -> torch.Tensor:
        """Latents of ``captions`` at ``shape``: sample_grid's sampler, steps and guidance, the run's seed."""
        grid = self.config.sample_grid
        return sample_latents(
            unet,
            loaded.noise_scheduler.config,
            captions.float(),
            loaded.unconditional_caption,
            shape,
            sampler=grid.sampler,
            steps=grid.steps,
            guidance_scale=grid.guidance_scale,
            seed=self.config.train.seed,
            batch_size=self.config.eval.batch_size,
        )

    def _rows(self, loaded: LoadedModel) -> EvalRows:
        if self.rows is None:
            assert loaded.latent_shape is not None and loaded.caption_shape is not None
            self.rows = read_eval_rows(self.config, loaded.latent_shape, loaded.caption_shape)
        return self.rows

    def _encode(self, loaded: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
        from sdtrain.model.token_captions import CaptionEncoder

        source = loaded.meta.text_encoder if loaded.meta is not None else None
        if source is None:
            raise DataError(f"eval: data.val holds token ids, but {loaded.source} records no text encoder for them")
        encoder = CaptionEncoder.load(source, use_gpu=False).to(self.device)
        return torch.cat([encoder(ids[i : i + 64]).float().cpu() for i in range(0, len(ids), 64)])

    def _decode(self, latents: torch.Tensor, loaded: LoadedModel) -> np.ndarray:
        """Model-space latents -> images, divided by the scaling factor the model was trained with (else the VAE's)."""
        assert self.vae is not None
        scale = loaded.latent_scaling_factor or float(self.vae.config.scaling_factor)
        return decode(self.vae, latents, scale, self.config.eval.batch_size)

    def _reference(self, metric: str, loaded: LoadedModel) -> FeatureStats:
        """data.val's images' statistics in ``metric``'s features: read from the run directory if an evaluation
        computed them for this key, else computed (the rows' stored latents in model space, decoded) and kept there."""
        if metric in self.references:
            return self.references[metric]
        assert self.rows is not None
        features = self.features[metric]
        name = f"reference-{self.reference_key(metric)}.npz"
        uri = posixpath.join(self.run_dir, EVALUATION_DIR, name) if self.run_dir else None
        if uri is not None:
            fs, path = filesystem_for(uri)
            if fs.get_file_info(path).type == pafs.FileType.File:
                with fs.open_input_stream(path) as f:
                    self.references[metric] = FeatureStats.from_bytes(f.read())
                return self.references[metric]
        reference = FeatureStats(features.dim)
        for group in self.rows.groups:
            stored = torch.from_numpy(group.latents.astype(np.float32))
            images = self._decode(stored * (self.config.data.latent_scaling_factor or 1.0), loaded)
            reference.add(features(images, self.config.eval.batch_size))
        if uri is not None:
            write_bytes(uri, reference.to_bytes())
        self.references[metric] = reference
        return reference

    def reference_key(self, metric: str) -> str:
        """What the reference statistics of ``metric`` depend on: the rows (their files' names, sizes and versions, and
        how many), the VAE, and the settings any value of the metric depends on (the column, the feature model, the
        latents' scaling: :func:`sdtrain.evaluation.results.measured_with`)."""
        assert self.rows is not None
        rows = [self.rows.files, self.rows.versions, len(self.rows)]
        what = [*rows, self.vae_source, measured_with(self.config, metric)]
        return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:12]


def evaluate_checkpoint(checkpoint: Any, config: dict[str, Any], run_dir: str, vae: str | None) -> dict[str, float]:
    """The metrics of one committed checkpoint (Ray Train's evaluation task calls it through
    :func:`sdtrain.evaluation.eval_task.evaluate_in_task`), also written to ``<run dir>/evaluation/step_<N>.json`` with
    the CPU priority it ran at; an error is written there too, then raised (Ray Train records the evaluation as failed;
    training goes on).

    Args:
        checkpoint: the ray.train.Checkpoint Ray Train committed.
        config: the run's config as a dict (the task's arguments must be JSON).
        run_dir: run.storage_path/run.name.
        vae: the VAE that decodes latents (None when no metric needs images).
    """
    from sdtrain.storage.filesystems import uri_for

    uri = uri_for(checkpoint.filesystem, checkpoint.path)
    step = _checkpoint_step(uri)
    started = time.time()
    # A new Evaluator each time: no models stay in an idle process on a training node between evaluations (Ray ends a
    # GPU task's process after each call anyway).
    try:
        metrics = Evaluator(Config.from_dict(config), run_dir, vae).evaluate(uri)
    except Exception as error:
        write_evaluation(run_dir, step, {"step": step, "error": f"{type(error).__name__}: {error}", "time": started})
        raise
    write_evaluation(run_dir, step, {"step": step, **metrics, "time": started, "cpu_policy": cpu_policy()})
    return metrics


def _checkpoint_step(uri: str) -> int:
    fs, path = filesystem_for(uri)
    return DataPosition.read(fs, path).step
