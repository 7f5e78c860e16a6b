"""The training step at real shapes: what one optimizer step of SD3 / SD3.5 fine-tuning costs (`make bench`).

    python benchmarks/train_step.py [--size real|tiny] [--models NAME ...] [--variants NAME ...]
                                    [--steps 10] [--warmup 3] [--out FILE]

Each model is a fine-tuning config of configs/ with the released architecture (plan_memory.py's table; random
weights, nothing downloaded) at 1024 px (128x128 latents, 4096 image tokens + 333 text tokens), the config's
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
- host syncs per step in one more step (CUDA's sync debug mode; runtime/host_syncs.py's counter on a CPU);
- graph breaks that torch.compile reported while building the row (dynamo's counters).

Variants of SD3-medium (the issue's target): fp32+TF32, bf16 eager, bf16 compiled (the config as written),
each activation-checkpointing choice, each attention backend, float8,
and in the same run the anchor: diffusers' SD3Transformer2DModel at the same shape, precision, activation
checkpointing and fused AdamW, eager and compiled per block (diffusers 0.42 lists no `_repeated_blocks` for it),
with the same loss, clipping and EMA. A row that cannot run here (a CUDA-only kernel, a missing package) is
listed as "not runnable here" with the reason; one that runs out of memory as failed, with the error.

`--overrides key=value ...` changes every row (e.g. training.train_batch_size=8), `--resolution` the image side.
`--size tiny` shrinks every model to 2 blocks at 128 px (compile with the aot_eager backend), so the whole table
runs on a CPU (about 5 minutes on a busy 2-core machine, far less with OMP_NUM_THREADS=1, as threads only
contend at that size): it checks the machinery, its times mean nothing. The table is printed and the
rows written to benchmarks/train_step_<device>.json (or --out).
"""

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the project folders import by their names

from configs.build import build_model, build_trained_model  # noqa: E402
from configs.schema import check_sections  # noqa: E402
from errors import ConfigError  # noqa: E402
from models.lora import apply_lora  # noqa: E402
from models.rectified_flow import interpolate, per_sample_loss  # noqa: E402
from optim.adamw import build_adamw  # noqa: E402
from optim.ema import EMA  # noqa: E402
from perf.attention import BACKENDS, apply_attention_backend  # noqa: E402
from perf.parallel import apply_parallelism, unwrap  # noqa: E402
from perf.precision import autocast, configure_cuda_math, grad_scaler  # noqa: E402
from plan_memory import RELEASED, SD3_TEXT, planning_config  # noqa: E402
from runtime.distributed import World  # noqa: E402
from runtime.host_syncs import HostSyncCounter, cuda_sync_counter  # noqa: E402
from runtime.nonfinite import NonFiniteGuard  # noqa: E402
from runtime.step_stats import SigmaBuckets, peak_flops, train_flops_per_sample  # noqa: E402
from train_mmdit_stable import forward_backward, optimizer_step  # noqa: E402

# name: (config file, released architecture)
MODELS = {
    "sd3-medium": ("sd3_medium.yaml", "sd3-medium"),
    "sd3.5-medium-lora": ("sd35_medium_lora.yaml", "sd35-medium"),
    "sd3.5-medium-lora-24gb": ("sd35_medium_lora_24gb.yaml", "sd35-medium"),
    "sd3.5-large-lora": ("sd35_large_lora.yaml", "sd35-large"),
    "sd3.5-large-lora-24gb": ("sd35_large_lora_24gb.yaml", "sd35-large"),
}
RESOLUTION = 1024
# --size tiny: the same configs, every model 2 blocks of 2 heads x 16 at 128 px (16x16 latents, 8x8 patches)
TINY = {"architecture": {"num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 16, "sample_size": 16,
                         "pos_embed_max_size": 8},
        "text": {"tokens": 8, "joint": 32, "pooled": 16}, "resolution": 128}


@dataclass
class Variant:
    name: str
    overrides: list[str] = field(default_factory=list)
    anchor: bool = False  # diffusers' SD3Transformer2DModel instead of this project's model


