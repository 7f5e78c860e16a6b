"""FLUX.2's original single-file checkpoint (`flux-2-klein-4b.safetensors`, `flux2-dev.safetensors`: Black Forest
Labs' key names, which ComfyUI loads too), read as if it were a diffusers `Flux2Transformer2DModel` folder:
`Flux2BFLReader` answers the calls of models/diffusers_io.py's `WeightReader`, so training starts from the file as
from a folder (`model.init_from=FILE`), each FSDP rank reading only the rows it holds. It is FLUX.1's reader
(models/flux/bfl.py: row ranges of fused tensors) over FLUX.2's names, which diffusers'
`convert_flux2_transformer_checkpoint_to_diffusers` maps (loaders/single_file_utils.py, diffusers 0.42):

- no biases; the shared modulations `double_stream_modulation_{img,txt}.lin` and `single_stream_modulation.lin`
  (`.linear` in diffusers), recognising the file;
- a double block's `img_attn.qkv` is to_q, to_k, to_v stacked by rows (`txt_attn.qkv` the add_*_proj),
  `{img,txt}_attn.proj` to_out.0 / to_add_out, `{img,txt}_mlp.0` / `.2` the feed-forwards' linear_in / linear_out,
  `*.norm.{query,key}_norm.scale` the q / k norms;
- a single block's `linear1` / `linear2` are its fused to_qkv_mlp_proj / to_out (unsplit, as in diffusers);
- `final_layer.adaLN_modulation.1` holds (shift, scale) where diffusers' norm_out.linear has (scale, shift).

The file holds no config: the shapes give the blocks, widths, heads (from the q norm's head dim), text width,
MLP ratio and whether there is a guidance embedding (dev) or not (klein); the rotary split is FLUX.2's 32/32/32/32
(scaled to the head dim; ComfyUI fixes it too). Unlike diffusers' single-file loader, which takes every FLUX.2 file
for dev, a klein file is read as klein.
"""

from pathlib import Path

from models.diffusers_io import CheckpointFormatError, open_safetensors
from models.flux.bfl import PREFIX, BFLReader, Rows
from models.flux2.model import Flux2Config, rotary_axes

MARKER = "double_stream_modulation_img.lin.weight"  # ComfyUI's and diffusers' test for a FLUX.2 file
# BFL module -> diffusers module, whole tensors outside the blocks
TOP = {"img_in": "x_embedder", "txt_in": "context_embedder",
       "time_in.in_layer": "time_guidance_embed.timestep_embedder.linear_1",
       "time_in.out_layer": "time_guidance_embed.timestep_embedder.linear_2",
       "guidance_in.in_layer": "time_guidance_embed.guidance_embedder.linear_1",
       "guidance_in.out_layer": "time_guidance_embed.guidance_embedder.linear_2",
       "double_stream_modulation_img.lin": "double_stream_modulation_img.linear",
       "double_stream_modulation_txt.lin": "double_stream_modulation_txt.linear",
       "single_stream_modulation.lin": "single_stream_modulation.linear", "final_layer.linear": "proj_out"}
FINAL = ("final_layer.adaLN_modulation.1", "norm_out.linear")  # (shift, scale) -> (scale, shift)
# double_blocks.i.<bfl> -> transformer_blocks.i.<diffusers> (whole tensors; the qkv are split)
DOUBLE = {"img_attn.proj": "attn.to_out.0", "txt_attn.proj": "attn.to_add_out", "img_mlp.0": "ff.linear_in",
          "img_mlp.2": "ff.linear_out", "txt_mlp.0": "ff_context.linear_in", "txt_mlp.2": "ff_context.linear_out",
          "img_attn.norm.query_norm": "attn.norm_q", "img_attn.norm.key_norm": "attn.norm_k",
          "txt_attn.norm.query_norm": "attn.norm_added_q", "txt_attn.norm.key_norm": "attn.norm_added_k"}
QKV = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
       "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
# single_blocks.i.<bfl> -> single_transformer_blocks.i.<diffusers>
SINGLE = {"linear1": "attn.to_qkv_mlp_proj", "linear2": "attn.to_out", "norm.query_norm": "attn.norm_q",
          "norm.key_norm": "attn.norm_k"}
NORMS = ("query_norm", "key_norm")  # their tensor is `scale` (diffusers: `weight`)


