"""Golden printouts: the graph code the backend hands to Inductor after the rewrite, and reports.

Refresh the expected strings with ``EXPECTTEST_ACCEPT=1 python -m pytest tests/test_golden.py`` and
read the diff: each block must be a single twell call, with no linear/relu/mul of the block left.
"""

from __future__ import annotations

import unittest.mock

import expecttest
import torch

import twell_compile
from helpers import GatedMLP, ReluMLP, SiluGatedMLP, Stack, capture_dynamo_graphs, normalize_text

HIDDEN, INTER = 8, 16


def backend_graph_code(model, *inputs) -> str:
    """The code of the graph ``backend="twell"`` passes on to Inductor (the rewritten Dynamo graph).

    Inductor itself is replaced by a recorder that runs the graph eagerly, so nothing is compiled.
    """
    handed_to_inductor = []

    def record(gm, example_inputs, config_patches=None):
        handed_to_inductor.append(gm)
        return gm.forward

    with unittest.mock.patch("torch._inductor.compile_fx.compile_fx", record):
        torch.compile(model, backend="twell")(*inputs)
    (gm,) = handed_to_inductor
    return normalize_text(gm.code)


class TestGolden(expecttest.TestCase):
    def test_gated_block_backend_graph(self):
        code = backend_graph_code(GatedMLP(HIDDEN, INTER, bias=False), torch.randn(2, 3, HIDDEN))
        self.assertExpectedInline(code, """\
def forward(self, L_self_modules_gate_proj_parameters_weight_ : torch.nn.parameter.Parameter, L_x_ : torch.Tensor, L_self_modules_up_proj_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_down_proj_parameters_weight_ : torch.nn.parameter.Parameter):
    l_self_modules_gate_proj_parameters_weight_ = L_self_modules_gate_proj_parameters_weight_
    l_x_ = L_x_
    l_self_modules_up_proj_parameters_weight_ = L_self_modules_up_proj_parameters_weight_
    l_self_modules_down_proj_parameters_weight_ = L_self_modules_down_proj_parameters_weight_
    gated_relu_mlp = torch.ops.twell.gated_relu_mlp.default(l_x_, l_self_modules_gate_proj_parameters_weight_, l_self_modules_up_proj_parameters_weight_, l_self_modules_down_proj_parameters_weight_, None, None, None);  l_x_ = l_self_modules_gate_proj_parameters_weight_ = l_self_modules_up_proj_parameters_weight_ = l_self_modules_down_proj_parameters_weight_ = None
    return (gated_relu_mlp,)""")

    def test_gated_block_with_bias_backend_graph(self):
        code = backend_graph_code(GatedMLP(HIDDEN, INTER, bias=True), torch.randn(3, HIDDEN))
        self.assertExpectedInline(code, """\
def forward(self, L_self_modules_gate_proj_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_gate_proj_parameters_bias_ : torch.nn.parameter.Parameter, L_x_ : torch.Tensor, L_self_modules_up_proj_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_up_proj_parameters_bias_ : torch.nn.parameter.Parameter, L_self_modules_down_proj_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_down_proj_parameters_bias_ : torch.nn.parameter.Parameter):
    l_self_modules_gate_proj_parameters_weight_ = L_self_modules_gate_proj_parameters_weight_
    l_self_modules_gate_proj_parameters_bias_ = L_self_modules_gate_proj_parameters_bias_
    l_x_ = L_x_
    l_self_modules_up_proj_parameters_weight_ = L_self_modules_up_proj_parameters_weight_
    l_self_modules_up_proj_parameters_bias_ = L_self_modules_up_proj_parameters_bias_
    l_self_modules_down_proj_parameters_weight_ = L_self_modules_down_proj_parameters_weight_
    l_self_modules_down_proj_parameters_bias_ = L_self_modules_down_proj_parameters_bias_
    gated_relu_mlp = torch.ops.twell.gated_relu_mlp.default(l_x_, l_self_modules_gate_proj_parameters_weight_, l_self_modules_up_proj_parameters_weight_, l_self_modules_down_proj_parameters_weight_, l_self_modules_gate_proj_parameters_bias_, l_self_modules_up_proj_parameters_bias_, l_self_modules_down_proj_parameters_bias_);  l_x_ = l_self_modules_gate_proj_parameters_weight_ = l_self_modules_up_proj_parameters_weight_ = l_self_modules_down_proj_parameters_weight_ = l_self_modules_gate_proj_parameters_bias_ = l_self_modules_up_proj_parameters_bias_ = l_self_modules_down_proj_parameters_bias_ = None
    return (gated_relu_mlp,)""")

    def test_non_gated_block_rewrite_of_dynamo_graph(self):
        (gm,) = capture_dynamo_graphs(ReluMLP(HIDDEN, INTER, bias=True), torch.randn(2, 3, HIDDEN))
        rewritten, _ = twell_compile.rewrite(gm)
        self.assertExpectedInline(normalize_text(rewritten.code), """\
def forward(self, L_self_modules_fc1_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_fc1_parameters_bias_ : torch.nn.parameter.Parameter, L_x_ : torch.Tensor, L_self_modules_fc2_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_fc2_parameters_bias_ : torch.nn.parameter.Parameter):
    l_self_modules_fc1_parameters_weight_ = L_self_modules_fc1_parameters_weight_
    l_self_modules_fc1_parameters_bias_ = L_self_modules_fc1_parameters_bias_
    l_x_ = L_x_
    l_self_modules_fc2_parameters_weight_ = L_self_modules_fc2_parameters_weight_
    l_self_modules_fc2_parameters_bias_ = L_self_modules_fc2_parameters_bias_
    relu_mlp = torch.ops.twell.relu_mlp.default(l_x_, l_self_modules_fc1_parameters_weight_, l_self_modules_fc2_parameters_weight_, l_self_modules_fc1_parameters_bias_, l_self_modules_fc2_parameters_bias_);  l_x_ = l_self_modules_fc1_parameters_weight_ = l_self_modules_fc2_parameters_weight_ = l_self_modules_fc1_parameters_bias_ = l_self_modules_fc2_parameters_bias_ = None
    return (relu_mlp,)""")

    def test_two_layer_model_backend_graph(self):
        model = Stack([GatedMLP(HIDDEN, INTER), ReluMLP(HIDDEN, INTER)], HIDDEN)
        code = backend_graph_code(model, torch.randn(2, 3, HIDDEN))
        self.assertExpectedInline(code, """\
def forward(self, L_self_modules_layers_modules_0_modules_norm_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_layers_modules_0_modules_norm_parameters_bias_ : torch.nn.parameter.Parameter, L_x_ : torch.Tensor, L_self_modules_layers_modules_0_modules_mlp_modules_gate_proj_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_layers_modules_0_modules_mlp_modules_up_proj_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_layers_modules_0_modules_mlp_modules_down_proj_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_layers_modules_1_modules_norm_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_layers_modules_1_modules_norm_parameters_bias_ : torch.nn.parameter.Parameter, L_self_modules_layers_modules_1_modules_mlp_modules_fc1_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_layers_modules_1_modules_mlp_modules_fc1_parameters_bias_ : torch.nn.parameter.Parameter, L_self_modules_layers_modules_1_modules_mlp_modules_fc2_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_layers_modules_1_modules_mlp_modules_fc2_parameters_bias_ : torch.nn.parameter.Parameter, L_self_modules_head_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_head_parameters_bias_ : torch.nn.parameter.Parameter):
    l_self_modules_layers_modules_0_modules_norm_parameters_weight_ = L_self_modules_layers_modules_0_modules_norm_parameters_weight_
    l_self_modules_layers_modules_0_modules_norm_parameters_bias_ = L_self_modules_layers_modules_0_modules_norm_parameters_bias_
    l_x_ = L_x_
    l_self_modules_layers_modules_0_modules_mlp_modules_gate_proj_parameters_weight_ = L_self_modules_layers_modules_0_modules_mlp_modules_gate_proj_parameters_weight_
    l_self_modules_layers_modules_0_modules_mlp_modules_up_proj_parameters_weight_ = L_self_modules_layers_modules_0_modules_mlp_modules_up_proj_parameters_weight_
    l_self_modules_layers_modules_0_modules_mlp_modules_down_proj_parameters_weight_ = L_self_modules_layers_modules_0_modules_mlp_modules_down_proj_parameters_weight_
    l_self_modules_layers_modules_1_modules_norm_parameters_weight_ = L_self_modules_layers_modules_1_modules_norm_parameters_weight_
    l_self_modules_layers_modules_1_modules_norm_parameters_bias_ = L_self_modules_layers_modules_1_modules_norm_parameters_bias_
    l_self_modules_layers_modules_1_modules_mlp_modules_fc1_parameters_weight_ = L_self_modules_layers_modules_1_modules_mlp_modules_fc1_parameters_weight_
    l_self_modules_layers_modules_1_modules_mlp_modules_fc1_parameters_bias_ = L_self_modules_layers_modules_1_modules_mlp_modules_fc1_parameters_bias_
    l_self_modules_layers_modules_1_modules_mlp_modules_fc2_parameters_weight_ = L_self_modules_layers_modules_1_modules_mlp_modules_fc2_parameters_weight_
    l_self_modules_layers_modules_1_modules_mlp_modules_fc2_parameters_bias_ = L_self_modules_layers_modules_1_modules_mlp_modules_fc2_parameters_bias_
    l_self_modules_head_parameters_weight_ = L_self_modules_head_parameters_weight_
    l_self_modules_head_parameters_bias_ = L_self_modules_head_parameters_bias_
    layer_norm = torch.nn.functional.layer_norm(l_x_, (8,), l_self_modules_layers_modules_0_modules_norm_parameters_weight_, l_self_modules_layers_modules_0_modules_norm_parameters_bias_, 1e-05);  l_self_modules_layers_modules_0_modules_norm_parameters_weight_ = l_self_modules_layers_modules_0_modules_norm_parameters_bias_ = None
    gated_relu_mlp = torch.ops.twell.gated_relu_mlp.default(layer_norm, l_self_modules_layers_modules_0_modules_mlp_modules_gate_proj_parameters_weight_, l_self_modules_layers_modules_0_modules_mlp_modules_up_proj_parameters_weight_, l_self_modules_layers_modules_0_modules_mlp_modules_down_proj_parameters_weight_, None, None, None);  layer_norm = l_self_modules_layers_modules_0_modules_mlp_modules_gate_proj_parameters_weight_ = l_self_modules_layers_modules_0_modules_mlp_modules_up_proj_parameters_weight_ = l_self_modules_layers_modules_0_modules_mlp_modules_down_proj_parameters_weight_ = None
    x = l_x_ + gated_relu_mlp;  l_x_ = gated_relu_mlp = None
    layer_norm_1 = torch.nn.functional.layer_norm(x, (8,), l_self_modules_layers_modules_1_modules_norm_parameters_weight_, l_self_modules_layers_modules_1_modules_norm_parameters_bias_, 1e-05);  l_self_modules_layers_modules_1_modules_norm_parameters_weight_ = l_self_modules_layers_modules_1_modules_norm_parameters_bias_ = None
    relu_mlp = torch.ops.twell.relu_mlp.default(layer_norm_1, l_self_modules_layers_modules_1_modules_mlp_modules_fc1_parameters_weight_, l_self_modules_layers_modules_1_modules_mlp_modules_fc2_parameters_weight_, l_self_modules_layers_modules_1_modules_mlp_modules_fc1_parameters_bias_, l_self_modules_layers_modules_1_modules_mlp_modules_fc2_parameters_bias_);  layer_norm_1 = l_self_modules_layers_modules_1_modules_mlp_modules_fc1_parameters_weight_ = l_self_modules_layers_modules_1_modules_mlp_modules_fc2_parameters_weight_ = l_self_modules_layers_modules_1_modules_mlp_modules_fc1_parameters_bias_ = l_self_modules_layers_modules_1_modules_mlp_modules_fc2_parameters_bias_ = None
    x_1 = x + relu_mlp;  x = relu_mlp = None
    linear_5 = torch._C._nn.linear(x_1, l_self_modules_head_parameters_weight_, l_self_modules_head_parameters_bias_);  x_1 = l_self_modules_head_parameters_weight_ = l_self_modules_head_parameters_bias_ = None
    return (linear_5,)""")

    def test_explain_report(self):
        model = Stack([GatedMLP(HIDDEN, INTER), SiluGatedMLP(HIDDEN, INTER), ReluMLP(HIDDEN, INTER)], HIDDEN)
        result = twell_compile.explain(model, torch.randn(2, 3, HIDDEN), print_report=False)
        self.assertExpectedInline(normalize_text(str(result)), """\
twell explain: 1 graph(s), 0 graph break(s); 2 block(s) rewritten, 1 left alone

=== graph 0 ===
twell rewrite report for GraphModule: 3 candidate block(s), 2 rewritten (1 gated, 1 non-gated), 1 left alone [<time>]
  [1] layers.0.mlp [gated] REWRITTEN: down(relu(gate(x)) * up(x)) with x = layer_norm (F.linear)
    before:
      linear = torch._C._nn.linear(layer_norm, l_self_modules_layers_modules_0_modules_mlp_modules_gate_proj_parameters_weight_, None)
      relu = torch.nn.functional.relu(linear)
      linear_1 = torch._C._nn.linear(layer_norm, l_self_modules_layers_modules_0_modules_mlp_modules_up_proj_parameters_weight_, None)
      mul = operator.mul(relu, linear_1)
      linear_2 = torch._C._nn.linear(mul, l_self_modules_layers_modules_0_modules_mlp_modules_down_proj_parameters_weight_, None)
    after:
      gated_relu_mlp = torch.ops.twell.gated_relu_mlp.default(layer_norm, l_self_modules_layers_modules_0_modules_mlp_modules_gate_proj_parameters_weight_, l_self_modules_layers_modules_0_modules_mlp_modules_up_proj_parameters_weight_, l_self_modules_layers_modules_0_modules_mlp_modules_down_proj_parameters_weight_, None, None, None)
  [2] layers.1.mlp [gated] LEFT ALONE: activation is silu, not relu
    before:
      linear_3 = torch._C._nn.linear(layer_norm_1, l_self_modules_layers_modules_1_modules_mlp_modules_gate_proj_parameters_weight_, None)
      silu = torch.nn.functional.silu(linear_3)
      linear_4 = torch._C._nn.linear(layer_norm_1, l_self_modules_layers_modules_1_modules_mlp_modules_up_proj_parameters_weight_, None)
      mul_1 = operator.mul(silu, linear_4)
      linear_5 = torch._C._nn.linear(mul_1, l_self_modules_layers_modules_1_modules_mlp_modules_down_proj_parameters_weight_, None)
  [3] layers.2.mlp [non_gated] REWRITTEN: down(relu(up(x))) with x = layer_norm_2 (F.linear)
    before:
      linear_6 = torch._C._nn.linear(layer_norm_2, l_self_modules_layers_modules_2_modules_mlp_modules_fc1_parameters_weight_, l_self_modules_layers_modules_2_modules_mlp_modules_fc1_parameters_bias_)
      relu_1 = torch.nn.functional.relu(linear_6)
      linear_7 = torch._C._nn.linear(relu_1, l_self_modules_layers_modules_2_modules_mlp_modules_fc2_parameters_weight_, l_self_modules_layers_modules_2_modules_mlp_modules_fc2_parameters_bias_)
    after:
      relu_mlp = torch.ops.twell.relu_mlp.default(layer_norm_2, l_self_modules_layers_modules_2_modules_mlp_modules_fc1_parameters_weight_, l_self_modules_layers_modules_2_modules_mlp_modules_fc2_parameters_weight_, l_self_modules_layers_modules_2_modules_mlp_modules_fc1_parameters_bias_, l_self_modules_layers_modules_2_modules_mlp_modules_fc2_parameters_bias_)
  per layer:
    layers.0: 1 rewritten, 0 left alone
    layers.1: 0 rewritten, 1 left alone
    layers.2: 1 rewritten, 0 left alone
  passes: relu_mlp_fusion <time>

=== sparsity of the rewritten blocks on the example inputs (one row per op call) ===
call op                  rows  width mean nnz/row max nnz/row overflow rows dense blocks path
   0 gated_relu_mlp         6     16         9.17          11             -            - reference
   1 relu_mlp               6     16         8.33          10             -            - reference""")
