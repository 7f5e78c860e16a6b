"""Frozen linear layers stored quantized (QLoRA-style LoRA on a big base): 4-bit NormalFloat or 8-bit integers.

- nf4: each block of 64 consecutive weights of a row (fewer where the row is shorter) is scaled by its absolute
  maximum and rounded to the nearest of the 16 NormalFloat levels (Dettmers et al. 2023, the levels are the
  quantiles of a normal distribution); two codes per byte. 0.5 bytes per weight plus a bf16 scale per block.
- int8: each row scaled by its absolute maximum / 127 and rounded (symmetric). 1 byte per weight plus a bf16
  scale per row.
The scales are bf16 so that FSDP's bf16 policy, which casts floating parameters, leaves them as they are (their
rounding is far below the quantization's own error: on random weights the SQNR is the same with fp32 scales).

The codes and scales are ordinary frozen parameters, quantized along rows only, so FSDP shards them by rows like
any weight (integer parameters are gathered as they are, never cast), and the rows a rank holds quantize the same
alone as within the whole matrix. Each forward dequantizes the weight to the compute dtype (one layer at a time).
torchao's NF4 and int8 tensors were the first choice; as of torchao 0.18 NF4 shards only in whole blocks of
16384 values, which SD3.5-large's 2432-wide projections do not divide into over 2, 4 or 8 ranks, and its int8
tensor does not shard under FSDP2 at all (benchmarks/RESULTS.md).
"""

import math

import torch
import torch.nn as nn

NF4_LEVELS = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                           -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                           0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
                           0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0])
NF4_BLOCK = 64
SCHEMES = ("nf4", "int8")


def block_size(scheme: str, in_features: int) -> int:
    return math.gcd(in_features, NF4_BLOCK) if scheme == "nf4" else in_features


