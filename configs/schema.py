"""The typed config schema. YAML files and `key=value` overrides are merged over these dataclasses, so an
unknown key or a value of the wrong type fails with the key's name before any compute; each section then
checks its own values (`__post_init__`, next to the fields), and `check_combinations` the few rules that
span sections.

Paths in a config mean what they mean in the directory the command runs in; `load_config` makes them
absolute, so the run directory's saved config works from anywhere. With `model.init_from`, the MMDiT's
architecture comes from that folder's config.json."""

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Literal, Optional

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from errors import ConfigError, FieldError
from models.diffusers_io import CheckpointFormatError
from models.families import FAMILIES, is_single_file, read_config
from models.lora import TEXT_ENCODER_PARTS
from optim.optimizers import check_optimizer

DEFAULT_CONFIG = Path(__file__).parent / "shapes.yaml"


def positive(section, *names: str) -> None:  # None: a family default, set by `load_config`
    for name in names:
        if getattr(section, name) is not None and not getattr(section, name) > 0:
            raise FieldError(name, getattr(section, name), "> 0")


def non_negative(section, *names: str) -> None:
    for name in names:
        if getattr(section, name) is not None and getattr(section, name) < 0:
            raise FieldError(name, getattr(section, name), ">= 0")


def fraction(section, *names: str) -> None:
    for name in names:
        if not 0 <= getattr(section, name) < 1:
            raise FieldError(name, getattr(section, name), "in [0, 1)")


@dataclass
class ModelConfig:
    # sd3: SD3 / SD3.5's joint blocks over [image, text]; flux: FLUX.1's double-stream blocks (SD3's with rotary
    # positions) then single-stream blocks (attention and MLP in parallel, cheaper per token); qwen_image:
    # Qwen-Image's dual-stream blocks (SD3's, with rotary positions and masked text padding); flux2: FLUX.2's double-
    # and single-stream blocks (no biases, SwiGLU, one modulation shared by all blocks of a kind). With init_from the
    # folder's class decides, and a family set here must agree with it
    family: Literal[tuple(FAMILIES)] = "sd3"
    # latent pixels per token side: sd3 patchifies with a conv, flux, qwen_image and flux2 pack p x p latents (their
    # pipelines: 2; flux2's: 1, its VAE step patchifies); a smaller value sees finer detail but costs ~4x tokens per
    # halving
    patch_size: int = 4
    # sd3, qwen_image: joint blocks; flux, flux2: double-stream blocks. None: the family's demo size (sd3 and
    # qwen_image 6; flux and flux2 3, with 4 single)
    num_layers: Optional[int] = None
    # flux, flux2: single-stream blocks after the double ones; None: 2 x num_layers (FLUX.1's ratio; flux2: 4 x,
    # klein-4B's), or 4 in the demo
    num_single_layers: Optional[int] = None
    num_attention_heads: int = 4  # hidden size = heads * head_dim
    attention_head_dim: int = 32  # wider heads: more capacity, more FLOPs per token
    sample_size: int = 32  # sd3: nominal input size; sets the scale of the sin-cos position table
    pos_embed_max_size: int = 16  # sd3: largest patch grid side the position table covers
    # per-head q,k RMSNorm (SD3.5, and always in FLUX.1, Qwen-Image and FLUX.2): stabler at high lr
    qk_norm: Optional[Literal["rms_norm"]] = "rms_norm"
    dual_attention_layers: List[int] = field(default_factory=list)  # sd3 (SD3.5): image-only attn2 in these blocks
    # flux, qwen_image, flux2: rotary channels per position axis (FLUX.1: unused, row, column; Qwen-Image: frame, row,
    # column; FLUX.2: four, time, row, column, text position), summing to attention_head_dim; None: their split
    # (16/56/56 of 128; FLUX.2 32/32/32/32), scaled to the head dim
    axes_dims_rope: Optional[List[int]] = None
    # flux, flux2: a guidance embedding, as FLUX.1-dev and FLUX.2-dev (guidance-distilled) have; FLUX.1-schnell,
    # FLUX.2-klein and models trained from scratch without distillation have none
    guidance_embeds: bool = False
    # qwen_image: reference images' tokens modulated at timestep 0, as Qwen-Image-Edit-2511 has them (its
    # config.json's zero_cond_t; model.init_from sets it)
    zero_cond_t: bool = False
    # a diffusers transformer directory (SD3Transformer2DModel, FluxTransformer2DModel, QwenImageTransformer2DModel,
    # Flux2Transformer2DModel) or a family's original single file to start from; sets the family and the sizes above
    init_from: Optional[str] = None

    def __post_init__(self):
        positive(self, "patch_size", "num_layers", "num_attention_heads", "attention_head_dim", "sample_size",
                 "pos_embed_max_size")
        non_negative(self, "num_single_layers")
        family = FAMILIES[self.family]
        for name in FAMILY_OPTIONS.keys() - set(family.options):
            value = getattr(self, name)
            if value not in UNSET.get(name, ()) and value != FAMILY_OPTIONS[name]:
                users = [f.name for f in FAMILIES.values() if name in f.options]
                raise FieldError(name, value, f"unset with family={self.family} (a setting of "
                                 f"{' and '.join(f'family={u}' for u in users)})")
        family.check(self)


# the model.* keys some family uses (Family.options), with their defaults: another family leaves them so
FAMILY_OPTIONS = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                  for f in dataclasses.fields(ModelConfig) if any(f.name in fam.options for fam in FAMILIES.values())}
UNSET = {"num_single_layers": (0,)}  # what a family without such blocks may also say


@dataclass
class TextEncoderConfig:
    dim: int = 128  # width of the jointly trained text encoder (joint and pooled dims of the MMDiT)
    num_layers: int = 1  # transformer layers over the caption; 0 is a bag of embeddings
    num_heads: int = 4  # attention heads of the text encoder; must divide its dim

    def __post_init__(self):
        positive(self, "dim", "num_heads")
        non_negative(self, "num_layers")
        if self.dim % self.num_heads:
            raise FieldError("dim", self.dim, f"divisible by num_heads ({self.num_heads})")


