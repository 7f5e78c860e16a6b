"""The training step at real shapes: what one optimizer step of SD3 / SD3.5, FLUX.1 and Qwen-Image fine-tuning
costs (`make bench`).

    python benchmarks/train_step.py [--size real|tiny] [--models NAME ...] [--variants NAME ...] [--list]
                                    [--steps 10] [--warmup 3] [--out FILE | --resume FILE [--redo-failed]]
                                    [--stop-after SECONDS] [--overrides KEY=VALUE ...] [--resolution PX]

Each model is a fine-tuning config of configs/ with the released architecture (plan_memory.py's table; random
weights, nothing downloaded) at 1024 px (128x128 latents, 4096 image tokens + 333 text tokens for SD3, 512 for
FLUX.1 and Qwen-Image, Qwen-Image's with their padding mask, every token present), the config's
micro-batch, one micro-step per optimizer step. A row runs the REAL step of train_mmdit_stable.py on batches that
are already on the device (the loader is measured apart): `forward_backward` then `optimizer_step` (clip,
fused AdamW, the EMA), imported, not re-implemented; the model is built as training builds it
(`build_trained_model`, `apply_attention_backend`, `apply_parallelism`: LoRA, the frozen base in bf16 or
quantized, activation checkpointing, compile). After `--warmup` steps (compilation included) `--steps` steps are
timed with CUDA events between steps, read after the last (perf_counter on a CPU); a row reports their median:

- images/s and tokens/s (image + text tokens) from the median step;
- MFU: model FLOPs per step over the median step time over the GPU's dense peak for the row's precision (TF32 for
  fp32 rows, bf16 for bf16 and float8 rows). Model FLOPs come from torch's flop counter on a meta-device copy
  (runtime/step_stats.py: train_flops_per_sample): the forward and backward the model does, attention as the
  math formula's two matmuls; activation checkpointing's recompute is not counted (the copy is not
  checkpointed); adaLN's modulation linears are counted as they run, once per sample on the conditioning vector
  (not per token, as 6 x params x tokens would), and each stream's weights only on that stream's tokens; a
  LoRA step's frozen weights get no weight gradient, so it counts 2 of the 3 matmuls per frozen linear; the
  diffusers anchor is counted on this project's model of the same architecture (SD3-medium at 1024 px: 26.7
  TFLOP per sample, 107 per step of 4; SD3.5-large LoRA: 69.6 per sample);
- peak device memory over the timed steps (CUDA allocator; not measured on a CPU);
- host syncs per step in one more step (CUDA's sync debug mode; runtime/host_syncs.py's counter on a CPU, under
  which every step of a row runs there);
- graph breaks that torch.compile reported while building the row (dynamo's counters), and the graphs that run
  eagerly because the compiler failed on them (`eager_fallbacks`: a "compiled" row with any is not compiled);
- seconds spent building the row, in its warm-up steps (compilation, on a cold cache) and in all.

The rows, in the order they run (`--list`, with each one's estimated seconds): first the headline, SD3-medium as
configured (bf16, compiled blocks, no activation checkpointing) and the anchor, diffusers' SD3Transformer2DModel
at the same shape, precision, activation checkpointing, attention kernel and step, eager and compiled per block
(diffusers 0.42 lists no `_repeated_blocks` for it); then SD3-medium bf16 eager and fp32+TF32 eager and each
other config as written (FLUX.1-dev LoRA's diffusers anchor after it); then the rest of SD3-medium's sweep (each
activation-checkpointing choice, each attention backend) and float8 (SD3-medium, and SD3.5-large LoRA: its target
is 1.2x bf16 there); then Qwen-Image LoRA as configured, its diffusers anchor (QwenImageTransformer2DModel with
peft adapters on the same targets) eager and compiled, and its 24 GB config; then FLUX.2 klein-4B LoRA as configured
and its anchor (Flux2Transformer2DModel with peft adapters), and dev's LoRA on 24 GB (nf4, blocks swapped). A
model's rows are entries of MODELS (its config, architecture, which variants, its diffusers anchor, how many kinds
of block it compiles). Each anchor, given our model's weights, predicts our model's velocity (a test). Any failure of a row is caught and recorded with
its error (the traceback goes to stderr) and the table goes on; a row that cannot run here (a CUDA-only kernel,
a missing package) is "not runnable" with the reason. On a GPU whose CUDA context an error broke, the run stops:
`--resume` continues in a fresh process.

The anchor: diffusers' model runs the same step (per-sample v-prediction loss, clipping, fused AdamW, the EMA,
autocast) at the row's kernel: SD3's attention processor in diffusers calls `F.scaled_dot_product_attention`
itself and ignores `set_attention_backend`, so an SDPA kernel of ours (sdpa_cudnn, ...) is forced around
diffusers' whole step with `torch.nn.attention.sdpa_kernel`; a flash-attn backend of ours has no counterpart
there (the row says so and diffusers runs SDPA's own choice). Activation checkpointing: diffusers checkpoints
every block or none; where ours does something else (every k-th block, selective) diffusers checkpoints every
block and the row says so. Where the numerics differ: our norms (LayerNorm, RMSNorm) run in the activation's
dtype outside autocast with fp32 statistics, and adaLN modulation is one bf16 multiply-add; under CUDA's autocast
diffusers' LayerNorms return fp32 and its modulation runs in fp32 (more bytes per block, rounded once more
later); our step skips a non-finite step on the device (NonFiniteGuard), seeds each step's RNG, keeps the loss by
noise level, and decays only Linear and Conv weights (the anchor decays every parameter); FLOPs are the same.

Long tables (a GPU lent for minutes, in commands of under 10 minutes): the JSON is rewritten after every row,
atomically (a command killed mid-row leaves the table as it was, with the row marked running); `--stop-after S`
ends the run within S seconds of the script's start: a row starts only if its estimated time fits in what is
left. A row is estimated at a build, a cold compile per block kind and its steps (COSTS: pessimistic for an H100
until the table holds measured rows; then scaled by the largest ratio of measured to estimated time among them,
each row's `estimated_s` beside its `seconds`), so an early row that ran long makes later estimates longer.
`--resume FILE` continues FILE's table (same size, steps,
resolution, overrides, device and torch; a FILE not there yet starts it, so every command of a series can be the
same), skipping the rows it holds (failed ones too, unless `--redo-failed`);
a row whose process was killed mid-row runs once more, then counts as failed. Compiled rows read and write
inductor's on-disk caches (TORCHINDUCTOR_CACHE_DIR, Triton's under it): a row whose graphs an earlier row or
command on the same machine compiled loads them instead of compiling (benchmarks/RESULTS.md: the GPU recipe).
A `--size real` table is never overwritten: an existing --out file is continued with --resume or refused.

`--overrides key=value ...` changes every row (e.g. training.train_batch_size=8), `--resolution` the image side.
`--size tiny` shrinks every model to 2 blocks at 128 px (compile with the aot_eager backend), so the whole table
runs on a CPU (every row runs, the compiled ones included; rows that need a GPU say why): it checks the
machinery, its times mean nothing, and its table (runs/bench/train_step_cpu_tiny.json) is rewritten each run.
The table is printed and the rows written to benchmarks/train_step_<device>.json (or --out).
"""

