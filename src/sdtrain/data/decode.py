"""Vectorized decoding of latent/caption columns, whatever parquet encoding they arrived in.

Three encodings are read: a flat list of floats per row (the Anyscale notebook's files), a
fixed-size list, and Ray Data's tensor extension type (what ``Dataset.write_parquet`` writes
for ndarray columns). Values stay float16 or float32, as stored: the cast to the training
dtype happens on the device, so the object store moves half the bytes for float16 data.
A caption column may instead hold integers: token ids, read as int32 and encoded in the training step
(sdtrain.model.token_captions); every id is checked against the vocabulary its file records as it is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sdtrain.data.metadata import TOKEN_VOCAB_SIZE
from sdtrain.errors import DataError

_FLOAT_TYPES = {pa.float16(): np.float16, pa.float32(): np.float32, pa.float64(): np.float64}
_ID_TYPES = (pa.int32(), pa.int64(), pa.uint16(), pa.uint32())


class TokenIdOutOfRange(DataError):
    """A token id outside the vocabulary its file records: the ids are another tokenizer's or were written wrongly.
    Not a damaged file: ``data.on_read_error=skip`` does not skip its rows."""


@dataclass(frozen=True)
class ColumnLayout:
    """How one column stores its per-row tensor."""

    encoding: str  # "list", "fixed_size_list" or "tensor"
    value_type: pa.DataType
    values_per_row: int | None  # None for a variable-size list: known only from a row
    shape: tuple[int, ...] | None  # only the tensor type records the shape itself

    @property
    def token_ids(self) -> bool:
        """Integers: caption token ids, not embeddings."""
        return self.value_type in _ID_TYPES

    def describe(self) -> str:
        if self.encoding == "tensor":
            return f"Ray tensor of shape {self.shape} ({self.value_type})"
        if self.encoding == "fixed_size_list":
            return f"fixed-size list of {self.values_per_row} {self.value_type}"
        return f"list of {self.value_type}"


def column_layout(field: pa.Field) -> ColumnLayout:
    """The layout of ``field``, or a DataError (without file context) saying what is wrong."""
    tp = field.type
    shape = None
    if isinstance(tp, pa.ExtensionType):
        shape = getattr(tp, "shape", None)
        tp = tp.storage_type
    elif field.metadata and b"arrow_tensor" in field.metadata.get(b"ARROW:extension:name", b""):
        # A Ray tensor column read where Ray's extension types are not registered.
        shape = json.loads(field.metadata[b"ARROW:extension:metadata"]).get("shape")
    if shape is not None and any(d is None or d < 0 for d in shape):
        raise DataError(f"holds variable-shaped tensors {shape}; every row must have the same shape")

    if pa.types.is_fixed_size_list(tp):
        encoding, values_per_row = "fixed_size_list", tp.list_size
    elif pa.types.is_list(tp) or pa.types.is_large_list(tp):
        encoding, values_per_row = "list", None
    else:
        raise DataError(f"has type {field.type}; expected a list of float16/float32 values or a Ray tensor column")
    if shape is not None:
        encoding, values_per_row = "tensor", int(np.prod(shape))
    value_type = tp.value_type
    if value_type not in _FLOAT_TYPES and value_type not in _ID_TYPES:
        nested = " (nested lists are not read: store the values flat)" if pa.types.is_list(value_type) else ""
        raise DataError(f"holds {value_type} values{nested}; expected float16 or float32 (or int32 token ids)")
    return ColumnLayout(encoding, value_type, values_per_row, tuple(shape) if shape is not None else None)


def to_array(
    column: pa.ChunkedArray | pa.Array,
    shape: tuple[int, ...],
    name: str,
    vocab_size: int | None = None,
    first_row: int = 0,
) -> np.ndarray:
    """Rows of ``column`` as one (rows, *shape) float16/float32 array (int32 for token ids); DataError if a row does
    not fit. Token ids with ``vocab_size`` given are checked to be below it (:func:`check_token_ids`; ``first_row``:
    the file's row number of the column's first row, for the error)."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if isinstance(array, pa.ExtensionArray):
        array = array.storage
    if array.null_count:
        raise DataError(f"column {name!r} has {array.null_count} null row(s); every row needs a value")
    expected = int(np.prod(shape))
    if pa.types.is_fixed_size_list(array.type):
        sizes = (array.type.list_size, array.type.list_size)
    else:
        lengths = pc.min_max(pc.list_value_length(array))
        sizes = (lengths["min"].as_py(), lengths["max"].as_py())
    if len(array) and sizes != (expected, expected):
        found = sizes[0] if sizes[0] != expected else sizes[1]
        raise DataError(
            f"column {name!r} has a row of {found} values; expected {expected} = {' x '.join(map(str, shape))}"
        )
    values = array.flatten().to_numpy(zero_copy_only=False)
    if vocab_size is not None and values.dtype.kind in "iu":  # before the cast to int32, which could wrap an id
        check_token_ids(values.reshape(len(array), -1), vocab_size, name, first_row)
    if values.dtype == np.float64:
        values = values.astype(np.float32)
    elif values.dtype.kind in "iu" and values.dtype != np.int32:  # token ids: below any vocabulary's 2**31
        values = values.astype(np.int32)
    return values.reshape((len(array), *shape))


def caption_array(
    table: pa.Table, columns: tuple[str, ...], shape: tuple[int, ...], vocab_size: int | None = None, first_row: int = 0
) -> np.ndarray:
    """The captions of ``table``'s rows, (rows, *shape): the one caption column's (:func:`to_array`), or token ids of
    several tokenizers (SDXL's), each of ``columns``' L ids joined in turn into ``shape`` = (T x L,)."""
    if len(columns) == 1:
        return to_array(table.column(columns[0]), shape, columns[0], vocab_size, first_row)
    length = (shape[0] // len(columns),)
    return np.concatenate([to_array(table.column(c), length, c, vocab_size, first_row) for c in columns], axis=1)


def check_token_ids(ids: np.ndarray, vocab_size: int, name: str, first_row: int = 0) -> None:
    """A TokenIdOutOfRange naming the row (``first_row`` + its index in ``ids``, one row of ids a row) and the value of
    the first id outside [0, ``vocab_size``). A batch costs a min and a max; the search for the row only a failure."""
    if not ids.size or (ids.min() >= 0 and ids.max() < vocab_size):
        return
    row, position = (int(i) for i in np.argwhere((ids < 0) | (ids >= vocab_size))[0])
    raise TokenIdOutOfRange(
        f"column {name!r}, row {first_row + row}: token id {ids[row, position]} (position {position}) is outside the "
        f"vocabulary of {vocab_size} ids the file records ({TOKEN_VOCAB_SIZE}): the ids were made with another "
        "tokenizer or written wrongly. Re-write the file (sdtrain preprocessing, output.captions: token_ids) or "
        "remove it, and re-run (the run resumes from its latest checkpoint)"
    )
