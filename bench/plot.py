"""docs/benchmarks.png from the JSON that bench.pipelines and bench.train write.

python -m bench.pipelines --json pipelines.json && python -m bench.train --json train.json
python -m bench.plot --pipelines pipelines.json --train train.json --out docs/benchmarks.png
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.plot", description=__doc__.split("\n")[0])
    ap.add_argument("--pipelines", required=True, help="JSON from python -m bench.pipelines --json")
    ap.add_argument("--train", required=True, help="JSON from python -m bench.train --json")
    ap.add_argument("--out", default="docs/benchmarks.png", help="PNG to write")
    args = ap.parse_args(argv)
    with open(args.pipelines) as f:
        pipes = json.load(f)
    with open(args.train) as f:
        train = json.load(f)

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2), dpi=100)
    rows = [
        r for r in pipes["rows"] if r["batch"] == max(x["batch"] for x in pipes["rows"] if x["preset"] == r["preset"])
    ]
    procs = [
        k for k in rows[0] if k.startswith("stage_") and k.endswith("p_img_s")
    ]  # the stage in N processes, when timed
    columns = [("stage_1t_img_s", "this stage (1 thread)")] + [
        (k, f"this stage ({k.split('_')[1][:-1]} processes)") for k in procs
    ]
    columns += [
        ("tv_pil_img_s", "torchvision PIL, 1 process"),
        ("tv_dataloader_img_s", "torchvision PIL, DataLoader"),
        ("tv_v2_batch_img_s", "torchvision v2 on batches*"),
    ]
    width = 0.8 / len(columns)
    for j, (key, label) in enumerate(columns):
        left.bar([i + j * width for i in range(len(rows))], [r[key] for r in rows], width, label=label)
    left.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], [f"{r['preset']}\n({r['device']})" for r in rows])
    left.set_yscale("log")
    left.set_ylabel("img/s (log)")
    left.set_title("augment stage, train preset", fontsize=10)
    left.legend(fontsize=7, loc="upper left")

    best = {}
    for r in train["rows"]:
        if r["steady_img_s"] is None:  # the floor run trains nothing
            continue
        if r["variant"] not in best or r["steady_img_s"] > best[r["variant"]]["steady_img_s"]:
            best[r["variant"]] = r
    names = [n for n in ("plain", "jobs.train", "synthetic") if n in best]
    labels = {
        "plain": "seed's plain script",
        "jobs.train": "jobs.train (Ray)",
        "synthetic": "synthetic batches\n(ceiling)",
    }
    bars = right.bar(
        [labels[n] for n in names],
        [best[n]["steady_img_s"] for n in names],
        color=["tab:gray", "tab:blue", "tab:green"][: len(names)],
    )
    for bar, n in zip(bars, names, strict=True):
        right.annotate(
            f"{best[n]['steady_img_s']:.0f}\n{best[n]['wall_s']:.0f} s wall",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=7,
        )
    s = train["settings"]
    right.set_ylabel("steady-state img/s")
    right.set_title(f"ResNet18 training, {s['preset']}, batch {s['batch_size']}, {s['device']}", fontsize=10)
    right.margins(y=0.25)
    right.tick_params(axis="x", labelsize=8)
    fig.text(0.01, 0.01, "* v2: one set of random parameters per batch", fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
