"""SDXL-shaped UNets (model.preset: tiny-sdxl, sdxl-base): two text encoders (a tiny SDXL-layout model directory built
from configs, tests/support/tiny_models.write_tiny_sdxl_model), the pooled embedding and size conditioning
(sdtrain.model.conditioning) in real Lightning fits, caption dropout, the checks before Ray, and the zero-terminal-SNR
schedule."""

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_config
from support.tiny_models import write_tiny_sdxl_model

from sdtrain.errors import ConfigError
from sdtrain.model.conditioning import Conditioner, Conditioning, pooled_width, time_ids
from sdtrain.model.encoders import load_text_encoders
from sdtrain.model.presets import PRESETS
from sdtrain.train.build import checkpoint_meta, fit_without_ray

TEXTS = ["a red fox in snow", "two boats", "an old map", "a cup of tea"]
SDXL_FIT = (
    "data.train=/unused",
    "model.preset=tiny-sdxl",
    "train.max_steps=1",
    "train.global_batch_size=4",
    "train.lr=1e-3",
    "train.warmup_steps=0",
    "scaling.use_gpu=false",
)


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    """The tiny SDXL-layout model directory and its encoders."""
    root = write_tiny_sdxl_model(str(tmp_path_factory.mktemp("sdxl") / "model"))
    return root, load_text_encoders(root)


def test_the_presets_take_two_encoders_hidden_states_a_pooled_embedding_and_six_time_ids():
    assert pooled_width(PRESETS["sdxl-base"]) == 1280 and PRESETS["sdxl-base"]["cross_attention_dim"] == 2048
    assert pooled_width(PRESETS["tiny-sdxl"]) == 32 and pooled_width(PRESETS["sd2-base"]) is None
    with pytest.raises(ConfigError, match="addition_embed_type 'text' is not supported"):
        pooled_width({"addition_embed_type": "text"})
    # An image's recorded placement, else its latents' own size uncropped; the target is the latents' size in pixels.
    placement = torch.tensor([[300, 500, 10, 20]], dtype=torch.int32)
    assert time_ids((16, 24), 8, 1, placement).tolist() == [[300, 500, 10, 20, 128, 192]]
    assert time_ids((16, 24), 8, 2).tolist() == [[128, 192, 0, 0, 128, 192]] * 2


def test_the_two_encoders_encode_as_diffusers_sdxl_pipeline_and_their_ids_give_the_same(sdxl):
    from diffusers import StableDiffusionXLPipeline

    _, encoders = sdxl
    hidden, pooled = encoders.encode(TEXTS)
    assert hidden.shape == (4, 77, 80) and pooled is not None and pooled.shape == (4, 32)
    pipe = StableDiffusionXLPipeline(
        vae=None,
        text_encoder=encoders.encoders[0],
        tokenizer=encoders.tokenizers[0],
        text_encoder_2=encoders.encoders[1],
        tokenizer_2=encoders.tokenizers[1],
        unet=None,
        scheduler=None,
    )
    theirs, _, theirs_pooled, _ = pipe.encode_prompt(TEXTS, device="cpu", do_classifier_free_guidance=False)
    torch.testing.assert_close(hidden, theirs, rtol=0, atol=0)
    torch.testing.assert_close(pooled, theirs_pooled, rtol=0, atol=0)
    ids = encoders.tokenize(TEXTS)
    assert ids.shape == (4, 2 * 77) and int(ids[0, 77 + 40]) == encoders.tokenizers[1].pad_token_id
    again, again_pooled = encoders.encode_ids(ids)
    torch.testing.assert_close(again, hidden, rtol=0, atol=0)
    torch.testing.assert_close(again_pooled, pooled, rtol=0, atol=0)


def _fit_loss(config, meta, batch) -> float:
    module, _ = fit_without_ray(config, [batch], meta, use_gpu=False)
    return float(module.take_window_stats()["loss"])


def test_a_tiny_sdxl_unet_trains_from_embeddings_and_from_ids_to_the_same_first_loss(sdxl, tmp_path):
    """The same rows stored as embeddings (hidden states and pooled) and as the two tokenizers' ids: one real
    Lightning step from each gives the same loss (the ids are encoded in the step); the size conditioning reaches the
    UNet (another placement, another loss)."""
    root, encoders = sdxl
    hidden, pooled = encoders.encode(TEXTS)
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(4, 4, 16, 24, generator=g)
    placement = torch.tensor([[64, 96, 0, 0], [80, 96, 8, 0], [32, 48, 0, 0], [64, 128, 0, 16]], dtype=torch.int32)
    config = tiny_config(*SDXL_FIT)
    meta = checkpoint_meta(config, (4, 16, 24), (77, 80), vae_downsampling=2)
    embedded = {"latents": latents, "captions": hidden, "pooled": pooled, "placement": placement}
    from_embeddings = _fit_loss(config, meta, embedded)
    ids = {"latents": latents, "captions": encoders.tokenize(TEXTS).to(torch.int32), "placement": placement}
    ids_meta = checkpoint_meta(config, (4, 16, 24), (77, 80), text_encoder=root, vae_downsampling=2)
    assert _fit_loss(config, ids_meta, ids) == pytest.approx(from_embeddings, rel=1e-5)
    moved = {**embedded, "placement": placement + torch.tensor([0, 0, 8, 8], dtype=torch.int32)}
    assert _fit_loss(config, meta, moved) != pytest.approx(from_embeddings, rel=1e-6)


