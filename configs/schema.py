"""The typed config schema. YAML files and `key=value` overrides are merged over these dataclasses, so an
unknown key or a value of the wrong type fails with the key's name before any compute.

Paths in a config mean what they mean in the directory the command runs in; `load_config` makes them
absolute, so the run directory's saved config works from anywhere. With `model.init_from`, the MMDiT's
architecture comes from that folder's config.json."""

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Literal, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from models.diffusers_io import CheckpointFormatError, read_config
from models.lora import DIFFUSERS_SD3_TARGETS

DEFAULT_CONFIG = Path(__file__).parent / "shapes.yaml"


@dataclass
class ModelConfig:
    patch_size: int = 4  # smaller patches see finer detail but cost ~4x tokens per halving
    num_layers: int = 6  # depth: capacity against time per step
    num_attention_heads: int = 4  # hidden size = heads * head_dim
    attention_head_dim: int = 32  # wider heads: more capacity, more FLOPs per token
    sample_size: int = 32  # nominal input size; sets the scale of the sin-cos position table
    pos_embed_max_size: int = 16  # largest patch grid side the position table covers
    qk_norm: Optional[Literal["rms_norm"]] = "rms_norm"  # per-head q,k RMSNorm (SD3.5): stabler at high lr
    dual_attention_layers: List[int] = field(default_factory=list)  # SD3.5 image-only attn2 in these blocks
    init_from: Optional[str] = None  # a diffusers SD3Transformer2DModel directory to start from; sets the sizes above


@dataclass
class TextEncoderConfig:
    dim: int = 128  # width of the jointly trained text encoder (joint and pooled dims of the MMDiT)
    num_layers: int = 1  # transformer layers over the caption; 0 is a bag of embeddings
    num_heads: int = 4  # attention heads of the text encoder; must divide its dim


@dataclass
class DataConfig:
    name: Literal["shapes", "latents"] = "shapes"  # built-in captioned shapes, or precomputed latent shards
    path: Optional[str] = None  # latents: the directory `python precompute_latents.py` wrote
    aspect_buckets: bool = False  # latents: train on several latent sizes, each global batch from one size
    num_items: int = 100_000  # shapes: distinct procedural items before the order repeats
    holdout: int = 0  # items kept out of training for the held-out loss (validation.every); fewer to learn from
    caption_dropout: float = 0.1  # share of samples trained unconditionally: enables CFG, costs conditional fit
    num_workers: int = -1  # loader processes; -1: 0 on CPU (both cores compute), 4 on CUDA (hide loading)
    pin_memory: bool = True  # CUDA only: page-locked batches so host-to-device copies overlap compute
    prefetch_factor: int = 2  # batches each worker prepares ahead (workers > 0): memory against stalls


@dataclass
class LoraConfig:
    enabled: bool = False  # train low-rank adapters on a frozen model: far less optimizer memory, tiny files
    rank: int = 16  # adapter rank: capacity against parameters and memory
    alpha: float = 16.0  # adapter output is scaled by alpha / rank; higher moves further from the base per step
    dropout: float = 0.0  # dropout on the adapter input: regularises small datasets, adds noise to the step
    target_modules: List[str] = field(default_factory=lambda: list(DIFFUSERS_SD3_TARGETS))  # diffusers' SD3 set


@dataclass
class FlowConfig:
    # where training spends its noise levels (SD3 paper, sec. 3.1): logit-normal and mode focus on mid noise,
    # cosmap is a heavier-tailed middle, uniform spreads evenly
    sigma_sampling: Literal["logit_normal", "uniform", "mode", "cosmap"] = "logit_normal"
    logit_mean: float = 0.0  # centre of the logit-normal; > 0 trains more at high noise
    logit_std: float = 1.0  # spread of the logit-normal; larger covers the ends better
    mode_scale: float = 1.29  # mode sampling's s: > 0 favours mid noise, < 0 the ends (SD3: 1.29)
    shift: float = 3.0  # SD3 timestep shift of training sigmas; > 1 trains more at high noise, where shapes form


@dataclass
class SamplingConfig:
    steps: int = 30  # Euler steps: quality against sampling time
    cfg_scale: float = 5.0  # classifier-free guidance weight; 1 disables guidance (half the cost)
    shift: float = 3.0  # timestep shift of the sampling schedule; > 1 spends more steps at high noise
    # sigma range [low, high] where guidance applies: layout and identity form at high noise, while guidance at
    # low noise over-sharpens; outside it only the conditional branch runs (cheaper)
    guidance_interval: List[float] = field(default_factory=lambda: [0.0, 1.0])
    grid_size: int = 16  # shapes: images shown in the sample grid (all 90 prompts are scored)


