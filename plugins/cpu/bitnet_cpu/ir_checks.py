"""A CPU level's IR (`dot_ir`) compiled for a CPU that has the level, on any host: x86-64 assembly to check,
never run. numba compiles for the host only, and LLVM aborts the process on an intrinsic the target cannot select,
so this is how the tests check a level the host lacks to the instruction (like compiling CUDA without a GPU)."""

from __future__ import annotations

from llvmlite import ir

from .dot_ir import TILE, emit_dot, emit_peak, emit_q8_dot

_I64 = ir.IntType(64)


# A CPU model with each level (LLVM names), for compiling a level the host may lack.
CHECK_CPU = {"avx512vbmi": "icelake-server", "avx512vnni": "icelake-server", "avxvnni": "alderlake", "avx2": "haswell",
             "generic": "x86-64"}
_TRIPLE = "x86_64-unknown-linux-gnu"


def _function(name: str, ret: ir.Type, n_args: int) -> tuple[ir.Module, ir.Function, ir.IRBuilder]:
    module = ir.Module(name=name)
    module.triple = _TRIPLE
    fn = ir.Function(module, ir.FunctionType(ret, [_I64] * n_args), name="dot")
    return module, fn, ir.IRBuilder(fn.append_basic_block("entry"))


def dot_module(isa: str, tile: int = TILE, per_block: bool = False, q8: bool = False, rows: int = 1) -> str:
    """LLVM IR text of a module holding one dot function of this level (emit_dot, or with q8 emit_q8_dot)."""
    n_args = 9 if q8 else 10 if rows > 1 else 7
    module, fn, builder = _function(f"{'q8' if q8 else 'ternary'}_dot_{isa}", ir.VoidType(), n_args)
    if q8:
        emit_q8_dot(builder, list(fn.args), tile, isa, rows)
    else:
        emit_dot(builder, list(fn.args), tile, per_block, isa, rows)
    builder.ret_void()
    return str(module)


def peak_module(isa: str) -> str:
    """LLVM IR text of a module holding this level's multiply-add probe (emit_peak)."""
    module, fn, builder = _function(f"peak_{isa}", _I64, 1)
    builder.ret(emit_peak(builder, fn.args[0], isa))
    return str(module)


def assembly(isa: str, cpu: str | None = None, tile: int = TILE, per_block: bool = False, q8: bool = False,
             rows: int = 1) -> str:
    """x86-64 assembly of this level's dot for `cpu` (default CHECK_CPU[isa]), optimized as numba would.

    Nothing is executed: this is how a level the host lacks is checked, since numba compiles
    for the host only and LLVM aborts the process on an intrinsic the target cannot select.
    """
    return _compile(dot_module(isa, tile, per_block, q8, rows), cpu or CHECK_CPU[isa])


def peak_assembly(isa: str, cpu: str | None = None) -> str:
    """x86-64 assembly of this level's multiply-add probe for `cpu` (default CHECK_CPU[isa]), as assembly()."""
    return _compile(peak_module(isa), cpu or CHECK_CPU[isa])


def _compile(text: str, cpu: str) -> str:
    from llvmlite import binding as llvm

    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    mod = llvm.parse_assembly(text)
    mod.verify()
    machine = llvm.Target.from_triple(_TRIPLE).create_target_machine(cpu=cpu, opt=3)
    builder = llvm.create_pass_builder(machine, llvm.create_pipeline_tuning_options(speed_level=3))
    builder.getModulePassManager().run(mod, builder)
    return machine.emit_assembly(mod)
