"""Indexed datasets: exact contents, atomic writes, the cached default corpus, the CLI."""

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from megatron_ext.data import ByteTokenizer, build_indexed_dataset, default_corpus_prefix

REPO = Path(__file__).resolve().parents[2]
DOCS = ["hello world", "", "Grüße 世界\n", "x" * 1000, "last one"]


def _write_corpus(folder: Path, count: int = 6) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (folder / f"doc{i}.txt").write_text(f"document {i}: " + "lorem ipsum " * (20 + i))
    return folder


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp" in p.name)


def test_sequences_are_utf8_bytes_plus_eod(tmp_path):
    prefix = build_indexed_dataset(iter(DOCS), ByteTokenizer(), str(tmp_path / "sub" / "ds"))
    dataset = IndexedDataset(prefix)
    expected = [list(d.encode("utf-8")) + [256] for d in DOCS if d]  # empty docs carry nothing
    assert len(dataset) == len(expected)
    for i, ids in enumerate(expected):
        assert dataset[i].tolist() == ids
    assert dataset.index.dtype == numpy.uint16  # 258 symbols: megatron's optimal dtype
    assert list(dataset.document_indices) == list(range(len(expected) + 1))
    assert _leftovers(tmp_path / "sub") == []


def test_no_documents_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        build_indexed_dataset(["", ""], ByteTokenizer(), str(tmp_path / "ds"))
    assert os.listdir(tmp_path) == []


def test_crash_mid_build_leaves_no_dataset(tmp_path, monkeypatch):
    def crash(self, idx_path):
        raise OSError("disk full")

    monkeypatch.setattr(IndexedDatasetBuilder, "finalize", crash)
    with pytest.raises(OSError, match="disk full"):
        build_indexed_dataset(DOCS, ByteTokenizer(), str(tmp_path / "ds"))
    assert not IndexedDataset.exists(str(tmp_path / "ds"))
    assert os.listdir(tmp_path) == []


def test_crash_while_replacing_keeps_the_old_dataset(tmp_path, monkeypatch):
    prefix = build_indexed_dataset(["old"], ByteTokenizer(), str(tmp_path / "ds"))

    def crash_in_documents():
        yield "new"
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_indexed_dataset(crash_in_documents(), ByteTokenizer(), prefix)
    dataset = IndexedDataset(prefix)  # kept alive: its items are views into its mmap
    assert dataset[0].tolist() == list(b"old") + [256]
    assert _leftovers(tmp_path) == []


def test_default_corpus_is_cached(tmp_path):
    corpus = str(_write_corpus(tmp_path / "text"))
    cache = tmp_path / "cache"
    prefix = default_corpus_prefix(str(cache), corpus, "byte")
    dataset = IndexedDataset(prefix)
    assert len(dataset) == 6 and all(seq[-1] == 256 for seq in dataset)
    mtimes = [os.stat(prefix + ext).st_mtime_ns for ext in (".bin", ".idx")]
    time.sleep(0.01)
    assert default_corpus_prefix(str(cache), corpus, "byte") == prefix
    assert [os.stat(prefix + ext).st_mtime_ns for ext in (".bin", ".idx")] == mtimes
    assert prefix.startswith(str(cache))


def test_cache_key_follows_tokenizer_cap_and_content(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    corpus = str(_write_corpus(tmp_path / "text"))
    cache = str(tmp_path / "cache")
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel()
    hf.train_from_iterator(["lorem ipsum"] * 4, trainers.BpeTrainer(special_tokens=["</s>"]))
    hf.save(str(tmp_path / "tokenizer.json"))

    byte_prefix = default_corpus_prefix(cache, corpus, "byte")
    hf_prefix = default_corpus_prefix(cache, corpus, str(tmp_path / "tokenizer.json"))
    assert hf_prefix != byte_prefix
    assert default_corpus_prefix(cache, corpus, "byte", max_bytes=100) != byte_prefix
    (Path(corpus) / "doc0.txt").write_text("edited")
    edited = default_corpus_prefix(cache, corpus, "byte")
    assert edited != byte_prefix
    new, old = IndexedDataset(edited), IndexedDataset(byte_prefix)
    assert sorted(map(len, new)) != sorted(map(len, old))


# One of several processes sharing a cache: waits until all have started (so they overlap),
# then asks for the corpus with a build that logs its pid and is slow enough that, without the
# lock, the others would start building meanwhile.
_CONCURRENT_CHILD = """
import os, sys, time
from pathlib import Path
from megatron_ext.data import preprocess

cache, corpus, log, gate, count = sys.argv[1:]
real_build = preprocess.build_indexed_dataset

def slow_logged_build(documents, tokenizer, prefix):
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(0.5)
    return real_build(documents, tokenizer, prefix)

preprocess.build_indexed_dataset = slow_logged_build
Path(gate, str(os.getpid())).touch()
while len(os.listdir(gate)) < int(count):
    time.sleep(0.01)
print(preprocess.default_corpus_prefix(cache, corpus, "byte"))
"""


def test_concurrent_processes_build_once(tmp_path):
    # Fresh interpreters, not fork: forking the pytest process, which may hold other tests'
    # gloo threads, can deadlock the child.
    corpus = str(_write_corpus(tmp_path / "text"))
    log, gate = tmp_path / "builds.log", tmp_path / "gate"
    gate.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    argv = [sys.executable, "-c", _CONCURRENT_CHILD, str(tmp_path / "cache"), corpus, str(log),
            str(gate), "3"]
    children = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=env) for _ in range(3)]
    outputs = [child.communicate(timeout=300) for child in children]
    for child, (_, stderr) in zip(children, outputs):
        assert child.returncode == 0, stderr
    prefixes = {stdout.strip() for stdout, _ in outputs}
    assert len(prefixes) == 1
    assert len(log.read_text().split()) == 1
    assert len(IndexedDataset(prefixes.pop())) == 6


def test_preprocess_script(tmp_path):
    corpus = _write_corpus(tmp_path / "text", count=3)
    out = tmp_path / "out" / "ds"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HOME=str(tmp_path))
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "preprocess_data.py"), "--input", str(corpus),
         "--output-prefix", str(out), "--tokenizer", "byte", "--max-mb", "1"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    expected_tokens = sum(len(p.read_bytes()) + 1 for p in corpus.iterdir())
    assert f"3 documents, {expected_tokens} tokens" in result.stdout
    assert IndexedDataset.exists(str(out))
