"""Every option the train config accepts, trained for real: the module and Trainer settings a Ray
worker builds (sdtrain.train.build.build_training), in a Lightning Trainer on CPU, tiny UNet.

What torch cannot run on a CPU is refused by config validation (tests/test_config.py) or trained
on a GPU by tests/test_gpu.py (``pytest -m gpu``); the Ray runs of tests/test_train_ray.py add
2-worker DDP and FSDP over gloo.
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from conftest import tiny_config
from lightning.pytorch.plugins.precision import MixedPrecision
from support.tiny_models import write_tiny_sd_model
from support.training import CAPTIONS, FIT, HOST_SYNCS, LATENTS, Watch, batches, fit
from torch.distributed.tensor import DTensor

from sdtrain.config.loader import load_config
from sdtrain.sampling.captions import Captions
from sdtrain.train.build import build_training, checkpoint_meta, fit_without_ray
from sdtrain.train.cadence import OptimizerStepCallback, ReportCadence
from sdtrain.train.device_settings import training_autocast
from sdtrain.train.reporting import StepReporter
from sdtrain.train.sample_grids import SampleGrids
from sdtrain.train.strategy import CompiledGraphs, fsdp_units
from sdtrain.train.validation import Validation


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("ema", [None, 0.9])
@pytest.mark.parametrize("clip", [0.0, 0.01])
@pytest.mark.parametrize("precision", ["auto", "32-true", "bf16-mixed"])
def test_every_precision_with_and_without_clipping_and_ema_trains_under_each_strategy(
    precision, clip, ema, strategy, tmp_path
):
    """Every combination of the options that meet in the optimizer step (16-mixed: GPUs only, below
    and in tests/test_gpu.py); FSDP in one process over gloo."""
    cfg = tiny_config(
        *FIT,
        f"train.precision={precision}",
        f"train.grad_clip_norm={clip}",
        f"train.ema_decay={ema or 'null'}",
        f"train.strategy={strategy}",
    )
    module, trainer, steps = fit(cfg, batches(3), default_root_dir=str(tmp_path))
    assert isinstance(module.unet.conv_in.weight, DTensor) == (strategy == "fsdp")
    assert trainer.global_step == 3 and [s["step"] for s in steps] == [1, 2, 3]
    assert trainer.precision == ("32-true" if precision == "auto" else precision)
    assert all(0 < s["loss"] < 10 for s in steps)
    assert not torch.equal(steps[0]["weight"], steps[-1]["weight"])
    if clip:  # the natural norm of these gradients is well above 0.01 (see the unclipped runs)
        assert all(s["grad_norm"] <= clip * 1.001 for s in steps)
    else:
        assert all(s["grad_norm"] > 0.05 for s in steps)
    if ema:
        assert not torch.equal(steps[0]["ema"], steps[-1]["ema"])
        assert not torch.equal(steps[-1]["ema"], steps[-1]["weight"])  # an average, not a copy


class ClippedReference(pl.Callback):
    """Before each optimizer step (callbacks' hooks run before the module's, so the gradients are not clipped yet):
    the step torch's own clipping and a fused AdamW without grad_scale take from the same weights, gradients and
    state; after it, how far the module's weights are from that."""

    def __init__(self, clip):
        self.clip, self.expected, self.differences = clip, None, []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        params = [torch.nn.Parameter(p.detach().clone()) for p in module.unet.parameters()]
        for twin, p in zip(params, module.unet.parameters(), strict=True):
            twin.grad = p.grad.detach().clone()
        reference = torch.optim.AdamW(params, lr=optimizer.param_groups[0]["lr"], weight_decay=0.01, fused=True)
        reference.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # loading shares the state's tensors
        torch.nn.utils.clip_grad_norm_(params, self.clip)
        reference.step()
        self.expected = params

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.differences.append(
            max((p - e).abs().max().item() for p, e in zip(module.unet.parameters(), self.expected, strict=True))
        )


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_clipping_in_the_fused_step_is_torchs_clipping_then_the_step(precision):
    """The clipping factor goes to the fused AdamW as its grad_scale (one pass over the gradients less): each step's
    weights are what clip_grad_norm_ and a plain fused step give, within float32 rounding of g / (1 / f) against
    g * f. The clip is far below the gradients' norm, so every step clips."""
    cfg = tiny_config(*FIT, f"train.precision={precision}", "train.grad_clip_norm=0.01", "train.weight_decay=0.01")
    reference = ClippedReference(0.01)
    module, trainer, steps = fit(cfg, batches(3), callbacks=[reference])
    assert trainer.global_step == 3 and all(s["grad_norm"] <= 0.01 * 1.001 for s in steps)
    assert not torch.equal(steps[0]["weight"], steps[-1]["weight"])
    assert len(reference.differences) == 3 and max(reference.differences) < 1e-6, reference.differences


