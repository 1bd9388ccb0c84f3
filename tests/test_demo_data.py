"""The demo's class-agreement check: an SVC digit classifier, run on the real demo data as written to parquet (no
model, under a few seconds)."""

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import REPO

from sdtrain.data.decode import to_array
from sdtrain.demo.digits import (
    NUM_CLASSES,
    class_agreement,
    classify_digits,
    digits_from_latents,
    ensure_demo_data,
    real_digits_agreement,
)
from sdtrain.errors import DataError


def _read(directory):
    table = pq.read_table(directory)
    return to_array(table.column("image_latents_256"), (4, 16, 16), "image_latents_256").astype(np.float32), np.asarray(
        table.column("label")
    )


def test_real_demo_latents_agree_with_their_labels_and_shuffled_labels_do_not(tmp_path):
    ensure_demo_data(str(tmp_path / "train"), str(tmp_path / "val"), caption_dim=32)
    for split, floor in (("train", 0.99), ("val", 0.94)):
        latents, labels = _read(tmp_path / split)
        result = class_agreement(latents, labels)
        # Fitted on the training digits it reads them all; on the held-out ones 0.95 (a nearest class mean read 0.87
        # of them, which left a model's samples no room to show an improvement past that).
        assert result["class_agreement"] >= floor, (split, result)
        assert result["samples"] == len(labels) and set(result["per_class"]) == set(range(NUM_CLASSES))
        shuffled = class_agreement(latents, np.random.default_rng(0).permutation(labels))
        assert shuffled["class_agreement"] < 0.2, (split, shuffled)  # chance is 0.1
    assert abs(real_digits_agreement() - class_agreement(*_read(tmp_path / "val"))["class_agreement"]) < 0.01


def test_the_classifier_reads_the_digits_as_the_demo_decodes_them_and_refuses_blanks(tmp_path):
    ensure_demo_data(str(tmp_path / "train"), str(tmp_path / "val"), caption_dim=32)
    latents, labels = _read(tmp_path / "val")
    images = digits_from_latents(latents)  # 16x16, each 8x8 pixel a 2x2 block, 0..16 up to float16 rounding
    assert images.shape == (len(labels), 16, 16) and abs(images.max() - 16) < 0.1 and abs(images.min()) < 0.1
    # What decides is the shape: noise of a tenth of the ink's range leaves the reading of almost every digit as it
    # was, a blank image (or one saturated everywhere) is no digit at all.
    noisy = images + np.random.default_rng(0).normal(0, 1.6, images.shape)
    assert (classify_digits(noisy) == classify_digits(images)).mean() > 0.9
    assert (classify_digits(np.stack([np.zeros((16, 16)), np.full((16, 16), 30.0)])) == -1).all()
    assert len(classify_digits(np.zeros((0, 16, 16)))) == 0


def test_demo_files_of_an_older_layout_are_refused_with_how_to_renew_them(tmp_path):
    assert ensure_demo_data(str(tmp_path / "train"), str(tmp_path / "val"), caption_dim=32)
    assert not ensure_demo_data(str(tmp_path / "train"), str(tmp_path / "val"), caption_dim=32)  # there: kept
    first = tmp_path / "val" / "part-00000.parquet"
    pq.write_table(pq.read_table(first).replace_schema_metadata(None), first)  # as sdtrain wrote it before layout 2
    with pytest.raises(
        DataError,
        match=rf"the digits demo: {first} holds its data as another sdtrain version.*"
        rf"remove {tmp_path / 'val'}",
    ):
        ensure_demo_data(str(tmp_path / "train"), str(tmp_path / "val"), caption_dim=32)


def test_the_demo_door_writes_its_data_only_where_its_config_names_it(tmp_path, monkeypatch):
    import yaml

    from sdtrain.data.metadata import latent_classifier
    from sdtrain.demo import digits

    shipped = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())["data"]
    assert [shipped["train"], shipped["val"]] == [f"{digits.DATA_DIR}/train", f"{digits.DATA_DIR}/val"]
    monkeypatch.chdir(tmp_path)
    assert digits.prepare([str(tmp_path / "mine")], [], caption_dim=32) is None  # other data: nothing written
    assert not (tmp_path / "mine").exists() and not (tmp_path / digits.DATA_DIR).exists()
    written = digits.prepare([shipped["train"]], [shipped["val"]], caption_dim=32)
    assert written == str(tmp_path / digits.DATA_DIR / "train")
    first = tmp_path / digits.DATA_DIR / "val" / "part-00000.parquet"
    assert latent_classifier(pq.read_schema(first).metadata) == "sdtrain.demo.digits"  # its files name their reader
    assert digits.prepare([shipped["train"]], [shipped["val"]], caption_dim=32) is None  # there already: kept