def test_under_fsdp_in_bf16_the_unet_embeds_the_exact_sizes(sdxl):
    """FSDP2's bf16 policy casts the forward's floating inputs to bf16, which holds whole numbers only to 256: sizes
    and crops reach the UNet's time-id embedding exact (a float32 2047 arrived as 2048, a crop of 341 as 340)."""
    from diffusers.models.embeddings import Timesteps
    from torch.distributed.tensor import DTensor

    _, encoders = sdxl
    hidden, pooled = encoders.encode(TEXTS)
    placement = torch.tensor([[1365, 2047, 341, 3], [3001, 4001, 0, 517]] * 2, dtype=torch.int32)
    batch = {"latents": torch.randn(4, 4, 16, 24), "captions": hidden, "pooled": pooled, "placement": placement}
    config = tiny_config(*SDXL_FIT, "train.strategy=fsdp", "train.precision=bf16-mixed")
    meta = checkpoint_meta(config, (4, 16, 24), (77, 80), vae_downsampling=2)
    seen = []

    def time_ids_in(module, args):
        if isinstance(module, Timesteps) and args[0].numel() == 6 * len(placement):  # not the timesteps' own
            seen.append(args[0].detach().clone())

    hook = torch.nn.modules.module.register_module_forward_pre_hook(time_ids_in)
    try:
        module, trainer = fit_without_ray(config, [batch], meta, use_gpu=False)
    finally:
        hook.remove()
    assert trainer.global_step == 1 and trainer.precision == "bf16-mixed"
    assert seen and isinstance(module.unet.conv_in.weight, DTensor)  # sharded: FSDP2's policy ran
    exact = torch.cat([placement.long(), torch.tensor([[32, 48]] * 4)], dim=1).flatten()
    assert all(torch.equal(ids.double(), exact.double()) for ids in seen), [ids.tolist() for ids in seen]


def test_caption_dropout_zeroes_the_text_and_keeps_the_sizes():
    from sdtrain.model.recipe import step_inputs
    from sdtrain.model.unet import build_noise_scheduler, noise_scheduler_config

    config = tiny_config(*SDXL_FIT)
    scheduler = build_noise_scheduler(noise_scheduler_config(config.model))
    conditioning = Conditioning(torch.ones(64, 77, 80), torch.ones(64, 32), torch.full((64, 6), 7.0))
    latents = torch.zeros(64, 4, 16, 16)
    inputs = step_inputs(
        scheduler,
        latents,
        conditioning,
        torch.zeros_like(latents),
        torch.zeros(64, dtype=torch.long),
        torch.Generator().manual_seed(0),
        caption_dropout_prob=0.5,
        unconditional_caption=torch.zeros(77, 80),
    )
    dropped = inputs.dropped
    assert dropped is not None and 0 < int(dropped.sum()) < 64
    out = inputs.conditioning
    assert out.pooled is not None and out.time_ids is not None
    assert (out.hidden[dropped] == 0).all() and (out.hidden[~dropped] == 1).all()
    assert (out.pooled[dropped] == 0).all() and (out.pooled[~dropped] == 1).all()
    assert (out.time_ids == 7).all()


def test_validation_conditions_an_sdxl_unet_as_training_does(sdxl):
    """validation_sums with no condition given reads the stored pooled embeddings and placement
    (sdtrain.model.conditioning.Conditioner), as the module's validation does."""
    from diffusers import UNet2DConditionModel

    from sdtrain.model.unet import build_noise_scheduler, noise_scheduler_config
    from sdtrain.model.validation import validation_sums

    _, encoders = sdxl
    hidden, pooled = encoders.encode(TEXTS)
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**PRESETS["tiny-sdxl"])
    scheduler = build_noise_scheduler(noise_scheduler_config(tiny_config(*SDXL_FIT).model))
    batch = {"latents": torch.randn(4, 4, 16, 16), "captions": hidden, "pooled": pooled}
    default = validation_sums(unet, scheduler, [batch], seed=3)
    assert np.isfinite(default[0]) and default[1] == 4
    explicit = validation_sums(unet, scheduler, [batch], seed=3, condition=Conditioner(unet.config, 8))
    assert explicit == default
    # Another VAE downsampling is other time ids: the conditioning reaches the UNet.
    assert validation_sums(unet, scheduler, [batch], seed=3, condition=Conditioner(unet.config, 2)) != default


def test_zero_terminal_snr_needs_v_prediction_and_keeps_min_snr_finite():
    from sdtrain.model.recipe import min_snr_weights, snr
    from sdtrain.model.unet import build_noise_scheduler, noise_scheduler_config

    with pytest.raises(ConfigError, match=r"train.zero_terminal_snr: .*model.prediction_type: v_prediction"):
        tiny_config("data.train=/d", "train.zero_terminal_snr=true")
    config = tiny_config("data.train=/d", "train.zero_terminal_snr=true", "model.prediction_type=v_prediction")
    stored = noise_scheduler_config(config.model, zero_terminal_snr=True)
    assert stored["rescale_betas_zero_snr"] is True and stored["timestep_spacing"] == "trailing"
    scheduler = build_noise_scheduler(stored)
    last = torch.tensor([scheduler.config.num_train_timesteps - 1])
    assert float(snr(scheduler, last)) == 0.0
    assert float(min_snr_weights(scheduler, last, 5.0)) == 0.0  # v: min(0, 5) / (0 + 1)
    # Epsilon's min(SNR, gamma) / SNR at SNR 0 is its limit, 1 (it used to divide by zero).
    epsilon = build_noise_scheduler({**stored, "prediction_type": "epsilon"})
    weights = min_snr_weights(epsilon, torch.tensor([0, 500, 999]), 5.0)
    assert torch.isfinite(weights).all() and float(weights[-1]) == 1.0


