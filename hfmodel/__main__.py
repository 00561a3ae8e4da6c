"""``python -m hfmodel describe CONFIG --micro-batch B --seq-len S --dtype D --out FILE``
(``--decoder-seq-len T`` for an encoder-decoder):
measure a config.json's model and write its description (atomically). Exit 2 on a user mistake."""

import argparse
import json
import sys

from sim.errors import UserError
from sim.fileio import read_json, write_json_atomic


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m hfmodel", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("describe", help="measure a config.json and write its model description")
    d.add_argument("config")
    d.add_argument("--name", default="custom")
    d.add_argument("--micro-batch", type=int, required=True)
    d.add_argument("--seq-len", type=int, required=True)
    d.add_argument("--dtype", default="bf16")
    d.add_argument("--decoder-seq-len", type=int, default=None, help="an encoder-decoder's decoder length")
    d.add_argument("--out", required=True)
    d.add_argument("--finetune", default=None, help="JSON: method, rank, alpha, dropout, target_modules, ...")
    args = parser.parse_args(argv)
    try:
        from hfmodel.describe import describe

        config = read_json(args.config, "config.json")
        result = describe(
            config,
            micro_batch=args.micro_batch,
            seq_len=args.seq_len,
            dtype=args.dtype,
            name=args.name,
            finetune=json.loads(args.finetune) if args.finetune else None,
            decoder_seq_len=args.decoder_seq_len,
        )
        write_json_atomic(args.out, result)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
