"""``k3 tokenizer``: train a byte-level BPE with the K3 reserved ids, and encode or decode with a saved one.

``train`` with no ``--files`` reads the local Python standard library (see ``k3.model.tokenizer``), so it
works offline. ``encode`` treats its argument as ordinary text (reserved literals in it stay text) unless
``--structure`` is given; ``decode`` prints the exact text of the ids.
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("tokenizer", help="train a BPE tokenizer; encode or decode with one")
    sub = parser.add_subparsers(dest="tokenizer_command", metavar="ACTION", required=True)

    train = sub.add_parser("train", help="train a byte-level BPE with the K3 reserved tokens")
    train.add_argument("--out", required=True, help="directory to write the tokenizer to")
    train.add_argument("--vocab-size", type=int, default=None, help="vocabulary size (default 32768)")
    train.add_argument(
        "--files", nargs="+", default=None, help="training text files, read in order (default: Python stdlib)"
    )
    train.add_argument("--max-bytes", type=int, default=None, help="stop reading before this many bytes")
    train.add_argument("--quiet", action="store_true", help="no progress output")
    train.set_defaults(func=run_train)

    encode = sub.add_parser("encode", help="print the token ids of TEXT")
    encode.add_argument("--tokenizer", required=True, help="directory of a saved tokenizer")
    encode.add_argument(
        "--structure", action="store_true", help="turn reserved-token literals in TEXT into reserved ids"
    )
    encode.add_argument("text", metavar="TEXT")
    encode.set_defaults(func=run_encode)

    decode = sub.add_parser("decode", help="print the text of token IDS")
    decode.add_argument("--tokenizer", required=True, help="directory of a saved tokenizer")
    decode.add_argument("ids", metavar="IDS", nargs="+", help="token ids (separate arguments or commas)")
    decode.set_defaults(func=run_decode)


def _load(directory: str):
    from k3.cli import CLIError
    from k3.model.tokenizer import TokenizerError, load_tokenizer

    try:
        return load_tokenizer(directory)
    except TokenizerError as exc:
        raise CLIError(str(exc)) from exc


def run_train(args: argparse.Namespace) -> int:
    from k3.cli import CLIError
    from k3.model.tokenizer import DEFAULT_MAX_BYTES, DEFAULT_VOCAB_SIZE, TokenizerError, train_tokenizer

    def log(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr)

    try:
        tok = train_tokenizer(
            args.files,
            DEFAULT_VOCAB_SIZE if args.vocab_size is None else args.vocab_size,
            args.out,
            max_bytes=DEFAULT_MAX_BYTES if args.max_bytes is None else args.max_bytes,
            show_progress=not args.quiet,
            log=log,
        )
    except TokenizerError as exc:
        raise CLIError(str(exc)) from exc
    print(f"{args.out}: BPE tokenizer, vocab {tok.vocab_size}")
    return 0


def run_encode(args: argparse.Namespace) -> int:
    tok = _load(args.tokenizer)
    ids = tok.encode_structure(args.text) if args.structure else tok.encode_text(args.text)
    print(" ".join(str(i) for i in ids))
    return 0


def run_decode(args: argparse.Namespace) -> int:
    from k3.cli import CLIError
    from k3.model.tokenizer import TokenizerError

    tok = _load(args.tokenizer)
    ids: list[int] = []
    for arg in args.ids:
        for part in arg.replace(",", " ").split():
            try:
                ids.append(int(part))
            except ValueError as exc:
                raise CLIError(f"IDS: {part!r} is not an integer token id") from exc
    try:
        text = tok.decode(ids)
    except TokenizerError as exc:
        raise CLIError(str(exc)) from exc
    sys.stdout.write(text + "\n")
    return 0
