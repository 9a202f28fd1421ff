"""qwen3-fast's measurements on a CUDA GPU, with random weights of the real shapes, \
built on the GPU.

    python bench/bench.py decode --size 8B --modes eager,compile,graph --peer
    python bench/bench.py decode --size 8B --quant int8
    python bench/bench.py decode --size 235B-A22B --quant int4 --modes graph  # one H200 holds it
    python bench/bench.py decode --size 8B --batch 8
    python bench/bench.py decode --size 30B-A3B --peer                  # MoE
    python bench/bench.py decode --size 0.6B --modes graph --profile   # the kernels of one
                                                                       # graphed step
    python bench/bench.py decode --size 0.6B --no-kernels              # PyTorch's ops only
    python bench/bench.py ttft --size 8B --lengths 128,2048 --modes eager,graph,compile --peer
                                                                       # first token
    python bench/bench.py ttft --size 8B --batch 8 --modes graph   # 8 prompts in one prefill,
                                                                   # and one by one
    python bench/bench.py ttft --size 8B --lengths 40 --history 3000 --modes graph  # a chat's turn
    python bench/bench.py first-text --modes graph,compile  # from the model on the GPU to the
                                                            # first text
    python bench/bench.py first-text --modes eager,graph,compile --checkpoint DIR --batch 2
                              # generate.py as typed: its wall time and first text, cold and warm
    python bench/bench.py load --checkpoint DIR     # generate.load against a plain safetensors load
    python bench/bench.py write-checkpoint --size 30B-A3B --checkpoint DIR --tokenizer-from DIR
    python bench/bench.py bandwidth                      # the decode ceiling's denominator
    python bench/bench.py step --size 8B --batch 1 --lengths 1,2,5,8,16 --history 300
                              # the fast path's step of --batch rows of T tokens, graphed
    python bench/bench.py speculate --size 8B --draft-size 0.6B --k 4 --greedy
    python bench/bench.py speculate --size 8B --draft-quant int4 --greedy  # its own int4 copy
    python bench/bench.py speculate --checkpoint TARGET --draft-checkpoint DRAFT --greedy
                              # speculative.py's graphed rounds against plain graphed decoding

Decode tok/s comes from two generation lengths in one process, (n2 - n1) / (t2 - t1), which cancels
prefill and every fixed cost; the best of --repeats. The peer is transformers' Qwen3ForCausalLM of
the same shapes (Qwen3MoeForCausalLM for MoE presets) with a static cache and torch.compile,
greedy (do_sample=False), measured the same way in the same process. Every result is one JSON line
on stdout.
"""
import argparse
import dataclasses
import gc
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import generate as G  # noqa: E402
import common  # noqa: E402
import convert_hf_checkpoint as convert  # noqa: E402
import quantize  # noqa: E402
from model import Experts, ModelArgs, Transformer  # noqa: E402

PRESETS = {  # from the published config.json files; head_dim is 128 in all of them
    "0.6B": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "4B": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "14B": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False),
    "32B": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False),
    "30B-A3B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                    num_attention_heads=32, num_key_value_heads=4, tie_word_embeddings=False,
                    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                    norm_topk_prob=True),
    "235B-A22B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
                      num_attention_heads=64, num_key_value_heads=4, tie_word_embeddings=False,
                      num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536,
                      norm_topk_prob=True),
}
VOCAB = 151936
SAMPLED = G.SamplingParams(temperature=0.6, top_k=20, top_p=0.95)  # Qwen3's generation_config.json


