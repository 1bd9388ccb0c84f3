"""DDP and FSDP2 as sdtrain sets them (sdtrain.train.strategy), in two real gloo processes without Ray:

- per-rank statistic buffers stay per rank, so what the reporter all-reduces is every rank's, not rank 0's copied
  everywhere;
- train.gradient_compression=bf16 all-reduces half the bytes of float32 and still trains;
- FSDP2's mixed-precision policy (bf16 all-gather, float32 reduce-scatter under bf16-mixed) trains, and with
  gradient accumulation reduce-scatters once per optimizer step, not per micro-batch, to the weights DDP reaches.

Collectives are counted as the c10d ops they dispatch (a TorchDispatchMode sees DDP's and FSDP2's, also from the
backward pass), with their tensors' dtype and bytes: what goes on the wire; and where the step was (micro-batch,
forward or backward), which holds tools/performance_model.py's communication model to what the ranks did: DDP
all-reduces only in the last micro-batch's backward, one bucket in the first step and the model's buckets after
(cut at the cap's float32 bytes, sent at their wire size), FSDP2 gathers in every micro-batch. Host syncs are
counted too (support.training.HOST_SYNCS: what ``.item()``, ``float()`` and ``bool()`` of a tensor dispatch): on a
GPU each one waits for the queue to empty. Each rank trains in a thread of its own, as Ray Train runs a worker's
function.
"""

import gc
import os
import tempfile
import threading
from collections import Counter

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import tiny_config
from support.training import CAPTIONS, FIT, HOST_SYNCS, LATENTS, batches
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from sdtrain.config.schema import TrainConfig
from sdtrain.train.build import build_training, checkpoint_meta
from sdtrain.train.strategy import DDP_KWARGS, bf16_compress, build_strategy, ddp_kwargs


