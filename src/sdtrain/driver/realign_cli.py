"""The command line of entrypoints/realign_row_groups.py (sdtrain.preprocess.realign)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from sdtrain.driver.cli import REPORTED, exit_code
from sdtrain.logs import configure_logging, log


def realign_main(argv: Sequence[str] | None) -> int:
    """Copy parquet latents with a row group starting at each bucket run; 0 on success, 2 for bad input, 75 when
    object storage failed past its retries (run again: it does what is not done)."""
    parser = argparse.ArgumentParser(
        prog="realign_row_groups.py",
        description=(
            "Copy bucketed parquet latents that an sdtrain before 2026-12-01 wrote (row groups counted from each "
            "file's start: training reads them ~2x) to TARGET with a row group starting at each bucket run, as "
            "preprocessing writes them now; nothing is encoded again. Every other file is copied, each dataset index "
            "written again; train on TARGET. Re-run it after a kill: it does what is not done (docs/data.md)."
        ),
    )
    parser.add_argument("source", help="local directory or s3:// prefix: a preprocessing output, or a tree of them")
    parser.add_argument("target", help="where the copy goes, beside the source (empty, or this source's earlier copy)")
    args = parser.parse_args(argv)
    configure_logging()
    try:
        from sdtrain.preprocess.realign import realign

        summary = realign(args.source, args.target)
    except REPORTED as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_code(e)
    before, after = summary.row_groups
    log.info(
        f"{summary.target}: {summary.rewritten} file(s) rewritten ({before} row groups to {after}, a run starting "
        f"each), {summary.copied} copied as they were, {summary.done_before} done before; {summary.rows} rows; "
        f"{summary.side_files} other file(s) copied; {summary.seconds:.1f} s"
    )
    for index in summary.indexes:
        log.info(f"index: {index}")
    return 0
