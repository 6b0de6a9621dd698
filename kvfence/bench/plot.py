"""The bench's JSON as one PNG: throughput and latency per contender, and the fidelity table.

`kvfence bench --json X.json` (and `--fidelity --json`) write X.png next to it; to put a
bench run and a fidelity run in one picture (the README's):

    python -m kvfence.bench.plot bench.json fidelity.json -o docs/bench.png --title "..."

matplotlib (the `bench` extra, installed by scripts/setup.sh) draws with the Agg backend,
so no display is needed.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def _latency(ax, rows: list[dict], key: str, title: str) -> None:
    import numpy as np

    rows = [r for r in rows if r.get(key)]
    y = np.arange(len(rows))
    for off, q, color in ((-0.2, "p50", "#4c78a8"), (0.2, "p99", "#e45756")):
        vals = [r[key].get(q, 0.0) for r in rows]
        ax.barh(y + off, vals, height=0.4, color=color, label=q)
        for yi, v in zip(y + off, vals):
            ax.text(v, yi, f" {v:.0f}", va="center", fontsize=7)
    ax.set_yticks(y, [r["name"] for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(1, max(max(r[key].values()) for r in rows) * 4)  # from 1 ms: bar lengths stay comparable
    ax.set_xlabel("ms (log scale)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper right")


def _throughput(ax, rows: list[dict], title: str) -> None:
    tps = [r["output_tokens"] / r["seconds"] for r in rows]
    y = range(len(rows))
    ax.barh(list(y), tps, color="#54a24b")
    for yi, (v, r) in enumerate(zip(tps, rows)):
        ax.text(v, yi, f" {v:.0f} tok/s, {r['seconds']:.2f} s", va="center", fontsize=7)
    ax.set_yticks(list(y), [r["name"] for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, max(tps) * 1.45)
    ax.set_xlabel("output tokens / s")
    ax.set_title(title, fontsize=9)


def _fidelity(ax, fid: dict) -> None:
    scores = fid["scores"]
    cols = ["contender", "top-1 agreement", "mean |dlogprob|", "max |dlogprob|", "exact ties"]
    cells = [[s["name"], f"{s['agreement']:.4f}", f"{s['mean_abs_logprob_diff']:.4f}",
              f"{s['max_abs_logprob_diff']:.3f}", str(s["exact_ties"])] for s in scores]
    ax.axis("off")
    table = ax.table(cellText=cells, colLabels=cols, loc="center", cellLoc="left", colLoc="left",
                     colWidths=[0.5, 0.14, 0.14, 0.12, 0.1])
    table.auto_set_font_size(False)
    table.set_fontsize(7)
    table.scale(1, 1.3)
    ax.set_title(f"fidelity: teacher-forced against {fid.get('reference', 'float32')}, "
                 f"{fid.get('positions', '?')} positions", fontsize=9)


def render(docs: list[dict], path: str | Path, title: str = "") -> Path:
    """One PNG from bench JSON documents: each {"results": [...]} (the fixed workload) adds a
    throughput panel and TTFT/ITL panels, a "one_request" part its inter-token latencies, an
    "arrivals" part its latency panels, and a
    fidelity document ({"scores": [...]}) adds the table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: list = []   # (height in rows, draw)
    for d in docs:
        if d.get("results"):
            rows = d["results"]
            w = d.get("workload", {})
            what = (f"{w['num_requests']} x {w['prompt_tokens']} -> {w['output_tokens']}, all at once"
                    if w else "fixed workload")
            panels.append((len(rows), lambda ax, rows=rows, what=what: _throughput(ax, rows, f"throughput ({what})")))
            timed = [r for r in rows if r.get("itl_ms")]
            if timed:
                panels.append((2 * len(timed), lambda ax, rows=timed: _latency(
                    ax, rows, "ttft_ms", "time to first token (fixed workload)")))
                panels.append((2 * len(timed), lambda ax, rows=timed: _latency(
                    ax, rows, "itl_ms", "inter-token latency (fixed workload)")))
        one = d.get("one_request")
        if one and one.get("results"):
            rows = one["results"]
            w = one["workload"]
            what = f"one request at a time ({w['prompt_tokens']} -> {w['output_tokens']})"
            panels.append((2 * len(rows), lambda ax, rows=rows, what=what: _latency(
                ax, [{**r, "name": f"{r['name']}, {r['decode_tps']:.1f} tok/s"} for r in rows], "itl_ms",
                f"{what}: inter-token latency, decode rate in the label")))
        arr = d.get("arrivals")
        if arr and arr.get("results"):
            rows = arr["results"]
            panels.append((2 * len(rows), lambda ax, rows=rows: _latency(
                ax, rows, "itl_ms", "requests arriving while others decode: inter-token latency")))
            panels.append((2 * len(rows), lambda ax, rows=rows: _latency(
                ax, rows, "ttft_ms", "requests arriving while others decode: time to first token")))
        if d.get("scores"):
            panels.append((len(d["scores"]) + 1, lambda ax, d=d: _fidelity(ax, d)))
    if not panels:
        raise ValueError("nothing to draw: no results, arrivals or fidelity scores in the JSON")
    heights = [1.0 + 0.28 * n for n, _ in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, sum(heights) + 0.4), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for (_, draw), ax in zip(panels, axes[:, 0]):
        draw(ax)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()) if title else None)  # room for the title
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_next_to(json_path: str, doc: dict, title: str = "") -> None:
    """The PNG beside a bench's JSON, or a line saying why not (matplotlib not installed)."""
    try:
        out = render([doc], Path(json_path).with_suffix(".png"), title)
    except ImportError as e:
        print(f"no PNG: {e} (pip install -e '.[bench]', or scripts/setup.sh)")
        return
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="bench JSON files -> one PNG")
    ap.add_argument("json", nargs="+")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--title", default="")
    a = ap.parse_args(argv)
    render([json.loads(Path(p).read_text()) for p in a.json], a.out, a.title)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
