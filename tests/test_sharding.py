"""FSDP and HSDP on CPU with gloo, in real processes: the same weights as DDP and one process, accumulation,
distributed checkpoints that resume under any world size and strategy, one-rank OOM, LoRA, export to diffusers,
and torchrun restarting workers killed at random moments."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from perf.checkpoint import checkpoints, verify
from tests.conftest import TINY, assert_close, final_weights, free_port, losses, metric_rows, spawn, train
from train_mmdit_stable import main

ROOT = Path(__file__).resolve().parents[1]
# Adam's eps well above the smallest gradients: an fp32 summation-order difference in a near-zero gradient then
# moves its weight by ~lr * 1e-6, not by up to lr, so strategies can be compared at 1e-5.
EXACT = [*TINY, "optimizer.eps=1e-3", "training.max_steps=3"]


def runs(tmp_path: Path, **specs) -> dict[str, Path]:
    """Each spec is (ranks, overrides); every run trains the same global batch of 8. Returns the run dirs."""
    out = {}
    for name, (ranks, overrides) in specs.items():
        run = [*overrides, f"logging.output_dir={tmp_path / name}"]
        if ranks == 1:
            assert main(run) == 0
        else:
            assert [r["status"] for r in spawn(ranks, train, run, tmp_path=tmp_path)] == [0] * ranks, name
        out[name] = tmp_path / name
    return out


def train_recording_timesteps(overrides: list[str]) -> dict:
    """main() on this rank, recording what the timestep embedding receives in every training forward."""
    import configs.build as build
    seen, real_build = [], build.build_trained_model

    def build_trained_model(*args):
        model = real_build(*args)
        model.transformer.time_text_embed.register_forward_pre_hook(
            lambda module, args: seen.append((str(args[0].dtype), args[0].tolist())) if module.training else None)
        return model

    build.build_trained_model = build_trained_model
    import train_mmdit_stable
    train_mmdit_stable.build_trained_model = build_trained_model
    from torch._dynamo.utils import counters
    status = main(overrides)
    return {"status": status, "timesteps": seen, "graphs": counters["stats"]["unique_graphs"],
            "graph breaks": sum(counters["graph_break"].values())}


def test_fsdp_in_bf16_feeds_the_timestep_embedding_fp32_timesteps(tmp_path):
    """sigma * 1000 reaches the timestep embedding in fp32 under FSDP's bf16 policy, exactly as under DDP with
    bf16 autocast (FSDP's default cast of the root's inputs made it bf16: steps of 2-4 above 256). The blocks
    are compiled and checkpointed under FSDP: each is one graph, with no graph break (DDP's compiled blocks:
    tests/test_distributed.py)."""
    common = [*TINY, "training.max_steps=2", "training.dtype=bf16", "training.train_batch_size=4"]
    compiled = ["compile.enabled=true", "compile.backend=aot_eager", "training.activation_checkpointing=full"]
    timesteps = {}
    for strategy in ("ddp", "fsdp"):
        run = [*common, *(compiled if strategy == "fsdp" else []), f"parallel.strategy={strategy}",
               f"logging.output_dir={tmp_path / strategy}"]
        ranks = spawn(2, train_recording_timesteps, run, tmp_path=tmp_path)
        assert [r["status"] for r in ranks] == [0, 0], ranks
        if strategy == "fsdp":
            assert all(r["graphs"] >= 1 and r["graph breaks"] == 0 for r in ranks), ranks
        timesteps[strategy] = [r["timesteps"] for r in ranks]
    assert timesteps["fsdp"] == timesteps["ddp"] and len(timesteps["ddp"][0]) == 2
    assert all(dtype == "torch.float32" for rank in timesteps["fsdp"] for dtype, _ in rank)


@pytest.fixture(scope="module")
def strategies(tmp_path_factory):
    """One process, 2-rank DDP, 2-rank FSDP with accumulation 2, 4-rank HSDP (2 shards x 2 replicas) with
    accumulation 2: global batch 8 each. FSDP also validates (EMA weights swapped in) after every step with its
    weights kept gathered after forward: neither may change what it trains."""
    tmp = tmp_path_factory.mktemp("strategies")
    return runs(tmp, one=(1, [*EXACT, "training.train_batch_size=8"]),
                ddp=(2, [*EXACT, "training.train_batch_size=4"]),
                fsdp=(2, [*EXACT, "training.train_batch_size=2", "training.gradient_accumulation_steps=2",
                          "parallel.strategy=fsdp", "parallel.reshard_after_forward=false", "validation.every=1"]),
                hsdp=(4, [*EXACT, "training.train_batch_size=1", "training.gradient_accumulation_steps=2",
                          "parallel.strategy=hsdp", "parallel.shard_size=2"]))


def test_fsdp_and_hsdp_train_the_weights_of_ddp_and_one_process(strategies):
    one = final_weights(strategies["one"])
    for name in ("ddp", "fsdp", "hsdp"):
        assert_close(final_weights(strategies[name]), one, atol=1e-5)
        assert_close(final_weights(strategies[name], "ema"), final_weights(strategies["one"], "ema"), atol=1e-5)
        assert losses(strategies[name]) == pytest.approx(losses(strategies["one"]), rel=1e-5)
    written = {name: json.loads((checkpoints(path)[-1] / "state.json").read_text())["strategy"]
               for name, path in strategies.items()}
    assert written == {"one": "ddp", "ddp": "ddp", "fsdp": "fsdp", "hsdp": "hsdp"}
    assert len(list(checkpoints(strategies["fsdp"])[-1].glob("__*_*.distcp"))) == 2  # each rank wrote its shards


def test_every_strategy_reports_its_training_state_per_rank(strategies):
    state = {name: [r for r in metric_rows(path) if "loss" in r][-1]["memory/train_state_gib"]
             for name, path in strategies.items()}
    assert state["ddp"] == pytest.approx(state["one"], rel=1e-6)  # a whole replica on every rank
    assert 0.45 < state["fsdp"] / state["one"] < 0.6  # half of it (plus a little padding and the buffers)
    assert 0.45 < state["hsdp"] / state["one"] < 0.6  # shard groups of 2


def test_fsdp_checkpoint_exports_to_diffusers(strategies, tmp_path):
    import export_mmdit
    from sample_mmdit import load_trained
    diffusers = pytest.importorskip("diffusers")
    assert export_mmdit.main(["--checkpoint", str(strategies["fsdp"]), "--out", str(tmp_path / "out")]) == 0
    theirs = diffusers.SD3Transformer2DModel.from_pretrained(tmp_path / "out").eval()
    ours = load_trained(checkpoints(strategies["fsdp"])[-1])[0].transformer  # the EMA weights, as exported
    gen = torch.Generator().manual_seed(0)
    x, c, p = (torch.randn(2, 3, 32, 32, generator=gen), torch.randn(2, 7, 32, generator=gen),
               torch.randn(2, 32, generator=gen))
    t = torch.tensor([200.0, 800.0])
    with torch.no_grad():
        expected = ours(x, c, p, t)
        got = theirs(hidden_states=x, encoder_hidden_states=c, pooled_projections=p, timestep=t, return_dict=False)[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def record_cross_replica_reductions(overrides: list[str]) -> dict:
    """train() on this rank, counting for each training forward (a micro-step) the all-reduces FSDP runs over
    the replica groups (2 ranks of the 4; the training and gloo groups span all 4) until the next one."""
    import torch.distributed as dist

    import train_mmdit_stable
    calls, real_all_reduce, real_build = [], dist.all_reduce, train_mmdit_stable.build_trained_model

    def all_reduce(tensor, *args, group=None, **kwargs):
        if group is not None and dist.get_world_size(group) == 2 and calls:
            calls[-1] += 1
        return real_all_reduce(tensor, *args, group=group, **kwargs)

    def build_trained_model(*args):
        model = real_build(*args)
        model.register_forward_pre_hook(lambda module, _: calls.append(0) if module.training else None)
        return model

    dist.all_reduce, train_mmdit_stable.build_trained_model = all_reduce, build_trained_model
    return {"status": main(overrides), "cross_replica": calls}


def test_hsdp_all_reduces_across_replicas_once_per_optimizer_step(tmp_path):
    """4 ranks as 2 shard groups x 2 replicas, accumulation 2: the first micro-step reduce-scatters within the
    shard groups only; the second also all-reduces across the replicas."""
    run = [*EXACT, "training.max_steps=1", "training.train_batch_size=1", "training.gradient_accumulation_steps=2",
           "parallel.strategy=hsdp", "parallel.shard_size=2", f"logging.output_dir={tmp_path / 'run'}"]
    results = spawn(4, record_cross_replica_reductions, run, tmp_path=tmp_path)
    assert [r["status"] for r in results] == [0] * 4, results
    first, last = results[0]["cross_replica"]
    assert first == 0 and last > 1  # one per FSDP module with gradients, on the last micro-step only


def test_a_checkpoint_resumes_under_other_world_sizes_and_strategies(tmp_path):
    """One process -> 2-rank FSDP -> 4-rank HSDP -> one process, two steps each, equals eight steps in one
    process. (A constant learning rate after warmup: each leg ends at its own max_steps.)"""
    common = [*EXACT, "training.max_steps=8", "checkpoint.every=2", "optimizer.min_lr_ratio=1"]
    fsdp = ["training.train_batch_size=4", "parallel.strategy=fsdp"]
    hsdp = ["training.train_batch_size=2", "parallel.strategy=hsdp", "parallel.shard_size=2"]
    one = ["training.train_batch_size=8"]
    legs = [(1, one), (2, fsdp), (4, hsdp), (1, one)]
    for leg, (ranks, overrides) in enumerate(legs):
        run = [*common, *overrides, f"training.max_steps={2 * (leg + 1)}", f"logging.output_dir={tmp_path / 'chain'}"]
        if ranks == 1:
            assert main(run) == 0
        else:
            assert [r["status"] for r in spawn(ranks, train, run, tmp_path=tmp_path)] == [0] * ranks
        assert [p.name for p in checkpoints(tmp_path / "chain")][-1] == f"step_{2 * (leg + 1):08d}"
    assert main([*common, *one, f"logging.output_dir={tmp_path / 'straight'}"]) == 0
    assert_close(final_weights(tmp_path / "chain"), final_weights(tmp_path / "straight"), atol=1e-5)
    assert_close(final_weights(tmp_path / "chain", "ema"), final_weights(tmp_path / "straight", "ema"), atol=1e-5)


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_one_rank_out_of_memory_under_fsdp_never_hangs_and_keeps_the_math(tmp_path, phase):
    """Rank 1 alone runs out of memory inside block 1 in step 1 (in its forward, or in its backward while the
    other rank goes on to its next collective): both ranks split the step the same way, finish (spawn() fails
    on a hang), and the weights match the run without OOM."""
    common = [*EXACT, "parallel.strategy=fsdp", "batch_sizer.enabled=true", "training.train_batch_size=4"]
    oom = [*common, "batch_sizer.debug_oom_above=2", "batch_sizer.debug_oom_ranks=[1]",
           "batch_sizer.debug_oom_steps=[1]", f"batch_sizer.debug_oom_phase={phase}",
           "batch_sizer.debug_oom_module=transformer.transformer_blocks.1", f"logging.output_dir={tmp_path / 'oom'}"]
    assert [r["status"] for r in spawn(2, train, oom, tmp_path=tmp_path)] == [0, 0]
    assert [r["micro_batch"] for r in metric_rows(tmp_path / "oom") if "micro_batch" in r] == [4, 2, 2]
    assert [r["oom_events"] for r in metric_rows(tmp_path / "oom") if "oom_events" in r] == [0, 1, 1]
    clean = runs(tmp_path, clean=(2, [*common, "batch_sizer.enabled=false"]))["clean"]
    assert_close(final_weights(tmp_path / "oom"), final_weights(clean), atol=1e-5)


def test_lora_under_fsdp_equals_lora_under_ddp(lora_run, tmp_path):
    import export_mmdit
    from tests.test_lora import check_exported_adapter
    common = ["optimizer.eps=1e-3", "training.max_steps=3", "training.train_batch_size=2", "optimizer.lr=5e-2"]
    for name, strategy in (("ddp", "ddp"), ("fsdp", "fsdp")):
        run = lora_run(*common, f"parallel.strategy={strategy}", run=name)
        assert [r["status"] for r in spawn(2, train, run, tmp_path=tmp_path)] == [0, 0]
    ddp, fsdp = final_weights(tmp_path / "ddp"), final_weights(tmp_path / "fsdp")
    assert all(".lora_" in k for k in fsdp)
    assert_close(fsdp, ddp, atol=1e-5)
    assert export_mmdit.main(["--checkpoint", str(tmp_path / "fsdp"), "--out", str(tmp_path / "adapter")]) == 0
    check_exported_adapter(tmp_path / "fsdp", tmp_path / "adapter", use_ema=True)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def workers(launcher: subprocess.Popen) -> list[int]:
    """The training processes torchrun started (not torchrun itself)."""
    def command(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return ""
    return [p for p in descendants(launcher.pid)
            if "train_mmdit_stable.py" in command(p) and "torch.distributed.run" not in command(p)]


@pytest.mark.full  # the deterministic kills of test_preemption.py and test_orphans.py run in `make test`
def test_workers_killed_at_random_restart_and_finish_with_the_uninterrupted_weights(tmp_path):
    """MAX_RESTARTS: torchrun restarts both FSDP workers after one is SIGKILLed (mid-step, mid-checkpoint,
    anywhere); the run resumes from its last complete checkpoint and ends bit for bit where an uninterrupted
    run ends. With MASTER_ADDR, as on several nodes (where torchrun's static rendezvous left the restarted
    workers waiting forever, so the launcher uses c10d rendezvous)."""
    import threading
    overrides = [*TINY, "parallel.strategy=fsdp", "training.train_batch_size=4", "training.max_steps=12",
                 "checkpoint.every=2", "sampling.steps=1"]
    env = {**os.environ, "PYTHON": sys.executable, "NPROC_PER_NODE": "2", "PYTHONUNBUFFERED": "1"}
    assert [r["status"] for r in spawn(2, train, [*overrides, f"logging.output_dir={tmp_path / 'straight'}"],
                                       tmp_path=tmp_path)] == [0, 0]

    launcher = subprocess.Popen([str(ROOT / "train_mmdit_stable.sh"), *overrides,
                                 f"logging.output_dir={tmp_path / 'killed'}"],
                                env={**env, "MAX_RESTARTS": "6", "MASTER_ADDR": "127.0.0.1",
                                     "MASTER_PORT": str(free_port())}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(launcher.stdout.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 400
    while not any("complete" in line for line in lines) and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # the workers trained and checkpointed (so the restarted ones resume)
    rng = random.Random(7)
    time.sleep(rng.uniform(0.0, 0.8))  # 10 steps remain: ~0.1 s each, and slower on a busy machine
    alive, kills = workers(launcher), 0
    if len(alive) == 2 and launcher.poll() is None:
        os.kill(rng.choice(alive), signal.SIGKILL)
        kills = 1
    launcher.wait(timeout=400)
    reader.join(timeout=10)
    output = "".join(lines)
    assert launcher.returncode == 0, output[-4000:]
    assert kills == 1, f"the test must interrupt the run ({kills} kills)"
    assert "resumed from" in output, output[-4000:]
    for path in checkpoints(tmp_path / "killed"):
        assert verify(path) is None, path
    assert_close(final_weights(tmp_path / "killed"), final_weights(tmp_path / "straight"))
