"""Retraining's gate: the new model and production scored alike (the held-out val_loss, and with eval each of its
metrics), the bar of the best version that served, and the promotion decision."""

from __future__ import annotations

import functools
import hashlib
import math
import os
from typing import Any

import ray
import torch

from sdtrain.artifacts.loading import LoadedModel, is_export, load_model
from sdtrain.artifacts.registry import ModelRegistry
from sdtrain.config.running import EVAL_METRICS, HIGHER_IS_BETTER
from sdtrain.config.schema import Config
from sdtrain.data.local_read import iter_local_batches
from sdtrain.data.parquet_files import resolve_parquet_files
from sdtrain.driver.data_check import dataset_spec
from sdtrain.driver.paths import with_absolute_paths
from sdtrain.errors import StorageUnavailable, find_sdtrain_error
from sdtrain.evaluation.measures import diverged_stand_in
from sdtrain.evaluation.results import measured_with
from sdtrain.logs import log
from sdtrain.model.conditioning import Conditioner
from sdtrain.model.token_captions import CaptionEncoder
from sdtrain.model.validation import validation_loss
from sdtrain.storage.filesystems import filesystem_for
from sdtrain.storage.s3 import S3Settings, apply_s3_settings, resolved_s3_settings
from sdtrain.storage.uris import absolute

EVAL_BATCH_SIZE = 32
GATE_TASK = "sdtrain-retrain-gate"
"""The name of the Ray task that scores a retraining's models (:func:`scores_in_task`)."""


def scores_in_task(config: Config, new: str, production: str | None) -> tuple[dict, dict]:
    """:func:`gate_scores` of the models at ``new`` (the run's final checkpoint) and ``production`` (its registry
    version; None: there is none yet), in a Ray task that loads both itself (:func:`gate_resources`: a GPU where
    training had them), not on the driver: a job's driver runs on the head node, CPU-only, where eval.num_samples
    samples of two UNets take hours and two large UNets its memory. Our error in the task (an SdtrainError, a
    StorageUnavailable) is raised here as itself, for the command line to report."""
    if not ray.is_initialized():  # a retry after training ended trains nothing, and so started no Ray
        ray.init()  # the job's cluster (RAY_ADDRESS), else a local one
    resources = gate_resources(config)
    paths = absolute(new), absolute(production) if production is not None else None
    # A worker or node lost (a spot node taken back) scores again from the start; an error raised is not retried.
    remote = ray.remote(_scores_here).options(name=GATE_TASK, max_retries=3, **resources)
    log.info(f"gate: scoring {' and '.join(p for p in paths if p)} in a Ray task with {resources}")
    try:
        new_scores, production_scores, where = ray.get(
            remote.remote(with_absolute_paths(config).to_dict(), *paths, resolved_s3_settings())
        )
    except ray.exceptions.RayTaskError as error:
        cause = getattr(error, "cause", None)
        ours = find_sdtrain_error(error) or (cause if isinstance(cause, StorageUnavailable) else None)
        if ours is None:
            raise
        raise ours from error
    log.info(f"gate: scored in Ray task {GATE_TASK} on node {where['node']} (pid {where['pid']})")
    return new_scores, production_scores


def gate_resources(config: Config) -> dict[str, float]:
    """The gate task's resources: eval.num_cpus, and eval.num_gpus, else one GPU when training used GPUs
    (scaling.use_gpu true, or auto on a cluster that has GPUs); on a CPU-only cluster, CPUs alone."""
    gpus = config.eval.num_gpus
    use_gpu = config.scaling.use_gpu
    if not gpus and (use_gpu is True or (use_gpu == "auto" and ray.cluster_resources().get("GPU", 0) > 0)):
        gpus = 1
    return {"num_cpus": config.eval.num_cpus, "num_gpus": gpus}


