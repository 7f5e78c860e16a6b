"""Attention kernels: the choice is the model's (no process-wide state); each backend that runs here agrees with
the math reference, one that cannot is refused with the reason; `auto` takes the fastest listed for the GPU
generation that is usable (runs, agrees with the math kernel forward and backward at the run's sequence lengths,
and compiles in one graph where the blocks will be) and says why; training agrees across the CPU backends."""

import typing

import pytest
import torch

from configs.schema import TrainingConfig
from errors import ConfigError
from models.attention import attention_kernels, math_attention, sdpa_attention
from models.sd3.model import MMDiT, MMDiTConfig
from perf import attention as backends
from data.shapes import IMAGE_SIZE
from perf.attention import (BACKENDS, apply_attention_backend, build_kernel, flash_kernel, joint_lengths, probe,
                            requirement, why_not)
from perf.precision import DTYPES
from configs.build import build_tokenizer
from tests.conftest import losses
from train_mmdit_stable import main

CUDA = torch.device("cuda")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = "bf16" if DEVICE.type == "cuda" else "fp32"  # what the fused kernels compute in on each device
HEAD_DIM = 64 if DEVICE.type == "cuda" else 16


def qkv(dtype=torch.float32, device="cpu", head_dim=16):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 3, 10, head_dim, generator=g).to(device, dtype).requires_grad_() for _ in range(3)]


def output_and_grads(kernel, tensors):
    out = kernel(*tensors)
    out.float().square().sum().backward()
    return out.detach(), [t.grad.clone() for t in tensors]


def tiny_model() -> MMDiT:
    return MMDiT(MMDiTConfig(num_layers=2, num_attention_heads=2, attention_head_dim=8, joint_attention_dim=16,
                             caption_projection_dim=16, pooled_projection_dim=16, pos_embed_max_size=8,
                             dual_attention_layers=[0]))


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b not in ("auto", "math")])
def test_each_backend_matches_the_math_reference_or_is_refused(backend):
    """Where it runs: equal to the fp32 formula within summation order (fp32, 1e-5 on outputs) or bf16 rounding
    (2e-2). Where it cannot: a ConfigError naming the backend and why, before any training."""
    reason = why_not(backend, DEVICE, DTYPE, HEAD_DIM)
    if reason:
        with pytest.raises(ConfigError, match=f"training.attention_backend={backend} cannot run here: "):
            apply_attention_backend(tiny_model(), backend, DEVICE, DTYPE, HEAD_DIM)
        return
    dtype = DTYPES.get(DTYPE, torch.float32)
    ref_out, ref_grads = output_and_grads(math_attention, qkv(torch.float32, DEVICE, HEAD_DIM))
    out, grads = output_and_grads(build_kernel(backend), qkv(dtype, DEVICE, HEAD_DIM))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), ref_out, **tol)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.float(), r, **{k: 10 * v for k, v in tol.items()})


def test_the_config_offers_every_backend():
    assert typing.get_args(TrainingConfig.__annotations__["attention_backend"]) == BACKENDS


def test_the_choice_is_the_models_and_auto_says_why(caplog):
    first, second = tiny_model(), tiny_model()
    caplog.set_level("INFO", logger="mmdit")
    assert apply_attention_backend(first, "math", torch.device("cpu"), "fp32", 8) == "math"
    assert apply_attention_backend(second, "auto", torch.device("cpu"), "fp32", 8) == "sdpa"
    assert attention_kernels(first) == {math_attention} and attention_kernels(second) == {sdpa_attention}
    assert "attention: sdpa (auto on cpu, fp32, head dim 8: the fastest listed for it that runs)" in caplog.text


@pytest.mark.parametrize("capability,missing,expected,skipped", [
    ((9, 0), set(), "flash_attn_3", None),  # H100 with FA3 installed
    ((9, 0), {"flash_attn_3"}, "sdpa_cudnn", "not flash_attn_3 (missing)"),
    ((10, 0), {"flash_attn_4"}, "sdpa_cudnn", "not flash_attn_4 (missing)"),  # B200 without flash-attn-4
    ((8, 6), {"flash_attn_2"}, "sdpa_flash", "not flash_attn_2 (missing)"),  # A10G
    ((7, 5), set(), "sdpa", None),  # T4: SDPA's own pick
])
def test_auto_takes_the_fastest_that_runs_on_each_gpu_generation(monkeypatch, capability, missing, expected, skipped):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(backends, "why_not", lambda backend, *_: "missing" if backend in missing else None)
    backend, why = backends.choose(CUDA, "bf16", 64)
    assert backend == expected
    assert f"auto on sm{capability[0]}{capability[1]}, bf16, head dim 64" in why
    assert skipped is None or skipped in why, why


