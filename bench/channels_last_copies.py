"""The layout copies channels_last costs a UNet's training forward on CUDA, counted on a machine without one.

Each preset's UNet runs one training forward on fake CUDA tensors (tests/support/fake_cuda.py: CUDA-device
FakeTensors, so aten::group_norm takes its CUDA branch; convolutions get cuDNN's output layout, emulated, as a
CPU-only torch has no cuDNN to ask), NCHW and channels-last. Printed: the GroupNorms, those that copied a
channels-last input back to NCHW, the convolutions that copied an NCHW input to channels-last, and the float32
bytes of those copies. Counts, not times: what they cost on a GPU is docs/gpu.md's prediction.

    python bench/channels_last_copies.py            # tiny 128 px, small 256 px, sd2-base 256 and 512 px; ~1 min
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
from support.fake_cuda import fake_cuda, forward_on_fake_cuda, group_norm_copies  # noqa: E402

from sdtrain.config.schema import ModelConfig  # noqa: E402
from sdtrain.model.unet import build_unet  # noqa: E402

CASES = (("tiny", 128, 2), ("small", 256, 8), ("sd2-base", 256, 8), ("sd2-base", 512, 8))


def main() -> None:
    header = f"{'UNet':9} {'px':>4} {'batch':>5} {'layout':14} {'GroupNorms':>10} {'GN copies':>9}"
    print(f"{header} {'conv copies':>11} {'GB':>6}")
    for preset, px, batch in CASES:
        for memory_format in (torch.contiguous_format, torch.channels_last):
            with torch.device("meta"):
                unet = build_unet(ModelConfig(preset=preset))  # in training mode: training's layouts
            unet.to(memory_format=memory_format)
            side, width = px // 8, unet.config.cross_attention_dim

            def inputs(mode, memory_format=memory_format, side=side, width=width, batch=batch):
                sample = torch.empty(batch, 4, side, side).contiguous(memory_format=memory_format)
                timesteps = torch.zeros(batch, dtype=torch.long)
                captions = torch.empty(batch, 77, width)
                return (fake_cuda(mode, sample), fake_cuda(mode, timesteps)), {
                    "encoder_hidden_states": fake_cuda(mode, captions)
                }

            log = forward_on_fake_cuda(unet, inputs)
            norms = sum(func is torch.ops.aten.native_group_norm.default for func, *_ in log.calls)
            copies = group_norm_copies(log)
            size = sum(t.numel() * t.element_size() for t in [*copies, *log.conv_copies]) / 1e9
            layout = "channels_last" if memory_format is torch.channels_last else "NCHW"
            print(
                f"{preset:9} {px:4} {batch:5} {layout:14} {norms:10} {len(copies):9} {len(log.conv_copies):11} "
                f"{size:6.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
