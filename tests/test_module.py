"""The Lightning module, model building and the checkpoint format, on a tiny real UNet (no Ray)."""

import json

import lightning.pytorch as pl
import pytest
import torch
from diffusers import DDPMScheduler, UNet2DConditionModel

from sdtrain.artifacts.checkpoint_format import CheckpointMeta
from sdtrain.artifacts.loading import load_model, read_checkpoint
from sdtrain.config.schema import ModelConfig, TrainConfig
from sdtrain.model.presets import PRESETS
from sdtrain.model.unet import build_unet, noise_scheduler_config, unet_config
from sdtrain.model.validation import validation_loss, validation_sums
from sdtrain.train.module import DiffusionModule
from sdtrain.train.validation import HeldValBatches


def _batches(n=4, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "latents": torch.randn(batch, 4, 16, 16, generator=g).half(),
            "captions": torch.randn(batch, 5, 32, generator=g).half(),
        }
        for _ in range(n)
    ]


def _module(**train):
    model = ModelConfig(preset="tiny")
    torch.manual_seed(0)
    meta = CheckpointMeta("test", unet_config(model), noise_scheduler_config(model), (4, 16, 16), (77, 32))
    return DiffusionModule(build_unet(model), meta.noise_scheduler_config, TrainConfig(**train), meta)


def _fit(module, steps, batches, callbacks=()):
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=list(callbacks),
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    return trainer


def test_training_steps_update_weights_with_warmup():
    module = _module(lr=1e-3, warmup_steps=10)
    before = {k: v.clone() for k, v in module.unet.state_dict().items()}
    trainer = _fit(module, 3, _batches())
    assert trainer.global_step == 3
    changed = [k for k, v in module.unet.state_dict().items() if not torch.equal(v, before[k])]
    assert len(changed) > 0.9 * len(before)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-3 * 3 / 10)
    stats = module.take_window_stats()
    assert torch.isfinite(stats["loss"]) and 0 < stats["loss"].item() < 10 and stats["skipped_steps"].item() == 0
    assert torch.isnan(module.take_window_stats()["loss"])  # the window resets: no steps, no loss


def test_loss_is_noise_prediction_mse_under_the_sd_schedule():
    module = _module()
    assert isinstance(module.noise_scheduler, DDPMScheduler)
    assert module.noise_scheduler.config.clip_sample is False
    assert (module.noise_scheduler.config.beta_start, module.noise_scheduler.config.beta_end) == (0.00085, 0.012)
    assert module.noise_scheduler.config.beta_schedule == "scaled_linear"
    batch = _batches(1)[0]
    loss = module.training_step(batch, 0)
    # Recompute by hand with the step's draws.
    latents = batch["latents"].float()
    noise, t = module.noise_and_timesteps(latents)
    alphas = module.noise_scheduler.alphas_cumprod[t].view(-1, 1, 1, 1)
    noisy = alphas.sqrt() * latents + (1 - alphas).sqrt() * noise
    expected = torch.nn.functional.mse_loss(module.unet(noisy, t, batch["captions"].float()).sample, noise)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_noise_depends_only_on_seed_rank_and_step():
    """What makes a resumed run draw what the uninterrupted one would have drawn."""
    module, other_seed = _module(), _module(seed=1)
    latents = torch.zeros(2, 4, 16, 16)
    torch.manual_seed(123)  # the global RNG plays no part
    first = module.noise_and_timesteps(latents)
    torch.manual_seed(456)
    again = module.noise_and_timesteps(latents)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], other_seed.noise_and_timesteps(latents)[0])


def test_checkpoint_rebuilds_the_model_alone(tmp_path):
    module = _module(lr=1e-3, warmup_steps=1)
    trainer = _fit(module, 2, _batches())
    trainer.save_checkpoint(tmp_path / "checkpoint.ckpt", weights_only=False)
    # weights_only=True loading: no pickled code in the file.
    raw = read_checkpoint(str(tmp_path))
    assert raw["global_step"] == 2 and "optimizer_states" in raw and "lr_schedulers" in raw
    loaded = load_model(str(tmp_path))
    unet, scheduler = loaded.unet, loaded.noise_scheduler
    assert loaded.global_step == 2
    assert scheduler.config.clip_sample is False
    batch = _batches(1, seed=5)[0]
    t = torch.tensor([10, 900])
    module.unet.eval()
    with torch.no_grad():
        want = module.unet(batch["latents"].float(), t, batch["captions"].float()).sample
        got = unet(batch["latents"].float(), t, batch["captions"].float()).sample
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_validation_loss_is_deterministic_and_independent_of_batching():
    module = _module()
    batches = _batches(4, batch=2, seed=3)
    regrouped = [{k: torch.cat([a[k], b[k]]) for k in a} for a, b in zip(batches[::2], batches[1::2], strict=True)]
    first = validation_loss(module.unet, module.noise_scheduler, batches, seed=7)
    assert first == pytest.approx(validation_loss(module.unet, module.noise_scheduler, regrouped, seed=7), rel=1e-6)
    assert first != validation_loss(module.unet, module.noise_scheduler, batches, seed=8)
    assert module.unet.training  # restored after eval


