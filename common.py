"""What every command of ours shares: one-line errors, the argument parser and how a command
runs (signals, exit statuses); reading and checking checkpoints, a Hugging Face snapshot and ours
(config.json, generation_config.json, the safetensors files, tokenizer.json).

Every command of ours imports it, and it imports model.py alone of ours: no command imports
another's file for these.
"""
import argparse
import importlib
import json
import os
import signal
import sys
from dataclasses import asdict, fields
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from model import ModelArgs, Transformer


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
        # Ours, there but no module (a dangling link, a directory): not missing, broken
        ours = Path(__file__).with_name(f"{name}.py")
        broken = e.name == name and os.path.lexists(ours)
        require(not broken, f"{ours}: unreadable: mend or remove it")
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
        value = json.loads(Path(path).read_text(encoding="utf-8"))
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
    files = sorted(Path(directory).glob(pattern))
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
    for spec in fields(ModelArgs):
        name, value = spec.name, given.get(spec.name)
        if value is None and name in REQUIRED:
            raise UserError(f"config.json: {name} is missing; download or convert it again")
        if value is None:
            continue
        # NaN, infinity and numbers past any model's make no model (NaN fails the comparison)
        finite = type(value) not in (int, float) or abs(value) < LARGEST
        negative_int = type(value) is int and value < 0
        # A list's items too: layer numbers
        ints = type(value) is not list or all(type(item) is int for item in value)
        if type(value) not in CONFIG_TYPES[spec.type] or not finite or negative_int or not ints:
            raise UserError(f"config.json: {name} is {value!r}, not a valid value")
        # The bounds the model's formulas need, before from_config divides by any
        if name in POSITIVE and value <= 0:
            raise UserError(f"config.json: {name} is {value!r}; it must be above 0")
    args = ModelArgs.from_config(config)
    # Older configs' head_dim, hidden_size // num_attention_heads (a head_dim given is above 0)
    require(args.head_dim > 0, "config.json: hidden_size is under num_attention_heads")
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
    sizes = args.hidden_size * widest < 2**40 and args.num_hidden_layers < 2**12
    # Or a cache of every position (a --cache-len up to it) that no memory holds
    positions = args.max_position_embeddings < 2**24
    require(sizes and positions, "config.json: sizes far past any Qwen3's; download it again")
    return args


def token_ids(ids, vocab: int) -> bool:
    """Whether `ids` is a list, tuple or set of token ids of a vocabulary of `vocab`."""
    listed = isinstance(ids, (list, tuple, set, frozenset))
    return listed and all(type(i) is int and 0 <= i < vocab for i in ids)


def eos_ids(config: dict, file: str, vocab: int) -> set[int]:
    """The end-of-sequence tokens of a config.json or generation_config.json: one id, or a list,
    each of the model's vocabulary of `vocab`."""
    eos = config.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    # null, as no key: none, as transformers reads it
    ids = [] if eos is None else ids
    require(token_ids(ids, vocab), f"{file}: eos_token_id {eos!r} is not token ids in [0, {vocab})")
    return set(ids)


def converted_config(path) -> dict:
    """The config.json of a directory that convert_hf_checkpoint.py wrote, refused if not one."""
    named = isinstance(path, (str, os.PathLike)) and str(path).strip()
    require(named, f"{path!r} is no path: name a converted checkpoint")
    config = Path(path, "config.json")
    require(config.is_file(), f"{path}: no converted checkpoint; the converter makes one")
    config = read_json(config)
    # Every config.json the converter writes says so; an older one's interleaved gate and up rows
    ours = config.get("gate_up") == "halves"
    require(ours, f"{path} is a Hugging Face snapshot or an older conversion: convert the "
            "snapshot: convert_hf_checkpoint.py --checkpoint-dir SNAPSHOT --output NEW")
    return config


def snapshot_args(src: Path) -> tuple[ModelArgs, dict]:
    """The model of a Hugging Face snapshot, refused where it isn't one we convert, and our
    config.json for it."""
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
    # gate_up_proj's rows [gate; up], as transformers 5's (older conversions: converted_config)
    return args, dict(asdict(args), eos_token_id=eos, quantization=None, gate_up="halves")


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
    file = Path(path, "tokenizer.json")
    try:
        return tokenizers.Tokenizer.from_file(str(file))
    # The tokenizers library's own error type
    except Exception as e:
        raise UserError(f"{file}: no readable tokenizer ({e})") from None


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
