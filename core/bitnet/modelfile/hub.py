"""Models from the Hugging Face Hub: `-m hf://OWNER/NAME[@REVISION][/FILE]`, `pull`, `models`, `rm`.

Every transfer goes through huggingface_hub, so its cache ($HF_HOME/hub), resumable downloads,
progress bars, HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE=1 behave exactly as in every other HF tool.
This module only picks the GGUF, checks what arrived, and turns the library's exceptions into one
line with the CLI's exit codes (docs/design.md section 3): 2 for a missing repo/file/revision, the
network or offline mode; 4 for a download that is not a valid GGUF (removed from the cache first).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import click

from bitnet.errors import ModelError, UsageError

SCHEME = "hf://"


@dataclass(frozen=True)
class CachedModel:
    repo: str
    file: str  # path inside the repository
    revision: str  # commit hash
    refs: tuple[str, ...]  # branch or tag names that point at the commit ("main")
    size: int  # bytes on disk
    path: str


def parse(uri: str) -> tuple[str, str | None, str | None]:
    """hf://OWNER/NAME[@REVISION][/FILE] -> (repo, file, revision); the @ form is HfFileSystem's."""
    parts = uri.removeprefix(SCHEME).split("/")
    if len(parts) < 2 or not all(parts):
        raise UsageError(f"{uri}: expected hf://OWNER/NAME[@REVISION][/FILE]")
    name, _, revision = parts[1].partition("@")
    return f"{parts[0]}/{name}", "/".join(parts[2:]) or None, revision or None


def resolve_model_path(path: str | os.PathLike[str] | None) -> str | os.PathLike[str] | None:
    """A local path for `path`: hf:// URIs are downloaded (or found in the cache), anything else is returned as is."""
    if not isinstance(path, str) or not path.startswith(SCHEME):
        return path
    repo, file, revision = parse(path)
    return pull(repo, file, revision)


def pull(repo: str, file: str | None = None, revision: str | None = None) -> str:
    """Download one GGUF of `repo` into the HF cache (a no-op when cached) and return its local path.

    Without `file`, the repository's only .gguf file; with several, ask on a terminal, else exit 2 listing them.
    """
    from huggingface_hub import hf_hub_download

    with _hub_errors(repo, file, revision):
        name = file or _choose(repo, _gguf_files(repo, revision))
        local = hf_hub_download(repo, name, revision=revision)
    _check_gguf(local, repo, name)
    return local


def cached(cache_dir: str | None = None) -> list[CachedModel]:
    """Every GGUF file in the HF cache, by repo, file and revision."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(cache_dir)
    except CacheNotFound:
        return []
    rows = [CachedModel(repo.repo_id, Path(f.file_path).relative_to(rev.snapshot_path).as_posix(), rev.commit_hash,
                        tuple(sorted(rev.refs)), f.size_on_disk, str(f.file_path))
            for repo in info.repos if repo.repo_type == "model"
            for rev in repo.revisions for f in rev.files if f.file_name.endswith(".gguf")]
    return sorted(rows, key=lambda m: (m.repo, m.file, m.revision))


def remove(target: str) -> tuple[int, str]:
    """Remove REPO (its whole cache folder) or REPO/FILE (that file in every revision) from the HF cache.

    Returns (files removed, the space freed as huggingface_hub writes it). Files are selected per repo and
    removed with `delete_files`, never `delete_revisions`: that one matches commit hashes in any repo, and a
    duplicated repo shares its source's hashes.
    """
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    repo, file, revision = parse(SCHEME + target.removeprefix(SCHEME))
    if revision is not None:
        raise UsageError(f"{target}: rm takes REPO[/FILE] and removes every revision")
    try:
        info = scan_cache_dir()
    except CacheNotFound:
        info = None
    repos = [r for r in info.repos if r.repo_id == repo and r.repo_type == "model"] if info else []
    files = [f for r in repos for rev in r.revisions for f in rev.files
             if file is None or Path(f.file_path).relative_to(rev.snapshot_path).as_posix() == file]
    if info is None or not repos or file is not None and not files:
        raise UsageError(f"{target.removeprefix(SCHEME)} is not in the cache (bitnet-select models lists it)")
    strategy = info.delete_files(*files)
    strategy.execute()  # unlinks each blob no other cached file uses
    if file is None:
        for r in repos:  # what is left: refs, empty snapshots, .no_exist markers
            shutil.rmtree(r.repo_path)
    return len(files), strategy.expected_freed_size_str


# -- choosing the file ----------------------------------------------------------------------------

def _gguf_files(repo: str, revision: str | None) -> list[str]:
    """The .gguf files of the repo at the revision: from the Hub's API, or from the cache when offline."""
    import httpx2
    from huggingface_hub import HfApi, constants, snapshot_download

    if not constants.is_offline_mode():
        try:
            info = HfApi().model_info(repo, revision=revision)
            return sorted(s.rfilename for s in info.siblings or [] if s.rfilename.endswith(".gguf"))
        except httpx2.TransportError:
            pass  # unreachable: like hf_hub_download, fall back to a cached snapshot (else the error below)
    # local_files_only resolves the revision through the cache's refs, as hf_hub_download does offline.
    folder = Path(snapshot_download(repo, revision=revision, local_files_only=True))
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.gguf"))


