import os
import re

import pytest
from conftest import REPO

from sdtrain.artifacts.checkpoint_format import CheckpointMeta
from sdtrain.config.keys import describe_keys, help_text
from sdtrain.config.loader import load_config
from sdtrain.config.schema import Config
from sdtrain.errors import ConfigError

BASE = ["data.train=/data/train"]


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "data:\n  train: [a, b]\n  val: v\nmodel:\n  preset: tiny\n  unet:\n    layers_per_block: 2\n"
        "train:\n  lr: 1e-4\n  max_steps: 10\n  global_batch_size: 24\nscaling:\n  num_workers: [1, 4]\n"
    )
    config = load_config(path, ["train.lr=3e-4", "model.unet.cross_attention_dim=64", "scaling.use_gpu=true"])
    assert config.data.train == ["a", "b"]
    assert config.data.val == ["v"]  # one path is a one-element list
    assert config.train.lr == 3e-4  # YAML reads 1e-4 as a string; it is still a float here
    assert config.model.unet == {"layers_per_block": 2, "cross_attention_dim": 64}
    assert config.scaling.num_workers == [1, 4]
    assert (config.scaling.min_workers, config.scaling.max_workers) == (1, 4)
    assert config.scaling.use_gpu is True
    assert config.train.max_steps == 10


def test_an_override_goes_into_a_section_the_file_leaves_empty(tmp_path):
    """A section header with only comments under it is YAML's null: an override of one of its keys fills it, as
    it would an absent section, instead of calling the section a value."""
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  train: /x\ntrain:\n  # lr: 1.0e-4\n")
    assert load_config(path, []).train.lr == load_config(None, ["data.train=/x"]).train.lr
    assert load_config(path, ["train.lr=0.002"]).train.lr == 0.002


def test_defaults_follow_the_seed_notebook():
    config = load_config(None, BASE)
    assert (config.data.latent_column, config.data.caption_column) == ("image_latents_256", "caption_latents")
    assert (config.train.lr, config.train.weight_decay, config.train.warmup_steps) == (1e-4, 1e-2, 10_000)
    assert config.train.max_steps == 550_000
    assert config.model.preset == "small"
    assert config.run.name == "sdtrain"  # stable: re-running resumes


