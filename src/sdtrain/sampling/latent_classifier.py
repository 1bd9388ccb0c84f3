"""Latent classifiers: modules that read latents without a VAE, named by a dataset's files (parquet metadata
``sdtrain.latent_classifier``, :mod:`sdtrain.data.metadata`), so that samples of a model trained on them can be looked
at and scored by class without decoding. The digits demo's files name ``sdtrain.demo.digits``.

A latent classifier module has

- ``preview(latents: np.ndarray) -> np.ndarray``: (N, C, H, W) latents to (N, h, w) or (N, h, w, 3) uint8 pictures;
- ``class_agreement(latents, labels) -> dict``: ``class_agreement`` (the share of samples it reads as their label),
  ``samples``, ``agreeing``;
- and may have ``report(latents, labels, samples_per_caption, embeddings) -> dict | None``: what ``generate.py`` writes
  of a grid whose rows are labelled (None: those captions are not ones whose labels it can read); and ``check()``,
  which raises if it cannot run here (a missing package), called before Ray starts.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from sdtrain.errors import DataError

REQUIRED = ("preview", "class_agreement")


def load_latent_classifier(name: str, where: str) -> ModuleType:
    """The module ``name``, checked to be a latent classifier; a DataError naming ``where`` (what named it) if not."""
    try:
        module = importlib.import_module(name)
    except ImportError as error:
        raise DataError(f"{where}: the latent classifier {name!r} cannot be imported: {error}") from None
    missing = [f for f in REQUIRED if not callable(getattr(module, f, None))]
    if missing:
        raise DataError(f"{where}: {name!r} is no latent classifier: it has no {'(), '.join(missing)}()")
    if callable(getattr(module, "check", None)):
        try:
            module.check()
        except ImportError as error:
            raise DataError(f"{where}: the latent classifier {name!r} cannot run here: {error}") from None
    return module
