"""
Reinforcement learning on a chat model: the GRPO family and friends.

One step = one rollout: sample n responses for each of a batch of prompts with our own engine, score them
with the reward hub, compute advantages, then take --num-steps-per-rollout optimizer steps over the samples
(the first is exactly on-policy). This file reads top to bottom:
  flags -> configs -> prompts and rewards -> setup (ranks, models, engine) -> rollout -> train step -> eval,
  save, resume -> the --async loops -> the loop -> report
The parts live where their names say: prompts in nanorl/prompts.py, generating and scoring samples in
nanorl/rollout.py (the Sample record and its tensor layout in nanorl/samples.py), graders in nanorl/rewards.py,
advantages and the one loss path in nanorl/rl_trainer.py (the math and the estimator table in nanorl/rl.py), the
critic and the teacher in nanorl/rl_models.py, the pass@k eval in nanorl/rl_eval.py, the --async roles in
nanorl/rl_async.py. The parts with flags hold them and their config (`--help` lists them by group).

    python -m scripts.chat_rl                                   # offline curriculum, CPU-sized defaults
    torchrun --standalone --nproc_per_node=8 -m scripts.chat_rl -- --task gsm8k --rollout-batch-size 64
    python -m scripts.chat_rl --prompt-data my.jsonl --input-key question --label-key answer --rm-type math
"""

import copy
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from nanorl import checkpoint, common, fsdp, lora, prompts, rewards, rl_async, rl_eval, rl_progress, rl_trainer, rollout
from nanorl.checkpoint import add_model_args, load_model_from_args, rng_state, set_rng_state
from nanorl.common import ETA, ArgumentParser, Timer, nonneg_float, positive_float, positive_int, print0
from nanorl.engine import Engine
from nanorl.execution import require_sandbox, sandbox_mode
from nanorl.gpt import attention_backend
from nanorl.optim import build_optimizer
from nanorl.report import load_json, log_json, log_section, rl_eval_rows
from nanorl.rl_models import build_critic, load_teacher
from nanorl.synthetic import levels_flag
from tasks import get_task

# -----------------------------------------------------------------------------------------------
# flags: the core ones here; rollout, reward, training-step and async flags next to the code they configure
parser = ArgumentParser(description="RL on a chat model (GRPO family)", epilog=rl_progress.step_legend())
g = parser.add_argument_group("model and data")
add_model_args(g, "sft")  # --source, --model-tag, --model-step, --hf-model
g.add_argument("--task", default="offline", help="RL prompts: offline (the synthetic curriculum) or gsm8k")
g.add_argument("--task-path", default=None, help="local jsonl/parquet for the task instead of downloading")
g.add_argument("--levels", type=levels_flag, default="1,2,3,4", help="offline task: difficulty levels of the prompts")
g.add_argument("--eval-task", default=None, help="held-out task (default: the test split of --task)")
prompts.add_args(g)  # --prompt-data and its keys
g.add_argument("--output-tag", default=None, help="save under rl_checkpoints/<tag> (default: the source's tag)")
g = parser.add_argument_group("rollouts")
g.add_argument("--num-rollouts", "--num-rollout", type=positive_int, default=60, help="number of rollouts (= RL steps)")
g.add_argument("--rollout-batch-size", type=positive_int, default=16, help="prompts per rollout (global)")
g.add_argument("--n-samples-per-prompt", type=positive_int, default=8, help="group size")
max_len_flags = ("--max-new-tokens", "--max-response-len", "--rollout-max-response-len")
g.add_argument(*max_len_flags, dest="max_response_len", type=positive_int, default=256, help="max tokens per response")
# the engine records log-probs of the distribution it samples from; the trainer divides its logits by the same T
g.add_argument("--temperature", "--rollout-temperature", type=positive_float, default=1.0, help="rollout temperature")
g.add_argument("--lr-scale", type=positive_float, default=0.05, help="multiplier on the base LRs (RL: small steps)")
g = parser.add_argument_group("eval, saving, misc")
# the eval also runs before the first rollout and after the last; a save also after the last
g.add_argument("--eval-every", "--eval-interval", type=positive_int, default=10, help="evaluate every N rollouts")
g.add_argument("--eval-max-problems", type=positive_int, default=200, help="held-out prompts per eval")
g.add_argument("--n-samples-per-eval-prompt", type=positive_int, default=4, help="per eval prompt (>= max k)")
g.add_argument("--eval-temperature", type=nonneg_float, default=1.0, help="eval sampling temperature")
g.add_argument("--pass-k", type=common.int_list, default="1,4", help="comma-separated k for pass@k")
g.add_argument("--save-every", "--save-interval", type=positive_int, default=20, help="save every N rollouts")
g.add_argument("--resume", action="store_true", help="continue from the latest RL checkpoint")
g.add_argument(
    "--overwrite", action="store_true", help="a new run into a tag holding steps: move them to <tag>.old-<time>"
)
common.add_logging_args(g)
g.add_argument("--device-type", default=None, help="cuda | cpu | mps (default: autodetect)")
g.add_argument("--seed", type=int, default=42, help="seed of the prompt order and of every sample's random stream")
rollout.add_args(parser)
rewards.add_args(parser)
rl_trainer.add_args(parser)
rl_async.add_args(parser)
fsdp.add_args(parser.add_argument_group("sharding (nanorl/fsdp.py)"))
lora.add_args(parser)
args = parser.parse_args()