def _sdxl_file(path, pooled_width=32, placement=False, rows=8):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    columns = {
        "image_latents_256": pa.array(list(rng.standard_normal((rows, 4 * 16 * 16)).astype(np.float16))),
        "caption_latents": pa.array(list(rng.standard_normal((rows, 77 * 80)).astype(np.float16))),
    }
    if pooled_width:
        columns["caption_pooled"] = pa.array(list(rng.standard_normal((rows, pooled_width)).astype(np.float16)))
    if placement:
        for name in ("original_height", "original_width", "crop_top", "crop_left"):
            columns[name] = pa.array(np.full(rows, 32, np.int32))
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)


def test_the_data_check_reads_an_sdxl_unets_added_columns_or_refuses_naming_them(tmp_path, caplog):
    from sdtrain.data.added_columns import AddedColumns
    from sdtrain.driver.data_check import check_data, unconditional_caption_of
    from sdtrain.errors import DataError

    def check(name, *keys):
        config = tiny_config(
            f"data.train={tmp_path / name}", "model.preset=tiny-sdxl", "export.enabled=false", *keys, batch=4
        )
        return check_data(config, str(tmp_path / "runs" / name))[0].spec

    _sdxl_file(tmp_path / "none" / "a.parquet", pooled_width=0)
    with pytest.raises(DataError, match=r"a.parquet, column 'caption_pooled' \(data.pooled_caption_column\): no such"):
        check("none")
    _sdxl_file(tmp_path / "narrow" / "a.parquet", pooled_width=16)
    with pytest.raises(DataError, match="holds 16 values a row, but the UNet's pooled text embedding is 32 wide"):
        check("narrow")
    _sdxl_file(tmp_path / "bare" / "a.parquet")
    with caplog.at_level("INFO", logger="sdtrain"):
        assert check("bare").added == AddedColumns("caption_pooled", 32, placement=False)
    assert "records no placement (original_height, original_width, crop_top, crop_left)" in caplog.text
    _sdxl_file(tmp_path / "placed" / "a.parquet", placement=True)
    assert check("placed").added == AddedColumns("caption_pooled", 32, placement=True)
    with pytest.raises(ConfigError, match="data.unconditional_caption: u.npy is no empty prompt for an SDXL-shaped"):
        check("placed", "data.unconditional_caption=u.npy")
    # auto: zeros for an SDXL-shaped UNet, whatever lies beside the data (SDXL drops captions to zeros).
    np.save(tmp_path / "placed" / "unconditional_caption.npy", np.ones((77, 32), np.float32))
    config = tiny_config(f"data.train={tmp_path / 'placed'}", "model.preset=tiny-sdxl", "export.enabled=false", batch=4)
    assert unconditional_caption_of(config, check("placed")).data.unconditional_caption == "zeros"
    assert "an SDXL-shaped UNet drops captions to zeros" in caplog.text


