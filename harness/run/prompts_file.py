"""prompts.json in a run folder: every prompt the run sent, so that a repro bundle can replay any request of it.

The sequential prompts are text for the harness's own models (the servers tokenize them; the bundle asks the
baseline's /tokenize and sends the ids to both sides) and token ids for any other model (built to their intended
lengths in its tokenizer, run/prompt_fit.py); ``sequential_tokens`` records each one's length in tokens where it is
exact. The load and prefix-cache prompts are already token ids (made with the served tokenizer).
"""

from __future__ import annotations

import json
from pathlib import Path

from harness.run.context import RunContext

PROMPTS_FILE = "prompts.json"


def write_prompts(ctx: RunContext, run_dir: Path) -> None:
    data = {
        "sequential": {p.id: p.payload for p in ctx.prompts},
        "sequential_tokens": {p.id: len(p.ids) for p in ctx.prompts if p.ids is not None},
        "load": dict(ctx.load_prompts),
        "prefix": dict(ctx.prefix_prompts),
    }
    (Path(run_dir) / PROMPTS_FILE).write_text(json.dumps(data) + "\n")


def read_prompts(run_dir: Path) -> dict[str, str | list[int]]:
    """Every prompt of the run by its id (sequential, load and prefix-cache ids do not overlap); {} without a file."""
    try:
        data = json.loads((Path(run_dir) / PROMPTS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for part in ("sequential", "load", "prefix") for k, v in (data.get(part) or {}).items()}
