"""FLUX.2's transformer (klein 4B and 9B, dev), in one file: double-stream blocks over [text, image], then
single-stream blocks over the joint sequence, as FLUX.1 has them, with what FLUX.2 changed:

- no biases anywhere;
- the modulation is shared: three projections of the timestep embedding (`double_stream_modulation_img`,
  `double_stream_modulation_txt`, `single_stream_modulation`) are computed once per forward and handed to every
  block of their kind; the blocks own no modulation weights;
- the feed-forwards are SwiGLU: `linear_in` projects to [gate | up] (gate first), silu(gate) * up goes into
  `linear_out`; a single block fuses its q, k, v and MLP input into one `to_qkv_mlp_proj` ([q | k | v | gate | up])
  and its attention and MLP outputs into one `to_out`;
- rotary positions over four axes (t, h, w, l), theta 2000: text token l at (0, 0, 0, l), image token (row,
  column) at (0, row, column, 0);
- one timestep (and, for the guidance-distilled dev, guidance) embedding, `time_guidance_embed`; no pooled text
  and no text mask (the pipelines attend to the text's padding).

Submodule and parameter names follow diffusers' `Flux2Transformer2DModel` key for key (docs/flux2-architecture.md
lists them). Like the other families' modules, this one takes latents [B, C, H, W]: the pipeline's latents, which
its VAE step already patchified 2 x 2 into 128 channels and normalised (models/vae.py), so a token is one latent
pixel (in_channels = C; a model trained from scratch on other data may pack p x p pixels: in_channels = C p p). It
takes the text tokens, timestep = sigma x 1000 and, with a guidance embedding, `guidance` [B] on the pipeline's
scale (dev: 4.0), and returns the velocity [B, C, H, W]. The rotary tables are computed once per latent size and
text length and reused by every block and step.

Reference images (both pipelines take them natively, `image=`) come as `reference_latents`, a list of [B, C, h, w]
latents (patchified and normalised as the target), each of its own size: its tokens are appended after the
target's at (10 + 10 i, row, column, 0) for reference i (`_prepare_image_ids`), and the velocity is the target's
alone.
"""

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.attention import sdpa_attention
from models.blocks import (JOINT_TEXT_ONLY, AdaLNContinuous, JointAttention, MLPEmbedder, RMSNorm, apply_rope,
                           check_rotary_split, gated, initial_value, initialize, layer_norm, merge_heads, modulate,
                           modulation, pack, pack_references, packing, rope_tables, split_heads, timestep_features,
                           unpack)

EPS = 1e-6  # every norm's (diffusers' config key `eps`)
# the shared modulations: module -> the (shift, scale, gate) sets it gives each block of its kind
MODULATIONS = {"double_stream_modulation_img": 2, "double_stream_modulation_txt": 2, "single_stream_modulation": 1}


@dataclass
class Flux2Config:  # diffusers' config.json keys and defaults (FLUX.2-dev)
    patch_size: int = 1  # diffusers' key; tokens are packed outside its module (here: in `Flux2.forward`)
    in_channels: int = 128  # the VAE's 32 channels, patchified 2 x 2 by the pipeline
    out_channels: int | None = None  # None: in_channels
    num_layers: int = 8  # double-stream blocks
    num_single_layers: int = 48
    attention_head_dim: int = 128
    num_attention_heads: int = 48
    joint_attention_dim: int = 15360  # dev: Mistral-Small's 3 x 5120 (klein-4B: Qwen3-4B's 3 x 2560)
    timestep_guidance_channels: int = 256  # sinusoidal features of the timestep (and guidance)
    mlp_ratio: float = 3.0  # SwiGLU hidden width / hidden size
    axes_dims_rope: list = field(default_factory=lambda: [32, 32, 32, 32])  # rotary channels of (t, h, w, l)
    rope_theta: int = 2000
    eps: float = EPS
    guidance_embeds: bool = True  # dev: True (guidance-distilled); klein: False

    def __post_init__(self):
        self.axes_dims_rope = list(self.axes_dims_rope)
        self.out_channels = self.out_channels or self.in_channels

    @property
    def hidden_size(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)


# ----------------------------------------------------------------------------------------------- positions


