"""pytest tests of the backend contract; a conftest provides the `backend_name` fixture."""

from __future__ import annotations

import pytest

from bitnet.plugins.registry import Registry
from bitnet.testing import check_probe, check_provider, check_selection


@pytest.fixture
def bitnet_registry() -> Registry:
    return Registry()


def test_backend_is_discovered(backend_name: str, bitnet_registry: Registry) -> None:
    assert backend_name in bitnet_registry.entries, (
        f"backend {backend_name!r} not found; plugins: {[p.to_json() for p in bitnet_registry.plugins]}")


def test_probe_contract(backend_name: str, bitnet_registry: Registry) -> None:
    check_probe(bitnet_registry.entries[backend_name].backend)


def test_selection_by_name_alias_and_index(backend_name: str, bitnet_registry: Registry) -> None:
    check_selection(backend_name, bitnet_registry)


def test_kernels_match_the_reference(backend_name: str, bitnet_registry: Registry) -> None:
    """Native operations against the reference; fallback operations run, and are counted, on the host."""
    backend = bitnet_registry.entries[backend_name].backend
    probe = bitnet_registry.probe(backend_name)
    if not probe.devices:
        pytest.skip(f"{backend_name}: {probe.reason}")
    provider = backend.open(probe.devices[0])
    try:
        support = check_provider(provider)
    finally:
        provider.close()
    print(f"{backend_name}: " + ", ".join(f"{op} {where}" for op, where in support.items()))  # pytest -rP
    counted = {op for op, _ in provider.fallbacks}
    uncounted = [op for op, where in support.items() if where == "fallback" and op not in counted]
    assert not uncounted, f"fallback operations that ran but were not counted: {uncounted}"
