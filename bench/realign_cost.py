"""What entrypoints/realign_row_groups.py pays to give an old bucketed file a row group at each bucket run
(``sdtrain.preprocess.realign``), against what it saves.

One task: the real ``realign_file`` on a --rows shard as an sdtrain before 2026-12-01 wrote it (SD 2 at 256 px: 4 x 32
x 32 float16 latents and 77 x 1024 float16 embeddings a row, random values, rows sorted into 40 buckets' runs, 64-row
groups from the file's start), beside a plain copy and the whole-table rewrite (read the table, write it with
``parquet_bytes``) it streams instead of; its time and its peak resident memory over the file's size. The driver: the
names it holds and compares for 2e5 shards and 2e6 markers (2e9 rows at 1000 a shard, 10 markers a shard: the
preprocessing outputs of several inputs). Then both scaled to 1e9 rows.

    python bench/realign_cost.py           # a 1000-row shard (~165 MB), 3 runs each
    python bench/realign_cost.py --smoke   # seconds: checks that it runs (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

from sdtrain.data.metadata import BUCKET_RUNS, BUCKET_SHAPES  # noqa: E402
from sdtrain.preprocess.outputs import parquet_bytes  # noqa: E402
from sdtrain.preprocess.realign import plan_copy, realign_file  # noqa: E402
from sdtrain.storage.filesystems import copy_file  # noqa: E402

BUCKETS = 40
FULL_ROWS = 1_000_000_000


def old_shard(path: Path, rows: int, caption_width: int) -> None:
    """A bucketed shard as preprocessing wrote it before 2026-12-01: runs of a bucket each, 64-row groups from row 0."""
    rng = np.random.default_rng(0)
    counts = np.bincount(rng.integers(0, BUCKETS, rows), minlength=BUCKETS)
    runs = [[b, int(n)] for b, n in enumerate(counts) if n]
    latents = rng.standard_normal((rows, 4 * 32 * 32)).astype(np.float16)
    captions = rng.standard_normal((rows, 77 * caption_width)).astype(np.float16)
    table = pa.table(
        {
            "image_latents_256": pa.FixedSizeListArray.from_arrays(pa.array(latents.reshape(-1)), 4 * 32 * 32),
            "caption_latents": pa.FixedSizeListArray.from_arrays(pa.array(captions.reshape(-1)), 77 * caption_width),
            "caption": [f"caption {i}" for i in range(rows)],
            "key": [f"k{i}" for i in range(rows)],
        }
    )
    shapes = [[4, 32, 32]] * BUCKETS
    table = table.replace_schema_metadata({BUCKET_SHAPES: json.dumps(shapes), BUCKET_RUNS: json.dumps(runs)})
    pq.write_table(table, path, row_group_size=64, compression="zstd")


def timed(run, repeats: int) -> tuple[float, int]:
    """Median seconds of ``run()`` and its largest peak of resident memory above where it started."""
    seconds, peaks = [], []
    process = psutil.Process()
    for _ in range(repeats):
        sampler = benchlib.TreeMemorySampler(os.getpid(), interval=0.01)
        base = process.memory_info().rss
        sampler.start()
        started = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - started)
        peaks.append(sampler.stop().rss - base)
    return sorted(seconds)[len(seconds) // 2], max(peaks)


def driver_names(shards: int, markers: int) -> tuple[float, float]:
    """Seconds and peak MB of the driver's listings (names with their sizes, as ``realign`` holds them: the driver's
    copies of side files take the listed size) and ``plan_copy`` over this many shards' and markers' names, half of
    them under the target already (a re-run)."""
    names = [f"date=2026-{i % 365:03d}/part-{i:06d}-1f2e3d4c5b-00000000.parquet" for i in range(shards)]
    names += [f"date=2026-{i % 365:03d}/_shards/part-{i:07d}-1f2e3d4c5b.json" for i in range(markers)]
    tracemalloc.start()
    started = time.perf_counter()
    files = {name: 1_000 + 7_919 * i for i, name in enumerate(names)}  # sizes of their own, as a listing gives
    there = {name: files[name] for name in names[::2]}
    plan = plan_copy(files, there)
    seconds = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(plan.parquet) == shards // 2 and not plan.strays
    return seconds, peak / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1000, help="rows of the shard (preprocessing's default: 1000)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one run: checks that it runs")
    args = parser.parse_args()
    rows, repeats, width = (128, 1, 64) if args.smoke else (args.rows, args.repeats, 1024)
    shards, markers = (2000, 20000) if args.smoke else (200_000, 2_000_000)
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old.parquet"
        old_shard(old, rows, width)
        size = old.stat().st_size
        realign_s, realign_peak = timed(lambda: realign_file(str(old), f"{tmp}/new.parquet", None), repeats)
        copy_s, _ = timed(lambda: copy_file(str(old), f"{tmp}/copy.parquet"), repeats)
        whole_s, whole_peak = timed(
            lambda: Path(f"{tmp}/whole.parquet").write_bytes(parquet_bytes(pq.read_table(old), 64)), repeats
        )
        groups = (pq.read_metadata(old).num_row_groups, pq.read_metadata(f"{tmp}/new.parquet").num_row_groups)
        assert pq.read_table(f"{tmp}/new.parquet").equals(pq.read_table(old))
    names_s, names_mb = driver_names(shards, markers)
    per_row = realign_s / rows
    print(f"# one {rows}-row shard of {size / 1e6:.1f} MB ({groups[0]} row groups -> {groups[1]})")
    print(f"realign_file: {realign_s:.2f} s ({size / 1e6 / realign_s:.0f} MB/s), peak +{realign_peak / 1e6:.0f} MB")
    print(f"whole-table rewrite: {whole_s:.2f} s, peak +{whole_peak / 1e6:.0f} MB; a copy: {copy_s:.3f} s")
    print(
        f"# the driver's plan of {shards} shards and {markers} markers, half done: {names_s:.1f} s, {names_mb:.0f} MB"
    )
    hours = per_row * FULL_ROWS / 3600
    print(f"# at 1e9 rows: {hours:.0f} CPU-hours of rewriting, {hours / 256:.1f} h on 256 CPUs")
    print(f"RATIO realign peak memory / file size = {realign_peak / size:.2f}")
    print(f"RATIO whole-table rewrite peak memory / file size = {whole_peak / size:.2f}")
    print(f"RATIO realign s / whole-table rewrite s = {realign_s / whole_s:.2f}")
    print(f"RATIO realign s / copy s = {realign_s / copy_s:.1f}")


if __name__ == "__main__":
    main()
