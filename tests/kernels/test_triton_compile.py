"""Every Triton kernel compiles for an NVIDIA H100 (sm_90) without one: the interpreter tests
run the kernels' Python, this runs Triton's compiler down to the GPU binary.

Compiled in a subprocess: the interpreter (TRITON_INTERPRET=1, set by the root conftest.py) replaces the
compiler in the process that imports the kernels.
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import sys
import triton, triton.language as tl
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from hybridembed.kernels import triton_hash as th
from hybridembed.kernels import triton_lookup as tk

F32 = tl.float32
ARCHS = (80, 90) if len(sys.argv) < 2 else tuple(map(int, sys.argv[1:]))
done = []


def build(fn, sig, consts, arch):
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", arch, 32))
    assert k.asm.get("cubin"), fn
    done.append(fn)


update = {
    "sorted_ids": "*i32", "perm": "*i64", "bag_of": "*i64", "psw": "*fp32", "grad": "*fp32", "buf": "*fp32",
    "weight": "*bf16", "s1": "*fp32", "s2": "*fp32", "N": "i32", "D": "i32", "stride_w": "i32", "stride_s": "i32",
    "lr": "fp64", "eps": "fp64", "b1": "fp64", "b2": "fp64", "wd": "fp64",  # (as annotated)
}
finish = {k: v for k, v in update.items() if k not in ("perm", "bag_of", "psw", "grad")}
for arch in ARCHS:
    build(tk._gather_rows, {"weight": "*fp16", "ids": "*i64", "psw": "*fp32", "out": "*fp32", "n": "i32", "D": "i32",
          "stride_w": "i32"} | dict.fromkeys(("HAS_PSW", "ACC", "ROWS", "BLOCK_D"), "constexpr"),
          {"HAS_PSW": True, "ACC": F32, "ROWS": 32, "BLOCK_D": 128}, arch)
    build(tk._pool_bags, {"weight": "*fp32", "ids": "*i32", "offsets": "*i32", "psw": "*fp32", "out": "*fp32",
          "D": "i32", "stride_w": "i32"} | dict.fromkeys(("HAS_PSW", "ACC", "BLOCK_N", "BLOCK_D"), "constexpr"),
          {"HAS_PSW": True, "ACC": F32, "BLOCK_N": 16, "BLOCK_D": 128}, arch)
    for opt in (tk.FUSED["RowWiseAdagrad"], tk.FUSED["Adam"]):  # (SGD's and Adagrad's branches use a subset of their operations)
        for reduce, chunk in ((tk._reduce_update, tk._CHUNK), (tk._reduce_update_short, tk._TILE_CHUNK)):
            flags = {"OPT": opt, "MAXIMIZE": True, "SKIP_ZERO": True, "ACC": F32, "CHUNK": chunk, "BLOCK_D": 128}
            build(reduce, update | dict.fromkeys(("HOT1", "HAS_PSW", *flags), "constexpr"),
                  {"HOT1": False, "HAS_PSW": True, **flags}, arch)
            build(tk._finish_runs, finish | dict.fromkeys(flags, "constexpr"), flags, arch)
    # (the tile for one-hot groups, as they come: each id its own bag, float64 rows, no multipliers)
    f64 = {"OPT": tk.FUSED["Adagrad"], "MAXIMIZE": False, "SKIP_ZERO": False, "ACC": tl.float64, "CHUNK": tk._TILE_CHUNK,
           "BLOCK_D": 64}
    build(tk._reduce_update_short, update | {"weight": "*fp64", "grad": "*fp64", "buf": "*fp64", "s1": "*fp64",
          "s2": "*fp64"} | dict.fromkeys(("HOT1", "HAS_PSW", *f64), "constexpr"), {"HOT1": True, "HAS_PSW": False, **f64},
          arch)
    build(tk._carry_partials, {"sorted_ids": "*i32", "run_chunk": "*i64", "buf": "*fp32", "CHUNK": "constexpr",
          "BLOCK_D": "constexpr"}, {"CHUNK": tk._CHUNK, "BLOCK_D": 128}, arch)
    index = {"hrow_ptr": "*i64", "mask": "i64", "keys_ptr": "*i64", "tabs_ptr": "*i32"}
    for home in (True, False):  # (given, or the hash in the kernel)
        build(th._find_kernel, index | {"home_ptr": "*i64", "out_ptr": "*i64", "n": "i32", "BLOCK": "constexpr",
              "HOME": "constexpr"}, {"BLOCK": 128, "HOME": home}, arch)
        build(th._insert_kernel, index | {"slots_ptr": "*i64", "home_ptr": "*i64", "n": "i32", "BLOCK": "constexpr",
              "HOME": "constexpr"}, {"BLOCK": 128, "HOME": home}, arch)
print(len(done), "compiled")
"""


def test_kernels_compile_for_gpus(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # (a fresh cache: really compiled)
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    # H100 (sm_90); the other targets compile the same source: `python -c "$SCRIPT" 80 90` checks A100 too
    r = subprocess.run([sys.executable, "-c", SCRIPT, "90"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "16 compiled" in r.stdout