def test_sdxl_token_ids_are_a_column_per_tokenizer_read_joined_or_refused_naming_the_columns(sdxl, tmp_path):
    """Each tokenizer's ids in a column of its own, the files naming them in order (sdtrain.token_id_columns): the
    data check takes them, and both readers (the file-order reader, and a training stream's read task) join them into
    the T x L ids a row that TextEncoders.tokenize makes; so does generate.py's --captions. Refused before Ray, each
    naming the columns: the ids of one tokenizer for a model of two (the T x L column earlier sdtrain wrote too),
    data.caption_column naming the second tokenizer's column, a named column a file lacks (the first or a later
    one), one stored otherwise than the first."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq
    from conftest import token_id_table

    from sdtrain.config.learning import Columns, DataConfig
    from sdtrain.data.metadata import TOKEN_ID_COLUMNS
    from sdtrain.data.read_order import DataState, SamplePlan
    from sdtrain.data.rows import RowReader
    from sdtrain.data.streams import WindowReader
    from sdtrain.driver.data_check import check_data
    from sdtrain.errors import DataError
    from sdtrain.sampling.captions import read_captions

    root, _ = sdxl
    table = token_id_table(np.zeros((8, 4, 16, 16), np.float16), root)
    joined = np.concatenate([np.stack(table.column(c).to_pylist()) for c in ("caption_ids", "caption_ids_2")], axis=1)

    def check(name, data, *keys, file="a.parquet"):
        (tmp_path / name).mkdir(exist_ok=True)
        pq.write_table(data, tmp_path / name / file)
        config = tiny_config(
            f"data.train={tmp_path / name}", "model.preset=tiny-sdxl", "export.enabled=false", *keys, batch=4
        )
        return check_data(config, str(tmp_path / "runs" / name))[0].spec

    spec = check("good", table, "data.caption_column=caption_ids")
    assert spec.token_ids is not None and spec.token_ids.columns == ("caption_ids", "caption_ids_2")
    assert spec.caption_shape == (154,) and spec.embedding_shape(80) == (77, 80)
    (batch,) = RowReader.of(spec, Columns("image_latents_256", "caption_ids")).batches(spec.files, "data.train")
    assert batch.captions.dtype == np.int32 and np.array_equal(batch.captions, joined)
    plan = SamplePlan(spec.rows_per_file, seed=0, chunk_rows=8, window_rows=8)
    (stretches,) = plan.rank_stretches(DataState(), 1, 8, 1)
    reader = WindowReader(spec, DataConfig(caption_column="caption_ids"), plan)
    (window,) = [w for stretch in stretches for w in plan.windows(stretch)]
    (block,) = reader.task(window)()
    captions = np.stack(block.column("captions").to_numpy(zero_copy_only=False))
    assert np.array_equal(captions, joined[block.column("sample_index").to_numpy()])

    # generate.py --captions and sample grids read the same rows joined, and encode them as the step does.
    _, encoders = sdxl
    captions = read_captions(str(spec.files[0]), 80, "caption_ids", rows=2, encode=encoders.encode_ids)
    hidden, pooled = encoders.encode_ids(torch.from_numpy(joined[:2]))
    assert (
        torch.equal(captions.embeddings, hidden)
        and captions.pooled is not None
        and torch.equal(captions.pooled, pooled)
    )

    one = table.drop_columns(["caption_ids_2"]).set_column(
        1, "caption_ids", pa.array(joined.tolist(), pa.list_(pa.int32()))
    )
    metadata = {k: v for k, v in table.schema.metadata.items() if k != TOKEN_ID_COLUMNS.encode()}
    with pytest.raises(DataError, match=r"hold the ids of 1 tokenizer\(s\), in \['caption_ids'\], but .* has 2: "):
        check("one", one.replace_schema_metadata(metadata), "data.caption_column=caption_ids")
    with pytest.raises(DataError, match=r"\['caption_ids', 'caption_ids_2'\] \(sdtrain.token_id_columns\), one per"):
        check("second", table, "data.caption_column=caption_ids_2")
    with pytest.raises(
        DataError, match=r"has no column 'caption_ids_2'; its columns are image_latents_256, caption_ids"
    ):
        check("lacks", table.drop_columns(["caption_ids_2"]), "data.caption_column=caption_ids")
    wide = table.set_column(2, "caption_ids_2", pa.array(joined[:, 77:].tolist(), pa.list_(pa.int64())))
    with pytest.raises(DataError, match=r"column 'caption_ids_2' \(sdtrain.token_id_columns\) is a list of int64 but"):
        check("otherwise", wide, "data.caption_column=caption_ids")
    assert json.loads(table.schema.metadata[TOKEN_ID_COLUMNS.encode()]) == ["caption_ids", "caption_ids_2"]
    # Every file's footer is held to the first's: a later file that lacks a listed column is named before Ray.
    (tmp_path / "mixed").mkdir()
    pq.write_table(table, tmp_path / "mixed" / "a.parquet")
    with pytest.raises(DataError, match=r"b.parquet records token ids in column 'caption_ids_2' .* has no such column"):
        check("mixed", table.drop_columns(["caption_ids_2"]), "data.caption_column=caption_ids", file="b.parquet")


# --- preprocessing with an SDXL model directory ---


def _encode_batch(captions: list[str]) -> dict[str, np.ndarray]:
    """A batch as the CPU stage hands it to the encoders, the last row only a shard's counts (valid false)."""
    return {
        "pixels": np.zeros((len(captions) + 1, 32, 32, 3), np.uint8),
        "caption": np.array([*captions, ""], object),
        "valid": np.array([True] * len(captions) + [False]),
        "key": np.array([str(i) for i in range(len(captions) + 1)], object),
    }


def test_the_encode_stage_stores_both_encoders_hidden_states_the_pooled_embedding_and_both_tokenizers_ids(sdxl):
    """An SDXL model directory's two encoders, as TextEncoders encode and tokenize: 77 x (32 + 48) hidden states, the
    32-wide pooled embedding, 77 ids of each tokenizer; for ids alone no encoder weights are loaded."""
    from sdtrain.preprocess.encode_stage import Encoder

    root, encoders = sdxl
    stage = Encoder(root, "mean", 0, "float32", 32, captions="both")
    out = stage(_encode_batch(TEXTS[:2]))
    hidden, pooled = encoders.encode(TEXTS[:2])
    assert pooled is not None
    assert out["embeddings"].shape == (3, 77 * 80) and out["embeddings"].dtype == np.float16
    assert out["pooled"].shape == (3, 32) and out["pooled"].dtype == np.float16
    ids = encoders.tokenize(TEXTS[:2]).numpy()
    for key, part in (("token_ids", ids[:, :77]), ("token_ids_2", ids[:, 77:])):
        assert out[key].shape == (3, 77) and out[key].dtype == np.int32
        assert np.array_equal(out[key][:2], part) and not out[key][2].any()
    assert np.array_equal(out["embeddings"][:2], hidden.flatten(1).numpy().astype(np.float16))
    assert np.array_equal(out["pooled"][:2], pooled.numpy().astype(np.float16))
    assert not out["embeddings"][2].any() and not out["pooled"][2].any()

    ids_only = Encoder(root, "mean", 0, "float32", 32, captions="token_ids")
    assert ids_only.text_encoder is None  # the tokenizers make the ids
    out = ids_only(_encode_batch(TEXTS[:2]))
    assert "embeddings" not in out and "pooled" not in out
    assert np.array_equal(np.concatenate([out["token_ids"], out["token_ids_2"]], axis=1)[:2], ids)


