"""The training recipe, formula by formula, against diffusers' own scheduler math; EMA; validation
with the recipe's prediction type; latent scaling applied once (tiny real UNet, no Ray)."""

import lightning.pytorch as pl
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler
from diffusers.training_utils import compute_snr

from sdtrain.artifacts.checkpoint_format import CheckpointMeta
from sdtrain.artifacts.loading import load_model
from sdtrain.config.schema import DataConfig, ModelConfig, TrainConfig
from sdtrain.data.metadata import LATENT_SCALING_FACTOR
from sdtrain.errors import ConfigError, DataError
from sdtrain.model import recipe
from sdtrain.model.ema import ema_update_
from sdtrain.model.unet import build_unet, noise_scheduler_config, unet_config
from sdtrain.model.validation import validation_loss
from sdtrain.train.module import DiffusionModule

CAPTION_SHAPE = (5, 32)


def _scheduler(prediction_type="epsilon"):
    return DDPMScheduler.from_config(
        noise_scheduler_config(ModelConfig(preset="tiny", prediction_type=prediction_type))
    )


def _module(prediction_type="epsilon", uncond=None, latent_scale=None, **train):
    model = ModelConfig(preset="tiny", prediction_type=prediction_type)
    torch.manual_seed(0)
    meta = CheckpointMeta(
        "test",
        unet_config(model),
        noise_scheduler_config(model),
        latent_shape=(4, 16, 16),
        caption_shape=tuple(CAPTION_SHAPE),
        latent_scale=1.0 if latent_scale is None else latent_scale,
        config={"train": {"caption_dropout_prob": train.get("caption_dropout_prob", 0.0)}},
    )
    return DiffusionModule(
        build_unet(model), meta.noise_scheduler_config, TrainConfig(**train), meta, unconditional_caption=uncond
    )


def _batches(n=4, batch=4, seed=0, same=False):
    g = torch.Generator().manual_seed(seed)

    def one():
        return {
            "latents": torch.randn(batch, 4, 16, 16, generator=g),
            "captions": torch.randn(batch, *CAPTION_SHAPE, generator=g),
        }

    if same:
        b = one()
        return [b for _ in range(n)]
    return [one() for _ in range(n)]


def _fit(module, steps, batches, ckpt_path=None):
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(
        module,
        train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None),
        ckpt_path=ckpt_path,
        weights_only=True,
    )
    return trainer


# --- formulas ---------------------------------------------------------------------------


def test_targets_are_the_noise_or_the_schedulers_velocity():
    latents, noise = torch.randn(3, 4, 16, 16), torch.randn(3, 4, 16, 16)
    t = torch.tensor([0, 500, 999])
    eps, v = _scheduler("epsilon"), _scheduler("v_prediction")
    assert v.config.prediction_type == "v_prediction" and v.config.clip_sample is False
    assert torch.equal(recipe.training_target(eps, latents, noise, t), noise)
    velocity = recipe.training_target(v, latents, noise, t)
    assert torch.equal(velocity, v.get_velocity(latents, noise, t))
    a = v.alphas_cumprod[t].view(-1, 1, 1, 1)
    torch.testing.assert_close(velocity, a.sqrt() * noise - (1 - a).sqrt() * latents)  # Salimans & Ho


