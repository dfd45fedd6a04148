"""
Measurement helpers for scripts/bench.py and scripts/bench_hf.py: wall-clock timing that waits for the device,
peak memory, the bytes a decode step reads and the memory bandwidth they are measured against, chat_rl's GRPO step as a timed function, and a load tester for a
running chat_web server.
"""

import resource
import threading
import time

import torch

from nanorl.logger import synchronize

# peak dense bf16 FLOP/s (no sparsity) for MFU and memory bandwidth in bytes/s for MBU (decode is bound by it, not by
# FLOPs), by a substring of the GPU's name; the first match wins, so more specific names come first ("gh200" before
# "h200", "h100 nvl" before "h100")
PEAKS = [  # (substring, flops, bytes/s)
    ("gh200", 989e12, 4.0e12),
    ("h200", 989e12, 4.8e12),
    ("h100 nvl", 835e12, 3.9e12),
    ("h100 pcie", 756e12, 2.0e12),
    ("h100", 989e12, 3.35e12),
    ("h800", 989e12, 3.35e12),
    ("b200", 2250e12, 8.0e12),
    ("a100", 312e12, 2.0e12),
    ("a10g", 125e12, 0.6e12),
    ("l40s", 362e12, 0.864e12),
    ("l4", 121e12, 0.3e12),
    ("4090", 165e12, 1.008e12),
    ("3090", 71e12, 0.936e12),
    ("v100", 125e12, 0.9e12),
    ("t4", 65e12, 0.32e12),
]


def get_peak_flops(device_name):
    """Peak dense bf16 FLOP/s for MFU, by GPU name. Unknown devices give None: MFU is then not printed."""
    return next((flops for key, flops, _ in PEAKS if key in device_name.lower()), None)


def get_peak_bandwidth(device_name):
    """Peak memory bandwidth in bytes/s for MBU, by GPU name; unknown -> None."""
    return next((bw for key, _, bw in PEAKS if key in device_name.lower()), None)


def peak_memory_gb(device_type):
    if device_type == "cuda":
        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # peak RSS of the whole process (Linux: KiB)


def reset_peak_memory(device_type):
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def device_name(device_type):
    return torch.cuda.get_device_name() if device_type == "cuda" else device_type


def timed(device_type, fn, *args):
    """(seconds, fn(*args)): the device synchronized before and after, so queued kernels are counted."""
    synchronize(device_type)
    t0 = time.perf_counter()
    out = fn(*args)
    synchronize(device_type)
    return time.perf_counter() - t0, out


