"""Incremental detokenization: never emits broken UTF-8 or part of a stop string.

UTF-8 safety comes from tokenizers' DecodeStream, which holds back bytes until they
form whole characters. Stop strings are handled here: text that could still turn into
a stop string (the last `max(len(stop)) - 1` characters) is held back until the next
token settles it or the request finishes. As with EOS and stop token ids, a stop string ends a
request only from its `min_tokens`-th output token on: it must end in that token's text or later.
"""

from __future__ import annotations

import os

from tokenizers.decoders import DecodeStream

from tokenmill.sampling_params import SamplingParams

# Prompt tokens given to the stream as context, so the first output token decodes with the
# right leading space (as it would inside the full text).
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.backend = tokenizer.backend_tokenizer  # a tokenizers.Tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        context = prompt_token_ids[-_CONTEXT_TOKENS:]
        self.stream = DecodeStream(ids=context, skip_special_tokens=params.skip_special_tokens)
        # A context whose text ends inside a character (a token-id prompt: an earlier output cut
        # mid-character) makes the stream hand its whole text back with the first piece; until
        # then the output's ids are kept, to find that piece's own text (_first_piece).
        context_text = self.backend.decode(context, skip_special_tokens=params.skip_special_tokens)
        self.unfinished: tuple[list[int], str] | None = (
            (list(context), context_text) if context_text.endswith("\ufffd") else None)
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.min_tokens = params.min_tokens
        self.text = ""        # decoded so far (cut at a stop string once one matched)
        self.emitted = 0      # characters of `text` already handed out
        self.num_tokens = 0   # output tokens fed so far

    def update(self, new_token_ids: list[int], stop_token: bool = False) -> tuple[str, str | None]:
        """Feed new tokens; returns (text safe to emit now, the stop string that matched or None).
        stop_token: the last one ended the request (EOS or a stop token id); as in vLLM its text is
        left out, unless include_stop_str_in_output. Several tokens at once (accepted drafts) are
        searched token by token, as they would be one per step: a stop string ends the output at
        the first token that completes one, and `num_tokens` then counts the tokens up to it
        (the caller drops the rest)."""
        searched_from = len(self.text)
        matched = None
        for i, token in enumerate(new_token_ids):
            self.num_tokens += 1
            if self.num_tokens == self.min_tokens:  # stops may end in this token's text, not before
                searched_from = len(self.text)
            if stop_token and i == len(new_token_ids) - 1 and not self.include_stop:
                break
            piece = self.stream.step(self.backend, token)
            if self.unfinished is not None:
                self.unfinished[0].append(token)
                piece = self._first_piece(piece) if piece else piece
            if piece:
                self.text += piece
                if self.stop and self.num_tokens >= self.min_tokens:
                    matched = self._find_stop(searched_from)
                    if matched is not None:
                        break
        end = len(self.text) if matched else max(self.emitted, len(self.text) - self.hold)
        return self._emit(end), matched

    def _first_piece(self, piece: str) -> str:
        """The output's first text after a context that ends inside a character: what decoding
        the context with the output so far changes or adds to the context's own text (the
        character the output completes, or none of a byte it leaves broken)."""
        ids, context_text = self.unfinished
        self.unfinished = None
        whole = self.backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return whole[len(os.path.commonprefix([context_text, whole])):]

    def flush(self) -> str:
        """The held-back tail, once the request finished for a reason other than a stop string."""
        return self._emit(len(self.text))

    def _find_stop(self, searched_from: int) -> str | None:
        best = None
        for stop in self.stop:
            i = self.text.find(stop, max(0, searched_from - len(stop) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return None
        i, stop = best
        self.text = self.text[:i + len(stop) if self.include_stop else i]
        return stop

    def _emit(self, end: int) -> str:
        out = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return out
