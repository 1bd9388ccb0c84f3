"""Captions stored as token ids and encoded in the training step (sdtrain.model.token_captions), against the same
rows stored as embeddings: real preprocessing encoder stage, tiny VAE and CLIP text encoder built from configs,
real Lightning fits on CPU. The Ray path (preprocessing with output.captions=both, training on the ids, validation,
sample grids, generate.py, export) is tests/test_preprocess.py's end-to-end test."""

from __future__ import annotations

import lightning.pytorch as pl
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import tiny_config
from support.datasets import inspect_dataset
from support.tiny_models import write_tiny_sd_model
from support.training import FIT, Watch
from torch.distributed.tensor import DTensor

from sdtrain.artifacts.checkpoint_format import CHECKPOINT_META_KEY
from sdtrain.config.learning import Columns
from sdtrain.data.local_read import iter_local_batches
from sdtrain.data.metadata import LATENT_SCALING_FACTOR, TEXT_ENCODER_SOURCE, TOKEN_VOCAB_SIZE, VAE_SOURCE
from sdtrain.errors import DataError
from sdtrain.model.encoders import load_tokenizer, tokenize
from sdtrain.model.recipe import load_unconditional_caption
from sdtrain.preprocess.encode_stage import Encoder
from sdtrain.preprocess.outputs import shard_table
from sdtrain.train.build import checkpoint_meta, fit_without_ray

ROWS = 12
COLUMNS = {"latents": "image_latents_256", "embeddings": "caption_latents", "token_ids": "caption_ids"}
WORDS = ["fox", "owl", "red barn", "a long caption that runs on " * 6, "", "sea", "tree", "sun", "moon", "x", "y", "z"]


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """ROWS rows stored both ways by the preprocessing encoder stage (output.captions=both) in one parquet file
    (row groups of 4), beside the empty prompt's embedding and ids, as the job writes them."""
    root = tmp_path_factory.mktemp("token-captions")
    model = write_tiny_sd_model(str(root / "tiny-sd"))
    pixels = np.random.default_rng(0).integers(0, 256, (ROWS, 32, 32, 3), dtype=np.uint8)
    batch = {
        "pixels": pixels,
        "caption": np.array(WORDS, object),
        "valid": np.ones(ROWS, bool),
        "key": np.array([str(i) for i in range(ROWS)], object),
    }
    out = Encoder(model, "mean", 0, "float32", 32, captions="both")(batch)
    assert out["token_ids"].dtype == np.int32 and out["token_ids"].shape == (ROWS, 77)
    rows = [{value: out[value][i] for value in COLUMNS} | {"caption": WORDS[i], "key": str(i)} for i in range(ROWS)]
    tokenizer = load_tokenizer(model)
    metadata = {
        LATENT_SCALING_FACTOR: "0.18215",
        VAE_SOURCE: model,
        TEXT_ENCODER_SOURCE: model,
        TOKEN_VOCAB_SIZE: str(len(tokenizer)),
    }
    data = root / "data"
    data.mkdir()
    pq.write_table(shard_table(rows, COLUMNS, metadata), data / "part-00000.parquet", row_group_size=4)
    np.save(root / "unconditional_ids.npy", tokenize(tokenizer, [""]).input_ids[0].numpy().astype(np.int32))
    from sdtrain.model.encoders import encode_prompts, load_text_encoder

    np.save(root / "unconditional.npy", encode_prompts(*load_text_encoder(model), [""])[0].numpy())
    return root, model


def _run_inputs(root, model, column, *overrides):
    cfg = tiny_config(*FIT, f"data.caption_column={column}", *overrides)
    spec = inspect_dataset(
        [str(root / "data" / "part-00000.parquet")], "data.train", Columns("image_latents_256", column), 4, 32
    )
    ids = spec.token_ids is not None
    meta = checkpoint_meta(
        cfg, spec.latent_shape, spec.embedding_shape(32), None, spec.token_ids.text_encoder if ids else None
    )
    unconditional = load_unconditional_caption(
        str(root / ("unconditional_ids.npy" if ids else "unconditional.npy")), meta.caption_shape, token_ids=ids
    )
    return cfg, spec, meta, unconditional


