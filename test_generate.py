"""Tests for qwen3-fast. transformers' Qwen3ForCausalLM and Qwen3MoeForCausalLM are the oracles.

Topics in order: model parity, cache, converter, sampling, decode modes, CLI, kernels. Tests marked
needs_cuda skip without a GPU; the kernel tests also run on the CPU in Triton's interpreter, in a
subprocess."""
import gc
import importlib
import inspect
import io
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import types
import weakref

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import common
import convert_hf_checkpoint as convert
import generate as G
import model as M
import quantize as Q
import speculative as S
from common import UserError
from model import ModelArgs
from quantize import quantize_int8

try:  # the Triton fast path: without Triton its tests run only where it is installed
    import qwen3_triton as fast
except ImportError:
    fast = None
# Triton's interpreter before 3.9 fails our gemv (a loop bound arrives as an array there): the tests
# that run the kernels in it skip with older Tritons, such as the one torch 2.11's CUDA build pins.
# CI pins triton==3.9.0 for them.
TRITON = tuple(map(int, fast.triton.__version__.split(".")[:2])) if fast else None
OLD_INTERPRETER = fast is not None and TRITON < (3, 9)

HERE = os.path.dirname(os.path.abspath(__file__))
# One thread: the tiny models gain nothing from more, and the processes started beside the tests
# (Started) get the other cores
torch.set_num_threads(1)
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
# A subprocess's limit, for a hang alone: many times what the slowest (a torchrun of 4 ranks in
# Triton's interpreter) takes on a busy 2-core machine
LIMIT = 1800
VOCAB = 512
GREEDY = G.SamplingParams()


@pytest.fixture(autouse=True)
def own_signal_handlers():
    """A command's main() run in this process (cli) sets SIGTERM's and SIGHUP's handlers and, once
    done, ignores those and Ctrl-C: pytest's are put back after each test."""
    numbers = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    handlers = {number: signal.getsignal(number) for number in numbers}
    yield
    for number, handler in handlers.items():
        signal.signal(number, handler)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every Generator compiles the same step function anew: without a reset, a run of compiling
    tests reaches dynamo's recompile limit (8), which fails with fullgraph=True."""
    torch._dynamo.reset()


def hf_checkpoint(path, *, hidden=64, heads=4, kv_heads=2, head_dim=16, layers=2, tied=False,
                  sharded=False, old_rope=False, dtype=torch.float32, seed=0, vocab=VOCAB,
                  moe=None, rope=None, intermediate=None):
    """A random Qwen3 snapshot written by transformers itself (save_pretrained); with `moe`
    (settings of Qwen3MoeConfig), a Qwen3-MoE one with 8 experts of which 2 are picked unless `moe`
    says otherwise; with `rope`, those rope_parameters. The MLP's intermediate size: 2 x hidden +
    32 unless `intermediate` says otherwise."""
    import transformers
    intermediate = intermediate or 2 * hidden + 32
    common = dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  vocab_size=vocab, max_position_embeddings=2048,
                  rope_theta=1e4 if old_rope else 1e6, rms_norm_eps=1e-6,
                  tie_word_embeddings=tied, eos_token_id=2)  # <|im_end|>, of write_tokenizer
    if rope:
        common["rope_parameters"] = rope
    torch.manual_seed(seed)
    if moe is None:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    else:
        moe = dict(num_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=hidden // 2 + 8) | moe
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**common, **moe))
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # norms start at ones: make them matter
                p.uniform_(0.5, 1.5)
            # the router: clear choices, which rounding can't flip
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 1)
    model = model.to(dtype)
    model.save_pretrained(path, max_shard_size="60KB" if sharded else "5GB")
    config = json.load(open(os.path.join(path, "config.json")))
    if old_rope:  # the layout of configs written before transformers 5: a top-level rope_theta
        config.pop("rope_parameters", None)
        config["rope_theta"] = 1e4
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    write_tokenizer(path)
    return model


QWEN3_CHAT_TEMPLATE = open(os.path.join(HERE, "testdata", "qwen3_chat_template.jinja")).read()
TOKENIZER_FILES = {}  # name -> text, built once


def write_tokenizer(path):
    """A tiny byte-level BPE tokenizer with Qwen3's chat tokens, built with the tokenizers library,
    and the files of a hub snapshot around it: tokenizer_config.json with Qwen3's chat template, and
    generation_config.json with Qwen3's sampling settings."""
    if not TOKENIZER_FILES:
        TOKENIZER_FILES.update(build_tokenizer_files())
    for name, text in TOKENIZER_FILES.items():
        with open(os.path.join(path, name), "w") as f:
            f.write(text)


def build_tokenizer_files() -> dict:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog. " * 20,
                             "user assistant system think why is the sky blue?"] * 10, trainer)
    tok.add_tokens(["<think>", "</think>"])
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    generation_config = {"do_sample": True, "eos_token_id": eos, "temperature": 0.6, "top_k": 20,
                         "top_p": 0.95}
    tokenizer_config = {"chat_template": QWEN3_CHAT_TEMPLATE, "eos_token": "<|im_end|>"}
    return {"tokenizer.json": tok.to_str(), "generation_config.json": json.dumps(generation_config),
            "tokenizer_config.json": json.dumps(tokenizer_config)}


def converted(tmp_path, **kw):
    src = str(tmp_path / "hf")
    hf = hf_checkpoint(src, **kw)
    convert.convert(src, str(tmp_path / "ours"))
    return hf, str(tmp_path / "ours")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A converted tiny checkpoint with a tokenizer, shared by the generation tests."""
    hf, path = converted(tmp_path_factory.mktemp("tiny"), tied=True)
    return path


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """A converted tiny Qwen3-MoE checkpoint, its first layer dense, with a tokenizer."""
    hf, path = converted(tmp_path_factory.mktemp("tiny_moe"), layers=3,
                         moe=dict(mlp_only_layers=[0]))
    return path


@pytest.fixture(scope="module")
def tiny_moe_int4(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint as tiny_moe, its experts 64 wide, in int4 (groups of 8)."""
    moe = dict(mlp_only_layers=[0], moe_intermediate_size=64)
    return quantized_of(tmp_path_factory.mktemp("tiny_moe_int4"), "int4", layers=3, moe=moe)


class Started:
    """A command started in a process of its own before the tests that read its result, so that it
    runs beside them; its output goes to files in `folder`, and result() waits for it."""

    def __init__(self, command: list[str], folder: pathlib.Path, env: dict):
        self.folder = folder
        with open(folder / "stdout", "w") as out, open(folder / "stderr", "w") as err:
            self.process = subprocess.Popen(command, stdout=out, stderr=err, cwd=HERE,
                                            env={**os.environ, **env})

    def result(self) -> subprocess.CompletedProcess:
        status = self.process.wait(timeout=LIMIT)
        out, err = ((self.folder / name).read_text() for name in ("stdout", "stderr"))
        return subprocess.CompletedProcess(self.process.args, status, out, err)

    def outcome(self, nodeid: str) -> tuple[str, str]:
        """A test's outcome in this pytest process (passed, failed or skipped) and its report,
        waited for: read from the lines that BesideOutcomes writes as each test ends."""
        waited = 0.0
        while waited < LIMIT:
            ended = self.process.poll() is not None  # before the read: its every line is in
            written = (self.folder / "outcomes").read_text().splitlines(keepends=True)
            # [nodeid, outcome, report] a whole line
            entries = [json.loads(line) for line in written if line.endswith("\n")]
            for entry in entries:
                if entry[0] == nodeid:
                    return entry[1], entry[2]
            if ended:
                return "failed", "not run beside: " + self.result().stdout[-3000:]
            time.sleep(0.2)
            waited += 0.2
        return "failed", f"not run beside within {LIMIT} s"


# Tests marked beside run in a second pytest process, started with the first test, on another core
# where the machine has one; this process takes each one's outcome there instead of calling it,
# waiting for it where it must. Marked: the slowest cases (compiling, processes of their own, the
# converter's memory, which writes and reads gigabytes), which this process reaches after work of
# its own as long as theirs. The second process finds the file for its outcomes in this variable.
BESIDE_OUTCOMES = "QWEN3_FAST_BESIDE_OUTCOMES"


class BesideOutcomes:
    """The second process's plugin: each test's outcome, a JSON line added as it ends."""

    def __init__(self, path: str):
        self.path = path

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":  # a setup that failed or skipped
            with open(self.path, "a") as file:
                file.write(json.dumps([report.nodeid, report.outcome, report.longreprtext]) + "\n")


# The tests that a third process runs where the machine has 4 cores or more (a GPU machine has
# many): the GPU's own
APART = ("cuda",)
# The machine's cores (None where Python can't tell: one)
CORES = os.cpu_count() or 1
# Where the machine has 8 cores or more, each of those processes' tests dealt among several
# processes: one for every 4 cores, 4 at most
SHARES = min(4, CORES // 4) if CORES >= 8 else 1


# Under pytest-xdist (-n) its workers spread the tests already: none is run beside them
XDIST = "PYTEST_XDIST_WORKER" in os.environ


def process_of(item) -> str | None:
    """The process that runs a test besides this one: "beside" for the tests marked so, "apart"
    for APART's where the machine has the cores; None: this process."""
    if XDIST:
        return None
    if item.get_closest_marker("beside"):
        return "beside"
    if CORES >= 4 and any(word in item.nodeid for word in APART):
        return "apart"
    return None


class CalledBeside:
    """This process's plugin: a test that process_of gives another process is not called here;
    its outcome is the one it had there, in `runs`."""

    def __init__(self, runs: dict[str, Started]):
        self.runs = runs  # {nodeid: the process that runs it}

    def pytest_pyfunc_call(self, pyfuncitem):
        run = self.runs.get(pyfuncitem.nodeid)
        if run is None:
            return None  # pytest calls it
        outcome, report = run.outcome(pyfuncitem.nodeid)
        if outcome == "skipped":
            pytest.skip(report)
        if outcome == "failed":
            pytest.fail(f"beside: {report}", pytrace=False)
        return True


class OnDemand(dict):
    """started's runs under pytest-xdist, where every worker sees every test: each started by the
    first test of this worker that reads it, not by every worker."""

    def __init__(self, runs: dict, starters: dict):
        super().__init__(runs)
        self.starters = starters  # {name: a function that starts it, and gives {name: Started}}

    def __missing__(self, name: str) -> Started:
        self.update(self.starters[name]())
        return self[name]


@pytest.fixture(scope="module", autouse=True)
def started(request, tmp_path_factory):
    """The slowest cases, started with the first test where they are selected (under pytest-xdist,
    by the first test of a worker that reads them: OnDemand): the tests marked beside, the kernel
    tests in Triton's interpreter, COMPILE_TWICE and the torchruns of SPLITS. They run beside this
    process's tests, on the machine's other cores, and their tests wait for
    them; any still running when the tests end are stopped."""
    outcomes = os.environ.get(BESIDE_OUTCOMES)
    if outcomes:  # the second process, running the tests marked beside
        request.config.pluginmanager.register(BesideOutcomes(outcomes))
        yield {}
        return
    names = {item.originalname for item in request.session.items}
    runs = {}
    others = {}
    for item in request.session.items:
        process = process_of(item)
        if process:
            others.setdefault(process, []).append(item.nodeid)
    called_beside = {}
    for process, nodeids in others.items():
        for share in range(SHARES):
            mine = nodeids[share::SHARES]
            if not mine:
                continue
            folder = tmp_path_factory.mktemp(f"{process}{share}")
            (folder / "outcomes").touch()
            command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *mine]
            env = {BESIDE_OUTCOMES: str(folder / "outcomes")}
            runs[f"{process}{share}"] = Started(command, folder, env)
            called_beside.update(dict.fromkeys(mine, runs[f"{process}{share}"]))
    beside = bool(others)
    if beside:
        request.config.pluginmanager.register(CalledBeside(called_beside), "called_beside")
    # Each a function that starts runs and gives them by name
    starters = {}
    if "test_kernels_in_triton_interpreter" in names and interpreter_skip_reason() is None:
        def interpreter():
            folder = tmp_path_factory.mktemp("interpreter")
            env = {"TRITON_INTERPRET": "1"}
            return {"interpreter": Started(INTERPRETER_COMMAND, folder, env)}
        starters["interpreter"] = interpreter
    if names & COMPILED_TESTS:
        def compiled():
            paths = [request.getfixturevalue(name) for name in COMPILED]
            return {"compiled": start_compiled(tmp_path_factory, paths)}
        starters["compiled"] = compiled
    if "test_tensor_parallel_ranks_equal_one_process" in names:
        def splits():
            paths = {name: request.getfixturevalue(name) for name in ("tiny", "tiny_moe")}
            moe = dict(mlp_only_layers=[0], moe_intermediate_size=64)
            for mode in ("int8", "int4"):
                paths[mode] = quantized_of(tmp_path_factory.mktemp(mode), mode, moe=moe)
            return start_splits(tmp_path_factory, paths)
        starters["split2"] = starters["split4"] = splits
    if XDIST:
        runs = OnDemand(runs, starters)
    else:
        for start in dict.fromkeys(starters.values()):
            runs.update(start())
    yield runs
    if beside:
        request.config.pluginmanager.unregister(name="called_beside")
    for run in runs.values():
        if run.process.poll() is None:
            run.process.terminate()  # torchrun passes it on to its ranks
            run.process.wait()


def load(path, slots=1, capacity=256, dtype=torch.float32, device="cpu"):
    model = G.load_model(path, device, dtype)
    model.setup_cache(slots, capacity)
    return model


def forward(model, tokens, start=0, use_kernels=False):
    """Runs tokens (list) through cache row 0 from position `start`; logits (T, vocab).
    use_kernels: one token through the fast path's forward_step instead (row 0)."""
    t = torch.tensor([tokens], device=model.norm.weight.device)
    pos = torch.arange(start, start + len(tokens), device=t.device)[None]
    kv_len = start + len(tokens)
    with torch.no_grad():
        if use_kernels:
            return fast.forward_step(model, t, pos, kv_len)[0]
        return model(t, pos, kv_len)[0]


def set_grouped_mm(model, grouped_mm):
    """Whether the model's MoE layers multiply by the picked experts alone (see
    model.expert_products)."""
    for module in model.modules():
        if isinstance(module, M.Experts):
            module.grouped_mm = grouped_mm


def grouped_mm_of(model):
    return {module.grouped_mm for module in model.modules() if isinstance(module, M.Experts)}


def generator(path, batch=1, capacity=512, sampling=GREEDY, device="cpu", dtype=torch.float32,
              **flags):
    """A Generator; flags: use_kernels (default: wherever they can run), compile, cuda_graph."""
    model = G.load_model(path, device, dtype)
    return G.Generator(model, batch=batch, capacity=capacity, sampling=sampling, **flags)


def speculator(target, draft, k, capacity=128, sampling=GREEDY, device="cpu", **flags):
    """A Speculator of two checkpoints' models in fp32; flags as generator's."""
    models = [G.load_model(path, device, torch.float32) for path in (target, draft)]
    return S.Speculator(*models, k=k, capacity=capacity, sampling=sampling, **flags)


def greedy(path, prompts, max_new=24, check_every=5, stop_ids=(), capacity=512, **kw):
    gen = generator(path, batch=len(prompts), capacity=capacity, **kw)
    return gen.generate(prompts, max_new=max_new, stop_ids=set(stop_ids),
                        check_every=check_every)[0]


def cli(*args, stdin=None, env=None, script="generate.py"):
    """A command (generate.py, or `script`: the converter, quantize.py, chat.py) run as a user runs
    it, on the CPU, in this process: its main(argv) with stdin, stdout and stderr of its own and
    `env` added to the environment; SystemExit becomes the exit status, as Python makes it (a
    message: on stderr, status 1). Tests where the process itself is the point (signals, closed
    streams, imports) start one with run_process."""
    module = importlib.import_module(script.removesuffix(".py"))
    streams = sys.stdin, sys.stdout, sys.stderr
    environment = dict(os.environ)
    out, err = io.StringIO(), io.StringIO()
    sys.stdin, sys.stdout, sys.stderr = io.StringIO(stdin or ""), out, err
    os.environ.update(env or {})
    try:
        module.main(list(args))
        status = 0
    except SystemExit as e:
        status = e.code or 0
    finally:
        sys.stdin, sys.stdout, sys.stderr = streams
        os.environ.clear()
        os.environ.update(environment)
    if isinstance(status, str):
        err.write(status + "\n")
        status = 1
    return subprocess.CompletedProcess(args, status, out.getvalue(), err.getvalue())


def run_process(script, *args, cwd=None, env=None):
    """`script` run by a new Python process, on the CPU, as a user runs it."""
    command = [sys.executable, script, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=LIMIT, cwd=cwd,
                          env={**os.environ, **(env or {})})


def with_patch(patch, script, *args, stdin=None):
    """Runs `script` (generate.py or convert_hf_checkpoint.py) as a CLI after the Python code
    `patch`: how the tests press Ctrl-C at a chosen moment."""
    code = "\n".join(["import sys", f"sys.path.insert(0, {HERE!r})",
                      f"sys.argv = [{script!r}, *{list(args)!r}]",
                      "import common, generate, convert_hf_checkpoint",
                      f"import {script.removesuffix('.py')}",
                      textwrap.dedent(patch),
                      f"{script.removesuffix('.py')}.main()"])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, input=stdin,
                          timeout=LIMIT)


# For with_patch and ctrl_c_at_the_second_check: Ctrl-C pressed while the text of the second check
# (the first decode steps) is being shown.
CTRL_C_AT_THE_SECOND_CHECK = """
    calls = []
    original = generate.TextStream.__call__
    def pressed(self, rows):
        original(self, rows)
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
    generate.TextStream.__call__ = pressed"""


def one_line_error(r, message):
    """A CLI refusal: exit 1, and one line starting with 'error:', naming the problem, last on
    stderr (after progress lines such as "loading ..."); no traceback."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert lines[-1].startswith("error: ") and message in lines[-1], r.stderr
    assert ("Traceback" not in r.stderr
            and sum(line.startswith("error") for line in lines) == 1), r.stderr


# ---------------------------------------------------------------- model parity with transformers

# tied/untied; head_dim != hidden/heads; GQA ratio 1, 2, 4; single-file and sharded; old and new
# rope
PARITY = {
    "tied-gqa1-hd24-single-newrope": dict(tied=True, heads=4, kv_heads=4, head_dim=24),
    "untied-gqa2-sharded-oldrope": dict(tied=False, heads=4, kv_heads=2, head_dim=16, sharded=True,
                                        old_rope=True),
    "untied-gqa4-hd32-sharded-newrope": dict(tied=False, heads=8, kv_heads=2, head_dim=32,
                                             sharded=True),
    "tied-gqa2-hd8-single-oldrope-3layers": dict(tied=True, heads=8, kv_heads=4, head_dim=8,
                                                 old_rope=True, layers=3),
}


@pytest.mark.parametrize("name", PARITY)
def test_parity_with_transformers_fp32(tmp_path, name):
    kw = PARITY[name]
    hf, path = converted(tmp_path, **kw)
    if kw.get("sharded"):
        assert len([f for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors")]) > 1
        assert os.path.exists(tmp_path / "hf" / "model.safetensors.index.json")
    cfg = json.load(open(tmp_path / "hf" / "config.json"))
    assert ("rope_theta" in cfg) == bool(kw.get("old_rope"))
    ours = load(path, capacity=128)
    assert ours.args.head_dim == kw["head_dim"] and ours.args.tie_word_embeddings == kw["tied"]
    assert_parity(hf, ours)


def assert_parity(hf, ours, steps=40):
    """fp32 logits within 1e-4 of transformers' and the same greedy tokens, over a prompt and
    `steps` tokens decoded one at a time through our StaticKVCache."""
    torch.manual_seed(1)
    prompt = torch.randint(0, VOCAB, (1, 12))
    worst = 0.0
    with torch.no_grad():
        out = hf(prompt, use_cache=True)
        got = forward(ours, prompt[0].tolist())
        worst = max(worst, (out.logits[0] - got).abs().max().item())
        # transformers 5.x renamed past_key_values to cache
        cache_kw = ("cache" if "cache" in inspect.signature(hf.forward).parameters
                    else "past_key_values")
        seq = prompt[0].tolist()
        for step in range(steps):
            nxt = int(got[-1].argmax())
            assert nxt == int(out.logits[0, -1].argmax()), f"greedy token differs at step {step}"
            out = hf(torch.tensor([[nxt]]), use_cache=True, **{cache_kw: getattr(out, cache_kw)})
            got = forward(ours, [nxt], start=len(seq))
            seq.append(nxt)
            worst = max(worst, (out.logits[0] - got).abs().max().item())
    assert worst <= 1e-4, worst


# norm_topk_prob on and off; every layer sparse, or dense ones by mlp_only_layers and
# decoder_sparse_step 2; GQA 2 and 4; top-1; tied. Each with the layers that are sparse.
MOE_PARITY = {
    # transformers' default: off
    "normed-all-sparse-gqa2": (dict(moe=dict(norm_topk_prob=True)), [0, 1]),
    "unnormed-mixed-gqa4": (dict(layers=4, heads=8, kv_heads=2, head_dim=8, sharded=True,
                                 moe=dict(decoder_sparse_step=2, mlp_only_layers=[3])), [1]),
    "normed-top1-mixed-tied": (dict(layers=3, tied=True,
                                    moe=dict(norm_topk_prob=True, num_experts_per_tok=1,
                                             mlp_only_layers=[1])),
                               [0, 2]),
}


@pytest.mark.parametrize("grouped_mm", [False, True], ids=["gathered-or-every", "grouped"])
@pytest.mark.parametrize("name", MOE_PARITY)
def test_moe_parity_with_transformers_fp32(tmp_path, name, grouped_mm):
    """Every form of the expert products (model.expert_products): grouped (fp32 on the CPU runs
    torch._grouped_mm eagerly, the default there); without it, a decode step's picked experts
    gathered and a prefill's every expert on every token."""
    kw, sparse = MOE_PARITY[name]
    hf, path = converted(tmp_path, **kw)
    ours = load(path, capacity=128)
    assert grouped_mm_of(ours) == {False}  # model.py alone: the forms that serve everywhere
    set_grouped_mm(ours, grouped_mm)
    assert [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")] == sparse
    assert [i for i, layer in enumerate(ours.layers) if isinstance(layer.mlp, M.MoE)] == sparse
    assert_parity(hf, ours, steps=32)


@pytest.mark.parametrize("moe", [None, {}], ids=["dense", "moe"])
def test_a_transformers_state_dict_is_our_models_tensors(tmp_path, moe):
    """model.py's tensors are transformers 5's: its model's own state dict, `model.` taken off the
    names and our fused products its tensors concatenated in its order (q, k, v; gate, up), loads
    into Transformer strictly, with no converter between, and gives its logits."""
    hf = hf_checkpoint(str(tmp_path / "hf"), moe=moe)
    state = {name.removeprefix("model."): t for name, t in hf.state_dict().items()}
    for fused, parts in convert.FUSED.items():
        for first in [name for name in state if name.endswith(f".{parts[0]}.weight")]:
            module = first.removesuffix(f"{parts[0]}.weight")
            tensors = [state.pop(f"{module}{part}.weight") for part in parts]
            state[f"{module}{fused}.weight"] = torch.cat(tensors)
    ours = M.Transformer(ModelArgs.from_config(hf.config.to_dict()))
    ours.load_state_dict(state)
    ours.setup_cache(1, 64)
    assert_parity(hf, ours, steps=8)


def test_the_generator_chooses_the_expert_products_once(tiny_moe):
    """The engine's one choice, made as it sets the model up: torch._grouped_mm in bf16, eager or
    compiled, on the CPU (and on Hopper and Blackwell:
    test_cuda_no_host_sync_inside_prefill_and_decode_steps); the other forms in fp32."""
    for compiled in (False, True):
        gen = generator(tiny_moe, dtype=torch.bfloat16, compile=compiled)
        assert grouped_mm_of(gen.model) == {True}
    assert grouped_mm_of(generator(tiny_moe).model) == {False}


@pytest.mark.parametrize("count", [3, 11], ids=["fewer-rows-than-experts", "more"])
def test_expert_products_every_form_gives_each_row_its_experts_product(count):
    """Rows sorted by expert, some experts with no rows (the first, a middle one, the last), some
    with one: grouped, gathered (no more rows than experts) and every expert on every row (more)
    give each row its own expert's product, in fp32 and bf16."""
    torch.manual_seed(0)
    experts = torch.tensor([1, 1, 1, 2, 4, 4, 5, 5, 5, 5, 6])[:count]  # of 8
    rows, weight = torch.randn(count, 24), torch.randn(8, 40, 24)
    want = torch.stack([weight[e] @ r for r, e in zip(rows, experts, strict=True)])
    for grouped_mm in (False, True):
        assert torch.allclose(M.expert_products(rows, weight, experts, grouped_mm), want, atol=1e-5)
    rows, weight = rows.bfloat16(), weight.bfloat16()
    grouped, other = (M.expert_products(rows, weight, experts, g) for g in (True, False))
    assert torch.allclose(grouped.float(), other.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("yarn", [dict(factor=4.0),
                                  dict(factor=8.0, beta_fast=16, attention_factor=1.3)])
def test_yarn_parity_with_transformers_fp32(tmp_path, yarn):
    """YaRN as Qwen3's model cards set it, on a tiny scale: logits at positions well past
    original_max_position_embeddings (32 here), prefill and decode, within 1e-4 of transformers'."""
    rope = {"rope_type": "yarn", "rope_theta": 1e6, "original_max_position_embeddings": 32, **yarn}
    hf, path = converted(tmp_path, rope=rope, heads=4, kv_heads=2, head_dim=32)
    ours = load(path, capacity=160)
    assert ours.args.yarn == {k: v for k, v in rope.items() if k not in ("rope_type", "rope_theta")}
    torch.manual_seed(3)
    prompt = torch.randint(0, VOCAB, (1, 100))
    with torch.no_grad():
        want = hf(prompt).logits[0]
        got = forward(ours, prompt[0].tolist())
        assert (want - got).abs().max().item() <= 1e-4
        assert (want[-1] - forward(ours, prompt[0, -1:].tolist(), start=99)[-1]).abs().max() <= 1e-4
    plain = load(converted(tmp_path / "plain", heads=4, kv_heads=2, head_dim=32)[1], capacity=160)
    assert not torch.allclose(ours.rope_cos, plain.rope_cos)  # YaRN really changed the rotation


@pytest.fixture(scope="module")
def tiny_yarn(tmp_path_factory):
    rope = {"rope_type": "yarn", "rope_theta": 1e6, "original_max_position_embeddings": 32,
            "factor": 4.0}
    return converted(tmp_path_factory.mktemp("yarn"), rope=rope, head_dim=32)[1]


def prompt_call(model, prompts: torch.Tensor, **options) -> torch.Tensor:
    """model(prompts, positions, kv_len=T) for prompts (R, T) at positions 0 ... T - 1: the
    causal path."""
    count, length = prompts.shape
    positions = torch.arange(length, device=prompts.device).expand(count, -1)
    return model(prompts, positions, length, **options)


def natural_calls(model, prompts: torch.Tensor, steps: int = 3, rows=None) -> list:
    """The calls a new user writes: model(prompts, positions) for prompts (R, T) from position 0,
    then model(token, positions) a token at a time, greedy. rows: run them as the rows of a bigger
    cache, which earlier calls filled with other tokens. Returns each call's last logits (R,
    vocab)."""
    count, length = prompts.shape
    out = [model(prompts, torch.arange(length).expand(count, -1))[:, -1]]
    for step in range(steps):
        token = out[-1].argmax(-1, keepdim=True)  # (R, 1)
        positions = torch.full((count, 1), length + step, device=prompts.device)
        out.append(model(token, positions)[:, -1])
    return out


@pytest.mark.parametrize("checkpoint", ["tiny", "tiny_moe", "tiny_yarn"])
def test_the_natural_decode_call_gives_the_whole_sequences_logits(checkpoint, request):
    """model(tokens, positions) after a prefill, with no other argument, attends to every cache
    position at or below its own: each step's logits are the last of a prefill of the whole sequence
    so far (fp32, 1e-5), in two rows of different lengths, in a cache that a longer earlier request
    left full of stale keys."""
    path = request.getfixturevalue(checkpoint)
    torch.manual_seed(11)
    model = load(path, slots=2, capacity=128)
    with torch.no_grad():
        prompt_call(model, torch.randint(0, VOCAB, (2, 100)))  # stale keys at positions 0 ... 99
        prompts = torch.randint(0, VOCAB, (2, 8))
        got = natural_calls(model, prompts)
        sequences = torch.cat([prompts, torch.stack(got[:-1], 1).argmax(-1)], 1)  # (2, 11)
        for step, logits in enumerate(got):
            whole = prompt_call(load(path, slots=2, capacity=128), sequences[:, :8 + step])
            assert torch.allclose(logits, whole[:, -1], atol=1e-5), step


def test_the_report_names_the_fast_flags_on_a_gpu_alone(tiny):
    """Eager on a GPU launches each kernel from Python, many times slower than either flag: its
    report says so. On the CPU (and with a flag) nothing is said."""
    runs = [("cpu", [], False)]
    if CUDA:
        runs += [("cuda", [], True), ("cuda", ["--cuda-graph"], False)]
    for device, flags, hinted in runs:
        r = cli("--checkpoint", tiny, "--prompt", "hi", "--max-new-tokens", "4", "--device", device,
                *flags)
        said = r.stderr.endswith(" Eager: --cuda-graph or --compile decode many times faster.\n")
        assert r.returncode == 0 and said == hinted, r.stderr


@needs_cuda
@pytest.mark.parametrize("mode", ["eager", "compile", "graph"])
@pytest.mark.parametrize("checkpoint", ["tiny", "tiny_moe"])
def test_cuda_the_natural_decode_call_in_every_mode(checkpoint, mode, request):
    """On CUDA (fp32), model(token, positions) after a prefill, eagerly, under torch.compile
    (reduce-overhead) and as our CUDA graphs: the logits of a prefill of the whole sequence."""
    path = request.getfixturevalue(checkpoint)
    model = load(path, capacity=64, device="cuda")
    prompt = torch.tensor([[5, 3, 9, 27, 4, 11, 2, 8]], device="cuda")
    token, position = torch.tensor([[7]], device="cuda"), torch.tensor([[8]], device="cuda")
    out = torch.empty(1, VOCAB, device="cuda")

    def step():
        out.copy_(model(token, position)[:, -1])
    run = {"eager": step, "compile": torch.compile(step, mode="reduce-overhead", fullgraph=True),
           "graph": G.CUDAGraphs(step)}[mode]
    with torch.no_grad():
        prompt_call(model, prompt)
        run()
        whole = prompt_call(load(path, capacity=64, device="cuda"), torch.cat([prompt, token], 1))
    whole = whole[:, -1]
    assert torch.allclose(out, whole, atol=1e-5)


def test_a_shorter_attended_prefix_is_faster_never_wrong(tiny):
    """kv_len, the attended prefix, gives the whole cache's logits where it covers every position
    given, and is refused where it doesn't (a query would miss its own key)."""
    model = load(tiny, capacity=128)
    with torch.no_grad():
        prompt_call(model, torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]))
        token, position = torch.tensor([[9]]), torch.tensor([[8]])
        whole = model(token, position)
        assert torch.equal(model(token, position, kv_len=64), whole)
        with pytest.raises(RuntimeError, match="positions past kv_len"):
            model(token, position, kv_len=8)