def random_model(size: str, quant: str | None) -> Transformer:
    """A preset with random bf16 weights, built on the GPU in bf16 (never a float32 copy: 30B-A3B is
    61 GB); with `quant` (int8, or int4 in groups of 128), every layer quantize.py quantizes gets
    random weights straight in their stored form (never a bf16 copy: 235B-A22B's is 470 GB), and
    scales (and offsets) that give them the bf16 weights' size."""
    args = ModelArgs(**PRESETS[size], head_dim=128, vocab_size=VOCAB)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(args)
        if quant:
            quantize.swap_in(model, quantize.quantized_config({}, quant))
    model = model.to(torch.bfloat16)  # .to() leaves the int8 and packed int4 buffers as they are
    model = model.to_empty(device="cuda")
    state = model.state_dict()
    with torch.no_grad():
        for name, tensor in state.items():
            if tensor.dtype == torch.int8:
                tensor.random_(-127, 128)
            elif tensor.dtype == torch.uint8:  # two int4 weights a byte
                tensor.random_(0, 256)
            elif name.endswith("_scale"):  # of the weight `name` less _scale
                weight = state[name.removesuffix("_scale")]
                int4 = weight.dtype == torch.uint8
                # weights of about columns ** -0.5: int8's q up to 127, int4's q - 7.5 up to 7.5
                columns = weight.shape[-1] * (2 if int4 else 1)
                tensor.uniform_(0.5, 1.5).mul_(columns ** -0.5 / (7.5 if int4 else 127))
            elif name.endswith("_offset"):  # int4's w = (q - 7.5) * scale
                tensor.copy_(state[name.removesuffix("_offset") + "_scale"]).mul_(-7.5)
            elif "norm" in name:
                tensor.uniform_(0.5, 1.5)
            elif name == "embed_tokens.weight":
                tensor.normal_()
            else:
                tensor.normal_(0, tensor.shape[-1] ** -0.5)
    if args.tie_word_embeddings:  # to_empty made the tied lm_head a tensor of its own
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()


def quantized_copy(model: Transformer, mode: str) -> Transformer:
    """The model's own weights quantized as quantize.py stores them (int8, or int4 in groups of
    128), on the model's device: a draft that is the target's own quantized copy."""
    config = quantize.quantized_config(dataclasses.asdict(model.args), mode)
    tensors, _ = quantize.quantizing(config, common.checkpoint_tensors(model).items())
    with torch.device("meta"):
        copy = Transformer(model.args)
        quantize.swap_in(copy, config)
    copy.load_state_dict(dict(tensors), strict=False, assign=True)
    if model.args.tie_word_embeddings:
        copy.lm_head.weight = copy.embed_tokens.weight
    return copy.eval()


def weight_bytes(model: Transformer) -> int:
    """Bytes a one-token decode step reads from the weights: all of them but the embedding (unless
    lm_head is it), and of each MoE layer's experts the picked ones alone."""
    def size(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)
    # lm_head may be shared
    total = size({t.data_ptr(): t for t in model.state_dict().values()}.values())
    if not model.args.tie_word_embeddings:
        total -= size([model.embed_tokens.weight])
    for m in model.modules():
        if isinstance(m, Experts):
            experts = size(m.state_dict().values())
            top_k = model.args.num_experts_per_tok
            total -= experts * (1 - top_k / model.args.num_experts)
    return int(total)


def bandwidth() -> float:
    """GB/s read by a sum over 4 GiB: the rate at which a decode step can read its weights at
    best."""
    x = torch.empty(2 * 1024 ** 3, dtype=torch.bfloat16, device="cuda").normal_()
    for _ in range(3):
        x.sum(dtype=torch.float32)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        x.sum(dtype=torch.float32)
    end.record()
    torch.cuda.synchronize()
    return x.numel() * 2 * 20 / (start.elapsed_time(end) * 1e6)


def every_expert(model: Transformer, every: bool) -> None:
    """With `every`, MoE layers multiply by every expert where the kernels don't run."""
    for module in model.modules():
        if isinstance(module, Experts):
            module.grouped_mm = module.grouped_mm and not every


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def rate_from_two_lengths(run, n1: int, n2: int, repeats: int) -> list[float]:
    """(n2 - n1) / (t(n2) - t(n1)) for `run(n)`, which generates n tokens; one figure per repeat."""
    rates = []
    for _ in range(repeats):
        times = []
        for n in (n1, n2):
            torch.cuda.synchronize()
            t = time.perf_counter()
            run(n)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        rates.append((n2 - n1) / (times[1] - times[0]))
    return rates


MODES = {"eager": {}, "compile": dict(compile=True), "graph": dict(cuda_graph=True)}  # Generator's


