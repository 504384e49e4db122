"""The fault injectors themselves (FaultyStore, FaultyFileSystem) and the retry policy, on a fake clock."""

from __future__ import annotations

import errno
import random
import secrets
import threading

import pytest

from tierckpt.errors import CheckpointError, CorruptCheckpointError, StorageError
from tierckpt.storage.faulty import FaultPlan, FaultyFileSystem, FaultyStore
from tierckpt.storage.retry import Cancelled, DeadlineExceeded, RetryPolicy, is_transient


def test_nth_call_fails_and_calls_are_counted(make_store):
    store = FaultyStore(make_store("memory"), fail={"write_bytes": [2, 4]})
    store.write_bytes("a", b"1")
    with pytest.raises(ConnectionError, match="write_bytes call 2"):
        store.write_bytes("b", b"2")
    store.write_bytes("c", b"3")
    with pytest.raises(ConnectionError):
        store.write_bytes("d", b"4")
    store.write_bytes("e", b"5")
    assert store.calls["write_bytes"] == 5 and store.plan.failures["write_bytes"] == 2
    assert store.list("") == ["a", "c", "e"]  # a failed call never reaches the inner store


def test_fail_all_and_custom_error(make_store):
    store = FaultyStore(make_store("local"), fail={"size": "all"}, error_factory=lambda op, n: PermissionError(op))
    store.write_bytes("x", b"1")
    for _ in range(3):
        with pytest.raises(PermissionError):
            store.size("x")
    assert store.local_path is None  # never bypassed with OS calls
    assert store.atomic_rename  # but the commit protocol is the inner store's


def test_fraction_is_repeatable():
    def pattern(seed: int) -> list[bool]:
        plan = FaultPlan(fail_fraction=0.3, seed=seed)
        out = []
        for _ in range(200):
            try:
                plan.hit("op")
                out.append(False)
            except ConnectionError:
                out.append(True)
        return out

    a = pattern(1)
    assert a == pattern(1) and a != pattern(2)
    assert 30 < sum(a) < 90


def test_fraction_limited_to_some_ops():
    plan = FaultPlan(fail_fraction=1.0, fraction_ops=["write"])
    plan.hit("read")
    with pytest.raises(ConnectionError):
        plan.hit("write")


def test_stall_sleeps_the_planned_calls():
    slept = []
    plan = FaultPlan(stall={"write_bytes": 5.0, "read_bytes": (2.0, [2])})
    plan.sleep = slept.append
    plan.hit("write_bytes")
    plan.hit("read_bytes")
    plan.hit("read_bytes")
    plan.hit("read_bytes")
    assert slept == [5.0, 2.0]


def test_stream_faults_abort_the_stream(make_store):
    inner = make_store("posix_remote")
    store = FaultyStore(inner, fail={"write": [2]})
    w = store.open_write("f")
    w.write(b"abc")
    with pytest.raises(ConnectionError):
        w.write(b"def")
    w.abort()
    assert not inner.exists("f")


def test_short_writes_and_read_faults(make_store):
    store = FaultyStore(make_store("memory"), short_writes=True, fail={"read": [2]})
    with store.open_write("s") as w:
        w.write(b"12345678")
    store.write_bytes("t", b"abcd")
    assert store.size("s") == 4 and store.read_bytes("t", max_size=10) == b"ab"
    with store.open_read("s") as f:
        assert f.read(2) == b"12"
        with pytest.raises(ConnectionError):
            f.read(2)