def test_every_valid_row_of_a_step_weighs_the_same_wherever_its_skipped_neighbours_are():
    """2 ranks x 2 micro-batches of 4 rows, some skipped (valid=False): DDP averages the ranks and accumulation the
    micro-batches, so each valid row's squared error must weigh 1/16 and a skipped one 0, as over the whole step's
    rows with the skipped ones as zeros (over the valid rows of each micro-batch, the one survivor of a micro-batch
    weighed 1/4 and the rows of a fully skipped one's neighbours 1/16 of a smaller total)."""
    scheduler = _scheduler("epsilon")
    valid = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    errors = torch.rand(4, 4, requires_grad=True)  # each row's squared error, as a 1x1x1 prediction's with target 0
    step = (
        sum(
            recipe.diffusion_loss(
                errors[m].sqrt().view(4, 1, 1, 1), torch.zeros(4, 1, 1, 1), scheduler, torch.zeros(4), None, valid[m]
            )
            for m in range(4)
        )
        / 4
    )
    step.backward()
    assert errors.grad is not None
    torch.testing.assert_close(errors.grad, valid.float() / 16)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_min_snr_weights_match_the_paper_and_diffusers(prediction_type):
    scheduler = _scheduler(prediction_type)
    t = torch.tensor([0, 10, 100, 300, 600, 999])
    snr = compute_snr(scheduler, t)
    assert torch.equal(recipe.snr(scheduler, t), snr)
    a = scheduler.alphas_cumprod[t]
    torch.testing.assert_close(snr, a / (1 - a), rtol=1e-5, atol=0)
    weights = recipe.min_snr_weights(scheduler, t, gamma=5.0)
    # diffusers train_text_to_image: min(snr, gamma) / snr (epsilon), / (snr + 1) (v_prediction)
    clipped = torch.stack([snr, 5.0 * torch.ones_like(snr)], dim=1).min(dim=1)[0]
    expected = clipped / snr if prediction_type == "epsilon" else clipped / (snr + 1)
    assert torch.equal(weights, expected)
    assert weights[0] < 1 and weights[-1] == pytest.approx(
        1.0 if prediction_type == "epsilon" else snr[-1] / (snr[-1] + 1)
    )
    pred, target = torch.randn(6, 4, 2, 2), torch.randn(6, 4, 2, 2)
    per_sample = ((pred - target) ** 2).mean(dim=(1, 2, 3))
    assert recipe.diffusion_loss(pred, target, scheduler, t, 5.0).item() == pytest.approx(
        (per_sample * expected).mean().item(), rel=1e-6
    )
    assert recipe.diffusion_loss(pred, target, scheduler, t, None).item() == pytest.approx(
        F.mse_loss(pred, target).item(), rel=1e-6
    )


def test_offset_noise_perturbation_and_caption_dropout():
    noise = torch.randn(8, 4, 16, 16)
    g = torch.Generator().manual_seed(1)
    offset = recipe.offset_noise(noise, 0.1, g)
    shift = offset - noise
    torch.testing.assert_close(
        shift, shift[:, :, :1, :1].expand_as(shift), rtol=0, atol=1e-6
    )  # one constant per sample and channel
    torch.testing.assert_close(
        shift[:, :, 0, 0],
        0.1 * torch.randn(8, 4, 1, 1, generator=torch.Generator().manual_seed(1))[:, :, 0, 0],
        rtol=0,
        atol=1e-6,
    )
    perturbed = recipe.perturb(noise, 0.2, torch.Generator().manual_seed(2))
    assert torch.equal(perturbed, noise + 0.2 * torch.randn(noise.shape, generator=torch.Generator().manual_seed(2)))

    captions, uncond = torch.randn(1000, *CAPTION_SHAPE), torch.full(CAPTION_SHAPE, 7.0)
    mixed, dropped = recipe.drop_captions(captions, uncond, 0.3, torch.Generator().manual_seed(3))
    assert torch.equal(dropped, torch.rand(1000, generator=torch.Generator().manual_seed(3)) < 0.3)
    assert 0.25 < dropped.float().mean() < 0.35
    assert (mixed[dropped] == 7.0).all() and torch.equal(mixed[~dropped], captions[~dropped])


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_training_step_applies_the_whole_recipe_with_one_generator(prediction_type):
    uncond = torch.randn(CAPTION_SHAPE)
    options = dict(noise_offset=0.1, input_perturbation=0.05, caption_dropout_prob=0.5, snr_gamma=5.0)
    module = _module(prediction_type, uncond=uncond, **options)
    batch = _batches(1, batch=6)[0]
    loss = module.training_step(batch, 0)
    # By hand, drawing from the step's generator in the documented order.
    latents, scheduler = batch["latents"], module.noise_scheduler
    g = module._step_generator(latents.device, 0)
    noise = torch.randn(latents.shape, generator=g)
    t = torch.randint(0, 1000, (6,), generator=g)
    assert all(
        torch.equal(a, b) for a, b in zip((noise, t), module.noise_and_timesteps(latents), strict=True)
    )  # same first draws
    noise = noise + 0.1 * torch.randn(6, 4, 1, 1, generator=g)
    input_noise = noise + 0.05 * torch.randn(noise.shape, generator=g)
    dropped = torch.rand(6, generator=g) < 0.5
    captions = torch.where(dropped.view(-1, 1, 1), uncond, batch["captions"])
    a = scheduler.alphas_cumprod[t].view(-1, 1, 1, 1)
    noisy = a.sqrt() * latents + (1 - a).sqrt() * input_noise
    target = noise if prediction_type == "epsilon" else a.sqrt() * noise - (1 - a).sqrt() * latents
    snr = a.flatten() / (1 - a.flatten())
    weights = snr.clamp(max=5.0) / (snr if prediction_type == "epsilon" else snr + 1)
    with torch.no_grad():
        prediction = module.unet(noisy, t, captions).sample
    expected = (((prediction - target) ** 2).mean(dim=(1, 2, 3)) * weights).mean()
    assert 0 < dropped.sum() < 6
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4)