@dataclass
class DatasetEntry:  # one dataset of data.datasets
    path: Optional[str] = None  # a directory precompute_latents.py wrote
    weight: float = 1.0  # its share of the samples drawn (weights are normalised over the entries)
    caption_dropout: Optional[float] = None  # its own caption dropout; None: data.caption_dropout
    loss_weight: float = 1.0  # multiplies its samples' losses (prior preservation's lambda): pull against fit
    # kohya's num_repeats, instead of weight: every dataset's share is its items x repeats (1 where unset)
    repeats: Optional[int] = None


@dataclass
class DataConfig:
    # built-in captioned shapes, their edits (a reference shape, "make it {color}" or "move it to the {position}", the
    # changed shape: model.family flux, qwen_image or flux2), or precomputed latent shards (an edit dataset too)
    name: Literal["shapes", "shapes_edit", "latents"] = "shapes"
    path: Optional[str] = None  # latents: the directory precompute_latents.py wrote
    aspect_buckets: bool = False  # latents: train on several latent sizes, each global batch from one size
    # latents: precomputed embeddings cost ~2.7 MB per SD3 sample on disk; on_the_fly stores captions only and
    # runs the frozen CLIP-L, CLIP-G and T5 in the training process (memory and compute per step)
    text_encoding: Literal["precomputed", "on_the_fly"] = "precomputed"
    text_encoders_from: Optional[str] = None  # on_the_fly: the SD3 pipeline folder; None: the one precompute recorded
    num_items: int = 100_000  # shapes: distinct procedural items before the order repeats
    holdout: int = 0  # items kept out of training for the held-out loss (validation.every); fewer to learn from
    caption_dropout: float = 0.1  # share of samples trained unconditionally: enables CFG, costs conditional fit
    # latents: put before every caption (a trigger word, e.g. "sks person,"); a dropped caption stays empty. With
    # precomputed text the dataset must have been encoded with the same (precompute's --caption-prefix)
    caption_prefix: str = ""
    # latents: shuffle each caption's comma-separated tags per sample and step (less reliance on tag order). Needs the
    # text encoded in the step (text_encoding=on_the_fly: the encoders' compute every step) or precomputed variants
    # (precompute --caption-variants K --shuffle-caption-tags: K encodings per caption on disk, one drawn per step)
    shuffle_caption_tags: bool = False
    keep_tags: int = 0  # latents: the first k tags stay in place and are never dropped (a trigger word, a subject)
    # latents: each other tag left out with this probability; like shuffling, needs precomputed variants or the text
    # encoded in the step
    tag_dropout: float = 0.0
    num_workers: int = -1  # loader processes; -1: 0 on CPU (both cores compute), 4 on CUDA (hide loading)
    pin_memory: bool = True  # CUDA only: page-locked batches so host-to-device copies overlap compute
    prefetch_factor: int = 2  # batches each worker prepares ahead (workers > 0): memory against stalls
    # latents: several datasets mixed by weight (instead of data.path), e.g. a subject and its class images;
    # each step's batch still depends on (seed, step, global batch) only
    datasets: List[DatasetEntry] = field(default_factory=list)
    # latents: weigh the loss by the images' masks (alpha or NAME.mask.png; white = train); auto: where the
    # dataset has masks. A masked item costs its [1, h, w] weights on disk and in the batch
    use_masks: str = "auto"
    # latents: edit pairs' reference images per pair the config is made for (its dataset must have that many;
    # plan_memory.py counts their tokens, each of the result's size); None: as the dataset has (0: text to image)
    references: Optional[int] = None

    def __post_init__(self):
        positive(self, "num_items", "prefetch_factor")
        non_negative(self, "holdout", "references", "keep_tags")
        fraction(self, "caption_dropout", "tag_dropout")
        if self.use_masks not in ("auto", "true", "false"):
            raise FieldError("use_masks", self.use_masks, "auto, true or false")
        for i, entry in enumerate(self.datasets):
            if not entry.path:
                raise FieldError(f"datasets[{i}].path", entry.path, "a directory written by precompute_latents.py")
            if not entry.weight > 0 or not entry.loss_weight >= 0:
                raise FieldError(f"datasets[{i}].weight and loss_weight", (entry.weight, entry.loss_weight),
                                 "> 0 and >= 0")
            if entry.caption_dropout is not None and not 0 <= entry.caption_dropout < 1:
                raise FieldError(f"datasets[{i}].caption_dropout", entry.caption_dropout, "in [0, 1), or null")
            if entry.repeats is not None and (entry.repeats < 1 or entry.weight != 1.0):
                raise FieldError(f"datasets[{i}].repeats", entry.repeats, f">= 1, with weight left at 1 (repeats "
                                 f"set the share instead of weight; got weight {entry.weight})")
        if self.num_workers < -1:
            raise FieldError("num_workers", self.num_workers, ">= 0, or -1 for the device default")


