"""Held-out text kept apart by file: the stdlib split is disjoint and stable, and an overlap is refused."""

from pathlib import Path

import pytest

from megatron_ext.data import corpus_files
from megatron_ext.data.file_split import check_disjoint, split_by_file, token_windows


def test_stdlib_split_is_disjoint_about_one_in_ten_and_independent_of_order():
    files = corpus_files("stdlib")
    train, held = split_by_file(files)
    assert not {f.resolve() for f in train} & {f.resolve() for f in held}
    assert sorted(train + held) == sorted(files)
    assert 0.05 < len(held) / len(files) < 0.15
    # By each file's own path: the reversed order and a subset hold out the same files.
    assert set(split_by_file(files[::-1])[1]) == set(held)
    assert set(split_by_file(files[: len(files) // 2])[1]) == set(held) & set(files[: len(files) // 2])


CASES = {
    "shared file": ([Path("a.py"), Path("b.py")], [Path("b.py")], "held-out files are also training files"),
    "shared through a link": ([Path("real.py")], [Path("link.py")], "held-out files are also training files"),
    "nothing held out": ([Path("a.py")], [], "needs files on both sides"),
}


@pytest.mark.parametrize("case", CASES)
def test_check_disjoint_refuses(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("a.py", "b.py", "real.py"):
        (tmp_path / name).write_text("x = 1\n")
    (tmp_path / "link.py").symlink_to(tmp_path / "real.py")
    train, held, message = CASES[case]
    with pytest.raises(ValueError, match=message):
        check_disjoint(train, held)


def test_token_windows_pack_documents_in_order_with_eod(tmp_path):
    first, second = tmp_path / "1.txt", tmp_path / "2.txt"
    first.write_text("abc")
    second.write_text("defgh")
    windows = token_windows(lambda text: [ord(c) for c in text], 0, [first, second], seq=2, windows=3)
    assert windows.tolist() == [[97, 98, 99], [0, 100, 101], [102, 103, 104]]
    with pytest.raises(ValueError, match="fewer than 4 windows"):
        token_windows(lambda text: [ord(c) for c in text], 0, [first, second], seq=2, windows=4)
