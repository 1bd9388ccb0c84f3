"""What preprocessing decides about its model and its encoders on the driver, without Ray: whether the model is
SDXL-shaped (never guessed where the hub cannot answer), a model that cannot be read refused before the output records
anything, the GPUs each encoder asks for, the settings a re-run must keep, and pixels scaled on the encoder's device.
Real tiny models (tests/support) and a real Hugging Face cache layout, nothing mocked."""

from __future__ import annotations

import json
import shlex
import tracemalloc
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from support.log_lines import LogLines
from support.tiny_models import write_tiny_sd_model, write_tiny_sdxl_model

from sdtrain.config.loader import load_config
from sdtrain.errors import ConfigError, DataError
from sdtrain.model.encoders import encode_images, has_second_encoder, load_vae, to_unit_range, unit_range_on
from sdtrain.preprocess.config import PreprocessConfig
from sdtrain.preprocess.job import encoder_gpus, run_preprocess
from sdtrain.preprocess.outputs import RESUME_KEYS, SETTINGS_FILE, check_settings

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory) -> str:
    return write_tiny_sd_model(str(tmp_path_factory.mktemp("sd") / "tiny-sd"))


@pytest.fixture(scope="module")
def tiny_sdxl(tmp_path_factory) -> str:
    return write_tiny_sdxl_model(str(tmp_path_factory.mktemp("sdxl") / "tiny-sdxl"))


@pytest.fixture
def offline_hub(tmp_path, monkeypatch) -> Path:
    """HF_HUB_OFFLINE=1 with an empty Hugging Face cache of this test's own (huggingface_hub read both at import)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def _cache_model_index(cache: Path, repo_id: str, index: dict) -> None:
    """``index`` as the model_index.json of ``repo_id`` in the cache's own layout (refs/main -> a snapshot)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "model_index.json").write_text(json.dumps(index))


SDXL_INDEX = {
    "_class_name": "StableDiffusionXLPipeline",
    "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
}
SD_INDEX = {"_class_name": "StableDiffusionPipeline", "text_encoder": ["transformers", "CLIPTextModel"]}


# --- encode.num_gpus: auto ---


def test_auto_gpus_on_a_cluster_without_gpus_warns_naming_the_key_and_the_gpu_job_asks_for_one():
    """auto sees only the nodes already up: on an autoscaling cluster whose GPU nodes have not joined it became 0,
    and the encoders ran on CPUs in float32, silently."""
    with LogLines() as lines:
        assert encoder_gpus("auto", 0) == 0
    (warning,) = lines.messages
    assert warning.startswith("encode.num_gpus: auto: the cluster has no GPU now") and "CPUs" in warning
    assert "not GPU nodes an autoscaling cluster has yet to start" in warning and "encode.num_gpus=1" in warning
    with LogLines() as lines:
        assert encoder_gpus("auto", 4.0) == 1 and encoder_gpus(0.5, 0) == 0.5 and encoder_gpus(0, 8) == 0
    assert lines.messages == ["encode.num_gpus: auto: the cluster has 4 GPU(s) now: 1 GPU per encoder actor"]
    # The GPU job never leaves it to auto: its GPU nodes start after the driver.
    argv = shlex.split(yaml.safe_load((ROOT / "preprocess_job.yaml").read_text())["entrypoint"])
    config = load_config(ROOT / argv[argv.index("--config") + 1], argv[argv.index("--config") + 2 :], PreprocessConfig)
    assert config.encode.num_gpus == 1


# --- SDXL-shaped or not, never guessed ---


def test_a_hub_model_the_hub_cannot_answer_for_is_an_error_not_sd(offline_hub):
    """Offline (or rate-limited), the hub's lookup failed and an SDXL model was taken for SD 1/2: the wrong
    embeddings width, its VAE in float16."""
    with pytest.raises(DataError) as raised:
        has_second_encoder("stabilityai/stable-diffusion-xl-base-1.0")
    message = str(raised.value)
    assert message.startswith("stabilityai/stable-diffusion-xl-base-1.0: cannot tell whether this hub model is SDXL")
    assert "model_index.json is not in the local Hugging Face cache" in message and "Error" in message
    assert "huggingface-cli download stabilityai/stable-diffusion-xl-base-1.0" in message and "\n" not in message


def test_a_cached_hub_model_is_answered_offline_from_its_model_index(offline_hub):
    _cache_model_index(offline_hub, "org/an-sdxl", SDXL_INDEX)
    _cache_model_index(offline_hub, "org/an-sd2", SD_INDEX)
    assert has_second_encoder("org/an-sdxl") is True
    assert has_second_encoder("org/an-sd2") is False


def test_local_models_are_answered_by_their_index_or_their_directories(tiny_sd, tiny_sdxl, tmp_path, offline_hub):
    assert has_second_encoder(tiny_sdxl) is True and has_second_encoder(tiny_sd) is False
    indexed = tmp_path / "indexed"
    indexed.mkdir()
    (indexed / "model_index.json").write_text(json.dumps(SDXL_INDEX))
    with pytest.raises(DataError, match=r"indexed: its model_index.json names text_encoder_2, but it has no text_enc"):
        has_second_encoder(str(indexed))  # an SDXL model downloaded in part: said, not taken for SD
    (indexed / "model_index.json").write_text(json.dumps(SD_INDEX))
    assert has_second_encoder(str(indexed)) is False
    with pytest.raises(DataError, match=r"^/no/such/model is not a directory"):
        has_second_encoder("/no/such/model")  # never asked of the hub as a repository id


