"""Self-check: does each plugin work on this machine, and what does it cost? (`make selfcheck`)

    python benchmarks/selfcheck.py [--rows NAME ...] [--out runs/selfcheck] [--steps 4] [--size small|medium]

Runs a short real training run (the shapes data, no download) for each row of the plugin matrix that can run
here: fp32 / bf16, SDPA / flash-attn, compile, activation checkpointing and both, DDP and FSDP over all local
GPUs (2 gloo processes on a CPU machine), FSDP with CPU offload, an async checkpoint then a bitwise resume, the
OOM-aware batch sizer against a real allocation failure (the device memory capped so that the first
micro-batch cannot fit) and against an injected one, the profiler's trace, and block swapping (LoRA on a random
base with every block swapped, against the same run unswapped). Each row is a process of its
own (torchrun for the multi-process rows), so one failing row cannot take the others down.

Per row: passed / failed (with the error's first line) / not runnable here (why); step time, images/s, MFU
(GPUs of known peak), peak device memory (peak RSS on a CPU) and host-device synchronisations per step (CUDA's
sync debug mode on GPUs; runtime/host_syncs.py's counter on the CPU). On a GPU the speed columns of the
one-process rows that change how the step computes (precision, attention, compile, checkpointing) come from
benchmarks/train_step.py's machinery: the real step of SD3-medium at 512 px, micro-batch 4, on batches already on
the device, with the row's settings (`SPEED`), where step time means something; the toy model the check trains
(width 768, 256 image tokens, batches rendered on the host) measured the loader and the launches, not the
kernels. The other rows (and every row on a CPU) report the timed second half of their own run (on a CPU, a
compiled row's timed half can include compiling its blocks once more: entering the host-sync counter there
changes what compiled code guards on). The table is printed and written to OUT/selfcheck.json and
OUT/selfcheck.md; each row's log is OUT/<row>/log.txt. The command exits non-zero when a row failed.
"""

import argparse
import gc
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the project folders import by their names

# The model each row trains: tiny on a CPU (the check, not the speed, is the point there); on a GPU big enough
# that step time and MFU mean something (patch 2 over 32x32: 256 image tokens, width 768, 8 blocks).
SIZES = {
    "small": ["model.patch_size=4", "model.num_layers=2", "model.num_attention_heads=2", "model.attention_head_dim=32",
              "text_encoder.dim=64", "text_encoder.num_heads=2", "training.train_batch_size=8"],
    "medium": ["model.patch_size=2", "model.num_layers=8", "model.num_attention_heads=12",
               "model.attention_head_dim=64", "model.pos_embed_max_size=16", "text_encoder.dim=256",
               "training.train_batch_size=32"],
}


@dataclass
class Row:
    name: str
    overrides: list[str] = field(default_factory=list)
    processes: str = "one"  # "one", or "all" local GPUs (2 gloo processes on a CPU machine)
    needs: str = ""  # "cuda", "attention" (its backend), "fp8", "2 gpus": what the row cannot run without
    speed: bool = False  # on a GPU, speed columns from the device-batch benchmark of SD3-medium (see SPEED)


ROWS = [
    Row("fp32, sdpa", ["training.attention_backend=sdpa"], speed=True),
    Row("bf16, sdpa", ["training.dtype=bf16", "training.attention_backend=sdpa"], speed=True),
    Row("bf16, cuDNN attention", ["training.dtype=bf16", "training.attention_backend=sdpa_cudnn"], needs="attention",
        speed=True),
    Row("bf16, flash-attn", ["training.dtype=bf16", "training.attention_backend=flash_attn_2"], needs="attention",
        speed=True),
    Row("compile", ["compile.enabled=true"], speed=True),
    Row("activation checkpointing", ["training.activation_checkpointing=full"], speed=True),
    Row("selective activation checkpointing", ["training.activation_checkpointing=selective"]),
    Row("compile + activation checkpointing", ["compile.enabled=true", "training.activation_checkpointing=full"],
        speed=True),
    Row("float8, bf16", ["training.dtype=bf16", "float8.enabled=true"], needs="fp8"),
    Row("DDP", ["parallel.strategy=ddp"], processes="all"),
    Row("FSDP, bf16", ["parallel.strategy=fsdp", "training.dtype=bf16"], processes="all"),
    Row("FSDP, CPU offload", ["parallel.strategy=fsdp", "training.dtype=bf16", "parallel.cpu_offload=true"],
        processes="all", needs="cuda"),
    Row("async checkpoint, bitwise resume", ["checkpoint.async_save=true", "training.deterministic=true"]),
    Row("OOM sizer, injected failure", ["batch_sizer.enabled=true", "batch_sizer.debug_oom_steps=[1]",
                                        "batch_sizer.debug_oom_above=1"]),
    Row("OOM sizer, real allocation failure", ["batch_sizer.enabled=true"], needs="cuda"),
    # LoRA on a random base of the row's size, every block swapped (offload.blocks_to_swap: the model's blocks), then
    # the same run unswapped: the same adapters bit for bit; on a GPU pinned host buffers and a lower peak
    Row("block swap, LoRA", ["lora.enabled=true", "training.activation_checkpointing=full",
                             "training.deterministic=true", "validation.at_end=false"]),
    Row("profiler trace", ["profiler.enabled=true", "profiler.skip_first=1", "profiler.active_steps=2"]),
]