def test_a_call_that_cant_be_right_is_refused(tiny):
    """After a prompt, model(token) with no positions could mean a new prompt or the next token:
    positions are required. kv_len T (the causal path) with positions other than 0 ... T - 1 is
    refused on the device."""
    model = load(tiny, capacity=64)
    with torch.no_grad():
        prompt_call(model, torch.tensor([[1, 2, 3, 4]]))
        with pytest.raises(TypeError, match="positions"):
            model(torch.tensor([[5]]))
        with pytest.raises(RuntimeError, match=r"kv_len T needs positions 0 \.\.\. T-1"):
            model(torch.tensor([[5, 6]]), torch.tensor([[1, 0]]), kv_len=2)


def test_parity_with_transformers_bf16(tmp_path):
    """bf16 against bf16 transformers: both round at the same places, so logits stay within a few
    ulps."""
    hf, path = converted(tmp_path, dtype=torch.bfloat16, heads=8, kv_heads=2, head_dim=32)
    ours = load(path, capacity=128, dtype=torch.bfloat16)
    torch.manual_seed(2)
    prompt = torch.randint(0, VOCAB, (1, 24))
    with torch.no_grad():
        ref = hf(prompt).logits[0].float()
        got = forward(ours, prompt[0].tolist()).float()
    diff = (ref - got).abs().max().item()
    assert diff <= 2e-2 * max(1.0, ref.abs().max().item()), diff
    assert (ref.argmax(-1) == got.argmax(-1)).float().mean() >= 0.9


def test_config_variants():
    """config.json as the hub and transformers spell it, read by ModelArgs.from_config after the
    converter's checks (common.model_args), which refuse what describes no model in one line."""
    base = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "num_attention_heads": 16,
            "vocab_size": 1000, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
            "head_dim": 128,
            "num_key_value_heads": 8, "intermediate_size": 3072, "num_hidden_layers": 28}
    assert common.model_args({**base, "rope_theta": 5e5}).rope_theta == 5e5
    new_style = {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    assert common.model_args(new_style).rope_theta == 1e6
    assert common.model_args({**base, "head_dim": None}).head_dim == 64
    with pytest.raises(UserError, match="Qwen2"):
        common.model_args({**base, "architectures": ["Qwen2ForCausalLM"]})
    # a Qwen2 config with a Qwen3 architecture entry
    with pytest.raises(UserError, match="model_type qwen2"):
        common.model_args({**base, "model_type": "qwen2"})
    # Qwen3's model cards: YaRN to 131,072 positions
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    args = common.model_args({**base, "rope_scaling": yarn, "max_position_embeddings": 40960})
    assert args.yarn == {"factor": 4.0, "original_max_position_embeddings": 32768}
    assert (args.max_position_embeddings == 131072
            and common.model_args(vars(args)).yarn == args.yarn)
    with pytest.raises(UserError, match="rope type dynamic: only default RoPE and YaRN"):
        common.model_args({**base, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})
    with pytest.raises(UserError, match=r"YaRN parameters .* are not all numbers below 2\^40"):
        common.model_args({**base, "rope_scaling": {**yarn, "factor": "4"}})
    with pytest.raises(UserError, match="sliding-window attention is unsupported"):
        common.model_args({**base, "use_sliding_window": True})
    no_window = {**base, "use_sliding_window": False, "sliding_window": 4096}
    assert common.model_args(no_window).head_dim == 128
    moe = {**base, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}
    # transformers' name
    assert common.model_args({**moe, "num_local_experts": 16}).num_experts == 16
    assert common.model_args({**moe, "num_experts": 64}).num_experts == 64  # the hub's
    assert common.eos_ids({**base, "eos_token_id": 7}, "config.json", 8) == {7}
    for bad in [{"num_hidden_layers": "two"}, {"hidden_size": -1}, {"tie_word_embeddings": "yes"},
                {"rope_theta": "big"}, {"mlp_only_layers": 3.5}, {"rope_parameters": [1]},
                {"mlp_only_layers": ["0"]}, {"mlp_only_layers": [0.5]}]:
        with pytest.raises(UserError, match="config.json: "):
            common.model_args({**base, **bad})
    refused = [({"rope_theta": 0}, "rope_theta is 0; it must be above 0"),
               ({"rms_norm_eps": 0.0}, "rms_norm_eps is 0.0; it must be above 0"),
               ({"rms_norm_eps": -1e-6}, "rms_norm_eps is -1e-06"),
               ({"num_attention_heads": 0}, "num_attention_heads is 0"),
               ({"rope_parameters": {"rope_theta": 0}}, "rope_theta is 0")]
    for bad, message in refused:
        with pytest.raises(UserError, match=re.escape(f"config.json: {message}")):
            common.model_args({**base, **bad})
    for name in ("rms_norm_eps", "max_position_embeddings", "vocab_size", "hidden_size"):
        config = {key: value for key, value in base.items() if key != name}
        with pytest.raises(UserError, match=f"config.json: {name} is missing"):
            common.model_args(config)


def test_model_py_alone_runs_the_pytorch_path(tiny, tmp_path):
    """model.py copied into another project: PyTorch alone (it imports nothing of ours), and our
    logits."""
    shutil.copy(os.path.join(HERE, "model.py"), tmp_path)
    code = textwrap.dedent(f"""
        import sys
        sys.path = [{str(tmp_path)!r}] + [p for p in sys.path if p not in ("", {HERE!r})]
        import glob, json, torch, model
        from safetensors.torch import load_file
        config = json.load(open({tiny + "/config.json"!r}))
        m = model.Transformer(model.ModelArgs.from_config(config))
        for shard in glob.glob({tiny + "/model*.safetensors"!r}):
            m.load_state_dict(load_file(shard), strict=False)
        m.setup_cache(1, 64)
        with torch.no_grad():
            logits = m(torch.tensor([[1, 2, 3]]), torch.tensor([[0, 1, 2]]))
        ours = {{"qwen3_triton", "generate", "convert_hf_checkpoint", "common", "quantize"}}
        assert not ours & set(sys.modules)
        torch.save(logits, {str(tmp_path / "logits.pt")!r})""")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       timeout=LIMIT)
    assert r.returncode == 0, r.stderr
    want = forward(load(tiny), [1, 2, 3])[None]
    assert torch.allclose(torch.load(tmp_path / "logits.pt"), want, atol=1e-6)


def test_the_card_files_work_without_the_fast_path(tmp_path):
    """model.py, generate.py and the converter alone, in a process of their own with nothing else
    on its path: they convert and generate; int8 is refused in one line, nothing written, and no
    optional file is imported. The commands run in that one process, each through its main(), as
    a process each would import torch four times for the same point."""
    for name in ("model.py", "common.py", "generate.py", "convert_hf_checkpoint.py"):
        shutil.copy(os.path.join(HERE, name), tmp_path)
    hf_checkpoint(str(tmp_path / "hf"))
    commands = textwrap.dedent("""
        import contextlib, io, json, shutil, sys
        import convert_hf_checkpoint, generate

        def run(main, *argv):  # (exit status, stderr) as a process would end
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                try:
                    main(list(argv))
                    return 0, err.getvalue()
                except SystemExit as e:
                    message = e.code if isinstance(e.code, str) else ""
                    return (1 if message else e.code or 0), err.getvalue() + message

        results = [run(convert_hf_checkpoint.main, "--checkpoint-dir", "hf")]
        # Seeded: the checkpoint's sampling could otherwise draw an eos before the fifth token
        results.append(run(generate.main, "--checkpoint", "hf/converted", "--prompt", "hello",
                           "--max-new-tokens", "5", "--seed", "0", "--device", "cpu"))
        results.append(run(convert_hf_checkpoint.main, "--checkpoint-dir", "hf", "--quantize",
                           "int8"))
        shutil.copytree("hf/converted", "int8")
        config = json.load(open("int8/config.json"))
        json.dump({**config, "quantization": "int8"}, open("int8/config.json", "w"))
        results.append(run(generate.main, "--checkpoint", "int8", "--prompt", "hello", "--device",
                           "cpu"))
        optional = sorted(sys.modules.keys() & {"quantize", "qwen3_triton", "tp", "speculative"})
        # A refusal leaves sys.stdout at os.devnull (run_command): a file, then
        json.dump({"results": results, "optional": optional}, open("results.json", "w"))""")
    r = subprocess.run([sys.executable, "-c", commands], capture_output=True, text=True,
                       timeout=LIMIT, cwd=tmp_path, env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "results.json").read_text())
    converted, generated, int8_converted, int8_generated = out["results"]
    assert converted[0] == 0, converted
    assert generated[0] == 0 and "5 new tokens" in generated[1], generated
    assert not os.path.exists(tmp_path / "qwen3_triton.py") and out["optional"] == []
    # int8 needs quantize.py: one line, nothing written
    assert int8_converted == [1, "error: int8 needs quantize.py"], int8_converted
    assert not (tmp_path / "hf" / "converted-int8").exists()
    want = "error: int8 is int8: loading it needs quantize.py"
    assert int8_generated[0] == 1 and int8_generated[1].endswith(want), int8_generated


def test_an_optional_file_there_but_broken_is_an_error(tmp_path, monkeypatch):
    """Only a missing file, or the missing Triton it needs, reads as "not there": one that is there
    and fails to import raises, never a silently slower path."""
    monkeypatch.syspath_prepend(str(tmp_path))
    assert common.optional("no_such_optional_file") is None
    (tmp_path / "needs_triton.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'triton'\", name='triton')\n")
    assert common.optional("needs_triton") is None
    (tmp_path / "broken_name.py").write_text("from model import NoSuchName\n")
    with pytest.raises(ImportError, match="NoSuchName"):
        common.optional("broken_name")
    (tmp_path / "broken_package.py").write_text("import no_such_package_of_ours\n")
    with pytest.raises(ModuleNotFoundError, match="no_such_package_of_ours"):
        common.optional("broken_package")


def test_a_new_model_has_finite_weights():
    """Transformer(args) on a real device: every weight initialised, none left empty."""
    args = M.ModelArgs(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=100,
                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    model = M.Transformer(args)
    assert all(p.isfinite().all() and p.abs().max() > 0 for p in model.parameters())


def test_model_says_what_to_call_first_and_loads_frozen(tiny):
    model = G.load_model(tiny)
    assert not any(p.requires_grad for p in model.parameters())
    with pytest.raises(RuntimeError, match=r"call setup_cache\(slots, capacity\) before"):
        model(torch.tensor([[1]]), torch.tensor([[0]]), torch.arange(1))


# ---------------------------------------------------------------- StaticKVCache

def test_cache_rows_of_different_lengths_do_not_see_each_other(tiny):
    torch.manual_seed(3)
    a, b = torch.randint(0, VOCAB, (7,)).tolist(), torch.randint(0, VOCAB, (19,)).tolist()
    alone = [forward(load(tiny), p) for p in (a, b)]
    both = load(tiny, slots=2)
    padded = torch.tensor([a + [0] * (len(b) - len(a)), b])  # a row each, in one forward
    with torch.no_grad():
        logits = both(padded, torch.arange(len(b)).expand(2, -1))
    got = [logits[0, :len(a)], logits[1]]
    # then one batched decode step, each row at its own position
    nxt = torch.tensor([[5], [9]])
    pos = torch.tensor([[len(a)], [len(b)]])
    with torch.no_grad():
        step = both(nxt, pos, len(b) + 1)
    for i, (p, t) in enumerate(((a, 5), (b, 9))):
        assert torch.allclose(got[i], alone[i], atol=1e-5)
        single = load(tiny)
        forward(single, p)
        assert torch.allclose(step[i, -1], forward(single, [t], start=len(p))[-1], atol=1e-5)


def test_cache_stale_slots_from_a_longer_request_do_not_leak(tiny):
    torch.manual_seed(4)
    long, short = torch.randint(0, VOCAB, (40,)).tolist(), torch.randint(0, VOCAB, (6,)).tolist()
    reused = load(tiny)
    forward(reused, long)  # fills positions 0..39
    got = forward(reused, short)  # a new request in the same row
    got_next = forward(reused, [3], start=len(short))
    fresh = load(tiny)
    assert torch.equal(got, forward(fresh, short))
    assert torch.equal(got_next, forward(fresh, [3], start=len(short)))
    # the stale slots really are there
    assert reused.layers[0].self_attn.kv_cache.k[0, :, 20].abs().sum() > 0


def test_output_does_not_depend_on_cache_capacity(tiny):
    prompts = [[3, 5, 7], [2, 4, 6, 8, 10]]
    assert (greedy(tiny, prompts, max_new=40, capacity=64)
            == greedy(tiny, prompts, max_new=40, capacity=2048))


def test_buckets():
    """Powers of two from 64 to 2,048, then multiples of 256, within the capacity."""
    lengths = [1, 64, 65, 128, 129, 1000, 2048, 2049, 2304, 4097, 32000, 32001]
    buckets = [64, 64, 128, 128, 256, 1024, 2048, 2304, 2304, 4352, 32000, 32256]
    assert [G.bucket(n, 40960) for n in lengths] == buckets
    assert G.bucket(3000, 3000) == 3000 and G.bucket(100, 90) == 90
    assert G.bucket(10 ** 400, 4096) == 4096  # exact: no float to overflow


# ---------------------------------------------------------------- converter

def test_convert_output_layout_and_tied_lm_head(tmp_path):
    hf, path = converted(tmp_path, tied=True)
    names = set()
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            names |= set(safe_open(os.path.join(path, f), "pt").keys())
    assert "lm_head.weight" not in names and "layers.0.self_attn.qkv_proj.weight" in names
    assert "layers.1.mlp.gate_up_proj.weight" in names and not any("q_proj" in n for n in names)
    assert {"config.json", "tokenizer.json", "generation_config.json"} <= set(os.listdir(path))
    # readable by others as the umask allows
    assert os.stat(path).st_mode & 0o077 == 0o077 & ~current_umask()
    model = load(path)
    assert model.lm_head.weight is model.embed_tokens.weight


def current_umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_random_snapshot(src, args: ModelArgs) -> tuple[int, dict]:
    """A Hugging Face-layout snapshot of random fp32 weights in ~60 MB shards, every expert a tensor
    of its own; returns its bytes and its weight map."""
    src.mkdir()
    fields = {k: v for k, v in vars(args).items() if k != "quantization"}
    moe = args.num_experts > 0
    cfg = {"architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
           "model_type": "qwen3_moe" if moe else "qwen3", **fields}
    json.dump(cfg, open(src / "config.json", "w"))
    hf_names = {"model.embed_tokens.weight": (args.vocab_size, args.hidden_size)}
    h, d, kv = args.hidden_size, args.head_dim, args.num_key_value_heads
    inter = args.moe_intermediate_size if moe else args.intermediate_size
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}."
        hf_names.update({p + "self_attn.q_proj.weight": (8 * d, h),
                         p + "self_attn.o_proj.weight": (h, 8 * d),
                         p + "self_attn.k_proj.weight": (kv * d, h),
                         p + "self_attn.v_proj.weight": (kv * d, h),
                         p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                         p + "input_layernorm.weight": (h,),
                         p + "post_attention_layernorm.weight": (h,)})
        if moe:
            hf_names[p + "mlp.gate.weight"] = (args.num_experts, h)
        for e in [f"{p}mlp.experts.{e}." for e in range(args.num_experts)] if moe else [p + "mlp."]:
            hf_names.update({e + "gate_proj.weight": (inter, h), e + "up_proj.weight": (inter, h),
                             e + "down_proj.weight": (h, inter)})
    hf_names.update({"model.norm.weight": (h,), "lm_head.weight": (args.vocab_size, h)})
    shard, total, n, weight_map = {}, 0, 0, {}
    for name, shape in hf_names.items():
        shard[name] = torch.randn(shape)
        total += shard[name].numel() * 4
        if sum(t.numel() for t in shard.values()) * 4 > 60e6:
            save_file(shard, src / f"model-{n}.safetensors")
            weight_map.update({k: f"model-{n}.safetensors" for k in shard})
            shard, n = {}, n + 1
    save_file(shard, src / f"model-{n}.safetensors")
    weight_map.update({k: f"model-{n}.safetensors" for k in shard})
    json.dump({"weight_map": weight_map}, open(src / "model.safetensors.index.json", "w"))
    write_tokenizer(src)
    return total, weight_map


