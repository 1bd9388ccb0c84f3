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
The retraining gate scores both of its models with the same :class:`Evaluator`, and so does the offline evaluation
(entrypoints/evaluate.py: :mod:`sdtrain.evaluation.offline`).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import torch

from sdtrain.artifacts.loading import LoadedModel, load_model
from sdtrain.config.schema import Config
from sdtrain.data.position import DataPosition
from sdtrain.errors import DataError
from sdtrain.evaluation.cpu_priority import cpu_policy
from sdtrain.evaluation.eval_rows import EvalRows, read_eval_rows
from sdtrain.evaluation.image_metrics import ClipScore, DinoFeatures, FeatureStats, InceptionFeatures
from sdtrain.evaluation.measures import Measures, metrics_of
from sdtrain.evaluation.results import measured_with, write_evaluation
from sdtrain.model.conditioning import Conditioning
from sdtrain.model.encoders import load_vae
from sdtrain.model.unet import default_guidance_rescale
from sdtrain.sampling.images import decode
from sdtrain.sampling.latent_classifier import load_latent_classifier
from sdtrain.sampling.sampler import initial_noise_pieces, sample_latents, shape_seed
from sdtrain.storage.filesystems import filesystem_for, write_bytes
from sdtrain.storage.run_layout import EVALUATION_DIR

CHUNK_BATCHES = 4
"""A shape group is sampled, decoded and measured this many eval.batch_size batches at a time: what an evaluation
holds (latents, images, caption embeddings) does not grow with eval.num_samples (the feature statistics are sums)."""

