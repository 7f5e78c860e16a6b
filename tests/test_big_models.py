"""Big models on the GPUs people have: built on the meta device and filled shard by shard (fresh or from
model.init_from, each rank reading only its rows), a quantized frozen base for LoRA, and FSDP's CPU offload."""

import pytest
import torch

import export_mmdit
from configs.build import InitialValues, build_data, build_model, build_trained_model
from configs.schema import load_config
from errors import ConfigError
from models.diffusers_io import WeightReader, load_diffusers_weights
from models.blocks import initialize
from models.families import open_weights
from models.quantized import QuantizedLinear, dequantize, quantize
from perf.checkpoint import checkpoints
from perf.parallel import apply_parallelism
from runtime.distributed import World
from tests.conftest import (assert_close, config_and_overrides, final_weights, losses, metric_rows, sigkill_after, spawn,
                            trains)
from tests.test_lora import check_exported_adapter
from train_mmdit_stable import main

CPU = torch.device("cpu")


def eager_model(overrides: list[str]) -> torch.nn.Module:
    """The model as an eager build gives it: constructed on the CPU, initialised from the run's seed, and loaded
    from model.init_from."""
    cfg = load_config(*config_and_overrides(overrides))
    dataset, tokenizer = build_data(cfg)
    model = build_model(cfg, dataset, tokenizer)
    initialize(model, cfg.training.seed)
    if cfg.model.init_from:
        load_diffusers_weights(model.transformer, cfg.model.init_from, reader=open_weights(cfg.model.init_from))
    return model


def materialized(overrides: list[str], world: World = World()) -> tuple[torch.nn.Module, InitialValues]:
    """The model as training builds it: on the meta device, then (sharded and) filled by apply_parallelism."""
    cfg = load_config(*config_and_overrides(overrides))
    dataset, tokenizer = build_data(cfg)
    model = build_trained_model(cfg, dataset, tokenizer)
    assert all(p.is_meta for p in model.parameters())
    values = InitialValues(model, cfg.training.seed, cfg.model.init_from)
    return apply_parallelism(model, cfg, world, CPU, values), values


@pytest.mark.parametrize("seed", [0, 7])
def test_a_meta_built_model_equals_the_eagerly_built_one(tiny, seed):
    overrides = tiny(f"training.seed={seed}")
    model, _ = materialized(overrides)
    assert_close(model.state_dict(), eager_model(overrides).state_dict())
    other = eager_model(tiny(f"training.seed={seed + 1}")).state_dict()
    assert not torch.equal(model.state_dict()["transformer.context_embedder.weight"],
                           other["transformer.context_embedder.weight"])  # the seed matters


def shards_against_eager(overrides: list[str]) -> dict:
    """On this rank: the FSDP shards filled from the meta-built model, gathered whole, against the eagerly built
    model; and the bytes of model.init_from this rank read."""
    from runtime.distributed import destroy_distributed, init_distributed, world_from_env
    world = world_from_env()
    init_distributed(world, CPU, 60)
    try:
        model, values = materialized(overrides, world)
        whole = {name: tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # buffers: whole
                 for name, tensor in model.state_dict().items()}
        reference = eager_model(overrides).state_dict()
        different = [name for name in reference if not torch.equal(whole[name], reference[name])]
        return {"different": different, "keys": sorted(whole) == sorted(reference),
                "bytes_read": values.reader.bytes_read if values.reader else 0}
    finally:
        destroy_distributed()


@pytest.mark.parametrize("init_from", [False, True])
def test_fsdp_ranks_fill_only_their_shards_with_the_eager_values(latent_run, tmp_path, init_from):
    """Two FSDP ranks build on the meta device and fill their own shards: gathered, the weights equal an eagerly
    built model's, bitwise, fresh or loaded from model.init_from; and each rank reads only its rows of the
    checkpoint file (half of it), never the whole."""
    from tests.conftest import export_random_base
    overrides = latent_run("parallel.strategy=fsdp", "training.seed=5")
    if init_from:
        base = export_random_base(latent_run(), tmp_path / "base")
        overrides.append(f"model.init_from={base}")
    ranks = spawn(2, shards_against_eager, overrides, tmp_path=tmp_path)
    assert all(isinstance(r, dict) for r in ranks), ranks
    assert [r["different"] for r in ranks] == [[], []] and all(r["keys"] for r in ranks)
    if init_from:
        reader = WeightReader(base)
        file_bytes = sum(torch.Size(shape).numel() * 4 for shape in reader.shapes.values())  # fp32 export
        replicated = torch.Size(reader.shapes["pos_embed.pos_embed"]).numel() * 4  # a buffer: whole on every rank
        assert sum(r["bytes_read"] for r in ranks) == file_bytes + replicated  # every weight byte read once
        assert all(0.4 * file_bytes < r["bytes_read"] < 0.6 * file_bytes for r in ranks), ranks


# ----------------------------------------------------------------------------------------------- quantized base