def median_ms(device_type, fn, runs=5):
    """The median milliseconds of `runs` timed calls of fn()."""
    return sorted(timed(device_type, fn)[0] for _ in range(runs))[runs // 2] * 1e3


def byte_tokenizer():
    """A byte-level tokenizer: it needs no training, and the engine only needs its special tokens."""
    from nanorl.tokenizer import SPLIT_PATTERN, Tokenizer

    return Tokenizer.from_ranks({bytes([i]): i for i in range(256)}, SPLIT_PATTERN)


def decode_step_bytes(engine, rows, prompt_len, new_tokens):
    """(weight bytes, KV bytes per token, KV bytes per step) a decode step has to read: every matmul weight once
    (the embedding is a B-row lookup), and each row's whole KV so far; rows hold P+1 .. P+N-1 tokens over the
    decode steps, P + N/2 on average."""
    weight_bytes = sum(p.numel() * p.element_size() for n, p in engine.model.named_parameters() if "wte" not in n)
    kv_per_token = (engine.cache.k.nbytes + engine.cache.v.nbytes) // (engine.batch_size * engine.max_len)
    return weight_bytes, kv_per_token, rows * (prompt_len + new_tokens / 2) * kv_per_token


def copy_bandwidth(nbytes=256 * 2**20, runs=5):
    """The CPU's memory bandwidth as this process sees it, in bytes/s: the fastest of `runs` copies of an nbytes
    buffer (far larger than the caches) on torch's current threads, counting what is read and what is written
    (STREAM's "copy"). A CPU has no peak on a data sheet that one process reaches, so MBU is measured against this."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults are not bandwidth
    best = min(timed("cpu", dst.copy_, src)[0] for _ in range(runs))
    return 2 * nbytes / best


def bandwidth(device_type, name):
    """(bytes/s, where it comes from) to measure MBU against: the GPU's peak from its data sheet, the CPU's measured
    copy bandwidth, or (None, why) where neither is known."""
    if device_type == "cuda":
        bw = get_peak_bandwidth(name)
        return (bw, "peak (data sheet)") if bw else (None, f"no peak bandwidth known for {name}")
    if device_type == "cpu":
        return copy_bandwidth(), f"measured copy, {torch.get_num_threads()} thread(s)"
    return None, f"no bandwidth known for {device_type}"


def grpo_stepper(model, optimizer, engine, prompts, n, N, max_tokens_per_gpu, device):
    """chat_rl's GRPO step as a function of the step number: rollout (n samples of each prompt, every response forced
    to N tokens), a reward, nanorl.rl_trainer.Trainer's training step with chat_rl's defaults for every training flag,
    and the engine's weights refreshed. Each call returns (rollout seconds, train seconds, generated tokens, trained
    tokens, mean reward, grad norm)."""
    from nanorl.engine import Request
    from nanorl.logger import Timer
    from nanorl.rl_config import GroupSpec, TrainerConfig
    from nanorl.rl_trainer import Trainer
    from nanorl.rollout import Sample

    device_type = device.type
    group = GroupSpec(n_samples_per_prompt=n, temperature=1.0, max_response_len=N)
    cfg = TrainerConfig(group=group, max_tokens_per_gpu=max_tokens_per_gpu)
    trainer = Trainer(cfg, model, optimizer, device)

    def rollout(step):
        # stop_tokens=[]: a random model rarely ends a response, so every response runs to the budget
        reqs = [
            Request(
                p,
                num_samples=n,
                max_tokens=N,
                temperature=group.temperature,
                seed=step * len(prompts) + i,
                stop_tokens=[],
                use_tools=False,
            )
            for i, p in enumerate(prompts)
        ]
        samples = [
            Sample(
                tokens=list(p) + list(c.tokens),
                response_length=len(c.tokens),
                loss_mask=list(c.mask),
                rollout_log_probs=list(c.logprobs),
                status=c.status,
                group_index=gi,
                index=si,
                weight_version=step,
            )
            for gi, (p, comps) in enumerate(zip(prompts, engine.submit_and_wait(reqs)))
            for si, c in enumerate(comps)
        ]
        # a cheap deterministic reward from the sampled tokens (parity of their sum): about half right, so
        # every group has a non-zero advantage, as in a useful rollout
        for s in samples:
            s.reward = float(sum(s.tokens[s.prompt_length :]) % 2)
        return samples

    def train(step, samples):
        m = trainer.train_step(step, samples, Timer())
        engine.load_weights(model)  # as chat_rl: the engine samples from its own copy of the weights
        return m

    def rl_step(step):
        model.eval()
        t_roll, samples = timed(device_type, rollout, step)
        t_train, m = timed(device_type, train, step, samples)
        gen_tok = sum(s.response_length for s in samples)
        reward = sum(s.reward for s in samples) / len(samples)
        return t_roll, t_train, gen_tok, sum(len(s.tokens) for s in samples), reward, m["train/grad_norm"]

    return rl_step


def load_test(url, clients, max_tokens, prompt="Tell me a story about a robot."):
    """Hit a running chat_web server with `clients` concurrent streaming requests (one each) and measure aggregate
    tokens/s (from /stats: the tokens the engine generated, not text chunks) and time to first token p50/p95."""
    import httpx  # a dev dependency: only this benchmark needs it

    ttft, errors = [], []
    before = httpx.get(url + "/stats").json()["tokens_generated"]
    barrier = threading.Barrier(clients)
    # one shared client, made up front: a new httpx client per request builds an SSL context (~tens of ms of
    # CPU each), which would be counted as time to first token
    http = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=clients, max_keepalive_connections=clients))

    def client(i):
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True, "seed": i}
        barrier.wait()  # all start together, as a burst of users would
        t0 = time.perf_counter()
        try:
            with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
                first = None
                for line in r.iter_lines():
                    text = line.startswith("data: {") and '"content": "' in line and '"content": ""' not in line
                    if first is None and text:
                        first = time.perf_counter() - t0
                ttft.append(first if first is not None else time.perf_counter() - t0)
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    http.close()
    tokens = httpx.get(url + "/stats").json()["tokens_generated"] - before
    ttft.sort()
    pct = lambda q: ttft[min(len(ttft) - 1, int(q * len(ttft)))] if ttft else float("nan")
    return dict(tokens=tokens, wall=wall, ttft_p50=pct(0.5), ttft_p95=pct(0.95), errors=errors)
