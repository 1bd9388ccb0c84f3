"""The dataset index: a run's first start reads the footers and writes it; a restart reads it and only the files
that changed; the preprocessing job's index lets training read no footer (pyarrow and a moto server, no Ray)."""

import os

import boto3
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import write_latents
from support.datasets import inspect_dataset

from sdtrain.config.learning import Columns
from sdtrain.config.schema import DataConfig
from sdtrain.data.dataset_index import index_dataset
from sdtrain.data.directory_index import write_directory_index
from sdtrain.data.index_format import read_index, run_index_uri, write_index
from sdtrain.data.listing import DIRECTORY_INDEX, list_dataset
from sdtrain.data.metadata import LATENT_SCALING_FACTOR
from sdtrain.errors import ConfigError, DataError
from sdtrain.model.recipe import stored_latent_scaling

COLUMNS = Columns("image_latents_256", "caption_latents")


def _start(specs, index_uri, in_channels=4, page_size=1000):
    return index_dataset([str(s) for s in specs], "data.train", COLUMNS, in_channels, 32, index_uri, page_size)


def _start_and_write(specs, index_uri, **kwargs):
    data = _start(specs, index_uri, **kwargs)
    if data.stale:
        write_index(index_uri, data.index)
    return data


def test_a_restart_reads_the_index_and_only_the_files_that_changed(tmp_path, capsys):
    data_dir = tmp_path / "data"
    for i, name in enumerate(("a", "b", "c")):
        write_latents(data_dir / f"{name}.parquet", rows=8 + i, seed=i)
    (data_dir / "_SUCCESS").write_bytes(b"")
    index_uri = run_index_uri(str(tmp_path / "runs" / "r1"), "data.train")
    assert index_uri == str(tmp_path / "runs/r1/dataset_index/train.parquet")

    first = _start_and_write([data_dir], index_uri)
    assert (first.stats.files, first.stats.from_index, first.stats.footers_read, first.stats.rows_read) == (3, 0, 3, 1)
    assert first.stale and os.path.isfile(index_uri)
    # The same spec as reading every footer, plus the digest of each file's size and version.
    full = inspect_dataset([str(data_dir / f"{n}.parquet") for n in "abc"], "data.train", COLUMNS, 4, 32)
    assert (first.spec.files, first.spec.rows_per_file) == (full.files, (8, 9, 10))
    assert (first.spec.latent_shape, first.spec.caption_shape) == ((4, 16, 16), (77, 32))
    assert len(first.spec.content_digest) == 16
    assert "data.train: 3 files (0 from the index, 3 footers read)" in capsys.readouterr().out

    second = _start_and_write([data_dir], index_uri)
    assert (second.stats.from_index, second.stats.footers_read, second.stats.rows_read) == (3, 0, 0)
    assert not second.stale and second.stats.source == index_uri
    assert second.spec == first.spec
    assert "data.train: 3 files (3 from the index, 0 footers read)" in capsys.readouterr().out

    # Rewritten (another size), added, removed: only the first two are read; the third is dropped.
    write_latents(data_dir / "b.parquet", rows=20, seed=7)
    write_latents(data_dir / "d.parquet", rows=5, seed=8)
    (data_dir / "c.parquet").unlink()
    third = _start_and_write([data_dir], index_uri)
    assert (third.stats.from_index, third.stats.footers_read, third.stats.dropped) == (1, 2, 1)
    assert third.stats.rows_read == 1 and third.stale
    assert [os.path.basename(f) for f in third.spec.files] == ["a.parquet", "b.parquet", "d.parquet"]
    assert third.spec.rows_per_file == (8, 20, 5)
    assert _start([data_dir], index_uri).stats.footers_read == 0

    # Rewritten in place with the same rows (and size): the version differs, so its footer is read and the
    # content digest changes while the files and rows do not.
    before = _start([data_dir], index_uri).spec
    path = data_dir / "a.parquet"
    stat = path.stat()
    write_latents(path, rows=8, seed=0)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    after = _start_and_write([data_dir], index_uri)
    assert after.stats.footers_read == 1
    assert (after.spec.files, after.spec.rows_per_file) == (before.files, before.rows_per_file)
    assert after.spec.content_digest != before.content_digest


def test_the_model_check_runs_from_the_index_without_reading_a_file(tmp_path):
    data_dir = tmp_path / "data"
    write_latents(data_dir / "a.parquet", rows=4, latent_shape=(4, 8, 8))
    table = pq.read_table(data_dir / "a.parquet")
    metadata = {**(table.schema.metadata or {}), LATENT_SCALING_FACTOR: b"0.18215"}
    pq.write_table(table.replace_schema_metadata(metadata), data_dir / "a.parquet")
    index_uri = str(tmp_path / "index.parquet")
    _start_and_write([data_dir], index_uri)
    # The file is now unreadable: a restart that needs no footer and no row never opens it.
    path = data_dir / "a.parquet"
    stat = path.stat()
    path.write_bytes(b"\0" * stat.st_size)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    restart = _start([data_dir], index_uri)
    assert restart.stats.footers_read == 0 and restart.spec.latent_shape == (4, 8, 8)
    # The scaling the files record comes from the index's schema.
    assert stored_latent_scaling([(restart.schema_file, restart.schema_metadata)], DataConfig(train=["x"])) == (
        pytest.approx(0.18215)
    )
    with pytest.raises(ConfigError, match=r"a\.parquet records that its latents are already multiplied by 0\.18215"):
        stored_latent_scaling(
            [(restart.schema_file, restart.schema_metadata)], DataConfig(train=["x"], latent_scaling_factor=0.18215)
        )
    # Another model: the same errors as from the footers, from the recorded schema and shapes.
    with pytest.raises(
        DataError, match=r"has 256 values a row, which is not C\*H\*W for C = the UNet.s in_channels = 8"
    ):
        _start([data_dir], index_uri, in_channels=8)


