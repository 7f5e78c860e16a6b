"""The memory plan (plan_memory.py, runtime/memory_plan.py) against what a training step really holds: the peak
of live tensor bytes through one step on this CPU, for a full fine-tune under each kind of activation
checkpointing, a LoRA on an nf4 base with it, and a Qwen-Image full fine-tune (its text padded, with a mask; the last
block's text stream frozen and not computed), within 15 %; and the setting the plan picks for a memory size."""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import plan_memory
import train_mmdit_stable
from configs.build import InitialValues, build_collate, build_data, build_trained_model, build_validation
from configs.schema import load_config
from data.loader import step_batches
from optim.adamw import build_adamw
from optim.ema import EMA
from perf.parallel import apply_parallelism
from runtime.distributed import World
from runtime.memory_plan import CHECKPOINTING, cheapest_checkpointing, plan
from runtime.nonfinite import NonFiniteGuard
from runtime.step_stats import SigmaBuckets
from tests.conftest import LORA, export_random_base

CPU = torch.device("cpu")
SIZE = ["model.num_layers=4", "model.num_attention_heads=4", "model.attention_head_dim=32",
        "training.train_batch_size=16"]


class PeakMemory(TorchDispatchMode):
    """Measures what the plan estimates, on any device: the peak of the bytes held by live tensors (their
    storages, each counted once) from `tensors` alive at the start plus every tensor an op makes while the mode
    is on, each until it is freed."""

    def __init__(self, tensors=()):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0
        for tensor in tensors:
            self.hold(tensor)

    def hold(self, tensor) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        if storage._cdata in self.live:
            return
        self.live[storage._cdata] = storage.nbytes()
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self.release, storage._cdata)

    def release(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            self.hold(tensor)
        return out


def measured_peak(overrides: list[str]) -> float:
    """Peak bytes of live tensors during the second training step (the first made the optimizer's state)."""
    cfg = load_config(overrides=overrides)
    dataset, tokenizer = build_data(cfg)
    model = build_trained_model(cfg, dataset, tokenizer)
    model = apply_parallelism(model, cfg, World(), CPU, InitialValues(model, 0, cfg.model.init_from))
    optimizer = build_adamw(model, 1e-3, (0.9, 0.99), 1e-8, 0.0, CPU)
    ema, scaler, guard = EMA(model, 0.99), torch.amp.GradScaler("cpu", enabled=False), NonFiniteGuard(0, 100)
    batches = iter(step_batches(dataset, build_collate(cfg, dataset, tokenizer), list(range(len(dataset))),
                                cfg.training.train_batch_size, 0, 0, 1, 0, 2, CPU))

    def step(batch):
        train_mmdit_stable.forward_backward(model, batch, cfg, scaler, SigmaBuckets(CPU), cfg.training.train_batch_size)
        train_mmdit_stable.optimizer_step(model, optimizer, scaler, ema, guard, batch["step"], 1.0)

    step(next(batches))
    batch = next(batches)
    state = [*model.parameters(), *model.buffers(), *ema.shadow.values(),
             *[t for s in optimizer.state.values() for t in s.values()]]
    with PeakMemory(state) as memory:
        step(batch)
    return memory.peak


def planned_peak(overrides: list[str]) -> float:
    cfg = load_config(overrides=overrides)
    t = cfg.training
    dataset, tokenizer = plan_memory.data_like(cfg, 0)
    count = plan_memory.count(cfg, dataset, tokenizer, cfg.lora.base_quantization)
    return plan(count, strategy="ddp", ranks=1, micro_batch=t.train_batch_size, checkpointing=t.activation_checkpointing,
                every=t.activation_checkpointing_every, dtype=t.dtype, gpu=False).peak


@pytest.mark.parametrize("kind", ["full fine-tune", "full fine-tune, selective checkpointing",
                                  "full fine-tune, full checkpointing in every 2nd block",
                                  "LoRA, nf4 base, activation checkpointing", "Qwen-Image full fine-tune"])
def test_the_plan_is_within_15_percent_of_the_measured_peak(kind, tiny, lora_run, latent_run, tmp_path):
    if kind == "Qwen-Image full fine-tune":  # the shapes' captions are padded: the attention is masked
        overrides = tiny(*SIZE, "model.patch_size=2", "model.family=qwen_image")
    elif kind.startswith("full fine-tune"):
        checkpointing = {"full fine-tune": [], "full fine-tune, selective checkpointing": [
            "training.activation_checkpointing=selective", "training.train_batch_size=8"]}  # half the time
        overrides = tiny(*SIZE, "model.patch_size=2", *checkpointing.get(kind, [
            "training.activation_checkpointing=full", "training.activation_checkpointing_every=2",
            "training.train_batch_size=8"]))
    else:
        from tests.conftest import write_latent_shards
        data = write_latent_shards(tmp_path / "data", per_shard=32)
        base = export_random_base(latent_run(*SIZE, data=data), tmp_path / "bigger-base")
        overrides = latent_run(*SIZE, *LORA, f"model.init_from={base}", "lora.base_quantization=nf4",
                               "training.activation_checkpointing=full", data=data)
    measured, planned = measured_peak(overrides), planned_peak(overrides)
    assert abs(planned - measured) <= 0.15 * measured, (planned / 2**20, measured / 2**20)


def test_the_command_plans_a_released_model_without_its_files(capsys):
    """docs/sd3.md's example: SD3.5-large LoRA on one 24 GB GPU, planned from the config's name alone (with full
    checkpointing: the config, meant for 48 GB, has none)."""
    assert plan_memory.main(["--config", "configs/sd35_large_lora.yaml", "--gpus", "1", "--gpu-gib", "24",
                             "training.activation_checkpointing=full"]) == 0
    out = capsys.readouterr().out
    assert "sd35-large" in out and "as configured" in out and "base nf4" in out and "FSDP + CPU offload" in out
    rows = {line.split("  ")[0]: line.split() for line in out.splitlines()[2:]}
    assert rows["base nf4"][-1] == "yes"  # 4-bit weights fit where bf16 ones are tight


def test_the_plan_picks_the_setting_that_fits_with_the_least_recompute(tiny):
    """For a memory size, the activation checkpointing setting that fits and recomputes least: none where all
    fits, selective in every 4th block where only a little must go, full in every block as the last resort.
    Selective redoes no matmul but re-reads and re-writes the activations between them (on this width-128 model
    in fp32, priced at an H100's rates, that traffic outweighs its tiny matmuls); full redoes both."""
    cfg = load_config(overrides=tiny(*SIZE, "model.patch_size=2"))
    dataset, tokenizer = plan_memory.data_like(cfg, 0)
    count = plan_memory.count(cfg, dataset, tokenizer, "none")
    settings = {"strategy": "ddp", "ranks": 1, "micro_batch": 16, "dtype": "fp32", "gpu": False}
    plans = {(mode, every): plan(count, checkpointing=mode, every=every, **settings) for mode, every in CHECKPOINTING}
    assert plans[("none", 1)].recompute == 0 and plans[("selective", 1)].recompute_flops == 0
    assert plans[("full", 1)].recompute_flops == pytest.approx(1 / 3, rel=0.05)  # a block's forward, of 3 per step
    for every in (4, 2, 1):
        assert 0 < plans[("selective", every)].recompute < plans[("full", every)].recompute
    assert plans[("full", 1)].peak < plans[("selective", 1)].peak < plans[("selective", 4)].peak \
        < plans[("none", 1)].peak

    def pick(budget):
        return cheapest_checkpointing(count, budget, **settings)[:2]

    assert pick(plans[("none", 1)].peak) == ("none", 1)
    assert pick(plans[("selective", 4)].peak) == ("selective", 4)
    assert pick(plans[("full", 1)].peak) == ("full", 1)
    assert cheapest_checkpointing(count, plans[("full", 1)].peak - 1, **settings) is None
    for budget in (p.peak for p in plans.values()):  # never one that recomputes more than another that fits
        chosen = plans[pick(budget)]
        assert chosen.peak <= budget
        assert all(p.recompute >= chosen.recompute for p in plans.values() if p.peak <= budget)


def test_block_swapping_plans_the_swapped_blocks_in_host_memory_and_two_of_them_in_flight(tmp_path, capsys):
    """offload.blocks_to_swap=N on a LoRA run: the frozen weights of the N blocks perf/block_swap.py picks leave the
    GPU for host memory, the two largest of them are in flight (one computing, one arriving), 2N - 1 blocks are
    copied per micro-step, and nothing else changes; so swapping saves nothing below 3 blocks, and plan_memory.py
    prints the fewest blocks that fit."""
    from perf.block_swap import swapped_blocks
    from runtime.memory_plan import GIB, smallest_swap
    config = tmp_path / "lora.yaml"
    config.write_text("model: {num_layers: 4, num_attention_heads: 2, attention_head_dim: 32, patch_size: 2}\n"
                      "lora: {enabled: true}\ntraining: {train_batch_size: 8, activation_checkpointing: full}\n"
                      "validation: {every: 0, at_end: false}\n")  # validation is planned elsewhere
    cfg, _ = plan_memory.planning_config(str(config), [], None)
    dataset, tokenizer = plan_memory.data_like(cfg, 0)
    count = plan_memory.count(cfg, dataset, tokenizer, "none")
    frozen = count.block_frozen
    assert frozen == [b - 4 * t for b, t in zip(count.block_bytes, count.block_trained)] and min(frozen) > 0
    settings = {"strategy": "ddp", "ranks": 1, "micro_batch": 8, "dtype": "fp32", "checkpointing": "full"}
    plans = [plan(count, swapped=n, **settings) for n in range(len(frozen) + 1)]
    for n, p in enumerate(plans[1:], start=1):
        order = swapped_blocks(len(frozen), n)
        off = sum(frozen[i] for i in order)
        assert p.host == off and p.weights == plans[0].weights - off and p.swap_bytes == 2 * off - frozen[order[-1]]
        assert p.in_flight == sum(sorted((frozen[i] for i in order), reverse=True)[:2])
        assert (p.activations, p.gradients, p.optimizer, p.ema) == \
            (plans[0].activations, plans[0].gradients, plans[0].optimizer, plans[0].ema)
    assert plans[0].peak == plans[1].peak >= plans[2].peak > plans[3].peak > plans[4].peak
    assert smallest_swap(count, plans[3].peak, **settings) == (3, plans[3])
    assert smallest_swap(count, plans[0].peak, **settings)[0] == 0
    assert smallest_swap(count, plans[4].peak - 1, **settings) is None
    with pytest.raises(ValueError):
        plan(count, swapped=2, **{**settings, "strategy": "fsdp", "ranks": 2})
    gib = plans[3].peak / GIB + 1e-9  # the command plans the config as given: the same settings, on a GPU
    assert plan_memory.main(["--config", str(config), "--gpu-gib", repr(gib)]) == 0
    out = capsys.readouterr().out
    assert "smallest offload.blocks_to_swap that fits" in out and ": 3 of 4 blocks (" in out
    row = next(line for line in out.splitlines() if line.startswith("offload.blocks_to_swap=3 (fewest)"))
    assert row.split()[-1] == "yes" and next(line for line in out.splitlines()
                                             if line.startswith("as configured")).split()[-1] == "NO"


def test_validations_working_set_is_within_15_percent_of_its_measured_peak(tiny):
    """Validation's sampling (classifier-free guidance: twice the micro-batch's rows) from the EMA weights swapped in,
    measured as a training step is, against the plan's validation beside what persists."""
    from models.pipeline import generate, initial_noise
    from runtime.validation import evaluating
    overrides = tiny(*SIZE, "model.patch_size=2", "validation.at_end=true", "training.train_batch_size=8")
    cfg = load_config(overrides=overrides)
    dataset, tokenizer = build_data(cfg)
    model = build_trained_model(cfg, dataset, tokenizer)
    model = apply_parallelism(model, cfg, World(), CPU, InitialValues(model, 0, cfg.model.init_from))
    ema = EMA(model, 0.99)
    captions = dataset.validation_captions()[:8]
    text, uncond, noise = tokenizer(captions), tokenizer([""]), initial_noise(0, list(range(8)), (3, 32, 32))
    sampler = build_validation(cfg, dataset, tokenizer, [], World(), CPU).images.sampler
    state = [*model.parameters(), *model.buffers(), *ema.shadow.values(), *text.values(), *uncond.values(), noise]
    with PeakMemory(state) as memory, evaluating(model, ema) as plain:
        generate(plain, text, uncond, noise, sampler, batch_size=8)
    measured = memory.peak - sum(t.untyped_storage().nbytes() for t in {id(t): t for t in state}.values())
    dataset, tokenizer = plan_memory.data_like(cfg, 0)
    count = plan_memory.count(cfg, dataset, tokenizer, "none")
    planned = plan(count, strategy="ddp", ranks=1, micro_batch=8, dtype="fp32", gpu=False,
                   validation_rows=plan_memory.validation_rows(cfg, 8)).validation
    assert abs(planned - measured) <= 0.15 * measured, (planned / 2**20, measured / 2**20)


def test_a_vaes_decode_is_counted_within_15_percent_of_its_measured_peak():
    """The VAE that decodes validation images: its weights and one image's decode, counted on the meta device, against
    a real decode (a small AutoencoderKL at 64 px, attention in its middle block)."""
    import diffusers
    from runtime.memory_plan import vae_count
    config = dict(down_block_types=["DownEncoderBlock2D"] * 3, up_block_types=["UpDecoderBlock2D"] * 3,
                  block_out_channels=[16, 32, 32], layers_per_block=1, latent_channels=4, norm_num_groups=8)
    weights, planned = vae_count(("AutoencoderKL", config), 64, activation_bytes=4)
    vae = diffusers.AutoencoderKL(**config).eval()
    latents = torch.randn(1, 4, 16, 16)
    with torch.no_grad(), PeakMemory([latents]) as memory:
        vae.decode(latents)
    assert weights == sum(p.numel() * 4 for p in vae.parameters())
    measured = memory.peak - latents.untyped_storage().nbytes()
    assert abs(planned - measured) <= 0.15 * measured, (planned / 2**20, measured / 2**20)


@pytest.mark.parametrize("family, extra", [
    ("sd3", ["model.num_layers=4"]),  # the last block's text stream is pre-only
    ("sd3", ["model.num_layers=4", "model.dual_attention_layers=[0,1]", "lora.enabled=true"]),  # SD3.5's 3 kinds
    ("flux", ["model.num_layers=2", "model.num_single_layers=3", "lora.enabled=true"]),
    ("qwen_image", ["model.num_layers=3"]),  # the last block computes no text stream
    ("qwen_image", ["model.num_layers=3", "lora.enabled=true"]),
    ("flux2", ["model.num_layers=2", "model.num_single_layers=3", "lora.enabled=true"])])
def test_counting_two_blocks_of_each_kind_counts_what_counting_every_block_does(family, extra, monkeypatch, tmp_path):
    """The memory plan counts two blocks of each kind and gives the others the second's numbers: the whole count (every
    block's bytes, saved activations, FLOPs and traffic, validation's working set) equals counting every block."""
    from contextlib import nullcontext

    from runtime import memory_plan
    config = tmp_path / "config.yaml"
    config.write_text(f"model: {{family: {family}, patch_size: 2, num_attention_heads: 2, attention_head_dim: 16}}\n")
    cfg, _ = plan_memory.planning_config(str(config), extra, None)
    dataset, tokenizer = plan_memory.data_like(cfg, 0)
    per_kind = plan_memory.count(cfg, dataset, tokenizer, "nf4" if cfg.lora.enabled else "none")
    monkeypatch.setattr(memory_plan, "two_blocks_of_each_kind", lambda blocks: nullcontext({}))
    every_block = plan_memory.count(cfg, dataset, tokenizer, "nf4" if cfg.lora.enabled else "none")
    assert per_kind == every_block
    assert len(set(every_block.saved_per_block)) > 1 or family == "flux2"  # the kinds differ (FLUX.2's by their FLOPs)