@pytest.mark.parametrize("field", ["fail", "stall", "fraction_ops"])
@pytest.mark.parametrize("make", ["plan", "store", "filesystem"])
def test_a_plan_refuses_an_operation_no_store_has(field, make):
    """A misspelt operation would never fail or stall: the plan refuses it, naming it and the known ones."""
    import fsspec

    arg = {"fail": {"write_bytes": [1], "wirte_bytes": [1]}, "stall": {"wirte_bytes": 1.0},
           "fraction_ops": ["wirte_bytes"]}[field]
    if make == "plan":
        build, known = (lambda **kw: FaultPlan(**kw)), FaultyStore.OPS | FaultyFileSystem.OPS
    elif make == "store":
        build, known = (lambda **kw: FaultyStore(None, **kw)), FaultyStore.OPS  # type: ignore[arg-type]
    else:
        build, known = (lambda **kw: FaultyFileSystem(fsspec.filesystem("memory"), **kw)), FaultyFileSystem.OPS
    if make == "filesystem" and field == "fail":
        arg = {"cat_file": [1], "wirte_bytes": [1]}
    with pytest.raises(ValueError, match=f"{field} names an unknown operation 'wirte_bytes'") as err:
        build(**{field: arg})
    assert err.value.args[0].endswith("known: " + ", ".join(sorted(known)))


def test_each_wrapper_accepts_only_its_own_operations():
    import fsspec

    assert "cat_file" not in FaultyStore.OPS and "write_bytes" not in FaultyFileSystem.OPS
    with pytest.raises(ValueError, match="'cat_file'"):
        FaultyStore(None, stall={"cat_file": 1.0})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'write_bytes'"):
        FaultyFileSystem(fsspec.filesystem("memory"), fail={"write_bytes": "all"})
    for op in FaultyFileSystem.OPS:
        FaultyFileSystem(fsspec.filesystem("memory"), fail={op: "all"}, stall={op: 0.0}, fraction_ops=[op])
    FaultPlan(fail={"cat_file": [1], "write_bytes": [1]})  # a bare plan: any wrapper's operations


def test_every_store_operation_goes_through_the_plan(make_store):
    """Each name in ``FaultyStore.OPS`` is really counted by a call of that name (and only those names are)."""
    calls = {
        "list": lambda s: s.list(""),
        "exists": lambda s: s.exists("x"),
        "size": lambda s: s.size("x"),
        "read_bytes": lambda s: s.read_bytes("x", max_size=10),
        "readinto": lambda s: s.readinto("x", 0, memoryview(bytearray(1))),
        "open_read": lambda s: s.open_read("x"),
        "read": lambda s: s.open_read("x").read(1),
        "makedirs": lambda s: s.makedirs("d"),
        "open_write": lambda s: s.open_write("y"),
        "write": lambda s: s.open_write("y").write(b"1"),
        "close": lambda s: s.open_write("y").close(),
        "write_bytes": lambda s: s.write_bytes("y", b"1"),
        "remove": lambda s: s.remove("x"),
        "replace_dir": lambda s: s.replace_dir("d", "e"),
        "sync_dir": lambda s: s.sync_dir(""),
    }
    assert set(calls) == FaultyStore.OPS
    inner = make_store("memory")
    inner.write_bytes("x", b"abc")
    for op, call in calls.items():
        store = FaultyStore(inner, fail={op: "all"})
        with pytest.raises(ConnectionError, match=f"injected fault: {op} call 1"):
            call(store)
        assert store.plan.failures == {op: 1}


def test_faulty_filesystem_with_fsspec_store():
    import fsspec

    from tierckpt.storage.fsspec_store import FsspecStore

    fs = FaultyFileSystem(fsspec.filesystem("memory"), fail={"cat_file": [2], "write": [1]},
                          stall={"ls": 0.0})
    store = FsspecStore(f"memory://ffs-{secrets.token_hex(4)}/root", fs=fs)
    store.write_bytes("a", b"hello")
    assert store.read_bytes("a", max_size=10) == b"hello"
    with pytest.raises(ConnectionError):
        store.read_bytes("a", max_size=10)
    w = store.open_write("b")
    with pytest.raises(ConnectionError):
        w.write(b"x")
    w.abort()
    assert store.list("") == ["a"] and fs.calls["ls"] == 1 and fs.calls["open"] == 1
    fs.fs.rm(store.root.split("/")[1], recursive=True)


# --- retry policy ----------------------------------------------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def _flaky(failures: int, exc: BaseException):
    calls = {"n": 0}

    def fn():
        calls["n"] += 1
        if calls["n"] <= failures:
            raise exc
        return calls["n"]

    return fn, calls