def not_runnable(row: Row) -> str | None:
    """Why `row` cannot run on this machine, or None."""
    from perf.attention import why_not
    from perf.float8 import FP8_CAPABILITY
    cuda = torch.cuda.is_available()
    if row.needs in ("cuda", "attention", "fp8") and not cuda:
        return "needs a CUDA GPU"
    if row.needs == "fp8" and torch.cuda.get_device_capability() < FP8_CAPABILITY:
        return "needs float8 tensor cores (compute capability 8.9 or newer)"
    if row.needs == "attention":
        backend = next(o.split("=")[1] for o in row.overrides if o.startswith("training.attention_backend="))
        return why_not(backend, torch.device("cuda"), "bf16", 64)
    if row.processes == "all" and cuda and torch.cuda.device_count() < 2:
        return "needs 2 or more GPUs on this node"
    return None


# ----------------------------------------------------------------------------------------------- one row


def run_row(row: Row, overrides: list[str], steps: int, out: Path) -> dict:
    """Train `row` in this process (one rank of it) for 2 x `steps` steps, measuring the second half; writes and
    returns this rank's result."""
    import train_mmdit_stable
    from runtime.metrics import TrainingLog, read_rows
    rank = int(os.environ.get("RANK", 0))
    window = SyncWindow(steps)
    real_log, real_build = TrainingLog.step, train_mmdit_stable.build_optimizer

    def build_optimizer(model, *args, **kwargs):  # the model's parameters are the first device values (CPU count)
        window.counter.mark(list(model.parameters()))
        return real_build(model, *args, **kwargs)

    def log_step(self, done, loss, grad_norm, lr):  # metrics rows at `steps` and at 2 x `steps`: the window between
        if done == 2 * steps:
            window.close()
        real_log(self, done, loss, grad_norm, lr)
        if done == 2 * steps and rank == 0 and "step_s" not in window.measured:  # the row's own run only
            record = read_rows(self.logger.jsonl.path)[-1]
            window.measured.update(step_s=record["time/step_s"], images_per_s=record["samples_per_s"],
                                   mfu=record.get("mfu"), peak_memory_gib=record.get(
                                       "memory/peak_allocated_gib", record.get("memory/peak_rss_gib")))
        if done == steps:
            window.open()

    args = [*overrides, f"training.max_steps={2 * steps}", f"logging.log_every={steps}", "checkpoint.every=0",
            "validation.every=0", "sampling.steps=2", f"logging.output_dir={out / 'run'}"]
    errors = ErrorLines()
    logging.getLogger("mmdit").addHandler(errors)
    try:
        if row.name == "OOM sizer, real allocation failure":
            cap_memory_below_the_first_micro_batch(overrides, out)
        if row.name.startswith("block swap"):
            args = [*args, *swapping_all_blocks(overrides, out)]
        train_mmdit_stable.build_optimizer, TrainingLog.step = build_optimizer, log_step
        status = train_mmdit_stable.main(args)
        if status:
            raise RuntimeError(errors.first or f"training exited with status {status}")
        extra = check_row(row, out, args, window.measured)
        result = {"status": "passed", **window.measured, **device_batch_speed(row, overrides), **extra}
    except Exception as e:
        result = {"status": "failed", "error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"}
    finally:
        window.close()
    (out / f"result_rank{rank}.json").write_text(json.dumps(result))
    return result


# The speed rows' step on a GPU: SD3-medium's architecture at 512 px (1024 image + 333 text tokens), micro-batch 4,
# eager fp32 with TF32, SDPA, no checkpointing, unless the row says otherwise (its overrides go on top)
SPEED = {"model": "sd3-medium", "resolution": 512, "steps": 10, "warmup": 3,
         "overrides": ["training.dtype=fp32", "compile.enabled=false", "training.activation_checkpointing=none",
                       "training.attention_backend=sdpa"]}


