"""No host-device synchronisation in the default training step: counted (runtime/host_syncs.py) as the
difference between a 4-step and a 2-step run, in one process on the shapes data and on latents, and on two
DDP and two FSDP ranks, also with compiled blocks. The counter sees a synchronisation when there is one, also
of a value that compiled code made."""

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import _disable_current_modes

import train_mmdit_stable
from configs.build import build_model, build_tokenizer
from configs.schema import load_config
from data.shapes import ShapesDataset
from perf.compile import compile_modules
from runtime.host_syncs import HostSyncCounter
from tests.conftest import TINY, spawn


def count_syncs(overrides: list[str]) -> dict:
    """Every read of a device value and every blocking copy to the device in a whole run of main()."""
    counter = HostSyncCounter()
    real_build = train_mmdit_stable.build_optimizer

    def build_optimizer(model, *args, **kwargs):  # the model's parameters are the first device values
        counter.mark(list(model.parameters()))
        return real_build(model, *args, **kwargs)

    train_mmdit_stable.build_optimizer = build_optimizer
    try:
        with counter.counting():
            status = train_mmdit_stable.main(overrides)
    finally:
        train_mmdit_stable.build_optimizer = real_build
    return {"status": status, "counts": counter.counts}


def per_step(run, world_size: int, tmp_path, overrides: list[str]) -> dict:
    """Syncs per step of the training loop, from runs of 2 and 4 steps (setup and the end cancel out)."""
    quiet = ["logging.log_every=1000", "checkpoint.every=0", "validation.every=0", "sampling.steps=1"]
    counts = []
    for steps in (2, 4):
        args = [*overrides, *quiet, f"training.max_steps={steps}", f"logging.output_dir={tmp_path / str(steps)}"]
        results = spawn(world_size, count_syncs, args, tmp_path=tmp_path) if world_size > 1 else [count_syncs(args)]
        assert all(isinstance(r, dict) and r["status"] == 0 for r in results), results
        counts.append(results[0]["counts"])
    short, long = counts
    return {kind: (long.get(kind, 0) - short.get(kind, 0)) / 2 for kind in long.keys() | short.keys()
            if long.get(kind, 0) != short.get(kind, 0)}


@pytest.mark.parametrize("name", ["shapes", "latents", "latents, accumulation 2"])
def test_one_process_steps_make_no_host_sync(name, tiny, latent_run, tmp_path):
    overrides = {"shapes": tiny(), "latents": latent_run(),
                 "latents, accumulation 2": latent_run("training.gradient_accumulation_steps=2")}[name]
    assert per_step(None, 1, tmp_path, overrides) == {}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_rank_steps_make_no_host_sync(strategy, tmp_path):
    overrides = [*TINY, "training.train_batch_size=4", f"parallel.strategy={strategy}",
                 "training.gradient_accumulation_steps=2"]
    assert per_step(None, 2, tmp_path, overrides) == {}


def test_the_counter_sees_a_sync_where_there_is_one(tiny, tmp_path):
    """Without a fused AdamW the non-finite guard cannot skip a step on the device: it reads the flag."""
    assert per_step(None, 1, tmp_path, tiny("optimizer.fused=false")) == {"__bool__": 1}


def below_the_dispatcher(graph, example_inputs):
    """A compiler whose code, like inductor's kernels, runs out of sight of dispatch modes: the counter's
    tracker sees none of the ops of the compiled forward and backward, nor what they make."""
    def run(args):
        with _disable_current_modes():
            return graph(*args)
    run._boxed_call = True  # AOTAutograd calls compiled graphs with one list of arguments
    return run


OPAQUE = aot_autograd(fw_compiler=below_the_dispatcher, bw_compiler=below_the_dispatcher)


@pytest.fixture
def compiling(monkeypatch):
    """apply_compile's backend is OPAQUE; dynamo's caches and counters start empty and are left empty (the
    compiled code of one block's forward is limited to 8 versions per process)."""
    monkeypatch.setattr("perf.compile.torch_backend", lambda name, mode: OPAQUE)
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def test_compiled_steps_make_no_host_sync(tiny, tmp_path, compiling):
    """Compiled blocks run under the counter (dynamo compiles nothing while a dispatch mode that wants to see
    every op is active): the step is counted, and makes none."""
    assert per_step(None, 1, tmp_path, tiny("compile.enabled=true")) == {}
    assert counters["stats"]["unique_graphs"] >= 2 and not counters["graph_break"]  # it ran compiled


def test_a_read_of_a_compiled_blocks_output_or_gradient_is_counted(compiling):
    """Reads outside a compiled block of what it computed, forward and backward, are counted."""
    cfg = load_config(overrides=["model.num_layers=2", "text_encoder.dim=32", "text_encoder.num_heads=2"])
    block = build_model(cfg, ShapesDataset, build_tokenizer()).transformer.transformer_blocks[0]
    width = block.attn.to_q.in_features
    x, c, temb = torch.randn(2, 5, width), torch.randn(2, 3, width), torch.randn(2, width)

    def reads(compiled) -> dict:
        counter = HostSyncCounter([*block.parameters(), x, c, temb])
        with counter.counting():
            out_x, out_c = compiled(x, c, temb)
            out_x.sum().item()  # a read outside the compiled block
            (out_x.square().mean() + out_c.square().mean()).backward()
            bool(block.attn.to_q.weight.grad.norm() > 0)  # a gradient the compiled backward made
            torch.randn(()).item()  # a host value: no sync
        block.zero_grad(set_to_none=True)
        return counter.counts

    # the test's compiler hides what it computes from the counter's tracker, as inductor's kernels do: its output
    # is not known as a device value (the gradients are: the counter marks the parameters' as they accumulate)
    assert reads(torch.compile(block, backend=OPAQUE, fullgraph=True)) == {"__bool__": 1}
    compile_modules([block], "inductor", "default", fullgraph=True)  # its backend: OPAQUE (patched above)
    assert reads(block) == {"item": 1, "__bool__": 1}  # apply_compile's backend marks what it makes