def peak_memory_of(body: str) -> int:
    """Peak resident bytes that the Python code `body` adds, run in a fresh process."""
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {HERE!r})
        import convert_hf_checkpoint, torch
        def hwm():  # peak RSS, kB
            return [l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
        base = hwm()
        {{}}
        print(base, hwm())""")
    r = subprocess.run([sys.executable, "-c", code.format(body)], check=True, capture_output=True,
                       text=True, timeout=LIMIT)
    base, peak = [int(x) * 1024 for x in r.stdout.split()[-2:]]
    return peak - base


def peak_memory_of_converting(src) -> int:
    return peak_memory_of(f"convert_hf_checkpoint.main(['--checkpoint-dir', {str(src)!r}, "
                          "'--shard-size-mb', '32'])")


@pytest.mark.beside
def test_convert_memory_stays_bounded(tmp_path):
    """Converting a ~650 MB sharded checkpoint takes far less memory than its size (a tensor at a
    time)."""
    args = ModelArgs(hidden_size=512, intermediate_size=2048, num_hidden_layers=40,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=8000,
                     tie_word_embeddings=False)
    src = tmp_path / "big"
    total, weight_map = write_random_snapshot(src, args)
    assert total > 500e6
    used = peak_memory_of_converting(src)
    assert used < 0.25 * total, (used, total)
    shards = repr(str(src) + "/*.safetensors")
    used = peak_memory_of("from safetensors.torch import load_file; import glob; w = [[t.clone() "
                          f"for t in load_file(f).values()] for f in glob.glob({shards})]")
    assert used > 0.8 * total  # while loading it whole does show up: the measurement can fail
    model = load(str(src / "converted"))  # and the result is complete
    last = model.layers[39].mlp.gate_up_proj.weight
    up = "model.layers.39.mlp.up_proj.weight"
    # up's rows are the second half
    assert torch.equal(last[last.shape[0] // 2:], load_file(src / weight_map[up])[up])


@pytest.mark.beside
def test_convert_moe_memory_does_not_grow_with_the_model(tmp_path):
    """A MoE checkpoint of 1,536 expert tensors (64 experts x 3 x 8 layers, 230 MB) converts in the
    memory of one of half its layers: a layer's experts at a time, stacked."""
    used, total = {}, {}
    for layers in (4, 8):
        args = ModelArgs(hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=8000,
                         num_experts=64, moe_intermediate_size=128)
        src = tmp_path / f"moe{layers}"
        total[layers], weight_map = write_random_snapshot(src, args)
        used[layers] = peak_memory_of_converting(src)
    assert used[8] - used[4] < 0.1 * (total[8] - total[4]), (used, total)
    model = load(str(src / "converted"))  # and the result is complete, the experts in order
    last = model.layers[7].mlp.experts.gate_up_proj
    assert last.shape == (64, 256, 256)
    up = "model.layers.7.mlp.experts.63.up_proj.weight"
    assert torch.equal(last[63, 128:], load_file(src / weight_map[up])[up])


@pytest.fixture
def snapshot(tmp_path):
    hf_checkpoint(str(tmp_path / "hf"), sharded=True)
    return tmp_path / "hf"


def convert_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        convert.main(argv)
    message = str(e.value.code)
    assert message.startswith("error: ") and "\n" not in message
    assert "Traceback" not in capsys.readouterr().err
    return message


def test_convert_rejects_other_architectures(snapshot, capsys):
    for arch in ["Qwen2ForCausalLM", "Qwen3MoeForCausalLM"]:  # the latter with model_type qwen3
        cfg = json.load(open(snapshot / "config.json"))
        cfg["architectures"] = [arch]
        json.dump(cfg, open(snapshot / "config.json", "w"))
        assert arch in convert_error(["--checkpoint-dir", str(snapshot)], capsys)
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    cfg["model_type"] = "qwen2"
    json.dump(cfg, open(snapshot / "config.json", "w"))
    assert "model_type qwen2" in convert_error(["--checkpoint-dir", str(snapshot)], capsys)


def test_convert_bad_inputs_one_line_and_nothing_written(snapshot, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--checkpoint-dir", str(snapshot), "--output", str(out)]
    assert "no config.json" in convert_error(["--checkpoint-dir", str(tmp_path)], capsys)
    # generation_config.json's eos ids are the model's, or the result would be refused
    edit_json(snapshot / "generation_config.json", eos_token_id=-1)
    assert "generation_config.json: eos_token_id -1 is not token ids" in convert_error(argv, capsys)
    edit_json(snapshot / "generation_config.json", eos_token_id=3)
    shards = sorted(p for p in snapshot.iterdir() if p.suffix == ".safetensors")
    # a truncated shard (the last one, so the others are written before the failure)
    data = shards[-1].read_bytes()
    shards[-1].write_bytes(data[:len(data) // 2])
    message = convert_error(argv, capsys)
    assert "truncated or corrupt" in message or "not a readable" in message
    assert not out.exists() and not [p for p in tmp_path.iterdir()
                                     if p.name.startswith(".converting")]
    shards[-1].write_bytes(data)
    # a tensor we can't place, and a tensor missing
    extra = snapshot / "extra.safetensors"
    save_file({"model.layers.0.mlp.experts.0.weight": torch.zeros(2)}, extra)
    assert "model.layers.0.mlp.experts.0.weight" in convert_error(argv, capsys)
    extra.unlink()
    (snapshot / "model.safetensors.index.json").unlink()
    shards[0].unlink()
    assert "lacks" in convert_error(argv, capsys)
    assert not out.exists()
    for p in snapshot.iterdir():
        if p.suffix == ".safetensors":
            p.unlink()
    (snapshot / "pytorch_model.bin").write_bytes(b"pickle")
    assert "no *.safetensors files; download or convert it again" in convert_error(
        argv, capsys)
    (snapshot / "config.json").write_text("{not json")
    assert "not a readable JSON file" in convert_error(argv, capsys)


def test_convert_moe_names_a_missing_or_misshapen_expert_tensor(tmp_path, capsys):
    src = tmp_path / "hf"
    hf_checkpoint(str(src), moe={})
    out = tmp_path / "out"
    argv = ["--checkpoint-dir", str(src), "--output", str(out)]
    tensors = load_file(src / "model.safetensors")
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    save_file({k: t for k, t in tensors.items() if k != name}, src / "model.safetensors")
    assert f"the checkpoint lacks {name}" in convert_error(argv, capsys)
    save_file({**tensors, name: tensors[name][:-1]}, src / "model.safetensors")  # a row short
    message = convert_error(argv, capsys)
    assert name in message and "does not have the shape" in message
    assert not out.exists() and not [p for p in tmp_path.iterdir()
                                     if p.name.startswith(".converting")]


def test_convert_never_replaces_anything(snapshot, tmp_path, capsys, monkeypatch):
    user_dir = tmp_path / "mydata"
    user_dir.mkdir()
    (user_dir / "notes.txt").write_text("mine")
    (snapshot / "notes.txt").write_text("mine too")
    before = {p.name: p.read_bytes() for p in snapshot.iterdir()}
    a_file = tmp_path / "a-file"
    a_file.write_text("mine as well")
    for output in (user_dir, snapshot, a_file):
        assert "exists" in convert_error(["--checkpoint-dir", str(snapshot), "--output",
                                          str(output)], capsys)
    message = convert_error(["--checkpoint-dir", str(snapshot), "--output", str(a_file / "out")],
                            capsys)
    assert message == f"error: {a_file} is a file: choose another --output"
    monkeypatch.chdir(tmp_path)  # --output . : the current directory holds the user's files
    assert "exists" in convert_error(["--checkpoint-dir", str(snapshot), "--output", "."], capsys)
    assert (user_dir / "notes.txt").read_text() == "mine" and a_file.read_text() == "mine as well"
    assert {p.name: p.read_bytes() for p in snapshot.iterdir()} == before
    # nothing left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "hf", "mydata"]
    out = tmp_path / "out"  # a conversion is not replaced either
    convert.main(["--checkpoint-dir", str(snapshot), "--output", str(out)])
    assert load(str(out)).args.num_hidden_layers == 2
    written = {p.name: p.read_bytes() for p in out.iterdir()}
    assert "exists" in convert_error(["--checkpoint-dir", str(snapshot), "--output",
                                      str(out)], capsys)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == written


def test_convert_ctrl_c_exits_130_and_leaves_nothing(snapshot, tmp_path, monkeypatch):
    out = tmp_path / "out"

    def pressed(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(convert, "save_file", pressed)
    r = cli("--checkpoint-dir", str(snapshot), "--output", str(out),
            script="convert_hf_checkpoint.py")
    assert (r.returncode == 130 and "Traceback" not in r.stderr
            and r.stderr.strip().count("\n") == 0), r.stderr
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_convert_write_errors_are_one_line_and_leave_nothing(snapshot, tmp_path, capsys,
                                                             monkeypatch):
    """A full disk shows as safetensors' own error while a shard is written, or as an OSError while
    the other files are; both are one line, and the partial output and the directories made for it
    are gone."""
    from safetensors import SafetensorError
    out = tmp_path / "new" / "nested" / "out"
    argv = ["--checkpoint-dir", str(snapshot), "--output", str(out)]

    def full(*args):
        raise SafetensorError("Error while serializing: No space left on device (os error 28)")
    monkeypatch.setattr(convert, "save_file", full)
    assert "No space left on device" in convert_error(argv, capsys)
    # "new" and "new/nested" removed too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    monkeypatch.undo()

    def copy(*args):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(convert.shutil, "copy", copy)
    assert "No space left on device" in convert_error(argv, capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_convert_into_the_current_directory_is_refused_in_one_line(snapshot, tmp_path, monkeypatch,
                                                                   capsys):
    """--output . names an existing directory, even an empty one: refused, and nothing written
    beside it."""
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    message = convert_error(["--checkpoint-dir", str(snapshot), "--output", "."], capsys)
    assert f"{empty} exists: choose another --output" in message
    assert (sorted(p.name for p in tmp_path.iterdir()) == ["empty", "hf"]
            and not list(empty.iterdir()))
    # A link, even one to nothing: it stays as it is
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    message = convert_error(["--checkpoint-dir", str(snapshot), "--output", str(link)], capsys)
    assert message == f"error: {link} exists: choose another --output (it stays)"
    assert link.is_symlink() and not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGHUP"])
def test_convert_stopped_by_a_signal_leaves_nothing(snapshot, tmp_path, signal_name):
    """A closed terminal or `timeout` while a shard is being written: as Ctrl-C, the hidden output
    goes."""
    out = tmp_path / "a" / "b"
    patch = f"""
        import os, signal
        def save_file(*args):
            os.kill(os.getpid(), signal.{signal_name})
        convert_hf_checkpoint.save_file = save_file"""
    r = with_patch(patch, "convert_hf_checkpoint.py", "--checkpoint-dir", str(snapshot),
                   "--output", str(out))
    assert r.returncode == 130 and "Traceback" not in r.stderr, r.stderr  # as after Ctrl-C
    assert r.stderr.strip() == "interrupted: nothing was written"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_a_signal_while_a_finished_command_exits_is_quiet(snapshot, tmp_path):
    """Ctrl-C, SIGTERM or SIGHUP once the work is done, during the interpreter's exit (torch's
    atexit clean-up): ignored, where it would interrupt that clean-up with a traceback."""
    patch = """
        import atexit, os, signal, time
        def signals_at_exit():  # registered first: called after the command's own
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                os.kill(os.getpid(), signum)
                time.sleep(0.05)
        atexit.register(signals_at_exit)"""
    out = tmp_path / "out"
    r = with_patch(patch, "convert_hf_checkpoint.py", "--checkpoint-dir", str(snapshot),
                   "--output", str(out))
    assert r.returncode == 0 and r.stderr == f"wrote {out}\n", r.stderr
    assert (out / "config.json").is_file()


def test_convert_names_shards_as_the_hub_does(snapshot, tmp_path):
    """model-00001-of-0000N.safetensors, in the order the tensors were written."""
    convert.convert(str(snapshot), str(tmp_path / "out"), shard_bytes=1 << 16)
    names = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    count = len(names)
    assert count > 2
    assert names == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def test_an_interrupt_ends_the_line_it_cut_short_on_a_terminal():
    """Ctrl-C during a progress line: on a terminal the note starts a line of its own."""
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {HERE!r}); import common as c
        def command(argv):
            c.show_progress('writing out', 1, 4)
            raise KeyboardInterrupt
        c.run_command(command, [], 'interrupted: nothing was written')""")
    status, written = tty_stderr([sys.executable, "-c", code])
    assert status == 130
    assert written == "\rwriting out: 25%\r\ninterrupted: nothing was written\r\n", written


def test_convert_argument_errors_are_one_line(snapshot, capsys):
    for argv, message in [(["--shard-size-mb", "0"], "--shard-size-mb: must be at least 1, not 0"),
                          (["--shard-size-mb", "-5"],
                           "--shard-size-mb: must be at least 1, not -5"),
                          (["--checkpoint-dir", "x", "--bogus"], "unrecognized arguments: --bogus"),
                          (["--checkpoint-dir", ""], "--checkpoint-dir is empty: name a snapshot"),
                          ([], "the following arguments are required: --checkpoint-dir")]:
        assert message in convert_error(argv, capsys)
    r = cli("--checkpoint-dir", str(snapshot), "--shard-size-mb", "0",
            script="convert_hf_checkpoint.py")
    one_line_error(r, "must be at least 1")  # exit 1, as generate.py's
    r = cli("--help", script="convert_hf_checkpoint.py")
    assert r.returncode == 0 and convert.__doc__.split("\n\n")[0].split()[-1] in r.stdout.split()
    # the whole first paragraph
    assert " ".join(r.stdout.split()).count("snapshot into qwen3-fast weights.") == 1


def test_convert_refuses_a_snapshot_without_a_tokenizer_or_quantized(snapshot, capsys):
    argv = ["--checkpoint-dir", str(snapshot)]
    cfg = json.load(open(snapshot / "config.json"))
    json.dump({**cfg, "quantization_config": {"quant_method": "fp8"}},
              open(snapshot / "config.json", "w"))
    assert "is quantized: convert the bf16 snapshot" in convert_error(argv, capsys)
    json.dump(cfg, open(snapshot / "config.json", "w"))
    (snapshot / "tokenizer.json").unlink()
    assert "tokenizer.json: no readable tokenizer" in convert_error(argv, capsys)
    assert not (snapshot / "converted").exists()


def test_convert_cli_prints_one_line(snapshot):
    cfg = json.load(open(snapshot / "config.json"))
    cfg["architectures"] = ["Qwen2ForCausalLM"]
    json.dump(cfg, open(snapshot / "config.json", "w"))
    r = cli("--checkpoint-dir", str(snapshot),
            script="convert_hf_checkpoint.py")
    one_line_error(r, "Qwen2ForCausalLM")


@pytest.mark.parametrize("tied,moe", [(False, None), (True, None),
                                      (False, {"mlp_only_layers": [0]})])
def test_int8_quality_against_fp32(tmp_path, tied, moe):
    hf, path = converted(tmp_path, hidden=128, heads=8, kv_heads=2, head_dim=32, layers=4,
                         vocab=2048, tied=tied, moe=moe)
    convert.convert(str(tmp_path / "hf"), str(tmp_path / "int8"), quantization="int8")
    q8 = load(str(tmp_path / "int8"))
    assert q8.layers[0].self_attn.qkv_proj.weight.dtype == torch.int8
    assert q8.embed_tokens.weight.dtype == torch.float32
    # lm_head: int8 when it is its own matrix, the fp32 embedding when tied
    assert q8.lm_head.weight.dtype == (torch.float32 if tied else torch.int8)
    ref = load(path)
    torch.manual_seed(8)
    prompt = torch.randint(0, 2048, (64,)).tolist()
    a, b = forward(ref, prompt), forward(q8, prompt)
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item()
    rel = ((a - b).norm(dim=-1) / a.norm(dim=-1)).max().item()
    assert cos >= 0.999 and rel < 0.05
    # next-token choices on the same prefixes
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    assert agree >= 0.9
    # Free decoding from 8 prompts: how long int8 keeps fp32's greedy tokens. A random tiny model
    # has near-ties (and in MoE, near-tied routing) that int8 flips early on some prompts: the
    # median is long.
    prompts = [prompt[i:i + 8] for i in range(0, 64, 8)]
    out_ref = greedy(path, prompts, max_new=64)
    out_q8 = greedy(str(tmp_path / "int8"), prompts, max_new=64)
    same = [next((i for i, (x, y) in enumerate(zip(r, q, strict=True)) if x != y), len(r))
            for r, q in zip(out_ref, out_q8, strict=True)]
    assert sorted(same)[4] >= 8, same
    def size(d):
        return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)
                   if f.endswith(".safetensors"))
    quantized = sum(p.numel() for n, p in ref.named_parameters()
                    if "proj" in n or n == "lm_head.weight" and not tied)
    # those weights shrank 4x (fp32 -> int8)
    assert size(tmp_path / "int8") < size(path) - 0.7 * quantized * 4


def test_int8_checkpoint_with_a_bf16_lm_head_is_refused_in_one_line(tmp_path):
    # untied int8 checkpoints written before lm_head was quantized: lm_head.weight in float, no
    # lm_head.weight_scale
    hf, path = converted(tmp_path)
    convert.convert(str(tmp_path / "hf"), str(tmp_path / "int8"), quantization="int8")
    shards = sorted((tmp_path / "int8").glob("*.safetensors"))
    shard = next(f for f in shards if "lm_head.weight_scale" in load_file(f))
    state = load_file(shard)
    q, scale = state["lm_head.weight"], state.pop("lm_head.weight_scale")
    state["lm_head.weight"] = q.float() * scale[:, None]
    save_file(state, shard)
    # Named first: its float lm_head.weight where int8 belongs (lm_head.weight_scale is missing too)
    with pytest.raises(UserError, match=r"do not match config.json \(lm_head.weight\); "
                                        r"convert again"):
        load(str(tmp_path / "int8"))


@pytest.mark.parametrize("moe", [None, dict(mlp_only_layers=[0])], ids=["dense", "moe"])
def test_int8_modules_equal_their_dequantized_weights(tmp_path, moe):
    """quantize.py's modules: the logits of an int8 checkpoint equal, to 1e-4 in fp32, those of the
    same model with the dequantized weights loaded as plain ones; and quantize.py's own conversion
    of a converted checkpoint writes the converter's --int8 tensors."""
    hf, path = converted(tmp_path, moe=moe)
    convert.convert(str(tmp_path / "hf"), str(tmp_path / "int8"), quantization="int8")
    q8 = load(str(tmp_path / "int8"), capacity=64)
    plain = load(path, capacity=64)
    state = q8.state_dict()
    for name, weight in state.items():
        if weight.dtype == torch.int8:
            scale = state[f"{name}_scale"]
            plain.get_parameter(name).copy_(weight.float() * scale[..., None])
    assert any(isinstance(m, Q.QuantizedExperts) for m in q8.modules()) == (moe is not None)
    prompt = list(range(1, 30))
    assert (forward(q8, prompt) - forward(plain, prompt)).abs().max() <= 1e-4
    r = cli("--checkpoint", path, "--mode", "int8", script="quantize.py")
    assert r.returncode == 0 and r.stderr == f"wrote {path}-int8\n" and not r.stdout, r.stderr
    ours, theirs = (read_all(p) for p in (path + "-int8", tmp_path / "int8"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert json.load(open(path + "-int8/config.json"))["quantization"] == "int8"
    r = cli("--checkpoint", path + "-int8", "--mode", "int8",
            script="quantize.py")
    want = f"error: {path}-int8 is already int8: quantize its bf16 conversion\n"
    assert r.returncode == 1 and r.stderr == want


def read_all(directory) -> dict:
    """Every tensor of a directory's safetensors files."""
    tensors = {}
    for file in pathlib.Path(directory).glob("*.safetensors"):
        tensors.update(load_file(file))
    return tensors


def test_int8_quantize_roundtrip():
    w = torch.randn(64, 32) * torch.linspace(0.01, 3, 64)[:, None]  # rows of very different scales
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() == 127 and scale.shape == (64,)
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-6).all()


def test_int8_bad_inputs(tmp_path, capsys):
    hf, path = converted(tmp_path)
    convert.convert(str(tmp_path / "hf"), str(tmp_path / "int8"), quantization="int8")
    assert "already converted" in convert_error(["--checkpoint-dir", str(tmp_path / "int8"),
                                                 "--quantize", "int8"], capsys)
    assert "already converted" in convert_error(["--checkpoint-dir", path], capsys)
    cfg = json.load(open(tmp_path / "int8" / "config.json"))
    json.dump({**cfg, "quantization": None}, open(tmp_path / "int8" / "config.json", "w"))
    with pytest.raises(UserError, match="do not match"):
        load(str(tmp_path / "int8"))
    json.dump({**cfg, "hidden_size": 96}, open(tmp_path / "int8" / "config.json", "w"))
    with pytest.raises(UserError, match="do not match"):
        load(str(tmp_path / "int8"))


# A tiny model whose every layer's input is a multiple of 128, int4's default group size
INT4_SHAPES = dict(hidden=128, head_dim=32, intermediate=256)
INT4_MOE = dict(mlp_only_layers=[0], moe_intermediate_size=128)


def int4_dequantized(packed, scale, offset):
    """The weight (..., n_out, n_in) of int4 as quantize_int4 documents it: byte j holds column 2j
    in its low nibble and column 2j + 1 in its high one; w = q * scale + offset per group."""
    q = torch.empty(*packed.shape[:-1], 2 * packed.shape[-1])
    q[..., 0::2], q[..., 1::2] = packed & 15, packed >> 4
    group = q.shape[-1] // scale.shape[-1]
    return q * scale.float().repeat_interleave(group, -1) + offset.float().repeat_interleave(
        group, -1)


def test_int4_quantize_roundtrip():
    """Each group's lowest weight is q = 0 and its highest q = 15; every weight within about half
    a step of its value (the bf16 scale and offset round a little)."""
    torch.manual_seed(0)
    # rows of very different scales, rows and groups off centre
    centres = torch.randn(64, 1) + torch.randn(64, 3).repeat_interleave(32, -1)
    w = (torch.randn(64, 96) + centres) * torch.linspace(0.01, 3, 64)[:, None]
    packed, scale, offset = Q.quantize_int4(w, 32)
    assert packed.dtype == torch.uint8 and packed.shape == (64, 48)
    assert scale.dtype == offset.dtype == torch.bfloat16 and scale.shape == offset.shape == (64, 3)
    q = torch.stack((packed & 15, packed >> 4), -1).flatten(-2).unflatten(-1, (3, 32))
    assert (q.amin(-1) == 0).all() and (q.amax(-1) == 15).all()
    error = (int4_dequantized(packed, scale, offset) - w).abs().unflatten(-1, (3, 32)).amax(-1)
    assert (error <= 0.6 * scale.float() + offset.float().abs() / 128).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_int4_dequantized_in_each_dtype(dtype):
    """quantize.dequantized unpacks int4 as quantize_int4 documents it, in each dtype of a model
    (it writes a byte's two weights as the halves of one integer)."""
    torch.manual_seed(0)
    layer = Q.QuantizedLinear(256, 6, 64)
    for name, tensor in Q.quantize("weight", torch.randn(6, 256), 64).items():
        getattr(layer, name).copy_(tensor)
    want = int4_dequantized(layer.weight, layer.weight_scale, layer.weight_offset)
    got = Q.dequantized(layer, "weight", dtype)
    assert got.dtype == dtype and torch.equal(got, want.to(dtype))


@pytest.mark.parametrize("moe", [None, INT4_MOE], ids=["dense", "moe"])
def test_int4_modules_equal_their_dequantized_weights(tmp_path, moe):
    """quantize.py's int4 modules: the logits of the converter's int4 checkpoint (one pass, groups
    of 128) equal, to 1e-4 in fp32, those of the same model with the dequantized weights loaded as
    plain ones; quantize.py --mode int4 of the bf16 conversion writes the converter's tensors, and
    with --group-size 32 a checkpoint of 4 times the scales, as equal to its dequantized weights."""
    hf, path = converted(tmp_path, moe=moe, **INT4_SHAPES)
    one_pass = tmp_path / "hf" / "converted-int4"
    r = cli("--checkpoint-dir", str(tmp_path / "hf"), "--quantize", "int4",
            script="convert_hf_checkpoint.py")
    assert r.returncode == 0 and r.stderr == f"wrote {one_pass}\n", r.stderr
    script = "quantize.py"
    r = cli("--checkpoint", path, "--mode", "int4", script=script)
    assert r.returncode == 0 and r.stderr == f"wrote {path}-int4\n", r.stderr
    ours, theirs = (read_all(p) for p in (path + "-int4", one_pass))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    r = cli("--checkpoint", path, "--mode", "int4", "--group-size", "32", "--output",
            str(tmp_path / "g32"), script=script)
    assert r.returncode == 0, r.stderr
    # The converter's --group-size: the same checkpoint in one pass
    convert.main(["--checkpoint-dir", str(tmp_path / "hf"), "--quantize", "int4", "--group-size",
                  "32", "--output", str(tmp_path / "g32-one-pass")])
    ours, theirs = (read_all(p) for p in (tmp_path / "g32", tmp_path / "g32-one-pass"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    for directory, group in ((one_pass, 128), (tmp_path / "g32", 32)):
        config = json.load(open(directory / "config.json"))
        assert config["quantization"] == "int4" and config["group_size"] == group
        q4 = load(str(directory), capacity=64)
        plain = load(path, capacity=64)
        state = q4.state_dict()
        for name, weight in state.items():
            if weight.dtype == torch.uint8:
                scale, offset = state[f"{name}_scale"], state[f"{name}_offset"]
                assert scale.shape[-1] * group == 2 * weight.shape[-1], name
                plain.get_parameter(name).copy_(int4_dequantized(weight, scale, offset))
        quantized = [m for m in q4.modules() if isinstance(m, Q.QuantizedLinear)]
        # qkv, o, gate-up and down of 2 layers (MoE: 1 dense) and the untied lm_head
        assert len(quantized) == (7 if moe else 9)
        assert any(isinstance(m, Q.QuantizedExperts) for m in q4.modules()) == (moe is not None)
        prompt = list(range(1, 30))
        assert (forward(q4, prompt) - forward(plain, prompt)).abs().max() <= 1e-4


@pytest.mark.parametrize("moe", [None, INT4_MOE], ids=["dense", "moe"])
def test_int4_quality_against_fp32(tmp_path, moe):
    """int4's logits near fp32's (a random model's weights are int4's worst case: no group of
    them is narrow), nearer with smaller groups, not as near as int8's; its weights an eighth of
    fp32's and a little more (a bf16 scale and offset per group)."""
    hf, path = converted(tmp_path, heads=8, layers=4, vocab=2048, moe=moe, **INT4_SHAPES)
    ref = load(path)
    torch.manual_seed(8)
    prompt = torch.randint(0, 2048, (64,)).tolist()
    want = forward(ref, prompt)
    errors = {}
    for mode, group in (("int8", None), ("int4", 8), ("int4", 32), ("int4", 128)):
        out = str(tmp_path / f"{mode}-{group}")
        Q.quantize_checkpoint(path, out, mode, group)
        got = forward(load(out), prompt)
        errors[mode, group] = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
        cos = torch.nn.functional.cosine_similarity(got, want, dim=-1).min().item()
        assert cos >= 0.85, (mode, group, cos)
    assert errors["int8", None] < errors["int4", 8] < errors["int4", 32] < errors["int4", 128]

    def size(directory):
        return sum(f.stat().st_size for f in pathlib.Path(directory).glob("*.safetensors"))
    quantized = sum(p.numel() for n, p in ref.named_parameters()
                    if "proj" in n or n == "lm_head.weight")
    # fp32 -> half a byte, plus 4 bytes per group of 128
    shrunk = size(path) - size(tmp_path / "int4-128")
    assert 0.95 * 3.5 * quantized < shrunk < 3.5 * quantized


def test_int4_bad_inputs_are_one_line(tiny, tmp_path, snapshot, capsys):
    """A group size that no layer's input divides, or no power of two, or given to int8; int4 of
    a snapshot whose layers 128 doesn't divide: each refused in one line, nothing written. A
    config.json with an unknown quantization or a bad group size is refused; then generate.py runs
    the int4 checkpoint."""
    script = "quantize.py"
    out = str(tmp_path / "out")
    refusals = {("int4", "128"): "layers.0.self_attn.qkv_proj: its 64 input columns are no "
                                 "multiple of the group size 128 (--group-size sets it)",
                ("int4", "24"): "--group-size 24: int4 needs a power of two, at least 8",
                ("int4", "0"): "--group-size 0: int4 needs a power of two, at least 8",
                ("int8", "64"): "--group-size is int4's"}
    for (mode, group), message in refusals.items():
        r = cli("--checkpoint", tiny, "--mode", mode, "--group-size", group, "--output", out,
                script=script)
        one_line_error(r, message)
        assert not os.path.exists(out)
    r = cli("--checkpoint-dir", str(snapshot), "--quantize", "int4", "--output", out,
            script="convert_hf_checkpoint.py")
    one_line_error(r, "its 64 input columns are no multiple of the group size 128")
    assert not os.path.exists(out)
    for flags, message in ((["--group-size", "64"], "--group-size goes with --quantize int4"),
                           (["--quantize", "int8", "--group-size", "64"], "--group-size is int4's"),
                           (["--quantize", "int4", "--group-size", "12"], "--group-size 12: int4")):
        error = convert_error(["--checkpoint-dir", str(snapshot), *flags, "--output", out], capsys)
        assert message in error and not os.path.exists(out), error
    Q.quantize_checkpoint(tiny, out, "int4", 16)
    for changes, message in ((dict(quantization="int3"), "unknown quantization 'int3'"),
                             (dict(group_size="16"), "config.json: int4's group_size '16' is no"),
                             (dict(group_size=None), "int4 without its group_size: quantize")):
        edit_json(pathlib.Path(out, "config.json"), **changes)
        with pytest.raises(UserError, match=re.escape(message)):
            load(out)
        edit_json(pathlib.Path(out, "config.json"), quantization="int4", group_size=16)
    r = cli("--checkpoint", out, "--prompt", "hi", "--max-new-tokens", "5", "--seed", "0",
            "--device", "cpu")
    assert r.returncode == 0 and "5 new tokens" in r.stderr, r.stderr


# ---------------------------------------------------------------- sampling

def exact_filtered(logits, temperature, top_k, top_p):
    """The distribution sample() should draw from, the slow obvious way, in transformers' order:
    temperature, top-k, renormalise, then top-p (the smallest head whose mass reaches top_p)."""
    p = torch.softmax(logits.double() / temperature, -1)
    order = p.argsort(descending=True).tolist()
    if top_k:
        p[order[top_k:]] = 0
        p /= p.sum()
    keep, mass = torch.zeros_like(p, dtype=torch.bool), 0.0
    for i in order:
        if mass >= top_p or p[i] == 0:
            break
        keep[i], mass = True, mass + p[i].item()
    q = torch.where(keep, p, 0)
    return q / q.sum()


def chi_square_pvalue(counts, probs, n):
    expected = probs * n
    used = expected > 0
    stat = ((counts[used] - expected[used]) ** 2 / expected[used]).sum()
    dof = used.sum().item() - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2).item()


SAMPLING_CASES = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.8), (0.8, 6, 0.9)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("temperature,top_k,top_p", SAMPLING_CASES)
def test_sample_matches_exact_distribution(temperature, top_k, top_p, device):
    torch.manual_seed(5)
    logits = torch.randn(12) * 1.5
    n = 20_000
    params = G.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    batch = logits.expand(n, 12).contiguous().to(device)
    draws = G.sample(batch, params).cpu()
    counts = torch.bincount(draws, minlength=12).double()
    probs = exact_filtered(logits, temperature, top_k, top_p)
    assert counts[probs == 0].sum() == 0, "a filtered token was drawn"
    assert chi_square_pvalue(counts, probs, n) > 1e-3
    if top_k or top_p < 1:
        assert (probs == 0).sum() > 0  # the filter really removed something here


def test_sample_greedy_and_wrong_distribution_is_detected():
    logits = torch.randn(4, 50)
    assert torch.equal(G.sample(logits, GREEDY), logits.argmax(-1))
    torch.manual_seed(6)
    logits = torch.randn(12)
    draws = G.sample(logits.expand(20_000, 12).contiguous(), G.SamplingParams(temperature=1.0))
    counts = torch.bincount(draws, minlength=12).double()
    # the test can fail
    assert chi_square_pvalue(counts, exact_filtered(logits, 0.5, 0, 1.0), 20_000) < 1e-6


def test_sampling_settings_from_generation_config_are_checked_as_flags_are():
    config = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert G.SamplingParams.from_generation_config(config) == G.SamplingParams(0.6, 20, 0.95)
    assert (G.SamplingParams.from_generation_config({**config, "do_sample": False})
            == G.SamplingParams())
    assert G.SamplingParams.from_generation_config({}) == G.SamplingParams()
    for bad, message in [({"temperature": -1}, "must be 0 (greedy) or in [0.001, 1e6)"),
                         ({"temperature": 1e-45}, "in [0.001, 1e6)"),
                         ({"temperature": 10 ** 400}, "in [0.001, 1e6)"),
                         ({"temperature": "hot"}, "temperature 'hot'"),
                         ({"top_p": 1.5}, "must be in (0, 1]"), ({"top_k": 2.5}, "not 2.5"),
                         ({"top_k": True}, "top_k must be an int"), ({"top_p": [1]}, "top_p [1]")]:
        with pytest.raises(UserError, match=re.escape(message)):
            G.SamplingParams.from_generation_config({**config, **bad})
    for bad, message in [({"do_sample": "yes"}, "do_sample must be true or false"),
                         ({"do_sample": 1}, "do_sample must be true or false")]:
        with pytest.raises(UserError, match=re.escape(f"generation_config.json: {message}")):
            G.SamplingParams.from_generation_config({**config, **bad})
    for eos in ([1, "2"], "<|im_end|>", [True], -1, [1.5]):
        with pytest.raises(UserError, match="generation_config.json: eos_token_id .* is not token"):
            common.eos_ids({"eos_token_id": eos}, "generation_config.json", 100)
    assert common.eos_ids({"eos_token_id": 7}, "", 8) == {7}
    assert common.eos_ids({}, "", 8) == set()
    assert common.eos_ids({"eos_token_id": None}, "", 8) == set()  # unset, as transformers has it
    assert common.eos_ids({"eos_token_id": 0}, "", 8) == {0}


def test_the_python_api_refuses_bad_arguments_naming_them(tiny):
    """Each a UserError that names the argument: never a hang, a silent setting or a traceback
    from deep inside."""
    tokenizer = G.Tokenizer(tiny, VOCAB)
    for not_text in (b"Hello", 5):
        with pytest.raises(UserError, match=re.escape(f"{not_text!r} is not a str of valid UTF-8")):
            tokenizer.encode(not_text)
    for settings, message in [(dict(temperature=float("nan")), "temperature nan"),
                              (dict(temperature=-1), "temperature -1: must be 0 (greedy)"),
                              (dict(top_k=-1), "top_k must be an int of at least 0, not -1"),
                              (dict(top_p=0), "top_p 0: must be in (0, 1]"),
                              (dict(top_k="20"), "top_k must be an int of at least 0, not '20'")]:
        with pytest.raises(UserError, match=re.escape(message)):
            G.SamplingParams(**settings)
    model = G.load_model(tiny)
    for flags, message in [(dict(batch=0), "batch must be an int of at least 1, not 0"),
                           (dict(capacity=-5), "capacity must be an int of at least 1, not -5"),
                           (dict(batch=1.5), "batch must be an int of at least 1, not 1.5")]:
        with pytest.raises(UserError, match=re.escape(message)):
            G.Generator(model, **{"batch": 1, "capacity": 64, "sampling": GREEDY, **flags})
    gen = G.Generator(model, batch=2, capacity=64, sampling=GREEDY)
    for arguments, message in [(dict(max_new=0), "max_new must be an int of at least 1, not 0"),
                               (dict(max_new=-3), "max_new must be an int of at least 1"),
                               (dict(check_every=0), "check_every must be an int of at least 1"),
                               (dict(prompts=[[1, VOCAB]]), f"token ids in [0, {VOCAB})"),
                               (dict(prompts=[[-1]]), "token ids in [0,"),
                               (dict(prompts="hi"), "token ids in [0,"),
                               (dict(prompts=[["hello"]]), "token ids in [0,")]:
        call = {"prompts": [[1, 2]], "max_new": 4, "stop_ids": set(), **arguments}
        with pytest.raises(UserError, match=re.escape(message)):
            gen.generate(**call)
    for dtype in ("bfloat16", torch.int8):
        with pytest.raises(UserError, match=re.escape(f"dtype {dtype!r}: use torch.bfloat16")):
            G.load(tiny, dtype=dtype)
    with pytest.raises(UserError, match="sampling None: a SamplingParams"):
        G.Generator(model, batch=1, capacity=64, sampling=None)
    if not CUDA:
        with pytest.raises(UserError, match="use_kernels needs"):
            G.Generator(model, batch=1, capacity=64, sampling=GREEDY, use_kernels=True)
    for stop_ids in (None, 151645, [-5], {VOCAB}):
        with pytest.raises(UserError, match="stop_ids must be a set of the model's token ids"):
            gen.generate([[1, 2]], max_new=4, stop_ids=stop_ids)
    # Refused before the prefill runs
    with pytest.raises(UserError, match="on_tokens 5: a function"):
        gen.generate([[1, 2]], max_new=4, stop_ids=set(), on_tokens=5)
    with pytest.raises(UserError, match="give a list of 1 to 2 prompts"):
        gen.generate(torch.tensor([[1, 2]]), max_new=4, stop_ids=set())
    if not CUDA:
        with pytest.raises(UserError, match="there is no CUDA device here: use --device cpu"):
            G.load(tiny, device="cuda")
    for device in (5, "tpu", "cuda:x"):
        with pytest.raises(UserError, match=re.escape(f"unknown device {device!r}: use cpu, cuda")):
            G.load(tiny, device=device)
    with pytest.raises(UserError, match="model 'model': not a Transformer"):
        G.Generator("model", batch=1, capacity=64, sampling=GREEDY)
    for flags in (dict(compile="no"), dict(cuda_graph=1)):  # truthy, yet no flag
        with pytest.raises(UserError, match="compile, cuda_graph: True or False"):
            G.Generator(model, batch=1, capacity=64, sampling=GREEDY, **flags)
    for path in (None, 5, ""):
        with pytest.raises(UserError, match=re.escape(f"{path!r} is no path: name a converted")):
            G.load(path)
    with pytest.raises(UserError, match="vocab_size must be an int of at least 1, not '512'"):
        G.Tokenizer(tiny, "512")
    tokenizer = G.Tokenizer(tiny, VOCAB)
    # Not a list of messages, none, or a role the template doesn't know (it would drop the message)
    for messages in (123, "hello", [["user", "hi"]], [], [{"role": "wizard", "content": "hi"}],
                     [{"content": "hi"}]):
        message = f"messages {messages!r}: a list of one or more dicts"
        with pytest.raises(UserError, match=re.escape(message)):
            tokenizer.chat(messages)
    # Ids past the model's vocabulary would decode to nothing
    for ids in ([-1], [1.0], "hi", 5, None, [VOCAB], [10 ** 9]):
        message = f"{ids!r}: not token ids below {VOCAB}"
        with pytest.raises(UserError, match=re.escape(message)):
            tokenizer.decode(ids)
    assert tokenizer.decode([VOCAB - 1]) == ""  # the model's padding past the tokenizer's ids


# ---------------------------------------------------------------- decode modes

def longest_run(prompts, bucketed):
    return 64 if bucketed else max(map(len, prompts))


@pytest.mark.parametrize("bucketed", [False, True], ids=["to-the-longest", "to-the-bucket"])
@pytest.mark.parametrize("checkpoint", ["tiny", "tiny_moe"])
def test_padded_batch_prefill_equals_each_prompt_alone(checkpoint, bucketed, request):
    """One forward for prompts of different lengths, padded after each prompt's end (to the longest,
    as eagerly or compiled, or to its bucket, 64, as graphed): each row's logits at its last real
    token (fp32, 1e-5) and its cache at every real position are those of the prompt alone."""
    path = request.getfixturevalue(checkpoint)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7], [1, 8, 2, 8, 1], list(range(1, 41))]
    gen = generator(path, batch=4)
    gen.graphed = bucketed  # its prefill padded as graphed, run eagerly
    gen.prefill(prompts)
    k = gen.model.layers[0].self_attn.kv_cache.k  # the padding ran, to its bucket
    assert k[1, :, 2:longest_run(prompts, bucketed)].any(-1).all()
    assert not k[1, :, longest_run(prompts, bucketed):].any()
    batch_caches = [layer.self_attn.kv_cache for layer in gen.model.layers]
    for row, prompt in enumerate(prompts):
        alone = generator(path)
        alone.prefill([prompt])
        # greedy: the same logits' argmax
        assert gen.state.tokens[row, 0] == alone.state.tokens[0, 0]
        caches = [layer.self_attn.kv_cache for layer in alone.model.layers]
        for big, small in zip(batch_caches, caches, strict=True):
            for name in ("k", "v"):
                got = getattr(big, name)[row, :, :len(prompt)]
                assert torch.allclose(got, getattr(small, name)[0, :, :len(prompt)], atol=1e-5)
    model = gen.model
    longest = 64 if bucketed else max(map(len, prompts))
    tokens = torch.tensor([p + [0] * (longest - len(p)) for p in prompts])
    ends = torch.tensor([len(p) for p in prompts])
    with torch.no_grad():  # every token of the grid runs
        logits = model(tokens, torch.arange(longest).expand(4, -1), None,
                       logits_at=ends[:, None] - 1)[:, 0]
    for row, prompt in enumerate(prompts):
        assert torch.allclose(logits[row], forward(load(path), prompt)[-1], atol=1e-5)


@pytest.mark.parametrize("checkpoint", ["tiny", "tiny_moe"])
def test_logits_at_gives_those_tokens_logits_alone(checkpoint, request):
    """With logits_at, one token's logits per row, (R, 1, vocab): the full forward's at those tokens
    (fp32, 1e-5), through the causal path and the masked one."""
    path = request.getfixturevalue(checkpoint)
    torch.manual_seed(5)
    tokens = torch.randint(0, VOCAB, (2, 40))
    positions = torch.arange(40).expand(2, -1)
    at = torch.tensor([[39], [17]])
    full = load(path, slots=2)
    with torch.no_grad():
        want = prompt_call(full, tokens)
        for kv_len in (40, None):
            got = load(path, slots=2)(tokens, positions, kv_len, logits_at=at)
            assert got.shape == (2, 1, VOCAB)
            for row in range(2):
                assert torch.allclose(got[row, 0], want[row, at[row, 0]], atol=1e-5)


def test_causal_prompt_path_equals_the_masked_one(tiny):
    """A prompt from position 0 attends causally without a mask (kv_len T: flash attention on
    CUDA); the same prompt through the position mask gives the same logits."""
    torch.manual_seed(9)
    prompt = torch.randint(0, VOCAB, (2, 300))
    model = load(tiny, slots=2, capacity=512)
    positions = torch.arange(300).expand(2, -1)
    with torch.no_grad():
        causal = model(prompt, positions, 300)
        masked = model(prompt, positions)
    assert torch.allclose(causal, masked, atol=1e-5)


@pytest.mark.parametrize("checkpoint", ["tiny", "tiny_moe"])
def test_a_prompt_continues_its_rows_cached_tokens(checkpoint, request):
    """generate(start=): a second prompt prefilled at positions after the first's, on the cache the
    first left, gives what the two prompts as one give (greedy, fp32); its prefill ran its own
    tokens alone."""
    path = request.getfixturevalue(checkpoint)
    first, second = [5, 3, 9, 27, 4], [11, 2, 8, 30, 6, 7]
    gen = generator(path)
    gen.generate([first], max_new=1, stop_ids=set())
    ran = []
    gen.model.embed_tokens.register_forward_hook(lambda _m, inputs, _out: ran.append(inputs[0]))
    rows, _ = gen.generate([second], max_new=16, stop_ids=set(), start=len(first))
    whole, _ = generator(path).generate([first + second], max_new=16, stop_ids=set())
    assert rows == whole and ran[0].tolist() == [second]
    with pytest.raises(UserError, match="start must be an int of at least 0"):
        gen.generate([second], max_new=4, stop_ids=set(), start=-1)
    with pytest.raises(UserError, match="over the cache length"):
        gen.generate([second], max_new=4, stop_ids=set(), start=510)


def test_greedy_decode_equals_full_recomputation(tiny):
    prompt = [1, 2, 3, 4, 5]
    out = greedy(tiny, [prompt], max_new=30)[0]
    assert len(out) == 30
    seq = list(prompt)
    for t in out:
        # a fresh cache, the whole sequence each time
        assert t == int(forward(load(tiny), seq)[-1].argmax())
        seq.append(t)


def test_stop_tokens_trim_output(tiny):
    full = greedy(tiny, [[1, 2, 3]], max_new=30)[0]
    stop = full[9]
    first = full.index(stop)
    out = greedy(tiny, [[1, 2, 3]], max_new=30, stop_ids=[stop], check_every=7)[0]
    assert out == full[:first]


def test_batch_rows_equal_single_runs(tiny):
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5], [9]]
    full = greedy(tiny, [[3, 1, 4, 1, 5]], max_new=20)[0]
    stop = full[6]
    batch = greedy(tiny, prompts, max_new=20, stop_ids=[stop])
    singles = [greedy(tiny, [p], max_new=20, stop_ids=[stop])[0] for p in prompts]
    assert batch == singles
    assert len(batch[0]) < 20  # row 0 stopped on its own while the others went on


@pytest.mark.beside
def test_each_new_attended_length_warms_up_apart(tiny):
    """Compiled, the first decode step at each new attended length (its bucket: 64, then 128)
    compiles or records its own graph: it runs alone between two checks and is timed apart, never
    as decode; a second generation at those lengths warms nothing up and compiles nothing. Eagerly
    nothing warms up, and the report names no warm-up; the checks still fall at the buckets'
    ends."""
    prompt = list(range(1, 61))  # its next positions attend to 64, from position 64 on to 128
    seen = []
    # conversation_of's capacity and sampling: what compiles here, inductor's cache gives the
    # chat's compiled test
    gen = generator(tiny, compile=True)
    _, stats = gen.generate([prompt], max_new=20, stop_ids=set(), check_every=8,
                            on_tokens=lambda rows: seen.append(len(rows[0])))
    # Warm-ups: the step that makes token 2 (attending to 64) and token 6 (to 128)
    assert seen == [1, 2, 5, 6, 14, 20] and stats.decode_tokens == 17 and stats.warmup_s > 0
    # Once warm nothing compiles again: torch raises at a recompilation
    with torch.compiler.set_stance("fail_on_recompile"):
        _, again = gen.generate([prompt], max_new=20, stop_ids=set(), check_every=8)
    assert again.decode_tokens == 19 and again.warmup_s == 0
    seen.clear()
    _, stats = generator(tiny, capacity=256).generate(
        [prompt], max_new=20, stop_ids=set(), check_every=8,
        on_tokens=lambda rows: seen.append(len(rows[0])))
    assert seen == [1, 5, 13, 20] and stats.decode_tokens == 19 and stats.warmup_s == 0
    assert "compiling or capturing" not in stats.report([[1] * 20])
    _, stats = generator(tiny).generate([[1, 2, 3]], max_new=1, stop_ids=set())
    assert stats.decode_tokens == 0 and stats.warmup_s == 0 and stats.decode_s == 0


@needs_cuda
def test_cuda_compiled_lengths_warm_up_over_two_steps(tiny):
    """On CUDA, cudagraph trees run a new length's first compiled step without a graph and record
    its graph at the second: both steps are timed apart, never as decode (the report's rate is the
    replayed steps')."""
    prompt = list(range(1, 61))  # its next positions attend to 64, from position 64 on to 128
    seen = []
    gen = generator(tiny, device="cuda", dtype=torch.bfloat16, compile=True)
    _, stats = gen.generate([prompt], max_new=20, stop_ids=set(), check_every=8,
                            on_tokens=lambda rows: seen.append(len(rows[0])))
    # Warm-ups: the steps that make tokens 2 and 3 (attending to 64), 6 and 7 (to 128)
    assert seen == [1, 3, 5, 7, 15, 20] and stats.decode_tokens == 15 and stats.warmup_s > 0


def test_ctrl_c_in_the_decode_loop_returns_what_was_made(tiny):
    """KeyboardInterrupt (Ctrl-C, or SIGTERM and SIGHUP in our commands) anywhere in the decode
    loop ends it: the tokens made so far come back, read once more, with stats.interrupted; the
    Generator goes on working."""
    gen = generator(tiny)
    full, _ = gen.generate([[1, 2, 3]], max_new=30, stop_ids=set(), check_every=4)
    checks = []

    def pressed(rows):
        checks.append(len(rows[0]))
        if len(checks) == 3:
            raise KeyboardInterrupt
    rows, stats = gen.generate([[1, 2, 3]], max_new=30, stop_ids=set(), check_every=4,
                               on_tokens=pressed)
    assert stats.interrupted and checks == [1, 5, 9] and rows == [full[0][:9]]
    again, stats = gen.generate([[1, 2, 3]], max_new=30, stop_ids=set(), check_every=4)
    assert again == full and not stats.interrupted
    # An on_tokens that raises at every call still ends the loop
    checks.clear()

    def always_pressed(rows):
        checks.append(len(rows[0]))
        raise KeyboardInterrupt
    rows, stats = gen.generate([[1, 2, 3]], max_new=30, stop_ids=set(), check_every=4,
                               on_tokens=always_pressed)
    assert stats.interrupted and checks == [1] and rows == [full[0][:1]]


def test_generator_takes_fewer_prompts_than_its_batch(tiny):
    gen = generator(tiny, batch=3)
    assert (gen.generate([[5, 6, 7]], max_new=12, stop_ids=set())[0]
            == greedy(tiny, [[5, 6, 7]], max_new=12))
    both = gen.generate([[5, 6, 7], [1, 2]], max_new=12, stop_ids=set())[0]
    assert both == greedy(tiny, [[5, 6, 7], [1, 2]], max_new=12)
    for prompts in ([], [[1]] * 4, [[1], []]):
        with pytest.raises(UserError, match="give a list of 1 to 3 prompts"):
            gen.generate(prompts, max_new=4, stop_ids=set())


def python_blocks(markdown: str, section: str) -> list[str]:
    """The ```python blocks of one '## ' section of a Markdown text."""
    body = markdown.split(f"\n## {section}\n")[1].split("\n## ")[0]
    return re.findall(r"```python\n(.*?)```", body, flags=re.S)


def test_readme_from_python_runs(tiny, capsys):
    """The README's "From Python" code, on the tiny checkpoint and the CPU."""
    blocks = python_blocks(open(os.path.join(HERE, "README.md")).read(), "From Python")
    assert len(blocks) >= 2
    namespace = {}
    for code in blocks:
        code = code.replace("checkpoints/Qwen/Qwen3-0.6B/converted", tiny)
        code = code.replace('device="cuda"', 'device="cpu"')
        exec(compile(code, "README.md", "exec"), namespace)
    printed = capsys.readouterr().out
    assert len(printed.strip().splitlines()) >= 3, printed


# The decode modes: (compile, cuda_graph) for generator()
MODES = {"eager": {}, "compile": dict(compile=True), "graph": dict(cuda_graph=True)}


@needs_cuda
@pytest.mark.parametrize("prompts", [[[1, 2, 3, 4]], [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11],
                                                    [12, 13], [14, 15, 16, 17, 18, 19]]],
                         ids=["batch1", "batch4"])
@pytest.mark.parametrize("checkpoint,sampling",
                         [("tiny", GREEDY), ("tiny_moe", GREEDY),
                          ("tiny", G.SamplingParams(temperature=1.0, top_k=50))],
                         ids=["dense", "moe", "dense-sampled"])
def test_cuda_modes_identical_tokens(checkpoint, prompts, sampling, request):
    """fp32: every mode gives eager's tokens, greedy and sampled with one seed, from a prefill
    padded to its bucket (64) and graphed, or unpadded and eager. Both batches decode with the
    Triton kernels, batch 4's products of several tokens on tensor cores; 300 steps cross the
    attended lengths 64, 128, 256 and 512 (one graph each)."""
    path = request.getfixturevalue(checkpoint)
    runs = {}
    for mode, flags in MODES.items():
        torch.manual_seed(0)
        runs[mode] = greedy(path, prompts, max_new=300, device="cuda", sampling=sampling, **flags)
    assert all(tokens == runs["eager"] for tokens in runs.values()), \
        {m: r[0][:12] for m, r in runs.items()}


@needs_cuda
@pytest.mark.parametrize("mode", MODES)
def test_cuda_sampling_is_seeded_and_fresh_every_step(tiny, mode):
    """Sampled decoding in every mode: the same seed gives the same tokens, another seed others, and
    each step draws new noise (a graph that replayed one captured draw would repeat itself)."""
    sampling = G.SamplingParams(temperature=1.0, top_k=20, top_p=0.95)
    gen = generator(tiny, sampling=sampling, device="cuda", dtype=torch.bfloat16, **MODES[mode])
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(gen.generate([[1, 2, 3]], max_new=100, stop_ids=set())[0][0])
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert len(set(runs[0])) > 10


def no_host_sync(step):
    """`step`, failing wherever it waits for the host (torch's sync debug mode)."""
    def run(*args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            step(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return run


@needs_cuda
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prompts", [[[1, 2, 3]], [[1, 2, 3], [4, 5, 6, 7, 8]]],
                         ids=["batch1", "batch2"])
@pytest.mark.parametrize("checkpoint", ["tiny", "tiny_moe"])
def test_cuda_no_host_sync_inside_prefill_and_decode_steps(checkpoint, prompts, mode, request):
    """bf16, where MoE layers multiply by the picked experts alone in a grouped product (on Hopper
    and Blackwell); batch 1 decodes with the kernels, batch 2 with PyTorch's ops."""
    sampling = G.SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
    gen = generator(request.getfixturevalue(checkpoint), batch=len(prompts), capacity=1024,
                    sampling=sampling, device="cuda", dtype=torch.bfloat16, **MODES[mode])
    if checkpoint == "tiny_moe":
        assert grouped_mm_of(gen.model) == {torch.cuda.get_device_capability()[0] in (9, 10)}
    gen.generate(prompts, max_new=40, stop_ids=set())  # warm-up: compile and capture
    gen.decode_step = no_host_sync(gen.decode_step)
    gen.prefill_step = no_host_sync(gen.prefill_step)
    out = gen.generate(prompts, max_new=40, stop_ids=set())[0]
    assert [len(row) for row in out] == [40] * len(prompts)


@needs_cuda
@pytest.mark.parametrize("checkpoint", ["tiny", "tiny_moe"])
def test_cuda_prompts_continuing_their_rows_at_other_positions_in_every_mode(checkpoint, request):
    """fp32, sampled with one seed: prompts prefilled after cached tokens (generate(start=)) at two
    starts that give the prefill the same shapes (its bucket of 64, the attended 128): graphed,
    the second reads its own positions, not those the first's graph recorded; every mode gives
    eager's tokens."""
    path = request.getfixturevalue(checkpoint)
    runs = {}
    for mode, flags in MODES.items():
        torch.manual_seed(0)
        gen = generator(path, device="cuda", sampling=G.SamplingParams(temperature=1.0, top_k=50),
                        **flags)
        runs[mode] = []
        for first in ([5, 3, 9, 27, 4], [8, 1, 2, 6, 13, 17, 21, 4, 2]):
            gen.generate([first], max_new=1, stop_ids=set())
            rows, _ = gen.generate([[11, 2, 8, 30]], max_new=30, stop_ids=set(), start=len(first))
            runs[mode].append(rows[0])
    assert runs["graph"] == runs["compile"] == runs["eager"]
    assert runs["eager"][0] != runs["eager"][1]


@needs_cuda
@pytest.mark.parametrize("mode", MODES)
def test_cuda_sampler_kernel_draws_pytorchs_tokens_in_every_mode(tiny, mode):
    """Batch 2, where PyTorch's ops run the forward either way: the sampler kernel gives sample's
    tokens from one seed, eager, compiled and graphed."""
    sampling = G.SamplingParams(temperature=1.0, top_k=20, top_p=0.9)
    runs = []
    for use_kernels in (False, True):
        torch.manual_seed(0)
        runs.append(greedy(tiny, [[1, 2, 3], [4, 5, 6, 7]], max_new=100, device="cuda",
                           sampling=sampling, use_kernels=use_kernels, **MODES[mode]))
    assert runs[0] == runs[1]
    assert len(set(runs[0][0])) > 10


@needs_cuda
@pytest.mark.parametrize("checkpoint", ["tiny", "tiny_moe"])
def test_cuda_graph_capture_changes_no_state(checkpoint, request):
    """The first graphed prefill or decode step of a length runs for real, then is captured:
    afterwards the state, the caches and the random generator are those of one eager step; replays
    then advance them as eager steps do, drawing the same noise."""
    path = request.getfixturevalue(checkpoint)
    sampling = G.SamplingParams(temperature=1.0, top_k=20)
    gens = [generator(path, sampling=sampling, device="cuda", cuda_graph=graph)
            for graph in (False, True)]

    def state(gen):
        caches = [t.clone() for layer in gen.model.layers
                  for t in layer.self_attn.kv_cache.buffers()]
        return [t.clone() for t in vars(gen.state).values()] + caches + [torch.cuda.get_rng_state()]
    states = []
    for gen in gens:
        gen.graphed = True  # eager too: the same prefill, padded to 64
        torch.manual_seed(5)
        for _ in range(2):  # warm-up and capture, then a replay
            gen.prefill([[1, 2, 3, 4]])
            states.append(state(gen))
        for _ in range(3):  # warm-up and capture, then replays
            gen.decode_step(gen.model.key_positions[:64])  # bucket(8)
            states.append(state(gen))
    for eager, graphed in zip(states[:5], states[5:], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(eager, graphed, strict=True))
    assert len(gens[1].prefill_step.graphs) == 1 and len(gens[1].decode_step.graphs) == 1
    assert len(set(gens[1].state.sequences[0, 4:8].tolist())) > 1


@needs_cuda
def test_cuda_graphs_of_a_dropped_generator_never_end_another_capture(tiny):
    """A graphed Generator (its graphs' steps bound to a weak proxy of it), dropped, is freed with
    its graphs at once, not by Python's collector, which could free them inside another
    Generator's capture and end it with a CUDA error. That is tried too, with collections made
    frequent and cheap: everything older frozen, a collection at each allocation."""
    model = G.load_model(tiny, "cuda")
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(1, 1, 1)
    dropped = []
    try:
        for _ in range(3):
            gen = G.Generator(model, batch=1, capacity=128, sampling=GREEDY, cuda_graph=True)
            rows, _ = gen.generate([[1, 2, 3]], max_new=8, stop_ids=set())
            assert len(rows[0]) == 8
            dropped.append(weakref.ref(gen))
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
    del gen
    assert all(ref() is None for ref in dropped)


@needs_cuda
@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("moe", [None, dict(mlp_only_layers=[0], moe_intermediate_size=64)])
def test_cuda_quantized_modes_identical_greedy(tmp_path, moe, quantization):
    path = quantized_of(tmp_path, quantization, moe=moe)
    # fp32: in bf16 the fused dequantising reduction rounds once where eager rounds after the matmul
    # and again after the scale, which flips near-tied greedy choices of a random model.
    eager = greedy(path, [[1, 2, 3]], max_new=40, device="cuda")
    for mode in ("compile", "graph"):
        assert greedy(path, [[1, 2, 3]], max_new=40, device="cuda", **MODES[mode]) == eager, mode


def test_cuda_graph_without_cuda_is_one_line(tiny):
    """The Generator's own check, which the command line reaches."""
    r = cli("--device", "cpu", "--checkpoint", tiny, "--prompt", "hi", "--cuda-graph")
    one_line_error(r, "cuda_graph needs a CUDA device: leave out --cuda-graph")


@pytest.mark.beside
def test_compile_without_a_cpp_compiler_is_one_line(tiny):
    """On the CPU inductor compiles C++: where it finds no compiler (CXX names none that exists),
    --compile is refused in one line when the Generator is made, not as inductor's traceback at
    the first step. A process of its own: torch looks for the compiler once a process."""
    r = run_process(os.path.join(HERE, "generate.py"), "--device", "cpu", "--checkpoint", tiny,
                    "--prompt", "hi", "--compile", env={"CXX": "/nonexistent/g++"})
    one_line_error(r, "compile on the CPU needs g++ (or a C++ compiler in CXX)")


def test_compile_and_cuda_graph_are_alternatives(tiny):
    one_line_error(cli("--device", "cpu", "--checkpoint", tiny, "--prompt", "hi", "--compile",
                       "--cuda-graph"), "compile and cuda_graph: choose one")
    with pytest.raises(UserError, match="compile and cuda_graph: choose one"):
        generator(tiny, compile=True, cuda_graph=True)
    with pytest.raises(UserError, match="cuda_graph needs a CUDA device: leave out --cuda-graph"):
        generator(tiny, cuda_graph=True)


# ---------------------------------------------------------------- command line

@pytest.mark.parametrize("checkpoint", ["tiny", "tiny_moe"])
def test_cli_end_to_end_streams_the_generated_text(checkpoint, request):
    tiny = request.getfixturevalue(checkpoint)
    r = cli("--device", "cpu", "--checkpoint", tiny, "--prompt", "hello world",
            "--max-new-tokens", "12", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(tiny, "tokenizer.json"))
    eos = json.load(open(os.path.join(tiny, "generation_config.json")))["eos_token_id"]
    expected = greedy(tiny, [tok.encode("hello world").ids], max_new=12, stop_ids=eos)[0]
    # special tokens as generate.py's Tokenizer decodes them: shown
    assert r.stdout == tok.decode(expected, skip_special_tokens=False) + "\n"
    assert r.stderr.startswith(f"loading {tiny}")  # said before the wait
    assert ("tok/s per row" in r.stderr and "Time to first token" in r.stderr
            and "Traceback" not in r.stderr)


def test_cli_chat_batch_and_sampling(tiny):
    r = cli("--device", "cpu", "--checkpoint", tiny, "--prompt", "why is the sky blue?",
            "--prompt", "hello", "--chat", "--no-think", "--system", "be brief",
            "--max-new-tokens", "8", "--seed", "3")
    assert r.returncode == 0, r.stderr
    # each prompt, once, each followed by its text
    blocks = r.stdout.split("--- ")
    assert blocks[0] == "" and blocks[1].startswith("why is the sky blue?\n")
    assert blocks[2].startswith("hello\n")
    assert all(len(block.split("\n", 1)[1].strip()) > 0 for block in blocks[1:]), r.stdout
    assert "in 2 rows" in r.stderr and "in all" in r.stderr
    runs = [cli("--device", "cpu", "--checkpoint", tiny, "--prompt", "hello",
                "--max-new-tokens", "24", "--seed", seed) for seed in ("7", "7", "8")]
    assert all(run.returncode == 0 and len(run.stdout.strip()) > 0 for run in runs), runs
    assert runs[0].stdout == runs[1].stdout  # --seed makes sampling reproducible
    assert runs[0].stdout != runs[2].stdout  # and sampled: another seed, another text


def test_cli_stop_ids(tiny):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(tiny, "tokenizer.json"))
    eos = json.load(open(os.path.join(tiny, "generation_config.json")))["eos_token_id"]
    ids = greedy(tiny, [tok.encode("hello world").ids], max_new=16, stop_ids=eos)[0]
    stop = ids[len(ids) // 2]
    r = cli("--device", "cpu", "--checkpoint", tiny, "--prompt", "hello world",
            "--max-new-tokens", "16", "--temperature", "0", "--stop-ids", str(stop))
    assert r.returncode == 0, r.stderr
    assert r.stdout == tok.decode(ids[:ids.index(stop)]) + "\n"


def test_cli_draft_checkpoint_gives_the_plain_text_and_says_what_was_accepted(tiny, tiny_moe,
                                                                              tmp_path):
    """--draft-checkpoint: speculative rounds give the plain command's greedy text (fp32), with
    --speculate-k's k too, and the report says how many drafts were kept; a draft whose tokenizer
    is the target's saved otherwise is accepted. Refused in one line: --speculate-k alone, two
    prompts, an empty draft path, a draft of another vocabulary, no speculative.py."""
    flags = ["--device", "cpu", "--checkpoint", tiny_moe, "--prompt", "hello world",
             "--max-new-tokens", "24", "--temperature", "0"]
    plain = cli(*flags)
    for k in ([], ["--speculate-k", "2"]):
        r = cli(*flags, "--draft-checkpoint", tiny, *k)
        assert r.returncode == 0 and r.stdout == plain.stdout, r.stderr
        assert "tokens kept a round" in r.stderr and "in 1 row" in plain.stderr
        assert f"loading the draft, {tiny} ..." in r.stderr
    one_line_error(cli(*flags, "--speculate-k", "2"), "--speculate-k needs --draft-checkpoint")
    two = cli(*flags, "--prompt", "hi", "--draft-checkpoint", tiny)
    one_line_error(two, "--draft-checkpoint takes one --prompt")
    one_line_error(cli(*flags, "--draft-checkpoint", ""), "'' is no path")
    other = tmp_path / "other"
    shutil.copytree(tiny, other)
    saved = json.loads((other / "tokenizer.json").read_text())
    # The same vocabulary saved otherwise: the same ids, accepted
    (other / "tokenizer.json").write_text(json.dumps(saved, indent=1))
    r = cli(*flags, "--draft-checkpoint", str(other))
    assert r.returncode == 0 and r.stdout == plain.stdout, r.stderr
    # Two tokens' ids swapped: another vocabulary
    vocab = saved["model"]["vocab"]
    first, second = list(vocab)[-2:]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (other / "tokenizer.json").write_text(json.dumps(saved))
    one_line_error(cli(*flags, "--draft-checkpoint", str(other)), "not the target's tokenizer")
    # Without speculative.py (as if deleted: no module, and no file beside common.py): one line
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "speculative", None)
        patch.setattr(common, "__file__", str(tmp_path / "common.py"))
        missing = cli(*flags, "--draft-checkpoint", tiny)
    one_line_error(missing, "--draft-checkpoint needs speculative.py")


def test_text_stream_holds_back_split_characters(tiny, monkeypatch):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(tiny, "tokenizer.json"))
    ids = tok.encode("hello 🦙 world ñ").ids
    decode = tok.decode
    # a character really is split
    assert any(decode(ids[:i]).endswith("\ufffd") for i in range(len(ids)))
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stdout", buf)  # replaced after import: the stream finds it
    stream = G.TextStream(decode)
    for i in range(1, len(ids) + 1):
        stream([ids[:i]])
        assert "\ufffd" not in buf.getvalue()
    stream.finish([ids], ["the prompt"])
    assert buf.getvalue() == decode(ids) + "\n" == "hello 🦙 world ñ\n"


