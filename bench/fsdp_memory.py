"""Per-rank training state of the UNet under DDP, FSDP1 and FSDP2: why train.strategy=fsdp is FSDP2.

Two processes over gloo (CPU) each build the preset's UNet, shard it, and take one bf16-autocast
training step with the fused AdamW and the module's non-finite check and clipping arithmetic;
then each counts the bytes it holds of weights, gradients and optimizer state (local shards).

- ddp: the whole model on every rank (the baseline).
- fsdp1: ``FullyShardedDataParallel``, per ResNet and transformer block, ``use_orig_params`` (what
  Ray's ``RayFSDPStrategy`` was configured with); deprecated upstream.
- fsdp2: ``fully_shard`` per block (sdtrain.train.strategy.shard_unet), what the package runs.

It also checks the step itself: whether the fused AdamW took the sharded parameters and whether a
NaN gradient on one rank was skipped on both. Memory, not speed: CPU timings say nothing of GPUs.

    python bench/fsdp_memory.py                  # the small UNet (223M)
    python bench/fsdp_memory.py --smoke          # tiny UNet (CI)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

KINDS = ("ddp", "fsdp1", "fsdp2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny UNet: checks that it runs")
    parser.add_argument("--preset", default="small")
    args = parser.parse_args()
    import torch.multiprocessing as mp

    preset = "tiny" if args.smoke else args.preset
    print(f"# machine: {benchlib.machine()}")
    print(f"# {benchlib.versions()}, sdtrain commit {benchlib.git_commit()}; preset {preset}, 2 ranks over gloo")
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_rank, args=(preset, queue, _free_port()), nprocs=2, start_method="spawn")
    results: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    for _ in range(2 * len(KINDS)):
        result = queue.get()
        results[result["kind"]].append(result)
    print(f"{'strategy':8} {'GiB per rank':>12} {'fused AdamW':>12} {'NaN skipped on both':>20}")
    for kind, ranks in results.items():
        if "error" in ranks[0]:
            print(f"{kind:8} cannot run here: {ranks[0]['error']}")
            continue
        gib = max(r["bytes"] for r in ranks) / 2**30
        print(
            f"{kind:8} {gib:12.3f} {str(all(r['fused'] for r in ranks)):>12} "
            f"{str(all(r['skipped'] for r in ranks)):>20}"
        )
    full = max(r["bytes"] for r in results["ddp"])
    for kind in ("fsdp1", "fsdp2"):
        if "error" not in results[kind][0]:
            print(benchlib.ratio_line(f"state per rank {kind}", max(r["bytes"] for r in results[kind]), "ddp", full))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, preset: str, queue, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    for kind in KINDS:
        queue.put({"kind": kind, "rank": rank, **_measure(rank, kind, preset)})
    dist.destroy_process_group()


def _measure(rank: int, kind: str, preset: str) -> dict:
    import torch
    import torch.distributed as dist

    from sdtrain.config.schema import ModelConfig
    from sdtrain.model.ema import local_tensor
    from sdtrain.model.unet import build_unet
    from sdtrain.train.strategy import shard_unet

    torch.manual_seed(0)
    unet = build_unet(ModelConfig(preset=preset))
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh

        shard_unet(unet, init_device_mesh("cpu", (2,)))
        model = unet
    elif kind == "fsdp1":
        from diffusers.models.resnet import ResnetBlock2D
        from diffusers.models.transformers.transformer_2d import Transformer2DModel
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        try:
            model = FullyShardedDataParallel(
                unet, auto_wrap_policy=ModuleWrapPolicy({ResnetBlock2D, Transformer2DModel}), use_orig_params=True
            )
        except RuntimeError as error:  # on CPU: "FSDP needs a non-CPU accelerator device"
            return {"error": str(error).splitlines()[0]}
    else:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(unet)
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        fused = True
    except (RuntimeError, TypeError):
        optimizer, fused = torch.optim.AdamW(model.parameters(), lr=1e-4), False
    config = unet.config
    latents = torch.randn(1, config.in_channels, 8, 8)
    captions = torch.randn(1, 8, config.cross_attention_dim)
    skipped = True
    for step in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(latents, torch.tensor([500]), encoder_hidden_states=captions).sample.float().square().mean()
        if step == 1 and rank == 1:
            loss = loss * float("nan")  # one rank's NaN: every rank must skip the step
        loss.backward()
        grads = [local_tensor(p.grad) for p in model.parameters() if p.grad is not None]
        squares = torch.stack(torch._foreach_norm(grads)).square().sum()
        if kind != "ddp":  # sharded gradients: the norm is summed over ranks (DDP's are all-reduced)
            dist.all_reduce(squares)
        nonfinite = (~torch.isfinite(squares)).float()
        torch._foreach_mul_(grads, torch.clamp(1.0 / (squares.sqrt() + 1e-6), max=1.0))
        before = [local_tensor(p).detach().clone() for p in model.parameters()]
        if fused:
            optimizer.found_inf = nonfinite
            optimizer.step()
        elif not nonfinite:
            optimizer.step()
        if step == 1:
            skipped = all(torch.equal(b, local_tensor(p)) for b, p in zip(before, model.parameters(), strict=True))
        held = sum(local_tensor(p).numel() * p.element_size() for p in model.parameters())
        held += sum(g.numel() * g.element_size() for g in grads)
        optimizer.zero_grad(set_to_none=False)
    held += sum(
        local_tensor(v).numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if torch.is_tensor(v)
    )
    return {"bytes": held, "fused": fused, "skipped": skipped}


if __name__ == "__main__":
    main()
