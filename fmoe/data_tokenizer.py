"""Tokenizers of a token dataset: the builtin ``"bytes"`` one, or a Hugging Face ``tokenizer.json``.

``"bytes"``: the UTF-8 bytes, ids 0..255, EOS = 256, so vocab_size = 257; needs nothing. A
tokenizer.json is identified in a dataset's index by its path and sha256 (:class:`TokenizerSpec`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from fmoe.data_inputs import expand_inputs, file_pieces, piece_texts

__all__ = ["BYTES_EOS", "BYTES_VOCAB", "EOS_CANDIDATES", "TokenizerSpec", "load_tokenizer", "train_tokenizer"]

BYTES_VOCAB, BYTES_EOS = 257, 256
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>")


@dataclass(frozen=True)
class TokenizerSpec:
    """What a dataset was tokenized with; recorded in index.json as its tokenizer identity.

    kind: "bytes" or "hf"; path and sha256 (of the tokenizer.json file) for "hf".
    """

    kind: str
    vocab_size: int
    eos_id: int
    eos_token: str | None = None
    path: str | None = None
    sha256: str | None = None


def load_tokenizer(tokenizer: str | os.PathLike = "bytes", eos_token: str | None = None) -> TokenizerSpec:
    """Resolve ``"bytes"`` or a tokenizer.json path to a :class:`TokenizerSpec`.

    For a tokenizer.json the EOS id is that of ``eos_token``, or of the first of EOS_CANDIDATES the
    tokenizer knows; ValueError naming the file when there is none.
    """
    if str(tokenizer) == "bytes":
        if eos_token is not None:
            raise ValueError("eos_token: the bytes tokenizer has a fixed EOS id (256); do not pass eos_token")
        return TokenizerSpec("bytes", BYTES_VOCAB, BYTES_EOS)
    from tokenizers import Tokenizer

    path = Path(tokenizer)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer: {path} does not exist (give a tokenizer.json or 'bytes')")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:
        raise ValueError(f"tokenizer: {path} is not a readable Hugging Face tokenizer.json ({e})") from e
    candidates = (eos_token,) if eos_token is not None else EOS_CANDIDATES
    for cand in candidates:
        eos_id = tok.token_to_id(cand)
        if eos_id is not None:
            break
    else:
        raise ValueError(f"tokenizer: {path} has no end-of-document token {list(candidates)}; pass eos_token")
    return TokenizerSpec(
        "hf",
        tok.get_vocab_size(with_added_tokens=True),
        eos_id,
        cand,
        str(path.resolve()),
        hashlib.sha256(path.read_bytes()).hexdigest(),
    )


def train_tokenizer(
    text_files: Sequence[str | os.PathLike],
    vocab_size: int,
    out_path: str | os.PathLike,
    eos_token: str = "<|endoftext|>",
) -> Path:
    """Train a byte-level BPE tokenizer (GPT-2 style pre-tokenizer, all 256 bytes in its alphabet, so
    any text encodes) on .txt / .jsonl / .parquet files; save it as a tokenizer.json at out_path.

    vocab_size counts the 256 byte tokens and ``eos_token``; it must be >= 257.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not (isinstance(vocab_size, int) and vocab_size >= 257):
        raise ValueError(f"vocab_size must be an int >= 257 (256 bytes + EOS), got {vocab_size!r}")
    files = expand_inputs(text_files)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts() -> Iterator[str]:
        for f in files:
            for piece, _ in file_pieces(f, 1 << 62):
                for text, _ in piece_texts(piece):
                    yield text if isinstance(text, str) else text.decode("utf-8", errors="replace")

    tok.train_from_iterator(texts(), trainer=trainer)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    tok.save(str(tmp))
    os.replace(tmp, out)
    return out