@dataclass
class LoraConfig:
    enabled: bool = False  # train low-rank adapters on a frozen model: far less optimizer memory, tiny files
    # lora: W + B A of rank `rank`; lokr: a Kronecker product of two small factors (a full-rank update from few
    # parameters); loha: the elementwise product of two rank-`rank` products (rank up to rank^2 for twice LoRA's
    # parameters). LoKr and LoHa form each layer's dense update in every forward and keep it for the backward (more
    # memory and time than LoRA); they take none of dropout, use_dora, use_rslora, text_encoders (peft's LoKr / LoHa)
    type: Literal["lora", "lokr", "loha"] = "lora"
    rank: int = 16  # adapter rank: capacity against parameters and memory
    alpha: float = 16.0  # adapter output is scaled by alpha / rank; higher moves further from the base per step
    dropout: float = 0.0  # dropout on the adapter input: regularises small datasets, adds noise to the step
    # module names in the blocks to adapt (or full names, e.g. double_stream_modulation_img.linear); None: those of
    # diffusers' LoRA training script for the family. flux2's defaults leave its shared modulations
    # (double_stream_modulation_img/_txt, single_stream_modulation): one matrix sets the shift, scale and gate of
    # every block of a kind, outside the blocks; diffusers' scripts and musubi-tuner leave them (models/flux2/family.py)
    target_modules: Optional[List[str]] = None
    # frozen base weights stored in 4-bit NormalFloat or 8-bit integers, per row (models/quantized.py): ~1/8 or
    # ~1/4 of their fp32 memory, at a small output error (benchmarks/RESULTS.md); adapters train in full precision
    base_quantization: Literal["none", "nf4", "int8"] = "none"
    # DoRA (peft's use_dora): each adapted weight also learns a per-row magnitude; closer to a full fine-tune at the
    # same rank, for a weight norm in each forward and two more layer outputs kept for the backward (docs/fine-tuning.md: cost)
    use_dora: bool = False
    # rsLoRA (peft's use_rslora): scale the adapter by alpha / sqrt(rank) instead of alpha / rank, so higher ranks
    # keep learning instead of being damped; same cost
    use_rslora: bool = False
    # also train LoRA on SD3's CLIP text encoders (their attention projections; T5 stays frozen); needs
    # data.text_encoding=on_the_fly. Fits prompts to the data better, costs their activations and backward per step
    text_encoders: List[str] = field(default_factory=list)
    text_encoder_lr: Optional[float] = None  # peak lr of the text encoders' adapters; None: optimizer.lr

    def __post_init__(self):
        positive(self, "rank", "alpha")
        fraction(self, "dropout")
        if self.enabled and self.target_modules is not None and not self.target_modules:
            raise FieldError("target_modules", [], "the modules to adapt, e.g. attn.to_q")
        unknown = [t for t in self.text_encoders if t not in TEXT_ENCODER_PARTS]
        if unknown or len(set(self.text_encoders)) < len(self.text_encoders):
            raise FieldError("text_encoders", list(self.text_encoders), f"distinct names of {list(TEXT_ENCODER_PARTS)}")
        if self.text_encoder_lr is not None:
            positive(self, "text_encoder_lr")
        if self.type != "lora":  # what only peft's LoRA has
            for name, off, shown in (("use_dora", False, "false"), ("use_rslora", False, "false"),
                                     ("dropout", 0.0, "0"), ("text_encoders", [], "[]")):
                if getattr(self, name) != off:
                    raise FieldError(name, getattr(self, name), f"{shown} with type={self.type} (a setting of peft's "
                                     f"LoRA, which its {self.type.replace('loha', 'LoHa').replace('lokr', 'LoKr')} "
                                     f"does not have)")


@dataclass
class FlowConfig:
    # where training spends its noise levels (SD3 paper, sec. 3.1): logit-normal and mode focus on mid noise,
    # cosmap is a heavier-tailed middle, uniform spreads evenly
    sigma_sampling: Literal["logit_normal", "uniform", "mode", "cosmap"] = "logit_normal"
    logit_mean: float = 0.0  # centre of the logit-normal; > 0 trains more at high noise
    logit_std: float = 1.0  # spread of the logit-normal; larger covers the ends better
    mode_scale: float = 1.29  # mode sampling's s: > 0 favours mid noise, < 0 the ends (SD3: 1.29)
    shift: float = 3.0  # SD3 timestep shift of training sigmas; > 1 trains more at high noise, where shapes form
    # the family pipeline's shift by resolution instead of `shift`: e^mu, mu linear in the image tokens (FLUX.1: 0.5
    # at 256, 1.15 at 4096; Qwen-Image: 0.5 at 256, 0.9 at 8192; FLUX.2: FLUX.1's over its tokens, musubi-tuner's
    # flux2_shift), so larger images, whose noise hides less per token, train at higher noise
    resolution_shift: bool = False

    def __post_init__(self):
        positive(self, "shift")
        if not -1 <= self.mode_scale <= 1 / (math.pi / 2 - 1):
            raise FieldError("mode_scale", self.mode_scale, "in [-1, 1.75] (beyond, mode sampling is not monotone)")


@dataclass
class SamplingConfig:
    steps: int = 30  # Euler steps: quality against sampling time
    cfg_scale: float = 5.0  # classifier-free guidance weight; 1 disables guidance (half the cost)
    shift: float = 3.0  # timestep shift of the sampling schedule; > 1 spends more steps at high noise
    # the family pipeline's schedule: shift e^mu by the image's token count (flow.resolution_shift; FLUX.2: its
    # pipelines' mu of the token count and the step count), and its end as its scheduler stretches it (Qwen-Image:
    # the last sigma before 0 is 0.02)
    resolution_shift: bool = False
    # sigma range [low, high] where guidance applies: layout and identity form at high noise, while guidance at
    # low noise over-sharpens; outside it only the conditional branch runs (cheaper)
    guidance_interval: List[float] = field(default_factory=lambda: [0.0, 1.0])
    grid_size: int = 16  # shapes: images shown in the sample grid (all 90 prompts are scored)

    def __post_init__(self):
        positive(self, "steps", "shift", "grid_size")
        interval = list(self.guidance_interval)
        if len(interval) != 2 or not 0 <= interval[0] <= interval[1] <= 1:
            raise FieldError("guidance_interval", interval, "[low, high] with 0 <= low <= high <= 1")


@dataclass
class FluxGuidanceConfig:  # what only a guidance embedding needs (model.guidance_embeds: FLUX.1-dev, FLUX.2-dev)
    # the guidance value the embedding sees in training. dev was distilled to predict the guided velocity for the
    # scale it is given; the flow-matching target of real data is the unguided one, which dev produces at 1.0, so
    # 1.0 fine-tunes without teaching the embedding a new meaning (ai-toolkit, kohya's sd-scripts and SimpleTuner
    # feed 1.0; diffusers' script defaults to 3.5 but its documented commands pass 1; musubi-tuner's FLUX.2 trainer
    # feeds 1.0 too)
    train_guidance: float = 1.0
    # the embedded guidance of validation images (FluxPipeline's default; Flux2Pipeline's is 4.0)
    sample_guidance: float = 3.5

    def __post_init__(self):
        non_negative(self, "train_guidance", "sample_guidance")


