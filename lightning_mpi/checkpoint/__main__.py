"""``python -m lightning_mpi.checkpoint consolidate DIR OUT.ckpt``: a sharded checkpoint as one plain
Lightning checkpoint (see :mod:`lightning_mpi.checkpoint.consolidate`)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_mpi.checkpoint", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    merge = commands.add_parser("consolidate", help="write one plain Lightning checkpoint from a sharded one")
    merge.add_argument("directory", help="the sharded checkpoint directory (it holds manifest.json)")
    merge.add_argument("out", help="the checkpoint file to write (e.g. model.ckpt)")
    args = parser.parse_args(argv)
    from lightning_mpi.checkpoint.consolidate import consolidate_to_file
    from lightning_mpi.checkpoint.sharded import is_sharded_checkpoint

    if not is_sharded_checkpoint(args.directory):
        parser.error(f"directory={args.directory!r} is not a sharded checkpoint (no manifest.json in it)")
    size = consolidate_to_file(args.directory, args.out)
    print(f"wrote {args.out} ({size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
