"""Weight-only quantization: int8 weights with a scale per output row, or int4 weights with a scale
and an offset per group of input columns.

    python quantize.py --checkpoint checkpoints/Qwen/Qwen3-8B/converted --mode int8  # ...-int8
    python quantize.py --checkpoint checkpoints/Qwen/Qwen3-8B/converted --mode int4  # ...-int4
    python convert_hf_checkpoint.py --checkpoint-dir checkpoints/Qwen/Qwen3-8B --quantize int4

The last converts and quantizes in one pass. The blocks' linear layers, every expert and an untied
lm_head are quantized; the embedding, the norms and the MoE router stay as they are. int4 is
asymmetric, w ~= q * scale + offset with q in 0 ... 15, a bf16 scale and offset for each group of
--group-size (a power of two, default 128) input columns of a row; two weights a byte, packed for
the fast path's products. A quantized checkpoint's config.json says "quantization": "int8", or
"int4" with its "group_size", and generate.py swaps these modules in before loading it. Optional:
without this file, bf16 conversion and generation work as before.
"""
import functools
import pathlib
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import common
from model import Experts, ModelArgs, Transformer

MODES = ["int8", "int4"]
# int4's input columns per scale and offset, unless --group-size says otherwise
GROUP_SIZE = 128
# model.Experts' weights
PROJECTIONS = ("gate_up_proj", "down_proj")


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per output row: weight ~= q * scale[..., None]. Returns (q, scale)."""
    scale = weight.float().abs().amax(dim=-1).clamp(min=1e-8) / 127
    q = (weight.float() / scale[..., None]).round().clamp(-127, 127)
    return q.to(torch.int8), scale


def quantize_int4(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric int4 per group of group_size input columns: weight (..., n_out, n_in) ~= q *
    scale + offset, q in 0 ... 15, scale and offset (..., n_out, n_in / group_size) in bf16.
    Returns (packed, scale, offset); packed (..., n_out, n_in / 2) uint8, byte j holding column 2j
    in its low nibble and column 2j + 1 in its high one."""
    # (..., n_out, groups, group_size)
    groups = weight.float().unflatten(-1, (-1, group_size))
    low = groups.amin(-1)
    scale = ((groups.amax(-1) - low) / 15).clamp(min=1e-8).bfloat16()
    offset = low.bfloat16()
    # Rounded against the scale and offset as stored
    q = (groups - offset[..., None].float()) / scale[..., None].float()
    q = q.round().clamp(0, 15).to(torch.uint8).flatten(-2)
    return q[..., 0::2] | q[..., 1::2] << 4, scale, offset


def quantize(name: str, weight: Tensor, group_size: int | None) -> dict[str, Tensor]:
    """The weight `name` (..., n_out, n_in) as a quantized checkpoint holds it: with group_size None
    int8, `name` and `name`_scale; else int4, `name`, `name`_scale and `name`_offset."""
    if group_size is None:
        q, scale = quantize_int8(weight)
        return {name: q, f"{name}_scale": scale}
    q, scale, offset = quantize_int4(weight, group_size)
    return {name: q, f"{name}_scale": scale, f"{name}_offset": offset}


def dequantized(module: nn.Module, name: str, dtype) -> Tensor:
    """The weight (..., n_out, n_in) that `module` holds quantized as `name` and its scale (and
    offset), in dtype: the only full-precision tensor made."""
    q = getattr(module, name)
    scale = getattr(module, f"{name}_scale").to(dtype)
    offset = getattr(module, f"{name}_offset", None)
    shape = (*q.shape[:-1], -1)
    if offset is not None:
        # int4: a row a group, (rows, group_size / 2), with its scale and offset (rows, 1), so that
        # the compiled weight_from below divides its indices by constants alone
        q = q.unflatten(-1, (scale.shape[-1], -1)).flatten(0, -2)
        offset = offset.to(dtype).reshape(-1, 1)
    # (..., rows, 1): a scale for each row of q, int8's output rows or int4's groups
    scale = scale.reshape(*q.shape[:-1], 1)
    # On CUDA one pass over the weight, compiled at the first call (recompiled with dynamic sizes
    # once a second shape comes): PyTorch's own ops take two or more, or one without vector loads
    # (int8 times bf16). Under torch.compile inductor fuses it.
    if q.is_cuda and not torch.compiler.is_compiling():
        return compiled_weight_from()(q, scale, offset).reshape(shape)
    return weight_from(q, scale, offset).reshape(shape)


