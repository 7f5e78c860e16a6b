"""DDP on CPU with gloo: real multi-process runs (forked ranks, and torchrun through the launcher)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import (ROOT, TIMEOUT_S, TINY, assert_close, final_weights, free_port, gloo_threads,
                            losses, metric_rows, spawn, train, trains)

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


def train_recording_writes(overrides: list[str], run_dir: str):
    from train_mmdit_stable import main
    writes = []
    record_writes_under(run_dir, writes)
    return {"status": main(overrides), "writes": writes, "gloo threads": gloo_threads()}


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
    # Only the fp32 summation order differs: 8 micro-gradients summed in a row, or 4 + 4 then all-reduced.
    assert_close(final_weights(tmp / "two"), final_weights(tmp / "one"), atol=2e-4, mean_atol=1e-7)
    assert losses(tmp / "two") == pytest.approx(losses(tmp / "one"), rel=1e-5)


def test_a_finished_run_has_freed_its_process_group(two_ranks_and_one):
    """A group still alive when the interpreter shuts down lets gloo abort a finished run now and then (exit -6,
    "terminate called without an active exception"); DDP holds its group in a reference cycle."""
    assert [r["gloo threads"] for r in two_ranks_and_one[1]] == [[], []]


def test_ranks_write_only_their_checkpoint_files(two_ranks_and_one):
    """Rank 0 writes the run directory; every rank writes its own share of each checkpoint (DCP spreads the
    replicated tensors over the ranks) into the temporary directory rank 0 then publishes."""
    tmp, results = two_ranks_and_one
    assert results[0]["writes"], "the audit hook saw no write by rank 0, so it cannot see rank 1's either"
    others = [(event, Path(path)) for event, path in results[1]["writes"]]
    files = [path.name for event, path in others if event == "open"]
    assert files and all(name.startswith("__1_") for name in files), others  # only its own DCP file
    assert all(path.parent.name == "checkpoints" and path.name.startswith(".tmp-step_") for event, path in others
               if event != "open"), others  # and DCP's mkdir of the temporary directory rank 0 made
    rows = metric_rows(tmp / "two")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]  # once each, not once per rank
    run = json.loads((tmp / "two" / "run.json").read_text())
    assert (run["world_size"], run["strategy"]) == (2, "ddp")


def train_counting_compiled_graphs(overrides: list[str]) -> dict:
    from torch._dynamo.utils import counters
    result = train(overrides)
    return {**result, "graphs": counters["stats"]["unique_graphs"], "captured": counters["stats"]["calls_captured"],
            "graph breaks": sum(counters["graph_break"].values())}


def test_ddp_with_compile_activation_checkpointing_and_bf16(tmp_path):
    """Compiled before the wrap, checkpointed blocks, bf16 autocast: the blocks run compiled on both ranks
    (dynamo, through DDP's optimizer, captures graphs with the checkpointed regions), and 2 ranks x
    accumulation 2 equal 1 rank x accumulation 4, since each micro-batch holds the same samples either way."""
    plugins = [*TINY, "training.max_steps=3", "training.train_batch_size=2", "compile.enabled=true",
               "compile.backend=aot_eager", "training.activation_checkpointing=full", "training.dtype=bf16"]
    two = [*plugins, "training.gradient_accumulation_steps=2", f"logging.output_dir={tmp_path / 'two'}"]
    ranks = spawn(2, train_counting_compiled_graphs, two, tmp_path=tmp_path)
    assert [r["status"] for r in ranks] == [0, 0], ranks
    assert all(r["graphs"] >= 1 and r["captured"] >= 2 and r["graph breaks"] == 0 for r in ranks), ranks
    from train_mmdit_stable import main
    assert main([*plugins, "training.gradient_accumulation_steps=4", f"logging.output_dir={tmp_path / 'one'}"]) == 0
    assert_close(final_weights(tmp_path / "two"), final_weights(tmp_path / "one"), atol=2e-4, mean_atol=1e-7)


def test_profiler_traces_one_worker_per_rank(tmp_path):
    from tests.test_observability import PROFILE, load_with_tb_profiler
    run = [*TINY, "training.max_steps=5", *PROFILE, f"logging.output_dir={tmp_path / 'run'}"]
    assert [r["status"] for r in spawn(2, train, run, tmp_path=tmp_path)] == [0, 0]
    assert {"rank0", "rank1"} <= set(load_with_tb_profiler(tmp_path / "run" / "tensorboard").workers)


def count_gradient_all_reduces(accumulation: int, use_no_sync: bool) -> int:
    """All-reduce calls (one per gradient bucket) during one optimizer step of `forward_backward`, as the
    profiler records them."""
    from contextlib import nullcontext

    import train_mmdit_stable
    from configs.build import build_model, build_tokenizer
    from configs.schema import load_config
    from data.shapes import ShapesDataset, all_prompts, caption
    from perf.parallel import wrap_ddp
    from runtime.distributed import World, destroy_distributed, init_distributed

    world = World(int(os.environ["RANK"]), 2, int(os.environ["RANK"]))
    device = init_distributed(world, torch.device("cpu"), 60)
    cfg = load_config(overrides=[*TINY, "training.train_batch_size=2", "parallel.ddp_bucket_cap_mb=0.1",
                                 "model.attention_head_dim=64",  # 1.6 MB of gradients: several buckets
                                 f"training.gradient_accumulation_steps={accumulation}"])
    tokenizer = build_tokenizer()
    model = wrap_ddp(build_model(cfg, ShapesDataset, tokenizer), device, cfg.parallel.ddp_bucket_cap_mb)
    if not use_no_sync:  # the control: every micro-step synchronises
        train_mmdit_stable.sync_gradients = lambda model, last_micro_step: nullcontext()
    n = 2 * accumulation
    batch = {"step": 0, "first_position": world.rank * n, "latents": torch.randn(n, 3, 32, 32),
             "noise": torch.randn(n, 3, 32, 32), "sigma": torch.rand(n),
             "text": tokenizer([caption(*all_prompts()[0])] * n)}
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    buckets = train_mmdit_stable.SigmaBuckets(device)
    train_mmdit_stable.forward_backward(model, batch, cfg, scaler, buckets, 2)  # DDP then rebuilds buckets
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        train_mmdit_stable.forward_backward(model, batch, cfg, scaler, buckets, 2)
    destroy_distributed()
    return sum(event.name == "c10d::allreduce_" for event in profile.events())


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

    def initial_value(self, name, seed):
        return torch.zeros(3) if name == "dead_weight" else value_of(self, name, seed)

    value_of = TextToImage.initial_value
    monkeypatch.setattr(TextToImage, "__init__", with_dead_weight)
    monkeypatch.setattr(TextToImage, "initial_value", initial_value)
    with pytest.raises(RuntimeError, match="dead_weight"):
        main(tiny("training.max_steps=1"))


def test_resume_with_another_world_size_must_keep_the_global_batch(tiny, tmp_path, caplog):
    from configs.run_dir import prepare_run_dir
    from configs.schema import load_config
    from errors import ConfigError
    from train_mmdit_stable import main
    assert main(tiny("training.max_steps=1")) == 0
    cfg = load_config(overrides=tiny("training.max_steps=2"))
    with pytest.raises(ConfigError, match=r"world size\): 8 -> 16\); keep the global batch with "
                                          r"training\.train_batch_size=4 training\.gradient_accumulation_steps=1;"):
        prepare_run_dir(cfg, world_size=2)
    with pytest.raises(ConfigError, match=r"8 -> 24\); 3 processes cannot split a global batch of 8: resume on a "
                                          r"process count that divides it \(1, 2, 4, 8\); or choose another"):
        prepare_run_dir(cfg, world_size=3)  # a user's NPROC_PER_NODE=3, which no override can make fit
    halved = load_config(overrides=tiny("training.max_steps=2", "training.train_batch_size=4"))
    prepare_run_dir(halved, world_size=2)  # 4 x 2 ranks: the same global batch, so the resume is allowed


def launcher(env: dict, overrides: list[str]) -> subprocess.Popen:
    env = {**os.environ, **env}
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


def test_two_launcher_nodes_over_loopback_train_as_two_ranks_of_one_node(tmp_path):
    """NNODES=2 x 1 process as two torchrun node groups on this machine, against the same 2-rank job on one node
    (in processes of its own: NPROC_PER_NODE=2 under the launcher is tests/test_preemption.py's): the same
    weights bit for bit."""
    overrides = [*TINY, "training.max_steps=4", "training.train_batch_size=4"]
    trains(2, [*overrides, f"logging.output_dir={tmp_path / 'node'}"], tmp_path)
    port, two_nodes = str(free_port()), [f"logging.output_dir={tmp_path / 'nodes'}"]
    nodes = [launcher({"NNODES": "2", "NODE_RANK": str(r), "NPROC_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": port}, [*overrides, *two_nodes]) for r in (0, 1)]
    output = [finish(p) for p in nodes]
    assert "over 2 process(es)" in output[0]
    assert_close(final_weights(tmp_path / "nodes"), final_weights(tmp_path / "node"))
    assert json.loads((tmp_path / "nodes" / "run.json").read_text())["world_size"] == 2


def test_a_config_error_under_torchrun_is_one_line_and_exit_2(tmp_path):
    """Whatever the launcher: rank 0 prints the error once, no torchrun traceback, and the exit status of one
    process (2)."""
    proc = launcher({"NPROC_PER_NODE": "2"}, [*TINY, "training.max_steps=-3", f"logging.output_dir={tmp_path}"])
    output, _ = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 2, output[-3000:]
    assert output.count("config error: training.max_steps must be > 0, got -3") == 1, output
    assert "Traceback" not in output and "ChildFailedError" not in output, output
    assert not tmp_path.joinpath("config.yaml").exists()


def broken_load(*args, **kwargs):
    raise ValueError("injected: a bug in the checkpoint load")


def resume_with_a_broken_load(overrides: list[str]) -> dict:
    """main() on one rank, resuming while the checkpoint load fails as a bug in it (ours or torch's) would."""
    import torch.distributed.checkpoint as dcp

    from train_mmdit_stable import main
    dcp.load = broken_load  # in this rank's process only
    return {"status": main(overrides)}


def test_a_bug_in_the_checkpoint_load_keeps_its_type_and_traceback(two_ranks_and_one, tmp_path, monkeypatch,
                                                                   caplog):
    """Not "config error: ..." and exit 2: a ValueError that is not the user's input keeps its type and traceback
    (exit 1). One process raises it; of two ranks, rank 0 raises it (its traceback is printed once) and rank 1,
    whose own error rank 0 reports, returns 1 without a word."""
    import shutil

    import torch.distributed.checkpoint as dcp

    from train_mmdit_stable import main
    tmp, _ = two_ranks_and_one
    resume = [*TINY, "training.max_steps=4", "training.train_batch_size=1"]
    shutil.copytree(tmp / "one", tmp_path / "one")
    with monkeypatch.context() as patch:
        patch.setattr(dcp, "load", broken_load)
        with pytest.raises(ValueError, match="injected"):
            main([*resume, "training.gradient_accumulation_steps=8", f"logging.output_dir={tmp_path / 'one'}"])
    assert "config error" not in caplog.text and "input error" not in caplog.text

    shutil.copytree(tmp / "two", tmp_path / "two")
    results = spawn(2, resume_with_a_broken_load, [*resume, "training.gradient_accumulation_steps=4",
                                                   f"logging.output_dir={tmp_path / 'two'}"], tmp_path=tmp_path)
    assert results == ["ValueError: injected: a bug in the checkpoint load", {"status": 1}], results


def test_a_shared_checkpoint_that_would_run_code_is_refused_and_runs_nothing(two_ranks_and_one, tmp_path, caplog):
    """A run directory whose DCP metadata was replaced by a pickle that runs a shell command (its manifest updated
    to match): export, sampling and a resume, on one process and on two ranks, each refuse it in one line naming
    the file (exit 2), and the command never runs."""
    import pickle
    import shutil

    import export_mmdit
    import sample_mmdit
    from perf.checkpoint import checkpoints
    from tests.conftest import RunsCode, reseal
    from train_mmdit_stable import main
    tmp, _ = two_ranks_and_one
    marker = tmp_path / "ran"
    for run in ("one", "two"):
        shutil.copytree(tmp / run, tmp_path / run)
        metadata = checkpoints(tmp_path / run)[-1] / ".metadata"
        metadata.write_bytes(pickle.dumps(RunsCode(marker)))
        reseal(metadata.parent)
    (tmp_path / "prompts.txt").write_text("a red circle\n")
    one = str(tmp_path / "one")
    assert export_mmdit.main(["--checkpoint", one, "--out", str(tmp_path / "export")]) == 2
    assert sample_mmdit.main(["--checkpoint", one, "--prompts", str(tmp_path / "prompts.txt"), "--out",
                              str(tmp_path / "samples")]) == 2
    resume = [*TINY, "training.max_steps=4", "training.train_batch_size=1"]
    assert main([*resume, "training.gradient_accumulation_steps=8", f"logging.output_dir={one}"]) == 2
    said = f"{checkpoints(tmp_path / 'one')[-1] / '.metadata'}: it holds posix.system, which DCP's metadata never does"
    assert [said in r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [True] * 3, caplog.text
    results = spawn(2, train, [*resume, "training.gradient_accumulation_steps=4",
                               f"logging.output_dir={tmp_path / 'two'}"], tmp_path=tmp_path)
    assert results == [{"status": 2}] * 2, results
    assert not marker.exists() and not (tmp_path / "export").exists() and not (tmp_path / "samples").exists()
