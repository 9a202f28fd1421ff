"""Tensor parallelism: one model split over the processes that torchrun starts, one GPU each (NCCL),
or CPU processes (gloo, with --device cpu). generate.py runs whole without this file.

    torchrun --nproc-per-node 2 generate.py --cuda-graph --prompt "Hello, my name is"

Each rank builds the model at its own shapes and reads only its slices of the converted files: 1/N
of the query heads, of the kv heads (each replicated over N / kv_heads ranks where N is larger, as
the large serving engines do), of the MLP's and of each expert's intermediate size. q, k and v are
split inside the fused qkv_proj, gate and up inside the fused gate_up_proj (column-parallel, scales
and offsets following their rows); o_proj and down_proj take their input split (row-parallel, int4's
scales and offsets their groups), and one all-reduce each sums the ranks' shares. The embedding, the
norms, the MoE router and lm_head are whole on every rank, so every rank gets the same logits and,
from the same seed, samples the same tokens: nothing is broadcast. A rank's share of an int4 layer's
input is whole groups, or it is refused.
"""
import atexit
import dataclasses
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from common import UserError
from model import ModelArgs, Transformer

# Row-parallel: each rank takes its columns of the weight (its share of the input)
ROW_PARALLEL = ("o_proj", "down_proj")
# Column-parallel: each rank takes its rows of every part of the fused product (q, k, v; gate, up)
FUSED = ("qkv_proj", "gate_up_proj")


def launched() -> bool:
    """Whether torchrun started this process (as one rank of one or more)."""
    return "LOCAL_RANK" in os.environ


def start(device: torch.device) -> "TensorParallel":
    """This process's rank from torchrun's environment, its process group (NCCL on CUDA, gloo on
    the CPU) and its GPU: cuda:LOCAL_RANK. Rank 0 alone prints the text: the others' stdout goes
    nowhere, their stderr stays."""
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    # Before the interpreter's teardown, which a live group's threads can abort
    atexit.register(dist.destroy_process_group)
    rank = dist.get_rank()
    if rank:
        sys.stdout = open(os.devnull, "w")  # open until the exit
    return TensorParallel(rank, dist.get_world_size(), device)


def exit_now() -> None:
    """Ends a rank that succeeded, under torchrun (else does nothing): its process group destroyed
    and its output flushed, then os._exit(0). Left to run, the interpreter's teardown now and then
    aborts in gloo's threads (SIGABRT after the work is done, seen on the CPU); a rank that fails
    ends as Python ends it, after the atexit handler start registers."""
    if dist.is_initialized():
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


