"""Retraining's gate: the new model and production scored alike (the held-out val_loss, and with eval each of its
metrics), the bar of the best version that served, and the promotion decision."""

from __future__ import annotations

import functools
import math

import torch

from sdtrain.artifacts.loading import LoadedModel
from sdtrain.artifacts.registry import ModelRegistry
from sdtrain.config.running import HIGHER_IS_BETTER
from sdtrain.config.schema import Config
from sdtrain.data.local_read import iter_local_batches
from sdtrain.data.parquet_files import resolve_parquet_files
from sdtrain.driver.data_check import dataset_spec
from sdtrain.evaluation.results import measured_with
from sdtrain.model.conditioning import Conditioner
from sdtrain.model.token_captions import CaptionEncoder
from sdtrain.model.validation import validation_loss
from sdtrain.storage.filesystems import filesystem_for

EVAL_BATCH_SIZE = 32


def gate_scores(config: Config, new: LoadedModel, production: LoadedModel | None) -> tuple[dict, dict]:
    """The gate's measures of the new model and of production (empty without one): the held-out val_loss, and with
    eval each of its metrics, both models sampled from the same data.val captions and seeds by one Evaluator (its
    reference statistics computed once)."""
    models = [new] if production is None else [new, production]
    scores: list[dict[str, float]] = [{"val_loss": heldout_loss(config, m.unet, m.noise_scheduler)} for m in models]
    if config.eval.enabled:
        from sdtrain.evaluation.checkpoint_eval import Evaluator

        evaluator = Evaluator(config, None, _eval_vae(config))
        for model, score in zip(models, scores, strict=True):
            measured = evaluator.evaluate(model)
            score.update({key: measured[key] for key in config.eval.metrics})
    return scores[0], scores[1] if production is not None else {}


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


_UNRECORDED = object()


def best_served(
    registry: ModelRegistry, config: Config, metric: str = "val_loss"
) -> tuple[tuple[str, float] | None, list[str]]:
    """(the version with the best ``metric`` among those production named and was not rolled back from, with that
    value; the versions left out because theirs was measured on another data.val or seed (or, for an eval metric,
    with other eval models or samples), and why).

    The pointer log, not the manifests' ``promoted`` flag, says what served: a version decided for promotion may
    have been superseded, interrupted or rolled back, and must not be the bar."""
    scored, not_compared = [], []
    measured_on = measured_with(config, metric)
    for version in registry.served():
        manifest = registry.manifest(version)
        value = manifest["metrics"].get(metric)
        if value is None:
            continue
        recorded = manifest.get("config", {})
        # A setting the version's config does not record predates the key: no difference can be shown.
        theirs = {key: recorded.get(key.split(".")[0], {}).get(key.split(".")[1], _UNRECORDED) for key in measured_on}
        differ = [
            f"{k}={theirs[k]!r}, this run's is {v!r}"
            for k, v in measured_on.items()
            if theirs[k] is not _UNRECORDED and theirs[k] != v
        ]
        if differ:
            not_compared.append(f"{version}'s {value:.5f} was measured with " + " and ".join(differ))
            continue
        scored.append((-value if metric in HIGHER_IS_BETTER else value, version))
    if not scored:
        return None, not_compared
    key, version = min(scored)
    return (version, -key if metric in HIGHER_IS_BETTER else key), not_compared


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


def decide(
    new_loss: float,
    production_loss: float | None,
    production: str | None,
    best: tuple[str, float] | None,
    tolerance: float,
    metric: str = "val_loss",
) -> tuple[bool, str]:
    """Promote within ``tolerance`` of production and of the best model production ever named: a gate on
    production alone would let each promotion drift up to (1 + tolerance) worse than the last. ``metric``: what the
    values are (clip_score and class_agreement are higher the better, the others lower)."""
    if not math.isfinite(new_loss):
        return False, f"the new model's {metric} is {new_loss}: training diverged"
    if production_loss is None:
        return True, f"first version ({metric} {new_loss:.5f}); there is no production model to compare with"
    gates = [(production, production_loss)]
    if best is not None and best[0] != production:
        gates.append(best)
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
    if len(gates) > 1:
        reason += f" ({gates[1][0]} is the best that served)"
    return all(ok for ok, _ in verdicts), reason
