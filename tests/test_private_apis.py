"""Every private name of Ray, torch, Lightning and W&B that sdtrain uses is one that the installed (pinned) versions
have: an upgrade that moves one fails here, naming it and what it served, instead of in a run (sdtrain.private)."""

import importlib

import pytest

from sdtrain.private import lightning as lightning_private
from sdtrain.private import ray as ray_private
from sdtrain.private import torch as torch_private
from sdtrain.private import wandb as wandb_private
from sdtrain.private._lookup import PrivateApiMissing, pinned, private

NAMES = [
    (library.__name__.rsplit(".", 1)[1], module, name, purpose)
    for library in (ray_private, torch_private, lightning_private, wandb_private)
    for (module, name), purpose in library.NAMES.items()
]


@pytest.mark.parametrize(("library", "module", "name", "purpose"), NAMES, ids=[f"{m}.{n}" for _, m, n, _ in NAMES])
def test_each_private_name_sdtrain_uses_exists(library, module, name, purpose):
    assert private(module, name, library, purpose) is getattr(importlib.import_module(module), name)


def test_the_adapters_return_what_their_callers_use():
    assert ray_private.checkpoint_record_file().endswith(".json")
    assert issubclass(ray_private.checkpoint_record_error(), Exception)
    assert 0 < ray_private.unstated_preemption_deadline_s() < 3600  # a hold this long is a slow phase, not a hang
    assert ray_private.report_logger_name().endswith(".py")
    assert ray_private.execution_callback_base() is not None
    assert ray_private.range_datasource(3).estimate_inmemory_data_size() is not None
    tracker = torch_private.transient_memory_tracker()()
    assert tracker.transient_peak == 0
    graphs, breaks = torch_private.compiled_graphs()
    assert graphs >= 0 and breaks >= 0
    assert hasattr(wandb_private.run_file_record(), "ParseFromString")


def test_lightnings_sigterm_broadcast_is_skipped_on_a_trainer_run_off_the_main_thread_only():
    """Where Lightning installs its SIGTERM handler (the main thread) the loop broadcasts the flag as before; in another
    thread (a Ray Train worker's) that Trainer's loop does nothing there, and other Trainers are left as they are."""
    import threading

    import lightning.pytorch as pl

    def trainer():
        return pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)

    on_ray, elsewhere = trainer(), trainer()
    loop_class = type(on_ray.fit_loop.epoch_loop)
    assert lightning_private.skip_sigterm_broadcast(elsewhere) is False
    skipped = []
    thread = threading.Thread(target=lambda: skipped.append(lightning_private.skip_sigterm_broadcast(on_ray)))
    thread.start()
    thread.join()
    assert skipped == [True]
    broadcast = getattr(on_ray.fit_loop.epoch_loop, lightning_private.BROADCAST)
    assert broadcast is lightning_private._nothing and broadcast() is None
    kept = getattr(elsewhere.fit_loop.epoch_loop, lightning_private.BROADCAST)
    assert kept.__func__ is getattr(loop_class, lightning_private.BROADCAST)


def test_a_missing_private_name_is_refused_naming_it_and_the_pin():
    with pytest.raises(PrivateApiMissing) as raised:
        private("torch._subclasses.fake_tensor", "NoSuchMode", "torch", "what it would serve")
    message = str(raised.value)
    assert "torch._subclasses.fake_tensor.NoSuchMode (what it would serve)" in message
    assert "torch==2.13.0" in message and pinned("torch") == "torch==2.13.0"


def test_no_module_outside_sdtrain_private_reaches_a_private_name():
    # Read as text: an import, an attribute or a logger name of another library's private module counts.
    import re
    from pathlib import Path

    import sdtrain

    root = Path(sdtrain.__file__).parent
    private_use = re.compile(r"\b(ray|torch|wandb)(\.\w+)*\.(_internal|_subclasses|_tools|_pytree|_dynamo)\b")
    found = [
        f"{path.relative_to(root)}:{number}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        if path.parent.name != "private"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if private_use.search(line) or "wandb_internal_pb2" in line
    ]
    assert not found, "private names outside sdtrain.private:\n" + "\n".join(found)