@pytest.mark.parametrize("backend,device,dtype,head_dim,capability,reason", [
    ("flash_attn_3", CUDA, "bf16", 64, (8, 0), "runs on sm90 to sm99, this GPU is sm80"),
    ("flash_attn_2", CUDA, "bf16", 64, (7, 5), "this GPU is sm75"),
    ("flash_attn_2", CUDA, "fp32", 64, (9, 0), "fp16/bf16 only"),
    ("flash_attn_2", CUDA, "bf16", 12, (9, 0), "head dims 8..256 in steps of 8, not 12"),
    ("flash_attn_3", CUDA, "bf16", 80, (9, 0), "not 80"),
    ("flash_attn_4", torch.device("cpu"), "bf16", 64, None, "needs a CUDA GPU"),
    ("sdpa_cudnn", torch.device("cpu"), "bf16", 64, None, "needs a CUDA GPU"),
    ("sdpa_efficient", torch.device("cpu"), "fp32", 64, None, "needs a CUDA GPU"),
    ("sdpa_flash", torch.device("cpu"), "fp32", 64, None, None),  # PyTorch's CPU flash kernel: probed
    ("sdpa_cudnn", CUDA, "bf16", 64, (9, 0), None),  # on a GPU, SDPA's own checks decide (the probe)
])
def test_what_each_backend_needs(backend, device, dtype, head_dim, capability, reason, monkeypatch):
    monkeypatch.setattr(backends, "installed", lambda backend: True)
    found = requirement(backend, device, dtype, head_dim, capability)
    assert (found is None) if reason is None else (reason in found), found


def test_a_refused_sdpa_kernel_is_explained_by_its_own_reasons():
    """SDPA lists reasons for all its kernels when a forced one cannot run; the refusal quotes the forced one's."""
    warned = ["Memory efficient kernel not used because:", "Mem efficient reason",
              "Flash attention kernel not used because:", "Flash attention has been runtime disabled.",
              "cuDNN attention kernel not used because:", "cuDNN SDPA is not deterministic."]
    assert backends.refusal(warned, backends.SDPA_REFUSALS["sdpa_cudnn"]) == ["cuDNN SDPA is not deterministic."]
    assert backends.refusal(warned, backends.SDPA_REFUSALS["sdpa_efficient"]) == ["Mem efficient reason"]
    assert backends.refusal(["No available kernel"], None) == ["No available kernel"]


def test_an_uninstalled_flash_attn_is_named():
    if backends.installed("flash_attn_2"):
        pytest.skip("flash-attn is installed here")
    assert requirement("flash_attn_2", CUDA, "bf16", 64, (9, 0)) == "flash_attn is not installed"


def test_the_flash_kernel_gets_one_dtype(monkeypatch):
    """Under autocast q and k leave their fp32 RMS norms while v is bf16; flash-attn refuses mixed dtypes."""
    seen = []

    def flash_attn_func(q, k, v):
        seen.append({q.dtype, k.dtype, v.dtype})
        return v, None  # FA4 returns (out, lse)

    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device_type=None: True)
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda device_type: torch.bfloat16)
    q, k, v = qkv()
    out = flash_kernel(flash_attn_func)(q, k, v.bfloat16())
    assert seen == [{torch.bfloat16}] and out.shape == q.shape


