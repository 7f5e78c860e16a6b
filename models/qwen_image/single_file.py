"""Qwen-Image's transformer as one safetensors file, the form ComfyUI loads (Comfy-Org's repackaged
`qwen_image_bf16.safetensors`, `qwen_image_fp8_e4m3fn.safetensors`), read as if it were a diffusers
`QwenImageTransformer2DModel` folder: `QwenSingleFileReader` answers the calls of models/diffusers_io.py's
`WeightReader`, so training starts from the file as from a folder (`model.init_from=FILE`), each FSDP rank reading
only the rows it holds.

ComfyUI's Qwen-Image module names its parameters as diffusers does (ComfyUI a125cd84, comfy/ldm/qwen_image/model.py),
so the keys are diffusers' own: bare (the repackaged files) or under `model.diffusion_model.` (a checkpoint ComfyUI
saves; its loader strips the prefix, comfy/sd.py:1285-1288). The weights are bf16, fp32 or plain float8 casts, which
ComfyUI casts back to compute; a "scaled fp8" file (a `scaled_fp8` key, and a `scale_weight` per linear that
multiplies its weight, comfy/model_detection.py:693-703, comfy/ops.py:379-428) is refused.

The config is not in the file: the shapes give the blocks, widths and channels, the q norm the head dim; the patch is
2 (ComfyUI's only one) and the rotary split, which no shape holds, is the released 16/56/56 of a 128 head
(models/blocks.py's `rotary_axes`; ComfyUI's default, comfy/ldm/qwen_image/model.py:298).
"""

import functools
import logging
import re
from pathlib import Path

import torch

from models.blocks import rotary_axes
from models.diffusers_io import CheckpointFormatError, check_shapes, open_safetensors
from models.qwen_image.model import QwenImage, QwenImageConfig

log = logging.getLogger("mmdit")
PREFIX = "model.diffusion_model."  # ComfyUI's checkpoints put the transformer under it
MARKERS = ("txt_norm.weight", "img_in.weight")  # what tells the file apart (ComfyUI: txt_norm.weight)
CONFIG_KEYS = ("img_in.weight", "txt_in.weight", "proj_out.weight", "transformer_blocks.0.attn.norm_q.weight")
PATCH = 2
RELEASED_HEAD_DIM = 128


@functools.cache
def assumed_rotary_axes(head_dim: int) -> list[int]:
    """The rotary split of a file, which holds none; said once per process."""
    axes = rotary_axes(head_dim)
    if head_dim == RELEASED_HEAD_DIM:
        log.info("a Qwen-Image single file holds no rotary split: assuming the released one, axes_dims_rope=%s", axes)
    else:
        log.warning("a Qwen-Image single file holds no rotary split, and its head dim is %d (released: %d): assuming "
                    "axes_dims_rope=%s; a model trained with another split needs its diffusers folder (config.json)",
                    head_dim, RELEASED_HEAD_DIM, axes)
    return axes


class QwenSingleFileReader:
    """`WeightReader`'s interface over one Qwen-Image transformer file in diffusers' key names."""

    LAYOUT = f"diffusers' key names (txt_norm.weight, img_in.weight, ...), bare or under ComfyUI's {PREFIX}"

    @staticmethod
    def recognizes(keys: set[str]) -> bool:
        return any(all(prefix + key in keys for key in MARKERS) for prefix in ("", PREFIX))

    def __init__(self, path: Path):
        self.path = Path(path)
        self.handle = open_safetensors(self.path)
        keys = list(self.handle.keys())
        self.prefix = PREFIX if any(k.startswith(PREFIX) for k in keys) else ""
        # a ComfyUI checkpoint may hold the VAE and text encoders beside the transformer: only its keys are read
        self.shapes = {k.removeprefix(self.prefix): tuple(self.handle.get_slice(k).get_shape())
                       for k in keys if k.startswith(self.prefix)}
        if "scaled_fp8" in self.shapes:
            raise CheckpointFormatError(f"{self.path} is a ComfyUI \"scaled fp8\" file (its scaled_fp8 key: each "
                                        f"weight is stored divided by its scale_weight), which this trainer does not "
                                        f"read: use the bf16 file, or the plain float8_e4m3fn one")
        self.check_complete()
        self.bytes_read = 0

    def check_complete(self) -> None:
        """Every key of the transformer the shapes describe, and no other: each difference named."""
        absent = [k for k in CONFIG_KEYS if k not in self.shapes]
        if absent:
            raise CheckpointFormatError(f"{self.path} is not a complete Qwen-Image transformer: no {absent}")
        try:
            with torch.device("meta"):
                expected = QwenImage(self.config()).state_dict().keys()
        except ValueError as e:
            raise CheckpointFormatError(f"{self.path} is not a Qwen-Image transformer this trainer builds: "
                                        f"{e}") from None
        missing, unused = sorted(expected - self.shapes.keys()), sorted(self.shapes.keys() - expected)
        if missing or unused:
            raise CheckpointFormatError(f"{self.path} is not a complete Qwen-Image transformer in diffusers' key "
                                        f"names: missing {missing[:10]}, not understood {unused[:10]}")

    def blocks(self) -> int:
        return len({int(m.group(1)) for k in self.shapes if (m := re.match(r"transformer_blocks\.(\d+)\.", k))})

    def config(self) -> QwenImageConfig:
        """The architecture the shapes imply."""
        s = self.shapes
        dim, channels = s["img_in.weight"]
        head_dim = s["transformer_blocks.0.attn.norm_q.weight"][0]
        return QwenImageConfig(patch_size=PATCH, in_channels=channels, out_channels=s["proj_out.weight"][0] // PATCH**2,
                               num_layers=self.blocks(), attention_head_dim=head_dim,
                               num_attention_heads=dim // head_dim, joint_attention_dim=s["txt_in.weight"][1],
                               axes_dims_rope=assumed_rotary_axes(head_dim))

    def check(self, expected: dict[str, tuple], source) -> None:
        check_shapes(expected, self.shapes, source)

    def read(self, key: str, offsets: tuple[int, ...] | None = None, sizes: tuple[int, ...] | None = None):
        """Tensor `key`, or its block starting at `offsets` of `sizes`, in the file's dtype: the caller casts (a
        float8 block copies into a parameter of any dtype as a bf16 one does)."""
        region = self.handle.get_slice(self.prefix + key)
        region = region[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))] if offsets is not None else region[:]
        self.bytes_read += region.numel() * region.element_size()
        return region
