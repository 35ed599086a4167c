"""Redis Streams as a feed and a results sink ; the optional extra `trio-tasksets[redis]`.

* `RedisStreamTaskset(url, stream, group, consumer)`: a streaming taskset over a consumer group.
  Each pull of its `stream()` claims **at most one** entry, and only when the runner pulls, so a
  worker never holds more entries than its window asks for. Per pull, in this order: the
  consumer's own pending entries left from an earlier life (XREADGROUP from id 0), then, when a
  reclaim pass is due (at start and every `min(claim_idle / 2, 30)` s), XAUTOCLAIM COUNT 1 of
  an entry idle longer than `claim_idle` (a dead consumer's), else XREADGROUP COUNT 1 BLOCK
  `block` of a new entry.
* `RedisResults(url, stream)`: `publish(episode, entry)` XADDs the episode's trace row to the
  results stream and XACKs its task entry in one MULTI/EXEC transaction; `keep_alive(consumer,
  entries)` resets the idle time of entries still running, so that they are not reclaimed.
* `enqueue(url, stream, tasks)`: XADDs tasks as entries, one field `task` holding the JSON of
  `{"key", "data"}`, which reads back as an equal `tt.Task` (a `RedisTask`).

The client is the project's own connection (`_resp`: RESP over trio sockets, replies parsed by
hiredis), so a command costs no thread hop. A blocking read waits at most `block` seconds, so a
graceful stop (`RedisStreamTaskset.stop()`) ends the stream within `block` without abandoning a
read that may already have claimed an entry; a hard cancellation abandons the call at once and
closes its connection. Every call retries connection failures (Redis restarted or unreachable)
with capped, jittered exponential backoff and a log line naming the URL; nothing is replayed
behind the caller's back, so no transaction runs twice unseen. docs/distributed.md explains
the choice and the guarantees.

Rooms (private): `_resp` (one connection), `_entries` (tasks as entries), `_link` (a
connection that survives outages), `_feed` (`RedisStreamTaskset`), `_results` (`RedisResults`,
`enqueue`), `_queue` (`RedisTaskQueue`: the feed and the sink as the worker loop's
`TaskQueue`), `_worker` (`run_worker`), `_coordinator` (`ViaBackend`: an eval's slots over
workers, `--via`; a group as one entry run by one worker).
"""

from ._coordinator import ViaBackend
from ._entries import (
    TASK_FIELD,
    EntryRef,
    MalformedEntry,
    RedisTask,
    check_url,
    decode_task,
    encode_task,
)
from ._feed import RedisStreamTaskset
from ._queue import RedisTaskQueue
from ._results import Published, RedisResults, enqueue

__all__ = [
    "TASK_FIELD",
    "EntryRef",
    "MalformedEntry",
    "Published",
    "RedisResults",
    "RedisStreamTaskset",
    "RedisTask",
    "RedisTaskQueue",
    "ViaBackend",
    "check_url",
    "decode_task",
    "encode_task",
    "enqueue",
]
