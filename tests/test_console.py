"""What every worker used to print, and the deprecated settings behind it: an encoder actor's progress bar and
dtype notice, each DDP worker's broadcast_buffers warning. In this process, on real models and a real (one-rank)
gloo group. The preprocessing job and the demo run with deprecations as errors in test_preprocess.py and
test_entrypoint.py (support/deprecations.py)."""

import logging
import warnings

import pytest
import torch
import torch.distributed as dist
from support.tiny_models import write_tiny_sd_model

from sdtrain.config.schema import TrainConfig
from sdtrain.preprocess.encode_stage import Encoder
from sdtrain.train.strategy import build_strategy


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("captions", ["embeddings", "token_ids"])
def test_an_encoder_loads_its_models_without_a_progress_bar_or_a_notice(tmp_path, capfd, captions):
    """Each encoder actor printed transformers' "Loading weights" bar and diffusers' notice that the VAE was cast
    after loading instead of loaded in its dtype."""
    model = write_tiny_sd_model(str(tmp_path / "tiny-sd"))
    capfd.readouterr()
    # The libraries' loggers write to the stderr they found at import (pytest's, then): their records are read here.
    notices = _Records()
    for name in ("diffusers", "transformers"):
        logging.getLogger(name).addHandler(notices)
    try:
        encoder = Encoder(model=model, latent="mean", seed=0, dtype="float16", resolution=32, captions=captions)
    finally:
        for name in ("diffusers", "transformers"):
            logging.getLogger(name).removeHandler(notices)
    assert capfd.readouterr() == ("", "")
    assert notices.messages == []
    assert next(encoder.vae.parameters()).dtype == torch.float16  # loaded in the dtype asked for
    if encoder.text_encoder is not None:
        assert next(encoder.text_encoder.parameters()).dtype == torch.float16
    # The bars are off while sdtrain loads, not for the rest of the process (generate.py's user, a notebook).
    from transformers.utils import logging as transformers_logging

    assert transformers_logging.is_progress_bar_enabled()


def test_ddp_as_sdtrain_builds_it_warns_of_nothing(tmp_path):
    """torch 2.13 deprecates DDP's broadcast_buffers, which every DDP worker then warned of at each start."""
    from lightning.pytorch.strategies import DDPStrategy

    strategy = build_strategy(TrainConfig(), world_size=2, on_ray=False)
    assert isinstance(strategy, DDPStrategy)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1), **strategy._ddp_kwargs)
        assert [str(w.message) for w in caught] == []
        assert module.forward_sync_buffers is False  # rank 0's statistics never overwrite another rank's
    finally:
        dist.destroy_process_group()
