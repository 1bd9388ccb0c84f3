"""How well samples of a model trained on the digits demo show the digit they were conditioned on."""

from __future__ import annotations

import numpy as np

from sdtrain.artifacts.loading import LoadedModel
from sdtrain.sampling.captions import Captions


def demo_labels(loaded: LoadedModel, captions: Captions) -> list[int] | None:
    """Each grid row's digit when the model was trained on the digits demo and the captions are the
    demo's own (a ``label`` column of digits, each row's embedding the demo's caption of its
    digit); else None, and there is no class agreement to measure."""
    from sdtrain.demo.digits import NUM_CLASSES, class_captions

    if not loaded.trained_on_demo or captions.labels is None:
        return None
    labels = captions.labels
    if not all(isinstance(label, int) and 0 <= label < NUM_CLASSES for label in labels):
        return None
    expected = class_captions(captions.embeddings.shape[-1])[labels]
    if expected.shape != tuple(captions.embeddings.shape) or not np.allclose(
        captions.embeddings.numpy(), expected, atol=1e-2
    ):
        return None
    return list(labels)


def class_agreement_report(latents: np.ndarray, labels: list[int], samples_per_caption: int) -> dict:
    """The share of samples whose decoded digit is the one they were conditioned on, with chance
    and the classifier's agreement on real digits for scale."""
    from sdtrain.demo.digits import class_agreement, real_digits_agreement

    return {
        **class_agreement(latents, np.repeat(labels, samples_per_caption)),
        "chance": 0.1,
        "real_digits": round(real_digits_agreement(), 4),
        "classifier": (
            "an SVC (RBF kernel) fitted on the demo's training digits, on each sample decoded by "
            "sdtrain.demo.digits.digits_from_latents; real_digits = its agreement on the real validation digits"
        ),
    }
