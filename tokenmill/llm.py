"""LLM: the offline API. Queue every prompt, step the engine until all are done, return the
outputs in input order.

    llm = LLM()                                   # the default model
    outs = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=32, temperature=0))
    outs[0].outputs[0].text
    llm.embed(["a text to embed"])                # [[...hidden size floats...]]
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from tokenmill.chat import render_chat
from tokenmill.config import EngineConfig
from tokenmill.engine import LLMEngine
from tokenmill.input_processor import Prompt
from tokenmill.outputs import RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_options) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 deadline: Sequence[float | None] | None = None) -> list[RequestOutput]:
        """Prompts are strings, token-id lists or {"prompt_token_ids": [...]} dicts (or one of them).
        priority: one per prompt (lower first), for the engine's "priority" scheduling policy;
        deadline: one per prompt, seconds from this call (None: none), for its "edf" policy."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        start = time.monotonic()
        deadlines = list(deadline) if deadline is not None else [None] * len(prompts)
        deadlines = [None if d is None else start + d for d in deadlines]
        if len(deadlines) != len(prompts):
            raise ValueError(f"got {len(deadlines)} deadlines for {len(prompts)} prompts")

        # n > 1 fans out into n requests; a seeded request gets seeds seed, seed+1, ...
        jobs, requests = [], []  # (prompt index, sample index, request id), and the requests
        for i, (prompt, p, rank, due) in enumerate(zip(prompts, params_list, priorities, deadlines)):
            for j in range(p.n):
                sub = (p if p.n == 1 else p.for_sample(j)).clone(output_kind="final")  # no output per step
                # as vLLM offline: max_tokens past the context ends the output there ("length")
                make = self.engine.input_processor.make_request
                requests.append(make(self._next_id(), prompt, sub, priority=rank, deadline=due, fit_to_context=True))
                jobs.append((i, j, requests[-1].request_id))
        finished = self._run(requests, "generating", use_tqdm)

        results: list[RequestOutput | None] = [None] * len(prompts)
        for i, j, request_id in jobs:
            out = finished[request_id]
            out.outputs[0].index = j
            if results[i] is None:
                results[i] = out
            else:
                results[i].outputs.append(out.outputs[0])
        return results

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[list[float]]:
        """One vector per prompt (prompts as in generate): the final hidden states of the prompt
        pooled as `pooling` says (default: the last token's, L2-normalised; an encoder's checkpoint's
        own; pooling_params.py).
        Embedding requests run through the same engine, and may share a batch with generation."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        make = self.engine.input_processor.make_embedding_request
        requests = [make(self._next_id(), prompt, pooling) for prompt in prompts]
        finished = self._run(requests, "embedding", use_tqdm)
        return [finished[r.request_id].embedding for r in requests]

    def _next_id(self) -> str:
        self._counter += 1
        return f"llm-{self._counter - 1}"

    def _run(self, requests: list[Request], desc: str, use_tqdm: bool) -> dict[str, RequestOutput]:
        """Queue the requests and step the engine until all have ended; their final outputs by id."""
        finished: dict[str, RequestOutput] = {}
        try:
            for request in requests:
                self.engine.add(request)
            with tqdm(total=len(requests), desc=desc, unit="req", disable=not use_tqdm or len(requests) < 2) as bar:
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        if out.finished:
                            finished[out.request_id] = out
                            bar.update(1)
        except BaseException:  # Ctrl-C: what this call queued must not run on in later calls
            for request in requests:
                if request.request_id not in finished:
                    self.engine.abort(request.request_id)
            raise
        finally:  # the steps ran on the caller's thread: its own work next gets every thread and core
            self.engine.reset_threads()
        return finished

    def get_tokenizer(self):
        """The Hugging Face tokenizer (vLLM's name for it)."""
        return self.tokenizer

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, continue_final_message: bool = False) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} messages) or a list of them, rendered
        through the model's chat template (with `tools`, OpenAI's function list, where the template
        shows them, the calls being the caller's to parse; and the template's own variables, such
        as Qwen3's enable_thinking, as in vLLM's LLM.chat; continue_final_message: the last message
        left open for the model to go on, with add_generation_prompt=False). Content may be a string
        or OpenAI's list of text parts."""
        self.engine.input_processor.check_generates()  # (an encoder's tokenizer has no chat template to blame)
        if not isinstance(messages, list):
            raise ValueError(f"messages: a list of message dicts, or a list of such lists; got {messages!r:.80}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.render_chat(conv, add_generation_prompt, tools, chat_template_kwargs, continue_final_message)
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def render_chat(self, conversation: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
                    continue_final_message: bool = False) -> dict:
        return render_chat(self.tokenizer, conversation, add_generation_prompt, tools, chat_template_kwargs,
                           continue_final_message)
