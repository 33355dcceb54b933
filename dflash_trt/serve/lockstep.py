"""Serving a tensor-parallel target: every rank runs the same batch operations in lockstep (SPMD).

Under `torchrun ... dflash-trt serve --tp-size N` each rank holds its slice of the target
(`dflash_trt.runtime.tensor_parallel`), whose forward passes are collectives: every rank must run the
same prefills and decode steps. Rank 0 serves HTTP; its scheduler's in-flight batches
(`dflash_trt.runtime.decode_batch.DecodeBatch`) come from `leader(open_batch)`, which broadcasts each operation
before running it: a new batch, the sequences added to it (prompts, and sampling parameters with a seed
drawn on rank 0 where the request gave none), each decode step, the requests aborted before their
prompts were read (chunked prefill), and, at every `on_tokens` call, the
decision rank 0's callback made: None (go on), a finish reason (a stop string, a client gone: "stop" /
"abort"), or an error marker when the callback itself failed. The other ranks run `follow(open_batch)`:
they apply each operation to their own batch with a callback that returns rank 0's decisions, and so
take the same steps; their results are dropped (rank 0 answers). `stop_followers` ends their loop when
the server shuts down.

The engine is deterministic given its inputs and these decisions (the row-parallel sums are added in
rank order), so a request that fails does so at the same point on every rank, and the scheduler's
recovery (`dflash_trt.serve.scheduler`: failed sequences added again one at a time, a failed batch's
sequences rerun alone in new batches) is followed operation by operation. A failure on one rank only
(e.g. out of memory on one GPU) is not recoverable: the collectives then fail or time out
(torch.distributed's timeout), and the server must be restarted.
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from typing import Callable

#: the message that ends the followers' loop
STOP = ("dflash-trt", "stop")
#: the decision broadcast when rank 0's on_tokens callback raised
CALLBACK_FAILED = ("dflash-trt", "callback failed")


class LeaderCallbackFailed(RuntimeError):
    """Raised on a follower rank where rank 0's on_tokens callback raised (rank 0 raises its own error)."""


def broadcast(obj=None, group=None):
    """`obj` from rank 0 to every rank of `group` (any picklable object; the argument is ignored on the
    other ranks): torch.distributed.broadcast_object_list."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class _LeaderBatch:
    """Rank 0's DecodeBatch: each operation is broadcast before it runs (see the module docstring)."""

    def __init__(self, batch, group):
        self._batch, self._group = batch, group

    @property
    def active(self) -> int:
        return self._batch.active

    def add(self, prompts: list[list[int]], params: list, on_tokens: Callable) -> list[int]:
        params = [p if p.seed is not None else replace(p, seed=secrets.randbits(62)) for p in params]
        broadcast(("add", prompts, params), self._group)
        return self._batch.add(prompts, params, self._deciding(on_tokens))

    def step(self):
        broadcast(("step",), self._group)
        return self._batch.step()

    def flush_stats(self):
        return self._batch.flush_stats()  # reads rank 0's own counts: nothing to broadcast

    def abort_prefill(self, request_ids: list[int]) -> int:
        broadcast(("abort_prefill", request_ids), self._group)
        return self._batch.abort_prefill(request_ids)

    def take_finished(self):
        return self._batch.take_finished()

    def _deciding(self, on_tokens: Callable) -> Callable:
        def decide(index: int, ids: list[int], *logprobs):  # logprobs: for requests that ask for them
            try:
                reason = on_tokens(index, ids, *logprobs)
            except BaseException:
                broadcast(CALLBACK_FAILED, self._group)
                raise
            broadcast(reason, self._group)
            return reason

        return decide


def leader(open_batch: Callable, group=None) -> Callable:
    """Rank 0's `open_batch()` (the scheduler's): a new batch, announced to the followers, whose `add` and
    `step` are broadcast before they run, and whose on_tokens decisions are broadcast as they are made.
    Sampling requests without a seed get one drawn here (as the engine would draw one), so every rank
    samples the same tokens."""

    def open_leader_batch():
        broadcast(("open",), group)
        return _LeaderBatch(open_batch(), group)

    return open_leader_batch


def follow(open_batch: Callable, group=None) -> int:
    """A follower rank's loop: apply every batch operation rank 0 runs, with rank 0's decisions, until
    `stop_followers`. An error an operation raises here was raised on rank 0 at the same point (which
    answers it): it is dropped and the loop goes on. Returns the number of batches opened."""

    def decide(index: int, ids: list[int], *logprobs):
        reason = broadcast(None, group)
        if reason == CALLBACK_FAILED:
            raise LeaderCallbackFailed("rank 0's on_tokens callback failed at this step")
        return reason

    batch, batches = None, 0
    while True:
        message = broadcast(None, group)
        if message == STOP:
            return batches
        try:
            if message[0] == "open":
                batch, batches = open_batch(), batches + 1
            elif message[0] == "add":
                batch.add(message[1], message[2], decide)
            elif message[0] == "abort_prefill":
                batch.abort_prefill(message[1])
            else:
                batch.step()
        except Exception:  # noqa: BLE001 - rank 0 raised it too, at the same point, and answers it
            pass


def stop_followers(group=None) -> None:
    """End the followers' loops (rank 0, after its generation thread has stopped). Followers already gone
    (e.g. Ctrl-C reached every rank of torchrun) are not an error."""
    try:
        broadcast(STOP, group)
    except Exception:  # noqa: BLE001 - a peer that has exited: nothing left to stop
        pass
