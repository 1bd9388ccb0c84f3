"""Captions stored as embeddings or as token ids (issue #27): what each costs in storage, in the data path and in
the training step.

- Bytes per row: shards written by the preprocessing job's own table writer (sdtrain.preprocess.outputs, zstd, row
  groups of 64) for output.captions = embeddings, token_ids and both, with the tiny test shapes (77 x 32 captions,
  4x16x16 latents) and SD 2's (77 x 1024 captions from an OpenCLIP-H-shaped text encoder with random weights,
  tests/support/tiny_models.py.sd2_shaped_encoders; 4x32x32 latents of 256 px), captions the length of LAION's;
  then storage per billion rows.
- Rows/s of the data path: the training read tasks (``WindowReader`` -> ``WindowRead.read``, the code a Ray Data
  read task runs) over a local file of SD 2-shaped rows in each mode.
- The in-step encoding: FLOPs of the text encoder's forward over the UNet's forward + backward per sample for the
  ``small`` and ``sd2-base`` presets (FlopCounterMode on the meta device, sdtrain.model.flops), and measured CPU
  step time of the tiny UNet with embeddings against token ids encoded in the step (real Lightning fits).

    python bench/caption_modes.py            # minutes
    python bench/caption_modes.py --smoke    # seconds: fewer rows, steps and fits (CI)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # support.tiny_models
import benchlib  # noqa: E402

MODES = {
    "embeddings": {"latents": "image_latents_256", "embeddings": "caption_latents"},
    "token_ids": {"latents": "image_latents_256", "token_ids": "caption_ids"},
    "both": {"latents": "image_latents_256", "embeddings": "caption_latents", "token_ids": "caption_ids"},
}
WORDS = "a photograph of a red fox in the snow at dusk near an old wooden barn with mountains behind it".split()


def captions(n: int, seed: int = 0) -> list[str]:
    """LAION-like captions: 5 to 18 words (its median caption is ~10 words)."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(5, 19))) for _ in range(n)]


def encoded_rows(tokenizer, text_encoder, latent_shape, n: int) -> list[dict]:
    """``n`` rows as the encode stage makes them: float16 latents (random: a VAE's latents do not compress either),
    the text encoder's float16 embeddings and the tokenizer's int32 ids of the same captions."""
    from sdtrain.model.encoders import encode_prompts, tokenize

    texts = captions(n)
    rng = np.random.default_rng(1)
    rows = []
    for start in range(0, n, 8):
        batch = texts[start : start + 8]
        embeddings = encode_prompts(tokenizer, text_encoder, batch).flatten(1).numpy().astype(np.float16)
        ids = tokenize(tokenizer, batch).input_ids.numpy().astype(np.int32)
        for i, text in enumerate(batch):
            latents = rng.standard_normal(int(np.prod(latent_shape))).astype(np.float16)
            rows.append(
                {"latents": latents, "embeddings": embeddings[i], "token_ids": ids[i], "caption": text, "key": text}
            )
    return rows


def write_mode(directory: Path, name: str, mode: str, rows: list[dict], metadata: dict[str, str]) -> Path:
    from sdtrain.preprocess.outputs import parquet_bytes, shard_table

    path = directory / f"{name}-{mode}.parquet"
    path.write_bytes(parquet_bytes(shard_table(rows, MODES[mode], metadata), 64))
    return path


def column_bytes(path: Path) -> dict[str, int]:
    """Compressed bytes of each column of a parquet file."""
    meta = pq.ParquetFile(path).metadata
    sizes: dict[str, int] = {}
    for group in range(meta.num_row_groups):
        for c in range(meta.num_columns):
            column = meta.row_group(group).column(c)
            sizes[column.path_in_schema.split(".")[0]] = (
                sizes.get(column.path_in_schema.split(".")[0], 0) + column.total_compressed_size
            )
    return sizes