# -----------------------------------------------------------------------------------------------
# configs: each part's flags checked and turned into its config once, here; the flags themselves stay as given
rollout_cfg = rollout.config_from_args(args, parser)
reward_cfg = rewards.config_from_args(args, parser, default_rm_type="math" if args.prompt_data else "task")
trainer_cfg = rl_trainer.config_from_args(args, parser)
# --fsdp shards the policy only: the extra models of these options would stay whole on every rank, and --async's
# trainers ship weights to samplers that hold no shards
for on, flag in (
    (args.async_mode, "--async"),
    (trainer_cfg.needs_critic, "--advantage-estimator ppo (its critic)"),
    (trainer_cfg.needs_reference, "--use-kl-loss / --kl-coef (their reference model)"),
    (args.use_opd, "--use-opd (its teacher)"),
):
    if args.fsdp and on:
        parser.error(f"--fsdp does not work with {flag}: only the policy is sharded")
lora.check_args(args, parser)  # before fsdp's: --lora-rank with --fsdp is refused whatever the launcher
fsdp.check_args(args, "chat_rl")
pass_ks, n = args.pass_k, args.n_samples_per_prompt
n_eval, t_eval = args.n_samples_per_eval_prompt, args.eval_temperature  # samples per eval prompt, and their T
if max(pass_ks) > n_eval:
    parser.error(f"--pass-k {','.join(map(str, pass_ks))} needs --n-samples-per-eval-prompt >= {max(pass_ks)}")
if args.prompt_data is None and (args.eval_prompt_data or args.apply_chat_template):
    parser.error("--eval-prompt-data and --apply-chat-template only apply with --prompt-data")
over_sampling = args.over_sampling_batch_size or args.rollout_batch_size  # prompts sampled per round
group_filter, custom_generate = rollout.keep_all_groups, None
if args.over_sampling_batch_size is not None:
    group_filter = common.load_function(args.dynamic_sampling_filter_path, ["group"], "--dynamic-sampling-filter-path")
buffer_filter = common.load_function(args.buffer_filter_path, ["buffer", "n"], "--buffer-filter-path")
if args.custom_generate_function_path:
    keys = ["config", "engine", "tokenizer", "prompts", "seeds"]
    custom_generate = common.load_function(args.custom_generate_function_path, keys, "--custom-generate-function-path")
