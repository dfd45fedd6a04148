"""
What one RL step reads, as small dataclasses, and the flags they come from: the GroupSpec both sides share, the
rollout worker's RolloutConfig (nanorl/rollout.py) and RewardConfig (nanorl/rewards.py, nanorl/remote_rewards.py), and
the trainer's TrainerConfig (nanorl/rl_trainer.py). Each has its flags (add_rollout_args, add_reward_args,
add_trainer_args) and a function that checks that they agree and builds the config (rollout_config_from_args,
reward_config_from_args, trainer_config_from_args): a combination without meaning fails there, before any work,
naming both flags. Outside chat_rl build a config directly:
    TrainerConfig(group=GroupSpec(n_samples_per_prompt=4, max_response_len=64))
"""

from dataclasses import dataclass, fields

from nanorl import rl
from nanorl.flags import fraction, nonneg_float, nonneg_int, number_in, positive_float, positive_int
from nanorl.multiturn import TOOLS

# -----------------------------------------------------------------------------------------------
# the group and the rollout


@dataclass(frozen=True)
class GroupSpec:
    """What a group of samples is, read by both sides: the sampler draws n_samples_per_prompt responses of each
    prompt (consecutive samples: the trainer's groups) at `temperature`, at most max_response_len tokens each; the
    trainer computes its log-probs at the same temperature (the engine records log_softmax(logits / temperature)),
    so on-policy the two agree. The defaults are chat_rl's flag defaults."""

    n_samples_per_prompt: int = 8
    temperature: float = 1.0
    max_response_len: int = 256


AGENT_TIMEOUT = 300.0  # --agent-timeout's default


@dataclass
class RolloutConfig:
    """What the RolloutWorker reads. The defaults are chat_rl's flag defaults."""

    group: GroupSpec = GroupSpec()
    top_k: int | None = None  # None = off
    top_p: float | None = None  # None = off
    multi_turn: bool = False
    max_turns: int = 4  # tool calls per response with multi_turn
    tool: str = "calculator"  # what answers a tool call with multi_turn: one of multiturn.TOOLS
    partial_rollout: bool = False


def add_rollout_args(parser):
    g = parser.add_argument_group("rollout (nanorl/rollout.py, nanorl/rl_config.py)")
    g.add_argument(
        "--over-sampling-batch-size",
        type=positive_int,
        default=None,
        help="turns on dynamic sampling: "
        "prompts generated per round, groups kept by the filter until the batch is full",
    )
    g.add_argument(
        "--dynamic-sampling-filter-path",
        default="nanorl.rollout:keep_nonconstant_group",
        help="module:function(group) -> (keep, reason), used with --over-sampling-batch-size",
    )
    g.add_argument(
        "--max-sampling-rounds",
        type=positive_int,
        default=8,
        help="dynamic sampling: rounds before the batch is topped up with dropped groups",
    )
    g.add_argument(
        "--buffer-filter-path",
        default="nanorl.rollout:pop_first",
        help="module:function(buffer, n) -> (taken, rest) for surplus groups",
    )
    g.add_argument(
        "--partial-rollout",
        action="store_true",
        help="with over-sampling: once the batch is full, abort "
        "what is still generating, keep it with its tokens and continue it in the next rollout (pair with "
        "--use-tis)",
    )
    g.add_argument(
        "--top-k",
        type=positive_int,
        default=None,
        help="rollout top-k (default: off; anything but off makes rollouts off-policy)",
    )
    g.add_argument(
        "--top-p", type=number_in(float, 0, 1, lo_open=True), default=None, help="rollout top-p (default: off)"
    )
    g.add_argument("--engine-batch-size", type=positive_int, default=256, help="engine rows decoded at once")
    g.add_argument(
        "--custom-generate-function-path",
        default=None,
        help="module:function(config, engine, tokenizer, "
        "prompts, seeds) -> list of groups (lists) of Sample; config is the RolloutConfig",
    )
    agent = (
        "module:function(client, item) -> reward, or file.py:function: an agent on the openai client (docs/agents.md)"
    )
    g.add_argument("--agent", default=None, help=agent + ", one episode per sample")
    timeout = f"--agent: seconds an episode may take before it is lost (default {AGENT_TIMEOUT:g}; 0 = no limit)"
    g.add_argument("--agent-timeout", type=nonneg_float, default=None, help=timeout)
    g.add_argument(
        "--multi-turn",
        action="store_true",
        help="run tool calls turn by turn (nanorl/multiturn.py), with per-turn metrics",
    )
    g.add_argument(
        "--max-turns",
        type=positive_int,
        default=None,
        help=f"--multi-turn: tool calls per response (default {RolloutConfig.max_turns}); one more ends it "
        f"as truncated",
    )
    g.add_argument(
        "--tool",
        default=None,
        choices=TOOLS,
        help=f"--multi-turn: what answers a tool call (default {RolloutConfig.tool})",
    )
    g.add_argument(
        "--rollout-timeout",
        type=nonneg_float,
        default=1800,
        help="seconds a rank's rollout (or eval) may "
        "take before the run saves and exits non-zero, naming what was in flight (0 = no limit)",
    )