def test_round_trip_through_dict():
    config = load_config(
        None, BASE + ["scaling.num_workers=[2,4]", "train.global_batch_size=24", "model.unet.sample_size=8"]
    )
    assert Config.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([], r"data\.train: is required"),
        (BASE + ["train.lrr=1"], r"train\.lrr: unknown key \(did you mean lr\?\)"),
        (BASE + ["trian.lr=1"], r"trian: unknown section \(did you mean train\?\)"),
        (BASE + ["train.max_steps=1.5"], r"train\.max_steps: expected int, got 1\.5"),
        (BASE + ["train.max_steps=0"], r"train\.max_steps: must be > 0, got 0"),
        (BASE + ["train.global_batch_size=-8"], r"train\.global_batch_size: must be > 0"),
        (BASE + ["train.lr=fast"], r"train\.lr: expected float, got 'fast'"),
        (BASE + ["train.lr=0"], r"train\.lr: must be > 0"),
        (BASE + ["train.warmup_steps=-1"], r"train\.warmup_steps: must be >= 0"),
        (BASE + ["train.weight_decay=-0.1"], r"train\.weight_decay: must be >= 0"),
        (BASE + ["train.grad_clip_norm=-1"], r"train\.grad_clip_norm: must be >= 0"),
        (BASE + ["train.precision=fp8"], r"train\.precision: must be one of auto, bf16-mixed, 16-mixed, 32-true"),
        (
            BASE + ["model.preset=huge"],
            r"model\.preset: must be one of tiny, small, sd2-base, tiny-sdxl, sdxl-base; got 'huge'",
        ),
        (
            BASE + ["model.unet.layers_per_blok=2"],
            r"model\.unet\.layers_per_blok: is not a UNet2DConditionModel argument \(did you mean layers_per_block\?\)",
        ),
        (BASE + ["model.unet=3"], r"model\.unet: expected a mapping"),
        (
            BASE + ["model.pretrained=/m", "model.unet.sample_size=8"],
            r"model\.unet: cannot override the architecture of model\.pretrained",
        ),
        (BASE + ["scaling.num_workers=0"], r"scaling\.num_workers: must be >= 1"),
        (BASE + ["scaling.num_workers=[4,2]"], r"scaling\.num_workers: as a list must be \[min, max\]"),
        (BASE + ["scaling.num_workers=[1,2,3]"], r"scaling\.num_workers: as a list must be \[min, max\]"),
        (BASE + ["scaling.num_workers=two"], r"scaling\.num_workers: expected int \| list of int"),
        (BASE + ["scaling.use_gpu=maybe"], r"scaling\.use_gpu: expected auto \| bool, got 'maybe'"),
        (BASE + ["scaling.cpus_per_worker=0"], r"scaling\.cpus_per_worker: must be auto or in \[0\.0001, "),
        (BASE + ["run.name=my run/1"], r"run\.name: must be letters, digits"),
        (BASE + ["checkpoint.every_n_steps=0"], r"checkpoint\.every_n_steps: must be >= 1"),
        (BASE + ["run.log_every_n_steps=0"], r"run\.log_every_n_steps: must be >= 1"),
        (BASE + ["checkpoint.num_to_keep=0"], r"checkpoint\.num_to_keep: must be >= 1 or null"),
        (BASE + ["run.val_every_n_steps=0"], r"run\.val_every_n_steps: must be >= 1 or null"),
        (BASE + ["run.gpu_hour_cost=-0.5"], r"run\.gpu_hour_cost: must be a price >= 0 \(per GPU-hour"),
        (BASE + ["failure.max_failures=-2"], r"failure\.max_failures: must be >= -1"),
        (BASE + ["failure.max_preemptions=-2"], r"failure\.max_preemptions: must be >= -1"),
        (BASE + ["data.prefetch_batches=-1"], r"data\.prefetch_batches: must be >= 0"),
        (BASE + ["data.latent_column="], r"data\.latent_column: expected str, got None"),
        (
            BASE + ["train.global_batch_size=12", "scaling.num_workers=[2,5]"],
            r"train\.global_batch_size: 12 does not divide evenly over 5 worker\(s\), which "
            r"scaling\.num_workers=\[2, 5\] allows",
        ),
        (
            BASE + ["train.global_batch_size=48", "train.micro_batch_size=12", "scaling.num_workers=[2,4]"],
            r"train\.micro_batch_size: 12 does not divide the 16 samples each of 3 worker\(s\) takes per step",
        ),
        (BASE + ["train.micro_batch_size=0"], r"train\.micro_batch_size: must be > 0, auto or null, got 0"),
        (BASE + ["data.shuffle_window_rows=0"], r"data\.shuffle_window_rows: must be >= 1, got 0"),
        (
            BASE + ["data.shuffle_chunk_rows=6", "data.bucket_steps=4"],
            r"data\.bucket_steps: must be auto or a divisor of data\.shuffle_chunk_rows=6 \(each step takes an equal "
            r"part of a chunk\), got 4",
        ),
        (BASE + ["data.bucket_steps=fast"], r"data\.bucket_steps: expected auto \| int, got 'fast'"),
        (
            BASE + ["data.shuffle_chunk_rows=64", "data.bucket_steps=4", "train.global_batch_size=24"],
            r"data\.bucket_steps: 4 steps of one bucket take 16 rows of each chunk of data\.shuffle_chunk_rows=64 a "
            r"step, which does not divide train\.global_batch_size=24",
        ),
        (BASE + ["data.on_read_error=ignore"], r"data\.on_read_error: .*ignore"),
        (
            BASE + ["tracking.mlflow_register_as=unet"],
            r"^tracking\.mlflow_register_as: 'unet' registers the export from the run's MLflow run, but "
            r"tracking\.trackers=\['tensorboard'\] has no mlflow, so nothing would be registered; add mlflow to "
            r"tracking\.trackers, or set tracking\.mlflow_register_as to null$",
        ),
        (
            BASE + ["tracking.mlflow_register_as=unet", "tracking.trackers=[mlflow]", "export.enabled=false"],
            r"^tracking\.mlflow_register_as: 'unet' registers the run's final export, but export\.enabled is false "
            r"and writes none, so nothing would be registered; set export\.enabled to true, or "
            r"tracking\.mlflow_register_as to null$",
        ),
        (BASE + ["train"], r"override 'train' must look like key\.sub=value"),
        (BASE + ["train.lr.x=1"], r"train\.lr\.x: lr is a value, not a section|train\.lr: unknown|train\.lr: expected"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_an_mlflow_model_to_register_needs_the_mlflow_tracker_and_an_export():
    keys = [*BASE, "tracking.mlflow_register_as=unet", "tracking.trackers=[tensorboard, mlflow]"]
    assert load_config(None, keys).tracking.mlflow_register_as == "unet"
    assert load_config(None, [*BASE, "tracking.trackers=[]", "export.enabled=false"]).tracking.trackers == []


def test_unreadable_config_file(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot read config file .*missing\.yaml"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml is not valid YAML"):
        load_config(bad)


def test_every_key_has_a_docstring_and_is_in_help():
    # docs/configuration.md is generated from the same docstrings: tests/test_config_reference.py.
    text = help_text()
    for key, _type, _default, doc in describe_keys():
        assert doc, f"{key} has no docstring"
        assert key in text


@pytest.mark.parametrize("name", ["demo.yaml", "small.yaml", "sd2-base.yaml", "sdxl-base.yaml"])
def test_shipped_configs_load(name):
    config = load_config(REPO / "configs" / name)
    assert re.fullmatch(r"[a-z0-9-]+", config.run.name)


@pytest.mark.parametrize("name", ["demo.yaml", "small.yaml", "sd2-base.yaml", "sdxl-base.yaml", "retrain.yaml"])
def test_no_shipped_config_restarts_without_end(name):
    """Each restart resumes from the latest checkpoint and replays the same steps, so a failure that recurs there (a
    CUDA OOM, an NCCL error) would restart forever under -1: on 64 H100s for sdxl-base. Preemptions are counted
    apart (failure.max_preemptions), so a finite bound costs a spot run nothing."""
    overrides = ["retrain.data_root=/d", "retrain.models_root=/m"] if name == "retrain.yaml" else []
    assert 0 <= load_config(REPO / "configs" / name, overrides).failure.max_failures <= 10


PLACEHOLDER_MESSAGE = (
    "data.train[1]: s3://Your-Bucket/latents names the shipped configs' placeholder bucket (YOUR-BUCKET), not a real "
    "one; set data.train to the training latents: parquet files (a file, a directory or a glob, local or s3://), "
    "such as what entrypoints/preprocess.py wrote to its output.path, in the config or on the command line "
    "(data.train=s3://<bucket>/<prefix>)"
)


def test_a_placeholder_bucket_is_refused_naming_the_key_its_value_and_what_to_set():
    config = load_config(None, ["data.train=[/data/a, s3://Your-Bucket/latents]"])  # loads: --help, the reports
    with pytest.raises(ConfigError) as refused:
        config.refuse_placeholders()
    assert str(refused.value) == PLACEHOLDER_MESSAGE
    for key, value, more in [
        ("data.val[0]", "s3://YOUR-BUCKET/heldout/", []),
        ("run.storage_path", "s3://your-bucket/runs", []),
        ("model.pretrained", "s3://YOUR-BUCKET/models/export", []),
        ("retrain.data_root", "/mnt/YOUR-BUCKET/daily", ["retrain.models_root=/m", "data.val=/v"]),
    ]:
        config = load_config(None, [*BASE, f"{key.partition('[')[0]}={value}", *more])
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: {re.escape(value)} names the shipped"):
            config.refuse_placeholders()
    load_config(None, [*BASE, "data.val=s3://my-bucket/your/bucket"]).refuse_placeholders()  # not the placeholder


@pytest.mark.parametrize("command", ["train", "retrain", "check"])
def test_every_command_refuses_the_shipped_placeholder_before_it_reads_anything_or_starts_ray(
    command, tmp_path, capsys, monkeypatch, without_ray
):
    """configs/small.yaml and configs/retrain.yaml as shipped: one line naming the key, exit 2, instead of whatever
    the store answers for a bucket that does not exist (a timeout, access denied) on the driver or every worker."""
    import ray

    from sdtrain.driver import check, cli

    def no_phase(*args):
        raise AssertionError("a check phase ran")

    monkeypatch.setattr(check, "_run_phase", no_phase)
    main = {"train": cli.train_main, "retrain": cli.retrain_main, "check": cli.check_main}[command]
    config = REPO / "configs" / ("retrain.yaml" if command == "retrain" else "small.yaml")
    assert main(["--config", str(config), f"run.storage_path={tmp_path}/runs"], config) == 2
    key = {
        "retrain": "data.val[0]: s3://YOUR-BUCKET/stable-diffusion/256-heldout/",
        "train": "data.train[0]: s3://YOUR-BUCKET/stable-diffusion/256/",
        "check": "data.train[0]: s3://YOUR-BUCKET/stable-diffusion/256/",
    }[command]
    assert f"error: {key} names the shipped configs' placeholder bucket (YOUR-BUCKET)" in capsys.readouterr().err
    assert not ray.is_initialized()
    assert not (tmp_path / "runs").exists()


WARMUP_MESSAGE = (
    "train.warmup_steps: 30 is more than train.max_steps=20: the learning rate warms up linearly to train.lr=0.001 "
    "over train.warmup_steps, so the run ends at about 0.000667, never reaching train.lr; set "
    "train.warmup_steps to at most train.max_steps (a few percent of it is usual), or raise train.max_steps"
)


@pytest.mark.parametrize("name", ["demo.yaml", "small.yaml", "sd2-base.yaml", "sdxl-base.yaml", "retrain.yaml"])
def test_every_shipped_config_reaches_its_learning_rate(name):
    overrides = ["retrain.data_root=/d", "retrain.models_root=/m"] if name == "retrain.yaml" else []
    assert load_config(REPO / "configs" / name, overrides).train.unreached_lr() is None


@pytest.mark.parametrize("command", ["train", "check"])
def test_a_warmup_past_the_runs_end_is_warned_of_before_anything_runs(command, tmp_path, capfd, without_ray):
    """A constant schedule with warmup never reaches train.lr when warmup_steps > max_steps: the whole run trains at
    a fraction of the learning rate it names. Warned of (tests and demos shorten max_steps where the lr does not
    matter), naming both keys, before the first check of the data (here: missing, so nothing starts)."""
    import ray

    from sdtrain.driver import cli

    keys = ["train.max_steps=20", "train.warmup_steps=30", "train.lr=1e-3", f"run.storage_path={tmp_path}/runs"]
    keys = [*keys, f"data.train={tmp_path}/missing"]
    main = {"train": cli.train_main, "check": cli.check_main}[command]
    (tmp_path / "tiny.yaml").write_text("model:\n  preset: tiny\n")
    assert (
        main(["--config", str(tmp_path / "tiny.yaml"), *keys], tmp_path / "tiny.yaml")
        == {"train": 2, "check": 1}[command]
    )  # the missing data: bad input to train; a failed phase to the check, which runs them all
    printed = capfd.readouterr()
    assert (printed.out + printed.err).count(f"WARNING [sdtrain] {WARMUP_MESSAGE}") == 1
    assert not ray.is_initialized()
    assert load_config(None, [*BASE, "train.max_steps=20", "train.warmup_steps=20"]).train.unreached_lr() is None


def test_an_env_var_ending_in_a_slash_leaves_no_empty_path_component_in_an_s3_uri():
    """$ANYSCALE_ARTIFACT_STORAGE/sdtrain/runs, expanded by the job's shell from a value that ends in '/': pyarrow
    refuses s3://bucket/prefix//sdtrain/runs (ArrowInvalid: Empty path component) on the driver and every worker."""
    storage = "s3://bucket/org/artifact_storage/"  # $ANYSCALE_ARTIFACT_STORAGE
    config = load_config(
        None,
        [
            f"data.train=[{storage}/sdtrain/latents-256, s3://bucket//a///b/]",
            f"data.val={storage}/sdtrain/heldout",
            f"run.storage_path={storage}/sdtrain/runs",
            f"model.pretrained={storage}/sdtrain/runs/sd-small-256/export",
            f"retrain.data_root={storage}/sdtrain/daily",
            f"retrain.models_root={storage}/sdtrain/models",
            "tracking.mlflow_tracking_uri=http://mlflow//x",  # not an s3:// URI: as given
        ],
    )
    assert config.data.train == ["s3://bucket/org/artifact_storage/sdtrain/latents-256", "s3://bucket/a/b/"]
    assert config.data.val == ["s3://bucket/org/artifact_storage/sdtrain/heldout"]
    assert config.run.storage_path == "s3://bucket/org/artifact_storage/sdtrain/runs"
    assert config.model.pretrained == "s3://bucket/org/artifact_storage/sdtrain/runs/sd-small-256/export"
    assert config.retrain.data_root == "s3://bucket/org/artifact_storage/sdtrain/daily"
    assert config.retrain.models_root == "s3://bucket/org/artifact_storage/sdtrain/models"
    assert config.tracking.mlflow_tracking_uri == "http://mlflow//x"
    assert load_config(None, ["data.train=/local//path"]).data.train == ["/local//path"]  # a local path: as given


def test_retrain_keys():
    config = load_config(
        None, ["retrain.data_root=/d", "retrain.models_root=/m", "data.val=/v", "retrain.date=2026-11-22"]
    )
    assert config.retrain.date == "2026-11-22" and config.data.train == []  # retraining picks its own partitions
    with pytest.raises(ConfigError, match=r"retrain\.date: must be a date YYYY-MM-DD, got '2026-13-01'"):
        load_config(None, BASE + ["retrain.date=2026-13-01"])
    with pytest.raises(ConfigError, match=r"retrain\.models_root: is required with the other retrain key"):
        load_config(None, BASE + ["retrain.data_root=/d"])
    with pytest.raises(ConfigError, match=r"data\.val: retraining needs a fixed held-out set"):
        load_config(None, ["retrain.data_root=/d", "retrain.models_root=/m"])
    with pytest.raises(ConfigError, match=r"retrain\.tolerance: must be >= 0"):
        load_config(None, BASE + ["retrain.tolerance=-0.1"])
    for marker in ("''", "a/b"):  # '' named the partition directory itself: every partition incomplete for good
        with pytest.raises(ConfigError, match=r"retrain\.complete_marker: must be a file name"):
            load_config(None, BASE + [f"retrain.complete_marker={marker}"])


def test_batch_layout_keeps_the_global_batch_at_every_world_size():
    config = load_config(None, BASE + ["train.global_batch_size=48", "scaling.num_workers=[2,4]"])
    layouts = [config.batch_layout(n) for n in (2, 3, 4)]
    assert [(layout.micro_batch, layout.accumulation) for layout in layouts] == [(4, 6), (4, 4), (4, 3)]
    assert [layout.rows_per_step for layout in layouts] == [24, 16, 12]
    config = load_config(
        None, BASE + ["train.global_batch_size=48", "train.micro_batch_size=8", "scaling.num_workers=[2,3]"]
    )
    layouts = [config.batch_layout(n) for n in (2, 3)]
    assert [(layout.micro_batch, layout.accumulation) for layout in layouts] == [(8, 3), (8, 2)]
    assert all(layout.world_size * layout.micro_batch * layout.accumulation == 48 for layout in layouts)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.snr_gamma=-1"], r"train\.snr_gamma: must be > 0 or null, got -1"),
        (["train.noise_offset=-0.1"], r"train\.noise_offset: must be >= 0"),
        (["train.input_perturbation=-1"], r"train\.input_perturbation: must be >= 0"),
        (["train.caption_dropout_prob=1"], r"train\.caption_dropout_prob: must be in \[0, 1\), got 1"),
        (["train.ema_decay=1.5"], r"train\.ema_decay: must be in \(0, 1\) or null, got 1\.5"),
        (["train.ema_start_step=-1"], r"train\.ema_start_step: must be >= 0"),
        (["train.strategy=deepspeed"], r"train\.strategy: must be one of ddp, fsdp"),
        (
            ["train.strategy=fsdp", "train.precision=16-mixed"],
            r"train\.precision: 16-mixed cannot run with train\.strategy=fsdp",
        ),
        (
            ["train.strategy=fsdp", "train.channels_last=true"],
            r"train\.channels_last: cannot be used with train\.strategy=fsdp",
        ),
        (["train.precision=16-mixed", "scaling.use_gpu=false"], r"train\.precision: 16-mixed needs GPUs"),
        (["train.ddp_bucket_mb=0"], r"train\.ddp_bucket_mb: must be in \[1, 1048576\] MiB, got 0"),
        (["train.gradient_compression=fp16"], r"train\.gradient_compression: must be one of none, bf16"),
        (["train.fsdp_param_dtype=float16"], r"train\.fsdp_param_dtype: must be one of auto, float32, bfloat16"),
        (
            ["train.fsdp_param_dtype=bfloat16"],
            r"train\.fsdp_param_dtype: applies only to train\.strategy=fsdp \(strategy is ddp\); leave it auto",
        ),
        (["train.attention=flash"], r"train\.attention: must be one of sdpa, eager"),
        (["train.compile=3"], r"train\.compile: expected bool"),
        (["model.prediction_type=sample"], r"model\.prediction_type: expected epsilon \| v_prediction \| null"),
        (["data.latent_scaling_factor=0"], r"data\.latent_scaling_factor: must be > 0 or null"),
        (
            ["data.unconditional_caption=empty.txt"],
            r"data\.unconditional_caption: must be auto, zeros or the path of a \.npy file",
        ),
        (
            ["checkpoint.score_attribute=accuracy"],
            r"checkpoint\.score_attribute: expected val_loss \| loss \| fd_dinov2 \| fd_inception \| clip_score \| "
            r"class_agreement \| null",
        ),
        (["checkpoint.score_attribute=val_loss"], r"checkpoint\.score_attribute: val_loss needs data\.val"),
        (
            [
                "checkpoint.score_attribute=val_loss",
                "data.val=/v",
                "run.val_every_n_steps=300",
                "checkpoint.every_n_steps=1000",
            ],
            r"checkpoint\.score_attribute: val_loss needs a validation loss with every checkpoint",
        ),
    ],
)
def test_recipe_keys_are_validated(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, BASE + overrides)


