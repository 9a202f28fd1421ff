"""Generates text with Qwen3, fast: a decode step that never syncs with the host, compiled or graphed.

    python generate.py --compile --prompt "Hello, my name is"  # the converted checkpoints/Qwen/Qwen3-0.6B
    python generate.py --cuda-graph --prompt "Hello, my name is"  # our CUDA graphs: a fast start
    python generate.py --compile --chat --no-think --prompt "Why is the sky blue?" --prompt "Hi!"  # a batch
"""
import argparse
import dataclasses
import functools
import json
import math
import os
import pathlib
import re
import sys
import time
from dataclasses import dataclass

import torch

from model import Transformer, UserError, kernels, read_json


def checked(kind, requirement: str, valid):
    """An argparse type: the text as `kind`, refused unless valid(value)."""
    def parse(text: str):
        value = kind(text)
        if not valid(value):  # nan fails every comparison
            raise argparse.ArgumentTypeError(f"must be {requirement}, not {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names it when the text isn't a number at all
    return parse


POSITIVE = checked(int, "at least 1", lambda v: v >= 1)
# Each sampling setting's check, the same for a flag and for generation_config.json. Below 0.001, logits /
# temperature overflows fp32 (and would be greedy anyway): 0 is greedy.
SAMPLING_CHECKS = {
    "temperature": checked(float, "0 (greedy) or at least 0.001", lambda v: v == 0 or 1e-3 <= v < math.inf),
    "top_k": checked(int, ">= 0", lambda v: v >= 0),
    "top_p": checked(float, "in (0, 1]", lambda v: 0 < v <= 1),
}


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 is greedy
    top_k: int = 0  # 0 keeps every token
    top_p: float = 1.0  # 1 keeps every token

    @classmethod
    def from_generation_config(cls, generation_config: dict) -> "SamplingParams":
        """A checkpoint's defaults: its generation_config.json's settings where it samples, else greedy."""
        params = cls()
        for name, check in SAMPLING_CHECKS.items():
            value = generation_config.get(name)
            if value is not None and generation_config.get("do_sample", True):
                try:  # as JSON text, a flag's check refuses strings, booleans and lists too
                    setattr(params, name, check(json.dumps(value)))
                except (ValueError, argparse.ArgumentTypeError) as e:
                    raise UserError(f"generation_config.json: {name} {value!r}: {e}") from None
        return params


def sample(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Next ids (R,) from logits (R, V) without a host sync. Greedy at temperature 0; otherwise Gumbel-max:
    argmax(logits/T + g) with g ~ Gumbel(0, 1) is an exact draw from softmax(logits/T). top-k and top-p keep
    static shapes: the candidates come from topk (a full sort for top-p alone), the rest masked out."""
    if params.temperature == 0:
        return logits.argmax(-1)
    vocab = logits.shape[-1]
    scores, ids = logits.float(), None
    if 0 < params.top_k < vocab or params.top_p < 1:  # sorted, largest first; no sort unless filtered
        scores, ids = scores.topk(min(params.top_k or vocab, vocab))
    scores = scores / params.temperature
    if params.top_p < 1:  # keep the smallest head whose mass reaches top_p (the first candidate always stays)
        probs = scores.softmax(-1)
        scores = scores.masked_fill(probs.cumsum(-1) - probs >= params.top_p, float("-inf"))
    choice = (scores - torch.log(-torch.log(torch.rand_like(scores)))).argmax(-1)
    return choice if ids is None else ids.gather(-1, choice[:, None])[:, 0]


class DecodeState:
    """Every tensor a prefill or decode step reads or writes besides the model's: fixed addresses, updated in
    place."""

    def __init__(self, batch: int, capacity: int, device):
        # Each row's tokens at their positions, as in the cache: its prompt (padded after its end for a
        # prefill), then each token generated, written at its position over the padding.
        self.sequences = torch.zeros(batch, capacity, dtype=torch.long, device=device)
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)  # the token each row feeds next
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=device)  # and its position
        for t in vars(self).values():  # cudagraph trees: inputs, not copies
            torch._dynamo.mark_static_address(t)


def prefill_prompts(model: Transformer, state: DecodeState, sampling: SamplingParams, use_kernels: bool,
                    positions: torch.Tensor, tokens: int) -> None:
    """The prompts in state.sequences, padded after their ends, into cache rows 0 ... R - 1 at `positions`
    (R, T), 0 ... T - 1 in every row; each row's first token sampled from its last real token, at its length
    in state.positions, into state.tokens and the row's sequence. Device-side only, as decode_one_token.
    `tokens`: how many of the grid's R x T tokens run, every prompt's and then padding (see
    Transformer.forward, packed)."""
    rows, length = positions.shape
    packed = None  # every token of the grid runs
    if tokens < positions.numel():  # the prompts' tokens first (True sorts first), then padding
        packed = (positions < state.positions[:rows]).flatten().argsort(descending=True, stable=True)[:tokens]
    logits = model(state.sequences[:rows, :length], positions, None, rows=slice(0, rows),
                   logits_at=state.positions[:rows] - 1, packed=packed, use_kernels=use_kernels)
    state.tokens[:rows, 0] = sample(logits[:, -1], sampling)
    state.sequences.scatter_(1, state.positions, state.tokens)


def decode_one_token(model: Transformer, state: DecodeState, sampling: SamplingParams, use_kernels: bool,
                     kv_positions: torch.Tensor) -> None:
    """One step for every row, device-side only: the eager, compiled and graphed modes all run this."""
    logits = model(state.tokens, state.positions, kv_positions, use_kernels=use_kernels)
    state.tokens.copy_(sample(logits[:, -1], sampling)[:, None])
    state.positions.add_(1)
    state.sequences.scatter_(1, state.positions, state.tokens)


def bucket(length: int, capacity: int) -> int:
    """One of the few lengths that the compiled and graphed steps see (one graph each): the next power of two
    from 64 to 2,048, then the next multiple of 256, within the capacity. A decode step attends to that prefix
    of the cache, so that its cost follows the live length, not the capacity; a graphed or compiled prefill
    pads its prompts to it, and runs the bucket of their total of tokens (see Generator.prefill). Below 2,048
    tokens a prefill costs little and doubling keeps the graphs few (six).
    Above, padding to a multiple of 2,048 would cost real work (8B, 2,049 tokens graphed: 113 ms padded to
    4,096, 63 ms to 2,304), so the step stays 256: a graph for every 256 positions, each captured once, when
    first used (about 16 ms on 0.6B). No prompt is too long for a graph."""
    step = 256 if length > 2048 else max(64, 1 << (length - 1).bit_length())
    return min(capacity, -(-length // step) * step)


class CUDAGraphs:
    """Calls fn(*args) as CUDA graphs, one per shape of the arguments (of an int: its value): the first call
    with a shape runs fn for real on a side stream (the warm-up, where lazy initialisation and Triton's
    compilation happen, outside any capture), then captures it. Capture records kernels without running
    them, so it changes no tensor: the state that the warm-up advanced is the state every later call, a
    replay, starts from. fn must read and write static tensors only (DecodeState, the caches), as
    prefill_prompts and decode_one_token do."""

    def __init__(self, fn):
        self.fn = fn
        self.graphs = {}
        self.pool = torch.cuda.graph_pool_handle()  # one pool of intermediate buffers for every graph

    def __call__(self, *args: torch.Tensor | int) -> None:
        shape = tuple(getattr(arg, "shape", arg) for arg in args)  # an int stands for itself
        if shape in self.graphs:
            self.graphs[shape].replay()
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.fn(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.fn(*args)
        self.graphs[shape] = graph


@dataclass
class GenerationStats:
    prefill_s: float  # the prompts in, each row's first token out: the time to first token
    first_step_s: float  # the first decode step, where compilation and graph capture happen
    decode_s: float  # every later decode step
    decode_steps: int  # the steps timed in decode_s (each gives every row a token)


class Generator:
    """Prefill and the decode loop for up to `batch` prompts at once, in a cache of `capacity` positions.
    use_kernels: whether the Triton kernels run where they apply (one token of one row); by default, wherever
    they can (CUDA, with kernels.py and Triton). The prefill and decode steps run eagerly; or with compile,
    under torch.compile (reduce-overhead: inductor's code in its CUDA graphs); or with cuda_graph, as our
    CUDA graphs (with compile too: inductor's code without its graphs, in ours)."""

    def __init__(self, model: Transformer, *, batch: int, capacity: int, sampling: SamplingParams,
                 use_kernels: bool | None = None, compile: bool = False, cuda_graph: bool = False):
        device = model.norm.weight.device
        if cuda_graph and device.type != "cuda":
            raise UserError("--cuda-graph needs a CUDA device: use --device cuda, or leave it out")
        if use_kernels is None:  # wherever they can run
            use_kernels = kernels is not None and device.type == "cuda"
        model.setup_cache(batch, capacity)
        self.model = model
        self.batch = batch
        self.capacity = capacity
        self.state = DecodeState(batch, capacity, device)
        self.bucketed = compile or cuda_graph  # prompts padded to a few lengths, one graph each
        if compile:
            # Inductor's own random numbers differ from eager's: this makes it call eager's, so that one seed
            # gives one stream of noise in every mode (a process-wide setting; torch has no narrower one).
            torch._inductor.config.fallback_random = True

        def accelerated(step):  # compiled and/or captured as CUDA graphs, inductor's or ours: one a shape
            if compile:
                step = torch.compile(step, mode=None if cuda_graph else "reduce-overhead", fullgraph=True)
            if cuda_graph:
                step = CUDAGraphs(step)
            return step
        self.step = accelerated(functools.partial(decode_one_token, model, self.state, sampling, use_kernels))
        self.prefill_step = accelerated(functools.partial(prefill_prompts, model, self.state, sampling,
                                                          use_kernels))

    def decode_step(self, needed: int) -> None:
        """One step for every row; the rows' positions so far fit in the first `needed` of the cache."""
        kv_positions = self.model.key_positions[:bucket(needed, self.capacity)]
        torch._dynamo.maybe_mark_dynamic(kv_positions, 0)  # compile once for every attended length
        self.step(kv_positions)

    def prefill(self, prompts: list[list[int]]) -> None:
        """Every prompt into its cache row in one forward, padded to the longest (to its bucket when compiled
        or graphed); each row's first token sampled from its last real token into the state. The padding sits
        at positions after each prompt's end, where the causal rule hides it from every real query, and each
        decode step writes its own key and value over it before any query can read that position. Of several
        prompts, their tokens alone run (and padding up to a bucket of their total): the projections and
        MLPs skip the rest of the padding (8 prompts of 100 to 500 tokens: 2,560 tokens of a 4,096 grid)."""
        state = self.state
        length = max(map(len, prompts))
        if self.bucketed:
            length = bucket(length, self.capacity)
        state.sequences[:len(prompts), :length] = torch.tensor([p + [0] * (length - len(p)) for p in prompts])
        state.positions.zero_()
        state.positions[:len(prompts), 0] = torch.tensor([len(p) for p in prompts])
        tokens = bucket(sum(map(len, prompts)), len(prompts) * length)  # the padding beyond never runs
        self.prefill_step(self.model.key_positions[:length].expand(len(prompts), -1), tokens)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, max_new: int, stop_ids: set, check_every: int = 16,
                 on_tokens=None) -> tuple[list[list[int]], GenerationStats]:
        """Each prompt in its own cache row at its own length until every row has produced a stop token or
        max_new tokens. Returns each row's new tokens, cut before its first stop token, and timings.
        on_tokens(rows) gets the tokens so far at each check. Sampling draws from torch's random generator:
        torch.manual_seed makes the tokens reproducible, the same in every mode."""
        if not 1 <= len(prompts) <= self.batch or not all(prompts):
            raise UserError(f"give 1 to {self.batch} prompts, none empty (got {len(prompts)})")
        longest = max(map(len, prompts))
        if longest + max_new > self.capacity:
            raise UserError(f"prompt ({longest} tokens) + max new tokens ({max_new}) is over the cache "
                            f"length {self.capacity}: raise --cache-len or lower --max-new-tokens")
        shortest = min(map(len, prompts))  # the checks read the sequences from there on, not the prompts
        state = self.state
        sync = torch.cuda.synchronize if state.tokens.is_cuda else (lambda: None)
        t0 = time.perf_counter()
        self.prefill(prompts)
        sync()
        t1 = time.perf_counter()
        produced = 1  # tokens per row so far
        if max_new > 1:  # the first decode step, timed alone: compilation and graph capture happen here
            self.decode_step(longest + produced)
            produced += 1
        sync()
        t2 = time.perf_counter()
        while True:
            tails = state.sequences[:len(prompts), shortest:longest + produced].tolist()  # one sync per check
            rows = [t[len(p) - shortest:][:produced] for t, p in zip(tails, prompts, strict=True)]
            stopped = [next((i for i, t in enumerate(r) if t in stop_ids), None) for r in rows]
            if on_tokens:
                on_tokens([r[:s] for r, s in zip(rows, stopped, strict=True)])
            if produced == max_new or all(s is not None for s in stopped):
                break
            for _ in range(min(check_every, max_new - produced)):
                self.decode_step(longest + produced)
                produced += 1
        stats = GenerationStats(prefill_s=t1 - t0, first_step_s=t2 - t1, decode_s=time.perf_counter() - t2,
                                decode_steps=max(produced - 2, 0))
        return [r[:s] for r, s in zip(rows, stopped, strict=True)], stats


# Qwen3's ChatML, for a checkpoint that ships no chat template of its own.
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n"
          "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


class Tokenizer:
    """The checkpoint's tokenizer.json (Qwen3 adds no BOS) and its chat template: chat_template.jinja, or
    tokenizer_config.json's chat_template, else Qwen3's ChatML."""

    def __init__(self, path: str):
        import tokenizers
        file = pathlib.Path(path, "tokenizer.json")
        try:
            self.tokenizer = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # the tokenizers library's own error type
            raise UserError(f"{file}: no readable tokenizer ({e}); copy it from the snapshot") from None
        config_file = pathlib.Path(path, "tokenizer_config.json")
        config = read_json(config_file) if config_file.is_file() else {}
        self.chat_template = config.get("chat_template") or CHATML
        template_file = pathlib.Path(path, "chat_template.jinja")
        if template_file.is_file():  # where newer snapshots keep it; transformers prefers it too
            self.chat_template = template_file.read_text(encoding="utf-8")

    def encode(self, text: str) -> list[int]:
        try:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        except TypeError:  # what tokenizers raises for a str that can't be UTF-8 (from non-UTF-8 argv)
            raise UserError(f"{text!r} is not valid UTF-8 text") from None

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def chat(self, user: str, system: str | None = None, thinking: bool = True) -> str:
        """One user turn rendered with the chat template, opening the assistant's reply, as transformers'
        apply_chat_template(add_generation_prompt=True) renders it; thinking=False: enable_thinking=False."""
        import jinja2.sandbox
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": user})
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=["jinja2.ext.loopcontrols"])
        try:
            template = env.from_string(self.chat_template)
            return template.render(messages=messages, add_generation_prompt=True, enable_thinking=thinking)
        except (jinja2.TemplateError, TypeError) as e:  # TypeError: a template that is not a string
            raise UserError(f"the checkpoint's chat template fails: {e}") from None


@dataclass
class Checkpoint:
    """What generation needs from a converted checkpoint directory."""
    model: Transformer
    tokenizer: Tokenizer
    sampling: SamplingParams  # generation_config.json's defaults, else greedy
    stop_ids: set[int]  # the end-of-sequence tokens of config.json and generation_config.json


def load(path: str, device="cpu", dtype: torch.dtype | None = None) -> Checkpoint:
    """A converted checkpoint on `device`, in `dtype` (default: bf16 on CUDA, fp32 on the CPU)."""
    if dtype is None:
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    model = Transformer.from_checkpoint(path, device, dtype)
    file = pathlib.Path(path, "generation_config.json")
    generation_config = read_json(file) if file.is_file() else {}
    eos = generation_config.get("eos_token_id", [])
    stop_ids = set(model.args.eos_token_id) | set(eos if isinstance(eos, list) else [eos])
    return Checkpoint(model=model, tokenizer=Tokenizer(path),
                      sampling=SamplingParams.from_generation_config(generation_config), stop_ids=stop_ids)


class TextStream:
    """The on_tokens of generate(): streams one row's text as it grows, or prints every row at the end. A
    character split across tokens decodes to U+FFFD until its last byte arrives, so trailing U+FFFD is held
    back: what is printed is always a prefix of the final text."""

    def __init__(self, decode, prompts: list[str], file=None):
        self.decode = decode
        self.prompts = prompts
        self.file = file or sys.stdout  # looked up now: sys.stdout may have been replaced since import
        self.rows = [[] for _ in prompts]
        self.printed = ""

    def __call__(self, rows: list[list[int]]) -> None:
        self.rows = rows
        if len(rows) == 1:
            self.show(self.decode(rows[0]).rstrip("\ufffd"))

    def show(self, text: str) -> None:
        print(text[len(self.printed):], end="", file=self.file, flush=True)
        self.printed = text

    def finish(self) -> None:
        """Prints what is left: the rest of one row's text, or every row after its prompt."""
        if len(self.rows) == 1:
            self.show(self.decode(self.rows[0]))
            print(file=self.file)
        else:
            for prompt, row in zip(self.prompts, self.rows, strict=True):
                print(f"--- {prompt}\n{self.decode(row)}", file=self.file)


def report(stats: GenerationStats, rows: list[list[int]], compiled: bool) -> str:
    """The line on stderr after a generation: what came out, the time to first token and the decode rate."""
    line = f"{sum(map(len, rows))} new tokens in {len(rows)} row{'s' if len(rows) > 1 else ''}"
    line += f". Time to first token {stats.prefill_s:.3f} s"
    if stats.first_step_s and compiled:
        line += f"; the first decode step {stats.first_step_s:.2f} s (both compile and capture their graphs)"
    if stats.decode_steps:
        rate = stats.decode_steps / stats.decode_s
        line += f"; then {rate:.1f} tok/s per row, {rate * len(rows):.1f} in all"
        line += f", over {stats.decode_steps} steps"
    return line + "."


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line, as for every other bad input
        raise UserError(message)


def parse_args(argv=None) -> argparse.Namespace:
    ap = ArgumentParser(description=__doc__.split("\n")[0])
    g = ap.add_argument_group("model")
    g.add_argument("--checkpoint", default="checkpoints/Qwen/Qwen3-0.6B/converted",
                   help="a directory that convert_hf_checkpoint.py wrote")
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda:N")
    g.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="default: bf16 on CUDA, fp32")
    g = ap.add_argument_group("prompt")
    g.add_argument("--prompt", action="append", help="repeat it for a batch: one cache row per prompt")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the checkpoint's chat template")
    g.add_argument("--system", help="system message for --chat")
    g.add_argument("--no-think", action="store_true", help="with --chat: answer without a thinking block")
    g = ap.add_argument_group("sampling (defaults: the checkpoint's generation_config.json, else greedy)")
    g.add_argument("--temperature", type=SAMPLING_CHECKS["temperature"], help="0 is greedy")
    g.add_argument("--top-k", type=SAMPLING_CHECKS["top_k"], help="0 keeps every token")
    g.add_argument("--top-p", type=SAMPLING_CHECKS["top_p"], help="1 keeps every token")
    g.add_argument("--seed", type=checked(int, "in [0, 2^64)", lambda v: 0 <= v < 1 << 64),
                   help="the same seed gives the same text, in every mode")
    g.add_argument("--max-new-tokens", type=POSITIVE, default=200)
    g.add_argument("--stop-ids", type=int, nargs="*", default=[], help="stop tokens besides the model's eos")
    g = ap.add_argument_group("speed")
    g.add_argument("--compile", action="store_true", help="torch.compile prefill and decode steps")
    g.add_argument("--cuda-graph", action="store_true",
                   help="replay prefill and decode as our CUDA graphs (with --compile: inductor's)")
    g.add_argument("--check-every", type=POSITIVE, default=16, help="decode steps between stop checks")
    g.add_argument("--cache-len", type=POSITIVE, help="KV cache positions (default: prompt + max new tokens)")
    a = ap.parse_args(argv)
    if not re.fullmatch(r"cpu|cuda(:\d+)?", a.device):
        raise UserError(f"unknown device {a.device!r}: use cpu, cuda or cuda:N")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("no CUDA device here: use --device cpu")
    a.device = torch.device(a.device)
    if (a.system or a.no_think) and not a.chat:
        raise UserError("--system and --no-think go with --chat")
    return a


def main(argv=None):
    try:
        run(parse_args(argv))
    except UserError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:  # what was generated is printed already
        sys.exit(130)
    except BrokenPipeError:  # stdout closed early (`| head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        sys.exit(141)


def run(a: argparse.Namespace) -> None:
    if a.seed is not None:
        torch.manual_seed(a.seed)
    texts = a.prompt or []
    if not (texts and all(text.strip() for text in texts)):
        raise UserError("empty prompt: give --prompt TEXT")
    print(f"loading {a.checkpoint} ...", file=sys.stderr, flush=True)
    checkpoint = load(a.checkpoint, a.device, getattr(torch, a.dtype) if a.dtype else None)
    flags = {name: getattr(a, name) for name in SAMPLING_CHECKS if getattr(a, name) is not None}
    sampling = dataclasses.replace(checkpoint.sampling, **flags)
    if a.chat:
        texts = [checkpoint.tokenizer.chat(text, a.system, thinking=not a.no_think) for text in texts]
    prompts = [checkpoint.tokenizer.encode(text) for text in texts]
    capacity = a.cache_len or max(map(len, prompts)) + a.max_new_tokens  # too long: setup_cache says so
    gen = Generator(checkpoint.model, batch=len(prompts), capacity=capacity, sampling=sampling,
                    compile=a.compile, cuda_graph=a.cuda_graph)
    stream = TextStream(checkpoint.tokenizer.decode, a.prompt)
    try:
        rows, stats = gen.generate(prompts, max_new=a.max_new_tokens,
                                   stop_ids=checkpoint.stop_ids | set(a.stop_ids), check_every=a.check_every,
                                   on_tokens=stream)
    finally:  # on Ctrl-C too: what was generated so far
        stream.finish()
    print(report(stats, rows, compiled=a.compile or a.cuda_graph), file=sys.stderr)


if __name__ == "__main__":
    main()
