"""Speculative decoding: a draft model proposes K tokens a round, the target checks them in one
step of K + 1 tokens, and the row keeps the longest prefix the target accepts plus one token of
the target's. Exact (Leviathan et al. 2023; Chen et al. 2023): greedy, the target's own greedy
tokens; sampled, draws from the target's distribution (after its temperature, top-k and top-p).
A round never waits for the host: acceptance is decided on the device, and the positions past a
row's accepted tokens are simply written over in the next round, as the static cache allows.

    python generate.py --cuda-graph --checkpoint TARGET --draft-checkpoint DRAFT --prompt "..."

    import generate
    import speculative
    target = generate.load(path, "cuda")
    draft = generate.load_model(draft_path, "cuda")
    # A Generator of one row whose decode step is a round: eager, a CUDA graph (CUDA only), or
    # compiled. target.sampling: generation_config.json's (Qwen3's sample); greedy:
    # generate.SamplingParams()
    spec = speculative.Speculator(target.model, draft, k=4, capacity=1024,
                                  sampling=target.sampling, cuda_graph=True)
    prompt = target.tokenizer.encode("def fibonacci(n):")
    [tokens], stats = spec.generate([prompt], max_new=200, stop_ids=target.stop_ids)
    print(target.tokenizer.decode(tokens), stats.report([tokens]))
"""
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from generate import (Checkpoint, GenerationStats, Generator, SamplingParams, check_count,
                      load_model, read_tokenizer, require, top_candidates, tp)
from model import Transformer


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution (..., V) that generate.sample draws from for logits (..., V): softmax of
    logits / temperature over the top-k and top-p candidates; greedy, one-hot at the argmax."""
    vocab = logits.shape[-1]
    if params.temperature == 0:
        return F.one_hot(logits.argmax(-1), vocab).float()
    scores = logits.float().flatten(0, -2)
    count = min(params.top_k or vocab, vocab)
    # No filter: every token, no sort
    if count == vocab and params.top_p == 1:
        return (scores * (1.0 / params.temperature)).softmax(-1).view(logits.shape)
    # The candidates, largest first, as sample takes them
    top, ids = top_candidates(scores, count)
    top = top * (1.0 / params.temperature)
    if params.top_p < 1:
        probs = top.softmax(-1)
        ahead = probs.cumsum(-1) - probs
        top = top.masked_fill(ahead >= params.top_p, float("-inf"))
    dense = torch.zeros_like(scores).scatter_(-1, ids, top.softmax(-1))
    return dense.view(logits.shape)


def accept(target_logits: torch.Tensor, drafted: torch.Tensor, draft_probs: torch.Tensor,
           params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """A round's tokens (R, K + 1) and how many of them each row keeps (R,), 1 ... K + 1: drafted
    token i (R, K), drawn from draft_probs (R, K, V), is accepted with probability min(1, p / q),
    p the target's probability of it (target_logits (R, K + 1, V) at the K + 1 positions) and q the
    draft's; after the accepted prefix, one token from max(p - q, 0) at the first rejection, or
    from p after K acceptances. Greedy, p and q are one-hot: the target's argmax tokens."""
    count = drafted.shape[1]
    p = probabilities(target_logits, params)
    # (R, K, 1) each drafted token's id
    ids = drafted[..., None]
    p_drafted = p[:, :count].gather(-1, ids)[..., 0]
    q_drafted = draft_probs.gather(-1, ids)[..., 0]
    # u < p / q, without a division: u in [0, 1)
    accepted = torch.rand_like(p_drafted) * q_drafted < p_drafted
    # (R,) the accepted prefix's length
    prefix = accepted.int().cumprod(-1).sum(-1)
    # (R, K + 1) what a rejection at each position draws from, then p after every draft
    rejected = (p[:, :count] - draft_probs).clamp(min=0)
    residual = torch.cat([rejected, p[:, count:]], dim=1)
    fallback = draw(residual, params)
    index = torch.arange(count + 1, device=drafted.device)
    tokens = torch.where(index < prefix[:, None], F.pad(drafted, (0, 1)), fallback)
    return tokens, prefix + 1


