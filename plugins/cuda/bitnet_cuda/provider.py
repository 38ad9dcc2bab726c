"""The CUDA kernel provider: a buffer pool, one module built from the shared kernel source, and one
method per KernelProvider operation, each launching its kernel on a single stream.

The one stream is the whole synchronisation story, as the in-order queue is for the OpenCL plugin: a
kernel sees everything launched before it, a buffer handed back to the pool can be reused at once (its
next user runs later on the same stream), and `_read`, the only device-to-host path, synchronises the
stream before it copies. Only to_host and argmax read, both through `_read`, so no read can overtake
the work that writes what it reads.

Every public operation runs with this provider's context current (pushed and popped around it) inside
an NVTX range named after it when the `nvtx` package is importable.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import numpy as np
import pycuda.driver as drv
from pycuda.compiler import SourceModule

from bitnet import gpu as kernels_src
from bitnet.plugins.types import Device
from bitnet.errors import NoBackendError, UsageError
from bitnet.runtime.provider import ACT_QUANT_MODES, ACTIVATIONS, KernelProvider
from bitnet.gpu.host import KVCache, Tensor, TernaryWeight, groups, pow2_floor
from bitnet.modelfile.ternary import BLOCK, TernaryMatrix

from . import MAX_LOCAL, TILE_N, nvcc_options

try:
    import nvtx
except ImportError:  # profiling is optional: without nvtx the ranges cost one attribute test
    nvtx = None

ACT_MODE = {"row": 0, "block256": 1}
# LM-head table formats, as the kernel source numbers them (FMT_*). bf16 lives in uint16 arrays.
LM_FORMATS = {"f32": 0, "f16": 1, "bf16": 2}
_DTYPE_FORMAT = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", np.dtype(np.uint16): "bf16"}
LM_HEAD_ENV = "BITNET_CUDA_LM_HEAD"
MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y: tokens per launch ride on y

_T = TypeVar("_T")


def lm_head_precision(capability: tuple[int, int], env: dict[str, str] | None = None) -> tuple[str, str]:
    """(format, why) for F32 LM-head tables: bf16 on CC >= 8.0 (f32's range, native conversions),
    fp16 on CC >= 6.0, f32 below; BITNET_CUDA_LM_HEAD=f32|f16|bf16 overrides."""
    forced = (os.environ if env is None else env).get(LM_HEAD_ENV, "").strip().lower()
    if forced:
        if forced not in LM_FORMATS:
            raise UsageError(f"{LM_HEAD_ENV}={forced!r}: expected one of {', '.join(LM_FORMATS)}")
        return forced, LM_HEAD_ENV
    cc = f"compute capability {capability[0]}.{capability[1]}"
    return ("bf16" if capability >= (8, 0) else "f16" if capability >= (6, 0) else "f32"), cc


# The primary context of each device (shared with other CUDA libraries in the process) and the modules
# built in it: retained and built once per process, kept for its life, as pycuda.autoprimaryctx does.
_CONTEXTS: dict[int, Any] = {}
_MODULES: dict[tuple[int, str, tuple[str, ...]], SourceModule] = {}


def open_cuda_device(index: int) -> tuple[Any, Any]:
    """The primary context and the device `index` (counted after CUDA_VISIBLE_DEVICES)."""
    try:
        drv.init()
        dev = drv.Device(index)
        if index not in _CONTEXTS:
            _CONTEXTS[index] = dev.retain_primary_context()
    except drv.Error as exc:
        raise NoBackendError(f"CUDA: cannot open device {index} ({exc})") from exc
    return _CONTEXTS[index], dev


def build_program(index: int, dev: Any, source: str, max_local: int) -> SourceModule:
    """Build once per process and device; PyCUDA caches the cubin on disk. A failure carries nvcc's log.
    The device's context must be current (SourceModule targets its compute capability)."""
    options = nvcc_options(max_local)
    key = (index, hashlib.sha256(source.encode()).hexdigest(), tuple(options))
    if key not in _MODULES:
        try:
            # no_extern_c: the vendor header includes C++ headers (cuda_fp16.h) and declares every
            # kernel extern "C" itself, so the host finds them by the names the body gives.
            _MODULES[key] = SourceModule(source, options=options, no_extern_c=True)
        except drv.CompileError as exc:  # its text holds the command line and nvcc's output
            major, minor = dev.compute_capability()
            raise NoBackendError(
                f"CUDA kernel build failed on {dev.name()} (sm_{major}{minor}):\n{exc}") from exc
    return _MODULES[key]


# -- memory ------------------------------------------------------------------------------------------
@dataclass
class PoolStats:
    current: int = 0  # bytes allocated on the device: in use plus cached
    peak: int = 0
    in_use: int = 0
    allocations: int = 0  # real device allocations
    cache_hits: int = 0  # requests served from the cache


class BufferPool:
    """Device buffers cached by exact size: a transformer asks for the same few sizes every token."""

    def __init__(self) -> None:
        self.stats = PoolStats()
        self._free: dict[int, list[Any]] = {}
        self._live: dict[int, tuple[Any, int, str, bool]] = {}  # id -> (allocation, size, tag, resident)
        self._leaked: list[str] = []

    def alloc(self, nbytes: int, tag: str, resident: bool = False) -> Any:
        nbytes = max(int(nbytes), 4)  # cuMemAlloc refuses zero bytes
        cached = self._free.get(nbytes)
        if cached:
            buf = cached.pop()
            self.stats.cache_hits += 1
        else:
            buf = self._device_alloc(nbytes, tag)
            self.stats.allocations += 1
            self.stats.current += nbytes
            self.stats.peak = max(self.stats.peak, self.stats.current)
        self.stats.in_use += nbytes
        self._live[id(buf)] = (buf, nbytes, tag, resident)
        return buf

    def _device_alloc(self, nbytes: int, tag: str) -> Any:
        try:
            return drv.mem_alloc(nbytes)
        except drv.MemoryError:
            self.trim()  # cached buffers of other sizes are memory too: give them back and retry once
        try:
            return drv.mem_alloc(nbytes)
        except drv.MemoryError as exc:
            free, total = drv.mem_get_info()
            mib = 1 << 20
            raise NoBackendError(
                f"CUDA device out of memory: {tag} needs {nbytes / mib:.1f} MiB; this model holds "
                f"{self.stats.current / mib:.1f} MiB and the device has {free / mib:.1f} MiB free of "
                f"{total / mib:.1f} MiB (use a smaller context, --n-ctx, or a larger device)") from exc

    def free(self, buf: Any) -> None:
        entry = self._live.pop(id(buf), None)
        if entry is None:
            return  # close() released it already
        self.stats.in_use -= entry[1]
        self._free.setdefault(entry[1], []).append(buf)

    def trim(self) -> None:
        """Give every cached buffer back to the driver."""
        for size, bufs in self._free.items():
            for buf in bufs:
                self.stats.current -= size
                buf.free()
        self._free.clear()

    def leaks(self) -> list[str]:
        """Activation buffers still held by someone, or that were when the pool closed."""
        return self._leaked + [f"{tag} ({size} bytes)" for _, size, tag, resident in self._live.values()
                               if not resident]

    def close(self) -> None:
        """Release everything; activations still held at this point are recorded as leaks."""
        self._leaked = self.leaks()
        for buf, size, _, _ in self._live.values():
            self.stats.in_use -= size
            self.stats.current -= size
            buf.free()
        self._live.clear()
        self.trim()


def _op(method: Callable[..., _T]) -> Callable[..., _T]:
    """A public operation: this provider's context current, inside an NVTX range named after it."""
    name = method.__name__

    @functools.wraps(method)
    def run(self: CudaProvider, *args: Any, **kw: Any) -> _T:
        with self._current(), self.region(name):
            return method(self, *args, **kw)

    return run


class CudaProvider(KernelProvider):
    """One CUDA device; `device.index` counts the devices CUDA_VISIBLE_DEVICES leaves visible."""

    def __init__(self, device: Device, source: str | None = None) -> None:
        super().__init__("cuda", device)
        self.ctx, self.cu_device = open_cuda_device(device.index)
        self.capability: tuple[int, int] = self.cu_device.compute_capability()
        # F32 LM-head tables are re-encoded in this format; F16 tables stay F16 unless it is forced.
        self.lm_head_format, self.lm_head_reason = lm_head_precision(self.capability)
        self.lm_head_forced = self.lm_head_reason == LM_HEAD_ENV
        self.closed = True  # until the stream and pool exist: close() then has nothing to release
        with self._current():
            self.stream = drv.Stream()  # blocking w.r.t. the legacy stream, so plain copies order too
            self.pool = BufferPool()
            attr = drv.device_attribute
            max_local = pow2_floor(min(MAX_LOCAL, self.cu_device.get_attribute(attr.MAX_THREADS_PER_BLOCK)))
            source = source or kernels_src.source("cuda")
            module = build_program(device.index, self.cu_device, source, max_local)
            self.kernels = {name: module.get_function(name) for name in kernels_src.kernel_names(source)}
            self.local = {name: self._local_size(k, max_local) for name, k in self.kernels.items()}
            # The warp: lanes that share a row come in multiples of it (OpenCL: the preferred multiple).
            warp = self.cu_device.get_attribute(attr.WARP_SIZE)
            self.simd = {name: warp for name in self.kernels}
        self._formats: dict[str, str] = {}  # kernel -> the parameter format it was prepared with
        self._rope: dict[tuple[float, int], tuple[Tensor, Tensor]] = {}
        self._lm_tables: weakref.WeakKeyDictionary[Tensor, Tensor] = weakref.WeakKeyDictionary()
        self._writes: list[tuple[Any, np.ndarray]] = []  # host-to-device copies in flight, with their sources
        self.closed = False

    @contextmanager
    def _current(self) -> Iterator[None]:
        self.ctx.push()
        try:
            yield
        finally:
            drv.Context.pop()

    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        """An NVTX range (domain "bitnet") when nvtx is importable: wrap a layer in one to see it in
        Nsight Systems around the per-operation ranges."""
        if nvtx is None:
            yield
            return
        nvtx.push_range(name, domain="bitnet")
        try:
            yield
        finally:
            nvtx.pop_range(domain="bitnet")

    def _local_size(self, kernel: Any, max_local: int) -> int:
        """The largest power of two (the tree reductions need one) the device allows for this kernel."""
        limit = kernel.get_attribute(drv.function_attribute.MAX_THREADS_PER_BLOCK)
        return pow2_floor(min(max_local, limit))

    def _run(self, name: str, groups: tuple[int, ...], *args: Any, local: int | None = None) -> None:
        """Launch kernel `name` on a grid of `groups` blocks on the stream and record that it ran."""
        local = local or self.local[name]
        # P pointer, i int, f float, Q np.uint64 (the one 64-bit count, convert_table's)
        fmt = "".join("P" if isinstance(a, Tensor) else "i" if isinstance(a, int)
                      else "f" if isinstance(a, float) else "Q" for a in args)
        params = [int(a.buf) if isinstance(a, Tensor) else a for a in args]
        func = self.kernels[name]
        if self._formats.get(name) != fmt:  # prepared calls pack arguments without per-call inspection
            func.prepare(fmt)
            self._formats[name] = fmt
        if len(groups) > 1 and groups[1] > MAX_GRID_Y:
            raise UsageError(f"{name}: {groups[1]} tokens in one batch exceed CUDA's grid limit of "
                             f"{MAX_GRID_Y}")
        grid = tuple(groups) + (1,) * (2 - len(groups))
        func.prepared_async_call(grid, (local, 1, 1), self.stream, *params)
        self.record(name)

    def _new(self, shape: tuple[int, ...], dtype: Any = np.float32, tag: str = "activation") -> Tensor:
        return Tensor(self.pool, shape, dtype, tag)

    def _write(self, t: Tensor, host: np.ndarray) -> Tensor:
        # Asynchronous on the stream, so it queues behind the work before it. The source is kept until
        # an event proves the copy done (pageable memory is staged at once; page-locked memory is not).
        host = np.ascontiguousarray(host)
        self._writes = [(e, h) for e, h in self._writes if not e.query()]
        drv.memcpy_htod_async(t.buf, host, self.stream)
        self._writes.append((drv.Event().record(self.stream), host))
        return t

    def _read(self, t: Tensor, dtype: Any) -> np.ndarray:
        # The only device-to-host copy: the stream is drained first, so everything launched before this
        # read (the kernel that writes `t` included) has finished; then a synchronous copy.
        out = np.empty(t.shape, dtype)
        self.stream.synchronize()
        drv.memcpy_dtoh(out, t.buf)
        self._writes.clear()
        return out

    def leaks(self) -> list[str]:
        """Activations not given back: still held, or still held when the provider closed."""
        return self.pool.leaks()

    def memory_stats(self) -> dict[str, int]:
        """Device memory of this provider's pool (receipts report the peak)."""
        return {"peak_bytes": self.pool.stats.peak, **asdict(self.pool.stats)}

    # -- memory ---------------------------------------------------------------------------------------
    @_op
    def upload_ternary(self, w: TernaryMatrix) -> TernaryWeight:
        codes = Tensor(self.pool, (w.rows, w.cols // 16), np.uint32, "ternary codes", resident=True)
        scales = Tensor(self.pool, w.scales.shape, np.float32, "ternary scales", resident=True)
        self._write(codes, w.packed().view(np.uint32))
        self._write(scales, w.scales.astype(np.float32, copy=False))
        return TernaryWeight(codes, scales, w.rows, w.cols)

    @_op
    def upload_float(self, a: np.ndarray) -> Tensor:
        a = np.asarray(a)
        dtype = np.float16 if a.dtype == np.float16 else np.float32  # F16 tables stay F16 on the device
        return self._write(Tensor(self.pool, a.shape, dtype, f"float {a.shape}", resident=True),
                           a.astype(dtype, copy=False))

    @_op
    def kv_cache(self, n_layers: int, n_ctx: int, n_kv_heads: int, head_dim: int) -> KVCache:
        shape = (n_layers, n_kv_heads, n_ctx, head_dim)
        return KVCache(Tensor(self.pool, shape, np.float32, "kv cache K", resident=True),
                       Tensor(self.pool, shape, np.float32, "kv cache V", resident=True),
                       n_kv_heads, n_ctx, head_dim, [0] * n_layers)

    @_op
    def to_host(self, x: Tensor) -> np.ndarray:
        return self._read(x, x.dtype).astype(np.float32, copy=False)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with self._current():
            self.stream.synchronize()
            self._writes.clear()
            self._rope.clear()
            self._lm_tables.clear()
            self.pool.close()

    # -- operations -----------------------------------------------------------------------------------
    @_op
    def embed(self, table: Tensor, ids: np.ndarray) -> Tensor:
        ids = np.array(ids, dtype=np.int32).reshape(-1)  # a copy: the caller may reuse its array mid-copy
        vocab, dim = table.shape
        if not ids.size:
            raise UsageError("nothing to embed: no token ids")
        if ids.min() < 0 or ids.max() >= vocab:
            raise UsageError(f"token id out of range 0..{vocab - 1}")
        dev_ids = self._write(self._new(ids.shape, np.int32, "token ids"), ids)
        out = self._new((len(ids), dim))
        name = "embed_f16" if table.dtype == np.float16 else "embed_f32"
        self._run(name, (groups(dim, self.local[name]), len(ids)), table, dev_ids, out, dim)
        return out

    @_op
    def rmsnorm(self, x: Tensor, w: Tensor, eps: float) -> Tensor:
        out = self._new(x.shape)
        self._run("rmsnorm_f32", (x.shape[0],), x, w, out, x.shape[1], float(eps))
        return out

    @_op
    def bitlinear(self, x: Tensor, w: TernaryWeight, act_quant: str) -> Tensor:
        if act_quant not in ACT_QUANT_MODES:
            raise UsageError(f"unknown activation quantization {act_quant!r}; expected one of "
                             f"{', '.join(ACT_QUANT_MODES)}")
        n, cols = x.shape
        if cols != w.cols:
            raise ValueError(f"bitlinear: input width {cols} != weight columns {w.cols}")
        nb, y = cols // BLOCK, self._new((n, w.rows))
        name = "ternary_matmul_f32" if act_quant == "none" else "ternary_matmul_i8"
        lanes = min(nb, self.local[name])  # one 256-block per thread at a time
        grid = (groups(w.rows, self.local[name] // lanes), groups(n, TILE_N))
        if act_quant == "none":
            self._run(name, grid, w.codes, w.scales, x, y, w.rows, nb, n, lanes)
            return y
        q, qscale, qsum = self._new((n, cols), np.int8), self._new((n, nb)), self._new((n, nb), np.int32)
        self._run("quantize_i8", (nb, n), x, q, qscale, qsum, cols, ACT_MODE[act_quant])
        self._run(name, grid, w.codes, w.scales, q, qscale, qsum, y, w.rows, nb, n, lanes)
        return y

    def _rope_table(self, theta: float, head_dim: int, n_pos: int) -> tuple[Tensor, Tensor]:
        """cos and sin [position][head_dim // 2], computed in float64 once and grown by doubling."""
        key = (float(theta), head_dim)
        if key not in self._rope or self._rope[key][0].shape[0] < n_pos:
            cap = max(256, 1 << (n_pos - 1).bit_length())
            freqs = float(theta) ** (-np.arange(head_dim // 2, dtype=np.float64) * 2.0 / head_dim)
            angles = np.arange(cap, dtype=np.float64)[:, None] * freqs[None, :]
            cos = Tensor(self.pool, angles.shape, np.float32, "rope cos", resident=True)
            sin = Tensor(self.pool, angles.shape, np.float32, "rope sin", resident=True)
            self._rope[key] = (self._write(cos, np.cos(angles).astype(np.float32)),
                               self._write(sin, np.sin(angles).astype(np.float32)))
        return self._rope[key]

    @_op
    def rope(self, x: Tensor, n_heads: int, head_dim: int, pos0: int, theta: float) -> Tensor:
        n = x.shape[0]
        if x.shape[1] != n_heads * head_dim or head_dim % 2:
            raise ValueError(f"rope: width {x.shape[1]} is not {n_heads} heads of even dim {head_dim}")
        cos, sin = self._rope_table(theta, head_dim, pos0 + n)
        out = self._new(x.shape)
        pairs = n_heads * head_dim // 2
        self._run("rope_neox_f32", (groups(pairs, self.local["rope_neox_f32"]), n),
                  x, out, cos, sin, n_heads, head_dim, pos0)
        return out

    @_op
    def attention(self, q: Tensor, k: Tensor, v: Tensor, cache: KVCache, layer: int, pos0: int,
                  n_heads: int, n_kv_heads: int, head_dim: int) -> Tensor:
        n = q.shape[0]
        if (n_kv_heads, head_dim) != (cache.n_kv_heads, cache.head_dim) or n_heads % n_kv_heads:
            raise ValueError(f"attention: {n_heads} heads over {n_kv_heads} KV heads of dim {head_dim} "
                             f"do not fit a cache of {cache.n_kv_heads} KV heads of dim {cache.head_dim}")
        if pos0 + n > cache.n_ctx:
            raise UsageError(f"positions {pos0}..{pos0 + n - 1} exceed the context of {cache.n_ctx}")
        if pos0 > cache.filled[layer]:  # the kernel would read positions nobody wrote
            raise UsageError(f"position {pos0} follows only {cache.filled[layer]} cached positions")
        width = n_kv_heads * head_dim
        self._run("kv_store_f32", (groups(width, self.local["kv_store_f32"]), n),
                  k, v, cache.k, cache.v, layer, pos0, n_kv_heads, head_dim, cache.n_ctx)
        cache.filled[layer] = pos0 + n
        out = self._new(q.shape)
        # Chunks of about head_dim positions keep every thread busy in both the score and the V phase.
        local = min(self.local["attention_f32"], 1 << (head_dim - 1).bit_length())
        self._run("attention_f32", (n_heads, n), q, cache.k, cache.v, out, layer, pos0, n_heads,
                  n_kv_heads, head_dim, cache.n_ctx, float(1.0 / math.sqrt(head_dim)), local=local)
        return out

    @_op
    def act_mul(self, gate: Tensor, up: Tensor, act: str) -> Tensor:
        if act not in ACTIVATIONS:
            raise UsageError(f"unknown activation {act!r}; expected one of {', '.join(ACTIVATIONS)}")
        return self._elementwise(f"{act}_mul_f32", gate, up)

    @_op
    def add(self, a: Tensor, b: Tensor) -> Tensor:
        return self._elementwise("add_f32", a, b)

    def _elementwise(self, name: str, a: Tensor, b: Tensor) -> Tensor:
        if a.shape != b.shape:
            raise ValueError(f"{name}: shapes {a.shape} and {b.shape} differ")
        out, count = self._new(a.shape), math.prod(a.shape)
        self._run(name, (groups(count, self.local[name]),), a, b, out, count)
        return out

    @_op
    def last_row(self, x: Tensor) -> Tensor:
        n, width = x.shape
        out = self._new((1, width))
        drv.memcpy_dtod_async(out.buf, int(x.buf) + (n - 1) * width * 4, width * 4, self.stream)
        self.record("copy_last_row")
        return out

    def _lm_table(self, table: Tensor) -> Tensor:
        """The table in the LM head's format, re-encoded on the device once per table. An F16 table
        stays F16 unless BITNET_CUDA_LM_HEAD forces a format: bf16 would drop 3 of its mantissa bits
        and read no fewer bytes. The original stays too: a tied embedding still reads it."""
        src = _DTYPE_FORMAT[table.dtype]
        want = src if src == "f16" and not self.lm_head_forced else self.lm_head_format
        if want == src:
            return table
        if table not in self._lm_tables:
            dtype = np.float32 if want == "f32" else np.float16 if want == "f16" else np.uint16
            out = Tensor(self.pool, table.shape, dtype, f"lm head table {want}", resident=True)
            count, local = math.prod(table.shape), self.local["convert_table"]
            src16, src32 = (table, out) if src != "f32" else (out, table)  # the unused pointer is a dummy
            dst16, dst32 = (out, table) if want != "f32" else (table, out)
            self._run("convert_table", (min(groups(count, local), 1 << 16),), src16, src32, LM_FORMATS[src],
                      dst16, dst32, LM_FORMATS[want], np.uint64(count))
            self._lm_tables[table] = out
        return self._lm_tables[table]

    @_op
    def lm_head(self, x: Tensor, table: Tensor) -> Tensor:
        n, dim = x.shape
        vocab = table.shape[0]
        if table.shape[1] != dim:
            raise ValueError(f"lm_head: input width {dim} != table width {table.shape[1]}")
        table = self._lm_table(table)
        name = f"lm_head_{_DTYPE_FORMAT[table.dtype]}"
        local = self.local[name]
        # A row's lanes take 8-element chunks in turn: at least a warp of lanes (coalesced reads),
        # more while each lane still gets 64 elements or more.
        lanes = min(local, max(pow2_floor(self.simd[name]), pow2_floor(max(dim // 64, 1))))
        y, grid = self._new((n, vocab)), (groups(vocab, local // lanes), groups(n, TILE_N))
        self._run(name, grid, table, x, y, vocab, dim, n, lanes)
        return y

    @_op
    def argmax(self, logits: Tensor) -> np.ndarray:
        n, vocab = logits.shape
        idx = self._new((n,), np.int32, "argmax")
        self._run("argmax_f32", (n,), logits, idx, vocab)
        return self._read(idx, np.int32).astype(np.int64)
