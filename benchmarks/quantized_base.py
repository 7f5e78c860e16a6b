"""What a quantized frozen base costs in quality, and saves in memory, on a small model.

    python benchmarks/quantized_base.py [--base-steps 400] [--lora-steps 150] [--out benchmarks/quantized_base.json]

1. A base: the default shapes model trained for --base-steps steps (its EMA weights exported in diffusers' layout).
2. Its data as a latent dataset: the shapes images as latents, their captions encoded by the base's own (frozen)
   text encoder, 64 items held out.
3. For each base (unquantized, int8, nf4): the output's signal-to-quantization-noise ratio against the
   unquantized base on the held-out items at four noise levels, the bytes per weight the frozen base holds
   (counted from its tensors), and a LoRA fine-tune of --lora-steps steps: its first loss and its held-out loss
   (`val/loss`) along the way.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the project folders import by their names

from configs.build import InitialValues, build_data, build_trained_model  # noqa: E402
from configs.schema import load_config  # noqa: E402
from models.diffusers_io import export_diffusers_transformer, save_safetensors  # noqa: E402
from models.quantized import QuantizedLinear  # noqa: E402
from perf.checkpoint import checkpoints  # noqa: E402
from perf.parallel import apply_parallelism  # noqa: E402
from runtime.distributed import World  # noqa: E402

SCHEMES = ("none", "int8", "nf4")


def train_base(work: Path, steps: int) -> Path:
    import train_mmdit_stable
    run = work / "base_run"
    if not checkpoints(run):
        assert train_mmdit_stable.main([f"training.max_steps={steps}", "logging.log_every=100",
                                        f"logging.output_dir={run}"]) == 0
    return checkpoints(run)[-1]


def latent_dataset(checkpoint: Path, out: Path, items: int = 2048) -> Path:
    """The shapes items as a latent dataset whose text is the base's text encoder's output."""
    from configs.build import build_tokenizer
    from data.latents import shard_record, write_index
    from data.shapes import ShapesDataset
    from sample_mmdit import load_trained
    if (out / "dataset.json").is_file():
        return out
    model, _ = load_trained(checkpoint)
    tokenizer, dataset = build_tokenizer(), ShapesDataset(items, seed=11)
    out.mkdir(parents=True)
    shards, captions = [], []
    for start in range(0, items, 512):
        rows = [dataset[i] for i in range(start, min(start + 512, items))]
        with torch.no_grad():
            text = model.text_encoder(**tokenizer([r["caption"] for r in rows]))
        name = f"shard-{start // 512:05d}-32x32.safetensors"
        save_safetensors({"latents": torch.stack([r["latents"] for r in rows]), "prompt_embeds": text["prompt_embeds"],
                          "pooled_prompt_embeds": text["pooled_prompt_embeds"]}, out / name,
                         {"captions": json.dumps([r["caption"] for r in rows])})
        shards.append(shard_record(out, name, len(rows), (32, 32)))
        captions.append([r["caption"] for r in rows])
    with torch.no_grad():
        text = model.text_encoder(**tokenizer([""]))
    hidden, pooled = text["prompt_embeds"], text["pooled_prompt_embeds"]
    save_safetensors({"prompt_embeds": hidden, "pooled_prompt_embeds": pooled}, out / "empty_prompt.safetensors")
    write_index(out, shards, captions, {"channels": 3, "text_embeddings": True, "text_tokens": hidden.shape[1],
                                        "text_dims": [hidden.shape[2], pooled.shape[1]], "flipped": False})
    export_diffusers_transformer(model.transformer, out.parent / "base")
    return out


def run_overrides(data: Path, base: Path, scheme: str, run_dir: Path, steps: int) -> list[str]:
    return ["--config", str(run_dir.parent / "finetune.yaml"), "data.name=latents", f"data.path={data}",
            f"model.init_from={base}", "lora.enabled=true", "lora.rank=16", "lora.alpha=16",
            f"lora.base_quantization={scheme}", "data.holdout=64", f"validation.every={max(steps // 3, 1)}",
            "validation.loss_sigmas=4", f"training.max_steps={steps}", "training.train_batch_size=16",
            "optimizer.lr=1e-3", "optimizer.warmup_steps=10", "logging.log_every=10", f"logging.output_dir={run_dir}"]


def model_of(overrides: list[str]):
    cfg = load_config(overrides[1], overrides[2:])
    dataset, tokenizer = build_data(cfg)
    model = build_trained_model(cfg, dataset, tokenizer)
    model = apply_parallelism(model, cfg, World(), torch.device("cpu"), InitialValues(model, 0, cfg.model.init_from))
    return model.eval(), dataset


def frozen_bytes_per_weight(model) -> float:
    """Bytes the frozen base holds per weight of its matmul layers (codes and scales; or the dense weights)."""
    stored = weights = 0
    for module in model.transformer.modules():
        if isinstance(module, QuantizedLinear):
            stored += module.codes.numel() * module.codes.element_size() + module.scales.numel() * 2
            weights += module.in_features * module.out_features
        elif isinstance(module, torch.nn.Linear) and not module.weight.requires_grad:
            stored += module.weight.numel() * module.weight.element_size()
            weights += module.weight.numel()
    return stored / weights


def outputs(model, dataset, items: list[int]) -> torch.Tensor:
    sigmas = torch.tensor([0.2, 0.4, 0.6, 0.8])
    out = []
    with torch.no_grad():
        for index in items:
            item = dataset[index]
            x0 = item["latents"][None].expand(4, -1, -1, -1)
            noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(index))
            x_t = (1 - sigmas.view(-1, 1, 1, 1)) * x0 + sigmas.view(-1, 1, 1, 1) * noise
            text = {k: item[k][None].expand(4, *item[k].shape) for k in ("prompt_embeds", "pooled_prompt_embeds")}
            out.append(model(x_t, sigmas, text))
    return torch.cat(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-steps", type=int, default=400)
    parser.add_argument("--lora-steps", type=int, default=150)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "mmdit-quantized-base")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "quantized_base.json")
    args = parser.parse_args()
    import train_mmdit_stable
    data = latent_dataset(train_base(args.work, args.base_steps), args.work / "data")
    base = args.work / "base"
    (args.work / "finetune.yaml").write_text("training:\n  seed: 0\n")
    results, reference = {}, None
    for scheme in SCHEMES:
        run_dir = args.work / f"lora_{scheme}"
        overrides = run_overrides(data, base, scheme, run_dir, args.lora_steps)
        model, dataset = model_of(overrides)
        held = list(range(len(dataset)))[:32]
        out = outputs(model, dataset, held)
        reference = out if reference is None else reference
        sqnr = (10 * torch.log10(reference.square().sum() / (out - reference).square().sum())).item() \
            if scheme != "none" else float("inf")
        if not checkpoints(run_dir):
            assert train_mmdit_stable.main(overrides) == 0
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        results[scheme] = {"output_sqnr_db": sqnr, "bytes_per_weight": frozen_bytes_per_weight(model),
                           "first_loss": next(r["loss"] for r in rows if "loss" in r),
                           "last_loss": [r["loss"] for r in rows if "loss" in r][-1],
                           "val_loss": {r["step"]: r["val/loss"] for r in rows if "val/loss" in r}}
        r = results[scheme]
        print(f"{scheme:>5}: output SQNR {r['output_sqnr_db']:.1f} dB, {r['bytes_per_weight']:.3f} B/weight, loss "
              f"{r['first_loss']:.4f} -> {r['last_loss']:.4f}, val/loss {r['val_loss']}", flush=True)
    args.out.write_text(json.dumps({"base_steps": args.base_steps, "lora_steps": args.lora_steps,
                                    "results": results}, indent=1, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
