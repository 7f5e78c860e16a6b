"""Train an MMDiT with rectified flow. `train` below is the recipe; performance plugins wrap it from `perf/`,
and the parts it composes are built from the config in `configs/build.py`.

    python train_mmdit_stable.py [--config FILE] [key=value ...]
"""

import argparse
import dataclasses
import logging
import sys
import traceback
from contextlib import nullcontext
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch.distributed.tensor import DTensor

from configs.build import (InitialValues, build_collate, build_data, build_model, build_trained_model,
                           build_validation, example_text, holdout_split, text_tokens)
from configs.run_dir import global_batch, prepare_run_dir, save_run_config
from configs.schema import DEFAULT_CONFIG, load_config
from data.loader import check_batches, micro_batches, step_batches, to_device
from errors import ConfigError, InputError
from runtime.export import CheckpointLoras
from models.lora import apply_lora, text_encoder_settings, transformer_settings
from models.rectified_flow import interpolate, per_sample_loss, sample_key
from optim.ema import EMA
from optim.optimizers import build_optimizer, check_installed, learned_group_keys
from optim.schedule import learning_rate, set_learning_rate
from perf.attention import apply_attention_backend, joint_lengths
from perf.batch_sizer import build_batch_sizer
from perf.block_swap import check_block_swap
from perf.checkpoint import Checkpointer, OptimizerState, TrainedWeights
from perf.float8 import check_float8, precompute_scales_after_step
from perf.parallel import apply_parallelism, check_all_parameters_used, check_parallel, sync_gradients, unwrap
from perf.precision import autocast, configure_cuda_math, deterministic_kernels, grad_scaler
from perf.profiler import build_profiler
from runtime.directory_lock import lock_directory
from runtime.distributed import World, destroy_distributed, init_distributed, stop_together, world_from_env
from runtime.metrics import RunLogger, TrainingLog, save_loss_curve
from runtime.nonfinite import NonFiniteGuard
from runtime.outputs import Output
from runtime.preemption import PreemptionHandler, mark_exit
from runtime.quiet_imports import torchao_only_if
from runtime.step_stats import (MemoryStats, SigmaBuckets, StepTimer, Throughput, peak_flops,
                                train_flops_per_sample)

log = logging.getLogger("mmdit")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config over the typed schema")
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. training.max_steps=50")
    args = parser.parse_args(argv)
    world = world_from_env()
    logging.basicConfig(level=logging.INFO if world.is_main else logging.ERROR,  # only rank 0 talks
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout)
    try:
        cfg = load_config(args.config, args.overrides)  # every rank reads the same config and stops alike
        deterministic_kernels(cfg.training.deterministic)
        device = init_distributed(world, resolve_device(cfg.training.device), cfg.parallel.timeout_s,
                                  group_of_one=cfg.parallel.cpu_offload)  # FSDP offloads even one process
        try:
            with stop_together():  # one training per run directory, refused before anything is computed or written
                lock = lock_directory(Path(cfg.logging.output_dir), f"logging.output_dir={cfg.logging.output_dir}",
                                      ConfigError) if world.is_main else nullcontext()
            with lock, torchao_only_if(cfg.float8.enabled or cfg.optimizer.name == "adamw8bit"):  # noise to other runs
                return train(cfg, world, device)
        except BaseException as e:
            # the frames of its traceback hold the run's process groups: let them go with the rest, now, not at
            # exit, when a gloo group freed after its peers have gone can hang or abort the process
            traceback.clear_frames(e.__traceback__)
            raise
        finally:
            destroy_distributed()
    except InputError as e:  # the user's input: one line, once
        if world.is_main:
            log.error("%s: %s", "config error" if isinstance(e, ConfigError) else "input error", e)
        return mark_exit(world.rank, "input-error", status=2)
    except Exception as e:
        if getattr(e, "reported_by_main", False):  # rank 0 prints this rank's traceback (stop_together)
            return 1
        raise


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device=cuda but no CUDA device is available")
    return torch.device("cuda" if name == "auto" and torch.cuda.is_available() else
                        "cpu" if name == "auto" else name)


