#!/usr/bin/env python3
"""Reward and held-out pass@1 over the steps of a `lowbit rl` run.

    python3 examples/rl_report.py runs/rl-arith [OUT.png [TITLE]]

Reads RUN/metrics.jsonl (doc/rl.md lists its keys), prints a summary and writes a PNG
(default RUN/rl.png): training reward (mean over each step's completions, and its 5-step
mean) on the left axis; the share of correct rollouts and the held-out pass@1, pass@k and greedy
accuracy at each evaluation on the right.
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    steps, evals = [], []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if "reward_mean" in r:
                steps.append(r)
            elif "eval_pass_at_1" in r:
                evals.append(r)
    return steps, evals


def smooth(xs, k=5):
    return [sum(xs[max(0, i - k + 1):i + 1]) / len(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


run = sys.argv[1]
out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(run, "rl.png")
steps, evals = load(os.path.join(run, "metrics.jsonl"))
if not steps or not evals:
    sys.exit(f"{run}/metrics.jsonl: no RL steps or no evaluations")
k = evals[0]["eval_k"]
first, last = evals[0], evals[-1]
print(f"held-out pass@1 {first['eval_pass_at_1']:.4f} -> {last['eval_pass_at_1']:.4f}, "
      f"pass@{k} {first['eval_pass_at_k']:.4f} -> {last['eval_pass_at_k']:.4f}, "
      f"greedy {first['eval_greedy']:.4f} -> {last['eval_greedy']:.4f} "
      f"({first['eval_problems']} problems, steps {first['step']} -> {last['step']})")
diff = max(s["train_rollout_logprob_abs_diff"] for s in steps)
secs = sum(s["rollout_s"] + s["train_s"] for s in steps)
print(f"{len(steps)} steps, {secs:.0f} s of rollout + training; "
      f"largest train_rollout_logprob_abs_diff {diff:g}")

x = [s["step"] for s in steps]
reward = [s["reward_mean"] for s in steps]
fig, ax = plt.subplots(figsize=(8, 5))
ax.plot(x, reward, color="tab:blue", alpha=0.3, lw=1)
ax.plot(x, smooth(reward), color="tab:blue", lw=1.8, label="reward (5-step mean)")
ax.set_xlabel("RL step")
ax.set_ylabel("training reward")
ax2 = ax.twinx()
ax2.plot(x, smooth([s["correct"] for s in steps]), color="tab:cyan", lw=1.2,
         label="correct share of rollouts (5-step mean)")
ex = [e["step"] for e in evals]
ax2.plot(ex, [e["eval_pass_at_1"] for e in evals], "o-", color="tab:red", label="held-out pass@1")
ax2.plot(ex, [e["eval_pass_at_k"] for e in evals], "s--", color="tab:orange",
         label=f"held-out pass@{k}")
ax2.plot(ex, [e["eval_greedy"] for e in evals], "^:", color="tab:purple", label="held-out greedy")
ax2.set_ylabel("held-out accuracy")
ax2.set_ylim(bottom=0)
lines = ax.get_legend_handles_labels()
lines2 = ax2.get_legend_handles_labels()
ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper left", fontsize=8)
title = sys.argv[3] if len(sys.argv) > 3 else "lowbit rl"
ax.set_title(f"{title}: held-out pass@1 {first['eval_pass_at_1']:.3f} -> "
             f"{last['eval_pass_at_1']:.3f}")
fig.tight_layout()
fig.savefig(out, dpi=110)
print(f"wrote {out}")