if args.agent:  # the agent's episodes are the rollout, scored by the agent itself (nanorl/agents.py)
    if args.rm_type or args.custom_rm_path or args.rm_url:
        parser.error("--agent scores its own episodes: --rm-type, --custom-rm-path and --rm-url do not apply")
    try:
        from nanorl.agents import AgentRollout
    except ImportError as e:
        parser.error(f"--agent needs the openai package: pip install openai ({e})")
    try:
        agent = common.load_function(args.agent, ["client", "item"], "--agent")
    except ValueError as e:
        parser.error(str(e))
    custom_generate = AgentRollout(agent, rollout.AGENT_TIMEOUT if args.agent_timeout is None else args.agent_timeout)

# -----------------------------------------------------------------------------------------------
# the prompts and the reward, before any model is built: a bad task, data file or reward flag fails at once
label_needed = f"--rm-type {reward_cfg.rm_type}" if reward_cfg.needs_label else None


def task_prompts(name, split):
    """A task's examples as prompts, and the task (its own grader scores them with --rm-type task)."""
    kw = {"path": args.task_path} if args.task_path else {}
    if name == "offline":
        kw["levels"] = tuple(int(x) for x in args.levels.split(","))
    task = get_task(name, split, **kw)
    return prompts.task_prompts(task, name, split, label_needed), task


def file_prompts(path, split):
    """--prompt-data / --eval-prompt-data: prompts from a jsonl, and no task (no grader of their own)."""
    items = prompts.jsonl_prompts(path, split, args.input_key, args.label_key, args.apply_chat_template, label_needed)
    return items, None


if args.prompt_data:
    eval_name = args.eval_prompt_data or args.prompt_data
    train_items, train_task = file_prompts(args.prompt_data, "train")
    eval_items, eval_task = file_prompts(eval_name, "test") if args.eval_prompt_data else (train_items, None)
    if not args.eval_prompt_data:
        print0(f"no --eval-prompt-data: eval reads the first {args.eval_max_problems} training prompts (not held out)")
else:
    eval_name = args.eval_task or args.task
    train_items, train_task = task_prompts(args.task, "train")
    eval_items, eval_task = task_prompts(eval_name, "test")
eval_items = eval_items[: args.eval_max_problems]
reward_fns, rm_name = {}, f"agent:{args.agent}" if args.agent else f"remote:{reward_cfg.rm_url}"
if not (reward_cfg.remote or args.agent):  # one grader per split: the task's own grader reads its example
    try:
        (reward_fns["train"], rm_name), (reward_fns["test"], _) = (
            rewards.make_reward(reward_cfg.rm_type, t, reward_cfg.custom_rm_path) for t in (train_task, eval_task)
        )
    except ValueError as e:
        parser.error(str(e))
if (args.multi_turn and args.tool == "python") or any(getattr(t, "runs_code", False) for t in (train_task, eval_task)):
    require_sandbox()  # model-written code will run: with no sandbox here the run stops now, in one line

# -----------------------------------------------------------------------------------------------
# setup: ranks and their roles, then the batch sizes that depend on them
# collectives give up on a missing rank after a while (a hang in native code, a dead node) rather than block forever
timeout_s = 2 * args.rollout_timeout + 600 if args.rollout_timeout > 0 else None
ddp, rank, local_rank, world_size, device = common.compute_init(  # (CPU offload: gloo collectives beside NCCL)
    args.device_type, seed=args.seed, timeout_s=timeout_s, cpu_collectives=args.cpu_offload
)
master = rank == 0
roles = rl_async.split_ranks(args, parser, rank, world_size)
rollout_samples, steps = args.rollout_batch_size * n, args.num_steps_per_rollout
rollout_size = f"--rollout-batch-size x --n-samples-per-prompt = {rollout_samples}"
if args.global_batch_size is None and rollout_samples % steps:
    parser.error(f"{rollout_size} does not divide by --num-steps-per-rollout {steps}")
global_batch = args.global_batch_size or rollout_samples // steps  # samples per optimizer step
if global_batch * steps != rollout_samples:
    parser.error(f"--global-batch-size {global_batch} x --num-steps-per-rollout {steps} must equal {rollout_size}")
