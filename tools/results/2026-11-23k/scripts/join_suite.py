"""Join the suite's three runs of one loan (one a group) into one results file, as the README's block was made:
    python tools/results/2026-11-23k/scripts/join_suite.py OUT.json fa3/results.json long/results.json decode/results.json
    python tools/bench.py report OUT.json --readme README.md
The header keeps the first run's metadata; its command names all three, and `parts` keeps each run's ceilings,
run time and GPU state."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
import bench_suite as suite  # noqa: E402


def main(out, *paths):
    metas, rows = [], []
    for p in paths:
        m, r = suite.read_json(p)
        metas.append(m)
        rows += r
    meta = dict(metas[0])
    meta["command"] = " ; ".join(m["command"] for m in metas) + "  (three runs in one loan, one a group, rows joined)"
    meta["parts"] = [{k: m.get(k) for k in ("date", "command", "ceilings", "elapsed_s", "gpu_state_at_start",
                                            "gpu_state_at_end", "clock_monitor")} for m in metas]
    if all(m.get("elapsed_s") for m in metas):
        meta["elapsed_s"] = round(sum(m["elapsed_s"] for m in metas), 1)
    suite.write_json(out, meta, rows)


if __name__ == "__main__":
    main(*sys.argv[1:])
