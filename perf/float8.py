"""float8 training (torchao): the transformer blocks' attention and MLP linears become torchao `Float8Linear`s,
whose matmuls (forward, and both backward ones) run on float8 copies of their inputs with dynamic per-tensor
scales, while the weights, gradients and optimizer stay in full precision. Swapped in place, before activation
checkpointing, compile and the FSDP wrap (torchtitan's order); parameter names and state-dict keys are unchanged.

Which linears: those that act on every token (attention and MLP projections, image and text streams), like
torchtitan's converter: only those whose in and out features are multiples of 16 (float8 tensor cores need it).
The adaLN modulations are left alone (they act once per sample: a matmul of batch rows that float8 only slows,
and their outputs scale every activation of the block), and so are the embedders and the output projection
(outside the blocks). Under LoRA the frozen base linears run in float8 and the adapters in training.dtype: the
base matmuls are the cost, the adapters are small and are what trains.

Under FSDP/HSDP the weights are all-gathered in float8 (`enable_fsdp_float8_all_gather`), and after each
optimizer step one all-reduce computes every weight's scale for the next step's all-gathers
(`precompute_float8_dynamic_scale_for_fsdp`; without it each weight all-reduces its own). `float8.emulate`
rounds to float8 but multiplies in high precision, on any device: the same numerics without the speed, for tests.
"""

import importlib.util
import logging

import torch
import torch.nn as nn

from errors import ConfigError

log = logging.getLogger("mmdit")

FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with float8 tensor cores


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


def converts(module: nn.Module, name: str) -> bool:
    """A block's per-token linear with float8-sized dimensions (`name` relative to the block)."""
    return (isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0
            and not name.split(".")[0].startswith("norm") and ".lora_" not in f".{name}")


def apply_float8(model: nn.Module, cfg, device: torch.device, sharded: bool) -> None:
    """Swap the blocks' linears for torchao's Float8Linear; a no-op when float8 is off (`cfg`: the float8
    section). `sharded`: FSDP/HSDP will wrap the blocks, so their weights are all-gathered in float8."""
    if not cfg.enabled:
        return
    check_float8(cfg, device)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    config = Float8LinearConfig(emulate=cfg.emulate, enable_fsdp_float8_all_gather=sharded)
    blocks = model.transformer.blocks
    for block in blocks:
        convert_to_float8_training(block, module_filter_fn=converts, config=config)
    linears = [type(m).__name__ for block in blocks for m in block.modules() if isinstance(m, nn.Linear)]
    log.info("float8%s: %d of the blocks' %d linears%s", " (emulated)" if cfg.emulate else "",
             linears.count("Float8Linear"), len(linears), ", all-gathered in float8" if sharded else "")


def precompute_scales_after_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Under FSDP with float8 all-gathers: after each optimizer step, every weight's float8 scale in one
    all-reduce (torchao's advice) instead of one all-reduce per weight at its all-gather. A no-op otherwise."""
    if not any(type(m).__name__ == "Float8Linear" and m.config.enable_fsdp_float8_all_gather
               for m in model.modules()):
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))
