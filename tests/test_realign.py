"""entrypoints/realign_row_groups.py: bucketed files an earlier preprocessing wrote (row groups counted from the file's
start) copied with a row group starting at each bucket run, their rows, order, schema and metadata kept; the rest of a
preprocessing output copied as it is, each dataset index written again, a re-run doing only what is not done; the
target refused where it is the source, inside it, or holds files the source does not."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from test_bucket_reads import COLUMNS, _bucketed

from sdtrain.data.dataset_index import index_dataset
from sdtrain.data.directory_index import write_directory_index
from sdtrain.data.footer_counts import runs_start_row_groups
from sdtrain.data.metadata import bucket_runs
from sdtrain.driver.realign_cli import realign_main
from sdtrain.errors import DataError
from sdtrain.preprocess.realign import RECORD_FILE, realign, realign_file
from sdtrain.storage.filesystems import filesystem_for

ROOT = Path(__file__).resolve().parent.parent


def _old_files(directory: Path, files: int = 3) -> list[Path]:
    """Bucketed files as preprocessing wrote them before 2026-12-01: rows sorted by bucket, 64-row row groups counted
    from the file's start, so most runs start inside a row group."""
    _bucketed(directory, files=files)
    written = sorted(directory.glob("*.parquet"))
    for file in written:
        pq.write_table(pq.read_table(file), file, row_group_size=64)
    return written


def _aligned(uri: str) -> tuple[bool, list[int]]:
    """Whether each of the file's bucket runs starts a row group, and its row groups' rows."""
    fs, path = filesystem_for(uri)
    with fs.open_input_file(path) as f:
        parquet = pq.ParquetFile(f)
        meta = parquet.metadata
        groups = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        runs = bucket_runs(parquet.schema_arrow.metadata, uri, meta.num_rows, 4)
    return runs_start_row_groups(runs, np.array(groups)), groups


def _raw(uri: str) -> bytes:
    fs, path = filesystem_for(uri)
    with fs.open_input_stream(path, compression=None) as f:
        return f.read()


def _table(uri: str) -> pa.Table:
    fs, path = filesystem_for(uri)
    return pq.read_table(path, filesystem=fs)


def test_a_file_gets_a_row_group_at_each_bucket_run_and_keeps_its_rows_order_schema_and_metadata(tmp_path):
    old = _old_files(tmp_path / "old", files=2)[0]
    assert not _aligned(str(old))[0]
    result = realign_file(str(old), str(tmp_path / "new.parquet"), None)
    aligned, groups = _aligned(str(tmp_path / "new.parquet"))
    assert aligned and max(groups) == 64 and result.rewritten and result.rows == 400
    assert result.row_groups == (7, len(groups)) and len(groups) > 7  # a run's last rows are a group of their own
    assert _table(str(tmp_path / "new.parquet")).equals(_table(str(old)), check_metadata=True)
    # Written as preprocessing writes now: copied as it is, byte for byte. So is a one-shape file.
    again = realign_file(str(tmp_path / "new.parquet"), str(tmp_path / "again.parquet"), None)
    assert not again.rewritten and again.row_groups == (len(groups), len(groups))
    assert (tmp_path / "again.parquet").read_bytes() == (tmp_path / "new.parquet").read_bytes()
    pq.write_table(pa.table({"x": np.arange(100)}), tmp_path / "plain.parquet", row_group_size=30)
    assert not realign_file(str(tmp_path / "plain.parquet"), str(tmp_path / "plain2.parquet"), None).rewritten
    assert (tmp_path / "plain2.parquet").read_bytes() == (tmp_path / "plain.parquet").read_bytes()