def weight_from(q: Tensor, scale: Tensor, offset: Tensor | None) -> Tensor:
    """The weight of int8 q (rows, n_in) and its scale (rows, 1), q * scale; or of int4 q (rows,
    n_in / 2) with its scale and offset (rows, 1), offset + q * scale."""
    if offset is None:
        return q * scale
    # Byte j's low nibble is column 2j, its high one 2j + 1: their weights (rows, n_in / 2) are
    # packed as the two halves of an integer (the low one first in memory: little-endian, as every
    # machine PyTorch runs on) and viewed as floats, so that a compiled pass reads each byte once
    # and writes its two weights at once. Indexed by column instead, it reads each byte twice, in
    # single bytes: several times slower.
    bits = 8 * scale.element_size()
    # integer types of the floats' size and of twice it: int16 and int32 for bf16
    one, two = (getattr(torch, f"int{size}") for size in (bits, 2 * bits))
    low, high = (torch.addcmul(offset, half, scale).view(one).to(two) for half in (q & 15, q >> 4))
    return (low & (1 << bits) - 1 | high << bits).view(scale.dtype)


@functools.cache
def compiled_weight_from():
    """weight_from compiled: here alone torch._dynamo is imported (seconds)."""
    return torch.compile(weight_from)


def add_buffers(module: nn.Module, name: str, shape, group_size: int | None) -> None:
    """Gives `module` the weight `name` of `shape` (..., n_out, n_in) as quantize stores it:
    uninitialised buffers, on the device that is current, of the shapes and dtypes that quantize
    makes of a meta tensor."""
    for stored, tensor in quantize(name, torch.empty(shape, device="meta"), group_size).items():
        module.register_buffer(stored, torch.empty(tensor.shape, dtype=tensor.dtype))


class QuantizedLinear(nn.Module):
    """A bias-free linear layer whose weight (n_out, n_in) is quantized as quantize stores it: int8
    with group_size None, else int4."""

    def __init__(self, n_in: int, n_out: int, group_size: int | None):
        super().__init__()
        add_buffers(self, "weight", (n_out, n_in), group_size)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, dequantized(self, "weight", x.dtype))


class QuantizedExperts(Experts):
    """model.Experts with gate_up_proj and down_proj quantized as quantize stores them, an expert
    after another: int8 with group_size None, else int4."""

    def __init__(self, args: ModelArgs, group_size: int | None):
        super().__init__(args)
        for name in PROJECTIONS:
            shape = getattr(self, name).shape
            delattr(self, name)
            add_buffers(self, name, shape, group_size)

    def weights(self, dtype) -> tuple[Tensor, Tensor]:
        """gate_up_proj and down_proj dequantized, in dtype."""
        return tuple(dequantized(self, name, dtype) for name in PROJECTIONS)


def group_size_of(config: dict) -> int | None:
    """The group size of the quantization that config.json `config` names: None for int8. Refused
    in one line: an unknown quantization, or a group size that is no power of two of at least 8
    (the fast path reads int4 weights 8 to a word, and its blocks hold whole groups)."""
    mode = config["quantization"]
    common.require(mode in MODES, f"config.json: unknown quantization {mode!r}")
    if mode == "int8":
        return None
    size = config.get("group_size")
    common.require(size is not None, "config.json: int4 without its group_size: quantize the "
                   "bf16 checkpoint again")
    common.require(is_group_size(size), f"config.json: int4's group_size {size!r} is no power of "
                   "two of at least 8: quantize the bf16 checkpoint again")
    return size


def is_group_size(size) -> bool:
    """Whether int4 can group columns by `size`: a power of two, at least 8 (the fast path reads
    int4 weights 8 to a word, and its blocks hold whole groups)."""
    return type(size) is int and size >= 8 and size & (size - 1) == 0


