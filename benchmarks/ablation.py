"""Plugin ablation: train steps of a fixed MMDiT config with the baseline, each plugin alone, all together, and
diffusers' SD3Transformer2DModel with a plain AdamW loop at the identical configuration.

    python benchmarks/ablation.py [--size cpu|sd3-medium] [--steps 12] [--out benchmarks/ablation_cpu.json]

Every variant runs in its own process (clean peak memory, no compile cache shared between variants) on the
same random latents, text embeddings, noise and sigmas, with the same minimal loop: interpolate, forward,
MSE to the velocity target, backward, optimizer step. FLOPs per step are counted once with
torch.utils.flop_counter on this project's model (SDPA, fp32) and used for every row, since all variants do
the same math; the machine's own fp32 large-matmul FLOP/s is measured in the same run as the
reference for the MFU-style ratio. Needs `pip install diffusers` for the reference row.
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from models.attention import math_attention, sdpa_attention, set_attention_kernel  # noqa: E402
from models.mmdit import MMDiT, MMDiTConfig  # noqa: E402
from optim.adamw import build_adamw  # noqa: E402
from perf.activation_checkpointing import apply_activation_checkpointing  # noqa: E402
from perf.compile import apply_compile  # noqa: E402
from perf.precision import autocast  # noqa: E402

SIZES = {
    # the default shapes model of configs/shapes.yaml, at its batch size
    "cpu": dict(model=dict(sample_size=32, patch_size=4, in_channels=3, out_channels=3, num_layers=6,
                           attention_head_dim=32, num_attention_heads=4, joint_attention_dim=128,
                           caption_projection_dim=128, pooled_projection_dim=128, pos_embed_max_size=16,
                           qk_norm="rms_norm"), batch=16, image=32, text_tokens=7),
    # SD3-medium shaped: 24 layers, width 1536, 128x128 latents (1024 px images), 333 text tokens
    "sd3-medium": dict(model=dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                                  attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                                  caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=192),
                       batch=4, image=128, text_tokens=333),
}
# baseline: math attention, foreach AdamW, eager, fp32, no activation checkpointing
PLUGINS = {"sdpa": "SDPA attention", "fused_adamw": "fused AdamW", "compile": "torch.compile (blocks)",
           "bf16": "bf16 autocast", "activation_checkpointing": "activation checkpointing (every block)"}
VARIANTS = ["baseline", *PLUGINS, "all_fp32", "all", "diffusers"]


def variant_plugins(name: str) -> set[str]:
    if name == "all":
        return set(PLUGINS) - {"activation_checkpointing"}  # trades speed for memory: not part of "fastest"
    if name == "all_fp32":
        return {"sdpa", "fused_adamw", "compile"}
    return {name} & set(PLUGINS)


class Adapter(torch.nn.Module):
    """This project's MMDiT with the diffusers call signature used by the loop."""

    def __init__(self, model: MMDiT):
        super().__init__()
        self.transformer = model

    def forward(self, x, context, pooled, timestep):
        return self.transformer(x, context, pooled, timestep)


def build(name: str, size: dict, device: torch.device):
    torch.manual_seed(0)
    if name == "diffusers":
        from diffusers import SD3Transformer2DModel
        m = size["model"]
        model = SD3Transformer2DModel(**{**m, "qk_norm": m.get("qk_norm")}).to(device)
        forward = lambda x, c, p, t: model(hidden_states=x, encoder_hidden_states=c, pooled_projections=p,  # noqa
                                           timestep=t, return_dict=False)[0]
        return model, forward, torch.optim.AdamW(model.parameters(), lr=1e-4), set()
    plugins = variant_plugins(name)
    model = Adapter(MMDiT(MMDiTConfig(**size["model"]))).to(device)
    set_attention_kernel(sdpa_attention if "sdpa" in plugins else math_attention)
    apply_activation_checkpointing(model, 1 if "activation_checkpointing" in plugins else 0)
    apply_compile(model, "compile" in plugins)
    optimizer = build_adamw(model, 1e-4, (0.9, 0.999), 1e-8, 0.0, device)
    if "fused_adamw" not in plugins:
        optimizer = torch.optim.AdamW(optimizer.param_groups, lr=1e-4, foreach=True)
    return model, model, optimizer, plugins


