"""``tierckpt export``: a step's model weights as plain safetensors files for Hugging Face ``from_pretrained``.

The engine is :func:`tierckpt.export.export_weights` (docs/export.md); this module parses the options and maps its
errors to the CLI's exit codes: 2 for no such step, key or folder (naming the keys the step holds) and for an
output folder that already holds an export; 1 for a step whose copies are all corrupt (naming the files); 3 for
storage that cannot be reached. Unlike the other commands it imports torch (it builds tensors).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ._common import EXIT_OK, UsageError, _options_for, add_common_options, clean


def _size(text: str) -> int:
    from ..export import ExportError, parse_size

    try:
        return parse_size(text)
    except ExportError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cmd_export(args: argparse.Namespace) -> int:
    """Export ``state[KEY]`` of a step of ROOT as safetensors files in OUT_DIR."""
    from ..errors import StateMismatchError
    from ..export import ExportError, _existing_export, export_weights

    if args.threads < 1:
        raise UsageError(f"--threads must be at least 1, got {args.threads}")
    opts = _options_for(args, args.remote) if args.remote else _options_for(args, args.root)
    try:
        existing = [] if args.overwrite else _existing_export(args.out_dir)
        if existing:  # refused here in the CLI's words (export_weights names its overwrite=True)
            raise UsageError(f"{args.out_dir} already holds an export ({', '.join(existing[:3])}"
                             f"{' ...' if len(existing) > 3 else ''}); --overwrite replaces it")
        result = export_weights(args.root, args.out_dir, step=args.step, key=args.key, dtype=args.dtype,
                                max_shard_bytes=args.max_shard_size, storage_options=opts, remote=args.remote,
                                timeout_s=args.timeout, overwrite=args.overwrite, threads=args.threads)
    except (StateMismatchError, ExportError) as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps({"ok": True, "step": result.step, "files": list(result.files),
                          "bytes": result.total_bytes}))
    else:
        print(clean(args, f"step {result.step}: exported state[{args.key!r}] to {args.out_dir} "
                          f"({len(result.files)} file(s), {result.total_bytes / 2**20:.1f} MiB, verified)"))
    return EXIT_OK


def add_commands(sub: Any) -> None:
    """Register ``export`` on the ``tierckpt`` sub-parsers."""
    sp = sub.add_parser("export", help="write a step's model weights as safetensors files for from_pretrained")
    sp.add_argument("root", help="tier root, a single step folder, or a URL")
    sp.add_argument("out_dir", help="output folder (created if missing)")
    sp.add_argument("--step", type=int, metavar="N", help="the step (default: the newest intact one)")
    sp.add_argument("--key", default="model", help="top-level key of the saved state holding the module "
                                                   "(default: model)")
    sp.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="cast floating tensors to this dtype")
    sp.add_argument("--max-shard-size", type=_size, default="5GB", metavar="SIZE",
                    help="largest output file, e.g. 5GB (default), 500MB, 2GiB; larger exports are sharded with "
                         "model.safetensors.index.json")
    sp.add_argument("--remote", help="a second tier (URL or path) read where ROOT has no intact copy")
    sp.add_argument("--overwrite", action="store_true", help="replace an export already in OUT_DIR")
    sp.add_argument("--threads", type=int, default=4, metavar="N", help="files read at once (default 4)")
    add_common_options(sp)
    sp.set_defaults(fn=cmd_export)
