"""
Reinforcement learning on a chat model: the GRPO family and friends.

One step = one rollout: sample n responses for each of a batch of prompts with our own engine, score them with the
reward hub, compute advantages, take --num-steps-per-rollout optimizer steps over the samples (the first is exactly
on-policy), then give the engine the new weights. This file reads top to bottom:
  flags -> build the run (prompts, graders, ranks, models, engine) -> the loops (synchronous, and --async's two)
  -> main: resume, the loop, the report
The run's state and its step are nanorl/rl_run.py's RLRun; docs/rl.md follows one GRPO step through the files.

    python -m scripts.chat_rl                                   # offline curriculum, CPU-sized defaults
    torchrun --standalone --nproc_per_node=8 -m scripts.chat_rl -- --task gsm8k --rollout-batch-size 64
    python -m scripts.chat_rl --prompt-data my.jsonl --input-key question --label-key answer --rm-type math
"""

import copy
import os
import time

from nanorl import checkpoint, common, fsdp, lora, prompts, rewards, rl_async, rl_config, rl_trainer, rollout
from nanorl.engine import Engine
from nanorl.execution import require_sandbox, sandbox_mode
from nanorl.flags import (
    SLIME_NAMES,
    ArgumentParser,
    int_list,
    load_function,
    nonneg_float,
    positive_float,
    positive_int,
    tag_name,
)
from nanorl.gpt import attention_backend
from nanorl.logger import add_logging_args, get_logger, print0
from nanorl.model_loading import add_model_args, load_model_from_args
from nanorl.optim import build_optimizer
from nanorl.precision import precision_line
from nanorl.report import log_json, log_section, rl_eval_rows
from nanorl.rl_config import GroupSpec
from nanorl.rl_run import (
    Models,
    Ranks,
    RLRun,
    RunConfig,
    Sampling,
    build_critic,
    idle_line,
    load_teacher,
    rl_summary,
    step_legend,
)
from nanorl.synthetic import levels_flag
from tasks import get_task

# -----------------------------------------------------------------------------------------------
# flags: the core ones here; rollout, reward, training-step and async flags next to the code they configure


def make_parser():
    parser = ArgumentParser(description="RL on a chat model (GRPO family)", epilog=step_legend(), aliases=SLIME_NAMES)
    g = parser.add_argument_group("model and data")
    add_model_args(g, "sft")  # --source, --model-tag, --model-step, --hf-model
    g.add_argument("--task", default="offline", help="RL prompts: offline (the synthetic curriculum) or gsm8k")
    g.add_argument("--task-path", default=None, help="local jsonl/parquet for the task instead of downloading")
    g.add_argument(
        "--levels", type=levels_flag, default="1,2,3,4", help="offline task: difficulty levels of the prompts"
    )
    g.add_argument("--eval-task", default=None, help="held-out task (default: the test split of --task)")
    prompts.add_args(g)  # --prompt-data and its keys
    g.add_argument(
        "--output-tag", type=tag_name, default=None, help="save under rl_checkpoints/<tag> (default: the source's tag)"
    )
    g = parser.add_argument_group("rollouts")
    g.add_argument("--num-rollouts", type=positive_int, default=60, help="number of rollouts (= RL steps)")
    g.add_argument("--rollout-batch-size", type=positive_int, default=16, help="prompts per rollout (global)")
    g.add_argument("--n-samples-per-prompt", type=positive_int, default=8, help="group size")
    g.add_argument("--max-new-tokens", type=positive_int, default=256, help="max tokens per response")
    # the engine records log-probs of the distribution it samples from; the trainer divides its logits by the same T
    g.add_argument("--temperature", type=positive_float, default=1.0, help="rollout temperature")
    g.add_argument("--lr-scale", type=positive_float, default=0.05, help="multiplier on the base LRs (RL: small steps)")
    g = parser.add_argument_group("eval, saving, misc")
    # the eval also runs before the first rollout and after the last; a save also after the last
    g.add_argument("--eval-every", type=positive_int, default=10, help="evaluate every N rollouts")
    g.add_argument("--eval-max-problems", type=positive_int, default=200, help="held-out prompts per eval")
    g.add_argument("--n-samples-per-eval-prompt", type=positive_int, default=4, help="per eval prompt (>= max k)")
    g.add_argument("--eval-temperature", type=nonneg_float, default=1.0, help="eval sampling temperature")
    g.add_argument("--pass-k", type=int_list, default="1,4", help="comma-separated k for pass@k")
    g.add_argument("--save-every", type=positive_int, default=20, help="save every N rollouts")
    g.add_argument("--keep-last", type=positive_int, default=2, help="keep only the newest N checkpoints of this run")
    g.add_argument("--resume", action="store_true", help="continue from the latest RL checkpoint")
    g.add_argument(
        "--overwrite", action="store_true", help="a new run into a tag holding steps: move them to <tag>.old-<time>"
    )
    add_logging_args(g)
    g.add_argument("--device-type", default=None, help="cuda | cpu | mps (default: autodetect)")
    g.add_argument("--seed", type=int, default=42, help="seed of the prompt order and of every sample's random stream")
    rl_config.add_rollout_args(parser)
    rl_config.add_reward_args(parser)
    rl_config.add_trainer_args(parser)
    rl_async.add_args(parser)
    fsdp.add_args(parser.add_argument_group("sharding (nanorl/fsdp.py)"))
    lora.add_args(parser)
    return parser


