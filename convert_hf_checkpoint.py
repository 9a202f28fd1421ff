"""Converts a Hugging Face Qwen3 or Qwen3-MoE snapshot into qwen3-fast weights.

Our weights: fused qkv and gate-up products, each MoE layer's experts stacked, in safetensors.

    python convert_hf_checkpoint.py --checkpoint-dir checkpoints/Qwen/Qwen3-8B  # .../converted
    python convert_hf_checkpoint.py --checkpoint-dir checkpoints/Qwen/Qwen3-8B --quantize int4

Tensors are read one at a time and written in shards, so memory stays near one shard whatever the
model's size. The output is written to a hidden directory beside its destination and renamed into
place when complete; nothing that exists is replaced, and a failure, Ctrl-C, SIGTERM or SIGHUP
leaves nothing behind.

This file also holds what both formats' readers share (generate.py and quantize.py import it): the
checks of config.json, the safetensors index, the one-line errors.
"""
import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import pathlib
import shutil
import signal
import sys

try:
    import torch
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import save_file

    from model import ModelArgs, Transformer
except KeyboardInterrupt:
    # Ctrl-C while torch loads: nothing written, nothing to say
    sys.exit(130)


class UserError(Exception):
    """Bad input: the command-line tools print it as one line instead of a traceback."""


def require(condition: bool, message: str) -> None:
    """Refuses bad input: a UserError with `message` unless `condition`."""
    if not condition:
        raise UserError(message)


class ArgumentParser(argparse.ArgumentParser):
    # One line, as for every other bad input
    def error(self, message):
        raise UserError(message)


def optional(name: str, needed_by: str = ""):
    """An optional module (our quantize.py, qwen3_triton.py, tp.py, speculative.py; Python's
    readline), or None where it is missing, or the package it needs (Triton) is; a UserError then
    if `needed_by` (a flag, say) needs it. One that is there but fails to import is an error:
    without it, things would silently run many times slower."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name not in (name, "triton"):
            raise
        require(not needed_by, f"{needed_by} needs {name}.py")
        return None


def positive(text: str) -> int:
    """An argparse type: an int of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {text}")
    return value


def read_json(path) -> dict:
    """A JSON object from a file; anything else (unreadable, not JSON, a list) is a UserError."""
    try:
        value = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
    # ValueError: not UTF-8, or not JSON
    except (OSError, ValueError, RecursionError) as e:
        raise UserError(f"{path}: not a readable JSON file ({e})") from None
    kind = type(value).__name__
    require(kind == "dict", f"{path}: not a JSON object but {kind}; download or convert it again")
    return value


def show_progress(what: str, done: int, total: int) -> None:
    """`what` and the share of it done, redrawn in place on stderr where stderr is a terminal (a
    log gets nothing); the line ends when done reaches total."""
    if sys.stderr.isatty():
        end = "\n" if done == total else ""
        print(f"\r{what}: {100 * done // total}%", end=end, file=sys.stderr, flush=True)


def list_tensors(directory, pattern: str) -> dict[str, str]:
    """Every tensor's name in the safetensors files `pattern` of `directory` -> the file that holds
    it, read from the headers alone. A name in two files is refused: which one holds the weight is
    anyone's guess."""
    files = sorted(pathlib.Path(directory).glob(pattern))
    require(files, f"{directory}: no {pattern} files; download or convert it again")
    tensors = {}
    for file in files:
        require(os.access(file, os.R_OK), f"{file}: not readable (a broken link, or permissions)")
        try:
            with safe_open(file, "pt") as opened:
                names = opened.keys()
        except Exception as e:
            # safetensors' own error type: a truncated or corrupt file
            raise UserError(f"{file}: not a readable safetensors file ({e})") from None
        twice = min(tensors.keys() & names, default=None)
        require(not twice, f"{file}: tensor {twice} is in {tensors.get(twice)} too")
        tensors.update(dict.fromkeys(names, str(file)))
    return tensors