# --- a model that cannot be read records nothing ---


def _config(tmp_path: Path, model: str, *overrides: str) -> PreprocessConfig:
    from PIL import Image

    folder = tmp_path / "images"
    if not folder.is_dir():
        folder.mkdir()
        Image.new("RGB", (40, 40), (200, 10, 10)).save(folder / "a.jpg")
        (folder / "captions.jsonl").write_text(json.dumps({"file_name": "a.jpg", "caption": "red"}) + "\n")
    return load_config(
        None,
        [f"input.paths={folder}", "input.format=folder", f"output.path={tmp_path / 'out'}", f"encode.model={model}"]
        + ["image.resolution=32", *overrides],
        PreprocessConfig,
    )


def test_a_model_path_with_a_typo_fails_in_one_line_before_anything_is_recorded(tmp_path, tiny_sd):
    """It failed with a raw OSError after _settings.json pinned the typo, and the corrected run was refused."""
    typo = tiny_sd + "-typo"
    with pytest.raises(DataError) as raised:
        run_preprocess(_config(tmp_path, typo), max_shards=0)  # the driver's part: no Ray
    message = str(raised.value)
    assert message.startswith(f"encode.model: {typo} is not a directory") and "\n" not in message
    assert not (tmp_path / "out" / SETTINGS_FILE).exists()
    corrected = run_preprocess(_config(tmp_path, tiny_sd), max_shards=0)
    assert corrected.shards_total == 1 and (tmp_path / "out" / SETTINGS_FILE).is_file()
    # A directory that is no model: the key, the model and diffusers' reason, in one line.
    with pytest.raises(DataError, match=rf"^encode.model: cannot load {tmp_path}: .*config.json") as raised:
        run_preprocess(_config(tmp_path, str(tmp_path), "output.path=" + str(tmp_path / "other")), max_shards=0)
    assert "\n" not in str(raised.value) and not (tmp_path / "other").exists()


def test_a_model_without_its_tokenizer_fails_in_one_line_before_anything_is_recorded(tmp_path, tiny_sd):
    """A model whose VAE reads but whose tokenizer is missing or broken failed after _settings.json recorded it (in
    write_unconditional, with transformers' "Couldn't instantiate the backend tokenizer", naming no folder), and the
    corrected run was refused."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_sd, model)
    shutil.rmtree(model / "tokenizer")
    with pytest.raises(DataError) as raised:
        run_preprocess(_config(tmp_path, str(model)), max_shards=0)
    assert str(raised.value) == (
        f"encode.model: {model} has no tokenizer/: a diffusers model holds vae/, tokenizer/, text_encoder/"
    )
    assert not (tmp_path / "out" / SETTINGS_FILE).exists()
    (model / "tokenizer").mkdir()  # there, but holding nothing a tokenizer loads from
    with pytest.raises(DataError, match=rf"^encode.model: cannot load {model}: ") as raised:
        run_preprocess(_config(tmp_path, str(model)), max_shards=0)
    assert "\n" not in str(raised.value) and not (tmp_path / "out" / SETTINGS_FILE).exists()
    shutil.rmtree(model / "tokenizer")
    shutil.copytree(Path(tiny_sd) / "tokenizer", model / "tokenizer")
    assert run_preprocess(_config(tmp_path, str(model)), max_shards=0).shards_total == 1


# --- the settings a re-run must keep ---


def test_a_rerun_must_keep_the_pooled_column_name(tmp_path):
    """The pooled embedding's column was not among the resumed settings: a re-run could name it otherwise, and the
    shards of one output disagree on it."""
    output = str(tmp_path / "out")

    def settings(*overrides: str) -> dict:
        config = load_config(None, ["input.paths=x", f"output.path={output}", *overrides], PreprocessConfig).to_dict()
        return {key: config[key.split(".")[0]][key.split(".")[1]] for key in RESUME_KEYS}  # as run_preprocess

    check_settings(output, settings())
    check_settings(output, settings("encode.batch_size=8"))
    with pytest.raises(ConfigError, match=r"^output.pooled_column: .* written with 'caption_pooled', this run has 'p'"):
        check_settings(output, settings("output.pooled_column=p"))


# --- pixels scaled on the encoder's device ---


def test_pixels_go_to_the_device_as_uint8_and_scale_there_to_the_host_paths_values(tiny_sd):
    pixels = np.random.default_rng(0).integers(0, 256, (2, 128, 128, 3), dtype=np.uint8)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        host = torch.from_numpy(to_unit_range(pixels)).to("cpu", dtype)
        assert torch.equal(unit_range_on(pixels, "cpu", dtype), host), dtype  # bit for bit
    read_only = pixels.copy()
    read_only.flags.writeable = False  # as Ray Data hands a batch: nothing warns, nothing is written
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(unit_range_on(read_only, "cpu", torch.float32), unit_range_on(pixels, "cpu", torch.float32))
    vae = load_vae(tiny_sd)
    encode_images(vae, pixels, "mean")  # warmed up: nothing lazily allocated below
    tracemalloc.start()  # traces numpy's allocations (not torch's): a float32 copy of the batch on the host is
    try:
        latents = encode_images(vae, pixels, "mean")
        host_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert host_peak < pixels.nbytes, (host_peak, pixels.nbytes)  # 4x the uint8 had it been made
    assert latents.shape == (2, 4, 64, 64) and latents.dtype == torch.float32