@pytest.mark.parametrize("scheme,sqnr_db", [("nf4", 20.0), ("int8", 40.0)])
def test_quantization_error_bytes_and_row_locality(scheme, sqnr_db):
    weight = torch.randn(96, 256, generator=torch.Generator().manual_seed(0))
    q = quantize(weight, scheme)
    restored = dequantize(q["codes"], q["scales"], scheme, torch.float32)
    assert 10 * torch.log10(weight.square().sum() / (weight - restored).square().sum()) > sqnr_db
    stored = sum(t.numel() * t.element_size() for t in q.values()) / weight.numel()
    assert stored == {"nf4": 0.5 + 2 / 64, "int8": 1 + 2 / 256}[scheme]  # bytes per weight
    rows = quantize(weight[40:70], scheme)  # what a rank holding rows 40-69 computes alone
    assert_close(rows, {k: v[40:70] for k, v in q.items()})
    layer = QuantizedLinear(256, 96, True, scheme)
    with torch.no_grad():
        layer.codes.copy_(q["codes"])
        layer.scales.copy_(q["scales"])
        layer.bias.zero_()
    x = torch.randn(3, 256, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = layer(x)
    torch.testing.assert_close(out, x @ restored.T)
    # the backward keeps the codes, not a dequantized copy of the weight (which would undo the saving)
    assert sum(t.numel() * t.element_size() for t in saved) == sum(t.numel() * t.element_size() for t in q.values())
    out.sum().backward()
    torch.testing.assert_close(x.grad, restored.sum(0).expand(3, -1))


@pytest.mark.parametrize("scheme", ["nf4", "int8"])
def test_lora_on_a_quantized_base_trains_and_resumes_and_exports(lora_run, tmp_path, scheme):
    """The frozen base quantized, adapters in fp32: trains (the loss falls, only adapters are checkpointed),
    resumes bit for bit, and the exported adapter loads into diffusers on the original, unquantized base."""
    run = lora_run(f"lora.base_quantization={scheme}", "training.max_steps=6", "checkpoint.every=3",
                   "optimizer.lr=2e-2")
    assert main(run) == 0
    whole = final_weights(tmp_path / "run")
    assert whole and all(".lora_" in k for k in whole)
    assert losses(tmp_path / "run")[-1] < losses(tmp_path / "run")[0]
    import shutil
    shutil.rmtree(checkpoints(tmp_path / "run")[-1])
    assert main(run) == 0
    assert_close(final_weights(tmp_path / "run"), whole)
    assert export_mmdit.main(["--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "adapter")]) == 0
    check_exported_adapter(tmp_path / "run", tmp_path / "adapter", use_ema=True)


def test_a_quantized_base_is_quantized_in_every_frozen_linear(lora_run):
    cfg = load_config(overrides=lora_run("lora.base_quantization=nf4"))
    model = build_trained_model(cfg, *build_data(cfg))
    quantized = [n for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert quantized and all(".lora_" in n for n in linears)  # every other Linear became quantized
    assert all(not p.requires_grad for n, p in model.named_parameters() if ".lora_" not in n)


def test_lora_on_a_quantized_base_under_fsdp_equals_one_process(lora_run, tmp_path):
    """nf4 codes and scales shard by rows under FSDP; 2 ranks train the adapters as one process does."""
    common = ["lora.base_quantization=nf4", "training.max_steps=3", "optimizer.eps=1e-3", "optimizer.lr=2e-2"]
    trains(1, lora_run(*common, run="one"), tmp_path)
    trains(2, lora_run(*common, "parallel.strategy=fsdp", "training.train_batch_size=2", run="fsdp"), tmp_path)
    assert_close(final_weights(tmp_path / "fsdp"), final_weights(tmp_path / "one"), atol=1e-5)


def test_a_quantized_lora_run_killed_mid_training_resumes_bit_for_bit(lora_run, tmp_path):
    common = ["lora.base_quantization=int8", "training.max_steps=6", "checkpoint.every=2", "logging.log_every=2"]
    run = lora_run(*common, run="killed")
    sigkill_after(run, "step_00000004 complete", tmp_path / "killed.log")  # right after its second checkpoint
    assert checkpoints(tmp_path / "killed")
    assert main(run) == 0
    assert main(lora_run(*common, run="straight")) == 0
    assert_close(final_weights(tmp_path / "killed"), final_weights(tmp_path / "straight"))


def test_quantizing_a_full_fine_tune_is_refused(latent_run):
    with pytest.raises(ConfigError, match="lora.base_quantization=nf4 quantizes the frozen base of a LoRA run"):
        load_config(overrides=latent_run("lora.base_quantization=nf4"))


# ----------------------------------------------------------------------------------------------- CPU offload


def test_cpu_offload_trains_like_fsdp_without_it(tiny, tmp_path):
    """FSDP2's offload policy (on this CPU machine without pinning: the mechanism, not the speed): the same
    weights as FSDP without it, and one process offloads through a group of one."""
    common = [*tiny(), "optimizer.eps=1e-3", "training.max_steps=3", "parallel.strategy=fsdp"]
    trains(2, [*common, "training.train_batch_size=4", f"logging.output_dir={tmp_path / 'plain'}"], tmp_path)
    trains(2, [*common, "training.train_batch_size=4", "parallel.cpu_offload=true",
               f"logging.output_dir={tmp_path / 'offload'}"], tmp_path)
    trains(1, [*common, "parallel.cpu_offload=true", f"logging.output_dir={tmp_path / 'one'}"], tmp_path)
    assert_close(final_weights(tmp_path / "offload"), final_weights(tmp_path / "plain"))
    assert_close(final_weights(tmp_path / "one"), final_weights(tmp_path / "plain"), atol=1e-5)
    assert [r for r in metric_rows(tmp_path / "one") if "loss" in r]


def test_cpu_offload_is_refused_where_it_cannot_work(tiny):
    with pytest.raises(ConfigError, match="parallel.cpu_offload must be false with strategy=ddp"):
        load_config(overrides=tiny("parallel.cpu_offload=true"))