import argparse
import dataclasses
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import statistics
import sys
import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

STARTED = time.monotonic()  # before torch's import (many seconds on a fresh machine): --stop-after counts it

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torch.nn.attention import sdpa_kernel  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the project folders import by their names

import perf.block_swap  # noqa: E402
import perf.compile  # noqa: E402
from configs.build import build_model, build_trained_model, transformer_config  # noqa: E402
from configs.schema import check_sections  # noqa: E402
from data.latents import empty_text  # noqa: E402
from errors import ConfigError  # noqa: E402
from formats import DTYPES  # noqa: E402
from models.families import FAMILIES  # noqa: E402
from models.lora import apply_lora  # noqa: E402
from models.rectified_flow import interpolate, per_sample_loss  # noqa: E402
from optim.ema import EMA  # noqa: E402
from perf.attention import BACKENDS, SDPA_KERNELS, apply_attention_backend, choose, joint_lengths  # noqa: E402
from perf.parallel import apply_parallelism, unwrap  # noqa: E402
from perf.precision import autocast, configure_cuda_math, grad_scaler  # noqa: E402
from plan_memory import RELEASED, data_of, family_text, planning_config  # noqa: E402
from runtime.distributed import World  # noqa: E402
from runtime.host_syncs import HostSyncCounter, cuda_sync_counter  # noqa: E402
from runtime.nonfinite import NonFiniteGuard  # noqa: E402
from runtime.step_stats import SigmaBuckets, peak_flops, train_flops_per_sample  # noqa: E402
from train_mmdit_stable import forward_backward, optimizer_step, training_optimizer  # noqa: E402

RESOLUTION = 1024
# each row's step as benchmarks/roofline.py predicts it on one H100 (`--predict`, on any machine): a GPU run's table
# shows it beside the measured step
PREDICTED = ROOT / "benchmarks" / "train_step_predicted.json"


# ----------------------------------------------------------------------------------------------- the rows


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...] = ()
    tier: int = 2  # rows run by tier: 0 the headline and its anchor, 1 every config as written (FLUX.1's anchor
    # after its own row) and the eager baselines, 2 the rest
    anchor: bool = False  # the model's diffusers anchor instead of this project's model


def sd3_anchor(cfg, data: SimpleNamespace, device: torch.device):
    """diffusers' SD3Transformer2DModel with `cfg`'s architecture: (the model, its repeated blocks, which compile
    one by one, and forward(x_t, sigma, text) -> velocity, our model's call made on it)."""
    from diffusers import SD3Transformer2DModel
    m = cfg.model
    with torch.device(device):
        model = SD3Transformer2DModel(
            sample_size=m.sample_size, patch_size=m.patch_size, in_channels=data.latent_channels,
            num_layers=m.num_layers, attention_head_dim=m.attention_head_dim, num_attention_heads=m.num_attention_heads,
            joint_attention_dim=data.text_dims[0], caption_projection_dim=m.num_attention_heads * m.attention_head_dim,
            pooled_projection_dim=data.text_dims[1], out_channels=data.latent_channels,
            pos_embed_max_size=m.pos_embed_max_size, dual_attention_layers=tuple(m.dual_attention_layers),
            qk_norm=m.qk_norm)
    model.to(device)  # buffers made from numpy (its position table) ignore the device context

    def forward(x_t: torch.Tensor, sigma: torch.Tensor, text: dict) -> torch.Tensor:
        return model(hidden_states=x_t, encoder_hidden_states=text["prompt_embeds"],
                     pooled_projections=text["pooled_prompt_embeds"], timestep=sigma * 1000, return_dict=False)[0]
    return model, list(model.transformer_blocks), forward


