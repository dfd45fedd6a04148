"""
What an RL run tells its user as it goes: the step line's abbreviations explained once, each eval logged (the one
before training too, so the curves start from a "before" point), the ranks' idle time when there are ranks to wait
on, and at the end what changed, where the model is and how to chat with it. scripts/chat_rl.py calls these.
"""

# one entry per field of chat_rl's step line, in its order; tests/test_rl_progress.py checks it against log_step
STEP_FIELDS = [
    ("reward", "mean reward of the rollout's samples"),
    ("len", "mean response length in tokens"),
    ("pg", "policy-gradient loss"),
    ("clip", "fraction of tokens (gspo: of sequences) whose probability ratio was clipped"),
    ("ppo_kl", "mean rollout-policy minus current log-prob: how far this step's updates moved the policy"),
    ("ent", "mean entropy per token, in nats (falling fast: the policy is collapsing onto few answers)"),
    ("gnorm", "gradient norm before clipping"),
    ("lp_diff", "mean |trainer - sampler log-prob| per token (near 0: the engine samples the model being trained)"),
    ("pad", "share of padding in the training batches"),
    ("dropped", "groups removed by the dynamic-sampling filter"),
    ("dt", "seconds for the step (rollout: sampling and scoring; waiting: on other ranks)"),
    ("eta", "time left, evals and saves included"),
]


def step_legend():
    """One line explaining the step line, printed at the start of a run and shown in --help."""
    return "step line: " + "; ".join(f"{name} = {what}" for name, what in STEP_FIELDS)


def log_eval(logger, eval_history, step, metrics):
    """Record an eval: appended to eval_history (the report's before/after rows) and sent to the wandb/TensorBoard
    logger at its step, step 0 included, so a run's curves have the point before training."""
    eval_history.append({"step": step, **metrics})
    logger.log(metrics, step=step)


def idle_line(idle_frac, device_type, world_size):
    """The end-of-run line of the time ranks waited on each other; None on one rank (there is no one to wait on)."""
    if world_size <= 1:
        return None
    return f"idle fraction (time a {device_type.upper()} rank waited on other ranks): " + ", ".join(
        f"{k} {v:.1%}" for k, v in idle_frac.items()
    )


def rl_summary(eval_history, checkpoint_dir, saved_step, tag):
    """The lines an RL run ends with: each eval metric (pass@k, greedy if evaluated) before -> after, in points, the
    checkpoint it saved and the command to chat with it. eval_history: [{"step", "eval/<metric>": value, ...}]."""
    lines = ["RL summary:"]
    if eval_history:
        first, last = eval_history[0], eval_history[-1]
        for key, before in first.items():
            if key.startswith("eval/") and key in last:
                after = last[key]
                lines.append(
                    f"  {key[5:]}: {before:.4f} -> {after:.4f} ({100 * (after - before):+.1f} pts, "
                    f"step {first['step']} -> {last['step']})"
                )
    else:
        lines.append("  no eval ran")
    if saved_step is None:
        lines.append(f"  nothing saved in {checkpoint_dir}")
    else:
        lines.append(f"  saved: step {saved_step} in {checkpoint_dir}")
        lines.append(f"  chat with it: python -m scripts.chat_cli -i rl -g {tag}")
    return "\n".join(lines)
