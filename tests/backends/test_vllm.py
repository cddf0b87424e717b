"""vLLM backend against a stand-in `vllm` (AsyncLLM, SamplingParams, the platform), in the main venv.

The backend also runs for real on vLLM's CPU build: tests_vllm/ (run by .ci/run in the vLLM venv). These tests
cover what that run cannot: the engine args chosen on a GPU, hub checkpoints, old vLLM versions, and the order of
shutdown steps. Each stand-in names the upstream code (vLLM 0.32 unless said) whose behaviour it imitates.
"""

from __future__ import annotations

import asyncio
import enum
import json
import sys
import threading
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypedDict

import pytest

from orpheus_tts_plugin.backends.protocol import BackendError, FinishReason, GenerationRequest
from orpheus_tts_plugin.backends.pumped import continuation_seed
from orpheus_tts_plugin.config import SamplingParams
from orpheus_tts_plugin.spec import ENGLISH
from orpheus_tts_plugin.tools.testmodel import write_lora_adapter

SPEC = ENGLISH
AUDIO = [SPEC.audio_token(0, 1), SPEC.audio_token(1, 2), SPEC.audio_token(2, 3), SPEC.audio_token(3, 4)]
FQCN = "orpheus_tts_plugin.backends.vllm_logits:OrpheusAudioLogitsProcessor"


# ---- stand-in for vllm (v1 engine); field names as in vLLM, unknown keywords raise ----


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(kw_only=True)
class FakeSamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    detokenize: bool = True
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict[str, Any] | None = None


@dataclass(kw_only=True)
class FakeEngineArgs:
    model: str = "facebook/opt-125m"
    tokenizer: str | None = None
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool | None = None
    disable_log_stats: bool = False
    enforce_eager: bool = False
    logits_processors: list[Any] | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None


MaxLoRARanks = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]  # vllm/config/lora.py (0.32)