def test_training_on_a_preprocessing_output_reads_no_footer(tmp_path, capsys):
    output = tmp_path / "latents"
    rows = {"shard-000": 6, "shard-001": 7, "sub/shard-002": 3}
    for i, (name, n) in enumerate(rows.items()):
        write_latents(output / f"{name}.parquet", rows=n, seed=i)
    # A stand-in where a footer would be read: the writer reads only the file it is told it just wrote.
    (output / "shard-000.parquet").rename(tmp_path / "kept.parquet")
    (output / "shard-000.parquet").write_bytes(b"not parquet")
    known = {f"{name}.parquet": n for name, n in rows.items()}
    stats = write_directory_index(str(output), COLUMNS, known, sample="shard-001.parquet")
    assert stats is not None and stats.footers_read == 0
    (tmp_path / "kept.parquet").replace(output / "shard-000.parquet")
    stats = write_directory_index(str(output), COLUMNS, known)
    assert stats is not None and stats.footers_read == 0
    assert (output / DIRECTORY_INDEX).is_file()
    assert list_dataset([str(output)], "data.train").paths == [str(output / f"{n}.parquet") for n in sorted(rows)]
    index = read_index(str(output / DIRECTORY_INDEX))
    assert index is not None and index.paths[0] == str(output / "shard-000.parquet")  # stored relative

    run_index = run_index_uri(str(tmp_path / "runs/r"), "data.train")
    first = _start_and_write([output], run_index)
    # No footer; the one-row finiteness check of a run's first start is the only read.
    assert (first.stats.from_index, first.stats.footers_read, first.stats.rows_read) == (3, 0, 1)
    assert first.stats.source == "beside the data"
    assert first.spec.rows_per_file == (6, 7, 3)
    assert (first.spec.latent_shape, first.spec.caption_shape) == ((4, 16, 16), (77, 32))
    restart = _start([output], run_index)
    assert (restart.stats.from_index, restart.stats.footers_read, restart.stats.rows_read) == (3, 0, 0)
    assert restart.spec == first.spec


def test_a_restart_lists_no_directory_unchanged_since_its_directory_index(tmp_path, capsys):
    output, extra = tmp_path / "latents", tmp_path / "extra"
    for i in range(3):
        write_latents(output / f"shard-{i:03d}.parquet", rows=4 + i, seed=i)
    write_latents(extra / "x.parquet", rows=2, seed=9)
    assert write_directory_index(str(output), COLUMNS) is not None
    run_index = run_index_uri(str(tmp_path / "runs/r"), "data.train")
    specs = [output, extra]

    first = _start_and_write(specs, run_index)
    # The preprocessing output is exactly its index's files; the other directory has no index of its own.
    assert [(s.spec, s.start, s.count) for s in first.index.sealed] == [(str(output), 0, 3)]
    assert read_index(run_index).sealed == first.index.sealed
    capsys.readouterr()

    # A file copied in by hand, not through the preprocessing job (which rewrites its index): the restart does
    # not list that directory, so it trains on what the run started with; the other directory is listed.
    write_latents(output / "by-hand.parquet", rows=5, seed=5)
    write_latents(extra / "y.parquet", rows=3, seed=6)
    restart = _start_and_write(specs, run_index)
    assert (restart.stats.unlisted, restart.stats.footers_read, restart.stats.rows_read) == (3, 1, 1)
    assert str(output / "by-hand.parquet") not in restart.spec.files
    assert restart.spec.files[:3] == first.spec.files[:3] and restart.spec.files[-1] == str(extra / "y.parquet")
    assert "3 in 1 directory unchanged since their directory index, not listed" in capsys.readouterr().out

    # The job rewrites its index (a new shard): the directory is listed again, its new file found, and sealed anew.
    assert write_directory_index(str(output), COLUMNS) is not None
    relisted = _start_and_write(specs, run_index)
    assert relisted.stats.unlisted == 0 and str(output / "by-hand.parquet") in relisted.spec.files
    assert relisted.stats.footers_read == 0  # its rows came from the directory index
    assert [(s.start, s.count) for s in relisted.index.sealed] == [(0, 4)]
    again = _start(specs, run_index)
    assert again.stats.unlisted == 4 and again.spec == relisted.spec  # the same content digest, not recomputed
    assert not again.stale and again.index.content_digest == relisted.spec.content_digest

    # A directory holding a file its index does not name is never sealed: every start lists it.
    other_run = run_index_uri(str(tmp_path / "runs/r2"), "data.train")
    write_latents(output / "later.parquet", rows=1, seed=7)
    fresh = _start_and_write([output], other_run)
    assert fresh.index.sealed == () and fresh.stats.footers_read == 1
    assert _start([output], other_run).stats.unlisted == 0


