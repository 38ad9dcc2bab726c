"""The host side of every GPU backend, written once: buffer pool, size checks, all-or-nothing uploads,
every KernelProvider operation as launches of the shared kernel source, leak check (docs/design.md
section 6).

A plugin subclasses GpuProvider and supplies only its driver's primitives, in the spirit of tinygrad's
runtime/ops_cl.py:

    _alloc(nbytes) -> buffer     raise OutOfDeviceMemory(why) when the driver refuses
    _free(buffer)
    _copy_in(buffer, host)       host to device, queued behind the work before it; keeps `host` alive
    _copy_out(host, buffer)      device to host, after all queued work (only to_host and argmax read)
    _copy(dst, dst_offset, src, src_offset, n)   device to device, n bytes between byte offsets, queued
    _launch(kernel, grid, local, args)   grid in work-groups; args are buffers, np.int32, np.float32, np.uint64
    _finish()                    wait for all queued work

and calls `_load_kernels` with what its build produced. One in-order queue (a stream) per provider is the
whole synchronisation story: a kernel sees everything queued before it, a buffer given back to the pool
can be reused at once (its next user runs later), and a read waits for exactly the work queued before it.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import numpy as np

from bitnet.errors import NoBackendError, UsageError
from bitnet.gpu import TILE_N
from bitnet.modelfile.ternary import BLOCK, TernaryMatrix
from bitnet.runtime.provider import ACT_QUANT_MODES, ACTIVATIONS, KV_DTYPES, KernelProvider

ACT_MODE = {"row": 0, "block256": 1}
# LM-head table formats, as the kernel source numbers them (FMT_*). bf16 lives in uint16 arrays.
LM_FORMATS = {"f32": 0, "f16": 1, "bf16": 2}
DTYPE_FORMAT = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", np.dtype(np.uint16): "bf16"}

_T = TypeVar("_T")


def pow2_floor(x: int) -> int:
    return 1 << (int(x).bit_length() - 1)


def groups(count: int, per_group: int) -> int:
    return -(-count // per_group)


def size_text(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{nbytes} bytes"


class OutOfDeviceMemory(Exception):
    """A plugin's `_alloc` raises this when the driver refuses a buffer; its text says why."""


# -- memory ------------------------------------------------------------------------------------------
@dataclass
class PoolStats:
    current: int = 0  # bytes allocated on the device: in use plus cached
    peak: int = 0
    in_use: int = 0
    allocations: int = 0  # real device allocations
    cache_hits: int = 0  # requests served from the cache