def train(cfg: DictConfig, world: World, device: torch.device) -> int:
    training, optim = cfg.training, cfg.optimizer
    torch.manual_seed(training.seed)
    batch_size = global_batch(cfg, world.world_size)
    with stop_together():  # checks before anything is put on the device or written; only rank 0 writes
        check_parallel(cfg, world)
        check_float8(cfg.float8, device)
        check_installed(optim)
        dataset, tokenizer = build_data(cfg)
        items, holdout = holdout_split(cfg, dataset)
        check_batches(dataset, items, batch_size)
        model = build_trained_model(cfg, dataset, tokenizer)
        check_block_swap(cfg, model)
        lengths = joint_lengths(dataset.buckets, cfg.model.patch_size, text_tokens(dataset, tokenizer))
        apply_attention_backend(model, training.attention_backend, device, training.dtype, cfg.model.attention_head_dim,
                                lengths, fullgraph=cfg.compile.enabled and cfg.compile.scope == "blocks")
        validation = build_validation(cfg, dataset, tokenizer, holdout, world, device)
        if world.is_main:
            prepare_run_dir(cfg, world.world_size)
    run_dir = Path(cfg.logging.output_dir)

    # checkpointing, compile, block swap, the wrap, and the weights: each rank reads or draws only what it holds
    model = apply_parallelism(model, cfg, world, device, InitialValues(model, training.seed, cfg.model.init_from))
    optimizer = training_optimizer(model, cfg, device)
    ema = EMA(unwrap(model), optim.ema_decay)
    scaler = grad_scaler(device, training.dtype)
    configure_cuda_math(device, training.allow_tf32)
    sizer = build_batch_sizer(cfg, training.train_batch_size, device, world.rank, model)
    guard = NonFiniteGuard(training.max_nonfinite_steps, cfg.logging.log_every)
    states = {"model": TrainedWeights(model, adapters_only=cfg.lora.enabled), "ema": ema,
              "optimizer": OptimizerState(model, optimizer, learned_group_keys(optim.name)), "scaler": scaler,
              "batch_sizer": sizer, "nonfinite_guard": guard}
    checkpointer = Checkpointer(run_dir, cfg.checkpoint, states, checkpoint_meta(cfg, model, world, dataset, items),
                                {"config.yaml": OmegaConf.to_yaml(cfg)}, device, cfg.parallel.timeout_s,
                                CheckpointLoras(run_dir, cfg) if cfg.lora.enabled else None)
    optimizer.register_step_pre_hook(checkpointer.wait_for_staging)  # weights change only once staged
    with stop_together(), checkpointer.closed_on_error():  # a failed start leaves no thread of it running
        start_step = checkpointer.resume()
        if start_step > training.max_steps:
            raise ConfigError(f"training.max_steps={training.max_steps} is below the step of "
                              f"{checkpointer.last_complete}; raise it to continue")
    if start_step == training.max_steps and validation.finished(run_dir, start_step):
        checkpointer.close()
        log.info("%s is already finished at step %d: nothing to do (raise training.max_steps to train it further)",
                 run_dir, start_step)
        return 0
    with stop_together(), checkpointer.closed_on_error():  # a run directory that cannot take it stops every rank
        if world.is_main:
            save_run_config(run_dir, cfg, world.world_size)
    log.info("MMDiT %.2fM params, %.2fM trained; %d items (%d held out); global batch %d over %d process(es) (%s); "
             "%s; steps %d -> %d; run dir %s", sum(p.numel() for p in unwrap(model).transformer.parameters()) / 1e6,
             sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6, len(items), len(holdout),
             batch_size, world.world_size, cfg.parallel.strategy if world.distributed else "one process",
             f"precision {training.dtype}" + (" with a GradScaler" if scaler.is_enabled() else ""), start_step,
             training.max_steps, run_dir)

    data = cfg.data
    batches = step_batches(dataset, build_collate(cfg, dataset, tokenizer), items, batch_size, training.seed,
                           world.rank, world.world_size, start_step, training.max_steps, device, data.num_workers,
                           data.pin_memory, data.prefetch_factor)
    timer, sigma_losses = StepTimer(device), SigmaBuckets(device, datasets=getattr(dataset, "names", ()))
    profiler = build_profiler(cfg.profiler, run_dir / "tensorboard", world.rank, device)
    with RunLogger(run_dir, cfg, world.is_main, start_step) as logger, PreemptionHandler(cfg.parallel.timeout_s) \
            as preemption, profiler:
        metrics = TrainingLog(logger, cfg.logging.log_every, start_step, training.max_steps,
                              throughput(cfg, dataset, tokenizer, batch_size, world, device),
                              [timer, sigma_losses, MemoryStats(device, model, optimizer, ema), sizer, guard,
                               checkpointer])
        done, preempted = start_step, False
        model.train()  # for the whole run: validation switches to eval and back
        for batch in batches:
            step = batch["step"]
            batch = to_device(batch, device)
            timer.lap("data")
            lr = learning_rate(optim.schedule, step, optim.lr, optim.warmup_steps, training.max_steps,
                               optim.min_lr_ratio)
            set_learning_rate(optimizer, lr)
            loss = sizer.run(step, lambda micro_batch, reduce: forward_backward(
                model, batch, cfg, scaler, sigma_losses, micro_batch, reduce), model, sigma_losses)
            if step == start_step:
                check_all_parameters_used(model)
            timer.lap("forward_backward")
            grad_norm = optimizer_step(model, optimizer, scaler, ema, guard, step, optim.grad_clip_norm)
            timer.lap("optimizer")
            profiler.step()
            done = step + 1
            metrics.step(done, loss, grad_norm, lr)
            if guard.diverged(done, checkpointer.last_complete):
                checkpointer.close()
                return 1
            if validation.due(done):
                validation(model, ema, done, run_dir, logger)
            checkpointer.save(done)
            if preemption.should_stop():
                preempted = True
                break
            timer.lap("logging_and_checkpoint")
        checkpointer.save(done, last=True)
        checkpointer.close()
        if checkpointer.last_error:
            log.error("the final checkpoint was not written; exiting with an error")
            return 1
        if preempted:
            log.info("pre-empted: checkpoint of step %d written; exit %d (not finished: the same command resumes)",
                     done, preemption.exit_status)
            return mark_exit(world.rank, "preempted", status=preemption.exit_status)
        validation.at_end(model, ema, run_dir, logger)
    if world.is_main:
        curve = run_dir / "loss_curve.png"
        Output("loss curve").write(curve, save_loss_curve, run_dir / "metrics.jsonl", curve, partial=(curve,))
        log.info("done: run directory %s", run_dir)
    return 0