def rollout_config_from_args(args, parser, group):
    """The RolloutConfig of the rollout flags and the run's GroupSpec, after checking that the flags agree."""
    dynamic = args.over_sampling_batch_size is not None
    if args.partial_rollout and not (dynamic and args.over_sampling_batch_size > args.rollout_batch_size):
        parser.error(
            "--partial-rollout needs --over-sampling-batch-size larger than --rollout-batch-size: "
            "partial rollouts abort the surplus that is still generating once the batch is full"
        )
    if args.partial_rollout and args.custom_generate_function_path:
        parser.error(
            "--partial-rollout drives the engine itself: it cannot be combined with --custom-generate-function-path"
        )
    if args.agent:
        for on, flag in (
            (args.custom_generate_function_path, "--custom-generate-function-path"),
            (args.multi_turn, "--multi-turn"),
            (args.partial_rollout, "--partial-rollout"),
        ):
            if on:
                parser.error(f"--agent and {flag} cannot be combined: the agent's episodes are the rollout")
    elif args.agent_timeout is not None:
        parser.error("--agent-timeout is only used with --agent")
    if args.multi_turn:
        if args.custom_generate_function_path:
            parser.error("--multi-turn and --custom-generate-function-path both generate the rollout: give one of them")
        if args.partial_rollout:
            parser.error(
                "--multi-turn and --partial-rollout cannot be combined: partial rollouts park and resume "
                "single engine requests"
            )
    elif args.max_turns is not None or args.tool is not None:
        parser.error("--max-turns and --tool are only used with --multi-turn")
    return RolloutConfig(
        group=group,
        top_k=args.top_k,
        top_p=args.top_p,
        multi_turn=args.multi_turn,
        max_turns=args.max_turns or RolloutConfig.max_turns,
        tool=args.tool or RolloutConfig.tool,
        partial_rollout=args.partial_rollout,
    )


# -----------------------------------------------------------------------------------------------
# the rewards


@dataclass
class RewardConfig:
    """How a rollout is scored: make_reward(rm_type, task, custom_rm_path), or a remote server when rm_type is
    "remote"; what a failed reward becomes (rm_failure)."""

    rm_type: str = "task"
    custom_rm_path: str | None = None
    rm_url: str | None = None
    rm_concurrency: int = 32
    rm_timeout: float = 30.0
    rm_retries: int = 3
    rm_failure: str = "drop"

    @property
    def remote(self):
        return self.rm_type == "remote"

    @property
    def needs_label(self):
        """The generic graders compare with a label; the task's own grader, a custom or a remote one may not."""
        return not (self.remote or self.custom_rm_path or self.rm_type in ("task", "custom"))