class StepZero(pl.Callback):
    """The validation loss of the weights training starts from, where the fit has put the module."""

    def __init__(self, batches):
        self.batches, self.loss = batches, None

    def on_fit_start(self, trainer, module):
        self.loss = module.validation_loss(self.batches, seed=0)


def test_the_same_rows_as_token_ids_and_as_embeddings_train_and_validate_alike(both):
    """Caption dropout at 0.5, so the empty prompt's ids (encoded) and its stored embedding both play; the stored
    embeddings are float16, which is all that parts the two."""
    root, model = both
    losses, validation = {}, {}
    for column in ("caption_latents", "caption_ids"):
        cfg, spec, meta, unconditional = _run_inputs(
            root, model, column, "train.caption_dropout_prob=0.5", "train.global_batch_size=4"
        )
        assert spec.caption_shape == ((77, 32) if column == "caption_latents" else (77,))
        batches = list(iter_local_batches(spec, cfg.data, 4))
        assert batches[0]["captions"].dtype == (torch.float16 if column == "caption_latents" else torch.int32)
        watch, step_zero = Watch(), StepZero(batches)
        module, trainer = fit_without_ray(
            cfg, batches, meta, use_gpu=False, callbacks=[step_zero, watch], unconditional_caption=unconditional
        )
        validation[column] = step_zero.loss
        losses[column] = [s["loss"] for s in watch.steps]
        assert trainer.global_step == 3
        if column == "caption_ids":
            assert module.caption_encoder is not None and module.checkpoint_meta.text_encoder == model
            assert not any("text_model" in name for name in module.state_dict())  # not in any checkpoint
            params = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
            assert params == {id(p) for p in module.unet.parameters()}
            assert not any(p.requires_grad for p in module.caption_encoder.text_encoder.parameters())
    assert losses["caption_ids"][0] == pytest.approx(losses["caption_latents"][0], rel=1e-3)
    assert validation["caption_ids"] == pytest.approx(validation["caption_latents"], rel=1e-3)
    assert losses["caption_ids"] != losses["caption_latents"]  # computed, not copied: float16 parts them slightly


@pytest.mark.parametrize(
    "options",
    [
        ("train.strategy=fsdp", "train.precision=bf16-mixed", "train.ema_decay=0.9"),
        ("train.gradient_checkpointing=true", "train.channels_last=true", "train.ema_decay=0.9"),
    ],
    ids=["fsdp-bf16-ema", "ddp-checkpointing-channels-last"],
)
def test_token_id_data_trains_under_each_strategy_and_option(both, options, tmp_path):
    root, model = both
    cfg, spec, meta, unconditional = _run_inputs(root, model, "caption_ids", *options)
    batches = list(iter_local_batches(spec, cfg.data, 2))
    watch = Watch()
    module, trainer = fit_without_ray(
        cfg,
        batches,
        meta,
        use_gpu=False,
        callbacks=[watch],
        unconditional_caption=unconditional,
        default_root_dir=str(tmp_path),
    )
    assert trainer.global_step == 3 and all(0 < s["loss"] < 10 for s in watch.steps)
    assert not torch.equal(watch.steps[0]["ema"], watch.steps[-1]["ema"])
    # FSDP shards the UNet; the text encoder is every rank's whole, frozen copy, outside the module.
    assert isinstance(module.unet.conv_in.weight, DTensor) == ("train.strategy=fsdp" in options)
    assert not any(isinstance(p, DTensor) for p in module.caption_encoder.text_encoder.parameters())
    trainer.save_checkpoint(tmp_path / "saved.ckpt")
    saved = torch.load(tmp_path / "saved.ckpt", weights_only=True)
    assert not any("text_model" in key for key in saved["state_dict"])
    assert saved[CHECKPOINT_META_KEY]["text_encoder"] == model


