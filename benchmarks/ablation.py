"""Plugin ablation, measured twice: in a minimal loop and in the real training loop.

    python benchmarks/ablation.py [--size cpu|sd3-medium] [--rounds 2] [--minimal-steps 12] [--loop-steps 150]
                                  [--variants ...] [--out benchmarks/ablation_cpu.json]

Each variant is a set of config overrides over the baseline (math attention, foreach AdamW, eager, fp32); the
variant `default` is `configs/shapes.yaml` as `make train` runs it. Every measurement runs in its own process
(clean memory, no compile cache shared in-process), and the list of variants is run `--rounds` times,
interleaved, so a noisy minute hits every variant alike.

- Minimal loop: interpolate, forward, MSE to the velocity target, backward, optimizer step, on fixed random
  inputs; also diffusers' SD3Transformer2DModel with a plain AdamW loop at the identical configuration
  (`pip install diffusers`). Warm-up steps (compilation included) are timed separately.
- Real loop (`--size cpu`): `train_mmdit_stable.main` on configs/shapes.yaml with the variant's overrides for
  `--loop-steps` steps. Steady state is the median `time/step_s` of its metrics rows after the first
  `--loop-warmup` steps; compile time is what those first steps took beyond the steady-state rate.

Model FLOPs are counted once per loop with torch.utils.flop_counter on a meta-device model (math attention, so
attention is counted), never inside a timed process: a dispatch mode active at a compiled module's first call
makes dynamo skip it for good, which is how an earlier version of this script timed "torch.compile" eagerly.
The MFU-style ratio divides achieved model FLOP/s by this machine's large-matmul FLOP/s in the same precision,
measured in the same process right before and after the timed steps (the machine's speed drifts).
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from formats import DTYPES  # noqa: E402
from models.attention import math_attention, sdpa_attention, use_attention  # noqa: E402
from models.sd3.model import MMDiT, MMDiTConfig  # noqa: E402
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
BASELINE = {"training.attention_backend": "math", "optimizer.fused": False, "compile.enabled": False,
            "compile.scope": "blocks", "training.dtype": "fp32", "training.activation_checkpointing": "none"}
VARIANTS = {  # overrides over BASELINE
    "baseline": {},
    "sdpa": {"training.attention_backend": "sdpa"},
    "fused_adamw": {"optimizer.fused": True},
    "compile": {"compile.enabled": True},
    "compile_model": {"compile.enabled": True, "compile.scope": "model"},
    "compile_sdpa": {"compile.enabled": True, "training.attention_backend": "sdpa"},
    "bf16": {"training.dtype": "bf16"},
    "bf16_sdpa": {"training.dtype": "bf16", "training.attention_backend": "sdpa"},
    "bf16_compile": {"training.dtype": "bf16", "compile.enabled": True},
    "activation_checkpointing": {"training.activation_checkpointing": "full"},
    "all_fp32": {"optimizer.fused": True, "compile.enabled": True},
    "all": {"optimizer.fused": True, "compile.enabled": True, "training.dtype": "bf16"},
    "default": None,  # configs/shapes.yaml as it is
    "diffusers": None,  # minimal loop only
}


def settings(variant: str) -> dict:
    """The full set of plugin settings of a variant (the default config's own for `default`)."""
    if variant == "default":
        from omegaconf import OmegaConf

        from configs.schema import load_config
        cfg = load_config()
        return {key: OmegaConf.select(cfg, key) for key in BASELINE}
    return {**BASELINE, **(VARIANTS[variant] or {})}


class Adapter(torch.nn.Module):
    """This project's MMDiT with the diffusers call signature used by the loop."""

    def __init__(self, model: MMDiT):
        super().__init__()
        self.transformer = model

    def forward(self, x, context, pooled, timestep):
        return self.transformer(x, context, pooled, timestep)


def build(variant: str, size: dict, device: torch.device):
    """(model, forward(x, context, pooled, timestep), optimizer, dtype) of the minimal loop."""
    torch.manual_seed(0)
    if variant == "diffusers":
        from diffusers import SD3Transformer2DModel
        m = size["model"]
        model = SD3Transformer2DModel(**{**m, "qk_norm": m.get("qk_norm")}).to(device)
        forward = lambda x, c, p, t: model(hidden_states=x, encoder_hidden_states=c, pooled_projections=p,  # noqa
                                           timestep=t, return_dict=False)[0]
        return model, forward, torch.optim.AdamW(model.parameters(), lr=1e-4), "fp32"
    s = settings(variant)
    model = Adapter(MMDiT(MMDiTConfig(**size["model"]))).to(device)
    use_attention(model, sdpa_attention if s["training.attention_backend"] == "sdpa" else math_attention)
    apply_activation_checkpointing(model, s["training.activation_checkpointing"])
    apply_compile(model, s["compile.enabled"], scope=s["compile.scope"])
    optimizer = build_adamw(model, 1e-4, (0.9, 0.999), 1e-8, 0.0, device, s["optimizer.fused"])
    return model, model, optimizer, s["training.dtype"]


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
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_flops(device: torch.device, dtype: str, n: int = 2048, repeats: int = 10) -> float:
    """Large-matmul FLOP/s of this machine in the given precision."""
    a, b = (torch.randn(n, n, device=device, dtype=DTYPES[dtype]) for _ in range(2))
    for _ in range(3):
        a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync(device)
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def count_flops(size: dict) -> int:
    """FLOPs of one minimal-loop step (forward + backward), on the meta device, attention included."""
    shapes = [t.shape for t in batch(size, torch.device("cpu"))]
    with torch.device("meta"):
        model = use_attention(Adapter(MMDiT(MMDiTConfig(**size["model"]))), math_attention)
        data = [torch.empty(shape) for shape in shapes]
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        train_step(model, None, data, torch.device("meta"), "fp32")
    return counter.get_total_flops()


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def minimal_worker(variant: str, size_name: str, steps: int, warmup: int) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = SIZES[size_name]
    model, forward, optimizer, dtype = build(variant, size, device)
    data = batch(size, device)
    start = time.perf_counter()
    for _ in range(warmup):
        train_step(forward, optimizer, data, device, dtype)
    sync(device)
    warmup_s = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    before = matmul_flops(device, dtype)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        train_step(forward, optimizer, data, device, dtype)
        sync(device)
        times.append(time.perf_counter() - start)
    matmul = (before + matmul_flops(device, dtype)) / 2
    median = statistics.median(times)
    return {"step_s": median, "step_times_s": times, "warmup_s": warmup_s, "matmul_flops": matmul,
            "peak_memory_mib": peak_memory_mib(device), "dtype": dtype}


def loop_worker(variant: str, steps: int, warmup_steps: int, log_every: int) -> dict:
    """The real training loop on configs/shapes.yaml with the variant's overrides."""
    from train_mmdit_stable import main
    overrides = [f"{k}={v}" for k, v in (settings(variant) if variant != "default" else {}).items()]
    dtype = settings(variant)["training.dtype"]
    with tempfile.TemporaryDirectory() as run_dir:
        overrides += [f"training.max_steps={steps}", f"logging.log_every={log_every}", "checkpoint.every=0",
                      "logging.tensorboard=false", "sampling.steps=1", f"logging.output_dir={run_dir}"]
        before = matmul_flops(torch.device("cpu"), dtype)
        start = time.perf_counter()
        if main(overrides) != 0:
            raise RuntimeError(f"training failed with {overrides}")
        wall = time.perf_counter() - start
        matmul = (before + matmul_flops(torch.device("cpu"), dtype)) / 2
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/step_s" in r]
    steady = [r["time/step_s"] for r in rows if r["step"] > warmup_steps]
    step_s = statistics.median(steady)
    warm = [r for r in rows if r["step"] <= warmup_steps]
    compile_s = sum(r["time/step_s"] for r in warm) * log_every - step_s * warmup_steps
    flops_per_step = rows[-1]["tflops_per_s_per_rank"] * 1e12 / rows[-1]["samples_per_s"] * \
        SIZES["cpu"]["batch"]
    return {"step_s": step_s, "window_step_times_s": steady, "compile_s": compile_s, "wall_s": wall,
            "flops_per_step": flops_per_step, "matmul_flops": matmul, "dtype": dtype,
            "peak_rss_gib": rows[-1].get("memory/peak_rss_gib")}


def run_worker(args: list[str]) -> dict | None:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if proc.returncode:
        print(f"{args}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def combine(results: list[dict], flops: float) -> dict:
    """Median step time over all rounds' steps; FLOP/s and the matmul ratio per round, then their median."""
    key = "step_times_s" if "step_times_s" in results[0] else "window_step_times_s"
    times = [t for r in results for t in r[key]]
    ratios = [flops / r["step_s"] / r["matmul_flops"] for r in results]
    out = {"step_s": statistics.median(times), "per_round_step_s": [r["step_s"] for r in results],
           "achieved_flops": flops / statistics.median(times), "mfu_vs_matmul": statistics.median(ratios),
           "per_round_mfu": ratios, "matmul_flops": statistics.median(r["matmul_flops"] for r in results),
           "dtype": results[0]["dtype"]}
    for extra in ("warmup_s", "compile_s", "wall_s", "peak_memory_mib", "peak_rss_gib"):
        if extra in results[0]:
            out[extra] = statistics.median(r[extra] for r in results if r[extra] is not None) \
                if any(r[extra] is not None for r in results) else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="cpu")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--minimal-steps", type=int, default=12)
    parser.add_argument("--minimal-warmup", type=int, default=4)
    parser.add_argument("--loop-steps", type=int, default=150, help="0: no real-loop runs")
    parser.add_argument("--loop-warmup", type=int, default=30, help="first steps of a loop run not in steady state")
    parser.add_argument("--loop-log-every", type=int, default=10)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--minimal-worker", help=argparse.SUPPRESS)
    parser.add_argument("--loop-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.minimal_worker:
        print(json.dumps(minimal_worker(args.minimal_worker, args.size, args.minimal_steps, args.minimal_warmup)))
        return
    if args.loop_worker:
        print(json.dumps(loop_worker(args.loop_worker, args.loop_steps, args.loop_warmup, args.loop_log_every)))
        return

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    minimal_flops = count_flops(SIZES[args.size])
    loops = args.loop_steps > 0 and args.size == "cpu" and device.type == "cpu"
    common = ["--size", args.size, "--minimal-steps", str(args.minimal_steps), "--minimal-warmup",
              str(args.minimal_warmup), "--loop-steps", str(args.loop_steps), "--loop-warmup", str(args.loop_warmup),
              "--loop-log-every", str(args.loop_log_every)]
    minimal: dict[str, list[dict]] = {}
    loop: dict[str, list[dict]] = {}
    for round_ in range(args.rounds):  # interleaved rounds
        for name in args.variants:
            result = run_worker(["--minimal-worker", name, *common])
            if result:
                minimal.setdefault(name, []).append(result)
                print(f"  round {round_ + 1} {name}: minimal {result['step_s'] * 1000:.1f} ms", flush=True)
            if loops and name != "diffusers":
                result = run_worker(["--loop-worker", name, *common])
                if result:
                    loop.setdefault(name, []).append(result)
                    print(f"  round {round_ + 1} {name}: loop {result['step_s'] * 1000:.1f} ms "
                          f"(compile {result['compile_s']:.0f} s)", flush=True)

    rows = []
    for name in args.variants:
        row = {"variant": name, "settings": settings(name) if name != "diffusers" else None}
        if name in minimal:
            row["minimal"] = combine(minimal[name], minimal_flops)
        if name in loop:
            row["loop"] = combine(loop[name], statistics.median(r["flops_per_step"] for r in loop[name]))
        rows.append(row)
    by_name = {r["variant"]: r for r in rows}
    for r in rows:
        for kind in ("minimal", "loop"):
            if kind in r and kind in by_name.get("baseline", {}):
                r[kind]["speedup_vs_baseline"] = by_name["baseline"][kind]["step_s"] / r[kind]["step_s"]
        if "minimal" in r and "minimal" in by_name.get("diffusers", {}):
            r["minimal"]["speedup_vs_diffusers"] = by_name["diffusers"]["minimal"]["step_s"] / r["minimal"]["step_s"]

    print(f"\nsize {args.size}, device {device}, {args.rounds} interleaved rounds; minimal loop {args.minimal_steps} "
          f"timed steps after {args.minimal_warmup}; real loop {args.loop_steps} steps, steady state after "
          f"{args.loop_warmup}")
    print(f"{'variant':<26}{'min ms':>8}{'min MFU':>9}{'vs base':>8}{'vs diff':>8}"
          f"{'loop ms':>9}{'loop MFU':>9}{'vs base':>8}{'compile s':>10}")
    nan = float("nan")
    for r in rows:
        m, lo = r.get("minimal", {}), r.get("loop", {})
        print(f"{r['variant']:<26}{m.get('step_s', nan) * 1000:>8.1f}{m.get('mfu_vs_matmul', nan):>9.2f}"
              f"{m.get('speedup_vs_baseline', nan):>8.2f}{m.get('speedup_vs_diffusers', nan):>8.2f}"
              f"{lo.get('step_s', nan) * 1000:>9.1f}{lo.get('mfu_vs_matmul', nan):>9.2f}"
              f"{lo.get('speedup_vs_baseline', nan):>8.2f}{lo.get('compile_s', nan):>10.0f}")
    out = args.out or ROOT / "benchmarks" / f"ablation_{args.size}.json"
    out.write_text(json.dumps({"size": args.size, "device": str(device), "torch": torch.__version__,
                               "threads": torch.get_num_threads(), "cpu": cpu_name(), "rounds": args.rounds,
                               "minimal_flops_per_step": minimal_flops, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