def test_recipe_defaults_change_nothing_and_options_reach_the_model():
    from sdtrain.model.unet import noise_scheduler_config

    config = load_config(None, BASE)
    train = config.train
    assert (
        train.snr_gamma,
        train.noise_offset,
        train.input_perturbation,
        train.caption_dropout_prob,
        train.ema_decay,
    ) == (None, 0, 0, 0, None)
    assert (train.strategy, train.compile, train.channels_last, train.gradient_checkpointing, train.attention) == (
        "ddp",
        False,
        False,
        False,
        "sdpa",
    )
    # Unset: model.pretrained's scheduler's, else epsilon (resolved on the driver: tests/test_prediction_type.py).
    assert config.model.prediction_type is None and config.export.enabled is True
    assert noise_scheduler_config(config.model)["prediction_type"] == "epsilon"
    v = load_config(None, BASE + ["model.prediction_type=v_prediction", "model.preset=tiny"])
    scheduler = noise_scheduler_config(v.model)
    assert scheduler["prediction_type"] == "v_prediction" and scheduler["clip_sample"] is False
    assert (
        load_config(
            None,
            BASE
            + [
                "checkpoint.score_attribute=val_loss",
                "data.val=/v",
                "run.val_every_n_steps=500",
                "checkpoint.every_n_steps=1000",
            ],
        ).checkpoint.score_attribute
        == "val_loss"
    )


