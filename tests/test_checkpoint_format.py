"""The checkpoint format's metadata and the one model loader's errors (the loads themselves are
tested where checkpoints are written: test_module, test_recipe, test_export_generate, test_train_ray)."""

import pytest
import torch

from sdtrain.artifacts.checkpoint_format import CHECKPOINT_META_KEY, CheckpointMeta
from sdtrain.artifacts.loading import load_model
from sdtrain.config.schema import Config, ModelConfig
from sdtrain.errors import SdtrainError
from sdtrain.model.unet import noise_scheduler_config, unet_config
from sdtrain.storage.run_layout import CHECKPOINT_FILE
from sdtrain.train.build import checkpoint_meta


def test_metadata_round_trips_as_plain_data_and_names_what_is_missing():
    config = Config.from_dict({"model": {"preset": "tiny"}, "data": {"train": ["d/train"]}})
    meta = checkpoint_meta(
        config, [4, 16, 16], [77, 32], latent_scaling_factor=0.18215, latent_classifier="sdtrain.demo.digits"
    )
    raw = meta.to_dict()
    assert raw["latent_shape"] == [4, 16, 16] and raw["caption_shape"] == [77, 32]  # lists: weights_only loads them
    assert CheckpointMeta.from_dict(raw, "x") == meta
    assert meta.latent_classifier == "sdtrain.demo.digits"
    assert meta.latent_scaling_factor == 0.18215 and meta.latent_scale == 1.0
    # An older writer's extra key is ignored; a missing one is named with the checkpoint.
    assert CheckpointMeta.from_dict({**raw, "retired_key": 1}, "x") == meta
    del raw["caption_shape"]
    with pytest.raises(ValueError, match=r"runs/a/checkpoint_000000004: .* lacks caption_shape"):
        CheckpointMeta.from_dict(raw, "runs/a/checkpoint_000000004")


def test_load_model_says_what_a_path_is_not(tmp_path):
    with pytest.raises(SdtrainError, match="does not exist"):
        load_model(str(tmp_path / "missing"))
    with pytest.raises(SdtrainError, match="neither an export .* nor a run directory"):
        load_model(str(tmp_path))  # an empty directory
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")  # a file given as the model: torch's error would say
    with pytest.raises(SdtrainError, match=r"notes\.txt is no sdtrain checkpoint .*\(UnpicklingError: [^.]*\)\. Name"):
        load_model(str(tmp_path / "notes.txt"))  # to load it with weights_only=False, running code from the file
    plain = tmp_path / "plain"
    plain.mkdir()
    torch.save({"state_dict": {}, "global_step": 1}, plain / CHECKPOINT_FILE)
    with pytest.raises(SdtrainError, match="without sdtrain's metadata"):
        load_model(str(plain))
    model = ModelConfig(preset="tiny")
    meta = CheckpointMeta("test", unet_config(model), noise_scheduler_config(model), (4, 16, 16), (77, 32))
    torch.save({"state_dict": {}, "global_step": 1, CHECKPOINT_META_KEY: meta.to_dict()}, plain / CHECKPOINT_FILE)
    with pytest.raises(SdtrainError, match="holds no EMA weights"):
        load_model(str(plain), weights="ema")


def test_a_damaged_record_of_committed_checkpoints_is_named(tmp_path):
    from ray.train.v2._internal.constants import CHECKPOINT_MANAGER_SNAPSHOT_FILENAME

    from sdtrain.controller.data_hook import committed_run

    run_dir = tmp_path / "runs" / "a"
    assert committed_run(None, str(run_dir)) is None  # nothing there: a fresh run
    run_dir.mkdir(parents=True)
    (run_dir / CHECKPOINT_MANAGER_SNAPSHOT_FILENAME).write_text('{"ray_version": "2.60.0", "checkpoint_results": [')
    with pytest.raises(
        SdtrainError, match=r"record of the run's checkpoints .* cannot be read: .* run.start_fresh=true"
    ):
        committed_run(None, str(run_dir))