def draw(weights: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Ids (...,) drawn from weights (..., V) normalised, by Gumbel-max over their logarithms;
    greedy, the largest (noise of exactly 0 would make every score -inf)."""
    if params.temperature == 0:
        return weights.argmax(-1)
    noise = torch.rand_like(weights)
    return (weights.log() - torch.log(-torch.log(noise))).argmax(-1)


@dataclass
class SpeculationStats(GenerationStats):
    """A Speculator's GenerationStats (its decode_tokens: the tokens its rounds made), and the
    rounds' counts."""
    # Every round run, the warm-ups' too
    rounds: int = 0
    # Tokens each round kept, summed over the rounds: the accepted drafts and the target's
    kept: int = 0
    # The rounds that accepted all k drafts
    full: int = 0

    @property
    def acceptance(self) -> float:
        """The fraction of the drafted tokens the target checked that it accepted: a round checks
        its drafts up to the first it rejects (a draft's chance of acceptance, as the papers
        measure it: a round keeps (1 - a^(k + 1)) / (1 - a) tokens on average)."""
        accepted = self.kept - self.rounds
        return accepted / max(1, accepted + self.rounds - self.full)

    def report(self, rows: list[list[int]]) -> str:
        """GenerationStats' line, then the rounds': tokens kept a round, the drafts accepted."""
        kept = self.kept / max(1, self.rounds)
        return (f"{super().report(rows)} Drafts: {kept:.2f} tokens kept a round; "
                f"{self.acceptance:.1%} accepted of those checked (up to a rejection).")


class Speculator(Generator):
    """A Generator of one row whose decode step is a speculative round: the draft model (of the
    target's vocabulary) proposes k tokens, one by one, and the target checks them in one step of
    k + 1 tokens (at most 16: the fast path's steps); the row keeps the accepted prefix and one
    token of the target's. Every mode of the Generator serves it: eager, a round a CUDA graph
    (cuda_graph), or a round compiled as a whole (compile). The draft runs inside the round, with
    the fast path where the target has it."""

    def __init__(self, model: Transformer, draft: Transformer, *, k: int, capacity: int,
                 sampling: SamplingParams, **modes):
        require(type(k) is int and 1 <= k <= 15, f"k {k!r}: 1 to 15 drafted tokens (--speculate-k)")
        check_count("capacity", capacity)
        vocabs = model.args.vocab_size, draft.args.vocab_size
        require(vocabs[0] == vocabs[1], f"a draft of {vocabs[1]} tokens for a target of "
                f"{vocabs[0]}: the draft needs the target's tokenizer")
        # A step reads every weight once: a draft heavier than the target makes a round cost
        # more than the plain steps it replaces
        weights = [sum(t.nbytes for t in m.state_dict().values()) for m in (model, draft)]
        if weights[1] > weights[0]:
            warnings.warn("the draft outweighs the target: slower than plain decoding",
                          stacklevel=2)
        # Room for a round's k tokens past the capacity, within the model's positions (generate
        # refuses a prompt and max_new that don't fit the room less k); a capacity past them is
        # the Generator's to refuse
        room = min(capacity + k, max(capacity, model.args.max_position_embeddings))
        super().__init__(model, batch=1, capacity=room, sampling=sampling, **modes)
        self.draft = Generator(draft, batch=1, capacity=room, sampling=sampling,
                               use_kernels=modes.get("use_kernels"))
        self.k = k
        self.params = sampling
        self.step_tokens = k + 1
        # (3,) SpeculationStats' rounds, kept and full
        self.counts = self.state.tokens.new_zeros(3)
        if self.compiled:
            # cudagraph trees: an input, not a copy
            torch._dynamo.mark_static_address(self.counts)

    def prefill(self, prompts: list[list[int]], start: int = 0) -> None:
        """The prompt into both models' caches."""
        super().prefill(prompts, start)
        self.draft.prefill(prompts, start)

    def decode_one_token(self, kv_positions: torch.Tensor) -> None:
        """One round, device-side only: the draft's k + 1 one-token steps from the row's token
        (the last writes drafted token k's key, which the next round may attend to), the target's
        step of k + 1 tokens, then the kept tokens into the target's state and the counts.
        kv_positions: the attended prefix of the cache (its length alone is read)."""
        state = self.state
        kv_len = len(kv_positions)
        tokens = state.tokens
        # The k drafted tokens, each (1, 1), and the draft's distributions they came from
        drafted = []
        draft_probs = []
        for i in range(self.k + 1):
            logits = self.draft.forward_step(tokens, state.positions + i, kv_len)[:, -1]
            if i < self.k:
                # q, and a draft drawn from it
                draft_probs.append(probabilities(logits, self.params))
                tokens = draw(draft_probs[-1], self.params)[:, None]
                drafted.append(tokens)
        drafted = torch.cat(drafted, dim=1)
        checked = torch.cat([state.tokens, drafted], dim=1)
        offsets = torch.arange(self.k + 1, device=state.positions.device)
        logits = self.forward_step(checked, state.positions + offsets, kv_len)
        draft_probs = torch.stack(draft_probs, 1)
        round_tokens, kept = accept(logits, drafted, draft_probs, self.params)
        # Every token of the round at the positions after the row's; those past the kept ones
        # are written over by the next round
        state.sequences.scatter_(1, state.positions + 1 + offsets, round_tokens)
        state.tokens.copy_(round_tokens.gather(1, kept[:, None] - 1))
        state.positions.add_(kept[:, None])
        self.counts += torch.cat([torch.ones_like(kept), kept, kept == self.k + 1])

    def generate(self, prompts, **options):
        """Generator.generate of one prompt, its stats a SpeculationStats."""
        self.counts.zero_()
        rows, stats = super().generate(prompts, **options)
        return rows, SpeculationStats(*vars(stats).values(), *self.counts.tolist())


def from_args(args, target: Checkpoint, capacity: int, sampling) -> Speculator:
    """generate.py's --draft-checkpoint and --speculate-k (4 by default): a Speculator of one
    --prompt for the loaded `target`, in the mode the flags ask, its draft on the target's device
    in its dtype."""
    require(len(args.prompt) == 1, "--draft-checkpoint takes one --prompt")
    require(not (tp and tp.launched()), "--draft-checkpoint: not under torchrun")
    path = args.draft_checkpoint
    if not sys.stderr.isatty():
        # As for the target: a terminal gets load_model's progress line instead
        print(f"loading the draft, {path} ...", file=sys.stderr, flush=True)
    draft = load_model(path, args.device, args.dtype)
    # Ids that name the same tokens: the same vocabularies, added tokens too, however saved
    vocab = target.tokenizer.tokenizer.get_vocab(with_added_tokens=True)
    draft_vocab = read_tokenizer(path).get_vocab(with_added_tokens=True)
    require(draft_vocab == vocab, f"{path}: not the target's tokenizer")
    return Speculator(target.model, draft, k=args.speculate_k or 4, capacity=capacity,
                      sampling=sampling, compile=args.compile, cuda_graph=args.cuda_graph)
