"""Train an MMDiT with rectified flow. The loop below is the recipe; performance plugins wrap it from `perf/`.

    python train_mmdit_stable.py [--config FILE] [key=value ...]
"""

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor

from configs.build import build_data, build_model, build_trained_model, example_text, holdout_split
from configs.schema import DEFAULT_CONFIG, ConfigError, load_config
from data.loader import check_batches, step_batches
from models.lora import adapter_settings, apply_lora
from models.rectified_flow import (draw_sample_noise, interpolate, per_sample_loss, sample_key,
                                                training_sigmas)
from optim.adamw import build_adamw
from optim.ema import EMA
from optim.schedule import warmup_cosine
from perf.attention import apply_attention_backend
from perf.batch_sizer import build_batch_sizer
from perf.checkpoint import Checkpointer, NullCheckpointer, load_checkpoint, read_meta, stored_names
from perf.distributed import (World, broadcast_from_main, destroy_distributed, first_error,
                                           host_group, init_distributed, mean_over_ranks, world_from_env)
from perf.metrics import RunLogger, save_loss_curve
from perf.nonfinite import NonFiniteGuard
from perf.parallel import (apply_parallelism, check_all_parameters_used, check_parallel, is_sharded,
                                        sync_gradients, unwrap)
from perf.precision import autocast, configure_cuda_math, grad_scaler
from perf.preemption import PreemptionHandler, mark_preempted
from perf.profiler import build_profiler
from perf.step_stats import (SigmaBuckets, StepTimer, memory_stats, peak_flops, throughput_metrics,
                                          train_flops_per_sample, train_state_gib)
from perf.validation import build_validation

log = logging.getLogger("mmdit")
TEXT_KEYS = ("input_ids", "prompt_embeds", "pooled_prompt_embeds")  # a batch's text, tokenized or encoded
# What an existing run directory's checkpoints and data position mean; a resume must not change them.
RUN_IDENTITY_KEYS = ("model", "text_encoder", "lora", "data.name", "data.path", "data.aspect_buckets",
                     "data.num_items", "data.holdout", "training.seed")


def setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout)


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device=cuda but no CUDA device is available")
    return torch.device("cuda" if name == "auto" and torch.cuda.is_available() else
                        "cpu" if name == "auto" else name)


def prepare_run_dir(cfg: DictConfig, world_size: int) -> Path:
    """Create the run directory, or check that an existing one belongs to this config before reusing it.
    The resolved config is written only once the resume is known to be possible (`save_config`)."""
    run_dir = Path(cfg.logging.output_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"logging.output_dir={run_dir} is a file, not a directory")
    saved = run_dir / "config.yaml"
    if saved.is_file():
        try:
            old = load_config(saved, resolve=False)  # over the schema: keys added since read as their defaults
            old_world = json.loads((run_dir / "world.json").read_text())["world_size"] \
                if (run_dir / "world.json").is_file() else 1
        except Exception as e:
            raise ConfigError(f"{saved} or world.json is unreadable ({e}); fix it or choose another "
                              f"logging.output_dir") from None
        changed = identity_changes(old, cfg)
        if global_batch(old, old_world) != global_batch(cfg, world_size):
            changed.append(f"global batch (training.train_batch_size * training.gradient_accumulation_steps * "
                           f"world size): {global_batch(old, old_world)} -> {global_batch(cfg, world_size)}")
        if changed:
            raise ConfigError(f"{run_dir} holds a run with other settings that its checkpoints depend on "
                              f"({'; '.join(changed)}); restore them, or choose another logging.output_dir "
                              f"(nothing was changed on disk)")
        old_flat, new_flat = flatten(OmegaConf.to_container(old)), flatten(OmegaConf.to_container(cfg))
        for key in sorted(k for k in new_flat if old_flat.get(k) != new_flat[k]):
            log.info("config change since the run's last start: %s %s -> %s", key, old_flat.get(key), new_flat[key])
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        raise ConfigError(f"logging.output_dir={run_dir} cannot be created: {e}") from None
    return run_dir


def identity(cfg: DictConfig, key: str):
    """The part of the config under `key` that a resume must keep. Where full training's weights started does
    not count (checkpoints hold all weights); under LoRA it does (they hold only the adapters)."""
    value = OmegaConf.select(cfg, key)
    if isinstance(value, DictConfig):
        value = OmegaConf.to_container(value)
        if not OmegaConf.select(cfg, "lora.enabled"):
            value.pop("init_from", None)
    return value


