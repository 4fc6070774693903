"""More Hugging Face architectures with a ReLU MLP, compiled with ``backend="twell"`` in eval mode:
every block rewritten (encoder and decoder), none left alone, outputs as in eager.

Encoders (BERT, DistilBERT, ViT, ALBERT, DeBERTa-v2, MobileBERT), translation models (M2M100, the NLLB architecture; Marian) and
decoders (GPT-J, XGLM, GPTBigCode, Nemotron, BioGPT), each with its MLP's activation set to ReLU where
it is not already. Several put an eval-mode dropout between the ReLU and the down projection, which
the pass looks through (``fx_utils.is_value_identity``). Tiny random configurations; nothing is
downloaded; one Inductor compile each.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM

from helpers import SMALL_VOCAB_TOKENS, backend_reports

VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS = 128, 32, 64, 2, 4
SEQ2SEQ = dict(d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=HEADS,
               decoder_attention_heads=HEADS, encoder_ffn_dim=INTERMEDIATE, decoder_ffn_dim=INTERMEDIATE,
               decoder_start_token_id=2, activation_function="relu", **SMALL_VOCAB_TOKENS)

BERT_LIKE = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                 intermediate_size=INTERMEDIATE, hidden_act="relu")

# Llama-like decoders: gated (Qwen3, Gemma, Granite, OLMo 2, StableLM, Cohere) or non-gated (GPT-NeoX, Phi,
# Starcoder2) MLPs whose activation the config names.
LLAMA_LIKE = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                  intermediate_size=INTERMEDIATE, hidden_act="relu", **SMALL_VOCAB_TOKENS)

# model_type -> (auto class, config arguments, MLP blocks in the model)
ARCHITECTURES = {
    "bert": (AutoModel, BERT_LIKE, LAYERS),
    "distilbert": (AutoModel, dict(dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS, hidden_dim=INTERMEDIATE,
                                   activation="relu"), LAYERS),
    "vit": (AutoModel, dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                            intermediate_size=INTERMEDIATE, hidden_act="relu", image_size=32, patch_size=8), LAYERS),
    # ALBERT shares one layer's weights across its layers: one block per call site all the same.
    "albert": (AutoModel, dict(BERT_LIKE, embedding_size=16), LAYERS),
    "deberta-v2": (AutoModel, BERT_LIKE, LAYERS),
    # MobileBERT: bottlenecked layers of several feed-forward networks each (2 here).
    "mobilebert": (AutoModel, dict(BERT_LIKE, embedding_size=16, intra_bottleneck_size=16, true_hidden_size=16,
                                   num_feedforward_networks=2), 2 * LAYERS),
    "m2m_100": (AutoModelForSeq2SeqLM, SEQ2SEQ, 2 * LAYERS),
    "marian": (AutoModelForSeq2SeqLM, SEQ2SEQ, 2 * LAYERS),
    "gptj": (AutoModelForCausalLM, dict(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, rotary_dim=4,
                                        activation_function="relu", **SMALL_VOCAB_TOKENS), LAYERS),
    "xglm": (AutoModelForCausalLM, dict(d_model=HIDDEN, num_layers=LAYERS, attention_heads=HEADS,
                                        ffn_dim=INTERMEDIATE, activation_function="relu", **SMALL_VOCAB_TOKENS), LAYERS),
    "gpt_bigcode": (AutoModelForCausalLM, dict(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                               activation_function="relu", **SMALL_VOCAB_TOKENS), LAYERS),
    "nemotron": (AutoModelForCausalLM, dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                            num_key_value_heads=HEADS, head_dim=HIDDEN // HEADS,
                                            intermediate_size=INTERMEDIATE, hidden_act="relu", **SMALL_VOCAB_TOKENS), LAYERS),
    "biogpt": (AutoModelForCausalLM, dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                          intermediate_size=INTERMEDIATE, hidden_act="relu", **SMALL_VOCAB_TOKENS), LAYERS),
    **{model_type: (AutoModelForCausalLM, dict(LLAMA_LIKE, **extra), LAYERS) for model_type, extra in (
        ("qwen3", dict(head_dim=HIDDEN // HEADS)),
        ("gemma", dict(head_dim=HIDDEN // HEADS, hidden_activation="relu")),
        ("granite", {}), ("olmo2", {}), ("stablelm", {}), ("cohere", {}), ("gpt_neox", {}), ("phi", {}),
        ("starcoder2", {}))},
    "falcon": (AutoModelForCausalLM, dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                          ffn_hidden_size=INTERMEDIATE, activation="relu", **SMALL_VOCAB_TOKENS), LAYERS),
    "codegen": (AutoModelForCausalLM, dict(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=INTERMEDIATE, rotary_dim=4,
                                           activation_function="relu", **SMALL_VOCAB_TOKENS), LAYERS),
}


def _inputs(model_type: str, auto) -> dict:
    if model_type == "vit":
        return dict(pixel_values=torch.randn(2, 3, 32, 32))
    ids = torch.randint(3, VOCAB, (2, 8))
    return dict(input_ids=ids, decoder_input_ids=ids) if auto is AutoModelForSeq2SeqLM else dict(input_ids=ids)


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
@torch.no_grad()
def test_relu_architecture_rewritten_in_eval_mode(model_type):
    auto, arguments, blocks = ARCHITECTURES[model_type]
    config = AutoConfig.for_model(model_type, **({} if model_type == "vit" else {"vocab_size": VOCAB}), **arguments)
    torch.manual_seed(0)
    model = auto.from_config(config).eval()
    inputs = _inputs(model_type, auto)

    actual = torch.compile(model, backend="twell")(**inputs)[0]
    expected = model(**inputs)[0]

    reports = backend_reports()
    assert sum(r.rewritten_count for r in reports) == blocks, [str(r) for r in reports]
    assert sum(r.left_alone_count for r in reports) == 0, [str(r) for r in reports]
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