def variants(model: str) -> list[Variant]:
    """The config as written for every model; the sweep and the diffusers anchor for SD3-medium; float8 for
    SD3-medium and SD3.5-large (its target: 1.2x bf16 there)."""
    rows = [Variant("as configured")]
    float8 = Variant("float8", ["float8.enabled=true"])
    if model == "sd3-medium":
        rows[0].name = "bf16 compiled (as configured)"
        rows += [Variant("fp32+TF32 eager", ["training.dtype=fp32", "compile.enabled=false"]),
                 Variant("bf16 eager", ["compile.enabled=false"]),
                 Variant("bf16 compiled, no activation checkpointing", ["training.activation_checkpointing=none"]),
                 Variant("bf16 compiled, checkpointing the MLPs", ["training.activation_checkpointing=mlp"]),
                 Variant("bf16 compiled, checkpointing every 2nd block", ["training.activation_checkpointing=full",
                                                                          "training.activation_checkpointing_every=2"])]
        rows += [Variant(f"bf16 compiled, attention {b}", [f"training.attention_backend={b}"])
                 for b in BACKENDS if b not in ("auto", "math")]
        rows += [float8, Variant("diffusers eager", ["compile.enabled=false"], anchor=True),
                 Variant("diffusers compiled", [], anchor=True)]
    elif model == "sd3.5-large-lora":
        rows.append(float8)
    return rows


# ----------------------------------------------------------------------------------------------- building


def benchmark_config(model: str, overrides: list[str], size: str):
    """The model's fine-tuning config with the released architecture (or the tiny one) and `overrides`."""
    config, architecture = MODELS[model]
    shrink = [f"model.{k}={v}" for k, v in TINY["architecture"].items()] if size == "tiny" else []
    if size == "tiny":
        shrink += ["compile.backend=aot_eager"]  # traces the same graphs without code generation: seconds
        shrink += ["model.dual_attention_layers=[0]"] if RELEASED[architecture]["dual_attention_layers"] else []
    cfg, _ = planning_config(str(ROOT / "configs" / config), [], architecture)
    for item in [*shrink, *overrides]:
        key, _, value = item.partition("=")
        OmegaConf.update(cfg, key, OmegaConf.from_dotlist([f"v={value}"]).v, merge=False)
    check_sections(cfg)
    return cfg


def data_shapes(size: str, resolution: int = RESOLUTION) -> SimpleNamespace:
    """What the model needs to know of the data: SD3 latents and text embeddings at the benchmark's size."""
    text = TINY["text"] if size == "tiny" else {"tokens": SD3_TEXT["tokens"], "joint": SD3_TEXT["joint"],
                                                "pooled": SD3_TEXT["pooled"]}
    side = (TINY["resolution"] if size == "tiny" else resolution) // SD3_TEXT["vae_factor"]
    return SimpleNamespace(latent_channels=SD3_TEXT["latent_channels"], latent_sizes=[(side, side)],
                           text_dims=(text["joint"], text["pooled"]), text_tokens=text["tokens"])


def device_batch(cfg, data: SimpleNamespace, device: torch.device) -> dict:
    """One step's batch as the loader delivers it, made on the device."""
    g = torch.Generator(device).manual_seed(0)
    b, (h, w), joint, pooled = cfg.training.train_batch_size, data.latent_sizes[-1], *data.text_dims
    latents = lambda: torch.randn(b, data.latent_channels, h, w, generator=g, device=device)  # noqa: E731
    return {"step": 0, "first_position": 0, "latents": latents(), "noise": latents(),
            "sigma": torch.rand(b, generator=g, device=device),
            "text": {"prompt_embeds": torch.randn(b, data.text_tokens, joint, generator=g, device=device),
                     "pooled_prompt_embeds": torch.randn(b, pooled, generator=g, device=device)}}


@torch.no_grad()
def randomize(model: torch.nn.Module) -> None:
    """Random weights on the device (no download; adaLN gates non-zero, so every weight gets a gradient)."""
    torch.manual_seed(0)
    for p in model.parameters():
        if p.is_floating_point():
            p.normal_(0.0, 0.02)
        else:  # a quantized base's codes
            p.random_(-127, 128) if p.dtype == torch.int8 else p.random_(0, 256)


def flops_per_sample(cfg, data: SimpleNamespace) -> int:
    shape = (data.latent_channels, *data.latent_sizes[-1])
    joint, pooled = data.text_dims

    def inputs():  # made inside the counter's meta-device context
        text = {"prompt_embeds": torch.zeros(1, data.text_tokens, joint),
                "pooled_prompt_embeds": torch.zeros(1, pooled)}
        return torch.zeros(1, *shape), torch.full((1,), 0.5), text
    return train_flops_per_sample(lambda: apply_lora(build_model(cfg, data), cfg.lora), inputs)


