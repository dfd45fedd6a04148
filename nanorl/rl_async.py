"""
The roles of one-step-off-policy RL (`chat_rl --async`) and what travels between them, in one torchrun job: the
first --rollout-num-gpus ranks only sample, the others only train. The samplers hand rollout k to the trainers and
sample rollout k+1 with the weights they have (one version behind) while the trainers train on rollout k; then the
first trainer broadcasts the new weights in place (the engine's CUDA graphs see them) with their version and the
step's metrics. Staleness is at most 1; --use-tis corrects it. Collectives, in order: gather k, weights k,
gather k+1, ... A save (every rank, after the weights of its step) is one barrier of all ranks: the trainers write
weights and optimizer, each sampler its prompt order, buffer, RNGs and the rollout it has already sampled for the next
step, so that a --resume continues exactly where the run stopped.

The loops of both roles are in scripts/chat_rl.py (sampler_loop, trainer_loop), beside the synchronous one; this file
holds their pieces.
"""

from dataclasses import dataclass

import torch.distributed as dist

from nanorl.flags import positive_int
from nanorl.rollout import Sample


def add_args(parser):
    g = parser.add_argument_group("async RL (nanorl/rl_async.py)")
    g.add_argument(
        "--async",
        dest="async_mode",
        action="store_true",
        help="one-step-off-policy: sampling ranks "
        "generate rollout k+1 while training ranks train on rollout k, then get the new weights (one rank: "
        "synchronous)",
    )
    g.add_argument(
        "--rollout-num-gpus",
        type=positive_int,
        default=None,
        help="--async: how many ranks sample (the first ones; default half)",
    )


@dataclass
class Roles:
    """Who does what. Synchronous RL: every rank samples and trains, and the groups are None (= all ranks)."""

    async_mode: bool
    is_sampler: bool
    is_trainer: bool
    n_samplers: int  # sampling ranks
    n_trainers: int  # training ranks
    sampler_rank: int  # this rank among the samplers
    trainer_rank: int  # this rank among the trainers
    first_trainer: int = 0  # the first trainer's global rank: the one that broadcasts the weights
    sampler_group: object = None
    trainer_group: object = None
    weights_group: object = None  # the samplers + the first trainer: the weights travel in it

    @property
    def world(self):
        return self.n_samplers + self.n_trainers if self.async_mode else self.n_samplers


def split_ranks(args, parser, rank, world_size):
    """The Roles of this rank from --async and --rollout-num-gpus. --async on one rank falls back to synchronous RL
    (Roles.async_mode is then False)."""
    if args.rollout_num_gpus is not None and not args.async_mode:
        parser.error("--rollout-num-gpus only applies with --async")
    if not (args.async_mode and world_size > 1):
        if args.async_mode:
            print(
                "--async with one rank: falling back to synchronous RL (sampling and training take turns on the one "
                "device)"
            )
        return Roles(False, True, True, world_size, world_size, rank, rank)
    n = args.rollout_num_gpus or world_size // 2  # the samplers: ranks 0..n-1
    if not 1 <= n < world_size:
        parser.error(f"--rollout-num-gpus {n} must leave at least one of the {world_size} ranks to train (--async)")
    # every rank creates every group, in the same order (new_group is collective)
    samplers, trainers = dist.new_group(list(range(n))), dist.new_group(list(range(n, world_size)))
    weights = dist.new_group(list(range(n + 1)))
    return Roles(True, rank < n, rank >= n, n, world_size - n, rank, rank - n, n, samplers, trainers, weights)


def exchange_rollouts(roles, payload):
    """Every rank's rollout payload to every rank (a trainer sends None) -> the samplers' payloads, in rank order.
    A payload is a dict: groups, failure (None or what went wrong), metrics, rollout_s."""
    gathered = [None] * roles.world
    dist.all_gather_object(gathered, payload)
    return [p for p in gathered if p is not None]


def payload_state(payload):
    """A sampler's payload in plain values, for its checkpoint (None stays None)."""
    if payload is None:
        return None
    return {**payload, "groups": [[s.to_dict() for s in g] for g in payload["groups"]]}


def payload_from_state(state):
    """payload_state's inverse."""
    if state is None:
        return None
    return {**state, "groups": [[Sample(**d) for d in g] for g in state["groups"]]}


def sum_payload_metrics(payloads):
    """The samplers' rollout metrics as one: counts add up over the sampling ranks, perf figures are the slowest
    one's."""
    m = {}
    for p in payloads:
        for k, v in p["metrics"].items():
            m[k] = max(m.get(k, 0), v) if k.startswith("perf/") else m.get(k, 0) + v
    m["time/rollout"] = max(p["rollout_s"] for p in payloads)
    return m


def send_weights(model, roles, version, metrics):
    """The first trainer: the new weights, in place on every sampler, then their version and the step's metrics."""
    for p in model.parameters():
        dist.broadcast(p.data, src=roles.first_trainer, group=roles.weights_group)
    dist.broadcast_object_list([(version, metrics)], src=roles.first_trainer, group=roles.weights_group)


def receive_weights(model, engine, roles):
    """A sampler: send_weights' weights into the model, then into the engine's own copy -> (version, metrics)."""
    for p in model.parameters():
        dist.broadcast(p.data, src=roles.first_trainer, group=roles.weights_group)
    engine.load_weights(model)
    box = [None]
    dist.broadcast_object_list(box, src=roles.first_trainer, group=roles.weights_group)
    return box[0]


def idle_fractions(roles, idle_s, elapsed_s, distributed):
    """The share of its time each kind of rank ("both" when synchronous, else "sampling" and "training") waited on
    the others, over all ranks of that kind: {"idle_frac_<kind>_ranks": fraction}. Collective when distributed."""
    role = "both" if not roles.async_mode else "sampling" if roles.is_sampler else "training"
    busy = [(role, idle_s, elapsed_s)]
    if distributed:
        busy = [None] * roles.world
        dist.all_gather_object(busy, (role, idle_s, elapsed_s))
    out = {}
    for r in ("both", "sampling", "training"):
        rows = [(w, t) for rr, w, t in busy if rr == r]
        if rows:
            out[f"idle_frac_{r}_ranks"] = round(sum(w for w, _ in rows) / sum(t for _, t in rows), 3)
    return out
