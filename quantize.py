"""Weight-only int8 quantization: int8 weights with a scale per output row.

    python quantize.py --checkpoint checkpoints/Qwen/Qwen3-8B/converted --mode int8  # ...-int8
    python convert_hf_checkpoint.py --checkpoint-dir checkpoints/Qwen/Qwen3-8B --int8  # in one pass

The blocks' linear layers, every expert and an untied lm_head are quantized; the embedding, the
norms and the MoE router stay as they are. A quantized checkpoint's config.json says
"quantization": "int8", and generate.py swaps these modules in before loading it. Optional: without
this file, bf16 conversion and generation work as before.
"""
import pathlib
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import convert_hf_checkpoint as convert
from model import Experts, ModelArgs, Transformer

MODES = ["int8"]


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per output row: weight ~= q * scale[..., None]. Returns (q, scale)."""
    scale = weight.float().abs().amax(dim=-1).clamp(min=1e-8) / 127
    q = (weight.float() / scale[..., None]).round().clamp(-127, 127)
    return q.to(torch.int8), scale


class WeightOnlyInt8Linear(nn.Module):
    """A bias-free linear layer whose weight (n_out, n_in) is int8, with a scale per output row."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.register_buffer("weight", torch.empty(n_out, n_in, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.empty(n_out))

    def forward(self, x: Tensor) -> Tensor:
        # The int8 cast inside the product's expression: inductor fuses it into the product's loads
        # and never writes a full-precision copy of the weight.
        return F.linear(x, self.weight.to(x.dtype)) * self.weight_scale


class Int8Experts(Experts):
    """model.Experts with int8 weights: gate_up_proj and down_proj, each with a scale per
    output row (experts, rows)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        for name in ("gate_up_proj", "down_proj"):
            shape = getattr(self, name).shape
            delattr(self, name)
            self.register_buffer(name, torch.empty(shape, dtype=torch.int8))
            self.register_buffer(f"{name}_scale", torch.empty(shape[:-1]))

    def weights(self, dtype) -> tuple[Tensor, Tensor]:
        scaled = []
        for name in ("gate_up_proj", "down_proj"):
            scale = getattr(self, f"{name}_scale")[..., None]
            scaled.append(getattr(self, name).to(dtype) * scale.to(dtype))
        return scaled[0], scaled[1]


def swap_in_int8(model: Transformer) -> None:
    """Replaces the modules that quantization stores as int8 by int8 ones of their shapes,
    uninitialised (a checkpoint fills them): built on the device that is current, the meta device
    when loading."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, Experts):
                setattr(parent, name, Int8Experts(model.args))
            # The router stays: small, and its picks must not move
            quantized = name != "gate" and isinstance(child, nn.Linear)
            # A tied lm_head is the embedding
            if quantized and child.weight is not model.embed_tokens.weight:
                int8 = WeightOnlyInt8Linear(child.in_features, child.out_features)
                setattr(parent, name, int8)


def quantized(name: str, weight: Tensor, expected: dict) -> dict[str, Tensor]:
    """Tensor `name` as an int8 checkpoint holds it: itself, or, where `expected` (the int8
    model's tensors) has it in int8, its int8 weight and scale `name`_scale."""
    if expected[name].dtype != torch.int8:
        return {name: weight}
    q, scale = quantize_int8(weight)
    return {name: q, f"{name}_scale": scale}


def main(argv=None):
    parser = convert.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True,
                        help="a directory that convert_hf_checkpoint.py wrote")
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--output", help="default: CHECKPOINT-int8")
    convert.stop_on_signals()
    try:
        args = parser.parse_args(argv)
        default = args.checkpoint.rstrip("/") + "-int8"
        out = default if args.output is None else args.output
        quantize_checkpoint(args.checkpoint, out)
        print(f"wrote {out}", file=sys.stderr)  # as the converter: stdout may be full
    except KeyboardInterrupt:
        convert.exit_interrupted("interrupted: nothing was written")
    except convert.USER_ERRORS as e:
        convert.exit_on(e)


def quantize_checkpoint(path: str, out: str) -> None:
    """A converted bf16 checkpoint `path`, quantized into `out`: a tensor at a time."""
    config = convert.converted_config(path)
    if config["quantization"] is not None:
        raise convert.UserError(f"{path} is already {config['quantization']}")
    with torch.device("meta"):
        model = Transformer(convert.model_args(config))
        swap_in_int8(model)
    expected = convert.checkpoint_tensors(model)
    files = convert.list_tensors(path, "model*.safetensors")
    unscaled = {name for name in expected if not name.endswith("_scale")}
    if files.keys() != unscaled:
        raise convert.UserError(f"{path}: weights do not match config.json; convert again")

    def tensors():
        for name, file in files.items():
            weight = convert.read_tensor(file, name)
            yield from quantized(name, weight, expected).items()
    config = dict(config, quantization="int8")
    convert.write_checkpoint(out, tensors(), len(expected), config, pathlib.Path(path))


if __name__ == "__main__":
    main()
