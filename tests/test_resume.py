"""
Recovery the way users do it, in CUDA's dtype layout (NANORL_CUDA_DTYPES=1: the bf16 embedding and its fp32 AdamW
moments, bf16 autocast, the engine's bf16 copy, FSDP's bf16 gathers; docs/testing.md).

Every stage runs a few steps twice. Once uninterrupted; once SIGKILLed mid-run between two saves, then the same command
with --resume added, which finishes. The final weights, optimizer state and extra state (data position, RNGs, prompt
order) of the two must be equal bit for bit. tests/kill_fixture.py does the killing. In the pipeline's stages and
with --fsdp (DCP shards) the resumed command is also SIGKILLed in the middle of a save first, and run once more after it
finished (a finished run stays finished); chat_rl's other modes save as the pipeline's chat_rl does.

The chain base_train -> mid_train -> chat_sft -> chat_rl is one tiny pipeline, each stage trained from the one
before; chat_rl's other modes (--async, PPO's critic and --fsdp on 2 ranks, --lora-rank, partial rollouts) start from a
random SFT checkpoint.
"""

import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest
import torch
import warm_python  # pytest puts tests/ on sys.path
from tiny_checkpoints import save_random_sft, train_tokenizer

from nanorl.checkpoint import load_checkpoint
from nanorl.precision import CUDA_DTYPES_ENV

ROOT = Path(__file__).resolve().parents[1]
RM = f"{ROOT / 'tests' / 'rl_fixture_reward.py'}:vowel_reward"


def run(base_dir, module, args, kill=None, nproc=1):
    """The stage as a user starts it (torchrun with nproc > 1), killed where `kill` says -> CompletedProcess."""
    env = {
        **os.environ,
        "NANORL_BASE_DIR": str(base_dir),
        "OMP_NUM_THREADS": "1",
        CUDA_DTYPES_ENV: "1",
        "NANORL_TEST_KILL": kill or "",
    }
    launch = [sys.executable]
    if nproc > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = [*launch, str(ROOT / "tests" / "kill_fixture.py"), module, *(["--"] if nproc > 1 else []), *args]
    return warm_python.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def step_files(ckpt, step):
    return sorted(p.name for p in ckpt.glob(f"*_{step:06d}*"))


def complete_steps(ckpt):
    return sorted(int(m.group(1)) for p in ckpt.glob("meta_*.json") if (m := re.match(r"meta_(\d+)", p.name)))


def same(a, b, where="", atol=0.0):
    """Recursive equality: tensors of one dtype, bit for bit (atol=0) or within atol, everything else with ==.
    -> where the first difference is, or None."""
    if torch.is_tensor(a):
        ok = torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
        if ok and atol and a.is_floating_point():
            ok = torch.allclose(a.float(), b.float(), atol=atol, rtol=0)
        elif ok:
            ok = torch.equal(a, b)
        return None if ok else where
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return f"{where} keys"
        return next((d for k in a if (d := same(a[k], b[k], f"{where}/{k}", atol))), None)
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{where} length"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := same(x, y, f"{where}[{i}]", atol))), None)
    return None if a == b else where


def load_step(ckpt, step):
    """Every tensor file of a step but its meta (which holds the command's flags): {file name: contents}."""
    from safetensors.torch import load_file

    out = {}
    for name in step_files(ckpt, step):
        path = ckpt / name
        if name.endswith(".safetensors"):
            out[name] = load_file(path)
        elif name.endswith(".pt"):
            out[name] = torch.load(path, weights_only=True)
        elif path.is_dir():  # --fsdp: DCP shards of model and optimizer, read back whole
            from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

            flat = ckpt.parent / f"{ckpt.name}-{name}.pt"
            dcp_to_torch_save(str(path), str(flat))
            out[name] = torch.load(flat, weights_only=False)
    return out