CONVERSATIONS = [("hi", None), ("why is the sky blue?", "be brief"),
                 ("ünïcode {{ }} <|im_end|>", "x")]


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_template_renders_as_transformers_does(tiny, thinking):
    """Qwen3's own template (the hub's tokenizer_config.json, copied by the converter), rendered by
    us and by transformers' apply_chat_template from the same files."""
    import transformers
    ours = G.Tokenizer(tiny, VOCAB)
    assert ours.chat_template == QWEN3_CHAT_TEMPLATE
    theirs = transformers.PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(tiny, "tokenizer.json"))
    for user, system in CONVERSATIONS:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": user})
        want = theirs.apply_chat_template(messages, chat_template=QWEN3_CHAT_TEMPLATE,
                                          tokenize=False, add_generation_prompt=True,
                                          enable_thinking=thinking)
        assert ours.chat(messages, thinking=thinking) == want
        assert want.endswith("<|im_start|>assistant\n"
                             + ("" if thinking else "<think>\n\n</think>\n\n"))


def user_says(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_chat_template_from_the_checkpoint_first_refused_where_it_has_none(tiny, tmp_path):
    """chat_template.jinja wins over tokenizer_config.json; a checkpoint with neither can't chat."""
    own = tmp_path / "own"
    shutil.copytree(tiny, own)
    (own / "chat_template.jinja").write_text("{{ messages[-1].content | upper }}")
    assert G.Tokenizer(str(own), VOCAB).chat(user_says("hi")) == "HI"
    (own / "chat_template.jinja").write_text("{{ messages[0].content | no_such_filter }}")
    with pytest.raises(UserError, match="the checkpoint's chat template fails: .*no_such_filter"):
        G.Tokenizer(str(own), VOCAB).chat(user_says("hi"))
    # Hugging Face's raise_exception: the template's own words
    (own / "chat_template.jinja").write_text("{{ raise_exception('Roles must alternate.') }}")
    with pytest.raises(UserError, match="chat template fails: Roles must alternate.$"):
        G.Tokenizer(str(own), VOCAB).chat(user_says("hi"))
    # Nothing to prompt with: the template's fault, not the prompt's
    (own / "chat_template.jinja").write_text("{% if false %}x{% endif %} ")
    with pytest.raises(UserError, match="the chat template renders these messages as blank"):
        G.Tokenizer(str(own), VOCAB).chat(user_says("hi"))
    one_line_error(cli("--device", "cpu", "--checkpoint", str(own), "--prompt", "hi", "--chat"),
                   "the chat template renders these messages as blank")
    for failing in ("{{ 1 / 0 }}", "{% for i in range(10 ** 9) %}{% endfor %}"):
        (own / "chat_template.jinja").write_text(failing)  # Python's errors, not Jinja's
        with pytest.raises(UserError, match="the checkpoint's chat template fails: "):
            G.Tokenizer(str(own), VOCAB).chat(user_says("hi"))
    # An error of no words (no machine holds 2^62 bytes): its name
    (own / "chat_template.jinja").write_text("{{ 'x' * 2 ** 62 }}")
    with pytest.raises(UserError, match="chat template fails: MemoryError$"):
        G.Tokenizer(str(own), VOCAB).chat(user_says("hi"))
    # Arguments of the wrong kind: ours to refuse, not the template's
    with pytest.raises(UserError, match=r"each a role \(system, user or assistant\) and a str"):
        G.Tokenizer(str(own), VOCAB).chat([{"role": "user", "content": 5}])
    with pytest.raises(UserError, match="thinking 'no': True or False"):
        G.Tokenizer(str(own), VOCAB).chat(user_says("hi"), thinking="no")
    (own / "chat_template.jinja").write_bytes(b"\xff{{ messages }}")
    with pytest.raises(UserError, match="chat_template.jinja is not UTF-8 text"):
        G.Tokenizer(str(own), VOCAB)
    (own / "chat_template.jinja").unlink()
    (own / "tokenizer_config.json").unlink()
    with pytest.raises(UserError, match="the checkpoint has no chat template"):
        G.Tokenizer(str(own), VOCAB).chat(user_says("hi"))
    one_line_error(cli("--device", "cpu", "--checkpoint", str(own), "--prompt", "hi", "--chat"),
                   "the checkpoint has no chat template: plain prompts only")


def test_a_list_of_named_chat_templates_gives_its_default(tiny, tmp_path):
    """tokenizer_config.json's chat_template as Hugging Face's list of named templates: the one
    named "default" renders, as transformers' apply_chat_template renders it; without one, the
    checkpoint has no chat template, where transformers refuses too."""
    import transformers
    own = tmp_path / "own"
    shutil.copytree(tiny, own)
    tools = {"name": "tool_use", "template": "{{ 'with tools' }}"}
    default = {"name": "default", "template": QWEN3_CHAT_TEMPLATE}
    edit_json(own / "tokenizer_config.json", chat_template=[tools, default])
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(str(own))
    messages = user_says("Why is the sky blue?")
    want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert G.Tokenizer(str(own), VOCAB).chat(messages) == want
    assert want.startswith("<|im_start|>user\nWhy is the sky blue?")
    # entries of no name and template, or a name of no str (transformers' TypeError): passed over
    odd = {"name": ["default"], "template": "{{ 'odd' }}"}
    edit_json(own / "tokenizer_config.json", chat_template=[tools, "not a template", odd, default])
    assert G.Tokenizer(str(own), VOCAB).chat(messages) == want
    edit_json(own / "tokenizer_config.json", chat_template=[tools])
    with pytest.raises(ValueError, match="no default"):
        transformers.PreTrainedTokenizerFast.from_pretrained(str(own)).apply_chat_template(
            messages, tokenize=False)
    with pytest.raises(UserError, match="the checkpoint has no chat template"):
        G.Tokenizer(str(own), VOCAB).chat(messages)


def test_a_tokenizer_of_another_model_is_refused(tiny, tmp_path):
    """A tokenizer.json of more ids than the model's, or of fewer by a thousand or more (a model
    pads its tokenizer's ids by a few hundred at most), or without a token for a stop id: another
    model's, whose ids the model can't embed or whose tokens the model's ids would decode to
    nothing."""
    from tokenizers import Tokenizer, models
    bigger = tmp_path / "bigger"
    shutil.copytree(tiny, bigger)
    words = {f"w{i}": i for i in range(VOCAB + 1)}
    Tokenizer(models.WordLevel(words, unk_token="w0")).save(str(bigger / "tokenizer.json"))
    # The tests' tokenizer for a model of 2,048 ids
    hf, wider = converted(tmp_path, vocab=2048)
    size = common.read_tokenizer(tiny).get_vocab_size()
    for path, tokens, vocab in [(bigger, VOCAB + 1, VOCAB), (wider, size, 2048)]:
        message = f"tokenizer.json of {tokens} tokens for a model of {vocab}: another model's"
        with pytest.raises(UserError, match=re.escape(message)):
            G.load(str(path))
        one_line_error(cli("--device", "cpu", "--checkpoint", str(path), "--prompt", "hi"),
                       message)
    # Fewer ids by less than a thousand: a stop id that is no token tells
    fewer = tmp_path / "fewer"
    shutil.copytree(tiny, fewer)
    last = size - 1  # </think>, the tokenizer's last token
    edit_json(fewer / "config.json", eos_token_id=last)
    assert last in G.load(str(fewer)).stop_ids
    words = {f"w{i}": i for i in range(last)}
    Tokenizer(models.WordLevel(words, unk_token="w0")).save(str(fewer / "tokenizer.json"))
    message = f"tokenizer.json lacks stop ids [{last}]: another model's"
    with pytest.raises(UserError, match=re.escape(message)):
        G.load(str(fewer))
    one_line_error(cli("--device", "cpu", "--checkpoint", str(fewer), "--prompt", "hi"), message)


def test_convert_copies_the_chat_template_file(tmp_path):
    src = tmp_path / "hf"
    hf_checkpoint(str(src))
    (src / "chat_template.jinja").write_text("{{ messages[0].content }}!")
    convert.convert(str(src), str(tmp_path / "out"))
    assert G.Tokenizer(str(tmp_path / "out"), VOCAB).chat(user_says("hey")) == "hey!"


def ctrl_c_at_the_second_check(monkeypatch):
    """CTRL_C_AT_THE_SECOND_CHECK in this process, its count from zero; undone after the test."""
    monkeypatch.undo()
    monkeypatch.setattr(G.TextStream, "__call__", G.TextStream.__call__)
    exec(textwrap.dedent(CTRL_C_AT_THE_SECOND_CHECK), {"generate": G})


def test_cli_ctrl_c_prints_what_was_generated_and_exits_130(tiny, monkeypatch):
    # sampled: a random model's greedy text may be all invisible
    args = ["--device", "cpu", "--checkpoint", tiny, "--max-new-tokens", "100",
            "--check-every", "2", "--temperature", "1", "--seed", "0"]
    full = cli(*args, "--prompt", "hello").stdout
    ctrl_c_at_the_second_check(monkeypatch)
    r = cli(*args, "--prompt", "hello")
    assert r.returncode == 130 and "Traceback" not in r.stderr, r.stderr
    assert (len(r.stdout) > 1 and full.startswith(r.stdout.removesuffix("\n"))
            and len(r.stdout) < len(full))
    # The report of what was made: the two checks' tokens
    assert r.stderr.splitlines()[-1].startswith("Interrupted: 3 new tokens in 1 row."), r.stderr
    ctrl_c_at_the_second_check(monkeypatch)
    r = cli(*args, "--prompt", "hello", "--prompt", "world")
    assert r.returncode == 130 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.startswith("--- hello\n") and "--- world\n" in r.stdout


@pytest.mark.beside
@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGHUP"])
def test_cli_stopped_by_a_signal_ends_as_ctrl_c_does(tiny, signal_name):
    args = ["--device", "cpu", "--checkpoint", tiny, "--max-new-tokens", "100", "--check-every",
            "2", "--temperature", "1", "--seed", "0", "--prompt", "hello"]
    patch = CTRL_C_AT_THE_SECOND_CHECK.replace(
        "raise KeyboardInterrupt", f"os.kill(os.getpid(), signal.{signal_name})")
    r = with_patch("\n    import os, signal" + patch, "generate.py", *args)
    assert r.returncode == 130 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stdout) > 1 and r.stderr.splitlines()[-1].startswith("Interrupted: ")