def add_reward_args(parser):
    g = parser.add_argument_group("rewards (nanorl/rewards.py, nanorl/rl_config.py)")
    g.add_argument(
        "--rm-type",
        default=None,
        help="task (the task's own grader: chat_eval's verdict; the default with "
        "--task) | math (the default with --prompt-data) | boxed | mc | exact | f1 | format | weighted e.g. "
        "task+format:0.9,0.1 | custom (--custom-rm-path) | remote (--rm-url)",
    )
    g.add_argument("--custom-rm-path", default=None, help="module:function(response, label, metadata) -> float or dict")
    g.add_argument("--rm-url", default=None, help="--rm-type remote: each sample is POSTed here as JSON (README: RL)")
    g.add_argument(
        "--rm-concurrency",
        type=positive_int,
        default=RewardConfig.rm_concurrency,
        help="--rm-type remote: requests in flight at once",
    )
    g.add_argument(
        "--rm-timeout",
        type=positive_float,
        default=RewardConfig.rm_timeout,
        help="--rm-type remote: seconds per request attempt",
    )
    g.add_argument(
        "--rm-retries",
        type=nonneg_int,
        default=RewardConfig.rm_retries,
        help="--rm-type remote: retries after a refused/timed-out/5xx call",
    )
    g.add_argument(
        "--rm-failure",
        default=RewardConfig.rm_failure,
        choices=["drop", "zero"],
        help="a reward that fails (raises, non-number, failed remote call): drop = never trained on, zero = reward 0",
    )


def reward_config_from_args(args, parser, default_rm_type):
    """The RewardConfig of the reward flags, after checking the remote reward's. default_rm_type: the grader when
    --rm-type is not given (the script's choice: prompts from a file have no task grader)."""
    if args.rm_type == "remote":
        if not args.rm_url:
            parser.error(
                "--rm-type remote needs --rm-url (the reward server's address, e.g. http://127.0.0.1:8000/reward)"
            )
        if not args.rm_url.startswith(("http://", "https://")):
            parser.error(f"--rm-url {args.rm_url!r} must start with http:// or https://")
        if args.custom_rm_path:
            parser.error("--rm-type remote and --custom-rm-path both pick the reward: give one of them")
    elif args.rm_url:
        parser.error(f"--rm-url is only used with --rm-type remote (got --rm-type {args.rm_type})")
    return RewardConfig(
        rm_type=args.rm_type or default_rm_type,
        custom_rm_path=args.custom_rm_path or None,
        rm_url=args.rm_url,
        rm_concurrency=args.rm_concurrency,
        rm_timeout=args.rm_timeout,
        rm_retries=args.rm_retries,
        rm_failure=args.rm_failure,
    )


# -----------------------------------------------------------------------------------------------
# the training step


@dataclass
class TrainerConfig:
    """What one training step reads. The defaults are chat_rl's flag defaults."""

    group: GroupSpec = GroupSpec()  # the rollout's: group size, temperature of the log-probs, max length
    advantage_estimator: str = "grpo"  # a row of rl.ESTIMATORS: the advantage function and the policy loss
    num_steps_per_rollout: int = 1
    max_tokens_per_gpu: int = 8192
    grad_clip: float = 1.0  # 0 = off
    warmup_rollouts: int = 0
    lr_decay_style: str = "constant"  # or linear: to 0 over num_rollouts (nanochat's RL schedule)
    num_rollouts: int = 60  # the run's length, for the decay
    gamma: float = 1.0
    lambd: float = 1.0
    value_clip: float = 0.2  # 0 = off
    disable_grpo_std_normalization: bool = False
    normalize_advantages: bool = False
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    eps_clip_c: float | None = None
    entropy_coef: float = 0.0
    loss_aggregation: str = "token_mean"
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    mask_truncated_samples: bool = False
    kl_loss_coef: float = 0.0  # the KL loss (0 = off)
    kl_loss_type: str = "low_var_kl"
    kl_coef: float = 0.0  # the KL penalty in the reward (0 = off)
    opd_kl_coef: float = 1.0  # on-policy distillation, when the Trainer has a teacher
    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    tis_mode: str = "truncate"

    @property
    def estimator(self):
        return rl.ESTIMATORS[self.advantage_estimator]

    @property
    def needs_critic(self):
        return "values" in self.estimator.inputs  # the critic's

    @property
    def needs_reference(self):
        return self.kl_loss_coef > 0 or self.kl_coef > 0