class BufferPool:
    """Device buffers cached by exact size: a transformer asks for the same few sizes every token.

    Only activations are cached for reuse; a resident buffer (weights, tables, caches) given back goes
    straight back to the driver. Requests beyond the device's limits fail with NoBackendError naming the
    sizes before the driver is asked: `max_alloc` bytes per buffer, `capacity` bytes in all. When the
    driver refuses, cached activations go back to it and the request is tried once more.
    """

    def __init__(self, device: str, alloc: Callable[[int], Any], free: Callable[[Any], None],
                 max_alloc: int, capacity: int) -> None:
        self.device, self._driver_alloc, self._driver_free = device, alloc, free
        self.max_alloc, self.capacity = int(max_alloc), int(capacity)
        self.stats = PoolStats()
        self._free: dict[int, list[Any]] = {}
        self._live: dict[int, tuple[Any, int, str, bool]] = {}  # id -> (buffer, size, tag, resident)
        self._leaked: list[str] = []

    def out_of_memory(self, nbytes: int, tag: str, why: str) -> NoBackendError:
        return NoBackendError(f"{self.device} is out of memory: {tag} needs {size_text(nbytes)}; {why} "
                              f"({size_text(self.stats.current)} held by this model)")

    def ran_out(self, what: str, detail: object) -> NoBackendError:
        """Drivers that allocate at first use report a full device when work is queued, not at allocation."""
        return NoBackendError(f"{self.device} ran out of memory running {what}: {detail} "
                              f"({size_text(self.stats.current)} held by this model)")

    def alloc(self, nbytes: int, tag: str, resident: bool = False) -> Any:
        nbytes = max(int(nbytes), 4)  # neither OpenCL nor cuMemAlloc has empty buffers
        cached = self._free.get(nbytes)
        if cached:
            buf = cached.pop()
            self.stats.cache_hits += 1
        else:
            buf = self._allocate(nbytes, tag)
            self.stats.allocations += 1
            self.stats.current += nbytes
            self.stats.peak = max(self.stats.peak, self.stats.current)
        self.stats.in_use += nbytes
        self._live[id(buf)] = (buf, nbytes, tag, resident)
        return buf

    def _allocate(self, nbytes: int, tag: str) -> Any:
        if nbytes > self.max_alloc:
            raise self.out_of_memory(nbytes, tag, f"the device allows at most {size_text(self.max_alloc)} "
                                                  "in one buffer")
        if self.stats.current + nbytes > self.capacity:
            self.trim()  # cached activations are the first to go
        if self.stats.current + nbytes > self.capacity:
            raise self.out_of_memory(nbytes, tag, f"the device has {size_text(self.capacity)} of memory")
        try:
            return self._driver_alloc(nbytes)
        except OutOfDeviceMemory as exc:
            if not self._free:
                raise self.out_of_memory(nbytes, tag, str(exc)) from exc
        self.trim()  # other processes hold the rest: once more without our cached activations
        try:
            return self._driver_alloc(nbytes)
        except OutOfDeviceMemory as exc:
            raise self.out_of_memory(nbytes, tag, str(exc)) from exc

    def free(self, buf: Any) -> None:
        entry = self._live.pop(id(buf), None)
        if entry is None:
            return  # close() released it already
        _, size, _, resident = entry
        self.stats.in_use -= size
        if resident:  # a one-off size nobody asks for again
            self.stats.current -= size
            self._driver_free(buf)
        else:
            self._free.setdefault(size, []).append(buf)

    def trim(self) -> None:
        """Give every cached buffer back to the driver."""
        for size, bufs in self._free.items():
            for buf in bufs:
                self.stats.current -= size
                self._driver_free(buf)
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
            self._driver_free(buf)
        self._live.clear()
        self.trim()


class Tensor:
    """A device array: the opaque handle core passes around. Its buffer returns to the pool when the
    handle is dropped; `resident` ones (weights, tables, caches) are not activations and never leak."""

    def __init__(self, pool: BufferPool, shape: tuple[int, ...], dtype: Any, tag: str,
                 resident: bool = False) -> None:
        self.shape, self.dtype = tuple(int(s) for s in shape), np.dtype(dtype)
        self.buf = pool.alloc(math.prod(self.shape) * self.dtype.itemsize, tag, resident)
        self._free = weakref.finalize(self, pool.free, self.buf)

    def release(self) -> None:
        """Give the buffer back now rather than when the handle is dropped (once; later calls do nothing)."""
        self._free()


@dataclass(frozen=True)
class TernaryWeight:
    """Device layout: the canonical 2-bit codes, unchanged, read as 32-bit words (16 per 256-block).
    Masking one 2-bit plane of a word gives four codes that meet four consecutive int8 activations,
    one dp4a; the per-block float32 scales stay as they are."""

    codes: Tensor  # uint32 [rows, cols // 16]
    scales: Tensor  # float32 [rows, cols // 256]
    rows: int
    cols: int


@dataclass
class KVCache:
    k: Tensor  # float32 or float16 (kv_type) [n_layers, n_seqs, n_kv_heads, n_ctx, head_dim]
    v: Tensor
    n_kv_heads: int
    n_ctx: int
    head_dim: int
    n_seqs: int
    filled: np.ndarray  # int64 [n_layers, n_seqs]: positions 0..filled-1 of a slot hold K and V


def check_rows(cache: KVCache, layer: int, slots: np.ndarray, positions: np.ndarray, n: int) -> None:
    """One-line UsageErrors for what the kernels would get wrong: a slot or position outside the cache,
    or a row whose earlier positions were never written (neither cached nor a row just before it in the
    batch), which attention would read as garbage."""
    if len(slots) != n or len(positions) != n:
        raise UsageError(f"{n} rows need {n} slots and positions, got {len(slots)} and {len(positions)}")
    if slots.min() < 0 or slots.max() >= cache.n_seqs:
        raise UsageError(f"sequence slot out of range 0..{cache.n_seqs - 1}")
    outside = (positions < 0) | (positions >= cache.n_ctx)
    if outside.any():
        raise UsageError(f"position {int(positions[outside][0])} is outside the context of {cache.n_ctx}")
    follows = np.r_[False, (slots[1:] == slots[:-1]) & (positions[1:] == positions[:-1] + 1)]
    unwritten = ~follows & (positions > cache.filled[layer, slots])
    if unwritten.any():
        i = int(np.argmax(unwritten))
        raise UsageError(f"position {int(positions[i])} of slot {int(slots[i])} follows only "
                         f"{int(cache.filled[layer, slots[i]])} cached positions")


