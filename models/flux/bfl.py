"""FLUX.1's original single-file checkpoint (`flux1-dev.safetensors`, Black Forest Labs' key names), read as if it
were a diffusers `FluxTransformer2DModel` folder: `BFLReader` answers the same calls as models/diffusers_io.py's
`WeightReader` (keys and shapes under diffusers' names, a block of one tensor at a time), so training starts from
the file as from a folder (`model.init_from=FILE`), each FSDP rank reading only the rows it holds.

What differs from diffusers' layout: fused projections (a double block's `img_attn.qkv` is to_q, to_k and to_v
stacked by rows; a single block's `linear1` is to_q, to_k, to_v and proj_mlp), renamed modules, and the final
modulation's halves in the order (shift, scale) where diffusers has (scale, shift). A diffusers tensor is a
stack of row ranges of BFL tensors (`Rows`); a read of rows o..o+n takes just those rows from each.
The config (which the file does not hold) follows from the shapes, the rotary split is FLUX.1's (said once per
file; a head dim other than FLUX.1's 128 gets a warning with the split assumed).
"""

import functools
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from models.blocks import rotary_axes
from models.diffusers_io import CheckpointFormatError, check_shapes, open_safetensors
from models.flux.model import FluxConfig

log = logging.getLogger("mmdit")
PREFIX = "model.diffusion_model."  # ComfyUI's files put the transformer under it
FLUX1_HEAD_DIM = 128
EMBEDDERS = {"time_in": "time_text_embed.timestep_embedder", "vector_in": "time_text_embed.text_embedder",
             "guidance_in": "time_text_embed.guidance_embedder"}
# double_blocks.i.<bfl> -> transformer_blocks.i.<diffusers> (whole tensors)
DOUBLE = {"img_mod.lin": "norm1.linear", "txt_mod.lin": "norm1_context.linear", "img_attn.proj": "attn.to_out.0",
          "txt_attn.proj": "attn.to_add_out", "img_mlp.0": "ff.net.0.proj", "img_mlp.2": "ff.net.2",
          "txt_mlp.0": "ff_context.net.0.proj", "txt_mlp.2": "ff_context.net.2"}
DOUBLE_NORMS = {"img_attn.norm.query_norm.scale": "attn.norm_q.weight", "img_attn.norm.key_norm.scale": "attn.norm_k.weight",
                "txt_attn.norm.query_norm.scale": "attn.norm_added_q.weight",
                "txt_attn.norm.key_norm.scale": "attn.norm_added_k.weight"}
SINGLE = {"linear2": "proj_out", "modulation.lin": "norm.linear"}
SINGLE_NORMS = {"norm.query_norm.scale": "attn.norm_q.weight", "norm.key_norm.scale": "attn.norm_k.weight"}


@dataclass(frozen=True)
class Rows:
    key: str  # the BFL tensor
    start: int  # its first row in the diffusers tensor's stack
    count: int


@functools.cache  # once per file, however often its config is read
def say_rotary_split(path: Path, head_dim: int) -> None:
    """The file holds no rotary split: say which one is assumed, and warn where the head dim is not FLUX.1's."""
    if head_dim == FLUX1_HEAD_DIM:
        log.info("%s: FLUX.1's rotary split %s of its head dim %d (the file does not hold one)", path,
                 rotary_axes(head_dim), head_dim)
    else:
        log.warning("%s: head dim %d is not FLUX.1's (%d), and the file holds no rotary split: assuming FLUX.1's "
                    "scaled to it, %s; a model trained with another gives wrong outputs", path, head_dim,
                    FLUX1_HEAD_DIM, rotary_axes(head_dim))


