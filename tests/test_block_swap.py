"""Block swapping (perf/block_swap.py, `offload.blocks_to_swap`). On this CPU the copies are real and the streams
no-ops, so these tests count the copies a step makes against the plan (forward and backward, with and without
activation checkpointing, compiled, on nf4 and int8 bases), check that a swapped weight is on the device only in its
window (outside it its storage is freed, and a use fails), that the adapters' gradients are bitwise those of the
run without swapping, that the CUDA path orders allocations, events and copies as designed (a recording stand-in
for torch.cuda's streams), the failure paths, and the host memory at start. Every family trains bitwise like
without it: tests/test_families.py."""

import gc
import json
import re
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from configs.build import InitialValues, build_collate, build_data, build_trained_model
from configs.schema import load_config
from data.loader import step_batches
from errors import ConfigError
from perf import block_swap
from perf.block_swap import BlockSwap, check_block_swap, planned_loads, register_host, swapped_blocks
from perf.parallel import apply_parallelism, materialize
from runtime.distributed import World
from runtime.step_stats import SigmaBuckets
from tests.conftest import LORA, assert_close, export_random_base, spawn
from train_mmdit_stable import forward_backward, main

CPU = torch.device("cpu")
BLOCKS = 4  # the tests' model: SD3's joint blocks, the last one text-pre-only (2 kinds)


@pytest.fixture
def swap_run(latent_run, tmp_path):
    """A LoRA run on a random 4-block base (overrides; extend with more)."""
    base = export_random_base(latent_run(f"model.num_layers={BLOCKS}"), tmp_path / "base")

    def make(*extra: str, run: str = "run") -> list[str]:
        return latent_run(*LORA, f"model.num_layers={BLOCKS}", f"model.init_from={base}", *extra, run=run)
    return make


def built(overrides: list[str]):
    """The model as training builds it (on the meta device, then apply_parallelism on this CPU), with what a step
    needs, and its block swap (None when off)."""
    cfg = load_config(overrides=overrides)
    dataset, tokenizer = build_data(cfg)
    model = build_trained_model(cfg, dataset, tokenizer)
    check_block_swap(cfg, model)
    model = apply_parallelism(model, cfg, World(), CPU, InitialValues(model, 0, cfg.model.init_from))
    batch = next(iter(step_batches(dataset, build_collate(cfg, dataset, tokenizer), list(range(len(dataset))),
                                   cfg.training.train_batch_size, 0, 0, 1, 0, 1, CPU)))
    return cfg, model, batch, block_swap.active


def step(cfg, model, batch, micro_batch: int | None = None) -> dict[str, torch.Tensor]:
    """One training forward and backward of `batch` (in micro-batches); the adapters' gradients."""
    model.zero_grad(set_to_none=True)
    forward_backward(model, batch, cfg, torch.amp.GradScaler("cpu", enabled=False), SigmaBuckets(CPU),
                     micro_batch or len(batch["latents"]))
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def on_device(swap: BlockSwap, block: int) -> bool:
    return all(w.untyped_storage().nbytes() > 0 for w in swap.weights(block))


