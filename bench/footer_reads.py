"""What a first start pays to read every footer of files it has no index of (``sdtrain.data.inspection.read_footers``;
preprocessing's input planning reads its inputs' footers the same way, PLANNING_READS at a time).

Training data written by sdtrain's preprocessing carries an index and has no footer read; other data, and
preprocessing's inputs, have each footer read once: pyarrow opens the file (a HEAD) and reads its tail (a GET or
two). The real function over --files local parquet files through a filesystem that waits --latency-ms x 3 at each
open (pyarrow's ``PyFileSystem``), 16 at a time as before and DRIVER_READS (128) at a time, each scaled to 2e5 files.

    python bench/footer_reads.py           # 2000 files at 30 ms a request
    python bench/footer_reads.py --smoke   # seconds: checks that it runs (CI)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
from conftest import write_latents  # noqa: E402
from marker_digest import delayed  # noqa: E402
from support.wrapped_fs import wrapped_local  # noqa: E402

from sdtrain.config.learning import Columns  # noqa: E402
from sdtrain.data import inspection  # noqa: E402

LARGE = 200_000
REQUESTS = 3  # an open's HEAD, then the footer's length and the footer


def reading_s(files: list[str], latency: float, at_once: int) -> float:
    """Seconds of :func:`read_footers` over ``files``, ``at_once`` in flight, every open delayed."""
    slow = wrapped_local(delayed(latency * REQUESTS / 2))  # delayed() waits two round trips
    real, real_reads = inspection.filesystem_for, inspection.FOOTER_READS
    inspection.filesystem_for = lambda path: (slow, path)
    inspection.FOOTER_READS = at_once
    try:
        started = time.perf_counter()
        rows, _ = inspection.read_footers(files, "data.train", Columns("image_latents_256", "caption_latents"))
        assert len(rows) == len(files)
        return time.perf_counter() - started
    finally:
        inspection.filesystem_for, inspection.FOOTER_READS = real, real_reads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="200 files")
    parser.add_argument("--files", type=int, help="parquet files (default 2000; smoke 200)")
    parser.add_argument("--latency-ms", type=float, default=30.0, help="each request's round trip (default 30)")
    args = parser.parse_args()
    count = args.files or (200 if args.smoke else 2000)
    latency = args.latency_ms / 1000

    print(f"# {benchlib.machine()}\n# {benchlib.versions()}\n# commit {benchlib.git_commit()}")
    with tempfile.TemporaryDirectory() as directory:
        files = []
        for i in range(count):
            path = Path(directory) / f"part-{i:05d}.parquet"
            write_latents(path, rows=10, latent_shape=(4, 2, 2), caption_shape=(1, 32))
            files.append(str(path))
        before = reading_s(files, latency, 16)
        now = reading_s(files, latency, inspection.FOOTER_READS)
    for label, seconds in (("16 at a time", before), (f"{inspection.FOOTER_READS} at a time", now)):
        print(
            f"# {count} footers at {args.latency_ms:g} ms a request, {label}: {seconds:.2f} s "
            f"(at {LARGE:,} files, linearly: {seconds * LARGE / count / 60:.1f} min)"
        )
    print(
        benchlib.ratio_line(
            f"footers {inspection.FOOTER_READS} at a time", now, "16 at a time", before, "<= 0.25", now <= 0.25 * before
        )
    )


if __name__ == "__main__":
    main()
