"""
Reinforcement learning on a chat model: the GRPO family and friends, in one readable file.

One step = one rollout: sample n responses for each of a batch of prompts with our own engine (the same
model object we train, so no weight copies), score them with the reward hub, compute advantages, then
take --num-steps-per-rollout optimizer steps over the samples (the first is exactly on-policy).

    python -m scripts.chat_rl                                   # offline curriculum, CPU-sized defaults
    torchrun --standalone --nproc_per_node=8 -m scripts.chat_rl -- --task gsm8k --rollout-batch-size 64
"""
import argparse
import copy
import os
import random
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist

from nanorl import rl
from nanorl.checkpoint import build_model, load_checkpoint, load_model, save_checkpoint, find_last_step
from nanorl.common import (Timer, autocast_ctx, eta_min, compute_cleanup, compute_init, get_base_dir, get_logger, print0)
from nanorl.engine import Engine, Request
from nanorl.gpt import Critic
from nanorl.multiturn import TOOLS, make_tool, multi_turn_generate
from nanorl.optim import MuonAdamW, build_optimizer
from nanorl.report import load_json, log_json, log_section
from nanorl.rewards import compute_reward, extract_answer, remote_rewards, safe_reward
from nanorl.rollout import (ABORTED, TRUNCATED, PromptSource, RolloutBuffer, Sample, collate, extend_sample, fill_rollout,
                            keep_all_groups, load_function, pack_micro_batches, set_rewards)
from tasks import get_task

# fmt: off
parser = argparse.ArgumentParser(description="RL on a chat model (GRPO family)")
# model and data
parser.add_argument("--source", default="sft", choices=["base", "mid", "sft", "rl"], help="checkpoint to start from")
parser.add_argument("--model-tag", default=None, help="checkpoint subdirectory (default: newest)")
parser.add_argument("--model-step", type=int, default=None, help="checkpoint step (default: last)")
parser.add_argument("--task", default="offline", help="RL prompts: offline (the synthetic curriculum) or gsm8k")
parser.add_argument("--task-path", default=None, help="local jsonl/parquet for the task instead of downloading")
parser.add_argument("--levels", default="1,2,3,4", help="offline task: difficulty levels of the prompts")
parser.add_argument("--eval-task", default=None, help="held-out task (default: the test split of --task)")
parser.add_argument("--output-tag", default=None, help="save under rl_checkpoints/<tag> (default: the source's tag)")
# rollout
parser.add_argument("--num-rollouts", type=int, default=60, help="number of rollouts (= RL steps)")
parser.add_argument("--rollout-batch-size", type=int, default=16, help="prompts per rollout (global)")
parser.add_argument("--n-samples-per-prompt", type=int, default=8, help="group size")
parser.add_argument("--global-batch-size", type=int, default=None, help="samples per optimizer step (default: the whole rollout)")
parser.add_argument("--num-steps-per-rollout", type=int, default=1, help="optimizer steps per rollout (>1 is off-policy: uses the ratio)")
parser.add_argument("--over-sampling-batch-size", type=int, default=None, help="turns on dynamic sampling: prompts generated per round, groups kept by the filter until the batch is full")
parser.add_argument("--dynamic-sampling-filter-path", default="nanorl.rollout:keep_nonconstant_group", help="module:function(group) -> (keep, reason), used with --over-sampling-batch-size")
parser.add_argument("--max-sampling-rounds", type=int, default=8, help="dynamic sampling: rounds before the batch is topped up with dropped groups")
parser.add_argument("--buffer-filter-path", default="nanorl.rollout:pop_first", help="module:function(buffer, n) -> (taken, rest) for surplus groups")
parser.add_argument("--partial-rollout", action="store_true", help="with over-sampling: once the batch is full, abort what is still "
                    "generating, keep it with its tokens and continue it in the next rollout (pair with --use-tis)")
parser.add_argument("--max-response-len", type=int, default=256, help="max tokens per response")
parser.add_argument("--temperature", type=float, default=1.0, help="rollout temperature (the trainer divides logits by it too)")
parser.add_argument("--top-k", type=int, default=None, help="rollout top-k (default: off; anything but off makes rollouts off-policy)")
parser.add_argument("--top-p", type=float, default=None, help="rollout top-p (default: off)")
parser.add_argument("--async", dest="async_mode", action="store_true", help="one-step-off-policy: sampling ranks generate rollout "
                    "k+1 while training ranks train on rollout k, then get the new weights (one rank: synchronous)")
parser.add_argument("--rollout-num-gpus", type=int, default=None, help="--async: how many ranks sample (the first ones; default half)")
parser.add_argument("--engine-batch-size", type=int, default=256, help="engine rows decoded at once")
parser.add_argument("--custom-generate-function-path", default=None, help="module:function(args, engine, tokenizer, prompts, seeds) -> list of groups (lists) of Sample")
parser.add_argument("--multi-turn", action="store_true", help="run tool calls turn by turn (nanorl/multiturn.py), with per-turn metrics")
parser.add_argument("--max-turns", type=int, default=None, help="--multi-turn: tool calls per response (default 4); one more ends it as truncated")
parser.add_argument("--tool", default=None, choices=TOOLS, help="--multi-turn: what answers a tool call (default calculator)")
# advantages and loss
parser.add_argument("--advantage-estimator", default="grpo", choices=["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gspo", "cispo", "ppo"],
                    help="gspo / cispo: GRPO advantages with GSPO's sequence-level ratio or CISPO's clipped-weight loss")
