"""MMDiT: the multimodal diffusion transformer of Stable Diffusion 3 / 3.5, in one file.

Submodule and parameter names follow diffusers' `SD3Transformer2DModel`, so a released state dict maps onto
this module key for key (docs/sd3-architecture.md lists them, layer by layer, with the released sizes). Image
tokens come first in the joint sequence, text tokens second, as in the reference attention processor.
"""

import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from itertools import chain

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.attention import sdpa_attention
from models.rectified_flow import INIT_STREAM, sample_key


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

    @property
    def hidden_size(self) -> int:
        return self.num_attention_heads * self.attention_head_dim


# ----------------------------------------------------------------------------------------------- initial values


def init_generator(seed: int, name: str) -> torch.Generator:
    """The random stream of one parameter's initial value: keyed by (seed, its name), so a parameter starts
    the same whatever order the model was built in and whichever rank fills which shard of it."""
    return torch.Generator().manual_seed(sample_key(seed, INIT_STREAM, name))


def xavier_uniform(shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """Glorot-uniform over (fan_out, fan_in = the product of the other dimensions)."""
    fan_out, fan_in = shape[0], math.prod(shape[1:])
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


def initialize(module: nn.Module, seed: int) -> None:
    """Fill every parameter and buffer of `module` with its `initial_value(name, seed)` (in place)."""
    with torch.no_grad():
        for name, tensor in chain(module.named_parameters(), module.named_buffers()):
            tensor.copy_(module.initial_value(name, seed))


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


def timestep_features(t: torch.Tensor, dim: int = 256) -> torch.Tensor:
    """Sinusoidal features with flip_sin_to_cos=True and shift 0: [cos, sin]."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = t.float()[:, None] * freqs[None]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


class MLPEmbedder(nn.Module):
    """linear_1 -> SiLU -> linear_2, the shape of both diffusers timestep and pooled-text embedders."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TimeTextEmbed(nn.Module):
    def __init__(self, dim: int, pooled_dim: int):
        super().__init__()
        self.timestep_embedder = MLPEmbedder(256, dim)
        self.text_embedder = MLPEmbedder(pooled_dim, dim)

    def forward(self, timestep: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        t_emb = self.timestep_embedder(timestep_features(timestep).to(pooled.dtype))
        return t_emb + self.text_embedder(pooled)


# ----------------------------------------------------------------------------------------------- modulation


# The norms run in their input's dtype, outside autocast. CUDA's autocast runs layer_norm and rms_norm in fp32:
# a bf16 activation would be cast to fp32 and back around every norm (three extra passes over it), and an
# RMSNorm given a bf16 input (autocast off) with its fp32 weight decomposes into pow/mean/rsqrt kernels
# ("Cannot dispatch to fused implementation"). The kernels accumulate their statistics in fp32 whatever the
# input dtype; the output is rounded to the input's dtype, the precision the next matmul reads anyway.


def autocast_off(x: torch.Tensor):
    if not torch.amp.is_autocast_available(x.device.type):  # meta
        return nullcontext()
    return torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=False)  # the dtype is unused when off


def layer_norm(x: torch.Tensor) -> torch.Tensor:
    with autocast_off(x):
        return F.layer_norm(x, x.shape[-1:], eps=1e-6)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm in the input's dtype: the weight is cast to it so that the fused kernel runs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with autocast_off(x):
            return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x * (1 + scale) + shift in x's dtype, one kernel with one rounding (the per-sample shift and 1 + scale
    are cast to x's dtype: fp32 ones would make an fp32 copy of the activation, cast back by the next matmul)."""
    return torch.addcmul(shift[:, None].to(x.dtype), x, (1 + scale[:, None]).to(x.dtype))


def gated(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The residual update x + gate * y in x's dtype, one kernel with one rounding (the per-sample gate is
    cast to x's dtype: an fp32 gate would promote the whole residual stream to fp32)."""
    return torch.addcmul(x, gate[:, None].to(x.dtype), y)


def modulation(linear: nn.Linear, c: torch.Tensor) -> torch.Tensor:
    """linear(SiLU(c)) in its weight's dtype, outside autocast. It acts once per sample (B rows), so its
    matmul costs nothing, but its weight is large (6-9 D^2): autocast would cast it to bf16 in every forward and
    cast its gradient back in every backward, the largest cast traffic of a block. With fp32 master weights the
    matmuls read them as they are (under FSDP's bf16 policy the weight, and so the modulation, is bf16)."""
    with autocast_off(c):
        return linear(F.silu(c.to(linear.weight.dtype)))


class AdaLNZero(nn.Module):
    """SiLU -> Linear(D, n*D) on the conditioning vector; n=6 (SD3) or 9 (SD3.5 dual attention)."""

    def __init__(self, dim: int, chunks: int):
        super().__init__()
        self.chunks = chunks
        self.linear = nn.Linear(dim, chunks * dim)

    def forward(self, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return modulation(self.linear, c).chunk(self.chunks, dim=-1)


class AdaLNContinuous(nn.Module):
    """Final-style norm: chunk order (scale, shift), as in diffusers' AdaLayerNormContinuous."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        scale, shift = modulation(self.linear, c).chunk(2, dim=-1)
        return modulate(layer_norm(x), shift, scale)


# ----------------------------------------------------------------------------------------------- attention


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)  # [B, L, H*Dh] -> [B, H, L, Dh]


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2).flatten(2)


class SelfAttention(nn.Module):
    """Image-only attention (SD3.5 `attn2`)."""

    def __init__(self, dim: int, heads: int, qk_norm: bool):
        super().__init__()
        self.heads = heads
        self.attention_kernel = sdpa_attention  # q, k, v -> out; chosen from outside (models/attention.py)
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])
        head_dim = dim // heads
        self.norm_q = RMSNorm(head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.norm_k = RMSNorm(head_dim, eps=1e-6) if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.norm_q(split_heads(self.to_q(x), self.heads))
        k = self.norm_k(split_heads(self.to_k(x), self.heads))
        v = split_heads(self.to_v(x), self.heads)
        return self.to_out[0](merge_heads(self.attention_kernel(q, k, v)))


class JointAttention(SelfAttention):
    """One attention over [image tokens, text tokens]; each stream has its own projections."""

    def __init__(self, dim: int, heads: int, qk_norm: bool, context_pre_only: bool):
        super().__init__(dim, heads, qk_norm)
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(dim, dim) for _ in range(3))
        head_dim = dim // heads
        self.norm_added_q = RMSNorm(head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.norm_added_k = RMSNorm(head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.to_add_out = None if context_pre_only else nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        q = torch.cat([self.norm_q(split_heads(self.to_q(x), self.heads)),
                       self.norm_added_q(split_heads(self.add_q_proj(c), self.heads))], dim=2)
        k = torch.cat([self.norm_k(split_heads(self.to_k(x), self.heads)),
                       self.norm_added_k(split_heads(self.add_k_proj(c), self.heads))], dim=2)
        v = torch.cat([split_heads(self.to_v(x), self.heads), split_heads(self.add_v_proj(c), self.heads)], dim=2)
        out = merge_heads(self.attention_kernel(q, k, v))
        x_out, c_out = out[:, : x.shape[1]], out[:, x.shape[1] :]
        return self.to_out[0](x_out), (self.to_add_out(c_out) if self.to_add_out is not None else None)


class GELUProj(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.proj = nn.Linear(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.net = nn.ModuleList([GELUProj(dim, 4 * dim), nn.Identity(), nn.Linear(4 * dim, dim)])  # net.1: dropout slot

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.net:
            x = layer(x)
        return x


# ----------------------------------------------------------------------------------------------- blocks


class JointTransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, qk_norm: bool, context_pre_only: bool, dual_attention: bool):
        super().__init__()
        self.context_pre_only = context_pre_only
        self.dual_attention = dual_attention
        self.norm1 = AdaLNZero(dim, 9 if dual_attention else 6)
        self.norm1_context = AdaLNContinuous(dim) if context_pre_only else AdaLNZero(dim, 6)
        self.attn = JointAttention(dim, heads, qk_norm, context_pre_only)
        self.attn2 = SelfAttention(dim, heads, qk_norm) if dual_attention else None
        self.ff = FeedForward(dim)
        self.ff_context = None if context_pre_only else FeedForward(dim)

    def forward(self, x: torch.Tensor, c: torch.Tensor, temb: torch.Tensor):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp, *dual = self.norm1(temb)
        x_normed = layer_norm(x)
        if self.context_pre_only:
            c_in = self.norm1_context(c, temb)
        else:
            c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(temb)
            c_in = modulate(layer_norm(c), c_shift_msa, c_scale_msa)

        attn_x, attn_c = self.attn(modulate(x_normed, shift_msa, scale_msa), c_in)
        x = gated(x, gate_msa, attn_x)
        if self.dual_attention:
            shift_msa2, scale_msa2, gate_msa2 = dual
            x = gated(x, gate_msa2, self.attn2(modulate(x_normed, shift_msa2, scale_msa2)))
        x = gated(x, gate_mlp, self.ff(modulate(layer_norm(x), shift_mlp, scale_mlp)))

        if self.context_pre_only:
            return x, None
        c = gated(c, c_gate_msa, attn_c)
        c = gated(c, c_gate_mlp, self.ff_context(modulate(layer_norm(c), c_shift_mlp, c_scale_mlp)))
        return x, c


class MMDiT(nn.Module):
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

    # adaLN-Zero: every modulation and the output projection start at zero, so each block is an identity map
    # and the fresh model predicts zero velocity
    ZERO_INIT = ("norm1.linear", "norm1_context.linear", "norm_out.linear", "proj_out")

    def initial_value(self, name: str, seed: int) -> torch.Tensor:
        """The initial value of parameter or buffer `name`, a function of (seed, name) alone: Xavier-uniform
        matmul and patch weights, N(0, 0.02) timestep-embedder weights, zero biases, unit RMSNorm weights,
        adaLN-Zero, and the fixed sin-cos position table."""
        if name == "pos_embed.pos_embed":
            table = sincos_2d_table(self.cfg.hidden_size, self.cfg.pos_embed_max_size,
                                    self.cfg.sample_size // self.cfg.patch_size)
            return table[None]
        module_name, _, kind = name.rpartition(".")
        module = self.get_submodule(module_name)
        shape = getattr(module, kind).shape
        if isinstance(module, nn.RMSNorm):
            return torch.ones(shape)
        if kind == "bias" or any(module_name == z or module_name.endswith(f".{z}") for z in self.ZERO_INIT):
            return torch.zeros(shape)
        if ".timestep_embedder." in f".{module_name}.":
            return torch.empty(shape).normal_(0.0, 0.02, generator=init_generator(seed, name))
        return xavier_uniform(shape, init_generator(seed, name))

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
