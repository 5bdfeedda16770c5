"""Real English text for prompts without internet: the docstrings of Python standard-library modules.

The same Python version gives the same text, so a seed gives the same prompts on every machine that
runs it. The modules are fixed here (not discovered) for that reason.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings

CORPUS_MODULES: tuple[str, ...] = (
    "abc", "argparse", "asyncio.events", "asyncio.queues", "asyncio.tasks", "base64", "bisect",
    "calendar", "collections", "concurrent.futures", "configparser", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum", "fnmatch", "fractions",
    "ftplib", "functools", "getopt", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html.parser",
    "http.client", "http.cookiejar", "imaplib", "inspect", "io", "ipaddress", "itertools", "json",
    "locale", "logging", "lzma", "mailbox", "mimetypes", "operator", "optparse", "os", "pathlib",
    "pdb", "pickle", "pickletools", "platform", "plistlib", "poplib", "pprint", "queue", "random", "re",
    "sched", "secrets", "selectors", "shelve", "shlex", "shutil", "smtplib", "socket", "socketserver",
    "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading",
    "timeit", "tokenize", "trace", "traceback", "turtle", "typing", "unittest.case", "urllib.parse",
    "urllib.request", "uuid", "warnings", "wave", "weakref", "xml.dom.minidom", "zipfile",
)  # fmt: skip


def _module_docs(name: str) -> list[str]:
    try:
        module = importlib.import_module(name)
    except ImportError:  # a module a minimal Python build leaves out (e.g. turtle without tkinter)
        return []
    docs = [inspect.getdoc(module) or ""]
    with warnings.catch_warnings():  # deprecated module attributes (typing.io) warn when touched
        warnings.simplefilter("ignore")
        for attr in sorted(vars(module)):
            if attr.startswith("_"):
                continue
            obj = getattr(module, attr)
            # Only what the module defines, so re-exported names are not counted twice.
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                docs.append(inspect.getdoc(obj) or "")
    return [d.strip() for d in docs if d and len(d.split()) >= 8]


# ~40k tokens: windows at random offsets give plenty of distinct prompts of up to a few thousand
# tokens, and tokenizing it takes well under a second (the whole set of docstrings is ~3x longer).
MAX_CHARS = 160_000


@functools.cache
def stdlib_text(max_chars: int = MAX_CHARS) -> str:
    """Prose paragraphs separated by blank lines, at most `max_chars` characters."""
    parts: list[str] = []
    size = 0
    for name in CORPUS_MODULES:
        for doc in _module_docs(name):
            if size + len(doc) > max_chars:
                return "\n\n".join(parts)
            parts.append(doc)
            size += len(doc) + 2
    return "\n\n".join(parts)