def swap_in(model: Transformer, config: dict) -> None:
    """Replaces the modules that quantization stores quantized, as config.json `config` says, by
    quantized ones of their shapes, uninitialised (a checkpoint fills them): built on the device
    that is current, the meta device when loading. A layer whose input columns are no whole number
    of groups is refused, named."""
    group_size = group_size_of(config)

    def check(name: str, columns: int) -> None:
        """Refuses the weight `name` unless its input columns are whole groups."""
        if group_size and columns % group_size:
            raise common.UserError(f"{name}: its {columns} input columns are no multiple of the "
                                   f"group size {group_size} (--group-size sets it)")
    for path, parent in list(model.named_modules()):
        for name, child in parent.named_children():
            where = f"{path}.{name}".lstrip(".")
            if isinstance(child, Experts):
                for projection in PROJECTIONS:
                    check(f"{where}.{projection}", getattr(child, projection).shape[-1])
                setattr(parent, name, QuantizedExperts(model.args, group_size))
            # The router stays: small, and its picks must not move
            quantized = name != "gate" and isinstance(child, nn.Linear)
            # A tied lm_head is the embedding
            if quantized and child.weight is not model.embed_tokens.weight:
                check(where, child.in_features)
                layer = QuantizedLinear(child.in_features, child.out_features, group_size)
                setattr(parent, name, layer)


def quantized_config(config: dict, mode: str, group_size: int | None = None) -> dict:
    """The config.json of a bf16 checkpoint's `config`, quantized as `mode`: int4 in groups of
    `group_size` columns (None: GROUP_SIZE). A group size that can't be one is refused."""
    if mode == "int8":
        common.require(group_size is None, "--group-size is int4's: int8 scales whole rows")
        return dict(config, quantization=mode)
    size = GROUP_SIZE if group_size is None else group_size
    fits = is_group_size(size)
    common.require(fits, f"--group-size {size}: int4 needs a power of two, at least 8")
    return dict(config, quantization=mode, group_size=size)


def quantizing(config: dict, tensors) -> tuple:
    """The (name, tensor) pairs `tensors` of a bf16 checkpoint, quantized as config.json `config`
    (a quantized_config) says: the pairs of the quantized checkpoint, one at a time, and their
    count."""
    with torch.device("meta"):
        model = Transformer(common.model_args(config))
        swap_in(model, config)
    expected = common.checkpoint_tensors(model)
    group_size = group_size_of(config)

    def pairs():
        for name, weight in tensors:
            if expected[name].is_floating_point():
                yield name, weight
            else:
                yield from quantize(name, weight, group_size).items()
    return pairs(), len(expected)


def main(argv=None):
    common.run_command(quantize_command, argv, "interrupted: nothing was written")


def quantize_command(argv) -> None:
    parser = common.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True,
                        help="a directory that convert_hf_checkpoint.py wrote")
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--group-size", type=int,
                        help=f"int4: input columns per scale and offset (default {GROUP_SIZE})")
    parser.add_argument("--output", help="default: CHECKPOINT-MODE")
    args = parser.parse_args(argv)
    default = args.checkpoint.rstrip("/") + f"-{args.mode}"
    out = default if args.output is None else args.output
    quantize_checkpoint(args.checkpoint, out, args.mode, args.group_size)
    # As the converter: stdout may be full
    print(f"wrote {out}", file=sys.stderr)


def quantize_checkpoint(path: str, out: str, mode: str, group_size: int | None = None) -> None:
    """A converted bf16 checkpoint `path`, quantized as `mode` into `out`: a tensor at a time."""
    config = common.converted_config(path)
    # null (or any false value): not quantized, as generate.py reads it
    if config.get("quantization"):
        raise common.UserError(f"{path} is already {config['quantization']}: quantize its "
                               "bf16 conversion")
    with torch.device("meta"):
        model = Transformer(common.model_args(config))
    files = common.list_tensors(path, "model*.safetensors")
    if files.keys() != common.checkpoint_tensors(model).keys():
        raise common.UserError(f"{path}: weights do not match config.json; convert again")
    config = quantized_config(config, mode, group_size)
    tensors = ((name, common.read_tensor(file, name)) for name, file in files.items())
    pairs, count = quantizing(config, tensors)
    # The converter's writer: imported here, where this file's own command writes (the converter
    # imports this file for its --quantize)
    from convert_hf_checkpoint import write_checkpoint
    write_checkpoint(out, pairs, count, config, pathlib.Path(path))


if __name__ == "__main__":
    main()
