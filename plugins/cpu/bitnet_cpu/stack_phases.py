"""Where a `layer_stack` call's time went: the cycle stamps each thread takes at its phase boundaries inside the
region (layer_regions.layers_row_rowscale), as seconds per phase.

Sampling profilers had misread the region: perf put the dot loop at 76-81 % of its thread time streaming at ~92 %
of the bandwidth probe (an Emerald Rapids Xeon, 2 threads); the stamps showed the projections taking 90 % of the
time at 75 % of the probe. A stamp is one `rdtsc`, 16 a layer and thread: ~0.02 % of a decode step.
"""

from __future__ import annotations

import time

import numpy as np
from numba import njit

from bitnet_cpu import atomics

MARKS = 16  # stamps a layer and thread, in the order a thread passes them:
# 0 the layer entered, 1 its input ready (the previous layer's output), then for each of Q/K/V, attention, wo,
# gate/up and down: its tasks started, its tasks done (this thread's share and what it took from the others), its
# serial step done (only the thread that ran the phase's last task has one); Q/K/V starts at 1.
QKV, QKV_DONE, QKV_SERIAL = 1, 2, 3
ATTEND, ATTEND_DONE, ATTEND_SERIAL = 4, 5, 6
WO, WO_DONE, WO_SERIAL = 7, 8, 9
GATE_UP, GATE_UP_DONE, GATE_UP_SERIAL = 10, 11, 12
DOWN, DOWN_DONE, DOWN_SERIAL = 13, 14, 15

# (phase, kind, from mark, to mark): what each stretch between two stamps was.
SEGMENTS = (
    ("wait", "wait", 0, QKV),
    ("qkv", "projection", QKV, QKV_DONE), ("rope", "serial", QKV_DONE, QKV_SERIAL),
    ("wait", "wait", QKV_SERIAL, ATTEND),
    ("attention", "attention", ATTEND, ATTEND_DONE), ("combine", "serial", ATTEND_DONE, ATTEND_SERIAL),
    ("wait", "wait", ATTEND_SERIAL, WO),
    ("wo", "projection", WO, WO_DONE), ("residual", "serial", WO_DONE, WO_SERIAL),
    ("wait", "wait", WO_SERIAL, GATE_UP),
    ("gate_up", "projection", GATE_UP, GATE_UP_DONE), ("act", "serial", GATE_UP_DONE, GATE_UP_SERIAL),
    ("wait", "wait", GATE_UP_SERIAL, DOWN),
    ("down", "projection", DOWN, DOWN_DONE), ("residual", "serial", DOWN_DONE, DOWN_SERIAL),
)


@njit(cache=True)
def _now() -> int:
    return atomics.cycles()


def cycles_per_second(seconds: float = 0.05) -> float:
    """The stamps' rate, against Python's clock over `seconds`."""
    _now()  # compiled (or loaded) before the clock starts
    t0, c0 = time.perf_counter(), _now()
    time.sleep(seconds)
    c1, t1 = _now(), time.perf_counter()
    return (c1 - c0) / (t1 - t0)


def seconds(marks: np.ndarray, rate: float) -> dict[str, float]:
    """Each phase's and each kind's seconds in one call, summed over the layers and averaged over the threads, from
    its stamps [layers, threads, MARKS] (a provider's `stack_marks` after the call). Raises ValueError on stamps
    out of order: a phase not stamped, or stamps of another call."""
    marks = np.asarray(marks, dtype=np.int64)
    if marks.ndim != 3 or marks.shape[2] != MARKS or marks.size == 0:
        raise ValueError(f"stamps of shape {marks.shape}, not [layers, threads, {MARKS}]")
    flat = marks.transpose(1, 0, 2).reshape(marks.shape[1], -1)  # each thread's stamps in the order it took them
    if (np.diff(flat, axis=1) < 0).any():
        raise ValueError("stamps out of order: a phase was not stamped, or the stamps are of different calls")
    threads = marks.shape[1]
    out: dict[str, float] = {}
    for phase, kind, a, b in SEGMENTS:
        s = float((marks[:, :, b] - marks[:, :, a]).sum()) / threads / rate
        out[phase] = out.get(phase, 0.0) + s
        if kind != phase:
            out[kind] = out.get(kind, 0.0) + s
    out["total"] = float((marks[-1, :, DOWN_SERIAL] - marks[0, :, 0]).sum()) / threads / rate
    return out
