"""The rank pool (tests/pool.py) that runs the multi-rank tests: ranks set up as by torchrun,
per-case environment and output, megatron state torn down between cases, failures reported
with the test, the rank and its traceback, hung cases killed and the pool restarted."""
from __future__ import annotations

import pytest

from tests.pool import CaseFailed

CHECKS = "tests.multirank.pool_checks"


def test_ranks_look_like_a_torchrun_launch(pools):
    values = pools.run(2, f"{CHECKS}:whoami", "x", env={"POOL_CASE_VAR": "set"})
    assert [v["rank"] for v in values] == [0, 1]
    assert [v["env_rank"] for v in values] == ["0", "1"]
    for v in values:
        assert v["world"] == 2 and v["sum"] == 3 and v["local_world"] == "2"
        assert v["cpu_runtime"] and v["cuda_device"] == "cpu"   # the CPU host runtime
        assert v["case_var"] == "set" and v["tag"] == "x"
    # the case's variables are gone for the next case, which runs in the same processes
    again = pools.run(2, f"{CHECKS}:whoami", "y")
    assert [v["case_var"] for v in again] == [None, None]
    assert [v["pid"] for v in again] == [v["pid"] for v in values]


def test_script_case_exit_code_and_output(pools, tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import sys\nfrom tests.multirank.pool_checks import write_and_exit\n"
                      "if __name__ == '__main__':\n"
                      "    print('argv', sys.argv[1:])\n"
                      "    write_and_exit(int(sys.argv[1]))\n")
    run = pools.script(2, str(script), "3", check=False)
    assert run.returncode == 3 and [r.exit_code for r in run.ranks] == [3, 3]
    assert run.stdout.splitlines() == ["argv ['3']", "to stdout"]
    assert run.ranks[1].stderr.strip() == "to stderr"
    assert pools.script(2, str(script), "0").returncode == 0


def test_a_script_ending_with_a_live_thread_pool_exits_and_the_next_pool_works(pools, tmp_path):
    """A script that keeps a concurrent.futures thread pool referenced (transformers' weight
    loading does) ends through exit_process: its idle workers are not joined (the case used to
    hang until its timeout), and thread pools still work in the next case."""
    script = tmp_path / "script.py"
    script.write_text("import concurrent.futures, sys\n"
                      "from engine.cli import exit_process\n"
                      "KEPT = concurrent.futures.ThreadPoolExecutor(2)\n"
                      "if __name__ == '__main__':\n"
                      "    sys.modules['__kept_pool__'] = KEPT\n"
                      "    print(sum(KEPT.map(abs, [-1, -2])))\n"
                      "    exit_process(int(sys.argv[1]))\n")
    run = pools.script(2, str(script), "0", timeout=60)
    assert run.returncode == 0 and run.stdout.splitlines() == ["3"]
    assert pools.script(2, str(script), "4", timeout=60, check=False).returncode == 4


def test_megatron_state_is_torn_down_between_cases(pools):
    first = pools.run(2, f"{CHECKS}:megatron_layout", 2, 1)
    second = pools.run(2, f"{CHECKS}:megatron_layout", 1, 2)
    third = pools.run(2, f"{CHECKS}:megatron_layout", 2, 1)
    for values, (tp, pp) in ((first, (2, 1)), (second, (1, 2)), (third, (2, 1))):
        assert all(not v["initialized_before"] for v in values)
        assert all((v["tp"], v["pp"]) == (tp, pp) for v in values)
    # process groups of earlier cases are destroyed, not accumulated
    assert [v["groups"] for v in third] == [v["groups"] for v in first]


def test_failure_names_the_test_the_rank_and_its_traceback(pools):
    with pytest.raises(CaseFailed) as info:
        pools.run(2, f"{CHECKS}:raise_on_rank", 1)
    message = str(info.value)
    assert "test_pool.py::test_failure_names_the_test_the_rank_and_its_traceback" in message
    assert "raised on rank 1" in message and "===== rank 1: raised =====" in message
    assert "Traceback (most recent call last)" in message
    assert "ValueError: deliberate failure on rank 1" in message
    assert "===== rank 0: exit code 0 =====" in message
    # the next case runs (on fresh processes)
    assert [v["rank"] for v in pools.run(2, f"{CHECKS}:whoami", "after")] == [0, 1]


def test_ranks_left_waiting_by_a_failed_rank_are_killed_with_their_stack(pools, monkeypatch):
    monkeypatch.setattr("tests.pool.FAILURE_GRACE_S", 3.0)
    with pytest.raises(CaseFailed) as info:
        pools.run(2, f"{CHECKS}:raise_on_rank", 1, wait_in_barrier=True)
    message = str(info.value)
    assert "raised on rank 1" in message and "rank 0 still running" in message
    assert "===== rank 0: killed (stack below) =====" in message
    assert "in raise_on_rank" in message.split("===== rank 0")[1]   # faulthandler's dump
    assert pools.run(2, f"{CHECKS}:whoami", "after")[1]["rank"] == 1


