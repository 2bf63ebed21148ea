#!/usr/bin/env python3
"""Table and loss curves of an ablation run: report.py OUT VARIANT... (bf16 first)."""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    train, val = [], None
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if "loss" in r:
                train.append((r["step"], r["loss"], r["tokens"]))
            elif "val_loss" in r:
                val = r["val_loss"]
    return train, val


def smooth(xs, k=10):
    return [sum(xs[max(0, i - k + 1):i + 1]) / len(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


out, names = sys.argv[1], [n.strip() for n in sys.argv[2:]]
runs = {n: load(os.path.join(out, n, "metrics.jsonl")) for n in names}
base = runs[names[0]]
# final loss: mean of the last 10 steps (single steps are noisy at this batch size)
final = {n: sum(l for _, l, _ in r[0][-10:]) / len(r[0][-10:]) for n, r in runs.items()}
rows = ["| variant | final train loss (mean of last 10 steps) | vs bf16 | val loss | vs bf16 | tokens |",
        "|---|---|---|---|---|---|"]
for n, (train, val) in runs.items():
    rows.append(f"| {n} | {final[n]:.4f} | {final[n] - final[names[0]]:+.4f} | {val:.4f} | "
                f"{val - base[1]:+.4f} | {train[-1][2]:,} |")
table = "\n".join(rows)
with open(os.path.join(out, "table.md"), "w") as f:
    f.write(table + "\n")
print(table)
plt.figure(figsize=(8, 5))
for n, (train, _) in runs.items():
    plt.plot([s for s, _, _ in train], smooth([l for _, l, _ in train]), label=n, lw=1.2)
plt.xlabel("step")
plt.ylabel("training loss (10-step mean)")
plt.title("tiny MoE on the arithmetic corpus: precision recipes")
plt.ylim(bottom=1.3, top=2.6)
plt.legend()
plt.grid(alpha=0.3)
plt.tight_layout()
plt.savefig(os.path.join(out, "loss.png"), dpi=110)
print("wrote", os.path.join(out, "table.md"), "and", os.path.join(out, "loss.png"))