def forward_backward(model, batch: dict, cfg: DictConfig, scaler, sigma_losses: SigmaBuckets, micro_batch: int,
                     reduce: bool = True) -> torch.Tensor:
    """Loss and gradients of this rank's share of one optimizer step, in micro-batches.

    Each sample's loss (its masked mean where the data has loss masks: models/rectified_flow.py) is multiplied
    by its dataset's loss weight (1 unless a mixture sets one) and divided by the rank's sample count, so
    gradients are a weighted mean over the rank's samples whatever the micro-batch split. The last micro-step
    reduces the gradients over ranks as the strategy does (perf/parallel.py), unless `reduce` is off (the batch
    sizer then reduces them itself)."""
    # ops that draw from the global RNG (LoRA dropout) then replay the same after a resume or an OOM retry
    torch.manual_seed(sample_key(cfg.training.seed, batch["step"], f"global-rng/{batch['first_position']}"))
    samples = len(batch["latents"])
    total = torch.zeros((), device=batch["latents"].device)
    parts = list(micro_batches(batch, micro_batch))
    for i, part in enumerate(parts):
        x0, noise, sigma = part["latents"], part["noise"], part["sigma"]
        with sync_gradients(model, last_micro_step=reduce and i == len(parts) - 1):
            with autocast(x0.device, cfg.training.dtype):
                v_pred = model(interpolate(x0, noise, sigma), sigma, part["text"], references=part.get("references"))
            losses = per_sample_loss(v_pred, x0, noise, part.get("loss_mask"))  # the target's: references are clean
            loss = (losses * part.get("loss_weight", 1.0)).sum() / samples
            scaler.scale(loss * cfg.loss.loss_scale).backward()
        total += loss.detach()
        sigma_losses.add(sigma, losses, part.get("source"))
    return total


