"""Checkpoint metrics for Prometheus: a small training loop saves through tierckpt with a remote tier, and the
metrics are served at http://localhost:PORT/metrics (or printed once with --print).

    .venv/bin/python examples/prometheus_example.py [--port 9100] [--print] [--dir /tmp/tierckpt-metrics]

Run it again with the same ``--dir`` and it resumes from the newest checkpoint there. ``--port 0`` serves on a free
port (printed).

Needs ``pip install "tierckpt[prometheus]"``. Scrape it with Prometheus, or open the URL while it runs: the
histograms of save stall, durable and upload seconds, the counters of saves and failed uploads, and the gauges of
the last committed step per tier and the upload lag (read from ``mgr.health()`` at each scrape).
"""

from __future__ import annotations

import argparse
import os
import time

import prometheus_client
import torch

import tierckpt
from tierckpt.metrics import PrometheusMetrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=9100, help="0: a free port")
    ap.add_argument("--print", action="store_true", help="print the metrics once at the end instead of serving them")
    ap.add_argument("--dir", default="/tmp/tierckpt-metrics")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()

    registry = prometheus_client.CollectorRegistry()
    metrics = PrometheusMetrics(registry)
    if not args.print:
        started = prometheus_client.start_http_server(args.port, registry=registry)  # (server, thread) since 0.20
        port = started[0].server_port if started else args.port
        print(f"metrics at http://localhost:{port}/metrics", flush=True)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {"model": model, "optim": opt}
    with tierckpt.CheckpointManager(os.path.join(args.dir, "local"), remote=os.path.join(args.dir, "remote"),
                                    keep_local=2, keep_remote=3, on_record=metrics) as mgr:
        metrics.attach(mgr)  # the tier gauges
        start = (mgr.restore(state) or 0) + 1
        print(f"restored step {start - 1}" if start > 1 else "no checkpoint found, starting from scratch", flush=True)
        for step in range(start, start + args.steps):
            model(torch.randn(32, 256)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if step % 5 == 0:
                mgr.save(step, state)
            time.sleep(0.05)
        mgr.wait()
        text = prometheus_client.generate_latest(registry).decode()
    if args.print:
        print("\n".join(line for line in text.splitlines() if line.startswith("tierckpt_") and "_bucket" not in line))


if __name__ == "__main__":
    main()
