"""GPU options of the train config: the distributed strategy, torch.compile, channels_last,
gradient checkpointing and the attention kernel, applied to a built DiffusionModule.

FSDP is FSDP2 (``torch.distributed.fsdp.fully_shard``) under Lightning's ``ModelParallelStrategy``:
FSDP1, which Ray's ``RayFSDPStrategy`` wraps, is deprecated upstream, and FSDP2 keeps each
parameter a ``DTensor`` under its own name, so the optimizer, the non-finite check, clipping and
the EMA see the UNet's parameters (their local shards). Checkpoints are gathered into one full
state dict on rank 0: the same file as DDP's, resumable at any world size and by either strategy.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Generator
from typing import Any

import lightning.pytorch as pl
import torch
from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import MixedPrecisionPolicy

from sdtrain.config.schema import TrainConfig
from sdtrain.logs import log
from sdtrain.private import lightning as lightning_private
from sdtrain.private import torch as torch_private

DDP_KWARGS: dict[str, Any] = {
    # The module's buffers are per-rank statistics (loss sums, skipped samples), all-reduced where they are
    # reported: torch's default broadcasts rank 0's over every rank's before each forward (the reported loss
    # was rank 0's, skipped_samples world size x rank 0's), and pays a broadcast a step for it. Named so, not
    # broadcast_buffers=False (deprecated in torch 2.13, which every worker then warned of): this one still
    # broadcasts the buffers once when DDP wraps the module, which changes nothing here, as every statistic is
    # non-persistent and still zero on every rank then (a restore never loads them).
    "forward_sync_buffers": False,
    # Gradients are views into DDP's all-reduce buckets: no copy in and out of the buckets each step, and
    # one gradient-sized buffer less.
    "gradient_as_bucket_view": True,
    # static_graph stays off: what it adds (reentrant checkpointing, unused-parameter search done once) is not
    # needed here. Every UNet parameter gets a gradient each step (find_unused_parameters stays False: no graph
    # search at all), the EMA's parameters require no grad (DDP ignores them), and diffusers checkpoints with
    # use_reentrant=False, which DDP supports without it.
}
"""DistributedDataParallel's settings for train.strategy=ddp, with Ray and without (train.ddp_bucket_mb adds
bucket_cap_mb: :func:`ddp_kwargs`)."""


def ddp_kwargs(train: TrainConfig) -> dict[str, Any]:
    """DistributedDataParallel's keyword arguments for ``train``: :data:`DDP_KWARGS` and the bucket size."""
    return {**DDP_KWARGS, "bucket_cap_mb": train.ddp_bucket_mb}


def bf16_compress(state, bucket):
    """torch's ``bf16_compress_hook`` (each bucket cast to bf16, divided by the world size, all-reduced, cast
    back in place): half the bytes a step. Under its own name because DDP refuses torch's hook by name
    unless NCCL is available, although gloo all-reduces bf16 too; so the CPU tests run the hook the GPUs do.
    Unannotated: DDP compares a hook's annotations with its types, and this module's are strings."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    return bf16_compress_hook(state, bucket)


COMM_HOOKS = {"none": None, "bf16": bf16_compress}
"""The DDP communication hook of each train.gradient_compression."""


def build_strategy(train: TrainConfig, world_size: int, on_ray: bool):
    """Lightning's strategy for ``train.strategy`` at ``world_size`` processes, in Ray's flavour
    (the device Ray Train assigned this worker) when ``on_ray``."""
    if train.strategy == "fsdp":
        # Every process is one data-parallel rank: the whole world shards the UNet.
        strategy = RayModelParallelStrategy if on_ray else FSDP2Strategy
        return strategy(data_parallel_size=world_size, tensor_parallel_size=1, save_distributed_checkpoint=False)
    if on_ray or world_size > 1:
        return _ddp_strategy_class(on_ray)(comm_hook=COMM_HOOKS[train.gradient_compression], **ddp_kwargs(train))
    return "auto"


class _CommHookDDP:
    """A DDP strategy that registers ``comm_hook`` on the wrapped module on any device: Lightning's own
    ``ddp_comm_hook`` is registered on CUDA only, and the CPU tests must run the hook the GPUs run."""

    def __init__(self, *args, comm_hook=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.comm_hook = comm_hook

    def configure_ddp(self) -> None:
        super().configure_ddp()  # type: ignore[misc]
        if self.comm_hook is not None:
            self.model.register_comm_hook(None, self.comm_hook)  # type: ignore[attr-defined]


class _NoFlagBroadcast:
    """A strategy whose training loop makes no collective and no host sync of its own between micro-batches: in a
    Ray Train worker it skips Lightning's per-micro-batch SIGTERM broadcast, which carries nothing there
    (:func:`sdtrain.private.lightning.skip_sigterm_broadcast`). So the step's only collectives are the gradients'."""

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)  # type: ignore[misc]
        lightning_private.skip_sigterm_broadcast(trainer)


@functools.cache
def _ddp_strategy_class(on_ray: bool) -> type:
    """Lightning's DDPStrategy, or Ray's RayDDPStrategy when ``on_ray``, with :class:`_CommHookDDP`; built on
    demand so that a run without Ray never imports it."""
    from lightning.pytorch.strategies import DDPStrategy

    base: type[DDPStrategy] = DDPStrategy
    if on_ray:
        from ray.train.lightning import RayDDPStrategy

        base = RayDDPStrategy
    return type(f"Sdtrain{base.__name__}", (_CommHookDDP, _NoFlagBroadcast, base), {})


class FSDP2Strategy(_NoFlagBroadcast, ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2 applied by :func:`apply_options`) that skips the gradient
    reduce-scatter on the micro-batches of an accumulation that do not end an optimizer step: Lightning's
    ``block_backward_sync`` only knows DDP's ``no_sync``. FSDP2 then keeps the unsharded gradients summed
    on each rank and reduce-scatters their sum once, in the last micro-batch's backward pass."""

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        from torch.distributed.fsdp import FSDPModule

        unet = getattr(self.lightning_module, "unet", None)
        if not isinstance(unet, FSDPModule):
            yield
            return
        unet.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            unet.set_requires_gradient_sync(True)


