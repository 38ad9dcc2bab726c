"""Selection and discovery against in-process plugins (entry points are covered in test_cli)."""

from __future__ import annotations

import types

import pytest

from bitnet import hookimpl
from bitnet.errors import NoBackendError, PluginError, UsageError
from bitnet.plugins.registry import Registry
from bitnet.plugins.selection import parse_request, select
from bitnet.plugins.types import Backend, Device, ProbeResult


def backend(name: str, kind: str, priority: int, n_devices: int = 1, aliases=(), reason="not here",
            raises: Exception | None = None) -> Backend:
    def probe() -> ProbeResult:
        if raises:
            raise raises
        if not n_devices:
            return ProbeResult.unavailable(reason)
        return ProbeResult(tuple(Device(name, i, f"{name} dev {i}") for i in range(n_devices)))

    return Backend(name, kind, priority, probe, lambda d: ("opened", d), aliases=tuple(aliases))


def plugin(*backends: Backend, resolve=None) -> object:
    ns = types.SimpleNamespace()

    @hookimpl
    def bitnet_backends():
        return list(backends)

    ns.bitnet_backends = bitnet_backends
    if resolve:
        @hookimpl
        def bitnet_resolve_request(token, backends):
            return resolve(token)

        ns.bitnet_resolve_request = bitnet_resolve_request
    return ns


def registry(*plugins: object) -> Registry:
    return Registry(extra=[(f"p{i}", p) for i, p in enumerate(plugins)], use_entry_points=False)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in ("BITNET_DEVICE", "BITNET_GPU_FAKE", "BITNET_STRICT_MODE", "BITNET_DISABLE_PLUGINS",
                "BITNET_PLUGINS_STRICT"):
        monkeypatch.delenv(var, raising=False)


def standard(cuda_devices=0, opencl_devices=1, cpu_devices=1) -> Registry:
    return registry(
        plugin(backend("cpu", "cpu", 10, cpu_devices)),
        plugin(backend("opencl", "gpu", 50, opencl_devices, aliases=("ocl",)),
               resolve=lambda t: ["opencl"] if t == "oneapi" else None),
        plugin(backend("cuda", "gpu", 100, cuda_devices, aliases=("nvidia",), reason="pycuda is not installed")),
    )


def test_auto_picks_highest_priority_detected():
    sel = select("auto", standard())
    assert sel.summary == "requested=auto detected=[opencl,cpu] selected=opencl"
    sel = select("auto", standard(cuda_devices=2))
    assert sel.summary == "requested=auto detected=[cuda,opencl,cpu] selected=cuda"


def test_priority_ties_are_broken_by_name():
    reg = registry(plugin(backend("zeta", "cpu", 10)), plugin(backend("alpha", "cpu", 10)))
    assert select("auto", reg).summary == "requested=auto detected=[alpha,zeta] selected=alpha"


def test_gpu_request():
    assert select("gpu", standard()).selected == "opencl"
    assert select("gpu", standard(cuda_devices=1)).selected == "cuda"
    sel = select("gpu", standard(opencl_devices=0))
    assert sel.backend is None and "cuda: pycuda is not installed" in sel.error


def test_gpu_skips_cpu_kind_devices_of_a_gpu_backend():
    def probe():
        return ProbeResult((Device("opencl", 0, "pocl", kind="cpu"),))

    reg = registry(plugin(Backend("opencl", "gpu", 50, probe, lambda d: d)), plugin(backend("cpu", "cpu", 10)))
    sel = select("gpu", reg)
    assert sel.backend is None and "no GPU device" in sel.error
    assert select("opencl", reg).selected == "opencl"


def test_names_aliases_and_plugin_claimed_tokens():
    reg = standard(cuda_devices=1)
    assert select("ocl", reg).selected == "opencl"
    assert select("NVIDIA", reg).selected == "cuda"
    assert select("oneapi", reg).selected == "opencl"


def test_explicit_request_never_falls_back():
    sel = select("cuda", standard())
    assert sel.backend is None
    assert sel.summary == "requested=cuda detected=[opencl,cpu] selected=none"
    assert "cuda: pycuda is not installed" in sel.error
    with pytest.raises(NoBackendError, match="pycuda is not installed"):
        sel.require()


def test_device_index():
    reg = standard(cuda_devices=2)
    sel = select("cuda:1", reg)
    assert sel.selected == "cuda:1" and sel.device.index == 1
    sel = select("cuda:2", reg)
    assert sel.backend is None and "has 2 device(s)" in sel.error


def test_ordered_list_takes_first_available():
    assert select("cuda,opencl,cpu", standard()).selected == "opencl"
    assert select("cuda,cpu", standard(opencl_devices=0)).selected == "cpu"
    assert select("cuda,cuda:0", standard()).backend is None


def test_unknown_name_lists_installed():
    sel = select("metal", standard())
    assert sel.backend is None and "metal: no installed backend" in sel.error and "cuda, opencl, cpu" in sel.error