def test_sdxls_vae_encodes_in_float32_where_float16_is_asked_and_other_vaes_keep_it(sdxl, tmp_path):
    """SDXL's VAE (force_upcast in its config) overflows in float16 on some images, its latents inf or NaN: its
    pipelines decode in float32, diffusers' SDXL training script encodes in float32, and so does preprocessing
    where encode.dtype is float16 (auto on a GPU). The fp16-fix VAE (force_upcast false) and SD 2's keep float16."""
    import json
    import shutil

    from support.tiny_models import write_tiny_sd_model

    from sdtrain.model.encoders import vae_dtype
    from sdtrain.preprocess.encode_stage import Encoder

    root, _ = sdxl
    assert json.loads((Path(root) / "vae" / "config.json").read_text())["force_upcast"] is True
    stage = Encoder(root, "mean", 0, "float16", 32, captions="token_ids")
    assert stage.vae.dtype == torch.float32
    assert np.isfinite(stage(_encode_batch(TEXTS[:2]))["latents"][:2]).all()
    assert vae_dtype(root, torch.bfloat16) == torch.bfloat16  # float32's range: nothing overflows
    fixed = tmp_path / "fp16-fix"
    shutil.copytree(root, fixed)
    config = json.loads((fixed / "vae" / "config.json").read_text())
    (fixed / "vae" / "config.json").write_text(json.dumps({**config, "force_upcast": False}))
    assert vae_dtype(str(fixed), torch.float16) == torch.float16
    assert vae_dtype(write_tiny_sd_model(str(tmp_path / "sd2")), torch.float16) == torch.float16


def test_the_second_tokenizers_ids_column_takes_no_other_outputs_name(tmp_path):
    from sdtrain.config.loader import load_config
    from sdtrain.preprocess.config import PreprocessConfig

    keys = [f"input.paths={tmp_path}", f"output.path={tmp_path / 'out'}", "output.token_id_column=ids"]
    assert load_config(None, keys, PreprocessConfig).output.token_id_columns(2) == ["ids", "ids_2"]
    with pytest.raises(ConfigError, match=r"output.token_id_column: must differ, and so must 'ids_2' \(an SDXL model"):
        load_config(None, [*keys, "output.pooled_column=ids_2"], PreprocessConfig)


def test_an_sdxl_model_on_s3_encodes_as_the_local_one_and_writes_no_empty_prompt_file(sdxl, tmp_path, s3_bucket):
    """The model in a bucket: its two encoders fetched by an encoder actor (here in the test's process) encode as the
    local copy; the driver writes no empty-prompt file (SDXL drops captions to zeros) and says so in the manifest."""
    import boto3
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sdtrain.config.loader import load_config
    from sdtrain.preprocess.config import PreprocessConfig
    from sdtrain.preprocess.encode_stage import Encoder
    from sdtrain.preprocess.job import run_preprocess

    root, encoders = sdxl
    s3 = boto3.client("s3")
    for path in sorted(p for p in Path(root).rglob("*") if p.is_file()):
        s3.upload_file(str(path), "sdtrain-test", f"models/sdxl/{path.relative_to(root).as_posix()}")
    model = f"{s3_bucket}/models/sdxl"
    out = Encoder(model, "mean", 0, "float32", 32, captions="both")(_encode_batch(TEXTS))
    local = Encoder(root, "mean", 0, "float32", 32, captions="both")(_encode_batch(TEXTS))
    for column in ("latents", "embeddings", "pooled", "token_ids", "token_ids_2"):
        assert np.array_equal(out[column], local[column]), column

    (tmp_path / "input").mkdir()
    pq.write_table(pa.table({"jpg": pa.array([b"x"], pa.binary()), "caption": ["a"]}), tmp_path / "input" / "p.parquet")
    config = load_config(
        None,
        [f"input.paths={tmp_path / 'input'}", f"encode.model={model}", "output.captions=both"]
        + [f"output.path={s3_bucket}/latents"],
        PreprocessConfig,
    )
    manifest = run_preprocess(config, max_shards=0).manifest  # the driver's part, no Ray
    assert manifest["unconditional_caption"] == {"caption_latents": "zeros", "caption_ids": "zeros"}
    assert manifest["vae_downsampling"] == 2
    listed = s3.list_objects_v2(Bucket="sdtrain-test", Prefix="latents/").get("Contents", [])
    assert not [o["Key"] for o in listed if o["Key"].endswith(".npy")]