@dataclass
class FakeLoRARequest:
    """Like vllm/lora/request.py LoRARequest: a positive id and a path (its __post_init__ checks both)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")
        assert self.lora_path, "lora_path cannot be empty"


class TokensPrompt(TypedDict, total=False):
    prompt_token_ids: list[int]


def tokens_input(ids: list[int]) -> dict[str, Any]:
    """Like vllm/inputs/engine.py tokens_input (after 0.10.2)."""
    return {"type": "token", "prompt_token_ids": ids}


class FakePlatform:
    """Like vllm.platforms.current_platform: CPU, or CUDA with a compute capability (e.g. 90 for Hopper)."""

    def __init__(self, device: str = "cpu", capability: int | None = None):
        self.device_type, self.capability = device, capability

    def is_cpu(self) -> bool:
        return self.device_type == "cpu"

    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    def has_device_capability(self, capability: int) -> bool:
        return self.capability is not None and self.capability >= capability


@dataclass
class FakeCompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class FakeRequestOutput:
    request_id: str
    outputs: list[FakeCompletionOutput]
    finished: bool
    num_cached_tokens: int | None = None


@dataclass
class FakeRequest:
    prompt: Any
    params: FakeSamplingParams
    lora_request: FakeLoRARequest | None = None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    internal_aborts: int = 0


class FakeAsyncLLM:
    instances: list[FakeAsyncLLM] = []

    def __init__(self, engine_args: FakeEngineArgs):
        self.engine_args = engine_args
        self.requests: dict[str, FakeRequest] = {}
        self.live: set[str] = set()
        self.aborted: list[str] = []
        self.shutdown_calls: list[dict[str, Any]] = []
        self.num_cached_tokens = 0  # every output's prefix-cache hit
        FakeAsyncLLM.instances.append(self)

    @classmethod
    def from_engine_args(
        cls, engine_args: FakeEngineArgs, start_engine_loop: bool = True, usage_context=None, stat_loggers=None
    ) -> FakeAsyncLLM:
        assert isinstance(engine_args, FakeEngineArgs)
        return cls(engine_args)

    async def generate(
        self,
        prompt: Any,
        sampling_params: FakeSamplingParams,
        request_id: str,
        *,
        lora_request: FakeLoRARequest | None = None,
        **kwargs: Any,
    ):
        """Like v1/engine/async_llm.py AsyncLLM.generate: cancellation or aclose aborts internally."""
        assert lora_request is None or self.engine_args.enable_lora  # vLLM: "LoRA is not enabled!"
        req = FakeRequest(prompt, sampling_params, lora_request)
        self.requests[request_id] = req
        self.live.add(request_id)
        try:
            while True:
                ids, finish = await req.queue.get()
                completion = FakeCompletionOutput(0, "", ids, finish)
                out = FakeRequestOutput(request_id, [completion], finish is not None, self.num_cached_tokens)
                if out.finished:
                    self.live.discard(request_id)
                yield out
                if out.finished:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            req.internal_aborts += 1
            self.live.discard(request_id)
            raise

    def step(self, request_id: str, ids: list[int], finish: str | None = None) -> None:
        self.requests[request_id].queue.put_nowait((ids, finish))

    async def abort(self, request_id: str | list[str], internal: bool = False) -> None:
        """Like AsyncLLM.abort → OutputProcessor.abort_requests: a final output with finish reason 'abort'."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            self.aborted.append(rid)
            if rid in self.live:
                self.live.discard(rid)
                self.step(rid, [], "abort")

    def get_num_unfinished_requests(self) -> int:
        return len(self.live)

    def shutdown(self) -> None:
        """Like AsyncLLM.shutdown: blocking; a request still in flight when it runs on the loop never ends."""
        self.shutdown_calls.append({"thread": threading.get_ident(), "live": sorted(self.live)})


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    platform = FakePlatform("cpu")
    root = types.ModuleType("vllm")
    root.__version__ = "0.32.0"
    root.AsyncEngineArgs = FakeEngineArgs
    root.SamplingParams = FakeSamplingParams
    root.TokensPrompt = TokensPrompt
    modules = {
        "vllm": root,
        "vllm.sampling_params": types.ModuleType("vllm.sampling_params"),
        "vllm.inputs": types.ModuleType("vllm.inputs"),
        "vllm.lora": types.ModuleType("vllm.lora"),
        "vllm.lora.request": types.ModuleType("vllm.lora.request"),
        "vllm.config": types.ModuleType("vllm.config"),
        "vllm.config.lora": types.ModuleType("vllm.config.lora"),
        "vllm.platforms": types.ModuleType("vllm.platforms"),
        "vllm.v1": types.ModuleType("vllm.v1"),
        "vllm.v1.engine": types.ModuleType("vllm.v1.engine"),
        "vllm.v1.engine.async_llm": types.ModuleType("vllm.v1.engine.async_llm"),
        "vllm.model_executor": types.ModuleType("vllm.model_executor"),
        "vllm.model_executor.layers": types.ModuleType("vllm.model_executor.layers"),
        "vllm.model_executor.layers.quantization": types.ModuleType("vllm.model_executor.layers.quantization"),
    }
    modules["vllm.sampling_params"].RequestOutputKind = RequestOutputKind
    modules["vllm.inputs"].tokens_input = tokens_input
    modules["vllm.lora.request"].LoRARequest = FakeLoRARequest
    modules["vllm.config.lora"].MaxLoRARanks = MaxLoRARanks
    modules["vllm.platforms"].current_platform = platform
    modules["vllm.v1.engine.async_llm"].AsyncLLM = FakeAsyncLLM
    quant = modules["vllm.model_executor.layers.quantization"]
    quant.QUANTIZATION_METHODS = ["awq", "fp8", "fp8_per_tensor", "modelopt"]
    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    FakeAsyncLLM.instances = []
    return types.SimpleNamespace(root=root, platform=platform, quantization=quant, modules=modules)


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache, offline: hub ids are read from it only."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def cache_repo(cache: Path, repo: str, files: dict[str, dict]) -> None:
    """Put `files` (name → JSON) of hub repo `repo` into `cache`, laid out as huggingface_hub does."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("0" * 40)
    for name, content in files.items():
        (snapshot / name).write_text(json.dumps(content))


def checkpoint(root: Path, quantization: dict | None = None, kv: str | None = None) -> str:
    """A local checkpoint directory: config.json (with `quantization_config`), hf_quant_config.json if `kv`."""
    root.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {"vocab_size": SPEC.vocab_size}
    if quantization is not None:
        config["quantization_config"] = quantization
    (root / "config.json").write_text(json.dumps(config))
    if kv is not None:
        quant = {"quant_algo": "FP8", "kv_cache_quant_algo": kv}
        (root / "hf_quant_config.json").write_text(
            json.dumps({"producer": {"name": "modelopt"}, "quantization": quant})
        )
    return str(root)


def request(rid: str = "r1", *, constrain: bool = True, max_new: int = 700) -> GenerationRequest:
    prompt = (SPEC.start_of_human, SPEC.bos, 11, 22, 33, *SPEC.prompt_suffix())
    sampling = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.1, max_tokens=6144, seed=3)
    return GenerationRequest(rid, prompt, sampling, max_new, (SPEC.end_of_speech,), constrain)


async def started(model: str, **kwargs: Any):
    from orpheus_tts_plugin.backends.vllm import VllmBackend

    backend = VllmBackend(model, **kwargs)
    await backend.start()
    return backend, FakeAsyncLLM.instances[-1]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.fixture
def plain(tmp_path: Path) -> str:
    """A local unquantised checkpoint."""
    return checkpoint(tmp_path / "plain")


# ---- import and version ----


def test_import_guard_says_how_to_get_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)
    import orpheus_tts_plugin.backends.vllm as mod

    with pytest.raises(ImportError, match=r"pip install"):
        mod.VllmBackend("x")


@pytest.mark.parametrize("old", ["0.10.1", "0.10.0", "0.9.2"])
def test_a_vllm_older_than_0_10_2_is_refused_in_one_line(fake_vllm, old: str) -> None:
    from orpheus_tts_plugin.backends.vllm import VllmBackend

    fake_vllm.root.__version__ = old
    with pytest.raises(ImportError) as info:
        VllmBackend("m")
    assert "0.10.2" in str(info.value) and old in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("version", ["0.10.2", "0.11.0rc1", "0.32.0", "1.0.0.dev3+gabc"])
def test_vllm_0_10_2_and_later_are_accepted(fake_vllm, version: str) -> None:
    from orpheus_tts_plugin.backends.vllm import VllmBackend

    fake_vllm.root.__version__ = version
    VllmBackend("m")


async def test_without_tokens_input_the_prompt_is_a_tokens_prompt(fake_vllm, plain) -> None:
    del fake_vllm.modules["vllm.inputs"].tokens_input  # vLLM 0.10.2 has no vllm.inputs.tokens_input
    backend, engine = await started(plain)
    stream = backend.generate(request())
    await settle()
    assert engine.requests["r1"].prompt == {"prompt_token_ids": list(request().prompt_ids)}
    await stream.aclose()


# ---- engine arguments by device ----


async def test_on_the_cpu_build_the_defaults_are_eager_fp32_unquantised_with_the_audio_processor(
    fake_vllm, plain
) -> None:
    backend, engine = await started(plain, max_batch_size=96, max_num_tokens=4096, max_seq_len=2048)
    a = engine.engine_args
    assert (a.model, a.quantization, a.kv_cache_dtype) == (plain, None, "auto")
    assert (a.enforce_eager, a.dtype) == (True, "float32")
    assert (a.max_num_seqs, a.max_num_batched_tokens, a.max_model_len) == (96, 4096, 2048)
    assert a.logits_processors == [FQCN]
    await backend.close()


@pytest.mark.parametrize(("methods", "expected"), [(["fp8", "fp8_per_tensor"], "fp8_per_tensor"), (["fp8"], "fp8")])
async def test_on_an_fp8_gpu_an_unquantised_checkpoint_gets_online_fp8_and_an_fp8_kv_cache(
    fake_vllm, plain, methods: list[str], expected: str
) -> None:
    fake_vllm.platform.device_type, fake_vllm.platform.capability = "cuda", 90
    fake_vllm.quantization.QUANTIZATION_METHODS = methods  # "fp8_per_tensor" is 0.32's name for online FP8
    _, engine = await started(plain, gpu_memory_utilization=0.8)
    a = engine.engine_args
    assert (a.quantization, a.kv_cache_dtype, a.gpu_memory_utilization) == (expected, "fp8", 0.8)
    assert (a.enforce_eager, a.dtype) == (False, "auto")  # CUDA graphs, the checkpoint's bf16


async def test_on_a_gpu_without_fp8_nothing_is_quantised(fake_vllm, plain) -> None:
    fake_vllm.platform.device_type, fake_vllm.platform.capability = "cuda", 80  # Ampere
    _, engine = await started(plain)
    assert (engine.engine_args.quantization, engine.engine_args.kv_cache_dtype) == (None, "auto")


async def test_a_local_prequantized_checkpoint_keeps_its_own_scheme_on_a_gpu(fake_vllm, tmp_path) -> None:
    fake_vllm.platform.device_type, fake_vllm.platform.capability = "cuda", 90
    model = checkpoint(tmp_path / "fp8", {"quant_method": "modelopt"}, kv="FP8")
    _, engine = await started(model)
    assert engine.engine_args.quantization is None and engine.engine_args.kv_cache_dtype == "fp8"


async def test_a_prequantized_hub_checkpoint_in_the_cache_is_not_quantised_again_even_when_asked(
    fake_vllm, hub_cache
) -> None:
    fake_vllm.platform.device_type, fake_vllm.platform.capability = "cuda", 90
    cache_repo(hub_cache, "org/orpheus-fp8", {"config.json": {"quantization_config": {"quant_method": "modelopt"}}})
    _, engine = await started("org/orpheus-fp8", quantization="fp8")
    assert engine.engine_args.quantization is None


async def test_an_unquantised_hub_checkpoint_in_the_cache_gets_online_fp8(fake_vllm, hub_cache) -> None:
    fake_vllm.platform.device_type, fake_vllm.platform.capability = "cuda", 90
    cache_repo(hub_cache, "org/orpheus", {"config.json": {"vocab_size": SPEC.vocab_size}})
    _, engine = await started("org/orpheus")
    assert engine.engine_args.quantization == "fp8_per_tensor"


async def test_a_hub_checkpoint_that_cannot_be_read_is_left_to_vllm_unquantised(fake_vllm, hub_cache) -> None:
    fake_vllm.platform.device_type, fake_vllm.platform.capability = "cuda", 90
    _, engine = await started("org/not-cached")  # offline, not cached: its quantisation is unknown
    assert engine.engine_args.quantization is None


async def test_the_cpu_build_refuses_fp8_weights_before_starting_vllm(fake_vllm, tmp_path) -> None:
    from orpheus_tts_plugin.backends.vllm import VllmBackend

    for model, kwargs in [
        (checkpoint(tmp_path / "q", {"quant_method": "modelopt"}), {}),
        (checkpoint(tmp_path / "p"), {"quantization": "fp8_per_tensor"}),
    ]:
        with pytest.raises(ValueError, match="static_scaled_fp8_quant"):
            await VllmBackend(model, **kwargs).start()
    assert FakeAsyncLLM.instances == []


@pytest.mark.parametrize("kernels", [False, True])
async def test_the_cpu_build_takes_an_fp8_kv_cache_only_where_its_cpu_has_the_kernels(
    fake_vllm, plain, monkeypatch, kernels: bool
) -> None:
    from orpheus_tts_plugin.backends import vllm

    monkeypatch.setattr(vllm, "cpu_has_fp8_kv_kernels", lambda: kernels)  # AVX-512 or AMX (AVX2-only EPYC: none)
    if kernels:
        _, engine = await started(plain, kv_cache_dtype="fp8")
        assert engine.engine_args.kv_cache_dtype == "fp8"
    else:
        with pytest.raises(ValueError, match=r"no FP8 KV-cache kernels for this CPU .*kv_cache_dtype='auto'"):
            await vllm.VllmBackend(plain, kv_cache_dtype="fp8").start()
        assert FakeAsyncLLM.instances == []


async def test_prefix_caching_is_on_so_a_cloned_voices_reference_turn_is_computed_once(fake_vllm, plain) -> None:
    _, engine = await started(plain)
    assert engine.engine_args.enable_prefix_caching is True


async def test_engine_kwargs_override_every_choice(fake_vllm, plain) -> None:
    _, engine = await started(plain, engine_kwargs={"enforce_eager": False, "dtype": "bfloat16", "quantization": "x"})
    assert (engine.engine_args.enforce_eager, engine.engine_args.dtype, engine.engine_args.quantization) == (
        False,
        "bfloat16",
        "x",
    )


async def test_no_audio_constraint_means_no_logits_processor(fake_vllm, plain) -> None:
    backend, engine = await started(plain, constrain_audio=False)
    assert engine.engine_args.logits_processors is None
    stream = backend.generate(request())
    await settle()
    assert engine.requests["r1"].params.extra_args is None
    await stream.aclose()


# ---- requests ----


async def test_a_request_is_token_ids_with_delta_ids_only_sampling_and_the_position_constraint(
    fake_vllm, plain
) -> None:
    backend, engine = await started(plain)
    req = request(max_new=250)
    stream = backend.generate(req)
    await settle()
    sent = engine.requests["r1"]
    assert sent.prompt == {"type": "token", "prompt_token_ids": list(req.prompt_ids)}
    p = sent.params
    assert p.output_kind is RequestOutputKind.DELTA and p.detokenize is False and p.n == 1
    assert p.stop_token_ids == [128258] and p.max_tokens == 250
    assert (p.temperature, p.top_p, p.repetition_penalty, p.seed) == (0.6, 0.8, 1.1, 3)
    assert p.allowed_token_ids is None  # the union of all positions' ids: the processor does better
    assert p.extra_args == {"orpheus_audio": 1, "orpheus_first_audio_token": 128266, "orpheus_end_of_speech": 128258}
    await stream.aclose()


async def test_an_unconstrained_request_does_not_opt_in(fake_vllm, plain) -> None:
    backend, engine = await started(plain)
    stream = backend.generate(request(constrain=False))
    await settle()
    assert engine.requests["r1"].params.extra_args is None
    await stream.aclose()


async def test_deltas_stream_and_the_trailing_stop_id_is_dropped(fake_vllm, plain) -> None:
    backend, engine = await started(plain)
    stream = backend.generate(request())
    await settle()
    engine.step("r1", AUDIO[:2])
    engine.step("r1", AUDIO[2:3])
    engine.step("r1", [AUDIO[3], SPEC.end_of_speech], "stop")
    assert [ids async for ids in stream] == [AUDIO[:2], AUDIO[2:3], AUDIO[3:4]]
    assert stream.finish_reason == FinishReason.STOP
    await stream.aclose()
    assert engine.aborted == []
    assert backend.stats()["live_requests"] == 0 and backend.stats()["tokens"] == 4


async def test_a_requests_prefix_cache_hit_is_counted_once_from_its_outputs(fake_vllm, plain) -> None:
    backend, engine = await started(plain)
    engine.num_cached_tokens = 256  # vLLM repeats it on every output of the request
    stream = backend.generate(request())
    await settle()
    engine.step("r1", AUDIO[:2])
    engine.step("r1", [AUDIO[2], SPEC.end_of_speech], "stop")
    assert [ids async for ids in stream] == [AUDIO[:2], AUDIO[2:3]]
    assert stream.cached_prompt_tokens == 256 and backend.stats()["cached_prompt_tokens"] == 256


@pytest.mark.parametrize(
    ("vllm_reason", "ours"),
    [("length", FinishReason.LENGTH), ("abort", FinishReason.ABORTED), ("error", FinishReason.ERROR)],
)
async def test_vllm_finish_reasons_map_to_ours(fake_vllm, plain, vllm_reason: str, ours: str) -> None:
    backend, engine = await started(plain)
    stream = backend.generate(request(max_new=2))
    await settle()
    engine.step("r1", AUDIO[:2], vllm_reason)
    assert [ids async for ids in stream] == [AUDIO[:2]]
    assert stream.finish_reason == ours


async def test_closing_the_stream_aborts_it_in_vllm(fake_vllm, plain) -> None:
    backend, engine = await started(plain)
    stream = backend.generate(request())
    await settle()
    engine.step("r1", AUDIO[:1])
    assert await stream.__anext__() == AUDIO[:1]
    await stream.aclose()
    await settle()
    assert engine.aborted == ["r1"] and engine.requests["r1"].internal_aborts == 1
    assert engine.get_num_unfinished_requests() == 0
    assert stream.finish_reason == FinishReason.ABORTED
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()
    assert backend.stats()["aborted"] == 1 and backend.stats()["live_requests"] == 0


async def test_closing_from_another_task_wakes_the_consumer(fake_vllm, plain) -> None:
    backend, engine = await started(plain)
    stream = backend.generate(request())
    consumer = asyncio.create_task(_collect(stream))
    await settle()
    await stream.aclose()
    await settle()
    assert consumer.done() and consumer.result() == []
    assert engine.aborted == ["r1"]


async def _collect(stream) -> list[list[int]]:
    return [ids async for ids in stream]


async def test_a_paused_stream_leaves_vllm_and_resumes_as_a_request_that_continues_prompt_and_positions(
    fake_vllm, plain
) -> None:
    backend, engine = await started(plain)
    stream = backend.generate(request())
    await settle()
    engine.step("r1", AUDIO[:3])
    assert await stream.__anext__() == AUDIO[:3]
    stream.pause(True)
    await settle()
    assert engine.aborted == ["r1"] and engine.get_num_unfinished_requests() == 0
    assert backend.stats()["paused_requests"] == 1 and backend.stats()["live_requests"] == 1
    stream.pause(False)
    await settle()
    sent = engine.requests["r1~1"]
    assert sent.prompt == {"type": "token", "prompt_token_ids": [*request().prompt_ids, *AUDIO[:3]]}
    p = sent.params
    assert (p.max_tokens, p.seed, p.stop_token_ids, p.temperature) == (697, continuation_seed(3, 1), [128258], 0.6)
    assert p.extra_args["orpheus_audio_offset"] == 3 and p.extra_args["orpheus_audio"] == 1
    engine.step("r1~1", [AUDIO[3], SPEC.end_of_speech], "stop")
    assert await _collect(stream) == [AUDIO[3:4]]
    stats = backend.stats()
    assert stream.finish_reason == FinishReason.STOP and (stats["requests"], stats["tokens"]) == (1, 4)
    assert (stats["pauses"], stats["resumes"], stats["paused_requests"], stats["live_requests"]) == (1, 1, 0, 0)


async def test_an_engine_failure_is_a_backend_error(fake_vllm, plain) -> None:
    backend, engine = await started(plain)
    stream = backend.generate(request())
    await settle()
    engine.requests["r1"].queue.put_nowait(None)  # unpacking None raises inside vLLM's generator
    with pytest.raises(BackendError):
        await stream.__anext__()
    assert stream.finish_reason == FinishReason.ERROR and backend.stats()["errors"] == 1


async def test_generate_needs_a_started_backend(fake_vllm) -> None:
    from orpheus_tts_plugin.backends.vllm import VllmBackend

    with pytest.raises(BackendError, match="not started"):
        VllmBackend("m").generate(request())


# ---- shutdown ----


async def test_close_aborts_live_requests_then_shuts_vllm_down_off_the_loop(fake_vllm, plain) -> None:
    backend, engine = await started(plain)
    streams = [backend.generate(request(f"r{i}")) for i in range(3)]
    consumers = [asyncio.create_task(_collect(s)) for s in streams]
    await settle()
    engine.step("r0", AUDIO[:1], "stop")
    await settle()
    await backend.close()
    # r0 had finished; r1 and r2 were live: aborted first, so no request was in flight when shutdown ran.
    assert sorted(engine.aborted) == ["r1", "r2"]
    assert engine.shutdown_calls == [{"thread": engine.shutdown_calls[0]["thread"], "live": []}]
    assert engine.shutdown_calls[0]["thread"] != threading.get_ident()  # not on the event loop's thread
    await settle()
    assert [c.done() for c in consumers] == [True, True, True]
    assert [s.finish_reason for s in streams] == [FinishReason.STOP, FinishReason.ABORTED, FinishReason.ABORTED]
    await backend.close()  # twice: nothing more
    assert len(engine.shutdown_calls) == 1


# ---- LoRA adapters ----


@pytest.fixture
def adapters(tmp_path: Path, plain: str) -> dict[str, str]:
    """Two PEFT LoRA folders of ranks 8 and 24, by name."""
    model = Path(plain)
    _weights(model)
    return {
        "calm": str(write_lora_adapter(model, tmp_path / "calm", rank=8)),
        "bright": str(write_lora_adapter(model, tmp_path / "bright", rank=24, seed=1)),
    }


def _weights(model: Path) -> None:
    """A one-layer model.safetensors for `write_lora_adapter` to size its matrices from."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    names = ["self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.down_proj"]
    save_file({f"model.layers.0.{n}.weight": torch.zeros(8, 8) for n in names}, model / "model.safetensors")