def device_batch_speed(row: Row, overrides: list[str]) -> dict:
    """On a GPU, a speed row's columns from benchmarks/train_step.py (see SPEED); nothing elsewhere."""
    if not (row.speed and torch.cuda.is_available()):
        return {}
    from benchmarks.train_step import Row, Variant, measure
    settings = [o for o in overrides if o.split("=")[0] in ("training.dtype", "training.attention_backend",
                                                            "compile.enabled", "training.activation_checkpointing")]
    gc.collect()  # the check's run is over: its model and optimizer go before the benchmark's come
    torch.cuda.empty_cache()
    m = measure(Row(SPEED["model"], Variant(row.name, (*SPEED["overrides"], *settings))), "real", SPEED["steps"],
                SPEED["warmup"], torch.device("cuda"), SPEED["resolution"])
    if m["status"] != "passed":  # the plugin passed its check; only the speed columns stay the run's own
        return {"speed_from": f"its own run (the device-batch benchmark: {m.get('error') or m.get('reason')})"}
    return {"step_s": m["step_s"], "images_per_s": m["images_per_s"], "mfu": m["mfu"],
            "peak_memory_gib": m["peak_memory_gib"], "host_syncs_per_step": m["host_syncs_per_step"],
            "speed_from": f"{SPEED['model']} {SPEED['resolution']} px, micro-batch {m['micro_batch']}, device batches"}


class ErrorLines(logging.Handler):
    """The first error the training logged (a config error, a failed checkpoint)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.first = None

    def emit(self, record: logging.LogRecord) -> None:
        self.first = self.first or record.getMessage().splitlines()[0]


class SyncWindow:
    """Counts host-device synchronisations from `open` to `close`: CUDA's sync debug mode on a GPU, the CPU
    counter of runtime/host_syncs.py elsewhere."""

    def __init__(self, steps: int):
        from runtime.host_syncs import HostSyncCounter
        self.steps, self.counter, self.measured, self.context, self.counts = steps, HostSyncCounter(), {}, None, {}

    def open(self) -> None:
        """Once: the runs a row makes after the measured one (a resume, say) are not measured."""
        from runtime.host_syncs import cuda_sync_counter
        if "host_syncs_per_step" in self.measured:
            return
        self.context = cuda_sync_counter(self.counts) if torch.cuda.is_available() else self.counter.counting()
        self.context.__enter__()

    def close(self) -> None:
        if self.context is None:
            return
        self.context.__exit__(None, None, None)
        self.context = None
        counts = self.counts if torch.cuda.is_available() else self.counter.counts
        self.measured.update(host_syncs_per_step=sum(counts.values()) / self.steps, host_sync_kinds=dict(counts))


def check_row(row: Row, out: Path, args: list[str], measured: dict) -> dict:
    """What a row promises beyond finishing: a trace, an OOM the sizer survived, a bitwise resume, a block swap
    that trains like the run without it (what that run measured comes back, for the table)."""
    run = out / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] if \
        (run / "metrics.jsonl").is_file() else []
    if row.name.startswith("profiler") and not list((run / "tensorboard").glob("*.pt.trace.json")):
        raise RuntimeError("no profiler trace was written")
    if row.name.startswith("OOM sizer") and not any(r.get("oom_events", 0) > 0 for r in rows):
        raise RuntimeError("no out-of-memory event reached the sizer")
    if row.name.startswith("async checkpoint"):
        resume_bitwise(out, args)
    if row.name.startswith("block swap"):
        return like_unswapped(out, args, measured)
    return {}


def swapping_all_blocks(overrides: list[str], out: Path) -> list[str]:
    """A random "released" base of the row's model size (adaLN-Zero's zeros would leave the adapters without a
    gradient) in diffusers' layout, and its every block swapped."""
    from configs.build import build_data, build_model
    from configs.schema import load_config
    from models.diffusers_io import export_diffusers_transformer
    cfg = load_config(overrides=[*overrides, "lora.enabled=false"])
    transformer = build_model(cfg, *build_data(cfg)).transformer
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in transformer.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    base = export_diffusers_transformer(transformer, out / "base")
    return [f"model.init_from={base}", f"offload.blocks_to_swap={len(transformer.blocks)}"]


