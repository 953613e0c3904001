"""omni-bench chat --long-prompt N: what one long prompt does to everyone else (issue 27.2).

    python -m omni_bench.chat --long-prompt 2048 --threads 1 --max-step-tokens 256

In-process engine (the embedded SmolLM2 GGUF on the CPU, or --random-shape weights), the
thinker's settings (`--max-step-tokens`, 256 in repository/thinker). Three requests:

  stream  a chat answer decoding throughout (EOS ignored); its pace alone is measured first
  long    N prompt tokens (the questions repeated), added while the stream decodes
  chat    a short chat added after the long prompt's third step (4 new tokens)

Reported: the stream's tokens/s alone and while the long prompt prefills (and the longest gap
between two of its tokens there), whether it got a token in every step of that prefill, the
long prompt's prefill time and rate, and the short chat's time to first token against its TTFT
on an idle engine. Uses only the engine's public API, so the same script measures any checkout
(PYTHONPATH=<checkout>/server): the numbers before and after a change, in one sitting.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from omni_server.engine import Engine, GenerationRequest, SamplingParams


def run(engine: Engine, prompts: list[list[int]], long_tokens: int) -> dict[str, Any]:
    filler = [t for p in prompts for t in p]
    long_prompt = (filler * (long_tokens // len(filler) + 1))[:long_tokens]
    chat_prompt = prompts[0]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    # the short chat on an idle engine: its TTFT without the long prompt
    start = time.perf_counter()
    engine.add(GenerationRequest("idle-chat", chat_prompt, greedy))
    idle_ttft = None
    while engine.has_work():
        for e in engine.step():
            if idle_ttft is None and e.token_ids:
                idle_ttft = time.perf_counter() - start

    budget = min(2000, engine.max_seq_len - len(prompts[1]))  # outlasts the long prefill
    stream = SamplingParams(temperature=0, max_tokens=budget, ignore_eos=True)
    engine.add(GenerationRequest("stream", prompts[1], stream))
    stream_times: list[float] = []
    while len(stream_times) < 12:  # its pace alone
        for e in engine.step():
            stream_times.extend([time.perf_counter()] * len(e.token_ids))
    alone = (len(stream_times) - 3) / (stream_times[-1] - stream_times[2])

    added = time.perf_counter()
    engine.add(GenerationRequest("long", long_prompt, greedy))
    steps = 0
    chat_added = chat_first = long_first = None
    during: list[float] = []
    steps_without_stream = 0
    while long_first is None:
        events = engine.step()
        now = time.perf_counter()
        steps += 1
        ids = {e.request_id: e for e in events}
        if "stream" in ids:
            during.append(now)
        else:
            steps_without_stream += 1
        if "long" in ids and ids["long"].token_ids:
            long_first = now
        if "chat" in ids and chat_first is None and chat_added is not None:
            chat_first = now
        if steps == 3:
            engine.add(GenerationRequest("chat", chat_prompt, greedy))
            chat_added = time.perf_counter()
    engine.abort("stream")
    while engine.has_work():  # the chat's and long's last tokens
        for e in engine.step():
            if e.request_id == "chat" and chat_first is None and e.token_ids:
                chat_first = time.perf_counter()
    assert chat_added is not None and chat_first is not None
    prefill = long_first - added
    gaps = [b - a for a, b in zip([added, *during], during, strict=False)]
    return {
        "long_prompt_tokens": long_tokens,
        "stream_tps_alone": alone,
        "stream_tps_during_prefill": len(during) / prefill,
        "stream_longest_gap_ms": max(gaps, default=prefill) * 1e3,
        "steps_of_prefill": steps,
        "steps_without_a_stream_token": steps_without_stream,
        "long_prefill_s": prefill,
        "long_prefill_tps": long_tokens / prefill,
        "chat_ttft_ms_idle": (idle_ttft or 0.0) * 1e3,
        "chat_ttft_ms_during_prefill": (chat_first - chat_added) * 1e3,
        "chat_first_token_before_long_prefill_done": chat_first < long_first,
    }


def report(result: dict[str, Any]) -> str:
    r = result
    return "\n".join(
        [
            f"long prompt {r['long_prompt_tokens']} tokens: prefilled in "
            f"{r['long_prefill_s']:.1f} s"
            f" ({r['long_prefill_tps']:.0f} tok/s, {r['steps_of_prefill']} steps)",
            f"stream: {r['stream_tps_alone']:.1f} tok/s alone, "
            f"{r['stream_tps_during_prefill']:.1f} tok/s during the prefill (longest gap "
            f"{r['stream_longest_gap_ms']:.0f} ms; steps without its token: "
            f"{r['steps_without_a_stream_token']})",
            f"short chat TTFT: {r['chat_ttft_ms_idle']:.0f} ms idle, "
            f"{r['chat_ttft_ms_during_prefill']:.0f} ms during the prefill (first token before "
            f"the long prompt's: {r['chat_first_token_before_long_prefill_done']})",
        ]
    )


def main(engine: Engine, prompts: list[list[int]], args: argparse.Namespace) -> int:
    engine.warmup(capture_all_graphs=False)
    result = run(engine, prompts, args.long_prompt)
    result["setup"] = {"max_step_tokens": engine.config.max_step_tokens}
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