async def test_adapters_start_vllm_with_lora_sized_to_them(fake_vllm, plain, adapters) -> None:
    backend, engine = await started(plain, adapters=sorted(adapters.items()))
    a = engine.engine_args
    # max_lora_rank: the largest r (24) rounded up to a rank vLLM takes (32); every adapter fits in one batch, and
    # on the CPU build one spare slot stays empty (VllmBackend.lora_slots: a base row's index -1 picks the last).
    assert (a.enable_lora, a.max_loras, a.max_lora_rank, a.max_cpu_loras) == (True, 3, 32, None)
    assert {n: (x.int_id, x.rank) for n, x in backend.loras.items()} == {"bright": (1, 24), "calm": (2, 8)}
    await backend.close()


async def test_on_a_gpu_there_is_one_slot_per_adapter(fake_vllm, plain, adapters) -> None:
    fake_vllm.modules["vllm.platforms"].current_platform = FakePlatform("cuda", 90)
    backend, engine = await started(plain, quantization=None, adapters=sorted(adapters.items()))
    assert (engine.engine_args.enable_lora, engine.engine_args.max_loras) == (True, 2)
    await backend.close()


async def test_without_adapters_lora_stays_off(fake_vllm, plain) -> None:
    backend, engine = await started(plain)
    assert (engine.engine_args.enable_lora, backend.loras) == (False, {})
    await backend.close()


