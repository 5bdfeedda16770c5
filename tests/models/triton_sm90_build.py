"""Compile the Triton kernels (attention, the fused experts, the fused small ops) for an H100 (sm_90) on
any machine, GPU or not, and report what each compiled variant uses: registers, spills, shared memory.

Triton ships its compiler and ptxas, so the whole chain down to the cubin runs on a CPU; only
launching needs a GPU. The tests run this in a subprocess (`compile_for_h100`: Triton's interpreter
switch must be off, and it is fixed per process). Usage: python triton_sm90_build.py '<json list of
cases>'; a case's "kernel" names the fused experts' matmul ("expert_matmul") or one of triton_fused.py's
kernels ("rms_norm", "act_and_mul", "rope_and_cache"); without one it is attention.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from models.layers import triton_attention as ta
from models.layers import triton_fused as tf
from models.layers import triton_moe as tm

H100 = GPUTarget("cuda", 90, 32)
TRITON_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _source(kernel, pointers: dict[str, str], constexprs: dict[str, object]) -> ASTSource:
    """The kernel specialised the way Triton's launcher specialises real tensors: every pointer and
    every stride divisible by 16 (torch allocations are aligned, head dims are multiples of 16)."""
    names = kernel.arg_names
    signature = {n: pointers.get(n, "constexpr" if n in constexprs else "i32") for n in names}
    signature["scale_log2"] = "fp32" if "scale_log2" in names else signature.get("scale_log2")
    aligned = [n for n in names if n.endswith("_ptr") or n.startswith("stride")]
    return ASTSource(
        fn=kernel,
        signature={n: t for n, t in signature.items() if t is not None},
        constexprs={(names.index(n),): v for n, v in constexprs.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )


def _resources(cubin: bytes) -> dict[str, int]:
    """Registers, stack and local memory per thread (spills show as the last two), from the cuobjdump
    Triton ships; empty where this build of Triton has none."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.access(tool, os.X_OK):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    assert usage, text
    return dict(zip(("registers", "stack", "static_shared", "local"), map(int, usage.groups()), strict=True))


