"""Planning the preprocessing job on the driver without Ray: footers and markers read many at a time, the input
columns' types checked before any Ray work (a Hugging Face Image column read), every PIL mode's pixels on their own
scale, and the shards' float lists written without dictionary encoding."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from PIL import Image
from support.wrapped_fs import InFlight, wrapped_local

from sdtrain.errors import DataError
from sdtrain.preprocess.buckets import Placement
from sdtrain.preprocess.config import InputConfig
from sdtrain.preprocess.images import prepare_image


def _encoded(image: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def _jpeg() -> bytes:
    return _encoded(Image.fromarray(np.full((40, 40, 3), 128, np.uint8)), "JPEG")


def _parquet_files(directory: Path, rows: list[int]) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    for i, n in enumerate(rows):
        pq.write_table(
            pa.table({"jpg": pa.array([b"x"] * n, pa.binary()), "caption": ["c"] * n}), directory / f"{i:03d}.parquet"
        )
    return [str(directory / f"{i:03d}.parquet") for i in range(len(rows))]


# --- A. planning reads many at a time, and no footer of a file whose shards are all done ---


def test_footers_and_markers_are_read_many_at_a_time_in_order(tmp_path, monkeypatch):
    """2e5 input footers, three requests each, take ~21 min 16 at a time at 30 ms a request (simulated,
    bench/results/2026-11-30-footer-reads.md): PLANNING_READS (128) at once, on a filesystem made with as many
    connections (:func:`sdtrain.storage.s3.s3_connections`)."""
    from sdtrain.preprocess import outputs, planning
    from sdtrain.preprocess.outputs import read_shard_stats
    from sdtrain.preprocess.planning import PLANNING_READS
    from sdtrain.preprocess.sources import list_shards

    _parquet_files(tmp_path / "in", [3] * 40)
    footers, made_with, real = InFlight(), [], planning.filesystems_for
    monkeypatch.setattr(pq, "read_metadata", footers(pq.read_metadata))

    def filesystems_for(paths):
        made_with.append(pa.io_thread_count())
        return real(paths)

    monkeypatch.setattr(planning, "filesystems_for", filesystems_for)
    io_threads = pa.io_thread_count()
    shards = list_shards(InputConfig(paths=[str(tmp_path / "in")]))
    assert [s.source for s in shards] == sorted(s.source for s in shards) and len(shards) == 40
    assert footers.calls == 40 and footers.most > 16, footers.most  # all 40 at once, within PLANNING_READS
    assert PLANNING_READS >= 128 and made_with == [max(io_threads, PLANNING_READS)]
    assert pa.io_thread_count() == io_threads

    (tmp_path / "out" / "_shards").mkdir(parents=True)
    for i in range(40):
        (tmp_path / "out" / "_shards" / f"s{i:03d}.json").write_text(json.dumps({"shard": f"s{i:03d}"}))
    markers = InFlight()
    counting = wrapped_local(markers)
    monkeypatch.setattr(outputs, "filesystem_for", lambda path: (counting, path))
    assert [r["shard"] for r in read_shard_stats(str(tmp_path / "out"))] == [f"s{i:03d}" for i in range(40)]
    assert markers.calls == 40 and markers.most > 4


def test_markers_are_read_128_at_a_time_on_as_many_s3_connections(tmp_path, monkeypatch):
    """A re-run reads every done shard's marker (2e6 at 2e9 rows): 16 at a time took 2 h at 30 ms a request. Their
    filesystem is made while pyarrow's IO threads number MARKER_READS: its S3 client keeps max(those, 25)
    connections, and 128 threads on 25 connections were no faster than 25 (bench/results/2026-11-29-markers.md)."""
    import pyarrow as pa

    from sdtrain.preprocess import outputs
    from sdtrain.preprocess.outputs import read_shard_stats
    from sdtrain.preprocess.planning import MARKER_READS

    (tmp_path / "_shards").mkdir()
    for i in range(300):
        (tmp_path / "_shards" / f"s{i:03d}.json").write_text(json.dumps({"shard": f"s{i:03d}"}))
    markers, io_threads = InFlight(), []
    counting = wrapped_local(markers)

    def filesystem_for(path: str):
        io_threads.append(pa.io_thread_count())
        return counting, path

    monkeypatch.setattr(outputs, "filesystem_for", filesystem_for)
    before = pa.io_thread_count()
    assert [r["shard"] for r in read_shard_stats(str(tmp_path))] == [f"s{i:03d}" for i in range(300)]
    assert markers.calls == 300 and markers.most > 32, markers.most
    # The markers' filesystem made with MARKER_READS threads (then the digest's, one GET, without).
    assert MARKER_READS >= 128 and io_threads[0] == max(before, MARKER_READS) and pa.io_thread_count() == before


def test_a_rerun_takes_the_markers_older_than_the_last_runs_digest_from_it_and_reads_only_the_others(
    tmp_path, monkeypatch, caplog
):
    """2e6 markers took ~16 min to read at 128 at a time: a run ends by writing every done shard's record into one
    digest, and the next takes from it each marker the store's clock has older than the digest (past a margin of a
    few seconds: S3 keeps whole seconds). Newer markers (rewritten since, or written by a run killed before its
    digest) and markers it lacks are read; a shard in it whose marker is gone is not done."""
    from sdtrain.preprocess import outputs
    from sdtrain.preprocess.outputs import SHARDS_DIGEST, done_shards, write_shards_digest

    now = time.time()
    (tmp_path / "_shards").mkdir()

    def marker(i: int, rows: int, age_s: float) -> dict:
        record = {"shard": f"s{i:03d}", "rows_written": rows}
        path = tmp_path / "_shards" / f"s{i:03d}.json"
        path.write_text(json.dumps(record))
        os.utime(path, (now - age_s,) * 2)
        return record

    old = [marker(i, i, 100) for i in range(30)]
    write_shards_digest(str(tmp_path), [*old, *({"shard": f"s{i:03d}", "rows_written": -1} for i in range(30, 36))])
    os.utime(tmp_path / SHARDS_DIGEST, (now - 50,) * 2)
    close = marker(30, 30, 51)  # one second older than the digest: within the margin
    rewritten = [marker(i, 1000 + i, 0) for i in range(31, 35)]  # since the digest: it holds their old records
    (tmp_path / "_shards" / "s035.json").unlink(missing_ok=True)  # in the digest, its marker deleted: not done
    unknown = [marker(i, i, 100) for i in range(36, 40)]  # never in a digest
    opened = InFlight()
    counting = wrapped_local(opened)
    monkeypatch.setattr(outputs, "filesystem_for", lambda path: (counting, path))
    found = done_shards(str(tmp_path))
    assert found.records == [*old, close, *rewritten, *unknown]
    assert found.markers_read == 9 and opened.calls == 9 + 1  # and the digest

    (tmp_path / SHARDS_DIGEST).write_bytes(b"not gzip")  # a digest that does not read: every marker is
    os.utime(tmp_path / SHARDS_DIGEST, (now - 50,) * 2)
    found = done_shards(str(tmp_path))
    assert found.records == [*old, close, *rewritten, *unknown] and found.markers_read == 39
    assert "does not read" in caplog.text


def test_on_s3_the_digest_and_the_markers_carry_the_stores_time_and_new_markers_are_read(s3_bucket):
    """S3's listing and HEAD give each marker and the digest their LastModified (whole seconds), which decides what is
    taken from the digest: markers written since are read."""

    from sdtrain.preprocess.outputs import SHARDS_DIGEST, done_shards, write_shards_digest
    from sdtrain.storage.filesystems import filesystem_for, write_bytes

    records = [{"shard": f"s{i:03d}", "rows_written": i} for i in range(5)]
    write_shards_digest(f"{s3_bucket}/out", [{**r, "rows_written": -1} for r in records])
    for record in records:  # rewritten since the digest
        write_bytes(f"{s3_bucket}/out/_shards/{record['shard']}.json", json.dumps(record).encode())
    fs, path = filesystem_for(f"{s3_bucket}/out")
    listed = fs.get_file_info(pafs.FileSelector(f"{path}/_shards"))
    digest = fs.get_file_info(f"{path}/{SHARDS_DIGEST}")
    assert digest.mtime is not None and all(info.mtime is not None for info in listed)
    found = done_shards(f"{s3_bucket}/out")
    assert found.records == records and found.markers_read == 5


def test_in_order_keeps_the_order_raises_the_first_failure_and_starts_no_more():
    from sdtrain.preprocess.planning import in_order

    assert list(in_order(lambda i: i * i, range(100), threads=4)) == [i * i for i in range(100)]
    started = []

    def read(i: int) -> int:
        started.append(i)
        time.sleep(0.01 if i != 3 else 0)
        if i in (3, 5):
            raise ValueError(f"cannot read {i}")
        return i

    with pytest.raises(ValueError, match="cannot read 3"):
        list(in_order(read, range(1000), threads=4))
    assert len(started) <= 16  # a bounded window: the rest were never started


def test_no_footer_is_read_of_a_file_whose_shards_are_all_done(tmp_path, monkeypatch):
    from sdtrain.preprocess.sources import list_shards

    # All done (a short last shard); its last shard full (more rows might follow); one shard of two done.
    files = _parquet_files(tmp_path / "in", [5, 4, 5])
    config = InputConfig(paths=[str(tmp_path / "in")], rows_per_shard=2)
    shards = list_shards(config)
    done = {s.name: {"shard": s.name, "identity": s.identity} for s in shards if s.source != files[2] or s.start == 0}
    footers = InFlight()
    monkeypatch.setattr(pq, "read_metadata", footers(pq.read_metadata))
    again = list_shards(config, done)
    assert again == shards and [s.identity for s in again] == [s.identity for s in shards]
    assert footers.calls == 2  # files[1] and files[2]

    # The file rewritten (another size): its footer is read again, its new rows listed.
    _parquet_files(tmp_path / "in", [7])
    footers.calls = 0
    assert [s.stop for s in list_shards(config, done) if s.source == files[0]] == [2, 4, 6, 7]
    assert footers.calls == 3


# --- B. the input columns' types, checked before any Ray work ---


def test_a_hugging_face_image_column_is_read_and_columns_of_other_types_are_refused(tmp_path):
    from sdtrain.preprocess.sources import list_shards, read_shard

    good = _jpeg()
    image = pa.array([{"bytes": good, "path": "0.jpg"}, {"bytes": None, "path": "1.jpg"}])  # datasets' Image
    pq.write_table(
        pa.table({"image": image, "text": pa.array(["a cat", "a dog"], pa.large_string())}), tmp_path / "hf.parquet"
    )
    config = InputConfig(paths=[str(tmp_path / "hf.parquet")], image_column="image", caption_column="text")
    rows = list(read_shard(list_shards(config)[0], config))
    assert [row.image for row in rows] == [good, None]  # a path without bytes: missing_image
    pixels, placed = prepare_image(rows[0].image, [(32, 32)], "upscale")
    assert isinstance(placed, Placement) and pixels is not None and abs(pixels.mean() - 128) < 2

    large = tmp_path / "large.parquet"
    pq.write_table(pa.table({"jpg": pa.array([good], pa.large_binary()), "caption": ["a cat"]}), large)
    config = InputConfig(paths=[str(large)])
    assert [row.image for row in read_shard(list_shards(config)[0], config)] == [good]

    for name, columns, key, expected in [
        ("urls", {"jpg": ["https://example.com/0.jpg"], "caption": ["a cat"]}, "input.image_column", "string"),
        ("paths", {"jpg": pa.array([{"path": "0.jpg"}]), "caption": ["a cat"]}, "input.image_column", "struct<path"),
        ("numbers", {"jpg": pa.array([good]), "caption": [7]}, "input.caption_column", "int64"),
    ]:
        pq.write_table(pa.table(columns), tmp_path / f"{name}.parquet")
        with pytest.raises(DataError) as failure:
            list_shards(InputConfig(paths=[str(tmp_path / f"{name}.parquet")]))
        message = str(failure.value)
        assert message.startswith(key) and f"{name}.parquet" in message and expected in message, message
        assert "expected" in message and ("binary" in message if key == "input.image_column" else "string" in message)


def test_a_webdataset_tar_on_s3_is_read_in_a_few_requests(s3_bucket, tmp_path):
    """tarfile's stream mode reads 10 KiB at a time: unbuffered, each read was a ranged GET of its own (~300 for this
    3 MB tar, ~50,000 for a 500 MB one). moto's server logs every request it answers."""
    import tarfile

    import boto3

    from sdtrain.preprocess.sources import list_shards, read_shard

    rng, buffer = np.random.default_rng(0), io.BytesIO()
    images = [rng.integers(0, 256, 50_000, dtype=np.uint8).tobytes() for _ in range(60)]
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for i, image in enumerate(images):
            for ext, data in ((".jpg", image), (".txt", f"caption {i}".encode())):
                member = tarfile.TarInfo(f"{i:06d}{ext}")
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
    boto3.client("s3").put_object(Bucket="sdtrain-test", Key="tars/00000.tar", Body=buffer.getvalue())
    config = InputConfig(format="webdataset", paths=[f"{s3_bucket}/tars"])
    shard = list_shards(config)[0]

    def gets() -> int:
        return (tmp_path / "moto.log").read_text().count("GET /sdtrain-test/tars/00000.tar")

    before = gets()
    rows = list(read_shard(shard, config))
    assert [row.image for row in rows] == images and rows[-1].caption == "caption 59"
    assert gets() - before <= 3


