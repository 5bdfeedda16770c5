"""What a smaller KV cache buys (--kv-cache-dtype): the decode-attention kernel's read bandwidth at a
long context per cache type, and the tokens each type fits in the same memory.

    python -m engine.kv_bench [--shape smollm2-135m] [--context 4096] [--batch-sizes 1,8]
                              [--memory 1GiB] [--dtypes float32,float16,bfloat16,q8_0] [--variants best]

For each type and batch size it builds a paged cache of the shape's layers and KV heads (blocks
shuffled, as a running server's are), with every sequence `context` tokens long, and times the native
decode-attention kernel over all layers of one step (so the caches stream from DRAM, not from a
cache that one layer's K/V would fit in). GB/s counts the K and V bytes the step must read (the other
traffic, q and the output, is a few KB); the time is the median of `rounds` interleaved rounds. The
machine's read bandwidth (a torch sum over 1 GiB with all threads, the figure issue #28 compares with)
is measured first in the same process. Run it on a quiet machine: the numbers move with other load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from engine.cli_args import parse_size
from engine.kv_cache import KVCacheSpec
from engine.model_shapes import SHAPES
from engine.roofline import measure_read_bandwidth
from models.kernels import cpu as cpu_kernels
from models.kernels.isa import cpu_flags, supported_variants
from models.layers.kv_format import encode, kv_format
from models.options import KV_CACHE_DTYPES

BLOCK_SIZE = 16
ISA_FLAGS = ("avx2", "f16c", "avx512f", "avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class Row:
    dtype: str
    variant: str
    batch_size: int
    context: int
    ms_per_step: float  # all layers
    kv_gb_per_step: float
    gb_s: float
    of_read_bandwidth: float  # gb_s / the measured read bandwidth


def random_caches(
    spec: KVCacheSpec, num_seqs: int, context: int, seed: int = 0
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]:
    """Per layer (k, v) caches in the spec's format, holding num_seqs histories of `context` tokens
    in shuffled blocks; the block tables and lengths (int32)."""
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-context // BLOCK_SIZE)
    num_blocks = num_seqs * per_seq
    tables = torch.randperm(num_blocks, generator=g).to(torch.int32).view(num_seqs, per_seq)
    lens = torch.full((num_seqs,), context, dtype=torch.int32)
    fmt = spec.format
    layers = []
    for _ in range(spec.num_layers):
        pair = []
        for _ in range(2):
            values = torch.randn(num_blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, generator=g)
            pair.append(encode(values, torch.empty(0, dtype=fmt.storage)).contiguous())
        layers.append((pair[0], pair[1]))
    return layers, tables, lens


def attention_dims(shape: str) -> tuple[int, int, int, int]:
    """(layers, query heads, KV heads, head_dim) of an engine.model_shapes shape."""
    cfg = SHAPES[shape]
    hq = cfg["num_attention_heads"]
    return (
        cfg["num_hidden_layers"],
        hq,
        cfg["num_key_value_heads"],
        cfg.get("head_dim") or cfg["hidden_size"] // hq,
    )


def bench_step(
    kern: cpu_kernels.Kernels,
    layers: list[tuple[torch.Tensor, torch.Tensor]],
    q: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
) -> float:
    """Seconds of one decode step's attention: the kernel over every layer."""
    scale = q.shape[-1] ** -0.5
    t0 = time.perf_counter()
    for k, v in layers:
        kern.paged_decode_attention(q, k, v, tables, lens, scale)
    return time.perf_counter() - t0


def run(
    shape: str,
    context: int,
    batch_sizes: list[int],
    dtypes: list[str],
    variants: list[str],
    rounds: int,
    read_bw: float,
) -> list[Row]:
    layers, hq, hkv, d = attention_dims(shape)
    rows = []
    for b in batch_sizes:
        q = torch.randn(b, hq, d)
        setups = {}
        for name in dtypes:
            spec = KVCacheSpec(layers, hkv, d, BLOCK_SIZE, kv_format(name))
            setups[name] = (spec, random_caches(spec, b, context))
        times: dict[tuple[str, str], list[float]] = {(n, v): [] for n in dtypes for v in variants}
        for _ in range(rounds):  # interleaved: every (type, variant) once a round
            for name, (_spec, (caches, tables, lens)) in setups.items():
                for v in variants:
                    kern = cpu_kernels.for_variant(v)
                    bench_step(kern, caches, q, tables, lens)  # warm: this type's pages touched
                    times[(name, v)].append(bench_step(kern, caches, q, tables, lens))
        for (name, v), ts in times.items():
            spec = setups[name][0]
            kv_bytes = b * context * spec.bytes_per_token
            t = statistics.median(ts)
            gb_s = kv_bytes / t / 1e9
            rows.append(Row(name, v, b, context, t * 1e3, kv_bytes / 1e9, gb_s, gb_s * 1e9 / read_bw))
        del setups
    return rows