class Flux2BFLReader(BFLReader):
    """`WeightReader`'s interface over one FLUX.2 file in BFL's names (bare, or under ComfyUI's prefix)."""

    LAYOUT = f"Black Forest Labs' FLUX.2 key names ({MARKER}, double_blocks.0.img_attn.qkv.weight, ...), bare or " \
             f"under {PREFIX}"

    @staticmethod
    def recognizes(keys: set[str]) -> bool:
        return any(f"{prefix}{MARKER}" in keys for prefix in ("", PREFIX))

    def __init__(self, path: Path):
        self.path = Path(path)
        self.handle = open_safetensors(self.path)
        self.prefix = PREFIX if any(k.startswith(PREFIX) for k in self.handle.keys()) else ""
        self.bfl_shapes = {k.removeprefix(self.prefix): tuple(self.handle.get_slice(k).get_shape())
                           for k in self.handle.keys() if k.startswith(self.prefix)}
        needed = [MARKER, "img_in.weight", "double_blocks.0.img_attn.norm.query_norm.scale"]
        if any(k not in self.bfl_shapes for k in needed):
            raise CheckpointFormatError(f"{self.path} is not a FLUX.2 checkpoint in the original (BFL) layout: no "
                                        f"{[k for k in needed if k not in self.bfl_shapes]}")
        self.stacks = self.mapping()
        self.shapes = {key: (sum(r.count for r in rows), *self.bfl_shapes[rows[0].key][1:])
                       for key, rows in self.stacks.items()}
        self.bytes_read = 0

    def mapping(self) -> dict[str, list[Rows]]:
        """diffusers key -> the BFL row ranges it stacks, for every tensor of the file."""
        dim = self.bfl_shapes["img_in.weight"][0]
        s = self.bfl_shapes
        whole = lambda bfl: [Rows(bfl, 0, s.get(bfl, (0,))[0])]  # noqa: E731
        tensor = lambda bfl: f"{bfl}.scale" if bfl.endswith(NORMS) else f"{bfl}.weight"  # noqa: E731
        stacks = {f"{ours}.weight": whole(f"{bfl}.weight") for bfl, ours in TOP.items()
                  if not bfl.startswith("guidance_in") or "guidance_in.in_layer.weight" in s}
        final = f"{FINAL[0]}.weight"
        stacks[f"{FINAL[1]}.weight"] = [Rows(final, dim, dim), Rows(final, 0, dim)]
        for i in range(self.blocks("double_blocks")):
            bfl, ours = f"double_blocks.{i}", f"transformer_blocks.{i}"
            stacks.update({f"{ours}.{b}.weight": whole(tensor(f"{bfl}.{a}")) for a, b in DOUBLE.items()})
            for fused, parts in QKV.items():
                stacks.update({f"{ours}.{name}.weight": [Rows(f"{bfl}.{fused}.weight", n * dim, dim)]
                               for n, name in enumerate(parts)})
        for i in range(self.blocks("single_blocks")):
            bfl, ours = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
            stacks.update({f"{ours}.{b}.weight": whole(tensor(f"{bfl}.{a}")) for a, b in SINGLE.items()})
        read = {r.key for rows in stacks.values() for r in rows}
        missing, unused = sorted(read - s.keys()), sorted(s.keys() - read)
        if missing or unused:
            raise CheckpointFormatError(f"{self.path} is not a complete FLUX.2 checkpoint in the original (BFL) "
                                        f"layout: missing {missing[:10]}, not understood {unused[:10]}")
        return stacks

    def config(self) -> Flux2Config:
        """The architecture the shapes imply (the rotary split, which they do not, is FLUX.2's)."""
        s = self.bfl_shapes
        dim, channels = s["img_in.weight"]
        head_dim = s["double_blocks.0.img_attn.norm.query_norm.scale"][0]
        mlp_hidden = s["double_blocks.0.img_mlp.2.weight"][1] if "double_blocks.0.img_mlp.2.weight" in s else 3 * dim
        return Flux2Config(in_channels=channels, out_channels=s["final_layer.linear.weight"][0],
                           num_layers=self.blocks("double_blocks"), num_single_layers=self.blocks("single_blocks"),
                           attention_head_dim=head_dim, num_attention_heads=dim // head_dim,
                           joint_attention_dim=s["txt_in.weight"][1],
                           timestep_guidance_channels=s["time_in.in_layer.weight"][1], mlp_ratio=mlp_hidden / dim,
                           guidance_embeds="guidance_in.in_layer.weight" in s,
                           axes_dims_rope=rotary_axes(head_dim))
