"""The step prediction (benchmarks/roofline.py) on tiny models: CUDA's autocast reproduced on CPU; every model FLOP
of the step found (the census against torch's flop counter on the whole model, full fine-tune, LoRA, FLUX,
Qwen-Image and FLUX.2); both paths counting the block's arithmetic, the compiled one moving fewer bytes in fewer
kernels; no cast of an activation around the norms or the modulation; frozen LoRA weights without weight gradients;
the GEMM model by shape; and every term of the optimizer step."""

import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch._subclasses.fake_tensor import FakeTensorMode

from configs.build import build_model, build_trained_model
from configs.schema import Config, resolve_defaults
from data.latents import empty_text, text_shapes
from errors import ConfigError
from models.lora import apply_lora
from runtime.step_stats import train_flops_per_sample
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import roofline  # noqa: E402

DATA = SimpleNamespace(latent_channels=16, latent_sizes=[(8, 8)], buckets=[((8, 8), ())], references=0,
                       text_dims=(32, 16), text_tokens=8)  # 16 + 8 tokens
WIDTH, BATCH, IMAGE_TOKENS = 64, 2, 16


def tiny(*overrides: str):
    """A tiny config: 2 blocks of 4 heads x 16 (SD3: a joint block and the last, text-pre-only one), micro-batch 2."""
    cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist([
        "model.num_layers=2", "model.num_attention_heads=4", "model.attention_head_dim=16", "model.patch_size=2",
        "model.sample_size=8", "model.pos_embed_max_size=8", f"training.train_batch_size={BATCH}",
        "training.dtype=bf16", *overrides]))
    resolve_defaults(cfg)
    return cfg


LORA = ["lora.enabled=true", "lora.rank=4", "lora.alpha=4"]
FLUX = ["model.family=flux", "model.num_layers=1", "model.num_single_layers=1", "model.guidance_embeds=true"]
QWEN = ["model.family=qwen_image"]  # a dual-stream block and the last, whose text stream is not computed
# Qwen-Image's text: tokens with their padding mask, no pooled vector
QWEN_DATA = SimpleNamespace(**{**vars(DATA), "text_dims": (32, 0), "text_shapes": text_shapes(8, (32, 0), masked=True)})
# FLUX.2: a double and a single block taking the shared modulations; dev's guidance embedding; its pipelines' latents
# (patchified by the VAE step into 128 channels, a token per latent pixel) and text tokens without a pooled vector
FLUX2 = ["model.family=flux2", "model.num_layers=1", "model.num_single_layers=1", "model.patch_size=1",
         "model.guidance_embeds=true"]
FLUX2_DATA = SimpleNamespace(**{**vars(DATA), "latent_channels": 128, "text_dims": (32, 0)})

OPS = {"layer_norm": lambda x, w: F.layer_norm(x, x.shape[-1:]), "rms_norm": lambda x, w: F.rms_norm(x, x.shape[-1:]),
       "sum": lambda x, w: x.sum(), "sum_dim": lambda x, w: x.sum(0), "pow": lambda x, w: x.pow(2),
       "rsqrt": lambda x, w: x.rsqrt(), "softmax": lambda x, w: x.softmax(-1), "mean": lambda x, w: x.mean(-1),
       "linear": lambda x, w: F.linear(x, w), "silu": lambda x, w: F.silu(x),
       "gelu": lambda x, w: F.gelu(x, approximate="tanh")}


def output_dtypes(device: str) -> dict[str, torch.dtype]:
    with FakeTensorMode():
        x, w = torch.empty(8, 8, device=device, dtype=torch.bfloat16), torch.empty(8, 8, device=device)
        return {name: op(x, w).dtype for name, op in OPS.items()}


def test_cpu_autocast_follows_cuda_autocast_inside_the_census_only():
    """Fake CUDA tensors run a forward (not autograd) on a CPU build: CUDA autocast's output dtypes are the
    reference for the policy the census puts on CPU autocast, and CPU autocast is itself again after it."""
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.bfloat16)
    try:
        cuda = output_dtypes("cuda")
    finally:
        torch.set_autocast_enabled("cuda", False)
    with roofline.cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert output_dtypes("cpu") == cuda
    assert cuda["layer_norm"] == torch.float32  # the ops the policy changes
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert output_dtypes("cpu")["layer_norm"] == torch.bfloat16  # CPU's own policy, put back


@pytest.fixture(scope="module")
def sd3():
    """The eager census of a tiny SD3 step of 6 blocks (5 joint ones and the last), and the compiled census of its
    first block."""
    cfg = tiny("model.num_layers=6")
    census = roofline.count_step(cfg, DATA, ("eager",))
    block = build_trained_model(cfg, DATA).transformer.blocks[0]
    shape = roofline.BlockShape(BATCH, IMAGE_TOKENS, DATA.text_tokens, WIDTH, 16)
    return SimpleNamespace(cfg=cfg, census=census, block=block,
                           eager=census.blocks[0].kernels["eager"], compiled=roofline.compiled_census(block, shape))


