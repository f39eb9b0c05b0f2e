#!/usr/bin/env python3
"""make_table.py: the replication grid's results (tools/replicate/run_grid.sh) as a Markdown
table beside the MHAR paper's Table 1, plus SVG plots (validation loss curves per size, routing
depth maps from probe.json). It owns the reduction from run folders to figures: which number is
"final validation loss", how seeds are combined, what counts as an ordering reproduced.

  python3 tools/replicate/make_table.py [--out DIR] PATH [PATH ...]

PATH: a folder holding run folders (runs/replicate), a run folder, or a replicate_runs.tar.gz
that run_grid.sh packed. A run folder is named SIZE_MODE_sSEED and holds metrics.jsonl, and when
finished eval_val.json, eval_<task>.json and (routed modes) probe/probe.json. Writes
DIR/table.md and DIR/*.svg (default DIR: replicate_report) and prints the table.

Numbers are the runs' own: final validation loss is `mhar eval` over the whole validation split
of the final checkpoint (eval_val.json); an unfinished run is listed with its step and no loss.
Seeds: mean and half the range (max - min) / 2 over the finished seeds, with n.
Standard library only (the GPU machine and CI may lack matplotlib): the SVG is written by hand.
"""
import argparse
import json
import os
import re
import statistics
import sys
import tarfile
import tempfile

MODES = ["standard", "hyper", "attnres", "mhar", "block_mhar"]
MODE_LABEL = {"standard": "standard", "hyper": "Hyper-Conn. (n=4)", "attnres": "AttnRes",
              "mhar": "MHAR (H=KV)", "block_mhar": "block MHAR (8 blocks)"}
SIZES = ["small", "large"]
# The MHAR paper's Table 1, final validation loss (issue 15): 20k steps of 0.5M tokens,
# FineWeb-Edu, Qwen3 tokenizer. Block MHAR is not in that table.
PAPER = {"100M": {"standard": 3.031, "hyper": 2.999, "attnres": 2.970, "mhar": 2.969},
         "350M": {"standard": 2.997, "hyper": 2.931, "attnres": 2.876, "mhar": 2.848},
         "1B": {"standard": 2.894, "hyper": 2.807, "attnres": 2.759, "mhar": 2.754}}
RUN_RE = re.compile(r"^(small|large)_(standard|hyper|attnres|mhar|block_mhar)_s(\d+)$")
COLORS = {"standard": "#444444", "hyper": "#1f77b4", "attnres": "#2ca02c", "mhar": "#d62728",
          "block_mhar": "#9467bd"}


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read_jsonl(path):
    rows = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    try:
                        rows.append(json.loads(line))
                    except ValueError:
                        pass  # a line cut by a killed writer: the rest still counts
    except OSError:
        pass
    return rows


def load_run(path, size, mode, seed):
    metrics = read_jsonl(os.path.join(path, "metrics.jsonl"))
    curve = {}
    for r in metrics:
        if r.get("kind") == "eval" and "val_loss" in r:
            curve[int(r["step"])] = float(r["val_loss"])  # the final eval is logged twice
    train = [r for r in metrics if r.get("kind") == "train" and "tokens_per_s" in r]
    # Throughput: the median over logged steps after the first two, which carry start-up.
    tps = [float(r["tokens_per_s"]) for r in train[2:]] or [float(r["tokens_per_s"]) for r in train]
    cfg = read_json(os.path.join(path, "config.json")) or {}
    steps = cfg.get("train", {}).get("steps")
    run = {"size": size, "mode": mode, "seed": seed, "path": path,
           "done": os.path.exists(os.path.join(path, "DONE")),
           "step": max([int(r["step"]) for r in train] or [0]), "steps": steps,
           "curve": sorted(curve.items()), "tokens_per_s": statistics.median(tps) if tps else None,
           "lr": cfg.get("train", {}).get("lr"), "val": read_json(os.path.join(path, "eval_val.json")),
           "tasks": {}, "probe": read_json(os.path.join(path, "probe", "probe.json")),
           "seconds": sum(r.get("seconds", 0) for r in read_jsonl(os.path.join(path, "timing.jsonl"))
                          if r.get("phase") == "train")}
    for task in ("lambada", "hellaswag", "wikitext"):
        t = read_json(os.path.join(path, f"eval_{task}.json"))
        if t:
            run["tasks"][task] = t
    return run


