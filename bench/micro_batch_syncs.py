"""Host syncs between micro-batches: Lightning's per-micro-batch SIGTERM broadcast against sdtrain's strategies,
which skip it in a Ray Train worker's thread (sdtrain.private.lightning.skip_sigterm_broadcast).

Two gloo ranks without Ray train the tiny UNet as a worker builds it (sdtrain.train.build.build_training: the module,
DDP as sdtrain sets it, accumulation), twice: on the main thread, where Lightning broadcasts rank 0's SIGTERM flag
and reads it with ``.item()`` before every micro-batch, and on a thread of its own, as Ray Train runs a worker.

Reported:
- host syncs (``aten._local_scalar_dense``) per micro-batch, from the first micro-batch on, in both;
- the host's gap after each sync: from its return to the next micro-batch's first convolution (the UNet's
  ``conv_in``). On a GPU the queue is empty when a sync returns, and what the host queues before that convolution
  (the batch's copy, the noise and timesteps) is a few tiny kernels, so the GPU idles for about that long every
  micro-batch; without the sync the host runs ahead of the GPU and the gap is hidden. Measured on this CPU, in
  plain Lightning (a Ray worker's callbacks and Ray Data's iterator add to it), so a floor;
- steps/s of both on this CPU (gloo's broadcast is a few hundred microseconds of a tiny UNet's step);
- with the per-op model's predicted step of each shipped job (tools/performance_report.py, compiled as shipped):
  the share of its step the GPU would idle at this gap, one gap per micro-batch. A prediction.

    python bench/micro_batch_syncs.py           # 30 steps of 4 micro-batches, both ways
    python bench/micro_batch_syncs.py --smoke   # seconds: checks that it runs (CI)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]
import benchlib  # noqa: E402,F401  (tests/ on the path: the tiny config)

ACCUMULATION = 4


def _counting_mode():
    """A TorchDispatchMode that counts host syncs (``aten._local_scalar_dense``) once ``training`` is set."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Syncs(TorchDispatchMode):
        training = False
        syncs = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.training and func is torch.ops.aten._local_scalar_dense.default:
                self.syncs += 1
            return func(*args, **(kwargs or {}))

    return Syncs()


