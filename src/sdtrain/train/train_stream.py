"""This rank's planned stream of training micro-batches, read ahead on a thread of its own and checked against
the plan (sdtrain.data.read_order), as Lightning's one epoch: a chain of datasets, one a horizon of steps
(sdtrain.data.horizons)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import numpy as np
import ray.data
import ray.train
import torch

from sdtrain.errors import TrainingFailed, find_sdtrain_error
from sdtrain.train.watchdog import Phase, StallWatchdog

Batches = Iterator[dict[str, torch.Tensor]]


class TrainStream:
    """This rank's planned stream of micro-batches to ``train.max_steps``, as Lightning's one epoch.

    The stream is read once: its order and length are the sampling plan's, so a second pass
    would read rows twice. The first batch is checked against the plan, which catches a data
    position that does not match the checkpoint the worker was restored from.

    :meth:`start` begins reading before the model is built: the stream's start-up (Ray Data's
    executor, a worker process for the first read task, the first window's read) then overlaps
    building the model, the Lightning trainer and DDP instead of following them.
    """

    def __init__(
        self,
        shard: ray.data.DataIterator,
        micro_batch: int,
        prefetch_batches: int,
        device: torch.device,
        watchdog: StallWatchdog | None = None,
        pin_memory: bool = False,
    ):
        self.shard = shard
        self.pin_memory = pin_memory  # on GPUs: Ray Data pins each batch, and its copy to the device is non_blocking
        self.watchdog = watchdog  # told when the training loop waits for data, and when it has its batch
        self.micro_batch = micro_batch
        self.prefetch_batches = prefetch_batches
        self.device = device
        self.expected_first: np.ndarray | None = None  # set by _fit, before Lightning iterates
        self._batches: Batches | None = None
        self._first: Future[dict[str, torch.Tensor] | None] | None = None
        self._horizons: list[int] = []  # micro-batches of each horizon (follow_with); none set: the first shard only
        self._next_shard: Callable[[int], ray.data.DataIterator] | None = None
        self._ahead = 0
        self._started = False
        self._wait_s = 0.0

    def start(self) -> Future[dict[str, torch.Tensor] | None]:
        """Fetch the first batch in the background from now on; returns its future (None: no rows)."""
        self._first, self._batches = self._begin(self.shard)
        return self._first

    def follow_with(self, horizon_batches: list[int], next_shard: Callable[[int], ray.data.DataIterator], ahead: int):
        """Go on, after the first shard's ``horizon_batches[0]`` batches, with the shard of each next horizon.

        Args:
            horizon_batches: the micro-batches of each horizon (sdtrain.data.horizons.Horizons), the first shard's
                first.
            next_shard: makes horizon ``i``'s shard (``i`` from 1).
            ahead: micro-batches before a horizon's end at which the next one's first batch starts reading, so its
                dataset's start-up overlaps the last of this one.
        """
        self._horizons, self._next_shard, self._ahead = horizon_batches, next_shard, ahead

    def _begin(self, shard: ray.data.DataIterator) -> tuple[Future[dict[str, torch.Tensor] | None], Batches]:
        batches: Batches = iter(
            shard.iter_torch_batches(
                batch_size=self.micro_batch,
                prefetch_batches=self.prefetch_batches,
                device=self.device,
                pin_memory=self.pin_memory,
            )
        )
        first: Future[dict[str, torch.Tensor] | None] = Future()

        def fetch_first():
            try:
                first.set_result(next(batches, None))
            except BaseException as error:  # handed to the training thread, which raises it
                first.set_exception(error)

        # A daemon thread: a worker that fails while building its model must not wait for it.
        threading.Thread(target=fetch_first, name="sdtrain-first-batch", daemon=True).start()
        return first, batches

    def _chained(self) -> Batches:
        """The batches after the first, across the horizons: each next horizon started ``ahead`` batches early."""
        assert self._batches is not None
        batches, index, taken = self._batches, 0, 1  # the first batch is taken
        while True:
            upcoming = None
            following = self._next_shard if index + 1 < len(self._horizons) else None
            for batch in batches:
                taken += 1
                if following is not None and upcoming is None and taken >= self._horizons[index] - self._ahead:
                    upcoming = self._begin(following(index + 1))
                yield batch
            # Fewer: the run would end short of train.max_steps; more before another horizon: its steps' rows would
            # mix. Either way the plan and Ray Data's batching disagree, and a restart would read the same.
            planned = self._horizons[index] if self._horizons else taken  # none set: the first shard is the plan
            if taken < planned or (following is not None and taken != planned):
                raise self._off_plan(index, taken)
            if following is None:
                return
            first, batches = upcoming or self._begin(following(index + 1))
            index, taken = index + 1, 1
            head = first.result()
            if head is None:
                raise self._off_plan(index, 0)
            yield head

    def _off_plan(self, horizon: int, taken: int) -> TrainingFailed:
        return TrainingFailed(
            f"the training stream's horizon {horizon} held {taken} micro-batches, its plan "
            f"{self._horizons[horizon]}: Ray Data's batching changed"
        )

    def take_wait_s(self) -> float:
        """Seconds the training loop waited for its next batch since the previous call. The first
        batch's wait is start-up, not a stall: it shows in the metric time_to_first_step_s instead."""
        wait, self._wait_s = self._wait_s, 0.0
        return wait

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self._started:  # Lightning's next epoch: this one ended before train.max_steps
            # A TrainingFailed: the same plan would end as short after a restart (StopOnDeterministicErrors).
            raise TrainingFailed("the training stream was read to its end before train.max_steps")
        self._started = True
        # train_loop_per_worker starts the stream before it builds the model, long before Lightning iterates it.
        assert self._first is not None and self._batches is not None, "TrainStream.start() was not called"
        try:
            self._enter(Phase.FIRST_BATCH)
            batch = self._first.result()
            self._enter(Phase.BETWEEN_STEPS)
            if batch is None:
                if self._horizons and self._horizons[0] > 0:
                    raise self._off_plan(0, 0)
                return
            self._check_position(batch["sample_index"])
            yield batch
            batches = self._chained()
            while True:
                asked = time.perf_counter()
                self._enter(Phase.NEXT_BATCH)
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                self._enter(Phase.BETWEEN_STEPS)
                self._wait_s += time.perf_counter() - asked
                yield batch
        except Exception as error:
            data_error = find_sdtrain_error(error)
            if data_error is not None and data_error is not error:
                raise data_error from None  # Ray Data wraps it: surface our one-paragraph message
            raise

    def _enter(self, phase: str) -> None:
        if self.watchdog is not None:
            self.watchdog.enter(phase)

    def _check_position(self, indices: torch.Tensor) -> None:
        found = indices.tolist()
        expected = self.expected_first
        assert expected is not None  # _fit sets it before the trainer reads the first batch
        if found != list(expected):
            raise TrainingFailed(
                f"the training data stream starts at samples {found[:4]}..., but the restored checkpoint's "
                f"data position expects {list(expected[:4])}...: the data was positioned from "
                "another checkpoint than the one restored. Re-run to resume from the latest checkpoint"
            )