class AutocastSeen(pl.Callback):
    """The autocast state (enabled, dtype) on the CPU at each forward of the EMA UNet."""

    def __init__(self):
        self.seen = []

    def on_fit_start(self, trainer, pl_module):
        pl_module.ema_unet.register_forward_pre_hook(
            lambda *_: self.seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        )


def test_a_nan_step_under_bf16_with_clipping_and_ema_is_skipped_entirely(tmp_path):
    """And the EMA is validated, and sampled for a grid, under the training step's bf16 autocast
    (sdtrain.train.device_settings.training_autocast), as a Ray worker does."""
    cfg = tiny_config(
        *FIT,
        "train.precision=bf16-mixed",
        "train.grad_clip_norm=1.0",
        "train.ema_decay=0.9",
        "sample_grid.rows=2",
        "sample_grid.columns=1",
        "sample_grid.steps=2",
    )
    val = batches(2)
    validation = Validation(ReportCadence(cfg), lambda: val, cfg.train.seed, lambda phase: None)
    seen = AutocastSeen()
    module, trainer, steps = fit(cfg, batches(3, nan_at=[1]), callbacks=[validation, seen])
    assert seen.seen == [(True, torch.bfloat16)] * 2  # the validation's 2 batches
    captions = Captions(val[0]["captions"], ["a", "b"])
    grids = SampleGrids(
        cfg,
        checkpoint_meta(cfg, LATENTS, CAPTIONS),
        captions,
        str(tmp_path),
        torch.zeros(CAPTIONS),
        autocast=lambda: training_autocast(trainer),
    )
    assert grids.sample(module.eval_unet, 3).image.shape[-1] == 3
    assert seen.seen == [(True, torch.bfloat16)] * 4  # and the grid's 2 denoising steps
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = module.validation_loss(val, cfg.train.seed)
    assert validation.take(3) == under_autocast != module.validation_loss(val, cfg.train.seed)
    assert trainer.global_step == 3
    assert [s["skipped"] for s in steps] == [0, 1, 1] and steps[-1]["streak"] == 1
    assert torch.equal(steps[1]["weight"], steps[0]["weight"])  # no update from the NaN step
    assert torch.equal(steps[1]["ema"], steps[0]["ema"])  # and the EMA did not average it in
    assert not torch.equal(steps[2]["weight"], steps[1]["weight"])
    assert torch.isfinite(steps[2]["weight"]).all() and torch.isfinite(steps[2]["ema"]).all()


