"""A family outside fmoe goes to Hugging Face and comes back by command (the README's "Write your own
model family" section, its HF part, run as printed).

The section's blocks: ```python my_gpt.py (the family), ```python my_gpt.py, continued (its
HFMapping, appended to the file), ```toml my_gpt.toml (its recipe) and ```bash my_gpt hf (export,
then import with ``--family`` and with ``--recipe``). The test writes the files into an empty
folder, saves a checkpoint of the family there (what training would leave: no step is needed to
convert one), runs the commands as printed and compares the imported tensors with the saved ones.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fmoe import checkpoint, cli, recipe
from fmoe.stages.family import HFMapping, lookup

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Write your own model family"


def section_block(tag: str) -> str:
    """The one code block of the README's section whose fence reads ```<tag>."""
    readme = (REPO / "README.md").read_text()
    assert SECTION in readme, f"the README lacks its section {SECTION!r}"
    body = readme.split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(rf"```{re.escape(tag)}\n(.*?)```", body, flags=re.S)
    assert len(blocks) == 1, f"{SECTION}: expected one ```{tag} block, found {len(blocks)}"
    return blocks[0]


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """An empty folder holding the README's my_gpt.py (with its HF mapping) and my_gpt.toml, and a
    checkpoint of the family at the recipe's checkpoint.dir; importable from this process too."""
    (tmp_path / "my_gpt.py").write_text(
        section_block("python my_gpt.py") + "\n" + section_block("python my_gpt.py, continued")
    )
    (tmp_path / "my_gpt.toml").write_text(section_block("toml my_gpt.toml"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_gpt", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def saved_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """Seeded params of the recipe's model saved where the recipe's training would save them."""
    r = recipe.load(folder / "my_gpt.toml")
    params = lookup(r.model_family).init_params(r.model, seed=5)
    checkpoint.save(folder / r.checkpoint.dir, 10, params, {}, {"step": 10}, keep=1)
    return params


def run_as_printed(command: str, folder: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    env.pop("PYTHONPATH", None)  # the commands set it themselves, as printed
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        ["bash", "-c", command], cwd=folder, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_readme_family_round_trips_through_hugging_face_by_command_bit_for_bit(user_folder):
    params = saved_checkpoint(user_folder)
    commands = [line.strip() for line in section_block("bash my_gpt hf").splitlines() if line.strip()]
    words = [shlex.split(c) for c in commands]
    assert [w[1:4] for w in words] == [["fmoe", "checkpoint", "export-hf"]] + [
        ["fmoe", "checkpoint", "import-hf"]
    ] * 2
    assert "--family" in words[1] and "--recipe" in words[2]
    for command in commands:
        child = run_as_printed(command, user_folder)
        assert child.returncode == 0, f"{command}\n{child.stderr[-3000:]}"

    config = json.loads((user_folder / "hf" / "config.json").read_text())
    assert config["model_type"] == "my_gpt" and config["n_layer"] == 4  # the recipe's, not the default 2
    # the byte tokenizer's end-of-document id, 256, also begins documents; no padding
    assert [config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")] == [256, 256, None]
    for out in (words[1], words[2]):
        folder = user_folder / out[out.index("--out") + 1]
        back, _, state = checkpoint.load(checkpoint.latest(folder))
        assert state["family"] == "my_gpt" and state["step"] == 0
        assert set(back) == set(params)
        for name, t in params.items():
            assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_without_a_family_the_readme_familys_folder_is_refused_naming_its_model_type(user_folder, capsys):
    from fmoe import hf

    r = recipe.load(user_folder / "my_gpt.toml")
    hf.export_hf("my_gpt", r.model, saved_checkpoint(user_folder), user_folder / "hf")
    code = cli.main(["checkpoint", "import-hf", "hf", "--out", "runs/imported"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("fmoe: error: "), err
    assert "model_type 'my_gpt'" in err and "--family" in err, err
    assert not (user_folder / "runs" / "imported").exists()


def test_an_unknown_family_is_one_line_naming_it_and_nothing_is_written(user_folder, capsys):
    from fmoe import hf

    r = recipe.load(user_folder / "my_gpt.toml")
    hf.export_hf("my_gpt", r.model, saved_checkpoint(user_folder), user_folder / "hf")
    code = cli.main(["checkpoint", "import-hf", "hf", "--family", "no_such_family", "--out", "runs/imported"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("fmoe: error: "), err
    assert "unknown model family 'no_such_family'" in err, err
    assert not (user_folder / "runs" / "imported").exists()
    # a builtin family that reads another model_type is refused naming both
    code = cli.main(["checkpoint", "import-hf", "hf", "--family", "qwen3_moe", "--out", "runs/imported"])
    err = capsys.readouterr().err
    assert code == 2 and "model_type 'my_gpt'" in err and "'qwen3_moe'" in err, err


def test_an_import_whose_weights_do_not_fit_the_recipes_model_is_refused_naming_the_tensor(
    user_folder, capsys
):
    from fmoe import hf

    r = recipe.load(user_folder / "my_gpt.toml")
    hf.export_hf("my_gpt", r.model, saved_checkpoint(user_folder), user_folder / "hf")
    (user_folder / "wide.toml").write_text(
        (user_folder / "my_gpt.toml").read_text().replace("n_layer = 4", "n_layer = 4\nn_embd = 32")
    )
    code = cli.main(["checkpoint", "import-hf", "hf", "--recipe", "wide.toml", "--out", "runs/imported"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "wide.toml" in err and "model.wte.weight" in err and "[264, 64]" in err and "[264, 32]" in err, err
    assert not (user_folder / "runs" / "imported").exists()


def test_a_mapping_reads_its_familys_config_class_only(user_folder):
    import my_gpt

    mapping = HFMapping(my_gpt.GPTConfig, architecture="MyGPTForCausalLM", model_type="my_gpt")
    # every field is a key config.json holds and the import honours; a key it does not know is refused
    assert mapping.honoured_fields == {f for f in vars(my_gpt.GPTConfig()) if not f.startswith("_")}
    cfg = my_gpt.GPTConfig(n_layer=3)
    assert mapping.config_from_hf(mapping.hf_config(cfg)) == cfg
    with pytest.raises(ValueError, match=r"'bias' is unknown"):
        mapping.config_from_hf({**mapping.hf_config(cfg), "bias": True})

    other = HFMapping(recipe.DataConfig, architecture="X", model_type="x")
    with pytest.raises(TypeError, match=r"'my_gpt'.*DataConfig.*GPTConfig"):
        my_gpt.DECODER.family("my_gpt", my_gpt.GPTConfig, my_gpt.flops_per_token, hf=other)


def test_a_config_field_without_default_that_config_json_lacks_is_named():
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Sized:
        width: int
        depth: int = 2

    mapping = HFMapping(Sized, architecture="SizedForCausalLM", model_type="sized")
    assert mapping.config_from_hf({"width": 8}) == Sized(8)
    with pytest.raises(ValueError, match=r"config\.json lacks 'width' \(Sized has no default for it\)"):
        mapping.config_from_hf({"model_type": "sized", "depth": 3})
