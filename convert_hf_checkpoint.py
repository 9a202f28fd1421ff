"""Converts a Hugging Face Qwen3 or Qwen3-MoE snapshot into qwen3-fast weights.

Our weights: fused qkv and gate-up products, each MoE layer's experts stacked, in safetensors.

    python convert_hf_checkpoint.py --checkpoint-dir checkpoints/Qwen/Qwen3-8B  # .../converted
    python convert_hf_checkpoint.py --checkpoint-dir checkpoints/Qwen/Qwen3-8B --int8  # ...-int8

Tensors are read one at a time and written in shards, so memory stays near one shard whatever the
model's size. The output is written to a hidden directory beside its destination and renamed into
place when complete; nothing that exists is replaced, and a failure, Ctrl-C, SIGTERM or SIGHUP
leaves nothing behind.
"""
import contextlib
import dataclasses
import glob
import json
import os
import pathlib
import re
import shutil
import signal
import sys

try:
    import torch
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import save_file

    import generate
    from model import (ModelArgs, Transformer, UserError, list_tensors, quantize_int8,
                       read_json, show_progress)
except KeyboardInterrupt:  # Ctrl-C while torch loads: nothing written, nothing to say
    sys.exit(130)

# Our fused tensors, and the Hugging Face tensors they concatenate
FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
COPIED = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
          "generation_config.json"]


def hf_names(name: str, experts: int) -> list[str]:
    """The Hugging Face tensors that make our tensor `name`, in the order they are concatenated: q,
    k, v; gate, up; and with `experts` (a MoE layer's stacked tensors), every expert's in turn."""
    if name == "lm_head.weight":
        return [name]
    # "layers.0.self_attn.qkv_proj.weight" -> "model.layers.0.self_attn", "qkv_proj", "weight"
    module, projection, leaf = f"model.{name}".rsplit(".", 2)
    owners = [module]
    if experts:
        owners = [f"{module}.experts.{expert}" for expert in range(experts)]
    parts = FUSED.get(projection, [projection])
    return [f"{owner}.{part}.{leaf}" for owner in owners for part in parts]


def read_tensor(file: str, name: str) -> torch.Tensor:
    try:
        # Opened per tensor: only this tensor's pages are ever mapped
        with safe_open(file, "pt") as tensors:
            return tensors.get_tensor(name)
    except Exception as e:  # safetensors' own error type
        raise UserError(f"{file}: cannot read tensor {name} ({e}): download it again") from None


def snapshot_args(src: pathlib.Path, int8: bool) -> ModelArgs:
    """The model of a Hugging Face snapshot, refused where it isn't one we convert."""
    if not (src / "config.json").is_file():
        raise UserError(f"{src}: no config.json; is it a Hugging Face Qwen3 snapshot?")
    generate.Tokenizer(src)  # refused now if missing or broken, not when generating
    if (src / "generation_config.json").is_file():  # likewise
        generation_config = read_json(src / "generation_config.json")
        generate.SamplingParams.from_generation_config(generation_config)
        generate.eos_ids(generation_config)
    cfg = read_json(src / "config.json")
    if "quantization_config" in cfg:
        raise UserError(f"{src}: quantized snapshots are not supported: use the bf16 one")
    if "quantization" in cfg:
        raise UserError(f"{src}: already converted; convert its Hugging Face snapshot")
    args = ModelArgs.from_config(cfg)
    if int8:
        args.quantization = "int8"
    return args


def joined(src: pathlib.Path, name: str, parts: list[str], files: dict, meta) -> torch.Tensor:
    """Our tensor `name`, of meta's shape, from its Hugging Face parts."""
    missing = [hf for hf in parts if hf not in files]
    if missing:
        raise UserError(f"{src}: the checkpoint lacks {missing[0]}")
    tensors = [read_tensor(files[hf], hf) for hf in parts]
    # Stacked experts: every part has one shape, so name the one that differs
    if meta.dim() == 3:
        rows = meta.numel() // meta.shape[-1] // len(parts)
        part_shape = (rows, meta.shape[-1])
        wrong = [hf for hf, t in zip(parts, tensors, strict=True) if t.shape != part_shape]
        if wrong:
            raise UserError(f"{files[wrong[0]]}: {wrong[0]} does not have the shape "
                            f"{part_shape} that config.json implies")
    broken = [hf for hf, t in zip(parts, tensors, strict=True) if not t.isfinite().all()]
    if broken:
        raise UserError(f"{files[broken[0]]}: {broken[0]} holds values that are not finite")
    weight = torch.cat(tensors)  # experts: (experts x rows, columns)
    if weight.numel() != meta.numel() or weight.shape[-1] != meta.shape[-1]:
        raise UserError(f"{src}: {name} has shape {tuple(weight.shape)}; config.json implies "
                        f"{tuple(meta.shape)}")
    return weight.view(meta.shape)