def identity_changes(old: DictConfig, new: DictConfig) -> list[str]:
    """Each setting of the run's identity that differs, as 'key: old -> new'."""
    changes = []
    for key in RUN_IDENTITY_KEYS:
        before, now = identity(old, key), identity(new, key)
        before = flatten(before, f"{key}.") if isinstance(before, dict) else {key: before}
        now = flatten(now, f"{key}.") if isinstance(now, dict) else {key: now}
        changes += [f"{k}: {before.get(k)} -> {now.get(k)}" for k in sorted(before.keys() | now.keys())
                    if before.get(k) != now.get(k)]
    return changes


def save_config(run_dir: Path, cfg: DictConfig, world_size: int) -> None:
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    (run_dir / "world.json").write_text(json.dumps({"world_size": world_size, "strategy": cfg.parallel.strategy}))


def global_batch(cfg: DictConfig, world_size: int = 1) -> int:
    """Samples per optimizer step; the data order and noise of every step depend on it."""
    return cfg.training.train_batch_size * cfg.training.gradient_accumulation_steps * world_size


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def lr_at(step: int, cfg: DictConfig) -> float:
    o = cfg.optimizer
    return warmup_cosine(step, o.lr, o.warmup_steps, cfg.training.max_steps, o.min_lr_ratio)


def drop_captions(text: dict, drop: torch.Tensor, empty: dict | None) -> dict:
    """Replace dropped samples' captions by the empty caption: all padding for token ids; for precomputed
    embeddings the encoding of "" (what SD3 pipelines feed the unconditional branch), else zeros."""
    if "input_ids" in text:
        return {"input_ids": torch.where(drop[:, None], 0, text["input_ids"])}
    empty = empty or {k: torch.zeros_like(v[:1]) for k, v in text.items()}
    return {k: torch.where(drop.view(-1, *[1] * (v.dim() - 1)), empty[k].to(v.dtype), v) for k, v in text.items()}


def forward_backward(model, batch: dict, cfg: DictConfig, device: torch.device, scaler, sigma_losses: SigmaBuckets,
                     micro_batch: int, reduce: bool = True) -> torch.Tensor:
    """Loss and gradients of this rank's share of one optimizer step, in micro-batches.

    Each sample's loss is divided by the rank's sample count, so gradients are a plain mean over the
    rank's samples whatever the micro-batch split. The last micro-step reduces the gradients over ranks as
    the strategy does (perf/parallel.py), unless `reduce` is off (the batch sizer then reduces them itself)."""
    step, positions = int(batch["step"]), batch["position"]
    # ops that draw from the global RNG (LoRA dropout) then replay the same after a resume or an OOM retry
    torch.manual_seed(sample_key(cfg.training.seed, step, f"global-rng/{int(positions[0])}"))
    x0_all = batch["latents"].to(device, non_blocking=True)
    text_all = {k: batch[k].to(device) for k in TEXT_KEYS if k in batch}
    empty_text = {k: batch[f"empty_{k}"].to(device) for k in TEXT_KEYS if f"empty_{k}" in batch} or None
    draws = draw_sample_noise(cfg.training.seed, step, positions, tuple(x0_all.shape[1:])).to(device)
    f = cfg.flow
    sigma_all = training_sigmas(draws, f.sigma_sampling, f.logit_mean, f.logit_std, f.shift, f.mode_scale)
    drop_all = draws.dropout_uniform < cfg.data.caption_dropout
    total = torch.zeros((), device=device)
    sigmas, sample_losses = [], []
    starts = range(0, len(positions), micro_batch)
    for start in starts:
        part = slice(start, start + micro_batch)
        x0, noise, sigma = x0_all[part], draws.noise[part], sigma_all[part]
        text = drop_captions({k: v[part] for k, v in text_all.items()}, drop_all[part], empty_text)
        with sync_gradients(model, last_micro_step=reduce and start == starts[-1]):
            with autocast(device, cfg.training.dtype):
                v_pred = model(interpolate(x0, noise, sigma), sigma, text)
            losses = per_sample_loss(v_pred, x0, noise)
            loss = losses.sum() / len(positions)
            scaler.scale(loss * cfg.loss.loss_scale).backward()
        total += loss.detach()
        sigmas.append(sigma)
        sample_losses.append(losses.detach())
    sigma_losses.add(torch.cat(sigmas), torch.cat(sample_losses))  # only once the whole step succeeded
    return total


