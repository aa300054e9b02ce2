"""Fit at start (serving/engine/fit.py): the settings a config leaves `auto` sized by the memory model before the
engine loads: the weights within a GPU's free memory (experts to host memory first, then layers), the context and
slots in what is left, up to the trained length; explicit settings win; on the CPU the K/V cache's share of host
memory. The arithmetic on shapes written here (unit lane), and the engine loading a synthetic mixture of experts
on a declared GPU (engine lane: a CPU build of llama.cpp loads it whatever the placement)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from serving.engine.config import AutoSetting, EngineConfig, load_engine_config
from serving.engine.devices import DeviceMemory
from serving.engine.fit import (AGENT_CTX, CELL_STEP, CPU_KV_CAP, FIT_MARGIN, DeviceKind, FitBudget, cpu_budget, fit,
                                gpu_budget)
from serving.engine.memory import ModelShape, kv_cache_bytes, predict
from serving.engine.units import GiB, MiB
from tests.helpers import script_module

AUTO_ALL = {"n_gpu_layers": "auto", "n_ctx": "auto", "n_parallel": "auto"}


def dense(n_layer: int = 32, layer_bytes: int = 200 * MiB, n_ctx_train: int = 131072) -> ModelShape:
    """A Llama-3-8B-like shape (GQA, 8 K/V heads of 128): `n_layer` layers of `layer_bytes`."""
    tensors = [("token_embd.weight", 250 * MiB), ("output.weight", 250 * MiB), ("output_norm.weight", 16_384)]
    for i in range(n_layer):
        tensors += [(f"blk.{i}.attn_q.weight", layer_bytes // 4), (f"blk.{i}.ffn_up.weight", layer_bytes * 3 // 4)]
    return ModelShape(arch="llama", n_layer=n_layer, n_embd=4096, n_head=32, n_head_kv=8, head_dim_k=128,
                      head_dim_v=128, n_ff=14336, n_vocab=128256, n_ctx_train=n_ctx_train,
                      weight_bytes=sum(size for _, size in tensors), token_embd_bytes=250 * MiB,
                      tensors=tuple(tensors))


def moe(n_layer: int = 48, n_ctx_train: int = 40960) -> ModelShape:
    """A 30B-A3B-like mixture of experts: per layer 20 MiB of attention and 330 MiB of experts (128, 8 used)."""
    tensors = [("token_embd.weight", 150 * MiB), ("output.weight", 150 * MiB)]
    for i in range(n_layer):
        tensors += [(f"blk.{i}.attn_q.weight", 20 * MiB)]
        tensors += [(f"blk.{i}.ffn_{part}_exps.weight", 110 * MiB) for part in ("up", "down", "gate")]
    return ModelShape(arch="qwen3moe", n_layer=n_layer, n_embd=2048, n_head=32, n_head_kv=4, head_dim_k=128,
                      head_dim_v=128, n_ff=768, n_vocab=151936, n_ctx_train=n_ctx_train,
                      weight_bytes=sum(size for _, size in tensors), token_embd_bytes=150 * MiB, n_expert=128,
                      n_expert_used=8, tensors=tuple(tensors))


def gpu(free: int) -> FitBudget:
    """The budget of one GPU with `free` bytes free (the fit leaves FIT_MARGIN of it)."""
    return gpu_budget([DeviceMemory(0, "test GPU", 80 * GiB, 80 * GiB - free, free)], EngineConfig())


# -- the settings ----------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_auto_is_written_read_and_dumped_as_the_word() -> None:
    assert EngineConfig().auto == {AutoSetting.n_gpu_layers}  # llama-server's -ngl auto is its default too
    config = EngineConfig(**AUTO_ALL, vram_budget="10GiB")
    assert config.auto == set(AutoSetting) and config.vram_budget == 10 * GiB and not config.sized
    dumped = config.to_yaml_dict()
    assert dumped["n_ctx"] == dumped["n_parallel"] == dumped["n_gpu_layers"] == "auto" and "auto" not in dumped
    assert EngineConfig(**dumped) == config and hash(EngineConfig(**dumped)) == hash(config)
    # a value takes a setting out of auto, in a new config and in a copy (which skips the validators)
    assert EngineConfig(n_gpu_layers=-1).auto == set() and EngineConfig(n_gpu_layers="20").n_gpu_layers == 20
    copied = config.model_copy(update={"n_ctx": 8192})
    assert copied.auto == {AutoSetting.n_gpu_layers, AutoSetting.n_parallel} and copied.n_ctx == 8192
    # slots too few for the context are refused only when both are the user's
    assert EngineConfig(n_ctx=32, n_parallel="auto").auto == {AutoSetting.n_gpu_layers, AutoSetting.n_parallel}
    assert load_engine_config(Path("configs/default.yaml")).auto == set(AutoSetting)  # serve run's default


# -- the weights ---------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_a_dense_model_over_the_gpu_gets_the_most_layers_that_fit() -> None:
    shape = dense()
    config = EngineConfig(n_ctx=8192, n_parallel=2)
    whole = predict(shape, config.model_copy(update={"n_gpu_layers": -1}), on_gpu=True).total
    roomy = fit(shape, config, gpu(whole + FIT_MARGIN))
    assert roomy.config.n_gpu_layers == -1 and roomy.config.sized and roomy.predicted <= roomy.budget.bytes
    tight = fit(shape, config, gpu(whole // 2 + FIT_MARGIN))
    layers = tight.config.n_gpu_layers
    assert 0 < layers < shape.n_layer and tight.predicted <= tight.budget.bytes
    one_more = predict(shape, tight.config.model_copy(update={"n_gpu_layers": layers + 1}), on_gpu=True).total
    assert one_more > tight.budget.bytes  # the most that fit, not fewer
    assert tight.config.n_ctx == 8192 and tight.config.n_parallel == 2  # the user's context is kept
    assert "layers on the GPU" in tight.describe(shape) and "budget" in tight.describe(shape)


@pytest.mark.unit
def test_a_mixture_of_experts_moves_experts_of_the_last_layers_first_then_layers() -> None:
    shape = moe()
    config = EngineConfig(n_ctx=4096, n_parallel=1)
    placed = fit(shape, config, gpu(8 * GiB + FIT_MARGIN))
    moved = placed.config.n_cpu_moe
    assert placed.config.n_gpu_layers == -1 and 0 < moved < shape.n_layer
    assert placed.config.cpu_moe_start == shape.n_layer - moved  # where llama-server's --fit puts them
    assert placed.predicted <= 8 * GiB < predict(shape, placed.config.model_copy(
        update={"n_cpu_moe": moved - 1, "cpu_moe_start": shape.n_layer - moved + 1}), on_gpu=True).total
    # a budget that even all experts in host memory overrun: whole layers go too
    squeezed = fit(shape, config, gpu(GiB + FIT_MARGIN))
    assert squeezed.config.n_cpu_moe == shape.n_layer and 0 <= squeezed.config.n_gpu_layers < shape.n_layer


@pytest.mark.unit
def test_a_mixture_of_experts_with_auto_context_moves_experts_for_an_agents_slot() -> None:
    shape = moe()  # trained on 40,960 tokens: an agent's slot is that long
    budget = gpu(8 * GiB + FIT_MARGIN)
    for_speed = fit(shape, EngineConfig(n_ctx=4096, n_parallel=1), budget).config
    for_agents = fit(shape, EngineConfig(**AUTO_ALL), budget)
    assert for_agents.config.n_ctx_per_slot == shape.n_ctx_train and for_agents.config.n_parallel == 1
    assert for_speed.n_cpu_moe < for_agents.config.n_cpu_moe < shape.n_layer and for_agents.config.n_gpu_layers == -1
    assert for_agents.predicted <= budget.bytes
    # a dense model never moves layers for context: the weights first, the context in what is left
    dense_shape = dense()
    whole = predict(dense_shape, EngineConfig(n_ctx=4096, n_parallel=1, n_gpu_layers=-1), on_gpu=True).total
    sized = fit(dense_shape, EngineConfig(**AUTO_ALL), gpu(whole + 2 * GiB + FIT_MARGIN)).config
    assert sized.n_gpu_layers == -1 and 4096 < sized.n_ctx_per_slot < AGENT_CTX


@pytest.mark.unit
@pytest.mark.parametrize("explicit", [{"n_gpu_layers": 7}, {"n_gpu_layers": -1}, {"n_cpu_moe": 3},
                                      {"override_tensor": "ffn_.*_exps=CPU"}])
def test_the_users_placement_wins(explicit: dict[str, object]) -> None:
    shape = moe()
    config = EngineConfig(n_ctx=4096, n_parallel=1, **explicit)  # type: ignore[arg-type]
    placed = fit(shape, config, gpu(4 * GiB + FIT_MARGIN)).config
    assert placed.n_gpu_layers == explicit.get("n_gpu_layers", -1)
    assert placed.n_cpu_moe == explicit.get("n_cpu_moe", 0) and placed.cpu_moe_start == 0
    assert placed.override_tensor == config.override_tensor


@pytest.mark.unit
def test_the_budget_is_the_free_memory_less_the_margin_or_vram_budget_where_less() -> None:
    card = [DeviceMemory(0, "H100", 80 * GiB, 2 * GiB, 78 * GiB)]
    assert gpu_budget(card, EngineConfig()).bytes == 78 * GiB - FIT_MARGIN
    assert gpu_budget(card, EngineConfig(vram_budget="10GiB")).bytes == 10 * GiB
    assert gpu_budget(card, EngineConfig(vram_budget="100GiB")).bytes == 78 * GiB - FIT_MARGIN
    assert cpu_budget(8 * GiB).bytes == 2 * GiB and cpu_budget(512 * GiB).bytes == CPU_KV_CAP


# -- the context ---------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_auto_context_is_the_trained_length_where_memory_allows() -> None:
    shape = dense(n_ctx_train=32768)
    sized = fit(shape, EngineConfig(**AUTO_ALL), gpu(80 * GiB)).config
    assert sized.n_gpu_layers == -1 and sized.n_parallel == 4 and sized.n_ctx_per_slot == 32768


@pytest.mark.unit
def test_auto_context_is_bounded_by_memory_and_keeps_an_agents_slots() -> None:
    shape = dense()  # 128 KiB of f16 K/V a token: 65,536 tokens take 8 GiB
    weights = predict(shape, EngineConfig(n_ctx=4096, n_parallel=1, n_gpu_layers=-1), on_gpu=True).total
    budget = gpu(weights + 22 * GiB + FIT_MARGIN)  # room for two slots of an agent's context, not four
    fitted = fit(shape, EngineConfig(**AUTO_ALL), budget)
    sized = fitted.config
    assert sized.n_gpu_layers == -1 and sized.n_parallel == 2
    assert AGENT_CTX <= sized.n_ctx_per_slot < shape.n_ctx_train and fitted.predicted <= budget.bytes
    wider = sized.model_copy(update={"n_ctx": (sized.n_ctx_per_slot + CELL_STEP) * 2})
    assert predict(shape, wider, on_gpu=True).total > budget.bytes  # the largest that fits
    # with the slots the user's, the context is what is left for them
    four = fit(shape, EngineConfig(n_ctx="auto", n_parallel=4), budget).config
    assert four.n_parallel == 4 and four.n_ctx_per_slot < AGENT_CTX
    # with the context the user's, auto slots keep a slot at an agent's context
    assert fit(shape, EngineConfig(n_ctx=131072, n_parallel="auto"), budget).config.n_parallel == 2


@pytest.mark.unit
def test_on_the_cpu_the_weights_stay_and_the_cache_takes_its_share_of_host_memory() -> None:
    shape = dense(n_ctx_train=131072)
    budget = cpu_budget(16 * GiB)  # 4 GiB of K/V: 32,768 tokens of this model
    fitted = fit(shape, EngineConfig(**AUTO_ALL), budget)
    assert budget.kind is DeviceKind.cpu and fitted.config.n_gpu_layers == -1
    assert fitted.config.n_parallel == 1 and fitted.config.n_ctx_per_slot == 32768
    assert kv_cache_bytes(shape, fitted.config) <= budget.bytes
    assert fit(shape, EngineConfig(), budget).config == EngineConfig(n_gpu_layers=-1)  # else nothing changes


# -- the engine ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def synthetic() -> Iterator[ModuleType]:
    yield from script_module("make_synthetic_gguf")


@pytest.fixture(scope="module")
def tiny_moe(synthetic: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tinymoe` preset: qwen3moe, 4 layers of 8 experts (2 used), trained on 4,096 tokens, ~19 MB."""
    out = tmp_path_factory.mktemp("fit") / "tinymoe.gguf"
    synthetic.write_model(synthetic.PRESETS["tinymoe"], out, seed=3, log=lambda _: None)
    return out


