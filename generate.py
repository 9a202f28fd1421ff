"""Generates text with Qwen3, fast: a compiled decode step that never syncs with the host.

    python generate.py --compile --prompt "Hello, my name is"  # the converted checkpoints/Qwen/Qwen3-0.6B
    python generate.py --compile --chat --no-think --prompt "Why is the sky blue?" --prompt "Hi!"  # a batch
"""
import argparse
import math
import pathlib
import re
import sys
import time
from dataclasses import asdict, dataclass

import torch

import kernels
from model import Transformer, UserError, read_json


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 is greedy
    top_k: int = 0  # 0 keeps every token
    top_p: float = 1.0  # 1 keeps every token


def resolve_sampling(a: argparse.Namespace, generation_config: dict) -> SamplingParams:
    """Each flag where given, else the checkpoint's generation_config.json where it samples, else greedy."""
    values = asdict(SamplingParams())
    if generation_config.get("do_sample", True):
        values.update({k: generation_config[k] for k in values if k in generation_config})
    values.update({k: getattr(a, k) for k in values if getattr(a, k) is not None})
    return SamplingParams(**values)


def sample(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Next ids (R,) from logits (R, V) without a host sync. Greedy at temperature 0; otherwise Gumbel-max:
    argmax(logits/T + g) with g ~ Gumbel(0, 1) is an exact draw from softmax(logits/T). top-k and top-p keep
    static shapes: the candidates come from topk (a full sort for top-p alone), the rest masked out."""
    if params.temperature == 0:
        return logits.argmax(-1)
    scores = logits.float() / params.temperature
    vocab = logits.shape[-1]
    if not (0 < params.top_k < vocab or params.top_p < 1):  # nothing to filter: no sort
        return (scores - torch.log(-torch.log(torch.rand_like(scores)))).argmax(-1)
    scores, ids = scores.topk(params.top_k if 0 < params.top_k < vocab else vocab)  # sorted, largest first
    if params.top_p < 1:  # keep the smallest head whose mass reaches top_p (the first candidate always stays)
        probs = scores.softmax(-1)
        scores = scores.masked_fill(probs.cumsum(-1) - probs >= params.top_p, float("-inf"))
    choice = (scores - torch.log(-torch.log(torch.rand_like(scores)))).argmax(-1)
    return ids.gather(-1, choice[:, None])[:, 0]


class DecodeState:
    """Every tensor a decode step reads or writes besides the model's: fixed addresses, updated in place."""

    def __init__(self, batch: int, capacity: int, device):
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)  # the token each row feeds next
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=device)  # and its position
        self.out = torch.zeros(batch, capacity, dtype=torch.long, device=device)  # the tokens generated
        self.step = torch.zeros(1, dtype=torch.long, device=device)  # the column of `out` the next goes to
        for t in (self.tokens, self.positions, self.out, self.step):  # cudagraph trees: inputs, not copies
            torch._dynamo.mark_static_address(t)


def decode_one_token(model: Transformer, state: DecodeState, kv_positions: torch.Tensor,
                     sampling: SamplingParams, use_kernels: bool) -> None:
    """One step for every row, device-side only: the eager and the compiled modes both run this function."""
    logits = model(state.tokens, state.positions, kv_positions, use_kernels=use_kernels)
    token = sample(logits[:, -1], sampling)
    state.tokens.copy_(token[:, None])
    state.positions.add_(1)
    state.out.index_copy_(1, state.step, token[:, None])
    state.step.add_(1)


def attended_length(needed: int, capacity: int) -> int:
    """Attention reads a power-of-two prefix of the cache (at least 256): cost follows the live length, not
    the capacity, and a compiled step sees only a few distinct shapes."""
    return min(capacity, max(256, 1 << (needed - 1).bit_length()))


@dataclass
class GenerationStats:
    prefill_s: float  # the prompts in, each row's first token out: the time to first token
    first_step_s: float  # the first decode step, where compilation and graph capture happen
    decode_s: float  # every later decode step
    decode_steps: int