class RayModelParallelStrategy(FSDP2Strategy):
    """``FSDP2Strategy`` on the device Ray Train assigned this worker, as Ray's own
    ``RayDDPStrategy`` does: Ray workers on one node may all see every GPU, and Lightning's
    ``local_rank`` indexes Lightning's device list, not Ray's assignment."""

    @property
    def root_device(self) -> torch.device:
        import ray.train.torch

        return ray.train.torch.get_device()


def apply_options(module, train: TrainConfig, mesh: torch.distributed.device_mesh.DeviceMesh | None = None) -> None:
    """Set the attention kernel, memory format and gradient checkpointing of ``module.unet`` (and
    its EMA, which only runs inference), shard both over ``mesh`` (FSDP; the UNet with the policy of
    :func:`mixed_precision`), then compile the UNet:
    in place, in that order (compile sees the sharded module). Lightning calls it through
    ``DiffusionModule.configure_model``, on the device, before the strategy wraps the module."""
    unets = [module.unet] + ([module.ema_unet] if getattr(module, "ema_unet", None) is not None else [])
    for unet in unets:
        unet.set_attn_processor(AttnProcessor2_0() if train.attention == "sdpa" else AttnProcessor())
        if train.channels_last:
            unet.to(memory_format=torch.channels_last)
    if train.gradient_checkpointing:
        module.unet.enable_gradient_checkpointing()
    if mesh is not None:
        shard_unet(module.unet, mesh, mixed_precision(train, module.trainer.precision))
        for ema in unets[1:]:
            # The EMA only validates and samples: gathered in float32, so validation does not depend on the policy.
            shard_unet(ema, mesh)
    if train.compile:
        buckets = module.checkpoint_meta.bucket_shapes
        compile_unet(module.unet, sharded=mesh is not None, shapes=len(buckets) if buckets else 1)
        if buckets and module.trainer.is_global_zero:
            log.info(
                f"train.compile: {len(buckets)} bucket shapes, one static graph each (forward and backward), "
                "compiled the first time each is trained on"
            )


def compile_unet(unet: torch.nn.Module, sharded: bool, shapes: int = 1) -> None:
    """torch.compile with ``fullgraph=True`` (a graph break is an error, not a silent slow path), in place, so
    parameter names, and so checkpoints, stay those of the UNet.

    Under DDP the whole UNet is one graph (``nn.Module.compile``). Under FSDP each FSDP unit's ``forward`` is
    compiled on its own, as torchtitan compiles each transformer block: FSDP2's unshard and reshard hooks run
    around a unit's forward, and dynamo does not trace them (``skip_fsdp_hooks``), so a UNet compiled whole would
    break its graph at every unit; compiling the forward leaves the hooks outside the graphs. The root unit's own
    few layers (conv in and out, the timestep embedding, the down- and upsamplers) run eager.

    Graphs are static, one per input shape (aspect-ratio buckets: ``shapes`` latent shapes): dynamo's cache keeps an
    entry per code object and input shape, so its limit is raised to hold them all (past it, ``fullgraph=True`` makes
    dynamo raise, not run eager: validation and the sample grids, whose shapes vary, run under :func:`uncompiled`).
    Never dynamic: a second shape of the same code object (another bucket, or in one process another UNet compiled
    before) would make dynamo's automatic dynamic shapes recompile symbolic sizes, on which inductor's CPU backend
    fails ("cannot determine truth value of Relational").

    Args:
        unet: the UNet, sharded (:func:`shard_unet`) when ``sharded``.
        sharded: under FSDP.
        shapes: the latent shapes the run trains on (its buckets).
    """
    if not sharded:
        if shapes > 1:
            torch_private.raise_recompile_limit(shapes + 8)
        unet.compile(fullgraph=True, dynamic=False)
        return
    units = fsdp_units(unet)
    # The units of one class share their forward's code, and dynamo's cache is per code object: one entry per
    # distinct input shape (static shapes: dynamic ones make inductor's CPU backend fail on the symbolic sizes).
    torch_private.raise_recompile_limit(len(units) * shapes + 8)
    for block in units:
        # An instance attribute: nn.Module.__call__ runs the FSDP hooks, then this compiled forward.
        block.forward = torch.compile(block.forward, fullgraph=True, dynamic=False)


