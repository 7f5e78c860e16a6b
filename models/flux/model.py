"""FLUX.1's transformer (dev and schnell), in one file: models/blocks.py's joint blocks as its double-stream blocks,
then single-stream blocks over [text, image], rotary positions over the packed latent grid, and a guidance
embedding for the guidance-distilled dev.

Submodule and parameter names follow diffusers' `FluxTransformer2DModel` key for key (docs/flux-architecture.md
lists them). Unlike diffusers' module, this one takes what the SD3 module takes: latents [B, C, H, W] (packed here
into tokens of p x p latent pixels, p = 2 for FLUX.1's 16-channel latents: `in_channels` = C * p * p), text tokens,
pooled text and timestep = sigma * 1000, plus `guidance` [B] on the pipeline's scale (dev: 3.5) when the model has
a guidance embedding. The rotary tables are computed once per latent size and text length and reused by every
block and every step.

FLUX.1 Kontext (the edit model, the same transformer) is given the reference image's latents
(`reference_latents`, one [B, C, h, w] of its own size): packed like the target and appended after it, at the
positions of a target of its size with the first axis 1 (`FluxKontextPipeline.prepare_latents`); the velocity is
the target's alone. Its pipeline takes one reference, and so does this module.
"""

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.blocks import (JOINT_MODULATIONS, JOINT_TEXT_ONLY, AdaLNContinuous, AdaLNZero, JointTransformerBlock,
                           SelfAttention, TimeTextEmbed, check_rotary_split, gated, initial_value, initialize,
                           layer_norm, modulate, pack, pack_references, packing, rope_tables, unpack)


@dataclass
class FluxConfig:  # diffusers' config.json keys and defaults (FLUX.1-dev / -schnell but for guidance_embeds)
    patch_size: int = 1  # diffusers' key; tokens are packed outside its module (here: in `Flux.forward`)
    in_channels: int = 64  # latent channels x 2 x 2 (the packing)
    out_channels: int | None = None  # None: in_channels
    num_layers: int = 19  # double-stream blocks
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096  # T5-XXL's width
    pooled_projection_dim: int = 768  # CLIP-L's pooled output
    guidance_embeds: bool = False  # dev: True (guidance-distilled); schnell: False
    axes_dims_rope: list = field(default_factory=lambda: [16, 56, 56])  # rotary channels per id axis

    def __post_init__(self):
        self.axes_dims_rope = list(self.axes_dims_rope)
        self.out_channels = self.out_channels or self.in_channels

    @property
    def hidden_size(self) -> int:
        return self.num_attention_heads * self.attention_head_dim


# ----------------------------------------------------------------------------------------------- positions


def grid_ids(first: int, rows: int, columns: int, device: torch.device) -> torch.Tensor:
    """[rows * columns, 3] ids (first, row, column) of an image's tokens on its packed grid."""
    grid = torch.full((rows, columns, 3), float(first), device=device)
    grid[..., 1] = torch.arange(rows, device=device)[:, None]
    grid[..., 2] = torch.arange(columns, device=device)[None, :]
    return grid.reshape(-1, 3)