def test_a_gradscaler_overflow_is_skipped_without_counting_as_a_bad_step():
    """16-mixed's path (GPUs only in a config): fp16 autocast with a GradScaler, here on CPU with the
    plugin Lightning builds on GPUs. A huge initial scale overflows step 1; the scaler skips it and
    lowers the scale. The module unscales before clipping, and the EMA leaves the step out too."""
    cfg = tiny_config(*FIT, "train.grad_clip_norm=0.01", "train.ema_decay=0.9", "train.ema_start_step=0")
    module, trainer_kwargs = build_training(cfg, checkpoint_meta(cfg, LATENTS, CAPTIONS), use_gpu=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30, backoff_factor=2.0**-20)
    trainer_kwargs.update(precision=None, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    initial = (module.unet.conv_in.weight.detach().clone(), module.ema_unet.conv_in.weight.detach().clone())
    watch = Watch()
    trainer = pl.Trainer(callbacks=[watch], **trainer_kwargs)
    trainer.fit(module, torch.utils.data.DataLoader(batches(3), batch_size=None))
    steps = watch.steps
    assert trainer.global_step == 3 and scaler.get_scale() == 2.0**10
    assert [s["skipped"] for s in steps] == [1, 1, 1] and steps[-1]["streak"] == 0  # the scaler's business
    assert torch.equal(steps[0]["weight"], initial[0]) and torch.equal(steps[0]["ema"], initial[1])
    assert not torch.equal(steps[2]["weight"], steps[0]["weight"])
    assert all(s["grad_norm"] <= 0.01 * 1.001 for s in steps[1:])  # clipped after unscaling


@pytest.mark.parametrize(
    "options",
    [
        ("train.channels_last=true",),
        ("train.gradient_checkpointing=true",),
        ("train.attention=eager",),
        ("train.strategy=fsdp", "train.gradient_checkpointing=true", "train.attention=eager"),
    ],
)
def test_each_gpu_option_trains_the_same_function(options, plain_first_loss, tmp_path):
    """channels_last, checkpointing, the eager kernel and FSDP (one process) change how, not what:
    the first step's loss is the plain run's, and training goes on."""
    _, trainer, steps = fit(tiny_config(*FIT, *options), batches(3), default_root_dir=str(tmp_path))
    assert trainer.global_step == 3 and all(0 < s["loss"] < 10 for s in steps)
    assert steps[0]["loss"] == pytest.approx(plain_first_loss, rel=1e-4)


@pytest.fixture(scope="module")
def plain_first_loss() -> float:
    """The first step's loss of the plain run (no option), the same for every option above: fitted once."""
    _, _, plain = fit(tiny_config(*FIT), batches(3))
    return plain[0]["loss"]


class ReportRows(StepReporter):
    """The worker's reporter, its rows kept instead of sent to Ray Train (none here): what each report would send."""

    def __init__(self, config):
        super().__init__(ReportCadence(config), config.train, None, [], lambda: 0.0, 0.0)  # type: ignore[arg-type]
        self.rows = []

    def _report(self, trainer, pl_module, step, with_checkpoint):
        self.rows.append(self._metrics(trainer, pl_module, step, 0))
        self._reported_step = step


class Graphs(OptimizerStepCallback):
    """Dynamo's counters after each optimizer step: graphs compiled so far and graph breaks; and the validation loss
    every ``validate_every`` steps (the EMA's weights, as the worker's validation computes it)."""

    def __init__(self, batches, validate_every):
        self.batches, self.validate_every, self.after, self.validations = batches, validate_every, {}, []

    def on_step(self, trainer, module, step):
        from torch._dynamo.utils import counters

        self.after[step] = (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))
        if step % self.validate_every == 0:
            self.validations.append(module.validation_loss(self.batches, seed=0))


