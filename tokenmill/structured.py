"""Structured outputs: a JSON schema, a regex, a list of choices or a grammar, as token masks.

llguidance (one of vLLM's structured-output backends) compiles the constraint against the
tokenizer's vocabulary. Each constrained request carries a `Grammar` that follows its output:
before each of its sampling steps the grammar gives the tokens that keep the output inside the
language (a bitmask over the vocabulary, tens of microseconds for JSON), the sampler sets every
other logit to -inf, and each token the request appends advances the grammar. When the grammar
admits no further token the request ends with "stop"; where the language may go on (a regex
like [0-9]+), the model's end-of-sequence token is allowed wherever the output is complete.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import llguidance
import llguidance.numpy
import numpy as np

from tokenmill.sampling_params import MAX_SCHEMA_DEPTH, StructuredOutputsParams, check_schema_depth, too_deep

logger = logging.getLogger(__name__)

# JSON as json.dumps writes it ({"a": 1, "b": [2, 3]}): what models emit on one line. With
# llguidance's default (any whitespace between tokens) a small model can emit blank lines forever.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MIN_COMPILE_STACK = 64 << 20  # bytes of stack for compiling any grammar (compile_stack_bytes)
MAX_GRAMMAR_CHARS = 8 << 20   # a grammar's text (a JSON schema's included), past any body the server takes
MAX_PATTERNS_AT_ONCE = 8      # regexes a JSON schema may hold one string to (check_patterns_at_once)
MAX_ALLOF_VISITS = 200_000    # schemas check_patterns_at_once visits through allOf parts and their $refs

T = TypeVar("T")


class GrammarCompiler:
    """Compiles StructuredOutputsParams into per-request Grammars for one tokenizer. The
    tokenizer's llguidance form takes about 0.4 s to build (the default model's 49,152
    tokens), so it is built on first use, once, by whichever thread asks first."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size          # the width of the model's logits
        self.eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._stack_lock = threading.Lock()

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf  # imports transformers: not for a command line that only reads this module
                try:
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(
                        self.tokenizer, n_vocab=max(self.vocab_size, len(self.tokenizer)),
                        eos_token=self.eos_token_ids or None)
                except ValueError as exc:  # a slow (Python) tokenizer
                    raise ValueError(f"structured outputs need a fast tokenizer: {exc}") from None
            return self._ll_tokenizer

    def compile(self, spec: StructuredOutputsParams) -> Grammar:
        """A fresh Grammar for one request; ValueError naming the problem for an invalid one."""
        tokenizer = self.ll_tokenizer()
        try:
            text = grammar_text(spec)
        except ValueError as exc:
            raise ValueError(f"invalid structured output: {exc}") from None
        return self._on_own_stack(lambda: self._matcher(tokenizer, text), compile_stack_bytes(text))

    def _on_own_stack(self, fn: Callable[[], T], stack_bytes: int) -> T:
        """fn() on a thread of its own with a stack of `stack_bytes`. threading.stack_size is the
        process's setting for the threads started next: set for this one under the lock, then
        put back (another thread started meanwhile elsewhere gets the big stack too: harmless)."""
        pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        with self._stack_lock:
            before = threading.stack_size(stack_bytes)
            try:
                future = pool.submit(fn)  # (its thread starts here)
            finally:
                threading.stack_size(before)
        try:
            return future.result()  # (fn's exception raised here)
        finally:
            pool.shutdown()

    def _matcher(self, tokenizer: llguidance.LLTokenizer, text: str) -> Grammar:
        matcher = llguidance.LLMatcher(tokenizer, text, log_level=0)  # (never raises: an invalid
        grammar = Grammar(matcher, mask_width(tokenizer.vocab_size))   # grammar leaves it failed)
        if matcher.is_error():
            raise ValueError(f"invalid structured output: {compile_error(matcher.get_error())}")
        mask = np.zeros((1, grammar.num_words), np.int32)
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        if matcher.is_error():  # one that no text satisfies ([^\s\S]) fails on its first mask
            raise ValueError(f"invalid structured output: no text satisfies it ({grammar.error})")
        # llguidance builds its lexer as tokens come: one too big to build (a{1000000}) fails only
        # at the first token, mid-generation. A copy takes the first token the mask allows now.
        probe, allowed = matcher.deep_copy(), np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
        if allowed.size and (not probe.consume_token(int(allowed[0])) or probe.is_error()):
            raise ValueError(f"invalid structured output: {Grammar(probe, grammar.num_words).error}")
        return grammar


