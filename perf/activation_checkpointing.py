"""Activation checkpointing: activations recomputed in the backward pass instead of kept, in blocks 0, k, 2k, ...
(`training.activation_checkpointing_every` = k), the two ways torchtitan does it:

- selective: an op-level policy (`torch.utils.checkpoint.create_selective_checkpoint_contexts`) that keeps the
  outputs of the matmuls and of attention (`SAVED_OPS`: the expensive ops) and recomputes everything between them:
  the norms, the modulation and residual arithmetic, the activation functions, rotary positions. The backward
  redoes no matmul (FLOP-wise almost free; it re-reads and re-writes the recomputed ops' activations), and the block
  no longer keeps their outputs: its norms', modulations' and GELU's, and the fp32 copies of rotary positions;
- full: a block keeps only its inputs and the backward re-runs its whole forward (a third more compute for the
  block), the least memory.

runtime/memory_plan.py counts what each setting keeps and what its recompute costs; plan_memory.py picks the
cheapest setting that fits. SD3-medium, full fine-tune at 1024 px, micro-batch 4, bf16 (planned): activations
none 25.6 GiB; selective 14.0 GiB for at most 10 % more step time (the recomputed ops' traffic as eager kernels,
which compiled blocks fuse); full in every 2nd block 13.5 GiB for 22 %; full 2.3 GiB for 44 %. Selective is for
training that keeps the matmuls' outputs anyway: with LoRA on a frozen base the backward needs few of them (no
weight gradients), so selective keeps more than none (SD3.5-large LoRA, micro-batch 2: 23.0 GiB against 21.3) and
the plan never picks it there; full is the choice. (An earlier `mlp` mode recomputed the MLPs in full: 45 % of a
block's forward FLOPs, i.e. 15 % more compute for a third less activation memory, which `full` in every 2nd block
beats; it is gone, and a run directory that saved it resumes with `full`: the same gradients, less memory.)

Both keep the gradients bitwise: the recomputed ops see the same inputs (and the RNG state of the forward). Applied
in place (a block's `forward` is wrapped), so parameter names and state-dict keys stay diffusers-compatible, and on
any block (SD3's joint blocks, FLUX's double and single blocks): nothing here depends on what is inside a block.

The wrapper is a plain function that calls `torch.utils.checkpoint.checkpoint`, applied before `torch.compile`
compiles the block: dynamo traces into it and captures the checkpoint (and the selective policy, a
`functools.partial` it can read as a constant) as part of the block's graph (`tag_activation_checkpoint`), which
AOTAutograd's partitioner follows. (Wrapping with `functools.partial(checkpoint, ...)` instead makes `checkpoint`,
which dynamo does not trace, the first frame of the block: nothing would be compiled, silently.)
"""

import functools
import logging

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

log = logging.getLogger("mmdit")

aten = torch.ops.aten
# The ops whose outputs selective checkpointing keeps: torchtitan's list (matmuls and SDPA's kernels), with the
# matmuls of linears with a bias (addmm), batched ones (bmm: the math attention), float8's (_scaled_mm, and aten.max:
# a float8 cast's amax, one number, so that a recomputed cast uses the forward's scale) and the CPU's flash kernel.
SAVED_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten._scaled_mm.default,
             aten.max.default, aten._scaled_dot_product_flash_attention.default,
             aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_cudnn_attention.default,
             aten._scaled_dot_product_flash_attention_for_cpu.default, aten._flash_attention_forward.default,
             aten._efficient_attention_forward.default}
MODES = ("none", "selective", "full")


def keeps(op) -> bool:
    """Whether selective checkpointing keeps `op`'s output: a matmul, attention (flash-attn's custom ops too)."""
    return op in SAVED_OPS or getattr(op, "namespace", "").startswith("flash_attn")


def keep_matmuls_and_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if keeps(op) else CheckpointPolicy.PREFER_RECOMPUTE


SELECTIVE = functools.partial(create_selective_checkpoint_contexts, keep_matmuls_and_attention)


def checkpointed(forward, selective: bool):
    """`forward`, with its activations recomputed in the backward pass (those between matmuls, if `selective`)."""
    def checkpointed_forward(*args, **kwargs):
        if selective:
            return checkpoint(forward, *args, use_reentrant=False, context_fn=SELECTIVE, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    checkpointed_forward.checkpointed = forward
    return checkpointed_forward


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 1) -> None:
    """mode none: a no-op; selective or full: in blocks 0, every, 2*every, ..."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode {mode!r}, expected one of {MODES}")
    if mode == "none":
        return
    blocks = model.transformer.blocks
    for block in blocks[::every]:
        block.forward = checkpointed(block.forward, selective=mode == "selective")
    log.info("activation checkpointing (%s): %d of %d blocks", mode, len(blocks[::every]), len(blocks))