def _fit(steps: int, count_syncs: bool) -> dict:
    """Train ``steps`` steps; steps/s after the first third and, where Lightning's broadcast runs, the host's time
    from its return to the next ``conv_in`` (a wrapper and a forward pre-hook: no dispatch mode slows the ops), or
    with ``count_syncs`` the host syncs per micro-batch instead (counted by a dispatch mode, so not timed)."""
    import lightning.pytorch as pl
    import torch
    from conftest import tiny_config
    from support.training import CAPTIONS, FIT, LATENTS, batches

    from sdtrain.private.lightning import BROADCAST
    from sdtrain.train.build import build_training, checkpoint_meta

    cfg = tiny_config(*FIT, f"train.global_batch_size={2 * 2 * ACCUMULATION}", steps=steps)
    module, kwargs = build_training(
        cfg, checkpoint_meta(cfg, LATENTS, CAPTIONS), use_gpu=False, world_size=2, accumulation=ACCUMULATION
    )
    kwargs.update(devices=2, enable_progress_bar=False, enable_model_summary=False)
    syncs = _counting_mode() if count_syncs else contextlib.nullcontext()
    times: list[float] = []
    gaps: list[float] = []
    returned: list[float] = []

    class Clock(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if count_syncs:
                syncs.training = True
            if batch_idx % ACCUMULATION == 0:
                times.append(time.perf_counter())

    trainer = pl.Trainer(callbacks=[Clock()], **kwargs)
    loop = trainer.fit_loop.epoch_loop
    broadcast = getattr(loop, BROADCAST)

    def timed() -> None:  # replaced by sdtrain's strategy where it skips the broadcast
        broadcast()
        returned.append(time.perf_counter())

    setattr(loop, BROADCAST, timed)
    module.unet.conv_in.register_forward_pre_hook(
        lambda *_: gaps.append(time.perf_counter() - returned.pop()) if returned else None
    )
    with syncs:
        trainer.fit(module, torch.utils.data.DataLoader(batches(steps * ACCUMULATION), batch_size=None))
    if count_syncs:
        return {"syncs_per_micro_batch": syncs.syncs / (steps * ACCUMULATION)}
    warm = times[len(times) // 3 :]  # the first steps pay allocation and DDP's re-bucketing
    return {"steps_per_s": (len(warm) - 1) / (warm[-1] - warm[0]), "gaps": gaps[len(gaps) // 3 :]}


def _both(steps: int, on_thread: bool) -> dict:
    def run() -> None:
        out["timed"] = _fit(steps, count_syncs=False)
        out["counted"] = _fit(max(2, steps // 5), count_syncs=True)

    out: dict = {}
    if on_thread:
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    else:
        run()
    return out


def _rank(rank: int, rendezvous: str, steps: int, queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", LOCAL_RANK=str(rank), NODE_RANK="0")
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
    result = {"lightning": _both(steps, on_thread=False), "sdtrain": _both(steps, on_thread=True)}
    if rank == 0:
        queue.put(result)
        queue.close()
        queue.join_thread()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo's threads can abort an interpreter's teardown (tests/test_ddp_settings.py)


def _predicted_shares(gap_s: float) -> list[tuple[str, int, float]]:
    """(job file, micro-batches a step, share of the predicted step the GPU idles at one ``gap_s`` a micro-batch)."""
    from tools.performance_report import JOB_FILES, predict_job, read_job

    out = []
    for name in JOB_FILES:
        job = read_job(str(REPO / name))
        step = predict_job(job, job.min_nodes)
        accumulation = job.config.batch_layout(job.min_nodes * job.node.gpus).accumulation
        out.append((name, accumulation, accumulation * gap_s / (step.step_s + accumulation * gap_s)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--smoke", action="store_true", help="3 steps, no prediction")
    args = parser.parse_args()
    steps = 3 if args.smoke else args.steps

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="sdtrain-syncs-") as directory:
        queue = mp.get_context("spawn").Queue()
        mp.start_processes(
            _rank, args=(f"file://{directory}/store", steps, queue), nprocs=2, start_method="spawn", join=False
        )
        result = queue.get(timeout=600)
    print(f"2 gloo ranks, tiny UNet, {ACCUMULATION} micro-batches of 2 a step, {steps} steps (rank 0)")
    print(f"{'loop':<10} {'host syncs/micro-batch':>22} {'sync to next conv (ms)':>22} {'steps/s':>8}")
    for mode in ("lightning", "sdtrain"):
        counted, timed = result[mode]["counted"], result[mode]["timed"]
        gaps = timed["gaps"]
        gap = f"{1e3 * statistics.median(gaps):.2f}" if gaps else "-"
        print(f"{mode:<10} {counted['syncs_per_micro_batch']:>22.2f} {gap:>22} {timed['steps_per_s']:>8.2f}")
    before, after = result["lightning"], result["sdtrain"]
    print(f"RATIO host syncs per micro-batch, sdtrain = {after['counted']['syncs_per_micro_batch']:.3f}")
    print(f"RATIO host syncs per micro-batch, lightning = {before['counted']['syncs_per_micro_batch']:.3f}")
    print(f"RATIO steps/s sdtrain / lightning = {after['timed']['steps_per_s'] / before['timed']['steps_per_s']:.3f}")
    if args.smoke:
        return
    gap_s = statistics.median(before["timed"]["gaps"])
    print("\nPredicted, per-op model, compiled as shipped, at the smallest node count:")
    for name, accumulation, share in _predicted_shares(gap_s):
        batches = f"{accumulation} micro-batch{'es' if accumulation > 1 else ''}"
        print(f"{name}: {batches} a step; with Lightning's broadcast the GPU idles {share:.2%} of it")
        print(f"RATIO GPU idle share with lightning's broadcast, {name} = {share:.4f}")


if __name__ == "__main__":
    main()
