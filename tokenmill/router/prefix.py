"""Which prompt prefixes a replica has seen, approximately: a chain of hashes over fixed-size
chunks of the request's text, kept per replica in a bounded set.

The engine's prefix cache (kv_cache.py) chains a hash over each full block of token ids, each
hash covering its parent's, so one hash stands for the whole prefix up to its block. The router
does the same over characters instead of tokens: it loads no tokenizer, and asking a replica's
/tokenize would add a round trip (and the replica's tokenizer time) before every first token.
Text that shares a prefix tokenizes to ids that share a prefix, except near the point where the
texts part, so the matched length in chunks follows the replica's cached blocks closely, at a
granularity of CHUNK_CHARS characters (about a 16-token block of English) rather than of blocks.
SGLang's router matches text the same way, with a radix tree over characters.

A replica's set is bounded: past its capacity the least recently routed hashes go first, and a
chain is touched from its last chunk to its first, so a prefix's start outlives its ends (a chain
cut at its start would match nothing). It only approximates the replica's cache, which evicts by
its own pressure; a replica that restarts starts with an empty set (replicas.py clears it).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict

CHUNK_CHARS = 64
DEFAULT_DECODE_TOKENS = 16   # a request's decode steps when its body names no max_tokens (the completions default)
MAX_DECODE_TOKENS = 256      # max_tokens is a bound, often set high: past this it says little of an answer's length


def chunk_hashes(text: str, chunk_chars: int = CHUNK_CHARS) -> list[bytes]:
    """The chained hashes of the full `chunk_chars` chunks of `text` (a partial last chunk has
    none, as a partial KV block has none): hash i covers chunks 0..i."""
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, len(text) - chunk_chars + 1, chunk_chars):
        parent = hashlib.blake2b(parent + text[start:start + chunk_chars].encode("utf-8", "surrogatepass"),
                                 digest_size=8).digest()
        hashes.append(parent)
    return hashes


def routing_text(path: str, body: dict) -> str:
    """The text whose prefix decides where a request goes: a completion's prompt (the first of a
    batch: the whole batch goes to one replica), or a chat's tools and messages in order, each
    message as its role and content; after a cache_salt, which the replicas' caches share blocks
    under. Anything malformed gives what it can; the replica answers the 400."""
    salt = body.get("cache_salt")
    return (f"<salt>{salt}</salt>" if isinstance(salt, str) else "") + _routed_input(path, body)


def _routed_input(path: str, body: dict) -> str:
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        parts = [json.dumps(body["tools"], sort_keys=True)] if body.get("tools") else []
        for message in messages if isinstance(messages, list) else []:
            if isinstance(message, dict):
                content = message.get("content")
                text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
                parts.append(f"<{message.get('role')}>{text}")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def decode_tokens(body: dict) -> int:
    """The decode steps a request asks for, as the policy weighs them: its max_completion_tokens or
    max_tokens, at most MAX_DECODE_TOKENS; DEFAULT_DECODE_TOKENS when it names neither as a
    positive integer (the replica answers a bad one's 400)."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return min(value, MAX_DECODE_TOKENS)
    return DEFAULT_DECODE_TOKENS


class PrefixSet:
    """The chain hashes routed to one replica, at most `capacity`, least recently routed first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a prefix set holds at least 1 hash, got {capacity}")
        self.capacity = capacity
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def match(self, hashes: list[bytes]) -> int:
        """How many leading chunks of a chain the set holds."""
        for i, h in enumerate(hashes):
            if h not in self._hashes:
                return i
        return len(hashes)

    def insert(self, hashes: list[bytes]) -> None:
        """Record a chain as routed here now (last chunk first: the start is the most recent),
        then drop the least recently routed hashes past the capacity."""
        for h in reversed(hashes):
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def clear(self) -> None:
        self._hashes.clear()