@pytest.mark.slow
def test_compiled_training_with_every_other_option_compiles_once_and_matches_eager(tmp_path, monkeypatch):
    """torch.compile of the FSDP-sharded, checkpointed UNet with an EMA, caption dropout and accumulation, over 12
    steps: 6, a checkpoint, then a restart from it for 6 more, validated every 3. Dynamo's counters: no graph break
    anywhere, and no graph compiled after each fit's first step (no recompile from validation, the EMA, dropout,
    accumulation or the checkpoint). Against the plain eager run (channels_last is compiled on the GPU by
    tests/test_gpu.py; FSDP refuses it). The captions are token ids, which the frozen text encoder turns into
    embeddings in each step, outside the compiled UNet (sdtrain.model.token_captions).

    On the aot_eager backend: dynamo traces, guards, caches and breaks as under inductor, which is what the
    counters check, and AOTAutograd splits forward from backward, the checkpointed regions included; what it
    skips is inductor's C++ compiles (minutes on 2 cores, for each fit). Inductor compiles the FSDP units in bf16
    in tests/test_sdxl.py's shipped SDXL config, and the whole DDP UNet in the shipped GPU configs' test below."""
    from torch._dynamo.utils import counters

    compile_with_backend(monkeypatch, "aot_eager")
    model = write_tiny_sd_model(str(tmp_path / "tiny-sd"))
    g = torch.Generator().manual_seed(0)
    data = [
        {"latents": torch.randn(2, *LATENTS, generator=g), "captions": torch.randint(0, 300, (2, 77), generator=g)}
        for _ in range(4)
    ]
    options = (
        "train.compile=true",
        "train.strategy=fsdp",
        "train.gradient_checkpointing=true",
        "train.ema_decay=0.9",
        "train.precision=bf16-mixed",
        "train.caption_dropout_prob=0.3",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
    )
    with_ids = dict(caption_shape=(77, 32), text_encoder=model)
    counters.clear()
    first = Graphs(data[:2], validate_every=3)
    module, trainer, steps = fit(
        tiny_config(*FIT, *options, steps=6), data, callbacks=[first], default_root_dir=str(tmp_path), **with_ids
    )
    trainer.save_checkpoint(tmp_path / "step6.ckpt")
    # Under FSDP each unit's forward is compiled (strategy.compile_unet), the hooks left outside the graphs.
    units = fsdp_units(module.unet)
    assert module.caption_encoder is not None and units and all("forward" in vars(unit) for unit in units)
    assert trainer.global_step == 6 and isinstance(module.unet.conv_in.weight, DTensor)
    graphs, breaks = first.after[1]  # one graph per distinct input shape of a unit
    assert graphs >= 1 and breaks == 0, "\n".join(counters["graph_break"])
    assert first.after[6] == (graphs, 0), first.after  # nothing compiled after step 1, nothing broken
    assert len(first.validations) == 2 and all(0 < v < 10 for v in first.validations)

    restart = Graphs(data[:2], validate_every=3)
    resumed, trainer, more = fit(
        tiny_config(*FIT, *options, steps=12),
        data,
        callbacks=[restart],
        ckpt_path=str(tmp_path / "step6.ckpt"),
        default_root_dir=str(tmp_path),
        **with_ids,
    )
    assert trainer.global_step == 12 and min(restart.after) == 7
    after_restart, breaks = restart.after[7]
    assert breaks == 0 and restart.after[12] == (after_restart, 0), restart.after
    assert len(restart.validations) == 2 and all(0 < v < 10 for v in restart.validations)
    _, _, eager = fit(tiny_config(*FIT, *options[3:], steps=2), data, **with_ids)
    assert steps[0]["loss"] == pytest.approx(eager[0]["loss"], rel=2e-2)
    assert all(0 < s["loss"] < 10 for s in steps + more)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_checkpoint_written_under_bf16_resumes_to_the_uninterrupted_weights(tmp_path, strategy):
    """Same batch every step, so the data position plays no part: 2 steps, save, resume to 4 equals 4
    straight, bitwise. FSDP (one process, gloo) writes the same full file as DDP."""
    options = ("train.precision=bf16-mixed", "train.ema_decay=0.9", f"train.strategy={strategy}")
    data = batches(4, same=True)
    _, trainer, _ = fit(tiny_config(*FIT, *options, steps=2), data, default_root_dir=str(tmp_path))
    trainer.save_checkpoint(tmp_path / "step2.ckpt")
    resumed, trainer, steps = fit(
        tiny_config(*FIT, *options, steps=4),
        data,
        ckpt_path=str(tmp_path / "step2.ckpt"),
        default_root_dir=str(tmp_path),
    )
    straight, _, _ = fit(tiny_config(*FIT, *options, steps=4), data, default_root_dir=str(tmp_path))
    assert trainer.global_step == 4 and [s["step"] for s in steps] == [3, 4]
    assert (
        isinstance(resumed.unet.conv_in.weight, DTensor)
        == isinstance(resumed.ema_unet.conv_in.weight, DTensor)
        == (strategy == "fsdp")
    )
    for name, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name
    saved = torch.load(tmp_path / "step2.ckpt", weights_only=True)
    assert any(k.startswith("unet.") for k in saved["state_dict"]) and any(
        k.startswith("ema_unet.") for k in saved["state_dict"]
    )
    assert all(type(v) is torch.Tensor for v in saved["state_dict"].values())  # full tensors: DDP's format


SHIPPED_GPU_CONFIGS = ("small.yaml", "sd2-base.yaml", "retrain.yaml")
GPU_OPTIONS = (
    "precision",
    "compile",
    "strategy",
    "channels_last",
    "gradient_checkpointing",
    "attention",
    "grad_clip_norm",
    "ema_decay",
    "fsdp_param_dtype",
    "snr_gamma",
    "noise_offset",
    "caption_dropout_prob",
)


# The latent shapes of two aspect-ratio buckets: the tiny UNet halves a side once, so every side is even.
BUCKETS = (LATENTS, (4, 12, 20))