def quantize(weight: torch.Tensor, scheme: str) -> dict[str, torch.Tensor]:
    """{"codes", "scales"} of a weight [rows, in_features]; each row on its own."""
    rows, columns = weight.shape
    blocks = weight.float().reshape(rows, -1, block_size(scheme, columns))
    absmax = blocks.abs().amax(dim=-1, keepdim=True)
    scales = torch.where(absmax > 0, absmax, torch.ones_like(absmax)).to(torch.bfloat16)
    normalized = blocks / scales.float()
    if scheme == "int8":
        codes = (normalized * 127).round().clamp(-127, 127).to(torch.int8).reshape(rows, columns)
        return {"codes": codes, "scales": scales.reshape(rows, 1)}
    midpoints = (NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2
    index = torch.bucketize(normalized.reshape(rows, columns), midpoints).to(torch.uint8)
    return {"codes": index[:, 0::2] << 4 | index[:, 1::2], "scales": scales.reshape(rows, -1)}


def dequantize(codes: torch.Tensor, scales: torch.Tensor, scheme: str, dtype: torch.dtype) -> torch.Tensor:
    rows = codes.shape[0]
    if scheme == "int8":
        values = codes.to(dtype) / 127
    else:
        index = torch.empty(rows, 2 * codes.shape[1], dtype=torch.int32, device=codes.device)
        index[:, 0::2], index[:, 1::2] = codes >> 4, codes & 0x0F
        values = NF4_LEVELS.to(codes.device, dtype)[index]
    return (values.reshape(rows, scales.shape[1], -1) * scales.to(dtype)[..., None]).reshape(rows, -1)


class QuantizedMatmul(torch.autograd.Function):
    """x @ dequantize(codes, scales).T, keeping the codes (not the dequantized weight) for the backward, which
    dequantizes again: autograd would otherwise hold a full-precision copy of every frozen weight until the
    backward reaches it, and the quantized base would save no memory at all."""

    @staticmethod
    def forward(ctx, x, codes, scales, scheme):
        ctx.save_for_backward(codes, scales)
        ctx.scheme = scheme
        return x @ dequantize(codes, scales, scheme, x.dtype).T

    @staticmethod
    def backward(ctx, grad):
        codes, scales = ctx.saved_tensors
        return grad @ dequantize(codes, scales, ctx.scheme, grad.dtype), None, None, None


class QuantizedLinear(nn.Module):
    """A frozen nn.Linear whose weight is held as `codes` and `scales` (see the module docstring); the bias, if
    any, stays in full precision. Built empty (on the meta device, say); `quantize` gives the values."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: str, device=None):
        super().__init__()
        if scheme not in SCHEMES:
            raise ValueError(f"unknown quantization {scheme!r}; expected one of {SCHEMES}")
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        packed = in_features // 2 if scheme == "nf4" else in_features
        self.codes = nn.Parameter(torch.empty(out_features, packed, dtype=torch.uint8 if scheme == "nf4" else torch.int8,
                                              device=device), requires_grad=False)
        self.scales = nn.Parameter(torch.empty(out_features, in_features // block_size(scheme, in_features),
                                               dtype=torch.bfloat16, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, device=device), requires_grad=False) if bias else None

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight in fp32, for code that reads a linear layer's weight: peft's DoRA takes its row
        norms in each forward (as it dequantizes bitsandbytes' layers). A fresh tensor, neither stored nor trained."""
        return dequantize(self.codes, self.scales, self.scheme, torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if not (torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)):
            out = QuantizedMatmul.apply(x, self.codes, self.scales, self.scheme)
            return out if self.bias is None else out + self.bias.to(x.dtype)
        dtype = torch.get_autocast_dtype(device)
        with torch.autocast(device, enabled=False):  # the matmul runs in the autocast dtype already
            out = QuantizedMatmul.apply(x.to(dtype), self.codes, self.scales, self.scheme)
            return out if self.bias is None else out + self.bias.to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"


def quantize_linears(module: nn.Module, scheme: str) -> list[str]:
    """Replace every frozen nn.Linear below `module` (LoRA's base layers included) by an empty QuantizedLinear;
    returns their names. The adapters (trainable) stay as they are."""
    names = []
    for name, child in list(module.named_modules()):
        if isinstance(child, nn.Linear) and not child.weight.requires_grad:
            parent_name, _, attr = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            setattr(parent, attr, QuantizedLinear(child.in_features, child.out_features, child.bias is not None,
                                                  scheme, device=child.weight.device))
            names.append(name)
    return names


def stored_bytes(module: nn.Module, scheme: str, dtype: torch.dtype) -> int:
    """The bytes `module`'s parameters and buffers take in `dtype` with its frozen linears' weights stored as
    `scheme` (nf4, int8, or none): what `quantize_linears` and a cast to `dtype` would leave (meta modules too)."""
    quantized = {id(child.weight): child for child in module.modules()
                 if scheme in SCHEMES and isinstance(child, nn.Linear) and not child.weight.requires_grad}
    size = dtype.itemsize
    total = 0
    for tensor in [*module.parameters(), *module.buffers()]:
        layer = quantized.get(id(tensor))
        if layer is None:
            total += tensor.numel() * (size if tensor.is_floating_point() else tensor.element_size())
        else:
            blocks = layer.out_features * (layer.in_features // block_size(scheme, layer.in_features))
            total += tensor.numel() // (2 if scheme == "nf4" else 1) + 2 * blocks  # codes, bf16 scales
    return total


class QuantizingReader:
    """The codes and scales of a quantized layer's block of rows, from its weight's rows as `read_weight(key,
    offsets, sizes)` reads them from a checkpoint's files (`key`: the weight's key there): each block of rows is
    read and quantized once, for its codes and its scales alike."""

    def __init__(self, read_weight):
        self.read_weight, self.last = read_weight, (None, None)

    def __call__(self, weight_key: str, layer: "QuantizedLinear", kind: str, offsets: tuple[int, ...],
                 sizes: tuple[int, ...]) -> torch.Tensor:
        rows = (weight_key, offsets[0], sizes[0])
        if self.last[0] != rows:
            weight = self.read_weight(weight_key, (offsets[0], 0), (sizes[0], layer.in_features))
            self.last = (rows, quantize(weight, layer.scheme))
        return self.last[1][kind][(slice(None), *(slice(o, o + n) for o, n in zip(offsets[1:], sizes[1:])))]
