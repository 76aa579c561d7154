"""Paths stay where the operator put them: run paths confined to the box's roots, local state private.

A run's parameters name files on the GPU box (prompt sources, the model directory). They come from whoever
can start a run, so each is resolved the way the kernel will open it (`..` and symlinks followed, relative
paths from the working directory) and must land under a root the box's Settings name (`DATAGEN_DATA_ROOTS`,
`DATAGEN_MODEL_ROOTS`). A refusal names only what the run gave and the roots: it reads the same whether the
outside file exists or not, so a run cannot probe the box's files. Run names (namespace, pilot) are single path
components by their RunSpec patterns; the work directory holding keys, logs and checkpoints is made 0700.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Sequence
from pathlib import Path

from datagen.runspec import RunSpec
from datagen.settings import Settings

__all__ = ["PathNotAllowed", "confine", "private_dir", "private_file", "secure_run", "trusted_model", "untrusted"]

# A Hugging Face Hub dataset id (org/name); only with Settings.hub_datasets, and never a local path.
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*(?:\.[A-Za-z0-9_-]+)*(?:/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")


class PathNotAllowed(ValueError):
    """A run named a path outside the box's configured roots."""


def _real(path: Path, base: Path) -> Path:
    # realpath follows every symlink and applies '..' after it, as open() would; missing parts stay lexical.
    return Path(os.path.realpath(path if path.is_absolute() else base / path))


def _under(real: Path, roots: Sequence[Path], base: Path) -> bool:
    for root in roots:
        r = _real(Path(root).expanduser(), base)
        if real == r or r in real.parents:
            return True
    return False


def confine(path: str, roots: Sequence[Path], what: str, setting: str, base_dir: Path | None = None) -> Path:
    """`path` resolved (symlinks, '..', relative to `base_dir` or the working directory) if under one of `roots`."""
    base = base_dir if base_dir is not None else Path.cwd()
    real = _real(Path(path).expanduser(), base)
    if _under(real, roots, base):
        return real
    shown = ", ".join(str(r) for r in roots) or "none"
    # The same words whether `path` exists or not: nothing about the box's files outside the roots leaks.
    raise PathNotAllowed(f"{what} {path!r} is not under the roots the box allows ({setting}: {shown})")


def _confine_tree(real: Path, given: str, roots: Sequence[Path], base: Path) -> None:
    """Every file a directory source would read (its files, a saved dataset's) resolves under the roots too."""
    if not real.is_dir():
        return
    for path in real.rglob("*"):
        if not _under(Path(os.path.realpath(path)), roots, base):
            inside = path.relative_to(real).as_posix()  # a name inside the root: nothing outside is revealed
            shown = ", ".join(str(r) for r in roots)
            raise PathNotAllowed(
                f"prompt source {given!r}: {inside} leads outside the roots the box allows "
                f"(DATAGEN_DATA_ROOTS: {shown})"
            )


def secure_run(settings: Settings, spec: RunSpec, base_dir: Path | None = None, sources: bool = True) -> None:
    """Refuse a run whose sources or model lie outside the box's roots; make the work directory private."""
    base = base_dir if base_dir is not None else Path.cwd()
    for source in spec.sources if sources else []:
        try:
            real = confine(source.path, settings.data_roots, "prompt source", "DATAGEN_DATA_ROOTS", base)
            _confine_tree(real, source.path, settings.data_roots, base)
        except PathNotAllowed:
            local = _real(Path(source.path).expanduser(), base)
            # A Hub id is a name, not a path; one that is also a local path outside the roots stays refused
            # (the datasets library would read the local one).
            if not (settings.hub_datasets and _HUB_ID_RE.match(source.path) and not os.path.lexists(local)):
                raise
    model = confine(spec.model_path, settings.model_roots, "model_path", "DATAGEN_MODEL_ROOTS", base)
    trusted_model(model, spec.model_path)
    private_dir(settings.work_dir)


def untrusted(st: os.stat_result, uid: int) -> str | None:
    """Why a model file with this status could hold someone else's weights or tokenizer, or None."""
    if st.st_uid not in (uid, 0):
        return f"belongs to user {st.st_uid}"
    if st.st_mode & stat.S_IWOTH:
        return "is writable by every user"
    return None


def trusted_model(real: Path, given: str) -> None:
    """Refuse a model directory (or a file in it) that another local user owns or may write.

    The weights, tokenizer and chat template decide every token of the dataset. A directory such as /dev/shm is
    writable by every local user: a model there is trusted only if its own owner is this user (or root) and no
    one else may change it. A model that does not exist yet is the environment check's to report.
    """
    if not real.exists():
        return
    uid = os.getuid()
    for path in [real, *(sorted(real.rglob("*")) if real.is_dir() else [])]:
        try:
            why = untrusted(path.stat(), uid)
        except OSError:
            continue  # a dangling link: the model check reports missing files
        if why:
            inside = "" if path == real else f": {path.relative_to(real).as_posix()}"
            raise PathNotAllowed(
                f"model_path {given!r}{inside} {why}: the model must belong to this user or root and be "
                "writable by no one else"
            )


def private_dir(path: Path) -> Path:
    """Create `path` (and parents) and make it 0700: checkpoints, logs and the server key file live below."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) != 0o700:
        path.chmod(0o700)
    return path


def private_file(path: Path, append: bool = False) -> int:
    """Open `path` for writing as a 0600 file (an existing file is made 0600 too); returns the descriptor."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)  # the mode argument applies only to a file open() creates
    return fd