def test_gpu_options_and_strategies_are_built():
    """What the worker applies; tests/test_options.py trains with each of them."""
    import torch
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0
    from lightning.pytorch.strategies import ModelParallelStrategy
    from ray.train.lightning import RayDDPStrategy

    from sdtrain.config.schema import ModelConfig, TrainConfig
    from sdtrain.model.unet import build_unet, noise_scheduler_config, unet_config
    from sdtrain.train.module import DiffusionModule
    from sdtrain.train.strategy import (
        FSDP2Strategy,
        RayModelParallelStrategy,
        apply_options,
        build_strategy,
        mixed_precision,
    )

    assert isinstance(build_strategy(TrainConfig(), 2, on_ray=True), RayDDPStrategy)
    assert build_strategy(TrainConfig(), 1, on_ray=False) == "auto"
    fsdp = build_strategy(TrainConfig(strategy="fsdp"), 4, on_ray=True)
    assert type(fsdp) is RayModelParallelStrategy and (fsdp._data_parallel_size, fsdp._tensor_parallel_size) == (4, 1)
    assert fsdp._save_distributed_checkpoint is False  # one full file, as DDP writes
    assert type(build_strategy(TrainConfig(strategy="fsdp"), 1, on_ray=False)) is FSDP2Strategy
    assert issubclass(FSDP2Strategy, ModelParallelStrategy) and issubclass(RayModelParallelStrategy, FSDP2Strategy)
    # FSDP2's mixed-precision policy: bf16 parameters under bf16-mixed, float32 otherwise; float32 gradient
    # reduction unless compressed (tests/test_ddp_settings.py trains each on 2 ranks and counts the bytes).
    bf16, fp32 = torch.bfloat16, torch.float32
    for train, precision, dtypes in [
        ({}, "bf16-mixed", (bf16, fp32)),
        ({}, "32-true", (fp32, fp32)),
        ({"fsdp_param_dtype": "float32"}, "bf16-mixed", (fp32, fp32)),
        ({"fsdp_param_dtype": "bfloat16"}, "32-true", (bf16, fp32)),
        ({"gradient_compression": "bf16"}, "bf16-mixed", (bf16, bf16)),
        ({"gradient_compression": "bf16"}, "32-true", (fp32, bf16)),
    ]:
        policy = mixed_precision(TrainConfig(strategy="fsdp", **train), precision)
        assert (policy.param_dtype, policy.reduce_dtype) == dtypes, (train, precision)

    model = ModelConfig(preset="tiny")
    meta = CheckpointMeta("test", unet_config(model), noise_scheduler_config(model), (4, 16, 16), (5, 32))

    def module(**train):
        torch.manual_seed(0)
        return DiffusionModule(build_unet(model), meta.noise_scheduler_config, TrainConfig(**train), meta)

    plain = module()
    apply_options(plain, plain.train_config)
    assert all(type(p) is AttnProcessor2_0 for p in plain.unet.attn_processors.values())
    assert not plain.unet.is_gradient_checkpointing and plain.unet._compiled_call_impl is None

    tuned = module(attention="eager", channels_last=True, gradient_checkpointing=True, compile=True, ema_decay=0.99)
    apply_options(tuned, tuned.train_config)
    for unet in (tuned.unet, tuned.ema_unet):
        assert all(type(p) is AttnProcessor for p in unet.attn_processors.values())
        assert unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert tuned.unet.is_gradient_checkpointing and tuned.unet._compiled_call_impl is not None
    assert list(tuned.unet.state_dict()) == list(plain.unet.state_dict())  # checkpoints keep the UNet's names
    # eager attention and channels_last compute the same function (compile left out: a CPU compile takes minutes)
    eager = module(attention="eager", channels_last=True)
    apply_options(eager, eager.train_config)
    x, t, c = torch.randn(2, 4, 16, 16), torch.tensor([3, 600]), torch.randn(2, 5, 32)
    with torch.no_grad():
        torch.testing.assert_close(eager.unet(x, t, c).sample, plain.unet(x, t, c).sample, rtol=1e-4, atol=1e-5)


