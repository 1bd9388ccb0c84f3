"""The demo's class-agreement check: a nearest-class-mean digit classifier, run on the real demo
data as written to parquet (no model, under a few seconds)."""

import numpy as np
import pyarrow.parquet as pq

from sdtrain.data.decode import to_array
from sdtrain.data.demo import (
    NUM_CLASSES,
    class_agreement,
    classify_digits,
    digit_class_means,
    ensure_demo_data,
    real_digits_agreement,
)


def _read(directory):
    table = pq.read_table(directory)
    return to_array(table.column("image_latents_256"), (4, 16, 16), "image_latents_256").astype(np.float32), np.asarray(
        table.column("label")
    )


def test_real_demo_latents_agree_with_their_labels_and_shuffled_labels_do_not(tmp_path):
    ensure_demo_data(str(tmp_path / "train"), str(tmp_path / "val"), caption_dim=32)
    for split, floor in (("train", 0.9), ("val", 0.85)):
        latents, labels = _read(tmp_path / split)
        result = class_agreement(latents, labels)
        # The ceiling of a nearest-class-mean classifier on real handwriting: 0.91 and 0.87, not 1.
        assert result["class_agreement"] >= floor, (split, result)
        assert result["samples"] == len(labels) and set(result["per_class"]) == set(range(NUM_CLASSES))
        shuffled = class_agreement(latents, np.random.default_rng(0).permutation(labels))
        assert shuffled["class_agreement"] < 0.2, (split, shuffled)  # chance is 0.1
    assert abs(real_digits_agreement() - class_agreement(*_read(tmp_path / "val"))["class_agreement"]) < 0.01


def test_the_classifier_reads_shape_not_contrast_and_refuses_blanks():
    means = digit_class_means()
    assert means.shape == (NUM_CLASSES, 16, 16)
    assert (classify_digits(means) == np.arange(NUM_CLASSES)).all()
    assert (classify_digits(0.2 * means) == np.arange(NUM_CLASSES)).all()  # a faint digit is still that digit
    assert (classify_digits(np.stack([np.zeros((16, 16)), np.full((16, 16), 30.0)])) == -1).all()  # blank, saturated
