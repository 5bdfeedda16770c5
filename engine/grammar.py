"""Grammars for structured outputs: compile once per grammar (cached), one matcher per request.

llguidance does the work (a Rust library, no dependencies; see docs/architecture.md, "Structured outputs
and tools", for why it and not xgrammar). No torch here: the server compiles grammars with this module,
and engine/token_mask.py turns the matchers' states into logit masks at every step.

- `GrammarSpec`: what a request asks for (a JSON schema, any JSON object, a regex, a choice of strings,
  a Lark or GBNF grammar), hashable, so it keys the cache.
- `GrammarCompiler`: the tokenizer's llguidance view (built on first use, ~0.4 s) and an LRU cache of
  compiled grammars. A grammar that does not compile raises `GrammarError` with llguidance's message.
- `GrammarMatcher`: one request's parser state. It lives in the request's SamplingParams, so it exists
  only in the server process (rank 0, where the sampler runs) and follows the request through
  preemption: a preempted request keeps its outputs, so the state stays valid. The engine advances it
  to the request's output tokens before each mask (`advance`), so nobody else has to tell it which
  tokens were accepted.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

logger = logging.getLogger(__name__)

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "lark", "llguidance"]
CACHE_SIZE = 256  # compiled grammars kept (a matcher template each: tens of KB)
# JSON whitespace between tokens, bounded: room for pretty-printing a few levels deep, but a weak model
# sampled hot cannot loop on newlines until max_tokens (an unbounded pattern lets it; vLLM's answer is
# disable_any_whitespace, which takes pretty-printing away too).
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"


class GrammarError(ValueError):
    """The grammar (schema, regex, ...) cannot be compiled; the message says why."""


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on a request's output. `text` is the schema as canonical JSON (json_schema), the
    regex, the choices as a JSON list (choice), or the grammar (grammar: Lark or GBNF; lark: Lark only,
    for grammars the server builds itself; llguidance: a whole llguidance TopLevelGrammar as JSON, for
    grammars the server composes from others, e.g. free thinking text before a constrained answer)."""

    kind: GrammarKind
    text: str = ""
    any_whitespace: bool = True  # JSON: whitespace between tokens allowed (vLLM's disable_any_whitespace)

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool, any_whitespace: bool = True) -> GrammarSpec:
        return cls("json_schema", json.dumps(schema, sort_keys=False, separators=(",", ":")), any_whitespace)

    @classmethod
    def choice(cls, options: Sequence[str]) -> GrammarSpec:
        return cls("choice", json.dumps(list(options)))


def llguidance_grammar(spec: GrammarSpec) -> str:
    """The llguidance grammar for a spec (not yet checked; GrammarCompiler.compile checks it)."""
    import llguidance as llg

    if spec.kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_json_options(spec))
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.text)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON schema must be an object (or true/false)")
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=_json_options(spec))
        except ValueError as exc:
            raise GrammarError(f"invalid JSON schema: {exc}") from None
    if spec.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        options = json.loads(spec.text)
        if not options or not all(isinstance(o, str) and o for o in options):
            raise GrammarError("a choice needs at least one option, each a non-empty string")
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
    if spec.kind == "grammar":
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            lark = any_to_lark(spec.text)  # GBNF (llama.cpp, vLLM's examples) or Lark as it is
        except Exception as exc:  # the converter raises plain Exceptions for syntax errors
            raise GrammarError(f"invalid grammar: {exc}") from None
        return llg.LLMatcher.grammar_from_lark(lark)
    if spec.kind == "lark":
        return llg.LLMatcher.grammar_from_lark(spec.text)
    if spec.kind == "llguidance":
        return spec.text
    raise GrammarError(f"unknown grammar kind {spec.kind!r}")


def _json_options(spec: GrammarSpec) -> dict[str, Any]:
    # lenient: keywords llguidance does not implement (format: "email", ...) are ignored rather than
    # failing the request, as OpenAI's non-strict mode and vLLM do.
    if not spec.any_whitespace:
        return {"whitespace_flexible": False, "lenient": True}
    return {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE, "lenient": True}


class GrammarMatcher:
    """One request's position in its grammar. Advanced only by the engine's mask thread."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher  # llguidance.LLMatcher
        self.vocab_size = vocab_size  # of the mask llguidance fills (>= the model's logits width)
        self.num_consumed = 0
        self.error: str | None = None

    def advance(self, output_token_ids: Sequence[int]) -> None:
        """Consume the request's outputs not consumed yet (normally the one sampled last step)."""
        n = len(output_token_ids)
        if n > self.num_consumed and self.error is None:
            new = list(output_token_ids[self.num_consumed : n])
            if not self.matcher.consume_tokens(new):
                # Cannot happen for tokens sampled under the mask; the matcher then allows only EOS, so
                # the request ends instead of sampling from an empty set.
                self.error = self.matcher.get_error() or "the grammar rejected a token"
                logger.warning("grammar matcher failed: %s", self.error.splitlines()[0])
        self.num_consumed = n

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete sentence of the grammar."""
        return bool(self.matcher.is_accepting())


class CompiledGrammar:
    """A checked grammar: hands out fresh matchers (a copy of a template, cheaper than a parse)."""

    def __init__(self, spec: GrammarSpec, template: Any, vocab_size: int) -> None:
        self.spec = spec
        self._template = template
        self._vocab_size = vocab_size

    def new_matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy(), self._vocab_size)


class GrammarCompiler:
    """Compiles GrammarSpecs against one tokenizer; thread-safe; LRU-cached by spec."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_size: int = CACHE_SIZE,
    ) -> None:
        self._hf = hf_tokenizer
        # The mask must cover every logit: the model's vocabulary may be padded past the tokenizer's.
        self.vocab_size = max(vocab_size, len(hf_tokenizer))
        self._eos = sorted(eos_token_ids) or [hf_tokenizer.eos_token_id]
        self._llg_tokenizer: Any = None
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_compiled = 0

    def cached(self, spec: GrammarSpec) -> CompiledGrammar | None:
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
            return hit

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Blocking (a few ms for a typical schema, the first call ~0.4 s more): call from a worker
        thread. Raises GrammarError for a grammar llguidance rejects."""
        hit = self.cached(spec)
        if hit is not None:
            return hit
        import llguidance as llg

        tokenizer = self._tokenizer()
        grammar = llguidance_grammar(spec)
        error = llg.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise GrammarError(_first_lines(error))
        template = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(_first_lines(template.get_error()))
        compiled = CompiledGrammar(spec, template, self.vocab_size)
        with self._lock:
            self._cache[spec] = compiled
            self.num_compiled += 1
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._llg_tokenizer is None:
                import llguidance.hf

                self._llg_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self.vocab_size, eos_token=self._eos
                )
            return self._llg_tokenizer


def _first_lines(message: str, limit: int = 600) -> str:
    """llguidance's messages end with a parser-state dump that means nothing to a client."""
    text = message.split("\n<state>")[0].strip()
    return text if len(text) <= limit else text[:limit] + "..."