def test_the_index_command_makes_restarts_on_a_directory_of_ones_own_list_nothing(tmp_path, capsys, monkeypatch):
    from sdtrain.data import dataset_index
    from sdtrain.driver.cli import index_main

    data = tmp_path / "latents" / "date=2026-11-26"  # a '=' in a directory is not a config override
    for i in range(3):
        write_latents(data / f"part-{i}.parquet", rows=4 + i, seed=i, caption_column="caption_embeddings")
    overrides = ["data.caption_column=caption_embeddings"]
    # A directory listed at every restart says how to stop that (from 2 files here; 1000, one S3 page, by default).
    monkeypatch.setattr(dataset_index, "UNINDEXED_HINT_FILES", 2)
    plain = index_dataset([str(data)], "data.train", Columns(COLUMNS.latent, "caption_embeddings"), 4, 32, None)
    assert plain.stats.footers_read == 3
    assert f"`python entrypoints/index.py {data}` once makes restarts list nothing" in capsys.readouterr().out

    assert index_main([str(data), *overrides]) == 0
    assert f"{data}: 3 files (0 from its index, 3 footers read); wrote {data}/{DIRECTORY_INDEX}" in (
        capsys.readouterr().out
    )
    run_index = run_index_uri(str(tmp_path / "runs/r"), "data.train")

    def start():
        started = index_dataset(
            [str(data)], "data.train", Columns(COLUMNS.latent, "caption_embeddings"), 4, 32, run_index
        )
        if started.stale:
            write_index(run_index, started.index)
        return started

    first = start()
    assert (first.stats.footers_read, len(first.index.sealed)) == (0, 1)
    assert first.spec.rows_per_file == (4, 5, 6)
    assert "has no directory index" not in capsys.readouterr().out
    restart = start()
    assert (restart.stats.unlisted, restart.stats.footers_read, restart.stats.rows_read) == (3, 0, 0)

    # Nothing changed: the index is left as it is, so the runs sealed on it still list nothing.
    version = (data / DIRECTORY_INDEX).stat().st_mtime_ns
    assert index_main([str(data), *overrides]) == 0
    assert "3 files (3 from its index, 0 footers read); unchanged, not rewritten" in capsys.readouterr().out
    assert (data / DIRECTORY_INDEX).stat().st_mtime_ns == version and start().stats.unlisted == 3

    # A file added and one rewritten: only their footers are read, and the next start finds both without reading.
    write_latents(data / "part-3.parquet", rows=2, seed=3, caption_column="caption_embeddings")
    write_latents(data / "part-0.parquet", rows=9, seed=4, caption_column="caption_embeddings")
    os.utime(data / "part-0.parquet", ns=(version + 10**9, version + 10**9))  # a new mtime, whatever the clock
    assert index_main([str(data), *overrides]) == 0
    assert "4 files (2 from its index, 2 footers read); wrote" in capsys.readouterr().out
    relisted = start()
    assert (relisted.stats.unlisted, relisted.stats.footers_read) == (0, 0)
    assert relisted.spec.rows_per_file == (9, 5, 6, 2) and start().stats.unlisted == 4

    # From a config: its directories (not its files or globs), with its columns; a column the files lack is named.
    config = tmp_path / "job.yaml"
    config.write_text(
        f"data:\n  train: [{data}]\n  val: [{data}/part-1.parquet]\n  caption_column: caption_embeddings\n"
    )
    assert index_main(["--config", str(config)]) == 0
    assert "4 files (4 from its index, 0 footers read); unchanged" in capsys.readouterr().out
    assert index_main(["--config", str(config), "data.caption_column=captions"]) == 2
    err = capsys.readouterr().err
    assert "data.train" in err and "'captions'" in err and "part-0.parquet" in err
    assert index_main([str(tmp_path / "empty")]) == 2
    assert "holds no parquet file with rows" in capsys.readouterr().err


def test_footers_are_read_many_but_a_bounded_number_at_a_time_with_progress(tmp_path, monkeypatch):
    """A first start on 2e5 files not written by sdtrain's preprocessing reads every footer (three requests one after
    another): 16 at a time ~21 min at 30 ms a request, DRIVER_READS (128) ~4 (simulated,
    bench/results/2026-11-30-footer-reads.md)."""
    from support.wrapped_fs import InFlight, wrapped_local

    from sdtrain.data import inspection
    from sdtrain.data.inspection import FOOTER_READS, read_footers

    files = []
    for i in range(300):
        write_latents(tmp_path / f"{i:03d}.parquet", rows=1 + i % 3, latent_shape=(4, 2, 2), caption_shape=(1, 32))
        files.append(str(tmp_path / f"{i:03d}.parquet"))
    opened = InFlight()  # each open 20 ms, as a request to object storage
    monkeypatch.setattr(inspection, "filesystem_for", lambda path: (wrapped_local(opened), path))
    reports = []
    rows, checked = read_footers(files, "data.train", COLUMNS, progress=lambda done, total: reports.append(done))
    assert rows == [1 + i % 3 for i in range(300)] and checked is not None and checked.file == files[0]
    assert reports[-1] == 300 and len(reports) >= 2 and reports == sorted(reports)  # tenths, finished in batches
    assert opened.calls >= 300 and 32 < opened.most <= FOOTER_READS, opened.most
    assert FOOTER_READS >= 128