def optimizer_step(model, optimizer, scaler, ema: EMA, step: int, clip_norm: float,
                   guard: bool) -> tuple[torch.Tensor, bool]:
    """Unscale, clip, step, then update the EMA; returns the gradient norm before clipping and whether the
    step was applied. With the guard, a non-finite gradient norm (a NaN/inf loss gives one) skips the step:
    weights, optimizer state and EMA stay as they were; in fp16 the scaler still lowers its scale."""
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm or float("inf"))
    if isinstance(grad_norm, DTensor):  # sharded gradients: the norm over all shards
        grad_norm = grad_norm.full_tensor()
    applied = bool(torch.isfinite(grad_norm)) if guard else True  # the guard's one host sync per step
    if applied:
        scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if applied:
        ema.update(step)
    return grad_norm, applied


def due(done: int, every: int, last: int) -> bool:
    """Periodic work at every `every`-th step; the last step is handled after the loop."""
    return every > 0 and done % every == 0 and done != last


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config over the typed schema")
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. training.max_steps=50")
    args = parser.parse_args(argv)
    world = world_from_env()
    setup_logging(world.rank)
    try:
        cfg = load_config(args.config, args.overrides)
        device = resolve_device(cfg.training.device)
    except ConfigError as e:  # every rank reads the same config, so every rank stops here
        log.error("config error: %s", e)
        return 2
    device = init_distributed(world, device, cfg.parallel.timeout_s)
    try:
        return train(cfg, world, device)
    finally:
        destroy_distributed()


