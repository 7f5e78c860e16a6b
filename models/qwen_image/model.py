"""Qwen-Image's transformer, in one file: 60 dual-stream blocks (per-stream modulation, one joint attention over
[text, image] with q/k RMS norms, a feed-forward per stream), Qwen's multi-scale rotary positions (MSRoPE) and a
text padding mask; no pooled text, no guidance embedding.

Submodule and parameter names follow diffusers' `QwenImageTransformer2DModel` key for key
(docs/qwen-image-architecture.md lists them). Like the other families' modules, this one takes latents [B, C, H, W]
(packed here into tokens of 2 x 2 latent pixels, as `QwenImagePipeline._pack_latents` does: `in_channels` = C x 4),
the text tokens with their mask (`encoder_hidden_states_mask`, 1 for a token, 0 for padding) and timestep = sigma x
1000, and returns the velocity [B, C, H, W].

Positions (`QwenEmbedRope` with `scale_rope=True`): an image token's rotary angles are its (frame, row, column) with
rows and columns centred on the image (h rows: -(h - h//2) ... h//2 - 1), the frame the image's index (0 for the
target); the text's tokens follow on every axis from the largest image half-side on (max(h//2, w//2), + 1, ...).
The tables are computed once per shape and reused by every block and step.

Qwen-Image-Edit (-2509, -2511: the same transformer) is given reference images' latents (`reference_latents`, a
list of [B, C, h, w], each of its own size): packed like the target and appended after it, image i + 1 of the
rotary shapes (frame i + 1), as `QwenImageEditPipeline` and `QwenImageEditPlusPipeline` pass them (`img_shapes`);
the velocity is the target's alone. With `zero_cond_t` (Edit-2511's config) the references' tokens are modulated at
timestep 0 (the image stream's modulation of t = 0), the target's, the text's and the output norm's at t.
"""

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from models.blocks import (AdaLNContinuous, FeedForward, JointAttention, RMSNorm, TimeTextEmbed, check_rotary_split,
                           gated, initial_value, initialize, layer_norm, modulate, modulation, pack, pack_references,
                           packing, rope_tables, unpack)

ROPE_THETA = 10000


@dataclass
class QwenImageConfig:  # diffusers' config.json keys and defaults (Qwen-Image)
    patch_size: int = 2  # latent pixels per token side (the pipeline packs 2 x 2)
    in_channels: int = 64  # latent channels x 2 x 2
    out_channels: int | None = 16  # latent channels (None: in_channels)
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584  # Qwen2.5-VL-7B's width
    guidance_embeds: bool = False  # diffusers' key; no released Qwen-Image has one
    axes_dims_rope: list = field(default_factory=lambda: [16, 56, 56])  # rotary channels of (frame, row, column)
    zero_cond_t: bool = False  # Edit-2511: reference images' tokens modulated at timestep 0

    def __post_init__(self):
        self.axes_dims_rope = list(self.axes_dims_rope)
        self.out_channels = self.out_channels or self.in_channels

    @property
    def hidden_size(self) -> int:
        return self.num_attention_heads * self.attention_head_dim


# ----------------------------------------------------------------------------------------------- positions


