"""Hugging Face checkpoints: export fmoe params to a folder transformers loads, and import back.

A family's contract (``fmoe.stages.family.Family``, its ``hf`` mapping) supplies the pure
conversions (``to_hf``, ``from_hf``, ``hf_config``, ``config_from_hf``); this module does the files: ``config.json`` and
``model.safetensors``, written atomically.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from fmoe.checkpoint import LazyTensors, StreamedSafetensors
from fmoe.recipe import check_scale
from fmoe.stages.family import BUILTIN_FAMILIES, Family
from fmoe.stages.family import lookup as family

__all__ = [
    "ExportError", "HFError", "ImportedCheckpoint", "WeightsMismatch", "export_hf", "family", "import_checkpoint",
    "import_hf",
]  # fmt: skip


class HFError(ValueError):
    """A Hugging Face folder fmoe cannot read, or a family that cannot read it; one line naming the
    file, key, tensor or family."""


def family_of_model_type(model_type: str) -> str:
    """The builtin family whose Hugging Face ``model_type`` is ``model_type``; HFError otherwise."""
    for name in BUILTIN_FAMILIES:
        fam = family(name)
        if fam.hf is not None and fam.hf.model_type == model_type:
            return name
    known = sorted(f.hf.model_type for f in map(family, BUILTIN_FAMILIES) if f.hf is not None)
    raise HFError(
        f"unknown model_type {model_type!r} (builtin: {known}); name the family that reads it: "
        "--family NAME|module.path or --recipe RECIPE"
    )


class ExportError(ValueError):
    """An export that would overwrite or delete something; the message names the folder."""


def byte_level_tokenizer_json(eos_token: str = "<|endoftext|>") -> str:
    """A ``tokenizers`` tokenizer.json whose ids are fmoe's byte ids: UTF-8 byte b -> id b, and
    ``eos_token`` -> 256 (``fmoe.data_tokenizer.BYTES_EOS``), so text encodes as ``fmoe data build
    --tokenizer bytes`` tokenizes it (no merges: one token per byte; no special tokens added on encode)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from fmoe.data_tokenizer import BYTES_EOS

    # The byte-level pre-tokenizer spells each byte as one printable character (GPT-2's table:
    # printable Latin-1 bytes stand for themselves, the others take the code points from 256 up, in
    # byte order); the vocabulary maps that character back to the byte's id.
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), 256),
    ]
    spelling: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    vocab = {spelling[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(eos_token, special=True, normalized=False)])
    if tok.token_to_id(eos_token) != BYTES_EOS:
        raise RuntimeError(
            f"byte tokenizer: {eos_token!r} got id {tok.token_to_id(eos_token)}, not {BYTES_EOS}"
        )
    return tok.to_str()


def _tokenizer_files(tokenizer: str | os.PathLike, max_length: int) -> dict[str, bytes]:
    """{file name: contents} of the exported tokenizer: tokenizer.json and tokenizer_config.json.

    tokenizer: "bytes" (fmoe's byte ids) or the path of the Hugging Face tokenizer.json the data was
    built with (copied as it is)."""
    from fmoe.data_tokenizer import load_tokenizer

    if str(tokenizer) == "bytes":
        eos = "<|endoftext|>"
        tokenizer_json = byte_level_tokenizer_json(eos).encode()
    else:
        spec = load_tokenizer(tokenizer)  # FileNotFoundError / ValueError naming the file
        eos = spec.eos_token
        tokenizer_json = Path(tokenizer).read_bytes()
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    return {
        "tokenizer.json": tokenizer_json,
        "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode(),
    }


