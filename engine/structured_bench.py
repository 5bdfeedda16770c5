"""What a grammar costs per output token: decode steps with every row constrained against the same batch
unconstrained, in one run, alternating, on the same runner.

    python -m engine.structured_bench [--model default] [--batch-sizes 8,32] [--steps 48] [--repeats 3]
                                      [--json out.json]

Both sides decode greedily from the same prompts for --steps steps after one prefill step. The
constrained side's grammar is a JSON schema (a list of at least 50 people) that cannot end within the
run, so every step computes real masks. Reported per batch size: median step time of each side, the
ratio (the cost of a constrained token relative to a free one), and the mask work per step from the
runner's TokenMasker: filling (worker thread, overlapped with the forward), the part of it the sampler
still waited for, and applying the mask to the logits. Also: the tokenizer's llguidance init and the
schema's compile time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

from engine.bench import engine_decode_steps, engine_prefill
from engine.config import EngineConfig
from engine.contract import SamplingParams
from engine.executor import LocalExecutor
from engine.grammar import GrammarCompiler, GrammarSpec
from engine.token_mask import MaskStats

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "city": {"type": "string"},
    },
    "required": ["name", "age", "email", "city"],
}
SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "items": PERSON, "minItems": 50}},
    "required": ["people"],
}
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


def prompts(tokenizer, batch_size: int) -> list[list[int]]:
    out = []
    for i in range(batch_size):
        msgs = [{"role": "user", "content": f"List {50 + i} people as JSON with name, age, email and city."}]
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def time_decode_steps(
    runner: LocalExecutor, batch: list[list[int]], params: list[SamplingParams], steps: int
) -> list[float]:
    """Prefill every prompt in one step, then `steps` decode steps; returns each decode step's seconds."""
    tables, outputs = engine_prefill(runner, batch, steps + 1, params)
    return engine_decode_steps(runner, batch, tables, outputs, steps, params)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-sizes", default="8,32")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    from models.loader import load_tokenizer

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    prompt_len = 64
    blocks = max(sizes) * (-(-(prompt_len + args.steps + 1) // 16))
    runner = LocalExecutor(EngineConfig(model=args.model, dtype=args.dtype, num_kv_blocks=blocks))
    tokenizer = load_tokenizer(runner.model_path)
    compiler = GrammarCompiler(tokenizer, runner.vocab_size, sorted(runner.eos_token_ids))
    t0 = time.perf_counter()
    compiler.compile(GrammarSpec("json_object"))  # builds the tokenizer's llguidance view
    init_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = compiler.compile(GrammarSpec.json_schema(SCHEMA))
    compile_s = time.perf_counter() - t0
    print(
        f"llguidance tokenizer init + json_object: {init_s * 1e3:.0f} ms; schema compile: {compile_s * 1e3:.1f} ms"
    )

    results = []
    for b in sizes:
        batch = [p[:prompt_len] for p in prompts(tokenizer, b)]
        free_ms: list[float] = []
        cons_ms: list[float] = []
        mask = MaskStats()
        time_decode_steps(runner, batch, [GREEDY] * b, 4)  # warm-up
        for _ in range(args.repeats):
            free_ms.append(
                1e3 * statistics.median(time_decode_steps(runner, batch, [GREEDY] * b, args.steps))
            )
            before = replace(runner.masker.stats)
            params = [replace(GREEDY, grammar=grammar.new_matcher()) for _ in range(b)]
            cons_ms.append(1e3 * statistics.median(time_decode_steps(runner, batch, params, args.steps)))
            after = runner.masker.stats
            mask.steps += after.steps - before.steps
            mask.fill_s += after.fill_s - before.fill_s
            mask.wait_s += after.wait_s - before.wait_s
            mask.apply_s += after.apply_s - before.apply_s
        ratios = [c / f for c, f in zip(cons_ms, free_ms, strict=True)]
        row = {
            "batch_size": b,
            "free_step_ms": free_ms,
            "constrained_step_ms": cons_ms,
            "ratio": ratios,
            "mask_fill_ms_per_step": 1e3 * mask.fill_s / mask.steps,
            "mask_wait_ms_per_step": 1e3 * mask.wait_s / mask.steps,
            "mask_apply_ms_per_step": 1e3 * mask.apply_s / mask.steps,
        }
        results.append(row)
        print(
            f"B={b:3d}: free {statistics.median(free_ms):7.1f} ms/step, constrained "
            f"{statistics.median(cons_ms):7.1f} ms/step, ratio {statistics.median(ratios):.3f} "
            f"(each repeat: {', '.join(f'{r:.3f}' for r in ratios)}); mask per step: fill "
            f"{row['mask_fill_ms_per_step']:.2f} ms (overlapped), waited {row['mask_wait_ms_per_step']:.2f} ms, "
            f"apply {row['mask_apply_ms_per_step']:.2f} ms"
        )
    if args.json is not None:
        setup = {"model": args.model, "steps": args.steps, "repeats": args.repeats, "init_ms": init_s * 1e3}
        args.json.write_text(
            json.dumps({"setup": {**setup, "compile_ms": compile_s * 1e3}, "rows": results}, indent=1)
        )


if __name__ == "__main__":
    main()
