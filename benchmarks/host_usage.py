# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How the host spent a timed pass of ``bench_ddtree.py`` (offline rows and,
through ``bench_serve_client.py``, serve rows).

At batch 1 on a small pair both methods spend most of a step on the host, and
one config's step time has moved up to 1.5x between engine processes at the
same kernels. These figures say whether a slow process's step thread was busy
all the time (then its core was slow, or shared), starved by the hypervisor
(steal), or waiting."""

import math
import os
import time

# Fixed pure-Python work: the speed of one core, comparable across processes
# and machines of one kind.
CALIBRATION_LOOPS = 200_000


def calibration_ms(cpu: int | None = None, loops: int = CALIBRATION_LOOPS) -> float:
    """Best of three timings of a fixed pure-Python loop, in ms, on ``cpu``
    (this process pinned to it for the loop) or wherever this process runs."""
    saved = os.sched_getaffinity(0) if cpu is not None else None
    try:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})  # this thread only (Linux)
        best = math.inf
        for _ in range(3):
            start = time.perf_counter()
            acc = 0
            for i in range(loops):
                acc += i & 7
            best = min(best, time.perf_counter() - start)
    finally:
        if saved is not None:
            os.sched_setaffinity(0, saved)
    return round(best * 1e3, 3)


def thread_cpu(procs) -> dict[int, float]:
    """CPU seconds per thread id over ``procs`` (``psutil.Process``es)."""
    import psutil

    cpu = {}
    for proc in procs:
        try:
            for t in proc.threads():
                cpu[t.id] = t.user_time + t.system_time
        except psutil.Error:  # ended meanwhile
            continue
    return cpu


def thread_info(tid: int) -> tuple[str | None, int | None]:
    """A thread's own name and the CPU it last ran on (Linux: a thread id
    reads as a process); (None, None) once it has ended."""
    import psutil

    try:
        task = psutil.Process(tid)
        return task.name(), task.cpu_num()
    except psutil.Error:
        return None, None


class HostUsage:
    """Started just before a timed pass, stopped just after it. Of the whole
    machine: the share of CPU time the hypervisor took (steal) and the CPUs
    kept busy (steal not counted); of the engine's process tree (``root_pid``'s
    and its children, e.g. a multiprocess engine core or a server's): the two
    busiest threads' CPU time over the pass (a host-bound step loop runs one
    thread near 100 %); and, after the pass, the calibration loop on the CPU
    the busiest thread last ran on."""

    def __init__(self, root_pid: int | None = None):
        import psutil

        self._procs = process_tree(psutil.Process(root_pid))
        self._threads = thread_cpu(self._procs)
        self._times = psutil.cpu_times()
        self._start = time.perf_counter()

    def stop(self, timed_s: float | None = None, warmups: int = 0) -> dict:
        """``timed_s``: the timed part of the window, if known (``vllm bench
        serve``'s duration); the threads' busy shares are taken over it.
        ``warmups``: warm-up requests the window holds outside ``timed_s``
        (their CPU time is in the threads' shares), recorded as such."""
        import psutil

        wall = time.perf_counter() - self._start
        times = psutil.cpu_times()
        spent = {f: getattr(times, f) - getattr(self._times, f) for f in times._fields}
        # guest time is counted in user time already (Linux /proc/stat).
        total = sum(v for f, v in spent.items() if f not in ("guest", "guest_nice"))
        steal = spent.get("steal", 0.0)
        idle = spent.get("idle", 0.0) + spent.get("iowait", 0.0)
        after = thread_cpu(self._procs)
        deltas = sorted(
            ((cpu - self._threads.get(tid, 0.0), tid) for tid, cpu in after.items()),
            reverse=True,
        )
        (top, top_tid), (second, second_tid) = [*deltas, (0.0, None), (0.0, None)][:2]
        top_name, top_cpu = thread_info(top_tid) if top_tid else (None, None)
        second_name = thread_info(second_tid)[0] if second_tid else None
        timed = min(wall, timed_s) if timed_s else wall

        def share(cpu_s: float) -> float | None:
            return round(100 * cpu_s / timed, 1) if timed > 0 else None

        try:
            calibration = calibration_ms(top_cpu)
        except OSError:  # that CPU is outside this process's cpuset
            top_cpu, calibration = None, calibration_ms()
        return {
            "wall_s": round(wall, 3),
            "timed_s": round(timed, 3),
            "warmup_requests": warmups,
            "calibration_ms": calibration,
            "calibration_cpu": top_cpu,
            "steal_pct": round(100 * steal / total, 2) if total > 0 else None,
            "busy_cpus": round((total - idle - steal) / wall, 2) if wall > 0 else None,
            "step_thread": top_name,
            "step_thread_cpu_s": round(top, 3),
            "step_thread_busy_pct": share(top),
            # Behind vllm serve: often the API server's busiest thread.
            "next_thread": second_name,
            "next_thread_busy_pct": share(second),
        }


def process_tree(root) -> list:
    """``root`` (a ``psutil.Process``) and all its descendants."""
    return [root, *root.children(recursive=True)]


def parse_cpu_list(text: str, limit: int | None = None) -> set[int]:
    """A CPU list in taskset / numactl syntax (``"2-4,7"``) as a set of CPU
    ids, none above ``limit``; ``ValueError`` names what is wrong."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not _ascii_number(lo) or (sep and not _ascii_number(hi)):
            raise ValueError(f"bad CPU list {text!r} (want e.g. '2-4' or '2,3,7')")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"bad CPU list {text!r}: range {part} runs backwards")
        if limit is not None and last > limit:
            raise ValueError(f"CPU {last} does not exist here (the last is {limit})")
        cpus.update(range(first, last + 1))
    return cpus


def _ascii_number(text: str) -> bool:
    return text.isascii() and text.isdecimal()


def format_cpu_list(cpus) -> str:
    """The inverse of :func:`parse_cpu_list`, ranges merged: ``{2, 3, 4, 7}``
    -> ``"2-4,7"``."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][-1] + 1:
            runs[-1].append(cpu)
        else:
            runs.append([cpu])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def pin_process_tree(root_pid: int, cpus: set[int], passes: int = 5) -> int:
    """Every thread of ``root_pid``'s process tree onto ``cpus`` (Linux sets
    affinity per thread; threads started later inherit their creator's).
    Walks the tree again until a walk finds every thread there already (a
    thread or process started during a walk by one not yet pinned would keep
    the old CPUs). Returns the threads on ``cpus``; ones that end meanwhile
    are skipped. ``RuntimeError`` if the tree is not settled after
    ``passes`` walks; ``OSError`` (e.g. CPUs outside the server's cgroup) and
    ``psutil.Error`` (the root gone) pass through."""
    import psutil

    root = psutil.Process(root_pid)
    for _ in range(passes):
        moved = on_cpus = 0
        for proc in process_tree(root):
            try:
                threads = proc.threads()
            except psutil.Error:  # ended meanwhile
                continue
            for thread in threads:
                try:
                    if os.sched_getaffinity(thread.id) != cpus:
                        os.sched_setaffinity(thread.id, cpus)
                        moved += 1
                except ProcessLookupError:
                    continue
                on_cpus += 1
        if not moved:
            return on_cpus
    raise RuntimeError(f"threads of process {root_pid} kept appearing off {cpus}")
