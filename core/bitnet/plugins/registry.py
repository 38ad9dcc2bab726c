"""Discovery: load plugins from the `bitnet.backends` entry points, isolating broken ones.

A plugin that fails to import, whose hookimpls do not match the specs, whose
`bitnet_backends` raises, or whose probe raises, is set aside with its distribution,
version and reason; the others keep working. BITNET_PLUGINS_STRICT=1 makes those failures
errors. BITNET_DISABLE_PLUGINS=name,... blocks plugins by entry-point or distribution name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import pluggy

from bitnet.plugins import hookspecs
from bitnet.plugins.types import Backend, Device, ProbeResult
from bitnet.errors import PluginError

GROUP = "bitnet.backends"


def env_list(name: str) -> list[str]:
    return [part.strip().lower() for part in os.environ.get(name, "").split(",") if part.strip()]


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass
class PluginInfo:
    """One discovered plugin and what became of it."""

    name: str
    distribution: str
    version: str
    value: str
    status: str = "loaded"  # loaded | failed | disabled
    error: str | None = None
    backends: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def label(self) -> str:
        return f"{self.distribution} {self.version} (entry point {self.name!r})"


@dataclass
class BackendEntry:
    backend: Backend
    plugin: PluginInfo
    _probe: ProbeResult | None = None


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class Registry:
    """The plugin manager plus every backend the loaded plugins declare."""

    def __init__(self, extra: list[tuple[str, object]] | None = None, use_entry_points: bool = True) -> None:
        self.pm = pluggy.PluginManager("bitnet")
        self.pm.add_hookspecs(hookspecs)
        self.strict = env_flag("BITNET_PLUGINS_STRICT")
        self.plugins: list[PluginInfo] = []
        self.entries: dict[str, BackendEntry] = {}
        disabled = set(env_list("BITNET_DISABLE_PLUGINS"))
        if use_entry_points:
            for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
                self._load_entry_point(ep, disabled)
        for name, obj in extra or []:
            info = PluginInfo(name, "<in-process>", "", repr(obj))
            self._add(info, lambda obj=obj: obj, disabled)

    def _load_entry_point(self, ep: EntryPoint, disabled: set[str]) -> None:
        dist = ep.dist
        info = PluginInfo(ep.name, dist.name if dist else "<unknown>", dist.version if dist else "", ep.value)
        self._add(info, ep.load, disabled)

    def _fail(self, info: PluginInfo, reason: str) -> None:
        info.status, info.error = "failed", reason
        if self.strict:
            raise PluginError(f"plugin {info.label()} failed: {reason} (BITNET_PLUGINS_STRICT=1)")

    def _add(self, info: PluginInfo, load: Any, disabled: set[str]) -> None:
        self.plugins.append(info)
        if info.name.lower() in disabled or info.distribution.lower() in disabled:
            info.status = "disabled"
            return
        try:
            plugin = load()
        except Exception as exc:  # a broken plugin must not take the others down
            return self._fail(info, f"import failed: {_describe(exc)}")
        try:
            self.pm.register(plugin, name=info.name)
            self.pm.check_pending()
        except Exception as exc:
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            return self._fail(info, f"invalid hook implementation: {_describe(exc)}")
        self._collect_backends(info, plugin)

    def _collect_backends(self, info: PluginInfo, plugin: object) -> None:
        impls = [i for i in self.pm.hook.bitnet_backends.get_hookimpls() if i.plugin is plugin]
        try:
            backends = [b for impl in impls for b in impl.function()]
            for b in backends:
                if not isinstance(b, Backend):
                    raise TypeError(f"bitnet_backends returned {type(b).__name__}, not bitnet.Backend")
        except Exception as exc:
            self.pm.unregister(plugin)
            return self._fail(info, f"bitnet_backends failed: {_describe(exc)}")
        for b in backends:
            for key in (b.name, *b.aliases):
                owner = self._owner_of(key.lower())
                if owner is not None:
                    raise PluginError(
                        f"backend name {key!r} is claimed by both {owner.plugin.label()} and {info.label()}")
            self.entries[b.name.lower()] = BackendEntry(b, info)
            info.backends.append(b.name)

    def _owner_of(self, key: str) -> BackendEntry | None:
        for entry in self.entries.values():
            if key == entry.backend.name.lower() or key in (a.lower() for a in entry.backend.aliases):
                return entry
        return None

    # -- queries -------------------------------------------------------------------------
    def backends(self) -> list[Backend]:
        """Every installed backend in priority order (ties by name)."""
        return sorted((e.backend for e in self.entries.values()), key=Backend.sort_key)

    def probe(self, name: str) -> ProbeResult:
        """The probe of one backend, once per registry; fakes applied, exceptions isolated."""
        entry = self.entries[name.lower()]
        if entry._probe is None:
            entry._probe = self._run_probe(entry)
        return entry._probe

    def _run_probe(self, entry: BackendEntry) -> ProbeResult:
        b = entry.backend
        if b.name.lower() in env_list("BITNET_GPU_FAKE") and not env_flag("BITNET_STRICT_MODE"):
            return ProbeResult((Device(b.name, 0, f"fake {b.name} device (BITNET_GPU_FAKE)", fake=True),))
        try:
            result = b.probe()
            if not isinstance(result, ProbeResult):
                raise TypeError(f"probe returned {type(result).__name__}, not bitnet.ProbeResult")
        except Exception as exc:
            if self.strict:
                raise PluginError(f"probe of backend {b.name!r} from {entry.plugin.label()} raised "
                                  f"{_describe(exc)}") from exc
            return ProbeResult.unavailable(f"probe raised {_describe(exc)} ({entry.plugin.label()})")
        if not result.devices and not result.reason:
            return ProbeResult.unavailable("probe found no device")
        return result

    def detected(self) -> list[Backend]:
        """Backends whose probe found a device, in priority order."""
        return [b for b in self.backends() if self.probe(b.name).available]

    def resolve(self, token: str) -> list[Backend]:
        """Backends a request token (no index) names: a name or alias, else what a plugin claims."""
        owner = self._owner_of(token)
        if owner is not None:
            return [owner.backend]
        names: list[str] = []
        for impl in self.pm.hook.bitnet_resolve_request.get_hookimpls():
            try:
                claimed = impl.function(token=token, backends=self.backends())
            except Exception as exc:
                if self.strict:
                    raise PluginError(
                        f"bitnet_resolve_request of {impl.plugin_name!r} raised {_describe(exc)}") from exc
                continue
            names.extend(n.lower() for n in claimed or () if n.lower() not in names)
        return [self.entries[n].backend for n in names if n in self.entries]