# -----------------------------------------------------------------------------------------------
# building the run, in this order: the flags checked, the prompts and graders (a bad task, data file or reward fails
# before any model is built), the ranks and their roles, the models and the engine, then the run around them


def check_flags(args, parser):
    """Each part's flags checked and turned into its config once (the flags themselves stay as given) ->
    (rollout config, reward config, trainer config): the rollout and the trainer share one GroupSpec."""
    group = GroupSpec(args.n_samples_per_prompt, args.temperature, args.max_new_tokens)
    rollout_cfg = rl_config.rollout_config_from_args(args, parser, group)
    reward_cfg = rl_config.reward_config_from_args(args, parser, default_rm_type="math" if args.prompt_data else "task")
    trainer_cfg = rl_config.trainer_config_from_args(args, parser, group)
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
    if max(args.pass_k) > args.n_samples_per_eval_prompt:
        k = ",".join(map(str, args.pass_k))
        parser.error(f"--pass-k {k} needs --n-samples-per-eval-prompt >= {max(args.pass_k)}")
    if args.prompt_data is None and (args.eval_prompt_data or args.apply_chat_template):
        parser.error("--eval-prompt-data and --apply-chat-template only apply with --prompt-data")
    return rollout_cfg, reward_cfg, trainer_cfg


def user_functions(args, parser):
    """The functions the flags name -> (dynamic-sampling group filter, buffer filter, custom generate or None: a
    function, or --agent's episodes)."""
    group_filter, custom_generate = rollout.keep_all_groups, None
    if args.over_sampling_batch_size is not None:
        flag = "--dynamic-sampling-filter-path"
        group_filter = load_function(args.dynamic_sampling_filter_path, ["group"], flag)
    buffer_filter = load_function(args.buffer_filter_path, ["buffer", "n"], "--buffer-filter-path")
    if args.custom_generate_function_path:
        keys, flag = ["config", "engine", "tokenizer", "prompts", "seeds"], "--custom-generate-function-path"
        custom_generate = load_function(args.custom_generate_function_path, keys, flag)
    if args.agent:  # the agent's episodes are the rollout, scored by the agent itself (nanorl/agents.py)
        if args.rm_type or args.custom_rm_path or args.rm_url:
            parser.error("--agent scores its own episodes: --rm-type, --custom-rm-path and --rm-url do not apply")
        try:
            from nanorl.agents import AgentRollout
        except ImportError as e:
            parser.error(f"--agent needs the openai package: pip install openai ({e})")
        try:
            agent = load_function(args.agent, ["client", "item"], "--agent")
        except ValueError as e:
            parser.error(str(e))
        timeout = rl_config.AGENT_TIMEOUT if args.agent_timeout is None else args.agent_timeout
        custom_generate = AgentRollout(agent, timeout)
    return group_filter, buffer_filter, custom_generate


