"""Checkpoint evaluation (eval): a tiny UNet's checkpoint evaluated on real photographs (scikit-learn's) encoded by a
tiny VAE, with tiny DINOv2 and CLIP models built from configs; rank 0's choice of what to evaluate; the checks before
Ray. The evaluation beside a real Ray run is in tests/test_train_ray.py."""

import json
import math
import os
import sys

import lightning.pytorch as pl
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray.train
import torch
from conftest import tiny_config
from support.log_lines import LogLines
from support.tiny_models import write_tiny_clip, write_tiny_dinov2, write_tiny_inception, write_tiny_sd_model

from sdtrain.artifacts.checkpoint_format import CheckpointMeta
from sdtrain.config.loader import load_config
from sdtrain.data.metadata import LATENT_CLASSIFIER, LATENT_SCALING_FACTOR, VAE_SOURCE
from sdtrain.data.position import DataPosition
from sdtrain.data.read_order import DataState
from sdtrain.errors import ConfigError, DataError
from sdtrain.evaluation.checkpoint_eval import Evaluator, evaluate_checkpoint
from sdtrain.evaluation.checks import check_evaluation
from sdtrain.evaluation.eval_rows import read_eval_rows
from sdtrain.evaluation.image_metrics import DinoFeatures, FeatureStats, InceptionFeatures, frechet_distance
from sdtrain.evaluation.results import (
    NO_RESULT,
    awaited_results,
    final_results,
    merge_results,
    read_evaluation,
    write_evaluation,
)
from sdtrain.evaluation.scores import scored_metrics
from sdtrain.model.encoders import encode_images, encode_prompts, load_text_encoder, load_vae
from sdtrain.model.unet import build_unet, noise_scheduler_config, unet_config
from sdtrain.sampling.images import decode
from sdtrain.storage.run_layout import DATA_STATE_FILE, EVALUATION_DIR
from sdtrain.train.evaluations import CheckpointEvaluations
from sdtrain.train.module import DiffusionModule

ROWS = 12
TEXTS = ["a pagoda by a lake", "a pink flower", "temple roof", "petals in the sun"]


