"""What every MMDiT here is built from, written once: initial values, timestep embedding, adaLN modulation,
attention over one or two streams (with rotary positions and a text padding mask where the family uses them), the
feed-forward, packing latents into tokens, rotary tables, and the joint (double-stream) block that SD3 / SD3.5 and
FLUX.1 share. Submodule names follow diffusers, so released state dicts map key for key. The families assemble these
in their folders (models/sd3/model.py, models/flux/model.py, models/qwen_image/model.py, models/flux2/model.py).
"""

import math
from contextlib import nullcontext
from itertools import chain

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.attention import sdpa_attention
from models.rectified_flow import INIT_STREAM, sample_key

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


# adaLN-Zero: every modulation and the output projection start at zero, so each block is an identity map and the
# fresh model predicts zero velocity. Modulations are matched by their name inside a block, the output layers by
# their full name (a FLUX single block's own `proj_out` must not start at zero: with its gate at zero too, neither
# would ever get a gradient).
ZERO_IN_BLOCKS = ("norm1.linear", "norm1_context.linear", "norm.linear")
ZERO_AT_TOP = ("norm_out.linear", "proj_out")
# a joint block's linears over the text tokens alone and its modulations, by their first names in the block: what
# float8 leaves in bf16 (perf/float8.py); each transformer names its own as TEXT_ONLY_LINEARS and MODULATION_LINEARS
JOINT_TEXT_ONLY = ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "ff_context")
JOINT_MODULATIONS = ("norm",)


def initial_value(model: nn.Module, name: str, seed: int) -> torch.Tensor:
    """The initial value of parameter `name` of an MMDiT, a function of (seed, name) alone: Xavier-uniform matmul
    and patch weights, N(0, 0.02) timestep- and guidance-embedder weights, zero biases, unit RMSNorm weights and
    adaLN-Zero."""
    module_name, _, kind = name.rpartition(".")
    module = model.get_submodule(module_name)
    shape = getattr(module, kind).shape
    if isinstance(module, nn.RMSNorm):
        return torch.ones(shape)
    if kind == "bias" or module_name in ZERO_AT_TOP or module_name.endswith(tuple(f".{z}" for z in ZERO_IN_BLOCKS)):
        return torch.zeros(shape)
    if any(f".{embedder}." in f".{module_name}." for embedder in ("timestep_embedder", "guidance_embedder")):
        return torch.empty(shape).normal_(0.0, 0.02, generator=init_generator(seed, name))
    return xavier_uniform(shape, init_generator(seed, name))


# ----------------------------------------------------------------------------------------------- embeddings


