"""An export's model card (README.md) and the sample grid it shows: the latest grid training drew at or before the
exported step, else one the exported pipeline renders from the first captions of the run's data."""

from __future__ import annotations

import io
import json
import posixpath
from typing import Any

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from sdtrain import __version__
from sdtrain.artifacts.loading import LoadedModel
from sdtrain.artifacts.pipelines import STABLE_DIFFUSION_XL, PipelineKind
from sdtrain.data.metadata import EncoderSources
from sdtrain.data.parquet_files import resolve_parquet_files
from sdtrain.errors import SdtrainError
from sdtrain.model.unet import default_guidance_rescale
from sdtrain.storage.filesystems import filesystem_for
from sdtrain.storage.run_layout import (
    EXPORT_INFO_FILE,
    EXPORT_SAMPLE_GRID_FILE,
    HISTORY_FILE,
    SAMPLE_GRID_STEP,
    SAMPLES_DIR,
    UNCONDITIONAL_FILE,
)

# sdtrain.train.sample_grids writes run_dir/samples/step_<N>.png (this layer cannot import it).
# A grid rendered at export (the run drew none): this many captions of the data, sampled in this many steps.
RENDER_PROMPTS = 4
RENDER_STEPS = 20
TRAINED_AS_KEY = "trained_as"
"""The key of EXPORT_INFO_FILE under which an export keeps what its card says of the training (:func:`trained_as`):
an export's or registry version's model has no run config, and a card written from it would otherwise lose it."""
_RECIPE_KEYS = ("lr", "global_batch_size", "snr_gamma", "caption_dropout_prob", "ema_decay")


def trained_as(loaded: LoadedModel) -> dict[str, Any] | None:
    """How the model was trained, as its card says: ``pretrained`` (model.pretrained), ``data`` (data.train),
    ``recipe`` (train keys) and ``guidance_scale`` (sample_grid's). From the run's config; for an export or registry
    version, from what its EXPORT_INFO_FILE recorded; None where that records nothing (written before it did)."""
    if loaded.meta is not None:
        config = loaded.meta.config
        train, data = config.get("train", {}), config.get("data", {}).get("train") or []
        return {
            "pretrained": config.get("model", {}).get("pretrained"),
            "data": [data] if isinstance(data, str) else list(data),
            "recipe": {key: train[key] for key in _RECIPE_KEYS if train.get(key) is not None},
            "guidance_scale": config.get("sample_grid", {}).get("guidance_scale"),
        }
    fs, root = filesystem_for(loaded.source)
    path = posixpath.join(root, EXPORT_INFO_FILE)
    if not _is_file(fs, path):
        return None
    with fs.open_input_stream(path) as f:
        recorded = json.loads(f.read()).get(TRAINED_AS_KEY)
    return recorded if isinstance(recorded, dict) else None


def training_grid(loaded: LoadedModel) -> tuple[bytes, str] | None:
    """(PNG, what it shows) of the latest sample grid drawn at or before the model's step: run_dir/samples/ of its
    checkpoint, or the grid of the export it was loaded from; None if there is none.

    Args:
        loaded: a model from :func:`sdtrain.artifacts.loading.load_model`.
    """
    fs, root = filesystem_for(loaded.source)
    if loaded.meta is None:  # an export: keep its grid
        path = posixpath.join(root, EXPORT_SAMPLE_GRID_FILE)
        if not _is_file(fs, path):
            return None
        with fs.open_input_stream(path) as f:
            return f.read(), f"The sample grid of the export this one was written from (`{loaded.source}`)."
    checkpoint_dir = posixpath.dirname(root) if _is_file(fs, root) else root.rstrip("/")
    samples = posixpath.join(posixpath.dirname(checkpoint_dir), SAMPLES_DIR)
    steps = {}
    for info in fs.get_file_info(pafs.FileSelector(samples, allow_not_found=True)):
        match = SAMPLE_GRID_STEP.fullmatch(posixpath.basename(info.path))
        if match and info.type == pafs.FileType.File:
            steps[int(match.group(1))] = info.path
    # A grid drawn after the exported step shows other weights.
    usable = [step for step in steps if loaded.global_step is None or step <= loaded.global_step]
    if not usable:
        return None
    step = max(usable)
    with fs.open_input_stream(steps[step]) as f:
        data = f.read()
    return data, (
        f"The sample grid training drew at step {step} (`samples/step_{step}.png` of the run: a row per caption of "
        "sample_grid.captions, a column per seed; the latents' first three channels as colours, not decoded)."
    )