def shipped_gpu_options() -> tuple[list[str], int]:
    """The train options of every shipped GPU config, as overrides (they share one set, so one compiled fit covers
    them all; precision auto as a GPU with bf16 resolves it), and the accumulation of its nodes' micro-batches."""
    from conftest import REPO

    shipped = [
        load_config(
            REPO / "configs" / name, ["data.train=/unused", "retrain.data_root=null", "retrain.models_root=null"]
        )
        for name in SHIPPED_GPU_CONFIGS
    ]
    options = {tuple(getattr(config.train, key) for key in GPU_OPTIONS) for config in shipped}
    assert len(options) == 1, options  # one compiled fit covers every shipped config
    train = shipped[0].train
    assert train.compile and train.precision == "auto" and train.grad_clip_norm > 0
    assert all(config.scaling.use_gpu is True for config in shipped)
    (values,) = options
    overrides = [
        f"train.{key}={'null' if value is None else value}" for key, value in zip(GPU_OPTIONS, values, strict=True)
    ]
    overrides[0] = "train.precision=bf16-mixed"  # auto on a GPU with bf16 (sdtrain.train.build.resolve_precision)
    accumulation = shipped[0].batch_layout(shipped[0].scaling.max_workers).accumulation
    assert accumulation > 1
    return overrides, accumulation


@pytest.mark.slow  # inductor's CPU backend compiles the tiny UNet's step: over a minute cold on 2 cores
@pytest.mark.timeout(900)
def test_the_shipped_gpu_configs_options_train_inductor_compiled_without_a_graph_break(tmp_path):
    """What a GPU worker of each shipped config runs, but the tiny UNet on CPU and inductor's CPU backend: its train
    options as they are (compile on, the clipping folded into the fused AdamW, ...), micro-batches accumulated as on
    its nodes (train.gradient_compression, DDP's hook between ranks, is test_ddp_settings'). Two steps of one shape:
    the forward and backward compile in the first micro-batch, with no graph break, and nothing compiles after
    (accumulation, the optimizer step and the clipping do not recompile). Each further shape costs another minute
    of C++ compiles, so a graph set per aspect-ratio bucket is the next test's, on dynamo's eager backend. The first
    micro-batch's loss, computed before any update, is an eager fit's of the same batches."""
    from torch._dynamo.utils import counters

    overrides, accumulation = shipped_gpu_options()
    layout = (f"train.global_batch_size={2 * accumulation}", "train.micro_batch_size=2")
    counters.clear()
    graphs = Graphs(batches(1), validate_every=100)
    data = batches(2 * accumulation)
    cfg = tiny_config(*FIT, *overrides, *layout, steps=2)
    module, trainer, steps = fit(cfg, data, callbacks=[graphs], default_root_dir=str(tmp_path))
    assert trainer.global_step == 2 and trainer.precision == "bf16-mixed"
    assert module.unet._compiled_call_impl is not None  # nn.Module.compile: the whole UNet
    compiled, breaks = graphs.after[1]
    assert compiled >= 1 and breaks == 0, "\n".join(counters["graph_break"])
    assert graphs.after[2] == (compiled, 0), graphs.after
    assert all(0 < s["loss"] < 10 for s in steps) and not torch.equal(steps[0]["weight"], steps[-1]["weight"])
    _, _, eager = fit(tiny_config(*FIT, *overrides, *layout, "train.compile=false", steps=1), data)
    assert steps[0]["loss"] == pytest.approx(eager[0]["loss"], rel=2e-2)