CaptionsOf = Callable[[LoadedModel, np.ndarray], torch.Tensor | Conditioning]
"""The caption embeddings (n, L, D) a model samples the rows at the given positions with."""


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
        loaded.trained_shapes("evaluation")  # an SdtrainError naming the model where it records none
        measures = self.measure(loaded, self._rows(loaded))
        metrics = metrics_of(self.config, measures, self._references(loaded))
        metrics["eval_s"] = time.perf_counter() - started
        return metrics

    def measure(
        self,
        loaded: LoadedModel,
        rows: EvalRows,
        part: tuple[int, int] = (0, 1),
        captions_of: CaptionsOf | None = None,
    ) -> Measures:
        """What ``loaded``'s samples of ``rows`` measure: of all of them, or of part k of n = ``part`` (that share of
        each shape group, each row sampled from the noise it has in the whole set: the parts' measures add up to the
        whole set's).

        Args:
            captions_of: the caption embeddings (n, L, D) of rows at the given positions; None: rows.captions (token
                ids encoded by the text encoder the model records).
        """
        captions_of = captions_of or self._captions_of(rows)
        unet = loaded.unet.to(self.device)
        measures = Measures(generated={metric: FeatureStats(f.dim) for metric, f in self.features.items()})
        dtype = next(unet.parameters()).dtype
        for group in rows.groups:  # each at its own shape: one group, or a bucket each
            taken, (first, total) = group.share(part)  # rows read for one part (read_eval_rows' part) give only it
            positions = group.rows[taken]
            if not len(positions):
                continue
            # Each row's noise is what it is in the whole set, drawn a chunk at a time.
            seed = shape_seed(self.config.train.seed, group.shape)  # each bucket's noise its own
            chunks = self._chunks(len(positions))
            sizes = [len(positions[chunk]) for chunk in chunks]
            pieces = initial_noise_pieces(group.shape, total, seed, first, sizes, dtype)
            for chunk, noise in zip(chunks, pieces, strict=True):
                captions = captions_of(loaded, positions[chunk])
                latents = self._sample(unet, loaded, captions, group.shape, noise)
                self._measure_samples(measures, loaded, latents, rows, positions[chunk])
        return measures

    def _chunks(self, count: int) -> list[slice]:
        size = CHUNK_BATCHES * self.config.eval.batch_size
        return [slice(start, start + size) for start in range(0, count, size)]

    def _measure_samples(
        self, measures: Measures, loaded: LoadedModel, latents: torch.Tensor, rows: EvalRows, positions: np.ndarray
    ) -> None:
        """Add the samples ``latents`` of the rows at ``positions`` to ``measures``: those that diverged (NaN or inf,
        which would decode to black images and be scored as such) counted, not measured."""
        measures.samples += len(positions)
        finite = torch.isfinite(latents).flatten(1).all(dim=1)
        if not bool(finite.all()):
            measures.nonfinite += int((~finite).sum())
            latents, positions = latents[finite], positions[finite.numpy()]
            if not len(positions):
                return
        if rows.labels is not None:
            reader = load_latent_classifier(loaded.latent_classifier or "", f"eval.class_agreement: {loaded.source}")
            measures.agreeing += int(reader.class_agreement(latents.numpy(), rows.labels[positions])["agreeing"])
        images = self._decode(latents, loaded) if self.vae is not None else None
        for metric, features in self.features.items():
            assert images is not None
            measures.generated[metric].add(features(images, self.config.eval.batch_size))
        if self.clip is not None:
            assert rows.texts is not None and images is not None
            texts = [rows.texts[i] for i in positions]
            scores = np.asarray(self.clip(images, texts, self.config.eval.batch_size))
            measures.clip_scores = np.concatenate([measures.clip_scores, scores])

    def _captions_of(self, rows: EvalRows) -> CaptionsOf:
        """rows.captions by position; token ids encoded, only the rows asked for, by each model's text encoder."""
        stored, pooled = rows.captions, rows.pooled
        assert stored is not None
        encoders: dict[str, Any] = {}

        def captions_of(loaded: LoadedModel, positions: np.ndarray) -> Conditioning:
            if stored.dtype != np.int32:
                # Only these rows copied (numpy's indexing copies them): never the whole set's embeddings.
                chosen = None if pooled is None else torch.from_numpy(pooled[positions]).float()
                return Conditioning(torch.from_numpy(stored[positions]).float(), chosen)
            if loaded.source not in encoders:
                encoders.clear()  # one model's at a time
                encoders[loaded.source] = self._text_encoder(loaded)
            return _encode(encoders[loaded.source], torch.from_numpy(stored[positions]))

        return captions_of

    def _sample(
        self,
        unet: Any,
        loaded: LoadedModel,
        captions: torch.Tensor | Conditioning,
        shape: tuple[int, int, int],
        noise: torch.Tensor,
    ) -> torch.Tensor:
        """Latents of ``captions`` at ``shape``: sample_grid's sampler, steps and guidance, from ``noise`` (the rows'
        of their shape group's :func:`sdtrain.sampling.sampler.initial_noise`)."""
        grid = self.config.sample_grid
        scheduler = dict(loaded.noise_scheduler.config)
        return sample_latents(
            unet,
            scheduler,
            captions.float() if isinstance(captions, torch.Tensor) else captions,
            loaded.unconditional_caption,
            shape,
            sampler=grid.sampler,
            steps=grid.steps,
            guidance_scale=grid.guidance_scale,
            guidance_rescale=default_guidance_rescale(scheduler),
            batch_size=self.config.eval.batch_size,
            vae_downsampling=loaded.vae_downsampling,
            noise=noise,
        )

    def _rows(self, loaded: LoadedModel) -> EvalRows:
        if self.rows is None:
            assert loaded.latent_shape is not None and loaded.caption_shape is not None
            self.rows = read_eval_rows(
                self.config, loaded.latent_shape, loaded.caption_shape, pooled_width=loaded.pooled_width
            )
        return self.rows

    def _text_encoder(self, loaded: LoadedModel) -> Any:
        from sdtrain.model.token_captions import CaptionEncoder

        source = text_encoder_of(loaded)
        if source is None:
            raise DataError(f"eval: data.val holds token ids, but {loaded.source} records no text encoder for them")
        return CaptionEncoder.load(source, use_gpu=False).to(self.device)

    def _decode(self, latents: torch.Tensor, loaded: LoadedModel) -> np.ndarray:
        """Model-space latents -> images, divided by the scaling factor the model was trained with (else the VAE's)."""
        assert self.vae is not None
        scale = loaded.latent_scaling_factor or float(self.vae.config.scaling_factor)
        return decode(self.vae, latents, scale, self.config.eval.batch_size)

    def _references(self, loaded: LoadedModel) -> dict[str, FeatureStats]:
        """data.val's images' statistics in each feature model's features: read from the run directory where an
        evaluation computed them for their key, else computed (the rows' stored latents in model space, decoded) and
        kept there."""
        assert self.rows is not None
        uris = {
            metric: posixpath.join(self.run_dir, EVALUATION_DIR, f"reference-{self.reference_key(metric)}.npz")
            for metric in self.features
            if self.run_dir
        }
        for metric, uri in uris.items():
            fs, path = filesystem_for(uri)
            if metric not in self.references and fs.get_file_info(path).type == pafs.FileType.File:
                with fs.open_input_stream(path) as f:
                    self.references[metric] = FeatureStats.from_bytes(f.read())
        missing = [metric for metric in self.features if metric not in self.references]
        if missing:
            for metric, stats in self.reference_stats(self.rows, loaded, metrics=missing).items():
                if metric in uris:
                    write_bytes(uris[metric], stats.to_bytes())
                self.references[metric] = stats
        return self.references

    def reference_stats(
        self, rows: EvalRows, loaded: LoadedModel, part: tuple[int, int] = (0, 1), metrics: list[str] | None = None
    ) -> dict[str, FeatureStats]:
        """The statistics of ``rows``' own images (their stored latents times data.latent_scaling_factor, decoded as
        ``loaded``'s samples are) in the features of ``metrics`` (None: every Frechet distance measured): of all the
        rows, or of part k of n = ``part``, as :meth:`measure` splits them."""
        metrics = list(self.features) if metrics is None else metrics
        stats = {metric: FeatureStats(self.features[metric].dim) for metric in metrics}
        for group in rows.groups:
            taken, _ = group.share(part)
            if taken.start == taken.stop:
                continue
            assert group.latents is not None
            latents = group.latents[taken]
            for chunk in self._chunks(len(latents)):  # a chunk's images at a time, as measure's
                stored = torch.from_numpy(latents[chunk].astype(np.float32))
                images = self._decode(stored * (self.config.data.latent_scaling_factor or 1.0), loaded)
                for metric in metrics:
                    stats[metric].add(self.features[metric](images, self.config.eval.batch_size))
        return stats

    def reference_key(self, metric: str) -> str:
        """What the reference statistics of ``metric`` depend on: the rows (their files' names, sizes and versions, and
        how many), the VAE, and the settings any value of the metric depends on (the column, the feature model, the
        latents' scaling: :func:`sdtrain.evaluation.results.measured_with`)."""
        assert self.rows is not None
        rows = [self.rows.files, self.rows.versions, len(self.rows)]
        what = [*rows, self.vae_source, measured_with(self.config, metric)]
        return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:12]


def text_encoder_of(loaded: LoadedModel) -> str | None:
    """The text encoder that made the captions ``loaded`` trained on, where it or its data records one."""
    from sdtrain.artifacts.export import model_sources

    if loaded.meta is not None and loaded.meta.text_encoder is not None:
        return loaded.meta.text_encoder  # token ids, encoded in the step
    sources = model_sources(loaded)
    return sources.text_encoder if sources is not None else None


def _encode(encoder: Any, ids: torch.Tensor) -> Conditioning:
    """Token ids -> caption embeddings, 64 rows at a time."""
    parts = [encoder.encode(ids[i : i + 64]) for i in range(0, len(ids), 64)]
    hidden = torch.cat([part[0].float().cpu() for part in parts])
    pooled_parts = [part[1].float().cpu() for part in parts if part[1] is not None]
    pooled = torch.cat(pooled_parts) if pooled_parts else None
    return Conditioning(hidden, pooled)


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
