"""The command line of entrypoints/evaluate.py: one or two trained models (a run directory, a checkpoint or an export)
scored with training's evaluation metrics on a fixed set the user names, in this process or in Ray tasks; a JSON and
a markdown table written (docs/evaluation.md, Offline evaluation). Bad input is refused before any model samples
(:mod:`sdtrain.driver.offline_checks`)."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

from sdtrain.driver.offline_checks import Prepared, prepare
from sdtrain.evaluation.offline import PartResult
from sdtrain.logs import configure_logging, log

_OVERRIDE = re.compile(r"[A-Za-z_]\w*\.[\w.]+=")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="evaluate.py",
        description=(
            "Score one or two trained models (run directory, checkpoint or export; local or s3://) with the metrics "
            "of training's evaluation (eval.dinov2, eval.inception, eval.clip, eval.class_agreement: a --config or "
            "key=value) on a fixed set, the same seeded samples for both. Writes evaluation.json and evaluation.md."
        ),
    )
    parser.add_argument(
        "arguments",
        nargs="+",
        metavar="MODEL [MODEL2] [key.sub=value ...]",
        help="one or two models, then config overrides (eval.*, sample_grid.sampler/steps/guidance_scale, "
        "train.seed, data.latent_column/caption_column)",
    )
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument(
        "--captions", metavar="DATA", help="parquet rows as data.val holds them: latents, captions, text"
    )
    given.add_argument("--prompts", metavar="FILE", help="prompts in words, one a line (local or s3://)")
    parser.add_argument(
        "--reference",
        metavar="DATA|DIR",
        help="what the Frechet distances compare with: parquet rows (their latents decoded), or the reference/ "
        "directory an earlier call wrote; default for --captions: its own rows' images",
    )
    parser.add_argument("--config", help="YAML config file (its eval, sample_grid and train.seed)")
    parser.add_argument("--text-encoder", help="encodes --prompts for every model (default: the one each records)")
    parser.add_argument("--weights", choices=("auto", "ema", "raw"), default="auto", help="default: %(default)s")
    parser.add_argument("--out", default="evaluation", help="output directory (default: %(default)s)")
    parser.add_argument(
        "--tasks",
        type=int,
        help="split the set among this many Ray tasks (eval.num_gpus GPUs and eval.num_cpus CPUs each) on the Ray "
        "cluster (RAY_ADDRESS, else a local one); default: measured in this process",
    )
    return parser


def evaluate_main(argv: Sequence[str] | None = None) -> int:
    """The command line of entrypoints/evaluate.py; exit code 0 on success, 2 for bad input, 1 for a failed task, 75
    when object storage failed past its retries (run again)."""
    from sdtrain.driver.cli import REPORTED, exit_code
    from sdtrain.driver.offline_report import report

    parser = _parser()
    # Intermixed: key=value overrides may follow the options (`--prompts p.txt eval.clip=...`), as users write them.
    args = parser.parse_intermixed_args(argv)
    configure_logging()
    overrides = [a for a in args.arguments if _OVERRIDE.match(a)]
    models = [a for a in args.arguments if a not in overrides]
    if not 1 <= len(models) <= 2:
        parser.error(f"MODEL: give one or two models, got {len(models)}: {' '.join(models) or 'none'}")
    if args.tasks is not None and args.tasks < 1:
        parser.error(f"--tasks: must be >= 1, got {args.tasks}")
    try:
        prepared = prepare(args, models, overrides)
        merged = _measured(prepared, args.tasks)
        written = report(prepared, merged, args.out, args.tasks or 1)
    except (*REPORTED, ValueError) as e:
        error = getattr(e, "cause", None) or e  # a Ray task's error: what the task raised
        print(f"error: {error}", file=sys.stderr)
        return exit_code(error) if isinstance(error, REPORTED) else 2
    for note in prepared.notes:
        log.info(f"note: {note}")
    for path in written:
        log.info(f"wrote {path}")
    return 0


def _measured(prepared: Prepared, tasks: int | None) -> PartResult:
    """The whole set measured: in this process, or split among ``tasks`` Ray tasks and merged."""
    from sdtrain.evaluation.offline import measure_part, merge_parts

    if tasks is None:
        return measure_part(prepared.task, (0, 1), prepared.loaded)
    import ray

    if not ray.is_initialized():
        ray.init(log_to_driver=True)
    resources = {"num_cpus": prepared.config.eval.num_cpus, "num_gpus": prepared.config.eval.num_gpus}
    if not resources["num_gpus"] and ray.cluster_resources().get("GPU"):
        prepared.notes.append("the cluster has GPUs, but the tasks asked for none: set eval.num_gpus=1")
    remote = ray.remote(measure_part).options(**resources)
    log.info(f"measuring {tasks} parts of the set in Ray tasks of {resources}")
    return merge_parts(ray.get([remote.remote(prepared.task, (k, tasks)) for k in range(tasks)]))
