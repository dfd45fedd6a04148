"""
One optimizer object for the whole model: Muon for the transformer's 2D matrices, AdamW for the
embedding, the unembedding and anything else.

Distributed, the gradients must be averaged across ranks before the update. Three ways, one of them per step:
- the model is wrapped in DDP or sharded with FSDP2: they average during backward; the caller says so with
  gradients_averaged();
- the caller calls average_gradients() itself (one flat all-reduce per dtype; chat_rl does, before clipping);
- neither: step() calls average_gradients().
Muon's orthogonalisation (the expensive part) is split across the same ranks: in each group of same-shape
matrices rank r orthogonalises the r-th, and one all_gather hands every rank all the results (while the
next group is being orthogonalised).
Under FSDP2 the parameters are DTensor shards: AdamW works on the shards as is; Muon gathers each full
momentum matrix, orthogonalises it on its owner rank as above, and each rank keeps its shard of the update.
"""

from contextlib import nullcontext

import torch
import torch.distributed as dist

from nanorl.common import is_dtensor
from nanorl.precision import bf16_matmuls, cuda_dtypes


@torch.no_grad()
def orthogonalize(G, steps=5, dtype=torch.float32, matmuls=None):
    """
    Approximately replace G by the nearest semi-orthogonal matrix (U V^T of its SVD) with a quintic
    Newton-Schulz iteration. The coefficients push singular values towards 1 quickly rather than exactly,
    which is all Muon needs. It iterates in `dtype` with its matmuls inside the context `matmuls`: MuonAdamW
    passes bf16 on GPU (fast, and accurate enough) with precision.bf16_matmuls' context, fp32 elsewhere.
    """
    tall = G.size(-2) > G.size(-1)  # a tall matrix: orthogonalise its transpose, whose Gram matrix is the smaller one
    a, b, c = 3.4445, -4.7750, 2.0315
    X = (G.mT if tall else G).to(dtype)
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # spectral norm <= Frobenius norm <= 1
    with matmuls or nullcontext():
        for _ in range(steps):
            A = X @ X.mT
            B = b * A + c * (A @ A)
            X = a * X + B @ X
    return (X.mT if tall else X).to(G.dtype)


def _distributed():
    return dist.is_available() and dist.is_initialized()