@dataclass
class ValidationConfig:
    every: int = 0  # images and held-out loss every N steps and at the end; 0: off (shapes still score at the end)
    vae_from: Optional[str] = None  # latents: pipeline (or vae/) folder that decodes images; None: the precompute's
    loss_sigmas: int = 8  # held-out loss at this many fixed noise levels: a finer curve against more compute


@dataclass
class TrainingConfig:
    train_batch_size: int = 16  # micro-batch per device per micro-step; memory against throughput
    gradient_accumulation_steps: int = 1  # micro-steps per optimizer step; global batch = batch * accum * world
    max_steps: int = 3200  # optimizer steps in the run
    seed: int = 0  # data order, noise, sigmas and init all derive from it
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"  # autocast precision: speed and memory against accuracy
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when available
    allow_tf32: bool = True  # CUDA only: fp32 matmuls on tensor cores, much faster, 10-bit mantissa
    attention_backend: Literal["auto", "flash", "sdpa", "math"] = "auto"  # auto: flash-attn when usable, else SDPA
    compile_model: bool = False  # torch.compile: ~10% faster steps on CPU after a ~45 s compile
    compile_mode: Literal["default", "reduce-overhead", "max-autotune"] = "default"  # longer compile, faster steps
    compile_scope: Literal["blocks", "model"] = "blocks"  # whole model fuses more but compiles longer
    activation_checkpointing: int = 0  # recompute every k-th block in backward: less memory, ~1/3 more compute; 0 off
    enable_profiling: bool = False  # scheduled torch.profiler traces: insight against a slower run
    profile_steps: int = 5  # active steps the profiler records
    dist_timeout_s: int = 1800  # several processes: how long a rank waits for the others before failing, not hanging
    ddp_bucket_cap_mb: float = 25.0  # DDP gradient bucket size: larger buckets, fewer all-reduces, less overlap
    max_nonfinite_steps: int = 20  # non-finite steps in a row before stopping a diverged run; 0: no guard (no sync)


@dataclass
class OptimizerConfig:
    lr: float = 2e-3  # peak learning rate after warmup
    beta1: float = 0.9  # momentum: smoother updates against slower reaction
    beta2: float = 0.99  # lower adapts faster to changing gradient scale, noisier
    eps: float = 1e-8  # Adam denominator floor; larger damps updates of rarely-updated weights
    fused: bool = True  # one fused AdamW kernel where the device has one (CUDA, CPU), else foreach
    weight_decay: float = 0.0  # on matmul/conv weights only; regularises, slows fitting
    grad_clip_norm: float = 1.0  # global gradient norm cap; 0 disables; guards against spikes
    warmup_steps: int = 200  # linear warmup: stability early against slower start
    min_lr_ratio: float = 0.02  # cosine decays to lr * this at max_steps
    ema_decay: float = 0.999  # EMA of weights for sampling; higher is smoother but lags longer


@dataclass
class LossConfig:
    loss_scale: float = 1.0  # constant multiplier on the loss before backward; with Adam it matters only via eps


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


@dataclass
class ProfilerConfig:  # the schedule and contents of training.enable_profiling's traces
    skip_first: int = 5  # steps before the schedule starts: skips start-up effects (allocator, compile)
    wait: int = 1  # idle steps before each recording cycle
    warmup: int = 1  # steps traced but discarded each cycle: hides the profiler's own start-up cost
    repeat: int = 1  # recording cycles of training.profile_steps steps; one trace per cycle and rank
    cuda: bool = True  # record CUDA kernels too (where there is a GPU)
    record_shapes: bool = True  # input shapes per op (Operator view by shape); bigger traces
    profile_memory: bool = True  # allocations per op (Memory view); some overhead
    with_stack: bool = False  # Python source lines per op; much bigger traces and slower
    memory_snapshot: bool = False  # CUDA only: allocator history over the profiled steps and on OOM (memory_viz)


