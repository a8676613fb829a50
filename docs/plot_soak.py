#!/usr/bin/env python3
"""Plot a soak run's CSV (tests/soak/main.rs) for docs/reliability.md.

    pip install matplotlib
    python3 docs/plot_soak.py docs/soak/soak-long.csv docs/soak/soak

writes <prefix>-memory.png (RSS and threads), <prefix>-fds.png (open
descriptors and data folder size) and <prefix>-throughput.png (acknowledged
events and reads per second, in 10 s windows). Dashed lines mark each
SIGKILL + restart (the server's pid changes).
"""

import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("elapsed_s")]
    cols = {k: [float(r[k]) for r in rows] for k in rows[0]}
    return cols


def restarts(c):
    pids = c["pid"]
    return [c["elapsed_s"][i] for i in range(1, len(pids)) if pids[i] != pids[i - 1]]


def mark(ax, c):
    for t in restarts(c):
        ax.axvline(t / 60, color="grey", linestyle="--", linewidth=0.6)


def rate(c, key, window=10.0):
    t, v = c["elapsed_s"], c[key]
    xs, ys = [], []
    j = 0
    for i in range(len(t)):
        while t[i] - t[j] > window:
            j += 1
        if i > j and t[i] > t[j]:
            xs.append(t[i] / 60)
            ys.append((v[i] - v[j]) / (t[i] - t[j]))
    return xs, ys


def main():
    path, prefix = sys.argv[1], sys.argv[2]
    c = load(path)
    minutes = [t / 60 for t in c["elapsed_s"]]

    fig, ax = plt.subplots(figsize=(9, 3.6))
    ax.plot(minutes, [v / 1024 for v in c["rss_kib"]], label="RSS (MiB)")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MiB)")
    ax2 = ax.twinx()
    ax2.plot(minutes, c["threads"], color="tab:orange", linewidth=0.8, label="threads")
    ax2.set_ylabel("threads")
    mark(ax, c)
    ax.set_title("palisade serve: memory and threads (dashed: SIGKILL + restart)")
    fig.legend(loc="upper left", bbox_to_anchor=(0.08, 0.88))
    fig.tight_layout()
    fig.savefig(f"{prefix}-memory.png", dpi=110)

    fig, ax = plt.subplots(figsize=(9, 3.6))
    ax.plot(minutes, c["fds"], label="open fds")
    ax.set_xlabel("minutes")
    ax.set_ylabel("open file descriptors")
    ax2 = ax.twinx()
    ax2.plot(minutes, [v / 1024 for v in c["data_kib"]], color="tab:green", linewidth=0.8, label="data folder (MiB)")
    ax2.set_ylabel("data folder on disk (MiB)")
    mark(ax, c)
    ax.set_title("palisade serve: descriptors and data size (dashed: SIGKILL + restart)")
    fig.legend(loc="upper left", bbox_to_anchor=(0.08, 0.88))
    fig.tight_layout()
    fig.savefig(f"{prefix}-fds.png", dpi=110)

    fig, ax = plt.subplots(figsize=(9, 3.6))
    x, y = rate(c, "acked_events")
    ax.plot(x, y, label="events acknowledged / s")
    x, y = rate(c, "reads")
    ax.plot(x, y, label="reads / s")
    x, y = rate(c, "kafka_sent")
    ax.plot(x, y, label="Kafka records / s")
    ax.set_xlabel("minutes")
    ax.set_ylabel("per second (10 s windows)")
    mark(ax, c)
    ax.set_title("throughput under mixed load (dashed: SIGKILL + restart)")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(f"{prefix}-throughput.png", dpi=110)


if __name__ == "__main__":
    main()
