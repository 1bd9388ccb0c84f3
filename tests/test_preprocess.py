"""The preprocessing job on real parts: tiny VAE and CLIP text encoder built from configs (with a tokenizer
written here), crops of the photographs scikit-learn ships, and damaged, grayscale, CMYK, tiny and caption-less
rows among them; parquet, WebDataset tars and a folder in; parquet that training reads out."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from support.deprecations import deprecations_are_errors
from support.tiny_models import write_tiny_sd_model

from sdtrain.config.learning import Columns
from sdtrain.config.loader import load_config
from sdtrain.data.metadata import LATENT_SCALING_FACTOR, encoder_sources
from sdtrain.errors import ConfigError, DataError
from sdtrain.model.encoders import (
    encode_images,
    encode_prompts,
    load_text_encoder,
    load_vae,
    local_model,
    to_unit_range,
)
from sdtrain.preprocess.buckets import Placement
from sdtrain.preprocess.config import OutputConfig, PreprocessConfig
from sdtrain.preprocess.images import NO_CAPTION, NO_IMAGE, TOO_SMALL, UNDECODABLE, prepare_image

ROOT = Path(__file__).resolve().parent.parent
RESOLUTION = 32  # tiny VAE halves it: 4 x 16 x 16 latents, model.preset=tiny's sample_size
OUTSIDE_FOLDER = "file_outside_folder"  # the skip reason of a captions-file name that leaves the folder


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return write_tiny_sd_model(str(tmp_path_factory.mktemp("sd") / "tiny-sd"))


def photographs() -> list[tuple[bytes, str]]:
    """JPEG crops of scikit-learn's two sample photographs, each with a caption naming what it shows."""
    from sklearn.datasets import load_sample_images

    crops = []
    for name, image in zip(("china", "flower"), load_sample_images().images, strict=True):
        height, width = image.shape[:2]
        for i, (top, left) in enumerate([(0, 0), (0, width // 2), (height // 2, 0), (height // 2, width // 2)]):
            crop = Image.fromarray(image[top : top + height // 2, left : left + width // 2])
            buffer = io.BytesIO()
            crop.save(buffer, "JPEG", quality=90)
            crops.append((buffer.getvalue(), f"a photograph of a {name}, part {i}"))
    return crops


def _encoded(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def odd_rows() -> list[tuple[bytes | None, str | None, str | None]]:
    """(image bytes, caption, the skip reason or None if the row must be kept)."""
    good = photographs()[0][0]
    rgb = Image.open(io.BytesIO(good))
    palette = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    palette.info["transparency"] = 0
    return [
        (good[: len(good) // 3], "a truncated jpeg", UNDECODABLE),
        (b"not an image at all", "garbage bytes", UNDECODABLE),
        (None, "no image", NO_IMAGE),
        (_encoded(rgb.convert("L"), "JPEG"), "a grayscale photograph", None),
        (_encoded(rgb.convert("CMYK"), "JPEG"), "a cmyk photograph", None),
        (_encoded(rgb.convert("RGBA"), "PNG"), "a photograph with alpha", None),
        (_encoded(palette, "PNG"), "a palette photograph", None),
        (_encoded(rgb.resize((8, 6)), "PNG"), "a tiny image", TOO_SMALL),
        (good, None, NO_CAPTION),
        (good, "   ", NO_CAPTION),
    ]


def all_rows() -> list[tuple[bytes | None, str | None, str | None]]:
    return [(data, caption, None) for data, caption in photographs()] + odd_rows()


def write_parquet_input(directory: Path, files: int = 3) -> list[tuple[bytes | None, str | None, str | None]]:
    """img2dataset-style parquet (jpg, caption, url columns) split over ``files`` files."""
    rows = all_rows()
    directory.mkdir(parents=True, exist_ok=True)
    for f, part in enumerate(np.array_split(np.arange(len(rows)), files)):
        table = pa.table(
            {
                "jpg": pa.array([rows[i][0] for i in part], pa.binary()),
                "caption": pa.array([rows[i][1] for i in part], pa.string()),
                "url": [f"https://example.com/{i}.jpg" for i in part],
            }
        )
        pq.write_table(table, directory / f"part-{f:05d}.parquet")
    return rows


def config_for(tmp_path: Path, model: str, *overrides: str, fmt: str = "parquet", source: Path | str | None = None):
    source = source or tmp_path / "input"
    return load_config(
        ROOT / "configs" / "preprocess.yaml",
        [
            f"input.paths={source}",
            f"input.format={fmt}",
            f"encode.model={model}",
            f"output.path={tmp_path / 'latents'}",
            f"image.resolution={RESOLUTION}",
            "encode.batch_size=4",
            "output.row_group_rows=4",
            *overrides,
        ],
        PreprocessConfig,
    )


SQUARE = [(RESOLUTION, RESOLUTION)]  # image.buckets: square


# --- the CPU stage, without Ray ---


def test_prepare_image_converts_every_mode_and_skips_bad_input():
    for data, caption, reason in odd_rows():
        pixels, why = prepare_image(data, SQUARE, "skip")
        if reason in (None, NO_CAPTION):
            assert isinstance(why, Placement) and why.bucket == 0, caption
            assert pixels is not None and pixels.shape == (RESOLUTION, RESOLUTION, 3) and pixels.dtype == np.uint8
        else:
            assert (pixels, why) == (None, reason), caption
    tiny = odd_rows()[7][0]
    pixels, why = prepare_image(tiny, SQUARE, "upscale")
    assert isinstance(why, Placement) and why.upscaled and pixels is not None
    assert pixels.shape == (RESOLUTION, RESOLUTION, 3)


def test_alpha_is_composited_on_white_and_the_center_is_cropped():
    image = Image.new("RGBA", (60, 40), (255, 0, 0, 0))  # fully transparent red
    image.paste((0, 0, 255, 255), (20, 0, 40, 40))  # an opaque blue band in the middle third
    pixels, why = prepare_image(_encoded(image, "PNG"), [(40, 40)], "skip")
    assert isinstance(why, Placement) and why.crop_top_left == (0, 10) and why.original_size == (40, 60)
    assert pixels is not None
    assert pixels.shape == (40, 40, 3)
    assert tuple(pixels[20, 2]) == (255, 255, 255)  # transparent -> white, not black or red
    assert tuple(pixels[20, 20]) == (0, 0, 255)  # the crop is centered on the blue band
    unit = to_unit_range(pixels[None])
    assert unit.shape == (1, 3, 40, 40) and unit.min() == -1.0 and unit.max() == 1.0


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="image.resolution: must be a positive multiple of 8, got 100"):
        load_config(None, ["input.paths=x", "output.path=y", "image.resolution=100"], PreprocessConfig)
    with pytest.raises(ConfigError, match=r"encode.latnt: unknown key \(did you mean latent\?\)"):
        load_config(None, ["input.paths=x", "output.path=y", "encode.latnt=mean"], PreprocessConfig)
    with pytest.raises(ConfigError, match="output.path: is required"):
        load_config(None, ["input.paths=x"], PreprocessConfig)
    write_parquet_input(tmp_path / "input", files=1)
    from sdtrain.preprocess.sources import list_shards

    config = config_for(tmp_path, "unused", "input.caption_column=text")
    with pytest.raises(DataError, match=r"input.caption_column: .*part-00000.parquet has no column 'text'"):
        list_shards(config.input)


def test_credentials_in_any_uri_are_refused_before_ray_and_never_repeated():
    """A secret in a URI would be copied into the manifest, the shards' metadata and logs: refused as training
    refuses it, the message naming the key with the secret redacted (before any listing or Ray work)."""
    base = {"input.paths": "in", "output.path": "out"}
    for key, uri in (
        ("input.paths", "s3://AKIAKEY:se/cr+et@bucket/laion"),
        ("input.captions_file", "s3://AKIAKEY:secret@bucket/captions.txt"),  # the wrong suffix is not checked first
        ("encode.model", "s3://AKIAKEY:secret@bucket/models/sd"),
        ("output.path", "s3://someone@bucket/latents"),
    ):
        overrides = [f"{k}={v}" for k, v in {**base, key: uri}.items()]
        with pytest.raises(ConfigError) as raised:
            load_config(None, overrides, PreprocessConfig)
        message = str(raised.value)
        assert message.startswith(key) and "holds a user name or password" in message, message
        userinfo = uri.split("://")[1].split("@")[0]
        assert "***@bucket" in message and userinfo not in message and "AKIAKEY" not in message, message
        assert "\n" not in message


def test_encoders_match_the_diffusers_pipeline(tiny_model):
    """Captions as StableDiffusionPipeline.encode_prompt computes them; latents scaled by the VAE's factor once."""
    from diffusers import StableDiffusionPipeline

    tokenizer, text_encoder = load_text_encoder(tiny_model)
    vae = load_vae(tiny_model)
    ours = encode_prompts(tokenizer, text_encoder, ["a red fox", ""])
    assert ours.shape == (2, 77, 32)
    pipeline = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=None,
        scheduler=None,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    theirs, _ = pipeline.encode_prompt(["a red fox", ""], "cpu", 1, False)
    torch.testing.assert_close(ours, theirs)

    pixels = np.stack([prepare_image(data, SQUARE, "skip")[0] for data, _ in photographs()[:2]])
    latents = encode_images(vae, pixels, "mean")
    expected = vae.encode(torch.from_numpy(to_unit_range(pixels))).latent_dist.mean * vae.config.scaling_factor
    torch.testing.assert_close(latents, expected)
    assert latents.shape == (2, 4, 16, 16)
    sampled = encode_images(vae, pixels, "sample", seeds=[1, 2])
    again = encode_images(vae, pixels[1:], "sample", seeds=[2])
    torch.testing.assert_close(sampled[1:], again)  # a row's sample depends on its seed, not its batch
    assert not torch.allclose(sampled, latents)


def test_a_batch_all_of_one_non_square_bucket_is_encoded_at_its_own_shape(tiny_model):
    """Ray Data hands a batch whose rows are all one shape as a plain uint8 array, not an array of arrays: with
    aspect buckets its latents are its bucket's size, not the square's (they raised, failing the whole job)."""
    from sdtrain.preprocess.encode_stage import Encoder

    encoder = Encoder(tiny_model, "mean", 0, "float32", RESOLUTION, buckets="aspect")
    pixels = np.random.default_rng(0).integers(0, 256, (3, 40, 24, 3), dtype=np.uint8)  # bucket 0 of 32 (step 8)
    pixels[2] = 0  # the shard's counts row, of bucket 0's shape as the CPU stage makes it
    out = encoder(
        {
            "pixels": pixels,
            "caption": np.array(["a fox", "a cat", ""]),
            "valid": np.array([True, True, False]),
            "key": np.array(["a", "b", ""]),
        }
    )
    expected = encode_images(encoder.vae, pixels[:2], "mean").flatten(1).numpy().astype(np.float16)
    assert expected.shape == (2, 4 * 20 * 12)
    assert [np.asarray(row).shape for row in out["latents"]] == [(960,), (960,), (0,)]
    np.testing.assert_array_equal(np.stack(out["latents"][:2]), expected)
    assert out["embeddings"].shape == (3, 77 * 32) and not out["embeddings"][2].any()


def test_a_text_file_that_cannot_be_read_names_the_setting_and_the_file(tmp_path):
    """input.captions_file and generate.py's --prompts-file read through one function (storage.filesystems)."""
    from sdtrain.sampling.prompts import read_prompts_file
    from sdtrain.storage.filesystems import read_text

    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "prompts.txt").write_text("# a comment\na red fox\n\n")
    assert read_text(str(tmp_path / "prompts.txt"), "--prompts-file") == "# a comment\na red fox\n\n"
    assert read_prompts_file(str(tmp_path / "prompts.txt")) == ["a red fox"]
    with pytest.raises(DataError, match=r"^--prompts-file: cannot read .*missing\.txt: "):
        read_prompts_file(str(tmp_path / "missing.txt"))
    with pytest.raises(DataError, match=r"^input\.captions_file: cannot read .*latin1\.txt: .*utf-8"):
        read_text(str(tmp_path / "latin1.txt"), "input.captions_file")


def test_one_load_vae_takes_a_model_or_the_vae_directory_itself(tiny_model):
    """The same weights from the model directory (its vae/) and from the vae/ directory (generate.py --vae)."""
    from_model, from_vae_dir = load_vae(tiny_model), load_vae(os.path.join(tiny_model, "vae"))
    assert not from_model.training and not from_vae_dir.training
    for (name, ours), (_, theirs) in zip(
        from_model.state_dict().items(), from_vae_dir.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(ours, theirs, msg=name)


def test_a_rerun_with_settings_that_change_the_shards_is_refused(tmp_path, tiny_model):
    """A re-run into the same output with another input.rows_per_shard would cut other shards and write rows twice."""
    from sdtrain.preprocess.job import run_preprocess

    write_parquet_input(tmp_path / "input", files=1)
    first = run_preprocess(config_for(tmp_path, tiny_model, "input.rows_per_shard=3"), max_shards=0)  # no Ray
    assert first.shards_written == [] and (tmp_path / "latents" / "_settings.json").is_file()
    with pytest.raises(ConfigError, match=r"input.rows_per_shard: .*latents was written with 3, this run has 4"):
        run_preprocess(config_for(tmp_path, tiny_model, "input.rows_per_shard=4"))
    with pytest.raises(ConfigError, match=r"image.resolution: .* was written with 32, this run has 64"):
        run_preprocess(config_for(tmp_path, tiny_model, "input.rows_per_shard=3", "image.resolution=64"))
    # What changes neither the shards nor their values may change between runs.
    again = run_preprocess(config_for(tmp_path, tiny_model, "input.rows_per_shard=3", "encode.batch_size=8"), 0)
    assert again.shards_done_before == 0 and again.shards_total == 6


def test_the_latent_column_has_trainings_name_and_an_output_recorded_under_the_old_one_is_still_checked(
    tmp_path, tiny_model
):
    """output.latent_column is what training reads as data.latent_column; the old name output.image_column is refused
    naming it. An output whose _settings.json was written under the old name keeps its check: a re-run that writes
    its latents to another column is refused."""
    from sdtrain.preprocess.job import run_preprocess

    with pytest.raises(ConfigError, match=r"^output\.image_column: was renamed output\.latent_column; "):
        config_for(tmp_path, tiny_model, "output.image_column=latents")
    assert set(PreprocessConfig.RENAMED.values()) <= {f"output.{f.name}" for f in dataclasses.fields(OutputConfig)}
    write_parquet_input(tmp_path / "input", files=1)
    run_preprocess(config_for(tmp_path, tiny_model, "input.rows_per_shard=3"), max_shards=0)  # no Ray
    settings = tmp_path / "latents" / "_settings.json"
    recorded = json.loads(settings.read_text())
    recorded["output.image_column"] = recorded.pop("output.latent_column")  # as outputs before the rename have it
    settings.write_text(json.dumps(recorded))
    with pytest.raises(ConfigError, match=r"output.latent_column: .* was written with 'image_latents_256', this"):
        run_preprocess(config_for(tmp_path, tiny_model, "input.rows_per_shard=3", "output.latent_column=other"))
    again = run_preprocess(config_for(tmp_path, tiny_model, "input.rows_per_shard=3"), max_shards=0)
    assert again.shards_total == 6


def _mark_done(output: Path, shard) -> None:
    """What the job writes once a shard is done (its record); its rows are not needed by the listing."""
    from sdtrain.preprocess.outputs import write_shard

    stats = {
        "shard": shard.name,
        "source": shard.source,
        "identity": getattr(shard, "identity", None),
        "inputs_read": 0,
    }
    write_shard(str(output), shard.name, None, {**stats, "rows_written": 0, "skipped": {}}, 4)


def test_inputs_with_the_same_file_names_never_share_a_shard_and_a_rewritten_one_is_refused(tmp_path, tiny_model):
    """img2dataset names every day's files 00000.parquet: a second day into the same output is new shards, not
    'done'; a file rewritten in place after its shards were done is refused, naming the shard and both sources."""
    from sdtrain.preprocess.job import run_preprocess
    from sdtrain.preprocess.sources import list_shards

    write_parquet_input(tmp_path / "day1", files=1)
    write_parquet_input(tmp_path / "day2", files=1)  # the same file name, part-00000.parquet
    day1 = config_for(tmp_path, tiny_model, "input.rows_per_shard=3", source=tmp_path / "day1")
    day2 = config_for(tmp_path, tiny_model, "input.rows_per_shard=3", source=tmp_path / "day2")
    for shard in list_shards(day1.input):
        _mark_done(tmp_path / "latents", shard)
    again = run_preprocess(day1, max_shards=0)  # lists and records, no Ray
    assert (again.shards_total, again.shards_done_before) == (6, 6)
    second = run_preprocess(day2, max_shards=0)
    assert (second.shards_total, second.shards_done_before) == (6, 0)  # none of day 2 is taken for done
    both = load_config(
        None, [*_overrides(day1), f"input.paths=[{tmp_path / 'day1'},{tmp_path / 'day2'}]"], PreprocessConfig
    )
    assert len({s.name for s in list_shards(both.input)}) == 12  # one run over both days: no collision either

    rows = all_rows()[:-2]
    pq.write_table(pa.table({"jpg": [r[0] for r in rows], "caption": [r[1] for r in rows]}), tmp_path / "day1" / "x")
    os.replace(tmp_path / "day1" / "x", tmp_path / "day1" / "part-00000.parquet")  # rewritten in place, 2 rows less
    with pytest.raises(DataError) as refused:
        run_preprocess(day1, max_shards=0)
    message = str(refused.value)
    first = sorted(s.name for s in list_shards(day1.input))[0]
    assert message.startswith(f"input.paths: shard {first} was made from {tmp_path / 'day1' / 'part-00000.parquet'}")
    assert "the input now is" in message and "delete" in message and "another output.path" in message
    sizes = [part for part in message.split("size ")[1:]]
    assert len(sizes) == 2 and sizes[0].split(",")[0] != sizes[1].split(",")[0]  # the recorded size, the new one

    # An output written before shards recorded their source (named by file name alone) is not resumed by name.
    marker = tmp_path / "latents" / "_shards" / f"{first}.json"
    marker.write_text(json.dumps({k: v for k, v in json.loads(marker.read_text()).items() if k != "identity"}))
    with pytest.raises(DataError, match=rf"output.path: .* record no source \(_shards/{first}.json: written by an"):
        run_preprocess(day2, max_shards=0)


def _overrides(config) -> list[str]:
    return [
        f"output.path={config.output.path}",
        f"encode.model={config.encode.model}",
        f"input.rows_per_shard={config.input.rows_per_shard}",
    ]


def test_an_image_added_to_a_folder_never_moves_a_row_of_a_done_shard(tmp_path, tiny_model):
    """A folder cut by position in its sorted listing: a file added later shifted rows between done shards (one
    never encoded, another twice). Done shards keep their keys; the new image goes to a new shard."""
    from sdtrain.preprocess.job import run_preprocess
    from sdtrain.preprocess.sources import list_shards

    write_folder_input(tmp_path / "images")
    config = config_for(
        tmp_path,
        tiny_model,
        "input.caption_column=text",
        "input.rows_per_shard=3",
        fmt="folder",
        source=tmp_path / "images",
    )
    before = list_shards(config.input)
    for shard in before[:2]:
        _mark_done(tmp_path / "latents", shard)
    (tmp_path / "images" / "0000.jpg").write_bytes((tmp_path / "images" / "001.jpg").read_bytes())  # sorts 2nd
    summary = run_preprocess(config, max_shards=0)
    assert summary.shards_done_before == 2
    from sdtrain.preprocess.outputs import read_shard_stats

    done = {r["shard"]: r for r in read_shard_stats(str(tmp_path / "latents"))}
    after = list_shards(config.input, done)
    assert [(s.name, s.identity["keys"]) for s in after[:2]] == [(s.name, s.identity["keys"]) for s in before[:2]]
    pending = [key for s in after if s.name not in done for key, _ in s.rows]
    held = [key for s in after[:2] for key in s.identity["keys"]]
    every = sorted(key for s in before for key, _ in s.rows) + ["0000.jpg"]
    assert sorted(held + pending) == sorted(every)  # each key once: none lost, none twice
    assert "0000.jpg" in pending and not set(held) & set(pending)
    assert list_shards(config.input, done) == after  # a re-run cuts the pending keys the same way


def test_a_folder_spelled_another_way_is_the_same_input(tmp_path, tiny_model):
    """A trailing '/', './', '//' or a file:// URI of the same folder named another input: its done shards were not
    found, and a re-run after one image arrived encoded every image again. One spelling names a source in the
    records; records an earlier run wrote with another spelling are still found."""
    from sdtrain.preprocess.job import run_preprocess
    from sdtrain.preprocess.outputs import read_shard_stats
    from sdtrain.preprocess.sources import list_shards

    images = tmp_path / "images"
    write_folder_input(images)

    def spelled(source: str):
        overrides = ("input.caption_column=text", "input.rows_per_shard=3")
        return config_for(tmp_path, tiny_model, *overrides, fmt="folder", source=source)

    before = list_shards(spelled(f"file://{images}/").input)
    for shard in before[:2]:
        _mark_done(tmp_path / "latents", shard)
    (images / "0000.jpg").write_bytes((images / "001.jpg").read_bytes())  # sorts first: every new cut moves
    held = {key for s in before[:2] for key in s.identity["keys"]}
    for source in (f"{images}", f"{images}/", f"{images}/./", f"{tmp_path}//images", f"file://{images}"):
        summary = run_preprocess(spelled(source), max_shards=0)  # lists and records, no Ray
        assert summary.shards_done_before == 2, source
        done = {r["shard"]: r for r in read_shard_stats(str(tmp_path / "latents"))}
        pending = {key for s in list_shards(spelled(source).input, done) if s.name not in done for key, _ in s.rows}
        assert not pending & held and "0000.jpg" in pending, source  # only what no done shard holds
    # A record written with another spelling than the one used now (by an earlier sdtrain) is of the same source.
    marker = tmp_path / "latents" / "_shards" / f"{before[0].name}.json"
    record = json.loads(marker.read_text())
    record["identity"]["path"] = record["source"] = f"file://{images}//"
    marker.write_text(json.dumps(record))
    assert run_preprocess(spelled(str(images)), max_shards=0).shards_done_before == 2


def test_one_spelling_of_a_source():
    from sdtrain.preprocess.sources import canonical_source

    for same in (("s3://bucket/prefix", "s3://bucket/prefix/", "s3://bucket//prefix/"), ("/a/b", "/a/./b/", "//a//b")):
        assert len({canonical_source(s) for s in same}) == 1, same
    assert canonical_source("file:///a/b%20c/") == "/a/b c" == canonical_source("/a/b c")
    assert canonical_source("s3://bucket/./prefix") != canonical_source("s3://bucket/prefix")  # S3: another key


class _Killed(BaseException):
    """The job killed between two of its writes."""


def _write_keys(output: str, shard) -> None:
    """What the job writes for a folder shard, with made-up values: one row a key (no encoder needed)."""
    from sdtrain.preprocess.outputs import shard_table, write_shard

    rows = [{"latents": np.zeros(4), "embeddings": np.zeros(4), "caption": str(c), "key": k} for k, c in shard.rows]
    table = shard_table(rows, {"latents": "image_latents_256", "embeddings": "caption_latents"}, {})
    stats = {"shard": shard.name, "source": shard.source, "identity": shard.identity, "inputs_read": len(rows)}
    write_shard(output, shard.name, table, {**stats, "rows_written": len(rows), "skipped": {}}, 4)


def _kill_writes(monkeypatch, after_record: bool) -> None:
    """The shard writer's storage operations die at its record's write, or at the first one after it."""
    from sdtrain.preprocess import outputs

    recorded = []

    def dying(real):
        def operation(uri: str, *args) -> None:
            is_record = "/_shards/" in uri and uri.endswith(".json")
            if recorded or (is_record and not after_record):
                raise _Killed(uri)
            real(uri, *args)
            recorded.extend([uri] if is_record else [])

        return operation

    for name in ("write_bytes", "move_file"):  # move_file: the writer's last step, where it has one
        if hasattr(outputs, name):
            monkeypatch.setattr(outputs, name, dying(getattr(outputs, name)))


def _killed_and_rerun(output: str, tmp_path: Path, tiny_model: str, monkeypatch) -> tuple[list[str], list[str]]:
    """A folder's shards written, the job killed while writing a shard at each point a kill can fall (before its
    record, after it), an image added, the job re-run (its cut moves every key): the keys listed at first, and the
    keys of the files training's listing then finds."""
    from sdtrain.data.parquet_files import resolve_parquet_files
    from sdtrain.preprocess import outputs
    from sdtrain.preprocess.job import run_preprocess
    from sdtrain.preprocess.sources import list_shards
    from sdtrain.storage.filesystems import filesystem_for

    images = tmp_path / "images"
    write_folder_input(images)
    overrides = ("input.caption_column=text", "input.rows_per_shard=3", f"output.path={output}")
    config = config_for(tmp_path, tiny_model, *overrides, fmt="folder", source=images)
    shards = list_shards(config.input)
    _write_keys(output, shards[0])
    for shard, after_record in ((shards[1], False), (shards[2], True)):
        with monkeypatch.context() as patched:
            _kill_writes(patched, after_record)
            try:
                _write_keys(output, shard)
            except _Killed:
                pass
    # An earlier sdtrain's writer (the parquet, then the record) killed between the two: a file no record names.
    orphan = outputs.parquet_bytes(pa.table({"key": ["written by an earlier sdtrain"]}), 4)
    outputs.write_bytes(outputs.join(output, f"{shards[3].name}.parquet"), orphan)
    (images / "0000.jpg").write_bytes((images / "001.jpg").read_bytes())

    run_preprocess(config, max_shards=0)  # what the re-run does before it encodes (no Ray)
    done = {r["shard"]: r for r in outputs.read_shard_stats(output)}
    for shard in list_shards(config.input, done):
        if shard.name not in done:
            _write_keys(output, shard)
    keys = []
    for file in resolve_parquet_files([output], "data.train"):
        fs, path = filesystem_for(file)
        keys += pq.read_table(path, filesystem=fs, columns=["key"]).column("key").to_pylist()
    return sorted([key for shard in shards for key, _ in shard.rows] + ["0000.jpg"]), sorted(keys)


def test_a_job_killed_while_writing_a_shard_never_leaves_a_row_twice(tmp_path, tiny_model, monkeypatch):
    """The shard's parquet was written before its record: a kill between the two left a file no record names, which
    a re-run that cut the folder anew (an image added) never replaced, and training read its rows twice."""
    listed, trained = _killed_and_rerun(str(tmp_path / "latents"), tmp_path, tiny_model, monkeypatch)
    assert trained == listed  # each row once: none twice, none lost
    left = [p.name for p in (tmp_path / "latents").rglob("*") if p.is_file() and ".parquet" in p.name]
    assert not [name for name in left if name.startswith((".", "_")) and name != "_sdtrain_index.parquet"]


@pytest.mark.slow  # moto's server
def test_a_job_killed_while_writing_a_shard_to_s3_never_leaves_a_row_twice(
    tmp_path, tiny_model, s3_bucket, monkeypatch
):
    """S3 has no rename: the parquet waits under _shards/ and is copied to its name once its record is written."""
    import boto3

    listed, trained = _killed_and_rerun(f"{s3_bucket}/latents", tmp_path, tiny_model, monkeypatch)
    assert trained == listed
    objects = _keys(boto3.client("s3"), "latents/")
    assert not [k for k in objects if k.startswith("_shards/") and not k.endswith(".json")], objects


def test_captions_file_names_outside_the_folder_are_skipped_and_never_read(tmp_path, capsys):
    """file_name values were joined to the folder as written: '../private/secret.jpg' or an absolute path read a
    file outside the folder (on S3, any prefix the job's credentials reach) and encoded it. They, and URIs, are
    skipped and counted (file_outside_folder), named on the driver, and never opened."""
    from sdtrain.preprocess.sources import list_shards, read_shard

    images = tmp_path / "images"
    rows = write_folder_input(images)
    config = config_for(tmp_path, "unused", "input.caption_column=text", fmt="folder", source=images)
    shards = list_shards(config.input)
    secret = (tmp_path / "private" / "secret.jpg").read_bytes()
    read = [row for shard in shards for row in read_shard(shard, config.input)]
    assert len(read) == len(rows)
    assert not [row.key for row in read if row.image == secret]
    outside = sorted(row.key for row in read if getattr(row, "skip", None) == OUTSIDE_FOLDER)
    assert outside == sorted(_outside_names(images))
    assert all(row.skip is None for row in read if row.key not in outside)
    message = capsys.readouterr().out
    assert f"input.captions_file: {images / 'captions.jsonl'}: 3 file names leave the folder" in message
    assert "'../private/secret.jpg'" in message and OUTSIDE_FOLDER in message


@pytest.mark.slow  # entrypoints/preprocess.py in five subprocesses
def test_the_command_line_lists_every_key_and_fails_bad_input_in_one_line(tmp_path):
    command = [sys.executable, str(ROOT / "entrypoints" / "preprocess.py")]
    shown = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0
    for key in ("input.rows_per_shard", "image.small_images", "encode.latent", "output.row_group_rows"):
        assert key in shown.stdout
    assert "storage.endpoint_url" in shown.stdout
    for overrides, message in (
        (["input.paths=x", f"output.path={tmp_path}", "encode.latnt=mean"], "encode.latnt: unknown key"),
        ([f"input.paths={tmp_path / 'nowhere'}", f"output.path={tmp_path / 'out'}"], "input.paths: "),
        (["--max-shards", "-1", "input.paths=x", f"output.path={tmp_path}"], "--max-shards: must be >= 0"),
        (["input.paths=s3://KEY:TOPSECRET@bucket/x", f"output.path={tmp_path}"], "input.paths[0]: s3://***@bucket/x"),
    ):
        failed = subprocess.run([*command, *overrides], capture_output=True, text=True, timeout=120)
        assert failed.returncode == 2 and failed.stderr.startswith("error: ") and message in failed.stderr
        assert "Traceback" not in failed.stderr and "TOPSECRET" not in failed.stderr
        assert failed.stderr.count("\n") == 1  # one line


def test_local_paths_are_made_absolute_for_the_workers_and_the_record(tmp_path, tiny_model, monkeypatch):
    """Ray's workers run elsewhere than the driver's working directory, and training, export and generate.py
    read the model path the output records: relative paths become absolute, a hub id stays one."""
    from sdtrain.preprocess.job import run_preprocess, with_absolute_paths

    write_parquet_input(tmp_path / "input", files=1)
    shutil.copytree(tiny_model, tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    relative = load_config(
        None, ["input.paths=input/part-00000.parquet", "output.path=latents", "encode.model=model"], PreprocessConfig
    )
    summary = run_preprocess(relative, max_shards=0)  # lists and records, no Ray
    config = summary.manifest["config"]
    assert config["input"]["paths"] == [str(tmp_path / "input" / "part-00000.parquet")]
    assert config["output"]["path"] == str(tmp_path / "latents") and config["encode"]["model"] == str(
        tmp_path / "model"
    )
    hub = with_absolute_paths(load_config(None, ["input.paths=x", "output.path=y"], PreprocessConfig))
    assert hub.encode.model == "stabilityai/stable-diffusion-2-base"


# --- the job on Ray ---


SHARD_FILES = "[!_]*.parquet"  # not the dataset index, _sdtrain_index.parquet


def _written(output: Path) -> dict[str, int]:
    return {p.name: p.stat().st_ino for p in sorted(output.glob(SHARD_FILES))}


@pytest.mark.slow
def test_parquet_input_interrupted_and_resumed(tmp_path, tiny_model, ray_cluster, capfd):
    from support.datasets import inspect_dataset

    from sdtrain.data.dataset_index import index_dataset
    from sdtrain.preprocess.job import _pipeline, run_preprocess
    from sdtrain.preprocess.outputs import done_shards
    from sdtrain.preprocess.sources import list_shards

    rows = write_parquet_input(tmp_path / "input", files=3)
    config = config_for(tmp_path, tiny_model, "input.rows_per_shard=3")
    shards = list_shards(config.input)
    assert len(shards) == 6  # 3 files of 6 rows, in shards of 3 rows
    output = tmp_path / "latents"

    with deprecations_are_errors():  # the job's calls into Ray Data and the encoders: none deprecated
        first = run_preprocess(config, max_shards=2)  # the job stopped after two shards
    assert len(first.shards_written) == 2 and first.shards_done_before == 0
    # The CPU stage runs as tasks of its own, beside the encoders, not fused into their actors: Ray Data's plan.
    capfd.readouterr()
    _pipeline(config, shards, False).explain()  # the tiny model is SD-shaped
    plan = capfd.readouterr().out.split("Physical Plan (Optimized)")[1]
    assert "ActorPoolMapOperator[MapBatches(Encoder)]\n+- TaskPoolMapOperator[FlatMap(_Prepare)]" in plan, plan
    before = _written(output)
    assert len(before) == 2

    second = run_preprocess(config)
    assert second.shards_done_before == 2
    assert not set(second.shards_written) & set(first.shards_written)  # no shard written twice
    after = _written(output)
    assert {name: after[name] for name in before} == before  # the first run's files were left alone
    marked = sorted(p.stem for p in (output / "_shards").glob("*.json"))
    assert sorted(first.shards_written + second.shards_written) == marked == sorted(s.name for s in shards)
    assert {p[: -len(".parquet")] for p in after} <= set(marked)  # a shard of only skipped rows has no file

    kept = [caption.strip() for _, caption, reason in rows if reason is None]
    files = sorted(str(p) for p in output.glob(SHARD_FILES))
    table = pa.concat_tables(pq.read_table(f) for f in files)
    assert sorted(table.column("caption").to_pylist()) == sorted(kept)  # none lost, none twice
    manifest = json.loads((output / "manifest.json").read_text())
    assert manifest["inputs_read"] == len(rows)
    assert manifest["rows_written"] == len(kept)
    expected_skips: dict[str, int] = {}
    for _, _, reason in rows:
        if reason is not None:
            expected_skips[reason] = expected_skips.get(reason, 0) + 1
    assert manifest["skipped_by_reason"] == expected_skips

    spec = inspect_dataset(files, "data.train", Columns("image_latents_256", "caption_latents"), 4, 32)
    assert spec.latent_shape == (4, 16, 16) and spec.caption_shape == (77, 32)
    # The job's dataset index: training on its output reads no footer, and finds what the footers say.
    indexed = index_dataset([str(output)], "data.train", Columns("image_latents_256", "caption_latents"), 4, 32)
    assert (indexed.stats.from_index, indexed.stats.footers_read) == (len(files), 0)
    assert (indexed.spec.files, indexed.spec.rows_per_file) == (spec.files, spec.rows_per_file)
    assert (indexed.spec.latent_shape, indexed.spec.caption_shape) == (spec.latent_shape, spec.caption_shape)
    for file in files:
        parquet = pq.ParquetFile(file)
        assert parquet.schema_arrow.field("image_latents_256").type == pa.list_(pa.float16())
        assert all(parquet.metadata.row_group(g).num_rows <= 4 for g in range(parquet.num_row_groups))
        assert float(parquet.schema_arrow.metadata[LATENT_SCALING_FACTOR.encode()]) == 0.18215
    sources = encoder_sources(files)
    assert sources is not None and sources.vae == tiny_model and sources.resolution == RESOLUTION

    # The stored rows are what the encoders give for the same inputs, row for row.
    tokenizer, text_encoder = load_text_encoder(tiny_model)
    captions = table.column("caption").to_pylist()[:3]
    stored = np.array(table.column("caption_latents").to_pylist()[:3], dtype=np.float32).reshape(3, 77, 32)
    np.testing.assert_allclose(stored, encode_prompts(tokenizer, text_encoder, captions).numpy(), atol=2e-3, rtol=1e-2)
    empty = np.load(output / "unconditional_caption.npy")
    np.testing.assert_allclose(empty, encode_prompts(tokenizer, text_encoder, [""])[0].numpy(), atol=1e-6)

    # The runs' digest of the done shards: a later re-run takes every marker older than it from it, reading none.
    for marker in (output / "_shards").glob("*.json"):
        os.utime(marker, (time.time() - 60,) * 2)  # written a minute before the re-run
    found = done_shards(str(output))
    assert found.markers_read == 0
    assert found.records == [json.loads(p.read_text()) for p in sorted((output / "_shards").glob("*.json"))]

    third = run_preprocess(config)  # everything done: nothing is read or written
    assert third.shards_written == [] and _written(output) == after

    # Another day whose files have the same names (img2dataset's), into the same output: new shards, every row
    # written (it used to be taken as done by name, a whole day lost), the first day's files left alone.
    write_parquet_input(tmp_path / "day2", files=3)
    day2 = run_preprocess(config_for(tmp_path, tiny_model, "input.rows_per_shard=3", source=tmp_path / "day2"))
    assert (len(day2.shards_written), day2.shards_done_before, day2.shards_failed) == (6, 0, {})
    assert _written(output).items() >= after.items()
    table = pa.concat_tables(pq.read_table(f) for f in sorted(output.glob(SHARD_FILES)))
    assert sorted(table.column("caption").to_pylist()) == sorted(kept * 2)
    assert json.loads((output / "manifest.json").read_text())["rows_written"] == 2 * len(kept)


def write_webdataset_input(directory: Path, per_tar: int = 6) -> list[tuple[bytes | None, str | None, str | None]]:
    """img2dataset's tar layout (<key>.jpg + <key>.txt, or <key>.json with a caption field); the last tar is cut
    short mid-member, as an interrupted upload leaves it."""
    rows = all_rows()
    directory.mkdir(parents=True, exist_ok=True)
    for t, start in enumerate(range(0, len(rows), per_tar)):
        with tarfile.open(directory / f"{t:05d}.tar", "w") as tar:
            for i in range(start, min(start + per_tar, len(rows))):
                data, caption, _ = rows[i]
                members = {}
                if data is not None:
                    members[f"{i:09d}.jpg"] = data
                if caption is not None:
                    if i % 2:
                        members[f"{i:09d}.txt"] = caption.encode()
                    else:
                        members[f"{i:09d}.json"] = json.dumps({"caption": caption, "url": "x"}).encode()
                else:
                    members[f"{i:09d}.json"] = json.dumps({"url": "x"}).encode()  # img2dataset: no caption
                for name, payload in members.items():
                    info = tarfile.TarInfo(name)
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
    good = (directory / "00000.tar").read_bytes()
    (directory / "99999.tar").write_bytes(good[: len(good) // 2])
    return rows


def _outside_names(directory: Path) -> list[str]:
    """Captions-file names of a photograph beside the folder, outside it: through '..', as an absolute path, a URI."""
    secret = directory.parent / "private" / "secret.jpg"
    return ["../private/secret.jpg", str(secret), f"file://{secret}"]


def write_folder_input(directory: Path) -> list[tuple[bytes | None, str | None, str | None]]:
    """Image files plus captions.jsonl; a caption entry whose file is absent, an image with no entry, and entries
    naming a photograph outside the folder (<directory>/../private/secret.jpg)."""
    rows = [r for r in all_rows() if r[0] is not None]
    directory.mkdir(parents=True, exist_ok=True)
    (directory.parent / "private").mkdir(exist_ok=True)
    (directory.parent / "private" / "secret.jpg").write_bytes(
        _encoded(Image.open(io.BytesIO(photographs()[-1][0])), "PNG")
    )
    with open(directory / "captions.jsonl", "w") as f:
        for i, (data, caption, _) in enumerate(rows):
            (directory / f"{i:03d}.jpg").write_bytes(data)
            if caption is not None:  # a row without a caption has no entry: the image stands alone
                f.write(json.dumps({"file_name": f"{i:03d}.jpg", "text": caption}) + "\n")
        f.write(json.dumps({"file_name": "missing.jpg", "text": "an image that is not there"}) + "\n")
        for name in _outside_names(directory):
            f.write(json.dumps({"file_name": name, "text": "a photograph the job must not read"}) + "\n")
    outside = [(None, "a photograph the job must not read", OUTSIDE_FOLDER)] * len(_outside_names(directory))
    return rows + [(None, "an image that is not there", NO_IMAGE)] + outside


def _skips(rows) -> dict[str, int]:
    found: dict[str, int] = {}
    for _, _, reason in rows:
        if reason is not None:
            found[reason] = found.get(reason, 0) + 1
    return found


@pytest.mark.slow
def test_webdataset_tars_and_an_image_folder(tmp_path, tiny_model, ray_cluster):
    from sdtrain.preprocess.job import run_preprocess

    rows = write_webdataset_input(tmp_path / "tars")
    config = config_for(tmp_path / "wds", tiny_model, fmt="webdataset", source=tmp_path / "tars")
    summary = run_preprocess(config)
    [cut] = summary.shards_failed  # the cut tar fails alone, and is not marked done
    assert cut.startswith("99999-")  # the tar's name, then a digest of its path
    assert "ReadError" in summary.shards_failed[cut] or "EOF" in summary.shards_failed[cut]
    manifest = summary.manifest
    assert manifest["inputs_read"] == len(rows) and manifest["skipped_by_reason"] == _skips(rows)
    output = tmp_path / "wds" / "latents"
    files = sorted(output.glob(SHARD_FILES))
    captions = sorted(c for f in files for c in pq.read_table(f).column("caption").to_pylist())
    assert captions == sorted(c.strip() for _, c, reason in rows if reason is None)
    assert not (output / "_shards" / f"{cut}.json").exists()
    (tmp_path / "tars" / "99999.tar").unlink()  # the upload is redone whole...
    (tmp_path / "tars" / "00000.tar").rename(tmp_path / "tars" / "99999.tar")
    # ...and a re-run does that shard only (00000 stays done: its file is not rewritten).
    again = run_preprocess(config)
    assert again.shards_written == [cut] and again.shards_failed == {}

    rows = write_folder_input(tmp_path / "images")
    config = config_for(
        tmp_path / "folder",
        tiny_model,
        "input.caption_column=text",
        "output.captions=token_ids",
        fmt="folder",
        source=tmp_path / "images",
    )
    summary = run_preprocess(config)
    manifest = summary.manifest
    assert manifest["inputs_read"] == len(rows)
    assert manifest["skipped_by_reason"] == _skips(rows)
    output = tmp_path / "folder" / "latents"
    files = sorted(output.glob(SHARD_FILES))
    keys = sorted(k for f in files for k in pq.read_table(f).column("key").to_pylist())
    assert keys == sorted(f"{i:03d}.jpg" for i, r in enumerate(rows) if r[2] is None)
    # Captions as token ids alone: no embeddings anywhere, the empty prompt's ids, an index of the ids column.
    assert {"caption_ids", "image_latents_256"} <= set(pq.read_schema(files[0]).names)
    assert "caption_latents" not in pq.read_schema(files[0]).names
    assert (output / "unconditional_caption_ids.npy").is_file() and not (output / "unconditional_caption.npy").exists()
    from sdtrain.data.dataset_index import index_dataset

    indexed = index_dataset(
        [str(output)],
        "data.train",
        Columns("image_latents_256", "caption_ids"),
        4,
        32,
        str(tmp_path / "run-index.parquet"),
    )
    assert indexed.stats.footers_read == 0 and indexed.spec.token_ids.text_encoder == tiny_model


# --- on object storage ---


def _upload(s3, directory: Path, prefix: str) -> None:
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        s3.upload_file(str(path), "sdtrain-test", f"{prefix}/{path.relative_to(directory).as_posix()}")


def _keys(s3, prefix: str) -> list[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket="sdtrain-test", Prefix=prefix)
    return sorted(o["Key"][len(prefix) :] for page in pages for o in page.get("Contents", []))


def _get(s3, key: str) -> bytes:
    return s3.get_object(Bucket="sdtrain-test", Key=key)["Body"].read()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_inputs_model_and_output_on_s3_resumed_and_trained_on(tmp_path, tiny_model, s3_bucket, ray_cluster):
    """Parquet, WebDataset and folder inputs, the model and the output all in a bucket of a real S3 server. The
    cluster knows the credentials but not the endpoint (conftest's ray_cluster): the job hands it to its tasks.
    Interrupted and re-run, no shard is written twice; training reads the latents and the captions' token ids from
    the bucket, and its worker encodes them with the text encoder it fetches from there."""
    import boto3
    from support.datasets import inspect_dataset

    from sdtrain.artifacts.loading import load_model
    from sdtrain.config.loader import load_config
    from sdtrain.data.parquet_files import resolve_parquet_files
    from sdtrain.driver.run import train
    from sdtrain.preprocess.job import run_preprocess
    from sdtrain.sampling.generate import GenerateRequest, generate

    s3 = boto3.client("s3")
    _upload(s3, Path(tiny_model), "models/tiny-sd")
    model = f"{s3_bucket}/models/tiny-sd"
    s3.put_object(Bucket="sdtrain-test", Key="models/tiny-sd/unet/config.json", Body=b"not read")
    assert sorted(os.listdir(local_model(model, "vae", "text_encoder"))) == ["text_encoder", "vae"]

    # Parquet in, stopped after two shards, then re-run.
    rows = write_parquet_input(tmp_path / "parquet", files=3)
    _upload(s3, tmp_path / "parquet", "in/parquet")
    output = f"{s3_bucket}/latents/parquet"
    config = config_for(
        tmp_path,
        model,
        "input.rows_per_shard=3",
        f"output.path={output}",
        "output.captions=both",
        source=f"{s3_bucket}/in/parquet",
    )
    first = run_preprocess(config, max_shards=2)
    assert len(first.shards_written) == 2 and first.shards_failed == {}
    files_before = [k for k in _keys(s3, "latents/parquet/") if k.endswith(".parquet") and not k.startswith("_")]
    assert files_before and set(files_before) <= {f"{name}.parquet" for name in first.shards_written}
    # A shard done before is not written again: a stand-in object put in its place outlives the re-run.
    done_key = f"latents/parquet/{files_before[0]}"
    original = _get(s3, done_key)
    s3.put_object(Bucket="sdtrain-test", Key=done_key, Body=b"stand-in")
    second = run_preprocess(config)
    assert second.shards_done_before == 2 and not set(second.shards_written) & set(first.shards_written)
    assert _get(s3, done_key) == b"stand-in"
    s3.put_object(Bucket="sdtrain-test", Key=done_key, Body=original)

    names = sorted(first.shards_written + second.shards_written)
    assert len(names) == 6
    written = _keys(s3, "latents/parquet/")
    parquet = [k for k in written if k.endswith(".parquet") and not k.startswith("_")]
    # Every object is a whole file under its final name: no temporaries, nothing else.
    assert set(written) == {
        *parquet,
        *(f"_shards/{name}.json" for name in names),
        "_settings.json",
        "_sdtrain_index.parquet",
        "_shards.jsonl.gz",  # the done shards' records, for the next re-run
        "manifest.json",
        "unconditional_caption.npy",
        "unconditional_caption_ids.npy",
    }
    assert {k[: -len(".parquet")] for k in parquet} <= set(names)
    manifest = json.loads(_get(s3, "latents/parquet/manifest.json"))
    kept = [caption.strip() for _, caption, reason in rows if reason is None]
    assert (manifest["inputs_read"], manifest["rows_written"]) == (len(rows), len(kept))
    assert manifest["skipped_by_reason"] == _skips(rows)
    tokenizer, text_encoder = load_text_encoder(tiny_model)
    empty = np.load(io.BytesIO(_get(s3, "latents/parquet/unconditional_caption.npy")))
    np.testing.assert_allclose(empty, encode_prompts(tokenizer, text_encoder, [""])[0].numpy(), atol=1e-6)

    # Training's reader finds the files (and only them) in the bucket, with the shapes the model needs.
    files = resolve_parquet_files([output], "data.train")
    assert files == [f"{output}/{k}" for k in parquet]
    spec = inspect_dataset(files, "data.train", Columns("image_latents_256", "caption_latents"), 4, 32)
    assert spec.latent_shape == (4, 16, 16) and spec.caption_shape == (77, 32)
    sources = encoder_sources(files)
    assert sources is not None and sources.vae == model and sources.text_encoder == model

    # WebDataset tars in the bucket; the cut one fails alone and is not marked done.
    tar_rows = write_webdataset_input(tmp_path / "tars")
    _upload(s3, tmp_path / "tars", "in/tars")
    config = config_for(
        tmp_path, tiny_model, f"output.path={s3_bucket}/latents/wds", fmt="webdataset", source=f"{s3_bucket}/in/tars"
    )
    summary = run_preprocess(config)
    [cut] = summary.shards_failed
    assert cut.startswith("99999-") and f"_shards/{cut}.json" not in _keys(s3, "latents/wds/")
    assert summary.manifest["inputs_read"] == len(tar_rows) and summary.manifest["skipped_by_reason"] == _skips(
        tar_rows
    )
    wds_files = resolve_parquet_files([f"{s3_bucket}/latents/wds"], "data.train")
    captions = sorted(
        c
        for f in wds_files
        for c in pq.read_table(io.BytesIO(_get(s3, f[len("s3://sdtrain-test/") :]))).column("caption").to_pylist()
    )
    assert captions == sorted(c.strip() for _, c, reason in tar_rows if reason is None)

    # A folder of images with its captions file, in the bucket.
    folder_rows = write_folder_input(tmp_path / "images")
    _upload(s3, tmp_path / "images", "in/images")
    _upload(s3, tmp_path / "private", "in/private")  # what '../private/secret.jpg' would reach
    config = config_for(
        tmp_path,
        tiny_model,
        "input.caption_column=text",
        f"output.path={s3_bucket}/latents/folder",
        fmt="folder",
        source=f"{s3_bucket}/in/images",
    )
    summary = run_preprocess(config)
    assert summary.manifest["inputs_read"] == len(folder_rows)
    assert summary.manifest["skipped_by_reason"] == _skips(folder_rows)
    folder_files = resolve_parquet_files([f"{s3_bucket}/latents/folder"], "data.train")
    keys = sorted(
        k
        for f in folder_files
        for k in pq.read_table(io.BytesIO(_get(s3, f[len("s3://sdtrain-test/") :]))).column("key").to_pylist()
    )
    assert keys == sorted(f"{i:03d}.jpg" for i, r in enumerate(folder_rows) if r[2] is None)
    # The folder's prefix spelled with a trailing '/' is the same input: its done shards are found, none redone.
    again = run_preprocess(
        dataclasses.replace(config, input=dataclasses.replace(config.input, paths=[f"{s3_bucket}/in/images/"]))
    )
    assert again.shards_written == [] and again.shards_done_before == summary.shards_total

    # Training on the parquet latents and token ids, straight from the bucket: the worker fetches the text encoder
    # the files name (the model in the bucket) and encodes the ids in the step.
    summary = train(
        load_config(
            None,
            [
                f"data.train={output}",
                "data.caption_column=caption_ids",
                f"data.unconditional_caption={output}/unconditional_caption_ids.npy",
                "data.shuffle_chunk_rows=4",
                "data.shuffle_window_rows=8",
                "model.preset=tiny",
                "train.max_steps=2",
                "train.global_batch_size=4",
                "train.warmup_steps=1",
                "scaling.num_workers=1",
                "scaling.use_gpu=false",
                f"run.storage_path={tmp_path / 'runs'}",
                "run.name=from-s3",
                "checkpoint.every_n_steps=2",
                "run.log_every_n_steps=1",
            ],
        )
    )
    assert summary.final_step == 2 and np.isfinite(summary.final_loss)
    assert load_model(str(tmp_path / "runs" / "from-s3")).meta.text_encoder == model
    # The export is a whole pipeline: its VAE and text encoder come from the model in the bucket.
    export = tmp_path / "runs" / "from-s3" / "export"
    assert (export / "model_index.json").is_file()
    # Its card's grid, rendered at export for captions read from the bucket (the run drew none).
    assert "a photograph of a" in (export / "README.md").read_text()
    with Image.open(export / "sample_grid.png") as grid:
        assert grid.format == "PNG"
    # Prompts in words for the run: the text encoder and VAE its data records, fetched from the bucket.
    out = tmp_path / "prompted"
    generate(
        GenerateRequest(
            str(tmp_path / "runs" / "from-s3"), out=str(out), prompts=["a red fox"], samples_per_caption=1, steps=2
        )
    )
    with Image.open(out / "images" / "row00_sample00.png") as image:
        assert image.size == (RESOLUTION, RESOLUTION)
    assert json.loads((out / "generate.json").read_text())["vae"] == model


# --- the whole loop ---

PROMPTS = ["a photograph of a china", "a photograph of a flower"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_images_to_latents_to_training_to_prompted_pipeline(tmp_path, tiny_model, ray_cluster):
    """preprocess (captions stored both ways) -> train a few steps on the token ids, encoded in the step, with
    accumulation, an EMA, validation and sample grids of prompts in words -> generate.py --prompt -> PNGs, and the
    grids' prompts by default; the run's export is a diffusers pipeline that from_pretrained loads and prompts."""
    from diffusers import DiffusionPipeline

    from sdtrain.artifacts.loading import load_model
    from sdtrain.config.loader import load_config
    from sdtrain.data.metadata import TEXT_ENCODER_SOURCE, TOKEN_VOCAB_SIZE
    from sdtrain.driver.run import train
    from sdtrain.preprocess.job import run_preprocess

    write_parquet_input(tmp_path / "input", files=2)
    run_preprocess(config_for(tmp_path, tiny_model, "output.captions=both"))
    latents = tmp_path / "latents"
    shard = pq.read_table(sorted(latents.glob(SHARD_FILES))[0])
    assert shard.schema.field("caption_ids").type == pa.list_(pa.int32())
    assert shard.schema.field("caption_latents").type == pa.list_(pa.float16())
    assert shard.schema.metadata[TEXT_ENCODER_SOURCE.encode()] == tiny_model.encode()
    assert int(shard.schema.metadata[TOKEN_VOCAB_SIZE.encode()]) == len(load_text_encoder(tiny_model)[0])
    assert np.load(latents / "unconditional_caption_ids.npy").dtype == np.int32
    summary = train(
        load_config(
            None,
            [
                f"data.train={latents}",
                f"data.val={latents}",
                "data.caption_column=caption_ids",
                f"data.unconditional_caption={latents / 'unconditional_caption_ids.npy'}",
                "data.shuffle_chunk_rows=4",
                "data.shuffle_window_rows=8",
                "model.preset=tiny",
                "train.max_steps=4",
                "train.global_batch_size=4",
                "train.micro_batch_size=2",
                "train.ema_decay=0.9",
                "train.warmup_steps=1",
                "train.caption_dropout_prob=0.1",
                "scaling.num_workers=1",
                "scaling.use_gpu=false",
                f"run.storage_path={tmp_path / 'runs'}",
                "run.name=loop",
                "checkpoint.every_n_steps=4",
                "run.log_every_n_steps=2",
                f"sample_grid.prompts={PROMPTS}",  # encoded on the driver by the encoder the ids are for
            ],
        )
    )
    assert summary.final_step == 4
    run_dir = tmp_path / "runs" / "loop"
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert np.isfinite(float(rows[-1]["val_loss"]))
    trained = load_model(str(run_dir / "checkpoint_000000004"))
    assert trained.meta.text_encoder == tiny_model and trained.meta.caption_shape == (77, 32)
    assert trained.meta.grid_prompts == PROMPTS and trained.meta.grid_text_encoder == tiny_model
    with Image.open(run_dir / "samples" / "step_4.png") as grid:  # a row a prompt, 4 samples each, at zoom 2
        tile = 2 * trained.meta.latent_shape[-1] + 2
        assert grid.size[1] == 2 * tile + 2 and grid.size[0] - 4 * tile - 2 > 60  # a margin for the prompts' text
    # The empty prompt's ids, encoded by the run's text encoder: the embedding preprocessing stored for them.
    torch.testing.assert_close(
        trained.unconditional_caption,
        torch.from_numpy(np.load(latents / "unconditional_caption.npy")),
        atol=1e-5,
        rtol=1e-4,
    )

    out = tmp_path / "samples"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "entrypoints" / "generate.py"),
            str(run_dir),
            "--prompt",
            PROMPTS[0],
            "--prompt",
            PROMPTS[1],
            "--samples-per-caption",
            "2",
            "--steps",
            "3",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    pngs = sorted((out / "images").glob("*.png"))
    assert len(pngs) == 4 and (out / "grid.png").is_file()
    assert Image.open(pngs[0]).size == (RESOLUTION, RESOLUTION)
    info = json.loads((out / "generate.json").read_text())
    assert info["prompts"] == PROMPTS and info["vae"] == tiny_model

    # Given no captions or prompts: the prompts of the run's grids, the same samples.
    from sdtrain.sampling.generate import GenerateRequest, generate

    default = GenerateRequest(str(run_dir), out=str(tmp_path / "default"), samples_per_caption=2, steps=3)
    generate(default)
    assert default.prompts == PROMPTS and default.text_encoder == tiny_model
    assert np.array_equal(np.load(tmp_path / "default" / "latents.npy"), np.load(out / "latents.npy"))

    # Sampling with the data's own captions, stored as token ids: the model's text encoder encodes them.
    from_ids = tmp_path / "from-ids"
    request = GenerateRequest(
        str(run_dir), captions=str(latents), caption_column="caption_ids", rows=2, samples_per_caption=1, steps=2
    )
    request.out = str(from_ids)
    generate(request)
    sampled = np.load(from_ids / "latents.npy")  # no --vae: latents and their preview
    assert len(sampled) == 2 and np.isfinite(sampled).all() and (from_ids / "preview.png").is_file()

    export = run_dir / "export"
    for part in ("model_index.json", "README.md", "unet", "vae", "text_encoder", "tokenizer", "scheduler"):
        assert (export / part).exists(), part
    card = (export / "README.md").read_text()
    assert "step 4" in card
    # The card shows the grid the run drew of its prompts (tests/test_export_generate.py renders one at export for a
    # run that drew none).
    assert "![Samples](sample_grid.png)" in card and "The sample grid training drew at step 4" in card
    assert (export / "sample_grid.png").read_bytes() == (run_dir / "samples" / "step_4.png").read_bytes()
    pipeline = DiffusionPipeline.from_pretrained(str(export))
    assert type(pipeline).__name__ == "StableDiffusionPipeline"
    images = pipeline("a red fox", num_inference_steps=2, height=RESOLUTION, width=RESOLUTION, output_type="np").images
    assert images.shape == (1, RESOLUTION, RESOLUTION, 3) and np.isfinite(images).all()
    loaded = load_model(str(export))  # sdtrain still loads the pipeline export as a model
    assert loaded.global_step == 4 and loaded.unconditional_caption is not None