def sampling_guidance(loaded: LoadedModel, kind: PipelineKind) -> dict[str, Any]:
    """The pipeline's call arguments that guide as training's sampling and generate.py do: a Stable Diffusion pipeline
    guides against its text encoder's output for "" where the model trained on its own empty prompt (zeros, by
    default), while SDXL's has force_zeros_for_empty_prompt; a zero-terminal-SNR model samples with guidance rescale;
    the scale is sample_grid's (the pipeline's default, 7.5, is not what training's grids showed)."""
    arguments: dict[str, Any] = {}
    scale = (trained_as(loaded) or {}).get("guidance_scale")
    if scale is not None:
        arguments["guidance_scale"] = scale
    if kind is not STABLE_DIFFUSION_XL and loaded.unconditional_caption is not None:
        arguments["negative_prompt_embeds"] = loaded.unconditional_caption.float()[None]
    rescale = default_guidance_rescale(dict(loaded.noise_scheduler.config))
    if rescale:
        arguments["guidance_rescale"] = rescale
    return arguments


def _usage(guidance: dict[str, Any], kind: PipelineKind) -> list[str]:
    """The model card's lines on calling the pipeline with ``guidance`` (:func:`sampling_guidance`)."""
    sdxl = kind is STABLE_DIFFUSION_XL
    if not guidance and not sdxl:
        return []
    code = ["import numpy as np, torch", "from diffusers import DiffusionPipeline", "", 'path = "."  # this directory']
    # diffusers writes no add_watermarker into model_index.json: only the loading call can keep the watermark off.
    code.append(f"pipe = DiffusionPipeline.from_pretrained(path{', add_watermarker=False' if sdxl else ''})")
    code.append('prompts = ["a red fox", "a blue bird"]')
    call = ["prompts"]
    if "negative_prompt_embeds" in guidance:
        # A row per prompt: the pipeline concatenates it with the prompts' embeddings, batch by batch.
        load = f'np.load(f"{{path}}/{UNCONDITIONAL_FILE}")'
        code.append(f"empty = torch.from_numpy({load})[None].expand(len(prompts), -1, -1)")
        call.append("negative_prompt_embeds=empty")
    call += [f"{key}={guidance[key]}" for key in ("guidance_scale", "guidance_rescale") if key in guidance]
    code.append(f"images = pipe({', '.join(call)}).images")
    why = ["Sample as training did"]
    if "guidance_scale" in guidance:
        why.append("at its sample grids' guidance scale")
    if "negative_prompt_embeds" in guidance:
        why.append(
            f'guiding against the empty prompt it trained with (`{UNCONDITIONAL_FILE}`; the pipeline would encode "")'
        )
    if "guidance_rescale" in guidance:
        why.append("with guidance rescale (a zero-terminal-SNR schedule)")
    if sdxl:
        why.append("without the invisible watermark (diffusers does not record that it is off)")
    return ["", ", ".join(why) + ":", "", "```python", *code, "```"]


def render_grid(loaded: LoadedModel, pipeline: Any, guidance: dict[str, Any]) -> tuple[bytes, str] | None:
    """A row of images this pipeline draws for the first captions of the run's data (seed 0), guided by
    ``guidance`` (:func:`sampling_guidance`); None without captions."""
    import torch
    from PIL import Image

    prompts = _data_captions(loaded, RENDER_PROMPTS)
    if not prompts:
        return None
    # The size it trained at: the square (the UNet's sample_size, set by the export), else its latents' own.
    latents = loaded.latent_shape
    trained = latents[-2:] if latents and latents[-2] != latents[-1] and not loaded.bucket_shapes else None
    height, width = trained or (pipeline.unet.config.sample_size,) * 2
    images = pipeline(
        prompts,
        num_inference_steps=RENDER_STEPS,
        height=height * pipeline.vae_scale_factor,
        width=width * pipeline.vae_scale_factor,
        generator=torch.Generator().manual_seed(0),
        output_type="pil",
        **{
            key: value.expand(len(prompts), -1, -1) if key == "negative_prompt_embeds" else value
            for key, value in guidance.items()
        },
    ).images
    canvas = Image.new("RGB", (len(images) * (images[0].width + 2) + 2, images[0].height + 4), "white")
    for i, image in enumerate(images):
        canvas.paste(image, (2 + i * (image.width + 2), 2))
    buffer = io.BytesIO()
    canvas.save(buffer, format="PNG")
    listed = "; ".join(f"{i + 1}. {p}" for i, p in enumerate(prompts))
    return buffer.getvalue(), (
        f"Rendered at export by this pipeline ({RENDER_STEPS} steps, seed 0), left to right, for the first captions "
        f"of the training data (the run drew no sample grid): {listed}"
    )


