"""The model registry on a local directory and on a real S3-protocol server."""

import json

import pytest
import torch
from diffusers import DDPMScheduler, UNet2DConditionModel

from sdtrain.artifacts.loading import load_model
from sdtrain.artifacts.registry import ModelRegistry
from sdtrain.config.schema import ModelConfig
from sdtrain.errors import DataError
from sdtrain.model.presets import PRESETS
from sdtrain.model.unet import build_unet, noise_scheduler_config


def _exercise(root: str) -> None:
    registry = ModelRegistry(root)
    assert registry.versions() == [] and registry.production() is None
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**PRESETS["tiny"])
    scheduler = DDPMScheduler(clip_sample=False, num_train_timesteps=700)
    first = registry.write_version(unet, scheduler, {"schedule_date": "2026-11-01", "promoted": True})
    second = registry.write_version(unet, scheduler, {"schedule_date": "2026-11-02", "promoted": False})
    assert (first, second) == ("v0001", "v0002") and registry.versions() == ["v0001", "v0002"]
    assert registry.production() is None  # writing a version never moves the pointer
    registry.set_production(first)
    assert registry.production() == "v0001" and registry.manifest("v0002")["promoted"] is False
    with pytest.raises(ValueError, match="v0009 is not a complete version"):
        registry.set_production("v0009")
    production = load_model(registry.location(registry.production()))
    loaded, loaded_scheduler = production.unet, production.noise_scheduler
    for (name, a), b in zip(unet.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert loaded_scheduler.config.num_train_timesteps == 700
    # A version is a valid model.pretrained: weights and schedule for a warm start, from any node.
    model = ModelConfig(preset="tiny", pretrained=registry.location("v0001"))
    assert torch.equal(build_unet(model).conv_in.weight, unet.conv_in.weight)
    assert noise_scheduler_config(model)["num_train_timesteps"] == 700


def test_registry_on_local_disk(tmp_path):
    _exercise(str(tmp_path / "models"))
    assert json.loads((tmp_path / "models" / "production.json").read_text()) == {"version": "v0001"}
    (tmp_path / "models" / "versions" / "v0003" / "unet").mkdir(parents=True)  # a write cut short: no manifest
    registry = ModelRegistry(str(tmp_path / "models"))
    assert registry.versions() == ["v0001", "v0002"]
    assert (
        registry.write_version(
            UNet2DConditionModel(**PRESETS["tiny"]), DDPMScheduler(), {"schedule_date": "x", "promoted": False}
        )
        == "v0004"
    )
    assert not list((tmp_path / "models").rglob("*.tmp"))  # manifests and the pointer were moved into place whole

    # What a crash or a hand edit can leave is refused, naming the file, never joined into a path.
    (tmp_path / "models" / "versions" / "v0002" / "manifest.json").write_text('{"version": "v0002", "promo')
    with pytest.raises(DataError, match=r"v0002/manifest.json is not valid JSON"):
        registry.manifest("v0002")
    (tmp_path / "models" / "production.json").write_text('{"version": "../../elsewhere"}')
    with pytest.raises(DataError, match=r'production.json must hold \{"version": "vNNNN"\}'):
        registry.production()


@pytest.mark.timeout(120)
def test_registry_on_s3(s3_bucket):
    import boto3

    _exercise(f"{s3_bucket}/models")
    # What landed in the bucket: the pointer object, and complete versions (manifest included).
    s3 = boto3.client("s3")
    pointer = s3.get_object(Bucket="sdtrain-test", Key="models/production.json")["Body"].read()
    assert json.loads(pointer) == {"version": "v0001"}
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket="sdtrain-test", Prefix="models/")["Contents"]}
    for version in ("v0001", "v0002"):
        assert {f"models/versions/{version}/manifest.json", f"models/versions/{version}/unet/config.json"} <= keys
    assert not [k for k in keys if k.endswith(".tmp")]  # the staged pointer was moved, not left behind