class Generator:
    """Prefill and the decode loop for up to `batch` prompts at once, in a cache of `capacity` positions.
    use_kernels: the Triton kernels run wherever they apply (one token of one row) - the caller's decision."""

    def __init__(self, model: Transformer, *, batch: int, capacity: int, sampling: SamplingParams,
                 use_kernels: bool, compile: bool = False):
        model.setup_cache(batch, capacity)
        self.model = model
        self.capacity = capacity
        self.sampling = sampling
        self.use_kernels = use_kernels
        self.state = DecodeState(batch, capacity, model.norm.weight.device)

        def step(kv_positions):
            decode_one_token(model, self.state, kv_positions, sampling, use_kernels)
        if compile:  # and captured in CUDA graphs (one per attended length): a replay launches the whole step
            step = torch.compile(step, mode="reduce-overhead", fullgraph=True)
        self.step = step

    def decode_step(self, needed: int) -> None:
        """One step for every row; the rows' positions so far fit in the first `needed` of the cache."""
        kv_positions = self.model.key_positions[:attended_length(needed, self.capacity)]
        torch._dynamo.maybe_mark_dynamic(kv_positions, 0)  # compile once for every attended length
        self.step(kv_positions)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, max_new: int, stop_ids: set, check_every: int = 16,
                 on_tokens=None) -> tuple[list[list[int]], GenerationStats]:
        """Each prompt in its own cache row at its own length until every row has produced a stop token or
        max_new tokens. Returns each row's new tokens, cut before its first stop token, and timings.
        on_tokens(rows) gets the tokens so far at each check."""
        state = self.state
        ends = [len(prompt) for prompt in prompts]
        if max(ends) + max_new > self.capacity:
            raise UserError(f"prompt ({max(ends)} tokens) + max new tokens ({max_new}) is over the cache "
                            f"length {self.capacity}: raise --cache-len or lower --max-new-tokens")
        sync = torch.cuda.synchronize if state.tokens.is_cuda else (lambda: None)
        t0 = time.perf_counter()
        for row, tokens in enumerate(prompts):  # prefill, a row at a time
            positions = torch.arange(len(tokens), device=state.tokens.device)[None]
            logits = self.model(torch.tensor([tokens], device=positions.device), positions,
                                self.model.key_positions[:ends[row]], rows=slice(row, row + 1),
                                last_only=True, use_kernels=self.use_kernels)
            state.tokens[row] = sample(logits[:, -1], self.sampling)
        state.positions.copy_(torch.tensor(ends)[:, None])
        state.out[:, 0] = state.tokens[:, 0]
        state.step.fill_(1)
        sync()
        t1 = time.perf_counter()
        produced = 1  # tokens per row in state.out
        if max_new > 1:  # the first decode step, timed alone: compilation and graph capture happen here
            self.decode_step(max(ends) + produced)
            produced += 1
        sync()
        t2 = time.perf_counter()
        rows = [[] for _ in prompts]
        while True:
            new = state.out[:, len(rows[0]):produced].tolist()  # the one sync per check
            rows = [r + x for r, x in zip(rows, new, strict=True)]
            stopped = [next((i for i, t in enumerate(r) if t in stop_ids), None) for r in rows]
            if on_tokens:
                on_tokens([r[:s] for r, s in zip(rows, stopped, strict=True)])
            if produced == max_new or all(s is not None for s in stopped):
                break
            for _ in range(min(check_every, max_new - produced)):
                self.decode_step(max(ends) + produced)
                produced += 1
        stats = GenerationStats(prefill_s=t1 - t0, first_step_s=t2 - t1, decode_s=time.perf_counter() - t2,
                                decode_steps=max(produced - 2, 0))
        return [r[:s] for r, s in zip(rows, stopped, strict=True)], stats


def load_tokenizer(path: str):
    """(encode, decode) from the checkpoint's tokenizer.json; Qwen3 adds no BOS."""
    from tokenizers import Tokenizer
    file = pathlib.Path(path, "tokenizer.json")
    if not file.is_file():
        raise UserError(f"{path}: no tokenizer.json; copy it from the Hugging Face snapshot")
    tok = Tokenizer.from_file(str(file))
    return (lambda s: tok.encode(s, add_special_tokens=False).ids,
            lambda ids: tok.decode(ids, skip_special_tokens=False))


