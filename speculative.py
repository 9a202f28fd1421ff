"""Speculative decoding: a draft model proposes K tokens a round, the target checks them in one
step of K + 1 tokens, and the row keeps the longest prefix the target accepts plus one token of
the target's. Exact (Leviathan et al. 2023; Chen et al. 2023): greedy, the target's own greedy
tokens; sampled, draws from the target's distribution (after its temperature, top-k and top-p).
A round never waits for the host: acceptance is decided on the device, and the positions past a
row's accepted tokens are simply written over in the next round, as the static cache allows.

    import generate
    target, draft = generate.load(path, "cuda"), generate.load(draft_path, "cuda")
    sampling = target.sampling  # generation_config.json's; or generate.SamplingParams(...)
    # cuda_graph: each round one CUDA graph; the draft's steps are captured in the target's
    made = [generate.Generator(checkpoint.model, batch=1, capacity=1024, sampling=sampling,
                               cuda_graph=checkpoint is target) for checkpoint in (target, draft)]
    prompt = target.tokenizer.encode("def fibonacci(n):")
    tokens, stats = Speculator(*made, sampling, k=4).generate(prompt, max_new=200,
                                                              stop_ids=target.stop_ids)
    print(target.tokenizer.decode(tokens), stats.acceptance)
"""
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from generate import CUDAGraphs, Generator, SamplingParams, require, top_candidates


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
class SpeculationStats:
    rounds: int
    # Tokens each round kept, summed over the rounds: the accepted drafts and the target's
    kept: int
    # The rounds that accepted all k drafts
    full: int

    @property
    def acceptance(self) -> float:
        """The fraction of the drafted tokens the target checked that it accepted: a round checks
        its drafts up to the first it rejects (a draft's chance of acceptance, as the papers
        measure it: a round keeps (1 - a^(k + 1)) / (1 - a) tokens on average)."""
        accepted = self.kept - self.rounds
        return accepted / max(1, accepted + self.rounds - self.full)


class Speculator:
    """Decodes one prompt with `target` (a Generator), its drafts from `draft` (a Generator of a
    model with the target's vocabulary and the same capacity), both of which must be made with
    `sampling`: rounds of k drafted tokens, each checked by one step of the target of k + 1
    tokens (at most 16: the fast path's steps). Where the target is made with cuda_graph, each
    round is replayed as one CUDA graph (a graph an attended length); otherwise it runs eagerly."""

    def __init__(self, target: Generator, draft: Generator, sampling: SamplingParams, k: int = 4):
        require(type(k) is int and 1 <= k <= 15, f"k {k!r}: 1 to 15 drafted tokens a round")
        vocabs = target.model.args.vocab_size, draft.model.args.vocab_size
        require(vocabs[0] == vocabs[1], f"a draft of {vocabs[1]} tokens for a target of "
                f"{vocabs[0]}: the draft needs the target's tokenizer")
        require(target.capacity == draft.capacity, "the draft's capacity must be the target's")
        # A step reads every weight once: a draft heavier than the target makes a round cost
        # more than the plain steps it replaces
        weights = [sum(t.nbytes for t in g.model.state_dict().values()) for g in (target, draft)]
        if weights[1] > weights[0]:
            warnings.warn(f"the draft's weights ({weights[1]:,} bytes) outweigh the target's "
                          f"({weights[0]:,}): its rounds will be slower than plain decoding",
                          stacklevel=2)
        self.target, self.draft, self.k, self.params = target, draft, k, sampling
        # (2,) the tokens the rounds kept, and the rounds that accepted every draft
        self.counts = torch.zeros(2, dtype=torch.long, device=target.state.tokens.device)
        self.step = self.round
        if target.graphed:
            self.step = CUDAGraphs(self.round)

    def round(self, kv_positions: torch.Tensor) -> None:
        """One round for row 0, device-side only: the draft's k + 1 one-token steps from the row's
        token (the last writes drafted token k's key, which the next round may attend to), the
        target's step of k + 1 tokens, then the kept tokens into the target's state and their
        count into self.counts. kv_positions: the attended prefix of the cache (its length alone
        is read), as in Generator.decode_one_token."""
        state = self.target.state
        kv_len = len(kv_positions)
        tokens, positions = state.tokens[:1], state.positions[:1]
        drafted, draft_probs = [], []
        for i in range(self.k + 1):
            logits = self.draft.forward_step(tokens, positions + i, kv_len)[:, -1]
            if i < self.k:
                # q, and a draft drawn from it
                draft_probs.append(probabilities(logits, self.params))
                tokens = draw(draft_probs[-1], self.params)[:, None]
                drafted.append(tokens)
        drafted = torch.cat(drafted, dim=1)
        checked = torch.cat([state.tokens[:1], drafted], dim=1)
        offsets = torch.arange(self.k + 1, device=positions.device)
        logits = self.target.forward_step(checked, positions + offsets, kv_len)
        draft_probs = torch.stack(draft_probs, 1)
        round_tokens, kept = accept(logits, drafted, draft_probs, self.params)
        # Every token of the round at the positions after the row's; those past the kept ones
        # are written over by the next round
        state.sequences[:1].scatter_(1, positions + 1 + offsets, round_tokens)
        state.tokens[:1] = round_tokens.gather(1, kept[:, None] - 1)
        state.positions[:1] += kept[:, None]
        self.counts += torch.cat([kept, kept == self.k + 1])

    @torch.no_grad()
    def generate(self, prompt: list[int], *, max_new: int, stop_ids: set,
                 check_every: int = 16) -> tuple[list[int], SpeculationStats]:
        """The prompt's new tokens, cut at max_new and before the first stop token, and the
        rounds' counts. Between checks, rounds of about check_every tokens' worth of steps (at
        least one round); each check is one sync."""
        require(len(prompt) + max_new + self.k + 2 <= self.target.capacity,
                "the prompt, max_new and a round's k + 1 tokens must fit the capacity")
        self.target.prefill([prompt])
        self.draft.prefill([prompt])
        start = len(prompt)
        produced, rounds = 1, 0
        self.counts.zero_()
        while True:
            # The last rounds may overshoot max_new
            new = self.target.state.sequences[0, start:start + produced].tolist()[:max_new]
            ends = [i for i, token in enumerate(new) if token in stop_ids]
            if ends or produced >= max_new:
                new = new[:ends[0]] if ends else new
                kept, full = self.counts.tolist()
                return new, SpeculationStats(rounds, kept, full)
            # Rounds of at least one token each: none past max_new + k tokens
            count = max(1, min(check_every, max_new - produced) // (self.k + 1))
            # The attended prefix: every position these rounds may write
            kv_positions = self.target.attended(start + produced + count * (self.k + 1))
            for _ in range(count):
                self.step(kv_positions)
            rounds += count
            produced = int(self.target.state.positions[0, 0]) - start + 1