@dataclass(frozen=True)
class Kernel:
    """A built kernel: the driver's handle, the largest work-group it may run with, and the SIMD width
    (warp) it prefers."""

    handle: Any
    max_local: int
    simd: int


def op(method: Callable[..., _T]) -> Callable[..., _T]:
    """A public operation: runs inside the plugin's `scope` (CUDA: its context current, an NVTX range)."""
    name = method.__name__

    @functools.wraps(method)
    def run(self: GpuProvider, *args: Any, **kw: Any) -> _T:
        with self.scope(name):
            return method(self, *args, **kw)

    return run


class GpuProvider(KernelProvider):
    """Every KernelProvider operation, as launches of the shared kernels through a plugin's primitives."""

    # Largest grid along y (tokens ride on it), where the API has one.
    max_grid_y: int | None = None
    # The format F32 LM-head tables are re-encoded in (LM_FORMATS), or None to keep tables as uploaded.
    lm_head_format: str | None = None
    lm_head_forced = False  # F16 tables too are re-encoded (a user's choice, not the device's)

    def __init__(self, backend: str, device: Any, device_text: str, max_alloc: int, capacity: int) -> None:
        super().__init__(backend, device)
        self.pool = BufferPool(device_text, self._alloc, self._free, max_alloc, capacity)
        self.kernels: dict[str, Any] = {}
        self.local: dict[str, int] = {}
        self.simd: dict[str, int] = {}
        self._rope: dict[tuple[float, int], tuple[Tensor, Tensor]] = {}
        # Per role ("positions", "slots"): a resident device buffer and the host values it holds.
        self._indices: dict[str, tuple[Tensor, np.ndarray]] = {}
        self._lm_tables: weakref.WeakKeyDictionary[Tensor, Tensor] = weakref.WeakKeyDictionary()
        self.closed = False

    # -- what a plugin supplies ---------------------------------------------------------------------
    def _alloc(self, nbytes: int) -> Any:
        raise NotImplementedError

    def _free(self, buf: Any) -> None:
        raise NotImplementedError

    def _copy_in(self, buf: Any, host: np.ndarray) -> None:
        raise NotImplementedError

    def _copy_out(self, host: np.ndarray, buf: Any) -> None:
        raise NotImplementedError

    def _copy(self, dst: Any, dst_offset: int, src: Any, src_offset: int, nbytes: int) -> None:
        raise NotImplementedError

    def _launch(self, kernel: Any, grid: tuple[int, ...], local: int, args: list[Any]) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError

    @contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Around each public operation; a plugin may make its context current or open a profiler range."""
        yield

    # -- shared machinery -----------------------------------------------------------------------------
    def _load_kernels(self, kernels: dict[str, Kernel], max_local: int) -> None:
        """Take what the plugin's build produced; each kernel runs with the largest power of two (the tree
        reductions need one) the device allows it, up to `max_local`."""
        self.kernels = {name: k.handle for name, k in kernels.items()}
        self.local = {name: pow2_floor(min(max_local, k.max_local)) for name, k in kernels.items()}
        self.simd = {name: k.simd for name, k in kernels.items()}

    def _run(self, name: str, grid: tuple[int, ...], *args: Any, local: int | None = None) -> None:
        """Launch kernel `name` on `grid` work-groups and record that it ran."""
        if self.max_grid_y and len(grid) > 1 and grid[1] > self.max_grid_y:
            raise UsageError(f"{name}: {grid[1]} tokens in one batch exceed the grid limit of {self.max_grid_y}")
        typed = [a.buf if isinstance(a, Tensor) else np.int32(a) if isinstance(a, int)
                 else np.float32(a) if isinstance(a, float) else a for a in args]
        self._launch(self.kernels[name], grid, local or self.local[name], typed)
        self.record(name)

    def _new(self, shape: tuple[int, ...], dtype: Any = np.float32, tag: str = "activation") -> Tensor:
        return Tensor(self.pool, shape, dtype, tag)

    def _write(self, t: Tensor, host: np.ndarray) -> Tensor:
        self._copy_in(t.buf, np.ascontiguousarray(host))
        return t

    def _resident(self, *parts: tuple[tuple[int, ...], Any, str, np.ndarray | None]) -> list[Tensor]:
        """Resident tensors (shape, dtype, tag, host data or None), all or none: when one cannot be
        allocated or written, those made before it are released, so a failed load leaves the pool as it
        found it."""
        made: list[Tensor] = []
        try:
            for shape, dtype, tag, host in parts:
                made.append(Tensor(self.pool, shape, dtype, tag, resident=True))
                if host is not None:
                    self._write(made[-1], host)
        except BaseException:
            for t in made:  # a copy still queued keeps its buffer alive in the driver until it is done
                t.release()
            raise
        return made

    def _index(self, role: str, host: np.ndarray) -> Tensor:
        """A small int32 array (the rows' positions or slots) on the device. The transformer passes the
        same arrays to every layer, so one resident buffer per role is rewritten only when the values
        change: one upload per forward, not one per layer. Rewriting it is safe on the one in-order queue
        (kernels queued before the copy read the old values); it grows by doubling."""
        held = self._indices.get(role)
        if held is not None and held[1].shape == host.shape and np.array_equal(held[1], host):
            return held[0]
        if held is None or held[0].shape[0] < host.size:
            if held is not None:
                held[0].release()
            (dev,) = self._resident(((max(64, 1 << (host.size - 1).bit_length()),), np.int32, f"{role} index",
                                     None))
        else:
            dev = held[0]
        values = np.array(host, dtype=np.int32)  # a copy: the caller may reuse its array mid-copy
        self._copy_in(dev.buf, values)
        self._indices[role] = (dev, values)
        return dev

    def _read(self, t: Tensor, dtype: Any) -> np.ndarray:
        out = np.empty(t.shape, dtype)
        self._copy_out(out, t.buf)
        return out

    def leaks(self) -> list[str]:
        """Activations not given back: still held, or still held when the provider closed."""
        return self.pool.leaks()

    def memory_stats(self) -> dict[str, int]:
        """Device memory of this provider's pool (receipts report the peak)."""
        return {"peak_bytes": self.pool.stats.peak, **asdict(self.pool.stats)}

    @op
    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._finish()
        self._rope.clear()
        self._indices.clear()
        self._lm_tables.clear()
        self.pool.close()

    # -- memory ---------------------------------------------------------------------------------------
    @op
    def upload_ternary(self, w: TernaryMatrix) -> TernaryWeight:
        name = f"{w.rows}x{w.cols}"
        codes, scales = self._resident(
            ((w.rows, w.cols // 16), np.uint32, f"ternary codes {name}", w.packed().view(np.uint32)),
            (w.scales.shape, np.float32, f"ternary scales {name}", w.scales.astype(np.float32, copy=False)))
        return TernaryWeight(codes, scales, w.rows, w.cols)

    @op
    def upload_float(self, a: np.ndarray) -> Tensor:
        a = np.asarray(a)
        dtype = np.float16 if a.dtype == np.float16 else np.float32  # F16 tables stay F16 on the device
        (t,) = self._resident((a.shape, dtype, f"float {a.shape}", a.astype(dtype, copy=False)))
        return t

    @op
    def kv_cache(self, n_layers: int, n_ctx: int, n_kv_heads: int, head_dim: int, n_seqs: int = 1,
                 kv_type: str = "f32") -> KVCache:
        if kv_type not in KV_DTYPES:  # q8's rows would need a kernel of their own, which the GPU sources do not have
            raise UsageError(f"the {self.backend} backend keeps its KV cache in {' or '.join(KV_DTYPES)}: kv_type "
                             f"{kv_type!r} runs on the CPU backends only")
        shape = (n_layers, n_seqs, n_kv_heads, n_ctx, head_dim)
        what = f"of {n_ctx} positions" + (f" x {n_seqs} sequences" if n_seqs > 1 else "")
        k, v = self._resident((shape, KV_DTYPES[kv_type], f"KV cache K {what}", None),
                              (shape, KV_DTYPES[kv_type], f"KV cache V {what}", None))
        return KVCache(k, v, n_kv_heads, n_ctx, head_dim, n_seqs, np.zeros((n_layers, n_seqs), np.int64))

    @op
    def from_host(self, a: np.ndarray) -> Tensor:
        """An activation from the host, float32: what core's fallback hands back after running an
        operation this device lacks."""
        a = np.asarray(a, dtype=np.float32)
        return self._write(self._new(a.shape), a)

    @op
    def to_host(self, x: Tensor) -> np.ndarray:
        return self._read(x, x.dtype).astype(np.float32, copy=False)

    # -- operations -----------------------------------------------------------------------------------
    @op
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

    @op
    def rmsnorm(self, x: Tensor, w: Tensor, eps: float) -> Tensor:
        out = self._new(x.shape)
        self._run("rmsnorm_f32", (x.shape[0],), x, w, out, x.shape[1], float(eps))
        return out

    @op
    def bitlinear(self, x: Tensor, w: TernaryWeight, act_quant: str) -> Tensor:
        if act_quant not in ACT_QUANT_MODES:
            raise UsageError(f"unknown activation quantization {act_quant!r}; expected one of "
                             f"{', '.join(ACT_QUANT_MODES)}")
        n, cols = x.shape
        if cols > w.cols:
            raise ValueError(f"bitlinear: input width {cols} > weight columns {w.cols}")
        if cols < w.cols:  # a width that is not whole 256-blocks: the weight is held zero-extended
            padded = self._new((n, w.cols))
            self._run("zero_extend_f32", (groups(w.cols, self.local["zero_extend_f32"]), n), x, padded, cols, w.cols)
            x, cols = padded, w.cols
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
            cos, sin = self._resident((angles.shape, np.float32, "rope cos", np.cos(angles).astype(np.float32)),
                                      (angles.shape, np.float32, "rope sin", np.sin(angles).astype(np.float32)))
            self._rope[key] = (cos, sin)
        return self._rope[key]

    @op
    def rope(self, x: Tensor, n_heads: int, head_dim: int, positions: np.ndarray, theta: float) -> Tensor:
        n = x.shape[0]
        if x.shape[1] != n_heads * head_dim or head_dim % 2:
            raise ValueError(f"rope: width {x.shape[1]} is not {n_heads} heads of even dim {head_dim}")
        positions = np.asarray(positions).reshape(-1)
        if len(positions) != n or (n and positions.min() < 0):
            raise UsageError(f"rope: {n} rows need {n} positions >= 0, got {positions.tolist()[:8]}")
        cos, sin = self._rope_table(theta, head_dim, int(positions.max()) + 1)
        out = self._new(x.shape)
        pairs = n_heads * head_dim // 2
        self._run("rope_neox_f32", (groups(pairs, self.local["rope_neox_f32"]), n),
                  x, out, cos, sin, self._index("positions", positions), n_heads, head_dim)
        return out

    @op
    def attention(self, q: Tensor, k: Tensor, v: Tensor, cache: KVCache, layer: int, slots: np.ndarray,
                  positions: np.ndarray, n_heads: int, n_kv_heads: int, head_dim: int) -> Tensor:
        n = q.shape[0]
        if (n_kv_heads, head_dim) != (cache.n_kv_heads, cache.head_dim) or n_heads % n_kv_heads:
            raise ValueError(f"attention: {n_heads} heads over {n_kv_heads} KV heads of dim {head_dim} "
                             f"do not fit a cache of {cache.n_kv_heads} KV heads of dim {cache.head_dim}")
        slots, positions = np.asarray(slots).reshape(-1), np.asarray(positions).reshape(-1)
        check_rows(cache, layer, slots, positions, n)
        dev_slots, dev_pos = self._index("slots", slots), self._index("positions", positions)
        width, fmt = n_kv_heads * head_dim, DTYPE_FORMAT[cache.k.dtype]
        self._run(f"kv_store_{fmt}", (groups(width, self.local[f"kv_store_{fmt}"]), n), k, v, cache.k, cache.v,
                  dev_slots, dev_pos, layer, cache.n_seqs, n_kv_heads, head_dim, cache.n_ctx)
        # As the transformer counts: a sequence's last row ends what its slot holds (a rewind forgets the rest).
        last = np.r_[slots[1:] != slots[:-1], True]
        cache.filled[layer, slots[last]] = positions[last] + 1
        out = self._new(q.shape)
        # Chunks of about head_dim positions keep every thread busy in both the score and the V phase.
        local = min(self.local[f"attention_{fmt}"], 1 << (head_dim - 1).bit_length())
        self._run(f"attention_{fmt}", (n_heads, n), q, cache.k, cache.v, out, dev_slots, dev_pos, layer,
                  cache.n_seqs, n_heads, n_kv_heads, head_dim, cache.n_ctx, float(1.0 / math.sqrt(head_dim)),
                  local=local)
        return out

    @op
    def act_mul(self, gate: Tensor, up: Tensor, act: str) -> Tensor:
        if act not in ACTIVATIONS:
            raise UsageError(f"unknown activation {act!r}; expected one of {', '.join(ACTIVATIONS)}")
        return self._elementwise(f"{act}_mul_f32", gate, up)

    @op
    def add(self, a: Tensor, b: Tensor) -> Tensor:
        return self._elementwise("add_f32", a, b)

    def _elementwise(self, name: str, a: Tensor, b: Tensor) -> Tensor:
        if a.shape != b.shape:
            raise ValueError(f"{name}: shapes {a.shape} and {b.shape} differ")
        out, count = self._new(a.shape), math.prod(a.shape)
        self._run(name, (groups(count, self.local[name]),), a, b, out, count)
        return out

    @op
    def rows(self, x: Tensor, index: np.ndarray) -> Tensor:
        """Rows `index` of x, by device copies: one per run of consecutive rows (the indices are known on
        the host; a batch asks for one row per sequence, a handful)."""
        n, width = x.shape
        index = np.asarray(index, np.int64).reshape(-1)
        if not index.size or index.min() < 0 or index.max() >= n or (np.diff(index) <= 0).any():
            raise UsageError(f"rows: indices must be ascending in 0..{n - 1}, got {index.tolist()[:8]}")
        out = self._new((len(index), width))
        breaks = np.flatnonzero(np.diff(index) != 1) + 1
        for run in np.split(np.arange(len(index)), breaks):
            self._copy(out.buf, int(run[0]) * width * 4, x.buf, int(index[run[0]]) * width * 4,
                       len(run) * width * 4)
        self.record("copy_rows")
        return out

    def _lm_table(self, table: Tensor) -> Tensor:
        """The table in the LM head's format, re-encoded on the device once per table. An F16 table
        stays F16 unless the format is forced: bf16 would drop 3 of its mantissa bits and read no fewer
        bytes. The original stays too: a tied embedding still reads it."""
        src = DTYPE_FORMAT[table.dtype]
        want = src if self.lm_head_format is None or (src == "f16" and not self.lm_head_forced) \
            else self.lm_head_format
        if want == src:
            return table
        if table not in self._lm_tables:
            dtype = np.float32 if want == "f32" else np.float16 if want == "f16" else np.uint16
            (out,) = self._resident((table.shape, dtype, f"lm head table {want}", None))
            count, local = math.prod(table.shape), self.local["convert_table"]
            src16, src32 = (table, out) if src != "f32" else (out, table)  # the unused pointer is a dummy
            dst16, dst32 = (out, table) if want != "f32" else (table, out)
            self._run("convert_table", (min(groups(count, local), 1 << 16),), src16, src32, LM_FORMATS[src],
                      dst16, dst32, LM_FORMATS[want], np.uint64(count))
            self._lm_tables[table] = out
        return self._lm_tables[table]

    @op
    def lm_head(self, x: Tensor, table: Tensor) -> Tensor:
        n, dim = x.shape
        vocab = table.shape[0]
        if table.shape[1] != dim:
            raise ValueError(f"lm_head: input width {dim} != table width {table.shape[1]}")
        table = self._lm_table(table)
        name = f"lm_head_{DTYPE_FORMAT[table.dtype]}"
        local = self.local[name]
        # A row's lanes take 8-element chunks in turn: at least a SIMD width of lanes (coalesced reads),
        # more while each lane still gets 64 elements or more.
        lanes = min(local, max(pow2_floor(self.simd[name]), pow2_floor(max(dim // 64, 1))))
        y, grid = self._new((n, vocab)), (groups(vocab, local // lanes), groups(n, TILE_N))
        self._run(name, grid, table, x, y, vocab, dim, n, lanes)
        return y

    @op
    def argmax(self, logits: Tensor) -> np.ndarray:
        n, vocab = logits.shape
        idx = self._new((n,), np.int32, "argmax")
        self._run("argmax_f32", (n,), logits, idx, vocab)
        return self._read(idx, np.int32).astype(np.int64)
