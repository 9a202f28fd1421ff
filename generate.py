"""Generates text with Qwen3, fast: a decode step that never syncs with the host, compiled and/or CUDA-graphed.

Prefill runs each prompt in its own cache row; decode steps run on the device alone, and the host looks for stop
tokens every --check-every steps with one sync.

    python generate.py --compile --prompt "Hello, my name is"
    python generate.py --compile --chat --no-think --prompt "Why is the sky blue?"
    python generate.py --dummy 8B --prompt-tokens 128 --max-new-tokens 256 --compile --num-samples 3   # benchmark
"""
import argparse, contextlib, json, os, pathlib, resource, sys, time

import torch

import kernels
from model import ModelArgs, Transformer, UserError, quantize_int8


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Next ids (R,) from logits (R, V) without a host sync. Greedy at temperature 0; otherwise Gumbel-max:
    argmax(logits/T + g) with g ~ Gumbel(0, 1) is an exact draw from softmax(logits/T). top-k and top-p keep static
    shapes: the candidates come from topk (a full sort when top_k is 0) and the filtered ones are masked to -inf."""
    if temperature == 0:
        return logits.argmax(-1)
    if kernels.ENABLED and logits.is_cuda and 0 < top_k <= 64:  # one kernel launched twice instead of ~25
        # float(): fed straight from the model's custom ops, inductor (torch 2.11) took minutes to lower this one
        seed = torch.randint(2 ** 31 - 1, (1,), device=logits.device)
        return kernels.sample(logits.float(), seed, temperature, top_k, top_p)
    logits, ids, vocab = logits.float() / temperature, None, logits.shape[-1]
    k = top_k if 0 < top_k < vocab else vocab
    if k < vocab or top_p < 1:
        logits, ids = logits.topk(k)  # sorted, largest first
        if top_p < 1:  # keep the smallest head whose mass reaches top_p (the first candidate always stays)
            probs = logits.softmax(-1)
            logits = logits.masked_fill(probs.cumsum(-1) - probs >= top_p, float("-inf"))
    choice = (logits - torch.log(-torch.log(torch.rand_like(logits)))).argmax(-1)
    return choice if ids is None else ids.gather(-1, choice[:, None])[:, 0]


class DecodeState:
    """Every tensor a decode step reads or writes besides the model's own: fixed addresses, updated in place."""

    def __init__(self, batch: int, capacity: int, device):
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)  # the token each row feeds next
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=device)  # and its position
        self.out = torch.zeros(batch, capacity, dtype=torch.long, device=device)  # every token generated so far
        self.step = torch.zeros(1, dtype=torch.long, device=device)  # column of `out` the next token goes to
        for t in self.tensors():  # lets cudagraph trees keep them as graph inputs instead of copying them
            torch._dynamo.mark_static_address(t)

    def tensors(self):
        return self.tokens, self.positions, self.out, self.step


def decode_one_token(model: Transformer, state: DecodeState, kv_positions: torch.Tensor, temperature: float,
                     top_k: int, top_p: float) -> None:
    """One step for every row, device-side only: eager, compiled and graphed modes all run this function."""
    token = sample(model(state.tokens, state.positions, kv_positions)[:, -1], temperature, top_k, top_p)
    state.tokens.copy_(token[:, None])
    state.positions.add_(1)
    state.out.index_copy_(1, state.step, token[:, None])
    state.step.add_(1)


class CUDAGraphStep:
    """Replays a decode step as a manually captured CUDA graph, one graph per attended cache length."""

    def __init__(self, step, state: DecodeState):
        self.step, self.state, self.graphs, self.pool = step, state, {}, torch.cuda.graph_pool_handle()

    def __call__(self, kv_positions: torch.Tensor) -> None:
        if kv_positions.shape[0] not in self.graphs:
            saved, rng = [t.clone() for t in self.state.tensors()], torch.cuda.get_rng_state()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture: lazy init, compilation, autotuning
                for _ in range(3):
                    self.step(kv_positions)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.step(kv_positions)
            # Warm-up advanced the state and the RNG: restore them. Its cache writes sit at positions that the
            # real steps write again before they read them.
            for t, s in zip(self.state.tensors(), saved):
                t.copy_(s)
            torch.cuda.set_rng_state(rng)
            self.graphs[kv_positions.shape[0]] = graph
        self.graphs[kv_positions.shape[0]].replay()


