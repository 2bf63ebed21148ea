#!/usr/bin/env python3
"""Training loss, validation loss and learning rate of one or several `lowbit train` runs.

    python3 examples/plot_runs.py RUN_DIR... [-o OUT.png] [--title TITLE] [--smooth K]

Reads each RUN_DIR/metrics.jsonl (its rows' loss and lr per step, val_loss at each
validation) and writes one PNG (default plot.png): the losses on the left,
the learning rate on the right, one colour per run, labelled by the run's directory name.
The axes fit the data; nothing about the runs is assumed. Needs matplotlib
(apt-get install python3-matplotlib).
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(run):
    path = os.path.join(run, "metrics.jsonl")
    train, val, lr = [], [], []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if "loss" in r:
                train.append((r["step"], r["loss"]))
                lr.append((r["step"], r["lr"]))
            elif "val_loss" in r:
                val.append((r["step"], r["val_loss"]))
    if not train:
        sys.exit(f"{path}: no training rows (is it a lowbit train run?)")
    return train, val, lr


def smooth(ys, k):
    return [sum(ys[max(0, i - k + 1):i + 1]) / len(ys[max(0, i - k + 1):i + 1]) for i in range(len(ys))]


p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("runs", nargs="+", help="run directories (run.out_dir)")
p.add_argument("-o", "--out", default="plot.png")
p.add_argument("--title", default=None)
p.add_argument("--smooth", type=int, default=1, help="running mean of the training loss over K steps")
a = p.parse_args()

fig, (ax, axr) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 1.4]})
for i, run in enumerate(a.runs):
    train, val, lr = load(run)
    name = os.path.basename(os.path.normpath(run))
    color = f"C{i % 10}"
    steps = [s for s, _ in train]
    ax.plot(steps, smooth([l for _, l in train], a.smooth), color=color, lw=1.2,
            label=f"{name} train (last {train[-1][1]:.3f})")
    if val:
        ax.plot([s for s, _ in val], [v for _, v in val], "o--", color=color, ms=4, lw=1,
                label=f"{name} val (last {val[-1][1]:.3f})")
    axr.plot([s for s, _ in lr], [v for _, v in lr], color=color, lw=1.2, label=name)
    print(f"{name}: {len(train)} steps, train loss {train[0][1]:.4f} -> {train[-1][1]:.4f}"
          + (f", val loss {val[-1][1]:.4f}" if val else ""))
ax.set_xlabel("step")
ax.set_ylabel("loss (nats/token)")
ax.grid(alpha=0.3)
ax.legend(fontsize=8)
axr.set_xlabel("step")
axr.set_ylabel("learning rate")
axr.grid(alpha=0.3)
axr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
fig.suptitle(a.title or ", ".join(os.path.basename(os.path.normpath(r)) for r in a.runs))
fig.tight_layout()
fig.savefig(a.out, dpi=110)
print(f"wrote {a.out}")