def _upload_many(s3, bucket: str, prefix: str, source, count: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: s3.upload_file(str(source), bucket, f"{prefix}/part-{i:03d}.parquet"), range(count)))


@pytest.mark.slow
def test_s3_listing_is_paginated_and_records_etags(s3_bucket, tmp_path, capsys):
    s3 = boto3.client("s3")
    bucket = s3_bucket[len("s3://") :]
    write_latents(tmp_path / "part.parquet", rows=10)
    _upload_many(s3, bucket, "data", tmp_path / "part.parquet", 30)
    s3.put_object(Bucket=bucket, Key="data/_SUCCESS", Body=b"")
    # A page of 7 cannot hold 30 keys: the listing below took 5 pages.
    assert s3.list_objects_v2(Bucket=bucket, Prefix="data/", MaxKeys=7)["IsTruncated"]
    index_uri = run_index_uri(f"{s3_bucket}/runs/r", "data.train")

    from sdtrain.data import inspection
    from sdtrain.data.inspection import FOOTER_READS

    made_with, real = [], inspection.filesystem_for  # the footers' S3 client: a connection per read in flight

    def filesystem_for(path):
        made_with.append(pa.io_thread_count())
        return real(path)

    io_threads = pa.io_thread_count()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(inspection, "filesystem_for", filesystem_for)
        first = _start_and_write([f"{s3_bucket}/data"], index_uri, page_size=7)
    # The footers' client, made once for the bucket (then the first row's: one read), and the setting put back.
    assert made_with[0] == max(io_threads, FOOTER_READS) and pa.io_thread_count() == io_threads, made_with
    assert (first.stats.files, first.stats.footers_read) == (30, 30)
    assert first.spec.files == tuple(f"{s3_bucket}/data/part-{i:03d}.parquet" for i in range(30))
    etag = s3.head_object(Bucket=bucket, Key="data/part-004.parquet")["ETag"].strip('"')
    assert first.index.versions[4] == etag
    assert s3.head_object(Bucket=bucket, Key="runs/r/dataset_index/train.parquet")["ContentLength"] > 0

    restart = _start_and_write([f"{s3_bucket}/data"], index_uri, page_size=7)
    assert (restart.stats.from_index, restart.stats.footers_read, restart.stats.rows_read) == (30, 0, 0)

    # Rewritten with other content: its ETag changes, so its footer is read, and the digest reports it.
    write_latents(tmp_path / "other.parquet", rows=10, seed=3)
    s3.upload_file(str(tmp_path / "other.parquet"), bucket, "data/part-004.parquet")
    changed = _start_and_write([f"{s3_bucket}/data"], index_uri, page_size=7)
    assert (changed.stats.from_index, changed.stats.footers_read) == (29, 1)
    assert changed.spec.content_digest != restart.spec.content_digest
    # Many files of a folder named one by one: its listing finds them (pages of 7 keys here), not a HEAD each.
    from sdtrain.data.file_lists import FOLDER_LISTING_MIN
    from sdtrain.data.listing import listing_client

    _upload_many(s3, bucket, "many", tmp_path / "part.parquet", FOLDER_LISTING_MIN + 6)
    named = [f"{s3_bucket}/many/part-{i:03d}.parquet" for i in range(FOLDER_LISTING_MIN + 6) if i % 13][::-1]
    heads: list[str] = []
    listing_client().meta.events.register("before-call.s3.HeadObject", lambda params, **_: heads.append(params))
    assert len(named) >= FOLDER_LISTING_MIN and list_dataset(named, "data.train", page_size=7).paths == named
    assert heads == []  # in the specs' order, with no HEAD
    gone = f"{s3_bucket}/many/part-999.parquet"
    with pytest.raises(DataError, match=rf"^data\.train: {gone} matches no parquet files"):
        list_dataset([*named, gone], "data.train", page_size=7)
    assert len(heads) == 1  # the one the folder's listing did not find
    # Globs list the same way.
    globbed = list_dataset([f"{s3_bucket}/data/part-00?.parquet"], "data.train", page_size=7)
    assert globbed.paths == [f"{s3_bucket}/data/part-{i:03d}.parquet" for i in range(10)]
    assert pa.array(globbed.sizes).to_pylist() == [changed.index.sizes[i] for i in range(10)]
    assert np.all(np.asarray(changed.spec.rows_per_file) == 10)

    # The directory index beside the files (entrypoints/index.py's, as the preprocessing job's): a run on them
    # records the directory as sealed, and its restart lists nothing: one GET (the run's index) and one HEAD (the
    # directory's index). Indexing again reads no footer and leaves the index as it is.
    from sdtrain.data import listing as listing_module
    from sdtrain.driver.cli import index_main

    assert index_main([f"{s3_bucket}/data"]) == 0
    assert "30 files (0 from its index, 30 footers read); wrote" in capsys.readouterr().out
    assert index_main([f"{s3_bucket}/data/"]) == 0
    assert "30 files (30 from its index, 0 footers read); unchanged, not rewritten" in capsys.readouterr().out
    sealed_uri = run_index_uri(f"{s3_bucket}/runs/sealed", "data.train")
    on_output = _start_and_write([f"{s3_bucket}/data"], sealed_uri, page_size=7)
    assert [s.spec for s in on_output.index.sealed] == [f"{s3_bucket}/data"]
    calls: list[str] = []
    client = listing_module.listing_client()
    record = lambda model, **_: calls.append(model.name)  # noqa: E731
    client.meta.events.register("before-call.s3", record)
    try:
        restart = _start([f"{s3_bucket}/data"], sealed_uri, page_size=7)
    finally:
        client.meta.events.unregister("before-call.s3", record)
    assert calls == ["GetObject", "HeadObject"]
    assert (restart.stats.unlisted, restart.stats.footers_read) == (30, 0) and restart.spec == on_output.spec


