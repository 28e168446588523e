from bench.profile import EVENT_LOOP, aggregate, table

LOOP = (
    "process 1:python -m mesh coordinator;<module> (mesh/__main__.py:7);Runner.run (asyncio/runners.py:118)"
)
THREAD = (
    "process 1:python -m mesh coordinator;thread_run (libpython3.11.so.1.0);Thread.run (threading.py:982)"
)
LOCK = "PyThread_acquire_lock_timed (libpython3.11.so.1.0);0x7f00 (libc.so.6)"
RAW = f"""\
{LOOP};Authorization.Check (coordinator/ext_authz.py:40);_write (grpc/aio/_call.py:500);sendmsg (libc.so.6) 6
{LOOP};Authorization.Check (coordinator/ext_authz.py:41);KvAffinity.pick (coordinator/scheduling/kv_affinity.py:9) 3
{LOOP};epoll_wait (libc.so.6) 10
{LOOP};sendmsg (libc.so.6) 1
process 2:tokenizer worker;Thread.run (threading.py:982);Condition.wait (threading.py:320);0x7f00 (libc.so.6) 5
{THREAD};_worker (concurrent/futures/thread.py:81);_queue_SimpleQueue_get (_queuemodule.c.h:177);{LOCK} 7
"""


def test_waiting_samples_are_not_busy_and_a_function_counts_once_per_sample_whatever_its_line():
    total, busy, inclusive, innermost = aggregate(RAW)
    # epoll, a blocked Condition.wait and a thread pool's idle worker (unsymbolized libc below them) are waits
    assert (total, busy) == (32, 10)
    assert not any("_worker" in f for f in innermost)
    assert inclusive["Authorization.Check (coordinator/ext_authz.py)"] == 9  # lines 40 and 41 merged
    assert innermost["_write (grpc/aio/_call.py)"] == 6  # with the sendmsg it called
    assert innermost["KvAffinity.pick (coordinator/scheduling/kv_affinity.py)"] == 3
    assert innermost[EVENT_LOOP] == 1  # nothing in Python below the event loop
    assert not any("runners.py" in f or "mesh/__main__" in f for f in inclusive)  # entry frames left out


def test_the_table_reports_the_busy_share_and_the_top_frames():
    text = table("coordinator", RAW, 5)
    assert "busy in 10 of 32 samples (31%)" in text
    assert (
        "| `Authorization.Check (coordinator/ext_authz.py)` | 90.0% | `_write (grpc/aio/_call.py)` | 60.0% |"
        in text
    )
    assert table("idle", f"{LOOP};epoll_wait (libc.so.6) 4\n", 5) == "**idle**: no busy samples."