def task_prompts(args, name, split, label_needed):
    """A task's examples as prompts, and the task (its own grader scores them with --rm-type task)."""
    kw = {"path": args.task_path} if args.task_path else {}
    if name == "offline":
        kw["levels"] = tuple(int(x) for x in args.levels.split(","))
    task = get_task(name, split, **kw)
    return prompts.task_prompts(task, name, split, label_needed), task


def load_prompts(args, parser, reward_cfg):
    """-> (training prompts, eval prompts, eval name, graders, reward name). graders: one per split, the task's own
    reading the example a prompt came from (None: a remote reward; none with --agent, which scores its episodes)."""
    label_needed = f"--rm-type {reward_cfg.rm_type}" if reward_cfg.needs_label else None
    if args.prompt_data:
        read = lambda path, split: prompts.jsonl_prompts(
            path, split, args.input_key, args.label_key, args.apply_chat_template, label_needed
        )
        train_items, train_task, eval_task = read(args.prompt_data, "train"), None, None
        eval_items = read(args.eval_prompt_data, "test") if args.eval_prompt_data else train_items
        eval_name = args.eval_prompt_data or args.prompt_data
        if not args.eval_prompt_data:
            print0(
                f"no --eval-prompt-data: eval reads the first {args.eval_max_problems} training prompts (not held out)"
            )
    else:
        eval_name = args.eval_task or args.task
        train_items, train_task = task_prompts(args, args.task, "train", label_needed)
        eval_items, eval_task = task_prompts(args, eval_name, "test", label_needed)
        if eval_name == "offline":  # named as chat_eval's card rows name it: which levels were held out
            eval_name = f"offline levels {args.levels}"
    graders, rm_name = None, f"remote:{reward_cfg.rm_url}"
    if args.agent:
        graders, rm_name = {}, f"agent:{args.agent}"
    elif not reward_cfg.remote:
        # a task's grader reads the examples its prompts were made from, loaded once here: a step rebuilds none
        examples = lambda task, items: None if task is None else [p["conversation"] for p in items]
        try:
            (train_grader, rm_name), (eval_grader, _) = (
                rewards.make_reward(reward_cfg.rm_type, task, reward_cfg.custom_rm_path, examples(task, items))
                for task, items in ((train_task, train_items), (eval_task, eval_items))
            )
        except ValueError as e:
            parser.error(str(e))
        graders = {"train": train_grader, "test": eval_grader}
    if (args.multi_turn and args.tool == "python") or any(
        getattr(t, "runs_code", False) for t in (train_task, eval_task)
    ):
        require_sandbox()  # model-written code will run: with no sandbox here the run stops now, in one line
    return train_items, eval_items[: args.eval_max_problems], eval_name, graders, rm_name


