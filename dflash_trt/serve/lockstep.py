"""Serving a tensor-parallel target: every rank runs the same `generate` calls in lockstep (SPMD).

Under `torchrun ... dflash-trt serve --tp-size N` each rank holds its slice of the target
(`dflash_trt.runtime.tensor_parallel`), whose forward passes are collectives: every rank must run the
same batches through the same decode steps. Rank 0 serves HTTP; its generation thread's calls go through
`leader(generate)`, which broadcasts each batch (prompts, and sampling parameters with a seed drawn on
rank 0 where the request gave none) and then, at every `on_tokens` call, the decision rank 0's callback
made: None (go on), a finish reason (a stop string, a client gone: "stop" / "abort"), or an error marker
when the callback itself failed. The other ranks run `follow(generate)`: they receive each batch, run it
with a callback that returns rank 0's decisions, and so take the same steps; their results are dropped
(rank 0 answers). `stop_followers` ends their loop when the server shuts down.

The engine is deterministic given its inputs and these decisions (the row-parallel sums are added in
rank order), so a request that fails does so at the same point on every rank, and the scheduler's rerun
of a failed batch request by request (`dflash_trt.serve.scheduler`) is followed call by call. A failure
on one rank only (e.g. out of memory on one GPU) is not recoverable: the collectives then fail or time
out (torch.distributed's timeout), and the server must be restarted.
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


def leader(generate: Callable, group=None) -> Callable:
    """Rank 0's `generate(prompts, params_list, on_tokens)` (the scheduler's): the same call, with the batch
    and every on_tokens decision broadcast to the followers first. Sampling requests without a seed get one
    drawn here (as the engine would draw one), so every rank samples the same tokens."""

    def run(prompts: list[list[int]], params: list, on_tokens: Callable):
        params = [p if p.seed is not None else replace(p, seed=secrets.randbits(62)) for p in params]
        broadcast(("batch", prompts, params), group)

        def decide(index: int, ids: list[int]):
            try:
                reason = on_tokens(index, ids)
            except BaseException:
                broadcast(CALLBACK_FAILED, group)
                raise
            broadcast(reason, group)
            return reason

        return generate(prompts, params, decide)

    return run


def follow(generate: Callable, group=None) -> int:
    """A follower rank's loop: run every batch rank 0 runs, with rank 0's decisions, until `stop_followers`.
    An error a batch raises here was raised on rank 0 at the same point (which answers it): it is dropped
    and the loop goes on. Returns the number of batches run."""
    batches = 0
    while True:
        message = broadcast(None, group)
        if message == STOP:
            return batches
        _, prompts, params = message

        def decide(index: int, ids: list[int]):
            reason = broadcast(None, group)
            if reason == CALLBACK_FAILED:
                raise LeaderCallbackFailed("rank 0's on_tokens callback failed at this step")
            return reason

        try:
            generate(prompts, params, decide)
        except Exception:  # noqa: BLE001 - rank 0 raised it too, at the same step, and answers it
            pass
        batches += 1


def stop_followers(group=None) -> None:
    """End the followers' loops (rank 0, after its generation thread has stopped). Followers already gone
    (e.g. Ctrl-C reached every rank of torchrun) are not an error."""
    try:
        broadcast(STOP, group)
    except Exception:  # noqa: BLE001 - a peer that has exited: nothing left to stop
        pass
