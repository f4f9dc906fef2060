"""--fault hold-between-hops: the proxy marks a held request in --hold-dir by its id, and a client's X-Request-Id
(``../x/y``, ``/abs``) never makes it write outside that folder."""

import asyncio
from pathlib import Path

import pytest

from harness.core.safe import file_stem
from harness.hosts.faults import GO, HELD
from harness.proxy.app import hold_until_released
from tests.unit.proxy.fakes import client


async def held(hold: Path, rid: str, limit_s: float) -> None:
    """The between-hops hook for ``rid`` (asyncio.run and create_task take a coroutine; the hook is an Awaitable)."""
    await hold_until_released(hold, limit_s=limit_s)(rid)


def files_under(root):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


@pytest.mark.parametrize("rid", ["../x/y", "../../escaped", "/tmp/abs-escape", "..", "a/../../b", "ok-id"])
def test_a_request_id_never_leaves_the_hold_folder(tmp_path, rid):
    hold = tmp_path / "hold"
    hold.mkdir()
    asyncio.run(held(hold, rid, limit_s=0))
    assert files_under(tmp_path) == ["hold", f"hold/{file_stem(rid)}{HELD}"]


def test_the_hold_is_released_by_the_go_file_of_the_same_name(tmp_path):
    """The net-fault cutter (hosts/faults.py) answers <stem>.go for the <stem>.held it sees."""
    hold = tmp_path / "hold"
    hold.mkdir()

    async def main():
        task = asyncio.create_task(held(hold, "../x/y", limit_s=30))
        for _ in range(500):
            if list(hold.glob(f"*{HELD}")) or task.done():
                break
            await asyncio.sleep(0.01)
        assert not task.done(), task.exception()
        (hold / (list(hold.glob(f"*{HELD}"))[0].name[: -len(HELD)] + GO)).touch()
        await asyncio.wait_for(task, 5)

    asyncio.run(main())


def test_a_hostile_request_id_through_the_proxy(b, tmp_path):
    hold = tmp_path / "hold"
    hold.mkdir()
    with client(b, between_hops=hold_until_released(hold, limit_s=0)) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"}, headers={"X-Request-Id": "../outside/y"})
    assert r.status_code == 200
    assert not (tmp_path / "outside").exists()
    assert [p.name for p in hold.iterdir()] == [f"{file_stem('../outside/y')}{HELD}"]
