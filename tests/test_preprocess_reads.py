"""Reading the inputs without Ray: a shard cut from a parquet row group far larger than a shard reads its own rows in
bounded memory (and planning warns of such files), and a captions file that starts with a UTF-8 byte-order mark."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image
from support.log_lines import LogLines

from sdtrain.preprocess.config import InputConfig
from sdtrain.preprocess.sources import Shard, list_shards, read_shard

ROWS, IMAGE_BYTES = 2000, 32 << 10


def _one_group(path: Path) -> list[bytes]:
    """A file of one row group of ROWS images (62.5 MiB), in pages of 64 rows, as pyarrow writes one by default
    (row_group_size 1Mi rows) but for its pages (1,024 rows a page by default, a page being the least read)."""
    rng = np.random.default_rng(0)
    images = [rng.bytes(IMAGE_BYTES) for _ in range(ROWS)]
    table = pa.table({"jpg": images, "caption": [f"c{i}" for i in range(ROWS)]})
    pq.write_table(table, path, compression="none", use_dictionary=["caption"], write_batch_size=64)
    assert pq.ParquetFile(path).num_row_groups == 1
    return images


def test_a_shard_of_a_large_row_group_reads_its_rows_not_the_group(tmp_path):
    """Each shard cut from one large row group read all of the group (read_row_group, then slice): a 10 GiB group
    in the memory of every task reading one of its shards."""
    path = tmp_path / "one-group.parquet"
    images = _one_group(path)
    config = InputConfig(paths=[str(path)], rows_per_shard=100)
    expected = pq.ParquetFile(path).read_row_group(0).slice(1037, 100).to_pydict()  # the group read whole
    before, held = pa.total_allocated_bytes(), 0
    rows = []
    for row in read_shard(Shard("s", str(path), 1037, 1137), config):  # in the middle, off any page's edge
        held = max(held, pa.total_allocated_bytes() - before)  # Arrow's buffers alive at each row
        rows.append(row)
    assert [row.key for row in rows] == [f"{path}:{i}" for i in range(1037, 1137)]
    assert [row.image for row in rows] == expected["jpg"] == images[1037:1137]
    assert [row.caption for row in rows] == expected["caption"]
    group_bytes = ROWS * IMAGE_BYTES
    assert held < group_bytes / 3, (held, group_bytes)  # a buffer and a batch of rows, not the 62.5 MiB group
    for start, stop in [(0, 100), (1900, 2000), (1999, 2000)]:  # the group's first and last rows
        assert [row.image for row in read_shard(Shard("s", str(path), start, stop), config)] == images[start:stop]
    with LogLines() as lines:
        shards = list_shards(config)
    assert len(shards) == 20
    (warning,) = lines.messages
    assert warning.startswith(f"input.paths: {path} has a row group of 2000 rows, more than input.rows_per_shard (100)")
    assert "each of its ~20 shards reads the group's bytes" in warning and "row_group_size" in warning
    with LogLines() as lines:
        list_shards(InputConfig(paths=[str(path)], rows_per_shard=2000))
    assert lines.messages == []  # a group no larger than a shard: nothing to say


def test_a_captions_file_with_a_byte_order_mark_is_read_by_its_column_names(tmp_path):
    """Excel's "CSV UTF-8" starts with a BOM, which became part of the first column's name: the file_name column
    was reported missing, its fields listed as '\\ufefffile_name'."""
    folder = tmp_path / "images"
    folder.mkdir()
    Image.new("RGB", (40, 40), (200, 10, 10)).save(folder / "a.jpg")
    (folder / "captions.csv").write_text("file_name,caption\na.jpg,a red square\n", encoding="utf-8-sig")
    (folder / "captions.jsonl").write_text('{"file_name": "a.jpg", "caption": "red"}\n', encoding="utf-8-sig")
    for name, caption in (("captions.csv", "a red square"), ("captions.jsonl", "red")):
        config = InputConfig(paths=[str(folder)], format="folder", captions_file=str(folder / name))
        (shard,) = list_shards(config)
        assert shard.rows == (("a.jpg", caption),), name