def find_runs(paths, tmp):
    """Every run folder under the given paths; a later path's copy of a run wins only if it
    got further (an archive from a later device call holds the same run, advanced)."""
    runs = {}
    sweeps = {}
    for p in paths:
        if os.path.isfile(p) and (p.endswith(".tar.gz") or p.endswith(".tgz")):
            dest = tempfile.mkdtemp(dir=tmp)
            with tarfile.open(p) as tf:
                for m in tf.getmembers():  # only plain files and folders, inside dest
                    if not (m.isfile() or m.isdir()) or m.name.startswith("/") or ".." in m.name.split("/"):
                        raise SystemExit(f"make_table: {p}: refusing archive member {m.name!r}")
                tf.extractall(dest)
            p = dest
        if not os.path.isdir(p):
            raise SystemExit(f"make_table: {p}: not a folder or a .tar.gz archive")
        for root, dirs, files in os.walk(p):
            dirs[:] = [d for d in dirs if d != "checkpoints"]
            for f in files:
                m = re.match(r"^sweep_(small|large)\.txt$", f)
                if m:
                    sweeps[m.group(1)] = open(os.path.join(root, f)).read().split("\n")
            m = RUN_RE.match(os.path.basename(root))
            if m and "metrics.jsonl" in files and os.path.basename(os.path.dirname(root)) != "sweep":
                r = load_run(root, m.group(1), m.group(2), int(m.group(3)))
                key = (r["size"], r["mode"], r["seed"])
                old = runs.get(key)
                if old is None or (r["done"], r["step"]) >= (old["done"], old["step"]):
                    runs[key] = r
    return runs, sweeps


def mean_spread(values):
    """(mean, half range, n) of the values that exist; (None, None, 0) when none do."""
    v = [x for x in values if x is not None]
    if not v:
        return None, None, 0
    return statistics.fmean(v), (max(v) - min(v)) / 2, len(v)


def fmt(mean, half, n, digits=3):
    if mean is None:
        return "-"
    if n > 1:
        return f"{mean:.{digits}f} ± {half:.{digits}f} (n={n})"
    return f"{mean:.{digits}f}"


def summarize(runs):
    """Per (size, mode): the seed-combined figures the table shows."""
    out = {}
    for size in SIZES:
        for mode in MODES:
            rs = [r for (s, m, _), r in sorted(runs.items()) if s == size and m == mode]
            if not rs:
                continue
            done = [r for r in rs if r["done"] and r["val"]]
            task = lambda t, k: [r["tasks"].get(t, {}).get(k) for r in done]
            out[(size, mode)] = {
                "runs": rs, "done": done,
                "val_loss": mean_spread([r["val"]["loss"] for r in done]),
                "val_ppl": mean_spread([r["val"]["ppl"] for r in done]),
                "lambada_acc": mean_spread(task("lambada", "acc")),
                "lambada_ppl": mean_spread(task("lambada", "perplexity")),
                "hellaswag_acc_norm": mean_spread(task("hellaswag", "acc_norm")),
                "wikitext_word_ppl": mean_spread(task("wikitext", "word_perplexity")),
                "tokens_per_s": mean_spread([r["tokens_per_s"] for r in done]),
                "train_s": mean_spread([r["seconds"] for r in done]),
            }
    return out