def test_an_impossible_unet_or_a_missing_pretrained_directory_fails_on_the_driver(tmp_path, monkeypatch):
    from sdtrain.config.schema import ModelConfig
    from sdtrain.errors import ConfigError
    from sdtrain.model.unet import check_unet, unet_config

    check_unet(ModelConfig(preset="tiny"), (4, 16, 16), (77, 32))  # on the meta device: no weights allocated
    with pytest.raises(ConfigError, match=r"^model.unet: model.preset=tiny with model.unet=\{'block_out_channels'"):
        check_unet(ModelConfig(preset="tiny", unet={"block_out_channels": [32, 64, 128]}), (4, 16, 16), (77, 32))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()  # models/sd2 looks like a hub id, but models/ is a local directory
    for missing in ("models/sd2", "./sd2", str(tmp_path / "sd2"), "a/b/c"):
        with pytest.raises(ConfigError, match=rf"^model.pretrained: directory {missing} does not exist"):
            unet_config(ModelConfig(pretrained=missing))


@pytest.mark.parametrize("out_channels", [8, 1])
def test_a_unet_whose_prediction_is_not_of_the_latents_shape_fails_on_the_driver(out_channels):
    """8 channels fail the first step's loss; 1 used to train silently, broadcast against the 4 of the latents."""
    from sdtrain.config.schema import ModelConfig
    from sdtrain.errors import ConfigError
    from sdtrain.model.unet import check_unet

    with pytest.raises(
        ConfigError,
        match=rf"^model.unet: .* predicts tensors of shape \({out_channels}, 16, 16\) "
        r"for latents of shape \(4, 16, 16\).*set model.unet.out_channels to 4",
    ):
        check_unet(ModelConfig(preset="tiny", unet={"out_channels": out_channels}), (4, 16, 16), (77, 32))