def test_realign_refuses_a_target_that_is_the_source_holds_it_or_holds_other_files_before_any_work(
    tmp_path, without_ray
):
    import ray

    _old_files(tmp_path / "data", files=1)
    for target in (tmp_path / "data", tmp_path / "data" / "copy", tmp_path):
        with pytest.raises(DataError, match="are one or hold each other: the copy goes beside the source"):
            realign(str(tmp_path / "data"), str(target))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "part-9.parquet").write_bytes(b"not this source's")
    left = tmp_path / "other" / f".part-0.parquet.{'0' * 32}.tmp"  # a write a kill cut short: removed, not a stray
    left.write_bytes(b"half")
    with pytest.raises(DataError, match=r"other holds part-9.parquet \(1 file\(s\) in all\) that .*data does not"):
        realign(str(tmp_path / "data"), str(tmp_path / "other"))
    assert not left.exists()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "manifest.json").write_text("{}")
    with pytest.raises(DataError, match="notes holds no parquet file"):
        realign(str(tmp_path / "notes"), str(tmp_path / "empty"))
    assert not ray.is_initialized() and not (tmp_path / "empty").exists()
    # The command line: the message, exit 2.
    done = subprocess.run(
        [sys.executable, str(ROOT / "entrypoints" / "realign_row_groups.py"), str(tmp_path / "nothing"), "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "is not a directory" in done.stderr, done.stderr


def test_realign_copies_a_tree_of_preprocessing_outputs_on_s3_and_a_rerun_does_only_what_is_not_done(
    tmp_path, s3_bucket, ray_cluster, capsys
):
    """Two days' outputs under one prefix, as retraining's data root holds them: every bucketed file rewritten by a
    Ray task (the cluster has no endpoint: the driver hands its own), every other file copied server-side, each
    directory's index written again so training reads no footer, and a re-run after a lost file writes that one."""
    local = tmp_path / "source"
    for day in ("day=1", "day=2"):
        _old_files(local / day, files=2)
        (local / day / "_shards").mkdir()
        (local / day / "_shards" / "a.json").write_text('{"shard": "a"}')
        (local / day / "_shards.jsonl.gz").write_bytes(gzip.compress(b'{"shard": "a"}\n'))
        (local / day / "unconditional_caption.npy").write_bytes(b"empty prompt")
        write_directory_index(str(local / day), COLUMNS)
    source, target = f"{s3_bucket}/latents", f"{s3_bucket}/latents-realigned"
    fs, path = filesystem_for(source)
    pafs.copy_files(str(local), path, destination_filesystem=fs)

    summary = realign(source, target)
    assert (summary.rewritten, summary.copied, summary.done_before, summary.side_files) == (4, 0, 0, 6)
    assert summary.rows == 1600 and summary.row_groups[1] > summary.row_groups[0] == 28
    for day in ("day=1", "day=2"):
        for n in range(2):
            name = f"{day}/part-{n}.parquet"
            assert _aligned(f"{target}/{name}")[0], name
            assert _table(f"{target}/{name}").equals(_table(f"{source}/{name}"), check_metadata=True), name
        for side in ("_shards/a.json", "_shards.jsonl.gz", "unconditional_caption.npy"):
            assert _raw(f"{target}/{day}/{side}") == (local / day / side).read_bytes()
        before = index_dataset([f"{source}/{day}"], "data.train", COLUMNS, 4, 32)
        after = index_dataset([f"{target}/{day}"], "data.train", COLUMNS, 4, 32)
        assert after.stats.footers_read == 0 and after.stats.from_index == 2  # the new index, of the new files
        assert np.array_equal(after.spec.runs, before.spec.runs) and after.spec.num_rows == before.spec.num_rows
    record = json.loads(_raw(f"{target}/{RECORD_FILE}"))
    assert record["source"] == source and record["files_rewritten"] == 4

    fs.delete_file(filesystem_for(f"{target}/day=2/part-1.parquet")[1])
    capsys.readouterr()
    assert realign_main([source, target]) == 0  # the command line, on this cluster
    out = capsys.readouterr().out
    assert f"{target}: 1 file(s) rewritten (7 row groups to " in out, out
    assert "a run starting each), 0 copied as they were, 3 done before; 400 rows; 0 other file(s) copied;" in out, out
    # Written again byte for byte (its ETag too), so the index still stands.
    assert f"index: {target}/day=2/_sdtrain_index.parquet (unchanged)" in out, out
    assert _aligned(f"{target}/day=2/part-1.parquet")[0]
    # A file that is no parquet stops the job naming it, after the writes in flight end.
    with fs.open_output_stream(f"{path}/day=3/part-0.parquet") as f:
        f.write(b"not parquet")
    with pytest.raises(DataError, match=r"latents/day=3/part-0.parquet: cannot be read as parquet \(Parquet magic"):
        realign(source, target)
