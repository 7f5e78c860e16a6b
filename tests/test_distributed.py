"""DDP on CPU with gloo: real multi-process runs (spawned processes and torchrun through the launcher)."""

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY, final_weights, losses, metric_rows

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 180  # a hung collective fails the test instead of the suite


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


WRITE_EVENTS = {"os.mkdir", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree", "os.truncate", "os.symlink"}


def record_writes_under(root: str, log: list) -> None:
    """An audit hook noting every file-system write below `root` made by this process."""
    def hook(event, args):
        if event == "open" and args[0] is not None:
            path, mode, flags = str(args[0]), args[1] or "", args[2] or 0
            writes = any(c in mode for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            if writes and path.startswith(root):
                log.append((event, path))
        elif event in WRITE_EVENTS and str(args[0]).startswith(root):
            log.append((event, str(args[0])))
    sys.addaudithook(hook)


def rank_main(rank: int, world_size: int, port: int, func, args: tuple, out: Path) -> None:
    """One spawned rank with torchrun's environment; writes its result (or error) to `out`."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    try:
        result = func(*args)
    except Exception as e:  # reported to the test, which fails with it
        result = f"{type(e).__name__}: {e}"
    out.write_text(json.dumps(result))


def spawn(world_size: int, func, *args, tmp_path: Path) -> list:
    """Run func(*args) on `world_size` gloo ranks; results in rank order. Fails (not hangs) on a timeout."""
    ctx, port = mp.get_context("spawn"), free_port()
    outs = [tmp_path / f"rank{r}.json" for r in range(world_size)]
    procs = [ctx.Process(target=rank_main, args=(r, world_size, port, func, args, outs[r]))
             for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(TIMEOUT_S)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        p.kill()
    assert not hung, f"ranks {hung} still running after {TIMEOUT_S}s"
    return [json.loads(o.read_text()) for o in outs]


def train(overrides: list[str]):
    from train_mmdit_stable import main
    return {"status": main(overrides)}


def train_recording_writes(overrides: list[str], run_dir: str):
    from train_mmdit_stable import main
    writes = []
    record_writes_under(run_dir, writes)
    return {"status": main(overrides), "writes": writes}


@pytest.fixture(scope="module")
def two_ranks_and_one(tmp_path_factory):
    """The same global batch (8) as 2 ranks x accumulation 4 and as 1 rank x accumulation 8."""
    tmp = tmp_path_factory.mktemp("ddp")
    common = [*TINY, "training.max_steps=3", "training.train_batch_size=1"]
    two = [*common, "training.gradient_accumulation_steps=4", f"logging.output_dir={tmp / 'two'}"]
    one = [*common, "training.gradient_accumulation_steps=8", f"logging.output_dir={tmp / 'one'}"]
    results = spawn(2, train_recording_writes, two, str(tmp / "two"), tmp_path=tmp)
    from train_mmdit_stable import main
    assert main(one) == 0
    return tmp, results


def test_two_ranks_equal_one_rank_with_the_same_global_batch(two_ranks_and_one):
    tmp, results = two_ranks_and_one
    assert [r["status"] for r in results] == [0, 0], results
    ref, ddp = final_weights(tmp / "one"), final_weights(tmp / "two")
    assert ref.keys() == ddp.keys()
    # Only the fp32 summation order differs: 8 micro-gradients summed in a row, or 4 + 4 then all-reduced.
    diffs = torch.cat([(ddp[k] - ref[k]).abs().flatten() for k in ref])
    assert diffs.max() < 2e-4 and diffs.mean() < 1e-7, (diffs.max(), diffs.mean())
    assert losses(tmp / "two") == pytest.approx(losses(tmp / "one"), rel=1e-5)


def test_only_rank_zero_writes_the_run_directory(two_ranks_and_one):
    tmp, results = two_ranks_and_one
    assert results[0]["writes"], "the audit hook saw no write by rank 0, so it cannot see rank 1's either"
    assert results[1]["writes"] == []
    rows = metric_rows(tmp / "two")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]  # once each, not once per rank
    assert json.loads((tmp / "two" / "world.json").read_text()) == {"world_size": 2, "strategy": "ddp"}


@pytest.mark.slow
def test_ddp_with_compile_activation_checkpointing_and_bf16(tmp_path):
    """Compiled before the wrap, checkpointed blocks, bf16 autocast: 2 ranks x accumulation 2 equal 1 rank x
    accumulation 4, since each micro-batch holds the same samples either way."""
    plugins = [*TINY, "training.max_steps=3", "training.train_batch_size=2", "compile.enabled=true",
               "training.activation_checkpointing=1", "training.dtype=bf16"]
    two = [*plugins, "training.gradient_accumulation_steps=2", f"logging.output_dir={tmp_path / 'two'}"]
    assert [r["status"] for r in spawn(2, train, two, tmp_path=tmp_path)] == [0, 0]
    from train_mmdit_stable import main
    assert main([*plugins, "training.gradient_accumulation_steps=4", f"logging.output_dir={tmp_path / 'one'}"]) == 0
    ref, ddp = final_weights(tmp_path / "one"), final_weights(tmp_path / "two")
    diffs = torch.cat([(ddp[k] - ref[k]).abs().flatten() for k in ref])
    assert diffs.max() < 2e-4 and diffs.mean() < 1e-7, (diffs.max(), diffs.mean())


def test_profiler_traces_one_worker_per_rank(tmp_path):
    from tests.test_observability import PROFILE, load_with_tb_profiler
    run = [*TINY, "training.max_steps=5", *PROFILE, f"logging.output_dir={tmp_path / 'run'}"]
    assert [r["status"] for r in spawn(2, train, run, tmp_path=tmp_path)] == [0, 0]
    assert {"rank0", "rank1"} <= set(load_with_tb_profiler(tmp_path / "run" / "tensorboard").workers)


def count_gradient_all_reduces(accumulation: int, use_no_sync: bool) -> int:
    """All-reduce calls (one per gradient bucket) during one optimizer step of `forward_backward`."""
    from contextlib import nullcontext

    import train_mmdit_stable
    from configs.schema import load_config
    from data.shapes import ShapesDataset, all_prompts, caption
    from configs.build import build_model, build_tokenizer
    from perf.distributed import World, destroy_distributed, init_distributed
    from perf.parallel import wrap_ddp
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    world = World(int(os.environ["RANK"]), 2, int(os.environ["RANK"]))
    device = init_distributed(world, torch.device("cpu"), 60)
    cfg = load_config(overrides=[*TINY, "training.train_batch_size=2", "parallel.ddp_bucket_cap_mb=0.1",
                                 "model.attention_head_dim=64",  # 1.6 MB of gradients: several buckets
                                 f"training.gradient_accumulation_steps={accumulation}"])
    tokenizer = build_tokenizer()
    model = wrap_ddp(build_model(cfg, ShapesDataset, tokenizer), device, cfg.parallel.ddp_bucket_cap_mb)
    calls = []

    def counting_hook(state, bucket):
        calls.append(1)
        return allreduce_hook(None, bucket)

    model.register_comm_hook(None, counting_hook)
    if not use_no_sync:  # the control: every micro-step synchronises
        train_mmdit_stable.sync_gradients = lambda model, last_micro_step: nullcontext()
    n = 2 * accumulation
    batch = {"step": 0, "position": torch.arange(world.rank * n, (world.rank + 1) * n),
             "latents": torch.randn(n, 3, 32, 32), "input_ids": tokenizer([caption(*all_prompts()[0])] * n)}
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    buckets = train_mmdit_stable.SigmaBuckets(device)
    train_mmdit_stable.forward_backward(model, batch, cfg, device, scaler, buckets, 2)  # DDP then rebuilds buckets
    calls.clear()
    train_mmdit_stable.forward_backward(model, batch, cfg, device, scaler, buckets, 2)
    # Let gloo's thread drop the Python hook's last callback (it needs the GIL) before the group is torn down
    # on this thread: tearing down first deadlocks (a torch issue with Python comm hooks on gloo, not ours).
    torch.distributed.barrier()
    destroy_distributed()
    return len(calls)


def test_accumulation_all_reduces_once_per_optimizer_step(tmp_path):
    buckets = spawn(2, count_gradient_all_reduces, 1, True, tmp_path=tmp_path)
    assert buckets[0] == buckets[1] and buckets[0] > 1  # several 0.1 MB buckets, so each call is counted
    assert spawn(2, count_gradient_all_reduces, 4, True, tmp_path=tmp_path) == buckets
    assert spawn(2, count_gradient_all_reduces, 4, False, tmp_path=tmp_path) == [4 * b for b in buckets]


def test_an_unused_parameter_is_named(tiny, monkeypatch, caplog):
    from models.text_encoder import TextToImage
    from train_mmdit_stable import main
    original = TextToImage.__init__

    def with_dead_weight(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.dead_weight = torch.nn.Parameter(torch.zeros(3))

    monkeypatch.setattr(TextToImage, "__init__", with_dead_weight)
    with pytest.raises(RuntimeError, match="dead_weight"):
        main(tiny("training.max_steps=1"))


def test_resume_with_another_world_size_must_keep_the_global_batch(tiny, tmp_path, caplog):
    from configs.schema import ConfigError, load_config
    from train_mmdit_stable import main, prepare_run_dir
    assert main(tiny("training.max_steps=1")) == 0
    cfg = load_config(overrides=tiny("training.max_steps=2"))
    with pytest.raises(ConfigError, match=r"world size\): 8 -> 16"):
        prepare_run_dir(cfg, world_size=2)
    halved = load_config(overrides=tiny("training.max_steps=2", "training.train_batch_size=4"))
    prepare_run_dir(halved, world_size=2)  # 4 x 2 ranks: the same global batch, so the resume is allowed


def launcher(env: dict, overrides: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env}  # torchrun sets 1 only with several local processes
    return subprocess.Popen([str(ROOT / "train_mmdit_stable.sh"), *overrides], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> str:
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, output[-3000:]
    return output


@pytest.mark.slow
def test_launcher_one_node_and_two_nodes_over_loopback(tmp_path):
    """NPROC_PER_NODE=2 on one node, and NNODES=2 x 1 process as two torchrun node groups on this machine:
    the same 2-rank job, so the same weights bit for bit."""
    overrides = [*TINY, "training.max_steps=4", "training.train_batch_size=4"]
    finish(launcher({"NPROC_PER_NODE": "2"}, [*overrides, f"logging.output_dir={tmp_path / 'node'}"]))
    port, two_nodes = str(free_port()), [f"logging.output_dir={tmp_path / 'nodes'}"]
    nodes = [launcher({"NNODES": "2", "NODE_RANK": str(r), "NPROC_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": port}, [*overrides, *two_nodes]) for r in (0, 1)]
    output = [finish(p) for p in nodes]
    assert "over 2 process(es)" in output[0]
    single, multi = final_weights(tmp_path / "node"), final_weights(tmp_path / "nodes")
    assert all(torch.equal(single[k], multi[k]) for k in single)
    assert json.loads((tmp_path / "nodes" / "world.json").read_text()) == {"world_size": 2, "strategy": "ddp"}
