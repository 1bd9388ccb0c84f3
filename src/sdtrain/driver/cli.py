"""Command lines of entrypoints/train.py, retrain.py, check.py, preprocess.py, index.py and generate.py: parse, load,
run, report."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from sdtrain.config.keys import help_text
from sdtrain.config.loader import load_config
from sdtrain.config.schema import Config
from sdtrain.errors import SdtrainError, StorageUnavailable, TrainingFailed
from sdtrain.logs import configure_logging, log

EX_TEMPFAIL = 75
"""The exit status of a command that did nothing because another holds what it needs (the registry's lock), or
because object storage kept failing past its client's retries: a retry later may succeed. The training watchdog's is
the same (sdtrain.train.watchdog)."""

REPORTED = (SdtrainError, StorageUnavailable)
"""The errors a command prints as their one-paragraph message, without a traceback, and exits with
:func:`exit_code` of."""


def exit_code(error: SdtrainError | StorageUnavailable) -> int:
    """A command's exit status for ``error``: 1 for a run that failed after it started, EX_TEMPFAIL (75) when the
    registry is busy or object storage failed for now (neither is the input's fault), 2 for bad input."""
    from sdtrain.artifacts.registry_lock import RegistryBusy

    if isinstance(error, TrainingFailed):
        return 1
    return EX_TEMPFAIL if isinstance(error, RegistryBusy | StorageUnavailable) else 2


def train_main(argv: Sequence[str] | None, default_config: Path) -> int:
    """Run the training job; the exit code is 0 on success, 2 for bad input, 1 for a failed run, 75 when object storage
    failed past its retries before the run started (run again)."""
    return _main(
        argv,
        default_config,
        "train.py",
        "Train a Stable Diffusion UNet on parquet latents with Ray Train + Lightning.",
        _train,
    )


def retrain_main(argv: Sequence[str] | None, default_config: Path) -> int:
    """Run one scheduled retraining; exit codes as for training (a rejected model is not a failure), and 75 when
    another retraining holds the registry's lock (busy: try later)."""
    return _main(
        argv,
        default_config,
        "retrain.py",
        "Retrain on new date partitions and promote the result if it is better.",
        _retrain,
    )


def _main(argv, default_config: Path, prog: str, description: str, job: Callable[[Config], list[str]]) -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description=description, epilog=help_text(), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(default_config), help="YAML config file (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="override a config key")
    args = parser.parse_args(argv)
    configure_logging()
    try:
        lines = job(load_config(args.config, args.overrides))
    except REPORTED as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_code(e)
    for line in lines:
        log.info(line)
    return 0


def _train(config: Config) -> list[str]:
    from sdtrain.demo import digits
    from sdtrain.driver.run import train  # imports Ray and torch: only once the config is known good
    from sdtrain.model.unet import unet_config

    # The demo's door: its data is written where configs/demo.yaml names it, on first use.
    caption_dim = unet_config(config.model)["cross_attention_dim"]
    written = digits.prepare(config.data.train, config.data.val, caption_dim)
    if written is not None:
        log.info(f"wrote the digits demo dataset to {written}")
    summary = train(config)
    return [
        f"done: step {summary.final_step}, loss {summary.final_loss:.4f}",
        summary.totals.line(),
        f"final checkpoint: {summary.checkpoint_path}",
        *(f"wrote {path}" for path in summary.outputs),
    ]


def _retrain(config: Config) -> list[str]:
    from sdtrain.driver.retrain import retrain
    from sdtrain.errors import ConfigError

    if config.retrain.data_root is None:
        raise ConfigError("retrain.data_root and retrain.models_root are required for retraining")
    outcome = retrain(config)  # the schedule date: retrain.date, else pinned per Anyscale job (sdtrain.driver.retrain)
    return [f"{outcome.status}: {outcome.message}", f"production: {outcome.production or 'none'}"]


def check_main(argv: Sequence[str] | None, default_config: Path | None) -> int:
    """Run the check job (sdtrain.driver.check); 0 if every phase trained, 1 if one failed (or a TrainingFailed), 2
    for bad input."""
    parser = argparse.ArgumentParser(
        prog="check.py",
        description="Train the config for a few minutes on one GPU, then on all of them, and report what it measured.",
        epilog=help_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config", default=default_config and str(default_config), help="YAML config file (default: %(default)s)"
    )
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps of each phase (default: %(default)s)")
    parser.add_argument(
        "--compare-compile", action="store_true", help="add a one-GPU phase with train.compile the other way"
    )
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="override a config key")
    args = parser.parse_args(argv)
    configure_logging()
    if args.steps < 8:  # a report window after the first (compilation), and a checkpoint before the last step
        print(f"error: --steps: must be >= 8, got {args.steps}", file=sys.stderr)
        return 2
    try:
        from sdtrain.driver.check import check

        report = check(args.config, args.overrides, steps=args.steps, compare_compile=args.compare_compile)
    except REPORTED as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_code(e)
    for line in report.table():
        log.info(f"check: {line}")
    return 1 if report.failed else 0


def preprocess_main(argv: Sequence[str] | None, default_config: Path) -> int:
    """Run the preprocessing job (images and captions to parquet latents); 0 on success, 2 for bad input."""
    from sdtrain.preprocess.config import PreprocessConfig

    parser = argparse.ArgumentParser(
        prog="preprocess.py",
        description="Encode images and captions into the parquet latents training reads (Ray Data).",
        epilog=help_text(PreprocessConfig),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", default=str(default_config), help="YAML config file (default: %(default)s)")
    parser.add_argument("--max-shards", type=int, help="do at most this many pending shards (a re-run does the rest)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="override a config key")
    args = parser.parse_args(argv)
    configure_logging()
    if args.max_shards is not None and args.max_shards < 0:  # a slice [:-1] would silently drop the last shard
        print(f"error: --max-shards: must be >= 0 (0: list and record only), got {args.max_shards}", file=sys.stderr)
        return 2
    try:
        from sdtrain.preprocess.job import run_preprocess

        summary = run_preprocess(load_config(args.config, args.overrides, PreprocessConfig), max_shards=args.max_shards)
    except REPORTED as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_code(e)
    manifest = summary.manifest
    log.info(
        f"{len(summary.shards_written)} shard(s) written this run, {summary.shards_done_before} done "
        f"before, of {summary.shards_total}; {summary.seconds:.1f} s"
    )
    log.info(
        f"in all: {manifest['inputs_read']} inputs read, {manifest['rows_written']} rows written, "
        f"{manifest['rows_skipped']} skipped {manifest['skipped_by_reason']}"
    )
    for name, error in summary.shards_failed.items():
        log.warning(f"shard {name} could not be read ({error}); a re-run retries it")
    return 1 if summary.shards_failed else 0


def index_main(argv: Sequence[str] | None) -> int:
    """Write the dataset index beside directories of parquet latents; 0 on success, 2 for bad input, 75 when object
    storage failed past its retries (run again)."""
    import json
    import re

    parser = argparse.ArgumentParser(
        prog="index.py",
        description=(
            "Write the dataset index beside directories of parquet latents that did not come from preprocess.py: "
            "training on them then reads no footer, and its restarts list nothing (docs/data.md, Dataset index). "
            "Re-run it after changing a directory: it reads the footers of the new and rewritten files only."
        ),
    )
    parser.add_argument(
        "arguments",
        nargs="*",
        metavar="DIR | data.key=value",
        help="local or s3:// directories (default: the directories data.train and data.val name), and config "
        "overrides (data.latent_column, data.caption_column: the columns the index is for)",
    )
    parser.add_argument("--config", help="YAML config file: its data section's directories and columns")
    args = parser.parse_args(argv)
    configure_logging()
    # An override is section.key=value; a directory may hold '=' too (s3://bucket/date=2026-11-26/).
    overrides = [a for a in args.arguments if re.match(r"[A-Za-z_]\w*\.[\w.]+=", a)]
    directories = [a for a in args.arguments if a not in overrides]
    try:
        from sdtrain.data.directory_index import write_directory_index
        from sdtrain.data.listing import DIRECTORY_INDEX, names_directory

        if directories:  # they are the data here, whatever the config names (which must name some)
            overrides.append(f"data.train={json.dumps(directories)}")
        data = load_config(args.config, overrides).data
        targets = [("index.py", d) for d in directories] or [
            (f"data.{key}", spec) for key in ("train", "val") for spec in getattr(data, key) if names_directory(spec)
        ]
        if not targets:
            parser.error("give a directory, or a --config whose data.train or data.val names one")
        for key, directory in targets:
            stats = write_directory_index(directory, data.columns, key=key)
            if stats is None:
                print(f"error: {key}: {directory} holds no parquet file with rows", file=sys.stderr)
                return 2
            done = f"wrote {directory.rstrip('/')}/{DIRECTORY_INDEX}" if stats.written else "unchanged, not rewritten"
            log.info(
                f"{directory}: {stats.files} files ({stats.from_index} from its index, "
                f"{stats.footers_read} footers read); {done}"
            )
    except REPORTED as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_code(e)
    return 0


def _generate_parser() -> argparse.ArgumentParser:

    parser = argparse.ArgumentParser(
        prog="generate.py",
        description=(
            "Sample from a trained model (run directory, checkpoint or export; local or s3://), or export a checkpoint."
        ),
    )
    parser.add_argument(
        "model", help="a run directory (its latest checkpoint), a checkpoint directory or .ckpt, or an export directory"
    )
    parser.add_argument(
        "--captions",
        help="caption embeddings: a .npy file ((L, D) or (N, L, D)) or parquet (file, directory or glob); "
        "parquet with a label column gives one row per label. Given neither captions nor prompts, a run or checkpoint "
        "samples the prompts of its sample grids (sample_grid.prompts)",
    )
    parser.add_argument(
        "--prompt",
        action="append",
        default=[],
        help="a prompt in words (repeatable): encoded with the text encoder the model's data records (or "
        "--text-encoder), decoded with its VAE (or --vae)",
    )
    parser.add_argument("--prompts-file", help="a text file of prompts, one a line")
    parser.add_argument(
        "--text-encoder", help="diffusers model directory or hub id whose tokenizer/ and text_encoder/ encode prompts"
    )
    parser.add_argument("--out", default="samples", help="output directory (default: %(default)s)")
    parser.add_argument(
        "--caption-column", default="caption_latents", help="parquet column of the embeddings (default: %(default)s)"
    )
    parser.add_argument(
        "--rows", type=int, default=8, help="parquet rows to take when there is no label column (default: %(default)s)"
    )
    _add_sampling_arguments(parser)
    return parser


def _add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """How generate.py samples: the grid's shape, the sampler, guidance, seed, decoding and weights."""
    from sdtrain.sampling.sampler import SAMPLERS

    parser.add_argument("--samples-per-caption", type=int, default=8, help="grid columns (default: %(default)s)")
    parser.add_argument(
        "--sampler", choices=SAMPLERS, default="ddim", help="ddim or dpm (DPM-Solver++) (default: %(default)s)"
    )
    parser.add_argument("--steps", type=int, default=25, help="sampling steps (default: %(default)s)")
    parser.add_argument(
        "--guidance-scale",
        type=float,
        help="classifier-free guidance scale; 1 or below = none (default: 3; 5 for an SDXL-shaped model, as its pipe)",
    )
    parser.add_argument(
        "--guidance-rescale",
        type=float,
        help="rescale the guided prediction toward the conditional one's std (Lin et al. 2023; diffusers' "
        "guidance_rescale), 0 to 1; default: 0.7 for a zero-terminal-SNR model, else 0",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial noise (default: %(default)s)")
    parser.add_argument(
        "--vae",
        help="decode with this AutoencoderKL (local directory or hub id); without it, latents and a preview are saved",
    )
    parser.add_argument(
        "--weights",
        choices=("auto", "ema", "raw"),
        default="auto",
        help="auto = EMA if the run kept one (default: %(default)s)",
    )
    parser.add_argument(
        "--preview",
        choices=("auto", "classifier", "channels"),
        default="auto",
        help=(
            "latent preview without a VAE: classifier (the latent classifier the model's data names, e.g. the "
            "demo's digits), channels (first 3 as RGB); auto = classifier where there is one"
        ),
    )
    parser.add_argument("--batch-size", type=int, default=64, help="samples per UNet batch (default: %(default)s)")
    parser.add_argument(
        "--height",
        type=int,
        help="pixels (default: what the model trained at: its data's size, or the aspect-ratio bucket most rows had)",
    )
    parser.add_argument("--width", type=int, help="pixels (default: as --height)")
    parser.add_argument(
        "--export-to",
        metavar="DIR",
        help="instead of sampling: export the model as a diffusers pipeline to DIR (local or s3://)",
    )
    parser.add_argument(
        "--base-model",
        help="with --export-to: the Stable Diffusion model (local directory, s3:// or hub id) whose VAE, text encoder "
        "and tokenizer made the model's data; default: its run's export.base_model, else what its data records",
    )


def generate_main(argv=None) -> int:
    """The command line of entrypoints/generate.py; exit code 0 on success, 2 for bad input."""
    from sdtrain.sampling.generate import GenerateRequest, generate

    parser = _generate_parser()
    args = parser.parse_args(argv)
    configure_logging()
    for name in ("rows", "samples_per_caption", "steps", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.guidance_rescale is not None and not 0 <= args.guidance_rescale <= 1:
        parser.error(f"--guidance-rescale must be in [0, 1], got {args.guidance_rescale}")
    if args.base_model and not args.export_to:
        parser.error("--base-model is for --export-to (sampling takes --vae and --text-encoder)")
    try:
        if args.export_to:
            _export(args)
            return 0
        prompts = list(args.prompt)
        if args.prompts_file:
            from sdtrain.sampling.prompts import read_prompts_file

            prompts += read_prompts_file(args.prompts_file)
        if args.captions and prompts:
            parser.error("give --captions or prompts, not both")
        request = GenerateRequest(
            model=args.model,
            captions=args.captions,
            prompts=prompts,
            text_encoder=args.text_encoder,
            out=args.out,
            caption_column=args.caption_column,
            rows=args.rows,
            samples_per_caption=args.samples_per_caption,
            sampler=args.sampler,
            steps=args.steps,
            guidance_scale=args.guidance_scale,
            guidance_rescale=args.guidance_rescale,
            seed=args.seed,
            vae=args.vae,
            weights=args.weights,
            preview=args.preview,
            batch_size=args.batch_size,
            height=args.height,
            width=args.width,
        )
        written = generate(request)
    except (*REPORTED, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_code(e) if isinstance(e, REPORTED) else 2
    for note in request.notes:
        log.info(f"note: {note}")
    for line in request.results:
        log.info(line)
    for path in written:
        log.info(f"wrote {path}")
    return 0


def _export(args: argparse.Namespace) -> None:
    """generate.py --export-to: the model as a diffusers pipeline (sdtrain.artifacts.export)."""
    from sdtrain.artifacts.export import write_export
    from sdtrain.artifacts.loading import load_model

    loaded = load_model(args.model, args.weights)
    write_export(loaded, args.export_to, args.base_model)
    log.info(f"exported {loaded.weights} weights of step {loaded.global_step} to {args.export_to}")
