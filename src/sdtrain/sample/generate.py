"""Sampling from a trained model: latents with a fast scheduler and classifier-free guidance,
decoded to images with a VAE when one is given, else saved with a latent preview.

The sampling loop is StableDiffusionPipeline's (initial noise ``randn * init_noise_sigma`` from
one seeded CPU generator, conditional and unconditional halves in one batch, guidance
``uncond + scale * (cond - uncond)``), so a model exported by sdtrain gives the same latents here
and inside a diffusers pipeline.
"""

from __future__ import annotations

import json
import os
import posixpath
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pyarrow.fs as pafs
import torch
from diffusers import DDIMScheduler, DPMSolverMultistepScheduler, UNet2DConditionModel

from sdtrain.artifacts.checkpoint_format import CHECKPOINT_FILE
from sdtrain.artifacts.export import is_export, load_export
from sdtrain.artifacts.loading import LoadedModel, Weights, load_checkpoint
from sdtrain.data.parquet_files import resolve_parquet_files
from sdtrain.errors import DataError, SdtrainError
from sdtrain.storage.filesystems import filesystem_for, ray_storage, uri_for

SAMPLERS = ("ddim", "dpm")
LATENTS_FILE = "latents.npy"
PREVIEW_FILE = "preview.png"
GRID_FILE = "grid.png"
INFO_FILE = "generate.json"
DEMO_ACCURACY_FILE = "demo_accuracy.json"


# --- model ------------------------------------------------------------------------------


def load_for_sampling(path: str, weights: Weights = "auto") -> LoadedModel:
    """A model from an export directory, a checkpoint (directory or checkpoint.ckpt) or a run
    directory (its latest reported checkpoint); local or a storage URI."""
    fs, fs_path = filesystem_for(path)
    info = fs.get_file_info(fs_path)
    if info.type == pafs.FileType.NotFound:
        raise SdtrainError(f"model: {path} does not exist")
    if (
        info.type == pafs.FileType.File
        or fs.get_file_info(posixpath.join(fs_path, CHECKPOINT_FILE)).type == pafs.FileType.File
    ):
        return load_checkpoint(path, weights)
    if is_export(path):
        if weights == "raw":
            raise SdtrainError(
                f"model: {path} is an export, which holds one set of weights; --weights raw needs a checkpoint"
            )
        return load_export(path)
    from ray.train import Result

    storage_filesystem, run_path = ray_storage(path)
    try:
        checkpoint = Result.from_path(run_path, storage_filesystem=storage_filesystem).checkpoint
    except Exception as e:  # not a run directory
        raise SdtrainError(
            f"model: {path} is neither an export (unet/config.json), a checkpoint ({CHECKPOINT_FILE}) nor a run "
            f"directory with a reported checkpoint ({e})"
        ) from None
    if checkpoint is None:
        raise SdtrainError(f"model: the run {path} has reported no checkpoint yet")
    return load_checkpoint(uri_for(checkpoint.filesystem, checkpoint.path), weights)


# --- captions ---------------------------------------------------------------------------


@dataclass
class Captions:
    embeddings: torch.Tensor  # (R, L, D)
    names: list[str]  # one per row of the grid
    labels: list[Any] | None = None


