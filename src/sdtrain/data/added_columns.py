"""The columns an SDXL-shaped UNet's added conditioning is read from, beside the latents and captions
(:mod:`sdtrain.model.conditioning` says what the UNet does with them).

- ``pooled``: the pooled text embedding of each row's caption, P float values a row (data.pooled_caption_column,
  preprocessing's ``caption_pooled``), for data of caption embeddings; data of token ids has none: the text encoders
  compute it in the step.
- ``placement``: where each image went, in pixels (preprocessing writes these int32 columns for every image): its
  original height and width and the top-left corner of its crop. Data without them is read without; the UNet is then
  told each image is its latents' own size, uncropped.

A batch carries them as ``pooled`` (N, P) and ``placement`` (N, 4) int32. Light on purpose: Ray Data's read tasks
import it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from sdtrain.data.decode import to_array

PLACEMENT_COLUMNS = ("original_height", "original_width", "crop_top", "crop_left")
"""A row's placement, in the order of SDXL's first four time ids."""
BUCKET_COLUMN = "bucket"
"""A row's aspect-ratio bucket, an index into its file's sdtrain.bucket_shapes."""


@dataclass(frozen=True)
class AddedColumns:
    """Which added-conditioning columns a dataset is read with (the driver's data check decides, from the UNet and
    the data's schema).

    Args:
        pooled: the pooled embedding's column; None: the captions are token ids (encoded in the step).
        pooled_width: P, the UNet's pooled text embedding width.
        placement: the files have the placement columns.
    """

    pooled: str | None
    pooled_width: int
    placement: bool

    def names(self) -> list[str]:
        """The columns to read."""
        return ([self.pooled] if self.pooled else []) + (list(PLACEMENT_COLUMNS) if self.placement else [])

    def decode(self, table: pa.Table) -> dict[str, np.ndarray]:
        """The batch arrays of ``table``'s rows."""
        arrays = {}
        if self.pooled:
            arrays["pooled"] = to_array(table.column(self.pooled), (self.pooled_width,), self.pooled)
        if self.placement:
            arrays["placement"] = np.stack(
                [table.column(name).to_numpy().astype(np.int32) for name in PLACEMENT_COLUMNS], axis=1
            )
        return arrays

    def empty(self, rows: int) -> dict[str, np.ndarray]:
        """Zeros for ``rows`` unreadable rows skipped under data.on_read_error=skip (the loss leaves them out)."""
        arrays = {}
        if self.pooled:
            arrays["pooled"] = np.zeros((rows, self.pooled_width), np.float16)
        if self.placement:
            arrays["placement"] = np.zeros((rows, len(PLACEMENT_COLUMNS)), np.int32)
        return arrays