def test_a_text_encoder_of_another_width_or_vocabulary_is_refused_naming_both(both, tmp_path):
    """The driver's data check (sdtrain.driver.data_check.dataset_spec: what every start and the retraining gate run
    before Ray), with the text encoder's config only."""
    from sdtrain.driver.data_check import dataset_spec

    root, model = both

    def check(file, cross_attention_dim=32):
        cfg = tiny_config(f"data.train={file}", "data.caption_column=caption_ids", tmp_path=tmp_path, name="check")
        unet = {"in_channels": 4, "cross_attention_dim": cross_attention_dim}
        return dataset_spec(cfg, "data.train", [str(file)], unet)

    data = root / "data" / "part-00000.parquet"
    assert check(data).token_ids.text_encoder == model
    with pytest.raises(DataError) as wide:
        check(data, cross_attention_dim=64)
    message = str(wide.value)
    assert "output is 32 wide" in message and "cross_attention_dim is 64" in message and model in message
    assert "part-00000.parquet" in message and "caption_ids" in message

    table = pq.read_table(data)
    metadata = dict(table.schema.metadata)
    vocab = int(metadata[TOKEN_VOCAB_SIZE.encode()])
    metadata[TOKEN_VOCAB_SIZE.encode()] = str(vocab + 100).encode()  # ids of a larger tokenizer
    pq.write_table(table.replace_schema_metadata(metadata), tmp_path / "other.parquet")
    with pytest.raises(DataError) as narrow:
        check(tmp_path / "other.parquet")
    message = str(narrow.value)
    assert f"up to {vocab + 99}" in message and f"vocabulary of {vocab}" in message and model in message

    metadata[TOKEN_VOCAB_SIZE.encode()] = b"5"  # the first row's ids do not fit what the file says of them
    pq.write_table(table.replace_schema_metadata(metadata), tmp_path / "small.parquet")
    with pytest.raises(DataError, match=r"small.parquet, column 'caption_ids': the first row holds token ids from"):
        check(tmp_path / "small.parquet")

    del metadata[TOKEN_VOCAB_SIZE.encode()]  # ids that do not say what they are for
    pq.write_table(table.replace_schema_metadata(metadata), tmp_path / "bare.parquet")
    with pytest.raises(DataError, match="bare.parquet, column 'caption_ids' holds integers.*sdtrain.token_vocab_size"):
        check(tmp_path / "bare.parquet")


def test_the_ids_are_the_pipelines_own_and_the_empty_prompt_file_must_fit_the_data(both):
    root, model = both
    tokenizer = load_tokenizer(model)
    stored = pq.read_table(root / "data" / "part-00000.parquet").column("caption_ids").to_pylist()
    # StableDiffusionPipeline.encode_prompt: padding="max_length", max_length=model_max_length, truncation=True.
    expected = tokenizer(WORDS, padding="max_length", max_length=77, truncation=True).input_ids
    assert stored == expected
    with pytest.raises(Exception, match="holds token ids, but the data holds caption embeddings"):
        load_unconditional_caption(str(root / "unconditional_ids.npy"), (77, 32), token_ids=False)
    with pytest.raises(Exception, match=r"holds ids of shape \(77,\), but the dataset's captions are 76 token ids"):
        load_unconditional_caption(str(root / "unconditional_ids.npy"), (76, 32), token_ids=True)


def test_the_retraining_gate_scores_token_id_data_as_it_scores_the_same_rows_stored_as_embeddings(both, tmp_path):
    """retrain's held-out loss (both models of a gate are scored by it) encodes the ids with the data's encoder."""
    from sdtrain.driver.retrain_gate import heldout_loss
    from sdtrain.model.unet import build_noise_scheduler, build_unet, noise_scheduler_config

    root, _ = both
    data = root / "data" / "part-00000.parquet"
    losses = {}
    for column in ("caption_latents", "caption_ids"):
        cfg = tiny_config(
            f"data.train={data}", f"data.val={data}", f"data.caption_column={column}", tmp_path=tmp_path, name="gate"
        )
        torch.manual_seed(0)
        unet = build_unet(cfg.model)
        losses[column] = heldout_loss(cfg, unet, build_noise_scheduler(noise_scheduler_config(cfg.model)))
    assert losses["caption_ids"] == pytest.approx(losses["caption_latents"], rel=1e-3)
    assert losses["caption_ids"] != losses["caption_latents"]