@dataclass
class ParallelConfig:
    # ddp: every rank holds all weights and optimizer state (fastest while it fits); fsdp: every rank holds 1/N
    # of them and gathers weights block by block (fits N times larger models, more communication); hsdp: fsdp
    # within groups of parallel.shard_size ranks, replicated across groups (less cross-node traffic)
    strategy: Literal["ddp", "fsdp", "hsdp"] = "ddp"
    shard_size: int = 0  # hsdp: ranks per shard group; 0: the processes of one node (LOCAL_WORLD_SIZE)
    reshard_after_forward: bool = True  # fsdp/hsdp: free gathered weights after forward: memory against a
    #                                     second all-gather in backward


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
    save_freq: int = 1000  # checkpoint every N steps (and at the end); 0 only at the end
    log_every: int = 100  # metrics line every N steps; each line costs one host sync
    tensorboard: bool = True  # scalars and sample grids in <run>/tensorboard, next to profiler traces
    peak_tflops: float = 0.0  # device peak for MFU; 0: the known dense peak of the detected GPU, else no MFU
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class CheckpointConfig:
    async_save: bool = True  # write in a background thread: training stalls only for the CPU snapshot
    keep_last: int = 2  # checkpoints kept; older ones are deleted only after a newer one is complete
    fail_on_error: bool = False  # a failed write stops training instead of being logged and retried next save


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    text_encoder: TextEncoderConfig = field(default_factory=TextEncoderConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    batch_sizer: BatchSizerConfig = field(default_factory=BatchSizerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


class ConfigError(ValueError):
    pass


PATH_KEYS = ("data.path", "model.init_from", "logging.output_dir", "validation.vae_from")
# the MMDiT sizes a diffusers transformer folder fixes (the rest, like channels and text widths, come from the data)
ARCHITECTURE_KEYS = ("patch_size", "num_layers", "num_attention_heads", "attention_head_dim", "sample_size",
                     "pos_embed_max_size", "qk_norm", "dual_attention_layers")
RENAMED = {"sampling.every": "validation.every"}


def load_config(path: str | Path = DEFAULT_CONFIG, overrides: list[str] = (), resolve: bool = True) -> DictConfig:
    """Schema <- YAML file <- `key=value` overrides, then range checks. Errors name the key.

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
    except Exception as e:  # YAML syntax errors and unreadable files
        raise ConfigError(f"config file {path} is not valid YAML: {e}".split("\n")[0]) from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(loaded).__name__}")
    given = OmegaConf.merge(loaded, OmegaConf.from_dotlist(list(overrides)))
    for old, new in RENAMED.items():
        value = OmegaConf.select(given, old)
        if value is None:
            continue
        if resolve:
            raise ConfigError(f"{old} is now {new}; rename it in {path} or the command line")
        section, key = old.rsplit(".", 1)  # a run directory saved before the rename: read under the new name
        del given[section][key]
        OmegaConf.update(given, new, value, force_add=True)
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(Config), given)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise ConfigError(f"invalid config key {key!r}: {e.msg if hasattr(e, 'msg') else e}".split("\n")[0]) from None
    missing = sorted(OmegaConf.missing_keys(given))  # a merge would keep the schema's default instead
    if missing:
        raise ConfigError(f"{path} leaves {missing} to you (marked ???): set them on the command line, "
                          f"e.g. {missing[0]}=...")
    if resolve:
        for key in PATH_KEYS:
            if OmegaConf.select(cfg, key):
                OmegaConf.update(cfg, key, str(Path(OmegaConf.select(cfg, key)).expanduser().absolute()))
        if cfg.model.init_from:
            architecture_from_init(cfg, set(given.get("model", {})))
    validate(cfg)
    return cfg


def architecture_from_init(cfg: DictConfig, explicit: set[str]) -> None:
    """Set the MMDiT sizes from model.init_from's config.json; a size set explicitly must agree with it."""
    folder = cfg.model.init_from
    try:
        theirs = dataclasses.asdict(read_config(Path(folder)))
    except CheckpointFormatError as e:
        raise ConfigError(f"model.init_from={folder}: {e}") from None
    for key in ARCHITECTURE_KEYS:
        ours = OmegaConf.to_object(cfg.model[key]) if key == "dual_attention_layers" else cfg.model[key]
        if key in explicit and ours != theirs[key]:
            raise ConfigError(f"model.{key}={ours} contradicts {folder}/config.json ({key}: {theirs[key]}); the "
                              f"architecture comes from model.init_from: leave model.{key} unset, or point "
                              f"model.init_from at a transformer of that architecture")
        cfg.model[key] = theirs[key]


def validate(cfg: DictConfig) -> None:
    positive = ["model.patch_size", "model.num_layers", "model.num_attention_heads", "model.attention_head_dim",
                "model.pos_embed_max_size", "model.sample_size", "text_encoder.dim", "text_encoder.num_heads",
                "data.num_items", "data.prefetch_factor", "sampling.steps", "sampling.grid_size",
                "training.train_batch_size", "training.gradient_accumulation_steps", "training.max_steps",
                "training.profile_steps", "training.dist_timeout_s", "training.ddp_bucket_cap_mb", "optimizer.lr",
                "optimizer.eps", "logging.log_every", "checkpoint.keep_last", "loss.loss_scale",
                "profiler.repeat", "lora.rank", "lora.alpha", "validation.loss_sigmas"]
    for key in positive:
        if not OmegaConf.select(cfg, key) > 0:
            raise ConfigError(f"{key} must be > 0, got {OmegaConf.select(cfg, key)}")
    non_negative = ["text_encoder.num_layers", "training.activation_checkpointing", "training.max_nonfinite_steps",
                    "validation.every", "optimizer.weight_decay", "optimizer.grad_clip_norm", "optimizer.warmup_steps",
                    "logging.save_freq", "training.seed",
                    "profiler.skip_first", "profiler.wait", "profiler.warmup", "logging.peak_tflops",
                    "batch_sizer.grow_after", "batch_sizer.retry_after", "data.holdout", "parallel.shard_size"]
    for key in non_negative:
        if OmegaConf.select(cfg, key) < 0:
            raise ConfigError(f"{key} must be >= 0, got {OmegaConf.select(cfg, key)}")
    for key in ["data.caption_dropout", "lora.dropout", "optimizer.beta1", "optimizer.beta2", "optimizer.ema_decay"]:
        if not 0 <= OmegaConf.select(cfg, key) < 1:
            raise ConfigError(f"{key} must be in [0, 1), got {OmegaConf.select(cfg, key)}")
    if not 0 <= cfg.optimizer.min_lr_ratio <= 1:
        raise ConfigError(f"optimizer.min_lr_ratio must be in [0, 1], got {cfg.optimizer.min_lr_ratio}")
    m = cfg.model
    if (m.num_attention_heads * m.attention_head_dim) % 4:
        raise ConfigError(f"model.num_attention_heads * model.attention_head_dim = "
                          f"{m.num_attention_heads * m.attention_head_dim} must be divisible by 4 "
                          f"(the 2-D sin-cos position table splits it four ways)")
    if m.sample_size < m.patch_size:
        raise ConfigError(f"model.sample_size={m.sample_size} must be >= model.patch_size={m.patch_size}")
    if cfg.batch_sizer.debug_oom_above < -1:
        raise ConfigError(f"batch_sizer.debug_oom_above must be >= 0, or -1 for off; got {cfg.batch_sizer.debug_oom_above}")
    if cfg.data.num_workers < -1:
        raise ConfigError(f"data.num_workers must be >= 0, or -1 for the device default; got {cfg.data.num_workers}")
    if not -1 <= cfg.flow.mode_scale <= 1 / (math.pi / 2 - 1):
        raise ConfigError(f"flow.mode_scale must be in [-1, 1.75] (beyond, mode sampling is not monotone), "
                          f"got {cfg.flow.mode_scale}")
    interval = list(cfg.sampling.guidance_interval)
    if len(interval) != 2 or not 0 <= interval[0] <= interval[1] <= 1:
        raise ConfigError(f"sampling.guidance_interval must be [low, high] with 0 <= low <= high <= 1, got {interval}")
    if cfg.flow.shift <= 0 or cfg.sampling.shift <= 0:
        raise ConfigError("flow.shift and sampling.shift must be > 0")
    if cfg.text_encoder.dim % cfg.text_encoder.num_heads:
        raise ConfigError(f"text_encoder.dim={cfg.text_encoder.dim} must be divisible by "
                          f"text_encoder.num_heads={cfg.text_encoder.num_heads}")
    if cfg.lora.enabled and not cfg.lora.target_modules:
        raise ConfigError("lora.target_modules is empty; name the modules to adapt, e.g. attn.to_q")
    if cfg.lora.enabled and not cfg.model.init_from:
        raise ConfigError("lora.enabled=true needs model.init_from (a diffusers transformer directory): on a fresh "
                          "MMDiT the adaLN-Zero gates are zero and frozen, so the adapters would get no gradient")
    bad_layers = [i for i in cfg.model.dual_attention_layers if not 0 <= i < cfg.model.num_layers]
    if bad_layers:
        raise ConfigError(f"model.dual_attention_layers {bad_layers} outside 0..{cfg.model.num_layers - 1}")