def add_trainer_args(parser):
    c = TrainerConfig
    g = parser.add_argument_group("training step (nanorl/rl_trainer.py, nanorl/rl_config.py)")
    g.add_argument("--global-batch-size", type=positive_int, help="samples per optimizer step (default: the rollout)")
    g.add_argument(
        "--num-steps-per-rollout",
        type=positive_int,
        default=c.num_steps_per_rollout,
        help="optimizer steps per rollout (>1 is off-policy: uses the ratio)",
    )
    g.add_argument(
        "--max-tokens-per-gpu",
        type=positive_int,
        default=c.max_tokens_per_gpu,
        help="tokens per training micro-batch: samples are packed end to end into rows (at most the "
        "model's context each) and rows into micro-batches of this many positions, padding included",
    )
    g.add_argument("--weight-decay", type=nonneg_float, default=0.0, help="optimizer weight decay")
    g.add_argument("--grad-clip", type=nonneg_float, default=c.grad_clip, help="clip the grad norm (0 = off)")
    g.add_argument("--warmup-rollouts", type=nonneg_int, default=c.warmup_rollouts, help="linear LR warmup (rollouts)")
    decay = "LR after the warmup: constant, or linear to 0 at the last rollout (nanochat's RL)"
    g.add_argument("--lr-decay-style", default=c.lr_decay_style, choices=["constant", "linear"], help=decay)
    g = parser.add_argument_group("advantages and loss (nanorl/rl_trainer.py, nanorl/rl.py)")
    g.add_argument(
        "--advantage-estimator",
        default=c.advantage_estimator,
        choices=list(rl.ESTIMATORS),
        help="gspo / cispo: GRPO advantages with GSPO's sequence-level ratio or CISPO's clipped-weight loss",
    )
    g.add_argument("--gamma", type=fraction, default=c.gamma, help="discount of reinforce_plus_plus and ppo returns")
    g.add_argument("--lambd", type=fraction, default=c.lambd, help="ppo: GAE lambda (1: Monte Carlo returns)")
    g.add_argument("--critic-lr", type=positive_float, default=None, help="ppo: the critic's AdamW LR (required)")
    g.add_argument("--value-clip", type=nonneg_float, default=c.value_clip, help="ppo: critic value clip (0 = off)")
    g.add_argument("--disable-grpo-std-normalization", action="store_true", help="Dr. GRPO: no group-std division")
    g.add_argument("--normalize-advantages", action="store_true", help="whiten advantages across all training ranks")
    g.add_argument("--eps-clip", type=number_in(float, 0, 1, lo_open=True), default=c.eps_clip, help="PPO clip range")
    g.add_argument("--eps-clip-high", type=positive_float, default=None, help="clip-higher (DAPO); default --eps-clip")
    g.add_argument(
        "--eps-clip-c", type=number_in(float, 1, lo_open=True), default=None, help="dual clip (>1) for A < 0"
    )
    g.add_argument("--entropy-coef", type=nonneg_float, default=c.entropy_coef, help="entropy bonus coefficient")
    g.add_argument(
        "--loss-aggregation",
        default=c.loss_aggregation,
        choices=rl.LOSS_AGGS,
        help="how per-token losses become one number",
    )
    g.add_argument(
        "--overlong-buffer-len",
        type=nonneg_int,
        default=c.overlong_buffer_len,
        help="DAPO overlong shaping: penalise the last N tokens before the max length",
    )
    g.add_argument(
        "--overlong-penalty-factor",
        type=nonneg_float,
        default=c.overlong_penalty_factor,
        help="the overlong penalty at the max length",
    )
    g.add_argument("--mask-truncated-samples", action="store_true", help="truncated responses are not trained on")
    g.add_argument("--use-kl-loss", action="store_true", help="add a KL(policy || reference) loss")
    g.add_argument("--kl-loss-coef", type=nonneg_float, default=c.kl_loss_coef, help="KL loss weight (--use-kl-loss)")
    g.add_argument(
        "--kl-loss-type",
        default=c.kl_loss_type,
        choices=["k1", "k2", "k3", "low_var_kl"],
        help="KL estimator of the KL loss",
    )
    g.add_argument("--kl-coef", type=nonneg_float, default=c.kl_coef, help="KL penalty (k1) folded into the reward")
    g.add_argument("--use-opd", action="store_true", help="on-policy distillation: teacher log-probs shift advantages")
    g.add_argument("--opd-kl-coef", type=nonneg_float, default=c.opd_kl_coef, help="OPD: A -= coef * (lp - lp_teacher)")
    g.add_argument("--opd-teacher-load", default=None, help="OPD teacher: checkpoint dir or source[:tag]")
    g.add_argument("--use-tis", action="store_true", help="truncated importance weights, trainer vs rollout log-probs")
    g.add_argument("--tis-clip", type=positive_float, default=c.tis_clip, help="TIS: upper bound of the weights")
    g.add_argument("--tis-clip-low", type=nonneg_float, default=c.tis_clip_low, help="TIS: lower bound of the weights")
    g.add_argument("--tis-mode", default=c.tis_mode, choices=["truncate", "icepop"], help="icepop: 0 outside the band")