def set_up_ranks(args, parser):
    """torch.distributed, this rank's roles, then the batch sizes that depend on them -> Ranks."""
    # collectives give up on a missing rank after a while (a hang in native code, a dead node) rather than block forever
    timeout_s = 2 * args.rollout_timeout + 600 if args.rollout_timeout > 0 else None
    ddp, rank, local_rank, world_size, device = common.compute_init(  # (CPU offload: gloo collectives beside NCCL)
        args.device_type, seed=args.seed, timeout_s=timeout_s, cpu_collectives=args.cpu_offload
    )
    roles = rl_async.split_ranks(args, parser, rank, world_size)
    n, steps = args.n_samples_per_prompt, args.num_steps_per_rollout
    rollout_samples = args.rollout_batch_size * n
    rollout_size = f"--rollout-batch-size x --n-samples-per-prompt = {rollout_samples}"
    if args.global_batch_size is None and rollout_samples % steps:
        parser.error(f"{rollout_size} does not divide by --num-steps-per-rollout {steps}")
    global_batch = args.global_batch_size or rollout_samples // steps  # samples per optimizer step
    if global_batch * steps != rollout_samples:
        parser.error(f"--global-batch-size {global_batch} x --num-steps-per-rollout {steps} must equal {rollout_size}")
    for what, k in (("sampling ranks", roles.n_samplers), ("training ranks", roles.n_trainers)):
        if args.rollout_batch_size % k:
            parser.error(f"--rollout-batch-size {args.rollout_batch_size} must divide by the number of {what} {k}")
    if global_batch % (roles.n_trainers * n):
        unit = f"training ranks x --n-samples-per-prompt = {roles.n_trainers * n}"
        parser.error(f"--global-batch-size {global_batch} must be a multiple of {unit}")
    over_sampling = args.over_sampling_batch_size or args.rollout_batch_size
    if over_sampling % roles.n_samplers:
        parser.error(f"--over-sampling-batch-size {over_sampling} must divide by the sampling ranks {roles.n_samplers}")
    return Ranks(ddp, rank, device, roles)


def build_models(args, parser, ranks, trainer_cfg, items):
    """The policy and what the options add: a frozen reference (KL), a critic (ppo), a teacher (on-policy
    distillation), LoRA's adapters; the engine on a sampling rank, the optimizer, the trainer on a training rank.
    items: every prompt of the run (training and eval), given its "prompt_ids" here, by the policy's tokenizer.
    -> Models"""
    device, roles = ranks.device, ranks.roles
    model, tokenizer, meta = load_model_from_args(args, device, phase="train")
    if args.multi_turn and tokenizer.encode_special("<|python_start|>") is None:
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
    prompts.add_prompt_ids(tokenizer, items)  # with this model's tokenizer, once: the steps deal these ids
    longest_prompt = max(len(p["prompt_ids"]) for p in items)
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
        max_len = min(model.config.sequence_len, longest_prompt + args.max_new_tokens)
        if args.agent:  # an episode's later calls hold its earlier turns: they may be longer than any prompt
            max_len = model.config.sequence_len
        engine = Engine(
            model, tokenizer, batch_size=args.engine_batch_size, share_weights=bool(lora_base), max_len=max_len
        )
    if args.fsdp:  # the engine copied the whole model above; now shard the policy, before the optimizer is built on it
        fsdp.shard_model(model, device, args.activation_checkpointing, args.cpu_offload)
    if lora_base:  # AdamW on the adapters alone, at its own rate (--lora-lr)
        optimizer = lora.build_lora_optimizer(model, args.lora_lr, args.weight_decay)
    else:
        optimizer = build_optimizer(model, weight_decay=args.weight_decay, lr_scale=args.lr_scale)
    if roles.is_trainer:
        extras = rl_trainer.ExtraModels(ref_model, critic, critic_optimizer, teacher)
        data_parallel = rl_trainer.DataParallel(roles.trainer_group, roles.n_trainers, ranks.ddp)
        trainer = rl_trainer.Trainer(trainer_cfg, model, optimizer, device, extras, data_parallel)
    return Models(model, tokenizer, meta, lora_base, engine, optimizer, trainer)