class Copies(TorchDispatchMode):
    """The copies out of the swapped blocks' host buffers, seen in the ops the step dispatches: one (phase, block)
    per block copied (its first weight), the phase the backward when autograd's engine runs; and how many swapped
    blocks had their weights on the device at each."""

    def __init__(self, swap: BlockSwap):
        super().__init__()
        self.swap, self.made, self.resident = swap, [], []
        self.first = {masters[0].data_ptr(): block for block, masters in swap.masters.items()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.copy_.default and args[1].data_ptr() in self.first:
            backward = torch._C._current_graph_task_id() != -1
            self.made.append(("backward" if backward else "forward", self.first[args[1].data_ptr()]))
            self.resident.append(sum(on_device(self.swap, b) for b in self.swap.order))
        return out


def test_the_swapped_blocks_are_spread_evenly_and_include_the_last():
    assert swapped_blocks(4, 2) == [1, 3] and swapped_blocks(4, 4) == [0, 1, 2, 3] and swapped_blocks(4, 1) == [3]
    assert swapped_blocks(57, 10) == [4, 10, 16, 21, 27, 33, 38, 44, 50, 56]  # FLUX.1: 19 double + 38 single
    for blocks in range(1, 70):
        for swapped in range(1, blocks + 1):
            order = swapped_blocks(blocks, swapped)
            assert len(set(order)) == swapped and order == sorted(order) and order[-1] == blocks - 1
            gaps = [b - a for a, b in zip([-1, *order], order)]
            assert max(gaps) - min(gaps) <= 1  # as even as whole blocks allow
    assert planned_loads(4, 2) == [("forward", 1), ("forward", 3), ("backward", 1)]
    assert planned_loads(4, 2, backward=False) == [("forward", 1), ("forward", 3)]


@pytest.mark.parametrize("checkpointing", ["none", "selective", "full"])
def test_a_step_copies_each_swapped_block_as_planned_and_frees_it(swap_run, checkpointing):
    """2 of 4 blocks swapped (1 and 3), 2 micro-steps: each copies block 1 and block 3 in the forward and block 1
    again in the backward (block 3 stays for it), never more than two swapped blocks on the device, none after the
    step; a forward without gradients copies each once. With checkpointing the backward's recompute reads the
    weights the backward copy brought (without it, autograd's saved weights, refilled in place)."""
    cfg, model, batch, swap = built(swap_run("offload.blocks_to_swap=2",
                                             f"training.activation_checkpointing={checkpointing}"))
    assert swap.order == [1, 3] and not any(on_device(swap, b) for b in swap.order)
    with Copies(swap) as copies:
        step(cfg, model, batch, micro_batch=2)
    assert copies.made == planned_loads(BLOCKS, 2) * 2 == swap.loads
    assert max(copies.resident) == 2 and not any(on_device(swap, b) for b in swap.order)
    with Copies(swap) as copies, torch.no_grad():
        model(batch["latents"], batch["sigma"], batch["text"])
    assert copies.made == planned_loads(BLOCKS, 2, backward=False)
    assert not any(on_device(swap, b) for b in swap.order)
    linear = model.transformer.transformer_blocks[1].attn.to_q.base_layer  # a frozen weight outside its window
    with pytest.raises(RuntimeError, match="storage of size 0|not allocated"):
        linear(torch.randn(1, linear.in_features))


@pytest.mark.parametrize("checkpointing,quantization", [("none", "none"), ("full", "nf4"), ("selective", "int8")])
def test_the_gradients_are_bitwise_those_without_swapping(swap_run, checkpointing, quantization):
    """Every block swapped, and 2 of 4: the adapters' gradients of a step are those of the same model unswapped, bit
    for bit, on a bf16-sized base and on quantized ones (whose codes and scales are what is swapped)."""
    common = [f"training.activation_checkpointing={checkpointing}", f"lora.base_quantization={quantization}"]
    reference = step(*built(swap_run(*common))[:3])
    for swapped in (BLOCKS, 2):
        cfg, model, batch, swap = built(swap_run(*common, f"offload.blocks_to_swap={swapped}"))
        assert_close(step(cfg, model, batch), reference)
        assert swap.loads == planned_loads(BLOCKS, swapped)
        if quantization != "none":
            assert {type(m).__name__ for m, _ in swap.slots[swap.order[0]]} >= {"QuantizedLinear"}


def test_compiled_blocks_stay_one_graph_each_and_compute_what_eager_ones_do(lora_run):
    """compile.scope=blocks (aot_eager), both blocks of a 2-block base swapped: the swap's hooks run outside the
    graphs (no graph break; one graph per block, as unswapped: the first, whose inputs need no gradient under LoRA,
    and the last, text-pre-only), the copies are the planned ones, and the gradients are eager's (aot_eager: fp32
    rounding of decomposed ops)."""
    reference = step(*built(lora_run())[:3])
    torch._dynamo.reset()
    counters.clear()
    cfg, model, batch, swap = built(lora_run("compile.enabled=true", "compile.backend=aot_eager",
                                             "offload.blocks_to_swap=2"))
    gradients = step(cfg, model, batch)
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 2
    assert swap.loads == planned_loads(2, 2)
    assert_close(gradients, reference, atol=1e-6)


class RecordingStreams:
    """torch.cuda's stream interface as the block swap uses it, recording every call (with the swapped blocks on
    the device at that moment), and the stream each copy runs on."""

    class Recorded:
        def __init__(self, name: str, streams: "RecordingStreams"):
            self.name, self.streams = name, streams

        def record_event(self):
            event = len(self.streams.log)
            self.streams.note("record", self.name, event)
            return event

        def wait_event(self, event) -> None:
            self.streams.note("wait", self.name, event)

    def __init__(self):
        self.log, self.swap = [], None
        self.compute = self.current = RecordingStreams.Recorded("compute", self)

    def note(self, *entry) -> None:
        resident = frozenset(b for b in self.swap.order if on_device(self.swap, b)) if self.swap else frozenset()
        self.log.append((*entry, resident))

    def Stream(self):  # noqa: N802 (torch.cuda.Stream)
        return RecordingStreams.Recorded("side", self)

    def current_stream(self):
        return self.current

    @contextmanager
    def stream(self, stream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous


class CopiesOnStreams(TorchDispatchMode):
    def __init__(self, streams: RecordingStreams, swap: BlockSwap):
        super().__init__()
        self.streams = streams
        self.block_of = {m.data_ptr(): b for b, masters in swap.masters.items() for m in masters}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.copy_.default and args[1].data_ptr() in self.block_of:
            self.streams.note("copy", self.streams.current.name, self.block_of[args[1].data_ptr()])
        return out


def test_on_a_gpu_the_copies_wait_for_the_allocation_and_the_compute_waits_for_the_copies(swap_run):
    """The CUDA path's order, with a recording stand-in for torch.cuda's streams: each copy runs on the side stream
    after it waited for an event the compute stream recorded once the block's memory was allocated; the side
    stream records an event after the copies, which the compute stream waits for before the block runs and before
    the block's memory is freed; every host buffer is page-locked once, whole."""
    cfg = load_config(overrides=swap_run("training.activation_checkpointing=full"))
    dataset, tokenizer = build_data(cfg)
    with torch.device("meta"):
        model = build_trained_model(cfg, dataset, tokenizer)
    streams, registered = RecordingStreams(), []
    swap = BlockSwap(model, 2, CPU, streams=streams, register=registered.append)
    materialize(model, CPU, InitialValues(model, 0, cfg.model.init_from), swap=swap)
    assert [b.data_ptr() for b in registered] == [swap.buffers[b].data_ptr() for b in swap.order]
    streams.swap = swap
    for index, block in enumerate(model.transformer.blocks):  # after the swap's hooks: when the block computes
        block.register_forward_pre_hook(lambda module, args, index=index: streams.note("runs", "compute", index))
    batch = next(iter(step_batches(dataset, build_collate(cfg, dataset, tokenizer), list(range(len(dataset))),
                                   cfg.training.train_batch_size, 0, 0, 1, 0, 1, CPU)))
    with CopiesOnStreams(streams, swap):
        step(cfg, model, batch)
    log = streams.log
    copied = {}  # block -> the event its last copy recorded on the side stream
    loads = 0
    for i, (what, stream, value, resident) in enumerate(log):
        if what == "copy":
            assert stream == "side"
            if log[i - 1][0] != "copy":  # a load starts: the side stream waited for the compute stream's event
                loads += 1
                assert log[i - 1][:2] == ("wait", "side") and log[i - 2][:2] == ("record", "compute")
                assert log[i - 1][2] == log[i - 2][2] and value in log[i - 2][3]  # recorded once allocated
            if log[i + 1][0] != "copy":
                assert log[i + 1][:2] == ("record", "side")
                copied[value] = log[i + 1][2]
        if what == "runs" and value in swap.order:
            assert value in resident and ("wait", "compute", copied[value]) in [e[:3] for e in log[:i]]
        for block in swap.order:  # freed: the compute stream waited for its copy first
            if i and block in log[i - 1][3] and block not in resident:
                assert ("wait", "compute", copied[block]) in [e[:3] for e in log[:i]]
    assert loads == len(planned_loads(BLOCKS, 2)) == len(swap.loads)


def test_page_locking_registers_the_buffer_itself(monkeypatch):
    """cudaHostRegister on the buffer's own memory, its exact size, portable (torch's helper's flag); a failure
    names itself."""
    calls = []

    class CudaRuntime:
        def cudaHostRegister(self, pointer, size, flags):
            calls.append((pointer, size, flags))
            return 0 if len(calls) == 1 else 2

    monkeypatch.setattr(torch.cuda, "cudart", lambda: CudaRuntime())
    buffer = torch.empty(1000, dtype=torch.uint8)
    register_host(buffer)
    assert calls == [(buffer.data_ptr(), 1000, 1)]
    with pytest.raises(RuntimeError, match="cudaHostRegister .* failed with cudaError 2"):
        register_host(buffer)


# ----------------------------------------------------------------------------------------------- mistakes


@pytest.mark.parametrize("setting,named", [
    (["lora.enabled=false", "lora.base_quantization=none"], "swaps the frozen base of a LoRA run"),
    (["parallel.strategy=fsdp"], "parallel.strategy=fsdp: sharding already spreads the weights"),
    (["parallel.strategy=fsdp", "parallel.cpu_offload=true"], "parallel.cpu_offload=true: FSDP's offload already"),
    (["compile.enabled=true", "compile.scope=model"], "needs compile.scope=blocks"),
    (["compile.enabled=true", "compile.mode=reduce-overhead"], "CUDA graphs replay fixed addresses"),
    (["float8.enabled=true"], "float8 is no faster than bf16"),
    (["offload.blocks_to_swap=-1"], "offload.blocks_to_swap must be >= 0, got -1")])
def test_what_it_cannot_run_with_is_a_config_error(lora_run, setting, named):
    swap = [] if any(s.startswith("offload.") for s in setting) else ["offload.blocks_to_swap=1"]
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_config(overrides=lora_run(*swap, *setting))


def test_more_swapped_blocks_than_the_model_has_stop_the_run_naming_the_count(lora_run, caplog, tmp_path):
    assert main(lora_run("offload.blocks_to_swap=3")) == 2  # the base has 2 blocks
    assert "offload.blocks_to_swap=3 is more than the 2 transformer blocks of this model (sd3); at most 2" in \
        caplog.text
    assert not (tmp_path / "run").exists()  # before the run directory, before any compute


def test_on_a_cpu_it_says_once_that_swapping_saves_nothing_and_trains(lora_run, caplog, tmp_path):
    caplog.set_level("INFO", logger="mmdit")
    assert main(lora_run("offload.blocks_to_swap=2", "training.max_steps=2")) == 0
    warnings = [r for r in caplog.records if "saves nothing here" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelname == "WARNING"
    assert "block swap: 2 of 2 blocks ([0, 1])" in caplog.text


# ----------------------------------------------------------------------------------------------- host memory


def resident_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def host_memory_at_start(overrides: list[str]) -> dict:
    """In a fresh process: how far host memory rose while the model was filled (the peak, from the kernel's
    high-water mark, reset just before), and how much of that the process still holds once the reader is gone."""
    cfg = load_config(overrides=overrides)
    dataset, tokenizer = build_data(cfg)
    model = build_trained_model(cfg, dataset, tokenizer)
    values = InitialValues(model, 0, cfg.model.init_from)
    gc.collect()
    before = resident_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from here
    model = apply_parallelism(model, cfg, World(), CPU, values)
    peak = resident_kib("VmHWM")
    del values
    gc.collect()
    return {"peak": (peak - before) * 1024, "kept": (resident_kib("VmRSS") - before) * 1024,
            "host_buffers": block_swap.active.host_bytes}


def shard(folder: Path, out: Path, shard_bytes: int) -> list[Path]:
    """A transformer folder's weights as diffusers writes a released model's (`save_pretrained(max_shard_size=...)`,
    FLUX.2-dev's layout): files of at most `shard_bytes` in state-dict order, named -0000i-of-0000n, and an index
    mapping each weight to its file; bf16."""
    from safetensors.torch import load_file, save_file
    out.mkdir()
    (out / "config.json").write_text((folder / "config.json").read_text())
    groups, size = [[]], 0
    for key, tensor in load_file(folder / "diffusion_pytorch_model.safetensors").items():
        tensor = tensor.to(torch.bfloat16)
        if groups[-1] and size + tensor.nbytes > shard_bytes:
            groups, size = [*groups, []], 0
        groups[-1].append((key, tensor))
        size += tensor.nbytes
    names = [f"diffusion_pytorch_model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    for name, group in zip(names, groups):
        save_file(dict(group), out / name, metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.nbytes for g in groups for _, t in g)},
             "weight_map": {key: name for name, group in zip(names, groups) for key, _ in group}}
    (out / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return [out / name for name in names]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_filling_a_swapped_model_holds_at_most_one_shard_beyond_what_it_keeps(latent_run, tmp_path):
    """A 27M-parameter base (width 384, 5 blocks) in bf16, in 8 MB shards with an index, as diffusers writes a
    released transformer (FLUX.2-dev's layout), 3 blocks swapped: while a fresh process builds and fills the model,
    its memory rises at most one shard (the file being read, memory-mapped) above what it keeps. (Mapping every
    shard it had read until the end, as the reader once did, rose by the whole base: 51 MB here, against 4 MB now.)"""
    size = ["model.num_layers=5", "model.num_attention_heads=6", "model.attention_head_dim=64"]
    shards = shard(export_random_base(latent_run(*size), tmp_path / "single"), tmp_path / "base", 8 * 10**6)
    assert len(shards) >= 5
    overrides = latent_run(*LORA, *size, f"model.init_from={tmp_path / 'base'}", "training.dtype=bf16",
                           "offload.blocks_to_swap=3")
    [measured] = spawn(1, host_memory_at_start, overrides, tmp_path=tmp_path)
    largest, total = max(s.stat().st_size for s in shards), sum(s.stat().st_size for s in shards)
    assert measured["kept"] > 0.9 * total and measured["host_buffers"] > 0.5 * total  # the base is in memory
    assert measured["peak"] - measured["kept"] <= largest + 6 * 2**20, (measured, largest, total)


def test_under_ddp_each_rank_swaps_its_own_blocks_and_trains_as_one_process(swap_run, tmp_path):
    """2 gloo ranks with 3 of 4 blocks swapped: DDP leaves the swapped weights alone (it broadcasts every parameter
    from rank 0 as it starts, and these have no memory between uses: both ranks died of it), and the adapters train
    as one process unswapped on the same global batch does (fp32 summation order apart)."""
    from tests.conftest import final_weights, trains
    trains(1, swap_run("training.max_steps=2", "training.train_batch_size=8", run="one"), tmp_path)
    trains(2, swap_run("training.max_steps=2", "offload.blocks_to_swap=3", run="ddp_swapped"), tmp_path)
    assert_close(final_weights(tmp_path / "ddp_swapped"), final_weights(tmp_path / "one"), atol=1e-5)
