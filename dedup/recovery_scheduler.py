"""When partitions are recovered from the log: a queue, worked in the background.

A partition is queued on first use, when its state cannot be trusted (Redis lost it, a
write stayed ambiguous) and on request (proxy start, an operator). The queue is worked in
batches (`dedup.recovery.Recovery.run`: one fence for the batch). A partition waits until
its own writes have settled (in the log then, or never): the engine checks nothing new
for it meanwhile, since ``recovered`` is False. A partition that fails is retried after a
pause of its own, doubling from ``retry_s[0]`` to ``retry_s[1]``: it never holds back the
others, nor a partition queued after it. One whose topic does not exist is not retried:
its next use recovers it, once the topic is created again. When a whole batch fails (the
fence), the next tries take one partition at a time, so one bad partition cannot block
the rest. A partition whose recovery waits for a transaction open in its log (up to
many minutes) is finished apart, so the queue goes on meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import structlog

from dedup import metrics
from dedup.partitions import AckCursor, Key, PartitionStates
from dedup.ports import PartitionRecovery
from dedup.recovery import NotOwner, RecoveredPartition
from dedup.topic_ids import UnknownTopic
from proxy.runtime import background
from proxy.runtime.metrics import BACKGROUND_PASS_ERRORS

log = structlog.get_logger(__name__)

RECOVERY_RETRY_S = (0.5, 30.0)  # first and longest pause before retrying a failed recovery
RECOVERY_BATCH = 256  # partitions fenced together
HOLDER_BELIEVED_S = (
    1.0  # requests are sent to the lease holder for this long, then it is asked again
)
# After a partition changes owner, how long a Kafka producer with implicit identities that
# its log does not name must start at sequence 0 (`dedup.sequence_gaps`): its first request
# may still come from the owner before. Kafka's Java producer gives a request 30 s
# (`request.timeout.ms`), librdkafka a connection 60 s (`socket.timeout.ms`) before either
# sends it again.
FIRST_SEQUENCE_WAIT_S = 60.0
JOIN_S = 0.01  # let requests arriving together join one batch
SETTLE_POLL_S = 0.05  # how often a partition waiting for its writes to settle is looked at


@dataclass(slots=True)
class _Queued:
    reason: str
    failures: int = 0  # in a row
    retry_at: float = 0.0  # loop time before which it is not tried again
    last_error: str = ""


class RecoveryScheduler:
    def __init__(
        self,
        recovery: PartitionRecovery,
        partitions: PartitionStates | None = None,
        *,
        retry_s: tuple[float, float] = RECOVERY_RETRY_S,
        batch: int = RECOVERY_BATCH,
        first_sequence_wait_s: float = FIRST_SEQUENCE_WAIT_S,
    ) -> None:
        self.partitions = PartitionStates() if partitions is None else partitions
        self._recovery = recovery
        self._first_sequence_wait_s = first_sequence_wait_s
        self._retry_s = retry_s
        self._batch = batch
        self._limit = batch  # 1 after a whole batch failed, until one succeeds
        self._queue: dict[Key, _Queued] = {}
        # Recoveries finishing apart (`Recovery.run`'s ``later``), still queued meanwhile.
        self._finishing: dict[Key, asyncio.Task[None]] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._recovered = asyncio.Condition()
        # Told of every partition a recovery loaded, as it opens (the maps kept in memory).
        self.on_opened: Callable[[Key, RecoveredPartition], None] = lambda key, result: None
        # Told of every partition a recovery found the topic of deleted (the engine gives
        # its lease up then, rather than at its topic watch's next look).
        self.on_topic_deleted: Callable[[Key], None] = lambda key: None

    async def close(self) -> None:
        tasks = [*self._finishing.values(), *([self._task] if self._task is not None else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # ------------------------------------------------------------- asking

    def request(self, key: Key, reason: str) -> None:
        """Recover this partition (again). Its requests wait, or are told to retry, until
        it is recovered."""
        if key not in self._queue:
            state = self.partitions.of(key)
            if state.recovered:
                state.recovered = False
                state.open.set()  # waiters see `recovered` is False and answer at once
            self._queue[key] = _Queued(reason)
            metrics.RECOVERING.set(len(self._queue))
            self._wakeup.set()
        # Also for a partition queued already: the loop is started again if it ended.
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="recovery")

    def request_all(self, partitions: Sequence[Key], reason: str) -> None:
        for key in partitions:
            self.request(key, reason)

    def state_lost(self, topic: str, partition: int, token: str) -> None:
        """Redis no longer holds the state this process recovered: recover it again."""
        state = self.partitions.get((topic, partition))
        if state is None or not state.recovered or state.token != token:
            return  # already being recovered
        log.error(
            "dedup state lost (Redis flushed, restarted empty or replaced); recovering",
            topic=topic,
            partition=partition,
        )
        self.request((topic, partition), "state lost")

    def recovering(self, key: Key) -> bool:
        """Whether a recovery of this partition is queued or under way."""
        return key in self._queue

    def failing(self) -> dict[Key, dict[str, object]]:
        """The partitions whose last recovery failed: how often in a row, the last error,
        and when the next try is (for the admin API)."""
        now = asyncio.get_running_loop().time()
        return {
            key: {
                "failures": queued.failures,
                "last_error": queued.last_error,
                "retry_in_s": round(max(0.0, queued.retry_at - now), 3),
                "reason": queued.reason,
            }
            for key, queued in self._queue.items()
            if queued.failures
        }

    def forget(self, key: Key) -> None:
        """The partition is no longer this instance's (lease lost or handed over): its
        requests are refused or redirected until it is taken again."""
        state = self.partitions.get(key)
        if state is None:
            return
        state.recovered = False
        state.token = ""
        state.sequences = None
        state.gaps.forget()  # what its producers send elsewhere meanwhile is not seen here
        state.wraps.forget()  # the next recovery seeds it again
        state.open.set()

    async def ensure_recovered(self, partitions: Sequence[Key], timeout_s: float) -> bool:
        """Recover those not recovered yet, and wait: a state read (last sequence id) after
        a crash is only true once the log's tail has been replayed."""
        for key in partitions:
            if not self.partitions.of(key).recovered:
                self.request(key, "state read")
        return await self.wait_recovered(partitions, timeout_s)

    async def wait_recovered(self, partitions: Sequence[Key], timeout_s: float) -> bool:
        """Whether every one of these partitions is recovered, or found owned by another
        instance, within the timeout."""

        def done() -> bool:
            now = asyncio.get_running_loop().time()
            return all(
                self.partitions.of(key).recovered
                or self.partitions.of(key).held_by(now) is not None
                for key in partitions
            )

        async with self._recovered:
            try:
                await asyncio.wait_for(self._recovered.wait_for(done), timeout_s)
            except TimeoutError:
                return False
        return True

    # ------------------------------------------------------------- working the queue

    async def _loop(self) -> None:
        while True:
            pause = self._pause()
            if pause is None or pause > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), pause)
            self._wakeup.clear()
            await asyncio.sleep(JOIN_S)
            ready = self._ready()
            if ready:
                with background.one_pass("recovery"):
                    await self._recover(ready)

    def _due(self) -> list[Key]:
        now = asyncio.get_running_loop().time()
        return [
            key
            for key, queued in self._queue.items()
            if queued.retry_at <= now and key not in self._finishing
        ]

    def _ready(self) -> list[Key]:
        """Due, and its own writes settled: they are in the log then, or never will be."""
        due = [key for key in self._due() if self.partitions.of(key).pending == 0]
        return due[: self._limit]

    def _pause(self) -> float | None:
        """How long nothing can be done: None until a request comes."""
        waiting = [queued for key, queued in self._queue.items() if key not in self._finishing]
        if not waiting:
            return None  # until a request comes, or a recovery finishing apart ends
        if self._due():
            return 0.0 if self._ready() else SETTLE_POLL_S
        now = asyncio.get_running_loop().time()
        return max(0.0, min(queued.retry_at for queued in waiting) - now)

    async def _recover(self, ready: list[Key]) -> None:
        log.info(
            "recovering partitions",
            partitions=[f"{t}/{p}" for t, p in ready],
            reasons=sorted({self._queue[k].reason for k in ready}),
        )
        try:
            recovered, failed = await self._recovery.run(ready, self._finish_apart)
            self._limit = self._batch
        except Exception as exc:  # the fence or the end offsets: the whole batch failed
            recovered, failed = {}, {key: exc for key in ready if key not in self._finishing}
            self._limit = 1  # one bad partition (a deleted topic) must not block the rest
        await self._settle(recovered, failed)

    def _finish_apart(self, key: Key, recovering: Awaitable[RecoveredPartition]) -> None:
        self._finishing[key] = asyncio.create_task(
            self._finish(key, recovering), name=f"recovery {key[0]}/{key[1]}"
        )

    async def _finish(self, key: Key, recovering: Awaitable[RecoveredPartition]) -> None:
        try:
            result = await recovering
        except Exception as exc:
            outcome: tuple[dict[Key, RecoveredPartition], dict[Key, Exception]] = {}, {key: exc}
        else:
            outcome = {key: result}, {}
        finally:
            self._finishing.pop(key, None)
        with background.one_pass("recovery"):
            await self._settle(*outcome)
        self._wakeup.set()  # the loop may have nothing else to wait for

    async def _settle(
        self, recovered: dict[Key, RecoveredPartition], failed: dict[Key, Exception]
    ) -> None:
        """Open the recovered partitions, record the failed ones, and tell those waiting."""
        for key, result in recovered.items():
            try:
                self._opened(key, result)
            except Exception as exc:  # a defect: its partition is retried, the others open
                BACKGROUND_PASS_ERRORS.labels("recovery").inc()
                log.exception(
                    "opening a recovered partition failed", topic=key[0], partition=key[1]
                )
                self.partitions.of(key).recovered = False
                failed = {**failed, key: exc}
        for key, error in failed.items():
            try:
                self._failed(key, error)
            except Exception:  # a defect: the others are still recorded, and retried
                BACKGROUND_PASS_ERRORS.labels("recovery").inc()
                log.exception("recording a failed recovery failed", topic=key[0], partition=key[1])
        metrics.RECOVERING.set(len(self._queue))
        async with self._recovered:
            self._recovered.notify_all()

    def _opened(self, key: Key, result: RecoveredPartition) -> None:
        state = self.partitions.of(key)
        state.token = result.token
        state.topic_id = result.topic_id
        state.log_start_offset = result.log_start  # until a write here gets a newer one
        state.wraps.seed(result.state.producers)
        if result.unseen_writes:
            # What was refused here before the lease (`DedupEngine._gaps_of`) may have been
            # written by another instance since: its producers are known from the log alone,
            # and one it does not name may have sent its first request to that instance.
            state.gaps.seed(result.state.producers, self._first_sequence_wait_s)
        self.on_opened(key, result)
        state.cursor = AckCursor(result.end)
        state.snapshot_generation = result.next_generation
        state.snapshot_offset = None if result.snapshot is None else result.snapshot.offset
        state.snapshot_ms = None if result.snapshot is None else result.snapshot.created_ms
        state.snapshot_records = 0
        state.snapshot_due = result.snapshot is None or result.snapshot.offset < result.end
        state.failed = False
        state.holder = None
        state.recovered = True
        state.open.set()
        self._queue.pop(key, None)
        metrics.RECOVERIES.labels("ok").inc()
        metrics.RECOVERIES_FAILING.set(sum(1 for q in self._queue.values() if q.failures))

    def _failed(self, key: Key, error: Exception) -> None:
        queued = self._queue.pop(key, None)
        if queued is None:
            return
        if isinstance(error, UnknownTopic):
            # Not to retry: the topic was deleted. Its next use, once it is created again,
            # recovers it; its lease, taken for this recovery, is given up meanwhile.
            metrics.RECOVERIES.labels("topic_deleted").inc()
            log.info(
                "partition not recovered: its topic does not exist", topic=key[0], partition=key[1]
            )
            self.on_topic_deleted(key)
            return
        if isinstance(error, NotOwner):  # not to retry: its requests go to the holder
            state = self.partitions.of(key)
            state.holder = error.owner
            state.gaps.forget()  # its producers go on at the holder
            state.holder_until = asyncio.get_running_loop().time() + HOLDER_BELIEVED_S
            log.info(
                "partition owned by another instance",
                topic=key[0],
                partition=key[1],
                owner=error.owner,
            )
            return
        queued.failures += 1
        first, longest = self._retry_s
        pause = min(first * 2 ** (queued.failures - 1), longest)
        queued.retry_at = asyncio.get_running_loop().time() + pause
        # Queued again, after its pause, before anything that could fail (an error's own
        # text, the metrics, the log): the partition is retried in any case, never at once.
        self._queue[key] = queued  # to the back: the others go first
        queued.last_error = described = f"{type(error).__name__}: {error}"
        metrics.RECOVERIES_FAILING.set(sum(1 for q in self._queue.values() if q.failures))
        metrics.RECOVERIES.labels("failed").inc()
        log.error(
            "partition recovery failed; retrying",
            topic=key[0],
            partition=key[1],
            error=described,
            retry_in_s=pause,
        )
