"""
chat_rl's training step (nanorl.rl_trainer.Trainer) in process on a tiny model: the step does not depend on how the
batch is cut into micro-batches, for every estimator and aggregation, and packing samples into rows gives the same
log-probs, values and update as padding each sample on its own row; the sampler's log-probs are the trainer's at
any temperature; flag combinations without meaning fail naming both flags.
"""

import argparse
import copy

import pytest
import torch

from nanorl import rl, rl_trainer
from nanorl.engine import Engine, Request
from nanorl.gpt import Critic, GPTConfig, build_model
from nanorl.logger import Timer
from nanorl.optim import MuonAdamW, build_optimizer
from nanorl.prompts import add_prompt_ids
from nanorl.rl_config import (
    GroupSpec,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
    add_trainer_args,
    trainer_config_from_args,
)
from nanorl.rl_trainer import collate_packed
from nanorl.rollout import RolloutWorker, Sample, extend_sample
from nanorl.tokenizer import SPLIT_PATTERN, Tokenizer

V = 300


def tiny_model(seed=0):
    torch.manual_seed(seed)
    m = build_model(GPTConfig(sequence_len=64, vocab_size=V, n_layer=2, n_head=2, n_kv_head=1, n_embd=32), "cpu")
    with torch.no_grad():
        m.lm_head.weight.normal_(0, 0.3)  # a spread-out distribution, so samples and ratios differ
    return m


def trainer_config(estimator="grpo", n=4, max_len=12, temperature=1.0, **kw):
    group = GroupSpec(n_samples_per_prompt=n, temperature=temperature, max_response_len=max_len)
    return TrainerConfig(group=group, advantage_estimator=estimator, **kw)


def parse_trainer_flags(*flags, estimator="grpo"):
    """chat_rl's training flags through its parser and checks -> the TrainerConfig."""
    p = argparse.ArgumentParser()
    add_trainer_args(p)
    p.add_argument("--num-rollouts", type=int, default=60)  # chat_rl's own flags: the LR decay's horizon,
    group = GroupSpec(n_samples_per_prompt=4, temperature=1.0, max_response_len=12)  # the group
    return trainer_config_from_args(p.parse_args([*flags, "--advantage-estimator", estimator]), p, group)