def like_unswapped(out: Path, args: list[str], measured: dict) -> dict:
    """The block swap row's run against the same run unswapped: the adapters bit for bit; on a GPU the host buffers
    page-locked and the swapped run's peak device memory lower. The unswapped run's step time and peak come back."""
    import train_mmdit_stable
    from perf import block_swap
    from perf.checkpoint import checkpoints, read_checkpoint
    swapped = block_swap.active
    pinned = all(b.is_pinned() for b in swapped.buffers.values()) if torch.cuda.is_available() else None
    plain = out / "unswapped"
    assert train_mmdit_stable.main([*[a for a in args if not a.startswith(("logging.output_dir=", "offload."))],
                                    f"logging.output_dir={plain}"]) == 0
    ours, theirs = (read_checkpoint(checkpoints(run)[-1])[0]["model"] for run in (out / "run", plain))
    different = [k for k in theirs if not torch.equal(ours[k], theirs[k])]
    if different or ours.keys() != theirs.keys():
        raise RuntimeError(f"the swapped run's adapters differ from the unswapped run's in {different[:3]}")
    row = [json.loads(line) for line in (plain / "metrics.jsonl").read_text().splitlines() if '"loss"' in line][-1]
    peak = row.get("memory/peak_allocated_gib", row.get("memory/peak_rss_gib"))
    if pinned is False:
        raise RuntimeError("the swapped blocks' host buffers are not page-locked: their copies would not overlap")
    if torch.cuda.is_available() and not measured.get("peak_memory_gib", peak) < peak:
        raise RuntimeError(f"swapping every block did not lower the peak device memory ({measured.get('peak_memory_gib')}"
                           f" GiB against {peak} GiB unswapped)")
    return {"speed_from": f"its own run; unswapped: {row['time/step_s']:.4f} s/step, peak {peak:.2f} GiB, adapters "
                          f"bitwise equal; {len(swapped.loads)} block copies"}


def resume_bitwise(out: Path, args: list[str]) -> None:
    """Train again to the middle (checkpointed asynchronously), resume to the end, compare with the whole run."""
    import train_mmdit_stable
    from perf.checkpoint import checkpoints, read_checkpoint
    steps = int(next(a for a in args if a.startswith("logging.log_every=")).split("=")[1])
    resumed = [*[a for a in args if not a.startswith(("logging.output_dir=", "training.max_steps="))],
               f"logging.output_dir={out / 'resumed'}"]
    assert train_mmdit_stable.main([*resumed, f"training.max_steps={steps}"]) == 0
    assert train_mmdit_stable.main([*resumed, f"training.max_steps={2 * steps}"]) == 0
    whole = read_checkpoint(checkpoints(out / "run")[-1])[0]
    again = read_checkpoint(checkpoints(out / "resumed")[-1])[0]
    different = [k for k in whole["model"] if not torch.equal(whole["model"][k], again["model"][k])]
    if different or whole["model"].keys() != again["model"].keys():
        raise RuntimeError(f"the resumed run differs from the whole run in {different[:3]}")


