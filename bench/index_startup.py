"""Start-up of a run's restart with the dataset index against a start that reads every footer (issue #26).

Against a real S3 server process (moto's server mode on loopback, tests/s3_server.py), with N small parquet
files (10 rows each, tiny columns) uploaded under their own bucket in parallel threads, it times the driver's
real data step, ``sdtrain.data.dataset_index.index_dataset``:

- a start without an index: the paginated listing, then every footer (16 in flight) and one row;
- a restart with the index: one GET of the index, then the listing in key ranges cut at its paths (no footer,
  no row); median of 3, with this process's CPU seconds and the server process's (from /proc) during it;
- the listing alone, paginated and in those key ranges; medians of 3;
- a restart of a run on the same files as the preprocessing job leaves them, its index beside them
  (``_sdtrain_index.parquet``): one GET of the run's index and one HEAD of the directory's, no listing; median of 3.

and prints ``RATIO restart_with_index_<large>/restart_with_index_<small>`` with its target (<= 3: a restart's
cost is the listing and one object, not N requests), the same for the restart on a preprocessing output, the
same ratio of this process's CPU seconds (the client's own work: botocore's parsing and ours, without the
server's), and, at each size, the footers-against-index ratio.
moto answers each page of a listing by reading and sorting every key under the prefix (S3 in a time that does not
grow with the bucket), so the server's CPU is shown beside it.

    python bench/index_startup.py            # 1k and 20k files
    python bench/index_startup.py --smoke    # 20 and 100 files (seconds)

``bench/data_scale.py`` calls :func:`restart_startup`.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import benchlib  # noqa: E402
from s3_server import moto_server  # noqa: E402

from sdtrain.config.learning import Columns  # noqa: E402

ROWS = 10
IN_CHANNELS, CAPTION_DIM = 4, 8  # latents 4x2x2, captions 1x8: tiny files, real footers
COLUMNS = Columns("latents", "captions")
UPLOAD_THREADS = 16
RESTARTS = 3


def _parquet_file() -> bytes:
    rng = np.random.default_rng(0)

    def flat(width: int) -> pa.Array:
        values = pa.array(rng.standard_normal(ROWS * width).astype(np.float16))
        return pa.ListArray.from_arrays(pa.array(np.arange(ROWS + 1, dtype=np.int32) * width), values)

    table = pa.table(
        {COLUMNS.latent: flat(IN_CHANNELS * 2 * 2), COLUMNS.caption: flat(CAPTION_DIM), "id": np.arange(ROWS)}
    )
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return buffer.getvalue()


def _upload(client, bucket: str, count: int) -> None:
    body = _parquet_file()
    client.create_bucket(Bucket=bucket)
    with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
        list(
            pool.map(
                lambda i: client.put_object(Bucket=bucket, Key=f"data/part-{i:06d}.parquet", Body=body), range(count)
            )
        )


def _server_cpu_s(endpoint: str) -> float | None:
    """CPU seconds the moto server process (``moto_server ... -p <port>``) has used so far, from /proc (Linux);
    None where that cannot be read."""
    port = endpoint.rsplit(":", 1)[-1]
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if not any(a.endswith(b"moto_server") for a in argv) or port.encode() not in argv:
                continue
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
        except OSError:
            continue
    return None


def _timed(endpoint: str, call) -> tuple[float, float, float | None, object]:
    """(wall s, this process's CPU s, the server's CPU s, result) of ``call()``."""
    server = _server_cpu_s(endpoint)
    cpu, started = time.process_time(), time.perf_counter()
    result = call()
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    after = _server_cpu_s(endpoint)
    return wall, cpu, (after - server) if server is not None and after is not None else None, result


def _measure(bucket: str, count: int, endpoint: str) -> dict:
    from sdtrain.data.dataset_index import index_dataset
    from sdtrain.data.directory_index import write_directory_index
    from sdtrain.data.index_format import (
        read_index,
        run_index_uri,
        write_index,
    )
    from sdtrain.data.listing import list_dataset

    spec = [f"s3://{bucket}/data"]
    index_uri = run_index_uri(f"s3://{bucket}/runs/bench", "data.train")

    def start_on(uri):
        return index_dataset(spec, "data.train", COLUMNS, IN_CHANNELS, CAPTION_DIM, uri)

    def start():
        return start_on(index_uri)

    listings = []
    for _ in range(RESTARTS):
        wall, _, _, listing = _timed(endpoint, lambda: list_dataset(spec, "data.train"))
        listings.append(wall)
        assert len(listing) == count

    started = time.perf_counter()
    first = start()
    footers_s = time.perf_counter() - started
    assert (first.stats.footers_read, first.spec.num_rows) == (count, count * ROWS)
    write_index(index_uri, first.index)
    index = read_index(index_uri)
    assert index is not None

    ranged = []
    for _ in range(RESTARTS):  # the listing a restart makes: in key ranges cut at the index's paths
        wall, _, _, listing = _timed(endpoint, lambda: list_dataset(spec, "data.train", known=index.paths))
        ranged.append(wall)
        assert len(listing) == count

    restarts = []
    for _ in range(RESTARTS):
        wall, cpu, server, again = _timed(endpoint, start)
        restarts.append((wall, cpu, server))
        assert (again.stats.from_index, again.stats.footers_read) == (count, 0)

    # The preprocessing job's index beside the files (the rows it knows from its shard records: no footer read),
    # and another run on them: its restarts list nothing while that index is unchanged.
    names = {
        path[len(spec[0]) + 1 :]: int(n) for path, n in zip(first.spec.files, first.spec.rows_per_file, strict=True)
    }
    assert write_directory_index(spec[0], COLUMNS, names) is not None
    sealed_uri = run_index_uri(f"s3://{bucket}/runs/bench-on-output", "data.train")
    on_output = start_on(sealed_uri)
    assert on_output.stats.footers_read == 0 and len(on_output.index.sealed) == 1
    write_index(sealed_uri, on_output.index)
    sealed = []
    for _ in range(RESTARTS):
        wall, cpu, server, again = _timed(endpoint, lambda: start_on(sealed_uri))
        sealed.append((wall, cpu, server))
        assert (again.stats.unlisted, again.stats.footers_read) == (count, 0)

    restart_s, listing_s = statistics.median(r[0] for r in restarts), statistics.median(listings)
    servers = [r[2] for r in restarts if r[2] is not None]
    return {
        "files": count,
        "restart_with_index_s": restart_s,
        "start_reading_footers_s": footers_s,
        "listing_s": listing_s,
        "listing_in_ranges_s": statistics.median(ranged),
        "pages": -(-count // 1000),
        # What the index adds to the listing: its GET, parsing it, matching the files, the checks.
        "restart_beyond_listing_s": max(restart_s - statistics.median(ranged), 0.0),
        # Where a restart's time goes: this process's CPU (botocore's parsing, ours), the server's CPU.
        "restart_client_cpu_s": statistics.median(r[1] for r in restarts),
        "restart_server_cpu_s": statistics.median(servers) if servers else float("nan"),
        "restart_on_output_s": statistics.median(r[0] for r in sealed),
        "restart_on_output_client_cpu_s": statistics.median(r[1] for r in sealed),
    }


def restart_startup(file_counts=(1000, 20000), workdir=None) -> list[dict]:
    """For each count: the seconds of a start that reads every footer and of a restart with the index, against a
    moto server process started here (its endpoint set in this process's environment while it runs)."""
    import boto3

    from sdtrain.storage import s3

    saved = {key: os.environ.get(key) for key in (*s3.ENDPOINT_VARS, *_CREDENTIALS)}
    with tempfile.TemporaryDirectory(prefix="sdtrain-index-") as scratch:
        log = Path(workdir or scratch) / "moto-index-startup.log"
        with moto_server(log) as endpoint:
            os.environ.update({"AWS_ENDPOINT_URL": endpoint, **_CREDENTIALS})
            for var in s3.ENDPOINT_VARS[:1]:
                os.environ.pop(var, None)  # AWS_ENDPOINT_URL_S3 would win over the server's
            try:
                client = boto3.client("s3")
                results = []
                for count in file_counts:
                    bucket = f"index-startup-{count}"
                    started = time.perf_counter()
                    _upload(client, bucket, count)
                    print(f"# uploaded {count} files in {time.perf_counter() - started:.1f} s", flush=True)
                    results.append(_measure(bucket, count, endpoint))
                    print(
                        "files {files:>6}  listing {listing_s:7.3f} s ({pages} pages), in ranges "
                        "{listing_in_ranges_s:7.3f} s  start reading footers {start_reading_footers_s:7.3f} s  "
                        "restart with index {restart_with_index_s:7.3f} s (beyond the listing "
                        "{restart_beyond_listing_s:6.3f} s; CPU: this process {restart_client_cpu_s:6.3f} s, "
                        "the server {restart_server_cpu_s:6.3f} s)  restart on a preprocessing output "
                        "{restart_on_output_s:7.3f} s (CPU {restart_on_output_client_cpu_s:6.3f} s)".format(
                            **results[-1]
                        ),
                        flush=True,
                    )
                return results
            finally:
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value


_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def ratio_lines(results: list[dict]) -> list[str]:
    few, many = results[0], results[-1]
    lines = [
        benchlib.ratio_line(
            f"restart_with_index_{many['files']}",
            many["restart_with_index_s"],
            f"restart_with_index_{few['files']}",
            few["restart_with_index_s"],
            "<= 3",
            many["restart_with_index_s"] <= 3 * few["restart_with_index_s"],
        )
    ]
    # Files as the preprocessing job leaves them (its index beside them): the restart lists nothing.
    lines.append(
        benchlib.ratio_line(
            f"restart_on_output_{many['files']}",
            many["restart_on_output_s"],
            f"restart_on_output_{few['files']}",
            few["restart_on_output_s"],
            "<= 3",
            many["restart_on_output_s"] <= 3 * few["restart_on_output_s"],
        )
    )
    lines.append(
        benchlib.ratio_line(f"listing_{many['files']}", many["listing_s"], f"listing_{few['files']}", few["listing_s"])
    )
    lines.append(
        benchlib.ratio_line(
            f"listing_in_ranges_{many['files']}",
            many["listing_in_ranges_s"],
            f"listing_in_ranges_{few['files']}",
            few["listing_in_ranges_s"],
        )
    )
    # The restart's own work, without the server's: this process's CPU seconds (it waits on the server otherwise).
    lines.append(
        benchlib.ratio_line(
            f"restart_client_cpu_{many['files']}",
            many["restart_client_cpu_s"],
            f"restart_client_cpu_{few['files']}",
            few["restart_client_cpu_s"],
            "<= 3",
            many["restart_client_cpu_s"] <= 3 * few["restart_client_cpu_s"],
        )
    )
    lines.append(
        benchlib.ratio_line(
            f"restart_server_cpu_{many['files']}",
            many["restart_server_cpu_s"],
            f"restart_server_cpu_{few['files']}",
            few["restart_server_cpu_s"],
        )
    )
    for r in results:
        lines.append(
            benchlib.ratio_line(
                f"start_reading_footers_{r['files']}",
                r["start_reading_footers_s"],
                f"restart_with_index_{r['files']}",
                r["restart_with_index_s"],
            )
        )
    return lines


def main() -> None:
    from sdtrain.logs import configure_logging

    configure_logging()  # the index's own lines (files from the index, footers read), as a command line prints them
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="20 and 100 files: checks that it runs")
    args = parser.parse_args()
    print(f"# machine: {benchlib.machine()}")
    print(f"# {benchlib.versions()}, sdtrain commit {benchlib.git_commit()}")
    results = restart_startup((20, 100) if args.smoke else (1000, 20000))
    print("\n".join(ratio_lines(results)), flush=True)


if __name__ == "__main__":
    main()