def _choose(repo: str, names: list[str]) -> str:
    if not names:
        raise UsageError(f"{repo} has no .gguf file (name one with --file or hf://{repo}/FILE)")
    if len(names) == 1:
        return names[0]
    if not (sys.stdin.isatty() and sys.stderr.isatty()):
        raise UsageError(f"{repo} has {len(names)} GGUF files: {', '.join(names)}; "
                         f"pass --file NAME (or hf://{repo}/NAME)")
    for i, name in enumerate(names, start=1):
        click.echo(f"{i:>3}  {name}", err=True)
    choice = click.prompt(f"{repo} has {len(names)} GGUF files; which one", type=click.IntRange(1, len(names)),
                          err=True)
    return names[choice - 1]


# -- checking what arrived ------------------------------------------------------------------------

def _check_gguf(local: str, repo: str, name: str) -> None:
    """A download that is not a whole GGUF (wrong bytes, truncated) is removed from the cache, then exit 4.

    The structural check (magic, version, tensor table, every tensor's data inside the file) reads the
    header and maps the file, so it is cheap even for a large model; the architecture is not checked
    here (load does that), so a file this engine cannot run yet still downloads.
    """
    from bitnet.modelfile.model import _open

    try:
        _open(local)
    except ModelError as e:
        _forget(local)
        why = str(e).removeprefix(f"{local}: ")
        raise ModelError(f"{repo}/{name}: the download is not a valid GGUF ({why}); removed it from the cache") \
            from None


def _forget(local: str) -> None:
    """Remove one downloaded file from the cache (its snapshot link, and its blob unless another link uses it)."""
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir()
    files = [f for r in info.repos for rev in r.revisions for f in rev.files if str(f.file_path) == local]
    if files:
        info.delete_files(*files).execute()
    else:  # not where the scan looks (a local_dir download): the file itself must go
        Path(local).unlink(missing_ok=True)


# -- errors ---------------------------------------------------------------------------------------

@contextmanager
def _hub_errors(repo: str, file: str | None, revision: str | None) -> Iterator[None]:
    """huggingface_hub's exceptions as one-line UsageErrors (exit 2) naming what was missing or unreachable."""
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub import errors as hf

    endpoint = constants.ENDPOINT
    what = f"{repo}/{file}" if file else repo
    try:
        yield
    except hf.GatedRepoError:
        raise UsageError(f"{repo} is gated on {endpoint}: accept its terms there and set HF_TOKEN") from None
    except hf.RepositoryNotFoundError:
        raise UsageError(f"{repo}: no such model repository on {endpoint} (a private one needs HF_TOKEN)") from None
    except hf.RevisionNotFoundError:
        raise UsageError(f"{repo}: no revision {revision!r} on {endpoint}") from None
    except hf.LocalEntryNotFoundError as e:  # before EntryNotFoundError, its base
        if constants.is_offline_mode():
            raise UsageError(f"{what}: offline (HF_HUB_OFFLINE=1) and not in the cache {constants.HF_HUB_CACHE}") \
                from None
        cause = e.__cause__ or e.__context__
        raise UsageError(f"{what}: cannot reach {endpoint} ({_one_line(cause or e)}) and it is not in the cache") \
            from None
    except hf.EntryNotFoundError:
        raise UsageError(f"{repo}: no file {file!r} at revision {revision or 'main'} on {endpoint}") from None
    except (hf.HfHubHTTPError, httpx2.HTTPError) as e:
        raise UsageError(f"{what}: cannot download from {endpoint}: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
