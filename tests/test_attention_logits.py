"""Max-logit measurement at bounded cost: tiles instead of [b, h, s, s], only on the iterations that log.

References are the full logits written out in the test (einsum, causal mask, amax), never our function.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections import Counter

import pytest
import torch

from bridge_ext.muon import attention_logits
from bridge_ext.without_te import sdpa_attention
from recipes import get_recipe
from recipes.optimizers import PRESETS

pytestmark = pytest.mark.stack  # megatron-core's attention: .ci/run runs these on every stack

CHUNK_BOUND = 512  # the bound: the largest intermediate is at most b*h*s*C with C <= 512


def full_max_logits(query, key, scale, *, causal=True):
    """Per-head max of the [b, h, s, s] logits, written out: the reference."""
    heads, groups = query.shape[2], key.shape[2]
    key = key.repeat_interleave(heads // groups, dim=2)
    logits = torch.einsum("sbhd,tbhd->bhst", query.double(), key.double()) * scale
    if causal:
        s_q, s_k = logits.shape[-2:]
        logits = logits.masked_fill(torch.ones(s_q, s_k, dtype=torch.bool).triu(1), -math.inf)
    return logits.amax(dim=(0, 2, 3))


@pytest.mark.parametrize(("s", "chunk", "causal"), [(1100, 512, True), (37, 8, True), (37, 8, False), (5, 512, True)])
def test_tiles_give_the_max_of_the_full_logits(s, chunk, causal):
    gen = torch.Generator().manual_seed(s)
    query = torch.randn(s, 2, 6, 24, generator=gen)
    key = torch.randn(s, 2, 3, 24, generator=gen)  # grouped-query attention: 2 heads per key group
    # make the max sit in different places per head: late rows, early columns, the diagonal
    query[-1, 0, 0] *= 8
    key[0, 1, 1] *= 8
    query[s // 2, 1, 4] = key[s // 2, 1, 2] * 5
    ours = sdpa_attention.max_logits(query, key, 0.2, causal=causal, chunk=chunk)
    torch.testing.assert_close(ours.double(), full_max_logits(query, key, 0.2, causal=causal), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------- real models
def _model(recipe_name: str, preset_name: str | None = None):
    from bridge_ext.build import build_config
    from bridge_ext.cpu import configure_for_cpu
    from bridge_ext.process_state import init_single_process_distributed, reset_megatron_globals
    from bridge_ext.muon import apply_preset

    reset_megatron_globals()
    init_single_process_distributed()
    recipe = get_recipe(recipe_name)
    if preset_name:
        recipe = dataclasses.replace(recipe, preset=PRESETS[preset_name])
    cfg = build_config(recipe)
    apply_preset(cfg, recipe.preset, runtime=False)
    configure_for_cpu(cfg)
    cfg.validate()
    torch.manual_seed(0)
    return cfg, cfg.model.provide_distributed_model(ddp_config=cfg.ddp, use_cpu_initialization=True)


class TensorSizes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the size of every tensor an op creates while the function ``code`` runs (on the stack)."""

    def __init__(self, code):
        super().__init__()
        self.code = code
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        frame = sys._getframe(1)
        while frame is not None and frame.f_code is not self.code:
            frame = frame.f_back
        if frame is not None:
            flat = out if isinstance(out, (tuple, list)) else [out]
            self.sizes += [t.numel() for t in flat if isinstance(t, torch.Tensor)]
        return out


@pytest.mark.slow
@pytest.mark.parametrize(("recipe_name", "preset_name"), [
    ("qwen3_proxy_muon", None),          # Megatron's local attention: our hook computes it
    ("kimi_k2_proxy_muon", "moonlight"),  # CPU mode's SDPA attention without QK-clip: our hook computes it
    ("kimi_k2_proxy_muon", None),         # kimi_k2 preset, QK-clip on: the SDPA attention computes it itself
])
def test_a_long_sequence_forward_never_builds_s_by_s_logits(cpu_mode, recipe_name, preset_name):
    from bridge_ext.process_state import reset_megatron_globals

    cfg, model = _model(recipe_name, preset_name)
    try:
        b, s = 2, 2048
        heads = cfg.model.num_attention_heads
        tracker = attention_logits.track_attention_logits(model)
        cores = [layer.self_attention.core_attention for layer in model[0].module.decoder.layers]
        captured = {}

        def capture(module, args, kwargs):  # the test's own copy of what each core attention sees
            captured[module] = (args[0].detach().clone(), args[1].detach().clone())

        grabs = [core.register_forward_pre_hook(capture, with_kwargs=True) for core in cores]
        tokens = torch.randint(0, cfg.model.vocab_size, (b, s), generator=torch.Generator().manual_seed(1))
        tracker.start()  # a logged iteration
        sizes = TensorSizes(sdpa_attention.max_logits.__code__)  # the measure, by our hook or the SDPA attention
        with torch.no_grad(), sizes:
            model[0](tokens, torch.arange(s).expand_as(tokens), None)
        tracker.stop()
        for grab in grabs:
            grab.remove()
        tracker.remove()

        bound = b * heads * s * CHUNK_BOUND
        print(f"{recipe_name} ({preset_name or 'recipe preset'}): {len(sizes.sizes)} tensors created while "
              f"measuring, the largest {max(sizes.sizes):,} elements; b*h*s*512 = {bound:,}, "
              f"b*h*s*s = {b * heads * s * s:,}")
        assert len(sizes.sizes) > 0  # the measurement ran under the recorder
        assert max(sizes.sizes) <= bound < b * heads * s * s
        for core in cores:  # and it measured the right thing: the max of the full logits
            query, key = captured[core]
            expected = full_max_logits(query, key, core.softmax_scale)
            torch.testing.assert_close(core.bridge_ext_max_logits.double(), expected, rtol=1e-5, atol=1e-6)
    finally:
        reset_megatron_globals()
        torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("recipe_name", ["qwen3_proxy_muon", "qwen3_moe_proxy_muon", "kimi_k2_proxy_muon"])