@pytest.mark.parametrize("bad", ["", "cuda:", "cuda:x", ",cpu", "cpu:-1"])
def test_malformed_requests_are_usage_errors(bad):
    with pytest.raises(UsageError):
        select(bad, standard())


def test_parse_request():
    assert parse_request("cuda:1,opencl,cpu") == [("cuda", 1), ("opencl", None), ("cpu", None)]


def test_env_request(monkeypatch):
    monkeypatch.setenv("BITNET_DEVICE", "cpu")
    assert select(None, standard()).summary == "requested=cpu detected=[opencl,cpu] selected=cpu"
    assert select("opencl", standard()).selected == "opencl"  # the flag beats the environment


def test_fake_gpu(monkeypatch):
    monkeypatch.setenv("BITNET_GPU_FAKE", "cuda")
    sel = select("auto", standard())
    assert sel.summary == "requested=auto detected=[cuda,opencl,cpu] selected=cuda"
    assert sel.device.fake
    with pytest.raises(NoBackendError, match="fake device"):
        sel.open()


def test_strict_mode_ignores_the_fake(monkeypatch):
    monkeypatch.setenv("BITNET_GPU_FAKE", "cuda")
    monkeypatch.setenv("BITNET_STRICT_MODE", "1")
    sel = select("cuda", standard())
    # Expected values written out, not computed by the code under test.
    assert sel.summary == "requested=cuda detected=[opencl,cpu] selected=none"
    assert "pycuda is not installed" in sel.error
    assert select("auto", standard()).selected == "opencl"


def test_probe_that_raises_is_isolated():
    reg = registry(plugin(backend("cpu", "cpu", 10)), plugin(backend("bad", "gpu", 60, raises=RuntimeError("boom"))))
    sel = select("auto", reg)
    assert sel.summary == "requested=auto detected=[cpu] selected=cpu"
    assert "probe raised RuntimeError: boom" in reg.probe("bad").reason


def test_probe_that_raises_is_an_error_in_plugin_strict_mode(monkeypatch):
    monkeypatch.setenv("BITNET_PLUGINS_STRICT", "1")
    reg = registry(plugin(backend("bad", "gpu", 60, raises=RuntimeError("boom"))))
    with pytest.raises(PluginError, match="boom"):
        select("auto", reg)


def test_a_clashing_name_disables_only_that_name():
    reg = registry(plugin(backend("cpu", "cpu", 10), backend("extra", "cpu", 5)), plugin(backend("cpu", "cpu", 20)),
                   plugin(backend("opencl", "gpu", 50)))
    assert [b.name for b in reg.backends()] == ["opencl", "extra"]
    sel = select("cpu", reg)
    assert sel.backend is None
    assert "'cpu' is claimed by both backend 'cpu' of <in-process>" in sel.error
    assert "(entry point 'p0')" in sel.error and "(entry point 'p1')" in sel.error
    assert select("extra", reg).selected == "extra" and select("auto", reg).selected == "opencl"
    assert reg.plugins[0].clashes == ["cpu"] and reg.plugins[1].clashes == ["cpu"] and reg.plugins[2].clashes == []
    assert reg.plugins[0].backends == ["extra"] and reg.plugins[0].status == "loaded"


def test_an_alias_clash_disables_only_that_name():
    reg = registry(plugin(backend("opencl", "gpu", 50, aliases=("ocl", "cl"))), plugin(backend("ocl", "gpu", 40)),
                   plugin(backend("cpu", "cpu", 10)))
    assert [b.name for b in reg.backends()] == ["opencl", "cpu"]
    assert "'ocl' is claimed by both" in select("ocl", reg).error
    assert select("opencl", reg).selected == "opencl" and select("cl", reg).selected == "opencl"
    assert reg.plugins[1].clashes == ["ocl"] and reg.plugins[0].clashes == []


def test_auto_ranks_gpus_then_the_cpu_backend_then_cpu_kind_devices_of_other_backends():
    def ocl(*kinds):
        return lambda: ProbeResult(tuple(Device("opencl", i, f"dev {i}", kind=k) for i, k in enumerate(kinds)))

    cpu = plugin(backend("cpu", "cpu", 10))
    pocl_only = registry(plugin(Backend("opencl", "gpu", 50, ocl("cpu"), lambda d: d)), cpu)
    # Written out, not computed: the summary lists detected backends by priority, selection by rank.
    assert select("auto", pocl_only).summary == "requested=auto detected=[opencl,cpu] selected=cpu"
    assert select("opencl", pocl_only).selected == "opencl"  # asked for by name: still usable
    mixed = registry(plugin(Backend("opencl", "gpu", 50, ocl("cpu", "gpu"), lambda d: d)), cpu)
    sel = select("auto", mixed)
    assert (sel.selected, sel.device.index) == ("opencl", 1)
    assert select("opencl", mixed).device.index == 1  # a backend's GPU before its CPU-kind device
    assert select("opencl:0", mixed).device.index == 0
    no_cpu = registry(plugin(Backend("opencl", "gpu", 50, ocl("cpu"), lambda d: d)))
    assert select("auto", no_cpu).selected == "opencl"  # last in rank, but still a device
    assert select("gpu", no_cpu).backend is None


