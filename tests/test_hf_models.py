"""Hugging Face models compiled with ``backend="twell"``: every ReLU MLP rewritten, logits and all
parameter gradients as in eager; the same architectures with SiLU/GELU are left alone. T5 (ReLU,
encoder-decoder): rewritten in eval mode, left alone in training mode, where its dropout is live.

The models are tiny and built from configs with random weights (nothing is downloaded). Each test
triggers one Inductor compile (training tests: forward and backward), fifteen in all.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    GlmConfig,
    GlmForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

from helpers import SMALL_VOCAB_TOKENS, assert_grads_close, backend_reports

VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS = 128, 32, 64, 2, 4
BATCH, SEQ = 2, 8


def _llama_like(config_cls, model_cls, act: str, **extra):
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS // 2,
        max_position_embeddings=64,
        hidden_act=act,
        **extra,
    )
    return model_cls(config)


def _opt(act: str):
    config = OPTConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        word_embed_proj_dim=HIDDEN,
        ffn_dim=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        max_position_embeddings=64,
        activation_function=act,
        enable_bias=True,
        # No randomness in training mode, so compiled and eager runs see the same network.
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        layerdrop=0.0,
    )
    return OPTForCausalLM(config)


# name -> (builder taking the activation, ReLU activation, non-ReLU activation, kind of MLP block)
MODELS = {
    "llama": (lambda act: _llama_like(LlamaConfig, LlamaForCausalLM, act, mlp_bias=True), "relu", "silu", "gated"),
    "qwen2": (lambda act: _llama_like(Qwen2Config, Qwen2ForCausalLM, act), "relu", "silu", "gated"),
    "mistral": (lambda act: _llama_like(MistralConfig, MistralForCausalLM, act), "relu", "silu", "gated"),
    "opt": (_opt, "relu", "gelu", "non_gated"),
    # gate and up as one fused projection, gate_up_proj(x).chunk(2, dim=-1) (passes/fused_projection.py)
    "phi3": (lambda act: _llama_like(Phi3Config, Phi3ForCausalLM, act, **SMALL_VOCAB_TOKENS), "relu", "silu", "gated"),
    "glm": (lambda act: _llama_like(GlmConfig, GlmForCausalLM, act, **SMALL_VOCAB_TOKENS), "relu", "silu", "gated"),
}
model_names = pytest.mark.parametrize("name", list(MODELS))


def _build(name: str, relu: bool) -> torch.nn.Module:
    build, relu_act, other_act, _ = MODELS[name]
    torch.manual_seed(0)
    model = build(relu_act if relu else other_act)
    # Randomly initialised biases are zero; make them non-zero so the bias paths are really tested.
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias"):
                param.normal_(0.0, 0.02)
    return model


def _input_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ))


@model_names
def test_relu_model_rewritten_logits_and_gradients_match(name):
    model = _build(name, relu=True).train()
    eager_model = copy.deepcopy(model)
    input_ids = _input_ids()

    logits = torch.compile(model, backend="twell")(input_ids, use_cache=False).logits
    eager_logits = eager_model(input_ids, use_cache=False).logits

    reports = backend_reports()
    kind = MODELS[name][3]
    assert sum(r.rewritten_count for r in reports) == LAYERS
    assert sum(r.gated_count if kind == "gated" else r.non_gated_count for r in reports) == LAYERS
    assert sum(r.left_alone_count for r in reports) == 0
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-6)

    logits.float().square().mean().backward()
    eager_logits.float().square().mean().backward()
    assert_grads_close(model, eager_model, rtol=1e-4, atol=1e-6)


@model_names
@torch.no_grad()
def test_non_relu_model_left_alone(name):
    model = _build(name, relu=False).eval()
    input_ids = _input_ids()

    logits = torch.compile(model, backend="twell")(input_ids, use_cache=False).logits
    expected = model(input_ids, use_cache=False).logits

    reports = backend_reports()
    assert reports and sum(r.rewritten_count for r in reports) == 0
    # Each layer's MLP is still found, and reported as left alone because of its activation.
    reasons = [reason for r in reports for reason in r.reasons]
    other_act = MODELS[name][2]
    assert len(reasons) == LAYERS
    assert all(f"activation is {other_act}" in reason for reason in reasons), reasons
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)


def _t5(feed_forward_proj: str, dropout_rate: float = 0.1):
    config = T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=INTERMEDIATE,
                      num_layers=LAYERS, num_decoder_layers=LAYERS, num_heads=HEADS,
                      feed_forward_proj=feed_forward_proj, dropout_rate=dropout_rate,
                      decoder_start_token_id=0, **SMALL_VOCAB_TOKENS)
    torch.manual_seed(0)
    return T5ForConditionalGeneration(config)


@pytest.mark.parametrize("feed_forward_proj, kind", [("relu", "non_gated"), ("gated-relu", "gated")])
@torch.no_grad()
def test_t5_eval_mode_blocks_rewritten(feed_forward_proj, kind):
    # T5's MLP is wo(dropout(relu(wi(x)))) (gated: wo(dropout(relu(wi_0(x)) * wi_1(x)))): in eval mode
    # Dynamo bakes training=False into the dropout, which is then the identity the pass looks through.
    model = _t5(feed_forward_proj).eval()
    ids = _input_ids()
    logits = torch.compile(model, backend="twell")(input_ids=ids, decoder_input_ids=ids).logits
    expected = model(input_ids=ids, decoder_input_ids=ids).logits

    reports = backend_reports()
    assert sum(r.rewritten_count for r in reports) == 2 * LAYERS  # encoder and decoder
    assert sum(r.gated_count if kind == "gated" else r.non_gated_count for r in reports) == 2 * LAYERS
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)


def test_t5_training_mode_dropout_left_alone():
    # In training mode the dropout is live, and the op has none: every block is left alone, with why.
    model = _t5("relu").train()
    ids = _input_ids()
    torch.compile(model, backend="twell")(input_ids=ids, decoder_input_ids=ids)
    reasons = [reason for r in backend_reports() for reason in r.reasons]
    assert len(reasons) == 2 * LAYERS
    assert all("dropout" in reason and "sits between the relu and the down projection" in reason
               for reason in reasons), reasons
