"""`logprobs` as the OpenAI API shapes them: /v1/completions' parallel lists (tokens, their
logprobs, the top alternatives, each token's offset in the choice's text), /v1/chat/completions'
`content` entries (token, logprob, UTF-8 bytes, alternatives). A token's text is its own decoding
(`TokenTexts`), as vLLM reports it."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from rbcompile.runtime.engine.logprobs import TokenLogprob


@dataclass(frozen=True)
class Echo:
    """A prompt as `echo` reports it: its text, its tokens and (with `logprobs`) theirs."""
    text: str
    tokens: list[int]
    entries: list[TokenLogprob | None] | None


class TokenTexts:
    """Each token id's text, decoded alone (special tokens kept) and remembered."""

    def __init__(self, tokenizer):
        self.tokenizer, self.known = tokenizer, {}

    def __call__(self, token: int) -> str:
        if token not in self.known:
            self.known[token] = self.tokenizer.decode([token])
        return self.known[token]


def completion_logprobs(entries: list[TokenLogprob | None], tokens: list[int],
                        texts: TokenTexts, offset: int = 0) -> dict:
    """The completions `logprobs` object of `tokens` (entries None: the prompt's first token,
    which has none), their text starting at character `offset` of the choice's text."""
    strings = [texts(token) for token in tokens]
    return {"tokens": strings,
            "token_logprobs": [None if entry is None else entry.logprob for entry in entries],
            "top_logprobs": [None if entry is None else
                             {texts(token): value for token, value in entry.top}
                             for entry in entries],
            "text_offset": list(accumulate((len(s) for s in strings[:-1]), initial=offset))}


def chat_logprobs(entries: list[TokenLogprob], texts: TokenTexts) -> dict:
    """The chat `logprobs` object of generated tokens."""
    def entry(token: int, logprob: float) -> dict:
        text = texts(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    return {"content": [entry(item.token, item.logprob) | {
        "top_logprobs": [entry(token, value) for token, value in item.top]}
        for item in entries]}


def join_logprobs(first: dict, second: dict) -> dict:
    """Two completions `logprobs` objects of consecutive tokens as one."""
    return {key: first[key] + second[key] for key in first}


def kept_tokens(tokens: list[int], text: str, decode) -> int:
    """How many of `tokens` a choice's `text` holds (fewer when it was cut at a stop string):
    the fewest whose decoding is at least as long (all of them when it is not cut)."""
    if len(decode(tokens)) <= len(text):
        return len(tokens)
    low, high = 0, len(tokens)
    while low < high:
        middle = (low + high) // 2
        if len(decode(tokens[:middle])) >= len(text):
            high = middle
        else:
            low = middle + 1
    return low


class StreamLogprobs:
    """The logprobs a stream's chunks carry: each choice's tokens since its last chunk (None
    where none were asked); with `echo`, its prompt's first. `run`: a choices.TokenRun, `fmt`:
    its ChoiceFormat, `job`: the completions' checked request."""

    def __init__(self, run, fmt, texts: TokenTexts, job):
        self.run, self.fmt, self.texts, self.job = run, fmt, texts, job
        self.asked = job.body.logprob_alternatives() is not None
        self.sent = [0] * job.choices          # tokens reported per choice
        self.offset = [0] * job.choices        # characters of text reported per choice

    def echo(self, index: int) -> tuple[str, dict | None]:
        echo = self.job.echo[index // self.job.body.n]
        self.offset[index] = len(echo.text)
        return echo.text, self.fmt.logprobs(echo.entries, echo.tokens, self.texts) \
            if self.asked else None

    def since(self, index: int, tokens: list[int]) -> dict | None:
        if not self.asked or self.sent[index] >= len(tokens):
            return None
        new, start = tokens[self.sent[index]:], self.sent[index]
        self.sent[index] = len(tokens)
        report = self.fmt.logprobs(self.run.requests[index].token_logprobs[start:len(tokens)],
                                   new, self.texts, self.offset[index])
        self.offset[index] += sum(len(self.texts(token)) for token in new)
        return report