def _scores_here(
    config: dict[str, Any], new: str, production: str | None, s3: S3Settings
) -> tuple[dict, dict, dict[str, Any]]:
    """The gate task: both models loaded here, scored by :func:`gate_scores`; with where it ran."""
    apply_s3_settings(s3)  # the checkpoint, the registry and data.val may be on s3:// at the driver's endpoint
    loaded = load_model(new), load_model(production) if production is not None else None
    new_scores, production_scores = gate_scores(Config.from_dict(config), *loaded)
    return new_scores, production_scores, {"node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}


def gate_scores(config: Config, new: LoadedModel, production: LoadedModel | None) -> tuple[dict, dict]:
    """The gate's measures of the new model and of production (empty without one): the held-out val_loss, and with
    eval each of its metrics and eval_nonfinite_samples, both models sampled from the same data.val captions and
    seeds by one Evaluator (its reference statistics computed once).

    A model with a diverged sample has NaN for each eval metric (not :func:`metrics_of`'s stand-in, which ranks
    checkpoints but would be a bar anything passes; recorded as null). Production trained for another objective
    (:func:`objective`) has a NaN val_loss, not measured, and :data:`OTHER_OBJECTIVE` says how it differs."""
    from sdtrain.evaluation.checkpoint_eval import Evaluator

    models = [new] if production is None else [new, production]
    evaluator: Evaluator | None = None
    scores: list[dict[str, Any]] = []
    for model in models:
        differs = _objective_difference(production, new) if model is production else None
        if differs:  # its val_loss is the MSE against another target: no measure of the new model's
            score: dict[str, Any] = {"val_loss": math.nan, OTHER_OBJECTIVE: differs}
        else:  # data.val checked first
            score = {"val_loss": heldout_loss(config, model.unet, model.noise_scheduler)}
        if config.eval.enabled:
            evaluator = evaluator or Evaluator(config, None, _eval_vae(config))
            measured = evaluator.evaluate(model)
            diverged = measured[NONFINITE]
            score.update({key: math.nan if diverged else measured[key] for key in config.eval.metrics})
            score[NONFINITE] = diverged
        model.unet.to("cpu")  # one UNet on the GPU at a time: two SDXL UNets in float32 fill a 24 GB one
        scores.append(score)
    return scores[0], scores[1] if production is not None else {}


NONFINITE = "eval_nonfinite_samples"
OTHER_OBJECTIVE = "other_objective"
"""In production's scores (not the manifest): how its objective differs from the new model's, its val_loss NaN."""
OBJECTIVE_KEYS = (
    "prediction_type",
    "rescale_betas_zero_snr",
    "num_train_timesteps",
    "beta_schedule",
    "beta_start",
    "beta_end",
    "trained_betas",
)
"""What of a model's noise schedule defines its val_loss: the target (epsilon or v) and the noise at each of its
fixed timesteps (sdtrain.model.validation)."""


def objective(scheduler: Any) -> dict[str, Any]:
    """The training objective of a model's noise schedule (:data:`OBJECTIVE_KEYS`)."""
    return {key: scheduler.config.get(key) for key in OBJECTIVE_KEYS}


def _objective_difference(theirs: LoadedModel | None, new: LoadedModel) -> str | None:
    """How ``theirs`` was trained for another objective than ``new`` ("prediction_type='epsilon', the new model's
    'v_prediction'"), or None where the same."""
    if theirs is None:
        return None
    old, now = objective(theirs.noise_scheduler), objective(new.noise_scheduler)
    differ = [f"{key}={old[key]!r}, the new model's {now[key]!r}" for key in OBJECTIVE_KEYS if old[key] != now[key]]
    return " and ".join(differ) or None


def _eval_vae(config: Config) -> str | None:
    """The VAE evaluations decode with (sdtrain.evaluation.checks: eval.vae, else the one data.val records; None when
    no metric needs images)."""
    import pyarrow.parquet as pq

    from sdtrain.evaluation.checks import check_evaluation

    first = resolve_parquet_files(list(config.data.val), "data.val")[0]
    fs, path = filesystem_for(first)
    with fs.open_input_file(path) as f:
        schema = pq.read_schema(f)
    return check_evaluation(config, schema.metadata or {}, schema.names)


def gate_baseline(config: Config, registry: ModelRegistry, production: str | None) -> tuple[str | None, str | None]:
    """(the model the gate scores the new one against, its name in the reason): production's version; for a first
    version, model.pretrained, the model it was fine-tuned from (a first version no better than that must not serve
    either); None where there is neither, or model.pretrained is nothing load_model reads."""
    if production:
        return registry.location(production), production
    pretrained = config.model.pretrained
    if pretrained is None:
        return None, None
    if not is_export(absolute(pretrained)):
        # A hub id or a bare UNet directory: training takes it, load_model does not (an export, a registry version or
        # a saved pipeline: unet/ and scheduler/).
        log.warning(
            f"gate: model.pretrained={pretrained} holds no unet/config.json that the gate can load (an export, a "
            "registry version or a diffusers pipeline directory): this first version is promoted with no baseline "
            "to compare it to"
        )
        return None, None
    log.info(
        f"gate: no production model yet: model.pretrained={pretrained} is the baseline the first version must beat"
    )
    return absolute(pretrained), "model.pretrained"


_UNRECORDED = object()
HELDOUT_KEY = "heldout_data"
"""In a version's manifest: :func:`heldout_fingerprint` of data.val as its metrics were measured on it."""


def best_served(
    registry: ModelRegistry, config: Config, metric: str = "val_loss", heldout: dict[str, Any] | None = None
) -> tuple[tuple[str, float] | None, list[str]]:
    """(the version with the best ``metric`` among those production named and was not rolled back from, with that
    value; the versions left out because theirs was measured on another data.val or seed (or, for an eval metric,
    with other eval models or samples), or on data.val's files as they were before they changed in place (``heldout``:
    this run's :func:`heldout_fingerprint`), and why).

    The pointer log, not the manifests' ``promoted`` flag, says what served: a version decided for promotion may
    have been superseded, interrupted or rolled back, and must not be the bar."""
    scored, not_compared = [], []
    measured_on = measured_with(config, metric)
    for version in registry.served():
        manifest = registry.manifest(version)
        value = manifest["metrics"].get(metric)
        if value is None or diverged_stand_in(metric, value):  # an older manifest's stand-in of a diverged sample
            continue
        recorded = manifest.get("config", {})
        # A setting the version's config does not record predates the key: no difference can be shown.
        theirs = {key: recorded.get(key.split(".")[0], {}).get(key.split(".")[1], _UNRECORDED) for key in measured_on}
        differ = [
            f"{k}={theirs[k]!r}, this run's is {v!r}"
            for k, v in measured_on.items()
            if theirs[k] is not _UNRECORDED and theirs[k] != v
        ]
        data = manifest.get(HELDOUT_KEY)  # none: written before versions recorded it
        if heldout is not None and data is not None and data != heldout:
            differ.append(f"data.val's files as they were then ({_described(data)}), now {_described(heldout)}")
        if differ:
            not_compared.append(f"{version}'s {value:.5f} was measured with " + " and ".join(differ))
            continue
        scored.append((-value if metric in HIGHER_IS_BETTER else value, version))
    if not scored:
        return None, not_compared
    key, version = min(scored)
    return (version, -key if metric in HIGHER_IS_BETTER else key), not_compared


def heldout_fingerprint(config: Config, unet: Any) -> dict[str, Any]:
    """data.val as the gate reads it, for a version's manifest (:data:`HELDOUT_KEY`): its files and rows, and a
    digest of each file's path, size, version (ETag or mtime) and rows, from one listing and the run's dataset index
    (``unet``: the UNet config the data is checked against). Files refreshed, added or removed in place change it."""
    config = with_absolute_paths(config)  # as the gate's task reads it
    spec = dataset_spec(config, "data.val", config.data.val, unet)
    digest = hashlib.sha256((spec.content_digest or "\n".join(spec.files)).encode())
    digest.update(",".join(map(str, spec.rows_per_file)).encode())
    return {"files": len(spec.files), "rows": spec.num_rows, "digest": digest.hexdigest()[:16]}


def _described(fingerprint: dict[str, Any]) -> str:
    return f"{fingerprint.get('files')} files, {fingerprint.get('rows')} rows, digest {fingerprint.get('digest')}"


@functools.lru_cache(maxsize=1)
def _gate_encoder(source: str, device: str) -> CaptionEncoder:
    """The data's text encoder for token-id captions, loaded once for both models a gate scores."""
    return CaptionEncoder.load(source, use_gpu=False).to(device)


def heldout_loss(config: Config, unet, scheduler) -> float:
    """Validation loss on data.val at fixed timesteps and noise: comparable between any two models."""
    spec = dataset_spec(config, "data.val", config.data.val, unet.config)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batches = iter_local_batches(spec, config.data, EVAL_BATCH_SIZE)
    latent_scale = config.data.latent_scaling_factor or 1.0
    # Both models see the same float32 embeddings of token ids.
    encoder = _gate_encoder(spec.token_ids.text_encoder, device) if spec.token_ids is not None else None
    condition = Conditioner(unet.config, spec.vae_downsampling, encoder)
    return validation_loss(
        unet.to(device), scheduler, batches, seed=config.train.seed, latent_scale=latent_scale, condition=condition
    )


def gate_decision(
    config: Config, new_scores: dict[str, Any], production_scores: dict[str, Any], production: str | None, best
) -> tuple[bool, str]:
    """:func:`decide` on retrain.metric of :func:`gate_scores`' scores (``production``: the name of what
    ``production_scores`` measured; none: empty): a new model whose eval samples diverged is rejected saying so, and
    production's value is no bar where its samples diverged or (val_loss) it was trained for another objective."""
    metric = config.retrain.metric
    eval_metric = metric in EVAL_METRICS
    if eval_metric and new_scores.get(NONFINITE):
        return False, (
            f"the new model diverged: {new_scores[NONFINITE]:.0f} of its eval samples hold NaN or inf, so its {metric} "
            "is not measured"
        )
    why = None
    if eval_metric and production_scores.get(NONFINITE):
        why = f"is not measured ({production_scores[NONFINITE]:.0f} of its eval samples diverged)"
    elif metric == "val_loss" and OTHER_OBJECTIVE in production_scores:
        why = f"is not compared (trained for another objective: {production_scores[OTHER_OBJECTIVE]})"
        if best is not None and best[0] == production:  # the value it served with was measured so too
            why, best = why[:-1] + "; nor is the value it served with)", None
    production_value = production_scores.get(metric)
    return decide(new_scores[metric], production_value, production, best, config.retrain.tolerance, metric, why)


def decide(
    new_loss: float,
    production_loss: float | None,
    production: str | None,
    best: tuple[str, float] | None,
    tolerance: float,
    metric: str = "val_loss",
    not_a_bar: str | None = None,
) -> tuple[bool, str]:
    """Promote within ``tolerance`` of production and of the best model production ever named: a gate on
    production alone would let each promotion drift up to (1 + tolerance) worse than the last. ``production``: the
    name of what ``production_loss`` was measured on (a first version's: model.pretrained; None: nothing was).
    ``metric``: what the values are (clip_score and class_agreement are higher the better, the others lower).
    ``not_a_bar``: why ``production_loss`` is no measure to compare with (it is then left out, as a non-finite one
    is); an eval metric's stand-in for a diverged sample (:func:`diverged_stand_in`) is none either."""
    if diverged_stand_in(metric, new_loss):
        return False, f"the new model's {metric} is {new_loss:g}, the stand-in of a model whose samples diverged"
    if not math.isfinite(new_loss):
        return False, f"the new model's {metric} is {new_loss}: training diverged"
    if production_loss is not None and diverged_stand_in(metric, production_loss):
        not_a_bar = not_a_bar or f"is {production_loss:g}, the stand-in of a model whose samples diverged"
    unmeasured = ""
    if production_loss is not None and (not_a_bar or not math.isfinite(production_loss)):
        # No bar (every comparison with NaN fails): the value it was promoted with, if the best, stands in for it.
        why = not_a_bar or f"measured {production_loss} on this data"
        unmeasured = f"; {production}'s {metric} {why}: not a bar"
        production_loss, production = None, None
    gates: list[tuple[str | None, float]] = [] if production_loss is None else [(production, production_loss)]
    # Without a production value (no production, nor a baseline) the best that served still holds.
    best_gate = best if best is not None and best[0] != production else None
    if best_gate is not None:
        gates.append(best_gate)
    if not gates and unmeasured:
        return True, f"{metric} {new_loss:.5f}{unmeasured}, and no other model to compare with"
    if not gates:
        return True, f"first version ({metric} {new_loss:.5f}); there is no production model to compare with"
    higher = metric in HIGHER_IS_BETTER
    verdicts = []
    for name, loss in gates:
        if higher:
            limit = loss * (1 - tolerance)
            ok = new_loss >= limit
            verdicts.append((ok, f"{'>=' if ok else '<'} {name}'s {loss:.5f}"))
        else:
            limit = loss * (1 + tolerance)
            ok = new_loss <= limit
            verdicts.append((ok, f"{'<=' if ok else '>'} {name}'s {loss:.5f}"))
    sign = "-" if higher else "+"
    reason = f"{metric} {new_loss:.5f} " + " and ".join(v for _, v in verdicts) + f" x (1 {sign} {tolerance:g})"
    if best_gate is not None:
        reason += f" ({best_gate[0]} is the best that served)"
    return all(ok for ok, _ in verdicts), reason + unmeasured
