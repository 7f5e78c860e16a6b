"""float8 training (torchao): the transformer blocks' image-stream (and FLUX single-stream) attention and MLP linears
become torchao `Float8Linear`s, whose three matmuls (forward, input gradient, weight gradient) run on float8 copies of
their inputs with dynamic per-tensor scales (`torch._scaled_mm`), while the weights, gradients and optimizer stay in
full precision. Swapped in place, before activation checkpointing, compile and the FSDP wrap (torchtitan's order);
parameter names and state-dict keys are unchanged.

Which linears: those of a block that act on every image token, like torchtitan's converter only those whose in and
out features are multiples of 16. Left alone: the adaLN modulations (one row per sample: a matmul float8 only slows,
whose outputs scale every activation of the block), the embedders and the output projection (outside the blocks), the
LoRA adapters (small; they are what trains), and the text stream's linears (the transformer's `TEXT_ONLY_LINEARS`),
for speed (below).

Shapes torch's `_scaled_mm` accepts (its CUDA kernel, mirrored by its meta function in torch/_meta_registrations.py):
the inner dimension of each matmul and both dimensions of its second operand must be multiples of 16. The weight
gradient is grad_output^T @ input, whose inner dimension is the token count of the micro-batch: B x 333 for SD3's
text stream (1332 at batch 4) is not one, nor is B x 3969 for a 1008 px image. torchao computes that matmul even for a
frozen weight (LoRA's base), so the token count matters with and without LoRA. Each converted linear pads that one
matmul's inner dimension with zeros to the next multiple of 16 (torchao's `pad_inner_dim`, set for the weight gradient
only: in the other two the inner dimension is a feature count, a multiple of 16 already, and padding copies its
operands): any micro-batch and latent size runs. tests/test_float8.py runs the float8 step of SD3-medium, SD3.5-large
LoRA, FLUX.1-dev and Qwen-Image at 1024 px through torch's own shape checks, on the meta device.

Where float8 wins, by a roofline of one linear's training step on an H100 SXM (`step_seconds`, torchao's model of
tensorwise float8 casts in testing/training/roofline_utils.py with benchmarks/roofline.py's rates: 800 TFLOP/s bf16
matmuls, twice that in float8, 3 TB/s; the casts fused with their producers or not), float8 time / bf16 time:

    full fine-tune, batch 4:     image linears   text linears
        SD3-medium               0.67-0.87       0.92-1.10 (M = 1332 tokens)
        FLUX.1-dev               0.59-0.70       0.77-0.86 (M = 2048)
    LoRA (frozen base):
        SD3-medium, batch 1-4    0.99-1.41       1.36-3.71
        SD3.5-large, batch 2     0.94-1.14       1.68-1.88
        FLUX.1-dev, batch 1-2    0.91-1.14       1.38-2.11

A float8 step halves each matmul's time but pays for casts: the weight is read three times per step (its amax, then
a cast per layout) whatever the token count, and each activation and gradient is read and written once more. With
few tokens the weight's casts are not paid back, so the text stream stays in bf16 (with the padding it would run in
float8 too): SD3's gains nothing there, and FLUX.1's full fine-tune would save a fifth of its text linears' time,
under 1 % of its step (their 512 of 4608 tokens pass 19 of its 57 blocks).

Where float8 loses: with LoRA on a frozen base. bf16 runs two matmuls per frozen linear (no weight gradient);
torchao's float8 runs three (it computes and discards the weight gradient), so at best it saves a quarter of the
matmul time, which its casts take back: 0.91-1.41x bf16 above, no gain to expect (two public measurements found
torchao's float8 slower than bf16 for LoRA; `apply_float8` warns). It pays for full fine-tunes: the image
stream's linears 1.15-1.7x faster at batch 4, 1024 px (torchao reports 0.8x at M,K,N = 1024,2048,1024 and
1.39x at 4096,8192,16384). These are estimates: `benchmarks/train_step.py` measures the step on a GPU.

Under FSDP/HSDP the weights are all-gathered in float8 (`enable_fsdp_float8_all_gather`), and after each
optimizer step one all-reduce computes every weight's scale for the next step's all-gathers
(`precompute_float8_dynamic_scale_for_fsdp`; without it each weight all-reduces its own). `float8.emulate`
rounds to float8 but multiplies in high precision, on any device: the same numerics without the speed, for tests.
"""

import importlib.util
import logging
from functools import partial

import torch
import torch.nn as nn

from errors import ConfigError

log = logging.getLogger("mmdit")

FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with float8 tensor cores

# H100 SXM rates of the roofline (benchmarks/roofline.py): bf16 matmuls as measured on an 8192^3 one, float8 at
# twice that (its dense peak is twice bf16's), memory as a measured device-to-device copy, inductor's launch floor
BF16_MATMUL_RATE, FLOAT8_MATMUL_RATE, MEMORY_RATE, KERNEL_FLOOR_S = 800e12, 1600e12, 3.0e12, 2e-6


def check_float8(cfg, device: torch.device) -> None:
    """float8 where this device cannot run it, or without torchao, named before any compute (`cfg`: the config's
    float8 section)."""
    if not cfg.enabled:
        return
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("float8.enabled=true needs torchao: pip install -e '.[float8]'")
    if cfg.emulate:
        return
    if device.type != "cuda":
        raise ConfigError(f"float8.enabled=true needs a GPU with float8 tensor cores, and this run is on "
                          f"{device.type}; set float8.emulate=true to emulate its numerics (no speed-up)")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        raise ConfigError(f"float8.enabled=true needs compute capability >= 8.9 (Ada, Hopper or newer); "
                          f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}: set "
                          f"float8.enabled=false (or float8.emulate=true, which brings no speed-up)")