def _grouped_parquet(path: Path, groups: list[int], size: int) -> list[bytes]:
    """A parquet file of row groups of ``groups`` rows, each row an incompressible image of ``size`` bytes."""
    rng = np.random.default_rng(0)
    images = [rng.bytes(size) for _ in range(sum(groups))]
    schema = pa.schema([("jpg", pa.binary()), ("caption", pa.string())])
    with pq.ParquetWriter(path, schema, compression="none") as writer:
        first = 0
        for rows in groups:
            part = images[first : first + rows]
            writer.write_table(pa.table({"jpg": part, "caption": [f"c{first + i}" for i in range(rows)]}, schema))
            first += rows
    return images


def test_a_parquet_shard_keeps_its_rows_and_keys_across_row_groups(tmp_path):
    from sdtrain.preprocess.sources import Shard, read_shard

    path = tmp_path / "groups.parquet"
    images = _grouped_parquet(path, [5, 1, 7, 70, 5, 3], 10)  # one group wider than a batch of Python copies
    assert pq.ParquetFile(path).num_row_groups == 6
    config = InputConfig(paths=[str(path)])
    # Cut through groups, on their edges, inside one, one row, all of them.
    for start, stop in [(3, 17), (5, 13), (20, 90), (90, 91), (0, 91), (84, 91)]:
        rows = list(read_shard(Shard("s", str(path), start, stop), config))
        assert [row.key for row in rows] == [f"{path}:{i}" for i in range(start, stop)]
        assert [row.image for row in rows] == images[start:stop]
        assert [row.caption for row in rows] == [f"c{i}" for i in range(start, stop)]