def test_latents_are_scaled_exactly_once(tmp_path):
    batch = _batches(1)[0]
    scaled = _module(latent_scale=0.18215)
    plain = _module()
    prescaled = {"latents": batch["latents"] * 0.18215, "captions": batch["captions"]}
    assert scaled.training_step(batch, 0).item() == pytest.approx(plain.training_step(prescaled, 0).item(), rel=1e-6)
    assert scaled.validation_loss([batch], seed=0) == pytest.approx(
        plain.validation_loss([prescaled], seed=0), rel=1e-6
    )

    # Files that record an applied factor, and the config asking for another: refused before training.
    table = pa.table({"x": [1]}).replace_schema_metadata({LATENT_SCALING_FACTOR: b"0.18215"})
    pq.write_table(table, tmp_path / "scaled.parquet")
    pq.write_table(table, tmp_path / "scaled_val.parquet")
    pq.write_table(pa.table({"x": [1]}), tmp_path / "raw.parquet")
    schemas = {path.stem: (str(path), pq.read_schema(path).metadata) for path in tmp_path.glob("*.parquet")}
    files = [schemas["scaled"], schemas["scaled_val"]]
    assert recipe.stored_latent_scaling(files, DataConfig(train=["x"])) == pytest.approx(0.18215)
    raw = [schemas["raw"]]
    assert recipe.stored_latent_scaling(raw, DataConfig(train=["x"], latent_scaling_factor=0.18215)) is None
    with pytest.raises(
        ConfigError,
        match=(
            r"data\.latent_scaling_factor: .*scaled\.parquet records that its latents are already multiplied "
            r"by 0\.18215.*twice"
        ),
    ):
        recipe.stored_latent_scaling(files, DataConfig(train=["x"], latent_scaling_factor=0.18215))
    # data.train and data.val scaled differently: the held-out loss would compare another scale.
    with pytest.raises(
        DataError, match=r"data\.val: .*scaled\.parquet records latents multiplied by 0\.18215 but .*raw\.parquet"
    ):
        recipe.stored_latent_scaling([schemas["raw"], schemas["scaled"]], DataConfig(train=["x"]))


def test_unconditional_caption_from_zeros_or_a_file(tmp_path):
    assert torch.equal(recipe.load_unconditional_caption("zeros", CAPTION_SHAPE), torch.zeros(CAPTION_SHAPE))
    empty = np.random.default_rng(0).standard_normal((1, *CAPTION_SHAPE)).astype(np.float32)
    np.save(tmp_path / "empty.npy", empty)
    assert torch.equal(
        recipe.load_unconditional_caption(str(tmp_path / "empty.npy"), CAPTION_SHAPE), torch.from_numpy(empty[0])
    )
    with pytest.raises(
        ConfigError,
        match=(
            r"data\.unconditional_caption: .*empty\.npy holds an array of shape \(5, 32\), but the dataset's "
            r"captions are \(77, 32\)"
        ),
    ):
        recipe.load_unconditional_caption(str(tmp_path / "empty.npy"), (77, 32))
    with pytest.raises(ConfigError, match=r"data\.unconditional_caption: cannot read"):
        recipe.load_unconditional_caption(str(tmp_path / "missing.npy"), CAPTION_SHAPE)