@dataclass
class ValidationConfig:
    every: int = 0  # images and held-out loss every N steps: how training goes, against their time; 0: only at_end
    # validate after the last step too (with every=0 as well): the run's final samples and scores, against its time
    at_end: bool = True
    vae_from: Optional[str] = None  # latents: pipeline (or vae/) folder that decodes images; None: the precompute's
    loss_sigmas: int = 8  # held-out loss at this many fixed noise levels: a finer curve against more compute

    def __post_init__(self):
        non_negative(self, "every")
        positive(self, "loss_sigmas")


@dataclass
class TrainingConfig:
    # micro-batch per device per micro-step; memory against throughput. None: 16, or 8 with data.name=shapes_edit
    # (the edit demo's pairs: DEMO_BATCH)
    train_batch_size: Optional[int] = None
    gradient_accumulation_steps: int = 1  # micro-steps per optimizer step; global batch = batch * accum * world
    max_steps: int = 3200  # optimizer steps in the run
    seed: int = 0  # data order, noise, sigmas and init all derive from it
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"  # autocast precision: speed and memory against accuracy
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when available
    allow_tf32: bool = True  # CUDA only: fp32 matmuls on tensor cores, much faster, 10-bit mantissa
    deterministic: bool = False  # CUDA: kernels that repeat bit for bit (runs and resumes), at some speed
    # the attention kernel (perf/attention.py): auto takes the fastest that runs on this GPU generation and logs
    # why; sdpa lets PyTorch pick; the others force one kernel (an error where it cannot run); math is the slow
    # fp32 reference
    attention_backend: Literal["auto", "sdpa", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flash_attn_2",
                               "flash_attn_3", "flash_attn_4", "math"] = "auto"
    # activations the backward recomputes instead of keeping (plan_memory.py picks the cheapest setting that fits):
    #   none: keep all; selective: keep the matmuls' and attention's outputs, recompute the norms, modulation and
    #   activation functions between them (no matmul redone); full: blocks keep only their inputs (a third more
    #   compute, the least memory)
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    activation_checkpointing_every: int = 1  # selective/full in blocks 0, k, 2k, ... only: memory between it and none
    # non-finite steps in a row before stopping a diverged run; 0: no guard. The guard skips a step on the device
    # and reads its count on log steps only, so it costs no host synchronisation per step
    max_nonfinite_steps: int = 20

    def __post_init__(self):
        positive(self, "train_batch_size", "gradient_accumulation_steps", "max_steps",
                 "activation_checkpointing_every")
        non_negative(self, "seed", "max_nonfinite_steps")


@dataclass
class CompileConfig:
    enabled: bool = False  # torch.compile: ~10% faster steps on CPU after a ~45 s compile
    mode: Literal["default", "reduce-overhead", "max-autotune"] = "default"  # longer compile, faster steps
    scope: Literal["blocks", "model"] = "blocks"  # whole model fuses more but compiles longer
    # inductor generates fused kernels; aot_eager traces the same graphs without code generation (fast to
    # compile, no speed-up): for checking that a model compiles, and for tests; eager stops after dynamo's capture
    # (no backward trace): the quickest check that every block is one graph
    backend: Literal["inductor", "aot_eager", "eager"] = "inductor"


@dataclass
class Float8Config:
    # the transformer blocks' image-stream attention and MLP matmuls in float8 with dynamic per-tensor scales
    # (torchao): on GPUs with fp8 tensor cores (compute capability >= 8.9) 1.15-1.7x faster linears in full
    # fine-tunes at 1024 px (estimated, perf/float8.py) and half the bytes of an FSDP all-gather, at e4m3/e5m2
    # rounding of their inputs. Not for LoRA: on a frozen base it is no faster than bf16 (0.9-1.4x its time)
    enabled: bool = False
    emulate: bool = False  # float8 rounding, high-precision matmuls: runs on any device, no speed-up; for tests

    def __post_init__(self):
        if self.emulate and not self.enabled:
            raise FieldError("emulate", True, "false unless float8.enabled=true (it changes how float8 runs)")


@dataclass
class OptimizerConfig:
    # adamw: torch's fused AdamW, 8 bytes of state per trained parameter; adamw8bit: torchao's, its moments in 8 bits
    # (about 2 bytes), at a small rounding of the update; prodigy: prodigyopt's, which estimates its own step size
    # (optimizer.lr=1.0 scales the estimate), 16 bytes; adafactor: torch's, factored second moment and no momentum
    # (bytes per row and column, not per value), steps relative to each weight's size. Under FSDP only adamw
    # (optim/optimizers.py says why)
    name: Literal["adamw", "adamw8bit", "prodigy", "adafactor"] = "adamw"
    # cosine: warmup, then down to lr * min_lr_ratio along a cosine; linear: warmup, then a straight line to it;
    # constant_with_warmup: warmup, then the peak; constant: the peak from the first step (no warmup)
    schedule: Literal["cosine", "constant", "constant_with_warmup", "linear"] = "cosine"
    lr: float = 2e-3  # peak learning rate after warmup
    beta1: float = 0.9  # momentum: smoother updates against slower reaction
    beta2: float = 0.99  # lower adapts faster to changing gradient scale, noisier
    eps: float = 1e-8  # Adam denominator floor; larger damps updates of rarely-updated weights
    fused: bool = True  # one fused AdamW kernel where the device has one (CUDA, CPU), else foreach
    weight_decay: float = 0.0  # on matmul/conv weights only; regularises, slows fitting
    grad_clip_norm: float = 1.0  # global gradient norm cap; 0 disables; guards against spikes
    warmup_steps: int = 200  # linear warmup: stability early against slower start
    min_lr_ratio: float = 0.02  # cosine and linear decay to lr * this at max_steps
    ema_decay: float = 0.999  # EMA of weights for sampling; higher is smoother but lags longer

    def __post_init__(self):
        positive(self, "lr", "eps")
        non_negative(self, "weight_decay", "grad_clip_norm", "warmup_steps")
        fraction(self, "beta1", "beta2", "ema_decay")
        if not 0 <= self.min_lr_ratio <= 1:
            raise FieldError("min_lr_ratio", self.min_lr_ratio, "in [0, 1]")


@dataclass
class LossConfig:
    loss_scale: float = 1.0  # constant multiplier on the loss before backward; with Adam it matters only via eps

    def __post_init__(self):
        positive(self, "loss_scale")


