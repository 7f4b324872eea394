"""``python -m engine.bench --paper``: the seed paper's experiments (arXiv 2311.04951) on this machine.

1. the target drafting for itself at K=1: acceptance ~1 shows the mechanism is sound;
2. autoregressive vs speculative at N=40 and N=100 new tokens, K from 1 to 8;
3. the target at int8, int4 and fp16 (int4 draft), with KV-cache memory per model.
Writes ``assets/paper_table.md`` and ``assets/paper_chart.png``.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from engine.bench import load_prompts, run_bench, summarize
from engine.convert import Compression
from engine.prepare import cache_dir_from_args, draft_compression, prepare_one
from engine.service import Engine

ASSETS = Path(__file__).resolve().parent.parent / "assets"


def _rows(engine: Engine, prompts, ks: list[int], n: int, label: str) -> list[dict]:
    runs = run_bench(engine, prompts, ["ar", "sd"], ks, n, {})
    rows = summarize(runs)
    kv = {r.mode: r.extra for r in runs}
    for row in rows:
        row.update(setup=label, n=n, target_kv_kib=kv[row["mode"]]["target_kv_bytes"] / 1024,
                   draft_kv_kib=kv[row["mode"]]["draft_kv_bytes"] / 1024)
    return rows


def run_paper(args: argparse.Namespace) -> None:
    cache = cache_dir_from_args(args)
    prompts = load_prompts(args.prompts)[: args.limit or 2]
    draft = prepare_one(args.draft, draft_compression(), cache).path
    targets = {p: prepare_one(args.target, Compression(p), cache).path for p in ("int4", "int8", "fp16")}
    rows: list[dict] = []

    self_engine = Engine(targets["int4"], targets["int4"])
    rows += _rows(self_engine, prompts, [1], 40, "target drafts for itself (int4)")
    del self_engine

    for precision, target in targets.items():
        engine = Engine(target, draft)
        ks = list(range(1, 9)) if precision == "int4" else [4]
        for n in (40, 100):
            rows += _rows(engine, prompts, ks, n, f"target {precision}, draft int4")
        del engine

    table = _markdown(rows)
    print(table)
    (ASSETS / "paper_table.md").write_text(table + "\n")
    _chart([r for r in rows if r["setup"] == "target int4, draft int4"], ASSETS / "paper_chart.png")
    print(f"wrote {ASSETS / 'paper_table.md'} and {ASSETS / 'paper_chart.png'}")


def _markdown(rows: list[dict]) -> str:
    lines = ["| setup | N | mode | tokens/s | speedup vs ar | acceptance | mean accepted length | target KV KiB | draft KV KiB |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        acc = "–" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        lines.append(f"| {r['setup']} | {r['n']} | {r['mode']} | {r['tokens_per_s']:.1f} | {r['speedup_vs_ar']:.2f}× | "
                     f"{acc} | {r['mean_accepted_length']:.2f} | {r['target_kv_kib']:.0f} | {r['draft_kv_kib']:.0f} |")
    return "\n".join(lines)


def _chart(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for n, colour in ((40, "tab:blue"), (100, "tab:orange")):
        sd = [r for r in rows if r["n"] == n and r["mode"].startswith("sd")]
        ar = next(r for r in rows if r["n"] == n and r["mode"] == "ar")
        ks = [int(r["mode"].split("-k")[1]) for r in sd]
        ax.plot(ks, [r["tokens_per_s"] for r in sd], "o-", color=colour, label=f"speculative, N={n}")
        ax.axhline(ar["tokens_per_s"], color=colour, linestyle="--", label=f"autoregressive, N={n}")
    ax.set_xlabel("draft length K")
    ax.set_ylabel("tokens/s")
    ax.set_title("Qwen2.5-Coder 1.5B int4 target, 0.5B int4 draft, 2 CPU cores")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