def test_an_unconditional_caption_storage_could_not_read_fails_the_attempt_not_the_run(tmp_path, monkeypatch):
    """Every worker reads data.unconditional_caption at every start, restarts included: a storage failure that
    outlasted the S3 client's retries (the OSError pyarrow's S3 filesystem raises) is a StorageUnavailable (an
    OSError) naming the key and the file, which the controller's failure callback leaves to Ray Train's restarts; a
    ConfigError would stop the run. A missing or empty file is still a ConfigError naming both."""
    import re

    import sdtrain.storage.filesystems as filesystems
    from sdtrain.errors import StorageUnavailable, find_sdtrain_error

    timeout = (
        "When reading information for key 'prep/unconditional_caption.npy' in bucket 'latents': AWS Error "
        "NETWORK_CONNECTION during GetObject operation: curlCode: 28, Timeout was reached"
    )

    class FlakyS3:
        def open_input_file(self, path):
            raise OSError(timeout)

    local = filesystems.filesystem_for
    monkeypatch.setattr(
        filesystems, "filesystem_for", lambda uri: (FlakyS3(), uri[5:]) if uri.startswith("s3://") else local(uri)
    )
    uri = "s3://latents/prep/unconditional_caption.npy"
    retried = rf"^data\.unconditional_caption: {re.escape(uri)}: object storage failed after \d+ attempt\(s\)"
    with pytest.raises(StorageUnavailable, match=retried) as failed:
        recipe.load_unconditional_caption(uri, CAPTION_SHAPE)
    assert find_sdtrain_error(failed.value) is None
    for name, content in (("missing.npy", None), ("empty.npy", b"")):
        if content is not None:
            (tmp_path / name).write_bytes(content)
        with pytest.raises(ConfigError, match=rf"data\.unconditional_caption: cannot read .*{name} as a \.npy array"):
            recipe.load_unconditional_caption(str(tmp_path / name), CAPTION_SHAPE)


def test_validation_follows_the_prediction_type():
    module = _module("v_prediction")
    batch = _batches(1, batch=10)[0]
    loss = validation_loss(module.unet, module.noise_scheduler, [batch], seed=4)
    # Recompute with validation's fixed grid and noise, against the velocity.
    t = torch.linspace(0, 999, 10).round().long()
    noise = torch.stack(
        [torch.randn(4, 16, 16, generator=torch.Generator().manual_seed(4 * 1_000_003 + i)) for i in range(10)]
    )
    a = module.noise_scheduler.alphas_cumprod[t].view(-1, 1, 1, 1)
    with torch.no_grad():
        pred = module.unet(a.sqrt() * batch["latents"] + (1 - a).sqrt() * noise, t, batch["captions"]).sample
    assert loss == pytest.approx(
        F.mse_loss(pred, a.sqrt() * noise - (1 - a).sqrt() * batch["latents"]).item(), rel=1e-5
    )


# --- EMA --------------------------------------------------------------------------------


def test_ema_update_formula_start_step_and_skip():
    ema, weights = [torch.zeros(3)], [torch.ones(3)]
    ema_update_(ema, weights, step=1, decay=0.9, start_step=2)
    assert torch.equal(ema[0], torch.ones(3))  # through the start step + 1: a copy
    ema_update_(ema, [torch.full((3,), 2.0)], step=3, decay=0.9, start_step=2, skipped=torch.tensor(0.0))
    assert torch.equal(ema[0], torch.full((3,), 2.0))
    weights = [torch.full((3,), 13.0)]
    ema_update_(ema, weights, step=4, decay=0.9, start_step=2, skipped=torch.tensor(0.0))
    # n = 1 step past it: the ramp's decay, min(0.9, 2 / 11), as diffusers' EMAModel's
    torch.testing.assert_close(ema[0], torch.full((3,), 2 / 11 * 2 + 9 / 11 * 13))
    ema_update_(ema, [torch.full((3,), 100.0)], step=5, decay=0.9, start_step=2, skipped=torch.tensor(1.0))
    torch.testing.assert_close(ema[0], torch.full((3,), 11.0))  # a skipped step leaves the EMA alone
    ema_update_(ema, [torch.full((3,), 1.0)], step=10**4, decay=0.9, start_step=2, skipped=torch.tensor(0.0))
    torch.testing.assert_close(ema[0], torch.full((3,), 0.9 * 11 + 0.1 * 1))  # the ramp done: the decay