def kill_and_resume(base_dir, module, args, ckpt_root, tag_flag, tag, between, during, last, nproc=1, atol=0.0):
    """The uninterrupted run and the killed-and-resumed one (`between`: the optimizer step killed mid-run; `during`:
    the save killed before its meta, None: no kill in a save and no rerun of the finished command), compared at their
    last step: bit for bit, or within atol (on a GPU, whose kernels may sum in another order from run to run).
    -> (chat_rl's history of the uninterrupted run, the outputs of the resumed commands that finished)."""
    full = run(base_dir, module, [*args, tag_flag, f"{tag}_full"], nproc=nproc)
    assert full.returncode == 0, full.stdout[-2000:] + full.stderr[-3000:]
    history = base_dir / "report" / "rl_history.json"  # chat_rl's steps, for the caller
    full_history = json.loads(history.read_text()) if module == "scripts.chat_rl" else None
    cmd = [*args, tag_flag, f"{tag}_killed"]
    ckpt = base_dir / ckpt_root / f"{tag}_killed"
    first = run(base_dir, module, cmd, kill=f"optstep:{between}", nproc=nproc)
    assert first.returncode == (-signal.SIGKILL if nproc == 1 else 1), first.stderr[-3000:]
    saved = complete_steps(ckpt)
    assert saved and max(saved) < last, saved
    if during is not None:
        second = run(base_dir, module, [*cmd, "--resume"], kill=f"save:{during}", nproc=nproc)
        assert second.returncode != 0 and "resumed from" in second.stdout, second.stdout[-2000:] + second.stderr[-3000:]
        assert step_files(ckpt, during) and during not in complete_steps(ckpt)  # killed mid-save: files but no meta
    outs = []
    for _ in range(1 if during is None else 2):  # the same command again: it finishes; once more: it stays finished
        out = run(base_dir, module, [*cmd, "--resume"], nproc=nproc)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        assert "warning: resuming with changed" not in out.stdout  # the very same flags: nothing to warn about
        outs.append(out)
    assert max(complete_steps(ckpt)) == last
    a, b = load_step(base_dir / ckpt_root / f"{tag}_full", last), load_step(ckpt, last)
    assert a.keys() == b.keys() and len(a) >= 2, (sorted(a), sorted(b))
    assert (diff := same(a, b, atol=atol)) is None, (
        f"{tag}: the resumed run differs from the uninterrupted one at {diff}"
    )
    return full_history, outs


