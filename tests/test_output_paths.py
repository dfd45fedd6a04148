"""Every place that deletes or replaces a path the user named: the export (-o, --peft), the tokenizer's --out-dir,
the report's --out, a checkpoint's old steps, chat_rl --overwrite, the downloads' --data-dir and speedrun.sh's
.venv. Each is tried with files planted around it that must survive every refused (and every allowed) case."""

import argparse
import os
import re
import sys
from pathlib import Path

import pytest
import torch
import warm_python  # pytest puts tests/ on sys.path

from nanorl.errors import BadValue
from nanorl.gpt import GPTConfig, build_model
from nanorl.tokenizer import SPLIT_PATTERN, Tokenizer

ROOT = Path(__file__).resolve().parents[1]


def plant(directory, name="notes.txt", text="mine, not nanorl's\n"):
    """A file of the user's in directory: -> (path, its text), to check afterwards that it is still there, unchanged."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(text)
    return path, text


def intact(planted):
    return all(p.is_file() and p.read_text() == text for p, text in planted)


def no_leftovers(parent):
    """No temp or moved-aside directory of an export left beside its target."""
    return [n for n in os.listdir(parent) if ".tmp-" in n or ".old-" in n] == []


def tiny_model(seed=0):
    tok = Tokenizer.from_ranks({bytes([i]): i for i in range(256)}, SPLIT_PATTERN)
    torch.manual_seed(seed)
    cfg = GPTConfig(sequence_len=32, vocab_size=tok.vocab_size, n_layer=1, n_head=1, n_kv_head=1, n_embd=16)
    return build_model(cfg, "cpu"), tok


# --- the export: -o ------------------------------------------------------------------------------


def test_export_replaces_only_an_earlier_export(tmp_path, monkeypatch):
    """A target that is not empty and not an earlier export, the current, home or repository directory or one
    holding them, a file: each refused in one line, with nothing written or lost (files planted in the target, its
    parent, the current and the home directory all survive). An empty or new directory takes the export; an earlier
    export is replaced only with force, and not when it holds a file the export did not write."""
    from nanorl.hf import EXPORT_MARKER, check_export_dir, export_hf

    model, tok = tiny_model()
    parent, cwd, home = tmp_path / "parent", tmp_path / "cwd", tmp_path / "home"
    target = parent / "mymodels"
    planted = [plant(target), plant(target / "other-model", "config.json", "{}"), plant(parent, "parent.txt")]
    planted += [plant(cwd, "cwd.txt"), plant(home, "home.txt")]
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HOME", str(home))
    refused = [
        (str(target), "is not empty (2 entries) and is not an earlier export"),
        (".", "is the current directory"),
        (str(cwd) + "/", "is the current directory"),
        (str(home), "is your home directory"),
        (str(tmp_path), "holds the current directory"),
        ("..", "holds the current directory"),
        (str(parent / "parent.txt"), "is a file, not a directory"),
    ]
    for out, why in refused:
        with pytest.raises(BadValue, match=re.escape(why)) as e:
            export_hf(model, tok, out, force=True)
        assert "\n" not in str(e.value)
        assert intact(planted) and no_leftovers(parent) and no_leftovers(tmp_path), out
    # never even tried: / and the repository are refused before anything is touched
    for out, why in (("/", "holds the current directory"), (str(ROOT), "the repository")):
        with pytest.raises(BadValue, match=why):
            check_export_dir(out, force=True)
    os.symlink(target, parent / "link")
    with pytest.raises(BadValue, match="is a link"):
        export_hf(model, tok, str(parent / "link"), force=True)
    assert intact(planted) and os.path.islink(parent / "link")

    # a new directory, then an empty one: written, with the marker that names its files
    out = parent / "export"
    export_hf(model, tok, str(out))
    files = sorted(os.listdir(out))
    assert EXPORT_MARKER in files and "model.safetensors" in files and no_leftovers(parent)
    (parent / "empty").mkdir()
    export_hf(model, tok, str(parent / "empty"))
    assert sorted(os.listdir(parent / "empty")) == files
    # an earlier export: refused without force, replaced with it (the new weights are there)
    with pytest.raises(BadValue, match="holds an earlier export: --force replaces it"):
        export_hf(model, tok, str(out))
    other, _ = tiny_model(seed=1)
    export_hf(other, tok, str(out), force=True)
    from safetensors.torch import load_file

    assert torch.equal(load_file(out / "model.safetensors")["lm_head.weight"], other.lm_head.weight)
    assert sorted(os.listdir(out)) == files and no_leftovers(parent)
    # the user added a file to the export: even force leaves it (and the export) alone
    planted.append(plant(out, "README.md"))
    with pytest.raises(BadValue, match=r"and 1 entries it did not write \(README.md\)"):
        export_hf(model, tok, str(out), force=True)
    assert intact(planted) and sorted(os.listdir(out)) == sorted(files + ["README.md"])
    # a failure while writing leaves the earlier export as it was, and no temp directory
    monkeypatch.setattr("nanorl.hf.hf_config", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        export_hf(model, tok, str(parent / "empty"), force=True)
    assert sorted(os.listdir(parent / "empty")) == files and no_leftovers(parent)


@pytest.fixture(scope="module")
def rl_base(tmp_path_factory):
    """A base dir holding a tokenizer and one rl checkpoint, for the scripts."""
    from nanorl import synthetic
    from nanorl.checkpoint import save_checkpoint

    base = tmp_path_factory.mktemp("base")
    tok = Tokenizer.train(iter([d for _, d in zip(range(200), synthetic.pretrain_documents("train"))]), 300)
    tok.save(str(base / "tokenizer"))
    torch.manual_seed(0)
    cfg = GPTConfig(sequence_len=64, vocab_size=tok.vocab_size, n_layer=1, n_head=1, n_kv_head=1, n_embd=16)
    model = build_model(cfg, "cpu")
    meta = {"model_config": cfg.to_dict(), "model_tag": "d1", "step": 3}
    save_checkpoint(str(base / "rl_checkpoints" / "d1"), 3, model.state_dict(), meta=meta)
    return base


def export_script(base, cwd, *flags):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NANORL_BASE_DIR": str(base), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "scripts.export_hf", "-i", "rl", *flags]
    return warm_python.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_export_script_refuses_in_one_line_and_writes_a_new_directory(rl_base, tmp_path):
    """scripts.export_hf: `-o .` and a full directory are one line on stderr (exit 1), even with --force, and every
    planted file is kept; a new directory is written."""
    cwd = tmp_path / "work"
    planted = [plant(cwd), plant(cwd / "mymodels", "model.safetensors", "someone else's weights")]
    for out in (".", "mymodels"):
        r = export_script(rl_base, cwd, "-o", out, "--force")
        assert r.returncode == 1 and r.stdout == "", r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "export_hf.py: error: -o " + out in r.stderr
        assert intact(planted) and sorted(os.listdir(cwd)) == ["mymodels", "notes.txt"]
    r = export_script(rl_base, cwd, "-o", "new", "--force")  # (an earlier export it replaces: the test above)
    assert r.returncode == 0 and "wrote rl (d1 step 3) to new" in r.stdout, r.stderr
    assert intact(planted) and no_leftovers(cwd) and (cwd / "new" / "model.safetensors").is_file()


def test_peft_export_replaces_only_an_earlier_export(tmp_path):
    """export_peft (scripts.export_hf --peft) claims its directory as the merged export does."""
    pytest.importorskip("transformers")
    from test_hf import tiny_hf, tiny_tokenizer

    from nanorl.checkpoint import save_checkpoint
    from nanorl.hf import EXPORT_MARKER
    from nanorl.lora import LoraConfig, apply_lora, checkpoint_meta, lora_state_dict
    from nanorl.model_loading import export_peft, load_hf

    src = tmp_path / "qwen"
    tiny_hf("qwen2", src, vocab=tiny_tokenizer(src))
    model, _, _ = load_hf(str(src), "cpu")
    apply_lora(model, LoraConfig(rank=4, alpha=8))
    meta = {"lora": checkpoint_meta(model, {"source": "sft", "hf_model": str(src)}), "step": 1}
    ck = str(tmp_path / "ck")
    save_checkpoint(ck, 1, lora_state_dict(model), meta=meta)
    theirs = tmp_path / "adapter"
    planted = [plant(theirs, "adapter_config.json", "{}"), plant(theirs)]
    with pytest.raises(BadValue, match="is not an earlier export"):
        export_peft(ck, None, str(theirs), force=True)
    assert intact(planted) and sorted(os.listdir(theirs)) == ["adapter_config.json", "notes.txt"]
    out = tmp_path / "peft"
    export_peft(ck, None, str(out))
    assert sorted(os.listdir(out)) == sorted(["adapter_config.json", "adapter_model.safetensors", EXPORT_MARKER])
    with pytest.raises(BadValue, match="--force replaces it"):
        export_peft(ck, None, str(out))
    export_peft(ck, None, str(out), force=True)
    assert no_leftovers(tmp_path)


# --- the other places a path the user named is replaced or deleted ---------------------------------


def test_tokenizer_replaces_only_its_own_file(tmp_path):
    """tok_train --out-dir: a tokenizer.json that is not ours (a Hugging Face directory's) is refused and kept, and
    the directory's other files stay; our own is replaced (a rerun of the stage)."""
    tok = Tokenizer.from_ranks({bytes([i]): i for i in range(256)}, SPLIT_PATTERN)
    hf_dir = tmp_path / "qwen"
    planted = [plant(hf_dir, "tokenizer.json", '{"model": {"type": "BPE"}}'), plant(hf_dir)]
    with pytest.raises(BadValue, match="is not a nanorl tokenizer: it is never replaced"):
        tok.save(str(hf_dir))
    assert intact(planted) and sorted(os.listdir(hf_dir)) == ["notes.txt", "tokenizer.json"]
    ours = tmp_path / "tokenizer"
    planted.append(plant(ours))
    tok.save(str(ours))
    tok.save(str(ours))  # a rerun: its own file is replaced, the user's stays
    assert intact(planted) and sorted(os.listdir(ours)) == ["notes.txt", "tokenizer.json"]
    assert Tokenizer.load(str(ours)).encode("hello") == tok.encode("hello")


def test_report_replaces_only_a_report(tmp_path, monkeypatch):
    """python -m nanorl.report --out FILE: a file that is not a report of ours is refused and kept."""
    from nanorl.report import generate

    monkeypatch.setenv("NANORL_BASE_DIR", str(tmp_path / "base"))
    notes, text = plant(tmp_path, "README.md", "# my project\n")
    with pytest.raises(BadValue, match="--out .*README.md exists and is not a nanorl report"):
        generate(str(notes))
    assert intact([(notes, text)])
    out = tmp_path / "report.md"
    generate(str(out))
    generate(str(out))  # its own report: replaced
    assert out.read_text().startswith("# nanorl report\n") and sorted(os.listdir(tmp_path)) == [
        "README.md",
        "base",
        "report.md",
    ]


def test_old_steps_go_but_a_users_file_beside_them_stays(tmp_path):
    """keep_last deletes an old step's files, not a file of the user's whose name merely carries the step number."""
    from nanorl.checkpoint import complete_steps, save_checkpoint

    model, _ = tiny_model()
    d = tmp_path / "d1"
    planted = [plant(d, "notes_000001.txt"), plant(d, "run_000002.log")]
    for step in (1, 2, 3):
        save_checkpoint(str(d), step, model.state_dict(), meta={"step": step}, keep_last=1)
    assert complete_steps(str(d)) == [3] and intact(planted)
    assert sorted(os.listdir(d)) == [
        "meta_000003.json",
        "model_000003.safetensors",
        "notes_000001.txt",
        "run_000002.log",
    ]


def test_overwrite_moves_the_users_files_aside_with_the_old_steps(tmp_path):
    """chat_rl --overwrite renames the tag's directory: nothing in it is deleted, a planted file included."""
    from nanorl.checkpoint import claim_output_dir, save_checkpoint

    model, _ = tiny_model()
    d = tmp_path / "rl_checkpoints" / "d1"
    save_checkpoint(str(d), 5, model.state_dict(), meta={"step": 5})
    plant(d)
    moved = Path(claim_output_dir(str(d), resume=False, overwrite=True))
    assert intact([(moved / "notes.txt", "mine, not nanorl's\n")]) and not d.exists()


def test_downloads_keep_what_the_data_dir_holds(tmp_path):
    """--data-dir: a file already at a shard's name is kept as it is, and the directory's other files stay."""
    from nanorl.dataset import download_file

    def opener(url, timeout):
        raise AssertionError("nothing should be fetched")

    data = tmp_path / "data"
    planted = [plant(data), plant(data, "shard_00000.parquet", "my own shard")]
    assert download_file("http://x/shard_00000.parquet", str(data / "shard_00000.parquet"), opener=opener)
    assert intact(planted)


def test_speedrun_keeps_a_venv_it_did_not_create(tmp_path):
    """speedrun.sh (its installer, install.sh): when `python3 -m venv` fails, a .venv that was there before (without a
    python) is left alone."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("speedrun.sh", "install.sh"):
        (repo / name).write_text((ROOT / name).read_text())
    planted = [plant(repo / ".venv")]
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text("#!/bin/sh\nexit 1\n")
    (fake / "python3").chmod(0o755)
    env = {
        "PATH": f"{fake}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "NANORL_BASE_DIR": str(tmp_path / "base"),
        "NANORL_SKIP_INSTALL": "1",
    }
    out = warm_python.run(["bash", "speedrun.sh"], cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "python3 -m venv failed" in out.stderr, out.stderr
    assert intact(planted)


@pytest.mark.parametrize(
    "module, flag",
    [
        ("scripts.base_train", "--model-tag"),
        ("scripts.mid_train", "--output-tag"),
        ("scripts.chat_sft", "--output-tag"),
        ("scripts.chat_rl", "--output-tag"),
        ("scripts.chat_eval", "--model-tag"),
        ("scripts.chat_cli", "--model-tag"),
    ],
)
def test_a_tag_that_leaves_its_checkpoints_directory_is_one_line(tmp_path, module, flag):
    """A tag is one directory name under <base>/<stage>_checkpoints: "../x" would save (or read) beside the base
    directory, so each script refuses it in argparse's one line before anything is loaded or written."""
    base = tmp_path / "base"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NANORL_BASE_DIR": str(base), "OMP_NUM_THREADS": "1"}
    for bad in ("../x",):  # the other shapes of a bad tag: test_tag_name below, in-process
        r = warm_python.run(
            [sys.executable, "-m", module, flag, bad], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 2 and r.stdout == "", r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 or lines[-2].startswith("usage:") or lines[-2].startswith(" "), r.stderr
        assert re.search(
            rf"error: argument (-\w/)?{flag}: {re.escape(repr(bad))} is not a tag: one directory name", lines[-1]
        )
        assert "Traceback" not in r.stderr
    assert sorted(os.listdir(tmp_path)) == []


def test_tag_name():
    from nanorl.flags import tag_name

    assert [tag_name(t) for t in ("d4", "my-run", "r.72")] == ["d4", "my-run", "r.72"]
    for bad in ("", ".", "..", "../x", "a/b", "a\\b", "-x"):
        with pytest.raises(argparse.ArgumentTypeError, match="is not a tag"):
            tag_name(bad)