parser.add_argument("--gamma", type=float, default=1.0, help="discount of reinforce_plus_plus returns and of ppo's GAE")
parser.add_argument("--lambd", type=float, default=1.0, help="ppo: GAE lambda (1 = Monte Carlo returns minus the critic's baseline)")
parser.add_argument("--critic-lr", type=float, default=None, help="ppo: AdamW learning rate of the critic (required with ppo)")
parser.add_argument("--value-clip", type=float, default=0.2, help="ppo: clip the critic's values to within this of the rollout's (0 = off)")
parser.add_argument("--disable-grpo-std-normalization", action="store_true", help="Dr. GRPO: no division by the group std")
parser.add_argument("--normalize-advantages", action="store_true", help="whiten advantages across all ranks")
parser.add_argument("--eps-clip", type=float, default=0.2)
parser.add_argument("--eps-clip-high", type=float, default=None, help="clip-higher (DAPO); default = --eps-clip")
parser.add_argument("--eps-clip-c", type=float, default=None, help="dual clip constant (> 1) for negative advantages")
parser.add_argument("--entropy-coef", type=float, default=0.0)
parser.add_argument("--loss-aggregation", default="token_mean", choices=["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
parser.add_argument("--overlong-buffer-len", type=int, default=0, help="DAPO overlong shaping: penalise the last N tokens before the max length")
parser.add_argument("--overlong-penalty-factor", type=float, default=1.0)
parser.add_argument("--mask-truncated-samples", action="store_true", help="truncated responses are not trained on")
parser.add_argument("--use-kl-loss", action="store_true", help="add a KL(policy || reference) loss")
parser.add_argument("--kl-loss-coef", type=float, default=0.0)
parser.add_argument("--kl-loss-type", default="low_var_kl", choices=["k1", "k2", "k3", "low_var_kl"])
parser.add_argument("--kl-coef", type=float, default=0.0, help="KL penalty folded into the reward")
parser.add_argument("--use-opd", action="store_true", help="on-policy distillation: a teacher's log-probs pull the advantages")
parser.add_argument("--opd-kl-coef", type=float, default=1.0, help="OPD: A -= coef * (logp_student - logp_teacher)")
parser.add_argument("--opd-teacher-load", default=None, help="OPD teacher: a checkpoint directory, or source[:tag] e.g. sft:d8")
parser.add_argument("--use-tis", action="store_true", help="truncated importance weights between trainer (old) and rollout log-probs")
parser.add_argument("--tis-clip", type=float, default=2.0)
parser.add_argument("--tis-clip-low", type=float, default=0.0)
parser.add_argument("--tis-mode", default="truncate", choices=["truncate", "icepop"], help="icepop: weights outside the band are 0")
# rewards
parser.add_argument("--rm-type", default="math", help="math | mc | exact | f1 | format | weighted e.g. math+format:0.9,0.1 | remote (needs --rm-url)")
parser.add_argument("--custom-rm-path", default=None, help="module:function(response, label, metadata) -> float or dict")
parser.add_argument("--rm-url", default=None, help="--rm-type remote: each sample is POSTed here as JSON (README: RL)")
parser.add_argument("--rm-concurrency", type=int, default=32, help="--rm-type remote: requests in flight at once")
parser.add_argument("--rm-timeout", type=float, default=30.0, help="--rm-type remote: seconds per request attempt")
parser.add_argument("--rm-retries", type=int, default=3, help="--rm-type remote: retries after a refused/timed-out/5xx call")
parser.add_argument("--rm-failure", default="drop", choices=["drop", "zero"],
                    help="a reward that fails (raises, non-number, failed remote call): drop = never trained on, zero = reward 0")
# optimisation
parser.add_argument("--max-tokens-per-gpu", type=int, default=8192, help="padded tokens per micro-batch")
parser.add_argument("--lr-scale", type=float, default=0.05, help="multiplier on the base optimizer LRs (RL wants small steps)")
parser.add_argument("--weight-decay", type=float, default=0.0)
parser.add_argument("--grad-clip", type=float, default=1.0)
parser.add_argument("--warmup-rollouts", type=int, default=0)
# eval, saving, misc
parser.add_argument("--eval-interval", type=int, default=10, help="evaluate every N rollouts (and before the first and after the last)")
parser.add_argument("--eval-max-problems", type=int, default=200)
parser.add_argument("--n-samples-per-eval-prompt", type=int, default=4)
parser.add_argument("--eval-temperature", type=float, default=1.0)
parser.add_argument("--pass-k", type=str, default="1,4", help="comma-separated k for pass@k")
parser.add_argument("--save-interval", type=int, default=20)
parser.add_argument("--rollout-timeout", type=float, default=1800, help="seconds a rank's rollout may take before the run saves and "
                    "exits non-zero, naming what was in flight (0 = no limit)")
parser.add_argument("--resume", action="store_true", help="continue from the latest RL checkpoint")
parser.add_argument("--run", default="dummy", help="wandb run name ('dummy' = no wandb)")
parser.add_argument("--device-type", default=None, help="cuda | cpu | mps (default: autodetect)")
parser.add_argument("--seed", type=int, default=42)
args = parser.parse_args(sys.argv[1:] if sys.argv[1:2] != ["--"] else sys.argv[2:])
# fmt: on

# -----------------------------------------------------------------------------------------------
# flags that must agree, checked before any GPU work
# collectives give up on a missing rank after a while (a hang in native code, a dead node) rather than block forever
ddp, rank, local_rank, world_size, device = compute_init(args.device_type, seed=args.seed,
                                                         timeout_s=2 * args.rollout_timeout + 600 if args.rollout_timeout > 0 else None)
master = rank == 0
# --async splits the ranks: the first R sample, the others train; synchronous mode has every rank do both
async_mode = args.async_mode and world_size > 1
if args.async_mode and not async_mode:
    print0("--async with one rank: falling back to synchronous RL (sampling and training take turns on the one device)")
if args.rollout_num_gpus is not None and not args.async_mode:
    raise SystemExit("--rollout-num-gpus only applies with --async")
R = (args.rollout_num_gpus or world_size // 2) if async_mode else world_size
if async_mode and not 1 <= R < world_size:
    raise SystemExit(f"--rollout-num-gpus {R} must leave at least one of the {world_size} ranks to train (--async)")
if async_mode and args.resume:
    raise SystemExit("--resume with --async is not supported: the prompt order lives on the sampling ranks; resume without --async")
is_sampler, is_trainer = rank < R or not async_mode, rank >= R or not async_mode
sworld, tworld = R, (world_size - R if async_mode else world_size)  # sampling ranks, training ranks
srank, trank = (rank, rank - R) if async_mode else (rank, rank)
sgroup = tgroup = wgroup = None  # process groups: samplers, trainers, first trainer + samplers (weights); None = all
if async_mode:
    sgroup, tgroup = dist.new_group(list(range(R))), dist.new_group(list(range(R, world_size)))
    wgroup = dist.new_group(list(range(R + 1)))
dist_group = (tgroup if async_mode else True) if ddp else False  # what rl.masked_whiten reduces over
n = args.n_samples_per_prompt
rollout_samples = args.rollout_batch_size * n
if args.global_batch_size is None:
    if rollout_samples % args.num_steps_per_rollout:
        raise SystemExit(f"--rollout-batch-size x --n-samples-per-prompt = {rollout_samples} does not divide by --num-steps-per-rollout {args.num_steps_per_rollout}")
    args.global_batch_size = rollout_samples // args.num_steps_per_rollout
if args.global_batch_size * args.num_steps_per_rollout != rollout_samples:
    raise SystemExit(f"--global-batch-size {args.global_batch_size} x --num-steps-per-rollout {args.num_steps_per_rollout} "
                     f"must equal --rollout-batch-size x --n-samples-per-prompt = {rollout_samples}")
for what, k in (("sampling ranks", sworld), ("training ranks", tworld)):
    if args.rollout_batch_size % k:
        raise SystemExit(f"--rollout-batch-size {args.rollout_batch_size} must divide by the number of {what} {k}")
if args.global_batch_size % (tworld * n):
    raise SystemExit(f"--global-batch-size {args.global_batch_size} must be a multiple of training ranks x --n-samples-per-prompt = {tworld * n}")
dynamic_sampling = args.over_sampling_batch_size is not None
if not dynamic_sampling:
    args.over_sampling_batch_size = args.rollout_batch_size
if args.partial_rollout and not (dynamic_sampling and args.over_sampling_batch_size > args.rollout_batch_size):
    raise SystemExit("--partial-rollout needs --over-sampling-batch-size larger than --rollout-batch-size: "
                     "partial rollouts abort the surplus that is still generating once the batch is full")
if args.partial_rollout and args.custom_generate_function_path:
    raise SystemExit("--partial-rollout drives the engine itself: it cannot be combined with --custom-generate-function-path")
if args.over_sampling_batch_size % sworld:
    raise SystemExit(f"--over-sampling-batch-size {args.over_sampling_batch_size} must divide by the number of sampling ranks {sworld}")
if args.use_kl_loss and args.kl_loss_coef <= 0:
    raise SystemExit("--use-kl-loss needs a positive --kl-loss-coef")
ppo = args.advantage_estimator == "ppo"
if ppo and not (args.critic_lr or 0) > 0:
    raise SystemExit("--advantage-estimator ppo needs a critic: give --critic-lr (e.g. 1e-4)")
if args.critic_lr is not None and not ppo:
    raise SystemExit(f"--critic-lr is only used by --advantage-estimator ppo, not {args.advantage_estimator}")
if args.use_opd != (args.opd_teacher_load is not None):
    raise SystemExit("--use-opd and --opd-teacher-load go together: give both or neither")
if args.eps_clip_c is not None and args.eps_clip_c <= 1:
    raise SystemExit(f"--eps-clip-c must be > 1 (dual clip), got {args.eps_clip_c}")
pass_ks = [int(k) for k in args.pass_k.split(",")]
if max(pass_ks) > args.n_samples_per_eval_prompt:
    raise SystemExit(f"--pass-k {args.pass_k} needs --n-samples-per-eval-prompt >= {max(pass_ks)}")
group_filter = load_function(args.dynamic_sampling_filter_path, ["group"], "--dynamic-sampling-filter-path") \
    if dynamic_sampling else keep_all_groups
buffer_filter = load_function(args.buffer_filter_path, ["buffer", "n"], "--buffer-filter-path")
custom_rm = load_function(args.custom_rm_path, ["response", "label", "metadata"], "--custom-rm-path") if args.custom_rm_path else None
custom_generate = load_function(args.custom_generate_function_path, ["args", "engine", "tokenizer", "prompts", "seeds"],
                                "--custom-generate-function-path") if args.custom_generate_function_path else None
if args.multi_turn:
    if custom_generate is not None:
        raise SystemExit("--multi-turn and --custom-generate-function-path both generate the rollout: give one of them")
    if args.partial_rollout:
        raise SystemExit("--multi-turn and --partial-rollout cannot be combined: partial rollouts park and resume single engine requests")
    args.max_turns = 4 if args.max_turns is None else args.max_turns
    if args.max_turns < 1:
        raise SystemExit(f"--max-turns must be >= 1, got {args.max_turns}")
    args.tool = args.tool or "calculator"
    tool = make_tool(args.tool)
elif args.max_turns is not None or args.tool is not None:
    raise SystemExit("--max-turns and --tool are only used with --multi-turn")
remote_rm = args.rm_type == "remote"
if remote_rm:
    if not args.rm_url:
        raise SystemExit("--rm-type remote needs --rm-url (the reward server's address, e.g. http://127.0.0.1:8000/reward)")
    if not args.rm_url.startswith(("http://", "https://")):
        raise SystemExit(f"--rm-url {args.rm_url!r} must start with http:// or https://")
    if custom_rm is not None:
        raise SystemExit("--rm-type remote and --custom-rm-path both pick the reward: give one of them")
    if args.rm_concurrency < 1 or args.rm_timeout <= 0 or args.rm_retries < 0:
        raise SystemExit(f"--rm-concurrency must be >= 1 (got {args.rm_concurrency}), --rm-timeout > 0 (got {args.rm_timeout}), "
                         f"--rm-retries >= 0 (got {args.rm_retries})")
elif args.rm_url:
    raise SystemExit(f"--rm-url is only used with --rm-type remote (got --rm-type {args.rm_type})")
if custom_rm is None and not remote_rm:
    compute_reward(args.rm_type, "#### 1", "1")  # fails now, naming the valid types, if --rm-type is unknown

# -----------------------------------------------------------------------------------------------
# model, reference, optimizer
model, tokenizer, meta = load_model(args.source, device, phase="train", model_tag=args.model_tag, step=args.model_step)
need_ref = args.use_kl_loss or args.kl_coef > 0
ref_model = copy.deepcopy(model).eval().requires_grad_(False) if need_ref and is_trainer else None  # frozen start point
critic = critic_optimizer = None
if ppo and is_trainer:
    critic = Critic(model).to(device)
    critic_optimizer = MuonAdamW([dict(params=list(critic.parameters()), kind="adamw", lr=args.critic_lr, initial_lr=args.critic_lr,
                                       betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)])
teacher = None
if args.use_opd and is_trainer:
    t = args.opd_teacher_load
    if os.path.isdir(t):
        teacher, _, _ = build_model(t, device=device)
    else:
        src, _, tag = t.partition(":")
        teacher, _, _ = load_model(src, device, model_tag=tag or None)
    if teacher.config.vocab_size != model.config.vocab_size:
        raise SystemExit(f"--opd-teacher-load {t}: vocab {teacher.config.vocab_size} differs from the student's {model.config.vocab_size}")
    teacher.requires_grad_(False)
optimizer = build_optimizer(model, weight_decay=args.weight_decay)
for g in optimizer.param_groups:
    g["initial_lr"] = g["initial_lr"] * args.lr_scale
    g["lr"] = g["initial_lr"]
engine = None  # made once the prompts are known: its KV cache is sized to the longest prompt + response
autocast = autocast_ctx(device.type)
output_tag = args.output_tag or meta.get("model_tag") or args.model_tag or "d"
ckpt_dir = os.path.join(get_base_dir(), "rl_checkpoints", output_tag)
logger = get_logger(args.run, project="nanorl-rl", config=vars(args), master_process=master)


def task_prompts(task_name, split):
    """Turn a task's examples into RL prompts: the conversation without its answer, plus the label."""
    kw = {"path": args.task_path} if args.task_path else {}
    if task_name == "offline":
        kw["levels"] = tuple(int(x) for x in args.levels.split(","))
    task = get_task(task_name, split, **kw)
    items = []
    for i in range(len(task)):
        conv = task.get_example(i)
        label = conv.get("label")
        if label is None and conv["messages"][-1]["role"] == "assistant":
            ref = conv["messages"][-1]["content"]
            ref = ref if isinstance(ref, str) else "".join(p["text"] for p in ref if p["type"] == "text")
            label = extract_answer(ref)
        if label is None and custom_rm is None and not remote_rm:  # a remote grader may not need one
            raise SystemExit(f"task {task_name!r} ({split}) row {i} has no label, and --rm-type {args.rm_type} needs one")
        items.append({"conversation": conv, "label": label, "metadata": {"task": task_name, "row": i}})
    return items


train_items = task_prompts(args.task, "train")
eval_name = args.eval_task or args.task
eval_items = task_prompts(eval_name, "test")[:args.eval_max_problems]
source = PromptSource(train_items, seed=args.seed, rank=srank, world_size=sworld)
longest_prompt = max(len(tokenizer.render_for_completion(p["conversation"])) for p in train_items + eval_items)
if longest_prompt + 1 > model.config.sequence_len:
    raise SystemExit(f"the longest prompt has {longest_prompt} tokens, more than the model's context {model.config.sequence_len}")
engine = Engine(model, tokenizer, batch_size=args.engine_batch_size,
                max_len=min(model.config.sequence_len, longest_prompt + args.max_response_len)) if is_sampler else None
buffer = RolloutBuffer(buffer_filter)
print0(f"RL on {len(train_items)} {args.task} prompts, eval on {len(eval_items)} {eval_name} prompts, {world_size} rank(s), device {device}")


def score(response_text, label, metadata):
    """Reward of one response; (None, reason) when the reward function fails or gives a non-number."""
    if custom_rm is not None:
        return safe_reward(custom_rm, response_text, label, metadata)
    return safe_reward(compute_reward, args.rm_type, response_text, label, metadata)


def response_text(tokens):
    return tokenizer.decode([t for t in tokens if t not in engine_stop_tokens])


inflight = {}  # what this rank's rollout is working on, named in the report if the rollout fails or hangs
engine_stop_tokens = {tokenizer.encode_special("<|assistant_end|>"), tokenizer.get_bos_token_id()}
python_start, output_end = tokenizer.encode_special("<|python_start|>"), tokenizer.encode_special("<|output_end|>")
reward_failures = {"count": 0}


def generate_groups(prompts, seeds, temperature, num_samples, weight_version):
    """The default rollout: one engine.generate call over all prompts, each fanned out to num_samples."""
    inflight.update(generating=[p["metadata"] for p in prompts])
    if custom_generate is not None:
        return custom_generate(args, engine, tokenizer, prompts, seeds)
    prompt_ids = [tokenizer.render_for_completion(p["conversation"]) for p in prompts]
    reqs = [Request(prompt_ids=ids, num_samples=num_samples, max_tokens=args.max_response_len, temperature=temperature,
                    top_k=args.top_k, top_p=args.top_p, seed=seed) for ids, seed in zip(prompt_ids, seeds)]
    results = multi_turn_generate(engine, reqs, args.max_turns, tool) if args.multi_turn else engine.generate(reqs)
    groups = [[extend_sample(s, c) for s, c in zip(new_group(p, ids, seed, num_samples, weight_version), comps)]
              for p, ids, seed, comps in zip(prompts, prompt_ids, seeds, results)]
    if args.multi_turn:  # each response's tool calls, errors and whether it hit --max-turns, for the step's metrics
        for group, comps in zip(groups, results):
            for s, c in zip(group, comps):
                s.metadata.update(c.turn_stats())
    return groups


def new_group(p, prompt_ids, seed, num_samples, weight_version):
    """Empty samples of one prompt, to be extended by the engine's completions."""
    return [Sample(prompt=p["conversation"], tokens=list(prompt_ids), label=p["label"], status=ABORTED, weight_version=weight_version,
                   index=si, metadata={**p["metadata"], "seed": seed}) for si in range(num_samples)]


def stream_groups(prompts, seeds, weight_version):
    """
    --partial-rollout: yield each group, scored, as soon as all its samples end. When the batch is full the caller
    closes this generator: what is still generating is aborted and parked in the buffer with the tokens it has
    (and the weight_version it started under), and the next rollout continues it before starting new prompts.
    """
    jobs = []  # (group, {sample index: (handle, completion index)})
    inflight.update(generating=[s.metadata for g in buffer.partial for s in g[:1]] + [p["metadata"] for p in prompts])
    for group in buffer.take_partial():
        jobs.append((group, {s.index: (engine.submit(Request(
            list(s.tokens), max_tokens=args.max_response_len - s.response_length, temperature=args.temperature, top_k=args.top_k,
            top_p=args.top_p, seed=s.metadata["seed"], first_sample=s.index, start_counter=s.response_length)), 0)
            for s in group if s.status == ABORTED}))
        for s in group:
            s.metadata["resumed"] = s.metadata.get("resumed", 0) + (s.status == ABORTED)
    for p, seed in zip(prompts, seeds):
        ids = tokenizer.render_for_completion(p["conversation"])
        h = engine.submit(Request(ids, num_samples=n, max_tokens=args.max_response_len, temperature=args.temperature,
                                  top_k=args.top_k, top_p=args.top_p, seed=seed))
        jobs.append((new_group(p, ids, seed, n, weight_version), {si: (h, si) for si in range(n)}))
    try:
        while jobs:
            engine.step()
            for job in [j for j in jobs if all(h.done for h, _ in j[1].values())]:
                jobs.remove(job)
                group, handles = job
                for si, (h, ci) in handles.items():
                    extend_sample(group[si], h.completions[ci])
                yield assign_rewards([group])[0]
    finally:
        if jobs:  # the batch is full: abort the rest and park it, cut back to where it can be continued exactly
            engine.abort()
            while engine.step():
                pass
            for group, handles in jobs:
                for si, (h, ci) in handles.items():
                    extend_sample(group[si], h.completions[ci], python_start, output_end)
                buffer.partial.append(group)


def assign_rewards(groups):
    todo = [s for g in groups for s in g if s.reward is None]  # custom generate functions may score their own samples
    texts = [response_text(s.tokens[s.prompt_length:]) for s in todo]
    if remote_rm:  # all the samples in one batched call, --rm-concurrency requests in flight
        payloads = [{"prompt": s.prompt, "response": t, "label": s.label, "metadata": s.metadata} for s, t in zip(todo, texts)]
        inflight["scoring"] = {"remote": args.rm_url, "samples": len(payloads)}
        results = remote_rewards(args.rm_url, payloads, args.rm_concurrency, args.rm_timeout, args.rm_retries)
        del inflight["scoring"]
    else:
        results = []
        for s, t in zip(todo, texts):
            inflight["scoring"] = {"metadata": s.metadata, "response": t[:200]}
            results.append(score(t, s.label, s.metadata))
            del inflight["scoring"]
    # a broken reward is counted, and its sample is dropped from training or scored 0 (--rm-failure)
    failed = set_rewards(groups, todo, results, args.rm_failure)
    reward_failures["count"] += len(failed)
    if failed:
        print0(f"warning: {len(failed)}/{len(todo)} rewards failed ({args.rm_failure}), e.g. {failed[0].metadata['reward_error']}")
    return groups


# -----------------------------------------------------------------------------------------------
# evaluation: pass@k on held-out prompts

def evaluate(step):
    model.eval()
    my_items = eval_items[srank::sworld]
    seeds = [10_000_000 + srank + sworld * i for i in range(len(my_items))]  # the prompt's global index
    groups = generate_groups(my_items, seeds, temperature=args.eval_temperature,
                             num_samples=args.n_samples_per_eval_prompt, weight_version=step)
    groups = assign_rewards(groups)
    correct = [[s.scalar_reward() >= 0.5 for s in g] for g in groups]
    sums = torch.tensor([sum(rl.pass_at_k(len(c), sum(c), k) for c in correct) for k in pass_ks] + [len(correct)],
                        dtype=torch.float64, device=device)
    if ddp:
        dist.all_reduce(sums, group=sgroup)
    out = {f"eval/pass@{k}": (sums[i] / max(sums[-1], 1)).item() for i, k in enumerate(pass_ks)}
    print0(f"step {step:05d} | eval on {int(sums[-1])} prompts | " + " | ".join(f"{k} {v:.4f}" for k, v in out.items()))
    return out


# -----------------------------------------------------------------------------------------------
# resume

start_step, weight_version = 0, 0
if args.resume:
    last = find_last_step(ckpt_dir)
    if last is None:
        raise SystemExit(f"--resume: no RL checkpoint in {ckpt_dir}")
    model_state, optim_state, ck_meta, extra = load_checkpoint(ckpt_dir, last, device=device, load_optimizer=True, rank=rank)
    model.load_state_dict(model_state)
    optimizer.load_state_dict(optim_state)
    source.load_state_dict(extra["source"])
    buffer.load_state_dict(extra["buffer"])
    if critic is not None:
        critic.load_state_dict(extra["critic"])
        critic_optimizer.load_state_dict(extra["critic_optim"])
    random.setstate(extra["py_rng"])
    torch.set_rng_state(extra["torch_rng"])
    start_step = weight_version = last
    old_args = ck_meta.get("rl_args", {})
    diffs = {k: (old_args.get(k), v) for k, v in vars(args).items() if k != "resume" and old_args.get(k) != v}
    if diffs:
        print0("warning: resuming with changed RL flags: " + ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diffs.items()))
    print0(f"resumed from {ckpt_dir} step {last}")


class RolloutTimeout(BaseException):
    """Not an Exception: a reward wrapper that catches Exception must not swallow it."""


def on_rollout_timeout(signum, frame):
    raise RolloutTimeout(f"the rollout ran past --rollout-timeout {args.rollout_timeout:g}s")


def save(step):
    extra = {"source": source.state_dict(), "buffer": buffer.state_dict(), "py_rng": random.getstate(),
             "torch_rng": torch.get_rng_state()}
    if critic is not None:  # every rank keeps the same critic (DDP-averaged), so each saves it with its extra state
        extra.update(critic=critic.state_dict(), critic_optim=critic_optimizer.state_dict())
    save_checkpoint(ckpt_dir, step, model.state_dict(), optimizer.state_dict(),
                    meta={**meta, "model_tag": output_tag, "step": step, "rl_args": vars(args)}, extra=extra, rank=trank, group=tgroup)


# -----------------------------------------------------------------------------------------------
# the training math on one micro-batch

def forward_logp(m, batch):
    with autocast:
        return m.token_logprobs(batch["inputs"], batch["targets"].clamp(min=0), temperature=args.temperature, return_entropy=True)


@torch.no_grad()
def logp_of(m, samples):
    """Per-token log-probs (B, T) of samples under model m, micro-batched, aligned like collate()."""
    return per_token(samples, lambda batch: forward_logp(m, batch)[0])


@torch.no_grad()
def values_of(samples):
    """The critic's per-token values of samples (the ones the rollout saw: GAE's baseline, value clipping's anchor)."""
    def f(batch):
        with autocast:
            return critic(batch["inputs"])
    return per_token(samples, f)


def per_token(samples, fn):
    out = [None] * len(samples)
    for mb in pack_micro_batches(samples, args.max_tokens_per_gpu):
        res = fn(collate([samples[i] for i in mb], device))
        for j, i in enumerate(mb):
            out[i] = res[j].float().cpu()
    return out


def pad_like(rows, T):
    return torch.stack([torch.nn.functional.pad(r[:T], (0, T - min(len(r), T))) for r in rows])


def compute_advantages(samples, ref_lp, old_values):
    """Per-sample per-token advantages (list of 1-D tensors aligned like collate()), by --advantage-estimator,
    and for ppo the critic's targets (returns); None otherwise."""
    batch = collate(samples)
    mask, T = batch["loss_mask"], batch["inputs"].size(1)
    rewards = torch.tensor([s.scalar_reward() for s in samples], dtype=torch.float32)
    kl = None
    if ref_lp is not None and args.kl_coef > 0:
        old_lp = pad_like(logp_of(model, samples), T)
        kl = rl.kl_estimate(old_lp, pad_like(ref_lp, T), "k1") * mask
    est = args.advantage_estimator
    if est in ("grpo", "rloo", "gspo", "cispo") and kl is not None:
        rewards = rewards - args.kl_coef * kl.sum(-1)  # sequence-level KL penalty in the reward
    if est in ("grpo", "gspo", "cispo"):
        adv = rl.grpo_advantages(rewards, mask, n, std_normalize=not args.disable_grpo_std_normalization)
    elif est == "rloo":
        adv = rl.rloo_advantages(rewards, mask, n)
    elif est == "reinforce_plus_plus":
        adv = rl.reinforce_pp_returns(rewards, mask, kl=kl, kl_coef=args.kl_coef, gamma=args.gamma, distributed=dist_group)
    elif est == "ppo":
        # the reward on the last response token, the KL penalty on every token, then GAE against the critic
        token_rewards = rl._last_token_rewards(rewards, mask)
        if kl is not None:
            token_rewards = token_rewards - args.kl_coef * kl
        adv, returns = rl.gae_advantages(token_rewards, pad_like(old_values, T), mask, args.gamma, args.lambd)
    else:
        adv = rl.reinforce_pp_baseline_advantages(rewards, mask, n, kl=kl, kl_coef=args.kl_coef, distributed=dist_group)
    if args.normalize_advantages and not est.startswith("reinforce_plus_plus"):
        adv = rl.masked_whiten(adv, mask, distributed=dist_group) * mask
    adv = [adv[i] for i in range(len(samples))]
    return adv, ([returns[i] for i in range(len(samples))] if est == "ppo" else None)


def train_minibatch(samples, adv, old_lp, ref_lp, lr_mult, returns=None, old_values=None):
    """One optimizer step over `samples` (this rank's share of the global batch); with ppo, one critic step too."""
    model.train()
    local_tok = sum(sum(s.loss_mask) for s in samples)
    counts = torch.tensor([local_tok, len(samples)], dtype=torch.float64, device=device)
    if ddp:
        dist.all_reduce(counts, group=tgroup)
    global_tok, global_seq = max(counts[0].item(), 1.0), counts[1].item()
    sums = {}
    for mb in pack_micro_batches(samples, args.max_tokens_per_gpu):
        mbs = [samples[i] for i in mb]
        batch = collate(mbs, device)
        T, mask = batch["inputs"].size(1), batch["loss_mask"]
        a = pad_like([adv[i] for i in mb], T).to(device)
        logp, ent = forward_logp(model, batch)
        logp, ent = logp.float(), ent.float()
        old = pad_like([old_lp[i] for i in mb], T).to(device) if old_lp is not None else logp.detach()
        tis = None
        if args.use_tis:
            tis, tm = rl.tis_weights(old, batch["rollout_logp"], mask, args.tis_clip, args.tis_clip_low, args.tis_mode)
        if args.advantage_estimator == "gspo":
            pg_loss, m = rl.gspo_loss(logp, old, a, mask, args.eps_clip, args.eps_clip_high)
        elif args.advantage_estimator == "cispo":
            pg_loss, m = rl.cispo_loss(logp, old, a, mask, args.eps_clip_high or args.eps_clip, args.eps_clip,
                                       loss_agg=args.loss_aggregation, max_len=args.max_response_len)
        else:
            pg_loss, m = rl.policy_loss(logp, old, a, mask, args.eps_clip, args.eps_clip_high, args.eps_clip_c,
                                        loss_agg=args.loss_aggregation, max_len=args.max_response_len, tis_weights=tis)
        if tis is not None:
            m.update(tm)
        loss = pg_loss
        if args.entropy_coef:
            loss = loss - args.entropy_coef * rl.aggregate_loss(ent, mask, args.loss_aggregation, args.max_response_len)
        if ref_lp is not None and args.use_kl_loss:
            kl = rl.kl_estimate(logp, pad_like([ref_lp[i] for i in mb], T).to(device), args.kl_loss_type)
            kl_loss = rl.aggregate_loss(kl, mask, args.loss_aggregation, args.max_response_len)
            loss = loss + args.kl_loss_coef * kl_loss
            m["kl_loss"] = kl_loss.detach()
        # each micro-batch's mean is re-weighted to its share of the global batch (the optimizer averages
        # gradients over the training ranks, hence x tworld), so the step equals one pass over the whole batch
        mb_tok = mask.sum().item()
        share = (mb_tok / global_tok) if args.loss_aggregation == "token_mean" else (len(mbs) / global_seq)
        (loss * share * tworld).backward()
        if critic is not None:
            with autocast:
                values = critic(batch["inputs"])
            vf_loss, vm = rl.value_loss(values, pad_like([old_values[i] for i in mb], T).to(device),
                                        pad_like([returns[i] for i in mb], T).to(device), mask, args.value_clip or None,
                                        loss_agg=args.loss_aggregation, max_len=args.max_response_len)
            (vf_loss * share * tworld).backward()
            m.update(vm, vf_loss=vf_loss.detach())
        m["pg_loss"], m["entropy"] = pg_loss.detach(), rl.masked_mean(ent.detach(), mask)
        m["train_rollout_logprob_abs_diff"] = rl.masked_mean((logp.detach() - batch["rollout_logp"]).abs(), mask)
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + float(v) * mb_tok
    optimizer.average_gradients(tgroup)  # clip the global gradient, not this rank's share
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip) if args.grad_clip > 0 else \
        torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None))
    for g in optimizer.param_groups:
        g["lr"] = g["initial_lr"] * lr_mult
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    out = {k: v / max(local_tok, 1) for k, v in sums.items()}
    out["grad_norm"] = float(grad_norm)
    if critic is not None:
        critic_optimizer.average_gradients(tgroup)
        out["critic_grad_norm"] = float(torch.nn.utils.clip_grad_norm_(critic.parameters(), args.grad_clip or float("inf")))
        critic_optimizer.step()
        critic_optimizer.zero_grad(set_to_none=True)
    return out