def compile_error(text: str) -> str:
    """llguidance's compile error without the backtrace it appends to a panic (a grammar of 65,600
    alternatives trips an assertion): frames of the server's own stack are no message."""
    return text.split("<backtrace>", 1)[0].strip()


def compile_stack_bytes(text: str) -> int:
    """The stack llguidance's compiler gets for a grammar. It recurses once per rule of a chain (a
    $ref to a $ref to ..., a Lark rule naming the next), about 3 KB a level, and a chain of 3,000
    overflowed the 8 MB stack of a default thread: a segfault that took the server down. A level
    takes at least 12 characters of grammar text, so 1 KB of stack a character covers any chain
    the text can hold; it is address space, touched only as deep as the compiler goes."""
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"invalid structured output: its grammar is {len(text):,} characters, more than "
                         f"{MAX_GRAMMAR_CHARS:,}")
    return MIN_COMPILE_STACK + 1024 * len(text)


def grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for the one constraint the spec sets."""
    if spec.json is not None or spec.json_object:
        schema = {"type": "object"} if spec.json_object else spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
            except RecursionError:  # nested past the decoder's own limit, far past ours
                raise too_deep("the JSON schema", MAX_SCHEMA_DEPTH) from None
            check_schema_depth(schema, "the JSON schema")
        check_patterns_at_once(schema)
        if spec.disable_additional_properties and isinstance(schema, dict):
            schema = forbid_undeclared_properties(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    if spec.regex is not None:
        return llguidance.grammar_from("regex", spec.regex)
    if spec.choice is not None:
        return llguidance.grammar_from("choice", spec.choice)
    return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to it


# An object schema with one of these says itself what its other properties may be.
OTHER_PROPERTIES = ("additionalProperties", "patternProperties", "unevaluatedProperties")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")   # name -> schema
SCHEMA_VALUES = ("items", "additionalItems", "additionalProperties")     # a schema (items: or a list)


def forbid_undeclared_properties(schema: dict) -> dict:
    """A copy of a JSON schema in which each object schema that declares properties (`properties`,
    even empty, or `required`) and says nothing of any others (OTHER_PROPERTIES) takes no others:
    `"additionalProperties": false`. JSON Schema's own default admits any other key, and under it
    a model writes keys that no caller declared ({"city": "Paris", "location": "Europe"} for a
    function f(city)); clients mean the keys they list, as vLLM's default backend (xgrammar) reads
    them. Values (const, enum, default, examples) are data, never rewritten.

    Composition is closed as a whole, not part by part (a part closed on its own would refuse its
    siblings' keys): an object made of `allOf` parts, or of a `$ref` beside keys of its own, is
    closed on the names of all of them, the parts left open (a local `$ref` part copied in); where
    it branches (`anyOf`, `oneOf`), each branch is closed on its own names plus the object's."""
    return _Closer(schema).walk(schema)


class _Closer:
    def __init__(self, root: dict) -> None:
        self.root = root

    def walk(self, node, extra: tuple = (), settled: bool = False, part: bool = False, chain: tuple = ()):
        """node's copy. extra: the names declared beside it (by the object it is a part or a branch
        of); settled: that object says itself what other properties it takes; part: node is an
        allOf part, closed by its whole; chain: the $refs copied in on the way (a cycle stays a $ref)."""
        if not isinstance(node, dict):
            return node
        out = dict(node)
        for key in SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                out[key] = {name: self.walk(sub) for name, sub in node[key].items()}
        for key in SCHEMA_VALUES:
            if isinstance(node.get(key), list):
                out[key] = [self.walk(sub) for sub in node[key]]
            elif key in node:
                out[key] = self.walk(node[key])
        if isinstance(node.get("prefixItems"), list):
            out["prefixItems"] = [self.walk(sub) for sub in node["prefixItems"]]
        ref, parts = self.parts(node, extra, chain)
        names, settled, branches = self.level(node, ref, parts, extra, settled)
        if ref is not None:  # the $ref's object first, then the node's: llguidance's order of their keys
            del out["$ref"]
            parts = [ref] + parts
        if parts:
            out["allOf"] = [self.walk(p, names, settled, True, c) for p, c in parts]
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                out[key] = [self.walk(sub, names, settled, chain=chain) for sub in node[key]]
        if (names or isinstance(node.get("properties"), dict)) and not (part or settled or branches):
            declared = out.get("properties") if isinstance(out.get("properties"), dict) else {}
            out["properties"] = {n: declared.get(n, True) for n in dict.fromkeys((*names, *declared))}
            out["additionalProperties"] = False
        return out

    def parts(self, node: dict, extra: tuple, chain: tuple) -> tuple[tuple | None, list[tuple]]:
        """What node is the intersection of, each (schema, chain): its $ref where node declares names
        of its own or beside it (a lone $ref is a reference, closed where it is defined), and its allOf."""
        parts = [self.resolve(p, chain) for p in node["allOf"]] if isinstance(node.get("allOf"), list) else []
        ref = None
        if isinstance(node.get("$ref"), str) and (parts or extra or _own_names(node) or "anyOf" in node
                                                  or "oneOf" in node):
            ref = self.resolve({"$ref": node["$ref"]}, chain)
            ref = ref if ref[1] != chain else None  # (one it cannot copy in stays where it is)
        return ref, parts

    def level(self, node: dict, ref: tuple | None, parts: list, extra: tuple,
              settled: bool) -> tuple[tuple, bool, bool]:
        """(names declared in their order, whether it says what others it takes, whether it
        branches) of the one object that node and its parts make."""
        names, branches = list(extra), "anyOf" in node or "oneOf" in node
        settled = settled or any(k in node for k in OTHER_PROPERTIES)
        for p, chain in ([ref] if ref else []) + [(None, ())] + parts:  # (None: node's own names)
            if p is None:
                names += _own_names(node)
            elif isinstance(p, dict):
                sub_names, settled, sub_branches = self.level(p, *self.parts(p, (), chain), (), settled)
                names, branches = names + list(sub_names), branches or sub_branches
        return tuple(dict.fromkeys(names)), settled, branches

    def resolve(self, node, chain: tuple) -> tuple[object, tuple]:
        """A part that is only a local $ref ("#/$defs/Name"): a copy of the schema it names (left
        open inside its whole, while the definition is closed where it is used alone), and the
        chain with the $ref; anything else (another part, a remote $ref, a cycle) as it is."""
        ref = node.get("$ref") if isinstance(node, dict) and len(node) == 1 else None
        if not isinstance(ref, str) or not ref.startswith("#") or ref in chain:
            return node, chain
        target = _pointer(self.root, ref)
        if not isinstance(target, dict):
            return node, chain
        copy = {k: v for k, v in target.items() if k not in ("$defs", "definitions", "$schema", "$id")}
        return copy, chain + (ref,)


def _pointer(root, ref: str):
    """What a local $ref ("#/$defs/Name") names in `root`, or None."""
    target = root
    for key in ref[1:].split("/")[1:]:
        key = key.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or key not in target:
            return None
        target = target[key]
    return target


def check_patterns_at_once(schema) -> None:
    """ValueError for a JSON schema that holds a string to more than MAX_PATTERNS_AT_ONCE regexes
    at once (allOf parts, nested or through local $refs, each with a `pattern`): llguidance checks
    that their intersection is not empty, and that check grows exponentially with their number
    (23 took 14 s and 1.3 GB, 25 failed to allocate 4.5 GB: a request that could take the server
    down). Refused as well: allOf parts that reach past MAX_ALLOF_VISITS schemas in all."""
    stack, visits = [schema], 0
    while stack:  # every object in the schema
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if isinstance(node.get("allOf"), list):
                count, visits = _patterns_at_once(schema, node, visits)
                if count > MAX_PATTERNS_AT_ONCE:
                    raise ValueError(f"the JSON schema holds a string to more than {MAX_PATTERNS_AT_ONCE} patterns "
                                     "at once (allOf parts), which are not taken")
            stack.extend(node.values())


def _patterns_at_once(root, node: dict, visits: int) -> tuple[int, int]:
    """The `pattern`s that node, its allOf parts and the local $refs among them hold a value to
    together (up to one past the limit), and the visits so far."""
    count, todo, seen = 0, [node], set()
    while todo and count <= MAX_PATTERNS_AT_ONCE:
        part = todo.pop()
        visits += 1
        if visits > MAX_ALLOF_VISITS:
            raise ValueError(f"the JSON schema's allOf parts reach past {MAX_ALLOF_VISITS:,} schemas")
        if not isinstance(part, dict):
            continue
        count += isinstance(part.get("pattern"), str)
        if isinstance(part.get("allOf"), list):
            todo.extend(part["allOf"])
        ref = part.get("$ref")
        if isinstance(ref, str) and ref.startswith("#") and ref not in seen:
            seen.add(ref)
            todo.append(_pointer(root, ref))
    return count, visits


def _own_names(node: dict) -> list[str]:
    """The property names a schema declares itself: its properties, then its required."""
    names = list(node["properties"]) if isinstance(node.get("properties"), dict) else []
    if isinstance(node.get("required"), list):
        names += [n for n in node["required"] if isinstance(n, str)]
    return list(dict.fromkeys(names))


class Grammar:
    """One request's position in its language."""

    def __init__(self, matcher: llguidance.LLMatcher, num_words: int) -> None:
        self.matcher = matcher
        self.num_words = num_words            # of its bitmask rows: the tokenizer's vocabulary / 32

    def fill_mask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the tokens allowed next into row `row` of an int32 bitmask (bit t of word t // 32
        for token t). A matcher that has stopped, or failed, allows only the end-of-sequence tokens."""
        llguidance.numpy.fill_next_token_bitmask(self.matcher, bitmask, row)

    def accept(self, token_id: int) -> None:
        """Advance past a token the request appended. A token the mask did not allow (there is
        none, unless a caller appends tokens of its own) leaves the matcher failed, which ends the
        request with an error."""
        if not self.matcher.consume_token(token_id) or self.matcher.is_error():
            logger.warning("a structured output's grammar failed (the request ends with an error): %s",
                           self.error)

    @property
    def is_terminated(self) -> bool:
        """No token may follow: the output is complete (or the matcher failed)."""
        return self.matcher.is_stopped() or self.failed

    @property
    def failed(self) -> bool:
        """The matcher failed: the output does not follow the grammar, so it is no answer."""
        return self.matcher.is_error()

    @property
    def error(self) -> str:
        """llguidance's message, first line (the rest dumps the parser's state and the grammar)."""
        return self.matcher.get_error().strip().split("\n", 1)[0]


def mask_width(vocab_size: int) -> int:
    """32-bit words of a bitmask over vocab_size tokens."""
    return (vocab_size + 31) // 32


def allowed_tokens(grammars: list[Grammar], vocab_size: int) -> np.ndarray:
    """(G, vocab_size) bool: the tokens each grammar allows next (the logits' width: tokens the
    tokenizer has beyond it are never sampled; logits beyond the tokenizer's tokens are never allowed)."""
    bitmask = np.zeros((len(grammars), grammars[0].num_words), dtype=np.int32)
    for row, grammar in enumerate(grammars):
        grammar.fill_mask(bitmask, row)
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little").astype(bool)  # x86: little-endian words
    if bits.shape[1] < vocab_size:
        bits = np.pad(bits, ((0, 0), (0, vocab_size - bits.shape[1])))
    return bits[:, :vocab_size]