@pytest.mark.parametrize("script", ["generate.py", "convert_hf_checkpoint.py"])
def test_cli_ctrl_c_while_torch_loads_is_quiet(script):
    """Ctrl-C while torch's own modules are importing (KeyboardInterrupt raised there, as Python
    raises it for SIGINT; a signal sent after a fixed delay lands anywhere, and a library's bare
    `except:` can swallow it), in generate.py and in the converter: exit 130, no traceback."""
    code = f"""
import runpy, sys
class Pressed:
    def find_spec(self, name, path=None, target=None):
        if name == "torch.functional":  # imported by torch's __init__
            raise KeyboardInterrupt
sys.meta_path.insert(0, Pressed())
sys.argv = [{script!r}]  # never parsed: the imports come first
runpy.run_path({os.path.join(HERE, script)!r}, run_name="__main__")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=LIMIT)
    assert r.returncode == 130 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr


def test_cli_prompt_too_long_prints_no_stray_line(tiny):
    r = cli("--device", "cpu", "--checkpoint", tiny, "--prompt", "hello", "--max-new-tokens", "100",
            "--cache-len", "50")
    one_line_error(r, "over the cache length")
    assert r.stdout == ""


def test_stop_ids_out_of_the_vocabulary_name_the_flag_alone(tiny):
    """--stop-ids past the vocabulary: the flag's ids, not the model's own eos ids besides."""
    for ids in ("-5", str(VOCAB), str(10 ** 30)):
        r = cli("--device", "cpu", "--checkpoint", tiny, "--prompt", "hi", "--stop-ids", ids)
        assert r.returncode == 1 and r.stderr.endswith(
            f"error: --stop-ids: ids in [0, {VOCAB}), please\n"), r.stderr


def test_the_cache_holds_a_buckets_length(tiny, monkeypatch, capsys):
    """Without --cache-len the cache's length is the bucket of the prompt + max new tokens: another
    prompt or --max-new-tokens of the same bucket keeps the compiled decode step's shapes, and a
    second run finds it in inductor's cache."""
    capacities = []
    real = G.Generator

    def spy(model, **kw):
        capacities.append(kw["capacity"])
        return real(model, **kw)
    monkeypatch.setattr(G, "Generator", spy)
    for max_new in (5, 7, 200):
        G.main(["--device", "cpu", "--checkpoint", tiny, "--prompt", "hello world",
                "--max-new-tokens", str(max_new)])
    assert capacities == [64, 64, 256]


