"""
dev/gpu_check.sh's table: read the steps' logs (LOGDIR/index.tsv names them) and write one markdown table.

    python dev/gpu_table.py LOGDIR OUT.md gpu|cpu SECONDS

Benchmarks end with one JSON line (scripts/bench.py); the gpu tests print their figures as "gpu_check {json}" lines.
Exits 1 when any step failed, after writing the table with the failure in it.
"""

import json
import re
import sys
from pathlib import Path

import torch

HEADER = ["check", "figure", "unit", "MFU / % of bandwidth bound", "peak memory (GB)"]


def fmt(x, digits=3):
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)


def bench_row(kind, label, r, mode):
    """(figure, unit, MFU/MBU) of one benchmark's JSON line."""
    if kind == "train":
        util = "MFU " + f"{r['mfu']:.1%}" if r["mfu"] is not None else None
        return fmt(r["tok_per_s"]), "tok/s", util
    if kind == "decode":
        util = "MBU " + f"{r['mbu']:.1%}" if r["mbu"] is not None else None
        return fmt(r["decode_tok_per_s"]), "tok/s", util
    if kind == "hf":  # the --hf-model load; decode and the GRPO step are extra_rows
        return fmt(r["load_s"]), "s", None
    # rl: the whole step; its split is in the log
    return fmt(r["total_s"]), "s/step", f"rollout {r['rollout_s']:.2f} s + train {r['train_s']:.2f} s"


def extra_rows(kind, label, r):
    """Rows beyond a benchmark's first: the sampler gather of train --fsdp, and bench hf's decode and GRPO figures."""
    if kind == "train" and r.get("gather_ms") is not None:
        return [[f"{label}: sampler weight gather", fmt(r["gather_ms"]), "ms", "", ""]]
    if kind != "hf":
        return []
    rows = [
        [
            f"{label}: decode batch {d['batch']}",
            fmt(d["nanorl_tok_per_s"]),
            "tok/s",
            f"transformers {fmt(d['hf_tok_per_s'])} tok/s ({d['speedup']:.2f}x); same greedy tokens {d['same_token_frac']:.0%}",
            "",
        ]
        for d in r["decode"]
    ]
    rows.append(
        [
            f"{label}: GRPO step ({r['rl_prompts']}x{r['rl_samples']})",
            fmt(r["rl_total_s"]),
            "s/step",
            f"rollout {r['rl_rollout_s']:.2f} s + train {r['rl_train_s']:.2f} s",
            fmt(r["peak_mem_gb"]),
        ]
    )
    return rows


def pipeline_rows(label, r):
    """dev/pipeline_check.py's rows: the rehearsal, its two checks (when it ran), and the profiled decode step."""
    rows = []
    if "rehearsal_s" in r:
        stages = ", ".join(f"{k} {v}" for k, v in r["stages_s"].items())
        rows.append([f"{label}: rehearsal", fmt(r["rehearsal_s"]), "s", f"exit {r['rehearsal_rc']}; {stages}", ""])
        rows.append([f"{label}: engines decoding eagerly", str(len(r["eager_fallbacks"])), "", "", ""])
        answered = "no answer" if r["chat_web_answer"] is None else f"answered {r['chat_web_answer'][:40]!r}"
        rows.append([f"{label}: chat_web -i rl", answered, "", "", ""])
    d = r["decode_step"]
    rows.append(
        [
            f"{label}: decode step d{r['depth']} batch 1 (profiled)",
            fmt(d["host_ms"]),
            "ms a step (host)",
            f"device {d['device_ms']:.3f} ms, {d['kernels']:.0f} kernels, {d['syncs']:.1f} syncs",
            "",
        ]
    )
    return rows


def main(logdir, out, mode, seconds):
    logdir = Path(logdir)
    rows, failed = [], []
    for line in (logdir / "index.tsv").read_text().splitlines():
        name, kind, label, rc = line.split("\t")
        text = (logdir / name).read_text()
        if kind == "tests":
            # pytest's last line: "3 passed, 1 failed, 2 skipped, 1 error in 40.1s" (any of the parts)
            summary = [
                ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?)\b.* in [\d.]+s", ln)
            ]
            counts = {k: 0 for k in ("passed", "failed", "skipped")}
            for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", summary[-1] if summary else ""):
                counts["failed" if k.startswith("error") else k] += int(n)
            rows.append(
                [
                    label,
                    f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped",
                    "",
                    "",
                    "",
                ]
            )
            # pytest's progress marks (".", "s") share the line with a test's print under -s: no ^ anchor
            for fig in re.findall(r"gpu_check (\{.*\})$", text, re.M):
                f = json.loads(fig)
                rest = {k: v for k, v in f.items() if k not in ("check", "unit", "peak_mem_gb")}
                rows.append(
                    [
                        f["check"],
                        fmt(f["figure"]) if "figure" in f else ", ".join(f"{k} {v}" for k, v in rest.items()),
                        f.get("unit", ""),
                        "",
                        fmt(f["peak_mem_gb"]) if "peak_mem_gb" in f else "",
                    ]
                )
            if rc != "0" and not (rc == "5" and mode == "cpu"):  # 5: pytest collected nothing
                failed.append(label)
            continue
        last = text.strip().splitlines()[-1] if text.strip() else ""
        if rc != "0" or not last.startswith("{"):
            rows.append([label, f"FAILED (exit {rc}; see {name})", "", "", ""])
            failed.append(label)
            continue
        r = json.loads(last)
        if kind == "pipeline":
            rows += pipeline_rows(label, r)
            continue
        figure, unit, util = bench_row(kind, label, r, mode)
        if kind == "hf":  # the first row is the load: no utilisation figure, the load's own peak memory
            rows.append([f"{label}: --hf-model load", figure, unit, "", fmt(r["load_peak_mem_gb"])])
        else:
            util = "n/a (CPU)" if mode == "cpu" else (util or "n/a (no peak figure for this GPU)")
            rows.append([label, figure, unit, util, fmt(r["peak_mem_gb"])])
        rows += extra_rows(kind, label, r)
    device = torch.cuda.get_device_name() if mode == "gpu" else "CPU mode (no CUDA GPU): tiny sizes"
    lines = [f"# dev/gpu_check.sh: {device}, torch {torch.__version__}, {seconds} s", ""]
    if mode == "cpu":
        lines += ["CPU mode: these figures show the command works end to end, not how fast anything is.", ""]
    lines += ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    if failed:
        lines += ["", "Failed: " + ", ".join(failed) + f" (logs in {logdir})"]
    tmp = Path(str(out) + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(out)  # written whole or not at all
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[3] not in ("gpu", "cpu"):
        sys.exit("usage: python dev/gpu_table.py LOGDIR OUT.md gpu|cpu SECONDS")
    sys.exit(main(*sys.argv[1:]))
