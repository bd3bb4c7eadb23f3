"""Tokenize text into a Megatron indexed dataset (<prefix>.bin / <prefix>.idx).

    python scripts/preprocess_data.py --input stdlib --output-prefix data/stdlib --tokenizer byte
"""

import argparse

from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_ext.data import (
    DEFAULT_MAX_BYTES,
    build_indexed_dataset,
    build_tokenizer,
    iter_documents,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--input", required=True, help='a text file, a folder of .txt/.md/.rst/.py, or "stdlib"'
    )
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument(
        "--tokenizer",
        default="byte",
        help='what data.tokenizer takes: "byte", a tokenizer.json, a SentencePiece .model, a folder holding '
        "either, a .gguf file",
    )
    parser.add_argument(
        "--max-mb",
        type=float,
        default=DEFAULT_MAX_BYTES / 2**20,
        help="cap on the text read, in MiB of UTF-8",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tokenizer = build_tokenizer(args.tokenizer)
    documents = iter_documents(args.input, max_bytes=int(args.max_mb * 2**20))
    prefix = build_indexed_dataset(documents, tokenizer, args.output_prefix)
    # Counted from the written files, so the report also proves they read back.
    dataset = IndexedDataset(prefix)
    tokens = int(dataset.sequence_lengths.sum())
    print(f"wrote {prefix}.bin/.idx: {len(dataset)} documents, {tokens} tokens")


if __name__ == "__main__":
    main()