class TextStream:
    """The on_tokens of generate(): streams one row's text as it grows, or prints every row at the end. A
    character split across tokens decodes to U+FFFD until its last byte arrives, so trailing U+FFFD is held
    back: what is printed is always a prefix of the final text."""

    def __init__(self, decode, prompts: list[str], file=sys.stdout):
        self.decode = decode
        self.prompts = prompts
        self.file = file
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


def chat_turn(user: str, system: str | None = None, no_think: bool = False) -> str:
    """One user turn in Qwen3's ChatML, opening the assistant's reply (no_think: an empty think block)."""
    head = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    tail = "<think>\n\n</think>\n\n" if no_think else ""
    return f"{head}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{tail}"


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
    g.add_argument("--chat", action="store_true", help="wrap each prompt in Qwen3's chat template")
    g.add_argument("--system", help="system message for --chat")
    g.add_argument("--no-think", action="store_true", help="with --chat: answer without a thinking block")
    g = ap.add_argument_group("sampling (defaults: the checkpoint's generation_config.json, else greedy)")
    g.add_argument("--temperature", type=checked(float, ">= 0", lambda v: 0 <= v < math.inf), help="0 greedy")
    g.add_argument("--top-k", type=checked(int, ">= 0", lambda v: v >= 0), help="0 keeps every token")
    g.add_argument("--top-p", type=checked(float, "in (0, 1]", lambda v: 0 < v <= 1), help="1 keeps all")
    g.add_argument("--seed", type=int, help="makes sampling reproducible")
    g.add_argument("--max-new-tokens", type=POSITIVE, default=200)
    g.add_argument("--stop-ids", type=int, nargs="*", default=[], help="stop tokens besides the model's eos")
    g = ap.add_argument_group("speed")
    g.add_argument("--compile", action="store_true", help="torch.compile the decode step (reduce-overhead)")
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


def run(a: argparse.Namespace) -> None:
    if a.seed is not None:
        torch.manual_seed(a.seed)
    texts = a.prompt or []
    if not (texts and all(text.strip() for text in texts)):
        raise UserError("empty prompt: give --prompt TEXT")
    print(f"loading {a.checkpoint} ...", file=sys.stderr, flush=True)
    dtype = getattr(torch, a.dtype or ("bfloat16" if a.device.type == "cuda" else "float32"))
    model = Transformer.from_checkpoint(a.checkpoint, a.device, dtype)
    generation_config = {}
    if pathlib.Path(a.checkpoint, "generation_config.json").is_file():
        generation_config = read_json(pathlib.Path(a.checkpoint, "generation_config.json"))
    encode, decode = load_tokenizer(a.checkpoint)
    eos = generation_config.get("eos_token_id", [])
    stop_ids = set(a.stop_ids) | set(eos if isinstance(eos, list) else [eos])
    prompts = [encode(chat_turn(t, a.system, a.no_think) if a.chat else t) for t in texts]
    capacity = a.cache_len or max(map(len, prompts)) + a.max_new_tokens  # too long: setup_cache says so
    gen = Generator(model, batch=len(prompts), capacity=capacity,
                    sampling=resolve_sampling(a, generation_config),
                    use_kernels=kernels.AVAILABLE and a.device.type == "cuda", compile=a.compile)
    stream = TextStream(decode, texts)
    try:
        _, stats = gen.generate(prompts, max_new=a.max_new_tokens, stop_ids=stop_ids,
                                check_every=a.check_every, on_tokens=stream)
    finally:  # on Ctrl-C too: what was generated so far
        stream.finish()
    rate = stats.decode_steps / stats.decode_s if stats.decode_steps else 0.0
    print(f"{sum(map(len, stream.rows))} new tokens. Time to first token {stats.prefill_s:.3f} s; the first "
          f"decode step {stats.first_step_s:.2f} s (compilation and graph capture happen there); then "
          f"{rate:.1f} tok/s per row.", file=sys.stderr)


if __name__ == "__main__":
    main()