def test_the_shipped_gpu_configs_options_compile_one_graph_set_a_bucket(tmp_path, caplog, monkeypatch):
    """The shipped configs' options (the test above) on two aspect-ratio buckets, a step's micro-batches all of one
    bucket as the bucketed reader makes them, four steps (each bucket twice), on dynamo's eager backend, which traces,
    guards and caches as inductor does. Dynamo's counters: no graph break; one static graph set per bucket shape,
    compiled in that bucket's first micro-batch, and nothing compiled after (a bucket met again does not recompile);
    the limit is raised to hold them (sdtrain.train.strategy), and the log says how many shapes there are and how
    many graphs were compiled. The report rows count each window's graphs, a bucket's first step's."""
    from torch._dynamo.utils import counters

    runs = compile_with_eager_backend(monkeypatch)
    overrides, accumulation = shipped_gpu_options()
    cfg = tiny_config(
        *FIT,
        *overrides,
        f"train.global_batch_size={2 * accumulation}",
        "train.micro_batch_size=2",
        "run.log_every_n_steps=1",
        steps=4,
    )
    g = torch.Generator().manual_seed(0)
    data = [
        {"latents": torch.randn(2, *BUCKETS[step % 2], generator=g), "captions": torch.randn(2, *CAPTIONS, generator=g)}
        for step in range(4)
        for _ in range(accumulation)
    ]
    counters.clear()
    graphs = Graphs(batches(1), validate_every=100)
    reports = ReportRows(cfg)
    with caplog.at_level("INFO", logger="sdtrain"):
        module, trainer, steps = fit(
            cfg,
            data,
            callbacks=[graphs, CompiledGraphs(), reports],
            bucket_shapes=[list(shape) for shape in BUCKETS],
            default_root_dir=str(tmp_path),
        )
    assert trainer.global_step == 4 and module.unet._compiled_call_impl is not None
    assert [graphs.after[step][1] for step in range(1, 5)] == [0] * 4, "\n".join(counters["graph_break"])
    compiled = [graphs.after[step][0] for step in range(1, 5)]
    # Step 1 compiled the first bucket's graphs in its first micro-batch, its other micro-batches nothing.
    assert compiled[0] >= 1 and compiled[:2] == [compiled[0], 2 * compiled[0]], compiled
    assert compiled[2:] == [compiled[1]] * 2, compiled
    assert runs == [(2, *BUCKETS[step % 2]) for step in range(4) for _ in range(accumulation)]  # all compiled
    assert [row["graphs_compiled"] for row in reports.rows] == [compiled[0]] * 2 + [0] * 2, reports.rows
    assert "train.compile: 2 bucket shapes, one static graph each" in caplog.text
    assert f"train.compile: rank 0 compiled {compiled[3]} graphs in all, with 0 graph breaks" in caplog.text
    assert all(0 < s["loss"] < 10 for s in steps) and not torch.equal(steps[0]["weight"], steps[-1]["weight"])


def compile_with_eager_backend(monkeypatch) -> list[tuple[int, ...]]:
    """nn.Module.compile (strategy.compile_unet's, options unchanged) with dynamo's eager backend: traced, guarded and
    cached as inductor's, without its C++ compiles. Returns the input shape of each run of a compiled graph."""
    runs = []

    def counting_eager(graph, example_inputs):
        def run(*args):
            runs.append(tuple(args[0].shape))  # the UNet's graphs take the latents first
            return graph.forward(*args)

        return run

    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(
        torch.nn.Module, "compile", lambda self, **kw: compile_module(self, backend=counting_eager, **kw)
    )
    return runs


def compile_with_backend(monkeypatch, backend: str) -> None:
    """Every torch.compile in the test on ``backend``, its other options unchanged: strategy.compile_unet's of each
    FSDP unit's forward, and nn.Module.compile's (which calls torch.compile) of a whole UNet."""
    compile_fn = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model=None, **kw: compile_fn(model, **{**kw, "backend": backend}))