def read_captions(path: str, caption_dim: int, column: str = "caption_latents", rows: int = 8) -> Captions:
    """Caption embeddings from a .npy file ((L, D) or (R, L, D)), or from parquet (a file, directory
    or glob): one row per distinct ``label`` when the data has that column (the demo), else the first ``rows``."""
    if path.endswith(".npy"):
        fs, fs_path = filesystem_for(path)
        with fs.open_input_file(fs_path) as f:
            array = np.load(f, allow_pickle=False)
        if array.ndim == 2:
            array = array[None]
        if array.ndim != 3 or array.shape[-1] != caption_dim:
            raise DataError(
                f"--captions: {path} holds shape {array.shape}; expected (L, {caption_dim}) or (N, L, {caption_dim})"
            )
        return Captions(torch.from_numpy(array.astype(np.float32)), [f"caption {i}" for i in range(len(array))])

    import pyarrow as pa
    import pyarrow.parquet as pq

    from sdtrain.data.decode import to_array

    tables = []
    for file in resolve_parquet_files([path], "--captions"):
        fs, fs_path = filesystem_for(file)
        with fs.open_input_file(fs_path) as f:
            schema = pq.read_schema(f)
            if column not in schema.names:
                raise DataError(
                    f"--captions: {file} has no column {column!r}; its columns are {', '.join(schema.names)} "
                    f"(see --caption-column)"
                )
            tables.append(pq.read_table(f, columns=[column] + (["label"] if "label" in schema.names else [])))
    table = pa.concat_tables(tables)
    if "label" in table.column_names:
        labels = table.column("label").to_pylist()
        first = {}
        for i, label in enumerate(labels):
            first.setdefault(label, i)
        order = sorted(first)
        table = table.take([first[label] for label in order])
        names = [f"label {label}" for label in order]
    else:
        order = None
        table = table.slice(0, rows)
        names = [f"row {i}" for i in range(table.num_rows)]
    width = table.column(column).combine_chunks()
    first_row = width.storage[0] if isinstance(width, pa.ExtensionArray) else width[0]
    length = len(first_row.values) if hasattr(first_row, "values") else len(first_row)
    if length % caption_dim:
        raise DataError(
            f"--captions: column {column!r} has {length} values a row, not a multiple of the UNet's "
            f"cross_attention_dim {caption_dim}"
        )
    embeddings = to_array(table.column(column), (length // caption_dim, caption_dim), column).astype(np.float32)
    return Captions(torch.from_numpy(embeddings), names, order)


# --- sampling ---------------------------------------------------------------------------


def make_sampler(noise_scheduler_config: dict[str, Any], name: Literal["ddim", "dpm"], steps: int):
    """DDIM or DPM-Solver++ (multistep) on the training schedule (same betas and prediction type),
    with DDIM's ``clip_sample`` off even if the stored config has it on: it would clip each predicted
    latent to [-1, 1], which wrecks samples."""
    cls = {"ddim": DDIMScheduler, "dpm": DPMSolverMultistepScheduler}[name]
    scheduler = cls.from_config({**noise_scheduler_config, "clip_sample": False})
    scheduler.set_timesteps(steps)
    return scheduler


def guided_prediction(
    unet: UNet2DConditionModel, latents: torch.Tensor, t, cond: torch.Tensor, uncond: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Classifier-free guidance: uncond + scale * (cond - uncond); at scale 1, the conditional prediction itself."""
    if scale == 1.0 or uncond is None:
        return unet(latents, t, encoder_hidden_states=cond).sample
    out = unet(torch.cat([latents, latents]), t, encoder_hidden_states=torch.cat([uncond, cond])).sample
    pred_uncond, pred_cond = out.chunk(2)
    return pred_uncond + scale * (pred_cond - pred_uncond)


@torch.no_grad()
def sample_latents(
    unet: UNet2DConditionModel,
    noise_scheduler_config: dict[str, Any],
    captions: torch.Tensor,
    unconditional: torch.Tensor | None,
    latent_shape: tuple[int, int, int],
    *,
    sampler: Literal["ddim", "dpm"] = "ddim",
    steps: int = 25,
    guidance_scale: float = 3.0,
    seed: int = 0,
    batch_size: int = 64,
) -> torch.Tensor:
    """One sample per row of ``captions`` (N, L, D): (N, C, H, W) latents in the model's space."""
    device = next(unet.parameters()).device
    dtype = next(unet.parameters()).dtype
    scheduler = make_sampler(noise_scheduler_config, sampler, steps)
    generator = torch.Generator().manual_seed(seed)
    # All the initial noise first, from one CPU generator: the result does not depend on batch_size or device.
    noise = torch.randn((len(captions), *latent_shape), generator=generator, dtype=dtype) * scheduler.init_noise_sigma
    out = []
    for start in range(0, len(captions), batch_size):
        scheduler = make_sampler(noise_scheduler_config, sampler, steps)  # multistep solvers keep state
        latents = noise[start : start + batch_size].to(device)
        cond = captions[start : start + batch_size].to(device, dtype)
        uncond = None if unconditional is None else unconditional.to(device, dtype).expand_as(cond)
        for t in scheduler.timesteps:
            model_input = scheduler.scale_model_input(latents, t)
            prediction = guided_prediction(unet, model_input, t, cond, uncond, guidance_scale)
            latents = scheduler.step(prediction, t, latents, return_dict=False)[0]
        out.append(latents.float().cpu())
    return torch.cat(out)


# --- pictures ---------------------------------------------------------------------------


def digits_preview(latents: np.ndarray) -> np.ndarray:
    """(N, 4, 16, 16) demo latents -> (N, 16, 16) uint8, dark ink on white."""
    from sdtrain.data.demo import digits_from_latents

    ink = np.clip(digits_from_latents(latents) / 16.0, 0, 1)
    return (255 * (1 - ink)).astype(np.uint8)


def channels_preview(latents: np.ndarray) -> np.ndarray:
    """(N, C, H, W) latents -> (N, H, W, 3) uint8: the first three channels as RGB, [-3, 3] mapped to [0, 255]
    (SD latents, scaled by 0.18215, have roughly unit variance)."""
    rgb = latents[:, :3] if latents.shape[1] >= 3 else np.repeat(latents[:, :1], 3, axis=1)
    return (255 * np.clip((rgb + 3) / 6, 0, 1)).transpose(0, 2, 3, 1).astype(np.uint8)


def grid_image(tiles: np.ndarray, names: list[str], zoom: int = 1):
    """(R, K, H, W[, 3]) uint8 tiles -> one PIL image, a row per caption with its name on the left."""
    from PIL import Image, ImageDraw

    rows, cols, h, w = tiles.shape[:4]
    h, w = h * zoom, w * zoom
    pad, margin = 2, 60
    canvas = Image.new("RGB", (margin + cols * (w + pad) + pad, rows * (h + pad) + pad), "white")
    draw = ImageDraw.Draw(canvas)
    for r in range(rows):
        draw.text((4, pad + r * (h + pad) + h // 2 - 5), names[r][:9], fill="black")
        for k in range(cols):
            tile = Image.fromarray(tiles[r, k]).convert("RGB").resize((w, h), Image.NEAREST)
            canvas.paste(tile, (margin + pad + k * (w + pad), pad + r * (h + pad)))
    return canvas


def load_vae(vae: str):
    from diffusers import AutoencoderKL

    root = os.path.expanduser(vae)
    if os.path.isdir(root):
        return AutoencoderKL.from_pretrained(
            root, subfolder="vae" if os.path.isdir(os.path.join(root, "vae")) else None
        )
    return AutoencoderKL.from_pretrained(vae, subfolder="vae")  # a hub id: a pipeline's vae/ (needs network)


@torch.no_grad()
def decode(vae, latents: torch.Tensor, scaling_factor: float, batch_size: int = 8) -> np.ndarray:
    """Model-space latents -> (N, H, W, 3) uint8 images: divided by the scaling factor once, then decoded."""
    device = next(vae.parameters()).device
    images = []
    for start in range(0, len(latents), batch_size):
        batch = latents[start : start + batch_size].to(device, vae.dtype) / scaling_factor
        images.append(((vae.decode(batch).sample.float().cpu() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8))
    return torch.cat(images).permute(0, 2, 3, 1).numpy()


# --- the whole command ------------------------------------------------------------------


@dataclass
class GenerateRequest:
    model: str
    captions: str
    out: str = "samples"
    caption_column: str = "caption_latents"
    rows: int = 8
    samples_per_caption: int = 8
    sampler: Literal["ddim", "dpm"] = "ddim"
    steps: int = 25
    guidance_scale: float = 3.0
    seed: int = 0
    vae: str | None = None
    weights: Weights = "auto"
    preview: Literal["auto", "digits", "channels"] = "auto"
    batch_size: int = 64
    notes: list[str] = field(default_factory=list)
    results: list[str] = field(default_factory=list)


def generate(request: GenerateRequest) -> list[str]:
    """Sample a grid (a row per caption, ``samples_per_caption`` columns) and write it to ``request.out``.
    Returns the paths written."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = load_for_sampling(request.model, request.weights)
    unet = loaded.unet.to(device).eval()
    meta = loaded.meta
    captions = read_captions(request.captions, unet.config.cross_attention_dim, request.caption_column, request.rows)
    latent_shape = tuple(
        meta.get("latent_shape") or (unet.config.in_channels, unet.config.sample_size, unet.config.sample_size)
    )
    unconditional = loaded.unconditional_caption
    if unconditional is not None and tuple(unconditional.shape) != tuple(captions.embeddings.shape[1:]):
        raise DataError(
            f"--captions: embeddings of shape {tuple(captions.embeddings.shape[1:])}, but the model was trained with "
            f"captions of shape {tuple(unconditional.shape)}"
        )
    if unconditional is None:
        unconditional = torch.zeros(captions.embeddings.shape[1:])
    trained_dropout = meta.get("config", {}).get("train", {}).get("caption_dropout_prob")
    if request.guidance_scale != 1.0 and trained_dropout == 0:
        request.notes.append(
            "the model was trained without caption dropout (train.caption_dropout_prob: 0), so its unconditional "
            "prediction is untrained; guidance may not help (try --guidance-scale 1)"
        )

    k = request.samples_per_caption
    repeated = captions.embeddings.repeat_interleave(k, dim=0)
    latents = sample_latents(
        unet,
        dict(loaded.noise_scheduler.config),
        repeated,
        unconditional,
        latent_shape,
        sampler=request.sampler,
        steps=request.steps,
        guidance_scale=request.guidance_scale,
        seed=request.seed,
        batch_size=request.batch_size,
    )
    os.makedirs(request.out, exist_ok=True)
    written = []
    grid_latents = latents.numpy().reshape(len(captions.names), k, *latent_shape)
    path = os.path.join(request.out, LATENTS_FILE)
    np.save(path, grid_latents)
    written.append(path)

    if request.vae is not None:
        vae = load_vae(request.vae).to(device).eval()
        factor = meta.get("latent_scaling_factor") or vae.config.scaling_factor
        images = decode(vae, latents, factor).reshape(len(captions.names), k, *decode_shape(latents, vae))
        image_dir = os.path.join(request.out, "images")
        os.makedirs(image_dir, exist_ok=True)
        from PIL import Image

        for r in range(images.shape[0]):
            for c in range(k):
                path = os.path.join(image_dir, f"row{r:02d}_sample{c:02d}.png")
                Image.fromarray(images[r, c]).save(path)
                written.append(path)
        path = os.path.join(request.out, GRID_FILE)
        grid_image(images, captions.names).save(path)
        written.append(path)
    else:
        mode = request.preview
        if mode == "auto":
            mode = "digits" if _trained_on_demo(meta) else "channels"
        flat = latents.numpy()
        tiles = digits_preview(flat) if mode == "digits" else channels_preview(flat)
        tiles = tiles.reshape(len(captions.names), k, *tiles.shape[1:])
        path = os.path.join(request.out, PREVIEW_FILE)
        grid_image(tiles, captions.names, zoom=max(1, 64 // latent_shape[-1])).save(path)
        written.append(path)

    labels = demo_labels(meta, captions)
    if labels is not None:
        from sdtrain.data.demo import class_agreement, real_digits_agreement

        accuracy = class_agreement(latents.numpy(), np.repeat(labels, k))
        accuracy = {
            **accuracy,
            "chance": 0.1,
            "real_digits": round(real_digits_agreement(), 4),
            "classifier": (
                "nearest class mean (correlation) of the demo's training digits, on each sample decoded by "
                "demo_data.digits_from_latents; real_digits = its agreement on the real validation digits"
            ),
        }
        path = os.path.join(request.out, DEMO_ACCURACY_FILE)
        with open(path, "w") as f:
            json.dump(accuracy, f, indent=2)
        written.append(path)
        request.results.append(
            f"class agreement {accuracy['class_agreement']:.2f}: {accuracy['agreeing']} of "
            f"{accuracy['samples']} samples "
            f"look like the digit they were conditioned on (nearest class mean; chance 0.10, real digits "
            f"{accuracy['real_digits']:.2f})"
        )

    path = os.path.join(request.out, INFO_FILE)
    with open(path, "w") as f:
        json.dump(
            {
                "model": request.model,
                "weights": meta.get("weights"),
                "global_step": meta.get("global_step"),
                "prediction_type": loaded.noise_scheduler.config.prediction_type,
                "captions": request.captions,
                "rows": captions.names,
                "samples_per_caption": k,
                "sampler": request.sampler,
                "steps": request.steps,
                "guidance_scale": request.guidance_scale,
                "seed": request.seed,
                "vae": request.vae,
                "latents": f"{LATENTS_FILE}: shape {list(grid_latents.shape)} (rows, samples, C, H, W), model space",
            },
            f,
            indent=2,
        )
    written.append(path)
    return written


def _trained_on_demo(meta: dict[str, Any]) -> bool:
    """A checkpoint's meta holds the run config; an export's records ``demo`` itself."""
    return bool(meta.get("demo") or meta.get("config", {}).get("data", {}).get("demo"))


def demo_labels(meta: dict[str, Any], captions: Captions) -> list[int] | None:
    """Each grid row's digit when the model was trained on the digits demo and the captions are the
    demo's own (a ``label`` column of digits, each row's embedding the demo's caption of its
    digit); else None, and there is no class agreement to measure."""
    from sdtrain.data.demo import NUM_CLASSES, class_captions

    if not _trained_on_demo(meta) or captions.labels is None:
        return None
    labels = captions.labels
    if not all(isinstance(label, int) and 0 <= label < NUM_CLASSES for label in labels):
        return None
    expected = class_captions(captions.embeddings.shape[-1])[labels]
    if expected.shape != tuple(captions.embeddings.shape) or not np.allclose(
        captions.embeddings.numpy(), expected, atol=1e-2
    ):
        return None
    return list(labels)


def decode_shape(latents: torch.Tensor, vae) -> tuple[int, int, int]:
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    return (latents.shape[-2] * factor, latents.shape[-1] * factor, 3)


def generate_main(argv=None) -> int:
    """The command line of entrypoints/generate.py; exit code 0 on success, 2 for bad input."""
    import argparse
    import sys

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
        "parquet with a label column gives one row per label",
    )
    parser.add_argument("--out", default="samples", help="output directory (default: %(default)s)")
    parser.add_argument(
        "--caption-column", default="caption_latents", help="parquet column of the embeddings (default: %(default)s)"
    )
    parser.add_argument(
        "--rows", type=int, default=8, help="parquet rows to take when there is no label column (default: %(default)s)"
    )
    parser.add_argument("--samples-per-caption", type=int, default=8, help="grid columns (default: %(default)s)")
    parser.add_argument(
        "--sampler", choices=SAMPLERS, default="ddim", help="ddim or dpm (DPM-Solver++) (default: %(default)s)"
    )
    parser.add_argument("--steps", type=int, default=25, help="sampling steps (default: %(default)s)")
    parser.add_argument(
        "--guidance-scale",
        type=float,
        default=3.0,
        help="classifier-free guidance scale; 1 = none (default: %(default)s)",
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
        choices=("auto", "digits", "channels"),
        default="auto",
        help=(
            "latent preview without a VAE: digits (the demo's inverse), channels (first 3 as RGB); auto = "
            "digits for demo runs"
        ),
    )
    parser.add_argument("--batch-size", type=int, default=64, help="samples per UNet batch (default: %(default)s)")
    parser.add_argument(
        "--export-to",
        metavar="DIR",
        help="instead of sampling: export the model in diffusers format to DIR (local or s3://)",
    )
    args = parser.parse_args(argv)
    for name in ("rows", "samples_per_caption", "steps", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        if args.export_to:
            from sdtrain.artifacts.export import write_export

            loaded = load_for_sampling(args.model, args.weights)
            write_export(loaded, args.export_to, source=args.model)
            print(
                f"[sdtrain] exported {loaded.meta.get('weights')} weights of step "
                f"{loaded.meta.get('global_step')} to {args.export_to}"
            )
            return 0
        if not args.captions:
            parser.error("--captions is required to sample")
        request = GenerateRequest(
            model=args.model,
            captions=args.captions,
            out=args.out,
            caption_column=args.caption_column,
            rows=args.rows,
            samples_per_caption=args.samples_per_caption,
            sampler=args.sampler,
            steps=args.steps,
            guidance_scale=args.guidance_scale,
            seed=args.seed,
            vae=args.vae,
            weights=args.weights,
            preview=args.preview,
            batch_size=args.batch_size,
        )
        written = generate(request)
    except (SdtrainError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for note in request.notes:
        print(f"[sdtrain] note: {note}")
    for line in request.results:
        print(f"[sdtrain] {line}")
    for path in written:
        print(f"[sdtrain] wrote {path}")
    return 0