def read_tensor(file: str, name: str) -> torch.Tensor:
    try:
        # Opened per tensor: only this tensor's pages are ever mapped
        with safe_open(file, "pt") as tensors:
            return tensors.get_tensor(name)
    # safetensors' own error type
    except Exception as e:
        raise UserError(f"{file}: tensor {name} unreadable ({e}): download it again") from None


# The supported architectures, each with its model_type
SUPPORTED = [(["Qwen3ForCausalLM"], "qwen3"), (["Qwen3MoeForCausalLM"], "qwen3_moe")]
# The JSON types a config.json value may have, by the type of its ModelArgs field. A bool is no int
# here.
CONFIG_TYPES = {int: (int,), float: (int, float), bool: (bool,),
                list[int]: (list,), dict: (dict,)}
# What config.json must give: no default is safe for these
REQUIRED = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "rms_norm_eps", "max_position_embeddings"]
# The numbers that must be above 0 for the model to be defined, whether config.json gives them or
# not
POSITIVE = [*REQUIRED, "head_dim", "rope_theta", "num_experts_per_tok", "moe_intermediate_size",
            "decoder_sparse_step"]
# Past every number of a Qwen3's config.json: a bound that NaN, infinity and ints of any size fail
# without overflowing a float
LARGEST = 2**40
# YaRN's numbers, each above 0 where given: its formula takes their logarithms or divides by them
YARN_POSITIVE = ["factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                 "attention_factor"]


def model_args(config: dict) -> ModelArgs:
    """The model of a config.json, a Hugging Face one or ours, refused in one line where its values
    describe none we run: of the wrong type, not finite, or out of the bounds the model needs."""
    architectures = config.get("architectures") or ["Qwen3ForCausalLM"]
    model_type = config.get("model_type", "qwen3")
    # Compared (a dict's keys would be hashed): config.json may hold anything there
    supported = (architectures, model_type) in SUPPORTED
    require(supported, f"{architectures} (model_type {model_type}) is no Qwen3 we run")
    windowed = config.get("use_sliding_window")
    require(not windowed, "config.json: sliding-window attention is unsupported")
    scaling = config.get("rope_scaling")
    rope = config.get("rope_parameters") or scaling or {}
    if scaling and scaling != rope:
        raise UserError("config.json: rope_parameters and rope_scaling disagree: keep one")
    require(isinstance(rope, dict), f"config.json: rope_parameters {rope!r} is no object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise UserError(f"rope type {rope_type}: only default RoPE and YaRN are supported")
    # YaRN's parameters: our config.json's yarn, or a Hugging Face config's rope_parameters
    yarn = config.get("yarn") or {}
    if rope_type == "yarn":
        yarn = {key: value for key, value in rope.items() if key not in ("rope_type", "type")}
    numbers = isinstance(yarn, dict) and all(
        type(v) in (int, float, bool) and abs(v) < LARGEST for v in yarn.values())
    require(numbers, f"config.json: YaRN parameters {yarn} are not all numbers below 2^40")
    given = {**config, "rope_theta": rope.get("rope_theta", config.get("rope_theta"))}
    given["num_experts"] = config.get("num_local_experts", config.get("num_experts"))
    for spec in dataclasses.fields(ModelArgs):
        name, value = spec.name, given.get(spec.name)
        if value is None and name in REQUIRED:
            raise UserError(f"config.json: {name} is missing; download or convert it again")
        if value is None:
            continue
        # NaN, infinity and numbers past any model's make no model (NaN fails the comparison)
        finite = type(value) not in (int, float) or abs(value) < LARGEST
        negative_int = type(value) is int and value < 0
        if type(value) not in CONFIG_TYPES[spec.type] or not finite or negative_int:
            raise UserError(f"config.json: {name} is {value!r}, not a valid value")
    # The bounds the model's formulas need
    args = ModelArgs.from_config(config)
    for name in POSITIVE:
        value = getattr(args, name)
        require(value > 0, f"config.json: {name} is {value!r}; it must be above 0")
    too_many = args.num_experts and args.num_experts_per_tok > args.num_experts
    require(not too_many, "config.json: num_experts_per_tok is over num_experts")
    if args.num_attention_heads % args.num_key_value_heads:
        raise UserError("config.json: num_attention_heads is no multiple of num_key_value_heads")
    if args.yarn and args.rope_theta <= 1:
        raise UserError(f"config.json: rope_theta is {args.rope_theta!r}; YaRN needs it above 1")
    for name in YARN_POSITIVE:
        value = args.yarn.get(name, 1)
        require(value > 0, f"config.json: YaRN's {name} is {value!r}; it must be above 0")
    # Past any Qwen3's by far: building the model would take minutes, or overflow a tensor's size
    widest = max(args.intermediate_size, args.num_experts * args.moe_intermediate_size,
                 args.vocab_size, args.num_attention_heads * args.head_dim)
    sane = args.hidden_size * widest < 2**40 and args.num_hidden_layers < 2**12
    require(sane, "config.json: sizes far past any Qwen3's; download it again")
    return args


def eos_ids(config: dict, file: str, vocab: int) -> set[int]:
    """The end-of-sequence tokens of a config.json or generation_config.json: one id, or a list,
    each of the model's vocabulary of `vocab`."""
    eos = config.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    # null, as no key: none, as transformers reads it
    ids = [] if eos is None else ids
    if not all(type(i) is int and 0 <= i < vocab for i in ids):
        raise UserError(f"{file}: eos_token_id {eos!r} is not token ids in [0, {vocab})")
    return set(ids)


def converted_config(path) -> dict:
    """The config.json of a directory that this converter wrote, refused if it isn't one."""
    named = isinstance(path, (str, os.PathLike)) and str(path).strip()
    require(named, f"{path!r} is no path: name a converted checkpoint")
    config = pathlib.Path(path, "config.json")
    require(config.is_file(), f"{path}: no converted checkpoint; the converter makes one")
    config = read_json(config)
    # Every config.json this converter writes says so; an older one's interleaved gate and up rows
    ours = config.get("gate_up") == "halves"
    require(ours, f"{path} is a Hugging Face snapshot or an older conversion: convert the "
            "snapshot: convert_hf_checkpoint.py --checkpoint-dir SNAPSHOT --output NEW")
    return config


def checkpoint_tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """What a converted checkpoint holds: the model's state, but a tied lm_head (the
    embedding)."""
    state = model.state_dict()
    if model.args.tie_word_embeddings:
        del state["lm_head.weight"]
    return state


def read_tokenizer(path):
    """The checkpoint's tokenizer.json, as the tokenizers library reads it."""
    import tokenizers
    file = pathlib.Path(path, "tokenizer.json")
    try:
        return tokenizers.Tokenizer.from_file(str(file))
    # The tokenizers library's own error type
    except Exception as e:
        raise UserError(f"{file}: no readable tokenizer ({e})") from None


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
    experts = len(meta) if meta.dim() == 3 else 0
    owners = [f"{module}.{expert}" for expert in range(experts)] or [module]
    parts = FUSED.get(projection, [projection])
    return [f"{owner}.{part}.weight" for owner in owners for part in parts]


def joined(src: pathlib.Path, name: str, files: dict, meta) -> torch.Tensor:
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
    src = pathlib.Path(src)
    # The snapshot's model, refused where it isn't one we convert
    require((src / "config.json").is_file(), f"{src}: no config.json; is it a Qwen3 snapshot?")
    # Refused now if missing or broken, not when generating
    read_tokenizer(src)
    config = read_json(src / "config.json")
    require("quantization_config" not in config, f"{src} is quantized: convert the bf16 snapshot")
    require("quantization" not in config, f"{src}: already converted; convert its snapshot")
    args = model_args(config)
    # Likewise generation_config.json, if it isn't JSON or its eos ids aren't the model's
    file = src / "generation_config.json"
    eos_ids(read_json(file) if file.is_file() else {}, file, args.vocab_size)
    eos = sorted(eos_ids(config, "config.json", args.vocab_size))
    # Our config.json for it. gate_up_proj's rows [gate; up], as transformers 5's (older
    # conversions: converted_config)
    config = dict(dataclasses.asdict(args), eos_token_id=eos, quantization=None, gate_up="halves")
    require(quantization or group_size is None, "--group-size goes with --quantize int4")
    if quantization:
        quantize = optional("quantize", quantization)
        config = quantize.quantized_config(config, quantization, group_size)
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
    # A tensor at a time, as read
    if quantization:
        pairs, count = quantize.quantizing(config, pairs)
    write_checkpoint(out, pairs, count, config, src, shard_bytes)


def write_checkpoint(out: str, tensors, count: int, config: dict, src: pathlib.Path,
                     shard_bytes: int = 2 << 30) -> None:
    """Writes a converted checkpoint into the new directory `out`: tensors, an iterator of `count`
    (name, tensor) pairs, in shards of about shard_bytes; config.json;
    the tokenizer files copied from `src`. Written beside it and renamed when complete: nothing
    that exists is replaced, and an error or a signal leaves nothing behind."""
    require(str(out).strip(), "--output is empty: name a new directory")
    # "." has no name to put beside it
    out = pathlib.Path(os.path.abspath(out))
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


def run_command(command, argv, interrupted: str) -> None:
    """command(argv), as every command of ours runs: SIGTERM and SIGHUP (`timeout`, a closed
    terminal, a job scheduler) stop it as Ctrl-C does, through the same clean-up, and exit 130
    saying `interrupted` (on a terminal, after ending the line that the interrupt cut short). A
    user's error (a UserError, OSError or SafetensorError) exits 1 in one line; a stdout closed
    early (`| head`) quietly, as Unix tools do. Once the command is done, these signals and Ctrl-C
    are ignored: the process is ending (a caller in Python that goes on sets its own handlers
    again)."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.default_int_handler)
    try:
        command(argv)
        # Done: ignored from here on, where a signal would interrupt the interpreter's exit (its
        # threads' and torch's clean-up) with a traceback
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)
    except KeyboardInterrupt:
        newline = "\n" if sys.stderr.isatty() else ""
        print(f"{newline}{interrupted}", file=sys.stderr)
        sys.exit(130)
    # A user's errors: a bad input, a file, a full disk. Anything else is a bug: a traceback.
    except (UserError, OSError, SafetensorError) as error:
        # Nothing more to stdout: a full or closed one fails again at exit's flush. Open until the
        # exit.
        sys.stdout = open(os.devnull, "w")
        if isinstance(error, BrokenPipeError):
            sys.exit(141)
        # Under torchrun every rank reads the same flags and files: rank 0 alone says what is
        # wrong with them. Anything else (a traceback) is printed by the rank where it happens.
        if os.environ.get("RANK", "0") != "0":
            sys.exit(1)
        sys.exit(f"error: {error}")


def main(argv=None):
    run_command(convert_command, argv, "interrupted: nothing was written")


def convert_command(argv) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint-dir", required=True,
                        help="a Hugging Face Qwen3 snapshot (config.json + *.safetensors)")
    parser.add_argument("--output", help="default: CHECKPOINT_DIR/converted[-QUANTIZE]")
    parser.add_argument("--quantize", choices=["int8", "int4"], help="weight-only, by quantize.py")
    parser.add_argument("--group-size", type=int, help="int4: columns a scale (default 128)")
    parser.add_argument("--shard-size-mb", type=positive, default=2048,
                        help="size of each output file")
    args = parser.parse_args(argv)
    name = f"converted-{args.quantize}" if args.quantize else "converted"
    out = os.path.join(args.checkpoint_dir, name) if args.output is None else args.output
    convert(args.checkpoint_dir, out, args.quantize, args.shard_size_mb << 20, args.group_size)
    # On stderr, as every message: stdout may be full, though the checkpoint is written
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    # As the module that quantize.py imports too: one UserError, which main catches
    import convert_hf_checkpoint
    convert_hf_checkpoint.main()