for what, k in (("sampling ranks", roles.sworld), ("training ranks", roles.tworld)):
    if args.rollout_batch_size % k:
        parser.error(f"--rollout-batch-size {args.rollout_batch_size} must divide by the number of {what} {k}")
if global_batch % (roles.tworld * n):
    unit = f"training ranks x --n-samples-per-prompt = {roles.tworld * n}"
    parser.error(f"--global-batch-size {global_batch} must be a multiple of {unit}")
if over_sampling % roles.sworld:
    parser.error(f"--over-sampling-batch-size {over_sampling} must divide by the sampling ranks {roles.sworld}")

# logging first: a missing wandb key stops the run before any model is built
logger = common.get_logger(
    args.run, project="nanorl-rl", config=vars(args), master_process=master, tensorboard_dir=args.tensorboard
)

# the policy, and what the options add: a frozen reference (KL), a critic (ppo), a teacher (on-policy distillation)
model, tokenizer, meta = load_model_from_args(args, device, phase="train")
if rollout_cfg.multi_turn and tokenizer.encode_special("<|python_start|>") is None:
    parser.error(f"--multi-turn: this model's tokenizer has no tool-call tokens ({args.hf_model or args.source})")
ref_model = critic = critic_optimizer = teacher = None
if trainer_cfg.needs_reference and roles.is_trainer and not args.lora_rank:
    ref_model = copy.deepcopy(model).eval().requires_grad_(False)
if trainer_cfg.needs_critic and roles.is_trainer:
    critic, critic_optimizer = build_critic(model, args.critic_lr, device)
if args.use_opd and roles.is_trainer:
    teacher = load_teacher(args.opd_teacher_load, device)
    if teacher.config.vocab_size != model.config.vocab_size:
        parser.error(
            f"--opd-teacher-load {args.opd_teacher_load}: vocab {teacher.config.vocab_size} differs from the "
            f"student's {model.config.vocab_size}"
        )
longest_prompt = max(len(prompts.prompt_ids(tokenizer, p)) for p in train_items + eval_items)
if longest_prompt + 1 > model.config.sequence_len:
    raise SystemExit(
        f"the longest prompt has {longest_prompt} tokens, more than the model's context {model.config.sequence_len}"
    )
# --lora-rank: freeze the base (bf16 on CUDA) and train adapters; the engine shares this model (nothing to sync)
lora_base = lora.setup(args, model, meta)
if lora_base and trainer_cfg.needs_reference and roles.is_trainer:
    ref_model = lora.Reference(model)  # the KL reference is the policy with its adapters off: no second copy
engine = trainer = None
if roles.is_sampler:
    max_len = min(model.config.sequence_len, longest_prompt + args.max_response_len)
    if args.agent:  # an episode's later calls hold its earlier turns: they may be longer than any prompt
        max_len = model.config.sequence_len
    engine = Engine(model, tokenizer, batch_size=args.engine_batch_size, share_weights=bool(lora_base), max_len=max_len)
if args.fsdp:  # the engine copied the whole model above; now shard the policy, before the optimizer is built on it
    fsdp.shard_model(model, device, args.activation_checkpointing, args.cpu_offload)
if lora_base:  # AdamW on the adapters alone, at its own rate (--lora-lr)
    optimizer = lora.build_lora_optimizer(model, args.lora_lr, args.weight_decay)
else:
    optimizer = build_optimizer(model, weight_decay=args.weight_decay, lr_scale=args.lr_scale)
if roles.is_trainer:
    extra_models = (ref_model, critic, critic_optimizer, teacher)
    trainer = rl_trainer.Trainer(trainer_cfg, model, optimizer, device, *extra_models, roles.tgroup, roles.tworld, ddp)
output_tag = args.output_tag or meta.get("model_tag") or args.model_tag or "d"
ckpt_dir = os.path.join(common.get_base_dir(), "rl_checkpoints", output_tag)
checkpoint.claim_output_dir(ckpt_dir, args.resume, args.overwrite, rank)  # an old run's steps never hide this one's

source = prompts.PromptSource(train_items, seed=args.seed, rank=roles.srank, world_size=roles.sworld)