def build_run(args, parser):
    """The flags -> the RLRun of this rank, and what the report names: (run, info)."""
    rollout_cfg, reward_cfg, trainer_cfg = check_flags(args, parser)
    group_filter, buffer_filter, custom_generate = user_functions(args, parser)
    train_items, eval_items, eval_name, graders, rm_name = load_prompts(args, parser, reward_cfg)
    ranks = set_up_ranks(args, parser)
    rank, device, roles = ranks.rank, ranks.device, ranks.roles
    # logging first: a missing wandb key stops the run before any model is built
    logger = get_logger(
        args.run, project="nanorl-rl", config=vars(args), master_process=rank == 0, tensorboard_dir=args.tensorboard
    )
    models = build_models(args, parser, ranks, trainer_cfg, train_items + eval_items)
    meta, engine = models.meta, models.engine
    output_tag = args.output_tag or meta.get("model_tag") or args.model_tag or "d"
    ckpt_dir = os.path.join(common.get_base_dir(), "rl_checkpoints", output_tag)
    checkpoint.claim_output_dir(ckpt_dir, args.resume, args.overwrite, rank)  # an old run's steps never hide this one's

    source = prompts.PromptSource(train_items, seed=args.seed, rank=roles.sampler_rank, world_size=roles.n_samplers)
    worker = rollout.RolloutWorker(rollout_cfg, engine, models.tokenizer, graders, reward_cfg, custom_generate)
    sampling = Sampling(worker, source, rollout.RolloutBuffer(buffer_filter), group_filter, eval_items)
    cfg = RunConfig(
        num_rollouts=args.num_rollouts,
        rollout_batch_size=args.rollout_batch_size,
        over_sampling_batch_size=args.over_sampling_batch_size or args.rollout_batch_size,
        max_sampling_rounds=args.max_sampling_rounds,
        rollout_timeout=args.rollout_timeout,
        eval_every=args.eval_every,
        save_every=args.save_every,
        keep_last=args.keep_last,
        eval_group=GroupSpec(args.n_samples_per_eval_prompt, args.eval_temperature, args.max_new_tokens),
        pass_ks=tuple(args.pass_k),
        fsdp=args.fsdp,
    )
    ckpt = {"dir": ckpt_dir, "tag": output_tag, "meta": meta, "flags": vars(args), "lora_base": models.lora_base}
    run = RLRun(cfg, models, sampling, ranks, logger, ckpt)
    print0(attention_backend(device))
    print0(precision_line(device))
    if engine is not None:  # its kernels and whether it decodes through CUDA graphs (gpu_check's pipeline checks it)
        print0(engine.attention_kernels())
    if rollout_cfg.multi_turn and rollout_cfg.tool == "python":  # bwrap: kernel namespaces; guard: in-process fallback
        print0(f"python sandbox: {sandbox_mode()}")
    print0(
        f"RL on {len(train_items)} prompts ({args.prompt_data or args.task}), eval on {len(eval_items)} ({eval_name}), "
        f"{roles.world} rank(s), device {device}"
    )
    print0(step_legend())
    return run, {"rm_name": rm_name, "eval_name": eval_name}


# -----------------------------------------------------------------------------------------------
# the loops: synchronous RL, and --async's two roles side by side (nanorl/rl_async.py: what travels between them)


def sync_loop(run, start):
    """Every rank samples its share of the rollout, then trains on it, then gives its engine the new weights."""
    for done in range(start, run.cfg.num_rollouts):  # done: the rollouts done before this step's
        run.step(done)  # rollout done+1: sample -> train -> update weights -> the step line
        if run.due(done + 1, run.cfg.eval_every):
            run.evaluate(done + 1)
        if run.due(done + 1, run.cfg.save_every):
            run.save(done + 1)