@pytest.mark.slow
def test_photographs_preprocessed_with_an_sdxl_model_both_ways_are_what_training_reads(sdxl, tmp_path, ray_cluster):
    """scikit-learn's photographs cut tall, wide and square, preprocessed by a real Ray Data job with the tiny SDXL
    model (output.captions: both, image.buckets: aspect): the two encoders' hidden states (77 x 80), the pooled
    embedding (32) and each tokenizer's 77 ids in a column of its own (caption_ids, caption_ids_2, named in the files'
    metadata), as TextEncoders make them; each image's placement; the files name the model and its VAE's
    downsampling. Training's data check takes the output with
    model.preset=tiny-sdxl both ways: from the embeddings with the pooled column, and from the ids."""

    import json

    import pyarrow as pa
    import pyarrow.parquet as pq
    from support.photographs import write_photograph_cuts

    from sdtrain.config.loader import load_config
    from sdtrain.data.added_columns import AddedColumns
    from sdtrain.data.metadata import (
        BUCKET_SHAPES,
        TEXT_ENCODER_SOURCE,
        TOKEN_ID_COLUMNS,
        TOKEN_VOCAB_SIZE,
        VAE_DOWNSAMPLING,
        VAE_SOURCE,
    )
    from sdtrain.driver.data_check import check_data
    from sdtrain.preprocess.buckets import place
    from sdtrain.preprocess.config import PreprocessConfig
    from sdtrain.preprocess.job import run_preprocess

    root, encoders = sdxl
    captions, sizes = write_photograph_cuts(tmp_path / "input")
    output = tmp_path / "latents"
    config = load_config(
        None,
        [f"input.paths={tmp_path / 'input'}", f"encode.model={root}", f"output.path={output}"]
        + ["output.captions=both", "image.resolution=32", "image.buckets=aspect", "image.bucket_step=8"]
        + ["input.rows_per_shard=4", "encode.batch_size=4"],
        PreprocessConfig,
    )
    summary = run_preprocess(config)
    assert summary.manifest["rows_written"] == 6 and not summary.shards_failed
    assert summary.manifest["unconditional_caption"] == {"caption_latents": "zeros", "caption_ids": "zeros"}
    assert not list(output.glob("*.npy"))  # no empty prompt but zeros for SDXL
    files = sorted(output.glob("[!_]*.parquet"))
    table = pa.concat_tables(pq.read_table(f) for f in files)
    rows = {row["caption"]: row for row in table.to_pylist()}
    assert sorted(rows) == sorted(captions)
    hidden, pooled = encoders.encode(captions)
    ids = encoders.tokenize(captions)
    assert pooled is not None
    buckets = config.image.shapes()
    for i, caption in enumerate(captions):
        row = rows[caption]
        assert len(row["caption_latents"]) == 77 * 80 and len(row["caption_pooled"]) == 32
        assert row["caption_ids"] + row["caption_ids_2"] == ids[i].tolist() and len(row["caption_ids_2"]) == 77
        np.testing.assert_allclose(row["caption_latents"], hidden[i].flatten().numpy(), atol=2e-3, rtol=1e-2)
        np.testing.assert_allclose(row["caption_pooled"], pooled[i].numpy(), atol=2e-3, rtol=1e-2)
        placed, _ = place(*sizes[i], buckets)
        assert (row["bucket"], row["original_height"], row["original_width"]) == (placed.bucket, *sizes[i])
        assert (row["crop_top"], row["crop_left"]) == placed.crop_top_left
    assert table.schema.field("caption_pooled").type == pa.list_(pa.float16())
    assert table.schema.field("caption_ids").type == table.schema.field("caption_ids_2").type == pa.list_(pa.int32())
    for file in files:
        metadata = pq.read_schema(file).metadata
        assert metadata[VAE_DOWNSAMPLING.encode()] == b"2"
        assert int(metadata[TOKEN_VOCAB_SIZE.encode()]) == max(len(t) for t in encoders.tokenizers)
        assert metadata[TEXT_ENCODER_SOURCE.encode()] == metadata[VAE_SOURCE.encode()] == root.encode()
        assert BUCKET_SHAPES.encode() in metadata
        assert json.loads(metadata[TOKEN_ID_COLUMNS.encode()]) == ["caption_ids", "caption_ids_2"]

    def checked(*keys):
        keys = (f"data.train={output}", "model.preset=tiny-sdxl", "export.enabled=false", *keys)
        return check_data(tiny_config(*keys, batch=4), str(tmp_path / "runs" / "check"))[0].spec

    embedded = checked()
    assert embedded.added == AddedColumns("caption_pooled", 32, placement=True)
    assert embedded.caption_shape == (77, 80) and embedded.vae_downsampling == 2 and embedded.token_ids is None
    from_ids = checked("data.caption_column=caption_ids")
    assert from_ids.token_ids is not None and from_ids.token_ids.columns == ("caption_ids", "caption_ids_2")
    assert from_ids.caption_shape == (154,)
    assert from_ids.token_ids.text_encoder == root and from_ids.embedding_shape(80) == (77, 80)
    assert from_ids.added == AddedColumns(None, 32, placement=True) and from_ids.vae_downsampling == 2


# --- sampling and export ---


def _sdxl_model(zero_terminal_snr: bool = True):
    """A seeded tiny-sdxl UNet (v-prediction) and its training schedule."""
    from sdtrain.config.schema import ModelConfig
    from sdtrain.model.unet import build_unet, noise_scheduler_config

    model = ModelConfig(preset="tiny-sdxl", prediction_type="v_prediction")
    torch.manual_seed(0)
    return build_unet(model).eval(), noise_scheduler_config(model, zero_terminal_snr=zero_terminal_snr)