async def test_each_request_carries_its_adapters_lora_request_and_a_continuation_keeps_it(
    fake_vllm, plain, adapters
) -> None:
    from dataclasses import replace

    backend, engine = await started(plain, adapters=sorted(adapters.items()))
    streams = [backend.generate(replace(request(rid), adapter=a)) for rid, a in [("b", None), ("c", "calm")]]
    streams.append(backend.generate(replace(request("br"), adapter="bright")))
    await settle()
    loras = {rid: engine.requests[rid].lora_request for rid in ("b", "c", "br")}
    assert loras["b"] is None
    assert loras["c"] == FakeLoRARequest("calm", 2, str(Path(adapters["calm"]).resolve()))
    assert loras["br"] == FakeLoRARequest("bright", 1, str(Path(adapters["bright"]).resolve()))
    engine.step("c", AUDIO[:2])
    assert await streams[1].__anext__() == AUDIO[:2]
    streams[1].pause(True)
    await settle()
    streams[1].pause(False)
    await settle()
    assert engine.requests["c~1"].lora_request is loras["c"]
    await backend.close()


async def test_a_request_for_an_adapter_the_backend_was_not_started_with_is_refused(fake_vllm, plain, adapters) -> None:
    from dataclasses import replace

    backend, engine = await started(plain, adapters=[("calm", adapters["calm"])])
    with pytest.raises(BackendError, match="unknown LoRA adapter 'bright'.*serves: calm"):
        backend.generate(replace(request(), adapter="bright"))
    assert engine.requests == {}
    await backend.close()


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("missing", "LoRA adapter 'x': .*missing is not a folder"),
        ("empty", "has no adapter_config.json"),
        ("prefix", "is not a LoRA \\(peft_type 'PREFIX_TUNING'"),
        ("rank", "has no rank \\(r: 0"),
        ("weights", "has no weights"),
    ],
)
async def test_a_folder_that_is_not_a_peft_lora_is_refused_in_one_line_before_vllm_starts(
    fake_vllm, plain, tmp_path, setup: str, message: str
) -> None:
    from orpheus_tts_plugin.backends.vllm import VllmBackend

    folder = tmp_path / setup
    if setup != "missing":
        folder.mkdir()
    config = {"peft_type": "LORA", "r": 8}
    if setup == "prefix":
        config["peft_type"] = "PREFIX_TUNING"
    if setup == "rank":
        config["r"] = 0
    if setup not in ("missing", "empty"):
        (folder / "adapter_config.json").write_text(json.dumps(config))
    if setup in ("prefix", "rank"):
        (folder / "adapter_model.safetensors").write_bytes(b"")
    backend = VllmBackend(plain, adapters=[("x", str(folder))])
    with pytest.raises(ValueError, match=message) as err:
        await backend.start()
    assert "\n" not in str(err.value) and FakeAsyncLLM.instances == []


def test_vllm_max_lora_rank_is_the_smallest_allowed_rank_that_holds_the_largest_adapter(fake_vllm) -> None:
    from orpheus_tts_plugin.backends.vllm import vllm_lora_rank

    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 64, 300, 512)] == [1, 8, 8, 16, 64, 320, 512]
    with pytest.raises(ValueError, match="rank 1024 is above vLLM's largest max_lora_rank \\(512\\)"):
        vllm_lora_rank(1024)


def test_make_backend_hands_the_configs_adapters_to_the_vllm_backend(fake_vllm, plain, adapters) -> None:
    from orpheus_tts_plugin.backends import make_backend
    from orpheus_tts_plugin.config import EngineConfig

    config = EngineConfig(model=plain, backend="vllm", adapters=adapters)
    assert make_backend(config, SPEC, "cpu").adapters == tuple(sorted(adapters.items()))