def timestep_features(t: torch.Tensor, dim: int = 256) -> torch.Tensor:
    """Sinusoidal features with flip_sin_to_cos=True and shift 0: [cos, sin]."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = t.float()[:, None] * freqs[None]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


class MLPEmbedder(nn.Module):
    """linear_1 -> SiLU -> linear_2, the shape of diffusers' timestep, guidance and pooled-text embedders."""

    def __init__(self, in_dim: int, dim: int, bias: bool = True):
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim, bias=bias)
        self.linear_2 = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TimeTextEmbed(nn.Module):
    """temb = timestep embedding (+ guidance embedding, FLUX.1-dev) (+ pooled-text embedding, where the family has
    pooled text: `pooled_dim` > 0). The sinusoidal features enter the embedders in the pooled text's dtype, or in
    `dtype` without one (Qwen-Image: the image tokens')."""

    def __init__(self, dim: int, pooled_dim: int, guidance: bool = False):
        super().__init__()
        self.timestep_embedder = MLPEmbedder(256, dim)
        self.guidance_embedder = MLPEmbedder(256, dim) if guidance else None
        self.text_embedder = MLPEmbedder(pooled_dim, dim) if pooled_dim else None

    def forward(self, timestep: torch.Tensor, pooled: torch.Tensor | None = None, guidance: torch.Tensor | None = None,
                dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = pooled.dtype if pooled is not None else dtype
        temb = self.timestep_embedder(timestep_features(timestep).to(dtype))
        if self.guidance_embedder is not None:
            temb = temb + self.guidance_embedder(timestep_features(guidance).to(dtype))
        return temb if self.text_embedder is None else temb + self.text_embedder(pooled)


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
    matmul costs nothing, but its weight is large (3-9 D^2): autocast would cast it to bf16 in every forward and
    cast its gradient back in every backward, the largest cast traffic of a block. With fp32 master weights the
    matmuls read them as they are (under FSDP's bf16 policy the weight, and so the modulation, is bf16)."""
    with autocast_off(c):
        return linear(F.silu(c.to(linear.weight.dtype)))


class AdaLNZero(nn.Module):
    """SiLU -> Linear(D, n*D) on the conditioning vector; n = 6 (joint blocks), 9 (SD3.5 dual attention) or 3
    (FLUX single blocks)."""

    def __init__(self, dim: int, chunks: int):
        super().__init__()
        self.chunks = chunks
        self.linear = nn.Linear(dim, chunks * dim)

    def forward(self, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return modulation(self.linear, c).chunk(self.chunks, dim=-1)


class AdaLNContinuous(nn.Module):
    """Final-style norm: chunk order (scale, shift), as in diffusers' AdaLayerNormContinuous."""

    def __init__(self, dim: int, bias: bool = True):
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim, bias=bias)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        scale, shift = modulation(self.linear, c).chunk(2, dim=-1)
        return modulate(layer_norm(x), shift, scale)


# ----------------------------------------------------------------------------------------------- tokens and positions


def pack(latents: torch.Tensor, p: int) -> torch.Tensor:
    """[B, C, H, W] -> [B, H/p * W/p, C * p * p], each token a p x p patch in (channel, row, column) order: how
    FLUX.1's and Qwen-Image's pipelines turn latents into tokens."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // p) * (w // p), c * p * p)


def unpack(tokens: torch.Tensor, h: int, w: int, p: int) -> torch.Tensor:
    """The inverse of `pack` for latents of h x w."""
    b, _, d = tokens.shape
    x = tokens.view(b, h // p, w // p, d // (p * p), p, p).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // (p * p), h, w)


def pack_references(references: list[torch.Tensor] | None, p: int, channels: int
                    ) -> tuple[list[torch.Tensor], tuple[tuple[int, int], ...]]:
    """An edit model's reference latents ([B, C, h, w] each, each of its own size) packed into tokens as `pack`
    packs the target, and their token grids (rows, columns); none for None."""
    tokens, grids = [], []
    for i, reference in enumerate(references or ()):
        h, w = reference.shape[-2:]
        if reference.shape[1] != channels or h % p or w % p:
            raise ValueError(f"reference {i} of {tuple(reference.shape[1:])} is not latents of {channels} channels "
                             f"whose sides divide by {p}")
        tokens.append(pack(reference, p))
        grids.append((h // p, w // p))
    return tokens, tuple(grids)


def packing(in_channels: int, latent_channels: int) -> int:
    """The side p of the latent patch a token packs: in_channels = latent channels x p x p."""
    p = math.isqrt(in_channels // latent_channels)
    if latent_channels * p * p != in_channels:
        raise ValueError(f"{latent_channels}-channel latents do not pack into in_channels={in_channels} "
                         f"(channels x p x p)")
    return p


def rotary_axes(head_dim: int) -> list[int]:
    """The split of a head's channels over the (first, row, column) position axes that FLUX.1 and Qwen-Image use,
    16/56/56 of 128, for any head dim that allows even parts."""
    first = 2 * max(1, round(head_dim / 16))
    rest = head_dim - first
    row = 2 * (rest // 4)
    return [first, row, rest - row]


def check_rotary_split(axes: list[int], head_dim: int, count: int) -> None:
    """A module's rotary split: `count` even numbers of channels, one per position axis, that sum to the head dim."""
    if len(axes) != count or sum(axes) != head_dim or any(d % 2 for d in axes):
        words = {3: "three", 4: "four"}.get(count, str(count))
        raise ValueError(f"axes_dims_rope={list(axes)} must be {words} even numbers that sum to "
                         f"attention_head_dim={head_dim}")


def rope_1d(dim: int, positions: torch.Tensor, theta: float = 10000) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [L, dim] of one position axis, frequencies theta^(-2i/dim) in float64, each repeated for its
    pair (the rotation `apply_rope` applies to adjacent channels)."""
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)
    angles = torch.outer(positions.double(), freqs)
    return angles.cos().repeat_interleave(2, dim=1).float(), angles.sin().repeat_interleave(2, dim=1).float()


def rope_tables(axes: list[int], ids: torch.Tensor, theta: float = 10000) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [L, sum(axes)] of tokens with position ids [L, len(axes)], axis i over axes[i] channels."""
    tables = [rope_1d(dim, ids[:, i], theta) for i, dim in enumerate(axes)]
    return torch.cat([cos for cos, _ in tables], dim=-1), torch.cat([sin for _, sin in tables], dim=-1)


# ----------------------------------------------------------------------------------------------- attention


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)  # [B, L, H*Dh] -> [B, H, L, Dh]


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2).flatten(2)


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """Rotary positions on [B, H, L, Dh]: each adjacent channel pair (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin),
    in fp32, cast back (`rope`: cos and sin [L, Dh], each frequency repeated for its pair); None: unchanged."""
    if rope is None:
        return x
    cos, sin = rope
    real, imag = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(-2)
    return (x.float() * cos + rotated * sin).to(x.dtype)