def test_a_unet_with_parameters_the_loss_never_reaches_fails_on_the_driver():
    """An LCM-distilled UNet's guidance embedding (time_cond_proj_dim) is never fed: every worker's DDP refused the
    unused parameter at its first step; the driver's meta-device backward names it."""
    from sdtrain.config.schema import ModelConfig
    from sdtrain.errors import ConfigError
    from sdtrain.model.unet import check_unet

    with pytest.raises(
        ConfigError, match=r"never reaches \(time_embedding\.cond_proj\.weight\).*time_cond_proj_dim=16"
    ):
        check_unet(ModelConfig(preset="tiny", unet={"time_cond_proj_dim": 16}), (4, 16, 16), (77, 32))


def _numeric_keys(sections):
    """(section.key, annotation) of every int or float key of the config sections (unions with null included)."""
    import dataclasses
    import typing

    for name, cls in sections.items():
        for key, tp in typing.get_type_hints(cls).items():
            if key == "section" or key not in {f.name for f in dataclasses.fields(cls)}:
                continue
            kinds = set(typing.get_args(tp)) | {tp}
            if kinds & {int, float}:
                yield f"{name}.{key}", float if float in kinds else int


def test_every_numeric_key_refuses_non_finite_and_negative_values_naming_the_key():
    """NaN passes every range check, inf most; a negative seed used to fail inside Ray. Every numeric key of
    training's and preprocessing's configs refuses them with one error naming the key, before anything runs."""
    from sdtrain.config.schema import SECTIONS as TRAINING
    from sdtrain.preprocess.config import SECTIONS as PREPROCESSING
    from sdtrain.preprocess.config import PreprocessConfig

    loaders = [
        (TRAINING, lambda o: load_config(None, [*BASE, o])),
        (PREPROCESSING, lambda o: load_config(None, ["input.paths=x", "output.path=y", o], PreprocessConfig)),
    ]
    checked = 0
    for sections, load in loaders:
        for key, kind in _numeric_keys(sections):
            bad = ["nan", ".inf", "-5"] if kind is float else ["-5"]
            for value in bad:
                with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: "):
                    load(f"{key}={value}")
                checked += 1
    assert checked > 50  # every section's numbers, not an empty walk