@dataclass
class BatchSizerConfig:
    enabled: bool = False  # on out-of-memory, halve the micro-batch and re-run the step (same math, more steps)
    grow_after: int = 200  # clean steps before trying twice the micro-batch (up to training.train_batch_size)
    retry_after: int = 2000  # steps before a micro-batch size that ran out of memory is tried again
    debug_oom_above: int = -1  # fault injection: a real OutOfMemoryError for micro-batches above this; -1 off
    debug_oom_ranks: List[int] = field(default_factory=list)  # ranks that inject; empty: all
    debug_oom_steps: List[int] = field(default_factory=list)  # steps that inject; empty: every step
    debug_oom_phase: Literal["forward", "backward"] = "forward"  # raise in the forward, or inside the backward
    debug_oom_module: str = ""  # the submodule whose forward (or backward) fails, e.g. transformer.transformer_blocks.1

    def __post_init__(self):
        non_negative(self, "grow_after", "retry_after")
        if self.debug_oom_above < -1:
            raise FieldError("debug_oom_above", self.debug_oom_above, ">= 0, or -1 for off")


@dataclass
class ProfilerConfig:  # the scheduled torch.profiler (ENABLE_PROFILING=true ./train_mmdit_stable.sh)
    enabled: bool = False  # traces for TensorBoard: insight against slower profiled steps
    active_steps: int = 5  # steps recorded per cycle
    skip_first: int = 5  # steps before the schedule starts: skips start-up effects (allocator, compile)
    wait: int = 1  # idle steps before each recording cycle
    warmup: int = 1  # steps traced but discarded each cycle: hides the profiler's own start-up cost
    repeat: int = 1  # recording cycles; one trace per cycle and rank
    cuda: bool = True  # record CUDA kernels too (where there is a GPU)
    record_shapes: bool = True  # input shapes per op (Operator view by shape); bigger traces
    profile_memory: bool = True  # allocations per op (Memory view); some overhead
    with_stack: bool = False  # Python source lines per op; much bigger traces and slower
    memory_snapshot: bool = False  # CUDA only: allocator history over the profiled steps and on OOM (memory_viz)

    def __post_init__(self):
        positive(self, "active_steps", "repeat")
        non_negative(self, "skip_first", "wait", "warmup")


@dataclass
class ParallelConfig:
    # ddp: every rank holds all weights and optimizer state (fastest while it fits); fsdp: every rank holds 1/N
    # of them and gathers weights block by block (fits N times larger models, more communication); hsdp: fsdp
    # within groups of parallel.shard_size ranks, replicated across groups (less cross-node traffic)
    strategy: Literal["ddp", "fsdp", "hsdp"] = "ddp"
    # hsdp only: ranks per shard group (0: the processes of one node); fsdp shards over all ranks and ddp over
    # none, so setting it with them is an error rather than silently ignored
    shard_size: int = 0
    reshard_after_forward: bool = True  # fsdp/hsdp: free gathered weights after forward: memory against a
    #                                     second all-gather in backward
    # fsdp/hsdp on GPUs: sharded weights, gradients and AdamW state live in host memory and the optimizer step
    # runs on the CPU: fits far larger models, at PCIe copies every step and a slow optimizer step
    cpu_offload: bool = False
    ddp_bucket_cap_mb: float = 25.0  # ddp: gradient bucket size; larger buckets, fewer all-reduces, less overlap
    timeout_s: int = 1800  # several processes: how long a rank waits for the others before failing, not hanging

    def __post_init__(self):
        positive(self, "ddp_bucket_cap_mb", "timeout_s")
        non_negative(self, "shard_size")
        if self.shard_size and self.strategy != "hsdp":
            raise FieldError("shard_size", self.shard_size, f"0 with strategy={self.strategy} (it sizes hsdp's "
                             f"shard groups; fsdp shards over all ranks)")
        if self.cpu_offload and self.strategy == "ddp":
            raise FieldError("cpu_offload", True, "false with strategy=ddp (FSDP2 offloads the shards it owns; "
                             "use strategy=fsdp)")


@dataclass
class OffloadConfig:
    # LoRA on a base larger than the GPU: the frozen weights of this many transformer blocks (spread evenly, the last
    # among them) stay in pinned host memory and are copied to the GPU one swapped block ahead of use, forward and
    # backward (2N - 1 block copies per micro-step), while it computes; the GPU holds two of them, so N - 2 blocks'
    # weights are saved. Device memory against host memory and PCIe traffic: plan_memory.py prints the smallest N
    # that fits, benchmarks/roofline.py the N beyond which the copies outlast the compute they hide behind. 0: off
    blocks_to_swap: int = 0

    def __post_init__(self):
        non_negative(self, "blocks_to_swap")


@dataclass
class WandbConfig:
    enabled: bool = False  # also log metrics and sample grids to Weights & Biases
    project: str = "mmdit-stable"  # wandb project
    entity: Optional[str] = None  # wandb team or user; None: your default
    name: Optional[str] = None  # run name; None: the run directory's name
    mode: Literal["online", "offline"] = "online"  # offline writes locally with no network (`wandb sync` later)


@dataclass
class LoggingConfig:
    output_dir: str = "runs/shapes"  # the run directory: config, metrics, samples, checkpoints; resumed if present
    log_every: int = 100  # metrics line every N steps; each line costs one host sync
    tensorboard: bool = True  # scalars and sample grids in <run>/tensorboard, next to profiler traces
    peak_tflops: float = 0.0  # device peak for MFU; 0: the known dense peak of the detected GPU, else no MFU
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self):
        positive(self, "log_every")
        non_negative(self, "peak_tflops")