def sampler_loop(run, start):
    """A sampling rank: hand rollout k to the trainers, sample rollout k+1 with the weights it has (one version
    behind) while they train, then take their new weights."""
    version, n = start, run.cfg.num_rollouts
    before = run.prompt_position()  # what a failed rollout is redone from
    if start < n:  # resumed: the rollout sampled before the save, as the trainers expect it
        payload = run.pending or run.sample_payload(start, version)
    for done in range(start, n):  # done: the rollouts trained on before this step's
        t0 = time.time()
        failures = [p["failure"] for p in rl_async.exchange_rollouts(run.roles, payload) if p["failure"]]
        wait = time.time() - t0
        if failures:
            run.rewind(before)
            run.stop_after_failure(done, len(failures))
        before, payload = run.prompt_position(), None
        if done + 1 < n:
            payload = run.sample_payload(done + 1, version)
        t_wait = time.time()
        version, metrics = rl_async.receive_weights(run.model, run.engine, run.roles)
        wait += time.time() - t_wait
        metrics["async/sampler_weight_version"] = version
        metrics["async/sampler_weight_checksum"] = run.weights_checksum()
        dt = time.time() - t0
        metrics["perf/idle_frac_sampler"] = metrics["perf/idle_frac"] = wait / dt
        run.idle_s += wait
        if run.roles.sampler_rank == 0:
            run.log_step(done, metrics, dt)
        if run.due(done + 1, run.cfg.save_every):  # beside the trainers' save of the same step
            run.save(done + 1, pending=payload)
        if run.due(done + 1, run.cfg.eval_every):
            run.evaluate(done + 1)


def trainer_loop(run, start):
    """A training rank: train on rollout k while the samplers sample k+1; the first trainer sends the new weights."""
    version, roles = start, run.roles
    for done in range(start, run.cfg.num_rollouts):  # done: the rollouts trained on before this step's
        t0 = time.time()
        payloads = rl_async.exchange_rollouts(roles, None)
        wait = time.time() - t0
        failures = [p["failure"] for p in payloads if p["failure"]]
        if failures:
            run.stop_after_failure(done, len(failures))
        groups = [g for p in payloads for g in p["groups"]][roles.trainer_rank :: roles.n_trainers]
        metrics = run.train(done, groups, rl_async.sum_payload_metrics(payloads))
        version += 1
        metrics["async/trainer_weight_checksum"] = run.weights_checksum()
        metrics["perf/idle_frac_trainer"] = wait / (time.time() - t0)
        run.idle_s += wait
        if roles.trainer_rank == 0:
            rl_async.send_weights(run.model, roles, version, metrics)
        if run.due(done + 1, run.cfg.save_every):
            run.save(done + 1)


# -----------------------------------------------------------------------------------------------
# main: build, resume, evaluate the "before" point, loop, report


def main(argv=None):
    parser = make_parser()
    args = parser.parse_args(argv)
    run, info = build_run(args, parser)
    start = run.resume() if args.resume else 0
    t_start = time.time()
    if start == 0 and run.roles.is_sampler:
        run.evaluate(0)  # the curves' "before" point
    roles = run.roles
    loop = sync_loop if not roles.async_mode else sampler_loop if roles.is_sampler else trainer_loop
    loop(run, start)

    # the report: time each role spent waiting on the others, pass@k before and after
    idle_frac = rl_async.idle_fractions(roles, run.idle_s, time.time() - t_start, run.ddp)
    if line := idle_line(idle_frac, run.device.type, roles.world):  # one rank waits on nobody
        print0(line)
    log_json("rl_history", {"train": run.history, "eval": run.eval_history, "idle": idle_frac}, rank=run.rank)
    if run.rank == 0 and run.eval_history:
        group = run.cfg.eval_group
        evals = rl_eval_rows(
            run.eval_history, info["eval_name"], len(run.eval_items), group.n_samples_per_prompt, group.temperature
        )
        wall = {"wall_time_s": round(time.time() - t_start, 1), **idle_frac}
        log_section("Chat RL", [{"reward": info["rm_name"]}, evals, wall], config=vars(args))
    ck = run.ckpt
    print0(rl_summary(run.eval_history, ck["dir"], checkpoint.find_last_step(ck["dir"]), ck["tag"]))
    run.logger.finish()
    common.compute_cleanup()


if __name__ == "__main__":
    main()
