"""Specs to llguidance grammars, validated and compiled once per spec for one tokenizer.

Why llguidance (measured, docs/benchmarks.md "Structured output"): on our SmolLM-shaped
tokenizer it computes a mask in ~15 us per token (xgrammar ~5 us; both far below a step),
builds a typical schema's grammar in ~2.5 ms (xgrammar ~6 ms), enforces number bounds and
string patterns, reports unsatisfiable schemas, and imports in 0.1 s without torch (xgrammar
pulls in torch, 1.4 s), so the torch-free server process validates schemas itself.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from swiftserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import numpy as np
    from llguidance import LLMatcher, LLTokenizer

# JSON without free whitespace: a small model allowed any whitespace often emits it forever.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A spec the grammar library cannot compile, or one that admits no output."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for a spec (not yet checked against a tokenizer)."""
    from llguidance import LLMatcher

    options: dict[str, Any] = COMPACT_JSON if spec.disable_any_whitespace else {"whitespace_flexible": True}
    kind = spec.kind
    if kind in ("json", "json_object"):
        schema = spec.json if kind == "json" else '{"type": "object"}'
        try:
            return LLMatcher.grammar_from_json_schema(schema or "", defaults=options)  # type: ignore[arg-type]
        except ValueError as e:
            raise GrammarError(f"json: not a JSON schema object: {e}", kind) from e
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec.regex or "")
    if kind == "choice":
        # Lark string literals take JSON's escapes, so any choice text is spelled exactly.
        alternatives = " | ".join(json.dumps(c) for c in spec.choice or ())
        return LLMatcher.grammar_from_lark(f"start: {alternatives}")
    return LLMatcher.grammar_from_lark(spec.grammar or "")


class GrammarCompiler:
    """Validates specs and hands out fresh matchers for one tokenizer; thread-safe.

    A spec's grammar is built once (the first matcher is kept as a template, later ones are
    ``deep_copy``s of it), so a schema used by many requests costs its build once.
    """

    def __init__(
        self,
        tokenizer_json: Callable[[], str],
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_size: int = 256,
    ):
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._tokenizer: LLTokenizer | None = None
        self._templates: OrderedDict[StructuredOutputsParams, LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> LLTokenizer:
        """The llguidance tokenizer (built on first use, ~40 ms)."""
        with self._lock:
            if self._tokenizer is None:
                from llguidance import LLTokenizer

                eos = list(self.eos_token_ids) or None  # None: the tokenizer's own EOS
                self._tokenizer = LLTokenizer(self._tokenizer_json(), n_vocab=self.vocab_size, eos_token=eos)
            return self._tokenizer

    def matcher(self, spec: StructuredOutputsParams) -> LLMatcher:
        """A fresh matcher at the start of the spec's grammar; GrammarError if it is invalid."""
        with self._lock:
            template = self._templates.get(spec)
            if template is not None:
                self._templates.move_to_end(spec)
                return template.deep_copy()
        template = self._build(spec)  # outside the lock: llguidance drops the GIL to build
        with self._lock:
            self._templates[spec] = template
            while len(self._templates) > self._cache_size:
                self._templates.popitem(last=False)
        return template.deep_copy()

    def validate(self, spec: StructuredOutputsParams) -> None:
        """Raise GrammarError (naming the spec's field) unless the spec compiles and admits output."""
        self.matcher(spec)

    def _build(self, spec: StructuredOutputsParams) -> LLMatcher:
        from llguidance import LLMatcher

        tokenizer = self.tokenizer
        grammar = grammar_text(spec)
        error = LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise GrammarError(f"{spec.kind}: {error.strip().splitlines()[0]}", spec.kind)
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{spec.kind}: {matcher.get_error().splitlines()[0]}", spec.kind)
        if not matcher.is_accepting():
            first = allowed_tokens(fill_bitmasks([matcher], self.vocab_size), self.vocab_size)[0]
            if not set(first.nonzero()[0].tolist()) - set(self.eos_token_ids):
                raise GrammarError(f"{spec.kind}: matches no output this model's tokens can spell", spec.kind)
        return matcher


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a token bitmask."""
    return (vocab_size + 31) // 32


def fill_bitmasks(matchers: Sequence[LLMatcher], vocab_size: int) -> np.ndarray:
    """[len(matchers), words] int32 bitmasks: bit t of a row is set when token t may come next."""
    import numpy as np  # not at import: the server's import path stays numpy-free (fast start)

    out = np.zeros((len(matchers), bitmask_words(vocab_size)), dtype=np.int32)
    for row, matcher in enumerate(matchers):
        view = out[row]
        matcher.unsafe_compute_mask_ptr(view.ctypes.data, view.nbytes)
    return out


def allowed_tokens(bitmasks: np.ndarray, vocab_size: int | None = None) -> np.ndarray:
    """Unpack [rows, words] bitmasks into [rows, vocab] booleans (token t is bit t % 32 of word
    t // 32; little-endian bytes keep that order under ``unpackbits(bitorder="little")``)."""
    import numpy as np

    bits = np.unpackbits(bitmasks.view(np.uint8), axis=1, bitorder="little")
    return bits[:, :vocab_size].astype(bool) if vocab_size else bits.astype(bool)


def tokenizer_json(backend: Any) -> str:
    """A ``tokenizers.Tokenizer``'s JSON without padding or truncation (what llguidance reads)."""
    from copy import copy

    tok = copy(backend)
    tok.no_padding()
    tok.no_truncation()
    return str(tok.to_str())