def test_token_ids_alone_need_no_text_encoder_to_write(both):
    root, model = both
    stage = Encoder(model, "mean", 0, "float32", 32, captions="token_ids")
    assert stage.text_encoder is None  # the tokenizer makes the ids: no encoder weights on the encode actors
    batch = {
        "pixels": np.zeros((2, 32, 32, 3), np.uint8),
        "caption": np.array(["fox", "owl"], object),
        "valid": np.array([True, False]),
        "key": np.array(["0", "1"], object),
    }
    out = stage(batch)
    assert "embeddings" not in out and out["token_ids"].shape == (2, 77) and out["token_ids"].dtype == np.int32
    assert not out["token_ids"][1].any()  # an invalid row: zeros, only a shard's statistics
    assert out["token_ids"][0].tolist() == tokenize(load_tokenizer(model), ["fox"]).input_ids[0].tolist()


def _with_a_bad_id(both, path, row=5, position=3, excess=7) -> tuple[str, int, int]:
    """The fixture's rows (row groups of 4) with one id past the recorded vocabulary at ``row``, whose first row stays
    good (the driver's check reads it); returns (file, vocabulary size, the bad id)."""
    import pyarrow as pa

    root, _ = both
    table = pq.read_table(root / "data" / "part-00000.parquet")
    vocab = int(table.schema.metadata[TOKEN_VOCAB_SIZE.encode()])
    ids = table.column("caption_ids").to_pylist()
    ids[row][position] = vocab + excess
    field = table.schema.field("caption_ids")
    table = table.set_column(table.schema.get_field_index("caption_ids"), field, pa.array(ids, field.type))
    pq.write_table(table, path, row_group_size=4)
    return str(path), vocab, vocab + excess


@pytest.mark.parametrize("on_read_error", ["fail", "skip"])
def test_a_token_id_past_the_vocabulary_in_any_row_is_a_data_error_naming_file_row_and_value(
    both, tmp_path, on_read_error
):
    """What a training read task runs (WindowRead.read) and what a validation read runs, without Ray: the first row is
    fine, row 5 holds an id the recorded vocabulary does not have. Not a damaged file: skip does not hide it."""
    from sdtrain.config.schema import DataConfig
    from sdtrain.data.read_order import DataState, SamplePlan
    from sdtrain.data.streams import WindowReader, _read_file
    from sdtrain.storage.filesystems import filesystems_for

    file, vocab, bad = _with_a_bad_id(both, tmp_path / "bad.parquet")
    spec = inspect_dataset([file], "data.train", Columns("image_latents_256", "caption_ids"), 4, 32)  # row 0: fine
    data = DataConfig(train=[file], caption_column="caption_ids", on_read_error=on_read_error)
    plan = SamplePlan(spec.rows_per_file, seed=0, chunk_rows=4, window_rows=4)
    (stretches,) = plan.rank_stretches(DataState(), 1, 4, 3)
    reader = WindowReader(spec, data, plan)
    expected = rf"data\.train: {file}: column 'caption_ids', row 5: token id {bad} .*vocabulary of {vocab} ids"
    with pytest.raises(DataError, match=expected):
        for stretch in stretches:
            for window in plan.windows(stretch):
                reader.read(window)

    with pytest.raises(DataError, match=expected.replace("train", "val")):
        list(_read_file({"id": np.array([0])}, spec, data, "data.val", filesystems_for(spec.files)))


def test_the_text_encoder_refuses_ids_past_its_vocabulary_naming_row_and_value(both):
    """The step's own bound, for ids read another way than the checked data path."""
    from sdtrain.model.token_captions import CaptionEncoder

    root, model = both
    encoder = CaptionEncoder.load(model, use_gpu=False)
    vocab = encoder.text_encoder.config.vocab_size
    ids = torch.tensor(pq.read_table(root / "data" / "part-00000.parquet").column("caption_ids").to_pylist())
    assert encoder(ids).shape == (ROWS, 77, 32)
    ids[2, 9] = vocab
    with pytest.raises(
        DataError, match=rf"row 2 of a batch holds token id {vocab}, outside the vocabulary of {vocab} of"
    ):
        encoder(ids)
    ids[2, 9] = -1
    with pytest.raises(DataError, match=r"row 2 of a batch holds token id -1, outside"):
        encoder(ids)
