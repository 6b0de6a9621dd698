"""The bench's JSON as one PNG: throughput and latency per contender, and the fidelity table.

`kvfence bench --json X.json` writes X.png next to it (the fixed workload, `--fidelity`,
`--native`, `--structured`, `--url`, `--pd`); to put a bench run and a fidelity run in one
picture (the README's):

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


def _what(w: dict, concurrency: int | None = None, words: bool = False) -> str:
    at_once = concurrency is None or concurrency >= w["num_requests"]
    return (f"{w['num_requests']} x {w['prompt_tokens']}{' words' if words else ''} -> {w['output_tokens']}, "
            + ("all at once" if at_once else f"{concurrency} at a time"))


def _http_row(r: dict, name: str) -> dict:
    """A `kvfence bench --url` report as a contender's row (its errors in the name)."""
    failed = r["num_requests"] - r["ok"]
    return {"name": name + (f", {failed} failed" if failed else ""), "seconds": r["seconds"],
            "output_tokens": r["output_tokens"], "ttft_ms": r["ttft_ms"], "itl_ms": r["itl_ms"]}


def _workloads(d: dict) -> list[tuple[str, list[dict]]]:
    """(what was run, contender rows) of each timed workload in a bench's JSON, whichever
    bench wrote it: the fixed workload and --structured ({"workload", "results"}), --native
    (rows of several "workloads"), --url (one report) and --pd (single node and PD)."""
    if "url" in d and "itl_ms" in d:   # --url
        w = {"num_requests": d["num_requests"], "prompt_tokens": d["prompt_words"], "output_tokens": d["max_tokens"]}
        return [(_what(w, d["concurrency"], words=True), [_http_row(d, f"{d['model']} at {d['url']}")])]
    if "single" in d and "pd" in d:    # --pd
        w = {**d["workload"], "prompt_tokens": d["workload"]["prompt_words"]}
        return [(_what(w, d["workload"]["concurrency"], words=True),
                 [_http_row(d["single"], "single node"), _http_row(d["pd"], "prefill + decode")])]
    rows = d.get("results") or []
    if "workloads" in d:               # --native
        return [(f"{name}: {_what(w)}", [r for r in rows if r.get("workload") == name])
                for name, w in d["workloads"].items() if any(r.get("workload") == name for r in rows)]
    if rows and isinstance(rows[0], dict) and "seconds" in rows[0]:
        return [(_what(d["workload"]) if d.get("workload") else "fixed workload", rows)]
    return []


def render(docs: list[dict], path: str | Path, title: str = "") -> Path:
    """One PNG from bench JSON documents: each timed workload (the fixed one, --native's,
    --structured's, --url's, --pd's) adds a throughput panel and TTFT/ITL panels, a
    "one_request" part its inter-token latencies, an "arrivals" part its latency panels, and a
    fidelity document ({"scores": [...]}) adds the table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: list = []   # (height in rows, draw)
    for d in docs:
        for what, rows in _workloads(d):
            panels.append((len(rows), lambda ax, rows=rows, what=what: _throughput(ax, rows, f"throughput ({what})")))
            timed = [r for r in rows if r.get("itl_ms")]
            if timed:
                panels.append((2 * len(timed), lambda ax, rows=timed, what=what: _latency(
                    ax, rows, "ttft_ms", f"time to first token ({what})")))
                panels.append((2 * len(timed), lambda ax, rows=timed, what=what: _latency(
                    ax, rows, "itl_ms", f"inter-token latency ({what})")))
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
        raise ValueError("nothing to draw: no timed workload or fidelity scores in the JSON")
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
