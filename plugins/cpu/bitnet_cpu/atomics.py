"""Atomic int64 counters and a spin hint for kernels whose threads share one parallel region and hand
work to each other inside it (see layer_regions.layers_row_rowscale): numba has no atomics of its own, so
these are LLVM's, sequentially consistent, on an element of an int64 array."""

from __future__ import annotations

import platform
from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _element(context: Any, builder: ir.IRBuilder, array_type: Any, array: Any, index: Any) -> Any:
    ary = context.make_array(array_type)(context, builder, array)
    return cgutils.get_item_pointer(context, builder, array_type, ary, [index])


@intrinsic
def fetch_add(typingctx: Any, array: Any, index: Any, value: Any) -> Any:
    """array[index] += value atomically; returns the value before."""
    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        where = _element(context, builder, sig.args[0], args[0], args[1])
        return builder.atomic_rmw("add", where, args[2], "seq_cst")

    return types.int64(array, types.intp, types.int64), codegen


@intrinsic
def load(typingctx: Any, array: Any, index: Any) -> Any:
    """array[index], read atomically (it sees every write another thread made before its store)."""
    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        return builder.load_atomic(_element(context, builder, sig.args[0], args[0], args[1]), "seq_cst", 8)

    return types.int64(array, types.intp), codegen


@intrinsic
def store(typingctx: Any, array: Any, index: Any, value: Any) -> Any:
    """array[index] = value atomically, after every write this thread made before it."""
    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        builder.store_atomic(args[2], _element(context, builder, sig.args[0], args[0], args[1]), "seq_cst", 8)
        return context.get_dummy_value()

    return types.void(array, types.intp, types.int64), codegen


@intrinsic
def pause(typingctx: Any) -> Any:
    """The CPU's spin-wait hint (x86 `pause`; nothing elsewhere): a waiting core yields to its sibling."""
    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def cycles(typingctx: Any) -> Any:
    """The CPU's time-stamp counter (`rdtsc` on x86: one constant rate for every core; 0 where LLVM has no
    counter): a region's threads stamp their phases with it, where Python's clocks cannot reach (stack_phases)."""
    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "llvm.readcyclecounter")
        return builder.call(fn, [])

    return types.int64(), codegen