def test_split_keys_cut_the_known_keys_into_whole_pages_over_the_threads():
    from sdtrain.data.known_keys import KnownKeys, split_keys
    from sdtrain.data.listing import LIST_THREADS

    paths = [f"s3://b/data/part-{i:03d}.parquet" for i in range(30)] + ["s3://b/other/x.parquet", "/local/y.parquet"]
    known = KnownKeys([*paths, "s3://c/data/part-100.parquet"])  # another bucket's keys are not this one's
    # 30 keys, pages of 3: 10 pages over at most LIST_THREADS ranges of whole pages.
    splits = split_keys(known, "b", "data/", 3, LIST_THREADS)
    step = 3 * -(-10 // LIST_THREADS)
    assert splits == [f"data/part-{i:03d}.parquet" for i in range(step - 1, 29, step)]
    assert split_keys(KnownKeys(paths[::-1]), "b", "data/", 3, LIST_THREADS) == splits  # in any order
    assert split_keys(known, "b", "data/", 30, LIST_THREADS) == []  # one page: listed as one range
    assert split_keys(None, "b", "data/", 3, LIST_THREADS) == split_keys(known, "b", "none/", 3, LIST_THREADS) == []
    assert known.under("b", "data/part-02") == [f"data/part-{i:03d}.parquet" for i in range(20, 30)]


def test_many_specs_are_listed_at_once_in_their_order_and_one_that_matches_nothing_is_named(tmp_path):
    """data.train as a list of files: a request each (on S3 a HEAD), made LIST_THREADS at a time, not one after
    another (hours at 1e5 files); the listing keeps the specs' order, and the first spec that names nothing fails."""
    from sdtrain.data.listing import list_specs

    files = []
    for i in range(24):
        path = tmp_path / f"part-{23 - i:02d}.parquet"  # named in reverse: the order is the specs'
        write_latents(path, rows=2)
        files.append(str(path))
    parts = list_specs(files, "data.train")
    assert [part.paths for part in parts] == [[file] for file in files]
    assert list_dataset(files, "data.train").paths == files
    missing = str(tmp_path / "gone.parquet")
    with pytest.raises(DataError, match=rf"^data\.train: {missing} matches no parquet files"):
        list_specs([*files[:12], missing, *files[12:]], "data.train")


@pytest.mark.slow
def test_s3_listing_in_key_ranges_from_the_index_finds_what_changed(s3_bucket, tmp_path):
    from sdtrain.data import listing as listing_module
    from sdtrain.data.known_keys import KnownKeys

    s3 = boto3.client("s3")
    bucket = s3_bucket[len("s3://") :]
    write_latents(tmp_path / "part.parquet", rows=10)
    _upload_many(s3, bucket, "data", tmp_path / "part.parquet", 30)
    index_uri = run_index_uri(f"{s3_bucket}/runs/r", "data.train")
    first = _start_and_write([f"{s3_bucket}/data"], index_uri, page_size=3)
    old = list(first.index.paths)
    splits = listing_module.split_keys(KnownKeys(old), bucket, "data/", 3, listing_module.LIST_THREADS)
    assert len(splits) >= 3  # several ranges, each of whole pages

    calls: list[str | None] = []
    client = listing_module.listing_client()
    record = lambda params, **_: calls.append(params.get("StartAfter"))  # noqa: E731
    client.meta.events.register("before-parameter-build.s3.ListObjectsV2", record)
    try:
        # Unchanged: the ranges list exactly what one paginated listing does.
        ranged = list_dataset([f"{s3_bucket}/data"], "data.train", page_size=3, known=old)
        assert set(splits) <= set(calls)  # each range started after its split key
        calls.clear()
        sequential = list_dataset([f"{s3_bucket}/data"], "data.train", page_size=3)
        assert set(calls) == {None}
        assert (ranged.paths, list(ranged.sizes), ranged.versions) == (
            sequential.paths,
            list(sequential.sizes),
            sequential.versions,
        )
        assert ranged.paths == old

        # Added right after a split key, between two others, before the first and after the last; a split key
        # and another file deleted; a hidden file: the ranges find the new ones, drop the gone ones, once each.
        after_split = splits[0].replace(".parquet", "a.parquet")  # the first key of a range
        before_split = f"data/part-{int(splits[2][len('data/part-') :][:3]) - 1:03d}z.parquet"  # a range's last key
        added = [after_split, before_split, "data/part-0155.parquet", "data/a.parquet", "data/part-999.parquet"]
        for key in added:
            s3.upload_file(str(tmp_path / "part.parquet"), bucket, key)
        s3.put_object(Bucket=bucket, Key=splits[1].replace("part-", "_tmp-"), Body=b"")
        gone = [splits[1], "data/part-020.parquet"]
        for key in gone:
            s3.delete_object(Bucket=bucket, Key=key)
        calls.clear()
        changed = list_dataset([f"{s3_bucket}/data"], "data.train", page_size=3, known=old)
        assert set(splits) <= set(calls)
        expected = sorted({*old, *(f"{s3_bucket}/{k}" for k in added)} - {f"{s3_bucket}/{k}" for k in gone})
        assert changed.paths == expected and len(changed.sizes) == len(changed.versions) == len(expected)
        assert changed.paths == list_dataset([f"{s3_bucket}/data"], "data.train", page_size=3).paths
        # Globs list in ranges the same way.
        globbed = list_dataset([f"{s3_bucket}/data/part-0*.parquet"], "data.train", page_size=3, known=old)
        assert globbed.paths == [p for p in expected if "/data/part-0" in p]

        # A restart reads the index first and lists in its ranges: only the new files' footers, the gone dropped.
        restart = _start_and_write([f"{s3_bucket}/data"], index_uri, page_size=3)
        assert set(splits) <= set(calls)
        assert (restart.stats.footers_read, restart.stats.dropped) == (len(added), len(gone))
        assert restart.spec.files == tuple(expected)
    finally:
        client.meta.events.unregister("before-parameter-build.s3.ListObjectsV2", record)


def _indexed_output(directory, metadata: dict, token_ids: bool = False, files: int = 2, seed: int = 0) -> list[str]:
    """A preprocessing output: parquet files whose schema records ``metadata``, captions as embeddings or as token
    ids (caption_ids), and the directory index beside them. Returns the files."""
    from conftest import column

    paths = []
    for i in range(files):
        path = directory / f"shard-{i:03d}.parquet"
        latents, _ = write_latents(path, rows=4, seed=seed + i)
        table = pq.read_table(path)
        if token_ids:
            ids = np.random.default_rng(seed + i).integers(0, 1000, (4, 77)).astype(np.int32)
            table = pa.table({"image_latents_256": column(latents, "list"), "caption_ids": column(ids, "list")})
        pq.write_table(table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata}), path)
        paths.append(str(path))
    caption = "caption_ids" if token_ids else COLUMNS.caption
    assert write_directory_index(str(directory), Columns(COLUMNS.latent, caption)) is not None
    return paths


