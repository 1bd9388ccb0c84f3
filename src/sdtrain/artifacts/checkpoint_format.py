"""A checkpoint directory's layout: its name and the files in it.

A checkpoint is a directory ``checkpoint_<step>/`` holding ``checkpoint.ckpt``: Lightning's
full training state (weights, optimizer, LR scheduler, loop progress) plus, under the
``sdtrain`` key, the UNet and noise-scheduler configs, the data shapes and the run config; the
state dict holds the UNet (``unet.``), its EMA when train.ema_decay is set (``ema_unet.``) and
the unconditional caption embedding (``unconditional_caption``);
``history.json``, the metric rows reported up to that step; and ``data_state.json``, the data
position to resume from. Only plain data and tensors are stored, so loading never unpickles code
(``torch.load(weights_only=True)``; :mod:`sdtrain.artifacts.loading` loads them).

This module imports nothing heavy: Ray Train's controller loads it (through
:mod:`sdtrain.train.shards`, which reads the data position), and importing diffusers and Lightning
there cost about 6 s of every run's start-up.
"""

CHECKPOINT_FILE = "checkpoint.ckpt"
# The metric rows reported up to the checkpoint's step: the run's curve, readable without the weights.
HISTORY_FILE = "history.json"
# The step and the data position after it (sdtrain.data.read_order.DataState): where the data stream resumes.
DATA_STATE_FILE = "data_state.json"
# With run.record_samples: (world size, rows) sample indices trained on since the previous checkpoint.
SAMPLES_FILE = "samples.npy"


def checkpoint_dir_name(step: int) -> str:
    return f"checkpoint_{step:09d}"