def test_muon_run_logs_max_logit_per_layer_computing_only_when_it_must(cpu_mode, tmp_path, monkeypatch, recipe_name):
    """The real pretrain() loop, 6 iterations of 2 micro-batches, telemetry every 3: the max logit is computed
    on the two logged iterations only, unless QK-clip (Kimi K2's preset) needs it on every forward."""
    from bridge_ext import training
    from bridge_ext.build import build_config
    from bridge_ext.process_state import reset_megatron_globals
    from bridge_ext.muon import install_ns_coefficients

    iters, interval = 6, 3
    recipe = get_recipe(recipe_name)
    cfg = build_config(recipe, values={"train.train_iters": iters, "logger.log_interval": interval})
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.logger.tensorboard_dir = str(tmp_path / "tb")
    micro_batches = cfg.train.global_batch_size // cfg.train.micro_batch_size
    assert micro_batches == 2

    computed = Counter()  # iteration -> forwards (of one layer) the max logit was computed on
    step = {"iteration": 0}
    original = sdpa_attention.max_logits

    def counting(*args, **kwargs):
        computed[step["iteration"]] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(sdpa_attention, "max_logits", counting)

    class Iteration:
        def on_train_step_start(self, context):
            step["iteration"] = context.state.train_state.step + 1

    reset_megatron_globals()
    try:
        prepared = training.prepare(recipe, cfg, device="cpu", data="mock")
        training.run_pretrain(cfg, prepared, callbacks=[Iteration()])
    finally:
        install_ns_coefficients("quintic")
        reset_megatron_globals()
    telemetry = prepared.callbacks[0]
    layers = cfg.model.num_layers
    logged = [i for i in range(1, iters + 1) if i % interval == 0]
    assert [r["iteration"] for r in telemetry.history] == logged
    for record in telemetry.history:
        per_layer = [record[f"max_attention_logit/layer_{i}"] for i in range(layers)]
        assert all(0 < x < 100 for x in per_layer) and record["max_attention_logit"] == max(per_layer)
        assert 0 < record["update_rms/muon"] < 0.1
    every = range(1, iters + 1) if cfg.model.qk_clip else logged
    assert computed == {i: micro_batches * layers for i in every}, computed
    print(f"{recipe_name}: max logit computed on iterations {sorted(computed)} ({micro_batches} micro-batches x "
          f"{layers} layers each); per layer at iteration {logged[-1]}: "
          f"{[round(telemetry.history[-1][f'max_attention_logit/layer_{i}'], 3) for i in range(layers)]}")


# ------------------------------------------------------------------------------- QK-clip over micro-batches
TAU = 100.0
# layer -> head -> factor on the head's query rows (its logits scale by it; unforced heads are ~0.1)
FORCE = {1: {1: 3000.0}, 2: {0: 5000.0, 2: 3000.0, 3: 12000.0}}


class ClipProbe:
    """A Megatron Bridge callback: forces some heads' logits above tau at the start, then records per step
    each head's max logit per micro-batch (the full logits, written out here) and the weights QK-clip scales."""

    def __init__(self):
        self.steps: list[dict] = []
        self.current: dict | None = None

    def _layers(self, model):
        return model[0].module.decoder.layers  # fp32 on CPU: DDP -> GPTModel

    def on_train_start(self, context):
        layers = self._layers(context.model)
        config = layers[0].self_attention.config
        self.nope, self.rope, self.v = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
        self.heads = config.num_attention_heads
        with torch.no_grad():
            for layer, heads in FORCE.items():
                w = layers[layer].self_attention.linear_q_up_proj.weight.view(self.heads, self.nope + self.rope, -1)
                for head, factor in heads.items():
                    w[head] *= factor
        for index, layer in enumerate(layers):
            core = layer.self_attention.core_attention

            def record(module, args, kwargs, index=index):
                if self.current is not None:
                    maximum = full_max_logits(args[0].detach(), args[1].detach(), module.softmax_scale)
                    self.current["maxima"][index].append(maximum)

            core.register_forward_pre_hook(record, with_kwargs=True)

    def _weights(self, context):
        return {i: (layer.self_attention.linear_q_up_proj.weight.detach().clone(),
                    layer.self_attention.linear_kv_up_proj.weight.detach().clone())
                for i, layer in enumerate(self._layers(context.model))}

    def on_train_step_start(self, context):
        layers = len(self._layers(context.model))
        self.current = {"maxima": {i: [] for i in range(layers)}, "before": self._weights(context)}

    def on_train_step_end(self, context):
        self.current["after"] = self._weights(context)
        self.steps.append(self.current)
        self.current = None