def reward_fn(response, label, metadata):
    """(value, None) or (None, why it failed): the grader of the split the prompt came from."""
    return rewards.safe_reward(reward_fns[metadata["split"]], response, label, metadata)


local_reward = None if reward_cfg.remote else reward_fn
worker = rollout.RolloutWorker(rollout_cfg, engine, tokenizer, local_reward, reward_cfg, custom_generate)
buffer = rollout.RolloutBuffer(buffer_filter)
print0(attention_backend(device))
if rollout_cfg.multi_turn and rollout_cfg.tool == "python":  # bwrap: kernel namespaces; guard: the in-process fallback
    print0(f"python sandbox: {sandbox_mode()}")
print0(
    f"RL on {len(train_items)} prompts ({args.prompt_data or args.task}), eval on {len(eval_items)} ({eval_name}), "
    f"{world_size} rank(s), device {device}"
)
print0(rl_progress.step_legend())

# -----------------------------------------------------------------------------------------------
# rollout: this rank's share of one rollout, and what happens when a rank's rollout fails


def do_rollout(step, version):
    """This rank's share of rollout step+1, sampled by policy `version` -> (groups, filter stats, failure, seconds).
    A failure or a hang past --rollout-timeout is caught and described (failure), never left to block the other
    ranks."""

    def make_groups():  # dynamic sampling: over-sample prompts until the batch holds enough useful groups
        batch = source.get(over_sampling // roles.sworld)
        seeds = [args.seed * 1_000_003 + epoch * 10_000_019 + pos for epoch, pos in source.last_keys]
        if rollout_cfg.partial_rollout:
            return worker.stream(batch, seeds, version, buffer)
        return worker.score(worker.generate(batch, seeds, rollout_cfg.temperature, n, version))

    model.eval()
    groups, fstats, failure, t0 = [], {}, None, time.time()
    share = args.rollout_batch_size // roles.sworld  # this rank's groups
    try:
        with rollout.deadline(args.rollout_timeout):
            groups, fstats = rollout.fill_rollout(
                share,
                buffer,
                make_groups,
                group_filter,
                args.max_sampling_rounds,
                stop_when_full=rollout_cfg.partial_rollout,
            )
    except (Exception, rollout.RolloutTimeout) as e:
        traceback.print_exc()
        what = worker.inflight.get("scoring") or {"prompts": worker.inflight.get("generating")}
        failure = f"rank {rank}: rollout {step + 1} failed: {type(e).__name__}: {e}\n  in flight: {what}"
        print(failure, file=sys.stderr, flush=True)
    worker.inflight.clear()
    return groups, fstats, failure, time.time() - t0


def stop_after_failure(step, n_failed, every_rank=True):
    """A rollout or eval failed somewhere: save the state before it (a --resume redoes that rollout; --async: on the
    saved weights, one version newer than the lost rollout's) and exit non-zero at once: a worker thread still blocked
    in a reward call or a tool must not hold the exit. every_rank: every rank got here (a save is collective)."""
    if every_rank:
        save(step)
    print0(f"stopped: a rollout failed on {n_failed} rank(s); saved step {step} in {ckpt_dir}")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


# -----------------------------------------------------------------------------------------------
# the training step on a rollout, and the step's log line


def train(step, groups, m):
    """The training step on this rank's groups; m (the rollout's metrics) gains the trainer's, then everything is
    averaged over the training ranks."""
    samples = [s for g in groups for s in g]
    timer = Timer()
    m.update(trainer.train_step(step, samples, timer))
    m["rollout/max_staleness"] = max(step - s.weight_version for s in samples)  # policy versions behind the trainer
    m.update({f"time/{k}": v for k, v in timer.times.items()})
    m["perf/train_tok_per_s"] = sum(len(s.tokens) for s in samples) / max(timer.times.get("train", 1e-9), 1e-9)
    if ddp:  # the ranks' names may differ (a filter that dropped groups on one rank only): the union is averaged
        m = common.mean_over_ranks(m, device, group=roles.tgroup)
    return m


def log_step(step, m, dt):
    eta.tick((step + 1) / args.num_rollouts)  # wall clock between step lines: evals and saves count
    tools = ""
    if rollout_cfg.multi_turn:
        tools = f" | tools {m['rollout/tool_calls_mean']:.2f} err {m['rollout/tool_errors_mean']:.2f} "
        tools += f"max_turns {m['rollout/max_turns_hit_mean']:.2f}"
    if args.agent:  # episodes lost (raised, timed out, no number) out of the rollout's, and calls per episode
        episodes = args.rollout_batch_size * n
        tools += f" | agent lost {round(m['rollout/agent_lost_frac'] * episodes)}/{episodes} "
        tools += f"calls {m['rollout/agent_calls_mean']:.2f}"
    print0(
        f"step {step + 1:05d}/{args.num_rollouts} | reward {m['rollout/reward_mean']:.3f} "
        f"| len {m['rollout/response_len_mean']:.1f} | pg {m['train/pg_loss']:+.4f} | clip {m['train/clipfrac']:.3f} "
        f"| ppo_kl {m['train/ppo_kl']:+.2e} | ent {m['train/entropy']:.3f} | gnorm {m['train/grad_norm']:.3f} "
        f"| lp_diff {m['train/train_rollout_logprob_abs_diff']:.1e} | pad {m['train/padding_frac']:.0%} "
        f"| dropped {int(m.get('rollout/groups_dropped', 0))} | dt {dt:.1f}s "
        f"(rollout {m.get('time/rollout', 0):.1f}s, waiting {m['perf/idle_frac']:.0%}) | eta {eta}{tools}"
    )
    history.append({"step": step + 1, **m})
    logger.log(m, step=step + 1)
    log_json("rl_history", {"train": history, "eval": eval_history}, rank=rank)


# -----------------------------------------------------------------------------------------------
# eval (pass@k on held-out prompts), save, resume


def evaluate(step):
    """pass@k over the held-out prompts, each sampling rank its share. A failure or hang stops the run like a
    failed rollout (its reward failures are not counted as the rollout's)."""
    model.eval()
    my_items = eval_items[roles.srank :: roles.sworld]
    seeds = [10_000_000 + roles.srank + roles.sworld * i for i in range(len(my_items))]  # the prompt's global index
    where = f"rank {rank}: the eval at step {step}"
    local = rl_eval.local_pass_at_k(worker, my_items, seeds, n_eval, t_eval, pass_ks, step, args.rollout_timeout, where)
    out, n_prompts, n_failed = rl_eval.reduce_pass_at_k(local, pass_ks, device, roles.sgroup, ddp)
    if n_failed:  # --async: the trainers are not in this eval, so nothing is saved
        stop_after_failure(step, n_failed, every_rank=not roles.async_mode)
    passes = " | ".join(f"{k} {v:.4f}" for k, v in out.items())
    print0(f"step {step:05d} | eval on {n_prompts} prompts x {n_eval} samples (T={t_eval:g}) | {passes}")
    return out


def maybe_eval(step):
    if (step + 1) % args.eval_every == 0 or step + 1 == args.num_rollouts:
        e = evaluate(step + 1)
        eval_history.append({"step": step + 1, **e})
        logger.log(e, step=step + 1)


def should_save(step):
    return step % args.save_every == 0 or step == args.num_rollouts


def save(step, pending=None):
    """Every rank: the trainers' weights and optimizer, each sampler's prompt order, buffer and RNGs (in sync RL every
    rank is both). --async: a sampler also keeps `pending`, the rollout it already sampled for step+1 with the weights
    before these, which a resumed run hands to the trainers first, as the uninterrupted run does."""
    # rl_args: this run's flags (meta's args are the source model's)
    ck_meta = {**meta, "model_tag": output_tag, "step": step, "rl_args": vars(args), "world_size": world_size}
    if lora_base:  # the adapters alone, and where their base is
        ck_meta["lora"] = lora.checkpoint_meta(model, lora_base)
    extra = rng_state(device)
    if roles.is_sampler:
        extra.update(source=source.state_dict(), buffer=buffer.state_dict())
    if roles.async_mode and roles.is_sampler:  # its files beside the trainers', which write weights and meta
        extra["pending"] = rl_async.payload_state(pending)
        checkpoint.save_checkpoint(ckpt_dir, step, None, None, ck_meta, extra, rank=rank, lead=False)
        return
    if critic is not None:  # every training rank keeps the same critic (averaged gradients): each saves it
        extra.update(critic=critic.state_dict(), critic_optim=critic_optimizer.state_dict())
    # --fsdp: every rank writes its shards (DCP; `python -m nanorl.fsdp consolidate` makes the single file)
    checkpoint.save(ckpt_dir, step, model, optimizer, ck_meta, extra, rank=rank, lead=rank == roles.R)


def weights_checksum():
    return sum(p.detach().double().sum().item() for p in model.parameters())


start_step, pending = 0, None
if args.resume:
    # model and optimizer (their shards with --fsdp, the adapters with --lora-rank; an --async sampler: the weights
    # alone); this rank's extra state
    last, ck_meta, extra = checkpoint.resume(ckpt_dir, model, optimizer if roles.is_trainer else None, rank, world_size)
    if roles.is_sampler:
        source.load_state_dict(extra["source"])
        buffer.load_state_dict(extra["buffer"])
        pending = rl_async.payload_from_state(extra.get("pending"))
    if critic is not None:
        critic.load_state_dict(extra["critic"])
        critic_optimizer.load_state_dict(extra["critic_optim"])
    set_rng_state(extra, device)
    start_step = last
    if args.fsdp:  # the engine's copy was made from the weights before the resume
        fsdp.gather_full_state(model, engine.model)
    elif engine is not None:
        engine.load_weights(model)
    old_args = ck_meta.get("rl_args", {})
    diffs = {k: (old_args.get(k), v) for k, v in vars(args).items() if k != "resume" and old_args.get(k) != v}
    if diffs:
        changed = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diffs.items())
        print0(f"warning: resuming with changed RL flags: {changed}")
    print0(f"resumed from {ckpt_dir} step {last}")

