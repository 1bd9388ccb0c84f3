"""DDP as sdtrain sets it (sdtrain.train.strategy), in two real gloo processes: per-rank statistic buffers stay
per rank, so what the reporter all-reduces is every rank's, not rank 0's copied everywhere."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sdtrain.config.schema import TrainConfig
from sdtrain.train.strategy import DDP_KWARGS, build_strategy


class _Counting(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.register_buffer("counter", torch.zeros(()), persistent=False)  # as DiffusionModule's statistics

    def forward(self, x):
        self.counter += 1 + 10 * dist.get_rank()  # rank 0 counts 1 a step, rank 1 counts 11
        return self.linear(x).sum()


def _steps(rank: int, port: int, kwargs: dict, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(_Counting(), **kwargs)
    for _ in range(3):
        model(torch.ones(2, 4)).backward()
    counters = [torch.zeros(()) for _ in range(2)]
    dist.all_gather(counters, model.module.counter)
    if rank == 0:
        out.put([float(c) for c in counters])
    dist.destroy_process_group()


def _run(kwargs: dict) -> list[float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    out = context.Queue()
    mp.start_processes(_steps, args=(port, kwargs, out), nprocs=2, start_method="spawn")
    return out.get(timeout=60)


@pytest.mark.slow  # two spawned processes each time
def test_sdtrain_ddp_keeps_each_ranks_statistics_where_torchs_default_overwrites_them_with_rank_0s():
    strategy = build_strategy(TrainConfig(), 2, on_ray=False)
    assert strategy._ddp_kwargs == DDP_KWARGS  # what Lightning hands DistributedDataParallel
    assert DDP_KWARGS["broadcast_buffers"] is False and DDP_KWARGS["gradient_as_bucket_view"] is True
    # The same settings on Ray Train's strategy.
    from ray.train.lightning import RayDDPStrategy

    ray_strategy = build_strategy(TrainConfig(), 2, on_ray=True)
    assert isinstance(ray_strategy, RayDDPStrategy) and ray_strategy._ddp_kwargs == DDP_KWARGS
    # After 3 steps rank 1's counter is 33 with sdtrain's settings; torch's default broadcast rank 0's buffers
    # into rank 1 before each forward, leaving it at 2 + 11 = 13.
    assert _run(DDP_KWARGS) == [3.0, 33.0]
    assert _run({}) == [3.0, 13.0]
