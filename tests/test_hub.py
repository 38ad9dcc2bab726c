"""`pull`, `-m hf://`, `models` and `rm` against a loopback server that answers like the Hub.

The server implements what huggingface_hub 2.x asks of HF_ENDPOINT: `/api/models/{repo}[/revision/{rev}]`
(the file list) and `/{repo}/resolve/{rev}/{file}` (HEAD with ETag, X-Repo-Commit and Content-Length; GET
with Range for resume), and 404s with X-Error-Code as the Hub sends them. Every CLI run gets its own
HF_HOME, so nothing touches the user's cache, and nothing leaves the loopback interface.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import pty
import select
import socket
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from bitnet.errors import UsageError
from bitnet.modelfile import hub
from bitnet.modelfile.writer import PRESETS, write_model
from conftest import cli_env, run_cli

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub(http.server.ThreadingHTTPServer):
    """repos: {"owner/name": {"file": bytes}}; drop_once: files whose first full GET stops halfway."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.repos: dict[str, dict[str, bytes]] = {}
        self.drop_once: set[str] = set()
        self.log: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.auth: set[str | None] = set()  # every Authorization header seen

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: FakeHub

    def log_message(self, *args: object) -> None:  # keep pytest's output for failures
        pass

    def _error(self, code: str, status: int = 404) -> None:
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _route(self) -> tuple[str, str, str, str] | None:
        """(kind, repo, revision, file) of an API or resolve URL."""
        parts = unquote(urlsplit(self.path).path).strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) in (4, 6):
            rev = parts[5] if len(parts) == 6 and parts[4] == "revision" else "main"
            return "api", "/".join(parts[2:4]), rev, ""
        if len(parts) >= 5 and parts[2] == "resolve":
            return "resolve", "/".join(parts[:2]), parts[3], "/".join(parts[4:])
        return None

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        self.server.log.append((self.command, self.path, self.headers.get("Range")))
        self.server.auth.add(self.headers.get("Authorization"))
        route = self._route()
        if route is None:
            return self._error("RepoNotFound")
        kind, repo, rev, name = route
        files = self.server.repos.get(repo)
        if files is None:
            return self._error("RepoNotFound")
        if rev not in ("main", COMMIT):
            return self._error("RevisionNotFound")
        if kind == "api":
            data = json.dumps({"id": repo, "sha": COMMIT, "siblings": [{"rfilename": f} for f in files]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data if body else b"")
            return None
        if name not in files:
            return self._error("EntryNotFound")
        data = files[name]
        start = int(self.headers["Range"].removeprefix("bytes=").split("-")[0]) if self.headers.get("Range") else 0
        self.send_response(206 if start else 200)
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if not body:
            return None
        if start == 0 and name in self.server.drop_once:
            self.server.drop_once.discard(name)
            self.wfile.write(data[: len(data) // 2])
            self.connection.shutdown(socket.SHUT_RDWR)  # the transfer breaks: the client must resume
            self.close_connection = True
            return None
        self.wfile.write(data[start:])
        return None


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return write_model(tmp_path_factory.mktemp("model") / "tiny.gguf", PRESETS["tiny"]).read_bytes()


@pytest.fixture
def server(gguf: bytes):
    srv = FakeHub()
    srv.repos = {"test/tiny": {"tiny.gguf": gguf, "README.md": b"# tiny\n"},
                 "test/multi": {"a.gguf": gguf, "sub/b.gguf": gguf}}
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()  # this server only, then its socket
    srv.server_close()
    thread.join()


@pytest.fixture
def env(server: FakeHub, tmp_path: Path) -> dict[str, str]:
    drop = ("HF_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")
    base = {k: v for k, v in cli_env().items() if k not in drop}
    return base | {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": server.endpoint, "NO_PROXY": "127.0.0.1",
                   "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1",
                   "BITNET_CACHE_DIR": str(tmp_path / "bitnet")}


def one_error_line(r: subprocess.CompletedProcess, code: int, *fragments: str) -> str:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


def snapshot(env: dict[str, str], repo: str) -> Path:
    return Path(env["HF_HOME"], "hub", f"models--{repo.replace('/', '--')}", "snapshots", COMMIT)


def test_pull_downloads_into_the_hf_cache_and_run_takes_hf_uri(server, env, gguf):
    r = run_cli("pull", "test/tiny", env=env | {"HF_TOKEN": "hf_loopbacktoken"})
    assert r.returncode == 0, r.stderr
    assert server.auth == {"Bearer hf_loopbacktoken"}  # HF_TOKEN reaches every request
    path = Path(r.stdout.strip())
    assert path == snapshot(env, "test/tiny") / "tiny.gguf" and path.read_bytes() == gguf
    assert ("GET", "/test/tiny/resolve/main/README.md", None) not in server.log  # only the GGUF is fetched
    r = run_cli("--device", "cpu", "run", "-m", "hf://test/tiny", "-p", "Hello", "-n", "4", env=env)
    assert r.returncode == 0, r.stderr
    assert "eval time" in r.stderr
    gets = [p for m, p, _ in server.log if m == "GET" and "/resolve/" in p]
    assert len(gets) == 1  # run found the pulled copy: no second download


def test_an_interrupted_transfer_resumes_with_a_range_request(server, env, gguf):
    # huggingface_hub writes in 10 MiB chunks, so only a break past the first chunk leaves something to resume
    # from: 20 MiB of padding after the tensor data (a GGUF reader ignores it) and a break at half.
    big = gguf + bytes(20 << 20)
    server.repos["test/big"] = {"big.gguf": big}
    server.drop_once.add("big.gguf")
    r = run_cli("pull", "test/big", env=env)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).read_bytes() == big
    ranges = [rng for m, p, rng in server.log if m == "GET" and p.endswith("/big.gguf")]
    assert ranges[0] is None and len(ranges) == 2, ranges
    start = int(ranges[1].removeprefix("bytes=").rstrip("-"))  # the second GET asked only for what was missing
    assert 0 < start <= len(big) // 2


def test_a_missing_repo_file_or_revision_exits_2_with_one_line(server, env):
    one_error_line(run_cli("pull", "nobody/nothing", env=env), 2, "nobody/nothing", server.endpoint)
    one_error_line(run_cli("--device", "cpu", "run", "-m", "hf://nobody/nothing/x.gguf", "-p", "x", env=env), 2,
                   "nobody/nothing")
    one_error_line(run_cli("pull", "test/tiny", "--file", "nope.gguf", env=env), 2, "nope.gguf")
    one_error_line(run_cli("pull", "test/tiny", "--revision", "v9", env=env), 2, "v9")
    one_error_line(run_cli("pull", "test/nogguf", env=env), 2)  # unknown repo: the API's 404
    server.repos["test/nogguf"] = {"README.md": b"x"}
    one_error_line(run_cli("pull", "test/nogguf", env=env), 2, "no .gguf file")


def test_an_unreachable_endpoint_exits_2_naming_it(env):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    pulled = run_cli("pull", "test/tiny", env=env).stdout.strip()
    r = run_cli("pull", "test/tiny", env=env | {"HF_ENDPOINT": closed})  # cached: the network is not needed
    assert r.returncode == 0 and r.stdout.strip() == pulled, r.stderr
    env = env | {"HF_HOME": env["HF_HOME"] + "-empty"}
    one_error_line(run_cli("pull", "test/tiny", env=env | {"HF_ENDPOINT": closed}), 2, closed)
    # Fetching a named file, huggingface_hub retries for about 20 s first and says so on stderr: those
    # notices, then the one error line.
    r = run_cli("pull", "test/tiny", "--file", "tiny.gguf", env=env | {"HF_ENDPOINT": closed})
    notices, error = r.stderr.strip().splitlines()[:-1], r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and error.startswith("error: ") and closed in error, r.stderr
    assert all("Retry" in line or "thrown while requesting" in line for line in notices), notices


def test_offline_mode_uses_the_cache_and_says_when_it_cannot(server, env):
    offline = env | {"HF_HUB_OFFLINE": "1"}
    one_error_line(run_cli("pull", "test/tiny", env=offline), 2, "offline", "not in the cache")
    one_error_line(run_cli("pull", "test/tiny", "--file", "tiny.gguf", env=offline), 2, "offline")
    assert server.log == []  # offline means not one request
    pulled = run_cli("pull", "test/tiny", env=env).stdout.strip()
    server.log.clear()
    for args in (("pull", "test/tiny"), ("pull", "test/tiny", "--file", "tiny.gguf")):
        r = run_cli(*args, env=offline)
        assert r.returncode == 0 and r.stdout.strip() == pulled, r.stderr
    r = run_cli("--device", "cpu", "run", "-m", "hf://test/tiny/tiny.gguf", "-p", "x", "-n", "1", env=offline)
    assert r.returncode == 0, r.stderr
    assert server.log == []


@pytest.mark.parametrize("damage", ["not-gguf", "truncated"])
def test_a_corrupt_download_exits_4_and_leaves_no_cache_entry(server, env, gguf, damage):
    server.repos["test/bad"] = {"bad.gguf": b"<html>not a model</html>" if damage == "not-gguf"
                                else gguf[: len(gguf) // 3]}
    one_error_line(run_cli("pull", "test/bad", env=env), 4, "test/bad/bad.gguf", "removed it from the cache")
    assert not (snapshot(env, "test/bad") / "bad.gguf").exists()
    blobs = Path(env["HF_HOME"], "hub", "models--test--bad", "blobs")
    assert not blobs.exists() or not any(blobs.iterdir())
    assert "test/bad" not in run_cli("models", env=env).stdout
    # Offline, the bad file is not found in the cache either: it is gone, not merely hidden.
    one_error_line(run_cli("pull", "test/bad", "--file", "bad.gguf", env=env | {"HF_HUB_OFFLINE": "1"}), 2)


def test_several_ggufs_need_a_choice(server, env):
    line = one_error_line(run_cli("pull", "test/multi", env=env), 2, "a.gguf", "sub/b.gguf", "--file")
    assert "2 GGUF files" in line
    r = run_cli("pull", "test/multi", "--file", "sub/b.gguf", env=env)
    assert r.returncode == 0 and r.stdout.strip() == str(snapshot(env, "test/multi") / "sub" / "b.gguf"), r.stderr


def test_several_ggufs_on_a_terminal_ask_by_number(server, env):
    controller, terminal = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "bitnet", "pull", "test/multi"], stdin=terminal,
                            stdout=subprocess.PIPE, stderr=terminal, env=env, text=True)
    os.close(terminal)
    seen = b""
    while b"which one" not in seen:  # the prompt, or the test fails on the timeout rather than hanging
        ready, _, _ = select.select([controller], [], [], 60)
        assert ready, seen
        seen += os.read(controller, 1024)
    os.write(controller, b"2\n")
    out, _ = proc.communicate(timeout=60)
    os.close(controller)
    assert proc.returncode == 0
    assert b"  1  a.gguf" in seen and b"  2  sub/b.gguf" in seen
    assert out.strip().endswith("sub/b.gguf")


def test_models_lists_the_cache_and_rm_removes_from_it(server, env, gguf):
    assert run_cli("models", env=env).stdout == ""  # an empty (missing) cache is no error
    for f in ("a.gguf", "sub/b.gguf"):
        assert run_cli("pull", "test/multi", "--file", f, env=env).returncode == 0
    assert run_cli("pull", "test/tiny", env=env).returncode == 0
    rows = run_cli("models", env=env).stdout.splitlines()
    mib = f"{len(gguf) / 2**20:.1f} MiB"
    assert rows == [f"test/multi  a.gguf  {COMMIT[:12]} (main)  {mib}",
                    f"test/multi  sub/b.gguf  {COMMIT[:12]} (main)  {mib}",
                    f"test/tiny  tiny.gguf  {COMMIT[:12]} (main)  {mib}"]
    r = run_cli("rm", "test/multi/a.gguf", env=env)
    assert r.returncode == 0 and "removed 1 file" in r.stdout, r.stderr
    # a.gguf and b.gguf share one blob (same bytes): b.gguf must still be whole.
    assert (snapshot(env, "test/multi") / "sub" / "b.gguf").read_bytes() == gguf
    assert [row.split()[:2] for row in run_cli("models", env=env).stdout.splitlines()] == [
        ["test/multi", "sub/b.gguf"], ["test/tiny", "tiny.gguf"]]
    assert run_cli("rm", "test/multi", env=env).returncode == 0
    assert [row.split()[0] for row in run_cli("models", env=env).stdout.splitlines()] == ["test/tiny"]
    # test/tiny has the same commit hash and blob as test/multi: removing one repo must leave the other whole.
    assert Path(run_cli("pull", "test/tiny", env=env | {"HF_HUB_OFFLINE": "1"}).stdout.strip()).read_bytes() == gguf
    assert not Path(env["HF_HOME"], "hub", "models--test--multi").exists()
    one_error_line(run_cli("rm", "test/multi", env=env), 2, "not in the cache")
    one_error_line(run_cli("rm", "test/tiny@main", env=env), 2, "every revision")
    one_error_line(run_cli("rm", "test/tiny/other.gguf", env=env), 2, "not in the cache")


def test_hf_uris_parse_and_local_paths_pass_through():
    assert hub.parse("hf://o/n") == ("o/n", None, None)
    assert hub.parse("hf://o/n@v1/dir/f.gguf") == ("o/n", "dir/f.gguf", "v1")
    for bad in ("hf://o", "hf://o/", "hf:///n/f.gguf"):
        with pytest.raises(UsageError):
            hub.parse(bad)
    assert hub.resolve_model_path("models/m.gguf") == "models/m.gguf"
    assert hub.resolve_model_path(None) is None