def adamw_moment_dtypes(optim_state):
    return {v.dtype for s in optim_state["state"].values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")}


# -----------------------------------------------------------------------------------------------
# the tiny pipeline: tokenizer -> base -> mid -> SFT -> RL, each stage killed twice and resumed


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume")
    train_tokenizer({**os.environ, "NANORL_BASE_DIR": str(d)})
    return d


BASE = "--depth 2 --aspect-ratio 32 --head-dim 32 --max-seq-len 64 --device-batch-size 2 --total-batch-size 256"
BASE += " --eval-every -1 --sample-every 3 --num-iterations 6 --save-every 2 --keep-last 5 --device-type cpu"
CHAT = "--levels 1 --num-examples 64 --num-iterations 6 --device-batch-size 2 --max-seq-len 64 --eval-every 6"
CHAT += " --eval-tokens 256 --save-every 2 --keep-last 5 --device-type cpu"
RL = "--levels 1 --rollout-batch-size 4 --n-samples-per-prompt 4 --max-new-tokens 12 --eval-every 100"
RL += " --eval-max-problems 4 --n-samples-per-eval-prompt 2 --pass-k 1,2 --lr-scale 1.0 --engine-batch-size 16"
RL += f" --num-rollouts 4 --save-every 2 --device-type cpu --custom-rm-path {RM}"


@pytest.mark.slow
def test_the_tiny_pipeline_killed_and_resumed_in_every_stage(tokenizer_dir):
    d = tokenizer_dir
    _, outs = kill_and_resume(d, "scripts.base_train", BASE.split(), "base_checkpoints", "--model-tag", "p", 4, 4, 6)
    assert "resumed from" in outs[0].stdout and "sample:" in outs[0].stdout  # sample(): the bf16 KV-cache path
    optim = torch.load(d / "base_checkpoints" / "p_killed" / "optim_000006.pt", weights_only=True)
    assert adamw_moment_dtypes(optim) == {torch.float32}  # beside the bf16 embedding: the crash on every resume
    with open(d / "base_checkpoints" / "p_killed" / "meta_000006.json") as f:
        assert json.load(f)["step"] == 6
    mid = [*CHAT.split(), "--model-tag", "p_full"]
    kill_and_resume(d, "scripts.mid_train", mid, "mid_checkpoints", "--output-tag", "p", 3, 4, 6)
    sft = [*CHAT.split(), "--source", "mid", "--model-tag", "p_full"]
    kill_and_resume(d, "scripts.chat_sft", sft, "sft_checkpoints", "--output-tag", "p", 3, 4, 6)
    rl = [*RL.split(), "--source", "sft", "--model-tag", "p_full"]
    _, outs = kill_and_resume(d, "scripts.chat_rl", rl, "rl_checkpoints", "--output-tag", "p", 3, 4, 4)
    # the engine samples from its bf16 copy while the trainer computes in fp32 weights under autocast: the two
    # log-probs may differ a little (bf16 sums in another order; in fp32 they are equal: tests/test_rl_trainer.py)
    assert "bf16 engine copy and KV cache (CUDA's layout on the CPU" in outs[0].stdout
    lp_diff = [float(x) for x in re.findall(r"lp_diff ([\d.e+-]+)", outs[0].stdout)]
    assert lp_diff and all(0 <= x < 0.05 for x in lp_diff), outs[0].stdout[-2000:]


# -----------------------------------------------------------------------------------------------
# chat_rl's other modes, from a random SFT checkpoint


@pytest.fixture(scope="module")
def sft_dir(tokenizer_dir):
    """tokenizer_dir with a random tiny SFT checkpoint "t" (saved in CUDA's layout: a bf16 embedding)."""
    env = {**os.environ, "NANORL_BASE_DIR": str(tokenizer_dir), CUDA_DTYPES_ENV: "1"}
    save_random_sft(env, n_layer=2)
    weights = load_checkpoint(str(tokenizer_dir / "sft_checkpoints" / "t"), 0)[0]
    assert weights["transformer.wte.weight"].dtype == torch.bfloat16
    return tokenizer_dir


@pytest.mark.slow
@pytest.mark.parametrize(
    "tag,flags,nproc",
    [
        ("ppo", ["--advantage-estimator", "ppo", "--critic-lr", "1e-3", "--lambd", "0.9"], 2),
        ("lora", ["--lora-rank", "4", "--lora-alpha", "8"], 1),
        # parked samples of an aborted rollout continue into the same tokens after the resume
        ("partial", ["--partial-rollout", "--over-sampling-batch-size", "8", "--use-tis", "--max-new-tokens", "24"], 1),
        ("async", ["--async", "--use-tis"], 2),
        ("fsdp", ["--fsdp"], 2),
    ],
)
def test_chat_rl_modes_killed_and_resumed(sft_dir, tag, flags, nproc):
    rl = [*RL.split(), "--source", "sft", "--model-tag", "t", *flags]
    during = 4 if tag == "fsdp" else None  # only --fsdp writes its own kind of save (DCP shards)
    hist, _ = kill_and_resume(
        sft_dir, "scripts.chat_rl", rl, "rl_checkpoints", "--output-tag", tag, 3, during, 4, nproc=nproc
    )
    if tag == "ppo":  # the critic, the same on both ranks, is written once: rank 1 resumes it from rank 0's file
        ck = sft_dir / "rl_checkpoints" / "ppo_killed"
        extras = [torch.load(ck / f"extra_000004_rank{r}.pt", weights_only=True) for r in range(2)]
        assert "critic_optim" in extras[0] and "critic" not in extras[1]
    if tag == "partial":  # samples were parked and continued, some of them generated by an older policy
        assert sum(h["rollout/partial_resumed_samples"] for h in hist["train"]) > 0
        assert max(h["rollout/max_staleness"] for h in hist["train"]) >= 1
    if tag == "async":  # the sampler got every new version, and its weights equal the trainer's
        assert [h["async/sampler_weight_version"] for h in hist["train"]] == [1, 2, 3, 4]
        assert all(h["async/sampler_weight_checksum"] == h["async/trainer_weight_checksum"] for h in hist["train"])
