"""What a run asks of one server: refused when it cannot be a server, and its label naming the process, not the role."""

import pytest

from harness.core.errors import ConfigError
from harness.run.config import E2EConfig
from harness.run.launch import WantedServer, kv_digest_dir, make_server
from harness.serve.ports import PortAllocator


@pytest.mark.parametrize(
    ("role", "tp", "match"),
    [
        ("proxy", 1, "role must be one of prefill, decode, baseline, got 'proxy'"),
        ("decode", 0, "tp must be >= 1, got 0"),
    ],
)
def test_a_server_that_cannot_be_is_refused_in_one_line(role, tp, match):
    with pytest.raises(ConfigError, match=match) as e:
        WantedServer(role=role, tp=tp, model="/m", served_name="m", block_size=32, cpu_bind=None)
    assert "\n" not in str(e.value)


def test_a_label_names_the_process_its_log_and_digests_while_the_role_decides_the_server(tmp_path):
    want = WantedServer(
        role="decode", tp=1, model="/m", served_name="m", block_size=32, cpu_bind=None, label="decode-recompute"
    )
    with PortAllocator(lock_dir=tmp_path / "locks") as alloc:
        srv = make_server(E2EConfig(python="/py"), alloc, want, tmp_path / "logs")
    spec = srv.proc.spec
    assert spec.name == "decode-recompute" and spec.log_path == tmp_path / "logs" / "decode-recompute.log"
    assert srv.spec.kv_digest_dir == str(kv_digest_dir(tmp_path / "logs", "decode-recompute"))
    assert srv.spec.role == "decode" and '"kv_role":"kv_consumer"' in srv.command
    unlabelled = WantedServer(role="decode", tp=1, model="/m", served_name="m", block_size=32, cpu_bind=None)
    assert unlabelled.name == "decode"
