"""The driver's side of Ray, against a fake Ray: connecting, running tasks, cancelling them on an interrupt."""

import socket
import sys
import types
from types import ModuleType
from typing import Any, cast

import pytest

from harness.cluster import node, ray_tasks
from harness.cluster.ray_tasks import ClusterError, connected, import_ray, probe, run_tasks
from harness.cluster.tasks import RayAddress, TaskSpec


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_without_ray_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ClusterError, match=r"--ray needs Ray .*requirements/harness.txt"):
        import_ray()


def test_importing_ray_turns_its_usage_reporting_off(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace())
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "1")
    import_ray()
    import os

    assert os.environ["RAY_USAGE_STATS_ENABLED"] == "0"


def test_an_address_nothing_listens_on_is_said_at_once(monkeypatch):
    inits = []
    monkeypatch.setattr(ray_tasks, "import_ray", lambda: types.SimpleNamespace(init=lambda **kw: inits.append(kw)))
    addr = RayAddress("127.0.0.1", free_port(), True)
    assert "connection refused" in (probe(addr) or "")
    with (
        pytest.raises(ClusterError, match=rf"cannot reach the Ray cluster at ray://127.0.0.1:{addr.port}: conn"),
        connected(addr),
    ):
        pass
    assert inits == []  # Ray Client would have tried for 30 s


class Listening:
    def __enter__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        return RayAddress("127.0.0.1", self.sock.getsockname()[1], True)

    def __exit__(self, *exc):
        self.sock.close()


class FakeCloudpickle:
    def __init__(self):
        self.by_value = []

    def register_pickle_by_value(self, module):
        self.by_value.append(module)


def test_connecting_ships_the_node_task_by_value_and_always_disconnects():
    calls: list[object] = []
    ray = types.SimpleNamespace(
        init=lambda **kw: calls.append(("init", kw)),
        shutdown=lambda: calls.append("down"),
        cloudpickle=FakeCloudpickle(),
    )
    with Listening() as addr, pytest.MonkeyPatch.context() as m:
        m.setattr(ray_tasks, "import_ray", lambda: ray)
        with pytest.raises(RuntimeError), connected(addr):
            raise RuntimeError("boom")
    assert calls[0] == ("init", {"address": addr.url, "logging_level": "ERROR", "log_to_driver": False})
    assert calls[-1] == "down" and ray.cloudpickle.by_value == [node]


def test_ray_clients_dead_server_is_tried_again_other_failures_are_not(capsys):
    tries = []

    def init(**kw):
        tries.append(kw)
        if len(tries) == 1:
            raise ConnectionAbortedError("Initialization failure from server: Starting Ray client server failed.")

    ray = types.SimpleNamespace(init=init, shutdown=lambda: None, cloudpickle=FakeCloudpickle())
    with Listening() as addr, pytest.MonkeyPatch.context() as m:
        m.setattr(ray_tasks, "import_ray", lambda: ray)
        with connected(addr):
            pass
        assert len(tries) == 2 and "Ray issue #63202" in capsys.readouterr().err

        def refuse(**kw):
            tries.append(kw)
            raise ConnectionError("version mismatch")

        ray.init = refuse
        tries.clear()
        with (
            pytest.raises(ClusterError, match="cannot connect to the Ray cluster at ray://.*: version mismatch$"),
            connected(addr),
        ):
            pass
        assert len(tries) == 1
        with (
            pytest.raises(ClusterError, match=r"give ray://HEAD:10001\)$"),
            connected(RayAddress(addr.host, addr.port, False)),
        ):
            pass


class FakeRay:
    """Tasks finish in the order given by ``finish``; ``fail`` ids raise in ray.get; records options and cancels."""

    def __init__(self, finish, fail=(), hang=()):
        self.finish, self.fail, self.hang = list(finish), set(fail), set(hang)
        self.options, self.cancels, self.refs = [], [], {}
        self.cancelled = set()

    def remote(self, fn):
        assert fn is node.run_entry
        fake = self

        class Remote:
            def options(self, **kw):
                fake.options.append(kw)
                return self

            def remote(self, payload):
                ref = f"ref-{payload['name']}"
                fake.refs[ref] = payload
                return ref

        return Remote()

    def wait(self, refs, num_returns=1, timeout=None):
        ready = [r for r in refs if r in self.cancelled and r not in self.hang]
        for name in self.finish:
            ref = f"ref-{name}"
            if ref in refs and ref not in ready:
                ready.append(ref)
                self.finish.remove(name)
                break
        ready = ready[:num_returns]
        return ready, [r for r in refs if r not in ready]

    def get(self, ref):
        name = self.refs[ref]["name"]
        if name in self.fail:
            raise RuntimeError("WorkerCrashedError\nthe worker died")
        return {"node_ip": "10.0.0.2", "returncode": 0, "task": name}

    def cancel(self, ref, force=False):
        self.cancels.append((ref, force))
        self.cancelled.add(ref)


def spec(name, cpus=1, gpus=8):
    return TaskSpec("v", name, "gpu", cpus, gpus, ("py",), "/r", f"/runs/{name}")


def test_every_spec_is_one_task_with_its_resources_never_retried_reported_as_it_ends():
    ray = FakeRay(finish=["matrix b vllm-v", "matrix a vllm-v"], fail={"matrix b vllm-v"})
    seen: list[tuple[str, Any, str | None]] = []
    specs = [spec("a"), spec("b", 2, 0)]
    out = run_tasks(cast(ModuleType, ray), specs, lambda s, ran, err: seen.append((s.pair_id, ran, err)))
    assert ray.options == [
        {"num_cpus": 1, "num_gpus": 8, "max_retries": 0, "name": "matrix a vllm-v"},
        {"num_cpus": 2, "num_gpus": 0, "max_retries": 0, "name": "matrix b vllm-v"},
    ]
    assert [(s, err) for s, _, err in seen] == [("b", "RuntimeError: WorkerCrashedError"), ("a", None)]
    assert seen[1][1]["returncode"] == 0 and len(out) == 2 and ray.cancels == []


def test_an_interrupt_cancels_the_tasks_still_out_then_by_force_what_still_runs(monkeypatch):
    monkeypatch.setattr(ray_tasks, "_still_running", lambda ray, refs, wait_s: [r for r in refs if r in ray.hang])
    ray = FakeRay(finish=["matrix a vllm-v"], hang={"ref-matrix c vllm-v"})

    def on_done(s, ran, err):
        raise KeyboardInterrupt  # Ctrl-C as the first task ends

    with pytest.raises(KeyboardInterrupt):
        run_tasks(cast(ModuleType, ray), [spec("a"), spec("b"), spec("c")], on_done)
    assert ray.cancels == [
        ("ref-matrix b vllm-v", False),
        ("ref-matrix c vllm-v", False),
        ("ref-matrix c vllm-v", True),
    ]  # a had ended; c did not end when asked