def test_backoff_schedule_without_jitter():
    clock = FakeClock()
    policy = RetryPolicy(attempts=5, base_delay_s=0.1, max_delay_s=0.3, jitter=0.0)
    fn, calls = _flaky(4, ConnectionResetError("reset"))
    seen = []
    assert policy.call(fn, clock=clock, sleep=clock.sleep, on_retry=lambda k, e, d: seen.append(k)) == 5
    assert clock.sleeps == pytest.approx([0.1, 0.2, 0.3, 0.3]) and seen == [1, 2, 3, 4]


def test_jitter_shortens_delays_within_bounds():
    policy = RetryPolicy(base_delay_s=1.0, max_delay_s=100, jitter=0.5)
    rng = random.Random(0)
    delays = [policy.delay(3, rng) for _ in range(100)]
    assert all(2.0 <= d <= 4.0 for d in delays) and len(set(delays)) > 50


def test_attempts_run_out():
    clock = FakeClock()
    fn, calls = _flaky(10, TimeoutError("slow"))
    with pytest.raises(TimeoutError):
        RetryPolicy(attempts=3, jitter=0).call(fn, clock=clock, sleep=clock.sleep)
    assert calls["n"] == 3


def test_permanent_errors_are_not_retried():
    for exc in (FileNotFoundError("x"), PermissionError("x"), CorruptCheckpointError("bad"), ValueError("x"),
                OSError(errno.EINVAL, "invalid argument"), OSError(errno.ENOSPC, "full")):
        fn, calls = _flaky(1, exc)
        with pytest.raises(type(exc)):
            RetryPolicy().call(fn, sleep=lambda s: None)
        assert calls["n"] == 1, exc


def test_deadline_cuts_retries_short():
    clock = FakeClock()
    fn, calls = _flaky(100, ConnectionError("down"))
    policy = RetryPolicy(attempts=100, base_delay_s=1.0, max_delay_s=1.0, jitter=0.0, deadline_s=3.5)
    with pytest.raises(DeadlineExceeded) as ei:
        policy.call(fn, clock=clock, sleep=clock.sleep)
    assert isinstance(ei.value.__cause__, ConnectionError)
    assert clock.now <= 3.5 and calls["n"] == 4


def test_cancel_interrupts_the_sleep():
    cancel = threading.Event()
    fn, _ = _flaky(100, ConnectionError("down"))
    threading.Timer(0.05, cancel.set).start()
    with pytest.raises(Cancelled):
        RetryPolicy(attempts=100, base_delay_s=10.0, jitter=0.0).call(fn, cancel=cancel)


class _ClientError(Exception):
    """Looks like botocore's ClientError (``.response`` with a code and an HTTP status)."""

    def __init__(self, code: str, status: int) -> None:
        super().__init__(code)
        self.response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}


class EndpointConnectionError(Exception):
    pass


class ReadTimeoutError(Exception):
    pass


@pytest.mark.parametrize("exc,transient", [
    (ConnectionResetError(), True),
    (TimeoutError(), True),
    (OSError(errno.EIO, "io"), True),
    (OSError(errno.EBUSY, "SlowDown"), True),  # how s3fs reports SlowDown / 503
    (OSError("no errno"), True),
    (_ClientError("SlowDown", 503), True),
    (_ClientError("Throttling", 400), True),
    (_ClientError("InternalError", 500), True),
    (_ClientError("AccessDenied", 403), False),
    (_ClientError("NoSuchBucket", 404), False),
    (EndpointConnectionError(), True),
    (ReadTimeoutError(), True),
    (FileNotFoundError(), False),
    (PermissionError(), False),
    (OSError(errno.EINVAL, "bad"), False),
    (StorageError("x"), False),
    (CheckpointError("x"), False),
    (KeyError("x"), False),
])
def test_classification(exc, transient):
    assert is_transient(exc) is transient


def test_classification_follows_the_cause():
    try:
        try:
            raise ConnectionResetError("peer")
        except ConnectionResetError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert is_transient(outer)