@pytest.mark.parametrize(
    "override, message",
    [
        # int(val_memory_gb * 1e9) in each worker: an OverflowError there, after Ray started.
        ("data.val_memory_gb=1e300", r"data\.val_memory_gb: must be in \[0, 1000000\] GB, got 1e\+300$"),
        # bucket_cap_mb * 2**20 bytes, a C++ int64 in DDP's reducer: a TypeError in each worker.
        (
            "train.ddp_bucket_mb=10000000000000",
            r"train\.ddp_bucket_mb: must be in \[1, 1048576\] MiB, got 10000000000000$",
        ),
        # Ray counts resources in integers of 0.0001: a finer fraction is refused when the task is submitted.
        ("scaling.cpus_per_worker=0.00001", r"scaling\.cpus_per_worker: must be auto or in \[0\.0001, 1000000\]"),
        ("scaling.cpus_per_worker=1e300", r"scaling\.cpus_per_worker: must be .* got 1e\+300$"),
        ("eval.num_cpus=0.00001", r"eval\.num_cpus: must be 0 or in \[0\.0001, 1000000\], got 1e-05$"),
        ("eval.num_gpus=1e300", r"eval\.num_gpus: must be 0 or in \[0\.0001, 1000000\], got 1e\+300$"),
        # Lightning's seed_everything in each worker refuses a seed past an unsigned 32-bit integer.
        ("train.seed=4294967296", r"train\.seed: must be in \[0, 2\*\*32\) .*, got 4294967296$"),
    ],
)
def test_numbers_a_worker_converts_are_bounded_naming_the_key_value_and_range(override, message):
    """Numbers that a worker, DDP or Ray turns into integers (bytes, resource units) fail there when out of their
    range, after Ray started: the config refuses them first."""
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*BASE, override])
    key = override.partition("=")[0]
    section, name = key.split(".")
    highest = {"data.val_memory_gb": 1e6, "train.ddp_bucket_mb": 2**20, "train.seed": 2**32 - 1}.get(key, 1e6)
    config = load_config(None, [*BASE, f"{key}={highest}"])  # the bounds themselves are allowed
    assert getattr(getattr(config, section), name) == highest


