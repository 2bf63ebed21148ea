#!/usr/bin/env python3
"""ncu_by_kernel.py: sums an Nsight Compute CSV by kernel, for doc/benchmarks.md's tables.

Reads what `ncu --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum,
dram__bytes_write.sum ...` printed (its own log lines before the table are skipped) and
prints, per kernel name (template arguments kept, parameters dropped; with --grid, per name
and grid), the launches, the summed time, the DRAM bytes and their rate, longest first.
  tests/tools/ncu_by_kernel.py NCU.csv [--grid]
"""
import collections
import csv
import sys

TIME = {"ns": 1e-9, "nsecond": 1e-9, "us": 1e-6, "usecond": 1e-6, "ms": 1e-3, "msecond": 1e-3}
SIZE = {"byte": 1, "B": 1, "Kbyte": 1e3, "KB": 1e3, "Mbyte": 1e6, "MB": 1e6, "Gbyte": 1e9,
        "GB": 1e9}


def main():
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        sys.exit(__doc__)
    path, by_grid = sys.argv[1], "--grid" in sys.argv[2:]
    lines = open(path).read().splitlines()
    head = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if head is None:
        sys.exit(f"{path}:1: no ncu CSV table (a line starting with \"ID\")")
    launches = collections.defaultdict(dict)
    for row in csv.DictReader(lines[head:]):
        unit, name = row["Metric Unit"], row["Metric Name"]
        value = float(row["Metric Value"].replace(",", ""))
        scale = TIME.get(unit) if name.startswith("gpu__time") else SIZE.get(unit)
        if scale is None:
            sys.exit(f"{path}: unknown unit {unit!r} of {name}")
        k = launches[row["ID"]]
        k[name] = value * scale
        k["kernel"] = row["Kernel Name"].split("(")[0] + (
            " " + row.get("Grid Size", "") if by_grid else "")
    total = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for k in launches.values():
        t = total[k["kernel"]]
        t[0] += 1
        t[1] += k.get("gpu__time_duration.sum", 0.0)
        t[2] += k.get("dram__bytes_read.sum", 0.0) + k.get("dram__bytes_write.sum", 0.0)
    print("| kernel | launches | ms | GB | TB/s |\n|---|---|---|---|---|")
    for name, (n, s, b) in sorted(total.items(), key=lambda kv: -kv[1][1]):
        rate = f"{b / s / 1e12:.2f}" if s > 0 else "-"
        print(f"| {name} | {n} | {s * 1e3:.3f} | {b / 1e9:.2f} | {rate} |")
    print(f"| all | {len(launches)} | {sum(t[1] for t in total.values()) * 1e3:.3f} | | |")


if __name__ == "__main__":
    main()