def attended_length(needed: int, capacity: int) -> int:
    """Attention reads a power-of-two prefix of the cache (at least 256): cost follows the live length, not the
    capacity, and a compiled or graphed step sees only a few distinct shapes."""
    return min(capacity, max(256, 1 << (needed - 1).bit_length()))


class Generator:
    def __init__(self, model: Transformer, batch: int, capacity: int, sampling: tuple, compile: bool = False,
                 cuda_graph: bool = False, compile_prefill: bool = False):
        model.setup_cache(batch, capacity)
        self.model, self.capacity, self.sampling = model, capacity, sampling
        self.state = state = DecodeState(batch, capacity, model.norm.weight.device)
        step = lambda kv_positions: decode_one_token(model, state, kv_positions, *sampling)
        if compile:  # the manual graph replaces cudagraph trees when both are asked for
            step = torch.compile(step, mode=None if cuda_graph else "reduce-overhead", fullgraph=True)
        self.step = CUDAGraphStep(step, state) if cuda_graph else step
        self.prefill_model = torch.compile(model, dynamic=True) if compile_prefill else model

    def prefill(self, tokens: list[int], row: int, start: int) -> torch.Tensor:
        """Runs one prompt through cache row `row` from position `start`; returns its first new token (1,)."""
        device, end = self.state.tokens.device, start + len(tokens)
        positions = torch.arange(start, end, device=device)[None]
        logits = self.prefill_model(torch.tensor([tokens], device=device), positions, self.model.key_positions[:end],
                                    rows=slice(row, row + 1), last_only=True)
        return sample(logits[:, -1], *self.sampling)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new: int, stop_ids: set, check_every: int = 16,
                 starts: list[int] | None = None, on_tokens=None) -> tuple[list[list[int]], dict]:
        """Each prompt in its own cache row at its own length (row b continues from position starts[b]); decodes
        until every row has produced a stop token or max_new tokens. Returns each row's new tokens, cut before
        its first stop token, and timings. on_tokens(rows) is called at each check with the tokens so far."""
        state, sync = self.state, self.state.tokens.device.type == "cuda"
        starts = starts or [0] * len(prompts)
        ends = [s + len(p) for s, p in zip(starts, prompts)]
        if max(ends) + max_new > self.capacity:
            raise UserError(f"prompt ({max(ends)} tokens) + max new tokens ({max_new}) is over the cache length "
                            f"{self.capacity}: raise --cache-len or lower --max-new-tokens")
        t0 = time.perf_counter()
        for row, (tokens, start) in enumerate(zip(prompts, starts)):
            state.tokens[row] = self.prefill(tokens, row, start)
        state.positions.copy_(torch.tensor(ends)[:, None])
        state.out[:, 0] = state.tokens[:, 0]
        state.step.fill_(1)
        if sync:
            torch.cuda.synchronize()
        t1, n, kv_read, rows = time.perf_counter(), 1, 0, [[] for _ in prompts]
        while True:
            new = state.out[:, len(rows[0]):n].tolist()  # the one sync per check
            rows = [r + x for r, x in zip(rows, new)]
            stopped = [next((i for i, t in enumerate(r) if t in stop_ids), None) for r in rows]
            if on_tokens:
                on_tokens([r[:s] for r, s in zip(rows, stopped)])
            if n == max_new or all(s is not None for s in stopped):
                break
            for _ in range(min(check_every, max_new - n)):
                kv_len = attended_length(max(ends) + n, self.capacity)  # this step feeds position ends[b] + n - 1
                kv_positions = self.model.key_positions[:kv_len]
                torch._dynamo.maybe_mark_dynamic(kv_positions, 0)  # compile once for every attended length
                self.step(kv_positions)
                n, kv_read = n + 1, kv_read + kv_len
        t2 = time.perf_counter()
        stats = {"prefill_s": t1 - t0, "decode_s": t2 - t1, "steps": n - 1, "rows": len(prompts), "kv_read": kv_read}
        return [r[:s] for r, s in zip(rows, stopped)], stats


