"""Generates text with Qwen3, fast: a decode step that never syncs with the host.

    python generate.py --compile --prompt "Hello, my name is"  # checkpoints/Qwen/Qwen3-0.6B
    python generate.py --cuda-graph --prompt "Hello, my name is"  # our CUDA graphs: a fast start
    python generate.py --compile --chat --no-think --prompt "Why is the sky blue?" --prompt "Hi!"
"""
import argparse
import os
import pathlib
import re
import sys
import time
import weakref
from dataclasses import asdict, dataclass, fields, replace
from functools import partial

try:
    import torch
    from safetensors import safe_open

    from common import (ArgumentParser, UserError, checkpoint_tensors, converted_config, eos_ids,
                        list_tensors, model_args, optional, positive, read_json, read_tokenizer,
                        require, run_command, show_progress, token_ids)
    from model import Experts, Transformer
    # Optional files: quantized checkpoints, the Triton fast path (without it, or Triton,
    # PyTorch's ops run everywhere), tensor parallelism under torchrun
    qwen3_triton, tp = map(optional, ["qwen3_triton", "tp"])
# Ctrl-C while torch loads: nothing to clean up, nothing to say
except KeyboardInterrupt:
    sys.exit(130)


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 is greedy
    top_k: int = 0  # 0 keeps every token
    top_p: float = 1.0  # 1 keeps every token

    def __post_init__(self):
        # Each a number of its kind (a bool is none), then in its range; nan fails every comparison
        temperature, top_k, top_p = self.temperature, self.top_k, self.top_p
        # Below 0.001, logits / temperature overflows fp32 (and would be greedy anyway)
        fits = type(temperature) in (int, float) and (temperature == 0 or 1e-3 <= temperature < 1e6)
        require(fits, f"temperature {temperature!r}: must be 0 (greedy) or in [0.001, 1e6)")
        check_count("top_k", top_k, least=0)
        fits = type(top_p) in (int, float) and 0 < top_p <= 1
        require(fits, f"top_p {top_p!r}: must be in (0, 1]")

    @classmethod
    def from_generation_config(cls, generation_config: dict) -> "SamplingParams":
        """A checkpoint's defaults: its generation_config.json's settings where it samples, else
        greedy."""
        do_sample = generation_config.get("do_sample", True)
        require(type(do_sample) is bool, "generation_config.json: do_sample must be true or false")
        settings = sampling_settings(generation_config) if do_sample else {}
        try:
            return cls(**settings)
        except UserError as e:
            raise UserError(f"generation_config.json: {e}") from None


def sampling_settings(values: dict) -> dict:
    """The SamplingParams fields that `values` sets, to other than None."""
    names = [spec.name for spec in fields(SamplingParams)]
    return {name: values[name] for name in names if values.get(name) is not None}


