import json
from pathlib import Path

import pytest
import torch

torch.set_num_threads(2)

TINY = ["model.patch_size=4", "model.num_layers=2", "model.num_attention_heads=2", "model.attention_head_dim=16",
        "text_encoder.dim=32", "text_encoder.num_heads=2", "training.train_batch_size=8", "optimizer.warmup_steps=2",
        "sampling.steps=2", "sampling.grid_size=4", "logging.log_every=1", "checkpoint.every=0"]


def metric_rows(run_dir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_weights(run_dir: Path, part: str = "model") -> dict[str, torch.Tensor]:
    """The trained weights (or their EMA) of a run's newest checkpoint, whole, however it was sharded."""
    from perf.checkpoint import checkpoints, read_checkpoint
    return read_checkpoint(checkpoints(run_dir)[-1], (part,))[0][part]


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in metric_rows(run_dir) if "loss" in r]


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Non-zero everywhere (adaLN-Zero initialises gates to zero, which would hide mapping errors)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)



@pytest.fixture
def tiny(tmp_path):
    """Overrides for a seconds-long run in a fresh run directory; extend with more key=value strings."""
    def make(*extra: str, run: str = "run") -> list[str]:
        return [*TINY, f"logging.output_dir={tmp_path / run}", *extra]
    return make


@pytest.fixture(autouse=True)
def default_attention_kernel():
    """A run may select another attention kernel for the process; tests start from the default."""
    from models.attention import sdpa_attention, set_attention_kernel
    yield
    set_attention_kernel(sdpa_attention)


LATENT_DIMS = {"channels": 4, "tokens": 6, "joint": 24, "pooled": 16}


def write_latent_shards(directory: Path, sizes=((8, 8),), per_shard: int = 12, seed: int = 0,
                        empty_prompt: bool = True, flipped: bool = False, validation_prompts: int = 0) -> Path:
    """A small latent dataset as `python precompute_latents.py` lays it out: one shard per latent size,
    random tensors (fp16 latents, as precompute writes them in half precision), captions in the header; with
    `flipped`, mirrored latents too, and `validation_prompts` encoded prompts."""
    from safetensors.torch import save_file
    gen = torch.Generator().manual_seed(seed)
    d = LATENT_DIMS
    directory.mkdir(parents=True, exist_ok=True)
    shards = []
    for i, (h, w) in enumerate(sizes):
        name = f"shard-{i:05d}-{h}x{w}.safetensors"
        tensors = {"latents": torch.randn(per_shard, d["channels"], h, w, generator=gen).half(),
                   "prompt_embeds": torch.randn(per_shard, d["tokens"], d["joint"], generator=gen),
                   "pooled_prompt_embeds": torch.randn(per_shard, d["pooled"], generator=gen)}
        if flipped:
            tensors["latents_flipped"] = tensors["latents"].flip(-1)
        captions = [f"item {i}/{j}" for j in range(per_shard)]
        save_file(tensors, directory / name, metadata={"captions": json.dumps(captions)})
        shards.append({"file": name, "count": per_shard, "latent_size": [h, w]})
    if empty_prompt:
        save_file({"prompt_embeds": torch.randn(1, d["tokens"], d["joint"], generator=gen),
                   "pooled_prompt_embeds": torch.randn(1, d["pooled"], generator=gen)},
                  directory / "empty_prompt.safetensors")
    if validation_prompts:
        save_file({"prompt_embeds": torch.randn(validation_prompts, d["tokens"], d["joint"], generator=gen),
                   "pooled_prompt_embeds": torch.randn(validation_prompts, d["pooled"], generator=gen)},
                  directory / "validation_prompts.safetensors",
                  metadata={"captions": json.dumps([f"prompt {i}" for i in range(validation_prompts)])})
    (directory / "dataset.json").write_text(json.dumps({"shards": shards}))
    return directory


# A tiny run on latent shards: patch 2 over 8x8 latents is a 4x4 grid of image tokens.
LATENT_RUN = ["data.name=latents", "model.patch_size=2", "model.num_layers=2", "model.num_attention_heads=2",
              "model.attention_head_dim=8", "model.sample_size=8", "model.pos_embed_max_size=8",
              "training.train_batch_size=4", "optimizer.warmup_steps=1", "logging.log_every=1",
              "checkpoint.every=0"]


@pytest.fixture
def latent_run(tmp_path):
    """Overrides for a seconds-long run on a fresh latent dataset (made on first use)."""
    def make(*extra: str, run: str = "run", data: Path | None = None) -> list[str]:
        if data is None:
            data = tmp_path / "latents"
            if not data.exists():
                write_latent_shards(data)
        return [*LATENT_RUN, f"data.path={data}", f"logging.output_dir={tmp_path / run}", *extra]
    return make


def export_random_base(overrides: list[str], directory: Path, seed: int = 3, config: Path | None = None) -> Path:
    """A "released" checkpoint for the run `config` + `overrides` describe: the same architecture, random
    non-zero weights, as a diffusers SD3Transformer2DModel directory."""
    from configs.build import build_data, build_model
    from configs.schema import DEFAULT_CONFIG, load_config
    from models.diffusers_io import export_diffusers_transformer
    cfg = load_config(config or DEFAULT_CONFIG, [*overrides, "model.init_from=null"])
    transformer = build_model(cfg, build_data(cfg)[0]).transformer
    randomize(transformer, seed)
    return export_diffusers_transformer(transformer, directory)


LORA = ["lora.enabled=true", "lora.rank=4", "lora.alpha=8"]  # alpha != rank: the scale must survive export


@pytest.fixture
def lora_run(latent_run, tmp_path):
    """A LoRA fine-tune of a random "released" base on the latent test data."""
    base = export_random_base(latent_run(), tmp_path / "base")

    def make(*extra: str, run: str = "run") -> list[str]:
        return latent_run(*LORA, f"model.init_from={base}", *extra, run=run)
    return make
