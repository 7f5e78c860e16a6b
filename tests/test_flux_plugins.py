"""Every plugin on FLUX.1's blocks, proven as on SD3's: a tiny FLUX-shaped model (2 double- and 2 single-stream
blocks) on the shapes data. FSDP over 2 gloo ranks trains DDP's weights within 1e-5 and resumes bit for bit;
compiled and checkpointed blocks (each block kind one graph, no graph break) train eager's weights; the OOM
splitter keeps the math; CPU offload trains FSDP's weights; float8 converts both block kinds."""

import shutil

import pytest
import torch

from perf.checkpoint import checkpoints
from tests.conftest import TINY, assert_close, final_weights, metric_rows, spawn, train
from train_mmdit_stable import main

FLUX = [*TINY, "model.family=flux", "model.num_single_layers=2", "optimizer.eps=1e-3", "training.max_steps=3"]
COMPILED = ["compile.enabled=true", "compile.backend=aot_eager", "training.activation_checkpointing=full"]


def test_fsdp_trains_ddps_weights_and_resumes_bit_for_bit(tmp_path):
    """Eager, for time: compiled blocks under FSDP are tests/test_sharding.py's (SD3's, one graph each), FLUX's
    compiled blocks are the next test's."""
    ddp = [*FLUX, "training.train_batch_size=4", f"logging.output_dir={tmp_path / 'ddp'}"]
    assert spawn(2, train, ddp, tmp_path=tmp_path) == [{"status": 0}] * 2
    fsdp = [*FLUX, "training.train_batch_size=4", "parallel.strategy=fsdp", "checkpoint.every=2",
            "checkpoint.async_save=false", f"logging.output_dir={tmp_path / 'fsdp'}"]
    assert spawn(2, train, fsdp, tmp_path=tmp_path) == [{"status": 0}] * 2
    whole = final_weights(tmp_path / "fsdp")
    assert_close(whole, final_weights(tmp_path / "ddp"), atol=1e-5)
    shutil.rmtree(checkpoints(tmp_path / "fsdp")[-1])  # resume from step 2
    assert spawn(2, train, fsdp, tmp_path=tmp_path) == [{"status": 0}] * 2
    assert_close(final_weights(tmp_path / "fsdp"), whole)


def test_compiled_and_checkpointed_training_matches_eager(tmp_path):
    assert main([*FLUX, f"logging.output_dir={tmp_path / 'eager'}"]) == 0
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert main([*FLUX, *COMPILED, f"logging.output_dir={tmp_path / 'compiled'}"]) == 0
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # the double and the single block
    assert_close(final_weights(tmp_path / "compiled"), final_weights(tmp_path / "eager"), atol=1e-5)


def test_the_oom_splitter_keeps_the_math(tmp_path):
    assert main([*FLUX, f"logging.output_dir={tmp_path / 'plain'}"]) == 0
    assert main([*FLUX, "batch_sizer.enabled=true", "batch_sizer.debug_oom_above=2",
                 "batch_sizer.debug_oom_module=transformer.single_transformer_blocks.1",
                 f"logging.output_dir={tmp_path / 'split'}"]) == 0
    assert [r["micro_batch"] for r in metric_rows(tmp_path / "split") if "micro_batch" in r] == [2, 2, 2]
    assert_close(final_weights(tmp_path / "split"), final_weights(tmp_path / "plain"), atol=2e-4, mean_atol=1e-7)


def test_cpu_offload_of_one_process_trains_like_it(tmp_path):
    assert main([*FLUX, f"logging.output_dir={tmp_path / 'plain'}"]) == 0
    assert main([*FLUX, "parallel.strategy=fsdp", "parallel.cpu_offload=true",
                 f"logging.output_dir={tmp_path / 'offload'}"]) == 0
    assert_close(final_weights(tmp_path / "offload"), final_weights(tmp_path / "plain"), atol=1e-5)


def test_float8_converts_both_block_kinds():
    """Their image-token linears (attention, MLPs, a single block's fused output projection), not the text stream's
    (perf/float8.py: no gain at 512 tokens), the modulations nor the final projection (tests/test_float8.py trains
    float8 steps)."""
    pytest.importorskip("torchao")
    from configs.build import build_data, build_trained_model
    from configs.schema import load_config
    from perf.float8 import apply_float8
    cfg = load_config(overrides=[*FLUX, "training.dtype=bf16", "float8.enabled=true", "float8.emulate=true"])
    model = build_trained_model(cfg, *build_data(cfg))
    apply_float8(model, cfg.float8, torch.device("cpu"), sharded=False)
    kind = lambda module: type(module).__name__  # noqa: E731
    double, single = model.transformer.transformer_blocks[1], model.transformer.single_transformer_blocks[0]
    assert {kind(m) for m in (double.attn.to_q, double.ff.net[2], single.attn.to_k, single.proj_mlp,
                              single.proj_out)} == {"Float8Linear"}
    assert {kind(m) for m in (double.attn.add_v_proj, double.ff_context.net[0].proj, double.norm1.linear,
                              single.norm.linear, model.transformer.proj_out)} == {"Linear"}
