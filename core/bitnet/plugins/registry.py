"""Discovery: load plugins from the `bitnet.backends` entry points, isolating broken ones.

Hooks are called through pluggy (`pm.hook`), so a plugin's hookwrappers and `tryfirst`/`trylast`
take effect. A plugin that fails to import, whose hookimpls do not match the specs, whose hook
raises or returns garbage, or whose probe raises, is set aside with its distribution, version and
reason; the others keep working. BITNET_PLUGINS_STRICT=1 makes those failures errors.
BITNET_DISABLE_PLUGINS=name,... blocks plugins by entry-point or distribution name. A backend name
or alias claimed by two backends disables those backends only: a request for it names both claimants.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import pluggy

from bitnet.errors import PluginError
from bitnet.plugins import hookspecs
from bitnet.plugins.types import Backend, Device, ProbeResult

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
    clashes: list[str] = field(default_factory=list)  # backend names disabled because another plugin claims them

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


def _check_backends(result: Any) -> list[Backend]:
    backends = list(result or ())
    for b in backends:
        if not isinstance(b, Backend):
            raise TypeError(f"bitnet_backends returned {type(b).__name__}, not bitnet.Backend")
    return backends


class Registry:
    """The plugin manager plus every backend the loaded plugins declare."""

    def __init__(self, extra: list[tuple[str, object]] | None = None, use_entry_points: bool = True) -> None:
        self.pm = pluggy.PluginManager("bitnet")
        self.pm.add_hookspecs(hookspecs)
        self.strict = env_flag("BITNET_PLUGINS_STRICT")
        self.plugins: list[PluginInfo] = []
        self.entries: dict[str, BackendEntry] = {}
        self.clashes: dict[str, str] = {}  # name or alias -> why no backend answers to it
        self._info: dict[int, PluginInfo] = {}  # id(plugin object) -> its info
        disabled = set(env_list("BITNET_DISABLE_PLUGINS"))
        if use_entry_points:
            for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
                self._load_entry_point(ep, disabled)
        for name, obj in extra or []:
            info = PluginInfo(name, "<in-process>", "", repr(obj))
            self._add(info, lambda obj=obj: obj, disabled)
        self._collect_backends()

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
        self._info[id(plugin)] = info

    # -- hook calls ----------------------------------------------------------------------------
    def _impls(self, hook: str, wrappers: bool) -> list[Any]:
        return [i for i in getattr(self.pm.hook, hook).get_hookimpls() if bool(i.hookwrapper or i.wrapper) == wrappers]

    def _set_aside(self, plugin: object, reason: str) -> None:
        if self.pm.is_registered(plugin):
            self.pm.unregister(plugin)
        self._fail(self._info[id(plugin)], reason)

    def _call(self, hook: str, check: Any = None, **kwargs: Any) -> list[Any]:
        """`pm.hook.<hook>(**kwargs)`, each result passed through `check`. When the call raises, each
        implementation is run alone; those that raise are set aside, else the hook's wrappers are (they
        are all the rest of the call), and the call is retried without them."""
        while True:
            try:
                results = getattr(self.pm.hook, hook)(**kwargs)
                return [check(r) for r in results] if check else results
            except Exception as exc:
                culprits = []
                for impl in self._impls(hook, wrappers=False):
                    try:
                        result = impl.function(*[kwargs[a] for a in impl.argnames])
                        if check:
                            check(result)
                    except Exception as why:
                        culprits.append((impl.plugin, why))
                culprits = culprits or [(impl.plugin, exc) for impl in self._impls(hook, wrappers=True)]
                if not culprits:
                    raise
                for plugin, why in culprits:
                    self._set_aside(plugin, f"{hook} failed: {_describe(why)}")

    def _collect_backends(self) -> None:
        found = [b for group in self._call("bitnet_backends", check=_check_backends) for b in group]
        # Who declared what: each plugin's own answer (a backend only a hookwrapper adds is its wrapper's).
        # A second call makes new probe/open callables, so declarations are matched by what they say.
        def said(b: Backend) -> tuple[Any, ...]:
            return b.name.lower(), b.kind, b.priority, b.aliases, b.description

        owners = [(said(b), self._info[id(impl.plugin)]) for impl in self._impls("bitnet_backends", wrappers=False)
                  for b in _check_backends(impl.function())]
        wrappers = [self._info[id(impl.plugin)] for impl in self._impls("bitnet_backends", wrappers=True)]
        unknown = PluginInfo("<hookwrapper>", "<unknown>", "", "")
        claims: dict[str, list[tuple[Backend, PluginInfo]]] = defaultdict(list)
        for b in found:
            mine = next((i for i, (key, _) in enumerate(owners) if key == said(b)), None)
            info = owners.pop(mine)[1] if mine is not None else (wrappers or [unknown])[0]
            for key in {b.name.lower(), *(a.lower() for a in b.aliases)}:
                claims[key].append((b, info))
        for key, claimants in claims.items():
            if len(claimants) > 1:
                who = " and ".join(f"backend {b.name!r} of {info.label()}" for b, info in claimants)
                self.clashes[key] = (f"{key!r} is claimed by both {who}: uninstall one, or disable one with "
                                     f"BITNET_DISABLE_PLUGINS")
        # Only the clashing name goes: a backend whose alias clashes keeps its name and other aliases.
        for b in found:
            info = next(info for ob, info in claims[b.name.lower()] if ob is b)
            if b.name.lower() in self.clashes:
                info.clashes.append(b.name)
            else:
                self.entries[b.name.lower()] = BackendEntry(b, info)
                info.backends.append(b.name)

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

    def _owner_of(self, key: str) -> BackendEntry | None:
        for entry in self.entries.values():
            if key == entry.backend.name.lower() or key in (a.lower() for a in entry.backend.aliases):
                return entry
        return None

    def resolve(self, token: str) -> list[Backend]:
        """Backends a request token (no index) names: a name or alias, else what the plugins claim
        (in hook order: a `tryfirst` plugin's claims come first). A clashing name names none."""
        if token in self.clashes:
            return []
        owner = self._owner_of(token)
        if owner is not None:
            return [owner.backend]
        names: list[str] = []
        for claimed in self._call("bitnet_resolve_request", token=token, backends=self.backends()):
            names.extend(n.lower() for n in claimed or () if n.lower() not in names)
        return [self.entries[n].backend for n in names if n in self.entries]