def decode(a: argparse.Namespace, mode: str) -> dict:
    torch._dynamo.reset()
    gc.collect()  # the last mode's model, cache and graphs
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = random_model(a.size, a.quant)
    gen = G.Generator(model, batch=a.batch, capacity=a.cache,
                      sampling=G.SamplingParams() if a.greedy else SAMPLED,
                      use_kernels=not a.no_kernels, **MODES[mode])
    every_expert(model, a.every_expert)
    prompts = [torch.randint(0, VOCAB, (a.prompt,)).tolist() for _ in range(a.batch)]
    t = time.perf_counter()
    gen.generate(prompts, max_new=2, stop_ids=set())  # one decode step: compiles and captures
    first_step_s = time.perf_counter() - t
    # warms every attended length the timed runs use
    gen.generate(prompts, max_new=a.n2, stop_ids=set())
    rates = rate_from_two_lengths(lambda n: gen.generate(prompts, max_new=n, stop_ids=set()),
                                  a.n1, a.n2, a.repeats)
    best = max(rates)
    row = {"size": a.size, "mode": mode, "quant": a.quant, "batch": a.batch,
           "kernels": not a.no_kernels, "greedy": a.greedy, "decode_tok_s": round(best, 1),
           "aggregate_tok_s": round(best * a.batch, 1), "all": [round(r, 1) for r in rates],
           "weights_GB": round(weight_bytes(model) / 1e9, 3),
           "GB_s": round(best * weight_bytes(model) / 1e9, 1),
           "first_step_s": round(first_step_s, 1),
           "peak_memory_GB": round(torch.cuda.max_memory_allocated() / 1e9, 2)}
    if a.profile and mode != "eager":
        row["profile"] = profile(gen, best, a.prompt + a.n2)
    return row


