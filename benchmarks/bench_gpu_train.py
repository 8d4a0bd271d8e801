"""README's main job on a GPU: ``cct train --gpu 0`` vs a PyTorch loop of the same net reading the same LMDB.

    python benchmarks/bench_gpu_train.py                      # 10,000 iterations, test every 500, 3 rounds
    python benchmarks/bench_gpu_train.py --iterations 2000 --rounds 1

Both sides run as their own process, timed from start to exit (imports, setup, data, tests, snapshots included):

* cct: ``python -m cct train --solver models/lenet/lenet_solver.prototxt --gpu 0 --iterations N`` (the README's
  job; the digits LMDBs are made first with ``cct make_digits data/digits`` when missing);
* PyTorch: this script with ``--torch-worker``: LeNet as ``lenet_train_test.prototxt`` defines it (Xavier
  weights, zero biases, bias lr_mult 2), SGD momentum 0.9, weight decay 5e-4, Caffe's "inv" rate policy set every
  iteration, reading ``data/digits/digits_{train,test}_lmdb`` (Caffe Datum records, scale 1/256) in a background
  thread, pinned host batches copied asynchronously, the test net (100 batches of 100) every 500 iterations.
  PyTorch's SGD applies the rate after momentum (Caffe before): equal for a fixed rate, a hair apart under "inv".

Prints the wall times (median over rounds) and each side's last test accuracy; writes
``results/bench_gpu_train.json``.
"""
from __future__ import annotations

import argparse
import os
import queue
import re
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TRAIN_DB, TEST_DB = "data/digits/digits_train_lmdb", "data/digits/digits_test_lmdb"


def lmdb_batches(path: str, batch: int, out: queue.Queue, stop: threading.Event) -> None:
    """Decode Caffe Datum records of ``path`` into (images float32 /256, labels int64) batches, forever."""
    import lmdb
    import numpy as np
    import torch

    from cct.proto import caffe_pb2

    env = lmdb.open(path, readonly=True, lock=False)
    datum = caffe_pb2.Datum()
    with env.begin() as txn:
        while not stop.is_set():
            imgs, labels = [], []
            for _, value in txn.cursor():
                datum.ParseFromString(value)
                imgs.append(np.frombuffer(datum.data, np.uint8).reshape(datum.channels, datum.height, datum.width))
                labels.append(datum.label)
                if len(imgs) == batch:
                    x = torch.from_numpy(np.stack(imgs).astype(np.float32) * np.float32(0.00390625)).pin_memory()
                    y = torch.tensor(labels, dtype=torch.int64).pin_memory()
                    while not stop.is_set():
                        try:
                            out.put((x, y), timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    imgs, labels = [], []
                    if stop.is_set():
                        return


def torch_worker(iterations: int) -> int:
    import torch
    import torch.nn as nn
    from bench_e2e import torch_model

    torch.manual_seed(1)
    dev = torch.device("cuda:0")
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    net = torch_model("lenet")
    for m in net.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            fan_in = m.weight[0].numel()
            bound = (3.0 / fan_in) ** 0.5  # Caffe's xavier filler (FAN_IN)
            nn.init.uniform_(m.weight, -bound, bound)
            nn.init.zeros_(m.bias)
    net = net.to(dev)
    weights = [p for n, p in net.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in net.named_parameters() if n.endswith("bias")]
    base_lr, gamma, power = 0.01, 1e-4, 0.75
    opt = torch.optim.SGD([{"params": weights, "lr_mult": 1.0}, {"params": biases, "lr_mult": 2.0}], lr=base_lr,
                          momentum=0.9, weight_decay=5e-4)
    loss_fn = nn.CrossEntropyLoss()
    stop = threading.Event()
    train_q: queue.Queue = queue.Queue(maxsize=4)
    test_q: queue.Queue = queue.Queue(maxsize=4)
    threads = [threading.Thread(target=lmdb_batches, args=(TRAIN_DB, 64, train_q, stop), daemon=True),
               threading.Thread(target=lmdb_batches, args=(TEST_DB, 100, test_q, stop), daemon=True)]
    for t in threads:
        t.start()
    accuracy = None

    def test() -> float:
        net.eval()
        correct = 0
        with torch.no_grad():
            for _ in range(100):
                x, y = test_q.get()
                x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
                correct += (net(x).argmax(1) == y).sum()
        net.train()
        return float(correct) / 10000.0

    for it in range(iterations):
        if it % 500 == 0:
            accuracy = test()
            print(f"iteration {it} test accuracy {accuracy:.4f}", flush=True)
        x, y = train_q.get()
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        rate = base_lr * (1.0 + gamma * it) ** (-power)
        for g in opt.param_groups:
            g["lr"] = rate * g["lr_mult"]
        opt.zero_grad(set_to_none=False)
        loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()
        if it % 100 == 0:
            print(f"iteration {it} loss {float(loss):.4f}", flush=True)
    accuracy = test()
    print(f"final test accuracy {accuracy:.4f}", flush=True)
    stop.set()
    return 0


def timed(cmd: list[str]) -> tuple[float, str, int]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    return time.perf_counter() - t0, proc.stdout + proc.stderr, proc.returncode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.torch_worker:
        return torch_worker(args.iterations)
    from common import write_json

    if not os.path.isdir(os.path.join(ROOT, TRAIN_DB)):
        subprocess.run([sys.executable, "-m", "cct", "make_digits", "data/digits", "--noprogress"], cwd=ROOT,
                       check=True)
    cct_cmd = [sys.executable, "-m", "cct", "train", "--solver", "models/lenet/lenet_solver.prototxt", "--gpu", "0",
               "--iterations", str(args.iterations), "--noprogress"]
    torch_cmd = [sys.executable, os.path.abspath(__file__), "--torch-worker", "--iterations", str(args.iterations)]
    runs: dict[str, list[float]] = {"cct": [], "pytorch": []}
    acc: dict[str, float | None] = {"cct": None, "pytorch": None}
    for _ in range(args.rounds):
        for name, cmd in (("cct", cct_cmd), ("pytorch", torch_cmd)):
            seconds, text, rc = timed(cmd)
            if rc != 0:
                print(f"# {name} failed (rc {rc}):\n{text[-3000:]}")
                return 1
            runs[name].append(seconds)
            found = re.findall(r"accuracy = ([0-9.]+)", text) if name == "cct" else \
                re.findall(r"final test accuracy ([0-9.]+)", text)
            acc[name] = float(found[-1]) if found else None
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"# {args.iterations} LeNet iterations on the digits LMDB, test every 500; {args.rounds} round(s)")
    for k in runs:
        print(f"{k:8s} wall {med[k]:7.2f} s (runs {', '.join(f'{s:.2f}' for s in runs[k])}); "
              f"last test accuracy {acc[k]}")
    print(f"cct / pytorch speed: {med['pytorch'] / med['cct']:.2f}x")
    path = write_json("bench_gpu_train", {"iterations": args.iterations, "rounds": args.rounds, "wall_s": runs,
                                          "median_s": med, "accuracy": acc,
                                          "speedup_vs_pytorch": med["pytorch"] / med["cct"]}, args.out)
    print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