def centred(n: int, device: torch.device) -> torch.Tensor:
    """Positions of n rows (or columns) centred on the image: -(n - n//2) ... n//2 - 1."""
    return torch.arange(n, device=device) - (n - n // 2)


def position_ids(text_tokens: int, images: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """[text + sum(h * w), 3] ids of the joint sequence [text, images...]: image i's tokens (i, row, column) with
    centred rows and columns, the text's (t, t, t) for t from the largest half-side of the images on."""
    grids = []
    for index, (rows, columns) in enumerate(images):
        grid = torch.empty(rows, columns, 3, device=device)
        grid[..., 0] = index
        grid[..., 1] = centred(rows, device)[:, None]
        grid[..., 2] = centred(columns, device)[None, :]
        grids.append(grid.reshape(-1, 3))
    start = max(max(rows // 2, columns // 2) for rows, columns in images)
    text = (start + torch.arange(text_tokens, device=device, dtype=torch.float32))[:, None].expand(-1, 3)
    return torch.cat([text, *grids])


# ----------------------------------------------------------------------------------------------- blocks


class Modulation(nn.Sequential):
    """SiLU -> Linear(D, 6 D) on the timestep embedding (diffusers' `img_mod` / `txt_mod`: keys `1.weight`, `1.bias`),
    computed as models/blocks.py's `modulation`: (shift, scale, gate) of the attention, then of the feed-forward."""

    def __init__(self, dim: int):
        super().__init__(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return modulation(self[1], c).chunk(6, dim=-1)


class ImageModulation:
    """The image stream's (shift, scale, gate) of the attention (0) and the feed-forward (1): one set for every
    token, or with `reference` (zero_cond_t) the target's for the first `target` tokens and the references' for
    the rest, each applied to its own part of the sequence."""

    def __init__(self, target: tuple[torch.Tensor, ...], reference: tuple[torch.Tensor, ...] | None, tokens: int):
        self.sets = [target] if reference is None else [target, reference]
        self.tokens = tokens

    def parts(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x] if len(self.sets) == 1 else list(x.split([self.tokens, x.shape[1] - self.tokens], dim=1))

    def modulate(self, x: torch.Tensor, which: int) -> torch.Tensor:
        return torch.cat([modulate(part, *chunks[3 * which:3 * which + 2])
                          for part, chunks in zip(self.parts(x), self.sets)], dim=1)

    def gated(self, x: torch.Tensor, which: int, y: torch.Tensor) -> torch.Tensor:
        return torch.cat([gated(part, chunks[3 * which + 2], update) for part, update, chunks in
                          zip(self.parts(x), self.parts(y), self.sets)], dim=1)


class QwenImageBlock(nn.Module):
    """A dual-stream block: each stream modulated by its own projection of the timestep embedding, one joint
    attention over [text, image], a feed-forward per stream, gated residuals. Returns (image, text; None after the
    last block).

    The last block's text output reaches nothing (the final layer reads the image tokens), yet diffusers' model has
    its weights: here they are kept, for the keys, but frozen and not computed (`text_output=False`), so a training
    step neither spends time on them nor holds parameters that no gradient reaches."""

    def __init__(self, dim: int, heads: int, text_output: bool = True):
        super().__init__()
        self.img_mod, self.txt_mod = Modulation(dim), Modulation(dim)
        self.attn = JointAttention(dim, heads, qk_norm=True, context_pre_only=False, text_first=True)
        self.img_mlp, self.txt_mlp = FeedForward(dim), FeedForward(dim)
        self.attn.text_output = text_output
        if not text_output:
            for module in self.unused():
                module.requires_grad_(False)

    def unused(self) -> list[nn.Module]:
        """Its linears whose output reaches nothing."""
        if self.attn.text_output:
            return []
        return [self.attn.to_add_out, *(m for m in self.txt_mlp.modules() if isinstance(m, nn.Linear))]

    def forward(self, x: torch.Tensor, c: torch.Tensor, temb: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor | None = None, reference_temb: torch.Tensor | None = None,
                target_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`reference_temb` (zero_cond_t): the embedding that modulates the image tokens after the first
        `target_tokens` (the references)."""
        img = ImageModulation(self.img_mod(temb), None if reference_temb is None else self.img_mod(reference_temb),
                              target_tokens)
        c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.txt_mod(temb)
        attn_x, attn_c = self.attn(img.modulate(layer_norm(x), 0), modulate(layer_norm(c), c_shift_msa, c_scale_msa),
                                   rope, mask)
        x = img.gated(x, 0, attn_x)
        x = img.gated(x, 1, self.img_mlp(img.modulate(layer_norm(x), 1)))
        if not self.attn.text_output:
            return x, None
        c = gated(c, c_gate_msa, attn_c)
        c = gated(c, c_gate_mlp, self.txt_mlp(modulate(layer_norm(c), c_shift_mlp, c_scale_mlp)))
        return x, c


# ----------------------------------------------------------------------------------------------- the model


class QwenImage(nn.Module):
    DIFFUSERS_CLASS = "QwenImageTransformer2DModel"
    # the text embeddings it takes (by a latent dataset's names) and the forward argument each is
    TEXT_INPUTS = {"prompt_embeds": "encoder_hidden_states", "prompt_embeds_mask": "encoder_hidden_states_mask"}
    # its blocks' linears over the text tokens alone, and their modulations (by first name; float8 leaves them)
    TEXT_ONLY_LINEARS = ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "txt_mlp")
    MODULATION_LINEARS = ("img_mod", "txt_mod")
    MAX_REFERENCES = None  # QwenImageEditPlusPipeline takes several reference images

    def __init__(self, cfg: QwenImageConfig):
        super().__init__()
        check_rotary_split(cfg.axes_dims_rope, cfg.attention_head_dim, 3)
        if cfg.in_channels != cfg.patch_size**2 * cfg.out_channels:
            raise ValueError(f"in_channels={cfg.in_channels} must be patch_size^2 x out_channels "
                             f"({cfg.patch_size}^2 x {cfg.out_channels}): the tokens pack patch_size x patch_size "
                             f"latent pixels")
        if cfg.guidance_embeds:
            raise ValueError("guidance_embeds=true: no released Qwen-Image has a guidance embedding, and this module "
                             "implements none")
        self.cfg = cfg
        dim, heads = cfg.hidden_size, cfg.num_attention_heads
        self.time_text_embed = TimeTextEmbed(dim, pooled_dim=0)
        self.txt_norm = RMSNorm(cfg.joint_attention_dim, eps=1e-6)
        self.img_in = nn.Linear(cfg.in_channels, dim)
        self.txt_in = nn.Linear(cfg.joint_attention_dim, dim)
        self.transformer_blocks = nn.ModuleList(QwenImageBlock(dim, heads, text_output=i < cfg.num_layers - 1)
                                                for i in range(cfg.num_layers))
        self.norm_out = AdaLNContinuous(dim)
        self.proj_out = nn.Linear(dim, cfg.patch_size**2 * cfg.out_channels)
        self.rope_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        if not self.proj_out.weight.is_meta:  # built on the meta device, the caller fills it (shard by shard)
            initialize(self, seed=0)

    @property
    def blocks(self) -> list[nn.Module]:
        """The repeated blocks, which the plugins wrap one by one (compile, checkpointing, sharding, float8)."""
        return list(self.transformer_blocks)

    def unused_modules(self) -> list[str]:
        """The submodules whose output reaches nothing (frozen; LoRA does not adapt them)."""
        names = {id(m): name for name, m in self.named_modules()}
        return [names[id(m)] for block in self.transformer_blocks for m in block.unused()]

    def initial_value(self, name: str, seed: int) -> torch.Tensor:
        """A function of (seed, name) alone: models/blocks.py's rule (the modulations start at zero)."""
        return initial_value(self, name, seed)

    def rope(self, text_tokens: int, images: tuple[tuple[int, int], ...], device: torch.device):
        """cos and sin [text + image tokens, head_dim] of the joint sequence, computed once per shape."""
        key = (text_tokens, images, device)
        if key not in self.rope_cache:
            self.rope_cache[key] = rope_tables(self.cfg.axes_dims_rope, position_ids(text_tokens, list(images), device),
                                               ROPE_THETA)
        return self.rope_cache[key]

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_hidden_states_mask: torch.Tensor | None, timestep: torch.Tensor,
                reference_latents: list[torch.Tensor] | None = None) -> torch.Tensor:
        """[B,C,H,W] latents, [B,L,joint_dim] text tokens, [B,L] text mask (1: token, 0: padding; None: no padding),
        timestep = sigma*1000; edit models: `reference_latents`, a list of [B,C,h,w] -> velocity [B,C,H,W] of the
        target."""
        h, w = hidden_states.shape[-2:]
        p = packing(self.cfg.in_channels, hidden_states.shape[1])
        if h % p or w % p:
            raise ValueError(f"latents of {h}x{w} do not pack into {p}x{p} patches: both sides must divide by {p}")
        references, grids = pack_references(reference_latents, p, hidden_states.shape[1])
        x = self.img_in(torch.cat([pack(hidden_states, p), *references], dim=1))
        target = (h // p) * (w // p)
        c = self.txt_in(self.txt_norm(encoder_hidden_states))
        temb = self.time_text_embed(timestep, dtype=x.dtype)
        reference_temb = self.time_text_embed(torch.zeros_like(timestep), dtype=x.dtype) \
            if self.cfg.zero_cond_t and references else None
        rope = self.rope(c.shape[1], ((h // p, w // p), *grids), x.device)
        mask = None
        if encoder_hidden_states_mask is not None:  # a key mask over [text, image]: images are never padding
            image = encoder_hidden_states_mask.new_ones(len(x), x.shape[1])
            mask = torch.cat([encoder_hidden_states_mask, image], dim=1).bool()[:, None, None, :]
        for block in self.transformer_blocks:
            x, c = block(x, c, temb, rope, mask, reference_temb, target)
        return unpack(self.proj_out(self.norm_out(x[:, :target], temb)), h, w, p)