def flux_anchor(cfg, data: SimpleNamespace, device: torch.device):
    """diffusers' FluxTransformer2DModel with `cfg`'s architecture, driven as FluxPipeline drives it (packed tokens,
    position ids, sigma as timestep, the guidance constant we train with): sd3_anchor's triple."""
    from diffusers import FluxTransformer2DModel

    from models.flux.model import pack, position_ids, unpack
    m, p = cfg.model, cfg.model.patch_size
    with torch.device(device):
        model = FluxTransformer2DModel(
            in_channels=data.latent_channels * p * p, num_layers=m.num_layers, num_single_layers=m.num_single_layers,
            attention_head_dim=m.attention_head_dim, num_attention_heads=m.num_attention_heads,
            joint_attention_dim=data.text_dims[0], pooled_projection_dim=data.text_dims[1],
            guidance_embeds=m.guidance_embeds, axes_dims_rope=tuple(m.axes_dims_rope))

    def forward(x_t: torch.Tensor, sigma: torch.Tensor, text: dict) -> torch.Tensor:
        (h, w), tokens = x_t.shape[-2:], text["prompt_embeds"].shape[1]
        # made on the device, as the pipeline makes them (derived from x_t, so the CPU's host-sync counter knows it)
        ids = x_t.new_zeros(()) + position_ids(tokens, h // p, w // p, x_t.device)
        guidance = torch.full_like(sigma, cfg.flux.train_guidance) if m.guidance_embeds else None
        out = model(hidden_states=pack(x_t, p), encoder_hidden_states=text["prompt_embeds"],
                    pooled_projections=text["pooled_prompt_embeds"], timestep=sigma, img_ids=ids[tokens:],
                    txt_ids=ids[:tokens], guidance=guidance, return_dict=False)[0]
        return unpack(out, h, w, p)
    return model, [*model.transformer_blocks, *model.single_transformer_blocks], forward


def qwen_anchor(cfg, data: SimpleNamespace, device: torch.device):
    """diffusers' QwenImageTransformer2DModel with `cfg`'s architecture, driven as QwenImagePipeline drives it
    (packed tokens, the text with its padding mask, the image's shape for the rotary positions, sigma as timestep):
    sd3_anchor's triple. diffusers computes the last block's text stream, which reaches nothing (ours skips it), and
    peft adapts it too: those adapters never get a gradient (AdamW and clipping skip them)."""
    from diffusers import QwenImageTransformer2DModel

    from models.blocks import pack, unpack
    m, p = cfg.model, cfg.model.patch_size
    # a LoRA base is built in the compute dtype it is trained in: 20.4B parameters in fp32 (82 GB) would not fit
    # an 80 GB GPU on the way
    default, dtype = torch.get_default_dtype(), DTYPES[cfg.training.dtype] if cfg.lora.enabled else torch.float32
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = QwenImageTransformer2DModel(
                patch_size=p, in_channels=data.latent_channels * p * p, out_channels=data.latent_channels,
                num_layers=m.num_layers, attention_head_dim=m.attention_head_dim,
                num_attention_heads=m.num_attention_heads, joint_attention_dim=data.text_dims[0],
                axes_dims_rope=tuple(m.axes_dims_rope))
    finally:
        torch.set_default_dtype(default)

    def forward(x_t: torch.Tensor, sigma: torch.Tensor, text: dict) -> torch.Tensor:
        h, w = x_t.shape[-2:]
        out = model(hidden_states=pack(x_t, p), encoder_hidden_states=text["prompt_embeds"],
                    encoder_hidden_states_mask=text["prompt_embeds_mask"], timestep=sigma,
                    img_shapes=[[(1, h // p, w // p)]] * len(x_t), return_dict=False)[0]
        return unpack(out, h, w, p)
    return model, list(model.transformer_blocks), forward


def flux2_anchor(cfg, data: SimpleNamespace, device: torch.device):
    """diffusers' Flux2Transformer2DModel with `cfg`'s architecture, driven as Flux2KleinPipeline (and Flux2Pipeline,
    with its guidance) drives it: tokens of the patchified latents, 4-axis ids of them and of the text, sigma as
    timestep: sd3_anchor's triple."""
    from diffusers import Flux2Transformer2DModel

    from models.blocks import pack, unpack
    from models.flux2.model import position_ids
    m = cfg.model
    with torch.device(device):  # our config is diffusers' config.json (tests/test_finetune_configs.py)
        model = Flux2Transformer2DModel(**dataclasses.asdict(
            transformer_config(cfg, data.latent_channels, data.latent_sizes, data.text_dims)))

    def forward(x_t: torch.Tensor, sigma: torch.Tensor, text: dict) -> torch.Tensor:
        (h, w), tokens = x_t.shape[-2:], text["prompt_embeds"].shape[1]
        ids = x_t.new_zeros(()) + position_ids(tokens, h, w, x_t.device)  # on the device, as flux_anchor's
        guidance = torch.full_like(sigma, cfg.flux.train_guidance) if m.guidance_embeds else None
        out = model(hidden_states=pack(x_t, 1), encoder_hidden_states=text["prompt_embeds"], timestep=sigma,
                    img_ids=ids[tokens:], txt_ids=ids[:tokens], guidance=guidance, return_dict=False)[0]
        return unpack(out, h, w, 1)
    return model, [*model.transformer_blocks, *model.single_transformer_blocks], forward


# --size tiny: every model 2 blocks of 2 heads x 16 at 128 px (16x16 latents, 8x8 patches), 8 text tokens
SD3_TINY = {"num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 16, "sample_size": 16,
            "pos_embed_max_size": 8}
TINY = {"text": {"tokens": 8, "joint": 32, "pooled": 16}, "resolution": 128}
SD3_TEXT, FLUX_TEXT, QWEN_TEXT, KLEIN_4B_TEXT, FLUX2_DEV_TEXT = (
    family_text(FAMILIES[RELEASED[name]["family"]], SimpleNamespace(**RELEASED[name]))
    for name in ("sd3-medium", "flux-dev", "qwen-image", "flux2-klein-4b", "flux2-dev"))


@dataclass(frozen=True)
class Model:
    config: str  # a fine-tuning config of configs/
    architecture: str  # its released sizes: plan_memory.RELEASED's key
    variants: tuple[Variant, ...]  # besides the config as written (tier 0 for the first model, else 1)
    text: dict = field(default_factory=lambda: SD3_TEXT)  # text embeddings' and latents' shapes
    anchor: Callable | None = None  # diffusers' model of the architecture (as sd3_anchor), for anchor variants
    tiny: dict = field(default_factory=lambda: SD3_TINY)  # model.* at --size tiny
    block_kinds: int = 2  # distinct blocks, each one graph to compile (SD3: joint and last; FLUX.1: double, single;
    # Qwen-Image: dual-stream and the last, whose text stream is not computed)
    tier: int = 1  # of its row as configured (the first model's: 0)


def anchors(tier: int) -> tuple[Variant, Variant]:
    return (Variant("diffusers eager", ("compile.enabled=false",), tier, anchor=True),
            Variant("diffusers compiled", (), tier, anchor=True))


FLOAT8 = Variant("float8", ("float8.enabled=true",))
SD3_MEDIUM_SWEEP = (
    *anchors(0),
    Variant("bf16 eager", ("compile.enabled=false",), 1),
    Variant("fp32+TF32 eager", ("training.dtype=fp32", "compile.enabled=false"), 1),
    Variant("bf16 compiled, full checkpointing", ("training.activation_checkpointing=full",)),
    Variant("bf16 compiled, selective checkpointing", ("training.activation_checkpointing=selective",)),
    Variant("bf16 compiled, checkpointing every 2nd block", ("training.activation_checkpointing=full",
                                                             "training.activation_checkpointing_every=2")),
    # not the memory-efficient kernel: no bf16 run on Hopper picks it, and its two cold block compiles would cost
    # a GPU window about two minutes (benchmarks/RESULTS.md: the GPU recipe)
    *(Variant(f"bf16 compiled, attention {b}", (f"training.attention_backend={b}",))
      for b in BACKENDS if b not in ("auto", "math", "sdpa_efficient")),
    FLOAT8)
SD35_MEDIUM_TINY = {**SD3_TINY, "dual_attention_layers": [0]}  # its first blocks have a second image attention
FLUX_TINY = {"num_layers": 1, "num_single_layers": 2, "num_attention_heads": 2, "attention_head_dim": 16,
             "axes_dims_rope": [2, 6, 8]}  # a double and two single blocks, 8x8 packed tokens
QWEN_TINY = {"num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 16, "axes_dims_rope": [2, 6, 8]}
FLUX2_TINY = {"num_layers": 1, "num_single_layers": 2, "num_attention_heads": 2, "attention_head_dim": 16,
              "axes_dims_rope": [4, 4, 4, 4]}
MODELS = {
    "sd3-medium": Model("sd3_medium.yaml", "sd3-medium", SD3_MEDIUM_SWEEP, anchor=sd3_anchor),
    # its dual-attention blocks are a third kind
    "sd3.5-medium-lora": Model("sd35_medium_lora.yaml", "sd35-medium", (), tiny=SD35_MEDIUM_TINY, block_kinds=3),
    "sd3.5-medium-lora-24gb": Model("sd35_medium_lora_24gb.yaml", "sd35-medium", (), tiny=SD35_MEDIUM_TINY,
                                    block_kinds=3),
    "sd3.5-large-lora": Model("sd35_large_lora.yaml", "sd35-large", (FLOAT8,)),
    "sd3.5-large-lora-24gb": Model("sd35_large_lora_24gb.yaml", "sd35-large", ()),
    # FLUX.1-dev: LoRA on one GPU against diffusers' model with peft's adapters on the same targets (the full
    # fine-tune shards over 8 GPUs: flux_dev.yaml is not a one-GPU row). No float8 row: float8 on a frozen LoRA
    # base is SD3.5-large's row (the roofline predicts a loss there; docs/performance.md)
    "flux-dev-lora": Model("flux_dev_lora.yaml", "flux-dev", anchors(1), FLUX_TEXT, flux_anchor, FLUX_TINY),
    "flux-dev-lora-24gb": Model("flux_dev_lora_24gb.yaml", "flux-dev", (), FLUX_TEXT, tiny=FLUX_TINY),
    # Qwen-Image (20.4B): LoRA on one 80 GB GPU against diffusers' model with peft's adapters on the same targets,
    # and on a 24 GB GPU's nf4 base; after the first tiers (a new family's rows wait for the headline's sweep:
    # benchmarks/RESULTS.md, the GPU recipe)
    "qwen-image-lora": Model("qwen_image_lora.yaml", "qwen-image", anchors(2), QWEN_TEXT, qwen_anchor, QWEN_TINY,
                             tier=2),
    "qwen-image-lora-24gb": Model("qwen_image_lora_24gb.yaml", "qwen-image", (), QWEN_TEXT, tiny=QWEN_TINY, tier=2),
    # FLUX.2: klein 4B's LoRA (16 GB) against diffusers' model with peft's adapters on the same targets, and dev's
    # on a 24 GB GPU (nf4, 14 blocks swapped) as configured, after the other families' rows
    "flux2-klein-4b-lora": Model("flux2_klein_4b_lora.yaml", "flux2-klein-4b", anchors(2), KLEIN_4B_TEXT,
                                 flux2_anchor, FLUX2_TINY, tier=2),
    "flux2-dev-lora-24gb": Model("flux2_dev_lora_24gb.yaml", "flux2-dev", (), FLUX2_DEV_TEXT, tiny=FLUX2_TINY,
                                 tier=2),
}


@dataclass(frozen=True)
class Row:
    model: str
    variant: Variant

    @property
    def name(self) -> str:
        return f"{self.model}: {self.variant.name}"


def all_rows() -> list[Row]:
    """Every row, in the order they run: by tier, then in MODELS' order and each model's."""
    rows = []
    for i, (name, model) in enumerate(MODELS.items()):
        rows += [Row(name, Variant("as configured", (), 0 if i == 0 else model.tier))]
        rows += [Row(name, variant) for variant in model.variants]
    return sorted(rows, key=lambda row: row.variant.tier)  # stable: MODELS' order within a tier


# ----------------------------------------------------------------------------------------------- building


def benchmark_config(model: str, overrides: list[str], size: str):
    """The model's fine-tuning config with the released architecture (or the tiny one) and `overrides`."""
    spec = MODELS[model]
    # at tiny size, aot_eager traces the same graphs as inductor without generating code: seconds
    shrink = [*(f"model.{k}={v}" for k, v in spec.tiny.items()), "compile.backend=aot_eager"] if size == "tiny" else []
    cfg, _ = planning_config(str(ROOT / "configs" / spec.config), [], spec.architecture)
    for item in [*shrink, *overrides]:
        key, _, value = item.partition("=")
        OmegaConf.update(cfg, key, OmegaConf.from_dotlist([f"v={value}"]).v, merge=False)
    if shrink and OmegaConf.select(OmegaConf.load(ROOT / "configs" / spec.config), "lora.target_modules") is None:
        # the family's default targets of the shrunk model (FLUX.2's name its single blocks by index)
        cfg.lora.target_modules = FAMILIES[cfg.model.family].default_lora_targets(cfg.model)
    if shrink:  # every tiny model has 2 blocks or more
        cfg.offload.blocks_to_swap = min(cfg.offload.blocks_to_swap, 2)
    check_sections(cfg)
    return cfg


def data_shapes(model: str, size: str, resolution: int = RESOLUTION) -> SimpleNamespace:
    """What the model needs to know of the data: latents and text embeddings at the benchmark's size (the text's
    fields as a latent dataset holds them: data/latents.py's `text_shapes`, Qwen-Image's padding mask included)."""
    text = MODELS[model].text
    if size == "tiny":
        tiny = TINY["text"]  # a family without a pooled vector has none at any size
        text = {**text, "tokens": tiny["tokens"], "joint": tiny["joint"], "pooled": tiny["pooled"] if text["pooled"] else 0}
    return data_of(text, (TINY["resolution"] if size == "tiny" else resolution) // text["vae_factor"])


def device_batch(cfg, data: SimpleNamespace, device: torch.device) -> dict:
    """One step's batch as the loader delivers it, made on the device: random latents, noise, sigma and text
    embeddings; a text mask of every token present (a padded caption runs the same kernels)."""
    g = torch.Generator(device).manual_seed(0)
    b, (h, w) = cfg.training.train_batch_size, data.latent_sizes[-1]
    latents = lambda: torch.randn(b, data.latent_channels, h, w, generator=g, device=device)  # noqa: E731
    batch = {"step": 0, "first_position": 0, "latents": latents(), "noise": latents(),
             "sigma": torch.rand(b, generator=g, device=device)}
    with torch.device(device):
        text = empty_text(data.text_shapes, b)
    batch["text"] = {name: t if name == "prompt_embeds_mask" else torch.randn(t.shape, generator=g, device=device)
                     for name, t in text.items()}
    return batch


@torch.no_grad()
def randomize(model: torch.nn.Module) -> None:
    """Random weights on the device (no download; adaLN gates non-zero, so every weight gets a gradient); a swapped
    block's frozen weights in their host buffers (on the device they are storage-less between copies)."""
    torch.manual_seed(0)
    swap = perf.block_swap.active
    for name, p in model.named_parameters():
        p = swap.master(name) if swap and swap.master(name) is not None else p
        if p.is_floating_point():
            p.normal_(0.0, 0.02)
        else:  # a quantized base's codes
            p.random_(-127, 128) if p.dtype == torch.int8 else p.random_(0, 256)


_FLOPS: dict[tuple, int] = {}  # the count of a model seen in an earlier row (a large model's takes many seconds)


def flops_per_sample(cfg, data: SimpleNamespace) -> int:
    """Model FLOPs of one sample's training step; the same for every row of one architecture, LoRA and data."""
    key = (OmegaConf.to_yaml(cfg.model), OmegaConf.to_yaml(cfg.lora), str(vars(data)))
    if key not in _FLOPS:
        _FLOPS[key] = count_flops_per_sample(cfg, data)
    return _FLOPS[key]


def count_flops_per_sample(cfg, data: SimpleNamespace) -> int:
    shape = (data.latent_channels, *data.latent_sizes[-1])

    def inputs():  # made inside the counter's meta-device context
        return torch.zeros(1, *shape), torch.full((1,), 0.5), empty_text(data.text_shapes)
    return train_flops_per_sample(lambda: apply_lora(build_model(cfg, data), cfg.lora), inputs)


def ours(cfg, data: SimpleNamespace, device: torch.device):
    """This project's model, optimizer and step as train_mmdit_stable.py builds and runs them; the row's facts."""
    t, o = cfg.training, cfg.optimizer
    model = build_trained_model(cfg, data)
    attention = apply_attention_backend(model, t.attention_backend, device, t.dtype, cfg.model.attention_head_dim,
                                        *attention_setting(cfg, data))
    buffers = dict(model.named_buffers())
    model = apply_parallelism(model, cfg, World(), device, lambda name, offsets, sizes: (
        model.initial_value(name, 0) if name in buffers else torch.zeros(())))  # weights: randomize() below
    randomize(model)
    optimizer = training_optimizer(model, cfg, device)
    ema, scaler = EMA(unwrap(model), o.ema_decay), grad_scaler(device, t.dtype)
    guard, sigma_losses = NonFiniteGuard(t.max_nonfinite_steps, cfg.logging.log_every), SigmaBuckets(device)
    configure_cuda_math(device, t.allow_tf32)

    def step(batch: dict, i: int) -> None:
        batch["step"] = i
        forward_backward(model, batch, cfg, scaler, sigma_losses, t.train_batch_size)
        optimizer_step(model, optimizer, scaler, ema, guard, i, o.grad_clip_norm)
    return model, step, {"attention": attention, "compiler": perf.compile.active, "notes": []}


def attention_setting(cfg, data: SimpleNamespace) -> tuple[list[int], bool]:
    """The sequence lengths `auto` checks a kernel at and whether the blocks compile as one graph, as
    train_mmdit_stable.py passes them."""
    return (joint_lengths([(size, ()) for size in data.latent_sizes], cfg.model.patch_size, data.text_tokens),
            cfg.compile.enabled and cfg.compile.scope == "blocks")


def resolved_attention(cfg, data: SimpleNamespace, device: torch.device) -> str:
    """The kernel our row runs, which the anchor's row runs too."""
    t = cfg.training
    return choose(device, t.dtype, cfg.model.attention_head_dim, *attention_setting(cfg, data))[0] \
        if t.attention_backend == "auto" else t.attention_backend


def diffusers_anchor(cfg, data: SimpleNamespace, device: torch.device, build):
    """diffusers' model (`build`: sd3_anchor's signature) with our step: loss, backward, clipping, fused AdamW,
    EMA; at our row's attention kernel and activation checkpointing where diffusers can (else the notes say)."""
    t, o = cfg.training, cfg.optimizer
    model, blocks, forward = build(cfg, data, device)
    randomize(model)
    model.train()
    if cfg.lora.enabled:  # as diffusers' LoRA scripts train: peft adapters in fp32 on a frozen base in the compute dtype
        from peft import LoraConfig
        model.requires_grad_(False).to(DTYPES[cfg.training.dtype])
        model.add_adapter(LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, init_lora_weights="gaussian",
                                     target_modules=list(cfg.lora.target_modules)))
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    notes, attention = [], resolved_attention(cfg, data, device)
    if attention in SDPA_KERNELS:
        kernel = partial(sdpa_kernel, SDPA_KERNELS[attention])
    else:
        kernel = nullcontext
        if attention != "sdpa":
            notes.append(f"attention: ours {attention}, diffusers SDPA's own choice (its SD3 attention calls SDPA "
                         f"itself)")
            attention = "sdpa"
    if t.activation_checkpointing != "none":
        model.enable_gradient_checkpointing()  # every block, whole
        if t.activation_checkpointing != "full" or t.activation_checkpointing_every != 1:
            notes.append(f"activation checkpointing: ours {t.activation_checkpointing} every "
                         f"{t.activation_checkpointing_every}, diffusers every block (its only choice)")
    compiler = None
    if cfg.compile.enabled:  # its blocks, as ours; not held to one graph (graph breaks are counted)
        compiler = perf.compile.compile_modules(blocks, cfg.compile.backend, cfg.compile.mode, fullgraph=False)
    configure_cuda_math(device, t.allow_tf32)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=o.lr,
                                  betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, fused=True)
    ema = EMA(model, o.ema_decay)

    def step(batch: dict, i: int) -> None:
        x0, noise, sigma = batch["latents"], batch["noise"], batch["sigma"]
        with kernel():  # around the backward too: checkpointing recomputes the forward there
            with autocast(device, t.dtype):
                v = forward(interpolate(x0, noise, sigma), sigma, batch["text"])
            per_sample_loss(v, x0, noise).mean().backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], o.grad_clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ema.update(i)
    return model, step, {"attention": attention, "compiler": compiler, "notes": notes}


# ----------------------------------------------------------------------------------------------- measuring


def timed(step, batch: dict, device: torch.device, first: int, count: int) -> list[float]:
    """Seconds of each of `count` steps: CUDA events on the GPU's timeline, read once after the last step (as in
    training, the host queues step after step without waiting), perf_counter on a CPU."""
    if device.type != "cuda":
        seconds = []
        for i in range(first, first + count):
            started = time.perf_counter()
            step(batch, i)
            seconds.append(time.perf_counter() - started)
        return seconds
    events = [torch.cuda.Event(enable_timing=True) for _ in range(count + 1)]
    events[0].record()
    for i, event in zip(range(first, first + count), events[1:]):
        step(batch, i)
        event.record()
    events[-1].synchronize()
    return [start.elapsed_time(end) / 1000 for start, end in zip(events, events[1:])]


def counted(model, batch: dict, device: torch.device) -> HostSyncCounter | None:
    """On a CPU, runtime/host_syncs.py's counter, under which every step of the row runs (entering it changes what
    compiled code guards on: a step under it alone would compile the blocks again); None on a GPU."""
    return None if device.type == "cuda" else HostSyncCounter([*model.parameters(), batch])


def host_syncs(step, batch: dict, device: torch.device, counter: HostSyncCounter | None, i: int) -> int:
    """The host syncs of one more step: CUDA's sync debug mode, or what `counter` counts in it."""
    if counter is None:
        counts = {}
        with cuda_sync_counter(counts):
            step(batch, i)
        return counts["cuda sync"]
    counter.counts.clear()
    step(batch, i)
    return counter.total


def settings(cfg) -> str:
    t = cfg.training
    checkpointing = t.activation_checkpointing + (f" every {t.activation_checkpointing_every}"
                                                  if t.activation_checkpointing_every != 1 else "")
    return ", ".join([t.dtype + (" float8" if cfg.float8.enabled else ""),
                      "compiled" if cfg.compile.enabled else "eager", f"checkpointing {checkpointing}",
                      *([cfg.optimizer.name] if cfg.optimizer.name != "adamw" else [])])


def measure(row: Row, size: str, steps: int, warmup: int, device: torch.device, resolution: int = RESOLUTION,
            overrides: tuple[str, ...] = ()) -> dict:
    """One row: build, warm up, time, count; or why it cannot run here, or the error it failed with."""
    result = {"model": row.model, "variant": row.variant.name}
    try:
        cfg = benchmark_config(row.model, [*row.variant.overrides, *overrides], size)
    except ConfigError as e:  # the variant's own settings: the table's mistake, not this machine's
        return {**result, "status": "failed", "error": f"ConfigError: {e}"}
    data = data_shapes(row.model, size, resolution)
    (h, w), patch = data.latent_sizes[-1], cfg.model.patch_size
    tokens = (h // patch) * (w // patch) + data.text_tokens
    batch_size = cfg.training.train_batch_size
    result.update(settings=settings(cfg), micro_batch=batch_size, tokens_per_sample=tokens, dtype=cfg.training.dtype,
                  compile=cfg.compile.enabled, activation_checkpointing=cfg.training.activation_checkpointing,
                  attention=cfg.training.attention_backend)
    if row.variant.anchor and importlib.util.find_spec("diffusers") is None:
        return {**result, "status": "not runnable", "reason": "diffusers is not installed (pip install -e '.[bench]')"}
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    if device.type == "cuda":  # what an earlier row's error kept alive is gone by now
        gc.collect()
        torch.cuda.empty_cache()
    model = step = batch = None
    started = time.perf_counter()
    try:
        if row.variant.anchor:
            model, step, facts = diffusers_anchor(cfg, data, device, MODELS[row.model].anchor)
        else:
            model, step, facts = ours(cfg, data, device)
        batch = device_batch(cfg, data, device)
        flops = flops_per_sample(cfg, data) * batch_size
        counter = counted(model, batch, device)
        built = time.perf_counter()
        with counter.counting() if counter else nullcontext():
            timed(step, batch, device, 0, warmup)
            warm = time.perf_counter()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            seconds = timed(step, batch, device, warmup, steps)
            peak_gib = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
            syncs = host_syncs(step, batch, device, counter, warmup + steps)
        graph_breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    except ConfigError as e:  # a backend or setting this machine cannot run
        return {**result, "status": "not runnable", "reason": str(e).split("; use auto")[0]}
    except torch.OutOfMemoryError as e:
        return {**result, "status": "failed", "error": f"out of memory: {str(e).splitlines()[0][:200]}"}
    except Exception as e:  # the row's failure, whatever it is: the table goes on (the traceback to stderr)
        traceback.print_exc()
        return {**result, "status": "failed", "error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"}
    finally:
        del model, step, batch
        torch._dynamo.reset()  # compiled code holds the row's modules
        gc.collect()
        if device.type == "cuda" and not cuda_broken(device):
            torch.cuda.empty_cache()
    median = statistics.median(seconds)
    peak = peak_flops(device, "bf16" if cfg.training.dtype != "fp32" else "fp32", cfg.training.allow_tf32, 0)
    compiler = facts["compiler"]
    predicted = predicted_step(row, size, overrides, resolution)
    return {**result, "status": "passed", "attention": facts["attention"], "notes": facts["notes"],
            "predicted_step_s": predicted.get("step_s"), "predicted_mfu": predicted.get("mfu"),
            "step_s": median, "step_s_all": seconds, "images_per_s": batch_size / median,
            "tokens_per_s": batch_size * tokens / median, "model_tflop_per_step": flops / 1e12,
            "tflops": flops / median / 1e12, "mfu": flops / median / peak if peak else None,
            "peak_memory_gib": peak_gib, "host_syncs_per_step": syncs,
            "graph_breaks": graph_breaks,
            "eager_fallbacks": len(compiler.fallbacks) if compiler else None,
            "fallback_errors": compiler.fallbacks[:3] if compiler else [],
            "build_s": round(built - started, 1), "warmup_s": round(warm - built, 1)}


def predicted_step(row: Row, size: str, overrides, resolution: int) -> dict:
    """The row's step as `--predict` wrote it ({} where it predicted none): for the rows as listed alone."""
    if size != "real" or overrides or resolution != RESOLUTION or not PREDICTED.is_file():
        return {}
    return json.loads(PREDICTED.read_text()).get(row.name, {})


def cuda_broken(device: torch.device) -> str | None:
    """Why the CUDA context can no longer run anything (a sticky error such as an illegal address), or None."""
    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize(device)
        return None
    except Exception as e:  # the error is sticky: every later call raises it
        return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


# ----------------------------------------------------------------------------------------------- the time budget


@dataclass(frozen=True)
class Costs:
    """Seconds a row's parts take before the table has measured any row (benchmarks/RESULTS.md: the GPU recipe)."""
    build: float  # the model on the device, random weights, the optimizer, the FLOP count on the meta device
    compile: float  # one block kind's cold inductor compile, forward and backward
    step: float  # one step of a row that --predict did not predict (the anchors, float8, FLUX.1's nf4 base)


# one H100, pessimistic (the central guess compiles a block kind in 20 s); this CPU at --size tiny (aot_eager)
COSTS = {"real": Costs(build=25, compile=45, step=1.5), "tiny": Costs(build=2, compile=5, step=0.2)}


def estimated_seconds(row: Row, args) -> float:
    """The row's build, cold compiles and steps (warm-up, timed and the host-sync count's) at COSTS."""
    costs = COSTS[args.size]
    try:
        cfg = benchmark_config(row.model, [*row.variant.overrides, *args.overrides], args.size)
    except ConfigError:  # the row fails at once
        return 0.0
    step = predicted_step(row, args.size, args.overrides, args.resolution).get("step_s") or costs.step
    return costs.build + compiled_kinds(row, cfg) * costs.compile + (args.warmup + args.steps + 1) * step


def compiled_kinds(row: Row, cfg) -> int:
    """The block graphs the row compiles: none eager; each kind twice where only every k-th block is checkpointed.
    A cache hit (an earlier row's graph) is not foreseen: the estimate errs long."""
    if not cfg.compile.enabled:
        return 0
    t = cfg.training
    mixed = t.activation_checkpointing != "none" and t.activation_checkpointing_every > 1
    return MODELS[row.model].block_kinds * (2 if mixed else 1)


def calibration(done: dict[str, dict]) -> float:
    """The largest ratio of measured to estimated seconds among the table's passed rows (1 before any): later rows'
    estimates are scaled by it, so that they learn this machine's compile and build times, erring long."""
    return max((r["seconds"] / r["estimated_s"] for r in done.values()
                if r["status"] == "passed" and r.get("estimated_s")), default=1.0)


def seconds_left(started: float, stop_after: float | None) -> float:
    return math.inf if stop_after is None else stop_after - (time.monotonic() - started)


# ----------------------------------------------------------------------------------------------- the table


def table(rows: list[dict]) -> str:
    def number(value, spec: str) -> str:
        return format(value, spec) if isinstance(value, (int, float)) and not math.isnan(value) else "-"

    lines = ["| model | variant | settings | attention | result | step (s) | predicted (s) | images/s | tokens/s | "
             "TFLOP/s | MFU | predicted MFU | peak GiB | syncs/step | graph breaks | eager fallbacks |",
             "|" + "---|" * 16]
    for r in rows:
        outcome = {"passed": "passed", "failed": f"FAILED: {r.get('error')}", "running": "did not finish",
                   "not runnable": f"not runnable here: {r.get('reason')}"}[r["status"]]
        lines.append(f"| {r['model']} | {r['variant']} | {r.get('settings', '-')} | {r.get('attention', '-')} | "
                     f"{outcome} | {number(r.get('step_s'), '.4f')} | {number(r.get('predicted_step_s'), '.4f')} | "
                     f"{number(r.get('images_per_s'), '.2f')} | {number(r.get('tokens_per_s'), '.0f')} | "
                     f"{number(r.get('tflops'), '.2f')} | {number(r.get('mfu'), '.1%')} | "
                     f"{number(r.get('predicted_mfu'), '.1%')} | {number(r.get('peak_memory_gib'), '.1f')} | "
                     f"{number(r.get('host_syncs_per_step'), 'd')} | {number(r.get('graph_breaks'), 'd')} | "
                     f"{number(r.get('eager_fallbacks'), 'd')} |")
    notes = [f"- {r['model']}, {r['variant']}: {note}" for r in rows for note in r.get("notes", [])]
    return "\n".join(lines + (["", "Notes:", *notes] if notes else []))


def machine() -> dict:
    info = {"torch": torch.__version__, "python": sys.version.split()[0], "cpus": os.cpu_count(), "device": "cpu"}
    if torch.cuda.is_available():
        info.update(device=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                    capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                    cudnn=torch.backends.cudnn.version())
    for package in ("triton", "diffusers", "torchao", "flash-attn", "flash-attn-4"):
        try:
            info[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return info


def device_slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower().removeprefix("nvidia ")).strip("_")


def write(path: Path, table_json: dict) -> None:
    """Atomically: a command stopped mid-write leaves the previous table."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(table_json, indent=1))
    tmp.replace(path)


def finished(row: dict | None, redo_failed: bool) -> bool:
    return row is not None and (row["status"] in ("passed", "not runnable") or
                                (row["status"] == "failed" and not redo_failed))


def resumed_rows(previous: dict, expected: dict) -> tuple[dict[str, dict], list[str]]:
    """A table's rows by name, and what it was measured with that differs from `expected` (header and machine)."""
    measured = {**previous["machine"], **{k: v for k, v in previous.items() if k not in ("machine", "rows")}}
    differs = [f"{key} {measured.get(key)!r} (this run: {value!r})" for key, value in expected.items()
               if measured.get(key) != value]
    return {f"{r['model']}: {r['variant']}": r for r in previous["rows"]}, differs


def main(argv: list[str] | None = None, started: float | None = None) -> int:
    """`started`: when --stop-after's clock started (the script's start, before torch's import; default: now)."""
    started = time.monotonic() if started is None else started
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("real", "tiny"), default="real", help="released sizes, or tiny (CPU check)")
    parser.add_argument("--models", nargs="*", choices=list(MODELS), help="default: all")
    parser.add_argument("--variants", nargs="*", help="variant names to run (default: all of each model; --list)")
    parser.add_argument("--list", action="store_true", help="print the rows in the order they run, and exit")
    parser.add_argument("--resolution", type=int, default=RESOLUTION, help="image side in pixels (latents: /8)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row (the median is reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, allocator)")
    parser.add_argument("--overrides", nargs="*", default=[], help="key=value for every row after its variant's, "
                        "e.g. training.train_batch_size=8")
    parser.add_argument("--out", type=Path, help="JSON file (default: benchmarks/train_step_<device>.json)")
    parser.add_argument("--resume", type=Path, help="continue this JSON's table (and write it): rows it holds are "
                        "not measured again (a file that does not exist yet starts the table)")
    parser.add_argument("--redo-failed", action="store_true", help="with --resume: measure its failed rows again")
    parser.add_argument("--stop-after", type=float, help="end within this many seconds of the start (imports "
                        "included): a row starts only if its estimated time fits in what is left (then --resume)")
    parser.add_argument("--predict", action="store_true", help=f"predict each row's step on one H100 with "
                        f"benchmarks/roofline.py instead (no GPU needed) and write {PREDICTED.name}, which a GPU run's "
                        f"table then shows beside what it measures")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.variants or []) - {row.variant.name for row in all_rows()})
    if unknown:
        parser.error(f"unknown variants {unknown}; --list shows the rows")
    rows = [row for row in all_rows() if (not args.models or row.model in args.models)
            and (not args.variants or row.variant.name in args.variants)]
    if not rows:
        parser.error("no row is of these --models and --variants; --list shows the rows")
    if args.list:
        return list_rows(rows, args)
    if args.out and args.resume:
        parser.error("--resume FILE writes FILE: give --out or --resume, not both")
    if args.predict:
        return predict_rows(rows, args.out or PREDICTED)
    try:
        benchmark_config(rows[0].model, args.overrides, args.size)
    except ConfigError as e:
        parser.error(f"--overrides: {e}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    info = machine()
    slug = device_slug(info["device"])
    out = args.out or args.resume or (ROOT / "benchmarks" / f"train_step_{slug}.json" if args.size == "real" else
                                      ROOT / "runs" / "bench" / f"train_step_{slug}_tiny.json")
    if not args.resume and args.size == "real" and out.exists():
        parser.error(f"{out} exists: continue its table with --resume {out}, or write another with --out")
    if device.type == "cpu" and args.size == "real":
        parser.error("the released sizes need a CUDA GPU (SD3.5-large is 8B parameters); --size tiny checks the "
                     "benchmark on a CPU")
    header = {"size": args.size, "resolution": args.resolution if args.size == "real" else TINY["resolution"],
              "warmup": args.warmup, "steps": args.steps, "overrides": args.overrides}
    done = {}
    if args.resume and not args.resume.is_file():
        print(f"{args.resume} does not exist yet: a new table")
    elif args.resume:
        done, differs = resumed_rows(json.loads(args.resume.read_text()),
                                     {**header, "device": info["device"], "torch": info["torch"]})
        if differs:
            parser.error(f"--resume {args.resume} was measured with {'; '.join(differs)}: its rows would not "
                         f"compare with this run's; run with its settings, or start another table with --out")
    print(f"training step on {info['device']} (torch {info['torch']}), size {args.size}, {args.warmup} warm-up + "
          f"{args.steps} timed steps per row, {len(rows)} rows" + (f", resuming {args.resume}" if args.resume else ""),
          flush=True)
    left, broken = run_rows(rows, done, args, device, lambda: write(out, {"machine": info, **header,
                                                                            "rows": in_order(done)}), started)
    print(table(in_order(done)))
    print(f"wrote {out}" + (f"; {len(left)} rows left: continue with --resume {out}" if left else ""))
    return 1 if broken or any(r["status"] == "failed" for r in done.values()) else 0


def list_rows(rows: list[Row], args) -> int:
    """The rows in the order they run, with each one's estimated seconds (COSTS, before calibration)."""
    total = 0.0
    for row in rows:
        estimate = estimated_seconds(row, args)
        total += estimate
        print(f"{row.name} (tier {row.variant.tier}, ~{estimate:.0f} s, ~{total:.0f} s in all)")
    return 0


def predict_rows(rows: list[Row], out: Path) -> int:
    """Each row's step at its released size as benchmarks/roofline.py predicts it on one H100 (one micro-step, as
    measured here); rows it does not model (float8, some attention backends, the diffusers anchors) say why. Rows
    `out` holds that are not among `rows` are kept."""
    from benchmarks.roofline import predict_step
    predicted = {}
    for row in rows:
        cfg = benchmark_config(row.model, list(row.variant.overrides), "real")
        try:
            if row.variant.anchor:
                raise ConfigError("diffusers' model: the roofline counts this project's")
            p = predict_step(cfg, data_shapes(row.model, "real"), micro_steps=1)
            predicted[row.name] = {"step_s": p.seconds, "mfu": p.mfu}
        except ConfigError as e:
            predicted[row.name] = {"reason": str(e)}
        print(f"  {row.name}: " + (f"{p.seconds:.4f} s, MFU {p.mfu:.1%}" if "step_s" in predicted[row.name] else
                                   f"not predicted ({predicted[row.name]['reason']})"), flush=True)
    previous = json.loads(out.read_text()) if out.is_file() else {}
    write(out, {**previous, **predicted})  # the other rows' predictions stay
    print(f"wrote {out}")
    return 0


def in_order(done: dict[str, dict]) -> list[dict]:
    """A table's rows in the order they run (rows of an older table's variants last)."""
    order = {row.name: i for i, row in enumerate(all_rows())}
    return sorted(done.values(), key=lambda r: order.get(f"{r['model']}: {r['variant']}", len(order)))


def run_rows(rows: list[Row], done: dict[str, dict], args, device: torch.device, save,
             started: float) -> tuple[list[str], str | None]:
    """Measure the rows `done` does not hold as finished, saving the table before and after each; a row starts only
    if its calibrated estimate ends before --stop-after (counted from `started`). Returns the rows left (by
    --stop-after, or a broken CUDA context) and why the CUDA context broke."""
    left, broken = [], None
    for row in rows:
        prior = done.get(row.name)
        if finished(prior, args.redo_failed):
            continue
        attempts = (prior or {}).get("attempts", 0) + 1
        if prior and prior["status"] == "running" and attempts > 2:
            done[row.name] = {**prior, "status": "failed", "error": "the process was stopped twice during this row "
                              "(a command's time limit, or a crash); --redo-failed tries it again"}
            save()
            continue
        estimate = estimated_seconds(row, args)
        needed, available = estimate * calibration(done), seconds_left(started, args.stop_after)
        if broken or needed > available:
            left.append(row.name)
            if not broken:
                print(f"  {row.name}: not started (~{needed:.0f} s, {max(available, 0):.0f} s left)", flush=True)
            continue
        done[row.name] = {"model": row.model, "variant": row.variant.name, "status": "running", "attempts": attempts}
        save()  # a process killed during the row leaves this mark
        row_started = time.perf_counter()
        result = measure(row, args.size, args.steps, args.warmup, device, args.resolution, tuple(args.overrides))
        done[row.name] = {**result, "attempts": attempts, "estimated_s": round(estimate, 1),
                          "seconds": round(time.perf_counter() - row_started, 1)}
        save()
        print(f"  {row.name}: {result['status']}" + (f", {result['step_s']:.4f} s/step" if result["status"] ==
              "passed" else f": {result.get('reason') or result.get('error')}") +
              f" ({done[row.name]['seconds']:.0f} s, ~{needed:.0f} s estimated)", flush=True)
        broken = cuda_broken(device)
        if broken:
            print(f"the CUDA context is broken ({broken}): no more rows in this process", flush=True)
    save()
    return left, broken


if __name__ == "__main__":
    sys.exit(main(started=STARTED))