def load_tokenizer(path: str):
    """(encode, decode) from tokenizer.json (tokenizers) or tokenizer.model (sentencepiece). Qwen3 adds no BOS."""
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        return (lambda s: tok.encode(s, add_special_tokens=False).ids,
                lambda ids: tok.decode(ids, skip_special_tokens=False))
    if os.path.isfile(os.path.join(path, "tokenizer.model")):
        import sentencepiece
        sp = sentencepiece.SentencePieceProcessor(model_file=os.path.join(path, "tokenizer.model"))
        return sp.encode, sp.decode
    raise UserError(f"{path}: no tokenizer.json or tokenizer.model")


class TextStream:
    """Prints the decoded text as it grows. A multi-byte character split across tokens decodes to U+FFFD until
    its last byte arrives, so trailing U+FFFD is held back: what is printed is always a prefix of the final text."""

    def __init__(self, decode, file=sys.stdout):
        self.decode, self.file, self.printed = decode, file, ""

    def __call__(self, rows: list[list[int]], final: bool = False) -> None:
        text = self.decode(rows[0]) if final else self.decode(rows[0]).rstrip("\ufffd")
        if len(text) > len(self.printed):
            print(text[len(self.printed):], end="", file=self.file, flush=True)
            self.printed = text


def chat_turn(user: str, system: str | None = None, no_think: bool = False) -> str:
    """One user turn in Qwen3's ChatML, opening the assistant's reply (with the empty think block for no_think)."""
    head = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    tail = "<think>\n\n</think>\n\n" if no_think else ""
    return f"{head}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{tail}"


def dummy_model(name: str, int8: bool, device, dtype) -> Transformer:
    """A named preset with random weights (benchmarks only: the text is gibberish)."""
    args = ModelArgs.from_name(name)
    with torch.device(device):
        model = Transformer(args).to(dtype)
    if int8:  # what linear() makes int8 (every Linear but a tied lm_head), as the converter does
        args.quantization, state = "int8", model.state_dict()
        for name in [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and
                     m.weight is not model.embed_tokens.weight]:
            state[name + ".weight"], scale = quantize_int8(state[name + ".weight"])
            state[name + ".scale"] = scale.to(dtype)
        model = Transformer.from_state_dict(args, state)
    return model.eval()