@pytest.mark.parametrize("case", ["scaling", "text encoder"])
def test_indexed_directories_are_held_to_each_other_as_their_footers_are(tmp_path, case):
    """Two preprocessing outputs whose latents are scaled differently, or whose token ids are of two text encoders,
    trained together when their rows came from their indexes (no footer read): the index records each output's
    checked schema with its metadata, so a first start over both and a restart that adds one refuse as the footers
    do, naming both files and the key."""
    from sdtrain.data.metadata import TEXT_ENCODER_SOURCE, TOKEN_VOCAB_SIZE

    if case == "scaling":
        key, token_ids, caption = LATENT_SCALING_FACTOR, False, COLUMNS.caption
        first, second, same = ({key: v} for v in ("0.18215", "0.13025", "0.18215"))
        message = r"records latents multiplied by 0\.1(3025|8215) but .* records latents multiplied by 0\.1(3025|8215)"
    else:
        key, token_ids, caption = TEXT_ENCODER_SOURCE, True, "caption_ids"
        first, second, same = ({key: v, TOKEN_VOCAB_SIZE: "1000"} for v in ("enc-a", "enc-b", "enc-a"))
        message = r"records enc-(a|b) \(sdtrain.text_encoder_source\) beside its token ids, but .* enc-(a|b);"
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    files = _indexed_output(a, first, token_ids) + _indexed_output(b, second, token_ids, seed=5)
    _indexed_output(c, same, token_ids, seed=9)

    def start(specs, run):
        data = index_dataset([str(s) for s in specs], "data.train", Columns(COLUMNS.latent, caption), 4, 32, run)
        if data.stale:
            write_index(run, data.index)
        return data

    def refused(specs, run):
        with pytest.raises(DataError, match=message) as error:
            start(specs, run)
        assert str(a) in str(error.value) and str(b) in str(error.value) and key in str(error.value)

    # What the footers say, and what a start from the indexes must say too.
    with pytest.raises(DataError, match=message):
        inspect_dataset(files, "data.train", Columns(COLUMNS.latent, caption), 4, 32)
    refused([a, b], run_index_uri(str(tmp_path / "runs/both"), "data.train"))
    refused([b, a], run_index_uri(str(tmp_path / "runs/both-reversed"), "data.train"))
    # A restart that adds the other output, to a run's index with its directory sealed or listed.
    run = run_index_uri(str(tmp_path / "runs/r"), "data.train")
    assert start([a], run).stats.footers_read == 0
    refused([a, b], run)
    refused([str(a) + "/*.parquet", b], run)

    # Outputs that agree train together from their indexes, on a first start and on a restart that adds one.
    agreeing = run_index_uri(str(tmp_path / "runs/agreeing"), "data.train")
    assert start([a, c], agreeing).stats.footers_read == 0
    assert start([a, c], agreeing).stats.unlisted == 4
    assert start([a], run).stats.unlisted == 2
    assert start([a, c], run).stats.footers_read == 0