def test_sdxl_sampling_is_the_sdxl_pipelines_on_a_zero_terminal_snr_schedule_with_guidance_rescale(sdxl):
    """sample_latents on a tiny-sdxl UNet gives StableDiffusionXLPipeline's latents for the same embeddings: the
    pooled embedding, the size conditioning of a 16 x 24 pixel image (the VAE downsamples by 2), zeros for the empty
    prompt, and on a zero-terminal-SNR schedule guidance rescaled by 0.7 by default. Without the pooled embedding
    it is refused."""
    from diffusers import StableDiffusionXLPipeline

    from sdtrain.errors import DataError
    from sdtrain.model.encoders import load_vae
    from sdtrain.model.unet import default_guidance_rescale
    from sdtrain.sampling.sampler import make_sampler, sample_latents

    root, encoders = sdxl
    unet, schedule = _sdxl_model()
    assert default_guidance_rescale(schedule) == 0.7 and default_guidance_rescale({}) == 0.0
    hidden, pooled = encoders.encode(TEXTS[:2])
    pipe = StableDiffusionXLPipeline(
        vae=load_vae(root),
        text_encoder=None,
        text_encoder_2=None,
        tokenizer=None,
        tokenizer_2=None,
        unet=unet,
        scheduler=make_sampler(schedule, "ddim", 5),
        add_watermarker=False,
    )
    assert pipe.vae_scale_factor == 2
    theirs = pipe(
        prompt_embeds=hidden,
        pooled_prompt_embeds=pooled,
        guidance_scale=3.0,
        guidance_rescale=0.7,
        num_inference_steps=5,
        generator=torch.Generator().manual_seed(0),
        output_type="latent",
        height=16,
        width=24,
    ).images
    conditioning = Conditioning(hidden, pooled)
    sample = dict(steps=5, guidance_scale=3.0, seed=0, vae_downsampling=2)
    rescaled = default_guidance_rescale(schedule)
    ours = sample_latents(
        unet, schedule, conditioning, torch.zeros(77, 80), (4, 8, 12), **sample, guidance_rescale=rescaled
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    plain = sample_latents(unet, schedule, conditioning, torch.zeros(77, 80), (4, 8, 12), **sample)
    assert not torch.allclose(plain, ours, atol=1e-4)  # the rescale is applied, not ignored
    with pytest.raises(DataError, match="pooled text embedding"):
        sample_latents(unet, schedule, hidden, torch.zeros(77, 80), (4, 8, 12), **sample)


def test_an_sdxl_model_exports_as_an_sdxl_pipeline_that_answers_a_prompt_and_generate_samples_it(sdxl, tmp_path):
    """export.base_model an SDXL model directory: the export is a StableDiffusionXLPipeline with both text encoders
    and tokenizers that DiffusionPipeline.from_pretrained loads and prompts; generate.py --prompt on the export
    encodes with both encoders, conditions on the image size and samples what sample_latents does by hand; a run
    starts from the export as model.pretrained. A base model with one text encoder is refused naming the missing
    one."""
    from diffusers import DiffusionPipeline, StableDiffusionXLPipeline
    from support.tiny_models import write_tiny_sd_model

    from sdtrain.artifacts.export import write_export
    from sdtrain.artifacts.loading import LoadedModel
    from sdtrain.model.unet import build_noise_scheduler
    from sdtrain.sampling.generate import LATENTS_FILE, GenerateRequest, generate
    from sdtrain.sampling.sampler import sample_latents

    root, encoders = sdxl
    unet, schedule = _sdxl_model()
    loaded = LoadedModel(
        unet,
        build_noise_scheduler(schedule),
        torch.zeros(77, 80),
        "test",
        "ema",
        4,
        (4, 8, 12),
        (77, 80),
        None,
        None,
        None,
        vae_downsampling=2,
    )
    export = tmp_path / "export"
    write_export(loaded, str(export), base_model=root)
    pipeline = DiffusionPipeline.from_pretrained(str(export))
    assert isinstance(pipeline, StableDiffusionXLPipeline)
    assert pipeline.text_encoder_2.config.projection_dim == 32 and pipeline.tokenizer_2.pad_token == "!"
    assert pipeline.scheduler.config.rescale_betas_zero_snr
    image = pipeline("a red fox", num_inference_steps=2, height=16, width=24, output_type="np").images
    assert image.shape == (1, 16, 24, 3) and np.isfinite(image).all()

    out = tmp_path / "samples"
    request = GenerateRequest(
        str(export), prompts=TEXTS[:2], out=str(out), samples_per_caption=1, steps=3, height=16, width=24
    )
    generate(request)
    latents = np.load(out / LATENTS_FILE)
    hidden, pooled = encoders.encode(TEXTS[:2])
    by_hand = sample_latents(
        unet,
        schedule,
        Conditioning(hidden, pooled),
        torch.zeros(77, 80),
        (4, 8, 12),
        steps=3,
        guidance_scale=5.0,  # SDXL pipeline's default, generate.py's for an SDXL model
        guidance_rescale=0.7,
        vae_downsampling=2,
    )
    np.testing.assert_allclose(latents.reshape(by_hand.shape), by_hand.numpy(), rtol=1e-4, atol=1e-5)

    # The export is an SDXL model directory as diffusers lays one out: model.pretrained starts a run from it.
    from sdtrain.config.schema import ModelConfig
    from sdtrain.model.unet import build_unet

    pretrained = ModelConfig(preset="tiny", pretrained=str(export), prediction_type="v_prediction")
    assert pooled_width(build_unet(pretrained).config) == 32
    assert all(torch.equal(a, b) for a, b in zip(build_unet(pretrained).parameters(), unet.parameters(), strict=True))
    config = tiny_config(
        *SDXL_FIT, f"model.pretrained={export}", "model.prediction_type=v_prediction", "train.global_batch_size=2"
    )
    meta = checkpoint_meta(config, (4, 8, 12), (77, 80), vae_downsampling=2)
    assert meta.noise_scheduler_config["rescale_betas_zero_snr"]  # the export's scheduler/: its schedule kept
    batch = {"latents": torch.randn(2, 4, 8, 12), "captions": hidden, "pooled": pooled}
    assert np.isfinite(_fit_loss(config, meta, batch))

    one_encoder = write_tiny_sd_model(str(tmp_path / "sd"), caption_dim=80)
    with pytest.raises(Exception, match="text_encoder_2"):
        write_export(loaded, str(tmp_path / "refused"), base_model=one_encoder)


@pytest.mark.slow  # inductor's CPU backend compiles each FSDP unit: about a minute
@pytest.mark.timeout(600)
def test_the_shipped_sdxl_config_trains_its_recipe_on_the_tiny_sdxl_unet(sdxl):
    """configs/sdxl-base.yaml's model and train options as they are (compiled, FSDP, gradient checkpointing,
    zero-terminal SNR with v-prediction and no min-SNR, which would drop its terminal timesteps, caption dropout to
    zeros, EMA, micro-batch auto) on the tiny SDXL layout: a real Lightning fit from the two tokenizers' ids for three
    steps, each FSDP unit compiled by inductor in bf16 without a graph break (the pooled embedding and time ids go
    through the root unit), the loss finite, and the first step's loss an eager fit's of the same batches."""
    from conftest import REPO
    from support.training import Watch
    from torch._dynamo.utils import counters

    from sdtrain.config.loader import load_config

    root, encoders = sdxl

    def recipe(*overrides):
        config = load_config(
            REPO / "configs" / "sdxl-base.yaml",
            ["data.train=/unused", "model.preset=tiny-sdxl", "scaling.use_gpu=false"]
            + ["train.global_batch_size=4", "scaling.num_workers=1", "train.warmup_steps=0", "train.lr=1e-3"]
            # auto's precision on a GPU with bf16 (sdtrain.train.build.resolve_precision; the CPU's is 32-true): the
            # units' bf16 graphs are what a GPU run compiles (as in test_options.shipped_gpu_options).
            + ["train.max_steps=3", "train.precision=bf16-mixed", *overrides]
            # Its turns of 2 steps (data.bucket_steps) need lanes that make a batch of 4: 8-row chunks. The batches
            # here are given, not read; turns are read in test_buckets.py.
            + ["data.shuffle_chunk_rows=8"],
        )
        return config, checkpoint_meta(config, (4, 16, 24), (77, 80), text_encoder=root, vae_downsampling=2)

    config, meta = recipe()
    assert config.model.preset == "tiny-sdxl" and config.train.zero_terminal_snr and config.train.strategy == "fsdp"
    assert meta.noise_scheduler_config["rescale_betas_zero_snr"]
    g = torch.Generator().manual_seed(0)
    batches = [
        {
            "latents": torch.randn(4, 4, 16, 24, generator=g),
            "captions": encoders.tokenize(TEXTS).to(torch.int32),
            "placement": torch.tensor([[64, 96, 0, 0]] * 4, dtype=torch.int32),
        }
        for _ in range(3)
    ]
    assert config.train.compile and config.train.gradient_checkpointing
    counters.clear()
    compiled = Watch()
    module, trainer = fit_without_ray(config, batches, meta, use_gpu=False, callbacks=[compiled])
    assert trainer.global_step == 3
    assert counters["stats"]["unique_graphs"] > 0 and not counters["graph_break"], dict(counters["graph_break"])
    loss = float(module.take_window_stats()["loss"])
    assert np.isfinite(loss) and 0 < loss < 10
    # The first step's loss comes before any update: what inductor's graphs compute is the eager UNet's, within bf16.
    eager_config, eager_meta = recipe("train.compile=false", "train.max_steps=1")
    eager = Watch()
    fit_without_ray(eager_config, batches, eager_meta, use_gpu=False, callbacks=[eager])
    assert compiled.steps[0]["loss"] == pytest.approx(eager.steps[0]["loss"], rel=2e-2)


def test_grid_captions_read_the_pooled_column_for_an_sdxl_unet_only(tmp_path):
    """sample_grid.captions of embeddings: an SD UNet's grid reads no pooled column (its data has none); an SDXL
    UNet's reads data.pooled_caption_column beside each caption, and a file without it is refused naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sdtrain.train.sample_grids import grid_captions

    hidden = np.random.default_rng(0).standard_normal((3, 77 * 80)).astype(np.float32)
    pooled = np.random.default_rng(1).standard_normal((3, 32)).astype(np.float32)
    plain = pa.table({"caption_latents": [row.tolist() for row in hidden]})
    pq.write_table(plain, tmp_path / "plain.parquet")
    pq.write_table(
        plain.append_column("caption_pooled", [pa.array([r.tolist() for r in pooled])]), tmp_path / "x.parquet"
    )

    def grid(file, pooled):
        config = tiny_config("data.train=/unused", f"sample_grid.captions={tmp_path / file}", "sample_grid.rows=3")
        return grid_captions(config, 80, pooled=pooled)

    sd = grid("plain.parquet", pooled=False)
    assert sd is not None and sd.pooled is None and tuple(sd.embeddings.shape) == (3, 77, 80)
    xl = grid("x.parquet", pooled=True)
    assert xl is not None and xl.pooled is not None
    np.testing.assert_allclose(xl.pooled.numpy(), pooled, rtol=1e-6)
    assert tuple(xl.conditioning(2).pooled.shape) == (6, 32)
    with pytest.raises(ConfigError, match="caption_pooled"):
        grid("plain.parquet", pooled=True)
