"""stack_phases.seconds: a region's cycle stamps as seconds per phase, and stamps it must refuse."""

from __future__ import annotations

import numpy as np
import pytest

from bitnet_cpu import stack_phases as ph


def stamps(layers: int = 2, threads: int = 2) -> np.ndarray:
    """Every stretch between two stamps 10 cycles long, and 10 more between one layer's last stamp and the next's
    first."""
    k = np.arange(ph.MARKS)
    return np.stack([np.stack([1000 + 10 * (k + (ph.MARKS) * layer) for _ in range(threads)])
                     for layer in range(layers)]).astype(np.int64)


def test_each_phase_and_kind_is_its_stretches_summed_over_layers_and_averaged_over_threads() -> None:
    s = ph.seconds(stamps(), 10.0)  # 10 cycles a second: each stretch is 1 s, twice (two layers)
    assert {k: s[k] for k in ("qkv", "attention", "wo", "gate_up", "down")} == dict.fromkeys(
        ("qkv", "attention", "wo", "gate_up", "down"), 2.0)
    assert (s["projection"], s["serial"], s["wait"]) == (8.0, 10.0, 10.0)  # 4, 5 and 5 stretches a layer
    assert (s["rope"], s["combine"], s["act"], s["residual"]) == (2.0, 2.0, 2.0, 4.0)
    assert s["total"] == 31.0  # first stamp to last: both layers' 15 stretches and the step between them


def test_threads_are_averaged_not_added() -> None:
    m = stamps(threads=2)
    m[:, 1] += (m[:, 1] - m[0, 1, 0])  # the second thread twice as slow in every stretch
    assert ph.seconds(m, 10.0)["qkv"] == pytest.approx((2.0 + 4.0) / 2)


@pytest.mark.parametrize("broken", ["swapped", "missing", "shape", "empty"])
def test_stamps_out_of_order_or_of_another_shape_are_refused(broken: str) -> None:
    m = stamps()
    if broken == "swapped":
        m[1, 0, ph.WO], m[1, 0, ph.WO_DONE] = m[1, 0, ph.WO_DONE], m[1, 0, ph.WO]
    elif broken == "missing":
        m[0, 1, ph.ATTEND] = 0  # a stamp the region never took
    elif broken == "shape":
        m = m[:, :, :-1]
    else:
        m = m[:0]
    with pytest.raises(ValueError, match="stamps"):
        ph.seconds(m, 10.0)