def rotary_axes(head_dim: int) -> list[int]:
    """FLUX.2's split of a head's channels over its (t, h, w, l) position axes, 32/32/32/32 of 128, for any head
    dim: four even quarters (the last takes what is left)."""
    quarter = 2 * (head_dim // 8)
    return [quarter, quarter, quarter, head_dim - 3 * quarter]


def grid_ids(time: int, rows: int, columns: int, device: torch.device) -> torch.Tensor:
    """[rows * columns, 4] ids (time, row, column, 0) of an image's tokens."""
    grid = torch.zeros(rows, columns, 4, device=device)
    grid[..., 0] = time
    grid[..., 1] = torch.arange(rows, device=device)[:, None]
    grid[..., 2] = torch.arange(columns, device=device)[None, :]
    return grid.reshape(-1, 4)


def position_ids(text_tokens: int, rows: int, columns: int, device: torch.device,
                 references: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
    """[text + image tokens, 4] ids (t, h, w, l) of the joint sequence [text, image, references]: text token l at
    (0, 0, 0, l), image token (row, column) at (0, row, column, 0), reference i's at (10 + 10 i, row, column, 0),
    as Flux2KleinPipeline and Flux2Pipeline make them (`_prepare_text_ids`, `_prepare_latent_ids`,
    `_prepare_image_ids`)."""
    text = torch.zeros(text_tokens, 4, device=device)
    text[:, 3] = torch.arange(text_tokens, device=device)
    return torch.cat([text, grid_ids(0, rows, columns, device),
                      *(grid_ids(10 + 10 * i, *grid, device) for i, grid in enumerate(references))])


# ----------------------------------------------------------------------------------------------- pieces


class TimeGuidanceEmbed(nn.Module):
    """temb = MLP(sinusoidal features of the timestep) (+ MLP(features of the guidance), dev); no biases
    (diffusers' `Flux2TimestepGuidanceEmbeddings`)."""

    def __init__(self, dim: int, channels: int, guidance: bool):
        super().__init__()
        self.channels = channels
        self.timestep_embedder = MLPEmbedder(channels, dim, bias=False)
        self.guidance_embedder = MLPEmbedder(channels, dim, bias=False) if guidance else None

    def forward(self, timestep: torch.Tensor, guidance: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        temb = self.timestep_embedder(timestep_features(timestep, self.channels).to(dtype))
        if self.guidance_embedder is not None:
            temb = temb + self.guidance_embedder(timestep_features(guidance, self.channels).to(dtype))
        return temb


class Modulation(nn.Module):
    """SiLU -> Linear(D, 3 D x sets) of the timestep embedding, no bias (diffusers' `Flux2Modulation`): for each set
    (shift, scale, gate), the attention's set first. The blocks chunk its output."""

    def __init__(self, dim: int, sets: int):
        super().__init__()
        self.linear = nn.Linear(dim, 3 * sets * dim, bias=False)

    def forward(self, temb: torch.Tensor) -> torch.Tensor:
        return modulation(self.linear, temb)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x = [gate | up] (diffusers' `Flux2SwiGLU`)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class FeedForward(nn.Module):
    """linear_in -> SwiGLU -> linear_out, no biases (diffusers' `Flux2FeedForward`)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.linear_in = nn.Linear(dim, 2 * hidden, bias=False)
        self.linear_out = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_out(swiglu(self.linear_in(x)))


class ParallelAttention(nn.Module):
    """A single block's attention and MLP side by side (diffusers' `Flux2ParallelSelfAttention`): one projection
    to [q | k | v | gate | up], attention over the joint sequence with rotary positions, SwiGLU, one projection of
    [attention | MLP] back."""

    def __init__(self, dim: int, heads: int, mlp_hidden: int):
        super().__init__()
        self.heads, self.split = heads, [dim, dim, dim, 2 * mlp_hidden]
        self.attention_kernel = sdpa_attention  # q, k, v, mask -> out; chosen from outside (models/attention.py)
        self.to_qkv_mlp_proj = nn.Linear(dim, 3 * dim + 2 * mlp_hidden, bias=False)
        self.norm_q = RMSNorm(dim // heads, eps=EPS)
        self.norm_k = RMSNorm(dim // heads, eps=EPS)
        self.to_out = nn.Linear(dim + mlp_hidden, dim, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        q, k, v, mlp = self.to_qkv_mlp_proj(x).split(self.split, dim=-1)
        q = apply_rope(self.norm_q(split_heads(q, self.heads)), rope)
        k = apply_rope(self.norm_k(split_heads(k, self.heads)), rope)
        out = merge_heads(self.attention_kernel(q, k, split_heads(v, self.heads)))
        return self.to_out(torch.cat([out, swiglu(mlp)], dim=-1))


# ----------------------------------------------------------------------------------------------- blocks


class DoubleStreamBlock(nn.Module):
    """Each stream modulated by its shared modulation (`mod_img`, `mod_txt`: [B, 6 D] each), one joint attention
    over [text, image], a SwiGLU feed-forward per stream, gated residuals."""

    def __init__(self, dim: int, heads: int, mlp_hidden: int):
        super().__init__()
        self.attn = JointAttention(dim, heads, qk_norm=True, context_pre_only=False, text_first=True, bias=False)
        self.ff = FeedForward(dim, mlp_hidden)
        self.ff_context = FeedForward(dim, mlp_hidden)

    def forward(self, x: torch.Tensor, c: torch.Tensor, mod_img: torch.Tensor, mod_txt: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mod_img.chunk(6, dim=-1)
        c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = mod_txt.chunk(6, dim=-1)
        attn_x, attn_c = self.attn(modulate(layer_norm(x), shift_msa, scale_msa),
                                   modulate(layer_norm(c), c_shift_msa, c_scale_msa), rope)
        x = gated(x, gate_msa, attn_x)
        x = gated(x, gate_mlp, self.ff(modulate(layer_norm(x), shift_mlp, scale_mlp)))
        c = gated(c, c_gate_msa, attn_c)
        c = gated(c, c_gate_mlp, self.ff_context(modulate(layer_norm(c), c_shift_mlp, c_scale_mlp)))
        return x, c


class SingleStreamBlock(nn.Module):
    """x + gate * attn(modulated x) over the joint sequence, `mod` [B, 3 D] the shared single-stream modulation."""

    def __init__(self, dim: int, heads: int, mlp_hidden: int):
        super().__init__()
        self.attn = ParallelAttention(dim, heads, mlp_hidden)

    def forward(self, x: torch.Tensor, mod: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        shift, scale, gate = mod.chunk(3, dim=-1)
        return gated(x, gate, self.attn(modulate(layer_norm(x), shift, scale), rope))


# ----------------------------------------------------------------------------------------------- the model


class Flux2(nn.Module):
    DIFFUSERS_CLASS = "Flux2Transformer2DModel"
    # the text embeddings it takes (by a latent dataset's names) and the forward argument each is
    TEXT_INPUTS = {"prompt_embeds": "encoder_hidden_states"}
    # its double blocks' linears over the text tokens alone (by first name; float8 leaves them); its modulations are
    # shared, outside the blocks
    TEXT_ONLY_LINEARS, MODULATION_LINEARS = JOINT_TEXT_ONLY, ()
    MAX_REFERENCES = None  # its pipelines take several reference images

    def __init__(self, cfg: Flux2Config):
        super().__init__()
        check_rotary_split(cfg.axes_dims_rope, cfg.attention_head_dim, 4)
        if cfg.patch_size != 1:
            raise ValueError(f"patch_size={cfg.patch_size}: FLUX.2 packs latents into tokens before its transformer, "
                             f"whose patch_size is 1")
        if cfg.out_channels != cfg.in_channels:
            raise ValueError(f"out_channels={cfg.out_channels} must equal in_channels={cfg.in_channels}: the "
                             f"output is unpacked like the input")
        if cfg.eps != EPS:
            raise ValueError(f"eps={cfg.eps}: this module's norms use {EPS}, FLUX.2's")
        self.cfg = cfg
        dim, heads, hidden = cfg.hidden_size, cfg.num_attention_heads, cfg.mlp_hidden
        self.time_guidance_embed = TimeGuidanceEmbed(dim, cfg.timestep_guidance_channels, cfg.guidance_embeds)
        self.double_stream_modulation_img = Modulation(dim, MODULATIONS["double_stream_modulation_img"])
        self.double_stream_modulation_txt = Modulation(dim, MODULATIONS["double_stream_modulation_txt"])
        self.single_stream_modulation = Modulation(dim, MODULATIONS["single_stream_modulation"])
        self.x_embedder = nn.Linear(cfg.in_channels, dim, bias=False)
        self.context_embedder = nn.Linear(cfg.joint_attention_dim, dim, bias=False)
        self.transformer_blocks = nn.ModuleList(DoubleStreamBlock(dim, heads, hidden) for _ in range(cfg.num_layers))
        self.single_transformer_blocks = nn.ModuleList(SingleStreamBlock(dim, heads, hidden)
                                                       for _ in range(cfg.num_single_layers))
        self.norm_out = AdaLNContinuous(dim, bias=False)
        self.proj_out = nn.Linear(dim, cfg.patch_size**2 * cfg.out_channels, bias=False)
        self.rope_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        if not self.proj_out.weight.is_meta:  # built on the meta device, the caller fills it (shard by shard)
            initialize(self, seed=0)

    @property
    def blocks(self) -> list[nn.Module]:
        """The repeated blocks, which the plugins wrap one by one (compile, checkpointing, sharding, float8); the
        shared modulations are outside them (under FSDP the root holds them)."""
        return [*self.transformer_blocks, *self.single_transformer_blocks]

    def initial_value(self, name: str, seed: int) -> torch.Tensor:
        """A function of (seed, name) alone: models/blocks.py's rule, whose adaLN-Zero also zeroes the shared
        modulations here: every gate starts at zero, so each block is an identity map and, with the output
        projection at zero, the fresh model predicts zero velocity. The blocks' own output projections (`to_out`,
        `linear_out`) start random, so that the gates get a gradient once the output projection has moved (one
        of each pair non-zero: neither stays at zero)."""
        if name.partition(".")[0] in MODULATIONS:
            return torch.zeros(self.get_parameter(name).shape)
        return initial_value(self, name, seed)

    def rope(self, text_tokens: int, rows: int, columns: int, device: torch.device,
             references: tuple[tuple[int, int], ...] = ()):
        """cos and sin [text + image tokens, head_dim] of the joint sequence, computed once per shape."""
        key = (text_tokens, rows, columns, references, device)
        if key not in self.rope_cache:
            ids = position_ids(text_tokens, rows, columns, device, references)
            self.rope_cache[key] = rope_tables(list(self.cfg.axes_dims_rope), ids, self.cfg.rope_theta)
        return self.rope_cache[key]

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, timestep: torch.Tensor,
                guidance: torch.Tensor | None = None,
                reference_latents: list[torch.Tensor] | None = None) -> torch.Tensor:
        """[B,C,H,W] latents, [B,L,joint_dim] text tokens, timestep = sigma*1000, with a guidance embedding
        `guidance` [B] (the pipeline's scale, e.g. 4.0), reference images' `reference_latents` (a list of
        [B,C,h,w]) -> velocity [B,C,H,W] of the target."""
        if (guidance is None) == self.cfg.guidance_embeds:
            raise ValueError("this FLUX.2 transformer has a guidance embedding (dev): pass guidance [B]"
                             if guidance is None else "this FLUX.2 transformer has no guidance embedding (klein): "
                             "pass no guidance")
        h, w = hidden_states.shape[-2:]
        p = packing(self.cfg.in_channels, hidden_states.shape[1])
        if h % p or w % p:
            raise ValueError(f"latents of {h}x{w} do not pack into {p}x{p} patches: both sides must divide by {p}")
        references, grids = pack_references(reference_latents, p, hidden_states.shape[1])
        x = self.x_embedder(torch.cat([pack(hidden_states, p), *references], dim=1))
        target = (h // p) * (w // p)
        c = self.context_embedder(encoder_hidden_states)
        temb = self.time_guidance_embed(timestep, None if guidance is None else guidance.to(timestep.dtype) * 1000,
                                        x.dtype)
        mod_img, mod_txt = self.double_stream_modulation_img(temb), self.double_stream_modulation_txt(temb)
        mod_single = self.single_stream_modulation(temb)
        rope = self.rope(c.shape[1], h // p, w // p, x.device, grids)
        for block in self.transformer_blocks:
            x, c = block(x, c, mod_img, mod_txt, rope)
        joint = torch.cat([c, x], dim=1)
        for block in self.single_transformer_blocks:
            joint = block(joint, mod_single, rope)
        x = joint[:, c.shape[1]:c.shape[1] + target]  # the target's tokens: the references' are conditioning
        return unpack(self.proj_out(self.norm_out(x, temb)), h, w, p)