@pytest.mark.parametrize(
    "damage",
    [
        lambda meta: meta.pop("latent_column"),
        lambda meta: meta.pop("schema_file"),
        lambda meta: meta.update(latent_shape=5),
        lambda meta: meta.update(sealed=[{"spec": "x"}]),
        lambda meta: meta.update(
            sealed=[{"spec": "x", "index_uri": "y", "size": 1, "version": "v", "start": "0", "count": 1}]
        ),
        lambda meta: meta.update(caption_shape=None),
        lambda meta: meta.update(caption_column=["caption_latents"]),
    ],
    ids=[
        "no latent_column",
        "no schema_file",
        "latent_shape an int",
        "sealed incomplete",
        "sealed start a string",
        "caption_shape null",
        "caption_column a list",
    ],
)
def test_an_index_of_this_format_missing_or_mistyping_a_key_is_read_past_to_the_footers(tmp_path, capsys, damage):
    """read_index parsed the metadata after its guarded block: an index of format 1 missing a key crashed the
    start with a KeyError or TypeError instead of reading the footers, as an unreadable index does."""
    import json

    data_dir = tmp_path / "data"
    for i in range(2):
        write_latents(data_dir / f"{i}.parquet", rows=3 + i, seed=i)
    index_uri = run_index_uri(str(tmp_path / "runs/r"), "data.train")
    _start_and_write([data_dir], index_uri)
    table = pq.read_table(index_uri)
    meta = json.loads(table.schema.metadata[b"sdtrain.dataset_index"])
    damage(meta)
    metadata = {**table.schema.metadata, b"sdtrain.dataset_index": json.dumps(meta).encode()}
    pq.write_table(table.replace_schema_metadata(metadata), index_uri)
    capsys.readouterr()

    assert read_index(index_uri) is None
    assert f"the dataset index {index_uri} cannot be read" in capsys.readouterr().out
    restart = _start([data_dir], index_uri)
    assert (restart.stats.footers_read, restart.stale, restart.spec.rows_per_file) == (2, True, (3, 4))


def _with_null_row(path, row: int) -> None:
    """``path`` rewritten with its latents' row ``row`` null."""
    table = pq.read_table(path)
    latents = table.column("image_latents_256").to_pylist()
    latents[row] = None
    column = pa.array(latents, table.schema.field("image_latents_256").type)
    pq.write_table(table.set_column(1, "image_latents_256", column), path, row_group_size=4)


@pytest.mark.parametrize("encoding", ["list", "fixed_size_list"])
def test_a_row_of_another_length_or_null_is_refused_from_the_footers_naming_file_column_and_row_group(
    tmp_path, encoding
):
    """Latents and captions stored as variable-size lists were checked across files by type only: a file of another
    resolution or text encoder, or with a null row, was accepted and failed a read task days into the run. Each row
    group's value count in the footer (already read) says it; fixed-size lists count a null row too."""
    a = tmp_path / "a.parquet"
    write_latents(a, rows=8, encoding=encoding, row_group_size=4)
    other = tmp_path / "other" / "b.parquet"
    cases = [
        (
            dict(latent_shape=(4, 8, 8)),
            "'image_latents_256' (data.latent_column), row group 0: 1024 values in 4 rows, 256 a row; expected "
            "1024 a row, as in {a}",
        ),
        (
            dict(caption_shape=(77, 16)),
            "'caption_latents' (data.caption_column), row group 0: 4928 values in 4 rows, 1232 a row; expected "
            "2464 a row, as in {a}",
        ),
        (
            None,
            "'image_latents_256' (data.latent_column), row group 1: 3073 values in 4 rows, 768.25 a row; "
            "expected 1024 a row, as in {a}",
        ),
    ]
    for written, found in cases[2:] if encoding == "fixed_size_list" else cases:  # a fixed size tells the rest
        write_latents(other, rows=8, encoding=encoding, row_group_size=4, **(written or {}))
        if written is None:
            _with_null_row(other, 5)
        with pytest.raises(DataError) as error:
            inspect_dataset([a, other], "data.train", COLUMNS, 4, 32)
        assert str(error.value).startswith(f"data.train: {other}, column {found.format(a=a)}. A row is null or of")
    # Row groups of any size, and files without rows, pass.
    write_latents(other, rows=7, encoding=encoding, row_group_size=3)
    write_latents(tmp_path / "empty.parquet", rows=0, encoding=encoding)
    passed = inspect_dataset([a, other, tmp_path / "empty.parquet"], "data.train", COLUMNS, 4, 32)
    assert passed.rows_per_file == (8, 7, 0)


def test_a_restart_holds_the_files_it_reads_to_the_shapes_the_run_recorded(tmp_path):
    """A restart reads the footers of new files only, and its reference is the run's index: each file read is held to
    the shapes it records (the first row read, of the first new file, says nothing of the others)."""
    data_dir = tmp_path / "data"
    write_latents(data_dir / "a.parquet", rows=8, row_group_size=4)
    index_uri = run_index_uri(str(tmp_path / "runs/r"), "data.train")
    _start_and_write([data_dir], index_uri)
    write_latents(data_dir / "b.parquet", rows=8, row_group_size=4)
    write_latents(data_dir / "c.parquet", rows=8, row_group_size=4, latent_shape=(4, 8, 8))
    with pytest.raises(DataError) as error:
        _start([data_dir], index_uri)
    assert str(error.value).startswith(
        f"data.train: {data_dir}/c.parquet, column 'image_latents_256' (data.latent_column), row group 0: 1024 values "
        f"in 4 rows, 256 a row; expected 1024 a row, as the dataset index records (4 x 16 x 16; its reference file "
        f"{data_dir}/a.parquet)"
    )
    (data_dir / "c.parquet").unlink()
    assert _start([data_dir], index_uri).stats.footers_read == 1


