"""Every private name of Ray, torch and W&B that sdtrain uses is one that the installed (pinned) versions have: an
upgrade that moves one fails here, naming it and what it served, instead of in a run (sdtrain.private)."""

import importlib

import pytest

from sdtrain.private import ray as ray_private
from sdtrain.private import torch as torch_private
from sdtrain.private import wandb as wandb_private
from sdtrain.private._lookup import PrivateApiMissing, pinned, private

NAMES = [
    (library.__name__.rsplit(".", 1)[1], module, name, purpose)
    for library in (ray_private, torch_private, wandb_private)
    for (module, name), purpose in library.NAMES.items()
]


@pytest.mark.parametrize(("library", "module", "name", "purpose"), NAMES, ids=[f"{m}.{n}" for _, m, n, _ in NAMES])
def test_each_private_name_sdtrain_uses_exists(library, module, name, purpose):
    assert private(module, name, library, purpose) is getattr(importlib.import_module(module), name)


def test_the_adapters_return_what_their_callers_use():
    assert ray_private.checkpoint_record_file().endswith(".json")
    assert issubclass(ray_private.checkpoint_record_error(), Exception)
    assert ray_private.report_logger_name().endswith(".py")
    assert ray_private.execution_callback_base() is not None
    assert ray_private.range_datasource(3).estimate_inmemory_data_size() is not None
    tracker = torch_private.transient_memory_tracker()()
    assert tracker.transient_peak == 0
    graphs, breaks = torch_private.compiled_graphs()
    assert graphs >= 0 and breaks >= 0
    assert hasattr(wandb_private.run_file_record(), "ParseFromString")


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