def convert(src: str, out: str, int8: bool = False, shard_bytes: int = 2 << 30) -> None:
    src = pathlib.Path(src)
    out = pathlib.Path(os.path.abspath(out))  # "." has no name to put beside it
    args = snapshot_args(src, int8)
    if out.exists():  # the source, ".", an old conversion, an empty directory...
        raise UserError(f"{out} exists: choose another --output (nothing is replaced)")
    with torch.device("meta"):
        expected = Transformer(args).checkpoint_tensors()
    sources = {}  # our tensor -> its Hugging Face parts; int8 scales come from the weights
    for name, meta in expected.items():
        if not name.endswith(".scale"):
            experts = meta.shape[0] if meta.dim() == 3 else 0
            sources[name] = hf_names(name, experts)
    files = list_tensors(src, "*.safetensors")
    placed = {hf for parts in sources.values() for hf in parts} | {"lm_head.weight"}
    unknown = files.keys() - placed
    if unknown:
        first = min(unknown)
        raise UserError(f"{files[first]}: tensor {first} has no place in a Qwen3 model")
    remove_leftovers(out)
    tmp = out.with_name(f".converting-{out.name}-{os.getpid()}")  # beside it, hidden
    # Read by setting it: the shards get 0666 less it, as the snapshot's files
    umask = os.umask(0)
    os.umask(umask)
    # The directories we create, deepest first
    made = [p for p in out.parents if not p.exists()]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        shard = {}
        for i, (name, parts) in enumerate(sources.items()):
            weight = joined(src, name, parts, files, expected[name])
            scale_name = name.removesuffix(".weight") + ".scale"
            if scale_name in expected:
                weight, shard[scale_name] = quantize_int8(weight)
            shard[name] = weight.contiguous()
            full = sum(t.nbytes for t in shard.values()) >= shard_bytes
            if full or i == len(sources) - 1:
                # Named by the index of its last tensor: in order, as the loader reads them
                file = tmp / f"model-{i:05d}.safetensors"
                save_file(shard, file)
                file.chmod(0o666 & ~umask)  # save_file makes it private
                shard = {}
            show_progress(f"converting {src}", i + 1, len(sources))
        (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(args), indent=2))
        for name in COPIED:
            if (src / name).is_file():
                shutil.copy(src / name, tmp)
        tmp.rename(out)  # only now that it is complete
    except BaseException:  # an error, Ctrl-C, SIGTERM or SIGHUP
        shutil.rmtree(tmp, ignore_errors=True)
        for directory in made:
            # Something else was put there meanwhile: it stays
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise


def remove_leftovers(out: pathlib.Path) -> None:
    """Removes what earlier conversions to `out` left when killed outright (SIGKILL, the OOM
    killer: no clean-up runs): a hidden directory named for a process that is gone, holding nothing
    but files we write. Anything else stays."""
    names = ["model-\\d{5}\\.safetensors", "config\\.json", *map(re.escape, COPIED)]
    ours = re.compile("|".join(names))
    for leftover in out.parent.glob(f".converting-{glob.escape(out.name)}-*"):
        pid = leftover.name.rsplit("-", 1)[-1]
        if leftover.is_symlink() or not leftover.is_dir() or running(pid):
            continue
        if all(ours.fullmatch(file.name) and file.is_file() for file in leftover.iterdir()):
            shutil.rmtree(leftover)
            print(f"removed {leftover}, left by a conversion that was killed", file=sys.stderr)


def running(pid: str) -> bool:
    """Whether process `pid` may exist: anything but a number of no process counts as running."""
    try:
        os.kill(int(pid), 0)  # signal 0: nothing is sent, the process is only looked up
    except ProcessLookupError:
        return False
    except (ValueError, OSError):  # not a number, or someone else's process
        return True
    return True


def main(argv=None):
    parser = generate.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint-dir", required=True,
                        help="a Hugging Face Qwen3 snapshot (config.json + *.safetensors)")
    parser.add_argument("--output", help="where to write (default: CHECKPOINT_DIR/converted, "
                        "or converted-int8)")
    parser.add_argument("--int8", action="store_true",
                        help="int8 weight-only (the blocks, an untied lm_head)")
    parser.add_argument("--shard-size-mb", type=generate.POSITIVE, default=2048,
                        help="size of each output file")
    # SIGTERM and SIGHUP (`timeout`, a closed terminal, a job scheduler) stop it as Ctrl-C does,
    # through the clean-up of convert
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGHUP, signal.default_int_handler)
    try:
        args = parser.parse_args(argv)
        name = "converted-int8" if args.int8 else "converted"
        out = args.output or os.path.join(args.checkpoint_dir, name)
        convert(args.checkpoint_dir, out, args.int8, args.shard_size_mb << 20)
        print(f"wrote {out}", flush=True)
    except KeyboardInterrupt:
        print("interrupted: nothing was written", file=sys.stderr)
        sys.exit(130)
    # A full disk: either error while the output is written, which is then gone; or a full stdout
    except (UserError, OSError, SafetensorError) as e:
        generate.exit_with(e)


if __name__ == "__main__":
    main()
