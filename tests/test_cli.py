"""bitnet-select end to end, discovering the installed plugins through their real entry points."""

from __future__ import annotations

import json

from conftest import cli_env, raised_in_c_call, run_cli


def test_summary_line_for_cpu():
    r = run_cli("--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("requested=cpu detected=[")
    assert r.stdout.strip().endswith("cpu] selected=cpu")


def test_summary_format_is_exact_with_bundled_plugins():
    r = run_cli(env=cli_env(BITNET_DISABLE_PLUGINS="opencl,example"))
    assert r.stdout == "requested=auto detected=[cpu] selected=cpu\n"


def test_unmet_request_exits_3_with_the_reason():
    r = run_cli("--device", "cuda", env=cli_env(BITNET_DISABLE_PLUGINS="example"))
    assert r.returncode == 3
    assert r.stdout.strip().endswith("selected=none")
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no backend satisfies --device cuda")
    assert "cuda: pycuda is not installed" in err[0]


def test_env_request_and_flag_precedence():
    env = cli_env(BITNET_DEVICE="cpu")
    assert run_cli(env=env).stdout.startswith("requested=cpu ")
    assert run_cli("--device", "auto", env=env).stdout.startswith("requested=auto ")


def test_fake_cuda_is_detected_and_selected_but_cannot_run():
    env = cli_env(BITNET_GPU_FAKE="cuda")
    r = run_cli("--device", "cuda", env=env)
    assert r.returncode == 0 and r.stdout.startswith("requested=cuda detected=[cuda,") and "selected=cuda" in r.stdout
    r = run_cli("--device", "cuda", "run", "--prompt", "hi", env=env)
    assert r.returncode == 3 and "fake device" in r.stderr and "Traceback" not in r.stderr


def test_strict_mode_ignores_fake_through_the_cli():
    r = run_cli("--device", "cuda", env=cli_env(BITNET_GPU_FAKE="cuda", BITNET_STRICT_MODE="1"))
    assert r.returncode == 3
    assert "detected=[cuda" not in r.stdout and "pycuda is not installed" in r.stderr


def test_malformed_request_is_a_usage_error():
    r = run_cli("--device", "cuda:x")
    assert r.returncode == 2 and r.stderr.startswith("error: invalid device request")


def test_devices_json_parses_and_lists_every_backend():
    r = run_cli("devices", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    by_backend = {row["backend"]: row for row in rows}
    assert {"cpu", "cuda"} <= set(by_backend)
    assert by_backend["cpu"]["available"] and by_backend["cpu"]["device"]["memory_bytes"] > 0
    assert not by_backend["cuda"]["available"] and "pycuda" in by_backend["cuda"]["reason"]
    ranks = [row["rank"] for row in rows if row["available"]]
    assert ranks == list(range(1, len(ranks) + 1)) and all(row["rank"] is None for row in rows if not row["available"])
    # The rank order is auto's: the cpu backend before any CPU-kind device of another backend (PoCL).
    assert rows[0]["backend"] == "cpu" and rows[0]["rank"] == 1


def test_auto_prefers_the_cpu_backend_to_an_opencl_cpu_device():
    r = run_cli()
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("requested=auto detected=[") and r.stdout.endswith(" selected=cpu\n")
    r = run_cli("--device", "gpu")
    assert r.returncode == 3 and "opencl: no GPU device (its devices are cpu)" in r.stderr


def test_devices_table():
    r = run_cli("devices")
    assert r.returncode == 0
    assert r.stdout.splitlines()[0].split()[:4] == ["RANK", "BACKEND", "IDX", "DEVICE"]
    assert r.stdout.splitlines()[1].split()[:2] == ["1", "cpu"]
    assert "unavailable: pycuda is not installed" in r.stdout


def test_plugins_json():
    r = run_cli("plugins", "--json")
    infos = {p["name"]: p for p in json.loads(r.stdout)}
    assert infos["cpu"]["distribution"] == "bitnet-cpu" and infos["cpu"]["status"] == "loaded"
    assert infos["cpu"]["backends"] == ["cpu"] and infos["cuda"]["backends"] == ["cuda"]


def test_disabled_plugin_is_listed_as_disabled():
    r = run_cli("plugins", "--json", env=cli_env(BITNET_DISABLE_PLUGINS="bitnet-cuda"))
    infos = {p["name"]: p for p in json.loads(r.stdout)}
    assert infos["cuda"]["status"] == "disabled"
    assert "cuda" not in run_cli("devices", env=cli_env(BITNET_DISABLE_PLUGINS="cuda")).stdout.split()


def test_version_and_help():
    r = run_cli("--version")
    assert r.returncode == 0 and "bitnet-select, version" in r.stdout
    for args in (["--help"], ["devices", "--help"], ["plugins", "--help"], ["run", "--help"]):
        r = run_cli(*args)
        assert r.returncode == 0 and "Usage:" in r.stdout
    assert "Exit codes" in run_cli("--help").stdout


def test_unknown_command_is_usage_error():
    assert run_cli("frobnicate").returncode == 2


def test_ctrl_c_inside_a_kernel_aborts_rather_than_reporting_an_internal_error():
    import click
    from click.testing import CliRunner

    from bitnet.cli import Group

    @click.group(cls=Group)
    def cli() -> None:
        pass

    @cli.command()
    @click.argument("cause")
    def fail(cause: str) -> None:
        if cause == "ctrl-c":  # inside numba's dispatch: a SystemError caused by a SystemError caused by the interrupt
            raise raised_in_c_call(raised_in_c_call(KeyboardInterrupt()))
        raise SystemError("a real bug")

    interrupted = CliRunner().invoke(cli, ["fail", "ctrl-c"], obj={})
    assert interrupted.exit_code == 1 and "Aborted!" in interrupted.output
    assert "internal error" not in interrupted.output
    bug = CliRunner().invoke(cli, ["fail", "bug"], obj={})
    assert bug.exit_code == 1 and "internal error: SystemError: a real bug" in bug.output