def heavy_flops(kernels, cls: str) -> int:
    return sum(k.flops for k in kernels if k.cls == cls)


def test_both_paths_count_the_block_flops(sd3):
    """Forward and backward of every matmul (inputs and weights need gradients: 3x the forward) and of the
    attention (forward 2 matmuls, backward 4)."""
    d, b, tokens = WIDTH, BATCH, IMAGE_TOKENS + DATA.text_tokens
    per_token = 2 * 2 * 12 * d * d  # two streams' q, k, v, out (4 D^2) and MLP (8 D^2), 2 FLOPs per MAC
    adaln = 2 * 2 * 6 * d * d * b  # once per sample: two streams' 6 D x D modulation
    matmul = 3 * (per_token * b * tokens // 2 + adaln)  # each token passes through one stream's weights
    attention = 3 * 4 * b * tokens * tokens * d
    assert sd3.census.kinds == ["joint"] * 5 + ["joint, last (text pre-only)"]
    for kernels in (sd3.eager, sd3.compiled):
        assert (heavy_flops(kernels, "matmul"), heavy_flops(kernels, "attention")) == (matmul, attention)


@pytest.mark.parametrize("overrides,data", [([], DATA), (LORA, DATA), (FLUX, DATA), (QWEN, QWEN_DATA),
                                           (QWEN + LORA, QWEN_DATA), (FLUX2, FLUX2_DATA), (FLUX2 + LORA, FLUX2_DATA)],
                         ids=["full", "lora", "flux", "qwen-image", "qwen-image lora", "flux2", "flux2 lora"])
def test_the_census_finds_every_model_flop_of_the_step(overrides, data):
    """Blocks x their counts + what runs outside them = torch's flop counter on the whole model's forward and
    backward (benchmarks/train_step.py's MFU numerator): no block, embedder, final layer or weight gradient is
    missed or counted twice; under LoRA the frozen weights get no weight gradient; Qwen-Image's masked attention
    and its last block, whose text stream is not computed, are counted as the model runs them; FLUX.2's shared
    modulations, which only its blocks take, get their backward once (the timestep embedding's once, on the sum of
    theirs and the final layer's)."""
    cfg = tiny(*overrides)
    census = roofline.count_step(cfg, data, ("eager",))
    prediction = roofline.predict(census, "eager", "fa3", micro_steps=1)

    def inputs():
        return (torch.zeros(1, data.latent_channels, *data.latent_sizes[-1]), torch.full((1,), 0.5),
                empty_text(roofline.text_fields(data)))
    per_sample = train_flops_per_sample(lambda: apply_lora(build_model(cfg, data), cfg.lora), inputs)
    assert prediction.model_flops == BATCH * per_sample
    assert len(census.kinds) == 2 and census.outside
    if cfg.model.family == "qwen_image":
        last = "dual-stream, last (text not computed)"
        assert census.kinds == ["dual-stream" + (", first (no input gradient)" if cfg.lora.enabled else ""), last]
        attention = [k for k in census.blocks[1].kernels["eager"] if k.cls == "attention"]
        assert len(attention) == 2 and "mask" not in str(census.blocks[1].kernels)  # forward and backward, fused
    if cfg.model.family == "flux2":
        assert census.kinds == ["double" + (", first (no input gradient)" if cfg.lora.enabled else ""), "single"]


def test_frozen_lora_weights_get_no_weight_gradient_matmul():
    """A weight gradient of a D x D linear is a matmul with a D x D output in the backward: the full fine-tune has
    them, the LoRA step none (its adapters' are rank x D)."""
    def weight_gradients(*overrides):
        kernels = roofline.count_step(tiny(*overrides), DATA, ("eager",)).blocks[0].kernels["eager"]
        return [k for k in kernels if k.cls == "matmul" and k.phase == "backward" and k.gemm[1:3] == (WIDTH, WIDTH)]
    assert weight_gradients()
    assert not weight_gradients(*LORA)


def test_compiled_moves_fewer_bytes_in_fewer_kernels(sd3):
    outside = lambda kernels: sum(k.bytes for k in kernels if k.cls not in roofline.HEAVY)  # noqa: E731
    assert len(sd3.compiled) < len(sd3.eager)
    assert outside(sd3.compiled) < outside(sd3.eager)
    assert {k.cls for k in sd3.compiled} <= {"matmul", "attention", "fused pointwise", "fused reduction"}
    assert {k.phase for k in sd3.compiled} == {"forward", "backward"}


def test_eager_block_casts_no_activation_and_runs_fused_norms(sd3):
    """Under autocast the casts are the matmuls' weights and biases and the RMSNorm weights (fp32 -> bf16 and
    their gradients back, 6 bytes per element each way) and per-sample [B, D] vectors (the modulation's
    input, shifts, scales, gates): no activation is cast around a norm, the modulation or a residual update,
    and the RMSNorm is one kernel each way, not pow/mean/rsqrt."""
    cast_weights = [p for name, p in sd3.block.named_parameters() if not name.startswith("norm1")]  # not adaLN's
    allowed = {6 * p.numel() for p in cast_weights} | {6 * BATCH * WIDTH}
    casts = [k.bytes for k in sd3.eager if k.cls == "cast"]
    assert casts and set(casts) <= allowed, sorted(set(casts) - allowed)
    assert sum(casts) >= 2 * sum(6 * p.numel() for p in cast_weights)  # each weight forward, its gradient back
    assert sum(k.cls == "norm" for k in sd3.eager) == 16  # 4 layer norms and 4 RMSNorms, forward and backward
    assert not {"pow", "rsqrt", "mean"} & {k.cls for k in sd3.eager}


def test_gemm_rate_follows_the_shape():
    """Calibrated on the measured 8192^3 matmul; the SD3 text stream's M = 1332 GEMM fills half a wave and runs at
    half the image stream's rate; a rank-16 product is memory-bound, not quantized."""
    assert roofline.gemm_rate(8192, 8192) == pytest.approx(800e12)
    assert roofline.gemm_rate(1332, 1536) < 0.5 * roofline.gemm_rate(16384, 1536)
    assert roofline.gemm_rate(16384, 1536) == pytest.approx(800e12, rel=0.01)
    assert roofline.wave_efficiency(16384, 16) == 1.0
    assert roofline.gemm_rate(8192, 8192, dtype="fp32") == pytest.approx(800e12 * 495 / 989)


def test_kernel_time_takes_the_rate_of_its_shape_and_phase():
    text = roofline.Kernel("matmul", "addmm", 2 * 1332 * 1536 * 1536, 10, gemm=(1, 1332, 1536, 1536))
    text_rate = roofline.gemm_rate(1332, 1536)
    assert roofline.kernel_seconds(text, "compiled", "fa3") == pytest.approx(text.flops / text_rate)
    assert roofline.kernel_seconds(text, "compiled", "fa3") > 1.9 * text.flops / 800e12
    assert roofline.kernel_seconds(text, "compiled", "fa3", flat_gemms=True) == pytest.approx(text.flops / 800e12)
    backward = roofline.Kernel("attention", "sdpa_backward", 10**12, 10, "backward", head_dim=64)
    assert roofline.kernel_seconds(backward, "eager", "fa3") == pytest.approx(1.25e12 / 453e12)
    forward = roofline.Kernel("attention", "sdpa", 10**12, 10, "forward", head_dim=128)
    assert roofline.kernel_seconds(forward, "eager", "cudnn") == pytest.approx(1e12 / 609e12)
    assert roofline.kernel_seconds(roofline.Kernel("add", "add", 0, 3000), "eager", "fa3") == 5e-6  # launch floor


def test_the_step_adds_every_term(sd3):
    """Blocks x counts x micro-steps, the rest of the model, recompute (none < selective < full = one more forward
    of every block), gradient accumulation, clipping, fused AdamW and the EMA by their bytes per trained parameter;
    nothing else, and they sum to the step. Checkpointing holds fewer activations: selective than none, full than
    selective."""
    census, steps = sd3.census, 3
    per_parameter = census.trained / roofline.MEMORY_RATE
    predictions = {mode: roofline.predict(census, "eager", "cudnn", steps, mode) for mode in roofline.CHECKPOINTING}
    for p in predictions.values():
        assert p.seconds == pytest.approx(sum(p.terms.values()))
        assert set(p.terms) == {"blocks", "outside the blocks", "checkpoint recompute", "gradient accumulation",
                                "clipping", "AdamW", "EMA"}
        blocks = sum(b.count * roofline.seconds(b.kernels["eager"], "eager", "cudnn") for b in census.blocks)
        assert p.terms["blocks"] == pytest.approx(steps * blocks)
        assert p.terms["outside the blocks"] > 0
        assert p.terms["gradient accumulation"] == pytest.approx((steps - 1) * 12 * per_parameter)
        assert p.terms["clipping"] == pytest.approx(12 * per_parameter)
        assert p.terms["AdamW"] == pytest.approx(28 * per_parameter)
        assert p.terms["EMA"] == pytest.approx(12 * per_parameter)
        assert p.mfu == pytest.approx(p.model_flops / p.seconds / roofline.PEAK_BF16)
    recompute = {mode: p.terms["checkpoint recompute"] for mode, p in predictions.items()}
    forwards = sum(b.count * roofline.seconds([k for k in b.kernels["eager"] if k.phase == "forward"], "eager",
                                              "cudnn") for b in census.blocks)
    assert recompute["none"] == 0 < recompute["selective"] < recompute["full"] == pytest.approx(steps * forwards)
    every_other = roofline.predict(census, "eager", "cudnn", steps, "full", every=2).terms["checkpoint recompute"]
    assert every_other < recompute["full"]
    foreach = roofline.predict(census, "eager", "cudnn", steps, fused_optimizer=False).terms["AdamW"]
    assert foreach == pytest.approx(72 * per_parameter)
    activations = {mode: roofline.activation_bytes(census, mode) for mode in roofline.CHECKPOINTING}
    assert activations["none"] > activations["selective"] > activations["full"]
    assert roofline.peak_memory(census, "none") > activations["none"] + 20 * census.trained  # weights, AdamW, EMA


def test_what_is_not_modelled_is_refused(sd3, capsys):
    """A setting without rates is a config error (one line, exit 2 from the command, before any census)."""
    with pytest.raises(ConfigError, match="activation_checkpointing=mlp"):
        roofline.predict(sd3.census, "eager", "cudnn", 1, "mlp")
    with pytest.raises(ConfigError, match="attention_backend=math"):
        roofline.predict(sd3.census, "eager", "math", 1)
    with pytest.raises(ConfigError, match="float8"):
        roofline.predict_step(tiny("float8.enabled=true"), DATA)
    assert roofline.main(["--preset", "sd3-medium", "training.attention_backend=math", "--json", "-"]) == 2
    assert roofline.main(["--preset", "sd3-medium", "training.no_such_key=1", "--json", "-"]) == 2
    assert roofline.main(["--preset", "flux2-dev-lora-24gb", "compile.enabled=true", "--json", "-"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 3 and "attention_backend=math" in errors[0] and "no_such_key" in errors[1]
    assert "nf4 compiled" in errors[2]


def test_block_swap_copies_wait_only_where_they_outlast_the_compute_before_them():
    """perf/block_swap.py's schedule played against block times: 2 of 4 blocks swapped (1 and 3), forward 1 s and
    backward 2 s per block. Copies of 0.5 s hide; copies of 3 s make the forward wait for block 1 (2 s: its copy
    starts with the pass) and for block 3 (1 s: its copy starts when block 1 does), and the backward not (block 3
    stayed; block 1's copy has blocks 3 and 2 to hide behind). A micro-step copies 2N - 1 blocks."""
    forward, backward, frozen = [1.0] * 4, [2.0] * 4, [1] * 4
    assert roofline.swap_stall(forward, backward, frozen, 2, rate=2.0) == (1.5, 0.0)
    assert roofline.swap_stall(forward, backward, frozen, 2, rate=1 / 3) == (pytest.approx(9.0), pytest.approx(3.0))
    assert roofline.swap_stall(forward, backward, frozen, 0, rate=1.0) == (0.0, 0.0)
    # every block: block 0's copy starts with the pass and cannot hide
    assert roofline.swap_stall(forward, backward, frozen, 4, rate=2.0) == (3.5, 0.5)


def test_block_swapping_is_priced_by_n_and_added_to_a_configured_step():
    """A LoRA census: for each N the frozen bytes copied per micro-step (2N - 1 swapped blocks), the waits growing
    with N on the slower link, the largest N whose copies hide; a config's own N adds its waits to the step."""
    census = roofline.count_step(tiny(*LORA, "model.num_layers=4"), DATA, ("eager",))
    frozen = {b.kind: b.frozen_bytes for b in census.blocks}
    assert all(frozen.values())
    rows = roofline.swap_rows(census, "eager", "cudnn", "full", 1)
    assert [r["swapped"] for r in rows] == [1, 2, 3, 4]
    by_block = [frozen[k] for k in census.kinds]
    for row in rows:
        order = roofline.swapped_blocks(4, row["swapped"])
        assert row["gb_per_micro_step"] * 1e9 == pytest.approx(2 * sum(by_block[b] for b in order) - by_block[order[-1]])
        assert row["PCIe 4.0 x16"]["stall_s"] >= row["PCIe 5.0 x16"]["stall_s"]
    assert roofline.hidden_up_to(rows, "PCIe 5.0 x16") >= roofline.hidden_up_to(rows, "PCIe 4.0 x16")
    plain = roofline.predict(census, "eager", "cudnn", 2, "full")
    swapped = roofline.predict(census, "eager", "cudnn", 2, "full", swapped=3, h2d_rate=1e3)
    stall = roofline.swap_stall(*roofline.block_times(census, "eager", "cudnn", "full"), by_block, 3, 1e3)[1]
    assert swapped.terms["block swap copies not hidden"] == pytest.approx(2 * stall) and stall > 1
    assert swapped.seconds == pytest.approx(plain.seconds + 2 * stall)  # 1 kB/s: nothing hides