def optimizer_step(model, optimizer, scaler, ema: EMA, guard: NonFiniteGuard, step: int,
                   clip_norm: float) -> torch.Tensor:
    """Unscale, clip, step (unless the gradient norm is non-finite: the guard skips it on the device), then
    update the EMA; returns the gradient norm before clipping."""
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm or float("inf"))
    if isinstance(grad_norm, DTensor):  # sharded gradients: the norm over all shards
        grad_norm = grad_norm.full_tensor()
    applied = guard.step(optimizer, scaler, grad_norm, step)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    ema.update(step, applied)
    return grad_norm


def training_optimizer(model, cfg: DictConfig, device: torch.device) -> torch.optim.Optimizer:
    """optimizer.name's optimizer over the model as it trains (wrapped, sharded), float8's scales refreshed after
    each step where FSDP all-gathers in float8."""
    optim = cfg.optimizer
    optimizer = build_optimizer(unwrap(model), optim, device, lr_scales(cfg),
                                warmup=optim.schedule != "constant" and optim.warmup_steps > 0)
    precompute_scales_after_step(model, optimizer)
    return optimizer


def lr_scales(cfg: DictConfig) -> dict[str, float]:
    """The text encoders' adapters train at lora.text_encoder_lr (default optimizer.lr): a factor on the
    schedule's learning rate, so they warm up and decay with the rest."""
    lora = cfg.lora
    scale = 1.0 if lora.text_encoder_lr is None else lora.text_encoder_lr / cfg.optimizer.lr
    return {f"text_encoder.{part}.": scale for part in lora.text_encoders}


def checkpoint_meta(cfg: DictConfig, model, world: World, dataset, items) -> dict:
    """What a checkpoint records beside the state: what export needs, without the data or the config (of the data,
    what a LoRA file's metadata says: the training items and the precompute resolution)."""
    parts = getattr(dataset, "datasets", [dataset])  # a mixture's
    resolution = max((p.index["resolution"] for p in parts if "resolution" in getattr(p, "index", {})), default=None)
    return {"family": cfg.model.family, "mmdit": dataclasses.asdict(unwrap(model).transformer.cfg),
            "lora": transformer_settings(cfg.lora, unwrap(model).transformer) if cfg.lora.enabled else None,
            "text_encoder_lora": text_encoder_settings(cfg.lora) if cfg.lora.enabled else {},
            "world_size": world.world_size, "strategy": cfg.parallel.strategy,
            "data": {"items": len(items), "resolution": resolution}}


def throughput(cfg: DictConfig, dataset, tokenizer, batch_size: int, world: World, device: torch.device) -> Throughput:
    """Samples, tokens and FLOPs per second; FLOPs counted once on a meta-device copy of the model, by the rank
    that reports them (the count takes seconds of CPU for a large model)."""
    count = lambda bucket: joint_lengths([bucket], cfg.model.patch_size, text_tokens(dataset, tokenizer))[0]  # noqa
    target, references = max(dataset.buckets, key=count)  # the longest sequence
    latents = lambda size: torch.zeros(1, dataset.latent_channels, *size)  # noqa: E731
    flops = train_flops_per_sample(
        lambda: apply_lora(build_model(cfg, dataset, tokenizer), cfg.lora),
        lambda: (latents(target), torch.full((1,), 0.5), example_text(dataset, tokenizer), None,
                 tuple(map(latents, references)))) if world.is_main else None
    peak = peak_flops(device, cfg.training.dtype, cfg.training.allow_tf32, cfg.logging.peak_tflops)
    return Throughput(batch_size, world.world_size, count((target, references)), flops, peak)


if __name__ == "__main__":
    sys.exit(main())