def test_an_old_key_name_is_refused_naming_its_new_one(tmp_path, capsys):
    """Keys were renamed before any release (the run section was split): one name per key, so an old name given
    once, on the command line over a shipped config that sets the new one, is refused naming the new name, never
    as "set too" (which it was), nor taken with a notice."""
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "configs" / "demo.yaml", ["run.checkpoint_every_n_steps=8"])
    assert str(e.value) == (
        "run.checkpoint_every_n_steps: was renamed checkpoint.every_n_steps; set checkpoint.every_n_steps instead"
    )
    (tmp_path / "old.yaml").write_text("data:\n  train: x\ntrain:\n  max_bad_steps: 7\n")
    with pytest.raises(ConfigError, match=r"^train\.max_bad_steps: was renamed train\.max_nonfinite_steps; "):
        load_config(tmp_path / "old.yaml")
    for old, new in Config.RENAMED.items():
        with pytest.raises(ConfigError, match=rf"^{re.escape(old)}: was renamed {re.escape(new)}; "):
            load_config(None, [*BASE, f"{old}=1"])
    assert capsys.readouterr().err == ""  # refused, not taken with a notice
    # Every old name maps to a key that exists, and none is a key itself.
    keys = {key for key, *_ in describe_keys()}
    assert set(Config.RENAMED.values()) <= keys and not set(Config.RENAMED) & keys


def test_every_local_path_the_config_names_is_made_absolute_for_the_workers(tmp_path, monkeypatch):
    """Ray Train V2 changes each worker into a directory of its own, so a relative path a worker reads (the empty
    prompt's embedding, the pretrained UNet, a grid's captions, an evaluator's weights) would name another file
    there: on the driver every path Config.storage_uris names is made absolute; URIs and hub ids stay."""
    import numpy as np

    from sdtrain.driver.paths import with_absolute_paths
    from sdtrain.model.recipe import load_unconditional_caption
    from sdtrain.storage.uris import is_uri

    monkeypatch.chdir(tmp_path)
    for directory in ("assets", "models/base", "models/eval"):
        (tmp_path / directory).mkdir(parents=True)
    np.save("assets/empty.npy", np.zeros((77, 32), np.float32))
    relative = {
        "data.train": "train",
        "data.val": "val",
        "data.unconditional_caption": "assets/empty.npy",
        "model.pretrained": "models/base",
        "run.storage_path": "runs",
        "eval.dinov2": "models/eval/dinov2",
        "eval.inception": "models/eval/inception.pt",
        "eval.clip": "models/eval/clip",
        "eval.text_column": "caption",
        "eval.vae": "models/eval/vae",
        "export.base_model": "models/base",
        "sample_grid.captions": "assets/grid.npy",
        "retrain.data_root": "data",
        "retrain.models_root": "registry",
    }
    config = with_absolute_paths(load_config(None, [f"{key}={value}" for key, value in relative.items()]))
    paths = dict(config.storage_uris())
    assert {key.split("[")[0] for key in paths} >= relative.keys() - {"eval.text_column"}
    assert all(os.path.isabs(path) for path in paths.values()), paths
    assert paths["model.pretrained"] == str(tmp_path / "models" / "base")
    monkeypatch.chdir(tmp_path / "models")  # a worker's own directory
    assert load_unconditional_caption(config.data.unconditional_caption, (77, 32)).shape == (77, 32)

    hub = "stabilityai/stable-diffusion-2-base"
    overrides = [f"model.pretrained={hub}", "data.train=s3://bucket/latents", "sample_grid.prompts=prompts.txt"]
    kept = with_absolute_paths(load_config(None, overrides))
    assert kept.model.pretrained == hub and kept.data.train == ["s3://bucket/latents"] and is_uri(kept.data.train[0])
    assert kept.sample_grid.prompts == str(tmp_path / "models" / "prompts.txt")


@pytest.mark.parametrize(
    "uri, absolute",
    [
        ("sqlite:///mlflow.db", "sqlite:///{cwd}/mlflow.db"),
        ("sqlite+pysqlite:///db/m.db?mode=rwc", "sqlite+pysqlite:///{cwd}/db/m.db?mode=rwc"),
        ("file:mlruns", "file://{cwd}/mlruns"),
        ("./mlruns", "{cwd}/mlruns"),
        ("sqlite:////abs/m.db", "sqlite:////abs/m.db"),
        ("sqlite://", "sqlite://"),
        ("file:///abs/mlruns", "file:///abs/mlruns"),
        ("http://mlflow:5000", "http://mlflow:5000"),
        ("databricks", "databricks"),
    ],
)
def test_a_relative_staging_dir_and_local_mlflow_store_are_made_absolute_on_the_driver(
    tmp_path, monkeypatch, uri, absolute
):
    """checkpoint.staging_dir and a local MLflow store named relatively (in the config or MLFLOW_TRACKING_URI, which
    the workers get from the driver's environment) resolved in each worker's own directory (Ray Train V2 changes into
    it): checkpoints staged and MLflow runs written there, not where the driver's export and evaluations look."""
    from sdtrain.driver.paths import with_absolute_paths
    from sdtrain.driver.trackers import tracker_env

    monkeypatch.chdir(tmp_path)
    overrides = ["data.train=/x", "checkpoint.staging_dir=scratch/staging", f"tracking.mlflow_tracking_uri={uri}"]
    config = with_absolute_paths(load_config(None, overrides))
    assert config.checkpoint.staging_dir == str(tmp_path / "scratch" / "staging")
    assert config.tracking.mlflow_tracking_uri == absolute.format(cwd=tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert tracker_env()["MLFLOW_TRACKING_URI"] == absolute.format(cwd=tmp_path)