class SelfAttention(nn.Module):
    """Attention over one sequence: SD3.5's image-only `attn2`, and a FLUX single block's attention over the joint
    sequence (rotary positions, no output projection: the block's `proj_out` follows). `bias`: its linears have
    biases (FLUX.2's have none)."""

    def __init__(self, dim: int, heads: int, qk_norm: bool, out_projection: bool = True, bias: bool = True):
        super().__init__()
        self.heads = heads
        self.attention_kernel = sdpa_attention  # q, k, v, mask -> out; chosen from outside (models/attention.py)
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=bias) for _ in range(3))
        self.to_out = nn.ModuleList([nn.Linear(dim, dim, bias=bias)]) if out_projection else None
        head_dim = dim // heads
        self.norm_q = RMSNorm(head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.norm_k = RMSNorm(head_dim, eps=1e-6) if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        q = apply_rope(self.norm_q(split_heads(self.to_q(x), self.heads)), rope)
        k = apply_rope(self.norm_k(split_heads(self.to_k(x), self.heads)), rope)
        v = split_heads(self.to_v(x), self.heads)
        out = merge_heads(self.attention_kernel(q, k, v))
        return self.to_out[0](out) if self.to_out is not None else out


class JointAttention(SelfAttention):
    """One attention over both streams; each stream has its own projections. The joint sequence is [image, text]
    (SD3) or [text, image] (FLUX, `text_first`), where rotary positions (`rope`, over the joint sequence) apply."""

    def __init__(self, dim: int, heads: int, qk_norm: bool, context_pre_only: bool, text_first: bool = False,
                 bias: bool = True):
        super().__init__(dim, heads, qk_norm, bias=bias)
        self.text_first = text_first
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(dim, dim, bias=bias) for _ in range(3))
        head_dim = dim // heads
        self.norm_added_q = RMSNorm(head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.norm_added_k = RMSNorm(head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.to_add_out = None if context_pre_only else nn.Linear(dim, dim, bias=bias)
        self.text_output = not context_pre_only  # off: the text's output is not computed (`to_add_out` unused)

    def joint(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        return torch.cat([text, image] if self.text_first else [image, text], dim=2)

    def forward(self, x: torch.Tensor, c: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`mask`: [B, 1, 1, joint tokens], False at the keys no token may attend to (text padding)."""
        q = self.joint(self.norm_q(split_heads(self.to_q(x), self.heads)),
                       self.norm_added_q(split_heads(self.add_q_proj(c), self.heads)))
        k = self.joint(self.norm_k(split_heads(self.to_k(x), self.heads)),
                       self.norm_added_k(split_heads(self.add_k_proj(c), self.heads)))
        v = self.joint(split_heads(self.to_v(x), self.heads), split_heads(self.add_v_proj(c), self.heads))
        out = merge_heads(self.attention_kernel(apply_rope(q, rope), apply_rope(k, rope), v, mask=mask))
        image_tokens, text_tokens = x.shape[1], c.shape[1]
        if self.text_first:
            c_out, x_out = out.split([text_tokens, image_tokens], dim=1)
        else:
            x_out, c_out = out.split([image_tokens, text_tokens], dim=1)
        return self.to_out[0](x_out), (self.to_add_out(c_out) if self.text_output else None)


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


# ----------------------------------------------------------------------------------------------- the joint block


class JointTransformerBlock(nn.Module):
    """SD3's joint block, which is FLUX's double-stream block (`text_first`, rotary positions, never
    `context_pre_only` or dual attention): adaLN-Zero modulation of each stream, one joint attention, a
    feed-forward per stream, gated residuals. Returns (image stream, text stream or None after the last SD3
    block)."""

    def __init__(self, dim: int, heads: int, qk_norm: bool, context_pre_only: bool, dual_attention: bool,
                 text_first: bool = False):
        super().__init__()
        self.context_pre_only = context_pre_only
        self.dual_attention = dual_attention
        self.norm1 = AdaLNZero(dim, 9 if dual_attention else 6)
        self.norm1_context = AdaLNContinuous(dim) if context_pre_only else AdaLNZero(dim, 6)
        self.attn = JointAttention(dim, heads, qk_norm, context_pre_only, text_first)
        self.attn2 = SelfAttention(dim, heads, qk_norm) if dual_attention else None
        self.ff = FeedForward(dim)
        self.ff_context = None if context_pre_only else FeedForward(dim)

    def forward(self, x: torch.Tensor, c: torch.Tensor, temb: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp, *dual = self.norm1(temb)
        x_normed = layer_norm(x)
        if self.context_pre_only:
            c_in = self.norm1_context(c, temb)
        else:
            c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(temb)
            c_in = modulate(layer_norm(c), c_shift_msa, c_scale_msa)

        attn_x, attn_c = self.attn(modulate(x_normed, shift_msa, scale_msa), c_in, rope)
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
