"""The ``fmoe`` command.

    fmoe train [RECIPE] [--set SECTION.KEY=VALUE ...]     train (the embedded tiny recipe by default)
    fmoe data build INPUTS... --out DIR [--tokenizer tokenizer.json|bytes] [--workers N]
    fmoe checkpoint export-hf CHECKPOINT --recipe RECIPE --out DIR [--overwrite] [--dtype float32|bfloat16]
    fmoe checkpoint import-hf HF_DIR --out CHECKPOINT_DIR [--family NAME|module.path | --recipe RECIPE]
    fmoe schedule show NAME --pp P --microbatches M [--png FILE] [--csv FILE]
    fmoe schedule check FILE.csv
    fmoe plan RECIPE --nproc N [--device-memory GIB] [--layout PP,DP,CP,EP] [--fitting]
              [--auto | --recompute none|full|selective --merge-window N --[no-]offload] [--set ...]

Run on several processes with ``torchrun --nproc-per-node N -m fmoe train RECIPE``.
Bad input ends with one line, ``fmoe: error: ...``, naming the field or file, and exit status 2
(``is_bad_input``: fmoe's typed errors). Anything else is a bug - fmoe's, or in a model family's
own code - and keeps its traceback (exit status 1), which ends where it was raised.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from importlib import resources
from pathlib import Path

from safetensors import SafetensorError

from fmoe import checkpoint
from fmoe.recipe import RecipeError


class UsageError(ValueError):
    """A command-line argument the command cannot use; the message names it."""


def default_recipe() -> Path:
    """The embedded tiny recipe, shipped inside the package."""
    return Path(str(resources.files("fmoe.recipes").joinpath("tiny.toml")))


def cmd_train(args: argparse.Namespace) -> int:
    from fmoe import recipe as R
    from fmoe.preemption import Aborted
    from fmoe.train import train

    overrides = dict(R.parse_override(s) for s in args.set)
    recipe = R.load(args.recipe or default_recipe(), overrides)
    try:
        result = train(recipe)
    except Aborted as e:
        newest = checkpoint.latest(recipe.checkpoint.dir)
        print(f"fmoe: {e}; the newest checkpoint is {newest}", file=sys.stderr, flush=True)
        return 128 + e.signum
    if result.stopped_by is not None:  # every rank: each says which signal it saw
        print(f"stopped by {result.stopped_by} after step {result.step}: checkpoint {result.checkpoint} "
              f"(the same command resumes from it)")  # fmt: skip
    elif os.environ.get("RANK", "0") != "0":  # torchrun's rank: one closing line per run, rank 0's
        return 0
    elif result.losses:
        mfu = "" if result.mfu is None else f", MFU {100 * result.mfu:.1f}%"
        print(
            f"trained to step {result.step}: loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}, "
            f"{result.tokens_per_second:,.0f} tokens/s{mfu} (steady state: without the first step and "
            f"{result.save_seconds:.1f} s of saving), {result.wall_seconds:.1f} s; checkpoint {result.checkpoint}"
        )
    else:
        print(f"nothing to do: the latest checkpoint is already at step {result.step}")
    return 0


def cmd_export_hf(args: argparse.Namespace) -> int:
    import torch

    from fmoe import checkpoint, hf
    from fmoe import recipe as R

    recipe = R.load_model(args.recipe)  # [model] and data.tokenizer: an export reads no data
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
            tokenizer=recipe.tokenizer, overwrite=args.overwrite, protect=(path,),
        )  # fmt: skip
    except hf.WeightsMismatch as e:
        raise hf.WeightsMismatch(f"{path} is not a checkpoint of {args.recipe}'s [model]: {e}") from None
    print(f"exported {path} -> {out}")
    return 0


def cmd_import_hf(args: argparse.Namespace) -> int:
    from fmoe import hf
    from fmoe import recipe as R

    # the family that reads the folder: named, the recipe's model.family, or config.json's model_type's
    recipe = None if args.recipe is None else R.load_model(args.recipe)
    family = args.family if recipe is None else recipe.model_family
    try:
        imported = hf.import_checkpoint(
            args.hf_dir, args.out, family, None if recipe is None else recipe.model
        )
    except hf.WeightsMismatch as e:
        raise hf.WeightsMismatch(f"{args.hf_dir} does not fit {args.recipe}'s [model]: {e}") from None
    print(f"imported {args.hf_dir} ({imported.family}) -> {imported.path}")
    return 0


def _plan_policy(memory, args: argparse.Namespace):
    """The recipe's ``[memory]`` with ``fmoe plan``'s overrides: --auto plans ``memory.policy =
    "auto"``; --recompute / --merge-window / --offload plan that explicit policy (on the recipe's)."""
    import dataclasses

    from fmoe.memory_policy import MemoryPolicy

    changes = {"recompute": args.recompute, "merge_window": args.merge_window, "offload": args.offload}
    changes = {k: v for k, v in changes.items() if v is not None}
    if args.auto:
        if changes:
            raise UsageError(
                f"--auto lets the plan pick the policy: drop --{next(iter(changes)).replace('_', '-')}"
            )
        return MemoryPolicy(policy="auto")
    if not changes:
        return memory
    try:
        return dataclasses.replace(memory, policy="explicit", **changes)
    except (
        ValueError
    ) as err:  # named as the flag that set it: "MemoryPolicy.merge_window" -> "--merge-window"
        flagged = [(f"MemoryPolicy.{k}", "--" + k.replace("_", "-")) for k in changes]
        text = str(err)
        for field_name, flag in flagged:
            text = text.replace(field_name, flag)
        raise UsageError(text) from None


def _shown_layout(args, recipe, choices, limit, pick):
    """The layout whose ranks ``fmoe plan`` prints: --layout's, else the recipe's if it fits, else
    the best that does, else the recipe's (to see why not)."""
    from fmoe import plan_text

    if args.layout:
        try:
            sizes = tuple(int(v) for v in args.layout.split(","))
        except ValueError:
            sizes = ()
        if len(sizes) != 4:
            raise UsageError(f"--layout must be PP,DP,CP,EP (four integers), got {args.layout!r}")
        if sizes not in [c.plan.sizes for c in choices]:
            raise UsageError(f"--layout {args.layout}: not a layout of {plan_text.processes(args.nproc)} this recipe can run "
                             f"(see the list without --layout)")  # fmt: skip
        return pick(sizes)
    p = recipe.parallel
    own = [c for c in choices if c.plan.sizes == (p.pp, p.dp, p.cp, p.ep)]
    fitting = [c for c in choices if c.plan.fits(limit)]
    return ([c for c in own if c.plan.fits(limit)] or fitting or own or choices)[0]


def cmd_plan(args: argparse.Namespace) -> int:
    from fmoe import plan, plan_policy, plan_text
    from fmoe import recipe as R
    from fmoe.check import check_family
    from fmoe.hf import family as family_module

    recipe = R.load(args.recipe, dict(R.parse_override(s) for s in args.set))
    if args.nproc < 1:
        raise UsageError(f"--nproc must be >= 1, got {args.nproc}")
    if args.device_memory is not None and not args.device_memory > 0:
        raise UsageError(f"--device-memory must be > 0 GiB, got {args.device_memory}")
    gib = args.device_memory if args.device_memory is not None else recipe.train.device_memory_gib
    limit = gib * plan.GiB if gib else None
    device = "cpu" if recipe.train.device == "cpu" else "cuda"
    fam = family_module(recipe.model_family)
    check_family(fam, recipe.model)  # a broken family named before planning it
    model, shapes = fam.build(recipe.model), fam.param_shapes(recipe.model)
    working_set = None if args.working_set is None else plan.WorkingSet(args.working_set)
    policy = _plan_policy(recipe.memory, args)
    options = {"device": device, "working_set": working_set, "policy": policy}
    choices = plan_policy.choose_layouts(recipe, model, shapes, args.nproc, limit,
                                         supports_cp=fam.supports_context_parallel, **options)  # fmt: skip
    if not choices:
        raise RecipeError(f"{args.recipe}: no layout of {plan_text.processes(args.nproc)} suits the recipe's sizes "
                         f"(train.global_batch, train.microbatches, model.num_experts, parallel.schedule)")  # fmt: skip
    shown = _shown_layout(
        args,
        recipe,
        choices,
        limit,
        lambda sizes: plan_policy.choose(recipe, model, shapes, sizes, limit, **options),
    )
    params = sum(math.prod(s) for s in shapes.values())
    fit = [c for c in choices if c.plan.fits(limit)]
    listed = fit if args.fitting else choices
    limit_text = "no device limit" if limit is None else f"{plan_text.human(limit)} per device"
    who = "memory.policy = 'auto': each layout's fastest policy that fits" if policy.policy == "auto" else (
        plan_text.policy_text(policy))  # fmt: skip
    print(f"memory plan of {args.recipe}: {recipe.model_family}, {plan_text.count(params)} parameters, "
          f"{recipe.train.dtype} compute, {plan_text.processes(args.nproc)}, {limit_text}, "
          f"gathers {_gathers_text(recipe, working_set)}, {who}")  # fmt: skip
    print(f"layouts ({len(fit)} of {len(choices)} fit{'; those that fit' if args.fitting else ''}), fewest idle "
          f"first; time: the policy's modelled extra time per layer (fmoe.plan_time):")  # fmt: skip
    for line in plan_text.table_lines([c.plan for c in listed], limit, listed):
        print("  " + line)
    print(f"per rank, {plan_text.layout_name(shown.plan)} ({shown.plan.schedule}, bubble {shown.plan.bubble:.3f}), "
          f"{plan_text.choice_text(shown.policy, shown.cost, shown.auto, limit is not None)}:")  # fmt: skip
    for line in plan_text.rank_lines(shown.plan):
        print("  " + line)
    return 0


def _gathers_text(recipe, working_set) -> str:
    """How the planned steps gather their parameters, for the plan's header."""
    if working_set is not None:
        return working_set.value
    return "once a step (train.fp8: FP8 steps do)" if recipe.train.fp8 else "per parallel.gather"


def _plan_arguments(pl: argparse.ArgumentParser) -> None:
    """The arguments of ``fmoe plan``."""
    pl.add_argument("recipe", help="recipe TOML")
    pl.add_argument("--nproc", type=int, required=True, help="processes (GPUs) of the job")
    pl.add_argument("--device-memory", type=float, default=None, metavar="GIB",
                    help="memory per device, GiB (default: train.device_memory_gib; 0 or unset: no limit)")  # fmt: skip
    pl.add_argument("--layout", default=None, metavar="PP,DP,CP,EP",
                    help="print this layout's ranks (default: the recipe's, else the best that fits)")  # fmt: skip
    pl.add_argument("--working-set", choices=["step", "unit"], default=None,
                    help="plan gathers per step or per pipeline chunk / layer (default: what the "
                         "recipe's parallel.gather makes parallel_step do)")  # fmt: skip
    pl.add_argument("--fitting", action="store_true", help="list only the layouts that fit")
    pl.add_argument("--auto", action="store_true",
                    help="plan with memory.policy = 'auto': each layout's fastest policy that fits")  # fmt: skip
    pl.add_argument("--recompute", choices=["none", "full", "selective"], default=None,
                    help="plan with this memory.recompute (default: the recipe's)")  # fmt: skip
    pl.add_argument("--merge-window", type=int, default=None, metavar="N",
                    help="plan with this memory.merge_window (default: the recipe's)")  # fmt: skip
    pl.add_argument(
        "--offload",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="plan with memory.offload on / off (default: the recipe's)",
    )
    pl.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a field"
    )


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="fmoe", description="Functional MoE trainer.")
    sub = top.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train from a recipe (the embedded tiny one by default)")
    p.add_argument("recipe", nargs="?", help="recipe TOML (default: the embedded recipes/tiny.toml)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a field")
    p.set_defaults(fn=cmd_train)

    pl = sub.add_parser("plan", help="memory per rank of each layout of N processes, and which fit")
    _plan_arguments(pl)
    pl.set_defaults(fn=cmd_plan)

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
    reader = i.add_mutually_exclusive_group()
    reader.add_argument("--family", metavar="NAME|module.path",
                        help="the family that reads the folder: a builtin name or the import path of a module "
                             "exposing FAMILY (default: the builtin family of config.json's model_type)")  # fmt: skip
    reader.add_argument(
        "--recipe", help="read it with this recipe's model.family; the weights must fit its [model]"
    )
    i.set_defaults(fn=cmd_import_hf)
    return top


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _run(argv)
        sys.stdout.flush()  # a reader that went away is met here, not at the interpreter's exit
        return code
    except BrokenPipeError:
        # the reader went away (`fmoe plan ... | head`): not bad input, nothing to say; stdout is
        # pointed at devnull so that the interpreter's last flush does not raise again
        with contextlib.suppress(OSError, ValueError):  # ValueError: a stdout with no descriptor
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # as a writer killed by SIGPIPE
    except Exception as e:
        if not is_bad_input(e, argv[0] if argv else ""):
            raise  # a bug, fmoe's or in a family's own code: its traceback says where
        print(f"fmoe: error: {error_line(e)}", file=sys.stderr)
        return 2


