"""The default corpus: the stdlib's text, deterministic and capped; user files and folders."""

import sysconfig
from pathlib import Path

import pytest

from megatron_ext.data import corpus_files, iter_documents

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _utf8_size(documents):
    return sum(len(d.encode("utf-8")) for d in documents)


def test_stdlib_is_nonempty_deterministic_and_capped():
    cap = 300_000
    first = list(iter_documents("stdlib", max_bytes=cap))
    assert len(first) > 5
    assert _utf8_size(first) == cap  # the stdlib is far larger than the cap: filled exactly
    assert first == list(iter_documents("stdlib", max_bytes=cap))
    # a larger cap extends the same selection instead of choosing another one
    larger = list(iter_documents("stdlib", max_bytes=2 * cap))
    assert larger[: len(first) - 1] == first[:-1]


def test_stdlib_files_are_the_library_not_its_tests_or_packages():
    files = corpus_files("stdlib")
    relative = [f.relative_to(STDLIB).parts for f in files]
    assert STDLIB / "os.py" in files and STDLIB / "json" / "decoder.py" in files
    assert not any({"test", "tests", "site-packages", "__pycache__"} & set(p) for p in relative)
    assert all(f.suffix in {".py", ".txt", ".rst"} for f in files)
    # the cap takes a spread, not the alphabetically first packages
    tops = {parts[0] for parts in relative[:100]}
    assert len(tops) > 20


def test_default_cap_is_about_8_mb():
    size = _utf8_size(iter_documents("stdlib"))
    assert 7 * 2**20 < size <= 8 * 2**20


def test_folder_corpus_takes_text_files_whole_and_cuts_at_the_cap(tmp_path):
    (tmp_path / "sub").mkdir()
    texts = {"a.txt": "alpha " * 9, "b.md": "# beta\n", "sub/c.py": "x = 'γ'\n", "sub/d.rst": "δ"}
    for name, text in texts.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    (tmp_path / "skip.bin").write_bytes(b"\x00\x01")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "e.txt").write_text("hidden")

    documents = list(iter_documents(str(tmp_path)))
    assert sorted(documents) == sorted(texts.values())

    total = _utf8_size(texts.values())
    cut = list(iter_documents(str(tmp_path), max_bytes=total - 3))
    assert cut[:-1] == documents[: len(cut) - 1]
    assert documents[len(cut) - 1].startswith(cut[-1])
    assert total - 3 - 3 <= _utf8_size(cut) <= total - 3  # a split multi-byte char is dropped


def test_single_file_is_one_document(tmp_path):
    path = tmp_path / "book.weird"
    path.write_text("line one\nline two\n")
    assert list(iter_documents(str(path))) == ["line one\nline two\n"]


def test_bad_corpus_names_the_setting(tmp_path):
    with pytest.raises(ValueError, match="data.corpus"):
        list(iter_documents(str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="data.corpus.*no"):
        list(iter_documents(str(tmp_path)))