def converts(module: nn.Module, name: str, text_only: tuple[str, ...], modulations: tuple[str, ...]) -> bool:
    """A block's image-token linear with float8-sized dimensions (`name` relative to the block): not one over the
    text tokens alone (`text_only`, by first names) nor a modulation (one row per sample: nothing to gain)."""
    return (isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0
            and not name.split(".")[0].startswith(modulations) and ".lora_" not in f".{name}"
            and not any(name == part or name.startswith(part + ".") for part in text_only))


def pad_weight_gradient(linear: nn.Module) -> None:
    """A Float8Linear whose weight-gradient matmul pads its inner dimension (the token count) to a multiple of 16."""
    config = linear.linear_mm_config  # torchao's (output, grad_input, grad_weight) matmul settings
    linear.linear_mm_config = config._replace(grad_weight=config.grad_weight._replace(pad_inner_dim=True))


def apply_float8(model: nn.Module, cfg, device: torch.device, sharded: bool) -> None:
    """Swap the blocks' linears for torchao's Float8Linear; a no-op when float8 is off (`cfg`: the float8
    section). `sharded`: FSDP/HSDP will wrap the blocks, so their weights are all-gathered in float8."""
    if not cfg.enabled:
        return
    check_float8(cfg, device)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    config = Float8LinearConfig(emulate=cfg.emulate, enable_fsdp_float8_all_gather=sharded)
    blocks, transformer = model.transformer.blocks, model.transformer
    chosen = partial(converts, text_only=transformer.TEXT_ONLY_LINEARS, modulations=transformer.MODULATION_LINEARS)
    for block in blocks:
        convert_to_float8_training(block, module_filter_fn=chosen, config=config)
    converted = [m for block in blocks for m in block.modules() if type(m).__name__ == "Float8Linear"]
    for linear in converted:
        pad_weight_gradient(linear)
    linears = sum(isinstance(m, nn.Linear) for block in blocks for m in block.modules())
    log.info("float8%s: %d of the blocks' %d linears (attention and MLP over image tokens; the text stream's stay "
             "in bf16)%s",
             " (emulated)" if cfg.emulate else "", len(converted), linears,
             ", all-gathered in float8" if sharded else "")
    if converted and not any(m.weight.requires_grad for m in converted):
        log.warning("float8 on a frozen base (LoRA): torchao still runs each frozen weight's gradient matmul, three "
                    "float8 matmuls where bf16 runs two, and its casts cost what that saves; by perf/float8.py's "
                    "roofline 0.91-1.41x bf16's time at 1024 px, batch 1-4. float8.enabled=false is as fast and "
                    "rounds less; measure (benchmarks/train_step.py) before keeping it")


def step_seconds(rows: int, in_features: int, out_features: int, float8: bool, trains_weight: bool = True,
                 fused_casts: bool = True) -> float:
    """Roofline time of one linear's forward and backward over `rows` tokens on an H100 (module docstring): its
    matmuls at their rate or memory traffic, and its casts' memory traffic. A trained weight is an fp32 master
    (autocast casts it to bf16 once per step; float8 reads it for its amax and two casts); a frozen one is bf16.
    float8 casts input and output gradient once each, writing both layouts (reading them again for their amax
    unless `fused_casts`: fused into the op that made them)."""
    m, k, n = rows, in_features, out_features

    def matmul(a: int, inner: int, b: int, fp8: bool) -> float:
        element = 1 if fp8 else 2
        traffic = (a * inner + inner * b) * element + a * b * 2
        flops = 2 * a * inner * b
        return max(flops / (FLOAT8_MATMUL_RATE if fp8 else BF16_MATMUL_RATE), traffic / MEMORY_RATE, KERNEL_FLOOR_S)

    def traffic(nbytes: float) -> float:
        return max(nbytes / MEMORY_RATE, KERNEL_FLOOR_S)

    weight = 4 if trains_weight else 2
    if not float8:
        gradient = matmul(k, m, n, False) if trains_weight else 0.0
        cast = traffic(6 * k * n) if trains_weight else 0.0  # autocast: the fp32 weight read, a bf16 copy written
        return matmul(m, k, n, False) + matmul(m, n, k, False) + gradient + cast
    amax = 0 if fused_casts else 2
    casts = (traffic((amax + 2 + 2) * m * k) + traffic((amax + 2 + 2) * m * n)  # read bf16, write 2 float8 layouts
             + traffic(weight * k * n) + 2 * traffic((weight + 1) * k * n))  # amax, then one cast per layout
    return matmul(m, k, n, True) + matmul(m, n, k, True) + matmul(k, m, n, True) + casts


def precompute_scales_after_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Under FSDP with float8 all-gathers: after each optimizer step, every weight's float8 scale in one
    all-reduce (torchao's advice) instead of one all-reduce per weight at its all-gather. A no-op otherwise."""
    if not any(type(m).__name__ == "Float8Linear" and m.config.enable_fsdp_float8_all_gather
               for m in model.modules()):
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))
