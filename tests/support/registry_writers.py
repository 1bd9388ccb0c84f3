"""A retraining's registry writes after its model is judged (``record_and_promote``: lock, version, pointer, log), each
run in a process of its own that a test may SIGKILL after any write (CHAOS_KILL_VAR).

The processes fork from the session's forkserver (support.forkserver), which imported torch, diffusers and sdtrain
once: a fresh interpreter for each of test_retrain_rules' dozen writers spent 6-8 s importing them, most of that
test's time. Each is still a real process, killed for real by its own write."""

from __future__ import annotations

import os
import sys
from multiprocessing.context import ForkServerContext
from pathlib import Path


def _record(models: str, manifest: dict, kill_after: int | None, output: str) -> None:
    """The writer: a tiny UNet recorded and promoted as retraining's v0002 under a job's lock; prints the status."""
    with open(output, "w") as out:  # what the test reads back, and the traceback of a writer that failed
        os.dup2(out.fileno(), sys.stdout.fileno())
        os.dup2(out.fileno(), sys.stderr.fileno())
    import torch
    from diffusers import DDPMScheduler, UNet2DConditionModel

    from sdtrain.artifacts.conditional_writes import CHAOS_KILL_VAR
    from sdtrain.artifacts.loading import LoadedModel
    from sdtrain.artifacts.registry import ModelRegistry
    from sdtrain.driver.retrain import record_and_promote
    from sdtrain.model.presets import PRESETS

    if kill_after is not None:
        os.environ[CHAOS_KILL_VAR] = str(kill_after)  # read at each write: this process dies after its Nth
    registry = ModelRegistry(models)
    torch.manual_seed(1)
    with registry.lock({"run": "retrain-2026-11-02", "date": "2026-11-02", "job": "prodjob_chaos"}) as lock:
        unet = UNet2DConditionModel(**PRESETS["tiny"])
        trained = LoadedModel(unet, DDPMScheduler(), None, "ckpt", "raw", 2, (4, 16, 16), (77, 32), None, None, None)
        print(record_and_promote(registry, lock, trained, manifest).status, flush=True)


class RegistryWriters:
    """Starts writers (:func:`_record`) from ``context``, the session's preloaded forkserver (conftest's forkserver)."""

    def __init__(self, context: ForkServerContext, scratch: Path):
        self.context = context
        self.scratch = scratch
        self.runs = 0

    def run(
        self, models: str, manifest: dict, kill_after: int | None = None, timeout_s: float = 170
    ) -> tuple[int, str]:
        """(exit code: -9 where the writer was killed, its output); a writer still running after ``timeout_s`` fails."""
        self.runs += 1
        output = self.scratch / f"writer-{self.runs}.log"
        process = self.context.Process(target=_record, args=(models, manifest, kill_after, str(output)))
        process.start()
        process.join(timeout_s)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise AssertionError(f"a registry writer ran past {timeout_s} s: {output.read_text()[-2000:]}")
        return process.exitcode, output.read_text()