def test_ranks_validation_shares_add_up_to_the_whole_set():
    """Under DDP rank r validates samples r, r+W, ...: the sums all-reduced give the single-process loss."""
    module = _module()
    batches = _batches(3, batch=3, seed=3)  # 9 samples: 3 ranks with shares of 3, 2 ranks with 5 and 4
    whole = validation_loss(module.unet, module.noise_scheduler, batches, seed=7)
    for world_size in (2, 3, 4):
        unet, scheduler = module.unet, module.noise_scheduler
        shares = [validation_sums(unet, scheduler, batches, 7, 1.0, r, world_size) for r in range(world_size)]
        assert [count for _, count in shares] == [len(range(r, 9, world_size)) for r in range(world_size)]
        assert sum(total for total, _ in shares) / 9 == pytest.approx(whole, rel=1e-6)


def test_the_validation_set_is_read_once_and_held_while_it_fits(caplog):
    """After one complete pass the batches come from memory: the same loss, no second read; a set over the limit, a
    pass cut short and a limit of 0 read again."""
    module = _module()
    batches = _batches(3, batch=3, seed=3)
    size = sum(t.nbytes for batch in batches for t in batch.values())
    reads = []

    def read():
        reads.append(1)
        yield from ({k: v.clone() for k, v in batch.items()} for batch in batches)

    held = HeldValBatches(read, limit_bytes=size)
    cut = held()
    next(cut)
    cut.close()  # a validation that raised mid-pass: nothing held
    assert held.held is None and len(reads) == 1
    whole = validation_sums(module.unet, module.noise_scheduler, held(), 7)
    assert len(reads) == 2 and held.held is not None
    for _ in range(2):  # the rows scored are copies: the held tensors stay as read
        assert validation_sums(module.unet, module.noise_scheduler, held(), 7) == whole
    assert len(reads) == 2
    assert whole == validation_sums(module.unet, module.noise_scheduler, batches, 7)

    with caplog.at_level("INFO", logger="sdtrain"):
        too_large = HeldValBatches(read, limit_bytes=size - 1)
        for _ in range(2):
            assert validation_sums(module.unet, module.noise_scheduler, too_large(), 7) == whole
    assert len(reads) == 4 and too_large.held is None
    assert caplog.text.count("it is read again at every validation") == 1
    never = HeldValBatches(read, limit_bytes=0)
    for _ in range(2):
        list(never())
    assert len(reads) == 6 and never.held is None


def test_presets_match_their_sources():
    with torch.device("meta"):
        sd2 = UNet2DConditionModel(**PRESETS["sd2-base"])
    assert sum(p.numel() for p in sd2.parameters()) == 865_910_724  # SD 2 base UNet
    small = PRESETS["small"]  # the Anyscale notebook's UNet
    assert small["block_out_channels"] == (160, 320, 640, 640) and small["cross_attention_dim"] == 1024
    config = unet_config(ModelConfig(preset="small", unet={"cross_attention_dim": 768}))
    assert config["cross_attention_dim"] == 768 and config["block_out_channels"] == [160, 320, 640, 640]
    json.dumps(config)  # plain data: stored in every checkpoint


def test_pretrained_directory_supplies_weights_and_schedule(tmp_path):
    torch.manual_seed(3)
    source = UNet2DConditionModel(**PRESETS["tiny"])
    source.save_pretrained(tmp_path / "unet")
    DDPMScheduler(beta_schedule="linear", clip_sample=False, num_train_timesteps=500).save_pretrained(
        tmp_path / "scheduler"
    )
    model = ModelConfig(preset="tiny", pretrained=str(tmp_path))
    loaded = build_unet(model)
    for (name, a), b in zip(source.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert noise_scheduler_config(model)["num_train_timesteps"] == 500
    bare = ModelConfig(preset="tiny", pretrained=str(tmp_path / "unet"))  # a bare UNet: the shipped schedule
    assert noise_scheduler_config(bare)["num_train_timesteps"] == 1000
    assert unet_config(bare)["block_out_channels"] == [32, 64]


def test_clip_sample_stays_off_whatever_a_scheduler_config_says(tmp_path):
    """DDPMScheduler's default clip_sample=True (taken when a config omits the key) clips predicted
    latents to [-1, 1] and wrecks samples: training, stored configs and samplers all keep it off."""
    from sdtrain.model.unet import build_noise_scheduler
    from sdtrain.sampling.sampler import make_sampler

    DDPMScheduler(clip_sample=True).save_pretrained(tmp_path / "on" / "scheduler")
    (tmp_path / "omitted" / "scheduler").mkdir(parents=True)
    config = json.loads((tmp_path / "on" / "scheduler" / "scheduler_config.json").read_text())
    del config["clip_sample"]
    (tmp_path / "omitted" / "scheduler" / "scheduler_config.json").write_text(json.dumps(config))
    assert DDPMScheduler.from_config(config).config.clip_sample is True  # the trap
    for source in ("on", "omitted"):
        stored = noise_scheduler_config(ModelConfig(preset="tiny", pretrained=str(tmp_path / source)))
        assert stored["clip_sample"] is False, source
    old = {**noise_scheduler_config(ModelConfig(preset="tiny")), "clip_sample": True}  # e.g. an older checkpoint's
    assert build_noise_scheduler(old).config.clip_sample is False
    assert make_sampler(old, "ddim", 5).config.clip_sample is False


class _GradNorms(pl.Callback):
    """Each step's global gradient norm as the optimizer step receives them (clipping scales them inside it)."""

    def __init__(self):
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = [p.grad for p in pl_module.unet.parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))


