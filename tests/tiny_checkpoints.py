"""
The tiny tokenizer and random SFT checkpoints that the tests running chat_rl (and its neighbours) as subprocesses
start from. Each is made in a subprocess of its own, as a stage would, under the test's NANORL_BASE_DIR (and its
NANORL_CUDA_DTYPES: a checkpoint saved in CUDA's layout has a bf16 embedding).
"""

import sys
from pathlib import Path

import warm_python  # pytest puts tests/ on sys.path

ROOT = Path(__file__).resolve().parents[1]


def train_tokenizer(env):
    """A 600-token BPE tokenizer of the offline curriculum in env's NANORL_BASE_DIR."""
    cmd = [sys.executable, "-m", "scripts.tok_train", "--vocab-size", "600", "--max-chars", "300000"]
    warm_python.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)


def save_random_sft(env, tag="t", sequence_len=256, n_layer=1, seed=0, head_std=0.2):
    """A random one-head, 32-wide SFT checkpoint <tag> (step 0) over that tokenizer; the lm_head drawn with std
    head_std, so the first-token distribution is spread out (a test of sampling needs more than one likely token)."""
    code = (
        "import torch\n"
        "from nanorl.gpt import GPTConfig, build_model\n"
        "from nanorl.tokenizer import get_tokenizer\n"
        "from nanorl.checkpoint import save_checkpoint\n"
        "from nanorl.model_loading import checkpoint_root\n"
        f"tok = get_tokenizer(); torch.manual_seed({seed})\n"
        f"cfg = GPTConfig(sequence_len={sequence_len}, vocab_size=tok.vocab_size, n_layer={n_layer}, n_head=1, "
        "n_kv_head=1, n_embd=32)\n"
        "m = build_model(cfg, 'cpu')\n"
        "with torch.no_grad():\n"
        f"    m.lm_head.weight.normal_(0, {head_std})\n"
        f"save_checkpoint(checkpoint_root('sft') + '/{tag}', 0, m.state_dict(), meta={{'model_config': cfg.to_dict()}})\n"
    )
    warm_python.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, capture_output=True)