def test_a_parquet_shard_holds_one_row_group_not_the_shard_before_its_first_row(tmp_path):
    """A shard's row groups were all read at once, and their columns copied to Python, before its first row: ~2.7x
    its image bytes in one task (~25 GiB at SDXL's rows per shard)."""
    import tracemalloc

    from sdtrain.preprocess.sources import Shard, read_shard

    path = tmp_path / "big.parquet"
    _grouped_parquet(path, [4] * 40, 64 << 10)  # 40 row groups of 256 KiB: a 10 MiB shard
    shard_bytes, group_bytes = 160 * (64 << 10), 4 * (64 << 10)
    rows = read_shard(Shard("s", str(path), 2, 160), InputConfig(paths=[str(path)]))
    arrow_before = pa.total_allocated_bytes()
    tracemalloc.start()
    try:
        next(rows)
        python_peak = tracemalloc.get_traced_memory()[1]  # the Python copies made before the first row
        arrow_held = pa.total_allocated_bytes() - arrow_before  # Arrow buffers alive at the first row
    finally:
        tracemalloc.stop()
        rows.close()
    # Arrow's: the group's decoded column and the pages it was decoded from.
    assert python_peak < 2 * group_bytes and arrow_held < 4 * group_bytes <= shard_bytes / 10, (python_peak, arrow_held)