def orderings(summary):
    """For each size: each routed mode against standard and each adjacent pair of the paper's
    order, whether ours has the same sign, and whether the gap exceeds the seeds' spread."""
    lines = []
    pairs = [("hyper", "standard"), ("attnres", "standard"), ("mhar", "standard"),
             ("block_mhar", "standard"), ("attnres", "hyper"), ("mhar", "attnres")]
    for size in SIZES:
        for better, worse in pairs:
            a, b = summary.get((size, better)), summary.get((size, worse))
            if not a or not b or a["val_loss"][0] is None or b["val_loss"][0] is None:
                continue
            (ma, ha, na), (mb, hb, nb) = a["val_loss"], b["val_loss"]
            gap = mb - ma
            verdict = "as in the paper" if gap > 0 else "NOT as in the paper"
            if na > 1 and nb > 1:
                noise = ha + hb
                verdict += (f"; the gap exceeds the seeds' half ranges summed ({noise:.3f})" if abs(gap) > noise
                            else f"; within the seeds' half ranges summed ({noise:.3f}): not resolved")
            else:
                verdict += "; one seed: no spread to compare the gap with"
            lines.append(f"- {size}: {MODE_LABEL[better]} {ma:.3f} vs {MODE_LABEL[worse]} {mb:.3f} "
                         f"(gap {gap:+.3f}): {verdict}")
    return lines