@dataclass
class CheckpointConfig:
    every: int = 1000  # checkpoint every N steps (and always at the end and when pre-empted); 0: only those
    async_save: bool = True  # write in the background: training stalls only for the copy to host memory
    keep_last: int = 2  # checkpoints kept; older ones are deleted only after a newer one is complete
    fail_on_error: bool = False  # a failed write stops training instead of being logged and retried next save

    def __post_init__(self):
        non_negative(self, "every")
        positive(self, "keep_last")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    text_encoder: TextEncoderConfig = field(default_factory=TextEncoderConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    flux: FluxGuidanceConfig = field(default_factory=FluxGuidanceConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    float8: Float8Config = field(default_factory=Float8Config)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    batch_sizer: BatchSizerConfig = field(default_factory=BatchSizerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


def check_combinations(cfg: DictConfig) -> None:
    """Rules that span sections."""
    lora = cfg.lora
    if lora.enabled and not cfg.model.init_from:
        raise ConfigError("lora.enabled=true needs model.init_from (a diffusers transformer directory): on a fresh "
                          "MMDiT the adaLN-Zero gates are zero and frozen, so the adapters would get no gradient")
    if lora.base_quantization != "none" and not lora.enabled:
        raise ConfigError(f"lora.base_quantization={lora.base_quantization} quantizes the frozen base of a LoRA run; "
                          f"set lora.enabled=true (a full fine-tune trains every weight in full precision)")
    if cfg.data.datasets and (cfg.data.path or cfg.data.name != "latents"):
        raise ConfigError("data.datasets lists the latent datasets of a run; data.path names the only one: give one "
                          "of the two (and data.name=latents)" if cfg.data.path else
                          "data.datasets lists latent datasets: set data.name=latents")
    captioned = [k for k in CAPTION_KEYS if cfg.data[k] != DataConfig.__dataclass_fields__[k].default]
    if captioned and cfg.data.name != "latents":
        raise ConfigError(f"data.{captioned[0]} changes the captions of a latent dataset; the shapes data's captions "
                          f"are fixed sentences of its own vocabulary")
    if cfg.data.use_masks == "true" and cfg.data.name != "latents":
        raise ConfigError("data.use_masks=true weighs the loss by the masks of a latent dataset; the shapes data has "
                          "none")
    if lora.text_encoders and not lora.enabled:
        raise ConfigError(f"lora.text_encoders={list(lora.text_encoders)} trains adapters of a LoRA run; set "
                          f"lora.enabled=true")
    if lora.text_encoders and cfg.data.text_encoding != "on_the_fly":
        raise ConfigError(f"lora.text_encoders={list(lora.text_encoders)} needs data.text_encoding=on_the_fly: with "
                          f"precomputed embeddings the text was encoded once, before training, and the encoders do "
                          f"not run in the step")
    if cfg.data.text_encoding == "on_the_fly" and cfg.data.name != "latents":
        raise ConfigError("data.text_encoding=on_the_fly runs the pipeline's text encoders over a latent dataset's "
                          "captions; the shapes data trains its own text encoder (data.name=latents to use it)")
    if cfg.data.text_encoders_from and cfg.data.text_encoding != "on_the_fly":
        raise ConfigError("data.text_encoders_from names the text encoders of data.text_encoding=on_the_fly; "
                          "set that too, or leave data.text_encoders_from unset")
    if cfg.float8.enabled and lora.base_quantization != "none":
        raise ConfigError(f"float8.enabled=true converts the frozen base's linears, which "
                          f"lora.base_quantization={lora.base_quantization} already replaced; choose one of them")
    check_block_swap_combinations(cfg)
    check_optimizer(cfg.optimizer, cfg.parallel.strategy, lora.enabled and lora.text_encoder_lr is not None)
    if cfg.training.dtype == "fp16" and cfg.parallel.strategy != "ddp":
        raise ConfigError(f"training.dtype=fp16 is not supported with parallel.strategy={cfg.parallel.strategy} "
                          f"(its gradient scaler does not handle sharded gradients); use training.dtype=bf16")


def check_block_swap_combinations(cfg: DictConfig) -> None:
    """What block swapping (offload.blocks_to_swap) does not run with, and why (perf/block_swap.py)."""
    swapped = cfg.offload.blocks_to_swap
    if not swapped:
        return
    key = f"offload.blocks_to_swap={swapped}"
    if not cfg.lora.enabled:
        raise ConfigError(f"{key} swaps the frozen base of a LoRA run (lora.enabled=true): a full fine-tune's weights "
                          f"change every step, and their fp32 master, gradients, AdamW state and EMA (20 bytes per "
                          f"parameter against 2 for a bf16 weight) stay on the GPU for the optimizer; for a full "
                          f"fine-tune that does not fit, use parallel.strategy=fsdp parallel.cpu_offload=true")
    if cfg.parallel.cpu_offload:
        raise ConfigError(f"{key} with parallel.cpu_offload=true: FSDP's offload already keeps every weight in host "
                          f"memory and copies each block to the GPU for its forward and backward; use one of them")
    if cfg.parallel.strategy != "ddp":
        raise ConfigError(f"{key} with parallel.strategy={cfg.parallel.strategy}: sharding already spreads the "
                          f"weights over the GPUs (each holds 1/N of them); use one of them")
    if cfg.compile.enabled and cfg.compile.scope == "model":
        raise ConfigError(f"{key} with compile.scope=model: the weights are copied in between blocks, outside "
                          f"their compiled graphs, which needs compile.scope=blocks")
    if cfg.compile.enabled and cfg.compile.mode == "reduce-overhead":
        raise ConfigError(f"{key} with compile.mode=reduce-overhead: CUDA graphs replay fixed addresses, and swapped "
                          f"weights get new device memory at each copy; use compile.mode=default")
    if cfg.float8.enabled:
        raise ConfigError(f"{key} with float8.enabled=true: block swapping is for LoRA runs, where float8 is no "
                          f"faster than bf16 (perf/float8.py); use lora.base_quantization to shrink the base instead")


CAPTION_KEYS = ("caption_prefix", "shuffle_caption_tags", "keep_tags", "tag_dropout")  # data.*: data/captions.py
PATH_KEYS = ("data.path", "data.text_encoders_from", "model.init_from", "logging.output_dir", "validation.vae_from")
SET_WHOLE = "a section is set key by key (training.seed=1), a list whole ('data.datasets=[{path: a}, {path: b}]')"
# keys that moved to the section a reader looks in: a config that still uses the old name is told the new one
RENAMED = {"sampling.every": "validation.every", "logging.save_freq": "checkpoint.every",
           "training.compile_model": "compile.enabled", "training.compile_mode": "compile.mode",
           "training.compile_scope": "compile.scope", "training.ddp_bucket_cap_mb": "parallel.ddp_bucket_cap_mb",
           "training.dist_timeout_s": "parallel.timeout_s", "training.enable_profiling": "profiler.enabled",
           "training.profile_steps": "profiler.active_steps"}
# values that were renamed: a user's config is told the new one; a run directory's saved config takes it
RENAMED_VALUES = {("training.attention_backend", "flash"): "flash_attn_2"}


def load_config(path: str | Path = DEFAULT_CONFIG, overrides: list[str] = (), resolve: bool = True) -> DictConfig:
    """Schema <- YAML file <- `key=value` overrides, then each section's checks. Errors name the key.

    `resolve` makes paths absolute and takes the architecture from `model.init_from`; a run directory's saved
    config is already resolved (and its init_from folder need not exist any more), so it is read with False."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"overrides must be key=value, got {bad}")
    try:
        loaded = OmegaConf.load(path)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {yaml_problem(e, path.read_text())}") from None
    except (OSError, UnicodeDecodeError, OmegaConfBaseException) as e:  # e.g. not UTF-8; a key `null`
        raise ConfigError(f"config file {path} cannot be read: {str(e).splitlines()[0]}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(loaded).__name__}")
    given = with_overrides(loaded, list(overrides), path)
    if OmegaConf.select(given, "data.datasets") and OmegaConf.is_missing(given.data, "path"):
        given.data.path = None  # the shipped configs ask for data.path, which data.datasets replaces
    moved = [f"{old} is now {new}" for old, new in RENAMED.items() if OmegaConf.select(given, old) is not None]
    if resolve:  # a user's file or command line; a saved run config just takes the new value below
        moved += [f"{key}={old} is now {key}={new}" for (key, old), new in RENAMED_VALUES.items()
                  if OmegaConf.select(given, key) == old]
    if moved:
        raise ConfigError(f"{'; '.join(moved)}: rename {'it' if len(moved) == 1 else 'them'} in {path} or the "
                          f"command line")
    every = OmegaConf.select(given, "training.activation_checkpointing")
    if isinstance(every, int) and not isinstance(every, bool):  # the key once counted blocks
        meant = {"activation_checkpointing": "none"} if every == 0 else \
            {"activation_checkpointing": "full", "activation_checkpointing_every": every}
        if resolve:
            raise ConfigError(f"training.activation_checkpointing={every} is now 'none', 'selective' or 'full': "
                              f"{', '.join(f'training.{k}={v}' for k, v in meant.items())} is what {every} meant "
                              f"(in {path} or the command line)")
        given.training.update(meant)  # a run's saved config from before the change: what it meant
    if every == "mlp":  # recomputed the MLPs in full; removed
        if resolve:
            raise ConfigError(f"training.activation_checkpointing=mlp was removed (it recomputed the MLPs' matmuls: "
                              f"15 % more compute for a third less memory): use selective (keeps the matmuls' outputs, "
                              f"recomputes what lies between them) or full with training.activation_checkpointing_every"
                              f"=2 (less memory for the same compute), in {path} or the command line")
        given.training.activation_checkpointing = "full"  # a run's saved config: the same gradients, less memory
    for (key, old), new in RENAMED_VALUES.items():
        if OmegaConf.select(given, key) == old:
            OmegaConf.update(given, key, new)
    check_dataset_entries(given)
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(Config), given)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise ConfigError(invalid_key(key, e)) from None
    except TypeError as e:  # a mapping where the schema has a list (model.dual_attention_layers.0=4), or the reverse
        raise ConfigError(f"invalid config: {e}: {SET_WHOLE}") from None
    missing = sorted(OmegaConf.missing_keys(given))  # a merge would keep the schema's default instead
    if missing:
        raise ConfigError(f"{path} leaves {missing} to you (marked ???): set them on the command line, "
                          f"e.g. {missing[0]}=...")
    cfg.data.use_masks = str(cfg.data.use_masks).lower()  # YAML reads true/false as booleans
    if resolve:
        keys = [*PATH_KEYS, *(f"data.datasets[{i}].path" for i in range(len(cfg.data.datasets)))]
        for key in keys:
            if OmegaConf.select(cfg, key):
                OmegaConf.update(cfg, key, str(Path(OmegaConf.select(cfg, key)).expanduser().absolute()))
        if cfg.model.init_from:
            architecture_from_init(cfg, set(given.get("model", {})))
    resolve_defaults(cfg)
    check_sections(cfg)
    if resolve:
        check_guidance_keys(cfg, given, loaded, path)
    check_combinations(cfg)
    return cfg


def with_overrides(loaded: DictConfig, overrides: list[str], path: Path) -> DictConfig:
    """The file's config with the `key=value` overrides merged over it. One that cannot be (a value that is not
    YAML, an item of a list: lists are set whole) is named; it is looked for only then, as a merge costs."""
    try:
        return OmegaConf.merge(loaded, OmegaConf.from_dotlist(overrides))
    except (yaml.YAMLError, OmegaConfBaseException, TypeError) as e:
        failure = e
    for override in overrides:
        try:
            OmegaConf.merge(loaded, OmegaConf.from_dotlist([override]))
        except yaml.YAMLError as e:
            raise ConfigError(f"{override}: the value is not valid YAML ({yaml_problem(e)})") from None
        except (OmegaConfBaseException, TypeError) as e:  # e.g. data.datasets.1.weight=2
            raise ConfigError(f"{override} does not fit the structure of {path} ({str(e).splitlines()[0]}): "
                              f"{SET_WHOLE}") from None
    raise failure  # only the overrides together: not known to be the user's doing


def yaml_problem(e: yaml.YAMLError, source: str | None = None) -> str:
    """What the YAML parser found, on one line (its own message spreads it over four), and where in `source`, the
    file's text (None: an override's one-line value)."""
    if not isinstance(e, yaml.MarkedYAMLError) or e.problem_mark is None:
        return " ".join(str(e).split())
    if source is None:
        return f"{e.problem}{f' ({e.context})' if e.context else ''}"
    at = lambda mark: f"line {mark.line + 1}, column {mark.column + 1}"  # marks count from 0
    mark, lines = e.problem_mark, source.splitlines()
    tab = mark.line < len(lines) and lines[mark.line][mark.column:mark.column + 1] == "\t" and "tab" not in e.problem
    context = f" ({e.context}{f' at {at(e.context_mark)}' if e.context_mark else ''})" if e.context else ""
    return f"{at(mark)}: {e.problem}{': a tab (YAML indents with spaces)' if tab else ''}{context}"


def invalid_key(key: str | None, e: OmegaConfBaseException) -> str:
    message = (getattr(e, "msg", None) or str(e)).split("\n")[0]  # the rest repeats the key
    return f"invalid config key {key!r}: {message}" if key else f"invalid config: {message}"


def check_dataset_entries(given: DictConfig) -> None:
    """Each data.datasets entry against the schema on its own: OmegaConf's merge names a bad key inside a list
    item without the item (`wieght`, not `data.datasets[1].wieght`)."""
    entries = OmegaConf.select(given, "data.datasets")
    if entries is not None and not isinstance(entries, ListConfig):
        raise ConfigError(f"data.datasets={entries} is not a list: {SET_WHOLE}")
    for i, entry in enumerate(entries or []):
        if isinstance(entry, DictConfig):  # anything else the merge names as data.datasets[i] itself
            try:
                OmegaConf.merge(OmegaConf.structured(DatasetEntry), entry)
            except OmegaConfBaseException as e:
                raise ConfigError(invalid_key(f"data.datasets[{i}].{e.full_key}", e)) from None


def check_sections(cfg: DictConfig) -> None:
    """Each section's own `__post_init__` checks, with the section's name put before the field's."""
    for section in cfg:
        for name, node in [(section, cfg[section]), *[(f"{section}.{k}", v) for k, v in cfg[section].items()
                                                        if isinstance(v, DictConfig)]]:
            try:
                OmegaConf.to_object(node)
            except FieldError as e:
                raise ConfigError(f"{name}.{e}") from None


def check_guidance_keys(cfg: DictConfig, given: DictConfig, file: DictConfig, path: Path) -> None:
    """flux.* feeds a guidance embedding: given to a model without one (FLUX.1-schnell, SD3), it would be ignored.
    Where the config file sets it, the command line cannot unset it: the remedy is another config."""
    given_keys = [f"flux.{k}" for k in ("train_guidance", "sample_guidance") if OmegaConf.select(given, f"flux.{k}") is not None]
    if given_keys and not cfg.model.guidance_embeds:
        key = given_keys[0]
        model = f"{cfg.model.init_from} has" if cfg.model.init_from else "model.guidance_embeds=false:"
        remedy = (f"{path} is a config for a model with one; use one for a model without (FLUX.1-schnell: "
                  f"configs/flux_schnell_lora.yaml, FLUX.2-klein: configs/flux2_klein_*_lora.yaml), or a copy of "
                  f"{path} without its flux section" if OmegaConf.select(file, key) is not None
                  else f"leave {key} off the command line")
        raise ConfigError(f"{key} sets the guidance a guidance-distilled model (FLUX.1-dev, FLUX.2-dev) embeds, and "
                          f"{model} no guidance embedding (FLUX.1-schnell, FLUX.2-klein, Qwen-Image and SD3 have none): "
                          f"{remedy}")


def as_override(value) -> str:
    """A value as a key=value override writes it, with nothing a shell would split."""
    return "null" if value is None else str(value).replace(" ", "") if isinstance(value, list) else str(value)


# the demo's micro-batch by built-in data.name: an edit pair is twice the tokens of a captioned shape, so half the
# pairs per step keep its demo near the text-to-image demo's time, with more steps per pair than a batch of 16
# (docs/editing.md has both measured)
DEMO_BATCH = {"shapes": 16, "shapes_edit": 8}


def resolve_defaults(cfg: DictConfig) -> None:
    """The values the keys left unset (None) take: a family's sizes of its demo model, values it derives from
    others (FLUX.1's single blocks and rotary split), the LoRA targets of diffusers' script for it; the built-in
    data's demo micro-batch."""
    if cfg.training.train_batch_size is None:
        cfg.training.train_batch_size = DEMO_BATCH.get(cfg.data.name, 16)
    m, family = cfg.model, FAMILIES[cfg.model.family]
    if m.num_layers is None:
        for key, value in family.demo.items():
            if m[key] is None:
                m[key] = value
    family.fill_defaults(m)
    if m.num_single_layers is None:
        m.num_single_layers = 0
    if cfg.lora.target_modules is None:
        cfg.lora.target_modules = family.default_lora_targets(m)


def architecture_from_init(cfg: DictConfig, explicit: set[str]) -> None:
    """Set the family and the sizes from model.init_from's config.json (a single file's: from its shapes); a value
    set explicitly must agree with it."""
    folder = cfg.model.init_from
    try:
        family, config = read_config(Path(folder))
    except CheckpointFormatError as e:
        raise ConfigError(f"model.init_from={folder}: {e}") from None
    theirs = {"family": family.name, **family.settings(config)}
    source = folder if is_single_file(Path(folder)) else f"{folder}/config.json"  # a single file's shapes say them
    for key, value in theirs.items():
        ours = cfg.model[key]
        ours = OmegaConf.to_object(ours) if isinstance(ours, ListConfig) else ours
        if key == "family" and key in explicit and ours != value:
            raise ConfigError(f"model.family={ours}, and model.init_from={folder} holds a {family.name} transformer "
                              f"({family.diffusers_class}): use a config of that family (configs/{family.name}_*.yaml)"
                              f" or a {ours} checkpoint")
        if key in explicit and ours != value:
            raise ConfigError(f"model.{key}={ours} contradicts {source} ({key}: {value}); the "
                              f"architecture comes from model.init_from: set model.{key}={as_override(value)} "
                              f"or leave it unset (configs/{family.name}_*.yaml set no sizes), or point "
                              f"model.init_from at a transformer of that architecture")
        cfg.model[key] = value