@dataclasses.dataclass
class TensorParallel:
    """Rank `rank` of `world`: what generate.load_model asks of a split (rank_args, read,
    apply)."""
    rank: int
    world: int
    device: torch.device
    args: ModelArgs | None = None  # the whole model's, from rank_args

    def rank_args(self, args: ModelArgs, config: dict) -> ModelArgs:
        """The shapes of this rank's share of the model `args`, from config.json `config`."""
        self.args = args
        sizes = {"num_attention_heads": args.num_attention_heads,
                 "intermediate_size": args.intermediate_size,
                 "moe_intermediate_size": args.moe_intermediate_size}
        kv_heads = args.num_key_value_heads
        # int4: a rank's share of o_proj's and down_proj's input columns must be whole groups
        group = 1
        if config["quantization"]:  # load_model has found quantize.py, which reads it
            import quantize
            group = quantize.group_size_of(config) or 1  # None: int8, a scale a row
        widths = [args.num_attention_heads * args.head_dim, args.intermediate_size]
        if args.num_experts:
            widths.append(args.moe_intermediate_size)
        fits = [n for n in range(1, 65) if all(size % n == 0 for size in sizes.values())
                and (kv_heads % n == 0 or n % kv_heads == 0)
                and all(width % (n * group) == 0 for width in widths)]
        if self.world not in fits:
            grouped = f" (int4: in whole groups of {group})" if group > 1 else ""
            raise UserError(f"{self.world} processes can't split this model{grouped}: "
                            f"use one of {fits}")
        shares = {name: size // self.world for name, size in sizes.items()}
        local_kv = max(kv_heads // self.world, 1)
        return dataclasses.replace(args, **shares, num_key_value_heads=local_kv)

    def rows(self, module: str, total: int) -> list[slice]:
        """This rank's rows of a fused product's `total` output rows: of q, k and v, or of gate and
        up. Its kv heads start at head rank * kv_heads // world, which replicates each over world /
        kv_heads ranks where there are fewer kv heads than ranks. gate_up_proj's rows are [gate;
        up]: a rank's are a run of each half, at the same place."""
        if module == "gate_up_proj":
            half = total // 2
            width = half // self.world
            start = self.rank * width
            return [slice(start, start + width), slice(half + start, half + start + width)]
        args = self.args
        size = args.head_dim
        q = args.num_attention_heads * size // self.world
        kv = max(args.num_key_value_heads // self.world, 1) * size
        kv_start = self.rank * args.num_key_value_heads // self.world * size
        k_start = args.num_attention_heads * size + kv_start
        v_start = k_start + args.num_key_value_heads * size
        return [slice(self.rank * q, self.rank * q + q), slice(k_start, k_start + kv),
                slice(v_start, v_start + kv)]

    def read(self, name: str, part) -> torch.Tensor:
        """This rank's share of the converted tensor `name` from `part`, its safetensors slice:
        only these bytes are read. A weight's output rows are its second-last dimension, as are
        those of int4's scales and offsets (a column per group); an int8 scale (`name`_scale) has
        one per output row, its last."""
        # "layers.0.mlp.experts.down_proj", "layers.0.self_attn.o_proj.weight_scale" -> the product
        pieces = name.removesuffix("_scale").removesuffix("_offset").split(".")
        module = [piece for piece in pieces if piece.endswith("_proj")]
        module = module[-1] if module else None
        shape = part.get_shape()
        # An int8 scale has a dimension fewer than its weight: 3 for stacked experts, else 2
        scale = name.endswith("_scale") and len(shape) < 2 + ("experts" in pieces)
        whole = [slice(None)] * len(shape)
        if module in ROW_PARALLEL and not scale:  # the input columns, made contiguous
            width = shape[-1] // self.world
            columns = slice(self.rank * width, self.rank * width + width)
            return part[(*whole[:-1], columns)].contiguous()
        if module not in FUSED:  # whole on every rank (a row-parallel scale: per output row)
            return part[:]
        dim = len(shape) - (1 if scale else 2)
        shares = [part[(*whole[:dim], rows)] for rows in self.rows(module, shape[dim])]
        return torch.cat(shares, dim)

    def apply(self, model: Transformer) -> None:
        """The all-reduces. PyTorch's path: each block's attention and MLP output is a share of the
        sum, which the all-reduce completes before the block adds its residual. The fast path
        (qwen3_triton.forward_step reads model.tensor_parallel): o_proj's and down_proj's
        kernels add the residual on rank 0 alone, then the all-reduce sums the shares. One rank
        holds the whole sum: it needs none."""
        if self.world == 1:
            return
        for layer in model.layers:
            for module in (layer.self_attn, layer.mlp):
                module.register_forward_hook(lambda _module, _inputs, share: self.all_reduce(share))
        model.tensor_parallel = self

    def all_reduce(self, share: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `share`: one all-reduce that eager code, our CUDA graphs and
        torch.compile alike can run."""
        return funcol.all_reduce(share, "sum", dist.group.WORLD)

    def residual(self, residual: torch.Tensor | None) -> torch.Tensor | None:
        """What a row-parallel kernel adds to its share: the residual on rank 0 alone, so that the
        sum holds it once."""
        if self.rank:
            return None
        return residual
