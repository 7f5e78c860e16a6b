"""MMDiT: the multimodal diffusion transformer of Stable Diffusion 3 / 3.5, in one file (its blocks are
models/blocks.py's, shared with FLUX.1).

Submodule and parameter names follow diffusers' `SD3Transformer2DModel`, so a released state dict maps onto
this module key for key (docs/sd3-architecture.md lists them, layer by layer, with the released sizes). Image
tokens come first in the joint sequence, text tokens second, as in the reference attention processor.
"""

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from models.blocks import (JOINT_MODULATIONS, JOINT_TEXT_ONLY, AdaLNContinuous, JointTransformerBlock, TimeTextEmbed,
                           initial_value, initialize)


@dataclass
class MMDiTConfig:
    sample_size: int = 128  # nominal latent size; only sets the scale of the sin-cos position table
    patch_size: int = 2
    in_channels: int = 16
    out_channels: int = 16
    num_layers: int = 18
    attention_head_dim: int = 64
    num_attention_heads: int = 18
    joint_attention_dim: int = 4096
    caption_projection_dim: int = 1152  # must equal heads * head_dim
    pooled_projection_dim: int = 2048
    pos_embed_max_size: int = 96
    dual_attention_layers: list = field(default_factory=list)
    qk_norm: str | None = None  # None or "rms_norm"

    def __post_init__(self):
        self.dual_attention_layers = list(self.dual_attention_layers or [])  # diffusers writes a tuple, or null

    @property
    def hidden_size(self) -> int:
        return self.num_attention_heads * self.attention_head_dim


# ----------------------------------------------------------------------------------------------- embeddings


def sincos_1d(dim: int, positions: torch.Tensor) -> torch.Tensor:
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2))
    angles = positions.reshape(-1, 1).double() * omega
    return torch.cat([angles.sin(), angles.cos()], dim=1)


def sincos_2d_table(dim: int, max_size: int, base_size: int) -> torch.Tensor:
    """[max_size^2, dim] table; first half encodes the column, second half the row (diffusers' layout)."""
    coords = torch.arange(max_size, dtype=torch.float64) * base_size / max_size
    rows, cols = torch.meshgrid(coords, coords, indexing="ij")
    return torch.cat([sincos_1d(dim // 2, cols), sincos_1d(dim // 2, rows)], dim=1).float()


class PatchEmbed(nn.Module):
    def __init__(self, cfg: MMDiTConfig):
        super().__init__()
        self.patch_size = cfg.patch_size
        self.max_size = cfg.pos_embed_max_size
        self.proj = nn.Conv2d(cfg.in_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size)
        max_tokens = cfg.pos_embed_max_size**2  # the sin-cos table; MMDiT.initial_value computes it
        self.register_buffer("pos_embed", torch.empty(1, max_tokens, cfg.hidden_size), persistent=True)

    def cropped_pos_embed(self, h: int, w: int) -> torch.Tensor:
        if h > self.max_size or w > self.max_size:
            raise ValueError(f"patch grid {h}x{w} exceeds pos_embed_max_size={self.max_size}")
        top, left = (self.max_size - h) // 2, (self.max_size - w) // 2
        table = self.pos_embed.reshape(1, self.max_size, self.max_size, -1)
        return table[:, top : top + h, left : left + w].reshape(1, h * w, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2] // self.patch_size, x.shape[-1] // self.patch_size
        x = self.proj(x).flatten(2).transpose(1, 2)
        return x + self.cropped_pos_embed(h, w).to(x.dtype)


# ----------------------------------------------------------------------------------------------- the model


class MMDiT(nn.Module):
    DIFFUSERS_CLASS = "SD3Transformer2DModel"
    # the text embeddings it takes (by a latent dataset's names) and the forward argument each is
    TEXT_INPUTS = {"prompt_embeds": "encoder_hidden_states", "pooled_prompt_embeds": "pooled_projections"}
    # its blocks' linears over the text tokens alone, and their modulations (by first name; float8 leaves them)
    TEXT_ONLY_LINEARS, MODULATION_LINEARS = JOINT_TEXT_ONLY, JOINT_MODULATIONS
    MAX_REFERENCES = 0  # no edit model of SD3: it takes no reference images

    def __init__(self, cfg: MMDiTConfig):
        super().__init__()
        if cfg.caption_projection_dim != cfg.hidden_size:
            raise ValueError(f"caption_projection_dim={cfg.caption_projection_dim} must equal "
                             f"num_attention_heads*attention_head_dim={cfg.hidden_size}")
        if cfg.hidden_size % 4:
            raise ValueError(f"hidden size {cfg.hidden_size} must be divisible by 4 for the 2-D sin-cos table")
        if cfg.qk_norm not in (None, "rms_norm"):
            raise ValueError(f"qk_norm must be None or 'rms_norm', got {cfg.qk_norm!r}")
        self.cfg = cfg
        dim = cfg.hidden_size
        self.pos_embed = PatchEmbed(cfg)
        self.time_text_embed = TimeTextEmbed(dim, cfg.pooled_projection_dim)
        self.context_embedder = nn.Linear(cfg.joint_attention_dim, dim)
        self.transformer_blocks = nn.ModuleList(
            JointTransformerBlock(dim, cfg.num_attention_heads, qk_norm=cfg.qk_norm == "rms_norm",
                                  context_pre_only=i == cfg.num_layers - 1,
                                  dual_attention=i in cfg.dual_attention_layers)
            for i in range(cfg.num_layers))
        self.norm_out = AdaLNContinuous(dim)
        self.proj_out = nn.Linear(dim, cfg.patch_size**2 * cfg.out_channels)
        if not self.proj_out.weight.is_meta:  # built on the meta device, the caller fills it (shard by shard)
            initialize(self, seed=0)

    @property
    def blocks(self) -> list[nn.Module]:
        """The repeated blocks, which the plugins wrap one by one (compile, checkpointing, sharding, float8)."""
        return list(self.transformer_blocks)

    def initial_value(self, name: str, seed: int) -> torch.Tensor:
        """The initial value of parameter or buffer `name`, a function of (seed, name) alone: the fixed sin-cos
        position table, and models/blocks.py's rule for every parameter."""
        if name == "pos_embed.pos_embed":
            table = sincos_2d_table(self.cfg.hidden_size, self.cfg.pos_embed_max_size,
                                    self.cfg.sample_size // self.cfg.patch_size)
            return table[None]
        return initial_value(self, name, seed)

    def unpatchify(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        p, c = self.cfg.patch_size, self.cfg.out_channels
        x = x.reshape(x.shape[0], h, w, p, p, c)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(x.shape[0], c, h * p, w * p)

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                pooled_projections: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        """[B,C,H,W] latents, [B,L,joint_dim] text tokens, [B,pooled_dim] pooled text, timestep = sigma*1000."""
        p = self.cfg.patch_size
        if hidden_states.shape[-2] % p or hidden_states.shape[-1] % p:
            raise ValueError(f"input {tuple(hidden_states.shape[-2:])} is not divisible by patch_size={p}")
        h, w = hidden_states.shape[-2] // p, hidden_states.shape[-1] // p
        x = self.pos_embed(hidden_states)
        temb = self.time_text_embed(timestep, pooled_projections)
        c = self.context_embedder(encoder_hidden_states)
        for block in self.transformer_blocks:
            x, c = block(x, c, temb)
        return self.unpatchify(self.proj_out(self.norm_out(x, temb)), h, w)
