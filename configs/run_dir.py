"""The run directory and what a new start may change in it.

A run directory holds the resolved config of its last start (`config.yaml`) and `run.json` (the format, world
size and strategy). Starting again resumes it, as long as what its checkpoints and data position mean stays
the same: the model, the data, the seed, the optimizer and the global batch (`RUN_IDENTITY_KEYS`). Anything else
(more steps, another learning rate, another micro-batch split, world size or strategy) is logged and applied. A
directory of another run, or of an earlier version of this trainer, is refused untouched, with each difference named.
"""

import json
import logging
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from configs.schema import load_config
from data.latents import publish_text
from errors import ConfigError
from formats import check_format
from runtime.directory_lock import unwritable, writable_directory

log = logging.getLogger("mmdit")
RUN_FORMAT = 2  # run.json's "format"; directories of format 1 (before run.json) are refused
RUN_INFO = "run.json"
# What an existing run directory's checkpoints and data position mean (and whose optimizer state they hold); a
# resume must not change them.
RUN_IDENTITY_KEYS = ("model", "text_encoder", "lora", "data.name", "data.path", "data.datasets", "data.use_masks",
                     "data.aspect_buckets", "data.text_encoding", "data.num_items", "data.holdout", "training.seed",
                     "optimizer.name")


def global_batch(cfg: DictConfig, world_size: int = 1) -> int:
    """Samples per optimizer step; the data order and noise of every step depend on it."""
    return cfg.training.train_batch_size * cfg.training.gradient_accumulation_steps * world_size


def prepare_run_dir(cfg: DictConfig, world_size: int) -> Path:
    """Create the run directory, or check that an existing one belongs to this config before reusing it; either
    must be writable. The resolved config is written only once the resume is known to be possible
    (`save_run_config`)."""
    run_dir = Path(cfg.logging.output_dir)
    if (run_dir / "config.yaml").is_file():
        check_same_run(run_dir, cfg, world_size)
    writable_directory(run_dir, f"logging.output_dir={run_dir}", ConfigError)
    return run_dir


def check_same_run(run_dir: Path, cfg: DictConfig, world_size: int) -> None:
    info = json.loads((run_dir / RUN_INFO).read_text()) if (run_dir / RUN_INFO).is_file() else {}
    check_format(info, RUN_FORMAT, f"the run directory {run_dir}", "this trainer",
                 "nothing was changed. Train into a new logging.output_dir, or finish this run with the "
                 "version that started it", ConfigError)
    try:
        old = load_config(run_dir / "config.yaml", resolve=False)
    except ConfigError as e:
        raise ConfigError(f"{run_dir}/config.yaml does not load ({e}); fix it or choose another logging.output_dir")
    changes = identity_changes(old, cfg)
    remedies = [f"restore {'it' if len(changes) == 1 else 'them'} (key=old value)"] if changes else []
    batch = global_batch(old, info["world_size"])
    if batch != global_batch(cfg, world_size):
        changes.append(f"global batch (training.train_batch_size * training.gradient_accumulation_steps * "
                       f"world size): {batch} -> {global_batch(cfg, world_size)}")
        remedies.append(keep_global_batch(batch, world_size, cfg.training.train_batch_size))
    if changes:
        raise ConfigError(f"{run_dir} holds a run with other settings that its checkpoints depend on "
                          f"({'; '.join(changes)}); {'; '.join(remedies)}; or choose another logging.output_dir "
                          f"(nothing was changed on disk)")
    old_keys, new_keys = flat_keys(OmegaConf.to_container(old)), flat_keys(OmegaConf.to_container(cfg))
    for key in sorted(k for k in new_keys if old_keys.get(k) != new_keys[k]):
        log.info("config change since the run's last start: %s %s -> %s", key, old_keys.get(key), new_keys[key])


def keep_global_batch(batch: int, world_size: int, micro_batch: int) -> str:
    """How `world_size` processes train a run's global batch again (the overrides, the micro-batch at most
    `micro_batch`), or the process counts that can."""
    if batch % world_size:
        counts = ", ".join(str(n) for n in range(1, batch + 1) if batch % n == 0)
        return (f"{world_size} processes cannot split a global batch of {batch}: resume on a process count that "
                f"divides it ({counts})")
    per_process = batch // world_size
    micro = max(m for m in range(1, min(micro_batch, per_process) + 1) if per_process % m == 0)
    return (f"keep the global batch with training.train_batch_size={micro} "
            f"training.gradient_accumulation_steps={per_process // micro}")


def identity_part(cfg: DictConfig, key: str):
    """The part of the config under `key` that a resume must keep. Where full training's weights started does
    not count (checkpoints hold all weights); under LoRA it does (they hold only the adapters)."""
    value = OmegaConf.select(cfg, key)
    if isinstance(value, ListConfig):
        value = OmegaConf.to_container(value)
    if isinstance(value, DictConfig):
        value = OmegaConf.to_container(value)
        if not OmegaConf.select(cfg, "lora.enabled"):
            value.pop("init_from", None)
        if key == "lora":  # a learning rate, like optimizer.lr
            value.pop("text_encoder_lr", None)
    return value


def identity_changes(old: DictConfig, new: DictConfig) -> list[str]:
    """Each setting of the run's identity that differs, as 'key: old -> new'."""
    changes = []
    for key in RUN_IDENTITY_KEYS:
        before, now = identity_part(old, key), identity_part(new, key)
        before = flat_keys(before, f"{key}.") if isinstance(before, dict) else {key: before}
        now = flat_keys(now, f"{key}.") if isinstance(now, dict) else {key: now}
        changes += [f"{k}: {before.get(k)} -> {now.get(k)}" for k in sorted(before.keys() | now.keys())
                    if before.get(k) != now.get(k)]
    return changes


def save_run_config(run_dir: Path, cfg: DictConfig, world_size: int) -> None:
    """config.yaml and run.json, each whole or not at all (a temporary file, renamed): a full disk must not
    leave a cut record of what the directory's checkpoints mean. A directory where they cannot be written is
    refused, before any training."""
    info = {"format": RUN_FORMAT, "world_size": world_size, "strategy": cfg.parallel.strategy}
    records = {"config.yaml": OmegaConf.to_yaml(cfg), RUN_INFO: json.dumps(info)}
    for name, text in records.items():
        try:
            publish_text(run_dir / name, text)
        except OSError as e:
            raise ConfigError(unwritable(f"logging.output_dir={run_dir}", run_dir, e)) from None


def flat_keys(tree: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}"""
    out = {}
    for key, value in tree.items():
        out.update(flat_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out