def _photo_crops(count: int, size: int = 32) -> np.ndarray:
    """Real photographs: ``count`` crops of scikit-learn's china.jpg and flower.jpg, resized to ``size``."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images
    rng = np.random.default_rng(0)
    crops = []
    for i in range(count):
        photo = photos[i % 2]
        y, x = rng.integers(0, photo.shape[0] - 128), rng.integers(0, photo.shape[1] - 128)
        crops.append(np.asarray(Image.fromarray(photo[y : y + 128, x : x + 128]).resize((size, size))))
    return np.stack(crops)


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """data.val as preprocessing would write it (photographs through a tiny VAE, captions through a tiny text
    encoder, the texts kept), the tiny DINOv2 and CLIP models, and a checkpoint of the tiny UNet trained on those rows
    for 2 steps, in a run directory."""
    root = tmp_path_factory.mktemp("evaluation")
    sd = write_tiny_sd_model(str(root / "sd"), caption_dim=32, vae_blocks=2)
    vae = load_vae(sd)
    latents = encode_images(vae, _photo_crops(ROWS), "mean").numpy().astype(np.float16)
    tokenizer, text_encoder = load_text_encoder(sd)
    texts = [TEXTS[i % len(TEXTS)] for i in range(ROWS)]
    captions = encode_prompts(tokenizer, text_encoder, texts).numpy().astype(np.float16)
    table = pa.table(
        {
            "image_latents_256": pa.array(list(latents.reshape(ROWS, -1))),
            "caption_latents": pa.array(list(captions.reshape(ROWS, -1))),
            "caption": texts,
        }
    ).replace_schema_metadata({VAE_SOURCE: sd, LATENT_SCALING_FACTOR: str(vae.config.scaling_factor)})
    (root / "val").mkdir()
    pq.write_table(table, root / "val" / "part-0.parquet")

    model = load_config(None, ["model.preset=tiny", "data.train=[x]"]).model
    meta = CheckpointMeta("test", unet_config(model), noise_scheduler_config(model), (4, 16, 16), (77, 32))
    torch.manual_seed(0)
    module = DiffusionModule(
        build_unet(model), meta.noise_scheduler_config, tiny_config("data.train=[x]", steps=2).train, meta
    )
    batches = [{"latents": torch.from_numpy(latents[:6]).float(), "captions": torch.from_numpy(captions[:6]).float()}]
    trainer = pl.Trainer(
        max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches * 2, batch_size=None))
    run_dir = root / "runs" / "r"
    checkpoint = run_dir / "checkpoint_000000002"
    trainer.save_checkpoint(checkpoint / "checkpoint.ckpt", weights_only=False)
    (checkpoint / DATA_STATE_FILE).write_text(json.dumps(DataPosition(2, DataState()).to_dict()))
    config = tiny_config(
        f"data.val=[{root / 'val'}]",
        f"data.train=[{root / 'val'}]",
        f"eval.dinov2={write_tiny_dinov2(str(root / 'dinov2'))}",
        f"eval.clip={write_tiny_clip(str(root / 'clip'))}",
        f"eval.inception={write_tiny_inception(str(root / 'inception.pt'))}",
        "eval.num_samples=8",
        "eval.batch_size=4",
        "sample_grid.steps=2",
        tmp_path=root,
        name="r",
    )
    return {"root": root, "sd": sd, "config": config, "run_dir": str(run_dir), "checkpoint": checkpoint, "vae": vae}


def test_a_checkpoint_is_evaluated_against_reference_statistics_kept_in_the_run(evaluated):
    config, run_dir = evaluated["config"], evaluated["run_dir"]
    metadata = pq.read_schema(evaluated["root"] / "val" / "part-0.parquet").metadata
    vae = check_evaluation(config, metadata, ["image_latents_256", "caption_latents", "caption"])
    assert vae == evaluated["sd"]  # the VAE data.val records
    checkpoint = ray.train.Checkpoint.from_directory(str(evaluated["checkpoint"]))
    metrics = evaluate_checkpoint(checkpoint, config.to_dict(), run_dir, vae)
    assert metrics["eval_samples"] == 8 and metrics["eval_s"] > 0
    assert np.isfinite(metrics["fd_dinov2"]) and metrics["fd_dinov2"] > 0
    assert np.isfinite(metrics["fd_inception"]) and metrics["fd_inception"] > 0
    assert 0 <= metrics["clip_score"] <= 100
    written = read_evaluation(run_dir, 2)
    assert written is not None and {k: written[k] for k in metrics} == metrics and written["step"] == 2
    assert written["cpu_policy"] == "normal"  # called here, not in the evaluation task (tests/test_train_ray.py)

    # A restart's evaluator (a new process) reads the references back instead of computing them: the same numbers.
    references = [n for n in os.listdir(os.path.join(run_dir, EVALUATION_DIR)) if n.startswith("reference-")]
    mtimes = {n: os.stat(os.path.join(run_dir, EVALUATION_DIR, n)).st_mtime_ns for n in references}
    evaluator = Evaluator(config, run_dir, vae)
    again = evaluator.evaluate(str(evaluated["checkpoint"]))
    assert {n: os.stat(os.path.join(run_dir, EVALUATION_DIR, n)).st_mtime_ns for n in references} == mtimes
    for metric in ("fd_dinov2", "fd_inception", "clip_score"):
        assert again[metric] == pytest.approx(metrics[metric], rel=1e-6), metric

    # The references: data.val's first 8 rows' own images (their stored latents decoded by the same VAE) in each
    # feature model's features, computed once and kept in the run directory.
    keys = {metric: evaluator.reference_key(metric) for metric in ("fd_dinov2", "fd_inception")}
    assert (
        sorted(references) == sorted(f"reference-{key}.npz" for key in keys.values()) and len(set(keys.values())) == 2
    )
    kept = {}
    for metric, key in keys.items():
        with open(os.path.join(run_dir, EVALUATION_DIR, f"reference-{key}.npz"), "rb") as f:
            kept[metric] = FeatureStats.from_bytes(f.read())
    table = pq.read_table(evaluated["root"] / "val" / "part-0.parquet")
    stored = np.stack(table.column("image_latents_256").to_numpy(zero_copy_only=False)[:8]).reshape(8, 4, 16, 16)
    images = decode(
        evaluated["vae"], torch.from_numpy(stored.astype(np.float32)), evaluated["vae"].config.scaling_factor
    )
    for metric, features in (
        ("fd_dinov2", DinoFeatures(config.eval.dinov2)),
        ("fd_inception", InceptionFeatures(config.eval.inception)),
    ):
        direct = FeatureStats(features.dim)
        direct.add(features(images))
        assert kept[metric].count == 8 and np.allclose(kept[metric].mean, direct.mean, atol=1e-5), metric
        assert frechet_distance(kept[metric], direct) < 1e-6, metric


def test_the_reference_key_changes_with_the_files_content_and_the_latent_column(evaluated, tmp_path):
    """A data.val rewritten in place, or read through another data.latent_column, used to reuse the reference
    statistics of other images: the Frechet distance was then measured against them."""
    table = pq.read_table(evaluated["root"] / "val" / "part-0.parquet")
    flipped = pa.array(table.column("image_latents_256").to_pylist()[::-1], table.column("image_latents_256").type)
    table = table.append_column("other_latents", flipped)
    (tmp_path / "val").mkdir()
    file = tmp_path / "val" / "part-0.parquet"
    pq.write_table(table, file)
    os.utime(file, ns=(1_700_000_000_000_000_000,) * 2)

    def key(*overrides):
        config = tiny_config(
            f"data.train=[{tmp_path / 'val'}]",
            f"data.val=[{tmp_path / 'val'}]",
            f"eval.dinov2={evaluated['config'].eval.dinov2}",
            "eval.num_samples=8",
            *overrides,
        )
        evaluator = Evaluator(config, None, evaluated["sd"])
        evaluator.rows = read_eval_rows(config, (4, 16, 16), (77, 32))
        return evaluator.reference_key("fd_dinov2")

    first = key()
    assert key() == first  # what a restart reads back
    assert key("data.latent_column=other_latents") != first
    # The same file name and size, other rows: as a job that rewrites data.val in place leaves it.
    pq.write_table(table.set_column(0, "image_latents_256", flipped), file)
    os.utime(file, ns=(1_700_000_100_000_000_000,) * 2)
    assert key() != first


def test_an_evaluation_that_fails_writes_its_error_and_rank_0_records_it(evaluated, tmp_path, caplog):
    broken = tmp_path / "checkpoint_000000004"
    broken.mkdir()
    (broken / "checkpoint.ckpt").write_bytes(b"not a checkpoint")
    (broken / DATA_STATE_FILE).write_text(json.dumps(DataPosition(4, DataState()).to_dict()))
    run_dir = str(tmp_path / "run")
    with pytest.raises(Exception):  # noqa: B017  # whatever torch raises on a corrupt file; Ray Train records it
        evaluate_checkpoint(
            ray.train.Checkpoint.from_directory(str(broken)), evaluated["config"].to_dict(), run_dir, evaluated["sd"]
        )
    result = read_evaluation(run_dir, 4)
    assert result is not None and result["step"] == 4 and "error" in result
    history = [{"step": 2.0, "loss": 1.0}, {"step": 4.0, "loss": 0.9, "evaluation_asked": 1.0}]
    with caplog.at_level("WARNING", logger="sdtrain"):
        assert merge_results(history, awaited_results(run_dir, history)) == [(4, {"eval_failed": 1.0})]
    assert history[1]["eval_failed"] == 1.0 and "evaluation of the checkpoint of step 4 failed" in caplog.text
    assert awaited_results(run_dir, history) == {} and merge_results(history, {4: result}) == []  # once


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_rank_0_keeps_one_evaluation_in_flight_and_skips_checkpoints_due_meanwhile(tmp_path):
    config = tiny_config(
        "data.train=[t]",
        "data.val=[v]",
        "eval.dinov2=d",
        "checkpoint.every_n_steps=10",
        "eval.every_n_checkpoints=2",
        "eval.timeout_s=60",
    )
    run_dir = str(tmp_path / "run")
    clock = Clock()
    evaluations = CheckpointEvaluations(config, run_dir, clock)
    history: list[dict] = []
    assert evaluations.started(history) == [] and evaluations.pending is None
    assert not evaluations.due(10, final=False)  # every 2nd checkpoint: steps 20, 40, ...
    assert evaluations.due(20, final=False) and evaluations.pending == (20, 0.0)
    history.append({"step": 20.0, "evaluation_asked": 1.0})
    assert not evaluations.due(40, final=False) and evaluations.skipped == 1  # 20's still runs: 40 is skipped
    assert evaluations.collect(history) == []
    write_evaluation(run_dir, 20, {"step": 20, "fd_dinov2": 3.5, "eval_s": 7.0, "time": 0})
    assert evaluations.collect(history) == [(20, {"fd_dinov2": 3.5, "eval_s": 7.0})]
    assert history[0]["fd_dinov2"] == 3.5 and evaluations.pending is None
    # The final checkpoint is always asked for, behind one in flight (its task starts when that one's timeout ends,
    # at the latest); one that never answers stops blocking after eval.timeout_s, recorded failed.
    assert evaluations.due(60, final=False) and evaluations.pending == (60, 0.0)
    history.append({"step": 60.0, "evaluation_asked": 1.0})
    assert evaluations.due(65, final=True) and evaluations.skipped == 1 and evaluations.pending == (65, 60.0)
    history.append({"step": 65.0, "evaluation_asked": 1.0})
    clock.now = 61.0
    assert evaluations.collect(history) == [(60, {"eval_failed": 1.0})] and evaluations.pending == (65, 60.0)

    # A restart from the checkpoint of step 65: results written meanwhile for rows without them are merged (60's
    # record of no result too); none is in flight.
    write_evaluation(run_dir, 65, {"step": 65, "fd_dinov2": 2.0, "eval_s": 5.0, "time": 0})
    resumed = [
        {"step": 20.0, "evaluation_asked": 1.0},
        {"step": 60.0, "evaluation_asked": 1.0},
        {"step": 65.0, "evaluation_asked": 1.0, "evaluations_skipped": 1},
    ]
    again = CheckpointEvaluations(config, run_dir, clock)
    assert again.started(resumed) == [
        (20, {"fd_dinov2": 3.5, "eval_s": 7.0}),
        (60, {"eval_failed": 1.0}),
        (65, {"fd_dinov2": 2.0, "eval_s": 5.0}),
    ]
    assert again.skipped == 1 and again.pending is None and again.awaited == {}


def test_an_evaluation_that_never_answers_is_recorded_failed_and_blocks_nothing_after_a_restart(tmp_path):
    """Ray Train cancels an evaluation past eval.timeout_s with force (no result file), and a killed task writes none
    either: such a row used to stay asked for good, and every restart took it for in flight and skipped every
    checkpoint due for up to eval.timeout_s (ranked last under checkpoint.score_attribute: fd_*)."""
    config = tiny_config(
        "data.train=[t]", "data.val=[v]", "eval.dinov2=d", "checkpoint.every_n_steps=10", "eval.timeout_s=60"
    )
    run_dir = str(tmp_path / "run")
    clock = Clock()
    evaluations = CheckpointEvaluations(config, run_dir, clock)
    evaluations.started([])
    assert evaluations.due(10, final=False)
    history: list[dict] = [{"step": 10.0, "evaluation_asked": 1.0}]
    clock.now = 61.0  # cancelled by Ray Train: no result file
    assert evaluations.collect(history) == [(10, {"eval_failed": 1.0})] and evaluations.pending is None
    recorded = read_evaluation(run_dir, 10)
    assert recorded is not None and recorded["step"] == 10
    assert recorded["error"].startswith(f"{NO_RESULT}; none came within eval.timeout_s=60 s"), recorded
    assert history[0]["eval_failed"] == 1.0

    # A group that restarts from the checkpoint of step 20, whose evaluation was killed with the group before it
    # wrote anything (or timed out while no group ran): the next checkpoint due is evaluated, none is skipped.
    resumed = [{"step": 10.0, "evaluation_asked": 1.0}, {"step": 20.0, "evaluation_asked": 1.0}]
    again = CheckpointEvaluations(config, run_dir, clock)
    assert again.started(resumed) == [(10, {"eval_failed": 1.0})] and again.pending is None
    assert again.due(30, final=False) and again.skipped == 0 and again.pending == (30, 61.0)
    resumed.append({"step": 30.0, "evaluation_asked": 1.0})
    # 20's result, should it still come (an evaluation that ran on through the restart), goes into its row...
    write_evaluation(run_dir, 30, {"step": 30, "fd_dinov2": 4.0, "eval_s": 3.0, "time": 0})
    assert again.collect(resumed) == [(30, {"fd_dinov2": 4.0, "eval_s": 3.0})]
    # ...and once no evaluation of it can still run, it is recorded failed, saying why.
    clock.now = 122.0
    assert again.collect(resumed) == [(20, {"eval_failed": 1.0})]
    assert read_evaluation(run_dir, 20)["error"].startswith(NO_RESULT)  # type: ignore[index]
    assert again.collect(resumed) == []  # once

    # At the end of a run (Ray Train has waited for every evaluation), a row still without a result gets this record.
    final = [{"step": 40.0, "evaluation_asked": 1.0}]
    assert merge_results(final, final_results(run_dir, final)) == [(40, {"eval_failed": 1.0})]
    assert read_evaluation(run_dir, 40)["error"].startswith(NO_RESULT)  # type: ignore[index]


def test_a_score_not_known_yet_ranks_last_in_ray_trains_own_checkpoint_manager(tmp_path):
    """Ray Train's checkpoint manager (the one its controller runs, driven here without a cluster) with
    checkpoint.num_to_keep=1: a checkpoint reported before its score is known (a reclaim notice's, off the validation
    schedule; one awaiting its evaluation) is pruned once it is no longer the latest, and the best one is kept."""
    import asyncio

    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
    from ray.train.v2._internal.execution.context import StorageContext
    from ray.train.v2._internal.execution.training_report import _TrainingReport

    from sdtrain.driver.ray_configs import ray_run_config

    worst = sys.float_info.max  # finite: Ray Train's snapshot is JSON, which has no infinity
    assert scored_metrics({"loss": 1.0}, "fd_dinov2") == {"loss": 1.0, "fd_dinov2": worst}
    assert scored_metrics({"loss": 1.0}, "clip_score") == {"loss": 1.0, "clip_score": -worst}
    assert scored_metrics({"loss": 1.0}, "class_agreement")["class_agreement"] == -worst
    assert scored_metrics({"loss": 1.0, "val_loss": 0.2}, "val_loss")["val_loss"] == 0.2
    assert scored_metrics({"loss": 1.0}, "loss") == scored_metrics({"loss": 1.0}, None) == {"loss": 1.0}

    def kept(attribute, reports, restarted_after=None):
        config = tiny_config(
            "data.train=/unused",
            "data.val=/unused",
            f"checkpoint.score_attribute={attribute}",
            "checkpoint.num_to_keep=1",
            "eval.clip=/unused",
        )
        run = f"{attribute}-{len(reports)}-{restarted_after}"
        storage = StorageContext(storage_path=str(tmp_path), experiment_dir_name=run)
        manager = CheckpointManager(ray_run_config(config).checkpoint_config, storage)

        async def report():
            nonlocal manager
            for step, metrics in reports:
                if step == restarted_after:  # a new controller (a retry, the run re-run) loads Ray's snapshot
                    manager = CheckpointManager(ray_run_config(config).checkpoint_config, storage)
                directory = tmp_path / run / f"checkpoint_{step}"
                directory.mkdir(parents=True)
                scored = scored_metrics({"step": step, "loss": 0.5, **metrics}, attribute)
                manager.register_checkpoint(_TrainingReport(ray.train.Checkpoint(str(directory)), scored, False))
                await asyncio.sleep(0)  # the manager prunes in a task of its own

        asyncio.run(report())
        return sorted(int(p.name.split("_")[1]) for p in (tmp_path / run).glob("checkpoint_[0-9]*"))

    # A reclaim notice at step 1500 checkpoints off the validation schedule (every 1000 steps here).
    val = [(1000, {"val_loss": 0.5}), (1500, {}), (2000, {"val_loss": 0.3}), (3000, {"val_loss": 0.4})]
    assert kept("val_loss", val) == [2000, 3000]  # the best and the latest; 1500 ranked last
    # Resumed by a new controller after the notice's checkpoint: its unknown score survives Ray Train's snapshot.
    assert kept("val_loss", val, restarted_after=2000) == [2000, 3000]
    assert kept("val_loss", val[:2]) == [1000, 1500]  # the latest is kept whatever its score
    # Evaluated checkpoints' scores come later (Ray Train's validation); at their report they rank last.
    assert kept("clip_score", [(1000, {}), (2000, {})]) == [2000]


def test_a_score_that_is_not_finite_is_reported_to_ray_train_as_the_worst():
    """Loss is NaN for a report window whose steps all were, and val_loss is as computed: Ray Train's snapshot wrote
    such a score null, and the next controller failed on it. Ray Train gets the worst finite score instead (mode min:
    the largest float; max: its negation); the row the run keeps has the real value."""
    worst = sys.float_info.max
    for value in (float("nan"), float("inf"), float("-inf")):
        for attribute, expected in (("loss", worst), ("val_loss", worst), ("fd_dinov2", worst), ("clip_score", -worst)):
            row = {"step": 10.0, "loss": 0.5, attribute: value}
            scored = scored_metrics(row, attribute)
            assert scored == {**row, attribute: expected}, (attribute, value)
            assert row[attribute] is value  # the run's own row is not changed
    for attribute, finite in (("loss", 0.25), ("val_loss", 1e300), ("clip_score", -3.0), ("class_agreement", 0.0)):
        row = {"step": 10.0, attribute: finite}
        assert scored_metrics(row, attribute) is row
    assert np.isnan(scored_metrics({"loss": float("nan")}, None)["loss"])  # no score attribute: nothing ranks by it


def test_an_evaluations_score_that_is_not_finite_reaches_ray_train_as_the_worst():
    """What the evaluation task returns, Ray Train merges into its checkpoint's metrics and writes to its JSON record:
    a NaN or infinite eval metric (an FD of degenerate features) would be null there. It gets the worst finite score;
    other metrics and finite scores are as measured, and the evaluation's file keeps the real values."""
    import json

    from sdtrain.evaluation.scores import finite_scores

    worst = sys.float_info.max
    measured = {"fd_dinov2": float("nan"), "clip_score": float("inf"), "class_agreement": 0.5, "eval_s": float("nan")}
    sent = finite_scores(measured)
    assert sent == {"fd_dinov2": worst, "clip_score": -worst, "class_agreement": 0.5, "eval_s": sent["eval_s"]}
    assert np.isnan(sent["eval_s"]) and np.isnan(measured["fd_dinov2"])  # not a score: as measured; the input as it was
    json.dumps({k: v for k, v in sent.items() if k != "eval_s"}, allow_nan=False)  # every score is JSON
    finite = {"fd_dinov2": 12.5, "class_agreement": 1.0}
    assert finite_scores(finite) is finite