def table(summary, sweeps):
    md = ["## Our runs (final validation loss of the final checkpoint, whole validation split)", "",
          "Mean ± half the range over seeds (n = finished seeds). Perplexities: `mhar eval --task` on "
          "the held-out documents (`mhar data make-eval`). tokens/s: median logged training throughput.",
          "",
          "| size | mode | val loss | val ppl | LAMBADA acc | LAMBADA ppl | HellaSwag acc_norm | "
          "WikiText word ppl | tokens/s | train s | runs |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for size in SIZES:
        for mode in MODES:
            s = summary.get((size, mode))
            if not s:
                md.append(f"| {size} | {MODE_LABEL[mode]} | not run | | | | | | | | 0 |")
                continue
            status = ", ".join(f"s{r['seed']}" + ("" if r["done"] else f" (step {r['step']}/{r['steps']}, unfinished)")
                               for r in s["runs"])
            md.append("| " + " | ".join([
                size, MODE_LABEL[mode], fmt(*s["val_loss"]), fmt(*s["val_ppl"], digits=2),
                fmt(*s["lambada_acc"]), fmt(*s["lambada_ppl"], digits=1), fmt(*s["hellaswag_acc_norm"]),
                fmt(*s["wikitext_word_ppl"], digits=1), fmt(*s["tokens_per_s"], digits=0),
                fmt(*s["train_s"], digits=0), status]) + " |")
    md += ["", "## The paper's Table 1 (final validation loss)", "",
           "| size | standard | Hyper-Conn. | AttnRes | MHAR |", "|---|---|---|---|---|"]
    for size, row in PAPER.items():
        md.append(f"| {size} | " + " | ".join(f"{row[m]:.3f}" for m in ["standard", "hyper", "attnres", "mhar"]) + " |")
    md += ["", "## Orderings", ""]
    md += orderings(summary) or ["- no pair of finished runs yet"]
    if sweeps:
        md += ["", "## Learning-rate sweeps (standard, a quarter of the steps; final validation loss)", ""]
        for size, lines in sorted(sweeps.items()):
            md.append(f"- {size}: " + ", ".join(f"lr {l.split()[0]}: {l.split()[1]}" for l in lines if l.strip()))
    return "\n".join(md) + "\n"


def svg_curves(summary, size):
    """Validation loss against step, one line per run (seed 1+ dashed)."""
    runs = [r for (s, _), v in summary.items() if s == size for r in v["runs"] if r["curve"]]
    if not runs:
        return None
    W, H, L, R, T, B = 640, 400, 60, 170, 30, 40
    xs = [st for r in runs for st, _ in r["curve"]]
    # Skip step 0 (ln V for every mode) so that the end of training, where modes differ, is readable.
    ys = [v for r in runs for st, v in r["curve"] if st > 0] or [v for r in runs for _, v in r["curve"]]
    x0, x1 = min(xs), max(xs) or 1
    y0, y1 = min(ys), max(ys)
    if y1 - y0 < 1e-9:
        y1 = y0 + 1
    sx = lambda x: L + (x - x0) / max(x1 - x0, 1) * (W - L - R)
    sy = lambda y: T + (y1 - min(max(y, y0), y1)) / (y1 - y0) * (H - T - B)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
           f'<text x="{L}" y="18" font-size="13">{size}: validation loss vs step</text>',
           f'<rect x="{L}" y="{T}" width="{W - L - R}" height="{H - T - B}" fill="none" stroke="#999"/>']
    for i in range(5):
        y = y0 + (y1 - y0) * i / 4
        out.append(f'<text x="{L - 5}" y="{sy(y) + 4:.1f}" text-anchor="end">{y:.3f}</text>')
        x = x0 + (x1 - x0) * i / 4
        out.append(f'<text x="{sx(x):.1f}" y="{H - B + 15}" text-anchor="middle">{x:.0f}</text>')
    for k, r in enumerate(sorted(runs, key=lambda r: (MODES.index(r["mode"]), r["seed"]))):
        pts = " ".join(f"{sx(st):.1f},{sy(v):.1f}" for st, v in r["curve"] if st > 0 or len(r["curve"]) == 1)
        dash = ' stroke-dasharray="5,3"' if r["seed"] else ""
        out.append(f'<polyline class="curve" data-run="{size}_{r["mode"]}_s{r["seed"]}" fill="none" '
                   f'stroke="{COLORS[r["mode"]]}" stroke-width="1.5"{dash} points="{pts}"/>')
        out.append(f'<text x="{W - R + 8}" y="{T + 14 * k + 10}" fill="{COLORS[r["mode"]]}">'
                   f'{MODE_LABEL[r["mode"]]} s{r["seed"]}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def svg_depth_map(run):
    """probe.json's mean routing weights: one panel per head, a row per site, a column per
    source (embedding first); white 0 to dark red 1."""
    p = run["probe"]
    sites = p["sites"]
    heads = len(sites[0]["mean_weights"])
    n_src = max(s["sources"] for s in sites)
    c = 10
    pw, ph = n_src * c, len(sites) * c
    W, H = 60 + heads * (pw + 20), ph + 60
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
           f'<text x="5" y="15" font-size="13">{run["size"]} {MODE_LABEL[run["mode"]]} s{run["seed"]}: '
           f'mean routing weight (row: site, column: source)</text>']
    for h in range(heads):
        ox = 50 + h * (pw + 20)
        out.append(f'<text x="{ox}" y="{H - 8}">head {h}</text>')
        for i, s in enumerate(sites):
            for j, w in enumerate(s["mean_weights"][h]):
                g = int(round(255 * (1 - min(max(w, 0.0), 1.0))))
                out.append(f'<rect class="cell" x="{ox + j * c}" y="{25 + i * c}" width="{c}" height="{c}" '
                           f'fill="rgb(255,{g},{g})"><title>{s["name"]} source {j}: {w:.3f}</title></rect>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--out", default="replicate_report")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        runs, sweeps = find_runs(a.paths, tmp)
        if not runs:
            print(f"make_table: no run folders (SIZE_MODE_sSEED with metrics.jsonl) under {a.paths}", file=sys.stderr)
            return 1
        summary = summarize(runs)
        md = table(summary, sweeps)
        plots = []
        for size in SIZES:
            svg = svg_curves(summary, size)
            if svg:
                plots.append(f"val_loss_{size}.svg")
                open(os.path.join(a.out, plots[-1]), "w").write(svg)
        for r in sorted(runs.values(), key=lambda r: (r["size"], MODES.index(r["mode"]), r["seed"])):
            if r["probe"] and r["probe"].get("sites"):
                plots.append(f"depth_{r['size']}_{r['mode']}_s{r['seed']}.svg")
                open(os.path.join(a.out, plots[-1]), "w").write(svg_depth_map(r))
    if plots:
        md += "\n## Plots\n\n" + "\n".join(f"![{p}]({p})" for p in plots) + "\n"
    open(os.path.join(a.out, "table.md"), "w").write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