def weight_bytes(model: Transformer) -> int:
    """Bytes a decode step reads from the weights: all of them but the embedding table, unless lm_head is it."""
    tensors = {t.data_ptr(): t for n, t in model.state_dict().items()
               if n != "embed_tokens.weight" or model.args.tie_word_embeddings}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = ap.add_argument_group("model")
    g.add_argument("--checkpoint", default="checkpoints/Qwen/Qwen3-0.6B/converted",
                   help="a directory written by convert_hf_checkpoint.py")
    g.add_argument("--dummy", metavar="NAME", help="benchmarks: random weights of a preset (0.6B, 1.7B, ..., 32B)")
    g.add_argument("--int8", action="store_true", help="with --dummy: int8 weights (checkpoints say it themselves)")
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    g.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="default: bfloat16 on CUDA, else fp32")
    g = ap.add_argument_group("prompt")
    g.add_argument("--prompt", action="append", help="repeat it for a batch: one cache row per prompt")
    g.add_argument("--prompt-file", help="one prompt per line, decoded together as a batch")
    g.add_argument("--prompt-tokens", type=int, help="benchmarks: a synthetic prompt of this many token ids")
    g.add_argument("--batch", type=int, default=1, help="benchmarks: copies of the synthetic prompt, decoded together")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in Qwen3's chat template")
    g.add_argument("--system", help="system message for --chat")
    g.add_argument("--no-think", action="store_true", help="with --chat: answer without a thinking block")
    g.add_argument("--interactive", action="store_true", help="chat turn after turn, keeping the history in the cache")
    g = ap.add_argument_group("sampling (defaults: the checkpoint's generation_config.json, else greedy)")
    g.add_argument("--temperature", type=float, help="0 is greedy")
    g.add_argument("--top-k", type=int, help="0 keeps every token")
    g.add_argument("--top-p", type=float, help="in (0, 1]; 1 keeps every token")
    g.add_argument("--seed", type=int, help="makes sampling reproducible")
    g.add_argument("--max-new-tokens", type=int, default=200)
    g.add_argument("--stop-ids", type=int, nargs="*", default=[], help="stop tokens besides the checkpoint's eos")
    g = ap.add_argument_group("speed")
    g.add_argument("--compile", action="store_true", help="torch.compile the decode step (mode reduce-overhead)")
    g.add_argument("--cuda-graph", action="store_true", help="capture the decode step as CUDA graphs by hand")
    g.add_argument("--compile-prefill", action="store_true", help="torch.compile prefill with dynamic shapes")
    g.add_argument("--check-every", type=int, default=16, help="decode steps between stop checks (one sync each)")
    g.add_argument("--cache-len", type=int, help="KV cache positions (default: longest prompt + max new, or 8192)")
    g.add_argument("--num-samples", type=int, default=1, help="runs; above 1 the first is a warm-up, not averaged")
    g.add_argument("--profile", metavar="PATH", help="write a torch.profiler trace of the last run")
    a = ap.parse_args(argv)
    checks = [(a.temperature is not None and a.temperature < 0, "--temperature must be >= 0"),
              (a.top_p is not None and not 0 < a.top_p <= 1, "--top-p must be in (0, 1]"),
              (a.top_k is not None and a.top_k < 0, "--top-k must be >= 0"),
              (min(a.max_new_tokens, a.check_every, a.num_samples, a.batch, a.prompt_tokens or 1) < 1,
               "--max-new-tokens, --check-every, --num-samples, --batch and --prompt-tokens must be >= 1"),
              (a.cuda_graph and not (a.device.startswith("cuda") and torch.cuda.is_available()),
               "--cuda-graph needs a CUDA device"),
              (a.device.startswith("cuda") and not torch.cuda.is_available(), "no CUDA device: use --device cpu"),
              (a.int8 and not a.dummy, "--int8 goes with --dummy; quantize checkpoints with convert_hf_checkpoint.py"),
              (a.prompt_file and not os.path.isfile(a.prompt_file), f"no prompt file at {a.prompt_file}"),
              (a.interactive and (a.prompt or a.prompt_file or a.prompt_tokens or a.dummy),
               "--interactive reads its prompts from the terminal and needs a checkpoint"),
              (a.dummy and not a.prompt_tokens, "--dummy has no tokenizer: give --prompt-tokens N"),
              (a.prompt_tokens and (a.prompt or a.prompt_file or a.chat), "--prompt-tokens replaces the text prompts"),
              (a.batch != 1 and not a.prompt_tokens, "--batch goes with --prompt-tokens; for text, repeat --prompt"),
              ((a.system or a.no_think) and not (a.chat or a.interactive), "--system and --no-think go with --chat")]
    for bad, message in checks:
        if bad:
            raise UserError(message)
    return a


def main(argv=None):
    try:
        run(parse_args(argv))
    except UserError as e:
        sys.exit(f"error: {e}")
    except (KeyboardInterrupt, EOFError):
        print()


