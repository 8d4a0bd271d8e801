#!/usr/bin/env python
"""The long fuzz run: thousands of mutated prototxts, caffemodels, HDF5 weights and data records (cct/fuzz.py).

    python tools/fuzz_inputs.py --cases 2500,900,600,600,300,400 [--start 0] [--workers 2] [--timeout 20]
                                [--json out.json]

Each case runs in a worker process (address space capped by ``--memory``, CCT_CALIBRATE=0); a case
over ``--timeout`` seconds is interrupted in the worker (SIGALRM), one that does not return within
twice that is killed with its worker (counted as ``hang``) and the worker restarted. Each worker
first runs the unmutated small nets untimed (numba compiles its kernels on first use). Prints the
outcome classes per kind and every case outside cct's error types (with its replay command); exits
1 if there is any. Replay one case: ``python tools/fuzz_inputs.py --replay prototxt:123``.
"""
from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from cct import fuzz  # noqa: E402


def _limit_memory(limit: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _worker(jobs: mp.Queue, results: mp.Queue, timeout: float, memory: int) -> None:
    os.environ.setdefault("CCT_CALIBRATE", "0")
    _limit_memory(memory)
    corpus = fuzz.prototxt_corpus()
    weights = fuzz.BaseWeights()  # built once per worker, mutated by every weight case
    _warm_up(corpus)
    while True:
        job = jobs.get()
        kind, seed = job
        results.put(("start", kind, seed, "", ""))
        try:
            case = fuzz.make_case(kind, seed, corpus, weights)
            outcome, detail = fuzz.run_case(case, timeout=timeout), ""
            if outcome.startswith("other") or outcome == "timeout":
                detail = fuzz.describe(case, outcome) + " | " + _error_text(case, timeout)
        except Exception:  # noqa: BLE001 - a failure to build the case itself is reported too
            outcome, detail = "other:fuzzer", traceback.format_exc(limit=3)
        results.put(("done", kind, seed, outcome, detail))


def _warm_up(corpus: list[tuple[str, bytes]]) -> None:
    """Run the unmutated small nets once, untimed: numba compiles its kernels on first use (seconds to
    minutes on a loaded machine), which must not count against the first cases' timeout."""
    for name, text in corpus:
        if name.startswith("builtin:") or "cifar10_quick" in name or "lenet" in name:
            fuzz.run_case(fuzz.Case("prototxt", -1, text, name, "none"), timeout=0)


def _error_text(case: fuzz.Case, timeout: float) -> str:
    """Re-run a bad case to capture its message (the outcome class alone hides it)."""
    import io
    import logging
    import tempfile
    from contextlib import redirect_stderr

    from cct.config import Config

    config = Config(python_layers=False, memory_budget=fuzz.FUZZ_MEMORY_BUDGET)
    logging.getLogger("cct").setLevel(logging.CRITICAL + 1)
    with tempfile.TemporaryDirectory() as d:
        try:
            with fuzz.alarm(timeout), redirect_stderr(io.StringIO()):
                fuzz.run_in(case, d, config)
        except BaseException as e:  # noqa: BLE001
            return f"{type(e).__name__}: {str(e)[:300]}"
    return "(passed on re-run)"


def run(plan: list[tuple[str, int]], workers: int, timeout: float, memory: int) -> tuple[dict, list[str]]:
    ctx = mp.get_context("fork")
    jobs: mp.Queue = ctx.Queue()
    results: mp.Queue = ctx.Queue()
    for job in plan:
        jobs.put(job)
    procs: dict[int, mp.Process] = {}
    running: dict[tuple[str, int], tuple[float, int]] = {}
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    bad: list[str] = []
    done = 0

    def start(slot: int) -> None:
        p = ctx.Process(target=_worker, args=(jobs, results, timeout, memory), daemon=True)
        p.start()
        procs[slot] = p

    for slot in range(workers):
        start(slot)
    t0 = time.time()
    while done < len(plan):
        try:
            msg, kind, seed, outcome, detail = results.get(timeout=1.0)
        except queue.Empty:
            msg = ""
        if msg == "start":
            running[(kind, seed)] = (time.time(), 0)
        elif msg == "done":
            running.pop((kind, seed), None)
            counts[kind][outcome] += 1
            done += 1
            if detail:
                bad.append(detail + f"  [replay: python tools/fuzz_inputs.py --replay {kind}:{seed}]")
            if done % 200 == 0:
                print(f"  {done}/{len(plan)} cases, {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        now = time.time()
        for (kind, seed), (since, _) in list(running.items()):
            if now - since > 2 * timeout + 10:  # stuck in native code: kill every worker, restart them
                running.pop((kind, seed))
                counts[kind]["hang"] += 1
                done += 1
                bad.append(f"{kind} seed={seed} -> hang (killed after {now - since:.0f} s)  "
                           f"[replay: python tools/fuzz_inputs.py --replay {kind}:{seed}]")
                for slot, p in list(procs.items()):
                    p.kill()
                    p.join()
                    start(slot)
                for other in list(running):  # their cases are lost with the killed workers: rerun
                    running.pop(other)
                    jobs.put(other)
        for slot, p in list(procs.items()):
            if not p.is_alive() and p.exitcode not in (0, None) and done < len(plan):
                start(slot)  # a worker killed by the OS (e.g. memory): its case is counted by the hang rule
    for p in procs.values():  # idle workers wait for jobs: end them
        p.kill()
        p.join()
    return counts, bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/fuzz_inputs.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--cases", default="2500,900,600,600,300,400",
                    help="cases per kind: prototxt,caffemodel,hdf5,datum,mean,imagelist")
    ap.add_argument("--start", type=int, default=0, help="first seed")
    ap.add_argument("--workers", type=int, default=2, help="worker processes")
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds per case before it counts as a timeout")
    ap.add_argument("--memory", default="6G", help="address-space limit of each worker")
    ap.add_argument("--json", default=None, help="write the counts and the bad cases here")
    ap.add_argument("--replay", default=None, help="KIND:SEED: run one case in this process and show the error")
    args = ap.parse_args(argv)
    if args.replay:
        kind, seed = args.replay.split(":")
        case = fuzz.make_case(kind, int(seed))
        print(fuzz.describe(case, fuzz.run_case(case, timeout=args.timeout)))
        print(_error_text(case, args.timeout))
        return 0
    from cct.membudget import parse_size

    numbers = [int(x) for x in args.cases.split(",")]
    plan = [(kind, args.start + i) for kind, n in zip(fuzz.KINDS, numbers) for i in range(n)]
    t0 = time.time()
    counts, bad = run(plan, args.workers, args.timeout, parse_size(args.memory) or (1 << 40))
    elapsed = time.time() - t0
    print(f"{len(plan)} cases in {elapsed:.0f} s ({args.workers} workers)")
    for kind in fuzz.KINDS:
        if counts.get(kind):
            total = sum(counts[kind].values())
            classes = ", ".join(f"{k} {v}" for k, v in sorted(counts[kind].items(), key=lambda kv: -kv[1]))
            print(f"  {kind:<10} {total:>5}: {classes}")
    outside = sum(v for c in counts.values() for k, v in c.items() if k.startswith("other") or k in ("timeout", "hang"))
    print(f"outside cct's error types (bare exceptions, timeouts, hangs): {outside}")
    for line in bad:
        print("  " + line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cases": len(plan), "seconds": round(elapsed), "counts": counts, "outside": outside,
                       "bad": bad}, f, indent=1)
    return 1 if outside else 0


if __name__ == "__main__":
    sys.exit(main())