@pytest.mark.parametrize("args,message", [
    (["--temperature", "-1"], "temperature -1.0: must be 0 (greedy) or in [0.001, 1e6)"),
    (["--temperature", "nan"], "temperature nan: must be 0 (greedy) or in [0.001, 1e6)"),
    (["--max-new-tokens", str(10 ** 400)], "is over the cache length (2048)"),
    # what Python makes of a non-UTF-8 argument
    (["--prompt", "caf\udce9"], "is not a str of valid UTF-8 text"),
    (["--top-p", "0"], "top_p 0.0: must be in (0, 1]"),
    (["--top-p", "1.5"], "top_p 1.5: must be in (0, 1]"),
    (["--temperature", "1e-45"], "temperature 1e-45: must be 0 (greedy) or in [0.001, 1e6)"),
    (["--seed", "1180591620717411303424"], "--seed 1180591620717411303424: must be in [0, 2^64)"),
    (["--seed", "-1"], "--seed -1: must be in [0, 2^64)"),
    (["--top-k", "-2"], "top_k must be an int of at least 0, not -2"),
    (["--prompt", "   "], "empty prompt"),
    (["--max-new-tokens", "100", "--cache-len", "50"],
     "over the cache length (50): fewer --max-new-tokens, or a longer --cache-len"),
    (["--max-new-tokens", "5000"], "max new tokens (5000) is over the cache length (2048): fewer "
     "--max-new-tokens, or a longer --cache-len (at most the model's 2048)"),
    (["--cache-len", "5000"],
     "a cache of 5000 positions is over the model's 2048: ask for fewer positions (--cache-len)"),
    (["--stop-ids"], "argument --stop-ids: expected at least one argument"),
    (["--cache-len", "-5"], "--cache-len: must be at least 1"),
    (["--cache-len", "-1"], "--cache-len: must be at least 1"),
    (["--cache-len", "0"], "--cache-len: must be at least 1"),
    (["--check-every", "0"], "--check-every: must be at least 1"),
    (["--max-new-tokens", "x"], "invalid positive value"),
    (["--device", "foo"], "unknown device 'foo'"),
    (["--checkpoint", "/nonexistent"], "no converted checkpoint"),
    (["--system", "be brief"], "go with --chat"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--stop-ids", "-5"], "--stop-ids: ids in [0, 512), please"),
    (["--stop-ids", str(10 ** 30)], "--stop-ids: ids in [0, 512), please"),
    (["--checkpoint", ""], "'' is no path: name a converted checkpoint"),
])
def test_cli_bad_input_one_line(tiny, args, message):
    argv = ["--device", "cpu", "--checkpoint", tiny, "--prompt", "hello world", *args]
    with pytest.raises(SystemExit) as e:
        G.main(argv)
    assert str(e.value.code).startswith("error: ") and message in str(e.value.code), e.value.code
    assert "\n" not in str(e.value.code)


def edit_json(path, **changes):
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_cli_bad_files_one_line(tiny, tmp_path):
    """Broken files, each run as a user runs the CLI: exit 1, one 'error:' line, no traceback."""
    def broken(name, change):
        path = tmp_path / name
        shutil.copytree(tiny, path)
        change(path)
        return str(path)
    def shard(p):
        return next(p.glob("model-*.safetensors"))
    cases = {
        broken("truncated", lambda p: shard(p).write_bytes(shard(p).read_bytes()[:1000])):
            "not a readable safetensors file",
        broken("config", lambda p: (p / "config.json").write_text("{oops")):
            "not a readable JSON file",
        broken("genconfig",
               lambda p: (p / "generation_config.json").write_text("[1,")): "not a readable JSON",
        broken("noweights", lambda p: shard(p).unlink()): "no model*.safetensors files",
        broken("tokenizer", lambda p: (p / "tokenizer.json").write_text("{")):
            "no readable tokenizer",
        broken("config-str", lambda p: (p / "config.json").write_text('"qwen3"')):
            "not a JSON object but str",
        broken("config-list", lambda p: (p / "config.json").write_text("[]")):
            "not a JSON object but list",
        broken("config-type", lambda p: edit_json(p / "config.json", num_hidden_layers="two")):
            "num_hidden_layers is 'two'",
        broken("genconfig-list", lambda p: (p / "generation_config.json").write_text("[]")):
            "not a JSON object",
        broken("genconfig-hot",
               lambda p: edit_json(p / "generation_config.json", temperature="hot")):
            "temperature 'hot'",
        broken("genconfig-cold", lambda p: edit_json(p / "generation_config.json", temperature=-1)):
            "temperature -1: must be 0 (greedy) or in [0.001, 1e6)",
        str(tmp_path / "hf"): "is a Hugging Face snapshot or an older conversion: convert the",
        # converted when gate_up_proj's rows were interleaved: its config.json says "pairs"
        broken("older", lambda p: edit_json(p / "config.json", gate_up="pairs")):
            "an older conversion: convert the snapshot",
        broken("nested", lambda p: (p / "config.json").write_text("[" * 100_000)):
            "config.json: not a readable JSON file",
        broken("eos-past-vocab", lambda p: edit_json(p / "config.json", eos_token_id=[2 ** 70])):
            f"config.json: eos_token_id [{2 ** 70}] is not token ids in [0, {VOCAB})",
        # the shard a link to nothing
        broken("dangling", lambda p: (p / "model-00001-of-00001.safetensors").unlink()
               or (p / "model-00001-of-00001.safetensors").symlink_to(p / "gone")):
            "not readable (a broken link, or permissions)",
    }
    hf_checkpoint(str(tmp_path / "hf"))
    for path, message in cases.items():  # in this process: a traceback would fail the test as well
        with pytest.raises(SystemExit) as e:
            G.main(["--device", "cpu", "--checkpoint", path, "--prompt", "hi", "--chat"])
        assert (str(e.value.code).startswith("error: ")
                and message in str(e.value.code)), (path, e.value.code)
        assert "\n" not in str(e.value.code)
    one_line_error(cli("--device", "cpu", "--checkpoint", str(tmp_path / "config-list"),
                       "--prompt", "hi"),
                   "not a JSON object")  # and as a user runs it


@pytest.mark.beside
def test_cli_stdout_closed_early_exits_quietly(tiny):
    """`generate.py ... | head -c 20`: the reader is gone before the text; no traceback, Unix's exit
    141."""
    read, write = os.pipe()
    os.close(read)
    command = [sys.executable, os.path.join(HERE, "generate.py"), "--device", "cpu",
               "--checkpoint", tiny, "--prompt", "hello", "--max-new-tokens", "8"]
    r = subprocess.run(command, stdout=write, stderr=subprocess.PIPE, text=True, timeout=LIMIT)
    os.close(write)
    assert r.returncode == 141 and "Traceback" not in r.stderr and "Error" not in r.stderr, r.stderr


@pytest.mark.beside
def test_cli_invalid_utf8_prompt_is_one_line(tiny):
    command = [sys.executable, os.path.join(HERE, "generate.py"), "--device", "cpu",
               "--checkpoint", tiny, "--prompt", b"caf\xe9"]
    r = subprocess.run(command, capture_output=True, text=True, timeout=LIMIT)
    one_line_error(r, "is not a str of valid UTF-8 text")


def test_eos_comes_from_config_json_too(tiny, tmp_path):
    """Without generation_config.json, generation stops on config.json's eos_token_id; with it, on
    both files' (here config.json's <|im_start|>, 1, and generation_config.json's two)."""
    path = tmp_path / "no-genconfig"
    shutil.copytree(tiny, path)
    edit_json(path / "config.json", eos_token_id=1)
    eos = json.loads((path / "generation_config.json").read_text())["eos_token_id"]
    assert G.load(str(path)).stop_ids == {1, *eos}
    (path / "generation_config.json").unlink()
    checkpoint = G.load(str(path))
    assert checkpoint.stop_ids == {1} and checkpoint.sampling == GREEDY


def test_report_says_what_a_user_can_act_on():
    stats = G.GenerationStats(prefill_s=0.05, warmup_s=2.0, decode_s=0.5, decode_tokens=50)
    assert stats.report([[1] * 30, [2] * 52]) == (
        "82 new tokens in 2 rows. Time to first token 0.050 s; compiling or capturing decode steps "
        "2.00 s; then 100.0 tok/s per row, 200.0 in all, over 50 tokens a row.")
    one = G.GenerationStats(prefill_s=0.05, warmup_s=0.0, decode_s=0.0, decode_tokens=0)
    assert one.report([[1]]) == "1 new token in 1 row. Time to first token 0.050 s."
    once = G.GenerationStats(prefill_s=0.05, warmup_s=0.1, decode_s=0.01, decode_tokens=1,
                             interrupted=True)
    assert once.report([[1, 2, 3]]) == (
        "Interrupted: 3 new tokens in 1 row. Time to first token 0.050 s; compiling or capturing "
        "decode steps 0.10 s; then 100.0 tok/s per row, 100.0 in all, over 1 token a row.")
    # Speculative rounds: 35 tokens kept in 10 rounds, 25 drafts accepted of the 30 checked
    rounds = S.SpeculationStats(0.05, 0.0, 0.5, 34, rounds=10, kept=35, full=5)
    assert rounds.report([[1] * 35]) == (
        "35 new tokens in 1 row. Time to first token 0.050 s; then 68.0 tok/s per row, 68.0 in "
        "all, over 34 tokens a row. Drafts: 3.50 tokens kept a round; 83.3% accepted of those "
        "checked (up to a rejection).")


def test_cli_float16(tiny, capsys):
    G.main(["--device", "cpu", "--checkpoint", tiny, "--prompt", "hello", "--dtype", "float16",
            "--max-new-tokens", "6", "--temperature", "1", "--seed", "0"])
    out = capsys.readouterr()
    assert "6 new tokens" in out.err and len(out.out.strip()) > 0, out


@pytest.mark.beside
# ---------------------------------------------------------------- loading, the first text, faults

def test_loading_and_an_eager_generation_never_import_dynamo(tiny):
    """torch._dynamo takes seconds to import: only --compile needs it (nn.Embedding's random init on
    the meta device used to pull it in at every load)."""
    code = f"""
        import sys
        sys.path.insert(0, {HERE!r})
        import generate
        checkpoint = generate.load({tiny!r})
        gen = generate.Generator(checkpoint.model, batch=1, capacity=64,
                                 sampling=generate.SamplingParams(temperature=1.0, top_k=5))
        gen.generate([[1, 2, 3]], max_new=8, stop_ids=set())
        assert "torch._dynamo" not in sys.modules
        generate.Generator(checkpoint.model, batch=1, capacity=64, sampling=checkpoint.sampling,
                           compile=True)
        assert "torch._dynamo" in sys.modules  # the check can fail"""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=LIMIT)
    assert r.returncode == 0, r.stderr


def test_the_first_check_comes_right_after_the_prefill(tiny):
    """The first text as soon as the first token exists, then every check_every steps."""
    gen = generator(tiny, batch=2)
    seen = []
    rows, stats = gen.generate([[1, 2, 3], [4, 5, 6, 7, 8]], max_new=20, stop_ids=set(),
                               check_every=8, on_tokens=lambda rows: seen.append(len(rows[0])))
    assert seen == [1, 9, 17, 20] and list(map(len, rows)) == [20, 20]
    # Eagerly every decode step is timed as one
    assert stats.decode_tokens == 19 and stats.prefill_s > 0 and stats.warmup_s == 0
    seen.clear()
    gen.generate([[1, 2, 3]], max_new=1, stop_ids=set(), on_tokens=lambda rows: seen.append(rows))
    assert len(seen) == 1 and len(seen[0][0]) == 1


def tty_stderr(command: list[str]) -> tuple[int, str]:
    """Runs `command` with stderr on a pseudo-terminal; its exit status and what it wrote there."""
    import pty
    main, secondary = pty.openpty()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=secondary)
    os.close(secondary)
    written = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:  # the terminal's other end closed
            break
        if not chunk:
            break
        written += chunk
    os.close(main)
    return process.wait(timeout=LIMIT), written.decode()


@pytest.mark.beside
def test_progress_lines_on_a_terminal_alone(snapshot, tmp_path):
    """Loading and converting draw a progress line on stderr where it is a terminal; a log gets
    none."""
    out = tmp_path / "out"
    script = os.path.join(HERE, "convert_hf_checkpoint.py")
    status, written = tty_stderr([sys.executable, script, "--checkpoint-dir", str(snapshot),
                                  "--output", str(out)])
    assert status == 0 and f"\rwriting {tmp_path / 'out'}: 100%" in written, written
    status, written = tty_stderr([sys.executable, os.path.join(HERE, "generate.py"), "--device",
                                  "cpu", "--checkpoint", str(out), "--prompt", "hi",
                                  "--max-new-tokens", "2"])
    assert status == 0 and f"\rloading {out}: 100%\r\n" in written, written
    assert " ..." not in written  # no "loading ..." line besides
    r = cli("--device", "cpu", "--checkpoint", str(out), "--prompt", "hi", "--max-new-tokens", "2")
    assert r.returncode == 0 and "%" not in r.stderr and r.stderr.startswith("loading")


def test_convert_refuses_while_another_conversion_to_its_output_runs(snapshot, tmp_path, capsys):
    """A conversion writes into a hidden .converting-NAME beside its output: a second one to the
    same output, or one after a conversion killed outright (SIGKILL, out of memory), finds it and
    stops at once, naming it and leaving it as it is; --output '' is refused too."""
    out = tmp_path / "out"
    running = tmp_path / ".converting-out"
    running.mkdir()
    (running / "model-00003.safetensors").write_bytes(b"partial")
    argv = ["--checkpoint-dir", str(snapshot), "--output", str(out)]
    message = convert_error(argv, capsys)
    assert message.startswith(f"error: {running} exists: another conversion to {out} is running")
    assert not out.exists() and (running / "model-00003.safetensors").read_bytes() == b"partial"
    running.rename(tmp_path / "kept")
    message = convert_error(["--checkpoint-dir", str(snapshot), "--output", ""], capsys)
    assert message == "error: --output is empty: name a new directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "kept"]
    assert not (snapshot / "converted").exists()


CONFIG_BASE = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 160, "num_hidden_layers": 2,
               "vocab_size": VOCAB, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048}
MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 8,
       "num_experts_per_tok": 2}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize("changes,message", [
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps is nan, not a valid value"),
    ({"rope_theta": float("inf")}, "rope_theta is inf, not a valid value"),
    ({"head_dim": 0}, "head_dim is 0; it must be above 0"),
    # older configs' head_dim: hidden_size // num_attention_heads, divided by neither 0 nor more
    ({"num_attention_heads": 0}, "num_attention_heads is 0; it must be above 0"),
    ({"hidden_size": 2}, "hidden_size is under num_attention_heads"),
    ({"num_key_value_heads": 3}, "num_attention_heads is no multiple of num_key_value_heads"),
    ({**MOE, "decoder_sparse_step": 0}, "decoder_sparse_step is 0; it must be above 0"),
    ({**MOE, "num_experts_per_tok": 9}, "num_experts_per_tok is over num_experts"),
    ({**MOE, "num_experts_per_tok": 0}, "num_experts_per_tok is 0; it must be above 0"),
    ({**MOE, "moe_intermediate_size": 0}, "moe_intermediate_size is 0; it must be above 0"),
    ({"rope_parameters": {**YARN, "factor": 0}}, "YaRN's factor is 0; it must be above 0"),
    ({"rope_parameters": {**YARN, "original_max_position_embeddings": 0}},
     "YaRN's original_max_position_embeddings is 0"),
    ({"rope_parameters": {**YARN, "beta_fast": -1}}, "YaRN's beta_fast is -1"),
    ({"rope_parameters": {**YARN, "rope_theta": 1}}, "rope_theta is 1; YaRN needs it above 1"),
    ({"rope_parameters": {**YARN, "factor": float("nan")}},
     "YaRN parameters {'factor': nan, 'original_max_position_embeddings': 32} are not all numbers"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rope_scaling": YARN},
     "rope_parameters and rope_scaling disagree: keep one"),
    # our config.json's own YaRN parameters
    ({"yarn": {"factor": "4", "original_max_position_embeddings": 32}},
     "YaRN parameters {'factor': '4', 'original_max_position_embeddings': 32} are not all numbers"),
    ({"yarn": [4]}, "YaRN parameters [4] are not all numbers below 2^40"),
    # sizes past any Qwen3's, each: building the model would take minutes, or overflow
    *[({name: 2 ** 39}, "sizes far past any Qwen3's") for name in
      ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size", "head_dim",
       "max_position_embeddings")],
    # numbers past any config.json's: an int too large for a float, an overflowing YaRN context
    *[({name: 10 ** 400}, "0, not a valid value") for name in
      ("num_hidden_layers", "rms_norm_eps", "rope_theta", "max_position_embeddings")],
    ({"rope_parameters": {**YARN, "factor": 1e308}}, "YaRN parameters {'factor': 1e+308"),
    ({"rope_parameters": {**YARN, "factor": 10 ** 400}}, "are not all numbers below 2^40"),
    # architectures of any JSON type
    *[({"architectures": value}, "(model_type qwen3) is no Qwen3 we run")
      for value in ([["Qwen3ForCausalLM"]], {"a": 1}, 5, "Qwen3ForCausalLM")],
    ({"num_hidden_layers": 5000}, "sizes far past any Qwen3's"),
    ({**MOE, "num_experts": 2 ** 30, "moe_intermediate_size": 2 ** 20},
     "sizes far past any Qwen3's"),
], ids=lambda value: str(value)[:40])
def test_config_values_that_describe_no_model_are_refused(changes, message):
    """Each value that leaves the model undefined, refused by the checks that the converter (before
    it writes) and generate.py's loader share, naming the field."""
    with pytest.raises(UserError, match=re.escape(message)):
        common.model_args({**CONFIG_BASE, **changes})


def test_config_nulls_are_the_defaults():
    """A null, as transformers reads it: the value not set."""
    names = ["yarn", "num_experts", "rope_theta", "decoder_sparse_step", "num_experts_per_tok",
             "mlp_only_layers", "head_dim", "rope_parameters", "num_local_experts"]
    for config in (CONFIG_BASE, {**CONFIG_BASE, **MOE}):
        nulls = {name: None for name in names if name not in config}
        args = common.model_args({**config, **nulls})
        assert args == common.model_args(config) and args.yarn == {} and args.mlp_only_layers == []


def test_config_values_refused_in_one_line_by_both_commands(snapshot, tiny, tmp_path):
    """A config.json that describes no model: the converter says so in one line and writes
    nothing; generate.py says so in one line for a converted checkpoint edited after."""
    edit_json(snapshot / "config.json", rms_norm_eps=float("nan"))
    out = tmp_path / "out"
    r = cli("--checkpoint-dir", str(snapshot), "--output", str(out),
            script="convert_hf_checkpoint.py")
    assert r.returncode == 1 and r.stderr == ("error: config.json: rms_norm_eps is nan, not a "
                                              "valid value\n") and not out.exists(), r.stderr
    copy = tmp_path / "copy"
    shutil.copytree(tiny, copy)
    edit_json(copy / "config.json", decoder_sparse_step=0)
    r = cli("--checkpoint", str(copy), "--prompt", "hi", "--device", "cpu")
    assert r.returncode == 1 and r.stderr.endswith(
        "error: config.json: decoder_sparse_step is 0; it must be above 0\n"), r.stderr


@pytest.mark.beside
@pytest.mark.parametrize("closed", [1, 2], ids=["stdout", "stderr"])
def test_cli_with_a_closed_stream_stops_before_any_work(tiny, closed):
    """`>&-` or `2>&-`: no text or error would be seen. Exit 1 before loading, saying so on stderr
    where stderr is open."""
    script = os.path.join(HERE, "generate.py")
    r = subprocess.run([sys.executable, script, "--checkpoint", tiny, "--prompt", "hi", "--device",
                        "cpu"], capture_output=closed == 1, text=True, timeout=LIMIT,
                       preexec_fn=lambda: os.close(closed))
    assert r.returncode == 1
    if closed == 1:
        assert r.stderr == "error: stdout or stderr is closed: give the text and the errors " \
                           "somewhere to go\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file whatever its permissions")
def test_an_unreadable_shard_is_named_in_one_line(tiny, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny, copy)
    shard = sorted(copy.glob("model*.safetensors"))[0]
    shard.chmod(0)
    with pytest.raises(UserError, match=f"{shard}: not readable by you"):
        G.load(str(copy))


def test_convert_checks_what_it_copies_and_every_weight(snapshot, tmp_path, capsys):
    """A broken tokenizer.json or a generation_config.json that isn't JSON is refused when
    converting, not later (its settings are checked where they are used, by generate.load); a
    tensor in two files and a weight that is not finite are refused, naming the tensor."""
    out = tmp_path / "out"
    argv = ["--checkpoint-dir", str(snapshot), "--output", str(out)]
    tokenizer = (snapshot / "tokenizer.json").read_text()
    (snapshot / "tokenizer.json").write_text("{}")
    assert "tokenizer.json: no readable tokenizer" in convert_error(argv, capsys)
    (snapshot / "tokenizer.json").write_text(tokenizer)
    generation = (snapshot / "generation_config.json").read_text()
    (snapshot / "generation_config.json").write_text("{")
    assert "generation_config.json: not a readable JSON file" in convert_error(argv, capsys)
    (snapshot / "generation_config.json").write_text(generation)
    shards = sorted(snapshot.glob("*.safetensors"))
    first = load_file(shards[0])
    name = sorted(first)[0]
    save_file({name: first[name]}, snapshot / "z.safetensors")
    assert f"tensor {name} is in {shards[0]} too" in convert_error(argv, capsys)
    (snapshot / "z.safetensors").unlink()
    first[name][0, 0] = float("nan")
    save_file(first, shards[0], metadata={"format": "pt"})
    assert f"{shards[0]}: {name} holds values that are not finite" in convert_error(argv, capsys)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_convert_writes_shards_readable_as_the_snapshots_files(snapshot, tmp_path):
    """0666 less the umask, as any new file (safetensors makes its files private)."""
    out = tmp_path / "out"
    convert.convert(str(snapshot), str(out), shard_bytes=1 << 16)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert len(modes) > 4 and set(modes.values()) == {0o666 & ~current_umask()}, modes


def test_loading_refuses_a_tensor_in_two_files(tiny, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny, copy)
    shard = sorted(copy.glob("model*.safetensors"))[0]
    tensors = load_file(shard)
    name = sorted(tensors)[0]
    save_file({name: tensors[name]}, copy / "model-99999.safetensors")
    with pytest.raises(UserError, match=f"tensor {name} is in {shard} too"):
        G.load(str(copy))


def test_an_optional_file_there_but_unreadable_is_an_error(tmp_path, monkeypatch):
    """qwen3_triton.py (or any optional file of ours) as a dangling link or a directory: an error
    naming it, not "missing", which would run many times slower without a word; one that isn't
    there is missing."""
    monkeypatch.setattr(common, "__file__", str(tmp_path / "common.py"))
    (tmp_path / "dangling_optional.py").symlink_to(tmp_path / "nowhere.py")
    (tmp_path / "directory_optional.py").mkdir()
    for name in ("dangling_optional", "directory_optional"):
        with pytest.raises(UserError, match=re.escape(f"{tmp_path / name}.py: unreadable: mend")):
            common.optional(name)
    assert common.optional("absent_optional") is None


def test_loading_refuses_a_weight_of_ints_where_floats_belong(tiny, tmp_path):
    """A weight of the right shape stored as int32 (another tool's file): refused by name, where
    it would fail inside load_state_dict; a quantized checkpoint's int weights load (int8 tests)."""
    copy = tmp_path / "copy"
    shutil.copytree(tiny, copy)
    shard = sorted(copy.glob("model*.safetensors"))[0]
    tensors = load_file(shard)
    name = sorted(tensors)[0]
    save_file({**tensors, name: tensors[name].to(torch.int32)}, shard)
    with pytest.raises(UserError, match=re.escape(f"weights do not match config.json ({name})")):
        G.load(str(copy))


@pytest.mark.beside
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_stdout_is_one_line(tiny, snapshot, tmp_path):
    """generate.py and the converter writing to a full disk (/dev/full): one line, exit 1."""
    with open("/dev/full", "w") as full:
        command = [sys.executable, os.path.join(HERE, "generate.py"), "--device", "cpu",
                   "--checkpoint", tiny, "--prompt", "hi", "--max-new-tokens", "4"]
        r = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, text=True, timeout=LIMIT)
        one_line_error(r, "[Errno 28] No space left on device")
        # The converter writes nothing to stdout: its one message is on stderr
        command = [sys.executable, os.path.join(HERE, "convert_hf_checkpoint.py"),
                   "--checkpoint-dir", str(snapshot), "--output", str(tmp_path / "out")]
        r = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, text=True, timeout=LIMIT)
        assert r.returncode == 0 and r.stderr == f"wrote {tmp_path / 'out'}\n", r.stderr
        assert (tmp_path / "out" / "config.json").is_file()


# ---------------------------------------------------------------- tensor parallelism (tp.py)

# Run by each process of a torchrun, for each checkpoint it is given: the logits of a prefill and
# of 16 greedy steps through the rank's share of the model, then the tokens of Generator runs,
# greedy and sampled, of one prompt and of a batch; with kernels, then one prompt through the
# fast path (Triton's interpreter). Rank 0 then runs the same through the whole model, as one
# process does without torchrun: the reference.
TP_SCRIPT = """
import sys
import torch
sys.path.insert(0, {here!r})
import generate as G, tp


def outputs(path, kernels, split):
    model = G.load(path, "cpu", torch.float32, split).model
    model.setup_cache(1, 96)
    tokens = torch.tensor([[5, 3, 9, 27, 4, 11, 2, 8]])
    logits = []
    with torch.no_grad():
        logits.append(model(tokens, torch.arange(8)[None])[0])
        for step in range(16):
            token = logits[-1][-1].argmax()[None, None]
            position = torch.tensor([[8 + step]])
            logits.append(model(token, position, 9 + step)[0])
    runs = []
    for prompts in ([[5, 3, 9]], [[5, 3, 9], [7, 1, 2, 6, 30, 4]]):
        for sampling in (G.SamplingParams(),
                         G.SamplingParams(temperature=1.0, top_k=40, top_p=0.9)):
            torch.manual_seed(0)
            gen = G.Generator(model, batch=len(prompts), capacity=96, sampling=sampling,
                              use_kernels=False)
            runs.append(gen.generate(prompts, max_new=16, stop_ids=set())[0])
    if kernels:  # one decode step: the interpreter is slow
        gen = G.Generator(model, batch=1, capacity=96, sampling=G.SamplingParams(),
                          use_kernels=True)
        runs.append(gen.generate([[5, 3, 9]], max_new=2, stop_ids=set())[0])
    return dict(logits=torch.cat(logits), runs=runs)


out, *cases = sys.argv[1:]  # then a case's name, its checkpoint and 1 or 0 (kernels), each case
split = tp.start(torch.device("cpu"))
for name, path, kernels in zip(cases[::3], cases[1::3], cases[2::3]):
    torch.save(outputs(path, kernels == "1", split), f"{{out}}/{{name}}-{{split.rank}}.pt")
    if split.rank == 0:
        torch.save(outputs(path, kernels == "1", None), f"{{out}}/{{name}}-alone.pt")
tp.exit_now()  # as generate.py ends: past gloo's teardown
"""