def special_token_ids(tokenizer: str | os.PathLike | None) -> dict[str, int | None]:
    """config.json's ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` for a model trained on
    data ``tokenizer`` built (what transformers' ``generate`` starts from, stops at and pads with).

    eos_token_id: the data's end-of-document id (``fmoe.data_tokenizer.load_tokenizer``: 256 for
    "bytes", the EOS token's id for a tokenizer.json), which ``fmoe data build`` appends to every
    document.
    bos_token_id: the same id. The data build adds no BOS token (it encodes without special
    tokens), so every document but the stream's first starts right after an EOS: that is the
    token the model learned to begin a document from (GPT-2's convention), with the byte tokenizer
    too, which has no other special token.
    pad_token_id: None: packed sequences hold no padding; the model never saw a pad token.
    tokenizer None (no tokenizer exported, ids unknown): all three None, transformers' defaults.
    """
    from fmoe.data_tokenizer import load_tokenizer

    if tokenizer is None:
        return {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    eos = load_tokenizer(tokenizer).eos_id  # FileNotFoundError / ValueError naming the file
    return {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": None}


def _check_out_dir(out_dir: Path, overwrite: bool, protect: tuple[Path, ...]) -> None:
    """Refuse an output folder whose contents fmoe would destroy (ExportError naming it)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"{out_dir}: --out exists and is not a folder")
    cwd = Path.cwd().resolve()
    for kept in (cwd, *protect):
        if out_dir == kept or out_dir in kept.parents:
            what = "the current folder" if kept == cwd else str(kept)
            raise ExportError(
                f"{out_dir}: --out holds {what}; replacing it would delete it: choose another folder"
            )
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ExportError(
            f"{out_dir}: --out is not empty; choose a new folder, or pass --overwrite to replace it "
            "(after the new export is complete)"
        )


class WeightsMismatch(ValueError):
    """Weights that do not fit the config they are exported with; the message names the tensor."""


def _check_params_fit(fam: Family, cfg, meta: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
    """WeightsMismatch naming the first parameter that the config's model lacks, or has another
    shape. meta: {name: (shape, dtype)} of the weights (nothing is read)."""
    shapes = fam.param_shapes(cfg)
    missing = [n for n in shapes if n not in meta]
    extra = [n for n in meta if n not in shapes]
    if missing or extra:
        raise WeightsMismatch(
            f"the weights do not fit the model config: missing {missing[:3]}, unexpected {extra[:3]}"
        )
    for name, shape in shapes.items():
        if tuple(meta[name][0]) != tuple(shape):
            raise WeightsMismatch(
                f"the weights do not fit the model config: {name} has shape {list(meta[name][0])}, "
                f"the config gives {list(shape)}"
            )


def _hf_tensors_of(fam: Family, cfg, name: str, t: Tensor, dtype: torch.dtype | None) -> dict[str, Tensor]:
    """The Hugging Face tensors one canonical tensor becomes: the family's ``to_hf`` maps every
    parameter on its own (experts unstacked, transposed, a buffer dropped), so it is called on a
    one-entry dict. With meta tensors this gives names, shapes and dtypes without data."""
    return {k: v.to(dtype) if dtype else v for k, v in fam.to_hf(cfg, {name: t}).items()}


def _write_converted(writer, fam: Family, cfg, name: str, t: Tensor, dtype: torch.dtype | None) -> None:
    """Convert one canonical tensor and write its Hugging Face tensors (all freed on return)."""
    for key, v in _hf_tensors_of(fam, cfg, name, t.detach(), dtype).items():
        writer.write(key, v)


def _token_ids(hf_config: Mapping, from_tokenizer: Mapping[str, int | None]) -> dict[str, int | None]:
    """The special-token ids config.json gets: a family whose config carries one (its hf_config
    writes it) keeps it; the tokenizer's (``special_token_ids``) fill the rest. ExportError when the
    two name different ids: the exported tokenizer would not encode what the config says."""
    ids = dict(from_tokenizer)
    for key, ours in from_tokenizer.items():
        theirs = hf_config.get(key)
        if theirs is not None and ours is not None and theirs != ours:
            raise ExportError(
                f"the model config's {key} is {theirs}, the tokenizer's is {ours}: make them agree"
            )
        if theirs is not None:
            ids[key] = theirs
    return ids


def _umask() -> int:
    """The process's umask (reading it means setting it; it is put back at once)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def export_hf(
    family_name: str,
    cfg,
    params: Mapping[str, Tensor],
    out_dir: str | Path,
    dtype: torch.dtype | None = None,
    *,
    tokenizer: str | os.PathLike | None = None,
    overwrite: bool = False,
    protect: tuple[str | Path, ...] = (),
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (+ a tokenizer) for transformers; returns the folder.

    params: {name: tensor}, or a checkpoint's lazy view (``checkpoint.open_checkpoint(path).tensors()``):
    the export streams tensor by tensor, each canonical tensor read (assembled from its pieces),
    converted, written and freed before the next, so at most one full tensor is held at a time.
    dtype: the tensors' dtype in the file (None: as in ``params``, the checkpoint's own dtype).
    tokenizer: "bytes" or a tokenizer.json path: the data's tokenizer, written beside the model
    (tokenizer.json + tokenizer_config.json) so ``AutoTokenizer.from_pretrained`` gives the ids
    fmoe trained on, and its special-token ids into config.json (``special_token_ids``); None
    writes no tokenizer and null ids.
    overwrite: replace a non-empty ``out_dir`` (else ExportError, nothing touched). The export is
    written to a new sibling folder and renamed into place, so ``out_dir`` is only replaced once the
    new one is complete. protect: folders ``out_dir`` must neither be nor contain (the source).
    Files get the default permissions (the umask's).
    """
    # 1. the family, the output folder and the weights are checked before anything is written
    fam = family(family_name)
    if fam.hf is None:
        raise ExportError(f"model family {fam.name!r} has no Hugging Face mapping (its Family.hf is None)")
    out_dir = Path(out_dir).resolve()  # "." and "x/.." name their folder, not ""
    _check_out_dir(out_dir, overwrite, tuple(Path(p).resolve() for p in protect))
    meta = _weights_meta(params)
    _check_params_fit(fam, cfg, meta)
    # 2. the file's header, the tokenizer's files and the special-token ids
    specs = _hf_specs(fam, cfg, family_name, meta, dtype)
    longest = fam.sizes(cfg).max_positions or 10**30  # transformers' "no limit" is as large
    files = {} if tokenizer is None else _tokenizer_files(tokenizer, longest)
    token_ids = _token_ids(fam.hf_config(cfg), special_token_ids(tokenizer))
    # 3. everything written into a new sibling folder, then renamed into place
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{secrets.token_hex(4)}"
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{tag}")
    old = out_dir.with_name(f".{out_dir.name}.old-{tag}")
    os.mkdir(tmp)  # not mkdtemp: its 0700 would make the export private to this user
    try:
        _write_export(tmp, fam, cfg, params, list(meta), specs, dtype, token_ids, files)
        if out_dir.is_dir() and any(out_dir.iterdir()):
            os.replace(out_dir, old)  # only with overwrite (checked above); removed once tmp is in place
        os.replace(tmp, out_dir)  # onto a missing or empty folder
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not out_dir.exists():
            os.replace(old, out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def _weights_meta(params: Mapping[str, Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{name: (shape, dtype)} of the weights to export, without reading a checkpoint's tensors."""
    if isinstance(params, LazyTensors):
        return params.meta
    return {n: (tuple(t.shape), t.dtype) for n, t in params.items()}


def _hf_specs(fam: Family, cfg, family_name: str, meta: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
              dtype: torch.dtype | None) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:  # fmt: skip
    """The exported file's header: every Hugging Face tensor's (name, dtype, shape), in the order
    the canonical tensors come, from the family's ``to_hf`` on meta tensors (nothing is read).
    ValueError when two canonical tensors give the same Hugging Face name."""
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    source: dict[str, str] = {}
    for name, (shape, dt) in meta.items():
        for key, v in _hf_tensors_of(
            fam, cfg, name, torch.empty(shape, dtype=dt, device="meta"), dtype
        ).items():
            if key in source:
                raise ValueError(f"{family_name}.to_hf gives {key!r} for both {source[key]!r} and {name!r}")
            source[key] = name
            specs.append((key, v.dtype, tuple(v.shape)))
    return specs


def _write_export(tmp: Path, fam: Family, cfg, params: Mapping[str, Tensor], names: list[str],
                  specs: list[tuple[str, torch.dtype, tuple[int, ...]]], dtype: torch.dtype | None,
                  token_ids: Mapping[str, int | None], files: Mapping[str, bytes]) -> None:  # fmt: skip
    """Write the export's files into ``tmp``: model.safetensors (the canonical tensors ``names``
    streamed one at a time, in the order of the header ``specs``), config.json, the tokenizer's."""
    with StreamedSafetensors(tmp / "model.safetensors", specs, {"format": "pt"}) as writer:
        for name in names:
            _write_converted(writer, fam, cfg, name, params[name], dtype)
    os.chmod(tmp / "model.safetensors", 0o666 & ~_umask())
    config = fam.hf_config(cfg)
    config["torch_dtype"] = str(specs[0][1]).removeprefix("torch.")
    config.update(token_ids)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name, contents in files.items():
        (tmp / name).write_bytes(contents)


def _family(name: str) -> Family:
    """The family ``name`` names (a builtin name or a module's import path), HFError naming it otherwise."""
    try:
        return family(name)
    except ValueError as e:
        raise HFError(str(e)) from None


def import_hf(folder: str | Path, family_name: str | None = None) -> tuple[str, object, dict[str, Tensor]]:
    """Read a Hugging Face folder (config.json + one or more *.safetensors) -> (family, config, params).

    family_name: the family that reads it, a builtin name or the import path of a module exposing
    ``FAMILY`` (``fmoe.stages.family.lookup``); None: the builtin family of config.json's model_type.
    Nothing is guessed or dropped: every config.json key must be one the family honours or knows to
    be harmless (the ``honoured_fields`` / ``pinned_fields`` / ``metadata_fields`` of its ``hf``
    mapping), and every tensor must be one the config implies, at the shape it implies. Any other
    case raises a one-line HFError naming the file and the key or tensor (or the family).
    """
    # 1. config.json, and the family that reads it
    folder = Path(folder)
    config_path = folder / "config.json"
    hf = _read_hf_config(config_path)
    family_name = _reading_family(config_path, hf.get("model_type"), family_name)
    fam = _family(family_name)
    _check_model_type(config_path, hf.get("model_type"), family_name, fam)
    # 2. the files, the config they give and its sizes, before any tensor is read
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    try:
        cfg = fam.config_from_hf(hf)
    except ValueError as e:
        raise HFError(f"{config_path}: {e}") from None
    check_scale(fam.sizes(cfg), str(config_path))  # before anything walks the layers
    # 3. the tensors, converted to the family's canonical params
    tensors = _read_hf_tensors(files)
    try:
        return family_name, cfg, fam.from_hf(cfg, tensors)
    except KeyError as e:
        raise HFError(f"{folder}: {e.args[0]}") from None
    except ValueError as e:
        raise HFError(f"{folder}: {e}") from None


def _read_hf_config(config_path: Path) -> dict[str, Any]:
    """config.json as a dict; FileNotFoundError when missing, HFError when not a JSON object."""
    if not config_path.parent.is_dir():
        raise FileNotFoundError(f"{config_path.parent}: no such Hugging Face folder")
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: no config.json in the Hugging Face folder")
    try:
        hf = json.loads(config_path.read_text())
    except (ValueError, RecursionError) as e:  # a RecursionError: brackets nested too deep
        raise HFError(f"{config_path}: not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(hf, dict):
        raise HFError(f"{config_path}: not a JSON object")
    return hf


def _reading_family(config_path: Path, model_type: str | None, family_name: str | None) -> str:
    """The name of the family that reads the folder: ``family_name``, or the builtin family of
    ``model_type`` when None (HFError when there is none)."""
    if family_name is not None:
        return family_name
    if model_type is None:
        raise HFError(f"{config_path}: no model_type (known families: {sorted(BUILTIN_FAMILIES)})")
    try:
        return family_of_model_type(model_type)
    except HFError as e:
        raise HFError(f"{config_path}: {e}") from None


def _check_model_type(config_path: Path, model_type: str | None, family_name: str, fam: Family) -> None:
    """HFError when the family has no Hugging Face mapping, or reads another model_type."""
    try:
        mapping = fam.hf_mapping()
    except ValueError as e:
        raise HFError(str(e)) from None
    if model_type is not None and model_type != mapping.model_type:
        raise HFError(
            f"{config_path}: model_type {model_type!r} is not the family asked for, {family_name!r} "
            f"(it reads {mapping.model_type!r})"
        )


def _read_hf_tensors(files: list[Path]) -> dict[str, Tensor]:
    """Every tensor of the folder's *.safetensors files; HFError naming an unreadable file or a
    tensor two files hold."""
    tensors: dict[str, Tensor] = {}
    for f in files:
        try:
            loaded = load_file(f)
        except (SafetensorError, OSError) as e:
            raise HFError(f"{f}: unreadable safetensors file ({e})") from None
        twice = sorted(set(loaded) & set(tensors))
        if twice:
            raise HFError(f"{f}: tensor {twice[0]!r} is also in another *.safetensors file of the folder")
        tensors.update(loaded)
    return tensors


@dataclass(frozen=True)
class ImportedCheckpoint:
    """What ``import_checkpoint`` wrote: the checkpoint's step folder, the family that read the
    Hugging Face folder (as a recipe's model.family names it) and the config config.json gave."""

    path: Path
    family: str
    config: Any


def import_checkpoint(
    folder: str | Path, out: str | Path, family_name: str | None = None, model: Any = None
) -> ImportedCheckpoint:
    """Import a Hugging Face folder (``import_hf``) into a new fmoe checkpoint folder ``out``: step 0,
    the params, no optimizer state (what ``fmoe checkpoint import-hf`` does; ``fmoe train`` resumes
    from it with a recipe whose [model] fits).

    family_name: as ``import_hf``'s. model: a recipe's [model] config the weights must fit
    (WeightsMismatch naming the first tensor that does not), or None. ``out`` must be missing or
    empty (HFError): a folder of checkpoints would lose them to keep-N, and the import to their
    higher steps.
    """
    from fmoe import checkpoint

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise HFError(f"{out}: --out is not an empty folder; import into a new (or empty) checkpoint folder")
    name, cfg, params = import_hf(folder, family_name)
    if model is not None:
        _check_params_fit(_family(name), model, {n: (tuple(t.shape), t.dtype) for n, t in params.items()})
    trainer_state = {"step": 0, "imported_from": str(folder), "family": name}
    return ImportedCheckpoint(checkpoint.save(out, 0, params, {}, trainer_state, keep=1), name, cfg)
