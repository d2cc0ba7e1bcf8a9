"""A prefill engine in a process of its own, for the NIXL connector's tests (each NIXL agent
wants its own process). Commands come one JSON object a line on stdin; each answer is one line on
stdout starting with "@" (anything else there is the engine's or NIXL's chatter).

    {"op": "prefill", "prompts": [[token ids], ...]}   -> the params of each, one token computed
    {"op": "held", "within": s, "until": n}            -> {"requests", "blocks", "timeouts"} once at
                                                          most n requests (default 0) hold blocks, or
                                                          when the s seconds are up
    {"op": "hold_timeout", "seconds": s}               -> the old kv_hold_timeout, s from now on
    {"op": "exit"}                                     -> "closed", after the engine is closed
"""

from __future__ import annotations

import json
import sys
import time

from tokenmill import LLM, SamplingParams


def held(llm: LLM, within: float, until: int) -> dict:
    deadline = time.monotonic() + within
    while True:
        llm.engine.idle()
        stats = llm.engine.scheduler.stats()
        if stats.num_held_requests <= until or time.monotonic() >= deadline:
            return {"requests": stats.num_held_requests, "blocks": stats.kv_blocks_held,
                    "timeouts": llm.engine.scheduler.connector.num_hold_timeouts}
        time.sleep(0.01)


def main(model: str, options: str) -> None:
    llm = LLM(model, kv_role="prefill", kv_connector="nixl", **json.loads(options))
    first = SamplingParams(max_tokens=1, temperature=0.0, kv_transfer_params={"do_remote_decode": True})
    print("@" + json.dumps("ready"), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "prefill":
            answer = [out.kv_transfer_params for out in llm.generate(command["prompts"], first, use_tqdm=False)]
        elif command["op"] == "held":
            answer = held(llm, command["within"], command.get("until", 0))
        elif command["op"] == "hold_timeout":
            connector = llm.engine.scheduler.connector.inner  # (the NixlConnector inside the guard)
            answer, connector.hold_timeout = connector.hold_timeout, command["seconds"]
        else:
            llm.engine.close()
            answer = "closed"
        print("@" + json.dumps(answer), flush=True)
        if answer == "closed":
            return


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
