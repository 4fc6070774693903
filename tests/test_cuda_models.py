"""The Hugging Face models of the compiler tests, compiled with ``backend="twell"`` on a Hopper GPU in
bfloat16 (``pytest -m cuda``): the TwELL kernels are what runs (not the reference), the logits match
eager, and ``mode="reduce-overhead"`` (CUDA graphs) works without skipping graphs.

Sizes are small but kernel-shaped (hidden 256, intermediate 1024, multiples of 8). Llama and OPT get
paper-like sparsity from a negative gate (OPT: fc1) bias, so the sparse path runs; Qwen2, Mistral and
Phi-3 have no MLP bias, so their ReLU is about half active and their blocks take the kernels' dense path.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, OPTConfig, OPTForCausalLM
from transformers import Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM

import twell_compile
from helpers import requires_twell_kernels
from twell_compile.testing import relative_error

pytestmark = pytest.mark.cuda


HIDDEN, INTERMEDIATE, LAYERS, HEADS, VOCAB = 256, 1024, 2, 4, 512


def _llama_like(config_cls, model_cls):
    return model_cls(config_cls(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                                max_position_embeddings=256, hidden_act="relu", mlp_bias=True))


def _phi3():
    # Gate and up as one fused projection (gate_up_proj, no bias): the op gets row slices of its weight.
    return Phi3ForCausalLM(Phi3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                      num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                                      max_position_embeddings=256, hidden_act="relu", pad_token_id=0,
                                      bos_token_id=1, eos_token_id=2))


def _opt():
    return OPTForCausalLM(OPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN, word_embed_proj_dim=HIDDEN,
                                    ffn_dim=INTERMEDIATE, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                    max_position_embeddings=256, activation_function="relu", enable_bias=True))


BUILDERS = {
    "llama": lambda: _llama_like(LlamaConfig, LlamaForCausalLM),
    "qwen2": lambda: _llama_like(Qwen2Config, Qwen2ForCausalLM),
    "mistral": lambda: _llama_like(MistralConfig, MistralForCausalLM),
    "opt": _opt,
    "phi3": _phi3,
}


SPARSE = {"llama", "opt"}  # the models with a bias to make sparse


def _sparse_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = BUILDERS[name]()
    for module in model.modules():
        # the projection whose ReLU is the sparse activation: gate_proj (gated) or fc1 (OPT)
        for proj_name in ("gate_proj", "fc1"):
            proj = getattr(module, proj_name, None)
            if proj is not None and proj.bias is not None:
                with torch.no_grad():
                    proj.bias.fill_(-2.5 * proj.weight.norm(dim=1).mean().item())
    return model.to(device="cuda", dtype=torch.bfloat16).eval()


@pytest.fixture(autouse=True)
def _twell_kernels_at_every_size(monkeypatch):
    """The models run 256 tokens, which the plan would give to cuBLAS (config.cublas_rows): these tests
    are about the TwELL kernels running inside compiled models, so the route is switched off here, and
    so is the routing of dense layers by their observed density."""
    from twell_compile.kernels import twell_mlp

    monkeypatch.setattr(twell_mlp.config, "cublas_rows", (1, 0))
    monkeypatch.setattr(twell_mlp.config, "route_by_density", False)


def _twell_calls(recorder) -> list:
    return [call for call in recorder.calls() if call.op in ("gated_relu_mlp", "relu_mlp")]


@requires_twell_kernels
@pytest.mark.parametrize("name", list(BUILDERS))
def test_compiled_model_runs_twell_kernels_and_matches_eager(name):
    model = _sparse_model(name)
    ids = torch.randint(0, VOCAB, (4, 64), device="cuda")
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits.float()
        compiled = torch.compile(model, backend="twell")
        with twell_compile.record_sparsity() as recorder:
            actual = compiled(ids, use_cache=False).logits.float()
    calls = _twell_calls(recorder)
    assert len(calls) == LAYERS
    # Only the kernel path reports overflow rows and dense blocks; the reference path leaves them None.
    assert all(call.blocks is not None and call.overflow_rows is not None for call in calls)
    assert all(call.path == "twell" for call in calls)
    if name in SPARSE:
        assert all(0 < call.mean_nnz_per_row < 0.05 * INTERMEDIATE for call in calls), [c.mean_nnz_per_row for c in calls]
        assert all(call.dense_blocks == 0 for call in calls)
    else:
        assert all(call.dense_blocks == call.blocks for call in calls)
    assert relative_error(actual, expected) < 2e-2


@requires_twell_kernels
@pytest.mark.parametrize("name", ["llama", "opt"])
def test_compiled_model_in_cuda_graph_mode(name):
    model = _sparse_model(name)
    ids = torch.randint(0, VOCAB, (4, 64), device="cuda")
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits.float()
        compiled = torch.compile(model, backend="twell", mode="reduce-overhead")
        for _ in range(3):  # warm-up, recording, replay
            actual = compiled(ids, use_cache=False).logits.float().clone()
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0
    assert sum(r.rewritten_count for r in twell_compile.last_reports()) == LAYERS
    assert relative_error(actual, expected) < 2e-2