def position_ids(text_tokens: int, rows: int, columns: int, device: torch.device,
                 references: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
    """[text + image tokens, 3] ids of the joint sequence [text, image, references]: text all zero, each image
    token (0, row, column) on the packed grid, a reference's tokens (1, row, column) on theirs (Kontext)."""
    return torch.cat([torch.zeros(text_tokens, 3, device=device), grid_ids(0, rows, columns, device),
                      *(grid_ids(1, *grid, device) for grid in references)])


# ----------------------------------------------------------------------------------------------- blocks


class SingleTransformerBlock(nn.Module):
    """Attention and MLP in parallel over the joint sequence [text, image]: x + gate * proj_out([attn, mlp])."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm = AdaLNZero(dim, 3)
        self.proj_mlp = nn.Linear(dim, 4 * dim)
        self.attn = SelfAttention(dim, heads, qk_norm=True, out_projection=False)
        self.proj_out = nn.Linear(5 * dim, dim)

    def forward(self, x: torch.Tensor, temb: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        shift, scale, gate = self.norm(temb)
        normed = modulate(layer_norm(x), shift, scale)
        mlp = F.gelu(self.proj_mlp(normed), approximate="tanh")
        return gated(x, gate, self.proj_out(torch.cat([self.attn(normed, rope), mlp], dim=-1)))


# ----------------------------------------------------------------------------------------------- the model


class Flux(nn.Module):
    DIFFUSERS_CLASS = "FluxTransformer2DModel"
    # the text embeddings it takes (by a latent dataset's names) and the forward argument each is
    TEXT_INPUTS = {"prompt_embeds": "encoder_hidden_states", "pooled_prompt_embeds": "pooled_projections"}
    # its blocks' linears over the text tokens alone, and their modulations (by first name; float8 leaves them)
    TEXT_ONLY_LINEARS, MODULATION_LINEARS = JOINT_TEXT_ONLY, JOINT_MODULATIONS
    MAX_REFERENCES = 1  # FluxKontextPipeline's one reference image

    def __init__(self, cfg: FluxConfig):
        super().__init__()
        check_rotary_split(cfg.axes_dims_rope, cfg.attention_head_dim, 3)
        if cfg.patch_size != 1:
            raise ValueError(f"patch_size={cfg.patch_size}: FLUX packs latents into tokens before its transformer, "
                             f"whose patch_size is 1")
        if cfg.out_channels != cfg.in_channels:
            raise ValueError(f"out_channels={cfg.out_channels} must equal in_channels={cfg.in_channels}: the "
                             f"output is unpacked like the input")
        self.cfg = cfg
        dim, heads = cfg.hidden_size, cfg.num_attention_heads
        self.time_text_embed = TimeTextEmbed(dim, cfg.pooled_projection_dim, guidance=cfg.guidance_embeds)
        self.context_embedder = nn.Linear(cfg.joint_attention_dim, dim)
        self.x_embedder = nn.Linear(cfg.in_channels, dim)
        self.transformer_blocks = nn.ModuleList(
            JointTransformerBlock(dim, heads, qk_norm=True, context_pre_only=False, dual_attention=False,
                                  text_first=True) for _ in range(cfg.num_layers))
        self.single_transformer_blocks = nn.ModuleList(SingleTransformerBlock(dim, heads)
                                                       for _ in range(cfg.num_single_layers))
        self.norm_out = AdaLNContinuous(dim)
        self.proj_out = nn.Linear(dim, cfg.patch_size**2 * cfg.out_channels)
        self.rope_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        if not self.proj_out.weight.is_meta:  # built on the meta device, the caller fills it (shard by shard)
            initialize(self, seed=0)

    @property
    def blocks(self) -> list[nn.Module]:
        """The repeated blocks, which the plugins wrap one by one (compile, checkpointing, sharding, float8)."""
        return [*self.transformer_blocks, *self.single_transformer_blocks]

    def initial_value(self, name: str, seed: int) -> torch.Tensor:
        """A function of (seed, name) alone: models/blocks.py's rule."""
        return initial_value(self, name, seed)

    def rope(self, text_tokens: int, rows: int, columns: int, device: torch.device,
             references: tuple[tuple[int, int], ...] = ()):
        """cos and sin [text + image tokens, head_dim] of the joint sequence, computed once per shape."""
        key = (text_tokens, rows, columns, references, device)
        if key not in self.rope_cache:
            ids = position_ids(text_tokens, rows, columns, device, references)
            self.rope_cache[key] = rope_tables(list(self.cfg.axes_dims_rope), ids)
        return self.rope_cache[key]

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                pooled_projections: torch.Tensor, timestep: torch.Tensor, guidance: torch.Tensor | None = None,
                reference_latents: list[torch.Tensor] | None = None) -> torch.Tensor:
        """[B,C,H,W] latents, [B,L,joint_dim] text tokens, [B,pooled_dim] pooled text, timestep = sigma*1000, and
        with a guidance embedding `guidance` [B] (the pipeline's scale, e.g. 3.5); Kontext: `reference_latents`,
        a list of one [B,C,h,w] -> velocity [B,C,H,W] of the target."""
        if (guidance is None) == self.cfg.guidance_embeds:
            raise ValueError("this FLUX transformer has a guidance embedding: pass guidance [B]" if guidance is None
                             else "this FLUX transformer has no guidance embedding (schnell): pass no guidance")
        if len(reference_latents or ()) > self.MAX_REFERENCES:
            raise ValueError(f"{len(reference_latents)} reference images: FLUX.1 Kontext takes one")
        h, w = hidden_states.shape[-2:]
        p = packing(self.cfg.in_channels, hidden_states.shape[1])
        if h % p or w % p:
            raise ValueError(f"latents of {h}x{w} do not pack into {p}x{p} patches: both sides must divide by {p}")
        references, grids = pack_references(reference_latents, p, hidden_states.shape[1])
        x = self.x_embedder(torch.cat([pack(hidden_states, p), *references], dim=1))
        target = (h // p) * (w // p)
        temb = self.time_text_embed(timestep, pooled_projections,
                                    None if guidance is None else guidance.to(timestep.dtype) * 1000)
        c = self.context_embedder(encoder_hidden_states)
        rope = self.rope(c.shape[1], h // p, w // p, x.device, grids)
        for block in self.transformer_blocks:
            x, c = block(x, c, temb, rope)
        joint = torch.cat([c, x], dim=1)
        for block in self.single_transformer_blocks:
            joint = block(joint, temb, rope)
        x = joint[:, c.shape[1]:c.shape[1] + target]  # the target's tokens: the references' are conditioning
        return unpack(self.proj_out(self.norm_out(x, temb)), h, w, p)