class BFLReader:
    """`WeightReader`'s interface over one BFL-format safetensors file."""

    LAYOUT = "Black Forest Labs' key names (img_in.weight, double_blocks.0.img_attn.qkv.weight, ...), or ComfyUI's " \
             f"copy under {PREFIX}"

    @staticmethod
    def recognizes(keys: set[str]) -> bool:
        """FLUX.1's names; FLUX.2's files have these too, and its shared modulation (models/flux2/bfl.py)."""
        return any(f"{prefix}img_in.weight" in keys and f"{prefix}double_blocks.0.img_attn.qkv.weight" in keys
                   and f"{prefix}double_stream_modulation_img.lin.weight" not in keys for prefix in ("", PREFIX))

    def __init__(self, path: Path):
        self.path = Path(path)
        self.handle = open_safetensors(self.path)
        self.prefix = PREFIX if any(k.startswith(PREFIX) for k in self.handle.keys()) else ""
        self.bfl_shapes = {k.removeprefix(self.prefix): tuple(self.handle.get_slice(k).get_shape())
                           for k in self.handle.keys() if k.startswith(self.prefix)}
        if "img_in.weight" not in self.bfl_shapes or "double_blocks.0.img_attn.qkv.weight" not in self.bfl_shapes:
            raise CheckpointFormatError(f"{self.path} is not a FLUX.1 checkpoint in the original (BFL) layout: no "
                                        f"img_in.weight or double_blocks.0.img_attn.qkv.weight")
        self.stacks = self.mapping()
        self.shapes = {key: (sum(r.count for r in rows), *self.bfl_shapes[rows[0].key][1:])
                       for key, rows in self.stacks.items()}
        self.bytes_read = 0

    def blocks(self, kind: str) -> int:
        return len({int(m.group(1)) for k in self.bfl_shapes if (m := re.match(rf"{kind}\.(\d+)\.", k))})

    def mapping(self) -> dict[str, list[Rows]]:
        """diffusers key -> the BFL row ranges it stacks, for every tensor of the file."""
        dim = self.bfl_shapes["img_in.weight"][0]
        whole = lambda bfl: [Rows(bfl, 0, self.bfl_shapes.get(bfl, (0,))[0])]  # noqa: E731
        stacks = {}

        def linear(bfl: str, ours: str | None, parts=None):  # every linear of FLUX.1 has a bias
            for kind in ("weight", "bias"):
                if parts is None:
                    stacks[f"{ours}.{kind}"] = whole(f"{bfl}.{kind}")
                    continue
                start = 0
                for name, rows in parts:
                    stacks[f"{name}.{kind}"] = [Rows(f"{bfl}.{kind}", start, rows)]
                    start += rows

        for bfl, ours in EMBEDDERS.items():
            if bfl == "guidance_in" and not self.has_guidance():  # schnell has no guidance embedding
                continue
            linear(f"{bfl}.in_layer", f"{ours}.linear_1")
            linear(f"{bfl}.out_layer", f"{ours}.linear_2")
        linear("img_in", "x_embedder")
        linear("txt_in", "context_embedder")
        linear("final_layer.linear", "proj_out")
        for kind in ("weight", "bias"):  # (shift, scale) -> diffusers' (scale, shift)
            key = f"final_layer.adaLN_modulation.1.{kind}"
            stacks[f"norm_out.linear.{kind}"] = [Rows(key, dim, dim), Rows(key, 0, dim)]
        for i in range(self.blocks("double_blocks")):
            bfl, ours = f"double_blocks.{i}", f"transformer_blocks.{i}"
            for a, b in DOUBLE.items():
                linear(f"{bfl}.{a}", f"{ours}.{b}")
            for stream, names in (("img", ("to_q", "to_k", "to_v")), ("txt", ("add_q_proj", "add_k_proj", "add_v_proj"))):
                linear(f"{bfl}.{stream}_attn.qkv", None, [(f"{ours}.attn.{n}", dim) for n in names])
            stacks.update({f"{ours}.{b}": whole(f"{bfl}.{a}") for a, b in DOUBLE_NORMS.items()})
        for i in range(self.blocks("single_blocks")):
            bfl, ours = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
            for a, b in SINGLE.items():
                linear(f"{bfl}.{a}", f"{ours}.{b}")
            mlp = self.bfl_shapes[f"{bfl}.linear1.weight"][0] - 3 * dim
            linear(f"{bfl}.linear1", None, [(f"{ours}.attn.to_q", dim), (f"{ours}.attn.to_k", dim),
                                            (f"{ours}.attn.to_v", dim), (f"{ours}.proj_mlp", mlp)])
            stacks.update({f"{ours}.{b}": whole(f"{bfl}.{a}") for a, b in SINGLE_NORMS.items()})
        missing = sorted({r.key for rows in stacks.values() for r in rows} - self.bfl_shapes.keys())
        unused = sorted(self.bfl_shapes.keys() - {r.key for rows in stacks.values() for r in rows})
        if missing or unused:
            raise CheckpointFormatError(f"{self.path} is not a complete FLUX.1 checkpoint in the original (BFL) "
                                        f"layout: missing {missing[:10]}, not understood {unused[:10]}")
        return stacks

    def has_guidance(self) -> bool:
        return "guidance_in.in_layer.weight" in self.bfl_shapes

    def config(self) -> FluxConfig:
        """The architecture the shapes imply (the rotary split, which they do not, is FLUX.1's)."""
        s = self.bfl_shapes
        dim, channels = s["img_in.weight"]
        head_dim = s["double_blocks.0.img_attn.norm.query_norm.scale"][0]
        say_rotary_split(self.path, head_dim)
        return FluxConfig(in_channels=channels, out_channels=s["final_layer.linear.weight"][0],
                          num_layers=self.blocks("double_blocks"), num_single_layers=self.blocks("single_blocks"),
                          attention_head_dim=head_dim, num_attention_heads=dim // head_dim,
                          joint_attention_dim=s["txt_in.weight"][1], pooled_projection_dim=s["vector_in.in_layer.weight"][1],
                          guidance_embeds=self.has_guidance(), axes_dims_rope=rotary_axes(head_dim))

    def check(self, expected: dict[str, tuple], source) -> None:
        check_shapes(expected, self.shapes, source)

    def read(self, key: str, offsets: tuple[int, ...] | None = None, sizes: tuple[int, ...] | None = None):
        """Tensor `key` (diffusers' name), or its block starting at `offsets` of `sizes`."""
        shape = self.shapes[key]
        offsets, sizes = offsets or (0,) * len(shape), sizes or shape
        first, last = offsets[0], offsets[0] + sizes[0]
        rest = tuple(slice(o, o + n) for o, n in zip(offsets[1:], sizes[1:]))
        pieces, position = [], 0
        for rows in self.stacks[key]:
            low, high = max(first, position), min(last, position + rows.count)
            if low < high:
                start = rows.start + low - position
                region = self.handle.get_slice(self.prefix + rows.key)[(slice(start, start + high - low), *rest)]
                pieces.append(region)
            position += rows.count
        out = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        self.bytes_read += out.numel() * out.element_size()
        return out