# -----------------------------------------------------------------------------------------------
# the loop: one rollout, one training step on it

def do_rollout(step, version, timer):
    """This rank's share of rollout step+1, sampled by policy `version` -> (groups, fstats, failure). A failure or a
    hang past --rollout-timeout is caught and described (failure), never left to block the other ranks."""
    def make_groups():  # dynamic sampling: over-sample prompts until the batch holds enough useful groups
        prompts = source.get(args.over_sampling_batch_size // sworld)
        seeds = [args.seed * 1_000_003 + epoch * 10_000_019 + pos for epoch, pos in source.last_keys]
        if args.partial_rollout:
            return stream_groups(prompts, seeds, version)
        return assign_rewards(generate_groups(prompts, seeds, args.temperature, n, version))

    model.eval()
    groups, fstats, failure = [], {}, None
    try:
        if args.rollout_timeout > 0:  # SIGALRM interrupts Python code that hangs (a reward call, a custom rollout)
            signal.signal(signal.SIGALRM, on_rollout_timeout)
            signal.setitimer(signal.ITIMER_REAL, args.rollout_timeout)
        with timer.section("rollout", device.type):
            groups, fstats = fill_rollout(args.rollout_batch_size // sworld, buffer, make_groups, group_filter,
                                          args.max_sampling_rounds, stop_when_full=args.partial_rollout)
    except (Exception, RolloutTimeout) as e:
        traceback.print_exc()
        what = inflight.get("scoring") or {"prompts": inflight.get("generating")}
        failure = f"rank {rank}: rollout {step + 1} failed: {type(e).__name__}: {e}\n  in flight: {what}"
        print(failure, file=sys.stderr, flush=True)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        inflight.clear()
    return groups, fstats, failure


def stop_after_failure(step, n_failed):
    """A rollout failed somewhere: save the state before it (a --resume redoes that rollout) and exit non-zero."""
    if is_trainer:
        save(step)
    print0(f"stopped: a rollout failed on {n_failed} rank(s); saved step {step} in {ckpt_dir}")
    compute_cleanup()
    sys.exit(1)


def train_step(step, samples, timer, m):
    """Shape rewards, compute advantages and take --num-steps-per-rollout optimizer steps on this training rank's
    samples -> the step's metrics (added to the rollout's metrics m), averaged over the training ranks."""
    bad = next((s for s in samples if len(s.rollout_log_probs) != s.response_length), None)
    if args.use_tis and bad is not None:  # TIS compares against the sampler's log-probs: without them it is garbage
        raise SystemExit(f"--use-tis needs the rollout's log-probs, but a sample ({bad.metadata}) has {len(bad.rollout_log_probs)} for "
                         f"{bad.response_length} response tokens: --custom-generate-function-path must fill Sample.rollout_log_probs")
    # reward shaping on the kept samples
    if args.overlong_buffer_len > 0:
        lens = torch.tensor([s.response_length for s in samples], dtype=torch.float32)
        pen = rl.overlong_penalty(lens, args.max_response_len, args.overlong_buffer_len, args.overlong_penalty_factor)
        for s, p in zip(samples, pen.tolist()):
            if isinstance(s.reward, dict):
                s.reward = {**s.reward, "overlong": p, "total": s.reward["total"] + p}
            else:
                s.reward = s.reward + p
    if args.mask_truncated_samples:
        for s in samples:
            if s.status == TRUNCATED:
                s.loss_mask = [0] * s.response_length
    # reference and old log-probs, the critic's values
    ref_lp = None
    if ref_model is not None:
        with timer.section("ref", device.type):
            ref_lp = logp_of(ref_model, samples)
    old_lp = None
    if args.num_steps_per_rollout > 1:
        with timer.section("old_logp", device.type):
            old_lp = logp_of(model, samples)  # the policy before this rollout's first update
    old_values = None
    if critic is not None:
        with timer.section("values", device.type):
            old_values = values_of(samples)
    adv, returns = compute_advantages(samples, ref_lp, old_values)
    opd_kl = None
    if teacher is not None:
        # on-policy distillation: tokens the teacher likes more than the student (before this update) get pushed up
        with timer.section("teacher", device.type):
            teacher_lp = logp_of(teacher, samples)
        student_lp = old_lp or logp_of(model, samples)
        T, mask = adv[0].numel(), collate(samples)["loss_mask"]
        s_lp, t_lp = pad_like(student_lp, T), pad_like(teacher_lp, T)
        adv = list(rl.opd_adjust(torch.stack(adv), s_lp, t_lp, mask, args.opd_kl_coef))
        opd_kl = rl.masked_mean(s_lp - t_lp, mask).item()
    # train: the rollout is cut into num_steps_per_rollout mini-batches of whole groups
    lr_mult = min(1.0, (step + 1) / args.warmup_rollouts) if args.warmup_rollouts > 0 else 1.0
    per_step = len(samples) // args.num_steps_per_rollout
    train_metrics = []
    with timer.section("train", device.type):
        for k in range(args.num_steps_per_rollout):
            sl = slice(k * per_step, (k + 1) * per_step)
            train_metrics.append(train_minibatch(samples[sl], adv[sl], old_lp[sl] if old_lp else None,
                                                 ref_lp[sl] if ref_lp else None, lr_mult,
                                                 returns[sl] if returns else None, old_values[sl] if old_values else None))
    # metrics, averaged over the training ranks
    rewards = [s.scalar_reward() for s in samples]
    lens = [s.response_length for s in samples]
    m.update({f"train/{k}": sum(t[k] for t in train_metrics) / len(train_metrics) for k in train_metrics[0]})
    m["train/first_step_ppo_kl"] = train_metrics[0].get("ppo_kl", 0.0)
    m.update({"rollout/reward_mean": sum(rewards) / len(rewards),
              "rollout/reward_std": float(torch.tensor(rewards).std()) if len(rewards) > 1 else 0.0,
              "rollout/response_len_mean": sum(lens) / len(lens),
              "rollout/truncated_frac": sum(s.status == TRUNCATED for s in samples) / len(samples),
              "rollout/reward_failures": reward_failures["count"]})
    comps = [k for k in next((s.reward for s in samples if isinstance(s.reward, dict)), {}) if k != "total"]
    for c in comps:
        m[f"rollout/reward_{c}"] = sum(s.reward.get(c, 0.0) for s in samples if isinstance(s.reward, dict)) / len(samples)
    seq_adv = torch.tensor([float(a[a != 0][0]) if (a != 0).any() else 0.0 for a in adv])
    m.update({"rollout/adv_mean": seq_adv.mean().item(), "rollout/adv_std": seq_adv.std().item() if len(seq_adv) > 1 else 0.0,
              "rollout/adv_abs_max": seq_adv.abs().max().item()})
    m["rollout/max_staleness"] = max(step - s.weight_version for s in samples)  # policy versions behind the trainer
    if args.partial_rollout:
        m["rollout/partial_resumed_samples"] = sum(s.metadata.get("resumed", 0) > 0 for s in samples)
    if opd_kl is not None:
        m["train/opd_student_teacher_kl"] = opd_kl
    if args.multi_turn:  # per response: tool calls, calls that errored, and whether it ran into --max-turns
        for k in ("tool_calls", "tool_errors", "max_turns_hit"):
            m[f"rollout/{k}_mean"] = sum(s.metadata.get(k, 0) for s in samples) / len(samples)
    for k, v in timer.times.items():
        m[f"time/{k}"] = v
    m["perf/train_tok_per_s"] = sum(len(s.tokens) for s in samples) / max(timer.times.get("train", 1e-9), 1e-9)
    if ddp:
        keys = sorted(m)
        vec = torch.tensor([float(m[k]) for k in keys], dtype=torch.float64, device=device)
        dist.all_reduce(vec, group=tgroup)
        m = {k: v / tworld for k, v in zip(keys, vec.tolist())}
    return m


def rollout_metrics(fstats, samples, rollout_s):
    m = {f"rollout/{k}": v for k, v in fstats.items()}
    m["perf/rollout_tok_per_s"] = sum(s.response_length for s in samples) / max(rollout_s, 1e-9)
    if args.partial_rollout:
        m["rollout/partial_parked_groups"] = len(buffer.partial)
    return m


def log_step(step, m, dt):
    print0(f"step {step + 1:05d}/{args.num_rollouts} | reward {m['rollout/reward_mean']:.3f} | len {m['rollout/response_len_mean']:.1f} "
           f"| pg {m['train/pg_loss']:+.4f} | clip {m['train/clipfrac']:.3f} | ppo_kl {m['train/ppo_kl']:+.2e} "
           f"| ent {m['train/entropy']:.3f} | gnorm {m['train/grad_norm']:.3f} | lp_diff {m['train/train_rollout_logprob_abs_diff']:.1e} "
           f"| dropped {int(m.get('rollout/groups_dropped', 0))} | dt {dt:.1f}s (rollout {m.get('time/rollout', 0):.1f}s, "
           f"idle {m['perf/idle_frac']:.0%}) | eta {eta_min(time.time() - timer_total, (step + 1 - start_step) / (args.num_rollouts - start_step)):.1f}m"
           + (f" | tools {m['rollout/tool_calls_mean']:.2f} err {m['rollout/tool_errors_mean']:.2f} "
              f"max_turns {m['rollout/max_turns_hit_mean']:.2f}" if args.multi_turn else ""))
    history.append({"step": step + 1, **m})
    logger.log(m, step=step + 1)
    log_json("rl_history", {"train": history, "eval": eval_history}, rank=rank)


def maybe_eval(step):
    if (step + 1) % args.eval_interval == 0 or step + 1 == args.num_rollouts:
        e = evaluate(step + 1)
        eval_history.append({"step": step + 1, **e})
        logger.log(e, step=step + 1)


def weights_checksum():
    return sum(p.detach().double().sum().item() for p in model.parameters())


timer_total = time.time()
# on resume, keep the history of the steps already done so the report's curves stay whole
prev = load_json("rl_history", {}) if start_step > 0 else {}
history = [h for h in prev.get("train", []) if h["step"] <= start_step]
eval_history = [e for e in prev.get("eval", []) if e["step"] <= start_step]
if start_step == 0 and is_sampler:
    eval_history.append({"step": 0, **evaluate(0)})
idle = {"s": 0.0}  # seconds this rank spent waiting on other ranks instead of computing

if not async_mode:
    # synchronous: every rank samples its share, then every rank trains on it
    for step in range(start_step, args.num_rollouts):
        timer, t0 = Timer(), time.time()
        before = (source.state_dict(), buffer.state_dict())
        groups, fstats, failure = do_rollout(step, weight_version, timer)
        # every rank learns whether any rank failed (so none waits in a collective for a rank that is gone); the wait
        # here is also this rank's idle time: the other ranks were still sampling
        t_wait = time.time()
        failed = torch.tensor([float(failure is not None)], device=device)
        if ddp:
            dist.all_reduce(failed)
        wait = time.time() - t_wait
        if failed.item():
            source.load_state_dict(before[0])
            buffer.load_state_dict(before[1])
            stop_after_failure(step, int(failed.item()))
        samples = [s for g in groups for s in g]
        m = train_step(step, samples, timer, rollout_metrics(fstats, samples, timer.times.get("rollout", 0.0)))
        weight_version += 1
        dt = time.time() - t0
        m["perf/idle_frac"] = wait / dt
        idle["s"] += wait
        log_step(step, m, dt)
        maybe_eval(step)
        if (step + 1) % args.save_interval == 0 or step + 1 == args.num_rollouts:
            save(step + 1)
elif is_sampler:
    # async, sampling rank: hand rollout k to the trainers, sample rollout k+1 with the weights it has (one version
    # behind) while they train, then take the new weights. Collectives, in order: gather k, weights k, gather k+1, ...
    def sample_payload(step):
        timer, t0 = Timer(), time.time()
        groups, fstats, failure = do_rollout(step, weight_version, timer)
        samples = [s for g in groups for s in g]
        return {"groups": groups, "failure": failure, "metrics": rollout_metrics(fstats, samples, timer.times.get("rollout", 0.0)),
                "rollout_s": time.time() - t0}

    payload = sample_payload(start_step)
    for step in range(start_step, args.num_rollouts):
        t0 = time.time()
        gathered = [None] * world_size
        dist.all_gather_object(gathered, payload)
        wait = time.time() - t0
        failures = [p["failure"] for p in gathered if p is not None and p["failure"]]
        if failures:
            stop_after_failure(step, len(failures))
        if step + 1 < args.num_rollouts:
            payload = sample_payload(step + 1)
        # the trainers' new weights (in place: the engine's CUDA graphs see them), their version and the step's metrics
        t_wait = time.time()
        for p in model.parameters():
            dist.broadcast(p.data, src=R, group=wgroup)
        box = [None]
        dist.broadcast_object_list(box, src=R, group=wgroup)
        wait += time.time() - t_wait
        weight_version, m = box[0]
        m["async/sampler_weight_version"] = weight_version
        m["async/sampler_weight_checksum"] = weights_checksum()
        dt = time.time() - t0
        m["perf/idle_frac_sampler"] = m["perf/idle_frac"] = wait / dt
        idle["s"] += wait
        if master:
            log_step(step, m, dt)
        maybe_eval(step)
else:
    # async, training rank: wait for rollout k, train on this rank's share, send the new weights to the samplers
    for step in range(start_step, args.num_rollouts):
        timer, t0 = Timer(), time.time()
        gathered = [None] * world_size
        dist.all_gather_object(gathered, None)
        wait = time.time() - t0
        payloads = [p for p in gathered if p is not None]
        failures = [p["failure"] for p in payloads if p["failure"]]
        if failures:
            stop_after_failure(step, len(failures))
        groups = [g for p in payloads for g in p["groups"]][trank::tworld]
        m = {}
        for p in payloads:  # counts add up over the sampling ranks, times are the slowest one's
            for k, v in p["metrics"].items():
                m[k] = max(m.get(k, 0), v) if k.startswith("perf/") else m.get(k, 0) + v
        m["time/rollout"] = max(p["rollout_s"] for p in payloads)
        m = train_step(step, [s for g in groups for s in g], timer, m)
        weight_version += 1
        m["async/trainer_weight_checksum"] = weights_checksum()
        m["perf/idle_frac_trainer"] = wait / (time.time() - t0)
        idle["s"] += wait
        if trank == 0:
            for p in model.parameters():
                dist.broadcast(p.data, src=R, group=wgroup)
            dist.broadcast_object_list([(weight_version, m)], src=R, group=wgroup)
        if (step + 1) % args.save_interval == 0 or step + 1 == args.num_rollouts:
            save(step + 1)

# -----------------------------------------------------------------------------------------------
# report: idle fraction per role, pass@k before and after
busy = [None] * world_size
if ddp:
    dist.all_gather_object(busy, ("sampling" if not is_trainer else "training" if async_mode else "both", idle["s"],
                                  time.time() - timer_total))
else:
    busy = [("both", idle["s"], time.time() - timer_total)]
idle_frac = {}
for role in ("both", "sampling", "training"):
    rows = [(w, t) for r, w, t in busy if r == role]
    if rows:
        idle_frac[f"idle_frac_{role}_ranks"] = round(sum(w for w, _ in rows) / sum(t for _, t in rows), 3)
print0("GPU idle fraction (time waiting on other ranks): " + ", ".join(f"{k} {v:.1%}" for k, v in idle_frac.items()))
log_json("rl_history", {"train": history, "eval": eval_history, "idle": idle_frac}, rank=rank)
if master and eval_history:
    first, last = eval_history[0], eval_history[-1]
    log_section("Chat RL", [
        {k: v for k, v in vars(args).items() if k in ("task", "advantage_estimator", "num_rollouts", "rollout_batch_size",
                                                     "n_samples_per_prompt", "loss_aggregation", "eps_clip", "kl_loss_coef",
                                                     "async_mode")},
        {**{f"before {k}": v for k, v in first.items() if k != "step"}, **{f"after {k}": v for k, v in last.items() if k != "step"},
         "wall_time_s": round(time.time() - timer_total, 1), **idle_frac},
    ])
logger.finish()
compute_cleanup()