def make_samples(lengths, n=4, seed=0):
    """Groups of n samples with the given response lengths (short and long mixed), random tokens and rewards."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, L in enumerate(lengths):
        P = 3 + i % 2
        toks = torch.randint(0, V, (P + L,), generator=g).tolist()
        out.append(
            Sample(
                tokens=toks,
                response_length=L,
                loss_mask=[1] * L,
                rollout_log_probs=[-1.0] * L,
                reward=float(torch.rand(1, generator=g) > 0.5) + 0.1 * i,
                index=i % n,
                metadata={"row": i},
            )
        )
    return out


class PaddedTrainer(rl_trainer.Trainer):
    """The reference: the scheme before packing, each sample on its own row padded to the micro-batch's longest
    (sorted by length, rows x longest within --max-tokens-per-gpu), plain causal attention, no document ids."""

    def micro_batches(self, samples, model):
        order, mb = sorted(range(len(samples)), key=lambda i: len(samples[i].tokens)), []
        for i in order + [None]:
            if mb and (i is None or len(samples[i].tokens) * (len(mb) + 1) > self.cfg.max_tokens_per_gpu):
                yield {**collate_packed(samples, [[j] for j in mb]), "doc_ids": None}  # one sample per row
                mb = []
            mb.append(i)


def tiny_critic(model):
    torch.manual_seed(1)
    critic = Critic(model)
    with torch.no_grad():
        critic.value_head.weight.normal_(0, 0.3)  # V != 0, so the trunk gets a gradient too
    return critic


def step_grads(args, samples, trainer_cls=rl_trainer.Trainer):
    """The gradient the training step hands its optimizer (Adam's division by sqrt(v) would blow float noise up);
    with ppo the critic's too."""
    model, grads = tiny_model(), {}
    critic = tiny_critic(model) if args.needs_critic else None
    optimizer, critic_optimizer = build_optimizer(model), None
    optimizer.step = lambda: grads.update({k: p.grad.clone() for k, p in model.named_parameters()})
    if critic:
        critic_optimizer = MuonAdamW(
            [
                dict(
                    params=list(critic.parameters()),
                    kind="adamw",
                    lr=1e-3,
                    initial_lr=1e-3,
                    betas=(0.9, 0.95),
                    eps=1e-8,
                    weight_decay=0.0,
                )
            ]
        )
        critic_optimizer.step = lambda: grads.update(
            {"critic." + k: p.grad.clone() for k, p in critic.named_parameters() if p.grad is not None}
        )
    extras = rl_trainer.ExtraModels(critic=critic, critic_optimizer=critic_optimizer)
    trainer = trainer_cls(args, model, optimizer, torch.device("cpu"), extras)
    m = trainer.train_step(0, copy.deepcopy(samples), Timer())
    return grads, m


@pytest.mark.parametrize(
    "estimator", ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gspo", "cispo"]
)
@pytest.mark.fp32("equal to fp32 rounding by design; bf16 rounds ~3e-3 relative")
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_step_does_not_depend_on_micro_batching(estimator, agg):
    """4 short + 4 long samples in one micro-batch or several (--max-tokens-per-gpu): the same update, for every
    estimator and aggregation (GSPO used to weigh micro-batches by token share whatever the aggregation)."""
    samples = make_samples([2, 3, 11, 12, 2, 12, 3, 11])
    kw = dict(estimator=estimator, loss_aggregation=agg, use_tis=True, grad_clip=0)
    one, m1 = step_grads(trainer_config(max_tokens_per_gpu=10000, **kw), samples)
    many, m2 = step_grads(trainer_config(max_tokens_per_gpu=40, **kw), samples)
    assert len(one) == len(many) > 0
    for k in one:
        assert torch.allclose(one[k], many[k], atol=1e-7, rtol=1e-5), (k, (one[k] - many[k]).abs().max())
    assert m1["train/grad_norm"] == pytest.approx(m2["train/grad_norm"], rel=1e-5)
    assert m1["train/grad_norm"] > 0
    # packed rows (document masking) == each sample on its own padded row (plain causal attention)
    padded, _ = step_grads(trainer_config(max_tokens_per_gpu=40, **kw), samples, PaddedTrainer)
    for k in one:
        assert torch.allclose(one[k], padded[k], atol=1e-7, rtol=1e-5), (k, (one[k] - padded[k]).abs().max())
    # --use-tis is applied by every estimator (the rollout log-probs here are off: the weights are not 1)
    plain, _ = step_grads(trainer_config(max_tokens_per_gpu=40, **{**kw, "use_tis": False}), samples)
    assert any(not torch.allclose(plain[k], many[k]) for k in plain)


@pytest.mark.fp32("equal to fp32 rounding by design; bf16 rounds ~3e-3 relative")
def test_ppo_step_packed_equals_padded():
    """ppo trains a critic too: its values and both gradients are the same packed (one micro-batch or several) as
    padded. train/padding_frac is the share of the positions the model ran that hold no sample."""
    samples = make_samples([2, 3, 11, 12, 2, 12, 3, 11])
    one, m1 = step_grads(trainer_config("ppo", max_tokens_per_gpu=10000, grad_clip=0), samples)
    many, m2 = step_grads(trainer_config("ppo", max_tokens_per_gpu=40, grad_clip=0), samples)
    padded, m3 = step_grads(trainer_config("ppo", max_tokens_per_gpu=10000, grad_clip=0), samples, PaddedTrainer)
    assert any(k.startswith("critic.gpt.") for k in one) and len(one) == len(many) == len(padded)
    for k in one:
        for other in (many, padded):
            assert torch.allclose(one[k], other[k], atol=1e-7, rtol=1e-5), (k, (one[k] - other[k]).abs().max())
    # by hand: inputs of 4, 6, 13, 15, 4, 15, 5, 14 positions (76) fit 2 rows of the context (64); evened out
    # (first-fit at capacity 38, 39, 40: 3, 3, 2 rows) they are 15+15+6+4 and 14+13+5+4, one micro-batch of 2 x 40;
    # padded: 8 rows x 15
    assert m1["train/padding_frac"] == pytest.approx(1 - 76 / 80)
    assert m3["train/padding_frac"] == pytest.approx(1 - 76 / 120)


@pytest.mark.fp32("calls the model outside autocast, as an fp32 reference (CUDA's layout runs it under autocast only)")
def test_packed_forward_equals_each_sample_alone():
    """Samples of mixed lengths, down to a 1-token response, packed several to a row: the trainer's log-probs,
    entropies and critic values equal those of each sample run alone, unpadded (fp32)."""
    samples = make_samples([1, 12, 2, 7, 1, 30, 3, 5, 20, 1, 40, 1])
    args = trainer_config("ppo", max_tokens_per_gpu=128)
    model = tiny_model()
    trainer = rl_trainer.Trainer(
        args, model, None, torch.device("cpu"), rl_trainer.ExtraModels(critic=tiny_critic(model))
    )
    batches = list(trainer.micro_batches(samples, model))
    assert max(len(set(row.tolist())) for b in batches for row in b["doc_ids"]) >= 4  # rows hold several samples
    assert len(batches) > 1
    lp, values = trainer.logp_of(model, samples), trainer.values_of(samples)
    with torch.no_grad():
        ent = {i: row for b in batches for i, row in zip(b["order"], trainer.forward_logp(model, b)[1])}
        for i, s in enumerate(samples):
            b, n = collate_packed([s], [[0]]), len(s.tokens) - 1
            inputs, targets = b["packed_inputs"], b["packed_targets"].clamp(min=0)
            want_lp, want_ent = model.token_logprobs(inputs, targets, return_entropy=True)
            want_v = trainer.critic(inputs)
            for got, want in ((lp[i], want_lp), (ent[i], want_ent), (values[i], want_v)):
                assert torch.allclose(got[:n], want[0], atol=1e-6, rtol=0), (i, (got[:n] - want[0]).abs().max())
                assert (got[n:] == 0).all()


@pytest.mark.fp32("calls the model outside autocast, as an fp32 reference (CUDA's layout runs it under autocast only)")
def test_gspo_rows_weigh_equally_under_sequence_mean():
    """The issue's case: 8 samples, 4 short + 4 long, in two micro-batches: with seq_mean_token_mean each row's
    gradient weight is 1/8 whatever its length, i.e. the loss is the plain mean of the rows' token means."""
    samples = make_samples([2, 2, 2, 2, 12, 12, 12, 12])
    args = trainer_config("gspo", loss_aggregation="seq_mean_token_mean", max_tokens_per_gpu=40, grad_clip=0)
    model = tiny_model()
    trainer = rl_trainer.Trainer(args, model, build_optimizer(model), torch.device("cpu"))
    adv, _ = trainer.compute_advantages(samples, None, None, None)
    # on-policy the GSPO loss's gradient is that of -1/8 sum_i A_i mean_t logp_i,t: each row weighs 1/8, whatever its length
    model.zero_grad()
    batch = collate_packed(samples, [[i] for i in range(len(samples))])  # one sample per row: padded
    logp = model.token_logprobs(batch["packed_inputs"], batch["packed_targets"].clamp(min=0))
    mask = batch["loss_mask"]
    ref = -(adv * logp * mask).sum(-1) / mask.sum(-1)
    ref.mean().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for mb in [[0, 1, 2, 3], [4, 5, 6, 7]]:  # the trainer's own loss path, two micro-batches of 4 samples, one row each
        b = collate_packed(samples, [mb])
        lp, _ = trainer.forward_logp(model, b)
        loss, _ = rl.policy_loss(
            lp,
            lp.detach(),
            adv[mb, : lp.size(1)],
            b["loss_mask"],
            rl.LossConfig(kind="gspo", loss_agg="seq_mean_token_mean"),
        )
        (loss * len(mb) / 8).backward()
    for w, p in zip(want, model.parameters()):
        assert torch.allclose(w, p.grad, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampler_logprobs_are_the_trainers_at_any_temperature(temperature):
    """On-policy, the engine's recorded log-probs are those of the distribution it sampled from, which is what the
    trainer computes at the rollout temperature: TIS weights are all 1 and the mismatch metric is ~0."""
    model = tiny_model(3)
    tok = Tokenizer.from_ranks({bytes([i]): i for i in range(256)}, SPLIT_PATTERN)
    engine = Engine(model, tok, batch_size=8, max_len=40)
    prompt = [tok.get_bos_token_id(), 5, 6, 7]
    comps = engine.submit_and_wait(
        [Request(prompt, num_samples=4, max_tokens=20, temperature=temperature, seed=1, stop_tokens=[])]
    )[0]
    samples = [extend_sample(Sample(tokens=list(prompt), reward=float(i % 2), index=i), c) for i, c in enumerate(comps)]
    args = trainer_config(use_tis=True, max_len=20, temperature=temperature)
    trainer = rl_trainer.Trainer(args, model, build_optimizer(model), torch.device("cpu"))
    lp = trainer.logp_of(model, samples)
    for s, row in zip(samples, lp):
        got = row[s.prompt_length - 1 : s.prompt_length - 1 + s.response_length]
        assert torch.allclose(got, torch.tensor(s.rollout_log_probs), atol=1e-5), (
            (got - torch.tensor(s.rollout_log_probs)).abs().max()
        )
    m = trainer.train_step(0, samples, Timer())
    assert m["train/train_rollout_logprob_abs_diff"] < 1e-5
    assert m["train/tis_mean"] == pytest.approx(1.0, abs=1e-5) and m["train/tis_clipfrac"] == 0.0


@pytest.mark.parametrize(
    "flags,msg",
    [
        (["--eps-clip-c", "3"], "--eps-clip-c (dual clip) has no meaning with --advantage-estimator cispo"),
        (["--tis-mode", "icepop"], "--tis-mode icepop has no effect without --use-tis"),
        (["--kl-loss-coef", "0.1"], "--use-kl-loss and --kl-loss-coef go together"),
        (["--use-kl-loss"], "--use-kl-loss and --kl-loss-coef go together"),
        (["--lambd", "0.9"], "--lambd 0.9 has no effect with --advantage-estimator cispo"),
        (["--opd-kl-coef", "0.5"], "--opd-kl-coef 0.5 has no effect without --use-opd"),
        (
            ["--overlong-penalty-factor", "2"],
            "--overlong-penalty-factor 2.0 has no effect without --overlong-buffer-len",
        ),
    ],
)
def test_meaningless_flag_combinations_fail_naming_both(flags, msg, capsys):
    with pytest.raises(SystemExit) as e:
        parse_trainer_flags(*flags, estimator="cispo")
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_normalize_advantages_refused_for_reinforce_pp(capsys):
    with pytest.raises(SystemExit):
        parse_trainer_flags("--normalize-advantages", estimator="reinforce_plus_plus")
    assert "already whitened" in capsys.readouterr().err


def test_worker_and_trainer_read_one_group_spec():
    """One GroupSpec, handed to both sides, is where the group size, the temperature and the length live: the worker
    samples groups of its size at its temperature, the trainer computes log-probs at that temperature (on-policy:
    the engine's recorded log-probs are the trainer's), and a trainer at another temperature would not be."""
    model = tiny_model(3)
    tok = Tokenizer.from_ranks({bytes([i]): i for i in range(256)}, SPLIT_PATTERN)
    engine = Engine(model, tok, batch_size=8, max_len=40)
    group = GroupSpec(n_samples_per_prompt=2, temperature=0.7, max_response_len=8)
    worker = RolloutWorker(RolloutConfig(group=group), engine, tok, None, RewardConfig())
    items = [{"text": t, "label": None, "metadata": {"row": i}} for i, t in enumerate(["ab", "cde"])]
    add_prompt_ids(tok, items)
    groups = worker.sample_groups(items, [1, 2], 0)
    assert [len(g) for g in groups] == [2, 2] and all(s.response_length <= 8 for g in groups for s in g)
    samples = [s for g in groups for s in g]
    for i, s in enumerate(samples):  # (the tiny model's vocabulary is larger than the tokenizer's: no text to grade)
        s.reward = float(i % 2)
    cfg = TrainerConfig(group=group)
    trainer = rl_trainer.Trainer(cfg, model, build_optimizer(model), torch.device("cpu"))
    assert trainer.train_step(0, copy.deepcopy(samples), Timer())["train/train_rollout_logprob_abs_diff"] < 1e-5
    other = TrainerConfig(group=GroupSpec(n_samples_per_prompt=2, temperature=1.0, max_response_len=8))
    fresh = tiny_model(3)
    trainer = rl_trainer.Trainer(other, fresh, build_optimizer(fresh), torch.device("cpu"))
    assert trainer.train_step(0, samples, Timer())["train/train_rollout_logprob_abs_diff"] > 1e-2


@pytest.mark.parametrize(
    "style,warmup,want",
    [("constant", 0, [1, 1, 1, 1]), ("linear", 0, [1, 0.75, 0.5, 0.25]), ("linear", 2, [0.5, 0.75, 0.5, 0.25])],
)
def test_lr_schedule_warms_up_then_decays_to_zero_at_the_last_rollout(style, warmup, want):
    """--lr-decay-style linear is nanochat's RL schedule (lr x (1 - step / steps)); after --warmup-rollouts' ramp."""
    cfg = parse_trainer_flags("--lr-decay-style", style, "--warmup-rollouts", str(warmup), "--num-rollouts", "4")
    model = tiny_model()
    trainer = rl_trainer.Trainer(cfg, model, build_optimizer(model), torch.device("cpu"))
    seen = []
    for step in range(4):
        trainer.train_step(step, make_samples([5, 7, 3, 6]), Timer())
        seen.append([g["lr"] / g["initial_lr"] for g in trainer.optimizer.param_groups])
    assert all(lrs == pytest.approx([w] * len(lrs), rel=1e-12) for lrs, w in zip(seen, want)), seen