def profile(gen: G.Generator, tok_s: float, needed: int) -> list:
    """The kernels of one graphed decode step, timed by torch.profiler over replays of its CUDA
    graph (us per step): their number a layer, the GB/s of the matrix-vector products (the weights'
    bytes over their time), and the gaps: the step's time at `tok_s` minus its GPU time."""
    kv_positions = gen.model.key_positions[:G.bucket(needed, gen.capacity)]
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.no_grad(), torch.profiler.profile(activities=activities) as prof:
        for _ in range(10):
            gen.decode_step(kv_positions)  # replays the step's CUDA graph
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_us = sum(e.device_time_total for e in events) / 10
    kernels = sum(e.count for e in events if e.device_time_total > 0) / 10
    top = sorted(events, key=lambda e: -e.device_time_total)[:12]
    # one token a row: _gemv; several: _rows_product
    products = [e for e in events if "_gemv" in e.key or "_rows_product" in e.key]
    gemv_us = sum(e.device_time_total for e in products) / 10
    summary = {"step_us": round(1e6 / tok_s), "gpu_us": round(gpu_us), "kernels": kernels,
               "kernels_per_layer": round(kernels / gen.model.args.num_hidden_layers, 1),
               "gemv_us": round(gemv_us),
               "gemv_GB_s": round(weight_bytes(gen.model) / gemv_us / 1e3)}
    return [summary] + [
        {"us": round(e.device_time_total / 10, 1), "count": e.count // 10, "name": e.key[:80]}
        for e in top]


def peer_model(size: str):
    import transformers
    moe = "num_experts" in PRESETS[size]
    config_class = transformers.Qwen3MoeConfig if moe else transformers.Qwen3Config
    config = config_class(**PRESETS[size], head_dim=128, vocab_size=VOCAB,
                          max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def peer_decode(a: argparse.Namespace) -> dict:
    import transformers
    model = peer_model(a.size)
    ids = torch.randint(0, VOCAB, (1, a.prompt), device="cuda")

    @torch.inference_mode()
    def run(n):
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                       cache_implementation="static")
    for _ in range(2):  # compilation, autotuning, graph capture
        run(a.n2)
    rates = rate_from_two_lengths(run, a.n1, a.n2, a.repeats)
    return {"size": a.size,
            "peer": f"transformers {transformers.__version__} static cache + compile, greedy",
            "decode_tok_s": round(max(rates), 1), "all": [round(r, 1) for r in rates]}


def step(a: argparse.Namespace) -> list:
    """The fast path's forward of a step of --batch rows of T new tokens each, T in --lengths (R x
    T at most qwen3_triton.STEP_TOKENS), after --history tokens a row: a draft's tokens checked, a
    chat's short turn, a batch. ms a step in a CUDA graph (the best of 20 replays), its ratio to
    a one-token step at the same rows, and the ceiling (every weight read once at the read
    bandwidth; MoE: the picked experts of one token, a floor)."""
    import qwen3_triton as fast
    lengths = [int(n) for n in a.lengths.split(",")]
    if a.batch * max(lengths) > fast.STEP_TOKENS or a.history + max(lengths) > a.cache:
        sys.exit(f"step: --batch x T at most {fast.STEP_TOKENS}, --history + T at most --cache")
    model = random_model(a.size, a.quant)
    model.setup_cache(a.batch, a.cache)
    ceiling_ms = weight_bytes(model) / bandwidth() / 1e6
    one_ms = step_ms(model, a.batch, 1, a.history, a.cache)
    rows = []
    for tokens_a_row in lengths:
        ms = step_ms(model, a.batch, tokens_a_row, a.history, a.cache)
        rows.append({"size": a.size, "quant": a.quant, "rows": a.batch, "tokens": tokens_a_row,
                     "history": a.history, "step_ms": round(ms, 3),
                     "to_one_token": round(ms / one_ms, 2), "ceiling_ms": round(ceiling_ms, 3)})
    return rows


def step_ms(model: Transformer, rows: int, tokens_a_row: int, history: int, cache: int) -> float:
    """ms of the fast path's forward of rows x tokens_a_row new tokens after `history` tokens a
    row, in a CUDA graph: the best of 20 replays."""
    import qwen3_triton as fast
    tokens = torch.randint(0, model.args.vocab_size, (rows, tokens_a_row), device="cuda")
    positions = history + torch.arange(tokens_a_row, device="cuda").expand(rows, -1)
    kv_len = G.bucket(history + tokens_a_row, cache)
    with torch.no_grad():
        fast.forward_step(model, tokens, positions, kv_len)  # Triton compiles
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fast.forward_step(model, tokens, positions, kv_len)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return min(times)


def speculate(a: argparse.Namespace) -> list:
    """speculative.py's rounds as CUDA graphs (a cuda_graph Speculator) against the
    target's plain graphed decoding, batch 1: tok/s from two lengths as decode's, the drafts'
    acceptance and tokens a round; and the cost model: a round's k + 1 draft steps and one verify
    step of k + 1 tokens, in plain steps, with the speedup they imply at acceptance 0.5 to 0.9
    ((1 - a^(k + 1)) / (1 - a) tokens a round; the round's own work besides the steps, its
    probabilities, acceptance and draws, is not in it: the measured rate has it). The pair: --size
    (with --quant) and --draft-size, random weights (greedy: no agreement, the overhead's worst
    case; the same size without --quant: the same weights, every draft accepted); --size and its
    own --draft-quant copy; or --checkpoint and --draft-checkpoint, a real pair, its prompt from
    torch's own source. The verify step is timed after the prompt and the middle of the timed
    tokens."""
    import inspect

    import speculative
    if not 1 <= a.k <= 15 or bool(a.checkpoint) != bool(a.draft_checkpoint):
        sys.exit("speculate: --k from 1 to 15; --checkpoint and --draft-checkpoint together")
    sampling = G.SamplingParams() if a.greedy else SAMPLED
    if a.checkpoint:
        target, draft = (G.load_model(path, "cuda") for path in (a.checkpoint, a.draft_checkpoint))
        source = inspect.getsource(torch.nn.modules.linear)
        tokenizer = G.Tokenizer(a.checkpoint, target.args.vocab_size)
        prompt = tokenizer.encode(source)[:a.prompt]
    else:
        target = random_model(a.size, a.quant)
        if a.draft_quant:
            draft = quantized_copy(target, a.draft_quant)
        else:
            draft = random_model(a.draft_size, None)
        prompt = torch.randint(0, VOCAB, (a.prompt,)).tolist()

    def generator(model: Transformer, graphed: bool) -> G.Generator:
        return G.Generator(model, batch=1, capacity=a.cache, sampling=sampling,
                           cuda_graph=graphed)

    def rate(run) -> float:
        run(a.n2)  # captures every attended length's graphs
        return max(rate_from_two_lengths(run, a.n1, a.n2, a.repeats))
    def plain_rate(model: Transformer) -> float:
        gen = generator(model, True)
        return rate(lambda n: gen.generate([prompt], max_new=n, stop_ids=set()))
    plain_tok_s = {"target": plain_rate(target), "draft": plain_rate(draft)}
    verify_ms = step_ms(target, 1, a.k + 1, a.prompt + (a.n1 + a.n2) // 2, a.cache)
    # The graphs above are of caches that a new Generator replaces: never replayed again
    spec = speculative.Speculator(target, draft, k=a.k, capacity=a.cache, sampling=sampling,
                                  cuda_graph=True)
    tok_s = rate(lambda n: spec.generate([prompt], max_new=n, stop_ids=set()))
    stats = spec.generate([prompt], max_new=a.n2, stop_ids=set())[1]
    plain_ms = 1e3 / plain_tok_s["target"]
    round_steps = ((a.k + 1) * 1e3 / plain_tok_s["draft"] + verify_ms) / plain_ms
    model_speedup = {f"{p:.1f}": round((1 - p ** (a.k + 1)) / (1 - p) / round_steps, 2)
                     for p in (0.5, 0.6, 0.7, 0.8, 0.9)}
    pair = [a.checkpoint, a.draft_checkpoint] if a.checkpoint else [a.size, a.draft_size]
    if a.draft_quant:
        pair = [a.size, f"{a.size} {a.draft_quant}"]
    return [{"pair": pair, "quant": a.quant, "k": a.k, "greedy": a.greedy,
             "plain_tok_s": round(plain_tok_s["target"], 1),
             "speculative_tok_s": round(tok_s, 1),
             "speedup": round(tok_s / plain_tok_s["target"], 2),
             "acceptance": round(stats.acceptance, 3),
             "tokens_a_round": round(stats.kept / stats.rounds, 2),
             "draft_step": round(1e3 / plain_tok_s["draft"] / plain_ms, 3),
             "verify_step": round(verify_ms / plain_ms, 3), "round_steps": round(round_steps, 2),
             "model_speedup_at": model_speedup}]


def ttft(a: argparse.Namespace) -> list:
    """Time to first token: the prefill of a prompt of each of --lengths tokens and its first token,
    best of 5 after a warm-up (which compiles and captures), for each of --modes; with --batch N, N
    prompts of 100 to 500 tokens in one prefill, beside the sum of their prefills one at a time.
    --peer: transformers' generate(max_new_tokens=1) for each length, in the same process.
    --history H: each prompt also as a chat's next turn, prefilled after H tokens already in the
    cache (generate(start=H), as Chat does), beside the prefill of the whole H + prompt."""
    model = random_model(a.size, a.quant)
    lengths = [int(n) for n in a.lengths.split(",")]
    for mode in a.modes.split(","):
        torch._dynamo.reset()
        gc.collect()
        gen = G.Generator(model, batch=a.batch, capacity=a.history + max(lengths + [500]) + 16,
                          sampling=SAMPLED, **MODES[mode])
        every_expert(model, a.every_expert)

        def best(prompts, start=0, gen=gen):
            return min(gen.generate(prompts, max_new=1, stop_ids=set(), start=start)[1].prefill_s
                       for _ in range(6)) * 1e3
        if a.batch > 1:
            prompts = [torch.randint(0, VOCAB, (int(n),)).tolist()
                       for n in torch.linspace(100, 500, a.batch)]
            emit({"size": a.size, "mode": mode, "batch": a.batch,
                  "one_prefill_ms": round(best(prompts), 1),
                  "singles_ms": round(sum(best([p]) for p in prompts), 1)})
            continue
        for n in lengths:
            prompt = torch.randint(0, VOCAB, (n,)).tolist()
            row = {"size": a.size, "mode": mode, "prompt": n, "ttft_ms": round(best([prompt]), 1)}
            if a.history:
                history = torch.randint(0, VOCAB, (a.history,)).tolist()
                gen.generate([history], max_new=1, stop_ids=set())  # now in the cache
                row.update(history=a.history,
                           after_history_ms=round(best([prompt], start=a.history), 1),
                           whole_ms=round(best([history + prompt]), 1))
            emit(row)
    if a.peer:
        del gen, model
        gc.collect()
        torch.cuda.empty_cache()
        peer = peer_model(a.size)
        for n in lengths:
            ids = torch.randint(0, VOCAB, (1, n), device="cuda")
            times = []
            for _ in range(6):
                torch.cuda.synchronize()
                t = time.perf_counter()
                with torch.inference_mode():
                    peer.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            emit({"size": a.size, "prompt": n, "peer": "transformers generate(max_new_tokens=1)",
                  "ttft_ms": round(min(times[1:]) * 1e3, 1)})
    return []


FLAGS = {"eager": [], "compile": ["--compile"], "graph": ["--cuda-graph"]}  # generate.py's


def first_text(a: argparse.Namespace) -> list:
    """Seconds to the first streamed text, for each of --modes, cold (empty inductor, Triton and
    bytecode caches, the page cache dropped where we may) then warm (the caches the cold run
    filled): from the model on the GPU (a process building a random model), and with --checkpoint
    as the user sees it, from the start of a process running generate.py to its first byte on
    stdout, and to its end (the command's wall time), with its report line. Each run is a process
    of its own: --batch prompts, --max-new tokens each."""
    if a.inner:
        model = random_model(a.size, a.quant)
        torch.cuda.synchronize()
        start = time.perf_counter()
        gen = G.Generator(model, batch=a.batch, capacity=a.cache, sampling=SAMPLED,
                          **MODES[a.modes])
        first = []

        def on_tokens(rows):
            if not first:
                first.append(time.perf_counter() - start)
        prompts = torch.randint(0, VOCAB, (a.batch, a.prompt)).tolist()
        gen.generate(prompts, max_new=a.max_new, stop_ids=set(), on_tokens=on_tokens)
        return [{"size": a.size, "mode": a.modes, "from": "model on the GPU",
                 "first_text_s": round(first[0], 2)}]
    rows = []
    for mode in a.modes.split(","):
        with tempfile.TemporaryDirectory() as caches:  # the cold run's caches, removed after
            rows += cold_and_warm(a, mode, caches)
    return rows


def cold_and_warm(a: argparse.Namespace, mode: str, caches: str) -> list:
    """first-text's two runs of `mode`, with their caches in the directory `caches`."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{caches}/inductor",
           "TRITON_CACHE_DIR": f"{caches}/triton", "PYTHONPYCACHEPREFIX": f"{caches}/pyc"}
    rows = []
    for run in ("cold", "warm"):
        dropped = run == "cold" and drop_page_cache()
        if a.checkpoint:
            command = [sys.executable, str(ROOT / "generate.py"), "--checkpoint", a.checkpoint,
                       "--max-new-tokens", str(a.max_new), "--seed", "0", *FLAGS[mode]]
            command += ["--prompt", "Hello, my name is"] * a.batch
            rows.append({"mode": mode, "run": run, "prompts": a.batch, "max_new": a.max_new,
                         "page_cache_dropped": dropped, **first_byte(command, env)})
            continue
        command = [sys.executable, __file__, "first-text", "--inner", "--size", a.size,
                   "--modes", mode, "--batch", str(a.batch), "--max-new", str(a.max_new),
                   *(["--quant", a.quant] if a.quant else [])]
        out = subprocess.run(command, env=env, capture_output=True, text=True,
                             check=True).stdout
        rows.append({**json.loads(out.strip().splitlines()[-1]), "run": run})
    return rows


def drop_page_cache() -> bool:
    """Empties the kernel's page cache (root alone may): the next load reads the disk."""
    try:
        os.sync()
        pathlib.Path("/proc/sys/vm/drop_caches").write_text("3")
        return True
    except OSError:
        return False


def first_byte(command: list, env: dict) -> dict:
    """Seconds from starting `command` to its first byte on stdout, and to its end."""
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.read(1)
    first = time.perf_counter() - start
    _, err = process.communicate()
    if process.returncode:
        raise SystemExit(err.decode())
    return {"from": "process start", "first_text_s": round(first, 2),
            "total_s": round(time.perf_counter() - start, 2),
            "report": err.decode().strip().splitlines()[-1]}


def load(a: argparse.Namespace) -> list:
    """generate.load of --checkpoint against a plain safetensors load of its files to the GPU
    (every tensor, no model), each in a process of its own, page cache warm (a first untimed read),
    with each process's peak host memory."""
    if a.inner:
        start = time.perf_counter()
        if a.modes == "plain":
            from safetensors import safe_open
            tensors = []
            for file in sorted(pathlib.Path(a.checkpoint).glob("model*.safetensors")):
                with safe_open(file, "pt", device="cuda") as opened:
                    tensors += [opened.get_tensor(name) for name in opened.keys()]
        else:
            G.load(a.checkpoint, "cuda")
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KB -> GB
        return [{"load": a.modes, "seconds": round(seconds, 2), "peak_host_GB": round(peak, 2),
                 "checkpoint": a.checkpoint}]
    rows = []
    for what in ("plain", "generate.load", "plain", "generate.load"):
        command = [sys.executable, __file__, "load", "--inner", "--modes", what,
                   "--checkpoint", a.checkpoint]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    return rows


def write_checkpoint(a: argparse.Namespace) -> list:
    """A converted checkpoint of --size with random weights at --checkpoint, written from the GPU
    (no Hugging Face snapshot to convert: 30B-A3B's would need the disk twice), with the tokenizer
    files of --tokenizer-from."""
    model = random_model(a.size, a.quant)
    tensors = common.checkpoint_tensors(model)
    config = dict(dataclasses.asdict(model.args), eos_token_id=[151645], quantization=None,
                  gate_up="halves")
    if a.quant:
        config = quantize.quantized_config(config, a.quant)
    source = pathlib.Path(a.tokenizer_from)
    convert.write_checkpoint(a.checkpoint, iter(tensors.items()), len(tensors), config, source)
    return [{"wrote": a.checkpoint, "GB": round(weight_bytes(model) / 1e9, 1)}]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["decode", "ttft", "first-text", "load", "write-checkpoint",
                                     "bandwidth", "step", "speculate"])
    ap.add_argument("--size", default="0.6B", choices=list(PRESETS))
    ap.add_argument("--modes", default="compile", help=f"comma-separated: {', '.join(MODES)}")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--cache", type=int, default=1024, help="KV cache positions")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--lengths", default="128",
                    help="ttft: comma-separated prompt lengths; step: tokens a row")
    ap.add_argument("--history", type=int, default=0,
                    help="ttft, step: tokens of a conversation already in the cache")
    ap.add_argument("--every-expert", action="store_true",
                    help="MoE: every expert on every token where the kernels don't run")
    ap.add_argument("--n1", type=int, default=64)
    ap.add_argument("--n2", type=int, default=320)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=200, help="first-text: tokens a run makes")
    ap.add_argument("--quant", choices=quantize.MODES,
                    help="weight-only, as quantize.py stores it (int4: groups of 128 columns)")
    ap.add_argument("--greedy", action="store_true",
                    help="greedy decoding, as the peer (default: sampled)")
    ap.add_argument("--no-kernels", action="store_true",
                    help="PyTorch's ops instead of qwen3_triton.py")
    ap.add_argument("--profile", action="store_true", help="graphed modes: the kernels of a step")
    ap.add_argument("--peer", action="store_true", help="transformers, in the same process")
    ap.add_argument("--checkpoint", help="first-text, load: a converted checkpoint; "
                    "write-checkpoint: where to write one")
    ap.add_argument("--tokenizer-from", help="write-checkpoint: a checkpoint's tokenizer files")
    ap.add_argument("--draft-size", default="0.6B", choices=list(PRESETS),
                    help="speculate: the draft's preset")
    ap.add_argument("--draft-checkpoint", help="speculate: with --checkpoint, a real pair")
    ap.add_argument("--k", type=int, default=4, help="speculate: tokens drafted a round")
    ap.add_argument("--draft-quant", choices=quantize.MODES,
                    help="speculate: the draft is --size's own copy, quantized")
    # first-text's and load's own processes
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.what == "bandwidth":
        rows = [{"read_GB_s": round(bandwidth(), 1), "gpu": torch.cuda.get_device_name()}]
    elif a.what == "ttft":
        rows = ttft(a)
    elif a.what == "step":
        rows = step(a)
    elif a.what == "speculate":
        rows = speculate(a)
    elif a.what == "first-text":
        rows = first_text(a)
    elif a.what == "load":
        rows = load(a)
    elif a.what == "write-checkpoint":
        rows = write_checkpoint(a)
    else:
        rows = []
        for mode in a.modes.split(","):
            print(json.dumps(decode(a, mode)), flush=True)
        gc.collect()  # the last mode's model: two 30B-A3B models don't fit one GPU
        torch.cuda.empty_cache()
        if a.peer:
            rows.append(peer_decode(a))
    for row in rows:
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