def test_the_window_reports_the_mean_and_largest_gradient_norm_before_clipping():
    module = _module(lr=1e-3, warmup_steps=0, grad_clip_norm=1e-3)  # clips every step
    watch = _GradNorms()
    _fit(module, 3, _batches(3, seed=4), [watch])
    stats = module.take_window_stats()
    assert len(watch.norms) == 3 and min(watch.norms) > 1e-3
    assert stats["grad_norm"].item() == pytest.approx(sum(watch.norms) / 3, rel=1e-5)
    assert stats["grad_norm_max"].item() == pytest.approx(max(watch.norms), rel=1e-5)
    empty = module.take_window_stats()  # the window resets
    assert torch.isnan(empty["grad_norm"]) and torch.isnan(empty["grad_norm_max"])


def test_a_non_finite_step_is_skipped_entirely_and_counted():
    module = _module(lr=1e-3, warmup_steps=0)
    good = _batches(3, seed=1)
    poisoned = {"latents": good[1]["latents"].clone(), "captions": good[1]["captions"]}
    poisoned["latents"][0, 0, 0, 0] = float("nan")
    before = {k: v.clone() for k, v in module.unet.state_dict().items()}
    trainer = _fit(module, 2, [poisoned, poisoned])
    assert trainer.global_step == 2
    for name, value in module.unet.state_dict().items():  # no update, not even weight decay
        assert torch.equal(value, before[name]), name
    (state,) = [trainer.optimizers[0].state[p] for p in list(module.unet.parameters())[:1]]
    assert state["step"].item() == 0 and torch.count_nonzero(state["exp_avg"]) == 0  # optimizer state untouched
    stats = module.take_window_stats()
    assert stats["skipped_steps"].item() == 2 and stats["longest_bad_streak"].item() == 2 and torch.isnan(stats["loss"])
    assert torch.isnan(stats["grad_norm"]) and torch.isnan(stats["grad_norm_max"])  # no finite step: no norm

    trainer = _fit(module, 2, [poisoned, good[0]])  # one bad step, then a good one that does update
    stats = module.take_window_stats()
    assert (
        stats["skipped_steps"].item() == 1 and stats["longest_bad_streak"].item() == 3
    )  # 2 + 1 consecutive, across windows
    assert 0 < stats["grad_norm"].item() == stats["grad_norm_max"].item() < float("inf")  # the good step's alone
    assert not torch.equal(module.unet.conv_in.weight, before["conv_in.weight"])
    assert torch.isfinite(module.unet.conv_in.weight).all()


def test_a_resume_into_another_model_is_refused_naming_the_keys_before_any_weight_loads(tmp_path):
    """A run re-run under its run.name with the EMA turned on or the UNet changed: Lightning would fail in
    load_state_dict with tensor names, not sdtrain's error, so Ray Train would restart the workers on it until
    failure.max_failures was spent. The checkpoint's own metadata and weights say what changed, as it loads."""
    from conftest import tiny_config
    from support.training import FIT, batches, fit

    from sdtrain.errors import ConfigError, find_sdtrain_error

    _, trainer, _ = fit(tiny_config(*FIT), batches(3), default_root_dir=str(tmp_path))
    trainer.save_checkpoint(tmp_path / "plain.ckpt")

    def resume(*overrides):
        config = tiny_config(*FIT, *overrides, "train.max_steps=5")
        return fit(config, batches(5), ckpt_path=str(tmp_path / "plain.ckpt"), default_root_dir=str(tmp_path))

    for overrides, named in (
        (["train.ema_decay=0.999"], r"its EMA \(train\.ema_decay was null, now 0\.999\)"),
        (["model.unet={layers_per_block: 2}"], r"its UNet \(model\.unet\)"),
    ):
        with pytest.raises(ConfigError, match=rf"^the run's latest checkpoint was trained with another model: {named}"):
            resume(*overrides)
    with pytest.raises(Exception) as refused:  # as Ray Train's controller sees it: ours, so no restart is spent
        resume("train.ema_decay=0.999")
    assert isinstance(find_sdtrain_error(refused.value), ConfigError)
    _, trainer, steps = resume()
    assert trainer.global_step == 5 and [s["step"] for s in steps] == [4, 5]  # the same model resumes
