"""Requests with new tokens -> RequestOutputs: incremental detokenizing, stop strings, final
outputs.

It reads requests and never writes them: a stop string it finds ends its request through the
`end_on_stop` callable it is given (the scheduler's end_on_stop_string), which also takes back
accepted draft tokens past the one that completed the string.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenmill.detokenizer import IncrementalDetokenizer
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.request import Request, RequestStatus

EndOnStop = Callable[[Request, int, str], None]  # (request, output tokens to drop, the stop string)


class OutputProcessor:
    def __init__(self, tokenizer, end_on_stop: EndOnStop) -> None:
        self.tokenizer = tokenizer
        self.end_on_stop = end_on_stop
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}  # every request whose end is not yet reported

    def add(self, request: Request) -> None:
        if request.request_id in self.detokenizers:  # not finished, or its end not yet reported
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.params)

    def outputs(self, requests: list[Request]) -> list[RequestOutput]:
        """The outputs of requests that got tokens or finished (none for a "final"-kind request
        still running)."""
        return [out for r in requests if (out := self._make_output(r)) is not None]

    def final_output(self, request_id: str, request: Request | None) -> RequestOutput | None:
        """The last output of a request ended outside the token-level stop checks (an abort, a
        failed step): the text held back for stop strings is flushed, since none can match now.
        None, forgetting the id, for a request the scheduler no longer knew."""
        detok = self.detokenizers.pop(request_id, None)
        if request is None:  # unknown, or finished by a step that was cut short (Ctrl-C) before its output
            return None
        delta = detok.flush() if detok else ""
        return self._output(request, detok.text[:detok.emitted] if detok else "", delta, [])

    def _make_output(self, request: Request) -> RequestOutput | None:
        detok = self.detokenizers[request.request_id]
        new_ids = request.token_ids[request.num_prompt_tokens + detok.num_tokens:]  # (not a copy of every output token)
        # (the scheduler finishes as "stopped" on an EOS or stop token, or on a completed grammar,
        # whose last token is text; stop strings are found just below)
        last = new_ids[-1] if new_ids else None
        ended_on_stop_token = (request.status == RequestStatus.FINISHED_STOPPED
                               and (last in request.eos_token_ids or last in request.params.stop_token_ids))
        fed = detok.num_tokens
        delta, stop = detok.update(new_ids, stop_token=ended_on_stop_token)
        if stop is not None and request.status != RequestStatus.FINISHED_ERROR:  # a failed grammar stays an error
            used = detok.num_tokens - fed  # accepted drafts past the one that completed the stop string
            self.end_on_stop(request, len(new_ids) - used, stop)
            new_ids = new_ids[:used]
        elif request.is_finished:
            delta += detok.flush()
        if request.is_finished:
            del self.detokenizers[request.request_id]
        elif request.params.output_kind == "final":
            return None  # (its text is still followed: stop strings end it)
        return self._output(request, detok.text[:detok.emitted], delta, new_ids)

    def _output(self, request: Request, text: str, delta: str, new_ids: list[int]) -> RequestOutput:
        if request.params.output_kind == "final":  # its one report: all of it is new
            delta, new_ids = text, request.output_token_ids
        logprobs = request.params.logprobs is not None
        completion = CompletionOutput(
            index=0, text=text, token_ids=request.output_token_ids, finish_reason=request.finish_reason,
            stop_reason=request.stop_reason, logprobs=list(request.output_logprobs) if logprobs else None,
            cumulative_logprob=request.cumulative_logprob if logprobs else None)
        timeline = request.timeline
        metrics = RequestMetrics(request.arrival_time, timeline.time_of("admitted"), timeline.time_of("first_token"),
                                 timeline.time_of("finished"), request.num_cached_tokens, request.num_preemptions,
                                 request.num_external_tokens)
        grammar = request.grammar
        failed = grammar is not None and grammar.failed and request.status == RequestStatus.FINISHED_ERROR
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, [completion],
                             request.is_finished, new_text=delta, new_token_ids=new_ids, metrics=metrics,
                             timeline=timeline,
                             prompt_logprobs=request.prompt_logprobs if request.params.prompt_logprobs is not None
                             else None,
                             prompt_logprob_ranks=request.prompt_logprob_ranks
                             if request.params.prompt_logprobs is not None else None,
                             error=f"its structured output's grammar failed: {grammar.error}" if failed else None,
                             kv_transfer_params=request.kv_transfer_params,
                             embedding=request.embedding)