def ours(cfg, data: SimpleNamespace, device: torch.device):
    """This project's model, optimizer and step as train_mmdit_stable.py builds and runs them."""
    t, o = cfg.training, cfg.optimizer
    model = build_trained_model(cfg, data)
    apply_attention_backend(model, t.attention_backend, device, t.dtype, cfg.model.attention_head_dim)
    buffers = dict(model.named_buffers())
    model = apply_parallelism(model, cfg, World(), device, lambda name, offsets, sizes: (
        model.initial_value(name, 0) if name in buffers else torch.zeros(())))  # weights: randomize() below
    randomize(model)
    optimizer = build_adamw(unwrap(model), o.lr, (o.beta1, o.beta2), o.eps, o.weight_decay, device, o.fused)
    ema, scaler = EMA(unwrap(model), o.ema_decay), grad_scaler(device, t.dtype)
    guard, sigma_losses = NonFiniteGuard(t.max_nonfinite_steps, cfg.logging.log_every), SigmaBuckets(device)
    configure_cuda_math(device, t.allow_tf32)

    def step(batch: dict, i: int) -> None:
        batch["step"] = i
        forward_backward(model, batch, cfg, scaler, sigma_losses, t.train_batch_size)
        optimizer_step(model, optimizer, scaler, ema, guard, i, o.grad_clip_norm)
    return model, step


def diffusers_anchor(cfg, data: SimpleNamespace, device: torch.device):
    """diffusers' SD3Transformer2DModel with the same step: loss, backward, clipping, fused AdamW, EMA."""
    from diffusers import SD3Transformer2DModel
    t, o, m = cfg.training, cfg.optimizer, cfg.model
    width = m.num_attention_heads * m.attention_head_dim
    with torch.device(device):
        model = SD3Transformer2DModel(
            sample_size=m.sample_size, patch_size=m.patch_size, in_channels=data.latent_channels,
            num_layers=m.num_layers, attention_head_dim=m.attention_head_dim, num_attention_heads=m.num_attention_heads,
            joint_attention_dim=data.text_dims[0], caption_projection_dim=width,
            pooled_projection_dim=data.text_dims[1],
            out_channels=data.latent_channels, pos_embed_max_size=m.pos_embed_max_size,
            dual_attention_layers=tuple(m.dual_attention_layers), qk_norm=m.qk_norm)
    model.to(device)  # buffers made from numpy (its position table) ignore the device context
    randomize(model)
    model.train()
    if t.activation_checkpointing != "none":
        model.enable_gradient_checkpointing()  # every block (diffusers has no every-k-th)
    if cfg.compile.enabled:
        for block in model.transformer_blocks:
            block.compile(backend=cfg.compile.backend)
    configure_cuda_math(device, t.allow_tf32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                  weight_decay=o.weight_decay, fused=True)
    ema = EMA(model, o.ema_decay)

    def step(batch: dict, i: int) -> None:
        x0, noise, sigma, text = batch["latents"], batch["noise"], batch["sigma"], batch["text"]
        with autocast(device, t.dtype):
            v = model(hidden_states=interpolate(x0, noise, sigma), encoder_hidden_states=text["prompt_embeds"],
                      pooled_projections=text["pooled_prompt_embeds"], timestep=sigma * 1000, return_dict=False)[0]
        per_sample_loss(v, x0, noise).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ema.update(i)
    return model, step


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


def host_syncs(step, model, batch: dict, device: torch.device, i: int) -> int:
    counts = {}
    if device.type == "cuda":
        with cuda_sync_counter(counts):
            step(batch, i)
        return counts["cuda sync"]
    counter = HostSyncCounter([*model.parameters(), batch])
    with counter.counting():
        step(batch, i)
    return counter.total