_PRIORITY_PROBE = """
import json, os, sys, threading
import sdtrain.evaluation.eval_task  # what Ray imports to call the task
from sdtrain.evaluation import cpu_priority as task
before = "torch" in sys.modules  # Ray imports the task's module before the task lowers its priority
started, ending = threading.Event(), threading.Event()
early = threading.Thread(target=started.wait, daemon=True)
early.start()  # a thread that exists before (Ray's own threads do)
lowered = task.lowest_cpu_priority()
import torch
torch.ones(512, 512) @ torch.ones(512, 512)  # starts torch's thread pool, after
late = threading.Thread(target=ending.wait, daemon=True)
late.start()
threads = os.listdir("/proc/self/task")
ending.set()
late.join()  # a thread that ends between the listing and the query, as torch's pool threads may


def policy(thread):
    try:
        return os.sched_getscheduler(int(thread))
    except ProcessLookupError:  # it ended since the listing
        return None


policies = sorted({p for p in map(policy, threads) if p is not None})
started.set()
print(json.dumps({"torch_before": before, "lowered": lowered, "policies": policies, "label": task.cpu_policy()}))
"""


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux's SCHED_IDLE")
def test_the_evaluation_task_runs_at_the_lowest_cpu_priority_only_in_its_own_runtime_environment():
    import subprocess
    import sys

    from sdtrain.evaluation.cpu_priority import EVALUATION_TASK_ENV

    def probe(**env):
        environment = {k: v for k, v in os.environ.items() if k != EVALUATION_TASK_ENV} | env
        done = subprocess.run([sys.executable, "-c", _PRIORITY_PROBE], env=environment, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    inside = probe(**{EVALUATION_TASK_ENV: "1"})
    assert inside == {"torch_before": False, "lowered": True, "policies": [os.SCHED_IDLE], "label": "idle"}
    # A process other tasks may be given (no such variable) keeps its priority: it could not get it back.
    outside = probe()
    assert outside["lowered"] is False and os.SCHED_IDLE not in outside["policies"] and outside["label"] != "idle"


def test_eval_is_refused_before_ray_when_something_it_needs_is_missing(evaluated, tmp_path):
    with pytest.raises(ConfigError, match="eval: evaluating checkpoints needs data.val"):
        tiny_config("data.train=[t]", "eval.dinov2=/models/dinov2")
    with pytest.raises(ConfigError, match="checkpoint.score_attribute: clip_score needs eval.clip"):
        tiny_config(
            "data.train=[t]", "data.val=[v]", "eval.dinov2=/models/dinov2", "checkpoint.score_attribute=clip_score"
        )
    with pytest.raises(ConfigError, match="retrain.metric: clip_score needs eval.clip"):
        tiny_config("data.train=[t]", "data.val=[v]", "eval.dinov2=/models/dinov2", "retrain.metric=clip_score")
    with pytest.raises(ConfigError, match="eval.num_samples: must be >= 2 for fd_dinov2"):
        tiny_config("data.train=[t]", "data.val=[v]", "eval.dinov2=/models/dinov2", "eval.num_samples=1")
    config = evaluated["config"]
    columns = ["image_latents_256", "caption_latents", "caption"]
    with pytest.raises(ConfigError, match=r"eval.vae: data.val's files record no VAE"):
        check_evaluation(config, {}, columns)
    with pytest.raises(ConfigError, match=r"eval.text_column: data.val has no column 'caption'.*caption_latents"):
        check_evaluation(config, {VAE_SOURCE.encode(): evaluated["sd"].encode()}, columns[:2])
    (tmp_path / "empty").mkdir()
    no_model = tiny_config(*_eval_keys(config), f"eval.dinov2={tmp_path / 'empty'}")
    with pytest.raises(ConfigError, match=r"eval.dinov2: .*empty holds no config.json"):
        check_evaluation(no_model, {VAE_SOURCE.encode(): evaluated["sd"].encode()}, columns)
    missing = tiny_config(*_eval_keys(config), f"eval.inception={tmp_path / 'inception.pt'}")
    with pytest.raises(ConfigError, match=r"eval.inception: .*inception.pt is not a file \(FID's Inception network"):
        check_evaluation(missing, {VAE_SOURCE.encode(): evaluated["sd"].encode()}, columns)
    (tmp_path / "inception.pt").write_bytes(b"not torchscript")
    with pytest.raises(DataError, match=r"the Inception feature extractor .*inception.pt is not a TorchScript file"):
        InceptionFeatures(str(tmp_path / "inception.pt"))
    with pytest.raises(ConfigError, match="checkpoint.score_attribute: fd_inception needs eval.inception"):
        tiny_config(*_eval_keys(config), "checkpoint.score_attribute=fd_inception")
    # Class agreement: data.val's label column and the latent classifier its files name (the demo's do); it decodes
    # nothing, so needs no VAE. Data that names none is refused before Ray, never measured with a guessed one.
    agreement = tiny_config("data.train=[t]", "data.val=[v]", "eval.class_agreement=true")
    assert agreement.eval.enabled and agreement.eval.metrics == ["class_agreement"] and not agreement.eval.needs_vae
    with pytest.raises(ConfigError, match=r"eval.class_agreement: data.val has no column 'label'.*caption_latents"):
        check_evaluation(agreement, {}, columns[:2])
    with pytest.raises(ConfigError, match=r"data.val's files name no latent classifier .*eval.class_agreement=false"):
        check_evaluation(agreement, {}, [*columns[:2], "label"])
    named = {LATENT_CLASSIFIER.encode(): b"sdtrain.demo.digits"}
    assert check_evaluation(agreement, named, [*columns[:2], "label"]) is None
    with pytest.raises(ConfigError, match=r"'sdtrain.demo' is no latent classifier: it has no preview\(\), class_agr"):
        check_evaluation(agreement, {LATENT_CLASSIFIER.encode(): b"sdtrain.demo"}, [*columns[:2], "label"])


def _eval_keys(config) -> list[str]:
    return [f"data.train=[{config.data.val[0]}]", f"data.val=[{config.data.val[0]}]", f"eval.clip={config.eval.clip}"]


def test_the_retraining_gate_compares_both_models_by_fd_dinov2_on_the_same_samples(evaluated):
    from sdtrain.artifacts.loading import load_model
    from sdtrain.driver.retrain_gate import decide, gate_scores

    config = tiny_config(*_eval_keys(evaluated["config"]), *_rest(evaluated["config"]), "retrain.metric=fd_dinov2")
    trained = load_model(str(evaluated["checkpoint"]))
    untrained = load_model(str(evaluated["checkpoint"]))
    torch.manual_seed(1)
    untrained.unet = build_unet(load_config(None, ["model.preset=tiny", "data.train=[x]"]).model).eval()
    new, production = gate_scores(config, trained, untrained)
    assert set(new) == set(production) == {"val_loss", "fd_dinov2", "clip_score", "eval_nonfinite_samples"}
    assert new["fd_dinov2"] != production["fd_dinov2"]
    # The same samples and reference: scoring the trained model alone gives its number again.
    alone, none = gate_scores(config, trained, None)
    assert alone["fd_dinov2"] == pytest.approx(new["fd_dinov2"], rel=1e-6) and none == {}
    better, worse = sorted([new["fd_dinov2"], production["fd_dinov2"]])
    assert decide(better, worse, "v0001", ("v0001", worse), 0.0, "fd_dinov2") == (
        True,
        f"fd_dinov2 {better:.5f} <= v0001's {worse:.5f} x (1 + 0)",
    )
    assert decide(worse, better, "v0001", ("v0001", better), 0.0, "fd_dinov2")[0] is False
    # clip_score is higher the better.
    assert decide(30.0, 31.0, "v0001", None, 0.05, "clip_score") == (
        True,
        "clip_score 30.00000 >= v0001's 31.00000 x (1 - 0.05)",
    )
    assert decide(29.0, 31.0, "v0001", None, 0.05, "clip_score")[0] is False


def _rest(config) -> list[str]:
    return [f"eval.dinov2={config.eval.dinov2}", "eval.num_samples=8", "eval.batch_size=4", "sample_grid.steps=2"]


def test_gate_scores_give_a_model_whose_samples_diverge_no_fd_and_count_them(evaluated):
    """A model whose samples diverge gets no Frechet distance or CLIP score in the gate, not metrics_of's stand-in
    (a bar any model passed), and the count of its diverged samples (tests/test_retrain_gate_diverged.py: the rest)."""
    from sdtrain.artifacts.loading import load_model
    from sdtrain.driver.retrain_gate import NONFINITE, gate_decision, gate_scores
    from sdtrain.evaluation.measures import WORST_HIGH, WORST_LOW

    config = tiny_config(*_eval_keys(evaluated["config"]), *_rest(evaluated["config"]), "retrain.metric=fd_dinov2")
    healthy = load_model(str(evaluated["checkpoint"]))
    diverged = load_model(str(evaluated["checkpoint"]))
    with torch.no_grad():
        diverged.unet.conv_out.bias.fill_(float("nan"))  # every sample's latents NaN from its first step
    new, production = gate_scores(config, healthy, diverged)
    assert production[NONFINITE] == 8 and new[NONFINITE] == 0
    assert math.isnan(production["fd_dinov2"]) and math.isnan(production["clip_score"])  # no stand-in
    assert new["fd_dinov2"] < WORST_HIGH and new["clip_score"] > WORST_LOW
    promote, reason = gate_decision(config, new, production, "v0003", ("v0003", new["fd_dinov2"] / 2))
    assert promote is False  # production's diverged samples are no bar: the value it served with is
    assert reason.endswith("v0003's fd_dinov2 is not measured (8 of its eval samples diverged): not a bar")
    promote, reason = gate_decision(config, production, new, "v0003", None)
    assert (promote, reason) == (
        False,
        "the new model diverged: 8 of its eval samples hold NaN or inf, so its fd_dinov2 is not measured",
    )


def test_a_registry_version_loads_and_is_gated_like_the_checkpoint_it_was_written_from(evaluated, tmp_path):
    """A version kept only unet/ and scheduler/: loaded, it had no trained shapes or empty-prompt embedding, and the
    gate with eval died on an assert scoring production (from the second day on)."""
    from sdtrain.artifacts.export import write_export
    from sdtrain.artifacts.loading import load_model
    from sdtrain.artifacts.registry import ModelRegistry
    from sdtrain.driver.retrain_gate import gate_scores
    from sdtrain.errors import SdtrainError

    config = tiny_config(*_eval_keys(evaluated["config"]), *_rest(evaluated["config"]), "retrain.metric=fd_dinov2")
    trained = load_model(str(evaluated["checkpoint"]))
    registry = ModelRegistry(str(tmp_path / "models"))
    manifest = {"schedule_date": "2026-11-01", "promoted": True, "parent": None, "checkpoint": "/gone/checkpoint"}
    version = registry.write_version(trained.unet, trained.noise_scheduler, manifest, trained=trained)
    production = load_model(registry.location(version))
    assert (production.latent_shape, production.caption_shape) == ((4, 16, 16), (77, 32)) == trained.trained_shapes("")
    assert production.unconditional_caption is not None and trained.unconditional_caption is not None
    assert torch.equal(production.unconditional_caption, trained.unconditional_caption.float())
    assert (production.weights, production.global_step) == ("raw", 2)
    new, scored = gate_scores(config, trained, production)
    for metric in ("val_loss", "fd_dinov2", "clip_score"):  # the same weights, samples and reference
        assert scored[metric] == pytest.approx(new[metric], rel=1e-5), metric
    with pytest.raises(SdtrainError, match=r"is a registry version \(manifest.json\), which an export must not"):
        write_export(production, registry.location(version))  # it records what an export does, and is none

    # A version written before versions recorded them: given them by the checkpoint its manifest names...
    old = registry.write_version(trained.unet, trained.noise_scheduler, {"checkpoint": str(evaluated["checkpoint"])})
    loaded = load_model(registry.location(old))
    assert (loaded.latent_shape, loaded.caption_shape, loaded.weights) == ((4, 16, 16), (77, 32), "raw")
    assert torch.equal(loaded.unconditional_caption, trained.unconditional_caption)
    # ...and where that is gone, an evaluation says so, naming the version, instead of a bare assert.
    gone = load_model(registry.location(registry.write_version(trained.unet, trained.noise_scheduler, manifest)))
    assert gone.latent_shape is None and gone.unconditional_caption is None
    with pytest.raises(SdtrainError) as refused:
        Evaluator(config, None, None).evaluate(gone)
    assert str(refused.value).startswith(
        f"model: evaluation needs the latent and caption shape {registry.location('v0003')} was trained at, which it "
        "does not record: it is a registry version written before versions recorded sdtrain.json and "
        "unconditional_caption.npy, and the checkpoint its manifest.json names (/gone/checkpoint) could not be read"
    )


def test_bucketed_validation_rows_are_sampled_and_compared_each_at_its_own_bucket(evaluated, tmp_path):
    """data.val of two aspect-ratio buckets (photographs square and 3:2, as preprocessing writes them: rows sorted by
    bucket, the buckets in the footer): each sample is generated at its row's bucket and the reference images are the
    same rows' latents decoded at their bucket; FD and CLIP score pool both."""
    from sdtrain.artifacts.loading import load_model
    from sdtrain.data.metadata import BUCKET_SHAPES
    from sdtrain.preprocess.outputs import parquet_bytes, shard_table
    from sdtrain.sampling.sampler import initial_noise, sample_latents, shape_seed

    vae, (tokenizer, text_encoder) = evaluated["vae"], load_text_encoder(evaluated["sd"])
    square, wide = _photo_crops(6), np.stack([np.concatenate([c, c[:, :16]], axis=1) for c in _photo_crops(4)])
    rows = []
    for bucket, pixels in ((0, square), (1, wide)):
        latents = encode_images(vae, pixels, "mean").numpy()
        for i, latent in enumerate(latents):
            text = TEXTS[(i + bucket) % len(TEXTS)]
            embedding = encode_prompts(tokenizer, text_encoder, [text]).numpy()[0]
            rows.append({"latents": latent, "embeddings": embedding, "bucket": bucket, "caption": text, "key": text})
    rows = rows[::2] + rows[1::2]  # the writer sorts them by bucket
    metadata = {
        BUCKET_SHAPES: json.dumps([[4, 16, 16], [4, 16, 24]]),
        VAE_SOURCE: evaluated["sd"],
        LATENT_SCALING_FACTOR: str(vae.config.scaling_factor),
    }
    table = shard_table(rows, {"latents": "image_latents_256", "embeddings": "caption_latents"}, metadata)
    (tmp_path / "val").mkdir()
    (tmp_path / "val" / "part-0.parquet").write_bytes(parquet_bytes(table, 4))
    config = _on_val(evaluated, tmp_path / "val")

    evaluator = Evaluator(config, None, evaluated["sd"])
    metrics = evaluator.evaluate(str(evaluated["checkpoint"]))
    groups = evaluator.rows.groups
    assert [(g.shape, g.rows.tolist()) for g in groups] == [((4, 16, 16), [0, 1, 2, 3, 4, 5]), ((4, 16, 24), [6, 7])]
    # Each bucket's noise seeded by (train.seed, its shape): row 0 of one no longer starts from row 0 of the other's.
    first, second = (initial_noise(g.shape, 1, shape_seed(config.train.seed, g.shape))[0].flatten() for g in groups)
    assert not torch.equal(first, second[: len(first)])
    assert metrics["eval_samples"] == 8 and 0 <= metrics["clip_score"] <= 100

    # The same numbers by hand: each bucket's rows sampled at its shape, both buckets' images pooled.
    loaded = load_model(str(evaluated["checkpoint"]))
    features = DinoFeatures(config.eval.dinov2)
    generated, reference = FeatureStats(features.dim), FeatureStats(features.dim)
    flat = np.stack(table.column("caption_latents").to_numpy(zero_copy_only=False)[:8]).reshape(8, 77, 32)
    for group in groups:
        sampled = sample_latents(
            loaded.unet,
            loaded.noise_scheduler.config,
            torch.from_numpy(flat[group.rows].astype(np.float32)),
            loaded.unconditional_caption,
            group.shape,
            sampler=config.sample_grid.sampler,
            steps=config.sample_grid.steps,
            guidance_scale=config.sample_grid.guidance_scale,
            seed=shape_seed(config.train.seed, group.shape),
            batch_size=4,
        )
        assert sampled.shape[1:] == group.shape
        generated.add(features(decode(vae, sampled, vae.config.scaling_factor)))
        stored = torch.from_numpy(group.latents.astype(np.float32))
        assert stored.shape[1:] == group.shape
        reference.add(features(decode(vae, stored, vae.config.scaling_factor)))
    assert metrics["fd_dinov2"] == pytest.approx(frechet_distance(generated, reference), rel=1e-5)


@pytest.mark.slow
def test_the_retraining_gate_scores_in_a_ray_task_that_loads_both_models_and_raises_our_errors_as_they_are(
    evaluated, tmp_path, ray_cluster
):
    """The gate used to score on the retraining job's driver (a CPU-only head node): both models loaded there, and
    eval.num_samples images sampled with each on its CPUs, hours after the GPUs finished. It runs in a Ray task of
    eval's resources (a GPU where training had them) that loads both from their paths, and gives what gate_scores
    gives in this process; an error of ours in it reaches the command line as itself, not as Ray's wrapper."""
    import re

    from sdtrain.artifacts.loading import load_model
    from sdtrain.driver.retrain_gate import gate_resources, gate_scores, scores_in_task

    keys = [*_eval_keys(evaluated["config"]), *_rest(evaluated["config"])]
    config = tiny_config(*keys, "eval.num_cpus=0", "retrain.metric=fd_dinov2")
    assert gate_resources(config) == {"num_cpus": 0, "num_gpus": 0}  # this cluster has no GPU: CPUs alone
    assert gate_resources(tiny_config(*keys, "scaling.use_gpu=true"))["num_gpus"] == 1  # as training's workers
    assert gate_resources(tiny_config(*keys, "scaling.use_gpu=true", "eval.num_gpus=0.5"))["num_gpus"] == 0.5
    checkpoint = str(evaluated["checkpoint"])
    with LogLines() as lines:
        new, production = scores_in_task(config, checkpoint, checkpoint)
    here, _ = gate_scores(config, load_model(checkpoint), None)
    assert set(new) == set(production) == set(here) == {"val_loss", "fd_dinov2", "clip_score", "eval_nonfinite_samples"}
    for metric, value in here.items():
        assert new[metric] == pytest.approx(value, rel=1e-5) and production[metric] == pytest.approx(value, rel=1e-5)
    (placed,) = [m for m in lines.messages if m.startswith("gate: scored in Ray task sdtrain-retrain-gate on node ")]
    assert int(re.search(r"\(pid (\d+)\)$", placed)[1]) != os.getpid(), placed  # not in this (the driver's) process

    (tmp_path / "val").mkdir()
    (tmp_path / "val" / "part-0.parquet").write_bytes(b"not parquet")
    broken = tiny_config(f"data.train=[{tmp_path / 'val'}]", f"data.val=[{tmp_path / 'val'}]")
    with pytest.raises(DataError) as raised:
        scores_in_task(broken, checkpoint, None)
    assert type(raised.value) is DataError, type(raised.value)  # what the retrain command prints in one line
    assert re.match(r"data\.val: cannot read \S+part-0\.parquet as parquet: ", str(raised.value)), raised.value


def test_a_shape_group_is_sampled_decoded_and_measured_a_few_batches_at_a_time(evaluated):
    """What an evaluation holds at once (latents, images, caption embeddings) does not grow with eval.num_samples: 9
    rows at eval.batch_size 2 are sampled, decoded and embedded at most CHUNK_BATCHES batches at a time, samples and
    reference alike."""
    from sdtrain.artifacts.loading import load_model

    dinov2 = f"eval.dinov2={evaluated['config'].eval.dinov2}"
    config = tiny_config(
        *_eval_keys(evaluated["config"]), dinov2, "eval.num_samples=9", "eval.batch_size=2", "sample_grid.steps=2"
    )
    evaluator = Evaluator(config, None, evaluated["sd"])
    rows: dict[str, list[int]] = {"sampled": [], "decoded": [], "embedded": []}
    sample, decode_, features = evaluator._sample, evaluator._decode, evaluator.features["fd_dinov2"]
    evaluator._sample = lambda unet, loaded, captions, *rest: (
        rows["sampled"].append(len(captions)) or sample(unet, loaded, captions, *rest)
    )
    evaluator._decode = lambda latents, loaded: rows["decoded"].append(len(latents)) or decode_(latents, loaded)

    class Counted:  # the real feature model, called through
        dim = features.dim

        def __call__(self, images: np.ndarray, batch_size: int) -> np.ndarray:
            rows["embedded"].append(len(images))
            return features(images, batch_size)

    evaluator.features["fd_dinov2"] = Counted()  # type: ignore[assignment]
    metrics = evaluator.evaluate(load_model(str(evaluated["checkpoint"])))
    assert metrics["eval_samples"] == 9
    chunk = 4 * 2  # CHUNK_BATCHES batches of eval.batch_size
    assert rows["sampled"] == [chunk, 9 - chunk]
    assert rows["decoded"] == rows["embedded"] == [chunk, 9 - chunk] * 2  # the samples, then the reference's rows


def test_chunks_measure_what_the_whole_group_at_once_measures(evaluated):
    """Each row sampled from the noise it has in its whole group, the feature statistics being sums: a group
    measured in chunks is the group sampled, decoded and scored whole, to the bit (the CLIP scores, one per image),
    and its feature statistics are the whole group's to float64 rounding (BLAS rounds a sum of 4 rows and one of 8
    rows differently, which order depending on the CPU it runs on)."""
    from sdtrain.artifacts.loading import load_model
    from sdtrain.sampling.sampler import sample_latents, shape_seed

    config = tiny_config(
        *_eval_keys(evaluated["config"]),
        f"eval.dinov2={evaluated['config'].eval.dinov2}",
        "eval.num_samples=8",
        "eval.batch_size=1",
        "sample_grid.steps=2",
    )
    evaluator = Evaluator(config, None, evaluated["sd"])
    loaded = load_model(str(evaluated["checkpoint"]))
    rows = evaluator._rows(loaded)
    measures = evaluator.measure(loaded, rows)  # chunks of CHUNK_BATCHES x 1 rows: 2
    group = rows.groups[0]
    grid = config.sample_grid
    whole = sample_latents(
        loaded.unet,
        dict(loaded.noise_scheduler.config),
        torch.from_numpy(rows.captions).float(),
        loaded.unconditional_caption,
        group.shape,
        sampler=grid.sampler,
        steps=grid.steps,
        guidance_scale=grid.guidance_scale,
        seed=shape_seed(config.train.seed, group.shape),
        batch_size=1,
    )
    images = decode(evaluator.vae, whole, evaluator.vae.config.scaling_factor, 1)
    expected = FeatureStats(evaluator.features["fd_dinov2"].dim)
    expected.add(evaluator.features["fd_dinov2"](images, 1))
    generated = measures.generated["fd_dinov2"]
    assert generated.count == expected.count == 8
    np.testing.assert_allclose(generated.mean, expected.mean, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(generated.cov, expected.cov, rtol=1e-12, atol=1e-15)
    texts = [rows.texts[i] for i in group.rows]
    np.testing.assert_array_equal(measures.clip_scores, np.asarray(evaluator.clip(images, texts, 1)))


def test_a_sample_that_diverged_is_counted_and_makes_the_evaluation_the_worst(evaluated):
    """NaN latents used to decode to a black image that was scored as one; now such samples are counted
    (eval_nonfinite_samples), not measured, and the model's metrics are the worst each can be."""
    import sys

    from sdtrain.artifacts.loading import load_model
    from sdtrain.evaluation.measures import Measures, metrics_of

    config = tiny_config(*_eval_keys(evaluated["config"]), *_rest(evaluated["config"]))
    evaluator = Evaluator(config, None, evaluated["sd"])
    loaded = load_model(str(evaluated["checkpoint"]))
    rows = evaluator._rows(loaded)
    group = rows.groups[0]
    latents = torch.from_numpy(group.latents.astype(np.float32)) * evaluator.vae.config.scaling_factor
    latents[1] = float("nan")
    latents[2, 0, 0, 0] = float("inf")
    measures = Measures(generated={m: FeatureStats(f.dim) for m, f in evaluator.features.items()})
    evaluator._measure_samples(measures, loaded, latents, rows, group.rows)
    assert measures.samples == 8 and measures.nonfinite == 2
    assert measures.generated["fd_dinov2"].count == len(measures.clip_scores) == 6
    metrics = metrics_of(config, measures, evaluator._references(loaded))
    assert metrics["fd_dinov2"] == sys.float_info.max and metrics["clip_score"] == 0.0
    assert metrics["eval_nonfinite_samples"] == 2 and metrics["eval_samples"] == 8
    clean = Measures(generated={m: FeatureStats(f.dim) for m, f in evaluator.features.items()})
    evaluator._measure_samples(clean, loaded, latents[[0, 3, 4, 5]], rows, group.rows[[0, 3, 4, 5]])
    assert metrics_of(config, clean, evaluator.references)["eval_nonfinite_samples"] == 0


def test_a_null_caption_text_is_refused_naming_its_file_column_and_row_before_sampling(evaluated, tmp_path):
    """clip_score scores each sample against its caption's text: a null one used to become the caption "None"."""
    table = pq.read_table(evaluated["root"] / "val" / "part-0.parquet")
    texts = table.column("caption").to_pylist()
    texts[5] = None
    table = table.set_column(table.schema.get_field_index("caption"), "caption", pa.array(texts, pa.string()))
    (tmp_path / "val").mkdir()
    pq.write_table(table, tmp_path / "val" / "part-0.parquet")
    config = _on_val(evaluated, tmp_path / "val")
    evaluator = Evaluator(config, None, evaluated["sd"])
    evaluator._sample = None  # nothing may sample before the refusal
    with pytest.raises(DataError, match=r"eval.text_column: .*part-0.parquet, column 'caption', row 5 is null"):
        evaluator.evaluate(str(evaluated["checkpoint"]))


def _on_val(evaluated, val):
    """The evaluated run's config, trained and evaluated on ``val``."""
    return tiny_config(
        f"data.train=[{val}]",
        f"data.val=[{val}]",
        f"eval.clip={evaluated['config'].eval.clip}",
        *_rest(evaluated["config"]),
    )


@pytest.mark.parametrize("shape", [(4, 8, 8), (4, 16, 24), (4, 3, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_initial_noise_drawn_a_piece_at_a_time_is_the_sets_row_for_row(shape, dtype):
    """An evaluation draws each chunk's noise as it samples it: 30k SD2 samples at 512 px held ~1.9 GiB drawn whole.
    Rows 300.. of 340 (skipping more rows than one draw skips), in uneven pieces."""
    from sdtrain.sampling.sampler import initial_noise, initial_noise_pieces

    pieces = list(initial_noise_pieces(shape, 340, 11, 300, [5, 16, 1, 18], dtype))
    assert torch.equal(torch.cat(pieces), initial_noise(shape, 340, 11, dtype)[300:])
    assert [len(piece) for piece in pieces] == [5, 16, 1, 18]
    assert all(piece.untyped_storage().nbytes() == piece.nbytes for piece in pieces)  # no view of a larger draw