class MuonAdamW(torch.optim.Optimizer):
    def __init__(self, param_groups):
        super().__init__(param_groups, defaults={})
        self._averaged, self._group = False, None
        params = [p for g in self.param_groups for p in g["params"]]
        # FSDP2 shards a whole model before its optimizer is built (every script that shards does): then every
        # parameter is a DTensor shard, which AdamW steps as is and Muon gathers whole
        self.sharded = any(is_dtensor(p) for p in params)
        # the precision of Muon's Newton-Schulz iteration, fixed for the run by the device it runs on: the model's, or
        # under FSDP's CPU offload the mesh's GPU, where each full matrix is gathered (_muon)
        device_type = params[0].device_mesh.device_type if self.sharded else params[0].device.type
        self.ns_dtype = torch.bfloat16 if cuda_dtypes(device_type) else torch.float32
        self.ns_matmuls = bf16_matmuls(device_type)

    def gradients_averaged(self, group=None):
        """The gradients are already the mean over the ranks of `group` (DDP's reducer or FSDP2's reduce-scatter
        did it during backward): step() must not all-reduce them again, and splits Muon's work over `group`."""
        self._averaged, self._group = True, group

    @torch.no_grad()
    def average_gradients(self, group=None):
        """All-reduce (mean) every gradient across ranks (of `group`, default all), one flat buffer per dtype to keep
        calls few. step() calls it, unless the caller already did (gradient clipping must see the averaged gradients)."""
        self.gradients_averaged(group)
        if not _distributed() or dist.get_world_size(group) == 1:
            return
        if self.sharded:  # FSDP2's gradients (DTensor shards) were already reduce-scattered during backward
            return
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        by_dtype = {}
        for gr in grads:
            by_dtype.setdefault(gr.dtype, []).append(gr)
        for same in by_dtype.values():
            flat = torch.cat([gr.reshape(-1) for gr in same])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            flat /= dist.get_world_size(group)
            off = 0
            for gr in same:
                gr.copy_(flat[off : off + gr.numel()].view_as(gr))
                off += gr.numel()

    def state_bytes(self):
        """The bytes of state step() allocates at its first call, on this rank: Muon's momentum like each matrix (of
        this rank's shard under FSDP), AdamW's two fp32 moments per parameter."""
        return sum(
            (p.to_local() if self.sharded else p).numel() * (p.element_size() if g["kind"] == "muon" else 8)
            for g in self.param_groups
            for p in g["params"]
        )

    FP32_STATE = ("exp_avg", "exp_avg_sq")  # AdamW's moments: fp32 whatever the parameter's dtype

    def load_state_dict(self, state_dict):
        """torch.optim.Optimizer.load_state_dict casts floating state to its parameter's dtype: a bf16 parameter (the
        CUDA embedding) would come back with bf16 moments, and the next step would mix them with fp32 ones. The
        moments are put back from the saved fp32 values, so a resumed run steps exactly as an uninterrupted one."""
        super().load_state_dict(state_dict)
        for saved_group, group in zip(state_dict["param_groups"], self.param_groups):
            for pid, p in zip(saved_group["params"], group["params"]):
                for key, value in state_dict["state"].get(pid, {}).items():
                    if key in self.FP32_STATE:
                        self.state[p][key] = value.to(device=p.device, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure=None):  # closure: unused, torch.distributed.checkpoint passes it
        if not self._averaged:
            self.average_gradients()
        pg, self._averaged, self._group = self._group, False, None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]  # a parameter without a gradient stays as is
            if group["kind"] == "muon":
                self._muon(group, params, pg)
            else:
                self._adamw(group, params)

    def _muon(self, group, params, pg):
        lr, mom, wd = group["lr"], group["momentum"], group["weight_decay"]
        world, rank = (dist.get_world_size(pg), dist.get_rank(pg)) if _distributed() else (1, 0)
        if world == 1:  # one process orthogonalises every matrix itself: nothing to split or gather
            for p in params:
                update = orthogonalize(self._look_ahead(p, mom), group["ns_steps"], self.ns_dtype, self.ns_matmuls)
                self._apply_muon(p, update, lr, wd)
            return

        def apply_gathered(chunk, updates, work):  # every rank's share of a chunk, once its all_gather is done
            work.wait()
            for p, update in zip(chunk, updates):
                self._apply_muon(p, update, lr, wd)

        by_shape = {}
        for p in params:
            by_shape.setdefault(tuple(p.shape), []).append(p)
        pending = None  # the previous chunk, applied once its all_gather is done: this chunk's math overlaps it
        for same in by_shape.values():
            for i in range(0, len(same), world):
                chunk = same[i : i + world]
                looks = [self._look_ahead(p, mom) for p in chunk]
                # rank r orthogonalises the chunk's r-th matrix; ranks past the chunk's end send a dummy
                if rank < len(chunk):
                    mine = orthogonalize(looks[rank], group["ns_steps"], self.ns_dtype, self.ns_matmuls)
                else:
                    mine = torch.zeros_like(looks[0])
                updates = [torch.empty_like(mine) for _ in range(world)]
                work = dist.all_gather(updates, mine, group=pg, async_op=True)
                if pending:
                    apply_gathered(*pending)
                pending = (chunk, updates, work)
        if pending:
            apply_gathered(*pending)

    def _look_ahead(self, p, mom):
        """Muon's momentum step for p, and the Nesterov look-ahead it orthogonalises: the full matrix under FSDP2.
        Every rank keeps the (cheap, elementwise) momentum of every matrix it holds, full or shard."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        buf = state["momentum_buffer"]
        buf.lerp_(p.grad, 1 - mom)  # buf = mom * buf + (1 - mom) * g
        g = p.grad.lerp(buf, mom)  # Nesterov: look ahead along the momentum
        if self.sharded:  # FSDP2: gather the full matrix
            if g.device.type == "cpu" and p.device_mesh.device_type != "cpu":
                g = g.to(p.device_mesh.device_type)  # CPU offload: gather and orthogonalise on the GPU
            g = g.full_tensor()
        return g

    def _apply_muon(self, p, update, lr, wd):
        if self.sharded:  # keep this rank's shard of the full update (no communication)
            update = torch.distributed.tensor.distribute_tensor(
                update, p.device_mesh, p.placements, src_data_rank=None
            ).to(p.device)
        # orthogonal updates have unit singular values; scale so tall matrices get comparable per-element steps
        scale = max(1.0, p.size(-2) / p.size(-1)) ** 0.5
        if wd:
            p.mul_(1 - lr * wd)
        p.add_(update, alpha=-lr * scale)

    def _adamw(self, group, params):
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        for p in params:
            state = self.state[p]
            if "step" not in state:
                state["step"] = 0
                state.update((key, torch.zeros_like(p, dtype=torch.float32)) for key in self.FP32_STATE)
            state["step"] += 1
            t = state["step"]
            g = p.grad.float()
            state["exp_avg"].lerp_(g, 1 - b1)
            state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (state["exp_avg_sq"] / (1 - b2**t)).sqrt_().add_(eps)
            update = (state["exp_avg"] / (1 - b1**t)) / denom
            if wd:
                p.mul_(1 - lr * wd)
            p.add_(update.to(p.dtype), alpha=-lr)


def build_optimizer(
    model,
    matrix_lr=0.02,
    embedding_lr=0.2,
    unembedding_lr=0.004,
    weight_decay=0.0,
    adam_betas=(0.8, 0.95),
    muon_momentum=0.95,
    lr_scale=1.0,
):
    """Muon for the blocks' matrices, AdamW for embedding / lm_head / the rest. Every group has initial_lr, the LR
    its schedule multiplies. lr_scale multiplies every LR: fine-tuning stages take the pretraining LRs times a factor
    (SFT's --init-lr-frac, RL's --lr-scale)."""
    head = list(model.lm_head.parameters())
    # a tied embedding is also the unembedding: it takes the unembedding's (much smaller) LR, and only once
    embed = [p for p in model.transformer.wte.parameters() if p is not model.lm_head.weight]
    special = {id(p) for p in embed + head}
    matrices = [p for p in model.transformer.h.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if id(p) not in special and p.ndim != 2]
    # AdamW LRs were tuned at width 768: scale them like 1/sqrt(width) for other widths
    dmodel_scale = (model.config.n_embd / 768) ** -0.5
    groups = [
        dict(params=matrices, kind="muon", lr=matrix_lr, momentum=muon_momentum, ns_steps=5, weight_decay=weight_decay),
        dict(params=embed, kind="adamw", lr=embedding_lr * dmodel_scale, betas=adam_betas, eps=1e-10, weight_decay=0.0),
        dict(
            params=head, kind="adamw", lr=unembedding_lr * dmodel_scale, betas=adam_betas, eps=1e-10, weight_decay=0.0
        ),
    ]
    if others:
        groups.append(
            dict(
                params=others,
                kind="adamw",
                lr=unembedding_lr * dmodel_scale,
                betas=adam_betas,
                eps=1e-10,
                weight_decay=0.0,
            )
        )
    for g in groups:
        g["initial_lr"] = g["lr"] = g["lr"] * lr_scale
    return MuonAdamW([g for g in groups if g["params"]])
