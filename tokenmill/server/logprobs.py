"""Log-probabilities in OpenAI's two shapes: the legacy one of /v1/completions (parallel lists
of tokens, logprobs, top-logprob dicts and text offsets) and the one of /v1/chat/completions
(an entry per token with its bytes and its top alternatives)."""

from __future__ import annotations

import codecs


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character that stands for each byte in a
    byte-level BPE vocabulary -> that byte. Printable Latin-1 bytes stand for themselves; the
    others, in order, for the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


BYTE_ALPHABET = _byte_alphabet()


def token_bytes(tokenizer, token_id: int, text: str | None = None) -> list[int]:
    """A token's own bytes, as OpenAI's `bytes` field gives them, from its text decoded alone (given
    as `text` where the caller has it): a piece of a character (an emoji's first bytes) decodes to
    "\ufffd", so its bytes come from its vocabulary entry, in GPT-2's byte alphabet or as
    sentencepiece's <0xNN>."""
    text = tokenizer.decode([token_id]) if text is None else text
    if "\ufffd" not in text:
        return list(text.encode())
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return [int(piece[3:5], 16)]
    if all(c in BYTE_ALPHABET for c in piece):
        return [BYTE_ALPHABET[c] for c in piece]
    return list(text.encode())


def _by_text(entry: dict[int, float], token_text) -> dict[str, float]:
    """{token text: logprob} of a logprobs entry. Of tokens that decode to the same text (byte
    pieces of one character all read "\ufffd") the first stays: the entry lists the chosen token,
    then the top ones best first, so a shared text keeps the chosen token's logprob, or else the
    best one's."""
    out: dict[str, float] = {}
    for token, lp in entry.items():
        out.setdefault(token_text(token), lp)
    return out


class TextOffsets:
    """Where each next token's text starts in a completion's text, in characters. A token that
    carries only part of a character (an emoji's first bytes, which decode alone to "\ufffd")
    starts where that character does, and the text moves on by the characters its bytes complete;
    a piece left incomplete before a whole token counts as the one "\ufffd" the text shows."""

    def __init__(self, start: int = 0):
        self.next = start
        self._pieces = codecs.getincrementaldecoder("utf-8")("replace")

    def take(self, tokenizer, token_id: int, text: str) -> int:
        """The offset of `token_id` (whose text alone is `text`); moves past it."""
        at = self.next
        if "\ufffd" in text:
            self.next += len(self._pieces.decode(bytes(token_bytes(tokenizer, token_id, text))))
        else:
            self.next += len(self._pieces.decode(b"", final=True)) + len(text)
            self._pieces.reset()
        return at


def completion_logprobs(tokenizer, entries: list[dict[int, float] | None], token_ids: list[int],
                        offsets: TextOffsets, as_ids: bool = False) -> dict:
    """OpenAI's legacy logprobs of `token_ids`, their text offsets taken from `offsets` (which
    moves past them); an entry of None (a prompt's first token) gives nulls. as_ids: tokens
    named "token_id:ID" (vLLM's return_tokens_as_token_ids), the offsets still the text's."""
    tokens, lps, tops, starts = [], [], [], []
    token_text = _token_text(tokenizer)
    shown = _token_id_text if as_ids else token_text
    for token, entry in zip(token_ids, entries):
        text = token_text(token)
        tokens.append(_token_id_text(token) if as_ids else text)
        lps.append(entry.get(token) if entry is not None else None)
        tops.append(_by_text(entry, shown) if entry is not None else None)
        starts.append(offsets.take(tokenizer, token, text))
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": starts}


def chat_logprobs(tokenizer, entries: list[dict[int, float]], token_ids: list[int], top_n: int,
                  as_ids: bool = False) -> dict:
    """Chat logprobs of `token_ids`: each token with its bytes and its `top_n` best alternatives.
    as_ids: tokens named "token_id:ID" (vLLM's return_tokens_as_token_ids), with their own bytes."""
    token_text = _token_text(tokenizer)

    def described(token: int, lp: float | None) -> dict:  # (each token decoded once)
        text = token_text(token)
        return {"token": _token_id_text(token) if as_ids else text, "logprob": lp,
                "bytes": token_bytes(tokenizer, token, text)}
    content = []
    for token, entry in zip(token_ids, entries):
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
        content.append({**described(token, entry.get(token)), "top_logprobs": [described(t, lp) for t, lp in top]})
    return {"content": content}


def ranked(entry: dict[int, float], rank: int, n: int) -> list[tuple[int, float, int]]:
    """A prompt token's entry (its own token first, then the top-N best first without it) as
    (token, logprob, rank), cut to the own token and the top n. The alternatives' ranks follow
    from the own token's: they are the top-N in order, without it."""
    out = [(token, lp, k if k < rank else k + 1) for k, (token, lp) in enumerate(entry.items())]
    return [(*out[0][:2], rank)] + [alternative for alternative in out[1:] if alternative[2] <= n]


def top_prompt_entries(entries: list[dict[int, float] | None], ranks: list[int | None],
                       n: int) -> list[dict[int, float] | None]:
    """Prompt entries scored with a top-N of at least n, cut to the top n (as if scored with n)."""
    return [None if entry is None else {token: lp for token, lp, _ in ranked(entry, rank, n)}
            for entry, rank in zip(entries, ranks)]


def prompt_logprobs(tokenizer, entries: list[dict[int, float] | None], ranks: list[int | None],
                    n: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token (None for the first) {token id: {"logprob", "rank",
    "decoded_token"}}, the prompt's own token first, then the top n best first."""
    token_text = _token_text(tokenizer)
    return [None if entry is None else {str(token): {"logprob": lp, "rank": r, "decoded_token": token_text(token)}
                                        for token, lp, r in ranked(entry, rank, n)}
            for entry, rank in zip(entries, ranks)]


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


def _token_text(tokenizer):
    """One token's text, decoded alone."""
    return lambda token_id: tokenizer.decode([token_id])
