"""Converts a Hugging Face Qwen3 or Qwen3-MoE snapshot into qwen3-fast weights.

Our weights: fused qkv and gate-up products, each MoE layer's experts stacked, in safetensors.

    python convert_hf_checkpoint.py --checkpoint-dir checkpoints/Qwen/Qwen3-8B  # .../converted
    python convert_hf_checkpoint.py --checkpoint-dir checkpoints/Qwen/Qwen3-8B --quantize int4

Tensors are read one at a time and written in shards, so memory stays near one shard whatever the
model's size. The output is written to a hidden directory beside its destination and renamed into
place when complete; nothing that exists is replaced, and a failure, Ctrl-C, SIGTERM or SIGHUP
leaves nothing behind. quantize.py's own command writes through write_checkpoint too.
"""
import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

try:
    import torch
    from safetensors.torch import save_file

    from common import (ArgumentParser, checkpoint_tensors, list_tensors, optional, positive,
                        read_tensor, require, run_command, show_progress, snapshot_args)
    from model import Transformer
except KeyboardInterrupt:
    # Ctrl-C while torch loads: nothing written, nothing to say
    sys.exit(130)


# Our fused tensors, and the Hugging Face tensors they concatenate
FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
         "gate_up_proj": ["gate_proj", "up_proj"]}
COPIED = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
          "generation_config.json"]


def hf_names(name: str, meta: torch.Tensor) -> list[str]:
    """The Hugging Face tensors that make our tensor `name`, of meta's shape, in the order they are
    concatenated: q, k, v; gate, up; and for a MoE layer's stacked experts (experts, rows, columns),
    every expert's in turn."""
    if name == "lm_head.weight":
        return [name]
    # "layers.0.self_attn.qkv_proj.weight" -> "model.layers.0.self_attn", "qkv_proj"; experts:
    # "layers.0.mlp.experts.down_proj" -> "model.layers.0.mlp.experts", "down_proj"
    module, projection = f"model.{name}".removesuffix(".weight").rsplit(".", 1)
    owners = [f"{module}.{expert}" for expert in range(len(meta))] if meta.dim() == 3 else [module]
    parts = FUSED.get(projection, [projection])
    return [f"{owner}.{part}.weight" for owner in owners for part in parts]


