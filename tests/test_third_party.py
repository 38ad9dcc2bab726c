"""Third-party plugins seen through real packaging metadata, never monkeypatched."""

from __future__ import annotations

import json
import site
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from bitnet.runtime.provider import OPERATIONS
from conftest import ROOT, cli_env, run_cli


@pytest.fixture(scope="module")
def example_venv(tmp_path_factory) -> Path:
    """A virtual environment with bitnet-example installed by pip, on top of this environment."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    query = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = subprocess.run([str(venv / "bin/python"), "-c", query],
                             capture_output=True, text=True, check=True).stdout.strip()
    # Reuse this environment's packages (bitnet-core and its dependencies) without reinstalling them.
    parents = [p for p in site.getsitepackages() + [site.getusersitepackages()] if Path(p).is_dir()]
    (Path(purelib) / "_parent_env.pth").write_text(
        "".join(f"import site; site.addsitedir({p!r})\n" for p in parents))
    r = subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "-q", "--no-deps",
                        str(ROOT / "examples/bitnet-example")], capture_output=True, text=True)
    assert r.returncode == 0, f"pip could not install the example plugin: {r.stderr}"
    return venv


def test_example_plugin_is_discovered_selected_and_listed(example_venv):
    py = str(example_venv / "bin/python")
    env = cli_env(BITNET_DISABLE_PLUGINS="opencl")
    r = run_cli("--device", "example", python=py, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "requested=example detected=[cpu,example] selected=example\n"
    assert run_cli("--device", "ex", python=py, env=env).stdout.endswith("selected=example\n")
    plugins = {p["name"]: p for p in json.loads(run_cli("plugins", "--json", python=py, env=env).stdout)}
    assert plugins["example"]["distribution"] == "bitnet-example"
    assert plugins["example"]["version"] == "0.3.0" and plugins["example"]["backends"] == ["example"]
    devices = json.loads(run_cli("devices", "--json", python=py, env=env).stdout)
    assert any(d["backend"] == "example" and d["available"] for d in devices)
    # The plain environment does not have it: discovery really reads installed metadata.
    assert "example" not in json.dumps(json.loads(run_cli("plugins", "--json", env=env).stdout))


def reference_run(prompt: str, max_tokens: int) -> tuple[str, Counter[str]]:
    """The greedy text of the default model on core's reference provider, and its dispatch counts."""
    import bitnet
    from bitnet.runtime.engine import Engine
    from bitnet.runtime.reference import ReferenceProvider
    from bitnet.runtime.transformer import Transformer

    with bitnet.load(device="cpu") as cpu:
        ref = ReferenceProvider()
        tr = Transformer(cpu.model, ref, cpu.n_ctx, "row", lm_head=cpu.transformer.lm_head_format)  # the CLI's head
        engine = Engine(cpu.selection, ref, cpu.model, cpu.tokenizer, tr)
        return "".join(engine.generate(prompt, max_tokens=max_tokens)), ref.dispatches


def test_bitlinear_only_plugin_runs_a_model_and_its_receipt_counts_each_fallback(example_venv, tmp_path, cpu_env):
    py, env, path = str(example_venv / "bin/python"), cli_env(BITNET_DISABLE_PLUGINS="opencl"), tmp_path / "r.json"
    prompt, n = "The quick brown fox", 8
    r = run_cli("--device", "example", "run", "-p", prompt, "-n", str(n), "--receipt", str(path), python=py, env=env)
    assert r.returncode == 0, r.stderr
    text, ref_calls = reference_run(prompt, n)
    assert r.stdout == text + "\n"  # the same tokens as the reference provider
    receipt = json.loads(path.read_text())
    assert receipt["selection"]["backend"] == "example"
    # One call of the plugin's kernel per reference bitlinear; every other call a counted fallback.
    assert receipt["kernels"] == [{"name": "example.bitlinear", "count": ref_calls["ref.bitlinear"]}]
    fallbacks = {f["operation"]: (f["count"], f["reason"]) for f in receipt["fallbacks"]}
    assert fallbacks == {op: (ref_calls[f"ref.{op}"], "not implemented by backend 'example'")
                         for op in OPERATIONS if op != "bitlinear" and ref_calls[f"ref.{op}"]}
    total = sum(count for count, _ in fallbacks.values())
    r = run_cli("receipt", "verify", str(path), "--max-fallbacks", str(total - 1), env=env)
    assert r.returncode == 5 and f"max-fallbacks: {total} CPU fallback(s)" in r.stdout + r.stderr
    assert run_cli("receipt", "verify", str(path), "--max-fallbacks", str(total), env=env).returncode == 0