@pytest.mark.engine
def test_the_engine_places_a_model_over_its_gpu_at_load_and_explicit_settings_win(
        tiny_moe: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from serving.engine import core, devices
    from serving.engine.core import Engine

    shape = ModelShape.from_gguf(tiny_moe)
    least = EngineConfig(model=tiny_moe, n_ctx=4096, n_parallel=1, n_batch=256, n_ubatch=256)
    everything = predict(shape, least.model_copy(update={"n_gpu_layers": -1}), on_gpu=True).total
    no_experts = predict(shape, least.model_copy(update={"n_cpu_moe": shape.n_layer}), on_gpu=True).total
    free = (everything + no_experts) // 2 + FIT_MARGIN  # room for some of the experts
    monkeypatch.setattr(core, "gpu_offload_supported", lambda: True)
    monkeypatch.setattr(devices, "visible_gpus", lambda: (DeviceMemory(0, "declared", 2 * free, free, free),))
    requested = EngineConfig(model=tiny_moe, n_batch=256, n_ubatch=256, **AUTO_ALL)
    with caplog.at_level("INFO", logger="serving"):
        engine = Engine(requested)
    try:
        placed = engine.config
        assert engine.requested == requested and placed.sized
        assert placed.n_gpu_layers == -1 and 0 < placed.n_cpu_moe < shape.n_layer
        assert placed.cpu_moe_start == shape.n_layer - placed.n_cpu_moe
        assert placed.n_ctx_per_slot == engine.n_ctx_slot == shape.n_ctx_train  # the trained length: a small cache
        assert predict(shape, placed, on_gpu=True).total <= free - FIT_MARGIN
        assert any(r.message.startswith("fit (") and "in host memory" in r.message for r in caplog.records)
        engine.reconfigure(least.model_copy(update={"n_gpu_layers": 2}), timeout=120)  # explicit: as written
        assert engine.config.n_gpu_layers == 2 and engine.config.n_cpu_moe == 0
    finally:
        engine.close()


@pytest.mark.engine
def test_the_replica_serves_what_the_fit_sized_and_the_same_auto_config_again_rebuilds_nothing(
        tiny_moe: Path) -> None:
    """Through the replica's host, on this machine's CPU: the auto settings sized once at load; Serve sending the
    same config again (a redeploy, a restore) compares it with what was asked, not with the sized config."""
    import asyncio
    from types import SimpleNamespace

    from serving.replica import host as engine_host

    requested = EngineConfig(model=tiny_moe, n_batch=256, n_ubatch=256, **AUTO_ALL)
    limits = engine_host.HostLimits(max_queued_requests=4, traffic_record=16, tuning_lease_s=60.0,
                                    config_poll_s=600.0)
    host = engine_host.EngineHost("r1", limits, SimpleNamespace())

    async def scenario() -> None:
        await host.take(requested)
        while host.state() is engine_host.HostState.loading:
            await asyncio.sleep(0.1)
        engine = host.ready_engine()
        sized = engine.config
        assert sized.sized and engine.requested == requested and sized.n_ctx_per_slot <= 4096
        await host.apply(EngineConfig(**requested.to_yaml_dict()))  # the same config, as Serve sends it
        assert engine.config is sized  # not sized again, not rebuilt (a rebuild installs a new config)
        await host.apply(requested.model_copy(update={"n_parallel": 2}))  # a value: the context only
        assert engine.config.n_parallel == 2 and engine.weight_loads == 1

    try:
        asyncio.run(scenario())
    finally:
        host.close()
