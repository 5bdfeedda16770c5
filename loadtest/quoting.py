"""A workload whose answers quote their prompts: editing code, fixing a text, quoting a passage before
summarising it. The traffic speculative decoding is for (n-gram prompt lookup finds what comes next in
the prompt), beside the ORCA workload's, which it is not.

Passages are real text with no internet, and the same on every machine with the same Python: the
docstrings of the standard library (loadtest/corpus.py) and the source of its functions. Each task
pairs a passage with an instruction; request i is task i of a list shuffled by the seed (cycled when
a run needs more). A task's output length is the passage's length in tokens plus a little, so the
answer is mostly the quote; like every workload here it is sent as max_tokens = min_tokens with
ignore_eos, so every configuration generates exactly as many tokens (`--no-ignore-eos`: the answer ends
at the model's end of turn instead; greedy decoding ends it at the same token in every configuration).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import random
import re
import warnings

from loadtest.corpus import CORPUS_MODULES, stdlib_text
from loadtest.tokenizer import PromptTokenizer
from loadtest.workload import FileEntry

# Passages of this many tokens: long enough that a quote is most of an answer, short enough that a
# small model still follows the instruction.
MIN_PASSAGE_TOKENS = 60
MAX_PASSAGE_TOKENS = 220
EXTRA_OUTPUT_TOKENS = 24  # beyond the passage: the instruction's own words, a closing line
NUM_TASKS = 96

PROSE_TASKS = (
    "Copy this text exactly, word for word:\n\n{text}",
    "Fix the typos in this text and write it out again in full:\n\n{text}",
    "Quote the following passage word for word, then summarize it in one sentence.\n\n{text}",
)
CODE_TASKS = (
    "Rename the function `{name}` to `{name}_v2` and show the whole function.\n\n```python\n{text}\n```",
    "Add a short comment above the first line of this Python function and show the whole "
    "function.\n\n```python\n{text}\n```",
    "Copy this Python function exactly:\n\n```python\n{text}\n```",
)
_TYPOS = (("the ", "teh "), (" and ", " adn "), ("tion", "tino"))


@functools.cache
def stdlib_functions() -> tuple[tuple[str, str], ...]:
    """(name, source) of the standard library's functions in the corpus modules, in a fixed order."""
    out: list[tuple[str, str]] = []
    for module_name in CORPUS_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for attr in sorted(vars(module)):
                obj = getattr(module, attr)
                if not inspect.isfunction(obj) or getattr(obj, "__module__", None) != module.__name__:
                    continue
                try:
                    source = inspect.getsource(obj)
                except (OSError, TypeError):
                    continue
                out.append((obj.__name__, source.rstrip()))
    return tuple(out)


def _paragraphs() -> list[str]:
    return [p for p in re.split(r"\n\s*\n", stdlib_text()) if p.strip()]


def _with_typos(text: str, rng: random.Random) -> str:
    """The text with a few common typos in it (the task asks to fix them)."""
    right, wrong = rng.choice(_TYPOS)
    return text.replace(right, wrong, 3)


def quoting_tasks(tokenizer: PromptTokenizer, seed: int, count: int = NUM_TASKS) -> list[FileEntry]:
    """`count` tasks (half prose, half code), each a prompt and its output length in tokens."""
    rng = random.Random(seed)

    def fits(text: str) -> int | None:
        n = len(tokenizer.encode(text))
        return n if MIN_PASSAGE_TOKENS <= n <= MAX_PASSAGE_TOKENS else None

    prose = [p for p in _paragraphs() if fits(p)]
    code = [(name, src) for name, src in stdlib_functions() if fits(src)]
    if not prose or not code:
        raise RuntimeError("no passages of the right length in the standard library's text")
    rng.shuffle(prose)
    rng.shuffle(code)
    tasks: list[FileEntry] = []
    for i in range(count):
        if i % 2 == 0:
            text = prose[(i // 2) % len(prose)]
            template = PROSE_TASKS[(i // 2) % len(PROSE_TASKS)]
            shown = _with_typos(text, rng) if "typos" in template else text
            prompt = template.format(text=shown)
        else:
            name, text = code[(i // 2) % len(code)]
            prompt = CODE_TASKS[(i // 2) % len(CODE_TASKS)].format(name=name, text=text)
        tasks.append(FileEntry(prompt, len(tokenizer.encode(text)) + EXTRA_OUTPUT_TOKENS))
    rng.shuffle(tasks)
    return tasks
