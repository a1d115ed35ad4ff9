"""A training run's data: the recipe's dataset (built from ``data.build_from`` when missing), checked
against the recipe's tokenizer, vocabulary and step count, and its stream of step batches.

Errors are :class:`fmoe.recipe.RecipeError` one-liners naming the recipe's field.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from fmoe import data
from fmoe.recipe import Recipe, RecipeError

__all__ = ["batch_stream", "check_dataset_tokenizer", "ensure_dataset", "open_dataset", "to_device"]


# the builtin corpus a "builtin" build tokenizes, written inside the dataset folder it builds
BUILTIN_CORPUS = "builtin-corpus.txt"


def ensure_dataset(recipe: Recipe) -> Path:
    """The recipe's dataset folder, built first from ``data.build_from`` if it holds no dataset.

    A build goes only into a missing or empty folder, or one an interrupted build left (it resumes):
    a file, or a folder holding other files, is the user's and is refused untouched. With "builtin"
    the corpus is written inside the folder (``BUILTIN_CORPUS``), nothing beside it."""
    path = Path(recipe.data.path)
    if (path / "index.json").is_file():
        return path
    source = recipe.data.build_from
    where = f"{recipe.path}: data.path {str(path)!r}"
    if not source:
        raise RecipeError(f"{where} holds no dataset and data.build_from is empty")
    if path.exists() and not path.is_dir():
        raise RecipeError(f"{where} is a file, not a dataset folder")
    try:
        entries = {p.name for p in path.iterdir()} if path.is_dir() else set()
    except OSError as e:
        raise RecipeError(f"{where}: cannot read it ({e.strerror or e})") from None
    # a folder fmoe's own build left: its build.json (data.build resumes it, or refuses another
    # build's), or just the builtin corpus written before the build began
    if entries and "build.json" not in entries and entries != {BUILTIN_CORPUS}:
        raise RecipeError(
            f"{where} holds other files but no dataset (no index.json); data.build_from builds only "
            f"into a missing or empty folder"
        )
    if source != "builtin" and not Path(source).is_file():
        raise RecipeError(f"{recipe.path}: data.build_from file {source!r} not found")
    try:
        path.mkdir(parents=True, exist_ok=True)
        if source == "builtin":
            text = path / BUILTIN_CORPUS
            if not text.is_file():
                data.builtin_corpus(text, recipe.data.builtin_bytes)
            source = str(text)
        data.build([source], path, tokenizer=recipe.data.tokenizer, workers=min(2, os.cpu_count() or 1))
    except ValueError as e:  # the file's contents (data's errors name it)
        raise RecipeError(f"{recipe.path}: data.build_from: {e}") from None
    except OSError as e:
        raise RecipeError(f"{where}: cannot build the dataset there ({e.strerror or e})") from None
    return path


def check_dataset_tokenizer(recipe: Recipe) -> None:
    """An existing dataset must have been built with the recipe's ``data.tokenizer`` (its index.json
    records the tokenizer: kind, and the tokenizer.json's sha256); RecipeError naming both if not."""
    wanted = recipe.data.tokenizer
    if wanted != "bytes" and not Path(wanted).is_file():
        raise RecipeError(
            f"{recipe.path}: data.tokenizer {wanted!r}: file not found (give a tokenizer.json or 'bytes')"
        )
    path = Path(recipe.data.path)
    if not (path / "index.json").is_file():
        return  # built from data.build_from with data.tokenizer, so they agree
    try:
        recorded = data.TokenDataset(path).tokenizer
    except ValueError as e:
        raise RecipeError(f"{recipe.path}: data.path: {e}") from None
    built_with = recorded.get("path") or recorded.get("kind")
    if wanted == "bytes":
        same = recorded.get("kind") == "bytes"
    else:
        file = Path(wanted)
        same = (
            recorded.get("kind") == "hf"
            and recorded.get("sha256") == hashlib.sha256(file.read_bytes()).hexdigest()
        )
    if not same:
        raise RecipeError(
            f"{recipe.path}: data.tokenizer {wanted!r} is not the tokenizer dataset {str(path)!r} was built with "
            f"({built_with}): set data.tokenizer to it, or point data.path at a dataset built with {wanted!r}"
        )


def open_dataset(recipe: Recipe, vocab_size: int, rank: int, world: int) -> data.TokenDataset:
    """The recipe's dataset on every rank: rank 0 builds it when missing while the others wait;
    then its vocabulary must fit ``vocab_size`` and it must hold the run's steps."""
    if rank == 0:
        ensure_dataset(recipe)
    if world > 1:
        dist.barrier()
    dataset = data.TokenDataset(ensure_dataset(recipe))
    seq, global_batch = recipe.data.seq_len, recipe.train.global_batch
    try:
        data.check_vocab(dataset, vocab_size)
    except ValueError as e:
        raise RecipeError(f"{recipe.path}: {e}") from None
    try:
        data.check_size(dataset, steps=recipe.train.steps, global_batch=global_batch, seq=seq)
    except ValueError as e:
        # an existing data.path is used as it is: data.build_from builds only a missing one
        rebuild = (
            f" (data.build_from builds only a missing data.path: move {dataset.path} away to rebuild it)"
            if recipe.data.build_from
            else ""
        )
        raise RecipeError(f"{recipe.path}: {e}{rebuild}") from None
    return dataset


def batch_stream(recipe: Recipe, dataset: data.TokenDataset, cursor: int) -> Iterator[data.Batch]:
    """The run's endless step batches (``data.batches``) from sample ``cursor`` on (a resumed run's
    data cursor): ``(tokens, labels, next cursor)``, tokens and labels
    [microbatches, global_batch / microbatches, seq] int64."""
    global_batch = recipe.train.global_batch
    return data.batches(
        dataset,
        seq=recipe.data.seq_len,
        global_batch=global_batch,
        micro_batch=global_batch // recipe.train.microbatches,
        seed=recipe.data.shuffle_seed,
        cursor=cursor,
    )


def to_device(tokens: Tensor, labels: Tensor, device: torch.device) -> dict[str, Tensor]:
    """A step's batch as the step takes it: {"tokens", "labels"}, each [global_batch, seq] int64 on
    ``device`` (the micro-batch dimension folded in)."""
    return {"tokens": tokens.flatten(0, 1).to(device), "labels": labels.flatten(0, 1).to(device)}
