"""What the LoRA file of each checkpoint costs training (issue 44 item 2): a LoRA run with them (the default:
loras/step_N.safetensors written beside each complete checkpoint, in the checkpoint's writer thread) against the same
run without them, in rounds that alternate the two in one process (the machine's noise then hits both alike).

    python benchmarks/lora_files.py [--layers 8 --heads 8 --rank 64 --steps 24 --every 4 --rounds 2
                                     --out benchmarks/lora_files_cpu.json]

The run is train_mmdit_stable.py's on a random SD3-shaped base (head dim 64, 16 latent channels, 16 x 16 latents,
batch 2), LoRA on the attention projections and both feed-forwards, a checkpoint (the adapters, their EMA and AdamW
state) every --every steps. Per mode, medians over the saves of all rounds: the stall of `save()` on the training
thread (`checkpoint/stall_s`), the time of the two steps after each save (the background write and the LoRA files
overlap them) and of the other steps, and the time from a save to its checkpoint being complete with its LoRA file.
The LoRA file alone (read back from the checkpoint, converted, written) is timed on the last checkpoint.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the project folders import by their names
import train_mmdit_stable  # noqa: E402
from runtime.export import CheckpointLoras  # noqa: E402
from perf.checkpoint import Checkpointer, checkpoints  # noqa: E402
from tests.conftest import export_random_base, metric_rows, write_latent_shards  # noqa: E402

TARGETS = "[attn.to_q,attn.to_k,attn.to_v,attn.to_out.0,attn.add_q_proj,attn.add_k_proj,attn.add_v_proj," \
          "attn.to_add_out,ff.net.0.proj,ff.net.2,ff_context.net.0.proj,ff_context.net.2]"


def overrides(args, data: Path, base: Path | None, run_dir: Path) -> list[str]:
    return ["data.name=latents", f"data.path={data}", "model.patch_size=2", f"model.num_layers={args.layers}",
            f"model.num_attention_heads={args.heads}", "model.attention_head_dim=64", "model.sample_size=16",
            "model.pos_embed_max_size=16", "training.train_batch_size=2", "optimizer.warmup_steps=1",
            "logging.log_every=1", "logging.tensorboard=false", "validation.at_end=false",
            f"training.max_steps={args.steps}", f"checkpoint.every={args.every}", "checkpoint.keep_last=2",
            *([f"model.init_from={base}", "lora.enabled=true", f"lora.rank={args.rank}", f"lora.alpha={args.rank}",
               f"lora.target_modules={TARGETS}"] if base else []), f"logging.output_dir={run_dir}"]


def recording(save, rows: list):
    """Checkpointer.save, recording each save's step, its stall on the training thread, and when it began."""
    def recorded(checkpointer, step, last=False):
        due = last or (checkpointer.every and step % checkpointer.every == 0)
        start = time.perf_counter()
        save(checkpointer, step, last)
        if due:
            rows.append({"step": step, "stall_s": checkpointer.last_stall_s, "at": start})
    return recorded


def run(args, data: Path, base: Path, run_dir: Path, with_files: bool) -> dict:
    saves, completed = [], {}
    save, publish, companion = Checkpointer.save, Checkpointer.publish_on_rank_zero, train_mmdit_stable.CheckpointLoras

    def timed_publish(checkpointer, step, *rest):  # the checkpoint, and then its LoRA files, complete
        publish(checkpointer, step, *rest)
        completed[step] = time.perf_counter()

    Checkpointer.save, Checkpointer.publish_on_rank_zero = recording(save, saves), timed_publish
    train_mmdit_stable.CheckpointLoras = companion if with_files else (lambda run_dir, cfg: None)
    try:
        assert train_mmdit_stable.main(overrides(args, data, base, run_dir)) == 0
    finally:
        Checkpointer.save, Checkpointer.publish_on_rank_zero = save, publish
        train_mmdit_stable.CheckpointLoras = companion
    step_s = {r["step"]: r["time/step_s"] for r in metric_rows(run_dir) if "time/step_s" in r}
    periodic = [r for r in saves if r["step"] != args.steps]  # the last one: no training after it
    saved = {r["step"] for r in periodic}
    after = [s for s in step_s if s - 1 in saved or s - 2 in saved]  # the next two steps: the write overlaps them
    return {"stall_s": [r["stall_s"] for r in periodic],
            "save_to_complete_s": [completed[r["step"]] - r["at"] for r in periodic],
            "step_after_save_s": [step_s[s] for s in after],
            "other_step_s": [step_s[s] for s in step_s if s not in after and s > 2]}  # not the first two (warm-up)


def lora_file_s(run_dir: Path, cfg_overrides: list[str]) -> tuple[float, float]:
    """The LoRA files of the last checkpoint written again, inline: seconds, and their MiB."""
    from configs.schema import load_config
    checkpoint = checkpoints(run_dir)[-1]
    (run_dir / "again").mkdir()
    files = CheckpointLoras(run_dir / "again", load_config(overrides=cfg_overrides))
    start = time.perf_counter()
    files.write(checkpoint)
    seconds = time.perf_counter() - start
    return seconds, sum(f.stat().st_size for f in files.files(int(checkpoint.name[5:]))) / 2**20


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "lora_files_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    modes = {"with LoRA files": True, "without": False}
    measured = {mode: {} for mode in modes}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = write_latent_shards(tmp / "data", sizes=((16, 16),), per_shard=32)
        base = export_random_base(overrides(args, data, None, tmp / "unused"), tmp / "base")
        for round_ in range(args.rounds):
            for mode, with_files in modes.items():
                found = run(args, data, base, tmp / f"{round_}-{with_files}", with_files)
                for key, values in found.items():
                    measured[mode].setdefault(key, []).extend(values)
        seconds, mib = lora_file_s(tmp / "0-True", overrides(args, data, base, tmp / "0-True"))
    results = {mode: {key: median(values) for key, values in m.items()} | {"samples": m} for mode, m in measured.items()}
    print(f"{'mode':<16} {'save() stall (s)':>17} {'save to complete (s)':>21} {'step after a save (s)':>22} "
          f"{'other steps (s)':>16}")
    for mode, r in results.items():
        print(f"{mode:<16} {r['stall_s']:>17.4f} {r['save_to_complete_s']:>21.3f} {r['step_after_save_s']:>22.3f} "
              f"{r['other_step_s']:>16.3f}")
    print(f"the LoRA files of one checkpoint, written inline: {seconds:.3f} s for {mib:.1f} MiB")
    args.out.write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)}, "device": "cpu",
                                    "lora_files_inline_s": seconds, "lora_files_mib": mib, "results": results},
                                   indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