def sample(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Next ids (R,) from logits (R, V), without a host sync. Greedy at temperature 0; otherwise
    Gumbel-max: argmax(logits / T + g), with g ~ Gumbel(0, 1), is an exact draw from softmax(logits
    / T). top-k and top-p keep static shapes: the candidates come from topk (a full sort for top-p
    alone), the rest are masked out."""
    if params.temperature == 0:
        return logits.argmax(-1)
    scores = logits.float()
    vocab = scores.shape[-1]
    filtered = 0 < params.top_k < vocab or params.top_p < 1
    if filtered:
        # The candidates, largest first: no sort unless a filter needs one
        scores, candidates = top_candidates(scores, min(params.top_k or vocab, vocab))
    # As the fast path's kernel scales them
    scores = scores * (1.0 / params.temperature)
    # The smallest head whose mass reaches top_p (the first always stays)
    if params.top_p < 1:
        probs = scores.softmax(-1)
        # Masked where the mass of the candidates before it reaches top_p
        scores = scores.masked_fill(probs.cumsum(-1) - probs >= params.top_p, float("-inf"))
    # Plus Gumbel noise, -log(-log(u)) of a uniform u
    choice = (scores - torch.log(-torch.log(torch.rand_like(scores)))).argmax(-1)
    return candidates.gather(-1, choice[:, None])[:, 0] if filtered else choice


def top_candidates(scores: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `count` largest of fp32 scores (R, V) and their ids, largest first and ties in id order
    (topk alone orders ties as it likes): a topk over int64 keys that order by score, then by id."""
    bits = scores.view(torch.int32).long()
    # As the floats: negatives flipped
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    vocab = scores.shape[-1]
    # Unique: the lower id first among equal scores
    keys = ordered * vocab + (vocab - 1 - torch.arange(vocab, device=scores.device))
    top = keys.topk(count).indices
    return scores.gather(-1, top), top


class DecodeState:
    """Every tensor a prefill or decode step reads or writes besides the model's: fixed addresses,
    updated in place."""

    def __init__(self, batch: int, capacity: int, device):
        # Each row's tokens at their positions, as in the cache: its prompt (padded after its end
        # for a prefill), then each token generated, written at its position over the padding.
        self.sequences = torch.zeros(batch, capacity, dtype=torch.long, device=device)
        # The token each row feeds next, and its position
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros_like(self.tokens)
        # A prefill's positions, (R, T) at the start of this buffer: a graph captured for one
        # shape reads them at the one address it recorded, whatever position the prompts start at
        self.prompt_positions = torch.zeros_like(self.sequences)


def bucket(length: int, capacity: int) -> int:
    """One of the few lengths that the compiled and graphed steps see (a graph each): the next power
    of two from 64 to 2,048, then the next multiple of 256, within the capacity. A decode step
    attends to that prefix of the cache, so its cost follows the live length, not the capacity; a
    graphed prefill pads its prompts to it. Below 2,048 tokens doubling keeps the graphs few;
    above, a step of 256 keeps the padding's work small (see bench/RESULTS.md), at a graph per 256
    positions, each captured when first used."""
    # Above 2,048, the next multiple of 256; else the next power of two, at least 64
    step = 256 if length > 2048 else max(64, 1 << (length - 1).bit_length())
    return min(capacity, (length + step - 1) // step * step)


class CUDAGraphs:
    """Calls fn(*args) as CUDA graphs, one per shape of the arguments (None: no tensor). The
    first call with a shape runs fn for real on a side stream (the warm-up, where lazy
    initialisation and Triton's compilation happen, outside any capture), then captures it. Capture
    records kernels without running them, so it changes no tensor: the state the warm-up advanced is
    the one every later call, a replay, starts from. fn must read and write static tensors only
    (DecodeState, the caches), as the Generator's prefill_prompts and decode_one_token do."""

    def __init__(self, fn):
        self.fn = fn
        self.graphs = {}
        # One pool of intermediate buffers for every graph
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, *args: torch.Tensor | None) -> None:
        # None stands for itself
        shape = tuple(getattr(arg, "shape", arg) for arg in args)
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
    # The prompts in, each row's first token out: the time to first token
    prefill_s: float
    # Compiled or graphed decode steps that compile or capture: the first at each attended length
    warmup_s: float
    # Every other decode step
    decode_s: float
    # The tokens a row that the steps timed in decode_s made
    decode_tokens: int
    # Ctrl-C, SIGTERM or SIGHUP ended the decode loop early
    interrupted: bool = False

    def report(self, rows: list[list[int]]) -> str:
        """The line on stderr after a generation of `rows`: what came out, the time to first
        token, the decode steps that compiled or captured (timed apart), the rate."""
        made = counted(sum(map(len, rows)), "new token")
        line = f"{made} in {counted(len(rows), 'row')}. Time to first token {self.prefill_s:.3f} s"
        if self.interrupted:
            line = f"Interrupted: {line}"
        if self.warmup_s:
            line += f"; compiling or capturing decode steps {self.warmup_s:.2f} s"
        if self.decode_tokens:
            rate = self.decode_tokens / self.decode_s
            line += f"; then {rate:.1f} tok/s per row, {rate * len(rows):.1f} in all"
            line += f", over {counted(self.decode_tokens, 'token')} a row"
        return line + "."


class Generator:
    """Prefill and the decode loop for up to `batch` prompts at once, in a cache of `capacity`
    positions. use_kernels: whether the Triton fast path runs (the decode step's forward up to a
    batch of 16, the top-k draw); by default, wherever it can (CUDA, with qwen3_triton.py and
    Triton). The two steps, prefill_prompts and decode_one_token, run eagerly; or with compile,
    the decode step under torch.compile (reduce-overhead: inductor's code in its CUDA graphs); or
    with cuda_graph, both as our CUDA graphs. A subclass may give its decode step more tokens a row
    (step_tokens; speculative.py's rounds): the loop reads each check's tokens from the state."""

    def __init__(self, model: Transformer, *, batch: int, capacity: int, sampling: SamplingParams,
                 use_kernels: bool | None = None, compile: bool = False, cuda_graph: bool = False):
        require(isinstance(model, Transformer), f"model {model!r}: not a Transformer")
        check_count("batch", batch)
        check_count("capacity", capacity)
        require(isinstance(sampling, SamplingParams), f"sampling {sampling!r}: a SamplingParams")
        device = model.norm.weight.device
        require(type(compile) is type(cuda_graph) is bool, "compile, cuda_graph: True or False")
        require(not (compile and cuda_graph), "compile and cuda_graph: choose one")
        on_cuda = device.type == "cuda"
        require(on_cuda or not cuda_graph, "cuda_graph needs a CUDA device: leave out --cuda-graph")
        if use_kernels is None:  # wherever they can run
            use_kernels = qwen3_triton is not None and on_cuda
        require(qwen3_triton or not use_kernels, "use_kernels needs qwen3_triton.py and Triton")
        # Triton's interpreter runs the kernels on the CPU too (the tests use it)
        require(on_cuda or os.environ.get("TRITON_INTERPRET") == "1" or not use_kernels,
                "use_kernels needs a CUDA device")
        # On the CPU inductor compiles C++: a missing compiler is said now, not as its traceback
        if compile and not on_cuda:
            from torch._inductor import cpp_builder, exc
            try:
                cpp_builder.get_cpp_compiler()
            except exc.InvalidCxxCompiler:
                raise UserError("compile on the CPU needs g++ (or a C++ compiler in CXX)") from None
        most = model.args.max_position_embeddings
        require(capacity <= most, f"a cache of {capacity} positions is over the model's {most}: "
                "ask for fewer positions (--cache-len)")
        # One spare position, never attended: every attended prefix is then a strict slice of the
        # cache, so a compiled step's contiguity guards hold (no recompile) when it reaches the
        # capacity
        model.setup_cache(batch, capacity + 1)
        # MoE layers multiply by torch._grouped_mm where it has kernels in bf16, eager and compiled
        # (model.expert_products): the CPU, Hopper and Blackwell. On CUDA before Hopper it loops
        # over the experts reading where each one's rows end on the host, which a CUDA graph can't
        # hold.
        has_kernels = not on_cuda or torch.cuda.get_device_capability(device)[0] in (9, 10)
        for module in model.modules():
            if isinstance(module, Experts):
                module.grouped_mm = has_kernels and model.norm.weight.dtype == torch.bfloat16
        self.model, self.batch, self.capacity = model, batch, capacity
        self.state = DecodeState(batch, capacity, device)
        # The model, or where it serves, the fast path's forward of a step (of at most STEP_TOKENS
        # tokens): tokens (R, T) at positions (R, T), the attended length -> logits (R, T, V)
        self.forward_step = model
        if use_kernels and batch <= qwen3_triton.STEP_TOKENS:
            self.forward_step = partial(qwen3_triton.forward_step, model)
        # Next ids (R,) from logits (R, V): the fast path's kernel where it takes the filter, a
        # top-k of at most MAX_TOP_K (the same tokens from the same noise, to the rounding of the
        # top-p cut and of the noise's logarithms), else sample
        # Greedy: no filter; a top_k of the whole vocabulary: none either
        top_k = sampling.top_k if sampling.temperature > 0 else 0
        self.draw = partial(sample, params=sampling)
        if use_kernels and 0 < top_k <= qwen3_triton.MAX_TOP_K and top_k < model.args.vocab_size:
            self.draw = partial(qwen3_triton.sample_top_k, **asdict(sampling))
        # Compiled: the decode step under torch.compile. Graphed: both steps as our CUDA graphs,
        # the prompts padded to a few lengths, a graph each.
        self.compiled, self.graphed = compile, cuda_graph
        # The attended lengths whose decode step has compiled or captured its own, and the steps
        # that takes: our graphs capture at a length's first step; on CUDA, cudagraph trees run
        # that one as a warm-up and record at the second
        self.warmed = set()
        self.warmup_steps = 1 + (compile and on_cuda)
        # The most tokens a decode step adds to a row (speculative.py's rounds: more than one)
        self.step_tokens = 1
        # The steps as the Generator runs them: eagerly, as our CUDA graphs, or the decode step
        # compiled. A compiled prefill would take seconds to a minute to compile and save
        # milliseconds a prompt (bench/RESULTS.md), which a command's few prompts never repay.
        self.prefill_step = self.prefill_prompts
        self.decode_step = self.decode_one_token
        if cuda_graph:
            # The graphs' steps bound to a weak proxy of the Generator: bound to it, they would make
            # a reference cycle, which Python's collector frees at any allocation, inside another
            # Generator's capture too, ending that in a CUDA error. Uncycled, a Generator dropped
            # is freed at once, its graphs' memory with it.
            proxy = weakref.proxy(self)
            self.prefill_step = CUDAGraphs(partial(type(self).prefill_prompts, proxy))
            self.decode_step = CUDAGraphs(partial(type(self).decode_one_token, proxy))
        if compile:
            # torch._dynamo is imported here alone: it takes seconds
            for tensor in vars(self.state).values():
                # cudagraph trees: inputs, not copies
                torch._dynamo.mark_static_address(tensor)
            # Inductor's own random numbers differ from eager's: this makes it call eager's, so
            # that one seed gives one stream of noise in every mode. A setting of the whole
            # process: torch offers no other.
            torch._inductor.config.fallback_random = True
            # Compiling in this process: a pool of compile workers (a process per core) would
            # start even when inductor's cache has every kernel, and hold the exit for seconds
            # (bench/RESULTS.md). The decode step has few kernels to compile. Process-wide too.
            torch._inductor.config.compile_threads = 1
            self.decode_step = torch.compile(self.decode_one_token, mode="reduce-overhead",
                                             fullgraph=True)

    def prefill_prompts(self, positions: torch.Tensor, kv_len: int) -> None:
        """The prompts in state.sequences at `positions` (R, T), padded after their ends, into cache
        rows 0 ... R - 1; each row's first token drawn from the logits at its last prompt token
        (just before state.positions) into state.tokens and the row's sequence. kv_len: the prefix
        of the cache they attend to; T for prompts from position 0. Device-side only, as
        decode_one_token."""
        state = self.state
        count = positions.shape[0]
        tokens = state.sequences[:count].gather(1, positions)  # (R, T)
        # (R, 1): the last prompt token's index
        last = state.positions[:count] - positions[:, :1] - 1
        logits = self.model(tokens, positions, kv_len, logits_at=last)
        state.tokens[:count, 0] = self.draw(logits[:, -1])
        state.sequences.scatter_(1, state.positions, state.tokens)

    def decode_one_token(self, kv_positions: torch.Tensor) -> None:
        """One step for every row, device-side only: the eager, compiled and graphed modes all run
        this. kv_positions: the attended prefix of the cache (its length alone is read)."""
        state = self.state
        logits = self.forward_step(state.tokens, state.positions, len(kv_positions))
        state.tokens.copy_(self.draw(logits[:, -1])[:, None])
        state.positions.add_(1)
        state.sequences.scatter_(1, state.positions, state.tokens)

    def prefill(self, prompts: list[list[int]], start: int = 0) -> None:
        """Every prompt into its cache row at positions start ... in one forward, padded to the
        longest (to its bucket when graphed); each row's first token drawn from its
        last prompt token into the state. The padding lies after each prompt's end, where the causal
        rule hides it from every real query, and each decode step writes its own key and value over
        it before any query can read that position."""
        state = self.state
        count = len(prompts)
        length = max(map(len, prompts))
        if self.graphed:
            length = bucket(length, self.capacity - start)
        padded = [prompt + [0] * (length - len(prompt)) for prompt in prompts]
        state.sequences[:count, start:start + length] = torch.tensor(padded)
        state.positions.zero_()
        state.positions[:count, 0] = torch.tensor([start + len(prompt) for prompt in prompts])
        positions = state.prompt_positions[:count, :length]
        # To every row
        positions.copy_(self.model.key_positions[start:start + length])
        # The attended length: the bucket that holds the prompts, or from position 0 their own
        # length, where they attend causally among themselves
        self.prefill_step(positions, bucket(start + length, self.capacity) if start else length)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, max_new: int, stop_ids: set,
                 check_every: int = 16, on_tokens=None,
                 start: int = 0) -> tuple[list[list[int]], GenerationStats]:
        """Each prompt in its own cache row at its own length until every row has produced a stop
        token or max_new tokens. Returns each row's new tokens, cut before its first stop token, and
        timings. on_tokens(rows) gets the tokens so far at each check. Sampling draws from torch's
        random generator: torch.manual_seed makes the tokens reproducible, the same in every
        mode. start: the prompts' first position; the rows keep their tokens before it in the
        cache from an earlier call (a conversation's earlier turns): only the prompts are
        prefilled. Ctrl-C (KeyboardInterrupt) during the decode loop ends it: what was made is
        returned (on_tokens is not called again), stats.interrupted set."""
        # A list of 1 to `batch` lists of token ids of the model's vocabulary, none empty
        vocab = self.model.args.vocab_size
        count = len(prompts) if isinstance(prompts, list) else 0
        ids = count and all(isinstance(p, list) and p and token_ids(p, vocab) for p in prompts)
        require(1 <= count <= self.batch and ids, f"give a list of 1 to {self.batch} prompts, each "
                f"a list of token ids in [0, {vocab}), none empty")
        check_count("max_new", max_new)
        check_count("check_every", check_every)
        require(token_ids(stop_ids, vocab),
                f"stop_ids must be a set of the model's token ids, not {stop_ids!r}")
        check_count("start", start, least=0)
        require(on_tokens is None or callable(on_tokens), f"on_tokens {on_tokens!r}: a function")
        # Where the longest prompt ends
        longest = start + max(map(len, prompts))
        # The cache less what a last step may write past max_new (a round's drafts: k positions)
        usable = self.capacity - self.step_tokens + 1
        most = self.model.args.max_position_embeddings
        require(longest + max_new <= usable, f"the prompt ({counted(longest, 'token')}) + "
                f"max new tokens ({max_new}) is over the cache length ({usable}): fewer "
                f"--max-new-tokens, or a longer --cache-len (at most the model's {most})")
        stats = GenerationStats(0.0, 0.0, 0.0, 0)
        # Each check times what ran since the last one, the host waiting for the device: at the
        # first, the prefill; then decode steps, warming up at a new attended length or not. The
        # tokens a row had at the last check: none before the first.
        warming, checked = False, 0
        began = time.perf_counter()
        self.prefill(prompts, start)
        # Row 0's first new token's position: every row makes as many tokens a step
        first = start + len(prompts[0])
        while True:
            try:
                # One wait a check, for the steps queued: the tokens a row has made (a step may make
                # more than max_new); then, copied at once, every row's tokens from `start` on
                produced = min(max_new, int(self.state.positions[0, 0]) - first + 1)
                tails = self.state.sequences[:count, start:longest + produced].tolist()
                rows = [tail[len(prompt):][:produced]
                        for tail, prompt in zip(tails, prompts, strict=True)]
                # Where each row's first stop token is, or None
                ends = [next((i for i, t in enumerate(row) if t in stop_ids), None) for row in rows]
                new_tokens = [row[:end] for row, end in zip(rows, ends, strict=True)]
                # Once interrupted, not again: an on_tokens that raises at every call ends the loop
                if on_tokens and not stats.interrupted:
                    on_tokens(new_tokens)
                now = time.perf_counter()
                if checked == 0:
                    stats.prefill_s = now - began
                elif warming:
                    stats.warmup_s += now - began
                else:
                    stats.decode_s += now - began
                    stats.decode_tokens += produced - checked
                began, checked = now, produced
                if produced == max_new or None not in ends or stats.interrupted:
                    break
                # The attended prefix of the cache: the bucket that holds every position the next
                # step writes. A tensor, whose length a compiled step reads as one dynamic size
                # (one compilation for every length) and our graphs as their key.
                kv_len = bucket(longest + produced - 1 + self.step_tokens, self.capacity)
                kv_positions = self.model.key_positions[:kv_len]
                if self.compiled:
                    torch._dynamo.maybe_mark_dynamic(kv_positions, 0)
                # The steps until the next check, the bucket's end or max_new: at least one
                room = min(check_every, max_new - produced, kv_len - longest - produced + 1)
                steps = max(1, room // self.step_tokens)
                # The first steps at a new length compile or capture its own: timed apart
                warming = (self.compiled or self.graphed) and kv_len not in self.warmed
                if warming:
                    steps = min(steps, self.warmup_steps)
                    self.warmed.add(kv_len)
                for _ in range(steps):
                    self.decode_step(kv_positions)
            except KeyboardInterrupt:
                # The rows are read once more, then returned
                stats.interrupted = True
        return new_tokens, stats


def check_count(name: str, value, least: int = 1) -> None:
    """An argument that counts something: an int of at least `least`."""
    if type(value) is not int or value < least:
        raise UserError(f"{name} must be an int of at least {least}, not {value!r}")


class Tokenizer:
    """The checkpoint's tokenizer.json (Qwen3 adds no BOS), for a model of `vocab_size` ids, and its
    chat template: chat_template.jinja, or tokenizer_config.json's chat_template."""

    def __init__(self, path: str, vocab_size: int):
        check_count("vocab_size", vocab_size)
        self.tokenizer = read_tokenizer(path)
        self.vocab_size = vocab_size
        # A model pads its tokenizer's ids (Qwen3: 151,669 of 151,936), never by a thousand
        size = self.tokenizer.get_vocab_size()
        require(size <= vocab_size < size + 1000, f"{path}: tokenizer.json of {size} tokens for a "
                f"model of {vocab_size}: another model's")
        config_file = pathlib.Path(path, "tokenizer_config.json")
        config = read_json(config_file) if config_file.is_file() else {}
        self.chat_template = config.get("chat_template")
        # Hugging Face's list of named templates, [{"name": ..., "template": ...}]: "default", the
        # one transformers renders for messages without tools (a name as str: a list is no key)
        if isinstance(self.chat_template, list):
            named = {str(t.get("name")): t.get("template")
                     for t in self.chat_template if isinstance(t, dict)}
            self.chat_template = named.get("default")
        template_file = pathlib.Path(path, "chat_template.jinja")
        # Where newer snapshots keep it; transformers prefers it too
        if template_file.is_file():
            try:
                self.chat_template = template_file.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise UserError(f"{template_file} is not UTF-8 text") from None

    def encode(self, text: str) -> list[int]:
        try:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        # tokenizers' error for a str that can't be UTF-8 (non-UTF-8 argv), or no str at all
        except TypeError:
            raise UserError(f"{text!r} is not a str of valid UTF-8 text") from None

    def decode(self, ids: list[int]) -> str:
        require(token_ids(ids, self.vocab_size), f"{ids!r}: not token ids below {self.vocab_size}")
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def chat(self, messages: list[dict], thinking: bool = True) -> str:
        """A conversation, messages {"role": "system", "user" or "assistant", "content": text},
        rendered with the chat template and opening the assistant's reply, as transformers'
        apply_chat_template(messages, add_generation_prompt=True) renders it; thinking=False:
        enable_thinking=False."""
        require(self.chat_template, "the checkpoint has no chat template: plain prompts only")
        listed = isinstance(messages, list) and all(isinstance(m, dict) for m in messages)
        # At least one message, each a str content of a role the template knows
        texts = listed and messages and all(isinstance(m.get("content"), str) for m in messages)
        known = texts and {m.get("role") for m in messages} <= {"system", "user", "assistant"}
        require(known, f"messages {messages!r}: a list of one or more dicts, "
                "each a role (system, user or assistant) and a str content")
        require(type(thinking) is bool, f"thinking {thinking!r}: True or False")
        import jinja2.sandbox
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        # Hugging Face templates refuse what they can't render with raise_exception(message)
        env.globals["raise_exception"] = partial(require, False)
        try:
            text = env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=True, enable_thinking=thinking)
        # A template's own error, of whatever kind (1 / 0, a range too large for the sandbox...)
        except Exception as e:
            # A MemoryError says nothing: its name, then
            reason = str(e) or type(e).__name__
            raise UserError(f"the checkpoint's chat template fails: {reason}") from None
        require(text.strip(), "the chat template renders these messages as blank")
        return text


