"""The text a run trains on when no dataset is given: files already on the machine.

`corpus="stdlib"` is the Python standard library's sources and docs (present wherever Python
is, so no download is ever needed); any other value is a text file or a folder of text files.
One file is one document.
"""

import hashlib
import os
import sysconfig
from pathlib import Path
from typing import Iterator

DEFAULT_MAX_BYTES = 8 * 2**20
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
_STDLIB_SUFFIXES = (".py", ".txt", ".rst")
# Folders of the stdlib tree that are not the library: its test suites (some files there are
# deliberately mis-encoded), installed third-party packages, caches and build leftovers.
_STDLIB_SKIP_DIRS = {
    "test",
    "tests",
    "idle_test",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "lib-dynload",
    "Icons",
}


def _walk(root: Path, suffixes: tuple[str, ...], skip_dirs: set[str]) -> list[Path]:
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip_dirs and not d.startswith((".", "config-"))]
        found.extend(Path(folder) / f for f in files if f.endswith(suffixes))
    return found


def _spread_order(root: Path, files: list[Path]) -> list[Path]:
    # A stable pseudo-random order, so that a size cap takes a spread of the whole tree instead
    # of the alphabetically first packages, and the same files on every machine and run.
    def key(path: Path) -> str:
        return hashlib.sha1(path.relative_to(root).as_posix().encode()).hexdigest()

    return sorted(files, key=key)


def corpus_files(corpus: str) -> list[Path]:
    """The files of `corpus` in the order documents are taken from them."""
    if corpus == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        return _spread_order(root, _walk(root, _STDLIB_SUFFIXES, _STDLIB_SKIP_DIRS))
    path = Path(os.path.expanduser(corpus))
    if path.is_file():
        return [path]
    if path.is_dir():
        files = _spread_order(path, _walk(path, TEXT_SUFFIXES, {"__pycache__"}))
        if not files:
            raise ValueError(f"data.corpus={corpus!r}: no {'/'.join(TEXT_SUFFIXES)} files in it")
        return files
    raise ValueError(
        f"data.corpus={corpus!r} is neither 'stdlib' nor an existing text file or folder"
    )


def corpus_fingerprint(corpus: str, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """A digest that changes whenever the documents `iter_documents` yields may change."""
    digest = hashlib.sha256(f"{max_bytes}".encode())
    for path in corpus_files(corpus):
        stat = path.stat()
        digest.update(f"\0{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def iter_documents(corpus: str, max_bytes: int = DEFAULT_MAX_BYTES) -> Iterator[str]:
    """Yield the documents of `corpus`, at most `max_bytes` of UTF-8 text in total.

    The file that crosses the cap is cut at the cap, so the total is min(cap, corpus size).
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    remaining = max_bytes
    for path in corpus_files(corpus):
        text = path.read_text(encoding="utf-8", errors="replace")
        data = text.encode("utf-8")
        if len(data) >= remaining:
            # "ignore" drops a character split by the cut instead of inventing one
            cut = data[:remaining].decode("utf-8", errors="ignore")
            if cut:
                yield cut
            return
        if text:
            yield text
        remaining -= len(data)