def batch(size: dict, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    m, b = size["model"], size["batch"]
    tensors = [torch.randn(b, m["in_channels"], size["image"], size["image"], generator=g),  # x0
               torch.randn(b, m["in_channels"], size["image"], size["image"], generator=g),  # noise
               torch.randn(b, size["text_tokens"], m["joint_attention_dim"], generator=g),
               torch.randn(b, m["pooled_projection_dim"], generator=g), torch.rand(b, generator=g)]
    return [t.to(device) for t in tensors]


def train_step(forward, optimizer, data, device, dtype: str) -> None:
    x0, noise, context, pooled, sigma = data
    s = sigma.view(-1, 1, 1, 1)
    with autocast(device, dtype):
        v = forward((1 - s) * x0 + s * noise, context, pooled, sigma * 1000)
    F.mse_loss(v.float(), noise - x0).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def worker(name: str, size_name: str, steps: int, warmup: int) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = SIZES[size_name]
    model, forward, optimizer, plugins = build(name, size, device)
    dtype = "bf16" if "bf16" in plugins else "fp32"
    data = batch(size, device)
    from torch.utils.flop_counter import FlopCounterMode
    counter = FlopCounterMode(display=False)
    with counter:
        train_step(forward, optimizer, data, device, "fp32")  # counts the math, independent of kernels
    flops = counter.get_total_flops()
    start = time.perf_counter()
    for _ in range(warmup):
        train_step(forward, optimizer, data, device, dtype)
    sync(device)
    warmup_s = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        train_step(forward, optimizer, data, device, dtype)
        sync(device)
        times.append(time.perf_counter() - start)
    median = statistics.median(times) if times else float("nan")
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"variant": name, "device": str(device), "median_step_s": median, "images_per_s": size["batch"] / median,
            "peak_memory_mib": peak / 2**20, "flops_per_step": flops, "achieved_flops": flops / median,
            "warmup_s": warmup_s, "step_times_s": times,
            "params": sum(p.numel() for p in model.parameters())}


def matmul_flops(device: torch.device, n: int = 2048, repeats: int = 10) -> float:
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    for _ in range(3):
        a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync(device)
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="cpu")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="the variant list is run this many times, "
                        "interleaved; a variant's step time is the median over all its rounds' steps")
    parser.add_argument("--variants", nargs="*", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.size, args.steps, args.warmup)))
        return

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak = matmul_flops(device)
    # the same math for all; counted on the math-attention baseline, since the flop counter does not see the
    # CPU SDPA kernel (it would miss attention there)
    reference_flops = worker("baseline", args.size, steps=0, warmup=0)["flops_per_step"]
    runs: dict[str, list[dict]] = {}
    for round_ in range(args.rounds):  # interleaved rounds: a noisy minute hits every variant alike
        for name in args.variants:
            proc = subprocess.run([sys.executable, __file__, "--worker", name, "--size", args.size, "--steps",
                                   str(args.steps), "--warmup", str(args.warmup)], capture_output=True, text=True)
            if proc.returncode:
                print(f"{name}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            runs.setdefault(name, []).append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"  round {round_ + 1} {name}: {runs[name][-1]['median_step_s']:.4f} s/step", flush=True)
    rows = []
    for name, results in runs.items():
        times = [t for r in results for t in r["step_times_s"]]
        rows.append({**results[0], "median_step_s": statistics.median(times), "step_times_s": times,
                     "images_per_s": results[0]["images_per_s"] * results[0]["median_step_s"] / statistics.median(times),
                     "peak_memory_mib": max(r["peak_memory_mib"] for r in results)})
    by_name = {r["variant"]: r for r in rows}
    for r in rows:
        r["achieved_flops"] = reference_flops / r["median_step_s"]
        r["mfu_vs_matmul"] = r["achieved_flops"] / peak
        if "baseline" in by_name:
            r["speedup_vs_baseline"] = by_name["baseline"]["median_step_s"] / r["median_step_s"]
        if "diffusers" in by_name:
            r["speedup_vs_diffusers"] = by_name["diffusers"]["median_step_s"] / r["median_step_s"]

    print(f"\nsize {args.size}, device {device}, {args.rounds} x {args.steps} timed steps after {args.warmup} warm-up; "
          f"machine fp32 matmul {peak / 1e9:.0f} GFLOP/s")
    print(f"{'variant':<26}{'step ms':>9}{'img/s':>8}{'peak MiB':>10}{'GFLOP/s':>9}{'MFU':>7}"
          f"{'vs base':>9}{'vs diffusers':>14}")
    for r in rows:
        print(f"{r['variant']:<26}{r['median_step_s'] * 1000:>9.1f}{r['images_per_s']:>8.1f}"
              f"{r['peak_memory_mib']:>10.0f}{r['achieved_flops'] / 1e9:>9.1f}{r['mfu_vs_matmul']:>7.2f}"
              f"{r.get('speedup_vs_baseline', float('nan')):>9.2f}{r.get('speedup_vs_diffusers', float('nan')):>14.2f}")
    out = args.out or ROOT / "benchmarks" / f"ablation_{args.size}.json"
    out.write_text(json.dumps({"size": args.size, "device": str(device), "matmul_flops": peak,
                               "torch": torch.__version__, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
