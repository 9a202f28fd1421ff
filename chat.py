"""Chats with Qwen3, keeping the conversation's cache: each turn prefills only what is new.

    python chat.py --cuda-graph  # checkpoints/Qwen/Qwen3-0.6B/converted
    python chat.py --device cpu --no-think --system "Answer in one sentence."
    printf 'Hi!\\nAnd then?\\n' | python chat.py --compile  # turns from a pipe

A turn is a line: typed after a `> ` prompt (with line editing), or read from a pipe. An empty line
or the end of the input ends the conversation. Ctrl-C during a reply stops it, and what it said
stays in the conversation; at the prompt, it ends. generate.py's flags, but --prompt and --chat.
Optional: generate.py works without this file.
"""
import os
import sys
from dataclasses import dataclass

import generate
from common import UserError, optional, require

# The cache's positions without --cache-len, within the model's own
CACHE_LEN = 8192


@dataclass
class Reply:
    tokens: list[int]  # the reply, cut before its stop token
    stats: generate.GenerationStats
    prefilled: int  # the turn's tokens that ran through the model
    reused: int  # the cached tokens of earlier turns it kept
    started_over: bool  # the conversation outgrew the cache: only the system message was kept


class Conversation:
    """A conversation in cache row 0 of `gen`. Each turn renders the whole conversation with the
    chat template, as transformers' apply_chat_template does, keeps the cached tokens of the longest
    prefix that rendering shares with what the cache holds, and prefills the rest
    (generate(..., start=)). Qwen3's template drops the thinking of earlier replies, so a reply that
    thought is prefilled again without it: what is reused is what the renderings share."""

    def __init__(self, checkpoint: generate.Checkpoint, gen: generate.Generator,
                 system: str | None = None, thinking: bool = True, **options):
        self.tokenizer = checkpoint.tokenizer
        self.gen = gen
        self.thinking = thinking
        # generate()'s max_new, stop_ids and check_every
        self.options = options
        self.system = [{"role": "system", "content": system}] if system else []
        self.messages = list(self.system)
        # The tokens whose keys and values cache row 0 holds, from position 0
        self.cached = []

    def render(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.encode(self.tokenizer.chat(messages, self.thinking))

    def say(self, text: str, on_tokens=None) -> Reply:
        """The reply to the user's `text`, streamed to on_tokens. A conversation over the cache
        starts over from the system message; a turn that alone is over it is refused."""
        turn = [{"role": "user", "content": text}]
        ids = self.render(self.messages + turn)
        # For the rendered conversation
        room = self.gen.capacity - self.options["max_new"]
        started_over = len(ids) > room
        if started_over:
            ids = self.render(self.system + turn)
            require(len(ids) <= room, f"this turn ({len(ids)} tokens, rendered) + max new tokens "
                    f"is over the cache length ({self.gen.capacity}): say it in fewer words, or "
                    "give a longer --cache-len")
            self.messages, self.cached = list(self.system), []
        # The longest common prefix (commonprefix takes lists too), but at least the last token
        # runs: its logits draw the reply's first
        reused = min(len(os.path.commonprefix([self.cached, ids])), len(ids) - 1)
        try:
            rows, stats = self.gen.generate([ids[reused:]], start=reused, on_tokens=on_tokens,
                                            **self.options)
        except KeyboardInterrupt:  # in the prefill: no reply, and the turn is not kept
            self.cached = self.cached[:reused]
            raise UserError("interrupted before the reply began: the turn is dropped") from None
        self.messages += [*turn, {"role": "assistant", "content": self.tokenizer.decode(rows[0])}]
        # The reply's last token was drawn, never fed: the cache holds the rest
        self.cached = (ids + rows[0])[:-1]
        return Reply(rows[0], stats, len(ids) - reused, reused, started_over)


def read_turn(interactive: bool) -> str:
    """The next line, without its line ending (a Windows file's too): typed after a `> ` prompt
    (readline's editing, where Python has it), or read from a pipe; "" at the end of the input."""
    try:
        if interactive:
            optional("readline")  # input()'s line editing, where Python has it
            line = input("> ")
        else:  # bytes: a line that is not UTF-8 is refused alone, the next ones still read
            line = sys.stdin.buffer.readline().decode()
        line.encode()  # a terminal's bytes that aren't UTF-8 come as lone surrogates
    except EOFError:  # Ctrl-D at the prompt: the shell's next prompt on a line of its own
        print()
        return ""
    except UnicodeError:
        again = ": type it again" if interactive else ""
        raise UserError(f"that line is not UTF-8 text{again}") from None
    return line.rstrip("\r\n")


def converse(argv) -> None:
    args = generate.parse_args(argv, __doc__, prompts=False)
    # torchrun (which sets LOCAL_RANK) would start a whole chat in each process: tp.py splits
    # generate.py's model alone
    require("LOCAL_RANK" not in os.environ, "chat.py is one process: run it without torchrun")
    require(sys.stdin, "stdin is closed: give the turns a terminal or a pipe")
    checkpoint, sampling, stop_ids = generate.load_for(args)
    # Refused now, not at every turn (as the flags below)
    require(checkpoint.tokenizer.chat_template, f"{args.checkpoint} has no chat template: chat.py "
            "needs one (generate.py takes plain prompts)")
    capacity = args.cache_len or min(CACHE_LEN, checkpoint.model.args.max_position_embeddings)
    # Refused now, not at every turn
    require(args.max_new_tokens < capacity, f"--max-new-tokens {args.max_new_tokens} leaves no "
            f"room in the cache ({capacity} positions): ask for fewer, or a longer --cache-len")
    gen = generate.Generator(checkpoint.model, batch=1, capacity=capacity, sampling=sampling,
                             compile=args.compile, cuda_graph=args.cuda_graph)
    chat = Conversation(checkpoint, gen, args.system, not args.no_think, stop_ids=stop_ids,
                        max_new=args.max_new_tokens, check_every=args.check_every)
    interactive = sys.stdin.isatty()
    failed = False
    while True:
        # Ctrl-C at the prompt ends the conversation; during a reply, the reply (in generate())
        try:
            text = read_turn(interactive)
            if not text.strip():
                break
            stream = generate.TextStream(checkpoint.tokenizer.decode)
            reply = chat.say(text, on_tokens=stream)
        except UserError as e:  # this turn alone: the conversation goes on
            print(f"error: {e}", file=sys.stderr)
            failed = True
            continue
        stream.finish([reply.tokens], [text])
        if reply.started_over:
            print("the conversation outgrew the cache: it starts over from the system message",
                  file=sys.stderr)
        print(f"{reply.prefilled} tokens prefilled, {reply.reused} reused. "
              f"{reply.stats.report([reply.tokens])}", file=sys.stderr)
    # Turns from a pipe, as a script's commands: one that failed makes the exit status 1
    if failed and not interactive:
        sys.exit(1)


def main(argv=None):
    generate.main(argv, command=converse)


if __name__ == "__main__":
    main()