def test_bitlinear_only_plugin_fails_in_strict_mode_naming_operation_and_backend(example_venv, tmp_path, cpu_env):
    py, path = str(example_venv / "bin/python"), tmp_path / "r.json"
    env = cli_env(BITNET_DISABLE_PLUGINS="opencl", BITNET_STRICT_MODE="1")
    r = run_cli("--device", "example", "run", "-p", "hi", "-n", "2", "--receipt", str(path), python=py, env=env)
    assert r.returncode == 3 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "backend 'example'" in lines[0] and "rmsnorm" in lines[0], r.stderr
    assert not path.exists()


def fake_distribution(root: Path, dist: str, version: str, module: str, code: str) -> dict[str, str]:
    """A dist-info with a real entry_points.txt on a PYTHONPATH entry, as pip would leave it."""
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[bitnet.backends]\n{module} = {module}\n")
    (root / f"{module}.py").write_text(textwrap.dedent(code))
    return cli_env(PYTHONPATH=str(root), BITNET_DISABLE_PLUGINS="opencl")


def test_plugin_that_fails_to_import_is_isolated_and_reported(tmp_path):
    env = fake_distribution(tmp_path, "bitnet-broken", "1.2.3", "broken_backend",
                            "raise ImportError('needs libfoo.so')\n")
    r = run_cli("plugins", "--json", env=env)
    infos = {p["name"]: p for p in json.loads(r.stdout)}
    broken = infos["broken_backend"]
    assert (broken["distribution"], broken["version"], broken["status"]) == ("bitnet-broken", "1.2.3", "failed")
    assert "needs libfoo.so" in broken["error"]
    assert run_cli("--device", "cpu", env=env).stdout.endswith("selected=cpu\n")
    strict = dict(env, BITNET_PLUGINS_STRICT="1")
    r = run_cli("--device", "cpu", env=strict)
    assert r.returncode == 1 and "bitnet-broken 1.2.3" in r.stderr and "Traceback" not in r.stderr


def test_two_distributions_claiming_one_name_disable_only_that_name(tmp_path):
    code = """
        import bitnet
        from bitnet import Backend, ProbeResult, Device

        @bitnet.hookimpl
        def bitnet_backends():
            return [Backend("twin", "cpu", 7, lambda: ProbeResult((Device("twin", 0, "{who}"),)), lambda d: None),
                    Backend("{who}", "cpu", 6, lambda: ProbeResult((Device("{who}", 0, "{who}"),)), lambda d: None)]
        """
    fake_distribution(tmp_path, "bitnet-twin-a", "1.0", "twin_a", code.format(who="solo_a"))
    env = fake_distribution(tmp_path, "bitnet-twin-b", "2.0", "twin_b", code.format(who="solo_b"))
    r = run_cli("--device", "twin", env=env)
    assert r.returncode == 3, r.stderr
    assert "'twin' is claimed by both" in r.stderr
    assert "bitnet-twin-a 1.0" in r.stderr and "bitnet-twin-b 2.0" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    # Every other backend, the two plugins' own included, keeps working.
    for request in ("cpu", "solo_a", "solo_b"):
        r = run_cli("--device", request, env=env)
        assert r.returncode == 0 and r.stdout.endswith(f"selected={request}\n"), r.stderr
    infos = {p["name"]: p for p in json.loads(run_cli("plugins", "--json", env=env).stdout)}
    assert infos["twin_a"]["clashes"] == ["twin"] and infos["twin_a"]["backends"] == ["solo_a"]
    assert infos["twin_b"]["clashes"] == ["twin"] and infos["cpu"]["clashes"] == []
    assert "disabled (name claimed by another plugin too): twin" in run_cli("plugins", env=env).stdout


def test_probe_raising_in_a_real_plugin_is_isolated(tmp_path):
    env = fake_distribution(tmp_path, "bitnet-flaky", "0.3", "flaky", """
        import bitnet
        from bitnet.plugins.types import Backend

        def probe():
            raise OSError("driver exploded")

        @bitnet.hookimpl
        def bitnet_backends():
            return [Backend("flaky", "gpu", 500, probe, lambda d: None)]
        """)
    r = run_cli("devices", "--json", env=env)
    rows = {row["backend"]: row for row in json.loads(r.stdout)}
    assert "driver exploded" in rows["flaky"]["reason"] and "bitnet-flaky 0.3" in rows["flaky"]["reason"]
    assert run_cli(env=env).stdout.endswith("selected=cpu\n")
