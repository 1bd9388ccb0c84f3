"""Training in one process, as a Ray worker builds it (sdtrain.train.build.build_training), watched step by step:
tests/test_options.py on CPU, tests/test_gpu.py on a CUDA GPU."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from sdtrain.model.ema import local_tensor
from sdtrain.train.build import checkpoint_meta, fit_without_ray

LATENTS, CAPTIONS = (4, 16, 16), (8, 32)

# The ops by which a tensor's value reaches the host (torch's .item(), float(), bool(), nonzero and the like all
# dispatch one of them): each one waits for the GPU to finish everything queued before it.
HOST_SYNCS = {"aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.nonzero", "aten.equal"}


# The settings of every fit below, before a test's own: conftest.tiny_config(*FIT, ...), steps= to change the 3 steps.
FIT = (
    "data.train=/unused",
    "train.max_steps=3",
    "train.global_batch_size=2",
    "train.lr=1e-3",
    "train.warmup_steps=0",
    "scaling.use_gpu=false",
)


def batches(n, nan_at=(), same=False):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        if same and out:
            out.append(out[0])
            continue
        latents = torch.randn(2, *LATENTS, generator=g)
        if i in nan_at:
            latents[0, 0, 0, 0] = float("nan")
        out.append({"latents": latents, "captions": torch.randn(2, *CAPTIONS, generator=g)})
    return out


class Watch(pl.Callback):
    """After each optimizer step: the UNet's and the EMA's first weights, the gradient norm the
    optimizer saw (clipped: Lightning zeroes gradients only in the next step), the step's loss,
    the skip counters, and the device the module trained on (Lightning's teardown moves it to the CPU after fit)."""

    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        grads = [local_tensor(p.grad) for p in module.unet.parameters() if p.grad is not None]  # one process: all of it
        self.steps.append(
            dict(
                # None on an accumulation micro-batch under FSDP: it reduce-scatters (and sets .grad) on the last only.
                grad_norm=torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))).item() if grads else None,
                step=trainer.global_step,
                loss=float(outputs["loss"]),
                weight=module.unet.conv_in.weight.detach().clone(),
                ema=None if module.ema_unet is None else module.ema_unet.conv_in.weight.detach().clone(),
                skipped=module.skipped_steps.item(),
                streak=module.longest_bad_streak.item(),
                device=module.device.type,
            )
        )


def fit(
    cfg, data, use_gpu=False, callbacks=(), caption_shape=CAPTIONS, text_encoder=None, bucket_shapes=None, **kwargs
):
    """``text_encoder``: the data's captions are token ids for it (then ``caption_shape`` is its output's);
    ``bucket_shapes``: the run's aspect-ratio buckets (latent shapes, the first :data:`LATENTS`)."""
    watch = Watch()
    meta = checkpoint_meta(cfg, LATENTS, caption_shape, text_encoder=text_encoder, bucket_shapes=bucket_shapes)
    module, trainer = fit_without_ray(cfg, data, meta, use_gpu=use_gpu, callbacks=[watch, *callbacks], **kwargs)
    return module, trainer, watch.steps