def joined(src: Path, name: str, files: dict, meta) -> torch.Tensor:
    """Our tensor `name`, of meta's shape, from its Hugging Face parts (hf_names) in `files`, the
    snapshot's tensors."""
    parts = hf_names(name, meta)
    missing = [hf for hf in parts if hf not in files]
    require(not missing, f"{src}: the checkpoint lacks {', '.join(missing)}")
    tensors = {hf: read_tensor(files[hf], hf) for hf in parts}
    # Stacked experts: every part has one shape, so name the one that differs
    if meta.dim() == 3:
        shape = (meta.numel() // meta.shape[-1] // len(parts), meta.shape[-1])
        wrong = next((hf for hf, t in tensors.items() if t.shape != shape), None)
        require(not wrong, f"{files.get(wrong)}: {wrong} does not have the shape {shape} "
                "that config.json implies")
    broken = next((hf for hf, t in tensors.items() if not t.isfinite().all()), None)
    require(not broken, f"{files.get(broken)}: {broken} holds values that are not finite")
    # Experts: (experts x rows, columns)
    weight = torch.cat(list(tensors.values()))
    same = weight.numel() == meta.numel() and weight.shape[-1] == meta.shape[-1]
    require(same, f"{src}: {name} has shape {tuple(weight.shape)}; config.json implies "
            f"{tuple(meta.shape)}")
    return weight.reshape(meta.shape)


def convert(src: str, out: str, quantization: str | None = None, shard_bytes: int = 2 << 30,
            group_size: int | None = None) -> None:
    """Converts the snapshot `src` into the new directory `out`, in shards of about shard_bytes;
    with `quantization` ("int8", or "int4" in groups of `group_size`, 128 by default), quantized by
    quantize.py as read."""
    require(str(src).strip(), "--checkpoint-dir is empty: name a snapshot")
    src = Path(src)
    args, config = snapshot_args(src)
    require(quantization or group_size is None, "--group-size goes with --quantize int4")
    with torch.device("meta"):
        expected = checkpoint_tensors(Transformer(args))
    files = list_tensors(src, "*.safetensors")
    # Every Hugging Face tensor that makes one of ours
    placed = {hf for name, meta in expected.items() for hf in hf_names(name, meta)}
    unknown = min(files.keys() - placed - {"lm_head.weight"}, default=None)
    require(not unknown, f"{files.get(unknown)}: {unknown} is in no Qwen3")

    # Joined as they are written, one at a time
    pairs = ((name, joined(src, name, files, meta)) for name, meta in expected.items())
    count = len(expected)
    # quantize.py's config.json (its checks of --group-size), and its tensors a tensor at a time,
    # as read
    if quantization:
        quantize = optional("quantize", quantization)
        config = quantize.quantized_config(config, quantization, group_size)
        pairs, count = quantize.quantizing(config, pairs)
    write_checkpoint(out, pairs, count, config, src, shard_bytes)


def write_checkpoint(out: str, tensors, count: int, config: dict, src: Path,
                     shard_bytes: int = 2 << 30) -> None:
    """Writes a converted checkpoint into the new directory `out`: tensors, an iterator of `count`
    (name, tensor) pairs, in shards of about shard_bytes; config.json;
    the tokenizer files copied from `src`. Written beside it and renamed when complete: nothing
    that exists is replaced, and an error or a signal leaves nothing behind."""
    require(str(out).strip(), "--output is empty: name a new directory")
    # "." has no name to put beside it
    out = Path(os.path.abspath(out))
    # the source, ".", an old conversion, an empty directory, a link (dangling too)...
    require(not os.path.lexists(out), f"{out} exists: choose another --output (it stays)")
    # Hidden, beside it: a second conversion to `out` finds it and stops before any work
    tmp = out.with_name(f".converting-{out.name}")
    require(not tmp.exists(), f"{tmp} exists: another conversion to {out} is running, or "
            "died (SIGKILL, out of memory): remove it if none runs")
    # Read by setting it: the shards get 0666 less it, as the snapshot's files
    umask = os.umask(0)
    os.umask(umask)
    blocked = next((p for p in out.parents if p.is_file()), None)
    require(not blocked, f"{blocked} is a file: choose another --output")
    # The directories we create, deepest first
    made = [p for p in out.parents if not p.exists()]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        shard, files = {}, []
        for done, (name, tensor) in enumerate(tensors, 1):
            shard[name] = tensor.contiguous()
            if sum(t.nbytes for t in shard.values()) >= shard_bytes or done == count:
                files.append(tmp / f"{len(files)}.safetensors")
                save_file(shard, files[-1])
                # save_file makes it private
                files[-1].chmod(0o666 & ~umask)
                shard = {}
            show_progress(f"writing {out}", done, count)
        # Named as the hub names shards, once their count is known
        for index, file in enumerate(files, 1):
            file.rename(tmp / f"model-{index:05d}-of-{len(files):05d}.safetensors")
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for name in COPIED:
            if (src / name).is_file():
                shutil.copy(src / name, tmp)
        # Only now that it is complete
        tmp.rename(out)
    # An error, Ctrl-C, SIGTERM or SIGHUP
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for directory in made:
            # Something else was put there meanwhile: it stays
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise


def main(argv=None):
    run_command(convert_command, argv, "interrupted: nothing was written")


def convert_command(argv) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    flag = parser.add_argument
    flag("--checkpoint-dir", required=True,
         help="a Hugging Face Qwen3 snapshot (config.json + *.safetensors)")
    flag("--output", help="default: CHECKPOINT_DIR/converted[-QUANTIZE]")
    flag("--quantize", choices=["int8", "int4"], help="weight-only, by quantize.py")
    flag("--group-size", type=int, help="int4: columns a scale (default 128)")
    flag("--shard-size-mb", type=positive, default=2048, help="size of each output file")
    args = parser.parse_args(argv)
    name = f"converted-{args.quantize}" if args.quantize else "converted"
    out = os.path.join(args.checkpoint_dir, name) if args.output is None else args.output
    convert(args.checkpoint_dir, out, args.quantize, args.shard_size_mb << 20, args.group_size)
    # On stderr, as every message: stdout may be full, though the checkpoint is written
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
