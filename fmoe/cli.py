"""The ``fmoe`` command.

    fmoe train [RECIPE] [--set SECTION.KEY=VALUE ...]     train (the embedded tiny recipe by default)
    fmoe data build INPUTS... --out DIR [--tokenizer tokenizer.json|bytes] [--workers N]
    fmoe checkpoint export-hf CHECKPOINT --recipe RECIPE --out DIR [--overwrite] [--dtype float32|bfloat16]
    fmoe checkpoint import-hf HF_DIR --out CHECKPOINT_DIR
    fmoe schedule show NAME --pp P --microbatches M [--png FILE] [--csv FILE]
    fmoe schedule check FILE.csv

Run on several processes with ``torchrun --nproc-per-node N -m fmoe train RECIPE``.
Bad input ends with one line, ``fmoe: error: ...``, naming the field or file, and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from safetensors import SafetensorError

from fmoe.checkpoint import CheckpointWriteError


def default_recipe() -> Path:
    """The embedded tiny recipe, shipped inside the package."""
    return Path(str(resources.files("fmoe.recipes").joinpath("tiny.toml")))


def cmd_train(args: argparse.Namespace) -> int:
    from fmoe import recipe as R
    from fmoe.train import train

    overrides = dict(R.parse_override(s) for s in args.set)
    result = train(R.load(args.recipe or default_recipe(), overrides))
    if result.losses:
        print(
            f"trained to step {result.step}: loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}, "
            f"{result.tokens_per_second:,.0f} tokens/s, {result.wall_seconds:.1f} s; checkpoint {result.checkpoint}"
        )
    else:
        print(f"nothing to do: the latest checkpoint is already at step {result.step}")
    return 0


def cmd_export_hf(args: argparse.Namespace) -> int:
    import torch

    from fmoe import checkpoint, hf
    from fmoe import recipe as R

    recipe = R.load(args.recipe)
    path = Path(args.checkpoint)
    if (path / checkpoint.MODEL).is_file() is False:
        found = checkpoint.latest(path)
        if found is None:
            raise FileNotFoundError(f"{path}: no checkpoint (no model.safetensors, no step_* folder)")
        path = Path(found)
    # read lazily: the export assembles one canonical tensor at a time from the checkpoint's pieces
    params = checkpoint.open_checkpoint(path).tensors("model")
    # default: the checkpoint's own dtype (fp32 masters stay fp32; a cast is asked for by --dtype)
    dtype = None if args.dtype is None else {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    try:
        out = hf.export_hf(
            recipe.model_family, recipe.model, params, args.out, dtype=dtype,
            tokenizer=recipe.data.tokenizer, overwrite=args.overwrite, protect=(path,),
        )  # fmt: skip
    except hf.WeightsMismatch as e:
        raise ValueError(f"{path} is not a checkpoint of {args.recipe}'s [model]: {e}") from None
    print(f"exported {path} -> {out}")
    return 0


def cmd_import_hf(args: argparse.Namespace) -> int:
    from fmoe import checkpoint, hf

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        # a folder of checkpoints would lose them to keep-N (and the import to their higher steps)
        raise ValueError(
            f"{out}: --out is not an empty folder; import into a new (or empty) checkpoint folder"
        )
    family, cfg, params = hf.import_hf(args.hf_dir)
    trainer_state = {"step": 0, "imported_from": str(args.hf_dir), "family": family}
    saved = checkpoint.save(out, 0, params, {}, trainer_state, keep=1)
    print(f"imported {args.hf_dir} ({family}) -> {saved}")
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="fmoe", description="Functional MoE trainer.")
    sub = top.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train from a recipe (the embedded tiny one by default)")
    p.add_argument("recipe", nargs="?", help="recipe TOML (default: the embedded recipes/tiny.toml)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a field")
    p.set_defaults(fn=cmd_train)

    sub.add_parser("data", help="build packed token datasets", add_help=False)
    sub.add_parser("schedule", help="show or check pipeline schedule tables", add_help=False)

    ck = sub.add_parser("checkpoint", help="convert checkpoints").add_subparsers(dest="action", required=True)
    e = ck.add_parser("export-hf", help="checkpoint -> Hugging Face folder")
    e.add_argument("checkpoint", help="a step_* folder or a checkpoint folder (its latest step)")
    e.add_argument("--recipe", required=True)
    e.add_argument("--out", required=True)
    e.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="cast the tensors (default: the checkpoint's dtype)",
    )
    e.add_argument(
        "--overwrite", action="store_true", help="replace a non-empty --out once the new export is complete"
    )
    e.set_defaults(fn=cmd_export_hf)
    i = ck.add_parser("import-hf", help="Hugging Face folder -> checkpoint")
    i.add_argument("hf_dir")
    i.add_argument("--out", required=True)
    i.set_defaults(fn=cmd_import_hf)
    return top


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        # data and schedule own their argument parsing
        if argv and argv[0] == "data":
            from fmoe import data

            return data.main(argv[1:])
        if argv and argv[0] == "schedule":
            from fmoe.schedules import cli

            return cli.main(argv[1:])
        args = parser().parse_args(argv)
        return args.fn(args)
    except (ValueError, OSError, KeyError, SafetensorError, CheckpointWriteError) as e:
        print(f"fmoe: error: {error_line(e)}", file=sys.stderr)
        return 2


def error_line(e: BaseException) -> str:
    """The exception as the one line the CLI promises (a KeyError's message unquoted; line breaks
    in a message folded into '; ')."""
    message = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    message = "; ".join(part.strip() for part in message.splitlines() if part.strip())
    return message or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
