"""LLM: the offline API. Queue every prompt, step the engine until all are done, return the
outputs in input order.

    llm = LLM()                                   # the default model
    outs = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=32, temperature=0))
    outs[0].outputs[0].text
"""

from __future__ import annotations

from collections.abc import Sequence

from tqdm.auto import tqdm

from tokenmill.config import EngineConfig
from tokenmill.engine import LLMEngine, Prompt
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_options) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Prompts are strings, token-id lists or {"prompt_token_ids": [...]} dicts (or one of them)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")

        # n > 1 fans out into n requests; a seeded request gets seeds seed, seed+1, ...
        jobs = []  # (prompt index, sample index, request id)
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params_list)):
                for j in range(p.n):
                    sub = p if p.n == 1 else p.for_sample(j)
                    request_id = f"llm-{self._counter}"
                    self._counter += 1
                    self.engine.add_request(request_id, prompt, sub)
                    jobs.append((i, j, request_id))
        except ValueError:
            for _, _, request_id in jobs:
                self.engine.abort(request_id)
            raise

        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(jobs), desc="generating", unit="req", disable=not use_tqdm or len(jobs) < 2) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)

        results: list[RequestOutput | None] = [None] * len(prompts)
        for i, j, request_id in jobs:
            out = finished[request_id]
            out.outputs[0].index = j
            if results[i] is None:
                results[i] = out
            else:
                results[i].outputs.append(out.outputs[0])
        return results

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} messages) or a list of them, rendered
        through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.render_chat(conv) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def render_chat(self, conversation: list[dict]) -> dict:
        text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        return {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}