# -----------------------------------------------------------------------------------------------
# --async: the samplers' and the trainers' loops, side by side (nanorl/rl_async.py: what travels between them)


def sampler_loop():
    """A sampling rank: hand rollout k to the trainers, sample rollout k+1 with the weights it has (one version
    behind) while they train, then take their new weights. Returns the seconds it waited on the trainers."""
    idle, version = 0.0, start_step
    before = (source.state_dict(), buffer.state_dict())  # what a failed rollout is redone from
    if start_step < args.num_rollouts:  # resumed: the rollout sampled before the save, as the trainers expect it
        payload = pending or sample_payload(start_step, version)
    for step in range(start_step, args.num_rollouts):
        t0 = time.time()
        failures = [p["failure"] for p in rl_async.exchange_rollouts(roles, payload) if p["failure"]]
        wait = time.time() - t0
        if failures:
            source.load_state_dict(before[0])
            buffer.load_state_dict(before[1])
            stop_after_failure(step, len(failures))
        before, payload = (source.state_dict(), buffer.state_dict()), None
        if step + 1 < args.num_rollouts:
            payload = sample_payload(step + 1, version)
        t_wait = time.time()
        version, m = rl_async.receive_weights(model, engine, roles)
        wait += time.time() - t_wait
        m["async/sampler_weight_version"] = version
        m["async/sampler_weight_checksum"] = weights_checksum()
        dt = time.time() - t0
        m["perf/idle_frac_sampler"] = m["perf/idle_frac"] = wait / dt
        idle += wait
        if roles.srank == 0:
            log_step(step, m, dt)
        if should_save(step + 1):  # beside the trainers' save of the same step
            save(step + 1, pending=payload)
        maybe_eval(step)
    return idle