def measure(model_name: str, variant: Variant, size: str, steps: int, warmup: int, device: torch.device,
            resolution: int = RESOLUTION) -> dict:
    """One row: build, warm up, time, count; or why it cannot run / failed."""
    cfg = benchmark_config(model_name, variant.overrides, size)
    data = data_shapes(size, resolution)
    (h, w), patch = data.latent_sizes[-1], cfg.model.patch_size
    tokens = (h // patch) * (w // patch) + data.text_tokens
    batch_size = cfg.training.train_batch_size
    row = {"model": model_name, "variant": variant.name, "micro_batch": batch_size, "tokens_per_sample": tokens,
           "dtype": cfg.training.dtype, "compile": cfg.compile.enabled,
           "activation_checkpointing": cfg.training.activation_checkpointing,
           "attention": "diffusers' default" if variant.anchor else cfg.training.attention_backend}
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    flops = flops_per_sample(cfg, data) * batch_size
    model = step = batch = None
    try:
        model, step = (diffusers_anchor if variant.anchor else ours)(cfg, data, device)
        batch = device_batch(cfg, data, device)
        timed(step, batch, device, 0, warmup)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        seconds = timed(step, batch, device, warmup, steps)
        peak_gib = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        syncs = host_syncs(step, model, batch, device, warmup + steps)
    except ConfigError as e:  # a backend or setting this machine cannot run
        return {**row, "status": "not runnable", "reason": str(e).split("; use auto")[0]}
    except torch.OutOfMemoryError as e:
        return {**row, "status": "failed", "error": f"out of memory: {str(e).splitlines()[0][:200]}"}
    finally:
        del model, step, batch
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    median = statistics.median(seconds)
    peak = peak_flops(device, "bf16" if cfg.training.dtype != "fp32" else "fp32", cfg.training.allow_tf32, 0)
    return {**row, "status": "passed", "step_s": median, "step_s_all": seconds,
            "images_per_s": batch_size / median, "tokens_per_s": batch_size * tokens / median,
            "model_tflop_per_step": flops / 1e12, "tflops": flops / median / 1e12,
            "mfu": flops / median / peak if peak else None, "peak_memory_gib": peak_gib,
            "host_syncs_per_step": syncs, "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values())}


def not_runnable_here(variant: Variant, device: torch.device) -> str | None:
    if variant.anchor:
        try:
            import diffusers  # noqa: F401
        except ImportError:
            return "diffusers is not installed (pip install -e '.[test]')"
    return None


# ----------------------------------------------------------------------------------------------- the table


def table(rows: list[dict]) -> str:
    def number(value, spec: str) -> str:
        return format(value, spec) if isinstance(value, (int, float)) and not math.isnan(value) else "-"

    lines = ["| model | variant | result | step (s) | images/s | tokens/s | TFLOP/s | MFU | peak GiB | syncs/step "
             "| graph breaks |", "|" + "---|" * 11]
    for r in rows:
        outcome = {"passed": "passed", "failed": f"FAILED: {r.get('error')}",
                   "not runnable": f"not runnable here: {r.get('reason')}"}[r["status"]]
        lines.append(f"| {r['model']} | {r['variant']} | {outcome} | {number(r.get('step_s'), '.4f')} | "
                     f"{number(r.get('images_per_s'), '.2f')} | {number(r.get('tokens_per_s'), '.0f')} | "
                     f"{number(r.get('tflops'), '.2f')} | {number(r.get('mfu'), '.1%')} | "
                     f"{number(r.get('peak_memory_gib'), '.1f')} | {number(r.get('host_syncs_per_step'), 'd')} | "
                     f"{number(r.get('graph_breaks'), 'd')} |")
    return "\n".join(lines)


def machine() -> dict:
    info = {"torch": torch.__version__, "python": sys.version.split()[0], "cpus": os.cpu_count(), "device": "cpu"}
    if torch.cuda.is_available():
        info.update(device=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                    capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                    cudnn=torch.backends.cudnn.version())
    return info


def device_slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower().removeprefix("nvidia ")).strip("_")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("real", "tiny"), default="real", help="released sizes, or tiny (CPU check)")
    parser.add_argument("--models", nargs="*", choices=list(MODELS), help="default: all")
    parser.add_argument("--variants", nargs="*", help="variant names to run (default: all of each model)")
    parser.add_argument("--resolution", type=int, default=RESOLUTION, help="image side in pixels (latents: /8)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row (the median is reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, allocator)")
    parser.add_argument("--overrides", nargs="*", default=[], help="key=value for every row after its variant's, "
                        "e.g. training.train_batch_size=8")
    parser.add_argument("--out", type=Path, help="JSON file (default: benchmarks/train_step_<device>.json)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and args.size == "real":
        parser.error("the released sizes need a CUDA GPU (SD3.5-large is 8B parameters); --size tiny checks the "
                     "benchmark on a CPU")
    info = machine()
    out = args.out or ROOT / "benchmarks" / f"train_step_{device_slug(info['device'])}" \
        f"{'_tiny' if args.size == 'tiny' else ''}.json"
    print(f"training step on {info['device']} (torch {info['torch']}), size {args.size}, {args.warmup} warm-up + "
          f"{args.steps} timed steps per row", flush=True)
    rows = []
    for model_name in args.models or MODELS:
        for variant in variants(model_name):
            if args.variants and variant.name not in args.variants:
                continue
            variant.overrides += args.overrides
            reason, started = not_runnable_here(variant, device), time.perf_counter()
            row = ({"model": model_name, "variant": variant.name, "status": "not runnable", "reason": reason}
                   if reason else measure(model_name, variant, args.size, args.steps, args.warmup, device,
                                          args.resolution))
            rows.append({**row, "seconds": round(time.perf_counter() - started, 1)})  # building, compiling, all steps
            print(f"  {model_name}, {variant.name}: {row['status']}"
                  + (f", {row['step_s']:.4f} s/step" if row["status"] == "passed" else
                     f": {row.get('reason') or row.get('error')}"), flush=True)
    text = table(rows)
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    resolution = args.resolution if args.size == "real" else TINY["resolution"]
    out.write_text(json.dumps({"machine": info, "size": args.size, "resolution": resolution, "warmup": args.warmup,
                               "steps": args.steps, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 1 if any(r["status"] == "failed" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