def torchrun_env(tmp_path) -> dict:
    """The environment of a torchrun in a test: a thread a process, and TMPDIR the test's own
    tmp_path, where torchrun makes its log folder (torchelastic_...) and leaves it."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}


def quantized_of(tmp_path, mode, **kw):
    """A tiny checkpoint (converted's keywords) quantized as `mode`; int4 in groups of 8 columns,
    of which the tiny layers' inputs are whole numbers (the experts' too with
    moe_intermediate_size=64, and each share of them up to 4 ranks)."""
    hf, path = converted(tmp_path, **kw)
    out = str(tmp_path / mode)
    Q.quantize_checkpoint(path, out, mode, group_size=8 if mode == "int4" else None)
    return out


# A case's checkpoint and processes
SPLITS = {"dense": ("tiny", 2), "moe": ("tiny_moe", 2), "int8": ("int8", 2), "int4": ("int4", 2),
          "dense-kv-replicated": ("tiny", 4)}


def start_splits(tmp_path_factory, paths: dict) -> dict:
    """SPLITS' torchruns started, one a number of processes with every case of that number in it
    (a torchrun's start is most of its time): {"split2": Started, "split4": ...}, each writing
    TP_SCRIPT's results into its folder. paths: each checkpoint of SPLITS."""
    # The interpreter is slow: not every case (the int4 kernels' model test is the next section's)
    interpreted = fast is not None and not OLD_INTERPRETER
    runs = {}
    for processes in (2, 4):
        folder = tmp_path_factory.mktemp(f"split{processes}")
        env = torchrun_env(folder)
        if interpreted:
            env["TRITON_INTERPRET"] = "1"
        script = folder / "tp_run.py"
        script.write_text(TP_SCRIPT.format(here=HERE))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={processes}", str(script), str(folder)]
        for case, (checkpoint, count) in SPLITS.items():
            kernels = interpreted and processes == 2 and checkpoint not in ("tiny_moe", "int4")
            if count == processes:
                command += [case, paths[checkpoint], str(int(kernels))]
        runs[f"split{processes}"] = Started(command, folder, env)
    return runs


@pytest.fixture(scope="module")
def split_runs(started, tiny, tiny_moe) -> dict:
    """TP_SCRIPT's results of each SPLITS case: (one process's, [each rank's]). Its checkpoints
    asked for: made before OnDemand starts the torchruns."""
    results = {}
    for case, (_, processes) in SPLITS.items():
        run = started[f"split{processes}"]
        r = run.result()
        assert r.returncode == 0, r.stderr[-3000:]
        ranks = [torch.load(run.folder / f"{case}-{rank}.pt") for rank in range(processes)]
        results[case] = torch.load(run.folder / f"{case}-alone.pt"), ranks
    return results


@pytest.mark.parametrize("case", SPLITS)
def test_tensor_parallel_ranks_equal_one_process(case, split_runs):
    """torchrun, gloo: fp32 logits within 1e-5 of one process's over a prefill and 16 steps, the
    same greedy and sampled tokens (one prompt and a batch) on every rank. With 4 ranks the tiny
    model's 2 kv heads are each replicated over 2 ranks. Where Triton is installed, a prompt runs
    through the fast path too (greedy), whose kernels add the residual on one rank alone."""
    alone, ranks = split_runs[case]
    for rank in ranks:
        assert (rank["logits"] - alone["logits"]).abs().max() <= 1e-5
        assert rank["runs"] == alone["runs"] == ranks[0]["runs"]
    assert len(alone["runs"][0][0]) == 16 and len(set(alone["runs"][1][0])) > 1


class CountingSlice:
    """A safetensors slice over a tensor that counts the elements read through it."""

    def __init__(self, tensor):
        self.tensor = tensor
        self.read = 0

    def get_shape(self):
        return list(self.tensor.shape)

    def __getitem__(self, index):
        part = self.tensor[index]
        self.read += part.numel()
        return part


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_reads_each_rank_its_share(world, tmp_path):
    """Every split tensor of a dense and a MoE checkpoint, int8 and int4: each rank reads its share
    exactly (1/world of it; of q 1/world and of k and v 1/2 where 4 ranks replicate 2 kv heads),
    the rest whole; the ranks' shares put back together are the tensor. An int4 model whose
    experts' inputs would split into parts of groups is refused, naming the worlds that don't."""
    import tp
    for mode in ("int8", "int4"):
        dense = quantized_of(tmp_path / mode / "dense", mode)
        moe = quantized_of(tmp_path / mode / "moe", mode, moe=dict(moe_intermediate_size=64))
        for path in (dense, moe):
            assert_reads_shares(path, mode, world, tp)
    # 40 inputs an expert's down_proj: 20 a rank, 2 groups and a half
    path = quantized_of(tmp_path / "ragged", "int4", moe={})
    split = tp.TensorParallel(1, 2, torch.device("cpu"))
    with pytest.raises(UserError, match=r"^2 processes can't split this model \(int4: in whole "
                                        r"groups of 8\): use one of \[1\]$"):
        G.load_model(path, split=split)


def assert_reads_shares(path, mode, world, tp):
    """test_tensor_parallel_reads_each_rank_its_share's checks of one checkpoint."""
    tensors = load_file(next(pathlib.Path(path).glob("model*.safetensors")))
    config = json.load(open(os.path.join(path, "config.json")))
    args = common.model_args(config)
    for name, tensor in tensors.items():
        shares, reads = [], []
        for rank in range(world):
            split = tp.TensorParallel(rank, world, torch.device("cpu"))
            split.rank_args(args, config)
            part = CountingSlice(tensor)
            shares.append(split.read(name, part))
            reads.append(part.read)
        # An int8 scale, one per output row, in its last dimension; int4's scales and offsets,
        # rows and a column per group, as a weight
        leaf = "scale" if mode == "int8" and name.endswith("_scale") else "weight"
        # "layers.0.mlp.experts.down_proj_scale" -> down_proj
        module = [p for p in re.sub("_(scale|offset)$", "", name).split(".")
                  if p.endswith("_proj")]
        module = (module or [None])[-1]
        if module in ("o_proj", "down_proj") and leaf == "weight":
            assert reads == [tensor.numel() // world] * world, name
            assert torch.equal(torch.cat(shares, -1), tensor), name
        elif module in ("qkv_proj", "gate_up_proj"):
            q = args.num_attention_heads * args.head_dim
            kv = args.num_key_value_heads * args.head_dim
            rows = [q // world, kv // min(world, 2), kv // min(world, 2)]
            if module == "gate_up_proj":
                rows = [tensor.shape[-2 if leaf == "weight" else -1] // world]
            per_row = tensor.numel() // tensor.shape[-2 if leaf == "weight" else -1]
            assert reads == [sum(rows) * per_row] * world, name
        else:
            assert reads == [tensor.numel()] * world and all(
                torch.equal(share, tensor) for share in shares), name


def test_tensor_parallel_a_world_that_does_not_split_the_model_is_one_line(tiny, tmp_path):
    """3 processes for 4 heads: one error line, from rank 0 (torchrun reports the failure too)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
               os.path.join(HERE, "generate.py"), "--device", "cpu", "--checkpoint", tiny,
               "--prompt", "hi"]
    r = subprocess.run(command, capture_output=True, text=True, timeout=LIMIT,
                       env=torchrun_env(tmp_path))
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode != 0 and errors == [
        "error: 3 processes can't split this model: use one of [1, 2, 4]"], r.stderr[-2000:]


def test_tensor_parallel_a_ranks_own_failure_reaches_its_stderr(tmp_path):
    """A failure on rank 1 alone (not a bad flag or file, which rank 0 reports): its traceback on
    rank 1's stderr, which tp.start leaves as it is."""
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {HERE!r})
        import tp
        split = tp.start(torch.device("cpu"))
        if split.rank == 1:
            raise RuntimeError("rank 1 alone fails")"""))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(script)]
    r = subprocess.run(command, capture_output=True, text=True, timeout=LIMIT,
                       env=torchrun_env(tmp_path))
    assert r.returncode != 0 and "RuntimeError: rank 1 alone fails" in r.stderr, r.stderr[-2000:]


def test_the_converter_imports_no_generator_fast_path_or_tp():
    """convert_hf_checkpoint.py reads and writes checkpoints: model.py and safetensors, no more."""
    ours = "{'generate', 'qwen3_triton', 'tp', 'triton', 'quantize'}"
    code = f"import sys, convert_hf_checkpoint\nassert not {ours} & set(sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE,
                       timeout=LIMIT)
    assert r.returncode == 0, r.stderr


def test_tensor_parallel_cli_streams_from_rank_0_alone(tiny, tmp_path):
    """torchrun --nproc-per-node 2 generate.py: the text once, the report once, as one process."""
    args = ["--device", "cpu", "--checkpoint", tiny, "--prompt", "hi", "--max-new-tokens", "12",
            "--temperature", "0"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               os.path.join(HERE, "generate.py"), *args]
    r = subprocess.run(command, capture_output=True, text=True, timeout=LIMIT,
                       env=torchrun_env(tmp_path))
    alone = cli(*args)
    assert r.returncode == 0 and r.stdout == alone.stdout, r.stderr[-2000:]
    assert r.stderr.count("new token") == 1 and r.stderr.count("loading") == 1, r.stderr


# ---------------------------------------------------------------- Triton kernels

# The kernel tests run on CUDA, and on the CPU in Triton's interpreter: TRITON_INTERPRET must be set
# before triton # is imported, so test_kernels_in_triton_interpreter runs them in a subprocess with
# it set.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
in_interpreter = pytest.mark.skipif(not INTERPRETED,
                                    reason="runs in test_kernels_in_triton_interpreter's process")
KERNEL_RUNS = [pytest.param("cpu", torch.float32, 1e-5, marks=in_interpreter, id="interpreter"),
               pytest.param("cuda", torch.float32, 1e-5, marks=needs_cuda, id="cuda-fp32"),
               pytest.param("cuda", torch.bfloat16, 2e-2, marks=needs_cuda, id="cuda-bf16")]


def assert_close(got, want, tol, what):
    err = ((got.float() - want.float()).abs().max().item()
           / max(1.0, want.float().abs().max().item()))
    assert err <= tol, (what, err)


@pytest.mark.parametrize("device,dtype,tol", KERNEL_RUNS)
# K above the kernel's block: a ragged last block
@pytest.mark.parametrize("N,K", [(40, 48), (44, 1104)])
# one token (_gemv), several (_rows_product)
@pytest.mark.parametrize("tokens", [1, 5])
def test_kernel_gemv_matches_reference_ops(device, dtype, tol, N, K, tokens):
    """The product, alone and with what it fuses (the RMSNorm before it, the residual or the SiLU
    gate after it), as PyTorch's ops make it: of float weights, and of quantize.py's int8 and int4
    layers (in groups of 16 columns); for one token and for several."""
    torch.manual_seed(0)
    x, w = torch.randn(tokens, 1, K), torch.randn(N, K) / K ** 0.5
    res = torch.randn(tokens, 1, N)
    norm = torch.nn.RMSNorm(K, 1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, w, res, norm = (x.to(device, dtype), w.to(device, dtype), res.to(device, dtype),
                       norm.to(device, dtype))
    lin = torch.nn.Linear(K, N, bias=False).to(device, dtype)
    lin.weight.data = w
    with torch.no_grad():
        assert_close(fast.gemv(x, w, None, norm.weight, 1e-6, False, res), res + lin(norm(x)), tol,
                     "norm+res")
        # w as a gate_up_proj: rows i and N / 2 + i are gate i and up i
        got = fast.gemv(x, w, None, norm.weight, 1e-6, True)
        assert got.shape == (tokens, 1, N // 2)
        assert_close(got, silu_gate(lin(norm(x))), tol, "norm+gated")
        for mode, group_size in (("int8", None), ("int4", 16)):
            layer = quantized_linear(w.float(), group_size).to(device)
            assert_close(fast.product(fast.weights(layer), x), layer(x), tol, mode)
            got = fast.product(fast.weights(layer), x, norm=norm, residual=res)
            assert_close(got, res + layer(norm(x)), tol, f"{mode} norm+res")
            layer = quantized_linear(w.float() * 3, group_size).to(device)
            got = fast.product(fast.weights(layer), x, norm=norm, gated=True)
            assert_close(got, silu_gate(layer(norm(x))), tol, f"{mode} norm+gated")
    # The op's schema and fake output: once a shape, at several tokens (one token's kernel is
    # slow in the interpreter, and the op checked is the same)
    if tokens == 1:
        return
    torch.library.opcheck(torch.ops.qwen3_fast.gemv,
                          (x, w, None, norm.weight.detach(), 1e-6, False, res))
    weight, scale, offset = fast.weights(layer)
    torch.library.opcheck(torch.ops.qwen3_fast.gemv,
                          (x, weight, scale, norm.weight.detach(), 1e-6, True),
                          dict(offset=offset))


def silu_gate(gate_up):
    """silu(gate) * up of a gate_up_proj's output (..., 2 x inner), [gate; up] as model.MLP takes
    them."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def quantized_linear(weight, group_size):
    """quantize.py's linear layer holding `weight` (N, K): int8 with group_size None, else
    int4."""
    layer = Q.QuantizedLinear(weight.shape[1], weight.shape[0], group_size)
    for name, tensor in Q.quantize("weight", weight, group_size).items():
        setattr(layer, name, tensor)
    return layer


@pytest.mark.parametrize("device,dtype,tol", KERNEL_RUNS)
@pytest.mark.parametrize("mode,norm_topk_prob,top_k",
                         [(None, True, 3), ("int8", False, 3), ("int4", True, 3), (None, True, 1)])
@pytest.mark.parametrize("tokens", [1, 2])
def test_kernel_gemv_of_picked_experts_matches_reference_ops(device, dtype, tol, mode,
                                                             norm_topk_prob, top_k, tokens):
    """A MoE layer's two products, the experts picked by the kernels from each token's router
    logits: gate-up of each pick (RMSNorm and the SiLU gate fused), and down of each pick's input,
    weighted by its routing weight and summed with the residual. 6 experts (not a power of two), 3
    picks, or 1; float weights, or quantize.py's int8 or int4 (in groups of 8 columns); one token
    or two."""
    torch.manual_seed(0)
    E, N, K = 6, 40, 48
    x = torch.randn(tokens, 1, K, device=device, dtype=dtype)
    logits = torch.randn(tokens, E, device=device, dtype=dtype) * 3
    norm = torch.nn.RMSNorm(K, 1e-6).to(device, dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    # Each product's weight, scale and offset (None where it has none), and its fp32 value
    products = []
    for shape in ((E, 2 * N, K), (E, K, N)):
        w = torch.randn(shape, device=device) * shape[-1] ** -0.5
        if mode is None:
            products.append(((w.to(dtype), None, None), w.to(dtype).float()))
        else:
            group_size = 8 if mode == "int4" else None
            held = types.SimpleNamespace(**Q.quantize("w", w, group_size))
            products.append((fast.weights(held, "w"), Q.dequantized(held, "w", torch.float)))
    gate_up, down = products
    # (tokens, top_k) each token's picks and their weights
    weights, picked = logits.softmax(-1, dtype=torch.float).topk(top_k)
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    res = torch.randn(tokens, 1, K, device=device, dtype=dtype)
    routing = dict(router=logits, top_k=top_k, norm_topk_prob=norm_topk_prob)
    with torch.no_grad():
        h = fast.product(gate_up[0], x, norm=norm, gated=True, **routing)
        # (tokens, top_k, 2 x N): each pick's gate and up, rounded as the product's output
        gate_ups = torch.einsum("tk,tenk->ten", norm(x)[:, 0].float(), gate_up[1][picked])
        assert h.shape == (tokens * top_k, 1, N)
        h = h.view(tokens, top_k, N)
        assert_close(h, silu_gate(gate_ups.to(dtype).float()), tol, "picked gate-up")
        got = fast.product(down[0], h.view(-1, 1, N), residual=res, routed=True, **routing)
        terms = torch.einsum("ten,tekn->tek", h.float(), down[1][picked])
        want = res + (terms * weights[..., None]).sum(1, keepdim=True)
        assert_close(got, want, tol, "routed down")
    weight, scale, offset = down[0]
    args = (h.view(-1, 1, N), weight, scale, None, 0.0, False, res, logits, top_k, norm_topk_prob,
            True, offset)
    # The op's schema and fake output at two tokens (one is their case)
    if tokens == 2:
        torch.library.opcheck(torch.ops.qwen3_fast.gemv, args)


@pytest.mark.parametrize("device,dtype,tol", KERNEL_RUNS)
# GQA 1, 2, 4, and 16 (235B-A22B's: the key row, after 16 query rows, takes a block of 32)
@pytest.mark.parametrize("heads,kv_heads,head_dim",
                         [(4, 4, 64), (4, 2, 128), (8, 2, 64), (16, 1, 64)])
# 1, 2 and 8 splits of 32-key blocks, 16 of 64-key blocks
@pytest.mark.parametrize("kv_len", [32, 64, 256, 1024])
def test_kernel_decode_attention_matches_reference_ops(device, dtype, tol, heads, kv_heads,
                                                       head_dim, kv_len):
    """One query per row, rows at different positions: around the key blocks and the split
    boundaries (chunks of ceil(ceil((p + 1) / splits) / block) * block keys), the first position
    and the cache's last. The cache holds random stale keys past each row's position: the kernel
    must not read them."""
    torch.manual_seed(0)
    positions = torch.tensor([0, 31, 63, 64, 127, 128, 200, 255], device=device)
    R, capacity, eps = len(positions), 256, 1e-6
    qkv = torch.randn(R, 1, (heads + 2 * kv_heads) * head_dim, device=device, dtype=dtype)
    cache_k = torch.randn(R, kv_heads, capacity, head_dim, device=device, dtype=dtype)
    cache_v = torch.randn_like(cache_k)
    q_norm, k_norm = (torch.rand(head_dim, device=device, dtype=dtype) + 0.5 for _ in range(2))
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    angles = (torch.arange(capacity).float()[:, None] * inv_freq.repeat(2)).to(device)
    # (capacity, head_dim), as model.rope_tables
    cos_table, sin_table = angles.cos().to(dtype), angles.sin().to(dtype)
    # (R, 1, 1, head_dim)
    cos, sin = cos_table[positions][:, None, None], sin_table[positions][:, None, None]

    def rms(x, w):
        return w * (x.float()
                    * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    q, k, v = qkv.view(R, 1, -1, head_dim).split([heads, kv_heads, kv_heads], dim=2)
    q, k = M.apply_rope(rms(q, q_norm), cos, sin), M.apply_rope(rms(k, k_norm), cos, sin)
    want_k, want_v = cache_k.clone(), cache_v.clone()
    rows = torch.arange(R, device=device)
    want_k[rows, :, positions], want_v[rows, :, positions] = k[:, 0], v[:, 0]
    mask = (torch.arange(capacity, device=device) <= positions[:, None])[:, None, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), want_k, want_v, attn_mask=mask, enable_gqa=True)[:, :, 0]
    got = fast.decode_attention(qkv, cache_k, cache_v, positions[:, None], cos_table, sin_table,
                                q_norm, k_norm, eps, heads, kv_len)
    assert_close(got, want, tol, "attention")
    written = torch.zeros_like(cache_k, dtype=torch.bool)
    written[rows, :, positions] = True
    # nothing else
    assert torch.equal(cache_k[~written], want_k[~written]) and torch.equal(cache_v, want_v)
    assert_close(cache_k[written], want_k[written], tol, "new keys")  # normalised and rotated


SAMPLER_RUNS = [pytest.param("cpu", marks=in_interpreter, id="interpreter"),
                pytest.param("cuda", marks=needs_cuda, id="cuda")]


@pytest.mark.parametrize("device", SAMPLER_RUNS)
@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (5, 1.0), (20, 0.95), (64, 0.5)])
def test_kernel_sampler_draws_pytorchs_tokens(device, top_k, top_p):
    """The fast path's top-k draw gives generate.sample's tokens from the same seed: 6 rows of one
    and a half chunks of logits (the second chunk ragged), 3 draws each; fp32 logits, and logits
    in steps of 1/4, as bf16 logits tie, within the candidates and at the k-th."""
    torch.manual_seed(0)
    vocab = fast.SAMPLE_CHUNK * 3 // 2
    logits = torch.randn(6, vocab, device=device)
    tied = (logits * 8).round() / 4
    params = G.SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p)
    draws = {False: lambda scores: G.sample(scores, params),
             True: lambda scores: fast.sample_top_k(scores, 0.7, top_k, top_p)}
    for scores in (logits, tied):
        drawn = {}
        for use_kernels, draw in draws.items():
            torch.manual_seed(1)
            drawn[use_kernels] = torch.stack([draw(scores) for _ in range(3)])
        assert torch.equal(drawn[False], drawn[True]), (drawn[False][:3], drawn[True][:3])
        # fresh noise at every draw
        assert (len(set(drawn[True][:, 0].tolist())) > 1) == (top_k > 1)
    ids = G.top_candidates(tied, 8)[1]  # ties in id order
    values = tied.gather(-1, ids)
    assert ((values[:, :-1] > values[:, 1:]) | (ids[:, :-1] < ids[:, 1:])).all()
    # The op's schema and fake output at one filter (the op checked is the same; a top-k of 64
    # is slow in the interpreter)
    if top_k == 5:
        noise = torch.rand(6, top_k, device=device)
        torch.library.opcheck(torch.ops.qwen3_fast.top_k_draw, (logits, noise, 0.7, top_p))


@pytest.mark.skipif(fast is None, reason="needs Triton")
def test_the_top_k_kernel_draws_where_it_takes_the_filter(tiny, monkeypatch):
    """The Generator draws with the fast path's kernel for a top-k filter of 1 to MAX_TOP_K below
    the vocabulary, sampled; else with sample. (Triton's interpreter lets the kernels on the CPU:
    no kernel runs here.)"""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = G.load_model(tiny)

    def kernel(**settings):
        sampling = G.SamplingParams(**settings)
        gen = G.Generator(model, batch=1, capacity=64, sampling=sampling, use_kernels=True)
        return gen.draw.func is fast.sample_top_k
    assert kernel(temperature=0.7, top_k=20) and kernel(temperature=0.7, top_k=fast.MAX_TOP_K)
    assert not kernel(temperature=0, top_k=20) and not kernel(temperature=0.7)
    assert not kernel(temperature=0.7, top_k=fast.MAX_TOP_K + 1)


# The interpreter runs MoE's programs (a token's pick each) slowly: the dense glue alone there
# (MoE's is the steps' test's)
GLUE_RUNS = [pytest.param("cpu", "tiny", marks=in_interpreter, id="interpreter-tiny")] + [
    pytest.param("cuda", checkpoint, marks=needs_cuda, id=f"cuda-{checkpoint}")
    for checkpoint in ("tiny", "tiny_moe", "tiny_moe_int4")]


@pytest.mark.parametrize("device,checkpoint", GLUE_RUNS)
def test_model_with_kernels_matches_reference_ops(checkpoint, device, request):
    """forward_step's glue around the kernels (cache views, strides, positions, expert ids): a
    batch-1 greedy decode with the kernels gives the logits, tokens and caches of one without,
    across the 256 -> 512 attended length (fp32)."""
    tiny = request.getfixturevalue(checkpoint)

    def run(use_kernels):
        gen = generator(tiny, capacity=320, device=device, use_kernels=use_kernels)
        logits, forward_step = [], gen.forward_step

        def kept(*args):  # each decode step's logits
            logits.append(forward_step(*args))
            return logits[-1]
        gen.forward_step = kept
        # Two decode steps: at position 255 (attending to 256) and at 256 (to 512)
        tokens = gen.generate([list(range(1, 256))], max_new=3, stop_ids=set())[0][0]
        cache = [c for layer in gen.model.layers for c in layer.self_attn.kv_cache.buffers()]
        return tokens, torch.cat(logits), cache
    # warm-up: the process's first CPU prefill sometimes rounds differently (~1 run in 10)
    run(False)
    ref_tokens, ref_logits, ref_cache = run(False)
    tokens, logits, cache = run(True)
    assert tokens == ref_tokens and len(logits) == 2
    assert torch.allclose(logits, ref_logits, atol=1e-4)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(cache, ref_cache, strict=True))


# (rows, tokens a row) of the fast path's steps: a draft's tokens checked, a batch, both, the most
# rows, the most tokens of a row, and the verify step of a speculative round at the default k = 4
# (a count of tokens that is no power of two)
STEPS = [(1, 2), (2, 1), (4, 4), (16, 1), (1, 8), (1, 5)]


@pytest.mark.parametrize("device,dtype,tol", KERNEL_RUNS[:2])
@pytest.mark.parametrize("checkpoint", ["tiny", "tiny_moe", "tiny_moe_int4"])
def test_fast_steps_of_several_tokens_match_the_model(checkpoint, device, dtype, tol, request):
    """The fast path's step of R rows of T new tokens each, after histories of different lengths
    in each row (stale keys past them): model.py's logits, keys and values, at each (R, T) of
    STEPS; dense and MoE, float and int4 (int8's products are the gemv test's)."""
    model = load(request.getfixturevalue(checkpoint), 16, 64, dtype, device)
    caches = [layer.self_attn.kv_cache for layer in model.layers]
    # The interpreter runs MoE's programs (a token's pick each) slowly: two steps there
    steps = STEPS[:2] if INTERPRETED and checkpoint != "tiny" else STEPS
    torch.manual_seed(0)
    for R, T in steps:
        history = torch.randint(VOCAB, (R, 40), device=device)
        # row r's new tokens at 20 + 2r ...: over the history's stale keys
        starts = 20 + 2 * torch.arange(R, device=device)[:, None]
        positions = starts + torch.arange(T, device=device)
        tokens = torch.randint(VOCAB, (R, T), device=device)
        with torch.no_grad():
            model(history, torch.arange(40, device=device).expand(R, 40), 40)
            kept = [(cache.k.clone(), cache.v.clone()) for cache in caches]
            want = model(tokens, positions, 64)
            want_caches = [(cache.k.clone(), cache.v.clone()) for cache in caches]
            for cache, (k, v) in zip(caches, kept, strict=True):
                cache.k.copy_(k)
                cache.v.copy_(v)
            got = fast.forward_step(model, tokens, positions, 64)
        assert got.shape == (R, T, VOCAB)
        assert_close(got, want, tol, f"{R}x{T} logits")
        for cache, (k, v) in zip(caches, want_caches, strict=True):
            assert_close(cache.k, k, tol, f"{R}x{T} keys")
            assert_close(cache.v, v, tol, f"{R}x{T} values")


def interpreter_skip_reason() -> str | None:
    """Why test_kernels_in_triton_interpreter does not run here, or None."""
    if fast is None:
        return "needs Triton"
    if OLD_INTERPRETER:
        return "Triton's interpreter before 3.9 fails the kernels: CI runs them with 3.9.0"
    if CUDA:
        return ("CUDA is present: the kernel tests run on the GPU (Triton 3.6's interpreter "
                "fails there)")
    if INTERPRETED:
        return "this is the interpreter's process"
    return None


