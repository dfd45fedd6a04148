"""
The run report: every stage writes its own section (a small markdown file under <base>/report/), and
`generate()` stitches them into report.md. Sections are written atomically, so a crash never leaves a
half-written one, and a rerun of a stage replaces only its own section.
"""
import datetime
import os

from nanorl.common import get_base_dir


def report_dir():
    d = os.path.join(get_base_dir(), "report")
    os.makedirs(d, exist_ok=True)
    return d


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def log_section(name, items, rank=0):
    """items: a list of dicts (key -> value) and/or markdown strings. Only rank 0 writes."""
    if rank != 0:
        return None
    lines = [f"## {name}", f"timestamp: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S')}", ""]
    for item in items:
        if isinstance(item, dict):
            lines += [f"- {k}: {_fmt(v)}" for k, v in item.items()]
        else:
            lines.append(str(item))
        lines.append("")
    slug = name.lower().replace(" ", "-").replace("/", "-")
    path = os.path.join(report_dir(), f"{slug}.md")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(lines))
    os.replace(tmp, path)
    return path
