#!/usr/bin/env python3
"""Reads the TensorBoard event files lowbit writes (src/io/metrics.c) with the tensorboard package
and compares every scalar with OUT_DIR/metrics.jsonl: each number of each line must appear as
PREFIX/KEY at that step, to float32 precision. Exits non-zero on a mismatch.

Usage: read_tfevents.py OUT_DIR [PREFIX]     (pip install tensorboard)
"""
import glob, json, struct, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

out = sys.argv[1]
prefix = sys.argv[2] if len(sys.argv) > 2 else "train"
files = glob.glob(f"{out}/events.out.tfevents.*")
assert files, f"no event files in {out}"
acc = EventAccumulator(out, size_guidance={"scalars": 0})
acc.Reload()
got = {}
for tag in acc.Tags()["scalars"]:
    for e in acc.Scalars(tag):
        got[(tag, e.step)] = e.value
want = {}
for line in open(f"{out}/metrics.jsonl"):
    row = json.loads(line)
    for k, v in row.items():
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
            want[(f"{prefix}/{k}", row["step"])] = struct.unpack("f", struct.pack("f", v))[0]
bad = [(k, want[k], got.get(k)) for k in want if got.get(k) != want[k]]
extra = [k for k in got if k not in want]
print(f"{len(files)} event file(s), {len(got)} scalars read, {len(want)} in metrics.jsonl, "
      f"{len(bad)} missing or different, {len(extra)} extra")
for b in bad[:10]:
    print("  mismatch", b)
sys.exit(1 if bad or extra else 0)