def trainer_config_from_args(args, parser, group):
    """The TrainerConfig of the flags and the run's GroupSpec, after checking that the flags agree: a combination
    without meaning fails here, before any work, naming both flags."""
    # every other field is a flag of the same name, but the KL loss is off unless --use-kl-loss
    kw = {f.name: getattr(args, f.name) for f in fields(TrainerConfig) if f.name != "group"}
    cfg = TrainerConfig(group=group, **{**kw, "kl_loss_coef": args.kl_loss_coef if args.use_kl_loss else 0.0})
    check_estimator_flags(cfg, args, parser)
    if args.use_kl_loss != (args.kl_loss_coef > 0):
        parser.error("--use-kl-loss and --kl-loss-coef go together: give both (a positive coefficient) or neither")
    if args.use_opd != (args.opd_teacher_load is not None):
        parser.error("--use-opd and --opd-teacher-load go together: give both or neither")
    if not args.use_opd:
        unused(parser, "--opd-kl-coef", cfg.opd_kl_coef, TrainerConfig.opd_kl_coef, "without --use-opd")
    if not cfg.use_tis:
        for flag, field in (("--tis-clip", "tis_clip"), ("--tis-clip-low", "tis_clip_low"), ("--tis-mode", "tis_mode")):
            unused(parser, flag, getattr(cfg, field), getattr(TrainerConfig, field), "without --use-tis")
    if cfg.overlong_buffer_len == 0:
        unused(
            parser,
            "--overlong-penalty-factor",
            cfg.overlong_penalty_factor,
            TrainerConfig.overlong_penalty_factor,
            "without --overlong-buffer-len",
        )
    return cfg


def unused(parser, flag, value, default, why):
    if value != default:
        parser.error(f"{flag} {value} has no effect {why}")


def check_estimator_flags(cfg, args, parser):
    """The flags one estimator reads and another ignores, by the table's `inputs` (rl.ESTIMATORS; "values": a
    critic)."""
    name, est = cfg.advantage_estimator, cfg.estimator
    users = {k: ", ".join(n for n, e in rl.ESTIMATORS.items() if k in e.inputs) for k in ("values", "gamma", "lambd")}
    if "values" in est.inputs and not (args.critic_lr or 0) > 0:
        parser.error(f"--advantage-estimator {name} needs a critic: give --critic-lr (e.g. 1e-4)")
    if args.critic_lr is not None and "values" not in est.inputs:
        parser.error(f"--critic-lr is only used by --advantage-estimator {users['values']}, not {name}")
    if "lambd" not in est.inputs:
        unused(
            parser,
            "--lambd",
            cfg.lambd,
            TrainerConfig.lambd,
            f"with --advantage-estimator {name} (only {users['lambd']} uses it)",
        )
    if "gamma" not in est.inputs:
        unused(
            parser,
            "--gamma",
            cfg.gamma,
            TrainerConfig.gamma,
            f"with --advantage-estimator {name} (it discounts the returns of {users['gamma']} only)",
        )
    if cfg.disable_grpo_std_normalization and "std_normalize" not in est.inputs:
        parser.error(
            f"--disable-grpo-std-normalization has no effect with --advantage-estimator {name} "
            f"({', '.join(n for n, e in rl.ESTIMATORS.items() if 'std_normalize' in e.inputs)})"
        )
    if cfg.normalize_advantages and est.whitened:
        parser.error(f"--normalize-advantages with --advantage-estimator {name}: its advantages are already whitened")
    if cfg.eps_clip_c is not None and est.loss == "cispo":
        parser.error(
            f"--eps-clip-c (dual clip) has no meaning with --advantage-estimator {name}: "
            f"its weights are already clipped"
        )
