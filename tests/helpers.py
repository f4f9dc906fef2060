"""Shared test helpers."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil

from harness.serve.ports import PortAllocator
from harness.serve.procs import RUN_TAG_ENV

# `make test-full`: the tests beyond CI's representative cut (marked `full`, tests/conftest.py) run too.
FULL = os.environ.get("PD_HARNESS_FULL") == "1"


def processes_tagged(logs_dir: Path) -> list[int]:
    """PIDs of live processes that a harness run with this logs folder started."""
    tag = str(logs_dir)
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get(RUN_TAG_ENV) == tag and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.Error:
            pass
    return out


def config_only_hf_cache(home: Path) -> Path:
    """A Hugging Face cache at ``home`` with each hub model of configs/models.yaml as a config-only snapshot (what a
    simulated GPU box plans from: the heads, no weights)."""
    from harness.models.config import load_models

    for e in load_models().models:
        if not e.hub_id:
            continue
        repo = home / "hub" / ("models--" + e.hub_id.replace("/", "--"))
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text("simulated")
        snap = repo / "snapshots" / "simulated"
        snap.mkdir(parents=True)
        hd = 64 if e.mla or not e.head_dim else e.head_dim
        cfg = {
            "model_type": e.family or "llama",
            "num_attention_heads": e.attention_heads,
            "num_key_value_heads": e.kv_heads,
            "hidden_size": e.attention_heads * hd,
            "head_dim": hd,
        }
        if e.mla:
            cfg.update(kv_lora_rank=512, qk_rope_head_dim=64)
        (snap / "config.json").write_text(json.dumps(cfg))
    return home


def tiny_server_setup() -> tuple:
    """(config, tiny model path, block size, P's and D's CPU binding) for tests that start their own servers."""
    import sys

    from harness.models.tiny import ensure_tiny_model
    from harness.run.config import E2EConfig
    from harness.serve.vllm_cmd import plan_cpu_binding

    cfg = E2EConfig(python=sys.executable)
    return cfg, str(ensure_tiny_model()), cfg.block_sizes()[0], plan_cpu_binding(os.cpu_count() or 1, [1, 1])


def config_error(load, path: Path, text: str) -> str:
    """The ConfigError message that ``load`` gives for a config file holding ``text``."""
    import pytest

    from harness.core.errors import ConfigError

    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load(path)
    return str(e.value)


class TextServer:
    """An HTTP stand-in on 127.0.0.1 at an allocated port: every GET answers 200 with ``body()`` (e.g. a server's
    /metrics text, read after read). ``close`` stops it and frees the port."""

    def __init__(self, body: Callable[[], str]):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                data = body().encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.alloc = PortAllocator()
        self.port = self.alloc.port()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.alloc.close()