def train(cfg: DictConfig, world: World, device: torch.device) -> int:
    t, o = cfg.training, cfg.optimizer
    torch.manual_seed(t.seed)
    run_dir, error = Path(cfg.logging.output_dir), None
    try:  # the same on every rank; only rank 0 touches the run directory, the others learn its verdict
        check_parallel(cfg, world)
        dataset, tokenizer = build_data(cfg)
        items, holdout = holdout_split(cfg, dataset)
        check_batches(dataset, items, global_batch(cfg, world.world_size))
        model = build_trained_model(cfg, dataset, tokenizer)
        validation = build_validation(cfg, dataset, tokenizer, holdout, world, device)
        if world.is_main:
            prepare_run_dir(cfg, world.world_size)
    except ValueError as e:  # ConfigError, and the model's own checks (its sizes, LoRA targets)
        error = str(e)
    error = first_error(error)
    if error:
        log.error("config error: %s", error)
        return 2

    batch_size = global_batch(cfg, world.world_size)
    model = apply_parallelism(model, cfg, world, device)  # on the device; checkpointing, compile, the wrap
    optimizer = build_adamw(unwrap(model), o.lr, (o.beta1, o.beta2), o.eps, o.weight_decay, device, o.fused)
    ema = EMA(unwrap(model), o.ema_decay)
    scaler = grad_scaler(device, t.dtype)
    configure_cuda_math(device, t.allow_tf32)
    log.info("device %s, precision %s%s", device, t.dtype, " with a GradScaler" if scaler.is_enabled() else "")
    apply_attention_backend(t.attention_backend, device, t.dtype, cfg.model.attention_head_dim)
    checkpointer = build_checkpointer(cfg, world, run_dir, model)
    resume_from = broadcast_from_main(checkpointer.last_complete)  # every rank loads rank 0's choice
    sizer = build_batch_sizer(cfg, t.train_batch_size, device, world.rank, model)
    error = None
    try:
        start_step = resume(resume_from, model, ema, optimizer, scaler, sizer, checkpointer)
    except ConfigError as e:
        error = str(e)
    error = first_error(error)
    if error:
        log.error("config error: %s", error)
        return 2
    if start_step > t.max_steps:
        log.error("config error: training.max_steps=%d is below the step of %s; raise it to continue",
                  t.max_steps, resume_from)
        return 2
    if world.is_main:
        save_config(run_dir, cfg, world.world_size)
    log.info("MMDiT %.2fM params, %.2fM trained; %d items (%d held out); global batch %d over %d process(es) "
             "(%s); steps %d -> %d; run dir %s", sum(p.numel() for p in unwrap(model).transformer.parameters()) / 1e6,
             sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6, len(items), len(holdout),
             batch_size, world.world_size, cfg.parallel.strategy if world.distributed else "one process", start_step,
             t.max_steps, run_dir)
    d = cfg.data
    batches = step_batches(dataset, tokenizer, items, batch_size, t.seed, world.rank, world.world_size, start_step,
                           t.max_steps, device, d.num_workers, d.pin_memory, d.prefetch_factor)
    shape = (dataset.latent_channels, *dataset.latent_sizes[-1])  # the largest size, for FLOPs

    done, preempted = start_step, False
    model.train()  # for the whole run: validation switches to eval and back
    guard = NonFiniteGuard(t.max_nonfinite_steps)
    preemption = PreemptionHandler()
    text_tokens = next(iter(example_text(dataset, tokenizer).values())).shape[1]
    tokens_per_sample = (shape[1] // cfg.model.patch_size) * (shape[2] // cfg.model.patch_size) + text_tokens
    flops_per_sample = train_flops_per_sample(
        lambda: apply_lora(build_model(cfg, dataset, tokenizer), cfg.lora),
        lambda: (torch.zeros(1, *shape), torch.full((1,), 0.5), example_text(dataset, tokenizer)))
    peak = peak_flops(device, t.dtype, t.allow_tf32, cfg.logging.peak_tflops)
    timer, sigma_losses, window = StepTimer(device), SigmaBuckets(device), Throughput(start_step)
    profiler = build_profiler(cfg.profiler, run_dir / "tensorboard",
                              world.rank, device)
    with RunLogger(run_dir, cfg, world.is_main, start_step) as logger, profiler:
        try:
            for batch in batches:
                timer.lap("data")
                step = int(batch["step"])
                checkpointer.report_errors()
                lr = lr_at(step, cfg)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                loss = sizer.run(step, lambda micro_batch, reduce: forward_backward(
                    model, batch, cfg, device, scaler, sigma_losses, micro_batch, reduce), model, sigma_losses)
                if step == start_step:
                    check_all_parameters_used(model)
                timer.lap("forward_backward")
                grad_norm, applied = optimizer_step(model, optimizer, scaler, ema, step, o.grad_clip_norm,
                                                     guard.enabled)
                timer.lap("optimizer")
                if guard.diverged(applied, step + 1, loss, grad_norm, checkpointer.last_complete):
                    checkpointer.close()
                    return 1
                profiler.step()
                done = step + 1

                if done % cfg.logging.log_every == 0 or done == t.max_steps:
                    samples_per_s = batch_size * window.steps_per_s(done)
                    record = {"loss": mean_over_ranks(loss).item(), "lr": lr, "grad_norm": grad_norm.item(),
                              "skipped_steps": guard.skipped, **sigma_losses.read(),
                              **throughput_metrics(samples_per_s, world.world_size, tokens_per_sample,
                                                   flops_per_sample, peak),
                              **timer.read(), **memory_stats(device), **sizer.metrics(),
                              "memory/train_state_gib": train_state_gib(model, optimizer, ema),
                              "checkpoint_stall_s": checkpointer.last_stall_s}
                    logger.scalars(done, record)
                    log.info("%s loss %.4f lr %.2e grad %.3f %.0f img/s%s", progress(done, start_step, t.max_steps,
                             window), record["loss"], lr, record["grad_norm"], samples_per_s,
                             f" MFU {record['mfu']:.1%}" if peak else "")
                if due(done, cfg.validation.every, t.max_steps):
                    validation(model, ema, done, run_dir, logger)
                if due(done, cfg.checkpoint.every, t.max_steps):
                    save(checkpointer, done, model, ema, optimizer, scaler, sizer, cfg)
                if preemption.should_stop(device):
                    preempted = True
                    break
                timer.lap("logging_and_checkpoint")
            save(checkpointer, done, model, ema, optimizer, scaler, sizer, cfg)  # the final step is always saved
            checkpointer.close()
        finally:
            preemption.close()
        if first_error(checkpointer.last_error):
            log.error("the final checkpoint was not written; exiting with an error")
            return 1
        if preempted:
            log.info("pre-empted: checkpoint of step %d written, exiting cleanly", done)
            mark_preempted(world.rank)
            return 0
        if validation.at_end():
            metrics = validation(model, ema, t.max_steps, run_dir, logger)
            if "fidelity/color" in metrics:
                fidelity = {k.removeprefix("fidelity/"): v for k, v in metrics.items() if k.startswith("fidelity/")}
                (run_dir / "fidelity.json").write_text(json.dumps(fidelity, indent=1))
    if world.is_main:
        save_loss_curve(run_dir / "metrics.jsonl", run_dir / "loss_curve.png")
        log.info("done: run directory %s", run_dir)
    return 0


class Throughput:
    """Optimizer steps per second since the last call; the run's elapsed time for the estimate of what is left."""

    def __init__(self, start_step: int):
        self.start = self.last = time.perf_counter()
        self.last_step = start_step

    def steps_per_s(self, step: int) -> float:
        now = time.perf_counter()
        rate = (step - self.last_step) / max(now - self.last, 1e-9)
        self.last, self.last_step = now, step
        return rate


def progress(done: int, start: int, total: int, window: Throughput, width: int = 20) -> str:
    filled = round(width * done / total)
    elapsed = window.last - window.start
    left = elapsed / max(done - start, 1) * (total - done)
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {elapsed:.0f}s <{left:.0f}s"


def build_checkpointer(cfg: DictConfig, world: World, run_dir: Path, model):
    """Sharded models: every rank writes its own shards (over a gloo group of the checkpointer's own, so the
    background writer's collectives never meet the training thread's). Otherwise rank 0 writes it all."""
    c = cfg.checkpoint
    if is_sharded(model):
        group = host_group(cfg.parallel.timeout_s)
        return Checkpointer(run_dir, c.keep_last, c.async_save, c.fail_on_error, group)
    return Checkpointer(run_dir, c.keep_last, c.async_save, c.fail_on_error) if world.is_main else NullCheckpointer()


def trained_state(model) -> dict[str, torch.Tensor]:
    """The weights a checkpoint holds: all of them, or under LoRA only the adapters (the frozen base is
    rebuilt from the config and model.init_from). Sharded weights are DTensors: each rank holds its part."""
    model = unwrap(model)
    if all(p.requires_grad for p in model.parameters()):
        return model.state_dict()
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def checkpoint_state(model, ema: EMA, optimizer) -> dict:
    """The live tensors a checkpoint holds (loading fills them in place); AdamW state keyed by parameter name,
    so that it maps onto any sharding."""
    return {"model": trained_state(model), "ema": ema.state_dict(),
            "optimizer": get_optimizer_state_dict(unwrap(model), optimizer)}


def save(checkpointer: Checkpointer, step: int, model, ema: EMA, optimizer, scaler, sizer, cfg: DictConfig) -> None:
    meta = {"step": step, "scaler": scaler.state_dict(), "batch_sizer": sizer.state_dict(),
            "mmdit": dataclasses.asdict(unwrap(model).transformer.cfg),  # what export needs, without the data
            "lora": adapter_settings(cfg.lora) if cfg.lora.enabled else None,
            "world_size": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
            "strategy": cfg.parallel.strategy}
    checkpointer.save(step, checkpoint_state(model, ema, optimizer), meta, {"config.yaml": OmegaConf.to_yaml(cfg)})


def resume(path: Path | None, model, ema: EMA, optimizer, scaler, sizer, checkpointer) -> int:
    """Restore everything exact resumption needs, whatever world size and strategy wrote the checkpoint; the
    data position and noise follow from the step."""
    if path is None:
        return 0
    meta, state = read_meta(path), checkpoint_state(model, ema, optimizer)
    expected, stored = set(state["model"]), stored_names(path, "model")
    if stored != expected:
        raise ConfigError(f"{path} holds other weights than this model trains: missing {sorted(expected - stored)[:5]}, "
                          f"unexpected {sorted(stored - expected)[:5]}")
    configured = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    load_checkpoint(path, state, group=checkpointer.group if is_sharded(model) else None)
    set_optimizer_state_dict(unwrap(model), optimizer, state["optimizer"])
    for group, settings in zip(optimizer.param_groups, configured):
        group.update(settings)  # betas, eps, weight decay come from today's config, not the checkpoint's
    if scaler.is_enabled() and not meta["scaler"]:
        log.warning("the checkpoint was not trained in fp16: the fp16 grad scaler starts fresh")
    else:
        scaler.load_state_dict(meta["scaler"])
    sizer.load_state_dict(meta.get("batch_sizer", {}))
    log.info("resumed from %s (written by %s over %d process(es))", path, meta.get("strategy", "ddp"),
             meta.get("world_size", 1))
    return meta["step"]


if __name__ == "__main__":
    sys.exit(main())