def storage(name: str, tokenizer, text_encoder, latent_shape, n: int, out: Path) -> dict[str, float]:
    """Bytes per row of each mode's whole file, and of the caption column alone."""
    from sdtrain.data.metadata import TEXT_ENCODER_SOURCE, TOKEN_VOCAB_SIZE

    rows = encoded_rows(tokenizer, text_encoder, latent_shape, n)
    metadata = {TEXT_ENCODER_SOURCE: name, TOKEN_VOCAB_SIZE: str(len(tokenizer))}
    per_row = {}
    for mode in MODES:
        path = write_mode(out, name, mode, rows, metadata)
        columns = column_bytes(path)
        per_row[mode] = path.stat().st_size / n
        caption = sum(v for k, v in columns.items() if k in ("caption_latents", "caption_ids")) / n
        print(
            f"{name:>6} {mode:>10}: {per_row[mode]:>10.0f} B/row in all, captions {caption:>9.0f} B/row, latents "
            f"{columns['image_latents_256'] / n:>6.0f} B/row; per 1e9 rows {per_row[mode] * 1e9 / 1e12:>8.2f} TB",
            flush=True,
        )
    return per_row


def data_path_rows_per_s(out: Path, n: int, repeats: int) -> dict[str, float]:
    """Rows/s of the training read tasks over one file of SD 2-shaped rows (random values) in each mode."""
    from sdtrain.config.schema import DataConfig
    from sdtrain.data.inspection import DatasetSpec
    from sdtrain.data.metadata import TokenIds
    from sdtrain.data.read_order import DataState, SamplePlan, files_digest
    from sdtrain.data.streams import WindowReader

    rng = np.random.default_rng(2)
    rows = [
        {
            "latents": rng.standard_normal(4 * 32 * 32).astype(np.float16),
            "embeddings": rng.standard_normal(77 * 1024).astype(np.float16),
            "token_ids": rng.integers(0, 49408, 77).astype(np.int32),
            "caption": "",
            "key": str(i),
        }
        for i in range(n)
    ]
    rates = {}
    for mode, column, shape in (("embeddings", "caption_latents", (77, 1024)), ("token_ids", "caption_ids", (77,))):
        path = write_mode(out, "read", mode, rows, {})
        token_ids = TokenIds("sd2", 49408, (column,)) if mode == "token_ids" else None
        spec = DatasetSpec((str(path),), (n,), (4, 32, 32), shape, token_ids=token_ids)
        data = DataConfig(train=[str(path)], caption_column=column, shuffle_chunk_rows=64, shuffle_window_rows=512)
        plan = SamplePlan(spec.rows_per_file, 0, 64, 512, files_digest(spec.files))
        reader = WindowReader(spec, data, plan)
        (stretch,) = plan.rank_stretches(DataState(), 1, 64, n // 64)[0]
        windows = plan.windows(stretch)
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            read = sum(reader.read(window).num_rows for window in windows)
            best = min(best, time.perf_counter() - started)
        rates[mode] = read / best
        print(f"data path {mode:>10}: {rates[mode]:>9.0f} rows/s ({read} rows, best of {repeats})", flush=True)
    return rates


def encoder_flops_share() -> dict[str, float]:
    """Text encoder forward FLOPs over UNet train-step FLOPs, per sample, for the presets of SD 2's width (1024: its
    OpenCLIP-H text encoder)."""
    from support.tiny_models import sd2_text_encoder_config

    from sdtrain.config.loader import load_config
    from sdtrain.model.flops import text_encoder_forward_flops, unet_train_step_flops
    from sdtrain.model.unet import unet_config

    shares = {}
    for preset in ("small", "sd2-base"):
        unet = unet_config(load_config(None, ["data.train=/unused", f"model.preset={preset}"]).model)
        side = unet["sample_size"]
        width = unet["cross_attention_dim"]
        step = unet_train_step_flops(unet, (unet["in_channels"], side, side), (77, width))
        if width != 1024:
            raise SystemExit(f"{preset}: cross_attention_dim {width}; this benchmark knows SD 2's encoder (1024)")
        text = text_encoder_forward_flops(sd2_text_encoder_config())
        shares[preset] = text / step
        print(
            f"FLOPs per sample {preset:>8} ({side * 8} px): text encoder forward {text / 1e9:7.1f} G, UNet "
            f"forward+backward {step / 1e9:8.1f} G",
            flush=True,
        )
    return shares


def step_times(out: Path, steps: int, rounds: int = 2) -> dict[str, float]:
    """Median step time of the tiny UNet on CPU, batch 8: stored embeddings against ids encoded in the step by the
    tiny test text encoder (2 layers, 32 wide), each mode fitted ``rounds`` times in turn (the last fit's)."""
    import logging

    import lightning.pytorch as pl
    from support.tiny_models import write_tiny_sd_model

    from sdtrain.config.loader import load_config
    from sdtrain.train.build import checkpoint_meta, fit_without_ray

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # after Lightning's import: no start-up chatter
    model = write_tiny_sd_model(str(out / "tiny-sd"))

    class Clock(pl.Callback):
        def __init__(self):
            self.times: list[float] = []

        def on_train_batch_start(self, *args):
            self.started = time.perf_counter()

        def on_train_batch_end(self, *args):
            self.times.append(time.perf_counter() - self.started)

    g = torch.Generator().manual_seed(0)
    latents = torch.randn(8, 4, 16, 16, generator=g)
    ids = torch.randint(0, 300, (8, 77), generator=g)
    data = {"embeddings": torch.randn(8, 77, 32, generator=g), "token_ids": ids}
    medians = {}
    for mode in ("embeddings", "token_ids") * rounds:  # twice each by default: the second is warm
        cfg = load_config(
            None,
            [
                "model.preset=tiny",
                "data.train=/unused",
                f"train.max_steps={steps}",
                "train.global_batch_size=8",
                "scaling.use_gpu=false",
            ],
        )
        meta = checkpoint_meta(cfg, (4, 16, 16), (77, 32), text_encoder=model if mode == "token_ids" else None)
        clock = Clock()
        fit_without_ray(
            cfg, [{"latents": latents, "captions": data[mode]}] * steps, meta, use_gpu=False, callbacks=[clock]
        )
        medians[mode] = float(np.median(clock.times[1:]))
    for mode, seconds in medians.items():
        print(f"tiny UNet step on CPU, batch 8, {mode:>10}: {seconds * 1e3:7.1f} ms (median of {steps - 1})")
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="few rows and steps: checks that it runs")
    args = parser.parse_args()
    print(f"# {benchlib.machine()}\n# {benchlib.versions()}\n# commit {benchlib.git_commit()}", flush=True)
    from support.tiny_models import sd2_shaped_encoders, write_tiny_sd_model
    from transformers import CLIPTextModel

    from sdtrain.model.encoders import load_text_encoder

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        tiny = write_tiny_sd_model(str(out / "tiny"))
        tiny_tokenizer, tiny_encoder = load_text_encoder(tiny)
        tiny_rows = storage("tiny", tiny_tokenizer, tiny_encoder, (4, 16, 16), 64 if args.smoke else 1024, out)
        sd2_tokenizer, sd2_encoder, _ = sd2_shaped_encoders(str(out / "sd2-tokenizer"))
        assert isinstance(sd2_encoder, CLIPTextModel)
        sd2_rows = storage("sd2", sd2_tokenizer, sd2_encoder, (4, 32, 32), 1 if args.smoke else 64, out)
        rates = data_path_rows_per_s(out, 128 if args.smoke else 4096, 1 if args.smoke else 3)
        shares = encoder_flops_share()
        times = step_times(out, 3 if args.smoke else 40, 1 if args.smoke else 2)
    print(
        benchlib.ratio_line(
            "bytes_per_row_token_ids_tiny", tiny_rows["token_ids"], "embeddings", tiny_rows["embeddings"]
        )
    )
    print(
        benchlib.ratio_line(
            "bytes_per_row_token_ids_sd2_256px",
            sd2_rows["token_ids"],
            "embeddings",
            sd2_rows["embeddings"],
            "<= 0.1",
            sd2_rows["token_ids"] / sd2_rows["embeddings"] <= 0.1,
        )
    )
    print(benchlib.ratio_line("bytes_per_row_both_sd2_256px", sd2_rows["both"], "embeddings", sd2_rows["embeddings"]))
    print(benchlib.ratio_line("data_path_rows_per_s_token_ids", rates["token_ids"], "embeddings", rates["embeddings"]))
    for preset, share in shares.items():
        print(benchlib.ratio_line(f"text_encoder_forward_flops_{preset}", share, "unet_train_step_flops", 1.0))
    print(benchlib.ratio_line("tiny_step_s_token_ids", times["token_ids"], "embeddings", times["embeddings"]))


if __name__ == "__main__":
    main()