def sample_payload(step, version):
    """This sampler's share of rollout step+1, as it travels to the trainers."""
    groups, fstats, failure, rollout_s = do_rollout(step, version)
    samples = [s for g in groups for s in g]
    metrics = worker.metrics(fstats, samples, rollout_s, buffer) if samples else {}
    return {"groups": groups, "failure": failure, "rollout_s": rollout_s, "metrics": metrics}


def trainer_loop():
    """A training rank: train on rollout k while the samplers sample k+1; the first trainer sends the new weights.
    Returns the seconds it waited on the samplers."""
    idle, version = 0.0, start_step
    for step in range(start_step, args.num_rollouts):
        t0 = time.time()
        payloads = rl_async.exchange_rollouts(roles, None)
        wait = time.time() - t0
        failures = [p["failure"] for p in payloads if p["failure"]]
        if failures:
            stop_after_failure(step, len(failures))
        groups = [g for p in payloads for g in p["groups"]][roles.trank :: roles.tworld]
        m = train(step, groups, rl_async.sum_payload_metrics(payloads))
        version += 1
        m["async/trainer_weight_checksum"] = weights_checksum()
        m["perf/idle_frac_trainer"] = wait / (time.time() - t0)
        idle += wait
        if roles.trank == 0:
            rl_async.send_weights(model, roles, version, m)
        if should_save(step + 1):
            save(step + 1)
    return idle


