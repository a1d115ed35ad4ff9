"""``fmoe checkpoint export-hf`` / ``import-hf``: they never delete what fmoe did not write, the export
keeps the checkpoint's dtype, has ordinary permissions, and carries a tokenizer transformers loads
that gives fmoe's ids (and, with the model, fmoe's logits)."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from safetensors.torch import load_file
from test_train import MODEL, toml_text

from fmoe import checkpoint, cli, data, data_tokenizer, hf
from fmoe import recipe as R
from fmoe.stages import qwen3_moe


@pytest.fixture
def run(tmp_path):
    """A saved fp32 checkpoint folder and a recipe for it: (checkpoint dir, recipe path, recipe)."""
    d = {"model": dict(MODEL), "data": {"path": str(tmp_path / "data"), "seq_len": 32}}
    recipe_path = tmp_path / "r.toml"
    recipe_path.write_text(toml_text(d))
    recipe = R.load(recipe_path)
    params = qwen3_moe.init_params(recipe.model, seed=3)
    ckpt = tmp_path / "ckpt"
    checkpoint.save(ckpt, 5, params, {}, {"step": 5}, keep=2)
    return ckpt, recipe_path, recipe


def export(args, capsys) -> tuple[int, str]:
    code = cli.main(["checkpoint", "export-hf", *map(str, args)])
    return code, capsys.readouterr().err


def tree(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_one_line_error(code: int, err: str, *names: str) -> None:
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("fmoe: error: "), err
    for name in names:
        assert name in err, (name, err)


def test_export_refuses_a_non_empty_out_and_leaves_its_files(run, tmp_path, capsys):
    ckpt, recipe_path, _ = run
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    (out / "sub").mkdir()
    (out / "sub" / "data.bin").write_bytes(b"\x00\x01")
    before = tree(out)
    code, err = export([ckpt, "--recipe", recipe_path, "--out", out], capsys)
    assert_one_line_error(code, err, str(out), "not empty", "--overwrite")
    assert tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "mine", "r.toml"]  # no temp left


def test_export_to_the_current_folder_is_refused_even_with_overwrite(run, tmp_path, capsys, monkeypatch):
    ckpt, recipe_path, _ = run
    here = tmp_path / "work"
    here.mkdir()
    (here / "precious.py").write_text("print('keep me')")
    monkeypatch.chdir(here)
    for extra in ([], ["--overwrite"]):
        code, err = export([ckpt, "--recipe", recipe_path, "--out", ".", *extra], capsys)
        assert_one_line_error(code, err, str(here))
        assert tree(here) == {"precious.py": b"print('keep me')"}
    # a parent of the current folder, or the checkpoint being exported, are no better
    code, err = export([ckpt, "--recipe", recipe_path, "--out", "..", "--overwrite"], capsys)
    assert_one_line_error(code, err, str(tmp_path), "current folder")
    code, err = export([ckpt, "--recipe", recipe_path, "--out", ckpt, "--overwrite"], capsys)
    assert_one_line_error(code, err, str(ckpt))
    assert checkpoint.latest(ckpt) is not None


def test_overwrite_replaces_the_folder_only_once_the_new_export_is_complete(
    run, tmp_path, capsys, monkeypatch
):
    ckpt, recipe_path, _ = run
    out = tmp_path / "hf"
    out.mkdir()
    (out / "old.txt").write_text("old export")

    def failing_writer(*args, **kwargs):  # the streamed model.safetensors writer hits a full disk
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(hf, "StreamedSafetensors", failing_writer)
        code, err = export([ckpt, "--recipe", recipe_path, "--out", out, "--overwrite"], capsys)
    assert_one_line_error(code, err, "No space left on device")
    assert tree(out) == {"old.txt": b"old export"}  # the old folder survives a failed export

    code, err = export([ckpt, "--recipe", recipe_path, "--out", out, "--overwrite"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf", "r.toml"]  # no temp left


def test_exported_files_get_the_umasks_permissions_and_the_checkpoints_dtype(run, tmp_path, capsys):
    ckpt, recipe_path, _ = run
    old_umask = os.umask(0o022)
    try:
        code, err = export([ckpt, "--recipe", recipe_path, "--out", tmp_path / "hf"], capsys)
    finally:
        os.umask(old_umask)
    assert code == 0, err
    out = tmp_path / "hf"
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    for f in out.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f.name
    tensors = load_file(out / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    # the saved fp32 weights, bit for bit
    params, _, _ = checkpoint.load(checkpoint.latest(ckpt))
    assert torch.equal(tensors["model.embed_tokens.weight"], params["model.embed_tokens.weight"])
    # --dtype still casts when asked
    code, err = export(
        [ckpt, "--recipe", recipe_path, "--out", tmp_path / "bf16", "--dtype", "bfloat16"], capsys
    )
    assert code == 0, err
    assert {t.dtype for t in load_file(tmp_path / "bf16" / "model.safetensors").values()} == {torch.bfloat16}


def test_the_export_loads_in_transformers_with_fmoes_ids_and_logits(run, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    ckpt, recipe_path, recipe = run
    out = tmp_path / "hf"
    code, err = export([ckpt, "--recipe", recipe_path, "--out", out], capsys)
    assert code == 0, err

    text = "Mixture of experts: ünïcode, tabs\tand emoji 😀 too.\n"
    corpus = tmp_path / "doc.txt"
    corpus.write_text(text)
    data.build([corpus], tmp_path / "ds", tokenizer="bytes", workers=1)
    ds = data.TokenDataset(tmp_path / "ds")
    fmoe_ids = ds.read(0, len(ds)).tolist()

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenizer(text)["input_ids"]
    assert ids + [tokenizer.eos_token_id] == fmoe_ids
    assert tokenizer.decode(ids) == text
    # config.json's special ids: the data's end-of-document id, which also precedes every document
    # but the first (fmoe's data has no BOS); no padding
    config = transformers.AutoConfig.from_pretrained(out)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        fmoe_ids[-1],
        fmoe_ids[-1],
        None,
    )

    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    params, _, _ = checkpoint.load(checkpoint.latest(ckpt))
    tokens = torch.tensor([ids[:24]])
    with torch.no_grad():
        theirs = model(tokens).logits
        ours = qwen3_moe.logits(recipe.model, params, tokens)
    assert theirs.dtype == torch.float32
    # both fp32, the same GEMMs in possibly another order: float32 rounding (as tests/test_hf.py)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_recipes_tokenizer_json_is_copied_into_the_export(run, tmp_path, capsys):
    ckpt, _, _ = run
    tokenizer = tmp_path / "my_tokenizer.json"
    tokenizer.write_text(hf.byte_level_tokenizer_json())
    d = {
        "model": dict(MODEL),
        "data": {"path": str(tmp_path / "data"), "seq_len": 32, "tokenizer": str(tokenizer)},
    }
    recipe_path = tmp_path / "hf_tok.toml"
    recipe_path.write_text(toml_text(d))
    code, err = export([ckpt, "--recipe", recipe_path, "--out", tmp_path / "hf"], capsys)
    assert code == 0, err
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|endoftext|>"
    ids = {
        k: v for k, v in json.loads((tmp_path / "hf" / "config.json").read_text()).items() if "token_id" in k
    }
    eos = data_tokenizer.load_tokenizer(tokenizer).eos_id
    assert ids == {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": None}


def test_an_export_without_a_tokenizer_writes_null_token_ids(run, tmp_path):
    _, _, recipe = run
    params = qwen3_moe.init_params(recipe.model, seed=3)
    config = json.loads(
        (hf.export_hf("qwen3_moe", recipe.model, params, tmp_path / "hf") / "config.json").read_text()
    )
    assert [config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")] == [None, None, None]


def test_the_export_reads_only_the_recipes_model_so_a_longer_seq_len_is_no_obstacle(run, tmp_path, capsys):
    # data.seq_len left at its default (128), beyond the model's 64 positions, and no data folder:
    # training refuses the recipe; the export reads no data
    ckpt, _, _ = run
    d = {"model": {**MODEL, "max_position_embeddings": 64}, "data": {"path": str(tmp_path / "none")}}
    recipe_path = tmp_path / "long.toml"
    recipe_path.write_text(toml_text(d))
    with pytest.raises(
        R.RecipeError, match=r"max_position_embeddings \(64\) must be >= data\.seq_len \(128\)"
    ):
        R.load(recipe_path)
    code, err = export([ckpt, "--recipe", recipe_path, "--out", tmp_path / "hf"], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["max_position_embeddings"] == 64
    code = cli.main(["checkpoint", "import-hf", str(tmp_path / "hf"), "--recipe", str(recipe_path),
                     "--out", str(tmp_path / "back")])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    params, _, _ = checkpoint.load(checkpoint.latest(ckpt))
    back, _, _ = checkpoint.load(checkpoint.latest(tmp_path / "back"))
    assert set(back) == set(params) and all(torch.equal(back[n], t) for n, t in params.items())


def test_import_into_a_folder_of_checkpoints_is_refused_and_deletes_nothing(run, tmp_path, capsys):
    ckpt, recipe_path, _ = run
    code, err = export([ckpt, "--recipe", recipe_path, "--out", tmp_path / "hf"], capsys)
    assert code == 0, err
    params, _, _ = checkpoint.load(checkpoint.latest(ckpt))
    checkpoint.save(ckpt, 9, params, {}, {"step": 9}, keep=2)
    before = tree(ckpt)
    code = cli.main(["checkpoint", "import-hf", str(tmp_path / "hf"), "--out", str(ckpt)])
    assert_one_line_error(code, capsys.readouterr().err, str(ckpt), "not an empty folder")
    assert tree(ckpt) == before
    # into a new folder it works, and the import is the latest checkpoint there
    code = cli.main(["checkpoint", "import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "new")])
    assert code == 0, capsys.readouterr().err
    assert checkpoint.latest(tmp_path / "new").name.endswith("0")


def test_a_recipe_whose_model_does_not_fit_the_checkpoint_is_refused_naming_the_tensor(run, tmp_path, capsys):
    ckpt, _, _ = run
    d = {"model": {**MODEL, "hidden_size": 48}, "data": {"path": str(tmp_path / "data"), "seq_len": 32}}
    recipe_path = tmp_path / "wider.toml"
    recipe_path.write_text(toml_text(d))
    code, err = export([ckpt, "--recipe", recipe_path, "--out", tmp_path / "hf"], capsys)
    assert_one_line_error(code, err, str(recipe_path), "model.embed_tokens.weight", "[264, 32]", "[264, 48]")
    assert not (tmp_path / "hf").exists()