# The kernel tests above in Triton's interpreter, nothing else
INTERPRETER_COMMAND = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                       "-k", "interpreter and not in_triton_interpreter"]


def test_kernels_in_triton_interpreter(request, started):
    """Runs the kernel tests above on the CPU, in Triton's interpreter (fp32: its bf16 is not
    exact)."""
    reason = interpreter_skip_reason()
    if reason:
        pytest.skip(reason)
    r = started["interpreter"].result()
    assert r.returncode == 0, r.stdout[-3000:]
    summary = r.stdout.strip().splitlines()[-1]
    # nothing else
    passed = re.fullmatch(r"(\d+) passed, \d+ deselected(, \d+ warnings?)? in .*", summary)
    # those this run selected (the command's -k)
    here = sum("interpreter" in item.name and "in_triton_interpreter" not in item.name
               for item in request.session.items)
    assert passed and int(passed.group(1)) >= max(here, 1), summary


# ---------------------------------------------------------------- speculative decoding

@pytest.mark.parametrize("params", [G.SamplingParams(temperature=1.0),
                                    G.SamplingParams(temperature=0.7, top_k=3),
                                    G.SamplingParams(temperature=1.3, top_p=0.8)],
                         ids=["temperature", "top-k", "top-p"])
def test_speculative_rounds_draw_the_targets_distribution(params):
    """Sampled (greedy's rounds are the next test's), accept() 40,000 times over one round's
    distributions (6 tokens, 3 drafted): at each
    position, among the rows that keep a token there, the tokens are distributed as the target's
    filtered distribution p (total variation under 0.03), though the draft's q is far from it."""
    torch.manual_seed(0)
    rows, drafts, vocab = 40_000, 3, 6
    target_logits = (torch.randn(1, drafts + 1, vocab) * 1.5).expand(rows, -1, -1)
    draft_logits = target_logits[:, :drafts] + torch.randn(1, drafts, vocab)
    q = S.probabilities(draft_logits, params)
    drafted = torch.stack([G.sample(draft_logits[:, i], params) for i in range(drafts)], 1)
    tokens, kept = S.accept(target_logits, drafted, q, params)
    p = S.probabilities(target_logits[0], params)
    assert ((1 <= kept) & (kept <= drafts + 1)).all()
    for i in range(drafts + 1):
        there = tokens[kept > i, i]
        assert len(there) > 5_000, (i, len(there))
        drawn = torch.bincount(there, minlength=vocab).float() / len(there)
        assert (drawn - p[i]).abs().sum() / 2 < 0.03, (i, drawn, p[i])
    # The draft alone would not pass
    assert (q[0] - p[:drafts]).abs().sum(-1).max() / 2 > 0.1


@pytest.mark.parametrize("target,draft", [("tiny", "tiny"), ("tiny_moe", "tiny"),
                                          ("tiny", "tiny_moe")])
def test_speculative_greedy_is_the_targets_own(target, draft, request):
    """Greedy rounds give the target's plain greedy tokens (fp32), whatever the draft: itself
    (every draft accepted), or another model (nearly none); 1 and 4 drafted tokens a round."""
    target, draft = request.getfixturevalue(target), request.getfixturevalue(draft)
    prompt = [1, 2, 3, 4, 5]
    plain = greedy(target, [prompt], max_new=40, capacity=128)[0]
    for k in (1, 4):
        spec = speculator(target, draft, k)
        tokens, stats = spec.generate([prompt], max_new=40, stop_ids=set())
        assert tokens == [plain]
        assert stats.kept >= 39 and (stats.acceptance == 1.0) == (draft == target)
        # A round that overshoots max_new is cut
        assert spec.generate([prompt], max_new=3, stop_ids=set())[0] == [plain[:3]]


def test_speculative_continues_a_row_as_the_generator_does(tiny):
    """generate(start=n), as chat.py continues a conversation: the prompt after the n tokens that
    both caches keep from the call before gives the plain Generator's greedy tokens; a draft that
    is the target holds the target's keys for both prompts, and has every draft accepted."""
    first, second = [5, 3, 9, 27, 4], [11, 2, 8, 30]
    spec = speculator(tiny, tiny, 3)
    runs = []
    for gen in (generator(tiny, capacity=128), spec):
        gen.generate([first], max_new=1, stop_ids=set())
        runs.append(gen.generate([second], max_new=30, stop_ids=set(), start=len(first)))
    assert runs[0][0] == runs[1][0] and len(runs[0][0][0]) == 30
    assert runs[1][1].acceptance == 1.0
    keys = [m.layers[0].self_attn.kv_cache.k[0, :, :9] for m in (spec.model, spec.draft.model)]
    assert torch.equal(*keys)


def test_speculative_sampled_with_itself_accepts_every_draft(tiny):
    """Sampled, a draft that is the target itself is always accepted (p / q = 1, to the rounding
    of two forwards); the text stops at a stop token as generate's does."""
    sampling = G.SamplingParams(temperature=1.0, top_k=50)
    torch.manual_seed(0)
    spec = speculator(tiny, tiny, 3, sampling=sampling)
    [tokens], stats = spec.generate([[1, 2, 3]], max_new=40, stop_ids=set())
    assert len(tokens) == 40 and stats.acceptance > 0.99
    stop = tokens[5]
    torch.manual_seed(0)
    spec.model.setup_cache(1, 129)
    [cut], _ = spec.generate([[1, 2, 3]], max_new=40, stop_ids={stop})
    assert cut == tokens[:tokens.index(stop)]


@needs_cuda
@pytest.mark.parametrize("target,draft", [("tiny", "tiny_moe"), ("tiny_moe", "tiny")])
def test_cuda_speculative_rounds_in_every_mode_give_the_eager_rounds_tokens(target, draft,
                                                                          request):
    """A graphed target replays each round as one CUDA graph, a compiled one runs it compiled: from
    one seed the eager rounds' tokens and counts, greedy (the target's plain greedy tokens) and
    sampled (fp32); no round waits for the host."""
    target, draft = request.getfixturevalue(target), request.getfixturevalue(draft)
    prompt = [1, 2, 3, 4, 5]
    plain = greedy(target, [prompt], max_new=40, capacity=128, device="cuda")[0]
    for sampling in (GREEDY, G.SamplingParams(temperature=0.8, top_k=20)):
        runs = {}
        for mode, flags in MODES.items():
            torch._dynamo.reset()
            torch.manual_seed(0)
            spec = speculator(target, draft, 3, sampling=sampling, device="cuda", **flags)
            if mode == "eager":  # no round waits for the host (graphed, none could)
                spec.decode_step = no_host_sync(spec.decode_step)
            rows, stats = spec.generate([prompt], max_new=40, stop_ids=set())
            runs[mode] = rows, stats.kept, stats.full, stats.rounds
        assert runs["graph"] == runs["eager"] == runs["compile"]
        assert sampling is not GREEDY or runs["eager"][0] == [plain]


def test_speculative_refuses_what_cannot_pair(tiny, tiny_moe):
    """A draft of another vocabulary, a k out of 1 ... 15, more than one prompt, a prompt that
    with max_new does not fit, the command's flags under torchrun: one line each; a draft heavier
    than the target: a warning."""
    target = G.load_model(tiny)
    args = ModelArgs(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=300)
    other = M.Transformer(args)
    with pytest.raises(UserError, match="a draft of 300 tokens for a target of 512"):
        S.Speculator(target, other, k=4, capacity=64, sampling=GREEDY)
    for k in (0, 16, 2.0):
        with pytest.raises(UserError, match="1 to 15 drafted tokens"):
            S.Speculator(target, target, k=k, capacity=64, sampling=GREEDY)
    spec = S.Speculator(target, G.load_model(tiny), k=4, capacity=64, sampling=GREEDY)
    with pytest.raises(UserError, match="give a list of 1 to 1 prompts"):
        spec.generate([[1], [2]], max_new=4, stop_ids=set())
    # Its last round's room: the capacity asked for is what the prompt and max_new must fit
    with pytest.raises(UserError, match=r"\(40\) is over the cache length \(64\)"):
        spec.generate([[1] * 25], max_new=40, stop_ids=set())
    # A capacity of all the model's positions: the rounds' room is within them, so what the last
    # k can't hold is refused, the rest made
    most = target.args.max_position_embeddings
    for capacity in (0, "64"):
        refusal = f"capacity must be an int of at least 1, not {capacity!r}"
        with pytest.raises(UserError, match=refusal):
            S.Speculator(target, target, k=4, capacity=capacity, sampling=GREEDY)
    with pytest.raises(UserError, match=f"a cache of {most + 1} positions is over the model's"):
        S.Speculator(target, target, k=4, capacity=most + 1, sampling=GREEDY)
    spec = S.Speculator(target, G.load_model(tiny), k=4, capacity=most, sampling=GREEDY)
    with pytest.raises(UserError, match=f"is over the cache length \\({most - 4}\\)"):
        spec.generate([[1] * (most - 8)], max_new=5, stop_ids=set())
    assert len(spec.generate([[1] * (most - 8)], max_new=4, stop_ids=set())[0][0]) == 4
    # A draft of more bytes than the target: a warning, the rounds still exact
    with pytest.warns(UserWarning, match="the draft outweighs the target"):
        S.Speculator(target, G.load_model(tiny_moe), k=4, capacity=64, sampling=GREEDY)
    # generate.py's --draft-checkpoint under torchrun (a rank's environment)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LOCAL_RANK", "0")
        with pytest.raises(UserError, match="--draft-checkpoint: not under torchrun"):
            S.from_args(types.SimpleNamespace(prompt=["hi"]), G.load(tiny), 64, GREEDY)


# ---------------------------------------------------------------- the line budget

def code_lines(text: str) -> int:
    """Lines of code as cloc counts them for Python: lines holding a token other than a comment, and
    not inside a docstring (a string that is the first statement of a module, class or function)."""
    return len(code_line_numbers(text))


def code_line_numbers(text: str) -> set[int]:
    """The numbers of the lines code_lines counts."""
    import ast
    import tokenize
    skipped = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
               tokenize.ENCODING, tokenize.ENDMARKER}
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in skipped:
            lines.update(range(token.start[0], token.end[0] + 1))
    return lines - docstrings


def test_code_lines_counts_as_cloc_does():
    text = '"""A module\n\ndocstring."""\nimport os  # a comment\n\n# a comment line\n\n\n' \
           'def f(x):\n    """Its docstring."""\n    return (x +\n            1)\n\n\n' \
           'S = """not a\ndocstring"""\n'
    assert code_lines(text) == 6  # import, def, the two lines of the return, the two of S


# the optional files' caps; the card's three files and the common.py they share: < 1,000
BUDGET = {"qwen3_triton.py": 500, "quantize.py": 165, "chat.py": 110, "tp.py": 120,
          "speculative.py": 120}
CARD_FILES = ["model.py", "common.py", "generate.py", "convert_hf_checkpoint.py"]


def library_files() -> list[str]:
    return sorted(f for f in os.listdir(HERE) if f.endswith(".py") and not f.startswith("test_"))


def library_counts() -> dict[str, int]:
    return {f: code_lines(open(os.path.join(HERE, f), encoding="utf-8").read())
            for f in library_files()}


def test_the_line_budget_by_file():
    """The design card's files under 1,000 lines of code together, as cloc counts them (comments and
    docstrings are free); each optional file within its own cap; no other library file. The
    README's Size table states each count."""
    counts = library_counts()
    assert (set(CARD_FILES) <= counts.keys() <= set(CARD_FILES) | BUDGET.keys()), counts
    card = sum(counts[f] for f in CARD_FILES)
    assert card < 1000, counts
    for name, cap in BUDGET.items():
        assert counts.get(name, 0) <= cap, (name, counts.get(name))
    readme = open(os.path.join(HERE, "README.md"), encoding="utf-8").read()
    stated = dict(re.findall(r"^\| `(\w+\.py)` \| ([\d,]+) \|", readme, re.MULTILINE))
    assert {f: int(n.replace(",", "")) for f, n in stated.items()} == counts, stated
    assert f"| the four together | {card:,} |" in readme
    assert len(readme.encode()) <= 12 * 1024  # a user's document; bench/RESULTS.md is the lab log


def test_the_library_reads_at_the_anchors_density():
    """No library line over 100 characters, and in each library file a code line of at most 46
    characters on average (indentation excluded)."""
    for name in library_files():
        text = open(os.path.join(HERE, name), encoding="utf-8").read()
        assert max(map(len, text.splitlines())) <= 100, name
        numbers = code_line_numbers(text)
        chars = sum(len(text.splitlines()[number - 1].strip()) for number in numbers)
        assert chars / len(numbers) <= 46, (name, chars / len(numbers))


# ---------------------------------------------------------------- the conversation (chat.py)

THREE_TURNS = [("hi", None), ("why is the sky blue?", "be brief"), ("and at night?", None)]


def conversation_of(path, thinking=True, capacity=512, **flags):
    """chat.py's Conversation over a fresh greedy fp32 Generator: 8 tokens a reply, no stop."""
    import chat
    checkpoint = G.load(path)
    gen = G.Generator(checkpoint.model, batch=1, capacity=capacity, sampling=GREEDY, **flags)
    return chat.Conversation(checkpoint, gen, "be brief", thinking, max_new=8, stop_ids=set(),
                             check_every=4)


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_renders_every_turn_as_transformers_does(tiny, thinking):
    """Three turns, replies with their thinking among them: our tokens are those of transformers'
    apply_chat_template over the same conversation."""
    import transformers
    theirs = transformers.PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(tiny, "tokenizer.json"))
    chat = conversation_of(tiny, thinking)
    messages = [{"role": "system", "content": "be brief"}]
    for number, (user, _) in enumerate(THREE_TURNS):
        messages.append({"role": "user", "content": user})
        want = theirs.apply_chat_template(messages, chat_template=QWEN3_CHAT_TEMPLATE,
                                          tokenize=True, add_generation_prompt=True,
                                          enable_thinking=thinking, return_dict=False)
        assert chat.render(messages) == list(want)
        reply = f"<think>\nstep {number}\n</think>\n\nanswer {number}"
        messages.append({"role": "assistant", "content": reply})


@pytest.mark.parametrize("checkpoint", ["tiny", "tiny_moe"])
def test_chat_replies_as_a_fresh_generator_prefilling_only_the_new_tokens(checkpoint, request):
    """fp32, greedy: each turn's reply equals a fresh Generator's on the whole conversation's
    rendering, while the model runs only the tokens the cache doesn't hold (counted)."""
    path = request.getfixturevalue(checkpoint)
    chat = conversation_of(path)
    ran = []
    prefill = chat.gen.prefill_step
    chat.gen.prefill_step = lambda positions, kv: (ran.append(positions.shape[1]),
                                                   prefill(positions, kv))
    for number, (user, _) in enumerate(THREE_TURNS):
        ids = chat.render(chat.messages + [{"role": "user", "content": user}])
        reply = chat.say(user)
        assert ran[-1] == reply.prefilled == len(ids) - reply.reused
        assert (reply.reused > 20) == (number > 0) and not reply.started_over
        fresh = greedy(path, [ids], max_new=8)[0]
        assert reply.tokens == fresh and len(fresh) == 8
    assert len(ran) == 3


@pytest.mark.beside
def test_chat_compiled_compiles_the_decode_step_once(tiny):
    """Compiled, the first turn compiles the decode step alone (its prefills run eagerly): later
    turns, at new start positions and attended lengths, compile nothing (the same text as
    eagerly)."""
    from torch._dynamo.utils import counters
    counters.clear()
    eager = conversation_of(tiny)
    compiled = conversation_of(tiny, compile=True)
    graphs = []
    for user, _ in THREE_TURNS * 2:
        assert compiled.say(user).tokens == eager.say(user).tokens
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [1] * 6, graphs


def test_chat_through_a_pipe(tiny):
    """Turns from a pipe: replies streamed, a report each; Ctrl-C in the first reply stops it and
    the conversation goes on; a line that is not UTF-8 and a turn too long alone are refused in
    one line each (a pipe's line is not to be typed again), and the exit status is 1 once the input
    ends; a conversation that outgrows the cache starts over; an empty line ends it."""
    too_long = " ".join(["word"] * 80)
    turns = ["hello", "and then?", "\udcff bad", too_long, "one more", "and again", "more", "",
             "unread"]
    stdin = "\n".join(turns).encode("utf-8", "surrogateescape")
    args = ["--device", "cpu", "--checkpoint", tiny, "--max-new-tokens", "12", "--check-every",
            "4", "--temperature", "1", "--seed", "0", "--cache-len", "96"]
    code = "\n".join(["import sys", f"sys.path.insert(0, {HERE!r})",
                      f"sys.argv = ['chat.py', *{args!r}]", "import generate, chat",
                      textwrap.dedent(CTRL_C_AT_THE_SECOND_CHECK), "chat.main()"])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, input=stdin,
                       timeout=LIMIT)
    stderr = r.stderr.decode().splitlines()
    assert r.returncode == 1, stderr
    reports = [line for line in stderr if "prefilled" in line]
    assert "Interrupted: 5 new tokens" in reports[0], stderr
    assert len(reports) == 5 and " 0 reused" not in reports[1], stderr
    assert stderr.count("error: that line is not UTF-8 text") == 1
    refused = [line for line in stderr if line.startswith("error: this turn (")]
    assert len(refused) == 1 and "over the cache length (96)" in refused[0], stderr
    assert sum("starts over from the system message" in line for line in stderr) == 1, stderr
    assert not any("Traceback" in line for line in stderr)


def test_chat_reads_turns_without_their_line_endings(monkeypatch):
    import chat
    stdin = io.TextIOWrapper(io.BytesIO(b"hello\r\nthere\n\r\n"))
    monkeypatch.setattr(sys, "stdin", stdin)
    assert [chat.read_turn(interactive=False) for _ in range(4)] == ["hello", "there", "", ""]


def test_chat_ends_a_terminal_line_at_ctrl_d(monkeypatch, capsys):
    """Ctrl-D at the `> ` prompt ends the conversation with a newline, so that the shell's next
    prompt starts a line of its own."""
    import chat

    def end_of_input(prompt):
        print(prompt, end="")
        raise EOFError
    monkeypatch.setattr("builtins.input", end_of_input)
    assert chat.read_turn(interactive=True) == ""
    assert capsys.readouterr().out == "> \n"


@needs_cuda
@pytest.mark.parametrize("checkpoint", ["tiny", "tiny_moe"])
def test_cuda_chat_one_text_in_every_mode_with_no_host_sync_in_a_step(checkpoint, request):
    """bf16 on CUDA: three turns give the same replies eagerly, compiled and graphed, and no
    prefill or decode step of a later conversation waits for the host."""
    import chat
    path = request.getfixturevalue(checkpoint)
    replies = {}
    for mode, flags in MODES.items():
        checkpoint = G.load(path, "cuda", torch.float32)
        gen = G.Generator(checkpoint.model, batch=1, capacity=512, sampling=GREEDY, **flags)
        talk = chat.Conversation(checkpoint, gen, None, max_new=16, stop_ids=set())
        replies[mode] = [talk.say(user).tokens for user, _ in THREE_TURNS]
        gen.decode_step = no_host_sync(gen.decode_step)
        gen.prefill_step = no_host_sync(gen.prefill_step)
        talk = chat.Conversation(checkpoint, gen, None, max_new=16, stop_ids=set())
        assert [talk.say(user).tokens for user, _ in THREE_TURNS] == replies[mode]
    assert replies["compile"] == replies["eager"] == replies["graph"]


def test_chat_refuses_bad_flags_and_a_closed_stdin_before_any_turn(tiny, tmp_path):
    """Flags that would fail every turn, a checkpoint without a chat template, a closed stdin, and
    torchrun: one line, exit 1, no turn taken."""
    chat_py = os.path.join(HERE, "chat.py")
    for args, message in [(["--stop-ids", "-5"], "--stop-ids: ids in [0, 512)"),
                          (["--stop-ids", "512"], "--stop-ids: ids in [0, 512)"),
                          (["--max-new-tokens", "64", "--cache-len", "64"],
                           "--max-new-tokens 64 leaves no room in the cache (64 positions)")]:
        r = cli("--device", "cpu", "--checkpoint", tiny, *args, stdin="hi\n", script="chat.py")
        one_line_error(r, message)
        assert "prefilled" not in r.stderr
    plain = tmp_path / "plain"
    shutil.copytree(tiny, plain)
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        (plain / name).unlink(missing_ok=True)
    r = cli("--device", "cpu", "--checkpoint", str(plain), stdin="hi\n", script="chat.py")
    one_line_error(r, f"{plain} has no chat template: chat.py needs one")
    command = f"{sys.executable} {chat_py} --device cpu --checkpoint {tiny} <&-"
    r = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=LIMIT)
    one_line_error(r, "stdin is closed")
    r = cli("--device", "cpu", "--checkpoint", tiny, stdin="hi\n", script="chat.py",
            env={"LOCAL_RANK": "0"})
    one_line_error(r, "chat.py is one process: run it without torchrun")
    assert "prefilled" not in r.stderr


# ---------------------------------------------------------------- compiling, last
# COMPILE_TWICE starts with the first test and compiles beside every test above, which this process
# runs first instead of waiting for it halfway: its readers come here, at the end.

# The checkpoints whose decode step COMPILE_TWICE compiles, and the tests that read its lines
COMPILED = ("tiny", "tiny_moe", "tiny_moe_int4")
COMPILED_TESTS = {"test_compile_matches_eager_on_cpu_sampled_with_one_seed",
                  "test_a_second_compile_process_starts_from_inductors_cache"}
# Their runs: two rows sampled for 300 steps, which cross the attended lengths 64, 128, 256 and
# 512 (still one compiled decode step: a dynamic length; the prefill runs eagerly)
COMPILED_PROMPTS = [[7, 8, 9], [4, 4, 4, 4, 4, 4, 4]]
COMPILED_SAMPLING = G.SamplingParams(temperature=1.0, top_k=40, top_p=0.95)

# A process that compiles each checkpoint's decode step in turn, then runs it as greedy() runs
# COMPILED_PROMPTS from seed 0; a JSON line a checkpoint: the tokens, and dynamo's, inductor's and
# AOTAutograd's counters (graphs; cache hits and misses)
CACHE_PROBE = """
import json, sys
import torch
sys.path.insert(0, {here!r})
import generate as G
from torch._dynamo.utils import counters
for path in sys.argv[1:]:
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    gen = G.Generator(G.load_model(path, "cpu", torch.float32), batch=2, capacity=512,
                      sampling=G.{sampling!r}, compile=True)
    tokens = gen.generate({prompts!r}, max_new=300, stop_ids=set(), check_every=5)[0]
    names = ("stats", "inductor", "aot_autograd")
    print(json.dumps(dict(tokens=tokens, **{{name: dict(counters[name]) for name in names}})))
"""
# CACHE_PROBE twice, into an empty inductor cache: tiny's step alone, then every checkpoint's
COMPILE_TWICE = """
import subprocess, sys
probe, tiny, *others = sys.argv[1:]
for paths in ([tiny], [tiny, *others]):
    subprocess.run([sys.executable, "-c", probe, *paths], check=True)
"""


def start_compiled(tmp_path_factory, paths: list[str]) -> Started:
    """COMPILE_TWICE started over `paths` (COMPILED's), its inductor cache in its folder: a minute
    or two of compiling, beside the tests."""
    folder = tmp_path_factory.mktemp("compiled")
    probe = CACHE_PROBE.format(here=HERE, sampling=COMPILED_SAMPLING, prompts=COMPILED_PROMPTS)
    env = {"TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor")}
    return Started([sys.executable, "-c", COMPILE_TWICE, probe, *paths], folder, env)


@pytest.fixture(scope="module")
def compiled_runs(started, tiny, tiny_moe, tiny_moe_int4) -> dict:
    """COMPILE_TWICE's lines: "cold", tiny's of the first process; then the second's, by
    checkpoint (tiny's from the cache). Its checkpoints asked for: made before OnDemand starts
    it."""
    r = started["compiled"].result()
    assert r.returncode == 0, r.stderr[-3000:]
    cold, *lines = [json.loads(line) for line in r.stdout.splitlines()]
    return dict(cold=cold, **dict(zip(COMPILED, lines, strict=True)))


@pytest.mark.parametrize("checkpoint", COMPILED)
def test_compile_matches_eager_on_cpu_sampled_with_one_seed(checkpoint, request, compiled_runs):
    """The same seed gives the same sampled tokens compiled (in a process of its own) and eager:
    compiled code draws its noise with eager's random functions (inductor's fallback_random), in
    the same order."""
    tiny = request.getfixturevalue(checkpoint)
    eager = {}
    for seed in (0, 1):
        torch.manual_seed(seed)
        eager[seed] = greedy(tiny, COMPILED_PROMPTS, max_new=300, sampling=COMPILED_SAMPLING)
    compiled = compiled_runs[checkpoint]
    assert compiled["stats"]["unique_graphs"] == 1
    assert compiled["tokens"] == eager[0] != eager[1]
    assert len(set(eager[0][0])) > 50  # sampled, not stuck on a few tokens


def test_a_second_compile_process_starts_from_inductors_cache(compiled_runs):
    """--compile's second run is warm: a new process finds the decode step's compiled code in
    inductor's cache (TORCHINDUCTOR_CACHE_DIR, where our commands leave it), AOTAutograd's too, and
    compiles nothing; another model finds no entry of the first's and compiles its own."""
    cold, warm, other = (compiled_runs[name] for name in ("cold", "tiny", "tiny_moe"))
    assert cold["inductor"]["fxgraph_cache_miss"] == 1
    assert "fxgraph_cache_hit" not in cold["inductor"]
    assert warm["aot_autograd"]["autograd_cache_hit"] == 1
    assert "autograd_cache_miss" not in warm["aot_autograd"]
    assert warm["tokens"] == cold["tokens"]  # the cache's code is the compiled code
    assert other["aot_autograd"]["autograd_cache_miss"] == 1
    assert "autograd_cache_hit" not in other["aot_autograd"]