@dataclass
class Checkpoint:
    """What generation needs from a converted checkpoint directory."""
    model: Transformer
    tokenizer: Tokenizer
    # generation_config.json's defaults, else greedy
    sampling: SamplingParams
    # The end-of-sequence tokens of config.json and generation_config.json
    stop_ids: set[int]


def load_model(path: str, device="cpu", dtype: torch.dtype | None = None,
               split=None) -> Transformer:
    """The model of a converted checkpoint, on `device` in `dtype` (default: bf16 on CUDA, fp32 on
    the CPU), read straight there: a tensor at a time from its file, no second copy in host or
    device memory. A quantized checkpoint gets quantize.py's modules first. split (tp.py's
    TensorParallel): this rank's share alone, at its shapes (split.rank_args), each tensor's slice
    read (split.read), the all-reduces added (split.apply)."""
    device = device_of(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    require(dtype in (torch.bfloat16, torch.float16, torch.float32),
            f"dtype {dtype!r}: use torch.bfloat16, torch.float16 or torch.float32")
    config = converted_config(path)
    args = model_args(config)
    if split is not None:
        args = split.rank_args(args, config)
    with torch.device("meta"):
        model = Transformer(args)
        if config.get("quantization"):
            # "PATH is int8: loading it needs quantize.py" where it is missing
            quantize = optional("quantize", f"{path} is {config['quantization']}: loading it")
            quantize.swap_in(model, config)
    # Its floats in `dtype`, as the checkpoint's are cast below; quantized weights stay ints
    model.to(dtype)
    expected = {name: (t.shape, t.dtype) for name, t in checkpoint_tensors(model).items()}
    # name -> its file
    tensors = list_tensors(path, "model*.safetensors")
    state = {}
    for file in sorted(set(tensors.values())):
        # A file at a time: its pages are mapped until its last tensor is read
        with safe_open(file, "pt", device=str(device)) as opened:
            for name in opened.keys():
                if split is None:
                    tensor = opened.get_tensor(name)
                else:  # this rank's slice of it alone is read
                    tensor = split.read(name, opened.get_slice(name)).to(device)
                if tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                state[name] = tensor
                show_progress(f"loading {path}", len(state), len(tensors))
    found = {name: (t.shape, t.dtype) for name, t in state.items()}
    # A name in one of them alone, or at another shape or dtype in each
    wrong = min((name for name, _ in expected.items() ^ found.items()), default=None)
    require(not wrong, f"{path}: weights do not match config.json ({wrong}); convert again")
    # The loaded tensors themselves, no copy; every one is checked above. A tied lm_head is not
    # among them: it is the embedding again.
    model.load_state_dict(state, strict=False, assign=True)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if split is not None:
        split.apply(model)
    return model.eval().requires_grad_(False)


def load(path: str, device="cpu", dtype: torch.dtype | None = None, split=None) -> Checkpoint:
    """A converted checkpoint: its model (load_model), tokenizer, sampling defaults and stop
    tokens."""
    model = load_model(path, device, dtype, split)
    file = pathlib.Path(path, "generation_config.json")
    generation_config = read_json(file) if file.is_file() else {}
    sampling = SamplingParams.from_generation_config(generation_config)
    # Each of the vocabulary: one out of it would blame the stop ids of a user who gave none
    stop_ids = eos_ids(generation_config, file, model.args.vocab_size)
    stop_ids |= eos_ids(converted_config(path), "config.json", model.args.vocab_size)
    tokenizer = Tokenizer(path, model.args.vocab_size)
    # A stop id that decodes to nothing, no token: another model's tokenizer.json, of fewer ids
    # (the size check allows a model's padding)
    unknown = sorted(i for i in stop_ids if not tokenizer.decode([i]))
    require(not unknown, f"{path}: tokenizer.json lacks stop ids {unknown}: another model's")
    return Checkpoint(model, tokenizer, sampling, stop_ids)


class TextStream:
    """The on_tokens of generate(): streams one row's text as it grows, or prints every row at the
    end. A character split across tokens decodes to U+FFFD until its last byte arrives, so trailing
    U+FFFD is held back: what is printed is always a prefix of the final text."""

    def __init__(self, decode):
        self.decode = decode
        self.printed = ""

    def __call__(self, rows: list[list[int]]) -> None:
        if len(rows) == 1:
            self.show(self.decode(rows[0]).rstrip("\ufffd"))

    def show(self, text: str) -> None:
        print(text[len(self.printed):], end="", flush=True)
        self.printed = text

    def finish(self, rows: list[list[int]], prompts: list[str]) -> None:
        """Prints what is left of generate's `rows`: the rest of one row's text, or every row after
        its prompt."""
        if len(rows) == 1:
            self.show(self.decode(rows[0]) + "\n")
        else:
            for prompt, row in zip(prompts, rows, strict=True):
                print(f"--- {prompt}\n{self.decode(row)}")


def device_of(name) -> torch.device:
    """A device of this machine: cpu, cuda or cuda:N, named by a str or a torch.device."""
    match = re.fullmatch(r"cpu|cuda(:\d+)?", str(name))
    require(match, f"unknown device {name!r}: use cpu, cuda or cuda:N")
    require(match[0] == "cpu" or torch.cuda.is_available(),
            "there is no CUDA device here: use --device cpu")
    return torch.device(name)


def counted(number: int, noun: str) -> str:
    """'1 step', '2 steps'."""
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def parse_args(argv=None, description: str = __doc__, prompts: bool = True) -> argparse.Namespace:
    """The command line, checked. prompts=False: chat.py's, whose turns are typed: no --prompt
    or --chat."""
    parser = ArgumentParser(description=description.split("\n")[0])
    flag = parser.add_argument
    flag("--checkpoint", default="checkpoints/Qwen/Qwen3-0.6B/converted",
         help="a directory that convert_hf_checkpoint.py wrote")
    flag("--device", help="cpu, cuda or cuda:N",
         default="cuda" if torch.cuda.is_available() else "cpu")
    flag("--dtype", choices=["bfloat16", "float16", "float32"],
         help="default: bf16 on CUDA, fp32 on the CPU")
    if prompts:
        flag("--prompt", action="append", help="repeat it for a batch, a row each")
        flag("--chat", action="store_true", help="wrap each in the chat template")
        flag("--draft-checkpoint", help="speculative decoding's draft checkpoint")
        flag("--speculate-k", type=positive, help="tokens drafted a round (4)")
    flag("--system", help="the system message (generate.py: with --chat)")
    flag("--no-think", action="store_true",
         help="answer without a thinking block (generate.py: with --chat)")
    # Sampling: the checkpoint's generation_config.json by default, else greedy
    flag("--temperature", type=float, help="0 is greedy")
    flag("--top-k", type=int, help="0 keeps every token")
    flag("--top-p", type=float, help="1 keeps every token")
    flag("--seed", type=int, help="one seed, one text (in fp32, in every mode)")
    flag("--max-new-tokens", type=positive, default=200)
    flag("--stop-ids", type=int, nargs="+", default=[], help="besides eos")
    flag("--compile", action="store_true", help="torch.compile the decode step")
    flag("--cuda-graph", action="store_true",
         help="replay the prefill and decode steps as our CUDA graphs")
    flag("--check-every", type=positive, default=16, help="steps a stop check")
    flag("--cache-len", type=positive,
         help="KV cache positions (default: prompt + max new tokens; chat: 8,192)")
    args = parser.parse_args(argv)
    args.chat = not prompts or args.chat
    # The flags that replace the checkpoint's sampling defaults, checked now, before loading
    args.sampling = sampling_settings(vars(args))
    SamplingParams(**args.sampling)
    require(args.seed is None or 0 <= args.seed < 2**64,
            f"--seed {args.seed}: must be in [0, 2^64)")
    args.device = device_of(args.device)
    args.dtype = getattr(torch, args.dtype) if args.dtype else None
    require(args.chat or not (args.system or args.no_think), "--system, --no-think go with --chat")
    return args


def main(argv=None, command=None):
    """generate.py's command, or chat.py's `command`(argv): a bad input or a user's error ends in
    one line, Ctrl-C and signals in exit status 130."""
    # A stream closed from the start (`>&-`) is None: the text, or an error, would go nowhere
    if sys.stdout is None or sys.stderr is None:
        sys.exit("error: stdout or stderr is closed: give the text and the errors somewhere to go")
    # Ctrl-C outside a decode loop: loading, or chat.py's prompt
    run_command(command or run, argv, "interrupted")


def load_for(args: argparse.Namespace, split=None) -> tuple[Checkpoint, SamplingParams, set]:
    """The checkpoint of the command line's flags (under torchrun, this rank's share), its sampling
    settings as the flags change them, and its stop tokens with --stop-ids', of its vocabulary.
    With --seed, torch's random generator seeded first."""
    if args.seed is not None:
        torch.manual_seed(args.seed)
    checkpoint = load(args.checkpoint, split.device if split else args.device, args.dtype, split)
    sampling = replace(checkpoint.sampling, **args.sampling)
    vocab = checkpoint.model.args.vocab_size
    require(token_ids(args.stop_ids, vocab), f"--stop-ids: ids in [0, {vocab}), please")
    return checkpoint, sampling, checkpoint.stop_ids | set(args.stop_ids)


def run(argv) -> None:
    args = parse_args(argv)
    texts = args.prompt or []
    require(texts and all(text.strip() for text in texts), "empty prompt: give --prompt TEXT")
    require(args.draft_checkpoint or not args.speculate_k, "--speculate-k needs --draft-checkpoint")
    # torchrun: this process is one rank of the model
    split = tp.start(args.device) if tp and tp.launched() else None
    # Under torchrun, rank 0 alone says what happens
    talks = split is None or split.rank == 0
    if talks and not sys.stderr.isatty():
        # A terminal gets a progress line instead
        print(f"loading {args.checkpoint} ...", file=sys.stderr, flush=True)
    checkpoint, sampling, stop_ids = load_for(args, split)
    if args.chat:
        system = [{"role": "system", "content": args.system}] if args.system else []
        turns = [[*system, {"role": "user", "content": text}] for text in texts]
        texts = [checkpoint.tokenizer.chat(messages, not args.no_think) for messages in turns]
    prompts = [checkpoint.tokenizer.encode(text) for text in texts]
    # A bucket's length within the model's: the decode step compiles for its cache's length, and a
    # run with another prompt or --max-new-tokens then finds it in inductor's cache
    needed = max(map(len, prompts)) + args.max_new_tokens
    capacity = args.cache_len or bucket(needed, checkpoint.model.args.max_position_embeddings)
    if args.draft_checkpoint is not None:
        speculative = optional("speculative", "--draft-checkpoint")
        gen = speculative.from_args(args, checkpoint, capacity, sampling)
    else:
        gen = Generator(checkpoint.model, batch=len(prompts), capacity=capacity, sampling=sampling,
                        compile=args.compile, cuda_graph=args.cuda_graph)
    stream = TextStream(checkpoint.tokenizer.decode)
    # Ctrl-C in the decode loop ends it: what was generated so far is returned
    rows, stats = gen.generate(prompts, max_new=args.max_new_tokens, stop_ids=stop_ids,
                               check_every=args.check_every, on_tokens=stream)
    stream.finish(rows, args.prompt)
    # No flag on a GPU: kernels launched one by one from Python, many times slower
    eager = args.device.type == "cuda" and not (args.compile or args.cuda_graph)
    hint = " Eager: --cuda-graph or --compile decode many times faster." if eager else ""
    if talks:
        print(stats.report(rows) + hint, file=sys.stderr)
    if stats.interrupted:
        sys.exit(130)


if __name__ == "__main__":
    # As the module that speculative.py imports: one Generator, one SamplingParams
    import generate
    generate.main()
    # Under torchrun a rank that succeeded ends here (tp.exit_now says why)
    tp and tp.exit_now()