def _run(argv: list[str]) -> int:
    # data and schedule own their argument parsing
    if argv and argv[0] == "data":
        from fmoe import data

        return data.main(argv[1:])
    if argv and argv[0] == "schedule":
        from fmoe.schedules import cli

        return cli.main(argv[1:])
    args = parser().parse_args(argv)
    return args.fn(args)


def is_bad_input(e: BaseException, command: str) -> bool:
    """Whether ``e`` reports bad input, which the CLI prints as one line with exit status 2: fmoe's
    typed errors for a recipe, an argument, a schedule table, a mesh, a checkpoint, a model family
    or an export, a run that diverged, and a file that cannot be read or written (OSError, a
    malformed safetensors file). A Hugging Face folder's bad config.json or tensor is an HFError
    (``fmoe.hf`` types what the family's ``HFMapping`` refuses)."""
    from fmoe.check import FamilyError
    from fmoe.checkpoint import CheckpointError
    from fmoe.hf import ExportError, HFError, WeightsMismatch
    from fmoe.mesh import MeshError
    from fmoe.schedules.table import ScheduleError
    from fmoe.train import NonFiniteError

    typed = (RecipeError, UsageError, ScheduleError, MeshError, CheckpointError, FamilyError, HFError,
             ExportError, WeightsMismatch, NonFiniteError, OSError, SafetensorError)  # fmt: skip
    return isinstance(e, typed)


def error_line(e: BaseException) -> str:
    """The exception as the one line the CLI promises (a KeyError's message unquoted; line breaks
    in a message folded into '; ')."""
    message = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    message = "; ".join(part.strip() for part in message.splitlines() if part.strip())
    return message or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
