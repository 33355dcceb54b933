"""What README's Python API says about asyncio and threads, checked: `Pipeline.generate` blocks its thread, so an
event loop runs it with `asyncio.to_thread` (the loop goes on meanwhile) and gets streamed text through
`loop.call_soon_threadsafe`; calls from other threads wait their turn; a callback calling generate is refused; the
tokenizer methods run from several threads at once."""

from __future__ import annotations

import asyncio
import threading

import pytest

from dflash_trt.errors import DFlashError
from dflash_trt.runtime.sampling import SamplingParams

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def test_generate_in_a_thread_leaves_the_event_loop_running(smollm2_pipeline):
    """The README's recipe: `await asyncio.to_thread(pipe.generate, ..., on_text=...)` with the deltas put on an
    asyncio.Queue by call_soon_threadsafe; a ticker task of the loop runs while the batch decodes, the deltas read
    from the queue join to the result's text, and the tokens are those of a call alone."""
    pipe = smollm2_pipeline
    prompt = pipe.encode_chat("Name a color.")
    [alone] = pipe.generate([prompt], PARAMS)

    async def main():
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        ticks = 0
        done = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.005)

        tick = asyncio.create_task(ticker())
        [res] = await asyncio.to_thread(pipe.generate, [prompt], PARAMS,
                                        on_text=lambda i, d: loop.call_soon_threadsafe(queue.put_nowait, d))
        done.set()
        await tick
        streamed = []
        while not queue.empty():
            streamed.append(queue.get_nowait())
        return res, ticks, "".join(streamed)

    res, ticks, streamed = asyncio.run(main())
    assert res.token_ids == alone.token_ids and streamed == res.text == alone.text
    assert ticks >= 3  # the loop ran while the engine decoded in the other thread


def test_a_second_thread_waits_and_a_callback_cannot_call_generate(smollm2_pipeline):
    """Two threads on one pipeline: each call returns what it returns alone (they run one at a time); generate
    called from a pipeline callback (on_text, run on the generating thread) raises DFlashError, and the pipeline
    works after."""
    pipe = smollm2_pipeline
    prompts = [pipe.encode_chat("Name a color."), pipe.encode_chat("Name a fruit.")]
    want = [pipe.generate([p], PARAMS)[0].token_ids for p in prompts]
    got: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda k=k: got.__setitem__(k, pipe.generate([prompts[k]], PARAMS)[0].token_ids))
               for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {0: want[0], 1: want[1]}
    with pytest.raises(DFlashError, match=r"^generate was called from its own callback"):
        pipe.generate([prompts[0]], PARAMS, on_text=lambda i, d: pipe.generate([prompts[1]], PARAMS))
    assert pipe.generate([prompts[0]], PARAMS)[0].token_ids == want[0]


def test_tokenizer_methods_from_several_threads(smollm2_pipeline):
    """encode, encode_chat and decode from four threads at once, while a fifth generates: each gives what it gives
    alone (the fast tokenizer's encode and decode hold no state between calls)."""
    pipe = smollm2_pipeline
    texts = [f"Sample {k}: 東京 🚀 {'x' * k}" for k in range(8)]
    want = [(pipe.encode(t), pipe.encode_chat(t)) for t in texts]
    wrong: list = []

    def work():
        for _ in range(40):
            for t, (ids, chat) in zip(texts, want):
                if pipe.encode(t) != ids or pipe.encode_chat(t) != chat or pipe.decode(ids) != t:
                    wrong.append(t)

    threads = [threading.Thread(target=work) for _ in range(4)]
    gen = threading.Thread(target=pipe.generate, args=([texts[0]], PARAMS), kwargs={"on_text": lambda i, d: None})
    for t in [gen, *threads]:
        t.start()
    for t in [gen, *threads]:
        t.join()
    assert wrong == []