def cap_memory_below_the_first_micro_batch(overrides: list[str], out: Path) -> None:
    """Cap this process's share of the GPU so that the configured micro-batch cannot fit but half of it can:
    two uncapped steps measure the memory a step needs; the cap is that less half of its activations."""
    import train_mmdit_stable
    probe = out / "probe"
    assert train_mmdit_stable.main([*overrides, "training.max_steps=2", "logging.log_every=1", "checkpoint.every=0",
                                    "validation.every=0", "sampling.steps=1", "batch_sizer.enabled=false",
                                    f"logging.output_dir={probe}"]) == 0
    rows = [json.loads(line) for line in (probe / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    peak, base = max(r["memory/peak_allocated_gib"] for r in rows) * 2**30, rows[-1]["memory/allocated_gib"] * 2**30
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.set_per_process_memory_fraction(min((base + 0.5 * (peak - base)) / total, 1.0))


# ----------------------------------------------------------------------------------------------- the table


def launch(row: Row, size: str, steps: int, out: Path, timeout_s: int, overrides: list[str]) -> dict:
    """One row in its own process(es); its result (or why it failed) from what they wrote."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    processes = 1
    if row.processes == "all":
        processes = torch.cuda.device_count() if torch.cuda.is_available() else 2
    command = [sys.executable, str(Path(__file__).resolve()), "--run-row", row.name, "--size", size,
               "--steps", str(steps), "--out", str(out), "--overrides", *overrides]
    if processes > 1:
        command[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2)
                                                                                       // processes)))}
    started = time.perf_counter()
    with open(out / "log.txt", "w") as log_file:
        try:
            proc = subprocess.run(command, stdout=log_file, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    result_file = out / "result_rank0.json"
    result = json.loads(result_file.read_text()) if result_file.is_file() else \
        {"status": "failed", "error": f"exit {code} before a result; last line: {last_line(out / 'log.txt')}"}
    if result["status"] == "passed" and code != 0:
        result = {"status": "failed", "error": f"exit {code}; last line: {last_line(out / 'log.txt')}"}
    return {**result, "seconds": round(time.perf_counter() - started, 1), "processes": processes}


def last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()] if path.is_file() else []
    return lines[-1][:300] if lines else "(no output)"


def table(results: dict[str, dict]) -> str:
    header = "| row | result | step (s) | images/s | MFU | peak memory (GiB) | host syncs/step | speed measured on |"
    lines = [header, "|" + "---|" * 8]

    def number(value, spec: str) -> str:
        return format(value, spec) if isinstance(value, (int, float)) else "-"

    for name, r in results.items():
        if r["status"] == "passed":
            outcome = "passed"
        elif r["status"] == "failed":
            outcome = f"FAILED: {r['error']}"
        else:
            outcome = f"not runnable here: {r['reason']}"
        lines.append(f"| {name} | {outcome} | {number(r.get('step_s'), '.4f')} | {number(r.get('images_per_s'), '.1f')} | "
                     f"{number(r.get('mfu'), '.1%')} | {number(r.get('peak_memory_gib'), '.2f')} | "
                     f"{number(r.get('host_syncs_per_step'), '.1f')} | "
                     f"{r.get('speed_from', 'its own run') if 'step_s' in r else '-'} |")
    return "\n".join(lines)


def describe_machine() -> dict:
    info = {"torch": torch.__version__, "python": sys.version.split()[0], "cpus": os.cpu_count(),
            "device": "cpu"}
    if torch.cuda.is_available():
        info.update(device=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(), cuda=torch.version.cuda,
                    capability=".".join(map(str, torch.cuda.get_device_capability(0))))
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="*", help="names of the rows to run (default: all)")
    parser.add_argument("--out", type=Path, default=Path("runs/selfcheck"), help="where the table and logs go")
    parser.add_argument("--steps", type=int, default=4, help="warm-up steps; as many more are timed")
    parser.add_argument("--size", choices=list(SIZES), help="model size (default: small on CPU, medium on GPU)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds one row may take")
    parser.add_argument("--overrides", nargs="*", default=[], help="key=value overrides for every row, e.g. "
                        "training.attention_backend=math")
    parser.add_argument("--run-row", help=argparse.SUPPRESS)  # internal: run one row in this process
    args = parser.parse_args(argv)
    size = args.size or ("medium" if torch.cuda.is_available() else "small")
    rows = {row.name: row for row in ROWS}
    if args.run_row:
        row = rows[args.run_row]
        run_row(row, [*SIZES[size], *row.overrides, *args.overrides], args.steps, args.out)
        return 0
    unknown = [name for name in args.rows or [] if name not in rows]
    if unknown:
        parser.error(f"unknown rows {unknown}; the rows are {list(rows)}")
    selected = [rows[name] for name in args.rows] if args.rows else ROWS
    machine, results = describe_machine(), {}
    print(f"self-check on {machine['device']} (torch {machine['torch']}), model size {size}, {args.steps} warm-up "
          f"+ {args.steps} timed steps per row", flush=True)
    for row in selected:
        reason = not_runnable(row)
        if reason:
            results[row.name] = {"status": "not runnable", "reason": reason}
        else:
            results[row.name] = launch(row, size, args.steps, args.out / slug(row.name), args.timeout, args.overrides)
        r = results[row.name]
        print(f"  {row.name}: {r['status']}{': ' + r.get('error', r.get('reason', '')) if r['status'] != 'passed' else ''}",
              flush=True)
    text = table(results)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "selfcheck.json").write_text(json.dumps({"machine": machine, "size": size, "steps": args.steps,
                                                         "rows": results}, indent=1))
    described = ", ".join(f"{key} {value}" for key, value in machine.items())
    (args.out / "selfcheck.md").write_text(f"Self-check on: {described}; model size {size}\n\n{text}\n")
    print(f"wrote {args.out / 'selfcheck.md'} and {args.out / 'selfcheck.json'}")
    failed = [name for name, r in results.items() if r["status"] == "failed"]
    if failed:
        print(f"{len(failed)} row(s) failed: {failed}; each row's log is in {args.out}/<row>/log.txt")
    return 1 if failed else 0


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


if __name__ == "__main__":
    sys.exit(main())
