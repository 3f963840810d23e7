"""python -m benchmarks.run_all [--out benchmarks/RESULTS.md]

Runs every benchmark script of the course (each a module benchmarks/bench_*.py with main() -> Section)
one after the other on this machine and writes one markdown file: the machine's description and the
command that made it, one table of the headline ratios (every ratio's two sides measured in this run,
side by side), then each benchmark's full tables.
"""
import argparse
import datetime
import importlib
import os
import pathlib
import platform
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent


def machine():
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (collectives on gloo, CPU)"
    return (f"- CPU: {cpu}, {cores} cores available\n- GPU: {gpu}\n- Python {platform.python_version()}, "
            f"torch {torch.__version__}, {platform.system()} {platform.release()}\n")


def headlines(sections):
    """One markdown table of every section's headline ratios, in the order the benchmarks ran."""
    rows = ["### Headlines: ratios measured side by side in this run\n",
            "| comparison | ratio | how to read it |", "|---|---:|---|"]
    for section in sections:
        rows += [f"| {what} | {ratio} | {reading} |" for what, ratio, reading in section.headlines]
    return "\n".join(rows) + "\n\nThe tables below hold every number behind these ratios.\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "RESULTS.md"))
    ap.add_argument("--only", nargs="*", help="benchmark module names (default: all bench_*.py)")
    args = ap.parse_args(argv)
    names = args.only or sorted(p.stem for p in HERE.glob("bench_*.py"))
    sections = []
    for name in names:
        t0 = time.time()
        print(f"running {name} ...", file=sys.stderr, flush=True)
        sections.append(importlib.import_module(f"benchmarks.{name}").main())
        print(f"  {name}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    text = "\n".join([f"# Benchmark results\n\nMade by `make bench` (`python -m benchmarks.run_all`) on "
                      f"{datetime.date.today().isoformat()}.\n\n{machine()}", headlines(sections), *sections])
    pathlib.Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