def test_hung_case_is_killed_after_its_timeout_and_the_pool_restarts(pools):
    pool = pools.get(2)
    before = pools.run(2, f"{CHECKS}:whoami", "before")
    starts = pool.starts
    with pytest.raises(CaseFailed) as info:
        pools.run(2, f"{CHECKS}:hang", timeout=3)
    message = str(info.value)
    assert "test_hung_case_is_killed_after_its_timeout_and_the_pool_restarts" in message
    assert "timed out after 3 s" in message and "about to hang" in message
    assert "in hang" in message   # the stack of the hung rank
    after = pools.run(2, f"{CHECKS}:whoami", "after")
    assert pool.starts == starts + 1
    assert not {v["pid"] for v in after} & {v["pid"] for v in before}
    assert [v["sum"] for v in after] == [3, 3]


def test_own_world_case_starts_and_ends_its_own_process_group(pools, tmp_path):
    """`own_world`: the case's script starts torch.distributed from torchrun's variables and
    destroys it at its end, as a launched script does; the pool's group comes back after."""
    script = tmp_path / "own.py"
    script.write_text(
        "import os, torch, torch.distributed as dist\n"
        "from parallel.process_groups import init_distributed\n"
        "assert not dist.is_initialized()\n"
        "rank, world = init_distributed()\n"
        "t = torch.tensor([rank + 1]); dist.all_reduce(t)\n"
        "print('sum', int(t), 'port', os.environ['MASTER_PORT'])\n"
        "dist.destroy_process_group()\n")
    before = pools.run(2, f"{CHECKS}:whoami", "before")
    run = pools.script(2, str(script), own_world=True)
    assert run.stdout.startswith("sum 3 port ")
    after = pools.run(2, f"{CHECKS}:whoami", "after")
    assert [v["sum"] for v in after] == [3, 3]
    assert [v["pid"] for v in after] == [v["pid"] for v in before]   # the same processes


def test_forked_ranks_draw_their_own_seeds_and_report_their_exit_code(pools):
    """The ranks are forked from the session's zygote (tests/pool_zygote.py), which imported
    the heavy modules once: each rank draws its own random, numpy and torch seeds as a new
    interpreter would, and a rank that ends its process reports its exit code."""
    import os

    values = pools.run(3, f"{CHECKS}:seeds_and_pid")
    assert all(v["ppid"] != os.getpid() for v in values)   # not started by this process
    for key in ("random", "numpy", "torch"):
        assert len({v[key] for v in values}) == 3, key
    with pytest.raises(CaseFailed) as info:
        pools.run(3, f"{CHECKS}:exit_now", 7, 2, timeout=60)
    assert "rank 2 process died (exit code 7; host: " in str(info.value)
    assert [v["rank"] for v in pools.run(3, f"{CHECKS}:whoami", "after")] == [0, 1, 2]


def test_idle_pools_are_closed_when_the_host_runs_low_on_memory(monkeypatch):
    """RankPools._make_room, before every case: idle pools (least recently used first) are
    closed while the live ranks pass max_ranks or the host's available memory is below the
    floor plus a share per rank of the case; a pool running a case in another thread is
    kept. Fake pools: nothing is started."""
    import threading

    import tests.pool as pool_mod

    class Fake:
        def __init__(self, world, last_used):
            self.world, self.last_used, self.alive = world, last_used, True
            self.lock = threading.RLock()

        def close(self):
            self.alive = False

    pools = pool_mod.Pools(max_ranks=16)
    two, four, eight = Fake(2, 1.0), Fake(4, 2.0), Fake(8, 3.0)
    pools._pools = {2: two, 4: four, 8: eight}
    monkeypatch.setattr(pool_mod, "_log_case", lambda *a, **k: None)
    plenty = pool_mod.MEMORY_FLOOR_BYTES + 64 * pool_mod.MEMORY_PER_RANK_BYTES
    monkeypatch.setattr(pool_mod, "available_memory", lambda: plenty)
    pools._make_room(8, counted=False)   # 14 live ranks, memory to spare: nothing closed
    assert [p.alive for p in (two, four, eight)] == [True, True, True]
    # low until the 4-rank pool is closed: the two least recently used go
    monkeypatch.setattr(pool_mod, "available_memory", lambda: 0 if four.alive else plenty)
    pools._make_room(8, counted=False)
    assert [p.alive for p in (two, four, eight)] == [False, False, True]
    busy, idle = Fake(2, 1.0), Fake(4, 2.0)
    pools._pools = {2: busy, 4: idle, 8: eight}
    monkeypatch.setattr(pool_mod, "available_memory", lambda: 0)
    held = threading.Event()
    release = threading.Event()

    def run_case():
        with busy.lock:
            held.set()
            release.wait(10)

    worker = threading.Thread(target=run_case)
    worker.start()
    held.wait(10)
    try:
        pools._make_room(8, counted=False)   # the busy one is skipped, the idle one closed
    finally:
        release.set()
        worker.join()
    assert (busy.alive, idle.alive) == (True, False)
    # the rank count still applies: a new 8-rank pool beside 14 live ranks closes the oldest
    a, b = Fake(8, 1.0), Fake(6, 2.0)
    pools._pools = {8: a, 6: b, 2: Fake(2, 0.0)}
    pools._pools[2].alive = False
    monkeypatch.setattr(pool_mod, "available_memory", lambda: plenty)
    pools._make_room(4, counted=True)
    assert (a.alive, b.alive) == (False, True)