def build(case: dict) -> dict:
    dtype = TRITON_DTYPES[case["dtype"]]
    hq, hkv, d = case["num_q_heads"], case["num_kv_heads"], case["head_dim"]
    config = ta.launch_config(
        num_tokens=case["num_tokens"],
        num_seqs=case["num_seqs"],
        max_query_len=case["max_query_len"],
        max_seq_len=4096,
        num_q_heads=hq,
        num_kv_heads=hkv,
        device=torch.device("cpu"),
    )
    splits = case.get("num_splits", 1)
    d_pad = max(ta.MIN_DOT, triton.next_power_of_2(d))
    attention = triton.compile(
        _source(
            ta._paged_attention_kernel,
            {
                **{p: f"*{dtype}" for p in ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")},
                **{p: "*fp32" for p in ("part_out_ptr", "part_max_ptr", "part_sum_ptr")},
                **{p: "*i32" for p in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr")},
            },
            dict(
                QUERIES_PER_KV=hq // hkv,
                HEAD_DIM=d,
                HEAD_DIM_PAD=d_pad,
                BLOCK_SIZE=case["block_size"],
                BLOCK_M=config.block_m,
                BLOCK_Q=config.block_q,
                TILE_N=config.tile_n,
                NUM_SPLITS=splits,
                DECODE_ONLY=config.decode_only,
                DOT_PRECISION="ieee" if dtype == "fp32" else "tf32",
            ),
        ),
        target=H100,
        options=dict(num_warps=config.num_warps, num_stages=config.num_stages),
    )
    report = {
        **case,
        "config": config.__dict__,
        "shared": attention.metadata.shared,
        **_resources(attention.asm["cubin"]),
    }
    if splits > 1:
        merge = triton.compile(
            _source(
                ta._merge_splits_kernel,
                {
                    "out_ptr": f"*{dtype}",
                    **{p: "*fp32" for p in ("part_out_ptr", "part_max_ptr", "part_sum_ptr")},
                },
                dict(HEAD_DIM=d, HEAD_DIM_PAD=d_pad, NUM_SPLITS=splits),
            ),
            target=H100,
            options=dict(num_warps=4),
        )
        report["merge"] = {"shared": merge.metadata.shared, **_resources(merge.asm["cubin"])}
    return report


def build_expert_matmul(case: dict) -> dict:
    dtype = TRITON_DTYPES[case["dtype"]]
    kernel = triton.compile(
        _source(
            tm._expert_matmul_kernel,
            {
                **{p: f"*{dtype}" for p in ("a_ptr", "w_ptr", "c_ptr")},
                "pair_weight_ptr": "*fp32",
                **{p: "*i32" for p in ("sorted_pairs_ptr", "block_expert_ptr", "num_padded_ptr")},
            },
            dict(
                PAIRS_PER_A_ROW=case["pairs_per_a_row"],
                MUL_WEIGHT=case["mul_weight"],
                DOT_PRECISION="ieee" if dtype == "fp32" else "tf32",
                BLOCK_M=tm.BLOCK_M,
                BLOCK_N=tm.BLOCK_N,
                BLOCK_K=tm.BLOCK_K,
            ),
        ),
        target=H100,
        options=dict(num_warps=tm.NUM_WARPS, num_stages=tm.NUM_STAGES),
    )
    return {**case, "shared": kernel.metadata.shared, **_resources(kernel.asm["cubin"])}


def build_fused(case: dict) -> dict:
    """One of triton_fused.py's kernels, at the case's sizes and dtype."""
    dtype = TRITON_DTYPES[case["dtype"]]
    name = case["kernel"]
    if name == "rms_norm":
        block = triton.next_power_of_2(case["hidden"])
        kernel, warps = tf._rms_norm_kernel, tf.norm_warps(block)
        weight = "fp32" if case.get("gemma") else dtype  # Gemma's norms hold 1 + w in float32
        pointers = {
            "x_ptr": f"*{dtype}",
            "res_ptr": f"*{dtype}",
            "w_ptr": f"*{weight}",
            "out_ptr": f"*{dtype}",
            "pre_w_ptr": f"*{weight}",
        }
        constexprs = dict(
            HAS_RESIDUAL=case.get("residual", True), SCALE_IN_FLOAT32=bool(case.get("gemma")),
            PRE_NORM=case.get("pre_norm", False), NORM_OUT=case.get("norm_out", True), BLOCK=block,
        )  # fmt: skip
    elif name == "act_and_mul":
        kernel, warps = tf._act_and_mul_kernel, tf.NUM_WARPS
        pointers = {"x_ptr": f"*{dtype}", "out_ptr": f"*{dtype}"}
        constexprs = dict(GELU_TANH=case.get("gelu", False), BLOCK=tf.ACT_BLOCK)
    else:
        kernel, warps = tf._rope_and_cache_kernel, 1
        norm = case.get("qk_norm")  # None, "llama" (weights in the model dtype) or "gemma" (float32)
        pointers = {
            **{p: f"*{dtype}" for p in ("qkv_ptr", "cos_sin_ptr", "k_cache_ptr", "v_cache_ptr")},
            **{p: "*i64" for p in ("pos_ptr", "slot_ptr")},
            **{p: "*fp32" if norm == "gemma" else f"*{dtype}" for p in ("q_norm_ptr", "k_norm_ptr")},
        }
        half, d = case["rotary_dim"] // 2, case["head_dim"]
        constexprs = dict(
            D=d, HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_D=triton.next_power_of_2(d),
            HAS_QK_NORM=norm is not None, NORM_SCALE_IN_FLOAT32=norm == "gemma",
        )  # fmt: skip
    source = _source(kernel, pointers, constexprs)
    if "eps" in source.signature:  # the norm's and the rotary kernel's epsilon is a float argument
        source.signature["eps"] = "fp32"
    compiled = triton.compile(source, target=H100, options=dict(num_warps=warps))
    return {**case, "shared": compiled.metadata.shared, **_resources(compiled.asm["cubin"])}


def compile_for_h100(cases: list[dict]) -> list[dict]:
    """Each case's report, from this script run in a subprocess with the interpreter off."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[2])  # the repository, for `models`
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, __file__, json.dumps(cases)], capture_output=True, text=True, env=env, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


if __name__ == "__main__":
    if triton.knobs.runtime.interpret:
        sys.exit("run with TRITON_INTERPRET unset: the interpreter replaces the compiler")
    builders = {
        "expert_matmul": build_expert_matmul,
        **dict.fromkeys(("rms_norm", "act_and_mul", "rope_and_cache"), build_fused),
    }
    print(json.dumps([builders.get(case.get("kernel"), build)(case) for case in json.loads(sys.argv[1])]))