def _data_captions(loaded: LoadedModel, n: int) -> list[str]:
    """Up to ``n`` distinct captions from the first data.train file's ``caption`` column (the preprocessing job
    writes one)."""
    train = loaded.meta.config.get("data", {}).get("train") if loaded.meta is not None else None
    try:
        files = resolve_parquet_files(list(train or []), "data.train")[:1]
        captions: list[str] = []
        for file in files:
            fs, path = filesystem_for(file)
            with fs.open_input_file(path) as handle:
                reader = pq.ParquetFile(handle)
                if "caption" not in reader.schema_arrow.names:
                    return []
                for batch in reader.iter_batches(batch_size=256, columns=["caption"]):
                    for caption in batch.column(0).to_pylist():
                        if caption and caption not in captions:
                            captions.append(caption)
                    if len(captions) >= n:
                        break
        return captions[:n]
    except (SdtrainError, OSError):  # the data moved or is not reachable from here: no grid
        return []


def write_model_card(
    loaded: LoadedModel,
    sources: EncoderSources,
    path: str,
    grid: str | None,
    guidance: dict[str, Any],
    kind: PipelineKind,
) -> None:
    from diffusers.utils.hub_utils import MODEL_CARD_TEMPLATE_PATH, populate_model_card
    from huggingface_hub import ModelCard, ModelCardData

    record = trained_as(loaded)
    # The prediction type is the scheduler's (its own line): the config's may be unset, meaning model.pretrained's.
    recipe = ", ".join(f"{key}={value}" for key, value in (record or {}).get("recipe", {}).items())
    pretrained = (record or {}).get("pretrained")
    origin = f"fine-tuned from `{pretrained}`" if pretrained else "trained from scratch"
    if record is None:  # an export written before exports recorded it: from scratch or not is unknown
        origin = "(origin not recorded) trained"
    lines = [
        f"A Stable Diffusion UNet {origin} with sdtrain {__version__}, step {loaded.global_step} "
        f"({loaded.weights} weights), in a pipeline with the VAE of `{sources.vae}` and the text encoder of "
        f"`{sources.text_encoder}`.",
        "",
        f"- Data: {', '.join((record or {}).get('data', [])) or 'not recorded'}",
        f"- Latents {list(loaded.latent_shape or [])}, captions {list(loaded.caption_shape or [])}, "
        f"latent scaling factor {loaded.latent_scaling_factor}",
        *(
            [f"- Aspect-ratio buckets (latents): {', '.join('x'.join(map(str, b[1:])) for b in loaded.bucket_shapes)}"]
            if loaded.bucket_shapes
            else []
        ),
        f"- Prediction type: {loaded.noise_scheduler.config.prediction_type}; recipe: {recipe or 'not recorded'}",
        f"- Final losses: {_final_losses(loaded.source) or 'not recorded'}",
        f"- Source checkpoint: `{loaded.source}`",
    ]
    lines += _usage(guidance, kind)
    if grid is not None:
        lines += ["", f"![Samples]({EXPORT_SAMPLE_GRID_FILE})", "", grid]
    # diffusers' training-script card, from its template: load_or_create_model_card would first look the
    # card up on the Hub, which an export must not depend on.
    card = ModelCard.from_template(
        card_data=ModelCardData(license="other", library_name="diffusers", inference=True),
        template_path=str(MODEL_CARD_TEMPLATE_PATH),
        model_description="\n".join(lines),
    )
    card = populate_model_card(card, tags=["stable-diffusion", "text-to-image", "sdtrain"])
    card.save(path)


def _final_losses(checkpoint: str) -> str:
    """The last loss and val_loss in the checkpoint's history.json, where there is one."""
    fs, root = filesystem_for(checkpoint)
    if _is_file(fs, root):
        root = posixpath.dirname(root)
    history_path = posixpath.join(root, HISTORY_FILE)
    if not _is_file(fs, history_path):
        return ""
    with fs.open_input_stream(history_path) as f:
        history = json.loads(f.read())
    found = {}
    for row in history if isinstance(history, list) else []:
        for key in ("loss", "val_loss"):
            if isinstance(row, dict) and isinstance(row.get(key), (int, float)):
                found[key] = row[key]
    return ", ".join(f"{key} {value:.4f}" for key, value in found.items())


def _is_file(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type == pafs.FileType.File
