"""`labkit data build` and `labkit data bench`."""
from __future__ import annotations

from labkit.config import DataConfig
from labkit.data.bench import format_table, run_bench
from labkit.data.dataset import build_dataset, format_build
from labkit.output import add_common_flags, emit


def add_cli(parser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    b = sub.add_parser("build", help="tokenise a corpus offline and pack it into a MindRecord dataset")
    b.add_argument("--corpus", nargs="+", required=True, help=".txt/.jsonl files (or .gz) or directories")
    b.add_argument("--tokenizer", required=True, help="tokenizer directory (data/tokenizer is the shipped one)")
    b.add_argument("--seq-len", type=int, required=True, help="tokens per training sequence (samples hold one more)")
    b.add_argument("--output", required=True, help="dataset directory to write (atomically)")
    b.add_argument("--workers", type=int, default=1, help="tokenising processes")
    b.add_argument("--text-field", default="text", help="JSON field holding the text in .jsonl files")
    b.add_argument("--split-on-blank-lines", action="store_true", help=".txt: one document per blank-line block")
    b.add_argument("--val-fraction", type=float, default=0.0,
                   help="share of whole documents held out as a validation set in OUTPUT/val (e.g. 0.02; default 0)")
    b.add_argument("--val-seed", type=int, default=0, help="seed of the document split (default 0)")
    b.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    add_common_flags(b)
    b.set_defaults(func=_cli_build)

    n = sub.add_parser("bench", help="tokens/s: on-the-fly tokenisation (GeneratorDataset) vs packed MindRecord")
    n.add_argument("--corpus", nargs="+", default=None, help="corpus (default: the shipped data/corpus)")
    n.add_argument("--tokenizer", default=None, help="tokenizer directory (default: data/tokenizer)")
    n.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    n.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="num_parallel_workers values")
    n.add_argument("--prefetch", type=int, nargs="+", default=[16, 64], help="prefetch sizes (MindRecord loader)")
    n.add_argument("--max-docs", type=int, default=None, help="documents for the on-the-fly runs (default: all)")
    add_common_flags(n)
    n.set_defaults(func=_cli_bench)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def _cli_build(args) -> int:
    r = build_dataset(DataConfig(corpus=args.corpus, tokenizer=args.tokenizer, seq_len=args.seq_len,
                                 val_fraction=args.val_fraction, val_seed=args.val_seed),
                      args.output, workers=args.workers, text_field=args.text_field,
                      split_on_blank_lines=args.split_on_blank_lines, overwrite=args.overwrite)
    emit(args, r, format_build(r))
    return 1 if r["verdict"] == "fail" else 0


def _cli_bench(args) -> int:
    r = run_bench(corpus=args.corpus, tokenizer_dir=args.tokenizer, seq_len=args.seq_len, workers=args.workers,
                  prefetch=args.prefetch, max_docs=args.max_docs)
    emit(args, r, format_table(r))
    return 0