def tokens_that_fit(shape: str, memory: int) -> dict[str, int]:
    layers, _, hkv, d = attention_dims(shape)
    fit = {}
    for name in KV_CACHE_DTYPES:
        fmt = kv_format(name)
        if fmt.quantized and d % 32:
            continue
        spec = KVCacheSpec(layers, hkv, d, BLOCK_SIZE, fmt)
        fit[name] = spec.num_blocks_for(memory) * BLOCK_SIZE
    return fit


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2-135m", choices=list(SHAPES))
    p.add_argument("--context", type=int, default=4096, help="tokens of history per sequence")
    p.add_argument("--batch-sizes", default="1", help="sequences per step, comma-separated")
    p.add_argument("--memory", default="1GiB", help="KV budget for the tokens-that-fit table")
    p.add_argument("--dtypes", default=",".join(KV_CACHE_DTYPES))
    p.add_argument(
        "--variants",
        default="best",
        help="ISA variants of the kernels: best, all, or names (avx2,avx512,...)",
    )
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--read-bytes", default="1GiB", help="buffer of the read-bandwidth measurement")
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args(argv)
    if not cpu_kernels.available():
        raise SystemExit("the native CPU kernels are not available here: nothing to measure")
    supported = [v.name for v in supported_variants()]
    if a.variants == "best":
        variants = [cpu_kernels.kernels().name]  # type: ignore[union-attr]
    elif a.variants == "all":
        variants = supported
    else:
        variants = a.variants.split(",")
        if unknown := [v for v in variants if v not in supported]:
            raise SystemExit(f"this CPU runs {', '.join(supported)}; not {', '.join(unknown)}")
    dtypes = a.dtypes.split(",")
    for name in dtypes:
        kv_format(name)  # a clear error for a bad name
    memory = parse_size(a.memory)
    threads = torch.get_num_threads()
    read_bw = measure_read_bandwidth(parse_size(a.read_bytes))
    print(
        f"shape {a.shape} | CPU flags: {' '.join(f for f in ISA_FLAGS if f in cpu_flags())} | threads {threads} "
        f"| measured read bandwidth {read_bw / 1e9:.1f} GB/s (torch sum over {a.read_bytes})"
    )
    rows = run(
        a.shape, a.context, [int(b) for b in a.batch_sizes.split(",")], dtypes, variants, a.rounds, read_bw
    )
    print(
        f"\ndecode attention at {a.context} tokens of context, all {SHAPES[a.shape]['num_hidden_layers']} layers:"
    )
    print(
        f"  {'dtype':9s} {'variant':12s} {'batch':>5s} {'ms/step':>8s} {'KV GB':>7s} {'GB/s':>6s} {'of read bw':>10s}"
    )
    for r in rows:
        print(
            f"  {r.dtype:9s} {r.variant:12s} {r.batch_size:5d} {r.ms_per_step:8.2f} {r.kv_gb_per_step:7.3f} "
            f"{r.gb_s:6.1f} {r.of_read_bandwidth:9.0%}"
        )
    fit = tokens_that_fit(a.shape, memory)
    print(f"\ntokens that fit in {a.memory} of KV cache ({a.shape}):")
    for name, n in fit.items():
        print(f"  {name:9s} {n:10d}  ({n / fit['float32']:.2f}x float32)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "shape": a.shape,
                    "threads": threads,
                    "cpu_flags": sorted(f for f in ISA_FLAGS if f in cpu_flags()),
                    "read_bandwidth_gb_s": read_bw / 1e9,
                    "rows": [asdict(r) for r in rows],
                    "tokens_that_fit": {"memory_bytes": memory, **fit},
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