def test_rows_of_two_lengths_that_average_out_are_told_apart_by_the_first_row(tmp_path):
    """Rows of 256 and 1792 values count 1024 a row in their row group: the footers alone pass them, the first row's
    shape (4 x 8 x 8) does not."""
    rows = [[0.0] * 256, [0.0] * 1792]
    path = tmp_path / "a.parquet"
    table = pa.table(
        {
            "image_latents_256": pa.array(rows, pa.list_(pa.float16())),
            "caption_latents": pa.array([[0.0] * 77 * 32] * 2, pa.list_(pa.float16())),
        }
    )
    pq.write_table(table, path)
    with pytest.raises(DataError) as error:
        inspect_dataset([path], "data.train", COLUMNS, 4, 32)
    assert str(error.value).startswith(
        f"data.train: {path}, column 'image_latents_256' (data.latent_column): its row groups hold 1024 values a row, "
        f"but the first row of {path} holds 256 (4 x 8 x 8): its rows are not all of one length"
    )


def test_the_largest_row_group_read_is_recorded_and_warned_of_once_when_far_larger_than_a_chunk(tmp_path, caplog):
    """Each read of data.shuffle_chunk_rows rows reads its whole row group: files written with one row group each made
    every chunk read the whole file, silently (71x slower at 10k-row groups)."""
    from conftest import tiny_config

    from sdtrain.driver.data_check import check_data

    small = dict(latent_shape=(4, 8, 8), caption_shape=(77, 32))
    write_latents(tmp_path / "data" / "a.parquet", rows=64, row_group_size=64, **small)
    write_latents(tmp_path / "data" / "b.parquet", rows=600, **small)  # pyarrow's default: one row group
    config = tiny_config(f"data.train={tmp_path}/data", tmp_path=tmp_path, name="r", batch=4)
    with caplog.at_level("WARNING", logger="sdtrain"):
        train, _, _ = check_data(config, str(tmp_path / "runs/r"))
    assert train.stats.largest_row_group == (600, f"{tmp_path}/data/b.parquet")
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning.startswith(
        f"data.train: {tmp_path}/data/b.parquet has row groups of 600 rows, and every read of a chunk of "
        "data.shuffle_chunk_rows=64 rows reads its whole row group: about 9x the data the chunk needs. Rewrite the "
        "files with pyarrow.parquet.write_table(..., row_group_size=64)"
    )
    caplog.clear()
    with caplog.at_level("WARNING", logger="sdtrain"):
        check_data(tiny_config(f"data.train={tmp_path}/data", "data.shuffle_chunk_rows=150"), str(tmp_path / "r2"))
    assert not [r for r in caplog.records if r.levelname == "WARNING"]  # 600 rows: 4 chunks of 150


def test_a_folders_listing_finds_the_files_named_in_it_within_its_scan_bound():
    """data.train as a list of many files of one S3 folder: listed from the first named key to the last, reading at
    most SCAN_PER_FILE keys a file before the rest are HEADed (a folder of many files not named)."""
    from sdtrain.data.file_lists import FOLDER_LISTING_MIN, folders_to_list, found_keys, listing_bounds

    few = [("b", f"small/{i}.parquet") for i in range(FOLDER_LISTING_MIN - 1)]
    many = [("b", f"big/{i:04d}.parquet") for i in range(FOLDER_LISTING_MIN)][::-1]
    assert folders_to_list([*few, *many, ("c", f"big/{0:04d}.parquet")]) == {("b", "big"): sorted(k for _, k in many)}
    keys = sorted(k for _, k in many)
    assert listing_bounds("big", keys) == ("big/", "big/0000.parque", "big/0063.parquet")
    assert listing_bounds("", ["a.parquet"]) == ("", "a.parque", "a.parquet")
    listed = [(f"big/{i:04d}.parquet", i, f"etag{i}") for i in range(0, 200, 2)]  # every other file exists
    found = found_keys(iter(listed), keys)
    assert found == {f"big/{i:04d}.parquet": (i, f"etag{i}") for i in range(0, FOLDER_LISTING_MIN, 2)}
    # A folder of far more files than named: the scan stops at its bound, and the rest are HEADed.
    crowded = ((f"big/{i:09d}", 0, "") for i in range(10**9))
    assert found_keys(crowded, keys[:1]) == {}  # after SCAN_PER_FILE keys, not 1e9
    # Data shared for s3:GetObject alone (no s3:ListBucket): the folder's files are asked for one by one, as before.
    from botocore.exceptions import ClientError

    from sdtrain.data.file_lists import files_in_listed_folders

    def denied(bucket, prefix, after, through):
        raise ClientError({"Error": {"Code": "AccessDenied", "Message": "Access Denied"}}, "ListObjectsV2")

    uris = [f"s3://b/{key}" for key in keys]
    assert files_in_listed_folders(uris, denied) == {}
    listed = iter([(key, 7, "v") for key in keys])
    assert files_in_listed_folders(uris, lambda *bounds: listed) == {uri: (7, "v") for uri in uris}