def test_the_ema_update_never_reads_the_skip_flag_back_to_the_host():
    from torch.profiler import profile

    ema = [torch.zeros(3), torch.zeros(2, dtype=torch.bfloat16)]
    weights = [torch.ones(3), torch.ones(2, dtype=torch.bfloat16)]
    with profile() as prof:
        ema_update_(ema, weights, step=3, decay=0.5, start_step=0, skipped=torch.tensor(0.0))
    syncs = {e.name for e in prof.events()} & {"aten::item", "aten::_local_scalar_dense"}
    assert not syncs, f"a host sync per step: {syncs}"
    # step 3, n = 2: the ramp's decay min(0.5, 3 / 12) = 0.25
    assert torch.equal(ema[0], torch.full((3,), 0.75)) and torch.equal(
        ema[1], torch.full((2,), 0.75, dtype=torch.bfloat16)
    )


def test_ema_tracks_training_and_is_used_for_validation_and_loading(tmp_path):
    module = _module(lr=1e-2, warmup_steps=0, ema_decay=0.5, ema_start_step=0)
    assert not module.ema_warm_start  # from the weights trained: the ramp
    batches = _batches(3, seed=1)
    snapshots = []

    class Snap(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            snapshots.append(pl_module.unet.conv_in.weight.detach().clone())

    trainer = pl.Trainer(
        max_steps=3,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Snap()],
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    # step 1: copy; steps 2, 3: ema = d ema + (1 - d) w, d = min(0.5, (1 + n) / (10 + n)) for n = 1, 2 (the ramp)
    expected = 3 / 12 * (2 / 11 * snapshots[0] + 9 / 11 * snapshots[1]) + 9 / 12 * snapshots[2]
    torch.testing.assert_close(module.ema_unet.conv_in.weight, expected)
    assert not torch.equal(module.ema_unet.conv_in.weight, module.unet.conv_in.weight)
    assert not any(p.requires_grad for p in module.ema_unet.parameters())
    val = _batches(2, seed=9)
    assert module.validation_loss(val, seed=0) == validation_loss(module.ema_unet, module.noise_scheduler, val, seed=0)

    trainer.save_checkpoint(tmp_path / "checkpoint.ckpt", weights_only=False)
    ema = load_model(str(tmp_path))
    assert ema.weights == "ema" and torch.equal(ema.unet.conv_in.weight, module.ema_unet.conv_in.weight)
    raw = load_model(str(tmp_path), weights="raw")
    assert raw.weights == "raw" and torch.equal(raw.unet.conv_in.weight, module.unet.conv_in.weight)
    assert torch.equal(raw.unconditional_caption, torch.zeros(CAPTION_SHAPE))


def test_ema_is_saved_and_restored_across_a_resume(tmp_path):
    batches = _batches(4, seed=2, same=True)  # the same batch every step: a restarted epoch sees the same data
    straight = _module(lr=1e-2, warmup_steps=0, ema_decay=0.7)
    _fit(straight, 4, batches)

    first = _module(lr=1e-2, warmup_steps=0, ema_decay=0.7)
    trainer = _fit(first, 2, batches)
    trainer.save_checkpoint(tmp_path / "checkpoint.ckpt", weights_only=False)
    resumed = _module(lr=1e-2, warmup_steps=0, ema_decay=0.7)
    assert not torch.equal(resumed.ema_unet.conv_in.weight, first.ema_unet.conv_in.weight)
    trainer = _fit(resumed, 4, batches, ckpt_path=str(tmp_path / "checkpoint.ckpt"))
    assert trainer.global_step == 4
    for (name, a), b in zip(
        straight.ema_unet.state_dict().items(), resumed.ema_unet.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7, msg=name)
    assert not torch.allclose(resumed.ema_unet.conv_in.weight, resumed.unet.conv_in.weight)


def test_ema_skips_a_non_finite_step():
    module = _module(lr=1e-3, warmup_steps=0, ema_decay=0.9)
    poisoned = _batches(1, seed=3)[0]
    poisoned = {"latents": poisoned["latents"].clone(), "captions": poisoned["captions"]}
    poisoned["latents"][0, 0, 0, 0] = float("nan")
    before = module.ema_unet.conv_in.weight.clone()
    module.unet.conv_in.weight.data.add_(1.0)  # weights != EMA: an update would move the EMA
    _fit(module, 1, [poisoned])
    assert torch.equal(module.ema_unet.conv_in.weight, before)