def test_validation_and_the_sample_grid_run_a_compiled_unet_eager_past_its_recompile_limit(
    tmp_path, monkeypatch, request
):
    """Without an EMA, validation and the sample grid run the compiled training UNet (module.eval_unet) in eval mode
    under no_grad, at every (N, H, W) data.val holds: compiled, each is one more static graph, and past the limit
    strategy.compile_unet sets (buckets + 8) fullgraph=True makes dynamo raise FailOnRecompileLimitHit, which ended
    such a run at its first validation. They run it eager (strategy.uncompiled): nothing compiled, no compiled graph
    run, and every training step, validated after or not, runs its bucket's graph. Dynamo's eager backend (inductor:
    the slow tests above), which traces, guards and caches as on a GPU, counting its graphs' runs."""
    from torch._dynamo.utils import counters

    runs = compile_with_eager_backend(monkeypatch)
    # torch's default, whatever earlier tests raised; through dynamo's own patch (monkeypatch's undo hid the key from
    # dynamo's config module, and the next compile in the session failed on it).
    limit = torch._dynamo.config.patch(recompile_limit=8)
    limit.__enter__()
    request.addfinalizer(lambda: limit.__exit__(None, None, None))
    buckets = (LATENTS, (4, 12, 20))
    cfg = tiny_config(
        *FIT,
        "train.compile=true",
        "run.log_every_n_steps=1",
        "run.val_every_n_steps=1",  # validated after every step: the next step must still run its graph
        "sample_grid.rows=2",
        "sample_grid.columns=1",
        "sample_grid.steps=2",
        steps=3,
    )
    g = torch.Generator().manual_seed(0)
    data = [
        {"latents": torch.randn(2, *buckets[step % 2], generator=g), "captions": torch.randn(2, *CAPTIONS, generator=g)}
        for step in range(3)
    ]
    sizes = ((16, 16), (12, 20), (8, 16), (20, 8))
    val = [
        {"latents": torch.randn(n, 4, h, w, generator=g), "captions": torch.randn(n, *CAPTIONS, generator=g)}
        for n in (1, 2, 3)
        for h, w in sizes
    ]
    assert len(val) > len(buckets) + 8  # more (N, H, W) than the limit holds
    validation = Validation(ReportCadence(cfg), lambda: val, cfg.train.seed, lambda phase: None)
    graphs = Graphs(val, validate_every=100)  # before validation's callback: the counters of the steps alone
    counters.clear()
    module, trainer, steps = fit(
        cfg,
        data,
        callbacks=[graphs, validation],
        bucket_shapes=[list(shape) for shape in buckets],
        default_root_dir=str(tmp_path),
    )
    assert trainer.global_step == 3 and module.eval_unet is module.unet and module.unet._compiled_call_impl is not None
    assert 0 < validation.take(3) < 10
    per_bucket = graphs.after[1][0]
    assert per_bucket >= 1 and graphs.after[3] == (2 * per_bucket, 0), graphs.after
    assert counters["stats"]["unique_graphs"] == 2 * per_bucket  # validations compiled nothing
    assert runs == [(2, *buckets[step % 2]) for step in range(3)]  # every step compiled, no validation batch

    grids = SampleGrids(
        cfg,
        checkpoint_meta(cfg, LATENTS, CAPTIONS),
        Captions(torch.randn(2, *CAPTIONS, generator=g), ["a", "b"]),
        str(tmp_path),
        torch.zeros(CAPTIONS),
    )
    assert grids.sample(module.eval_unet, 3).image.shape[-1] == 3
    assert counters["stats"]["unique_graphs"] == 2 * per_bucket and len(runs) == 3  # nor did the grid


class HostSyncs(pl.Callback):
    """Every op dispatched from the start to the end of each micro-batch (the forward, the backward, clipping, the
    skip check, the fused AdamW, the EMA) by a TorchDispatchMode; records those that read a value to the host."""

    def __init__(self):
        self.ops, self.syncs, self.seen = 0, [], set()

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        from torch.utils._python_dispatch import TorchDispatchMode

        callback = self

        class Detector(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                callback.ops += 1
                callback.seen.add(str(func.overloadpacket))
                if str(func.overloadpacket) in HOST_SYNCS:
                    import traceback

                    callback.syncs.append((trainer.global_step, str(func), "".join(traceback.format_stack(limit=8))))
                return func(*args, **(kwargs or {}))

        self.mode = Detector()
        self.mode.__enter__()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.mode.__exit__(None, None, None)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_training_step_reads_nothing_back_to_the_host(strategy, tmp_path):
    """No data-dependent host sync in a step with every option that works on the device's values (bf16, clipping,
    the non-finite skip, EMA, caption dropout, min-SNR, offset noise, accumulation): what the reporter reads at its
    log steps (sdtrain.train.reporting) is the only wait a GPU sees. Between micro-batches, where only a distributed
    run communicates, test_ddp_settings' ranks check the same."""
    cfg = tiny_config(
        *FIT,
        "train.precision=bf16-mixed",
        "train.grad_clip_norm=1.0",
        "train.ema_decay=0.9",
        "train.caption_dropout_prob=0.5",
        "train.snr_gamma=5.0",
        "train.noise_offset=0.05",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        f"train.strategy={strategy}",
        steps=4,
    )
    detector = HostSyncs()  # alone: the other tests' Watch reads the weights and the loss to the host
    module, trainer = fit_without_ray(
        cfg,
        batches(8, nan_at=(5,)),
        checkpoint_meta(cfg, LATENTS, CAPTIONS),
        use_gpu=False,
        callbacks=[detector],
        default_root_dir=str(tmp_path),
    )
    assert trainer.global_step == 4 and module.skipped_steps.item() == 1  # the NaN micro-batch's step: skipped
    # The detector saw the whole step: forward, backward, the fused AdamW and the EMA's update.
    assert {"aten.convolution", "aten.convolution_backward", "aten._fused_adamw_", "aten._foreach_lerp_"} <= (
        detector.seen
    ), sorted(detector.seen)
    assert detector.syncs == [], "".join(f"step {step}: {func} at\n{stack}" for step, func, stack in detector.syncs[:3])
