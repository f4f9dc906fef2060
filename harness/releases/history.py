"""The release history of matrix entries: release x entry outcomes, as Markdown and as a PNG heatmap.

Building the table is pure (``HistoryTable`` from cells); filling it runs or looks up one probe per cell
(``harness/releases/probe.py``); rendering writes history.md and history.png (matplotlib, no display).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from harness.upstream.known import load_known

# Cell colours by outcome; any other failure class is drawn as "other failure".
COLOURS = {
    "ok": "#4caf50",
    "assert-45330": "#e53935",
    "rejected": "#fb8c00",
    "kv-lease-expired": "#fdd835",
    "server-exited": "#8e24aa",
    "install-failed": "#616161",
    "not measured": "#ffffff",
}
OTHER_FAILURE = "#5c6bc0"
LEGEND = {
    "ok": "handshake passed, outputs match the baseline",
    "assert-45330": "the #45330 handshake assertion",
    "rejected": "refused at handshake by design",
    "kv-lease-expired": "KV read after P's lease expired (known intermittent)",
    "server-exited": "a server did not start (P/D not usable on this release)",
    "install-failed": "the release could not be installed",
    "not measured": "no result at this harness revision",
}


@dataclass(frozen=True)
class Column:
    id: str
    label: str  # e.g. "K=1 P1->D2 regime B"
    regime: str


@dataclass(frozen=True)
class Cell:
    outcome: str
    source: str = "run"  # run / store / missing
    run_dir: str | None = None
    expected: str | None = None  # what the entry expects of this version (config's version families)
    detail: str = ""


@dataclass
class HistoryTable:
    versions: list[str]  # oldest first
    columns: list[Column]
    cells: dict[tuple[str, str], Cell] = field(default_factory=dict)  # (version, entry id) -> cell
    revision: str = ""
    command: str = ""
    date: str = ""

    def cell(self, version: str, entry: str) -> Cell:
        return self.cells.get((version, entry), Cell("not measured", "missing"))

    def boundaries(self, entry: str) -> list[str]:
        """Lines naming where the entry's measured outcome changes between consecutive measured releases."""
        out, prev = [], None
        for v in self.versions:
            c = self.cell(v, entry)
            if c.source == "missing":
                continue
            if prev is not None and c.outcome != prev[1]:
                out.append(f"{prev[1]} on {prev[0]} -> {c.outcome} on {v}")
            prev = (v, c.outcome)
        return out

    def to_dict(self) -> dict:
        return {
            "versions": self.versions,
            "columns": [asdict(c) for c in self.columns],
            "revision": self.revision,
            "command": self.command,
            "date": self.date,
            "cells": [{"version": v, "entry": e, **asdict(c)} for (v, e), c in sorted(self.cells.items())],
        }


def render_markdown(t: HistoryTable, png_name: str | None = "history.png") -> str:
    lines = ["# Release history", ""]
    if t.command:
        lines += [f"- command: `{t.command}`"]
    lines += [
        f"- date: {t.date}; harness revision {t.revision}" if t.date else f"- harness revision {t.revision}",
        f"- releases: {t.versions[0]} .. {t.versions[-1]} ({len(t.versions)})",
        "",
    ]
    if png_name:
        lines += [f"![release history]({png_name})", ""]
    lines += [
        "| vLLM | " + " | ".join(f"{c.id} ({c.label})" for c in t.columns) + " |",
        "|---|" + "---|" * len(t.columns),
    ]
    for v in t.versions:
        row = []
        for c in t.columns:
            cell = t.cell(v, c.id)
            mark = "" if cell.source != "store" else " ·"
            unexpected = (
                " ⚠"
                if cell.expected and cell.source != "missing" and cell.outcome not in (cell.expected, "install-failed")
                else ""
            )
            row.append(f"{cell.outcome}{mark}{unexpected}")
        lines.append(f"| {v} | " + " | ".join(row) + " |")
    lines += [
        "",
        "`·` reused from the results store (same entry, release and harness revision); "
        "`⚠` differs from what the config's version families expect of that release.",
        "",
    ]
    lines += ["## Where outcomes change", ""]
    for c in t.columns:
        b = t.boundaries(c.id)
        lines.append(f"- {c.id}: " + ("; ".join(b) if b else "no change over the measured releases"))
    details = [(v, e, c) for (v, e), c in sorted(t.cells.items()) if c.detail and c.outcome != "ok"]
    if details:
        lines += ["", "## Details", ""] + [f"- {v} {e}: {c.outcome}: {c.detail[:300]}" for v, e, c in details]
    lines += known_section(t)
    lines += (
        ["", "## Legend", ""]
        + [f"- {k}: {v}" for k, v in LEGEND.items()]
        + ["- any other class: another failure of the run"]
    )
    return "\n".join(lines) + "\n"


def colour(outcome: str) -> str:
    return COLOURS.get(outcome, OTHER_FAILURE)


def known_section(t: HistoryTable) -> list[str]:
    """For each entry and failure it showed, what upstream already knows (configs/known_issues.yaml)."""
    known = load_known()
    seen: dict[tuple[str, str], list[str]] = {}
    for (v, e), c in sorted(t.cells.items()):
        if c.outcome not in ("ok", "not measured", "install-failed", "not-run"):
            seen.setdefault((e, c.outcome), []).append(v)
    if not seen:
        return []
    lines = ["", "## Known upstream reports", ""]
    for (e, outcome), versions in seen.items():
        text = "\n".join(t.cell(v, e).detail for v in versions)
        lines.append(f"- {e} {outcome} ({', '.join(versions)}): {known.line_for(e, outcome, text)}")
    return lines


def render_png(t: HistoryTable, path) -> None:
    """A heatmap: one row per release (oldest at the top), one column per entry, the outcome class written in each
    cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Patch

    rows, cols = len(t.versions), len(t.columns)
    img = [[to_rgb(colour(t.cell(v, c.id).outcome)) for c in t.columns] for v in t.versions]
    fig_w = 2.2 + 2.6 * cols + 3.4
    fig, ax = plt.subplots(figsize=(fig_w, 1.2 + 0.42 * rows))
    ax.imshow(img, aspect="auto", interpolation="nearest")
    for i, v in enumerate(t.versions):
        for j, c in enumerate(t.columns):
            cell = t.cell(v, c.id)
            dark = cell.outcome in ("assert-45330", "server-exited", "install-failed") or cell.outcome not in COLOURS
            ax.text(
                j,
                i,
                cell.outcome + (" ·" if cell.source == "store" else ""),
                ha="center",
                va="center",
                fontsize=8,
                color="white" if dark else "black",
            )
    ax.set_xticks(range(cols), [f"{c.id}\n{c.label}" for c in t.columns], fontsize=8)
    ax.set_yticks(range(rows), [f"vllm {v}" for v in t.versions], fontsize=8)
    ax.xaxis.tick_top()
    ax.set_xticks([x - 0.5 for x in range(1, cols)], minor=True)
    ax.set_yticks([y - 0.5 for y in range(1, rows)], minor=True)
    ax.grid(which="minor", color="white", linewidth=1.5)
    ax.tick_params(which="minor", length=0)
    seen = sorted({t.cell(v, c.id).outcome for v in t.versions for c in t.columns}, key=lambda o: (o not in COLOURS, o))
    handles = [Patch(facecolor=colour(o), edgecolor="#999999", label=o) for o in seen]
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),
        fontsize=8,
        frameon=False,
        title="outcome (· reused)",
        title_fontsize=8,
    )
    ax.set_title(f"P/D outcome by release (harness revision {t.revision})", fontsize=9, pad=28)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
