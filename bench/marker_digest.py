"""What a preprocessing re-run pays to learn which shards are done (``sdtrain.preprocess.outputs.done_shards``).

Every done shard has a marker (``_shards/<shard>.json``: its counts and source). A re-run lists them, then takes those
older than the last run's digest (``_shards.jsonl.gz``) from it and reads the others, a HEAD and a GET each, 128 at a
time. Measured with the real function over --markers local markers (records as the job writes them) through a
filesystem that waits --latency-ms for each of those two requests (pyarrow's ``PyFileSystem``), with the digest and
without it; then the digest's write and parse at --records shards, and both scaled to 2e6 shards (2e9 rows at
``input.rows_per_shard: 1000``).

    python bench/marker_digest.py           # 20000 markers at 30 ms a request; the digest at 2e5 shards
    python bench/marker_digest.py --smoke   # seconds: checks that it runs (CI)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
from support.wrapped_fs import wrapped_local  # noqa: E402

from sdtrain.preprocess import outputs  # noqa: E402
from sdtrain.preprocess.outputs import SHARDS_DIGEST, done_shards, write_shards_digest  # noqa: E402

FULL_RUN = 2_000_000


def record(i: int) -> dict:
    """A marker as the job writes one for a parquet input's 1000-row shard (sdtrain.preprocess.outputs.write_shard)."""
    source = f"s3://laion-400m/part-{i // 10:06d}.parquet"
    identity = {"path": source, "size": 152_826_000 + i, "version": f'"{i:032x}"', "rows": [i % 10 * 1000, 0]}
    identity["rows"][1] = identity["rows"][0] + 1000
    return {
        "shard": f"p-dff6f1202f-{i:08d}",
        "source": source,
        "identity": identity,
        "inputs_read": 1000,
        "rows_written": 987,
        "skipped": {"too_small": 13},
    }


def delayed(latency: float):
    """Each open after ``2 x latency`` seconds: a HEAD's and a GET's round trips, simulated."""

    def wrap(open_file):
        def opened(*args, **kwargs):
            time.sleep(2 * latency)
            return open_file(*args, **kwargs)

        return opened

    return wrap


def planning_s(output: str, latency: float) -> tuple[float, int]:
    """(seconds, markers read) of :func:`done_shards` on ``output``, every open delayed (:func:`delayed`)."""
    slow = wrapped_local(delayed(latency))
    real = outputs.filesystem_for
    outputs.filesystem_for = lambda path: (slow, path)  # every request of the function goes through it
    try:
        started = time.perf_counter()
        found = done_shards(output)
        return time.perf_counter() - started, found.markers_read
    finally:
        outputs.filesystem_for = real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="400 markers, the digest at 2e4 shards")
    parser.add_argument("--markers", type=int, help="done shards on disk (default 20000; smoke 400)")
    parser.add_argument("--latency-ms", type=float, default=30.0, help="each request's round trip (default 30)")
    parser.add_argument("--records", type=int, help="shards in the digest measured alone (default 2e5; smoke 2e4)")
    args = parser.parse_args()
    markers = args.markers or (400 if args.smoke else 20000)
    records = args.records or (20_000 if args.smoke else 200_000)
    latency = args.latency_ms / 1000

    print(f"# {benchlib.machine()}\n# {benchlib.versions()}\n# commit {benchlib.git_commit()}")
    with tempfile.TemporaryDirectory() as output:
        os.makedirs(os.path.join(output, "_shards"))
        written = [record(i) for i in range(markers)]
        an_hour_ago = time.time() - 3600
        for shard in written:
            path = os.path.join(output, "_shards", f"{shard['shard']}.json")
            with open(path, "w") as f:
                f.write(outputs.json.dumps(shard, indent=2))
            os.utime(path, (an_hour_ago, an_hour_ago))  # the markers of earlier runs
        read_s, read = planning_s(output, latency)
        write_shards_digest(output, written)  # as the last run ended
        digest_s, from_markers = planning_s(output, latency)
        assert (read, from_markers) == (markers, 0), (read, from_markers)
        os.remove(os.path.join(output, SHARDS_DIGEST))

        big = [record(i) for i in range(records)]
        started = time.perf_counter()
        write_shards_digest(output, big)
        write_s = time.perf_counter() - started
        size = os.path.getsize(os.path.join(output, SHARDS_DIGEST))
        started = time.perf_counter()
        assert len(outputs._digest(output)[0]) == records
        parse_s = time.perf_counter() - started

    print(
        f"# {markers} markers at {args.latency_ms:g} ms a request: all read {read_s:.2f} s; with the digest "
        f"{digest_s:.2f} s, none read (at 2e6, linearly: {read_s * FULL_RUN / markers / 60:.1f} min read)"
    )
    print(
        f"# the digest at {records:,} shards: {size / 1e6:.1f} MB, written in {write_s:.2f} s, parsed in "
        f"{parse_s:.2f} s (at 2e6, linearly: ~{size * FULL_RUN / records / 1e6:.0f} MB, written in "
        f"{write_s * FULL_RUN / records:.0f} s, parsed in {parse_s * FULL_RUN / records:.0f} s)"
    )
    print(
        benchlib.ratio_line(
            "planning with the digest", digest_s, "every marker read", read_s, "<= 0.1", digest_s <= 0.1 * read_s
        )
    )


if __name__ == "__main__":
    main()