def test_ranked_lists_every_detected_device_in_auto_order():
    from bitnet.plugins.selection import ranked

    def ocl():
        return ProbeResult((Device("opencl", 0, "pocl", kind="cpu"), Device("opencl", 1, "arc", kind="gpu")))

    reg = registry(plugin(Backend("opencl", "gpu", 50, ocl, lambda d: d)), plugin(backend("cpu", "cpu", 10)),
                   plugin(backend("npu", "npu", 30)), plugin(backend("cuda", "gpu", 100, 0)))
    assert [(b.name, d.index) for b, d in ranked(reg)] == [("opencl", 1), ("npu", 0), ("cpu", 0), ("opencl", 0)]


def test_hooks_go_through_pluggy_so_wrappers_and_tryfirst_apply():
    first = types.SimpleNamespace()

    @hookimpl(tryfirst=True)
    def bitnet_resolve_request(token, backends):
        return ["cpu"] if token == "fast" else None

    first.bitnet_resolve_request = bitnet_resolve_request
    wrapper = types.SimpleNamespace()

    @hookimpl(wrapper=True)
    def bitnet_backends():
        found = yield
        return [[b for b in group if b.name != "hidden"] for group in found]

    wrapper.bitnet_backends = bitnet_backends
    # `first` registers before the other resolver: pluggy's default (last registered first) would put
    # opencl first, tryfirst puts cpu first.
    reg = registry(first, plugin(backend("cpu", "cpu", 10), backend("hidden", "cpu", 5)),
                   plugin(backend("opencl", "gpu", 50), resolve=lambda t: ["opencl"] if t == "fast" else None),
                   wrapper)
    assert [b.name for b in reg.backends()] == ["opencl", "cpu"]
    assert [b.name for b in reg.resolve("fast")] == ["cpu", "opencl"]
    assert select("fast", reg).selected == "cpu"


def test_a_raising_hook_sets_aside_only_its_plugin():
    bad = types.SimpleNamespace()

    @hookimpl
    def bitnet_backends():
        raise RuntimeError("boom")

    bad.bitnet_backends = bitnet_backends
    bad_resolve = types.SimpleNamespace()

    @hookimpl
    def bitnet_resolve_request(token, backends):
        raise ValueError("no")

    bad_resolve.bitnet_resolve_request = bitnet_resolve_request
    reg = registry(plugin(backend("cpu", "cpu", 10), resolve=lambda t: ["cpu"] if t == "host2" else None),
                   bad, bad_resolve)
    assert [b.name for b in reg.backends()] == ["cpu"]
    assert reg.plugins[1].status == "failed" and "bitnet_backends failed: RuntimeError: boom" in reg.plugins[1].error
    assert select("host2", reg).selected == "cpu"
    assert reg.plugins[2].status == "failed" and "ValueError: no" in reg.plugins[2].error


def test_a_raising_hook_is_an_error_in_plugin_strict_mode(monkeypatch):
    monkeypatch.setenv("BITNET_PLUGINS_STRICT", "1")
    bad = types.SimpleNamespace()

    @hookimpl
    def bitnet_backends():
        raise RuntimeError("boom")

    bad.bitnet_backends = bitnet_backends
    with pytest.raises(PluginError, match="boom"):
        registry(plugin(backend("cpu", "cpu", 10)), bad)


def test_bad_hookimpl_is_isolated():
    bad = types.SimpleNamespace()

    @hookimpl
    def bitnet_backends(unexpected_argument):
        return []

    bad.bitnet_backends = bitnet_backends
    reg = registry(plugin(backend("cpu", "cpu", 10)), bad)
    assert [b.name for b in reg.backends()] == ["cpu"]
    assert reg.plugins[1].status == "failed" and "invalid hook implementation" in reg.plugins[1].error


def test_unknown_hook_is_isolated():
    bad = types.SimpleNamespace()

    @hookimpl
    def bitnet_no_such_hook():
        return []

    bad.bitnet_no_such_hook = bitnet_no_such_hook
    reg = registry(bad, plugin(backend("cpu", "cpu", 10)))
    assert reg.plugins[0].status == "failed" and "bitnet_no_such_hook" in reg.plugins[0].error
    assert select("cpu", reg).selected == "cpu"


def test_backends_hook_returning_garbage_is_isolated():
    bad = types.SimpleNamespace()

    @hookimpl
    def bitnet_backends():
        return ["not a backend"]

    bad.bitnet_backends = bitnet_backends
    reg = registry(bad)
    assert reg.plugins[0].status == "failed" and "not bitnet.Backend" in reg.plugins[0].error


def test_disable_plugins(monkeypatch):
    monkeypatch.setenv("BITNET_DISABLE_PLUGINS", "p1")
    reg = standard(cuda_devices=1)
    assert [b.name for b in reg.backends()] == ["cuda", "cpu"]
    assert reg.plugins[1].status == "disabled"