def run(a):
    if a.seed is not None:
        torch.manual_seed(a.seed)
    dtype = getattr(torch, a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32"))
    model = dummy_model(a.dummy, a.int8, a.device, dtype) if a.dummy else \
        Transformer.from_checkpoint(a.checkpoint, a.device, dtype)
    gen_path = os.path.join(a.checkpoint, "generation_config.json")
    gen_cfg = {} if a.dummy or not os.path.isfile(gen_path) else json.loads(pathlib.Path(gen_path).read_text())
    encode, decode = (None, None) if a.dummy else load_tokenizer(a.checkpoint)
    sampled = gen_cfg.get("do_sample", True)
    sampling = (a.temperature if a.temperature is not None else gen_cfg.get("temperature", 0.0) if sampled else 0.0,
                a.top_k if a.top_k is not None else gen_cfg.get("top_k", 0) if sampled else 0,
                a.top_p if a.top_p is not None else gen_cfg.get("top_p", 1.0) if sampled else 1.0)
    eos = gen_cfg.get("eos_token_id", [])
    stop_ids = set(a.stop_ids) | set(eos if isinstance(eos, list) else [eos])
    texts = list(a.prompt or []) + ([t for t in pathlib.Path(a.prompt_file).read_text().splitlines() if t.strip()]
                                    if a.prompt_file else [])
    if not (a.prompt_tokens or a.interactive) and (not texts or not all(t.strip() for t in texts)):
        raise UserError("empty prompt: give --prompt TEXT or --prompt-file FILE")
    prompts = ([torch.randint(0, 151643, (a.prompt_tokens,)).tolist()] * a.batch if a.prompt_tokens else
               [encode(chat_turn(t, a.system, a.no_think) if a.chat else t) for t in texts])  # none: --interactive
    longest = max(map(len, prompts)) if prompts else 0  # too long for the cache: Generator and generate() say so
    capacity = a.cache_len or (min(8192, model.args.max_position_embeddings) if a.interactive else
                               longest + a.max_new_tokens)
    gen = Generator(model, max(1, len(prompts)), capacity, sampling, a.compile, a.cuda_graph, a.compile_prefill)
    if a.interactive:
        return chat(gen, a, encode, decode, stop_ids)
    nbytes, runs = weight_bytes(model), []
    for i in range(a.num_samples):
        prof = torch.profiler.profile(record_shapes=True) if a.profile and i == a.num_samples - 1 else None
        stream = TextStream(decode) if decode and len(prompts) == 1 else None
        with prof or contextlib.nullcontext():
            out, stats = gen.generate(prompts, a.max_new_tokens, stop_ids, a.check_every, on_tokens=stream)
        if prof:
            prof.export_chrome_trace(a.profile)
        if stream:
            stream(out, final=True)
            print()
        elif decode:
            for text, tokens in zip(texts, out):
                print(f"--- {text}\n{decode(tokens)}")
        steps_s = stats["steps"] / stats["decode_s"] if stats["steps"] else 0.0
        peak = torch.cuda.max_memory_allocated() if a.device.startswith("cuda") else \
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        kv_bytes = 2 * model.args.num_hidden_layers * model.args.num_key_value_heads * model.args.head_dim * \
            dtype.itemsize * stats["kv_read"] * len(prompts)
        runs.append({"run": i, "warmup": a.num_samples > 1 and i == 0, "prompt_tokens": longest,
                     "new_tokens": [len(t) for t in out], "ttft_s": round(stats["prefill_s"], 4),
                     "decode_tok_s": round(steps_s, 1), "aggregate_tok_s": round(steps_s * len(prompts), 1),
                     "GB_s": round((nbytes * stats["steps"] + kv_bytes) / stats["decode_s"] / 1e9, 1)
                     if stats["steps"] else 0.0, "peak_mem_GB": round(peak / 1e9, 2)})
        print(json.dumps(runs[-1]), file=sys.stderr)
    measured = [r for r in runs if not r["warmup"]]
    mean = {k: round(sum(r[k] for r in measured) / len(measured), 4) for k in ("ttft_s", "decode_tok_s", "GB_s")}
    print(json.dumps({"summary": mean, "runs": len(measured), "weights_GB": round(nbytes / 1e9, 3),
                      "compile": a.compile, "cuda_graph": a.cuda_graph, "batch": len(prompts)}), file=sys.stderr)


def chat(gen: Generator, a, encode, decode, stop_ids: set) -> None:
    """Turn after turn in cache row 0: each turn prefills only its own tokens after the history already cached."""
    history, pending, system = 0, [], a.system
    while True:
        user = input("> ")
        if not user.strip():
            continue
        turn = pending + encode(("<|im_end|>\n" if history else "") + chat_turn(user, system, a.no_think))
        system = None
        stream = TextStream(decode)
        try:
            (reply,), _ = gen.generate([turn], a.max_new_tokens, stop_ids, a.check_every, [history], stream)
        except UserError as e:
            print(f"error: {e}; conversation ended")
            return
        stream([reply], final=True)
        print()
        # The cache holds every reply token that was fed back; the last one of a reply cut by max_new was not.
        fed = min(len(reply), a.max_new_tokens - 1)
        history, pending = history + len(turn) + fed, reply[fed:]


if __name__ == "__main__":
    main()
