"""
dev/gpu_check.sh's `pipeline` step: the rehearsal of the GPU pipeline on the visible GPUs, three checks of what it
left, and one profiled decode step.

    python dev/pipeline_check.py WORKDIR                    # a GPU machine: all of it (one rank per GPU)
    python dev/pipeline_check.py WORKDIR --depth 2 --cpu    # gpu_check's CPU mode: the profiled step alone

1. `NANORL_REHEARSAL=1 bash speedrun.sh` with NANORL_BASE_DIR=WORKDIR: every stage of the GPU branch, compiled, with
   CUDA graphs, at tiny sizes, its data from the mirror it serves (docs/testing.md).
2. No engine fell back to eager decoding: every stage log's `engine attention:` line names CUDA graphs, and none has
   the engine's warning that a graph did not reproduce the eager step.
3. `chat_web -i rl` answers one POST /v1/chat/completions with the rehearsal's RL model.
4. One decode step at batch 1 of a random d<depth> (the engine chat_rl samples with; a 512-token prompt) under
   torch.profiler: host time and device time a step, and the kernels and host-device syncs it launches.
Each check prints a line; the last line is one JSON object (dev/gpu_table.py turns it into rows).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FALLBACK = "does not reproduce the eager step"  # the engine's warning when it drops its CUDA graphs (nanorl/engine.py)
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpyAsync")


def rehearse(workdir):
    """Run the rehearsal into workdir -> (exit status, seconds, {stage: seconds} from its done/ markers)."""
    env = {**os.environ, "NANORL_REHEARSAL": "1", "NANORL_BASE_DIR": str(workdir)}
    env.update(NANORL_SKIP_INSTALL="1", NANORL_REPORT=str(Path(workdir) / "report.md"))
    t0 = time.time()
    with open(Path(workdir) / "speedrun.log", "w") as log:
        rc = subprocess.run(["bash", "speedrun.sh"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    done = Path(workdir) / "rehearsal" / "done"
    stages = {p.name: int(p.read_text()) for p in sorted(done.iterdir())} if done.is_dir() else {}
    return rc, round(time.time() - t0), stages


def eager_fallbacks(logs, cuda=True):
    """[(log name, line)] of every engine that decodes eagerly: it warned that a graph did not reproduce the eager
    step, or (on CUDA) its `engine attention:` line names no CUDA graphs. [] when none did."""
    bad = []
    for path in sorted(Path(logs).glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            fallback = FALLBACK in line or (cuda and line.startswith("engine attention:") and "CUDA graphs" not in line)
            if fallback:
                bad.append((path.name, line.strip()))
    return bad


def chat_web_answer(base_dir, timeout=300):
    """The RL model's answer to one request through chat_web's OpenAI API (the server is started and stopped here)."""
    env = {**os.environ, "NANORL_BASE_DIR": str(base_dir)}
    cmd = [sys.executable, "-m", "scripts.chat_web", "-i", "rl", "--port", "0"]
    server = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, url = time.time() + timeout, None
        while url is None and time.time() < deadline:
            line = server.stdout.readline()
            if not line:
                raise RuntimeError(f"chat_web exited with {server.wait()} before serving")
            m = re.search(r" at (http://\S+) \(OpenAI API", line)
            url = m and m[1]
        body = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 16, "temperature": 0}
        request = urllib.request.Request(
            f"{url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        while True:  # the address is printed as the server binds: on a busy machine it may not accept yet
            try:
                with urllib.request.urlopen(request, timeout=timeout) as response:
                    return json.load(response)["choices"][0]["message"]["content"]
            except urllib.error.URLError as e:
                if not isinstance(e.reason, ConnectionRefusedError) or time.time() > deadline:
                    raise
                time.sleep(0.5)
    finally:
        server.kill()
        server.wait()


def step_profile(events, steps):
    """Per step, from a profile of `steps` decode steps: (device ms, kernels, syncs). events: (name, on the device,
    device microseconds) of each event; a sync is a host call that waits for the device (SYNCS)."""
    kernels = [us for _, on_device, us in events if on_device]
    syncs = sum(1 for name, on_device, _ in events if not on_device and name in SYNCS)
    return sum(kernels) / 1e3 / steps, len(kernels) / steps, syncs / steps


def profile_decode(depth, steps=20, prompt_len=512):
    """One decode step at batch 1 of a random d<depth>, as bench decode builds it -> {host_ms, device_ms, kernels,
    syncs} a step (the mean of `steps` profiled steps, after warm-up ones)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from nanorl.benchmark import byte_tokenizer
    from nanorl.common import autodetect_device_type
    from nanorl.engine import Engine, Request
    from nanorl.gpt import build_model, config_from_depth

    device = torch.device(autodetect_device_type())
    cfg = config_from_depth(depth, 32768, sequence_len=prompt_len + 4 * steps, n_kv_head=2 if depth >= 8 else None)
    torch.manual_seed(0)
    engine = Engine(build_model(cfg, device).eval(), byte_tokenizer(), batch_size=1, max_len=prompt_len + 4 * steps)
    prompt = torch.randint(0, 256, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    engine.submit(Request(prompt, max_tokens=3 * steps, temperature=1.0, seed=0, stop_tokens=[], use_tools=False))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(steps):  # the prefill, then warm-up steps
        engine.step()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        host_ms = (time.perf_counter() - t0) * 1e3 / steps
    events = [(e.name, e.device_type.name == "CUDA", e.device_time) for e in prof.events()]
    device_ms, kernels, syncs = step_profile(events, steps)
    return {"host_ms": host_ms, "device_ms": device_ms, "kernels": kernels, "syncs": syncs}


def main(argv=None):
    parser = argparse.ArgumentParser(description="The rehearsal on the GPUs, its checks, a profiled decode step")
    parser.add_argument("workdir", help="where the rehearsal's files go (its NANORL_BASE_DIR)")
    parser.add_argument("--depth", type=int, default=20, help="the profiled model's depth (the speedrun's: 20)")
    parser.add_argument("--cpu", action="store_true", help="the profiled step alone (gpu_check's CPU mode)")
    args = parser.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    result, failed = {}, []
    if not args.cpu:
        rc, seconds, stages = rehearse(args.workdir)
        result.update(rehearsal_rc=rc, rehearsal_s=seconds, stages_s=stages)
        print(f"rehearsal: exit {rc} in {seconds} s; stages (s): {stages}")
        failed += ["rehearsal"] if rc else []
        run = Path(args.workdir) / "rehearsal"
        bad = eager_fallbacks(run / "logs")
        result["eager_fallbacks"] = [f"{name}: {line}" for name, line in bad]
        print(f"engines decoding eagerly: {len(bad)}" + "".join(f"\n  {name}: {line}" for name, line in bad))
        failed += ["eager fallback"] if bad else []
        try:
            answer = chat_web_answer(run)
        except Exception as e:  # noqa: BLE001 - the table says which check failed and why
            answer, failed = None, failed + [f"chat_web: {type(e).__name__}: {e}"]
        result["chat_web_answer"] = answer
        print(f"chat_web -i rl answered: {answer!r}")
    result["decode_step"] = profile_decode(args.depth)
    result["depth"], result["failed"] = args.depth, failed
    p = result["decode_step"]
    print(
        f"decode step d{args.depth} batch 1: {p['host_ms']:.2f} ms host, {p['device_ms']:.3f} ms on the device, "
        f"{p['kernels']:.0f} kernels, {p['syncs']:.1f} syncs"
    )
    print(json.dumps(result))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