def _train_kimi_proxy_with_lr_0(path: str, probe: ClipProbe, tmp_path) -> None:
    """Two iterations of four micro-batches at lr 0 (the optimizer moves nothing; only QK-clip scales weights),
    through ``nemo llm pretrain``'s path (telemetry on) or ``nemo llm compare``'s worker (telemetry off)."""
    from bridge_ext import compare, training
    from bridge_ext.build import build_config
    from bridge_ext.process_state import reset_megatron_globals
    from bridge_ext.muon import install_ns_coefficients

    reset_megatron_globals()
    try:
        if path == "pretrain":
            recipe = get_recipe("kimi_k2_proxy_muon")
            cfg = build_config(recipe, values={"train.train_iters": 2, "train.micro_batch_size": 2})
            cfg.optimizer.lr = cfg.optimizer.min_lr = 0.0
            cfg.checkpoint.save = cfg.checkpoint.load = cfg.logger.tensorboard_dir = None
            prepared = training.prepare(recipe, cfg, device="cpu", data="mock")
            assert [type(c).__name__ for c in prepared.callbacks] == ["MuonTelemetry"]
            training.run_pretrain(cfg, prepared, callbacks=[probe])
        else:
            spec = {"recipe": "kimi_k2_proxy_muon", "overrides": ["optimizer.lr=0.0", "optimizer.min_lr=0.0",
                                                                  "train.micro_batch_size=2"],
                    "label": "kimi", "iters": 2, "seed": 1234, "data": "mock", "common": [], "device": "cpu",
                    "threads": 0, "losses": str(tmp_path / "losses.jsonl")}
            compare.train_one(spec, callbacks=[probe])
    finally:
        install_ns_coefficients("quintic")
        reset_megatron_globals()


@pytest.mark.slow
@pytest.mark.parametrize("path", ["pretrain", "compare"])
def test_qk_clip_uses_the_max_over_every_micro_batch_of_the_step(cpu_mode, tmp_path, path):
    probe = ClipProbe()
    _train_kimi_proxy_with_lr_0(path, probe, tmp_path)
    assert len(probe.steps) == 2
    nope, heads = probe.nope, probe.heads
    first, second = probe.steps
    # the premises: four micro-batches per step whose maxima differ, so that the last one alone would give
    # another factor for some clipped head; and after step 1's clip, step 2's maxima are lower (reset matters)
    assert all(len(m) == 4 for step in probe.steps for m in step["maxima"].values())
    assert any(max(float(x[h]) for x in m[:-1]) > max(float(m[-1][h]), TAU)
               for m in first["maxima"].values() for h in range(heads))
    clipped = 0
    for number, step in enumerate(probe.steps, 1):
        for layer, maxima in step["maxima"].items():
            step_max = torch.stack(maxima).amax(dim=0)  # over the step's micro-batches
            q0, kv0 = (w.view(heads, -1, w.shape[-1]) for w in step["before"][layer])
            q1, kv1 = (w.view(heads, -1, w.shape[-1]) for w in step["after"][layer])
            for head in range(heads):
                gamma = min(1.0, TAU / float(step_max[head]))  # Kimi K2's QK-clip, alpha 0.5
                clipped += gamma < 1
                close = dict(rtol=1e-5, atol=1e-12)
                torch.testing.assert_close(q1[head, :nope], q0[head, :nope] * math.sqrt(gamma), **close)
                torch.testing.assert_close(q1[head, nope:], q0[head, nope:] * gamma, **close)
                torch.testing.assert_close(kv1[head, :nope], kv0[head, :nope] * math.sqrt(gamma), **close)
                assert torch.equal(kv1[head, nope:], kv0[head, nope:])  # v untouched
                if number == 1 and layer in FORCE:
                    print(f"{path} step 1 layer {layer} head {head}: micro-batch maxima "
                          f"{[round(float(m[head]), 2) for m in maxima]} -> gamma {gamma:.4f} "
                          f"(last micro-batch alone: {min(1.0, TAU / float(maxima[-1][head])):.4f})")
    assert clipped >= 4  # the forced heads of step 1 at least
    assert float(torch.stack(second["maxima"][2]).max()) < float(torch.stack(first["maxima"][2]).max())
