import json
import random

import pytest
import torch

from nanorl.checkpoint import (
    delete_step,
    find_last_step,
    load_checkpoint,
    load_weights,
    resume_point,
    save_checkpoint,
)
from nanorl.gpt import GPTConfig
from nanorl.gpt import build_model as build_gpt
from nanorl.model_loading import load_model_dir

CFG = GPTConfig(sequence_len=16, vocab_size=40, n_layer=2, n_head=2, n_kv_head=1, n_embd=32)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return build_gpt(CFG, "cpu")


def test_weights_are_safetensors_and_state_loads_with_weights_only(tmp_path):
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 40, (2, 16)), targets=torch.randint(0, 40, (2, 16))).backward()
    opt.step()
    random.seed(7)
    extra = {
        "loader": {"epoch": 1, "pool": [3, 4]},
        "py_rng": random.getstate(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": None,
    }
    save_checkpoint(
        str(tmp_path), 5, model.state_dict(), opt.state_dict(), {"model_config": CFG.to_dict(), "step": 5}, extra
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "extra_000005_rank0.pt",
        "meta_000005.json",
        "model_000005.safetensors",
        "optim_000005.pt",
    ]
    from safetensors.torch import load_file  # an independent reader: the weights file is plain safetensors

    raw = load_file(str(tmp_path / "model_000005.safetensors"))
    assert raw.keys() == model.state_dict().keys() and all(
        torch.equal(raw[k], v) for k, v in model.state_dict().items()
    )
    for name in ("optim_000005.pt", "extra_000005_rank0.pt"):
        torch.load(tmp_path / name, weights_only=True)  # no arbitrary code to run
    ms, optim_state, meta, got = load_checkpoint(str(tmp_path), load_optimizer=True)
    restored = build_gpt(CFG, "cpu")
    load_weights(restored, ms, "x")
    assert all(torch.equal(a, b) for a, b in zip(restored.state_dict().values(), model.state_dict().values()))
    opt2 = torch.optim.AdamW(restored.parameters())
    opt2.load_state_dict(optim_state)
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    random.seed(0)
    random.setstate(got["py_rng"])  # python's RNG state survives the plain-types round trip
    a = random.random()
    random.seed(7)
    assert (
        a == random.random() and torch.equal(got["torch_rng"], extra["torch_rng"]) and got["loader"] == extra["loader"]
    )
    assert meta == {"model_config": CFG.to_dict(), "step": 5}


def test_atomic_keep_last_and_corruption(tmp_path):
    d = tmp_path / "ck"
    for step in (1, 2, 3):
        save_checkpoint(
            str(d), step, {"w": torch.full((2,), float(step))}, {"o": step}, {"step": step}, {"e": step}, keep_last=2
        )
    assert find_last_step(str(d)) == 3 and not list(d.glob("*_000001*"))
    # an incomplete save (weights written, no meta) is never "latest"
    (d / "model_000004.safetensors").write_bytes((d / "model_000003.safetensors").read_bytes())
    assert find_last_step(str(d)) == 3
    # a truncated weights file: a clear error naming it, and the previous step still loads
    (d / "model_000003.safetensors").write_bytes(b"garbage")
    with pytest.raises(RuntimeError, match="model_000003.safetensors is corrupt"):
        load_checkpoint(str(d), 3)
    ms, os_, meta, extra = load_checkpoint(str(d), 2, load_optimizer=True)
    assert ms["w"][0] == 2 and os_ == {"o": 2} and meta == {"step": 2} and extra == {"e": 2}


def test_tied_weights_save(tmp_path):
    w = torch.randn(4, 3)
    save_checkpoint(str(tmp_path), 1, {"wte": w, "lm_head": w, "row": w[1]}, meta={})  # one storage, three names
    ms = load_checkpoint(str(tmp_path))[0]
    assert torch.equal(ms["wte"], w) and torch.equal(ms["lm_head"], w) and torch.equal(ms["row"], w[1])


def test_old_pt_checkpoints_still_load(tmp_path):
    model = tiny_model(1)
    torch.save(model.state_dict(), tmp_path / "model_000003.pt")  # the layout of earlier versions
    (tmp_path / "meta_000003.json").write_text(json.dumps({"model_config": CFG.to_dict()}))
    assert find_last_step(str(tmp_path)) == 3
    restored = build_gpt(CFG, "cpu")
    load_weights(restored, load_checkpoint(str(tmp_path))[0], "x")
    assert all(torch.equal(a, b) for a, b in zip(restored.state_dict().values(), model.state_dict().values()))


def test_bad_checkpoints_get_one_line_naming_the_file(tmp_path):
    model = tiny_model()
    save_checkpoint(str(tmp_path), 1, model.state_dict(), {"o": 1}, {"step": 1})  # no extra state
    with pytest.raises(FileNotFoundError, match=r"extra_000001_rank0.pt is missing: step 1 has no data/RNG state"):
        load_checkpoint(str(tmp_path), 1, load_optimizer=True)
    with pytest.raises(ValueError, match=r"meta_000001.json has no model_config"):
        load_model_dir(str(tmp_path), 1)
    # the wrong keys and a wrong shape, named, on one line
    state = dict(model.state_dict())
    state["extra.weight"] = state.pop("lm_head.weight")
    state["transformer.wte.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError) as e:
        load_weights(tiny_model(), state, "ck/model_000001.safetensors")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("checkpoint file ck/model_000001.safetensors does not fit the model")
    assert "missing keys lm_head.weight" in msg and "unexpected keys extra.weight" in msg
    assert "transformer.wte.weight (3, 3) vs (40, 32)" in msg
    # extra state holding arbitrary Python objects is refused, not executed
    torch.save({"config": CFG}, tmp_path / "extra_000001_rank0.pt")  # a dataclass: unpickling it would run code
    with pytest.raises(RuntimeError, match="extra_000001_rank0.pt holds Python objects other than tensors"):
        load_checkpoint(str(tmp_path), 1)


def test_files_orphaned_by_a_kill_during_deletion_are_cleaned_at_the_next_save(tmp_path):
    d = str(tmp_path)
    for step in (1, 2):
        save_checkpoint(d, step, {"w": torch.zeros(1)}, {"o": step}, {"step": step}, {"e": step})
    # a kill during delete_step(1): its meta is gone (deleted first), its other files remain
    (tmp_path / "meta_000001.json").unlink()
    (tmp_path / "optim_000002.pt.tmp").write_bytes(b"half")  # and one write of step 2 that never finished
    (tmp_path / "meta_000002.json").unlink()
    (tmp_path / "model_000009.safetensors").write_bytes(b"x")  # a later incomplete step: will be overwritten, untouched
    assert find_last_step(d) is None
    save_checkpoint(d, 3, {"w": torch.ones(1)}, {"o": 3}, {"step": 3}, {"e": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "extra_000003_rank0.pt",
        "meta_000003.json",
        "model_000003.safetensors",
        "model_000009.safetensors",
        "optim_000003.pt",
    ]
    delete_step(d, 9)
    assert find_last_step(d) == 3


def test_resume_point_refuses_no_step_another_world_size_or_fsdp_setting(tmp_path):
    with pytest.raises(SystemExit, match=r"--resume: no checkpoint in "):
        resume_point(str(tmp_path), 2, True)
    save_checkpoint(str(tmp_path), 3, {"w": torch.zeros(2)}, meta={"world_size": 2, "sharded": True, "x": 1})
    assert resume_point(str(tmp_path), 2, True) == (3, {"world_size": 2, "sharded": True, "x": 1})
    with pytest.raises(
        SystemExit, match=r"step 3 in .* was written by 2 rank\(s\), this run has 4; resume with --nproc_per_node=2"
    ):
        resume_point(str(tmp_path), 4, True)
    with pytest.raises(SystemExit, match=r"step 3 in .* was saved with --fsdp; resume with it"):
        resume_point(str(tmp_path), 2, False)
    save_checkpoint(str(tmp_path), 4, {"w": torch.zeros(2)}, meta={})  # a meta from before these fields: no refusal
    assert resume_point(str(tmp_path), 8, False) == (4, {})
    with pytest.raises(SystemExit, match="was saved without --fsdp; resume without it"):
        resume_point(str(tmp_path), 8, True)


def test_save_then_resume_restores_weights_optimizer_extra_and_rngs(tmp_path):
    from nanorl.checkpoint import resume, rng_state, save, set_rng_state
    from nanorl.optim import build_optimizer

    model = tiny_model()
    opt = build_optimizer(model)
    model(torch.randint(0, 40, (2, 16)), targets=torch.randint(0, 40, (2, 16))).backward()
    opt.step()
    random.seed(3)
    torch.manual_seed(3)
    extra = {"loader": [1, 2], **rng_state(torch.device("cpu"))}
    save(str(tmp_path), 7, model, opt, {"model_config": CFG.to_dict(), "world_size": 1}, extra)
    after = (random.random(), torch.rand(3))  # what the RNGs give right after the save
    assert json.loads((tmp_path / "meta_000007.json").read_text())["sharded"] is False  # what resume_point checks
    fresh = tiny_model(seed=1)
    opt2 = build_optimizer(fresh)
    step, meta, extra = resume(str(tmp_path), fresh, opt2)
    assert step == 7 and meta["world_size"] == 1 and extra["loader"] == [1, 2]
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    for s1, s2 in zip(opt.state.values(), opt2.state.values()):
        assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1 if torch.is_tensor(s1[k]))
    set_rng_state(extra, torch.device("cpu"))
    assert random.random() == after[0] and torch.equal(torch.rand(3), after[1])
    with pytest.raises(SystemExit, match=r"--resume: no checkpoint in "):  # resume_point's refusals
        resume(str(tmp_path / "none"), fresh, opt2)
    with pytest.raises(SystemExit, match=r"this run has 2; resume with --nproc_per_node=1"):
        resume(str(tmp_path), fresh, opt2, world_size=2)
    other = {**CFG.to_dict(), "n_layer": 3}
    with pytest.raises(SystemExit, match=r"--resume: the checkpoint's model config .* differs from this run's"):
        resume(str(tmp_path), fresh, opt2, model_config=other)


def test_model_flags_pick_the_checkpoint_that_load_model_reads(tmp_path, monkeypatch):
    from nanorl.flags import ArgumentParser
    from nanorl.model_loading import add_model_args, checkpoint_root, load_model_from_args
    from nanorl.tokenizer import SPLIT_PATTERN, Tokenizer

    monkeypatch.setenv("NANORL_BASE_DIR", str(tmp_path))
    # 31 byte tokens + the 9 specials = the tiny model's vocabulary of 40
    tok = Tokenizer.from_ranks({bytes([i]): i for i in range(31)}, SPLIT_PATTERN)
    monkeypatch.setattr("nanorl.tokenizer.get_tokenizer", lambda: tok)
    for tag, step, seed in (("a", 1, 1), ("a", 2, 2), ("b", 5, 3)):
        save_checkpoint(
            f"{checkpoint_root('mid')}/{tag}", step, tiny_model(seed).state_dict(), meta={"model_config": CFG.to_dict()}
        )
    p = ArgumentParser(prog="x")
    add_model_args(p, "mid", short=True)
    args = p.parse_args(["-g", "a", "-s", "1"])
    assert (args.source, args.model_tag, args.model_step, args.hf_model) == ("mid", "a", 1, None)
    model, _, meta = load_model_from_args(args, "cpu")
    assert meta["model_tag"] == "a" and all(
        torch.equal(u, v) for u, v in zip(model.state_dict().values(), tiny_model(1).state_dict().values())
    )
    p = ArgumentParser(prog="x")
    add_model_args(p, source=None, hf_model=False)  # base_eval's: no --source, no --hf-model, no short flags
    args = p.parse_args(["--model-tag", "b", "--step", "5"])
    assert vars(args) == {"model_tag": "b", "model_step": 5}
    assert load_model_from_args(args, "cpu", source="mid")[2]["model_tag"] == "b"


def _save_tiny(d, step):
    model = tiny_model()
    save_checkpoint(str(d), step, model.state_dict(), None, {"model_config": CFG.to_dict(), "step": step})


def test_a_fresh_run_refuses_a_folder_with_an_earlier_runs_steps(tmp_path):
    from nanorl.checkpoint import claim_output_dir

    d = tmp_path / "rl_checkpoints" / "d4"
    assert claim_output_dir(str(d), resume=False, overwrite=False) is None  # no folder yet
    d.mkdir(parents=True)
    (d / "notes.txt").write_text("x")
    assert claim_output_dir(str(d), resume=False, overwrite=False) is None  # a folder with no steps
    _save_tiny(d, 20)
    _save_tiny(d, 60)
    with pytest.raises(SystemExit) as e:
        claim_output_dir(str(d), resume=False, overwrite=False)
    msg = str(e.value)
    assert "\n" not in msg and f"{d} already holds steps 20, 60 of an earlier run" in msg
    assert all(w in msg for w in ("--resume", "--output-tag", "--overwrite"))
    assert claim_output_dir(str(d), resume=True, overwrite=False) is None and find_last_step(str(d)) == 60
    with pytest.raises(SystemExit, match="pass one of them"):
        claim_output_dir(str(d), resume=True, overwrite=True)


def test_overwrite_moves_the_old_steps_aside_not_away(tmp_path, capsys):
    from nanorl.checkpoint import claim_output_dir

    d = tmp_path / "d4"
    _save_tiny(d, 60)
    assert claim_output_dir(str(d), resume=False, overwrite=True, rank=1) is not None and d.exists()  # rank 0 moves
    moved = claim_output_dir(str(d), resume=False, overwrite=True)
    assert not d.exists() and moved.startswith(str(d) + ".old-") and find_last_step(moved) == 60
    assert f"moved the earlier run's step 60 aside to {moved}" in capsys.readouterr().out
    _save_tiny(d, 5)  # a second overwrite within the same second keeps both old folders
    again = claim_output_dir(str(d), resume=False, overwrite=True)
    assert again != moved and find_last_step(again) == 5 and find_last_step(moved) == 60


def test_loading_a_checkpoint_says_which_source_tag_and_step(tmp_path, monkeypatch, capsys):
    import types

    import nanorl.tokenizer
    from nanorl.model_loading import load_model

    monkeypatch.setattr(nanorl.tokenizer, "get_tokenizer", lambda: types.SimpleNamespace(vocab_size=CFG.vocab_size))
    d = tmp_path / "sft_checkpoints" / "d4"
    for step in (40, 80):
        _save_tiny(d, step)
    monkeypatch.setenv("NANORL_BASE_DIR", str(tmp_path))
    capsys.readouterr()
    load_model("sft", "cpu")
    assert capsys.readouterr().out == f"loaded sft checkpoint d4 step 80 from {d}\n"
    load_model("sft", "cpu", model_tag="d4", step=40)
    assert capsys.readouterr().out == f"loaded sft checkpoint d4 step 40 from {d}\n"
    load_model_dir(str(d), 40)
    assert capsys.readouterr().out == f"loaded sft checkpoint d4 step 40 from {d}\n"
    elsewhere = tmp_path / "teacher"
    d.rename(elsewhere)
    load_model_dir(str(elsewhere))
    assert capsys.readouterr().out == f"loaded checkpoint step 80 from {elsewhere}\n"


def test_several_tags_the_most_recently_saved_is_loaded_and_named(tmp_path, monkeypatch, capsys):
    """-i rl with no tag: the tag whose last step was saved last (a directory touched later, e.g. by a file copied
    into it, does not count), and with several tags one line on stderr names them and the one taken; the help of
    every tool that takes -g says the same. A step that is not there lists the steps that are."""
    import os
    import sys
    import types

    import nanorl.tokenizer
    from nanorl.model_loading import find_checkpoint_dir, load_model

    monkeypatch.setattr(nanorl.tokenizer, "get_tokenizer", lambda: types.SimpleNamespace(vocab_size=CFG.vocab_size))
    monkeypatch.setenv("NANORL_BASE_DIR", str(tmp_path))
    root = tmp_path / "rl_checkpoints"
    _save_tiny(root / "mine", 5)
    _save_tiny(root / "d4", 24)
    os.utime(root / "mine" / "meta_000005.json", (1e9, 1e9))  # saved long ago, but its directory touched now
    (root / "mine" / "notes.txt").write_text("copied in later")
    capsys.readouterr()
    assert find_checkpoint_dir("rl") == str(root / "d4")
    err = capsys.readouterr().err
    assert (
        err
        == "rl checkpoints have 2 tags (d4, mine): loading 'd4', the most recently saved; -g/--model-tag picks another\n"
    )
    assert find_checkpoint_dir("rl", "mine") == str(root / "mine") and capsys.readouterr().err == ""
    with pytest.raises(FileNotFoundError, match="step 99 is incomplete or missing .*; the steps there: 24$"):
        load_model("rl", "cpu", step=99)
    from scripts.chat_cli import main as chat_cli
    from scripts.chat_web import parse_args as chat_web_args

    for parse in (chat_cli, lambda: chat_web_args(["--help"])):
        monkeypatch.setattr(sys, "argv", ["chat", "--help"])
        with pytest.raises(SystemExit):
            parse()
        out = " ".join(capsys.readouterr().out.split())
        assert "the one saved most recently; named when there are several" in out and "largest" not in out


def _two_rank_steps(model, opt, rank, steps):
    """`steps` optimizer steps on rank `rank`'s half of fixed batches, the gradients averaged over the 2 ranks."""
    for s in steps:
        x = torch.randint(0, 40, (4, 16), generator=torch.Generator().manual_seed(s))[rank::2]
        model(x, targets=x).backward()
        opt.step()  # MuonAdamW averages the gradients: every rank's state stays the same
        model.zero_grad(set_to_none=True)


def _replicated_worker(rank, world, init_file, out):
    import torch.distributed as dist

    from nanorl.checkpoint import resume, save
    from nanorl.optim import build_optimizer

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = tiny_model()
        opt = build_optimizer(model)
        _two_rank_steps(model, opt, rank, range(2))
        save(out, 2, model, opt, {"model_config": CFG.to_dict(), "world_size": 2}, {"rank": rank}, rank)
        _two_rank_steps(model, opt, rank, range(2, 4))
        fresh = tiny_model(seed=1)
        fresh_opt = build_optimizer(fresh)
        step, _, extra = resume(out, fresh, fresh_opt, rank, world_size=2)
        _two_rank_steps(fresh, fresh_opt, rank, range(2, 4))
        same = [torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values())]
        for s1, s2 in zip(opt.state.values(), fresh_opt.state.values()):
            same += [torch.equal(s1[k], s2[k]) for k in s1 if torch.is_tensor(s1[k])]
        torch.save({"step": step, "extra": extra, "same": all(same) and len(same) > 10}, f"{out}/result{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_replicated_optimizer_state_is_written_once_and_every_rank_resumes_from_it(tmp_path):
    """2 gloo ranks save a step: one optimizer file (every rank holds the same state; one copy per rank was ranks x
    ~2 GB a save at d20), each rank's extra state; each rank resumes from them and steps on bit for bit as it did."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "ck")
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(_replicated_worker, args=(2, str(tmp_path / "init"), out), nprocs=2, start_method=method)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if not p.name.startswith("result")) == [
        "extra_000002_rank0.pt",
        "extra_000002_rank1.pt",
        "meta_000002.json",
        "model_000002.safetensors",
        "optim_000002.pt",
    ]
    for rank in range(2):
        result = torch.load(tmp_path / "ck" / f"result{rank}.pt")
        assert result == {"step": 2, "extra": {"rank": rank}, "same": True}


def test_a_checkpoint_with_an_optimizer_file_per_rank_still_resumes(tmp_path):
    """Checkpoints of the older layout (optim_<step>_rank<r>.pt) load as they did."""
    from nanorl.checkpoint import resume, save
    from nanorl.optim import build_optimizer

    model = tiny_model()
    opt = build_optimizer(model)
    _two_rank_steps(model, opt, 0, range(1))
    save(str(tmp_path), 1, model, opt, {"model_config": CFG.to_dict()}, {"e": 1})
    (tmp_path / "optim_000001.pt").rename(tmp_path / "optim_000001_rank0.pt")
    fresh = tiny_model(seed=1)
    fresh_opt = build_optimizer(fresh)
    resume(str(tmp_path), fresh, fresh_opt)
    for s1, s2 in zip(opt.state.values(), fresh_opt.state.values()):
        assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1 if torch.is_tensor(s1[k]))