def test_training_with_each_cpu_backend_agrees_and_refuses_one_that_cannot_run(tiny, tmp_path, caplog, monkeypatch):
    probed, real_probe = [], backends.probe
    monkeypatch.setattr(backends, "probe", lambda *args: probed.append(args[4:6]) or real_probe(*args))
    for backend in ("sdpa", "sdpa_flash", "math"):
        assert main(tiny("training.max_steps=2", f"training.attention_backend={backend}", run=backend)) == 0
    # sdpa_flash was checked at the run's sequence length: 8 x 8 image tokens (patch 4) and the text's, not compiled
    assert probed == [([(IMAGE_SIZE // 4) ** 2 + build_tokenizer().tokens], False)]
    loss = {b: losses(tmp_path / b) for b in ("sdpa", "sdpa_flash", "math")}
    assert loss["sdpa_flash"] == loss["sdpa"]  # SDPA's CPU pick is its flash kernel
    assert loss["math"] == pytest.approx(loss["sdpa"], rel=1e-5)
    assert main(tiny("training.attention_backend=sdpa_cudnn", run="cudnn")) == 2
    assert "training.attention_backend=sdpa_cudnn cannot run here: it needs a CUDA GPU, not cpu" in caplog.text
    assert not (tmp_path / "cudnn").exists()  # refused before the run directory was made


class BackwardWrongUnless128(torch.autograd.Function):
    """Attention whose backward is wrong at sequence lengths not divisible by 128, as cuDNN's before 9.15.1."""

    @staticmethod
    def forward(ctx, q, k, v):
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            out = math_attention(*inputs)
        ctx.save_for_backward(out, *inputs)
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        out, *inputs = ctx.saved_tensors
        grads = torch.autograd.grad(out, inputs, grad)
        length = inputs[0].shape[2]
        if length % 128:  # the last, partial tile of tokens gets no gradient
            grads = [g.clone().index_fill_(2, torch.arange(length - length % 128, length), 0.0) for g in grads]
        return tuple(grads)


def cudnn_before_9_15_1(q, k, v):
    return BackwardWrongUnless128.apply(q, k, v)


@torch._dynamo.disable
def opaque(q, k, v):  # as dynamo sees flash-attn-4's CuTe-DSL kernels: code it does not trace
    return math_attention(q, k, v)


def test_a_kernel_is_checked_against_the_math_kernel_at_the_runs_sequence_lengths():
    """SD3 at 1024 px attends over 4429 tokens, FLUX.1 over 4608 (joint_lengths); a kernel with a wrong backward
    at lengths not divisible by 128 passes at 256 and is refused at the run's length, naming what is wrong."""
    assert joint_lengths([((128, 128), ())], 2, 333) == [4429]
    assert joint_lengths([((128, 128), ()), ((96, 160), ()), ((160, 96), ())], 2, 512) == [4352, 4608]
    assert joint_lengths([((128, 128), ((96, 160),))], 2, 512) == [4096 + 3840 + 512]  # an edit's reference too
    assert probe(cudnn_before_9_15_1, torch.device("cpu"), "fp32", 16, [256]) is None
    refused = probe(cudnn_before_9_15_1, torch.device("cpu"), "fp32", 16, [256, 300])
    assert refused.startswith("at sequence length 300 its dq is off by") and "dk is off" in refused \
        and "dv is off" in refused and "output" not in refused, refused
    assert probe(math_attention, torch.device("cpu"), "fp32", 16, [300]) is None


def test_auto_skips_a_kernel_that_computes_wrong_gradients_or_breaks_the_compiled_graph(monkeypatch, caplog):
    """auto on a simulated Hopper whose first two kernels run but are unusable here: cuDNN with the old backward
    bug at the run's 300 tokens, and one dynamo cannot trace when the blocks compile with fullgraph=True; it takes
    the third, says why, and the explicit choice of either is a ConfigError naming the reason."""
    fake = {"sdpa_cudnn": cudnn_before_9_15_1, "flash_attn_4": opaque, "sdpa_flash": build_kernel("sdpa_flash")}
    monkeypatch.setattr(backends, "candidates", lambda device: ("sdpa_cudnn", "flash_attn_4", "sdpa_flash", "sdpa"))
    monkeypatch.setattr(backends, "requirement", lambda *args: None)
    monkeypatch.setattr(backends, "build_kernel", fake.get)
    caplog.set_level("INFO", logger="mmdit")
    torch._dynamo.reset()
    cpu = torch.device("cpu")
    assert apply_attention_backend(tiny_model(), "auto", cpu, "fp32", 16, [300], fullgraph=True) == "sdpa_flash"
    assert "attention: sdpa_flash (auto on cpu, fp32, head dim 16: the fastest listed for it that agrees with the " \
           "math kernel at sequence length 300 and compiles in one graph; not sdpa_cudnn (at sequence length 300 " \
           "its dq is off by" in caplog.text
    assert "not flash_attn_4 (dynamo cannot trace it in one graph, which compile.scope=blocks needs" in caplog.text
    assert apply_attention_backend(tiny_model(), "auto", cpu, "fp32", 16, [256], fullgraph=False) == "sdpa_cudnn"
    assert apply_attention_backend(tiny_model(), "flash_attn_4", cpu, "fp32", 16, [300]) == "flash_attn_4"
    with pytest.raises(ConfigError, match="attention_backend=flash_attn_4 cannot run here: dynamo cannot trace"):
        apply_attention_backend(tiny_model(), "flash_attn_4", cpu, "fp32", 16, [300], fullgraph=True)
    with pytest.raises(ConfigError, match="attention_backend=sdpa_cudnn cannot run here: at sequence length 300"):
        apply_attention_backend(tiny_model(), "sdpa_cudnn", cpu, "fp32", 16, [4096, 300])


def test_a_family_whose_text_is_padded_gets_a_kernel_that_takes_its_mask(monkeypatch):
    """Qwen-Image masks its text's padding: a kernel is probed with a key mask too (one that takes none fails the
    probe, with the reason), flash-attn's dense kernels are passed over, and the masked math kernel agrees."""
    from perf import attention
    cpu = torch.device("cpu")

    def maskless(q, k, v):
        return math_attention(q, k, v)
    assert attention.probe(maskless, cpu, "fp32", 16, [64]) is None
    assert "unexpected keyword argument 'mask'" in attention.probe(maskless, cpu, "fp32", 16, [64], masked=True)
    assert attention.probe(math_attention, cpu, "fp32", 16, [64], masked=True) is None
    assert attention.probe(sdpa_attention, cpu, "fp32", 16, [64], masked=True) is None
    monkeypatch.setattr(attention, "requirement", lambda *args: None)  # as on a GPU where it runs
    assert attention.why_not("flash_attn_2", cpu, "bf16", 64, masked=True) == (
        "its dense kernels take no attention mask, and this family masks its text's padding")