# -----------------------------------------------------------------------------------------------
# the loop: one rollout, one training step on it, the engine's weights refreshed

t_start, eta = time.time(), ETA(start_step / args.num_rollouts)
# on resume, keep the history of the steps already done so the report's curves stay whole
prev = load_json("rl_history", {}) if start_step > 0 else {}
history = [h for h in prev.get("train", []) if h["step"] <= start_step]
eval_history = [e for e in prev.get("eval", []) if e["step"] <= start_step]
if start_step == 0 and roles.is_sampler:
    rl_progress.log_eval(logger, eval_history, 0, evaluate(0))  # the curves' "before" point
idle_s = 0.0  # seconds this rank spent waiting on other ranks instead of computing

if roles.async_mode:
    idle_s = sampler_loop() if roles.is_sampler else trainer_loop()
else:
    for step in range(start_step, args.num_rollouts):
        t0 = time.time()
        before = (source.state_dict(), buffer.state_dict())
        groups, fstats, failure, rollout_s = do_rollout(step, step)
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
        m = train(step, groups, worker.metrics(fstats, [s for g in groups for s in g], rollout_s, buffer))
        t_sync = time.time()
        if args.fsdp:  # every rank gathers the full weights, one block at a time, into its engine's copy
            m["time/weight_gather"] = fsdp.gather_full_state(model, engine.model)
        else:
            engine.load_weights(model)  # the engine samples from its own (bf16 on GPUs) copy: give it the new weights
            m["time/weight_sync"] = time.time() - t_sync
        dt = time.time() - t0
        m["perf/idle_frac"] = wait / dt
        idle_s += wait
        log_step(step, m, dt)
        maybe_eval(step)
        if should_save(step + 1):
            save(step + 1)

# -----------------------------------------------------------------------------------------------
# report: time each role spent waiting on the others, pass@k before and after
idle_frac = rl_async.idle_fractions(roles, idle_s, time.time() - t_start, ddp)
if idle_line := rl_progress.idle_line(idle_frac, device.type, world_size):  # one rank waits on nobody
    print0(idle_line)
log_json("rl_history", {"train": history, "eval": eval_history, "idle": idle_frac}, rank=rank)
if master and eval_history:
    evals = rl_eval_rows(eval_history, eval_name, len(eval_items), n_eval, t_eval)
    wall = {"wall_time_s": round(time.time() - t_start, 1), **idle_frac}
    log_section("Chat RL", [{"reward": rm_name}, evals, wall], config=vars(args))
print0(rl_progress.rl_summary(eval_history, ckpt_dir, checkpoint.find_last_step(ckpt_dir), output_tag))
logger.finish()
common.compute_cleanup()