class _Counting(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.register_buffer("counter", torch.zeros(()), persistent=False)  # as DiffusionModule's statistics

    def forward(self, x):
        self.counter += 1 + 10 * dist.get_rank()  # rank 0 counts 1 a step, rank 1 counts 11
        return self.linear(x).sum()


def _counters(rank: int) -> dict[str, list[float]]:
    """Each rank's counter after 3 steps, under sdtrain's DDP settings and torch's defaults."""
    out = {}
    for name, kwargs in (("sdtrain", DDP_KWARGS), ("torch", {})):
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(_Counting(), **kwargs)
        for _ in range(3):
            model(torch.ones(2, 4)).backward()
        counters = [torch.zeros(()) for _ in range(2)]
        dist.all_gather(counters, model.module.counter)
        out[name] = [float(c) for c in counters]
    return out


class _Collectives(TorchDispatchMode):
    """The c10d collectives dispatched while active: calls and bytes of their first tensor, by (op, dtype); and each
    one in order with where the step was (``where``: micro-batch and pass, set by :class:`_Where`)."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()
        self.where = (-1, "setup")
        self.events: list[tuple[int, str, str, int]] = []  # (micro-batch, pass, op, bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if str(func.overloadpacket) in HOST_SYNCS:
            self.events.append((*self.where, "host sync", 0))
        elif name.startswith("c10d."):
            tensor = args[0]
            while isinstance(tensor, (list, tuple)):  # the ops take tensors, lists or lists of lists
                tensor = tensor[0]
            key = (name.removeprefix("c10d.").removesuffix(".default").strip("_"), str(tensor.dtype).split(".")[1])
            self.calls[key] += 1
            self.bytes[key] += tensor.nbytes
            self.events.append((*self.where, key[0], tensor.nbytes))
        return func(*args, **(kwargs or {}))


class _Where(pl.Callback):
    """Tells the counter which micro-batch and pass the step is in: forward (from the batch's start), backward (from
    Lightning's on_before_backward), after (clipping, the optimizer step)."""

    def __init__(self, collectives: _Collectives):
        self.collectives = collectives

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.collectives.where = (batch_idx, "forward")

    def on_before_backward(self, trainer, module, loss):
        self.collectives.where = (self.collectives.where[0], "backward")

    def on_after_backward(self, trainer, module):
        self.collectives.where = (self.collectives.where[0], "after")


class _Losses(pl.Callback):
    """Each micro-batch's loss (support.training.Watch reads gradients, which FSDP2 holds only at a step's end)."""

    def __init__(self):
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach())  # read after the fit: float() here is a host sync


def _fit(*options: str, steps: int = 2) -> dict:
    """The module and Trainer a worker builds, 2 ranks, accumulation 2, ``steps`` optimizer steps (micro-batches of 2),
    trained on this rank with the collectives counted."""
    cfg = tiny_config(*FIT, "train.global_batch_size=8", *options, steps=steps)
    meta = checkpoint_meta(cfg, LATENTS, CAPTIONS)
    module, trainer_kwargs = build_training(cfg, meta, use_gpu=False, world_size=2, accumulation=2)
    trainer_kwargs["devices"] = 2  # one process per rank, started by the test (Lightning reads LOCAL_RANK)
    initial = module.unet.conv_in.weight.detach().clone()
    losses = _Losses()
    collectives = _Collectives()
    trainer = pl.Trainer(callbacks=[losses, _Where(collectives)], **trainer_kwargs)
    with collectives:
        trainer.fit(module, torch.utils.data.DataLoader(batches(2 * steps), batch_size=None))
    weight = module.unet.conv_in.weight.detach()
    weight = weight.full_tensor() if isinstance(weight, DTensor) else weight.clone()
    weights = [torch.zeros_like(weight) for _ in range(2)]
    dist.all_gather(weights, weight)
    return dict(
        steps=trainer.global_step,
        losses=[float(loss) for loss in losses.losses],
        weight=weight,
        initial=initial,
        trained=not torch.equal(weight, initial),
        ranks_equal=torch.equal(weights[0], weights[1]),
        calls=collectives.calls,
        bytes=collectives.bytes,
        events=collectives.events,
        params=sum(p.numel() for p in module.unet.parameters()),
        numels=[p.numel() for p in module.unet.parameters()],
        units=sum(isinstance(m, FSDPModule) for m in module.unet.modules()),
        strategy=trainer.strategy,
    )


def _fits(rank: int) -> dict[str, dict]:
    out = {
        "ddp": _fit(),
        # 1 MiB buckets: the tiny UNet's 3 MiB of float32 gradients fill three.
        "ddp_bf16": _fit("train.gradient_compression=bf16", "train.ddp_bucket_mb=1"),
        "fsdp": _fit("train.strategy=fsdp"),
        "fsdp_bf16_mixed": _fit("train.strategy=fsdp", "train.precision=bf16-mixed"),
        "fsdp_bf16_reduce": _fit(
            "train.strategy=fsdp", "train.precision=bf16-mixed", "train.gradient_compression=bf16"
        ),
    }
    for result in out.values():  # plain data: the queue shares tensors by a file descriptor that dies with the rank
        result["strategy"] = type(result["strategy"]).__name__
        result["weight"], result["initial"] = result["weight"].numpy(), result["initial"].numpy()
    return out


def _rank(rank: int, rendezvous: str, function, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", LOCAL_RANK=str(rank), NODE_RANK="0")
    # Lightning joins this process group rather than making its own, so no rank binds a port.
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
    # In a thread, as Ray Train V2 runs a worker's training function (its TrainingThread): Lightning installs no
    # SIGTERM handler there, and sdtrain's strategies skip the flag's broadcast (sdtrain.private.lightning).
    outcome: list = []

    def train() -> None:
        try:
            outcome.append(function(rank))
        except BaseException as error:  # raised again on the process's main thread, for the test's report
            outcome.append(error)

    thread = threading.Thread(target=train)
    thread.start()
    thread.join()
    (result,) = outcome
    if isinstance(result, BaseException):
        raise result
    if rank == 0:
        out.put(result)
        out.close()
        out.join_thread()  # the result is in the pipe before this rank may end
    # Both ranks done with every collective, and nothing left holding gloo's work objects (the fits' modules, DDP
    # reducers and FSDP meshes sit in reference cycles), before the groups go.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()
    # Without the interpreter's teardown, where gloo's C++ threads can abort a process whose work is done (CI saw
    # rank 1 end so, "terminate called without an active exception", after all five fits; pytorch/pytorch#179291):
    # by here the rank's result is delivered and its groups are gone.
    os._exit(0)


def _run(function, forkserver):
    """``function(rank)`` on 2 gloo ranks forked from the session's ``forkserver`` (conftest), meeting at a file: a
    free port found here and let go could be taken by another process before the ranks bind it; rank 0's result."""
    with tempfile.TemporaryDirectory(prefix="sdtrain-gloo-") as directory:
        out = forkserver.Queue()
        rendezvous = f"file://{directory}/store"
        mp.start_processes(_rank, args=(rendezvous, function, out), nprocs=2, start_method="forkserver")
        return out.get(timeout=60)


@pytest.mark.slow  # two forked processes
def test_sdtrain_ddp_keeps_each_ranks_statistics_where_torchs_default_overwrites_them_with_rank_0s(forkserver):
    strategy = build_strategy(TrainConfig(), 2, on_ray=False)
    assert strategy._ddp_kwargs == {**DDP_KWARGS, "bucket_cap_mb": 25}  # what Lightning hands DDP
    assert DDP_KWARGS["forward_sync_buffers"] is False and DDP_KWARGS["gradient_as_bucket_view"] is True
    # The same settings on Ray Train's strategy.
    from ray.train.lightning import RayDDPStrategy

    ray_strategy = build_strategy(TrainConfig(ddp_bucket_mb=100, gradient_compression="bf16"), 2, on_ray=True)
    assert isinstance(ray_strategy, RayDDPStrategy) and ray_strategy._ddp_kwargs == ddp_kwargs(
        TrainConfig(ddp_bucket_mb=100)
    )
    assert ray_strategy._ddp_kwargs["bucket_cap_mb"] == 100 and ray_strategy.comm_hook is bf16_compress
    # After 3 steps rank 1's counter is 33 with sdtrain's settings; torch's default broadcast rank 0's buffers
    # into rank 1 before each forward, leaving it at 2 + 11 = 13.
    assert _run(_counters, forkserver) == {"sdtrain": [3.0, 33.0], "torch": [3.0, 13.0]}


@pytest.mark.slow  # two forked processes, five 2-rank fits of the tiny UNet
def test_bf16_compression_halves_the_bytes_and_fsdp2_reduce_scatters_once_per_step_in_its_policys_dtypes(forkserver):
    runs = _run(_fits, forkserver)
    for name, run in runs.items():
        assert run["steps"] == 2 and len(run["losses"]) == 4, name
        assert all(0 < loss < 10 for loss in run["losses"]), (name, run["losses"])
        assert run["trained"] and run["ranks_equal"], name
    ddp, ddp_bf16 = runs["ddp"], runs["ddp_bf16"]
    params = ddp["params"]
    # DDP all-reduces every gradient once per optimizer step (accumulation skips the other micro-batch): 4 bytes
    # a parameter in float32, 2 with bf16 compression. Nothing else is all-reduced in float.
    assert ddp["strategy"] == ddp_bf16["strategy"] == "SdtrainDDPStrategy"
    assert ddp["bytes"][("allreduce", "float32")] == 2 * 4 * params
    assert ddp_bf16["bytes"][("allreduce", "bfloat16")] == 2 * 2 * params
    assert ddp_bf16["bytes"][("allreduce", "float32")] == 0
    # One bucket a step in float32 (25 MiB hold the tiny UNet); in bf16 with 1 MiB buckets, one in the first step
    # (DDP has not seen the order yet) and three in the second (below).
    assert ddp["calls"][("allreduce", "float32")] == 2 and ddp_bf16["calls"][("allreduce", "bfloat16")] == 1 + 3
    # bf16 sums round: the update differs from the float32 run's by a few percent, not more, and not zero.
    update = abs(ddp["weight"] - ddp["initial"]).mean()
    assert 0 < abs(ddp_bf16["weight"] - ddp["weight"]).mean() < 0.05 * update

    for name in ("fsdp", "fsdp_bf16_mixed", "fsdp_bf16_reduce"):
        run = runs[name]
        assert run["strategy"] == "FSDP2Strategy" and run["units"] > 1
        # One reduce-scatter per FSDP unit per optimizer step: none on the micro-batch that does not end a step.
        scatters = {key: n for key, n in run["calls"].items() if key[0] == "reduce_scatter_base"}
        assert sum(scatters.values()) == 2 * run["units"], (name, scatters, run["units"])
        gathers = {key[1] for key in run["calls"] if key[0] == "allgather_base"}
        (gathered,) = gathers
        (reduced,) = {key[1] for key in scatters}
        expected = {
            "fsdp": ("float32", "float32"),  # 32-true: the policy is float32 throughout
            "fsdp_bf16_mixed": ("bfloat16", "float32"),  # bf16-mixed: bf16 parameters, float32 gradients
            "fsdp_bf16_reduce": ("bfloat16", "bfloat16"),  # gradient_compression=bf16: reduced in bf16 (gloo can)
        }[name]
        assert (gathered, reduced) == expected, name
    # Accumulating unsharded gradients over the skipped micro-batch and reducing their sum once is the step DDP
    # takes: same weights, within float32 summation order.
    torch.testing.assert_close(runs["fsdp"]["weight"], ddp["weight"], rtol=1e-4, atol=1e-6)
    assert not (runs["fsdp_bf16_mixed"]["weight"] == runs["fsdp"]["weight"]).all()
    _the_communication_model_is_what_the_ranks_did(runs)
    _nothing_else_waits_between_micro_batches(runs)


def _nothing_else_waits_between_micro_batches(runs: dict) -> None:
    """From the first micro-batch on, no host sync at all, and no broadcast but DDP's one re-bucketing (rank 0's
    bucket order, in the second step's first forward): the only collectives are the gradients'. Lightning's loop
    broadcast rank 0's SIGTERM flag and read it on the host before every micro-batch; sdtrain's strategies skip it
    where no SIGTERM handler can set the flag, as in these ranks' threads (sdtrain.private.lightning)."""
    for name, run in runs.items():
        trained = [(batch, where, op) for batch, where, op, _ in run["events"] if batch >= 0]
        assert [event for event in trained if event[2] == "host sync"] == [], name
        broadcasts = [event[:2] for event in trained if event[2] == "broadcast"]
        assert broadcasts == ([(2, "forward")] * 2 if name.startswith("ddp") else []), (name, broadcasts)


def _gradient_collectives(run: dict, op: str) -> dict[tuple[int, str], list[int]]:
    """Bytes of each ``op`` call by (micro-batch, pass), leaving out scalars (the sharded norm, Lightning's flags)."""
    out: dict[tuple[int, str], list[int]] = {}
    for batch, where, name, nbytes in run["events"]:
        if name == op and nbytes > 64:
            out.setdefault((batch, where), []).append(nbytes)
    return out


def _the_communication_model_is_what_the_ranks_did(runs: dict) -> None:
    """tools/performance_model.py against the collectives the two ranks dispatched (2 optimizer steps of 2
    micro-batches): which micro-batches communicate, in which pass, how many calls and bytes."""
    from sdtrain.config.schema import ModelConfig
    from sdtrain.model.op_costs import count_step_ops
    from sdtrain.model.unet import unet_config
    from tools.communication_model import ddp_buckets, fsdp_collectives

    # The order gradients become ready in the backward pass, from the fake-tensor trace (32-true, as these ranks).
    traced = count_step_ops(unet_config(ModelConfig(preset="tiny")), LATENTS, CAPTIONS, 2, precision="32-true")
    ready = [index for index, _ in traced.gradients_ready]
    for name, cap, compression in (("ddp", 25, "none"), ("ddp_bf16", 1, "bf16")):
        run = runs[name]
        reduced = _gradient_collectives(run, "allreduce")
        # Only in the backward pass of each step's last micro-batch (the first runs under no_sync).
        assert set(reduced) == {(1, "backward"), (3, "backward")}, (name, sorted(reduced))
        # The first step sends one bucket of everything (DDP has not seen the order yet); then the model's buckets,
        # cut at the cap's float32 bytes and sent at their wire size.
        assert reduced[1, "backward"] == [run["params"] * (2 if compression == "bf16" else 4)], name
        predicted = [size for size, _ in ddp_buckets(run["numels"], ready, cap, compression)]
        assert reduced[3, "backward"] == predicted, (name, reduced[3, "backward"], predicted)
    assert len(predicted) == 3 and max(predicted) <= 2**20 // 2 + max(runs["ddp_bf16"]["numels"]) * 2
    for name in ("fsdp", "fsdp_bf16_mixed"):
        run = runs[name]
        gathers, scatters = (
            _gradient_collectives(run, "allgather_base"),
            _gradient_collectives(run, "reduce_scatter_base"),
        )
        units = run["units"] - 1  # the root is a unit too
        for batch in range(4):
            expected = fsdp_collectives(units, accumulation=2)[batch % 2]
            found = {
                "forward gathers": len(gathers.get((batch, "forward"), [])),
                "backward gathers": len(gathers.get((batch, "backward"), [])),
                "reduce-scatters": len(scatters.get((batch, "backward"), [])),
            }
            assert found == expected, (name, batch, found, expected)


def _fsdp_grid(directory: str, rank: int) -> dict:
    """A 2-rank FSDP fit with an EMA, then the sample grid as a worker draws it (sdtrain.train.worker.sample_grids:
    every rank takes part in each sharded forward pass, rank 0 writes), beside the same grid sampled alone from the
    EMA's gathered weights."""
    from sdtrain.model.unet import build_unet
    from sdtrain.sampling.captions import Captions
    from sdtrain.sampling.sampler import sample_latents
    from sdtrain.train.sample_grids import SampleGrids
    from sdtrain.train.worker import sample_grids

    grid = ("sample_grid.prompts=[a, b]", "sample_grid.columns=2", "sample_grid.steps=2")
    ema = ("train.ema_decay=0.5", "train.ema_start_step=0")
    storage = (f"run.storage_path={directory}", "run.name=fsdp")
    cfg = tiny_config(*FIT, "train.global_batch_size=8", "train.strategy=fsdp", *ema, *grid, *storage, steps=2)
    meta = checkpoint_meta(cfg, LATENTS, CAPTIONS)
    module, trainer_kwargs = build_training(cfg, meta, use_gpu=False, world_size=2, accumulation=2)
    trainer_kwargs["devices"] = 2
    trainer = pl.Trainer(**trainer_kwargs)
    trainer.fit(module, torch.utils.data.DataLoader(batches(4), batch_size=None))
    prompts = Captions(torch.randn(2, *CAPTIONS, generator=torch.Generator().manual_seed(1)), ["a", "b"])
    grids = sample_grids(cfg, module, rank, prompts)
    assert grids is not None  # every rank draws
    drawn = grids.sample(module.eval_unet, 2)
    kinds = [None, None]
    dist.all_gather_object(kinds, type(drawn).__name__)
    sharded = DTensor in {type(p) for p in module.eval_unet.parameters()}
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in module.eval_unet.state_dict().items()}
    alone = build_unet(cfg.model)
    alone.load_state_dict(full)
    captions = prompts.embeddings.repeat_interleave(2, dim=0)
    settings = dict(sampler="ddim", steps=2, guidance_scale=3.0, seed=cfg.train.seed)
    unconditional = module.unconditional_caption.detach().cpu()
    scheduler = meta.noise_scheduler_config
    by_ranks = sample_latents(module.eval_unet, scheduler, captions, unconditional, LATENTS, **settings)
    if rank != 0:
        return {}
    by_one = sample_latents(alone, scheduler, captions, unconditional, LATENTS, **settings)
    reference = SampleGrids(cfg, meta, prompts, f"{directory}/alone", unconditional).sample(alone, 2)
    assert drawn is not None and reference is not None
    return dict(
        kinds=kinds,
        sharded=sharded,
        written=sorted(os.listdir(f"{directory}/fsdp/samples")),
        image=drawn.image,
        reference=reference.image,
        latent_gap=float((by_ranks - by_one).abs().max()),
    )


@pytest.mark.slow  # two forked processes
def test_a_sample_grid_under_fsdp_is_drawn_by_every_rank_and_written_by_rank_0(forkserver):
    """Each rank holds a shard of the EMA: every rank samples the grid in step (each forward pass gathers the weights
    from all), rank 0 alone writes it, and it is the grid the gathered EMA gives in one process."""
    import functools

    with tempfile.TemporaryDirectory(prefix="sdtrain-fsdp-grid-") as directory:
        result = _run(functools.partial(_fsdp_grid, directory), forkserver)
    assert result["sharded"] and result["kinds"] == ["Grid", "NoneType"]
    assert result["written"] == ["step_2.png"]
    assert result["latent_gap"] < 1e-4
    assert np.abs(result["image"].astype(int) - result["reference"].astype(int)).max() <= 1
