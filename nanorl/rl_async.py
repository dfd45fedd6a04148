"""
One-step-off-policy RL (`chat_rl --async`), in one torchrun job: the first --rollout-num-gpus ranks only sample,
the others only train. The samplers hand rollout k to the trainers and sample rollout k+1 with the weights they
have (one version behind) while the trainers train on rollout k; then the first trainer broadcasts the new weights
in place (the engine's CUDA graphs see them) with their version and the step's metrics. Staleness is at most 1;
--use-tis corrects it. Collectives, in order: gather k, weights k, gather k+1, ...

scripts/chat_rl.py decides the roles with split_ranks() and hands the loop to run() in one line.
"""
import time
from dataclasses import dataclass

import torch.distributed as dist

from nanorl.common import positive_int


def add_args(parser):
    g = parser.add_argument_group("async RL (nanorl/rl_async.py)")
    g.add_argument("--async", dest="async_mode", action="store_true", help="one-step-off-policy: sampling ranks generate rollout "
                   "k+1 while training ranks train on rollout k, then get the new weights (one rank: synchronous)")
    g.add_argument("--rollout-num-gpus", type=positive_int, default=None, help="--async: how many ranks sample (the first ones; default half)")


@dataclass
class Roles:
    """Who does what. Synchronous RL: every rank samples and trains, and the groups are None (= all ranks)."""
    async_mode: bool
    is_sampler: bool
    is_trainer: bool
    sworld: int  # sampling ranks
    tworld: int  # training ranks
    srank: int  # this rank among the samplers
    trank: int  # this rank among the trainers
    R: int = 0  # the first trainer's global rank: the one that broadcasts the weights
    sgroup: object = None
    tgroup: object = None
    wgroup: object = None  # the samplers + the first trainer: the weights travel in it


def split_ranks(args, parser, rank, world_size):
    if args.rollout_num_gpus is not None and not args.async_mode:
        parser.error("--rollout-num-gpus only applies with --async")
    if not (args.async_mode and world_size > 1):
        if args.async_mode:
            print("--async with one rank: falling back to synchronous RL (sampling and training take turns on the one device)")
        args.async_mode = False
        return Roles(False, True, True, world_size, world_size, rank, rank)
    if args.resume:
        parser.error("--resume with --async is not supported: the prompt order lives on the sampling ranks; resume without --async")
    R = args.rollout_num_gpus or world_size // 2
    if not 1 <= R < world_size:
        parser.error(f"--rollout-num-gpus {R} must leave at least one of the {world_size} ranks to train (--async)")
    # every rank creates every group, in the same order (new_group is collective)
    sgroup, tgroup = dist.new_group(list(range(R))), dist.new_group(list(range(R, world_size)))
    wgroup = dist.new_group(list(range(R + 1)))
    return Roles(True, rank < R, rank >= R, R, world_size - R, rank, rank - R, R, sgroup, tgroup, wgroup)


def sum_payload_metrics(payloads):
    """The samplers' rollout metrics as one: counts add up over the sampling ranks, perf figures are the slowest one's."""
    m = {}
    for p in payloads:
        for k, v in p["metrics"].items():
            m[k] = max(m.get(k, 0), v) if k.startswith("perf/") else m.get(k, 0) + v
    m["time/rollout"] = max(p["rollout_s"] for p in payloads)
    return m


def run(roles, start_step, num_rollouts, model, engine, sample, train, log_step, maybe_eval, save, should_save, stop_after_failure,
        weights_checksum):
    """
    The async loop of this rank; a sampler refreshes engine's weights after each broadcast. sample(step, version) -> payload dict (groups, failure, metrics, rollout_s);
    train(step, groups, m) -> metrics; log_step(step, m, dt); maybe_eval(step); save(step); should_save(step);
    stop_after_failure(step, n_failed). Returns the seconds this rank spent waiting on the others.
    """
    idle, version, R, world = 0.0, start_step, roles.R, roles.sworld + roles.tworld
    if roles.is_sampler:
        payload = sample(start_step, version)
        for step in range(start_step, num_rollouts):
            t0 = time.time()
            gathered = [None] * world
            dist.all_gather_object(gathered, payload)
            wait = time.time() - t0
            failures = [p["failure"] for p in gathered if p is not None and p["failure"]]
            if failures:
                stop_after_failure(step, len(failures))
            if step + 1 < num_rollouts:
                payload = sample(step + 1, version)
            # the trainers' new weights, in place, their version and the step's metrics
            t_wait = time.time()
            for p in model.parameters():
                dist.broadcast(p.data, src=R, group=roles.wgroup)
            engine.load_weights(model)  # the engine samples from its own copy
            box = [None]
            dist.broadcast_object_list(box, src=R, group=roles.wgroup)
            wait += time.time() - t_wait
            version, m = box[0]
            m["async/sampler_weight_version"] = version
            m["async/sampler_weight_checksum"] = weights_checksum()
            dt = time.time() - t0
            m["perf/idle_frac_sampler"] = m["perf/idle_frac"] = wait / dt
            idle += wait
            if roles.srank == 0:
                log_step(step, m, dt)
            maybe_eval(step)
        return idle
    for step in range(start_step, num_rollouts):  # a training rank
        t0 = time.time()
        gathered = [None] * world
        dist.all_gather_object(gathered, None)
        wait = time.time() - t0
        payloads = [p for p in gathered if p is not None]
        failures = [p["failure"] for p in payloads if p["failure"]]
        if failures:
            stop_after_failure(step, len(failures))
        groups = [g for p in payloads for g in p["groups"]][roles.trank::roles.tworld]
        m = train(step, groups, sum_payload_metrics(payloads))
        version += 1
        m["async/trainer_weight_checksum"] = weights_checksum()
        m["perf/idle_frac_trainer"] = wait / (time.time() - t0)
        idle += wait
        if roles.trank == 0:
            for p in model.parameters():
                dist.broadcast(p.data, src=R, group=roles.wgroup)
            dist.broadcast_object_list([(version, m)], src=R, group=roles.wgroup)
        if should_save(step + 1):
            save(step + 1)
    return idle
