"""How numba's worker threads run the kernels' parallel loops: TBB where it is installed, else OpenMP.

numba splits a parallel loop into one equal share per thread. Under OpenMP every thread must finish
its share before the loop returns, so a thread the OS has descheduled stalls the kernel until it
runs again; a decode step runs ~150 such loops. Under TBB the calling thread also runs the shares no
worker has started, so a busy co-tenant costs its fair share of a core, not the whole step. On the
2-core AMD EPYC with one busy co-tenant process, 2-thread decode ran 14.5-16.4 tokens/s on TBB and
7.3-8.8 on OpenMP; on a quiet machine the two ran alike.

numba picks TBB first when it can load it, but the `tbb` wheel puts `libtbb.so.12` in the
environment's `lib` directory, which the dynamic loader does not search (numba issue 6108): numba
then falls back to OpenMP without a word. Loading the library by its path first lets numba find it
by name (also when the user asks for `NUMBA_THREADING_LAYER=tbb`); `omp` or `workqueue` leave it unloaded.
"""

from __future__ import annotations

import ctypes
import os
import sysconfig

TBB_LIBRARY = "libtbb.so.12"


def installed_tbb() -> str | None:
    """The `tbb` wheel's library where pip puts it (this environment's `lib`, or the user's), or None."""
    for scheme in (sysconfig.get_default_scheme(), f"{os.name}_user"):
        path = os.path.join(sysconfig.get_path("data", scheme), "lib", TBB_LIBRARY)
        if os.path.exists(path):
            return path
    return None


def prefer_tbb() -> None:
    """Make the installed TBB loadable by numba, unless the user chose a layer without it."""
    if os.environ.get("NUMBA_THREADING_LAYER", "").strip().lower() in ("omp", "workqueue"):
        return
    path = installed_tbb()
    if path is not None:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:  # unloadable (another platform's build): numba uses OpenMP
            pass


def bounded_openmp_spinning() -> None:
    """Let numba's OpenMP workers (when OpenMP is the layer) spin ~0.5 ms between loops, then sleep.

    A 2B-4T decode step runs ~150 short parallel regions, a few tens of microseconds apart. Sleeping
    at once (OMP_WAIT_POLICY=passive) pays a wake-up per region: 2-thread decode lost 12 % on a
    quiet machine. libgomp's default (spinning ~15 ms) stalls every region on a descheduled
    spinner when the machine is shared: 0.5-1.6 tokens/s under a load of 7 on 2 cores, where
    2000-20000 spins gave 0.9-2.2 and passive 2.7-3.1. 10000 spins cover the gaps inside a step
    and give the cores back soon after. libgomp reads this when numba first starts its threads.
    """
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = "10000"


def configure() -> None:
    """Run before numba starts its threads (its first parallel call or thread-count change)."""
    prefer_tbb()
    bounded_openmp_spinning()
