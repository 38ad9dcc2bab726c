"""The OpenCL kernel provider: a buffer pool, one program built from the shared kernel source, and one
method per KernelProvider operation, each enqueueing its kernel on a single in-order queue.

The in-order queue is the whole synchronisation story: a kernel sees everything enqueued before it,
a buffer handed back to the pool can be reused at once (its next user runs later), and a blocking
read waits for exactly the work queued before it. Only to_host and argmax read.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyopencl as cl

from bitnet import gpu as kernels_src
from bitnet.plugins.types import Device
from bitnet.errors import NoBackendError, UsageError
from bitnet.runtime.provider import ACT_QUANT_MODES, ACTIVATIONS, KernelProvider
from bitnet.gpu.host import KVCache, Tensor, TernaryWeight, groups, pow2_floor
from bitnet.modelfile.ternary import BLOCK, TernaryMatrix

TILE_N = 8  # tokens per matmul work-group (the kernel source's TILE_N): weights read once per tile
# Cap on work-group size: static local arrays are sized by it at build time, and the reductions
# here gain nothing from larger groups. The device and each kernel may allow less.
MAX_LOCAL = 256
ACT_MODE = {"row": 0, "block256": 1}


def open_cl_device(platform_index: int, device_index: int) -> tuple[cl.Context, cl.Device]:
    """A fresh context on device `device_index` of platform `platform_index`."""
    try:
        platforms = cl.get_platforms()
    except cl.Error as exc:
        raise NoBackendError(f"OpenCL: no platform ({exc})") from exc
    try:
        dev = platforms[platform_index].get_devices()[device_index]
    except (IndexError, cl.Error) as exc:
        raise NoBackendError(f"OpenCL: no device {device_index} on platform {platform_index}") from exc
    return cl.Context([dev]), dev


def driver_caches_builds(dev: cl.Device) -> bool:
    """Whether the driver keeps its own on-disk cache of source builds (PoCL, NVIDIA), in which case
    PyOpenCL skips its binary cache and builds from source, and the driver answers from its cache."""
    from pyopencl.characterize import has_src_build_cache

    return bool(has_src_build_cache(dev))


def program_cache_dir(dev: cl.Device) -> Path | None:
    """Where the compiled program of `dev` is cached on disk, or None where only the driver knows.

    PoCL: its kernel cache (POCL_CACHE_DIR, else $XDG_CACHE_HOME/pocl/kcache, else
    ~/.cache/pocl/kcache), which also holds the per-kernel code PoCL generates at the first launch
    of each work-group size, the larger part of a cold start. Drivers without their own cache:
    PyOpenCL's binary cache, kept under bitnet's cache directory (BITNET_CACHE_DIR).
    """
    if dev.platform.name.strip() == "Portable Computing Language":
        if os.environ.get("POCL_CACHE_DIR"):
            return Path(os.environ["POCL_CACHE_DIR"])
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = Path(xdg) if xdg and Path(xdg).is_dir() else Path.home() / ".cache"
        return base / "pocl" / "kcache"
    if driver_caches_builds(dev):
        return None
    from bitnet.modelfile.default_model import cache_dir

    return cache_dir() / "opencl-programs"


def build_program(ctx: cl.Context, dev: cl.Device, source: str, max_local: int) -> cl.Program:
    """Build once per context, from the on-disk cache when an earlier process built the same source for
    the same device (program_cache_dir). A failure carries the build log."""
    options = [f"-DMAX_WG={max_local}", f"-DTILE_N={TILE_N}", "-cl-std=CL1.2"]
    if dev.single_fp_config & cl.device_fp_config.CORRECTLY_ROUNDED_DIVIDE_SQRT:
        options.append("-cl-fp32-correctly-rounded-divide-sqrt")  # 127/max must round as NumPy's does
    cache = None if driver_caches_builds(dev) else program_cache_dir(dev)
    try:
        return cl.Program(ctx, source).build(options=options, cache_dir=str(cache) if cache else None)
    except cl.Error as exc:  # PyOpenCL puts the device's build log in the message
        raise NoBackendError(f"OpenCL kernel build failed on {dev.name.strip()}:\n{exc}") from exc


# -- memory ------------------------------------------------------------------------------------------
@dataclass
class PoolStats:
    current: int = 0  # bytes allocated on the device: in use plus cached
    peak: int = 0
    in_use: int = 0
    allocations: int = 0  # real device allocations
    cache_hits: int = 0  # requests served from the cache


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{nbytes} bytes"


# Driver codes that mean "no memory for this buffer" (some drivers allocate at first use, so the
# enqueue that first touches a buffer can report them too).
_OUT_OF_MEMORY = {cl.status_code.MEM_OBJECT_ALLOCATION_FAILURE, cl.status_code.OUT_OF_RESOURCES,
                  cl.status_code.OUT_OF_HOST_MEMORY, cl.status_code.INVALID_BUFFER_SIZE}


def _is_out_of_memory(exc: cl.Error) -> bool:
    return isinstance(exc, cl.MemoryError) or getattr(exc, "code", None) in _OUT_OF_MEMORY


class BufferPool:
    """Device buffers cached by exact size: a transformer asks for the same few sizes every token.

    Only activations are cached for reuse; a resident buffer (weights, tables, caches) given back goes
    straight back to the driver. Requests beyond the device's limits fail with NoBackendError naming
    the sizes, before the driver is asked: `max_alloc` bytes per buffer, `capacity` bytes in all.
    """

    def __init__(self, ctx: cl.Context) -> None:
        self.ctx = ctx
        dev = ctx.devices[0]
        self.device_name = dev.name.strip()
        self.max_alloc, self.capacity = int(dev.max_mem_alloc_size), int(dev.global_mem_size)
        self.stats = PoolStats()
        self._free: dict[int, list[cl.Buffer]] = {}
        self._live: dict[int, tuple[cl.Buffer, str, bool]] = {}  # id -> (buffer, tag, resident)
        self._leaked: list[str] = []

    def out_of_memory(self, nbytes: int, tag: str, why: str) -> NoBackendError:
        return NoBackendError(f"OpenCL device {self.device_name} is out of memory: {tag} needs {_size(nbytes)}; "
                              f"{why} ({_size(self.stats.current)} held by this model)")

    def alloc(self, nbytes: int, tag: str, resident: bool = False) -> cl.Buffer:
        nbytes = max(int(nbytes), 4)  # OpenCL has no empty buffers
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
        self._live[id(buf)] = (buf, tag, resident)
        return buf

    def _allocate(self, nbytes: int, tag: str) -> cl.Buffer:
        if nbytes > self.max_alloc:
            raise self.out_of_memory(nbytes, tag, f"the device allows at most {_size(self.max_alloc)} "
                                                  "in one buffer (CL_DEVICE_MAX_MEM_ALLOC_SIZE)")
        if self.stats.current + nbytes > self.capacity:
            self.trim()  # cached activations are the first to go
        if self.stats.current + nbytes > self.capacity:
            raise self.out_of_memory(nbytes, tag, f"the device has {_size(self.capacity)} of global memory")
        for retry in (False, True):
            try:
                return cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, nbytes)
            except cl.Error as exc:
                if not _is_out_of_memory(exc):
                    raise
                if retry or not self._free:
                    raise self.out_of_memory(nbytes, tag, f"the driver refused ({exc})") from exc
            self.trim()  # other processes hold the rest: once more without our cached activations
        raise AssertionError("unreachable")

    def free(self, buf: cl.Buffer) -> None:
        entry = self._live.pop(id(buf), None)
        if entry is None:
            return  # close() released it already
        self.stats.in_use -= buf.size
        if entry[2]:  # resident: a one-off size nobody asks for again
            self.stats.current -= buf.size
            buf.release()
        else:
            self._free.setdefault(buf.size, []).append(buf)

    def trim(self) -> None:
        """Give every cached buffer back to the driver."""
        for bufs in self._free.values():
            for buf in bufs:
                self.stats.current -= buf.size
                buf.release()
        self._free.clear()

    def leaks(self) -> list[str]:
        """Activation buffers still held by someone, or that were when the pool closed."""
        return self._leaked + [f"{tag} ({buf.size} bytes)" for buf, tag, resident in self._live.values()
                               if not resident]

    def close(self) -> None:
        """Release everything; activations still held at this point are recorded as leaks."""
        self._leaked = self.leaks()
        for buf, _, _ in self._live.values():
            self.stats.in_use -= buf.size
            self.stats.current -= buf.size
            buf.release()
        self._live.clear()
        self.trim()


class OpenCLProvider(KernelProvider):
    """One OpenCL device; `device.properties` carry `platform_index` and `device_index`."""

    def __init__(self, device: Device, source: str | None = None) -> None:
        super().__init__("opencl", device)
        props = device.properties
        if "platform_index" not in props or "device_index" not in props:
            raise NoBackendError(f"device {device.name!r} lacks platform_index / device_index: "
                                 "open a device the opencl probe found")
        self.ctx, self.cl_device = open_cl_device(props["platform_index"], props["device_index"])
        if not self.cl_device.endian_little:
            raise NoBackendError(f"OpenCL device {self.cl_device.name.strip()} is big-endian; the code "
                                 "words of the ternary layout assume little-endian")
        self.queue = cl.CommandQueue(self.ctx)  # in order
        self.pool = BufferPool(self.ctx)
        max_local = pow2_floor(min(MAX_LOCAL, self.cl_device.max_work_group_size))
        t0 = time.perf_counter()
        program = build_program(self.ctx, self.cl_device, source or kernels_src.source("opencl"), max_local)
        # A cold build takes seconds on some drivers; from the on-disk cache, milliseconds.
        self.build_ms = (time.perf_counter() - t0) * 1e3
        self.program_cache = program_cache_dir(self.cl_device)
        self.kernels = {k.function_name: k for k in program.all_kernels()}
        self.local = {name: self._local_size(k, max_local) for name, k in self.kernels.items()}
        # The SIMD width (warp) each kernel prefers: lanes that share a row come in multiples of it.
        self.simd = {name: k.get_work_group_info(cl.kernel_work_group_info.PREFERRED_WORK_GROUP_SIZE_MULTIPLE,
                                                 self.cl_device) for name, k in self.kernels.items()}
        self._rope: dict[tuple[float, int], tuple[Tensor, Tensor]] = {}
        self._writes: list[cl.Event] = []  # host-to-device copies in flight (they own their host arrays)
        self.closed = False

    def _local_size(self, kernel: cl.Kernel, max_local: int) -> int:
        """The largest power of two (the tree reductions need one) the device allows for this kernel."""
        limit = kernel.get_work_group_info(cl.kernel_work_group_info.WORK_GROUP_SIZE, self.cl_device)
        return pow2_floor(min(max_local, limit))

    def _run(self, name: str, groups: tuple[int, ...], *args: Any, local: int | None = None) -> None:
        """Enqueue kernel `name` on a grid of `groups` work-groups and record that it ran."""
        local = local or self.local[name]
        cl_args = [a.buf if isinstance(a, Tensor) else np.int32(a) if isinstance(a, int)
                   else np.float32(a) if isinstance(a, float) else a for a in args]
        gsize = (groups[0] * local, *groups[1:])
        try:
            self.kernels[name](self.queue, gsize, (local,) + (1,) * (len(groups) - 1), *cl_args)
        except cl.Error as exc:
            raise self._enqueue_error(exc, f"kernel {name}") from exc
        self.record(name)

    def _enqueue_error(self, exc: cl.Error, what: str) -> Exception:
        """Drivers that allocate at first use report a full device here, not at allocation."""
        if _is_out_of_memory(exc):
            return NoBackendError(f"OpenCL device {self.pool.device_name} ran out of memory running {what}: {exc} "
                                  f"({_size(self.pool.stats.current)} held by this model)")
        return exc

    def _new(self, shape: tuple[int, ...], dtype: Any = np.float32, tag: str = "activation") -> Tensor:
        return Tensor(self.pool, shape, dtype, tag)

    def _write(self, t: Tensor, host: np.ndarray) -> Tensor:
        # Not blocking (a blocking write would wait for all queued work); the event keeps `host`
        # alive and is dropped at the next read, which proves the copy done.
        done = cl.command_execution_status.COMPLETE
        self._writes = [e for e in self._writes if e.command_execution_status != done]
        try:
            self._writes.append(cl.enqueue_copy(self.queue, t.buf, np.ascontiguousarray(host), is_blocking=False))
        except cl.Error as exc:
            raise self._enqueue_error(exc, "a copy to the device") from exc
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

    def _read(self, t: Tensor, dtype: Any) -> np.ndarray:
        out = np.empty(t.shape, dtype)
        cl.enqueue_copy(self.queue, out, t.buf, is_blocking=True)  # waits for the work queued before it
        self._writes.clear()
        return out

    def leaks(self) -> list[str]:
        """Activations not given back: still held, or still held when the provider closed."""
        return self.pool.leaks()

    def memory_stats(self) -> dict[str, int]:
        """Device memory of this provider's pool (receipts report the peak)."""
        return {"peak_bytes": self.pool.stats.peak, **asdict(self.pool.stats)}

    # -- memory ---------------------------------------------------------------------------------------
    def upload_ternary(self, w: TernaryMatrix) -> TernaryWeight:
        name = f"{w.rows}x{w.cols}"
        codes, scales = self._resident(
            ((w.rows, w.cols // 16), np.uint32, f"ternary codes {name}", w.packed().view(np.uint32)),
            (w.scales.shape, np.float32, f"ternary scales {name}", w.scales.astype(np.float32, copy=False)))
        return TernaryWeight(codes, scales, w.rows, w.cols)

    def upload_float(self, a: np.ndarray) -> Tensor:
        a = np.asarray(a)
        dtype = np.float16 if a.dtype == np.float16 else np.float32  # F16 tables stay F16 on the device
        (t,) = self._resident((a.shape, dtype, f"float {a.shape}", a.astype(dtype, copy=False)))
        return t

    def kv_cache(self, n_layers: int, n_ctx: int, n_kv_heads: int, head_dim: int) -> KVCache:
        shape = (n_layers, n_kv_heads, n_ctx, head_dim)
        what = f"of {n_ctx} positions"
        k, v = self._resident((shape, np.float32, f"KV cache K {what}", None),
                              (shape, np.float32, f"KV cache V {what}", None))
        return KVCache(k, v, n_kv_heads, n_ctx, head_dim, [0] * n_layers)

    def to_host(self, x: Tensor) -> np.ndarray:
        return self._read(x, x.dtype).astype(np.float32, copy=False)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.queue.finish()
        self._writes.clear()
        self._rope.clear()
        self.pool.close()

    # -- operations -----------------------------------------------------------------------------------
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

    def rmsnorm(self, x: Tensor, w: Tensor, eps: float) -> Tensor:
        out = self._new(x.shape)
        self._run("rmsnorm_f32", (x.shape[0],), x, w, out, x.shape[1], float(eps))
        return out

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
            cos, sin = self._resident((angles.shape, np.float32, "rope cos", np.cos(angles).astype(np.float32)),
                                      (angles.shape, np.float32, "rope sin", np.sin(angles).astype(np.float32)))
            self._rope[key] = (cos, sin)
        return self._rope[key]

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

    def act_mul(self, gate: Tensor, up: Tensor, act: str) -> Tensor:
        if act not in ACTIVATIONS:
            raise UsageError(f"unknown activation {act!r}; expected one of {', '.join(ACTIVATIONS)}")
        return self._elementwise(f"{act}_mul_f32", gate, up)

    def add(self, a: Tensor, b: Tensor) -> Tensor:
        return self._elementwise("add_f32", a, b)

    def _elementwise(self, name: str, a: Tensor, b: Tensor) -> Tensor:
        if a.shape != b.shape:
            raise ValueError(f"{name}: shapes {a.shape} and {b.shape} differ")
        out, count = self._new(a.shape), math.prod(a.shape)
        self._run(name, (groups(count, self.local[name]),), a, b, out, count)
        return out

    def last_row(self, x: Tensor) -> Tensor:
        n, width = x.shape
        out = self._new((1, width))
        cl.enqueue_copy(self.queue, out.buf, x.buf, src_offset=(n - 1) * width * 4, byte_count=width * 4)
        self.record("copy_last_row")
        return out

    def lm_head(self, x: Tensor, table: Tensor) -> Tensor:
        n, dim = x.shape
        vocab = table.shape[0]
        if table.shape[1] != dim:
            raise ValueError(f"lm_head: input width {dim} != table width {table.shape[1]}")
        name = "lm_head_f16" if table.dtype == np.float16 else "lm_head_f32"
        local = self.local[name]
        # A row's lanes take 8-element chunks in turn: at least a SIMD width of lanes (coalesced reads),
        # more while each lane still gets 64 elements or more.
        lanes = min(local, max(pow2_floor(self.simd[name]), pow2_floor(max(dim // 64, 1))))
        y, grid = self._new((n, vocab)), (groups(vocab, local // lanes), groups(n, TILE_N))
        self._run(name, grid, table, x, y, vocab, dim, n, lanes)
        return y

    def argmax(self, logits: Tensor) -> np.ndarray:
        n, vocab = logits.shape
        idx = self._new((n,), np.int32, "argmax")
        self._run("argmax_f32", (n,), logits, idx, vocab)
        return self._read(idx, np.int32).astype(np.int64)
