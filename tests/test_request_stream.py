"""The frontend's per-request stream (AsyncLLM's RequestStream): outputs in order, deltas that
pile up while the handler is behind merged into one, an error after the outputs before it; and
the SSE chunk encoder equal to sse() byte for byte."""
from __future__ import annotations

import asyncio

from lane.engine.async_llm import RequestStream, merge_deltas
from lane.entrypoints.openai_serving import ChunkEncoder, sse
from lane.entrypoints.protocol import ChatCompletionChunk, CompletionResponse
from lane.outputs import CompletionOutput, Logprob, RequestOutput


def out(texts: list[str], ids: list[list[int]], finished=False, reasons=None, lps=None) -> RequestOutput:
    reasons = reasons or [None] * len(texts)
    return RequestOutput("r", None, [1, 2], [
        CompletionOutput(i, t, list(x), -1.0 * i, lps[i] if lps else None, r, None)
        for i, (t, x, r) in enumerate(zip(texts, ids, reasons))], finished)


def test_merged_deltas_read_as_the_steps_in_order():
    lp = lambda v: [{7: Logprob(v, 1, "x")}]  # noqa: E731
    a = out(["He", "A"], [[5], [6]], lps=[lp(-0.1), lp(-0.2)])
    b = out(["llo", ""], [[7], [8]], finished=True, reasons=["length", "stop"], lps=[lp(-0.3), lp(-0.4)])
    m = merge_deltas(a, b)
    assert [c.text for c in m.outputs] == ["Hello", "A"]
    assert [c.token_ids for c in m.outputs] == [[5, 7], [6, 8]]
    assert [c.finish_reason for c in m.outputs] == ["length", "stop"] and m.finished
    assert [[d[7].logprob for d in c.logprobs] for c in m.outputs] == [[-0.1, -0.3], [-0.2, -0.4]]
    assert a.outputs[0].token_ids == [5]  # the parts are left as they were


def test_a_stream_merges_only_what_waits():
    async def main():
        s = RequestStream("r", 0)
        s.put(out(["a"], [[1]]))
        assert (await s.get()).outputs[0].text == "a"  # taken at once: nothing to merge with
        s.put(out(["b"], [[2]]))
        s.put(out(["c"], [[3]]))
        s.put(out(["d"], [[4]], finished=True, reasons=["length"]))
        m = await s.get()
        assert (m.outputs[0].text, m.outputs[0].token_ids, m.finished) == ("bcd", [2, 3, 4], True)
        waiter = asyncio.ensure_future(s.get())  # a handler waiting is woken by the next put
        await asyncio.sleep(0)
        s.put(out(["e"], [[5]]))
        assert (await waiter).outputs[0].text == "e"
        s.put(out(["f"], [[6]]))
        s.put(RuntimeError("engine died"))
        s.put(out(["g"], [[7]]))
        assert (await s.get()).outputs[0].text == "f"
        assert isinstance(await s.get(), RuntimeError)
        assert (await s.get()).outputs[0].text == "g"

    asyncio.run(main())


def test_chunk_encoder_is_sse_byte_for_byte():
    for base in (CompletionResponse(id="cmpl-1", model="m", choices=[]).model_dump(exclude={"usage"}),
                 ChatCompletionChunk(id="chatcmpl-1", model="m", choices=[]).model_dump(exclude={"usage"}),
                 {"id": "x", "choices": [], "model": "m"}):  # choices not last: the slow path, same bytes
        enc = ChunkEncoder(base)
        for choices, extra in (([{"index": 0, "text": 'é "q" 😀\n', "logprobs": None}], {}),
                               ([{"index": 1, "delta": {"content": "x"}}], {"usage": {"prompt_tokens": 3}}),
                               ([], None)):
            assert enc(choices, extra) == sse({**base, "choices": choices, **(extra or {})})