# --- C. every mode's pixels on their own scale ---


def _gray(data: bytes) -> float:
    pixels, placed = prepare_image(data, [(16, 16)], "upscale")
    assert isinstance(placed, Placement) and pixels is not None
    return float(pixels.mean())


def test_16_bit_and_float_images_keep_their_brightness_and_a_colour_key_is_white():
    assert _gray(_encoded(Image.fromarray(np.full((16, 16), 32768, np.uint16)))) == 128
    assert _gray(_encoded(Image.fromarray(np.full((16, 16), 200, np.uint16)))) == 1  # dark stays dark, not 200
    assert _gray(_encoded(Image.fromarray(np.full((16, 16), 0.5, np.float32)), "TIFF")) == 128  # unit scale
    assert _gray(_encoded(Image.fromarray(np.full((16, 16), 100.0, np.float32)), "TIFF")) == 100  # PIL's 0..255
    black = np.zeros((16, 16), np.uint8)
    assert _gray(_encoded(Image.fromarray(black), transparency=0)) == 255
    assert _gray(_encoded(Image.fromarray(np.zeros((16, 16, 3), np.uint8)), transparency=(0, 0, 0))) == 255
    assert _gray(_encoded(Image.fromarray(black), "GIF", transparency=0)) == 255
    assert _gray(_encoded(Image.fromarray(np.zeros((16, 16), np.uint16)), transparency=0)) == 255
    assert _gray(_encoded(Image.fromarray(black))) == 0  # no transparency: black


# --- D. float lists written without dictionary encoding ---


def test_shards_write_their_float_lists_without_a_dictionary_and_read_back(tmp_path):
    from sdtrain.preprocess.outputs import parquet_bytes, shard_table

    rng = np.random.default_rng(0)
    rows = [
        {
            "latents": rng.standard_normal(64),
            "embeddings": rng.standard_normal(77 * 8),
            "caption": "a cat",
            "key": f"{i}",
        }
        for i in range(20)
    ]
    table = shard_table(rows, {"latents": "latents", "embeddings": "caption_latents"}, {})
    data = parquet_bytes(table, 8)
    footer = pq.ParquetFile(io.BytesIO(data)).metadata
    encodings = {
        footer.row_group(0).column(c).path_in_schema.split(".")[0]: footer.row_group(0).column(c).encodings
        for c in range(footer.num_columns)
    }
    assert not any("DICTIONARY" in e for e in encodings["latents"] + encodings["caption_latents"]), encodings
    assert any("DICTIONARY" in e for e in encodings["caption"]), encodings
    assert pq.read_table(io.BytesIO(data)).equals(table)
