"""The fused kernels (augment/fused_kernel.py) compiled for a Hopper GPU (sm_90) without one:
Triton's own compiler and ptxas, as its launch on a GPU would, at the GPU's block shapes.
Prints each kernel's registers a thread, stack and spills (local loads and stores in its SASS).

    python -m bench.kernel_compile                  # TRITON_INTERPRET must be unset: a subprocess

Triton's interpreter (the tests' way to run the kernels on a CPU) accepts code that does not
compile for a GPU; this is the check that it does.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

POINTERS = {"meta_ptr": "*i64", "factors_ptr": "*fp32", "scratch_ptr": "*fp32", "partial_ptr": "*fp32"}
SCALARS = {"fill": "i32", "pack_gain": "fp32", "OH": "i32", "OW": "i32", "TILES": "i32"}


def compile_kernel(kernel, constexprs: dict, out_type: str, warps: int = 4) -> dict:
    """One kernel compiled for sm_90: {"registers", "stack", "spill_instructions", "shared"}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    types = POINTERS | SCALARS | {"out_ptr": out_type} | dict.fromkeys(constexprs, "constexpr")
    source = ASTSource(fn=kernel, signature={n: types[n] for n in names}, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = run([f"{tools}/cuobjdump", "--dump-resource-usage", cubin.name])
        sass = run([f"{tools}/cuobjdump", "--dump-sass", cubin.name])
    registers, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
    spills = len(re.findall(r"\b(?:LDL|STL)\b", sass))
    return {"registers": registers, "stack": stack, "spill_instructions": spills, "shared": compiled.metadata.shared}


def run(args: list[str]) -> str:
    return subprocess.run(args, capture_output=True, text=True, check=True).stdout


def main() -> dict:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("bench.kernel_compile: TRITON_INTERPRET=1 gives the interpreter's kernels: unset it", file=sys.stderr)
        sys.exit(2)
    from augment import fused_kernel as fk

    (th, tw), _ = fk.launch_shape("cuda")
    result = {}
    for float_out in (False, True):
        out_type = "*fp32" if float_out else "*u8"
        shape = {"FLOAT_OUT": float_out, "TH": th, "TW": tw}
        result[f"tile_kernel float_out={float_out}"] = compile_kernel(fk.tile_kernel, shape | {"RB": fk.ROWS}, out_type)
        tiles = -(-224 // th) * -(-224 // tw)
        result[f"contrast_kernel float_out={float_out}"] = compile_kernel(
            fk.contrast_kernel, shape | {"TILES_P2": 1 << (tiles - 1).bit_length()}, out_type
        )
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