@contextlib.contextmanager
def uncompiled() -> Generator[None, None, None]:
    """Every ``torch.compile`` in this process runs eager inside: validation and the sample grids run the UNet so.

    Without an EMA they run the training UNet itself (``module.eval_unet``), in eval mode under no_grad, on batches
    whose row count and shape vary (each rank's share of a piece, a bucket's partial last piece, the grid's guided
    batch): each would be one more static graph, and past :func:`compile_unet`'s recompile limit ``fullgraph=True``
    makes dynamo raise ``FailOnRecompileLimitHit`` instead of falling back, which ends the run. Eager, they add no
    graph and no cache entry, so the training step keeps its graphs and its limit. The price is eager speed for them
    (when the UNet they run is the compiled one: an EMA is never compiled), small as they are a small share of a
    run's forward passes; training's graphs would rarely serve them anyway, being traced in train mode with grad.

    A dynamo stance, not the module before compile: ``nn.Module.compile`` compiles in place (there is no
    ``_orig_mod`` to call) and under FSDP each unit's ``forward`` is compiled on its own, and the stance covers both,
    whatever DDP, FSDP or Lightning wrap around them. It is entered outside any compiled region, as dynamo requires.
    """
    with torch.compiler.set_stance("force_eager"):
        yield


class CompiledGraphs(pl.Callback):
    """With train.compile: rank 0 logs at the end of training how many graphs dynamo compiled and how many breaks it
    made. One graph per bucket shape (forward and backward, per FSDP unit under FSDP) is the design; more than that
    is a recompile storm, and a break cannot happen under fullgraph=True."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            graphs, breaks = torch_private.compiled_graphs()
            log.info(f"train.compile: rank 0 compiled {graphs} graphs in all, with {breaks} graph breaks")


def fsdp_units(unet: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks :func:`shard_unet` makes FSDP units of (the root aside): every transformer and resnet block."""
    from diffusers.models.resnet import ResnetBlock2D
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    return [block for block in unet.modules() if isinstance(block, (ResnetBlock2D, Transformer2DModel))]


def mixed_precision(train: TrainConfig, precision: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for ``train`` under Lightning's resolved ``precision``: parameters all-gathered and used
    in ``train.fsdp_param_dtype`` (auto: bf16 under bf16-mixed, else float32), gradients reduce-scattered in
    float32, or bf16 with ``train.gradient_compression=bf16``.

    Under bf16-mixed, Lightning's autocast still picks each op's dtype: matmuls and convolutions run in bf16
    either way (autocast would cast float32 weights on every call; FSDP2 casts once per all-gather, and
    gathers half the bytes), and ops autocast keeps in float32 (group_norm, layer_norm, softmax on GPUs)
    upcast their bf16 inputs, so only their weights carry bf16 rounding. The sharded weights, their update
    and the EMA stay float32."""
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    param = train.fsdp_param_dtype
    if param == "auto":
        param = "bfloat16" if precision == "bf16-mixed" else "float32"
    reduce = torch.bfloat16 if train.gradient_compression == "bf16" else torch.float32
    return MixedPrecisionPolicy(param_dtype=dtypes[param], reduce_dtype=reduce)


def shard_unet(unet: torch.nn.Module, mesh, policy: MixedPrecisionPolicy | None = None) -> None:
    """FSDP2 over ``mesh``: each transformer and resnet block is one unit (its parameters are
    gathered for its forward and freed after), the rest (conv in/out, embeddings) the root unit.

    Args:
        policy: the units' mixed-precision policy (:func:`mixed_precision`); default float32 throughout.
    """
    from torch.distributed.fsdp import fully_shard

    policy = policy or MixedPrecisionPolicy()
    for block in fsdp_units(unet):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(unet, mesh=mesh, mp_policy=policy)


def is_sharded(module: pl.LightningModule) -> bool:
    """True under FSDP: every rank holds a shard, so every rank takes part in each forward pass."""
    return getattr(module, "_device_mesh", None) is not None
