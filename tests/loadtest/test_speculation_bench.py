"""The quoting workload (loadtest/quoting.py) and the speculation benchmark (loadtest.speculation), end
to end on a tiny real model server."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from loadtest import speculation
from loadtest.quoting import CODE_TASKS, MAX_PASSAGE_TOKENS, PROSE_TASKS, quoting_tasks
from loadtest.tokenizer import HFTokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer_dir) -> HFTokenizer:
    return HFTokenizer(smollm2_tokenizer_dir)


def test_quoting_tasks_are_fixed_by_the_seed_and_quote_a_passage(tokenizer):
    tasks = quoting_tasks(tokenizer, seed=3, count=24)
    assert tasks == quoting_tasks(tokenizer, seed=3, count=24)
    assert tasks != quoting_tasks(tokenizer, seed=4, count=24)
    instructions = [t.split("{")[0].strip() for t in (*PROSE_TASKS, *CODE_TASKS)]
    for task in tasks:
        assert any(task.prompt.startswith(i) for i in instructions)
        # The answer is mostly the passage: the output length follows it.
        assert 60 < (task.output_len or 0) <= MAX_PASSAGE_TOKENS + 24
    assert sum("```python" in t.prompt for t in tasks) == 12  # half code, half prose


@pytest.mark.slow  # two server starts and two timed runs (~30 s): in `make test-slow`
@pytest.mark.timeout(300)
def test_the_benchmark_compares_speculation_on_and_off(tiny_llama_dir: Path, tmp_path: Path, capsys):
    server = f"{sys.executable} -m server --model {tiny_llama_dir} --dtype float32 --device cpu --num-kv-blocks 512"
    rc = speculation.main(
        ["--server-command", server, "--workloads", "quote", "--concurrency", "1", "--duration", "2"]
        + ["--output-dir", str(tmp_path)]
    )
    assert rc == 0
    report = (tmp_path / "speculation.md").read_text()
    assert "--speculative off" in report
    [row] = [line for line in report.splitlines() if line.startswith("| quote c=1")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    off, on, acceptance = float(cells[1]), float(cells[2]), cells[6]
    assert off > 0 and on > 0 and acceptance.endswith("%")  # the tiny model repeats itself: proposals
    assert (tmp_path / "quote-c1.json").is_file()
    assert "| quote c=1" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "quote", "chat"),
    [([], "--no-ignore-eos", "--ignore-eos"), (["--ignore-eos"], "--ignore-eos", "--ignore-eos")]
    + [(["--no-ignore-eos"], "--no-ignore-eos", "--no-ignore-eos")],
)
def test_quote_answers_end_at_the_end_of_turn_unless_told(flags: list[str], quote: str, chat: str) -> None:
    """Past its end of turn a small model invents text that quotes nothing: by default the quote
    scenario lets answers end there (the same token with speculation and without, under greedy), the
    chat scenario keeps exact lengths; the flag sets both."""
    a = speculation.build_parser().parse_args(flags)
    for workload, expect in (("quote", quote), ("chat", chat)):
        args = speculation.loadtest_args(speculation.Scenario(workload, 1), a, "off", "on", Path("out.json"))
        assert expect in args and len({"--ignore-eos", "--no-ignore-eos"} & set(args)) == 1
